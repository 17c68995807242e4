"""Files cfp reads and writes: .npy/.npz/.json only, loaded with allow_pickle=False, written to
a temporary name in the same folder and renamed, so a reader never sees a half-written file.
"""
import json
import os
import tempfile

import numpy as np


def load_array(path, what="array", mmap_mode=None):
    """The array in the .npy file `path` (memory-mapped with mmap_mode 'r': nothing read until
    sliced); ValueError naming the file when missing or malformed."""
    if not os.path.exists(path):
        raise ValueError(f"{what} file {path!r} does not exist")
    try:
        array = np.load(path, mmap_mode=mmap_mode, allow_pickle=False)
    except Exception as e:  # numpy raises ValueError, OSError or EOFError for bad files
        raise ValueError(f"{what} file {path!r} is not a readable .npy file: {e}") from None
    if not isinstance(array, np.ndarray):
        raise ValueError(f"{what} file {path!r} holds several arrays (.npz); expected one .npy array")
    return array


def load_json(path, what="JSON"):
    """The object in the JSON file `path`; ValueError naming the file when missing or malformed."""
    if not os.path.exists(path):
        raise ValueError(f"{what} {path!r} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"{what} {path!r} is a directory; expected a JSON file")
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        raise ValueError(f"{what} {path!r} is not valid JSON: {e}") from None
    except OSError as e:
        raise ValueError(f"{what} {path!r} cannot be read: {e.strerror}") from None


def _atomic_write(path, write):
    """Write `path` with write(f) on a temporary file `.tmp-*` in its folder, then rename it:
    a reader sees the old file or the new one, never half of one (cfp.checkpoint removes the
    `.tmp-*` files a killed writer leaves). The temporary file is created with mode 0666, which
    the kernel reduces by the umask as for open(): tempfile.mkstemp's private 0600 would make
    checkpoints and logs unreadable to the group, and reading the umask means setting it, which
    races with other threads."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    while True:  # a fresh random name, as mkstemp does; O_EXCL refuses one that exists
        tmp = os.path.join(folder, f".tmp-{os.urandom(6).hex()}-{os.path.basename(path)}")
        try:
            fd = os.open(tmp, flags, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_npz(path, **arrays):
    """Write `arrays` to the .npz file `path` atomically."""
    _atomic_write(path, lambda f: np.savez(f, **arrays))


FIGURE_FORMATS = ("png", "pdf", "svg")  # what a picture's file name may end in


def figure_format(path, what="picture"):
    """The format a picture is written in, from its file name's extension (.png, .pdf or .svg,
    any case); any other is refused, naming the path, rather than written under a wrong name."""
    extension = os.path.splitext(str(path))[1].lower()
    if extension[1:] not in FIGURE_FORMATS:
        given = f"'{extension}'" if extension else "none"
        raise ValueError(f"{what} {str(path)!r}: the file name's extension chooses the picture's format; expected "
                         f"{', '.join('.' + f for f in FIGURE_FORMATS)}, got {given}")
    return extension[1:]


def check_figure_path(path, what):
    """check_writable for a picture, and its format from the extension (figure_format)."""
    figure_format(path, what)
    check_writable(path, what)


def save_figure(path, fig, dpi=100):
    """Write the matplotlib figure `fig` to `path` atomically, as PNG, PDF or SVG by the file
    name's extension (figure_format)."""
    file_format = figure_format(path)
    _atomic_write(path, lambda f: fig.savefig(f, format=file_format, dpi=dpi))


def save_json(path, obj, sort_keys=True):
    """Write `obj` as JSON to `path` atomically. NaN and infinity are refused (ValueError):
    they are not JSON, and a number cfp writes is a result, never a placeholder. sort_keys=False
    keeps the objects' order (a plan's layers in model order)."""
    text = json.dumps(obj, indent=2, sort_keys=sort_keys, allow_nan=False) + "\n"
    _atomic_write(path, lambda f: f.write(text.encode()))


def check_writable(path, what, directory=False):
    """ValueError unless `path` can be written: a file (or, with directory=True, a directory)
    that exists and is writable, or one that can be made, its nearest existing ancestor
    being a writable directory. Checked by trying (a probe file, removed at once), since the
    permission bits say little to root or on a read-only file system. Call it before the work
    whose result goes there, so a bad path costs seconds, not a run."""
    if not path:
        raise ValueError(f"{what} path is empty")
    target = os.path.abspath(path)
    if os.path.isdir(target) and not directory:
        raise ValueError(f"{what} {path!r} is a directory; expected a file name")
    if os.path.exists(target) and directory and not os.path.isdir(target):
        raise ValueError(f"{what} {path!r} exists and is not a directory")
    folder = target if directory else os.path.dirname(target)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise ValueError(f"{what} {path!r} cannot be made: {folder!r} is a file, not a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".tmp-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{what} {path!r} cannot be written: {folder!r}: {e.strerror}") from None
    if os.path.isfile(target) and not os.access(target, os.W_OK):
        raise ValueError(f"{what} {path!r} exists and is not writable")
