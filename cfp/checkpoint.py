"""Checkpoints that can be loaded on another grid: every shard with its global index sets.

Layout of a checkpoint directory:

    DIR/step-00000040/meta.json        model, grid, step, global shapes, file checksums
    DIR/step-00000040/rank-00003.npz   the shards held by rank 3 (ranks at sample coordinate 0)
    DIR/latest.json                    {"checkpoint": "step-00000040"}, updated last

Shard files are written first, then meta.json (with their SHA-256), then latest.json, each to
a temporary name and renamed: a checkpoint interrupted half-way is never the one `latest.json`
points to. Loading checks every checksum and shape, assembles each global tensor from the
shards' index sets and takes this rank's shard under the new grid, so a run saved on 2 x 2 can
resume on 1 x 2 or on one rank. The previous `keep - 1` checkpoints are kept.
"""
import hashlib
import os
import shutil

import numpy as np

from . import backend
from .io import load_json, save_json, save_npz
from .nn.module import assemble

FORMAT = "cfp-checkpoint-1"


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


def save_checkpoint(directory, step, model, optimizer, grid, meta, keep=2):
    """Write checkpoint `step` collectively; return its path. `meta` (JSON-able) is stored as is."""
    name = f"step-{step:08d}"
    path = os.path.join(directory, name)
    writes = grid.coord("sample") == 0  # the other sample ranks hold copies of the same shards
    if grid.rank == 0:
        os.makedirs(path, exist_ok=True)
    grid.comm.Barrier()
    optim_state = optimizer.state_dict()
    if writes:
        arrays = {}
        for key, p in _tensors(model).items():
            arrays[f"{key}/data"] = backend.to_host(p.data)
            for dim, ix in enumerate(p.index):
                if ix is not None:
                    arrays[f"{key}/index{dim}"] = np.asarray(ix, dtype=np.int64)
            for buffer, value in optim_state["state"].get(p.name, {}).items():
                arrays[f"{key}/optim/{buffer}"] = backend.to_host(value)
        save_npz(os.path.join(path, f"rank-{grid.rank:05d}.npz"), **arrays)
    grid.comm.Barrier()
    if grid.rank == 0:
        files = sorted(f for f in os.listdir(path) if f.startswith("rank-") and f.endswith(".npz"))
        shapes = {key: list(p.global_shape) for key, p in _tensors(model).items()}
        save_json(os.path.join(path, "meta.json"), {
            "format": FORMAT, "step": step, "grid": grid.describe(), "shapes": shapes,
            "optimizer": {k: v for k, v in optim_state.items() if k != "state"},
            "files": {f: _sha256(os.path.join(path, f)) for f in files}, **meta,
        })
        save_json(os.path.join(directory, "latest.json"), {"checkpoint": name})
        old = sorted(d for d in os.listdir(directory) if d.startswith("step-") and d != name)
        for stale in old[:max(0, len(old) - (keep - 1))]:
            shutil.rmtree(os.path.join(directory, stale), ignore_errors=True)
    grid.comm.Barrier()
    return path


def latest_checkpoint(directory):
    """The path latest.json points to; ValueError when there is none."""
    pointer = os.path.join(directory, "latest.json")
    if not os.path.exists(pointer):
        raise ValueError(f"no checkpoint in {directory!r} (no latest.json)")
    latest = load_json(pointer, "checkpoint pointer")
    if not isinstance(latest, dict) or not isinstance(latest.get("checkpoint"), str):
        raise ValueError(f"checkpoint pointer {pointer!r} is malformed: expected {{\"checkpoint\": name}}")
    return os.path.join(directory, latest["checkpoint"])


def read_meta(path):
    """The checkpoint's meta.json, after checking that its files exist and match their checksums."""
    meta_path = os.path.join(path, "meta.json")
    if not os.path.exists(meta_path):
        raise ValueError(f"checkpoint {path!r} has no meta.json: it is incomplete")
    meta = load_json(meta_path, "checkpoint metadata")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path!r} is not a {FORMAT} file")
    for name, digest in meta["files"].items():
        file = os.path.join(path, name)
        if not os.path.exists(file):
            raise ValueError(f"checkpoint file {file!r} is missing")
        if _sha256(file) != digest:
            raise ValueError(f"checkpoint file {file!r} is corrupt: its SHA-256 does not match "
                             f"meta.json (truncated or altered)")
    return meta


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
