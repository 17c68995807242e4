"""Checkpoints that can be loaded on another grid: every shard with its global index sets.

Layout of a checkpoint directory:

    DIR/step-00000040/meta.json        model, grid, step, global shapes, file checksums
    DIR/step-00000040/rank-00003.npz   the shards rank 3 writes (one copy of each: Parameter.primary)
    DIR/latest.json                    {"checkpoint": "step-00000040"}, updated last

Shard files are written first, then meta.json (with their SHA-256), then latest.json, each to
a temporary name and renamed: a checkpoint interrupted half-way is never the one `latest.json`
points to. Loading checks every checksum and shape, assembles each global tensor from the
shards' index sets and takes this rank's shard under the new grid, so a run saved on 2 x 2 can
resume on 1 x 2, on one rank or under another per-layer plan. The previous `keep - 1` checkpoints are kept.

What a killed or damaged run leaves behind is handled here:

- Names read from latest.json and meta.json must be plain entries of their directory (no
  `..`, absolute path, path separator, or symlink resolving outside): these files are data
  anyone may have edited, and loading must not read, nor cleaning delete, outside DIR.
  A meta.json without its "files", "shapes" or "optimizer" is refused by name, like a
  garbled one.
- After each save rank 0 deletes what interrupted saves left: `.tmp-*` files (cfp.io's
  temporary names) and step-* directories without a usable meta.json.
- `resume_point(DIR)` is the checkpoint to resume from: the one latest.json names or, when
  that one is damaged, the newest step-* directory that passes every check, with the reasons
  the ones before it were refused. Every rank reads the same files in the same order, so
  every rank picks the same one (or raises the same ValueError).
"""
import hashlib
import os
import re
import shutil

import numpy as np

from . import backend
from .io import load_json, save_json, save_npz
from .tensor import assemble

FORMAT = "cfp-checkpoint-1"
POINTER = "latest.json"
_STEP = re.compile(r"step-(\d+)$")
_TEMPORARY = ".tmp-"  # the prefix of cfp.io's temporary files
_META_FIELDS = ("files", "shapes", "optimizer")  # what load_checkpoint reads besides "format"


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _tensors(model):
    """{key: Parameter-like (name, data, global_shape, index)} of everything a checkpoint holds."""
    out = {f"param/{p.name}": p for p in model.parameters()}
    out.update({f"buffer/{name}": b for name, b in model.buffers().items()})
    return out


def _inside(directory, name, source):
    """The path of entry `name` of `directory`. `name` comes from `source` (a JSON file, or the
    directory's listing), which may have been edited: ValueError unless it is one plain entry,
    so that no checkpoint makes cfp read or delete files elsewhere."""
    separators = {"/", "\\", os.sep, os.altsep} - {None}
    if (not isinstance(name, str) or name in ("", ".", "..") or os.path.isabs(name) or "\0" in name
            or any(s in name for s in separators)):
        raise ValueError(f"{source} names {name!r}: expected the name of an entry of {directory!r} "
                         f"(no '..', absolute path or path separator)")
    path = os.path.join(directory, name)
    real, root = os.path.realpath(path), os.path.realpath(directory)
    if real == root or os.path.commonpath([real, root]) != root:
        raise ValueError(f"{source} names {name!r}, a symlink to {real!r}, outside {directory!r}")
    return path


def step_directories(directory):
    """The step-N names in `directory`, newest (largest N) first; none when it does not exist."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    steps = [(int(m.group(1)), name) for name in names for m in [_STEP.match(name)] if m]
    return [name for _, name in sorted(steps, reverse=True)]


def _clear(path):
    """Remove whatever is at `path` (a leftover of an interrupted save of the same step), so a
    checkpoint written there holds only this save's shards."""
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def _together(comm, step=None):
    """Run `step()` (None: nothing to do on this rank) and meet the other ranks: every rank
    raises the first failing rank's error (OSError or ValueError, as a ValueError naming the
    file), instead of one rank failing while the others wait for it at a barrier."""
    problem = None
    if step is not None:
        try:
            step()
        except (OSError, ValueError) as e:
            problem = f"saving the checkpoint failed: {e}"
    problems = comm.allgather(problem)  # text or None per rank: the pickling form fits
    first = next((p for p in problems if p is not None), None)
    if first is not None:
        raise ValueError(first)


def save_checkpoint(directory, step, model, optimizer, grid, meta, keep=2):
    """Write checkpoint `step` collectively; return its path. `meta` (JSON-able) is stored as is.
    A rank that cannot write (a full disk, a directory that went away) makes every rank raise
    the same ValueError; the previous checkpoint stays the one latest.json names."""
    name = f"step-{step:08d}"
    path = os.path.join(directory, name)
    tensors = {key: p for key, p in _tensors(model).items() if p.primary}  # one copy of each shard
    writes = bool(tensors)
    first = grid.rank == 0

    def make_directory():
        _clear(path)
        os.makedirs(path)
    _together(grid.comm, make_directory if first else None)
    optim_state = optimizer.state_dict()

    def write_shards():
        arrays = {}
        for key, p in tensors.items():
            arrays[f"{key}/data"] = backend.to_host(p.data)
            for dim, ix in enumerate(p.index):
                if ix is not None:
                    arrays[f"{key}/index{dim}"] = np.asarray(ix, dtype=np.int64)
            for buffer, value in optim_state["state"].get(p.name, {}).items():
                arrays[f"{key}/optim/{buffer}"] = backend.to_host(value)
        save_npz(os.path.join(path, f"rank-{grid.rank:05d}.npz"), **arrays)
    _together(grid.comm, write_shards if writes else None)

    def publish():
        files = sorted(f for f in os.listdir(path) if f.startswith("rank-") and f.endswith(".npz"))
        shapes = {key: list(p.global_shape) for key, p in _tensors(model).items()}
        save_json(os.path.join(path, "meta.json"), {
            "format": FORMAT, "step": step, "grid": grids_of(model, grid), "shapes": shapes,
            "optimizer": {k: v for k, v in optim_state.items() if k != "state"},
            "files": {f: _sha256(os.path.join(path, f)) for f in files}, **meta,
        })
        save_json(os.path.join(directory, POINTER), {"checkpoint": name})
        _tidy(directory, name, keep)
    _together(grid.comm, publish if first else None)
    return path


def grids_of(model, grid):
    """The grid, or the grids a per-layer plan uses, in order."""
    layers = getattr(model, "layers", None)
    if not layers:
        return grid.describe() + grid.describe_placement()
    grids = list(dict.fromkeys(entry["grid"] + (f" (node axes: {entry['node_axes']})" if entry.get("node_axes")
                                                else "") for entry in layers.values()))
    return grids[0] if len(grids) == 1 else " then ".join(grids)


def _tidy(directory, current, keep):
    """After checkpoint `current` is saved and named in latest.json: delete the step-*
    directories of interrupted saves (no usable meta.json), all but the newest `keep - 1`
    other checkpoints, and the `.tmp-*` files killed writers left. Best effort: a file that
    cannot be removed does not undo a good save. Symlinked entries are never followed."""
    kept = []
    for name in step_directories(directory):
        path = os.path.join(directory, name)
        if name == current or os.path.islink(path) or not os.path.isdir(path):
            continue
        if not _is_complete(path):
            shutil.rmtree(path, ignore_errors=True)
        elif len(kept) < keep - 1:
            kept.append(name)
        else:
            shutil.rmtree(path, ignore_errors=True)
    for folder in [directory, os.path.join(directory, current)] + [os.path.join(directory, n) for n in kept]:
        _remove_temporaries(folder)


def _is_complete(path):
    """Whether `path` has a meta.json that loads and names its files: an interrupted save
    never gets that far (meta.json is written after the shards). Checksums are not read here:
    a complete checkpoint with a damaged shard is kept for `resume_point` to report."""
    try:
        load_meta(path)
    except ValueError:
        return False
    return True


def _remove_temporaries(folder):
    """Delete the `.tmp-*` files in `folder`: cfp.io's temporary files of writers that were
    killed before they could rename them (nobody else writes into a checkpoint directory)."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith(_TEMPORARY) and entry.is_file(follow_symlinks=False):
            try:
                os.unlink(entry.path)
            except OSError:
                pass


def latest_checkpoint(directory):
    """The path latest.json points to; ValueError when there is none or it names a path
    outside `directory`."""
    pointer = os.path.join(directory, POINTER)
    if not os.path.exists(pointer):
        raise ValueError(f"no checkpoint in {directory!r} (no {POINTER})")
    latest = load_json(pointer, "checkpoint pointer")
    if not isinstance(latest, dict) or not isinstance(latest.get("checkpoint"), str):
        raise ValueError(f"checkpoint pointer {pointer!r} is malformed: expected {{\"checkpoint\": name}}")
    return _inside(directory, latest["checkpoint"], f"checkpoint pointer {pointer!r}")


def load_meta(path):
    """The checkpoint's meta.json, checked for its format, the fields loading reads, and file
    names that stay inside `path`; the files themselves are not read."""
    meta_path = os.path.join(path, "meta.json")
    if not os.path.exists(meta_path):
        raise ValueError(f"checkpoint {path!r} has no meta.json: it is incomplete")
    meta = load_json(meta_path, "checkpoint metadata")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path!r} is not a {FORMAT} file")
    for field in _META_FIELDS:
        if field not in meta:
            raise ValueError(f"checkpoint metadata {meta_path!r} has no {field!r} entry")
        if not isinstance(meta[field], dict):
            raise ValueError(f"checkpoint metadata {meta_path!r}: {field!r} is a "
                             f"{type(meta[field]).__name__}, expected a JSON object")
    if not meta["files"]:
        raise ValueError(f"checkpoint metadata {meta_path!r} names no shard files")
    for name, digest in meta["files"].items():
        _inside(path, name, f"checkpoint metadata {meta_path!r}")
        if not isinstance(digest, str):
            raise ValueError(f"checkpoint metadata {meta_path!r}: the checksum of {name!r} is "
                             f"{digest!r}, expected a SHA-256 hex string")
    return meta


def read_meta(path):
    """The checkpoint's meta.json, after checking that its files exist and match their checksums."""
    meta = load_meta(path)
    for name, digest in meta["files"].items():
        file = os.path.join(path, name)
        if not os.path.exists(file):
            raise ValueError(f"checkpoint file {file!r} is missing")
        if _sha256(file) != digest:
            raise ValueError(f"checkpoint file {file!r} is corrupt: its SHA-256 does not match "
                             f"meta.json (truncated or altered)")
    return meta


def _candidates(directory):
    """(where, resolve) of each checkpoint `resume_point` may use, in the order it tries them:
    resolve() gives the checkpoint's path, or raises ValueError when its name is unusable."""
    pointer = os.path.join(directory, POINTER)
    if os.path.exists(pointer):
        yield pointer, lambda: latest_checkpoint(directory)
    for name in step_directories(directory):
        yield (os.path.join(directory, name),
               lambda name=name: _inside(directory, name, f"checkpoint directory {directory!r}"))


def resume_point(directory):
    """(path, skipped): the checkpoint to resume from and the (path, reason) of each one refused
    before it. The one latest.json names comes first, then every step-* directory, newest
    first; the first that passes read_meta's checks is chosen, and those after it are not read.
    A missing latest.json is not a refusal (a save killed before writing it leaves a usable
    step-*). ValueError, saying why each was refused, when none passes. Deterministic: the same
    files give the same answer on every rank."""
    skipped, tried = [], set()
    for where, resolve in _candidates(directory):
        try:
            path = resolve()
        except ValueError as e:
            skipped.append((where, str(e)))
            continue
        if path in tried:
            continue
        tried.add(path)
        try:
            read_meta(path)
        except ValueError as e:
            skipped.append((path, str(e)))
            continue
        return path, skipped
    if not skipped:
        raise ValueError(f"no checkpoint in {directory!r} (no {POINTER}, no step-* directory)")
    raise ValueError(f"no valid checkpoint in {directory!r}: " +
                     "; ".join(f"{path} refused: {reason}" for path, reason in skipped))


def load_checkpoint(path, model, optimizer, expect=None):
    """Load the checkpoint at `path` into `model` and `optimizer` (any grid); return its meta.

    `expect`: {meta field: value} the checkpoint must carry (e.g. the model description).
    Every rank reads the same files and checks the same things, so an error is raised alike on
    every rank.
    """
    meta = read_meta(path)
    for field, value in (expect or {}).items():
        if meta.get(field) != value:
            raise ValueError(f"checkpoint {path!r} has {field} {meta.get(field)}, this run has {value}")
    shards = []
    for name in meta["files"]:
        try:
            with np.load(os.path.join(path, name), allow_pickle=False) as f:
                shards.append({k: f[k] for k in f.files})
        except Exception as e:  # a file that matches its checksum but does not load
            raise ValueError(f"checkpoint file {os.path.join(path, name)!r} does not load: {e}") from None
    tensors = _tensors(model)
    saved = meta["shapes"]
    if set(saved) != set(tensors):
        missing, extra = sorted(set(tensors) - set(saved)), sorted(set(saved) - set(tensors))
        raise ValueError(f"checkpoint {path!r} does not fit this model: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}")
    optim_state = {"state": {}}
    optim_state.update(meta["optimizer"])
    for key, p in tensors.items():
        if tuple(saved[key]) != p.global_shape:
            raise ValueError(f"checkpoint {path!r}: {key} has shape {tuple(saved[key])}, this model "
                             f"has {p.global_shape}")
        xp = backend.get_array_module(p.data)

        def whole(suffix):
            pieces = [(tuple(s.get(f"{key}/index{d}") for d in range(len(p.global_shape))), s[f"{key}/{suffix}"])
                      for s in shards if f"{key}/{suffix}" in s]
            return assemble(p.global_shape, pieces, pieces[0][1].dtype) if pieces else None
        p.data = backend.from_host(p.take(whole("data")).astype(p.data.dtype), xp)
        buffers = sorted({k.split("/optim/")[1] for s in shards for k in s if k.startswith(f"{key}/optim/")})
        if buffers:
            optim_state["state"][p.name] = {
                b: backend.from_host(p.take(whole(f"optim/{b}")), xp) for b in buffers}
    optimizer.load_state_dict(optim_state)
    return meta
