"""Files cfp reads and writes: .npy/.npz/.json only, loaded with allow_pickle=False, written to
a temporary name in the same folder and renamed, so a reader never sees a half-written file.
"""
import json
import os
import tempfile

import numpy as np


def load_array(path, what="array"):
    """The array in the .npy file `path`; ValueError naming the file when missing or malformed."""
    if not os.path.exists(path):
        raise ValueError(f"{what} file {path!r} does not exist")
    try:
        array = np.load(path, allow_pickle=False)
    except Exception as e:  # numpy raises ValueError, OSError or EOFError for bad files
        raise ValueError(f"{what} file {path!r} is not a readable .npy file: {e}") from None
    if not isinstance(array, np.ndarray):
        raise ValueError(f"{what} file {path!r} holds several arrays (.npz); expected one .npy array")
    return array


def load_json(path, what="JSON"):
    """The object in the JSON file `path`; ValueError naming the file when missing or malformed."""
    if not os.path.exists(path):
        raise ValueError(f"{what} {path!r} does not exist")
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        raise ValueError(f"{what} {path!r} is not valid JSON: {e}") from None


def _atomic_write(path, write):
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
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


def save_json(path, obj):
    """Write `obj` as JSON to `path` atomically."""
    _atomic_write(path, lambda f: f.write((json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()))
