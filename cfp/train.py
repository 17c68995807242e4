"""The training loop: data, model, optimizer and schedule from a TrainConfig, on any grid;
evaluation, checkpoints (re-shardable), a progress bar, a JSON log and a closing summary.

`train(config)` is what scripts/train.py runs under mpiexec; the tests call it in-process.
"""
import contextlib
import dataclasses
import importlib.util
import math
import sys
import time

import numpy as np
from mpi4py import MPI

from . import backend, cli, comm
from .algorithms import ALGORITHMS
from .algorithms.base import GRADIENT_SYNC, chunks_fit, overlapped_gradient_sync
from .checks import alike_on_all_ranks, finite_number, int_options, option_name as option
from .checkpoint import grids_of, load_checkpoint, load_meta, resume_point, save_checkpoint
from .data import (ShardedLoader, load_cifar10, load_digits, load_arrays, load_npz, read_blocks, synthetic,
                   synthetic_segmentation)
from .grid import Grids, ProcessGrid, placement_order
from .io import check_figure_path, check_writable, save_figure, save_json
from .models import MODELS, build_model, layer_shapes, read_plan
from .nn import Conv2d, SoftmaxCrossEntropy
from .nn.containers import walk
from .calibration import machine_profile
from .optim import SGD, Adam, AdamW, CosineLR, LinearWarmup, StepLR
from .tensor import Layout, check_blocks

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("cosine", "step", "constant")
DATASETS = ("digits", "synthetic", "npz:PATH", "cifar10:DIR", "npy:DIR", "h5:FILE")
SEGMENT_CLASSES = 4  # the classes of the synthetic label maps a segmentation model learns
DTYPES = ("float32", "float64")
# --overlap: off (every collective blocking: what measured best on cfp's 2-core machine, over
# shared memory and the emulated cluster alike, docs/design.md section 5), grads (the gradient
# allreduces in buckets during backward) or all (and each x/y/w layer's collectives pipelined)
OVERLAPS = ("off", "grads", "all")
OVERLAP_BUCKET_MB = 25  # --overlap grads/all's bucket where --bucket-mb is not given (PyTorch DDP's)
OVERLAP_CHUNKS = 2  # --overlap all's chunks where --chunks is not given
# --mpi-progress: what moves a started collective while the rank computes: calls (the test()
# calls cfp makes as layers and chunks end) or thread (and comm.progress_thread's tests each ms)
MPI_PROGRESS = ("calls", "thread")
COMM_TABLES = ("top", "full")
WIDE_DEPTH = 4
SGD_MOMENTUM = 0.9


class TrainingDiverged(ValueError):
    """The loss (or a weight) became NaN or infinite: the run stops rather than go on."""


@dataclasses.dataclass
class TrainConfig:
    model: str = "resnet"
    width: int = 1
    depth: int = None  # wide CNN only (default WIDE_DEPTH)
    grid: str = None  # default: every rank on the sample axis (with algorithm auto: the planner's grids)
    node_axes: str = None  # the grid's axes kept inside a node (grid.ProcessGrid's placement); default channel
    algorithm: str = "y"  # or "auto": the planner's choice per layer (on --grid when given)
    plan: str = None  # a plan file: {"layers": {name: {"grid", "algorithm", "filter_groups"}}}
    filter_groups: int = None  # algorithm w only
    profile: str = None  # algorithm auto only: a JSON file or a built-in name (default: this machine's, calibration.py)
    memory_limit: float = None  # MiB per rank the "auto" plan must fit
    epochs: int = 10
    batch_size: int = 64
    lr: float = 0.1
    optimizer: str = "sgd"
    momentum: float = None  # sgd only (default SGD_MOMENTUM)
    weight_decay: float = 5e-4
    schedule: str = "cosine"
    warmup_steps: int = 0
    dtype: str = "float32"
    seed: int = 0
    dataset: str = "digits"
    shard_input: bool = False  # each rank reads only its first layer's block of each sample (Network.shard_input)
    upsample: int = 1
    augment: bool = False  # random crop (padding 4) and horizontal flip of the training batches
    train_samples: int = None  # use only the first n training samples (quick runs, tests)
    max_steps: int = None  # stop after this many steps in all
    threads: int = None  # BLAS threads per rank (default cores // ranks per node)
    log: str = None
    checkpoint_dir: str = None
    resume: bool = False
    eval_only: bool = False  # with resume: the test loss and accuracy of the checkpoint, no training
    plot: str = None
    progress: bool = True
    comm_table: str = "top"  # the summary's communication table: "top" rows of most transfer time, or "full"
    bucket_mb: float = 0  # > 0: the gradient allreduces started in buckets of this many MiB during backward
    chunks: int = 1  # > 1: each x/y/w layer's collectives pipelined over this many chunks of samples or features
    device: str = "cpu"  # "gpu": the model and each batch on this rank's GPU (CuPy; backend.use_device)
    overlap: str = None  # "off", "grads" (bucket_mb, default OVERLAP_BUCKET_MB) or "all" (and chunks, default
    # OVERLAP_CHUNKS); None: as bucket_mb and chunks say
    mpi_progress: str = "calls"  # or "thread": comm.progress_thread tests what is in flight while the rank computes

    def overlap_settings(self):
        """(bucket_mb, chunks, halo_interior) this run trains with: --overlap's, filled in with
        its defaults where --bucket-mb and --chunks were left at theirs (validate() refuses
        contradictions); halo_interior (the interior of a split image computed while its halo
        moves, train_step) with --overlap all."""
        if self.overlap in (None, "off"):
            return self.bucket_mb, self.chunks, False
        bucket_mb = self.bucket_mb or OVERLAP_BUCKET_MB
        chunks = self.chunks if self.overlap == "grads" or self.chunks > 1 else OVERLAP_CHUNKS
        return bucket_mb, chunks, self.overlap == "all"

    def validate(self):
        """ValueError naming the bad option, or an option this combination would ignore; the
        same on every rank (no MPI involved)."""
        for field, allowed in (("model", MODELS), ("algorithm", tuple(ALGORITHMS) + ("auto",)),
                               ("optimizer", OPTIMIZERS), ("schedule", SCHEDULES),
                               ("dataset", DATASETS), ("dtype", DTYPES), ("comm_table", COMM_TABLES),
                               ("device", backend.DEVICES)):
            value = getattr(self, field)
            if field == "dataset" and isinstance(value, str) and value.split(":", 1)[0] in ("npz", "cifar10", "npy", "h5") \
                    and len(value.split(":", 1)) == 2 and value.split(":", 1)[1]:
                continue
            if value not in allowed:
                raise ValueError(f"unknown {field} {getattr(self, field)!r}; expected one of "
                                 f"{', '.join(allowed)}")
        int_options(self, positive=("width", "epochs", "batch_size", "upsample", "depth", "filter_groups",
                                    "train_samples", "max_steps", "threads", "chunks"),
                    nonnegative=("warmup_steps", "seed"))
        finite_number(self.lr, "--lr", above=0)
        finite_number(self.bucket_mb, "--bucket-mb", minimum=0)
        if self.overlap is not None and self.overlap not in OVERLAPS:
            raise ValueError(f"unknown overlap {self.overlap!r}; expected one of {', '.join(OVERLAPS)}")
        if self.overlap == "off" and (self.bucket_mb or self.chunks > 1):
            raise ValueError(f"--overlap off runs every collective blocking; --bucket-mb {self.bucket_mb:g} and "
                             f"--chunks {self.chunks} ask for overlap: give one or the other")
        if self.overlap == "grads" and self.chunks > 1:
            raise ValueError(f"--overlap grads overlaps the gradient sums only; --chunks {self.chunks} pipelines the "
                             f"layers' collectives too: use --overlap all")
        if self.mpi_progress not in MPI_PROGRESS:
            raise ValueError(f"unknown mpi_progress {self.mpi_progress!r}; expected one of {', '.join(MPI_PROGRESS)}")
        bucket_mb, chunks, halo_interior = self.overlap_settings()
        if self.mpi_progress == "thread" and not (bucket_mb or chunks > 1 or halo_interior):
            raise ValueError("--mpi-progress thread progresses the collectives started during a step; with every "
                             "collective blocking none is: give --overlap grads or all (or --bucket-mb, --chunks)")
        finite_number(self.weight_decay, "--weight-decay", minimum=0)
        if self.momentum is not None:
            finite_number(self.momentum, "--momentum", minimum=0)
        if self.memory_limit is not None:
            finite_number(self.memory_limit, "--memory-limit", above=0)
        for field, needs, value in (("filter_groups", "algorithm", "w"), ("profile", "algorithm", "auto"),
                                    ("memory_limit", "algorithm", "auto"), ("depth", "model", "wide"),
                                    ("momentum", "optimizer", "sgd")):
            if getattr(self, field) is not None and getattr(self, needs) != value:
                raise ValueError(f"{option(field)} applies to {option(needs)} {value} only; with "
                                 f"{option(needs)} {getattr(self, needs)} it would be ignored")
        if self.node_axes is not None and self.plan:
            raise ValueError("--node-axes and --plan both place the layers' ranks; a plan file places each "
                             "layer's grid by its entry's \"node_axes\"")
        if self.node_axes is not None and self.grid is None and self.algorithm == "auto":
            raise ValueError("--node-axes places the ranks of --grid; without --grid the planner chooses each "
                             "layer's grid and placement")
        if self.node_axes is not None and self.grid is not None:  # else: sample=<ranks>, checked when made
            placement_order(ProcessGrid.shape_of(self.grid), self.node_axes)
        if self.plan is not None and self.algorithm == "auto":
            raise ValueError("--plan and --algorithm auto both choose the layers' grids and algorithms; "
                             "give one of them")
        if self.upsample != 1 and self.dataset not in ("digits", "synthetic"):
            raise ValueError(f"--upsample applies to --dataset digits and synthetic only; with --dataset "
                             f"{self.dataset} it would be ignored")
        if self.shard_input and self.augment:
            raise ValueError("--augment crops and flips whole images; --shard-input reads each rank's block of "
                             "them: give one or the other")
        if self.dataset.startswith("h5:") and (self.train_samples is not None or self.augment):
            raise ValueError(f"--dataset {self.dataset} is read by slices as the loader needs them; "
                             f"{'--train-samples' if self.train_samples is not None else '--augment'} works on "
                             f"samples in memory: use a file of the samples wanted, without it")
        if self.augment and self.eval_only:
            raise ValueError("--augment changes the training batches only; with --eval-only, which does not "
                             "train, it would be ignored")
        if self.eval_only and not self.resume:
            raise ValueError("--eval-only evaluates a checkpoint: it needs --resume and --checkpoint-dir")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir")

    def check_outputs(self):
        """ValueError unless every file this run will write can be written (this rank's view)."""
        if self.log:
            check_writable(self.log, "--log")
        if self.plot:
            check_figure_path(self.plot, "--plot")
            if importlib.util.find_spec("matplotlib") is None:
                raise ValueError("--plot needs matplotlib (pip install matplotlib)")
        if self.checkpoint_dir:
            check_writable(self.checkpoint_dir, "--checkpoint-dir", directory=True)
        if self.plan:
            read_plan(self.plan)

    def model_description(self):
        """What a checkpoint must match to be loaded into this run's model."""
        return {"model": self.model, "width": self.width,
                "depth": (self.depth or WIDE_DEPTH) if MODELS[self.model].depth else None,
                "dataset": self.dataset, "upsample": self.upsample}


def _check_trained_alike(path, meta, cfg):
    """ValueError, in the options' own terms, unless the checkpoint at `path` was trained with
    this run's model, width, depth, dataset, upsampling and optimizer (the options a resumed run
    must keep; the grid, plan, learning rate and the rest may change)."""
    saved = dict(meta.get("model") or {})
    here = cfg.model_description()
    if "optimizer_name" in meta:  # (checkpoints written before it was kept do not say)
        saved["optimizer"], here["optimizer"] = meta["optimizer_name"], cfg.optimizer
    differ = [f"--{k.replace('_', '-')} {saved.get(k)} in the checkpoint, {v} in this run"
              for k, v in here.items() if saved.get(k) != v]
    if differ:
        raise ValueError(f"checkpoint {path!r} was trained with other options: {'; '.join(differ)}; resume with "
                         f"the options it was trained with, or train afresh in another --checkpoint-dir")


def _dataset(cfg, dtype):
    """(x_train, y_train, x_test, y_test, classes, what was read: a line for the user)."""
    classes = 10
    if cfg.dataset.split(":", 1)[0] in ("npy", "h5"):
        x_train, y_train, x_test, y_test, classes = load_arrays(cfg.dataset, dtype)
        split = "its x_test and y_test (the samples read only as the loader slices them)"
        model = MODELS[cfg.model]
        if x_train.ndim != (5 if model.volumes else 4) or (y_train.ndim > 1) != model.segments:
            raise ValueError(f"--dataset {cfg.dataset}: samples {x_train.shape[1:]} with labels "
                             f"{y_train.shape[1:] or 'one a sample'} do not fit --model {cfg.model}, which takes "
                             f"{'volumes (C, D, H, W)' if model.volumes else 'images (C, H, W)'} labelled "
                             f"{'per pixel' if model.segments else 'one a sample'}")
    elif MODELS[cfg.model].segments:
        if cfg.dataset != "synthetic":
            raise ValueError(f"--model {cfg.model} labels every pixel: expected --dataset synthetic (generated "
                             f"images with label maps), got {cfg.dataset!r}")
        classes = SEGMENT_CLASSES
        x, y = synthetic_segmentation(600, 1, 8 * cfg.upsample, classes, seed=cfg.seed, dtype=dtype)
        x_train, y_train, x_test, y_test = x[:500], y[:500], x[500:], y[500:]
        split = "the last 100 of 600 generated, labelled per pixel"
    elif MODELS[cfg.model].volumes:
        if cfg.dataset != "synthetic":
            raise ValueError(f"--model {cfg.model} convolves volumes: expected --dataset synthetic (generated volumes), "
                             f"got {cfg.dataset!r}")
        side = 8 * cfg.upsample
        x, y = synthetic(600, 1, side, side, 10, seed=cfg.seed, dtype=dtype, depth=side)
        x_train, y_train, x_test, y_test = x[:500], y[:500], x[500:], y[500:]
        split = "the last 100 of 600 generated"
    elif cfg.dataset == "digits":
        x_train, y_train, x_test, y_test = load_digits(upsample=cfg.upsample, seed=cfg.seed, dtype=dtype)
        split = f"a stratified 20% test split (seed {cfg.seed})"
    elif cfg.dataset.startswith("npz:"):
        path = cfg.dataset[4:]
        x_train, y_train, x_test, y_test, classes = load_npz(path, seed=cfg.seed, dtype=dtype)
        with np.load(path, allow_pickle=False) as f:  # (its directory only: load_npz has read it)
            given = "x_test" in f.files
        split = "the file's x_test and y_test" if given else f"a stratified 20% test split (seed {cfg.seed})"
    elif cfg.dataset.startswith("cifar10:"):
        x_train, y_train, x_test, y_test, classes = load_cifar10(cfg.dataset[8:], dtype=dtype)
        split = "test_batch.bin"
    else:
        side = 8 * cfg.upsample
        x, y = synthetic(1200, 1, side, side, 10, seed=cfg.seed, dtype=dtype)
        x_train, y_train, x_test, y_test = x[:1000], y[:1000], x[1000:], y[1000:]
        split = "the last 200 of 1200 generated"
    if cfg.train_samples is not None:
        if cfg.train_samples > len(x_train):
            raise ValueError(f"--train-samples {cfg.train_samples} is more than the {len(x_train)} training "
                             f"samples of {cfg.dataset}")
        x_train, y_train = x_train[:cfg.train_samples], y_train[:cfg.train_samples]
        split += f"; the first {cfg.train_samples} training samples (--train-samples)"
    shape = "x".join(str(n) for n in x_train.shape[1:])
    kind = "volumes" if x_train.ndim == 5 else "images"
    read = (f"dataset {cfg.dataset}: {len(x_train)} training and {len(x_test)} test {kind} of {shape} "
            f"({'C x D x H x W' if x_train.ndim == 5 else 'C x H x W'}), {classes} classes; test set: {split}")
    return x_train, y_train, x_test, y_test, classes, read


def _optimizer(cfg, params):
    if cfg.optimizer == "sgd":
        momentum = SGD_MOMENTUM if cfg.momentum is None else cfg.momentum
        return SGD(params, cfg.lr, momentum=momentum, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adam":
        return Adam(params, cfg.lr, weight_decay=cfg.weight_decay)
    return AdamW(params, cfg.lr, weight_decay=cfg.weight_decay)


def _schedule(cfg, optimizer, total_steps):
    after = None
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    if cfg.schedule == "cosine":
        after = CosineLR(optimizer, decay_steps)
    elif cfg.schedule == "step":
        after = StepLR(optimizer, max(1, decay_steps // 3))
    return LinearWarmup(optimizer, cfg.warmup_steps, after=after)


def describe_devices(where):
    """One line for the summary: which rank computed on which device, from every rank's
    backend.use_device `where` (rank order), and whether ranks share a GPU; None when every
    rank computed on NumPy."""
    if all(w["device"] == "cpu" for w in where):
        return None
    parts = [f"rank {r}: gpu {w['index']} ({w['name']})" if w["device"] == "gpu" else f"rank {r}: cpu"
             for r, w in enumerate(where)]
    shared = len(where) > len({(w.get("index"), w.get("host")) for w in where})
    messages = next((w["messages"] for w in where if "messages" in w), None)
    return "; ".join(parts) + ("; ranks share a GPU" if shared else "") + (f"; messages {messages}" if messages else "")


def check_batch(spec, x_local, y_local):
    """That the ranks' blocks of a batch form one global batch in the model's input spec
    ((grid, layout): split by sample and whole over the other axes, or the first layer's own
    layout after Network.shard_input; tensor.check_blocks), its labels split by sample, before
    the layers trust them. Returns the batch's global shape (collective)."""
    grid, layout = spec
    shape = check_blocks(x_local, layout, grid, "the input batch")
    check_blocks(y_local, Layout(("sample",) + (None,) * (y_local.ndim - 1)), grid, "the labels")
    return shape


def pipelined_layers(model):
    """The convolutions (and linear layers) of `model` whose collectives --chunks pipelines:
    those whose algorithm sends messages of its own besides the gradient sum (stationary-x,
    -y and -w; ConvAlgorithm.pipelined), not sample-parallel or grouped ones."""
    return [m for m in walk(model) if isinstance(m, Conv2d) and set(m.conv.messages) - {GRADIENT_SYNC}]


def _chunks_of(layer, chunks):
    """A pipelined layer's chunks: `chunks` itself, or its entry where it is {layer name: k}."""
    return chunks.get(layer.name, 1) if isinstance(chunks, dict) else chunks


def check_chunks(model, chunks, batch_size, option=None):
    """ValueError unless every pipelined layer can run in `chunks` chunks of a batch of
    `batch_size`: its ranks hold at least that many samples (its smallest sample block), or,
    where they hold fewer, the smallest block of the features its chunks split has that many
    (ConvAlgorithm.feature_chunk_limit; a layer whose passes move nothing of their own runs
    one chunk): the same on every rank, as the batch size and the grids are. chunks: one count
    for every layer, or {layer name: k} (a plan's). option: how the message names the
    setting, {k} its count (default --chunks K)."""
    for layer in pipelined_layers(model):
        held = batch_size // layer.grid.axis_size("sample")
        k = _chunks_of(layer, chunks)
        limit = layer.conv.feature_chunk_limit()
        if not chunks_fit(held, k, limit):
            what = f"--chunks {k}" if option is None else option.format(k=k)
            raise ValueError(f"{what} is more than the {held} sample(s) a rank of layer {layer.name} "
                             f"holds (batch {batch_size} over sample={layer.grid.axis_size('sample')}) and the "
                             f"{limit} channel(s) or filter(s) of the smallest block its feature chunks split; "
                             f"expected --chunks <= {max(held, limit)}")


def halo_interior_layers(model):
    """The convolutions of `model` on a split image (or volume) that can compute their interior
    while the halo moves (ConvAlgorithm.interior_applies: convolutions, not transposed ones,
    that convolve their own block)."""
    return [m for m in walk(model) if isinstance(m, Conv2d) and m.conv.spatial and m.conv.interior_applies()]


def train_step(model, loss_fn, optimizer, x_local, y_local, bucket_mb=0, chunks=1, halo_interior=False):
    """One step on this rank's block of a global batch: forward, loss, backward (gradients
    synchronised inside the layers), update. Returns (loss, correct in the global batch).
    The batch is checked once (check_batch); the layers then run without checks of their own.
    bucket_mb > 0: the weight gradients' allreduces are started in buckets of that many MiB
    while backward runs (algorithms.base.overlapped_gradient_sync) and waited for before the
    update; 0: each layer sums its gradients when it has them, blocking. chunks > 1 (or, per
    layer, {layer name: k}: a plan's): the
    stationary-x/-y/-w layers run their passes over that many chunks of samples (or features), each chunk's
    collectives in flight while the next computes (ConvAlgorithm.pipelined; check_chunks
    first), and are left at one chunk (evaluation's batches may be smaller). halo_interior:
    the convolutions on a split image that convolve their own block compute its interior while
    the halo moves (halo_interior_layers), for this step."""
    shape = check_batch(model.input_spec, x_local, y_local)
    layers = [m for m in pipelined_layers(model) if _chunks_of(m, chunks) > 1]
    interiors = halo_interior_layers(model) if halo_interior else []
    for layer in layers:
        layer.conv.chunks = _chunks_of(layer, chunks)
    for layer in interiors:
        layer.conv.halo_interior = True
    try:
        return _step(model, loss_fn, optimizer, x_local, y_local, shape, bucket_mb)
    finally:
        for layer in layers:
            layer.conv.chunks = 1
        for layer in interiors:
            layer.conv.halo_interior = False


def _step(model, loss_fn, optimizer, x_local, y_local, shape, bucket_mb):
    with comm.inputs_checked():
        loss, correct = loss_fn.forward(model.forward(x_local, shape=shape), y_local)
        if bucket_mb:
            with overlapped_gradient_sync(bucket_mb * 2 ** 20):
                model.backward(loss_fn.backward())
        else:
            model.backward(loss_fn.backward())
        optimizer.step()
    return loss, correct


def evaluate(model, loss_fn, x, y, batch_size=256):
    """(mean loss, accuracy) over (x, y), in batches split over the sample axis of the model's
    input like training."""
    model.eval()
    total_loss = correct = 0.0
    grid, layout = model.input_spec
    xp = backend.get_array_module(*(p.data for p in model.parameters()))
    for start in range(0, len(x), batch_size):
        n_global = min(batch_size, len(x) - start)
        (rows, *_) = layout.indices((n_global,) + (1,) * (layout.ndim - 1), grid, grid.coords)
        mine = slice(start + rows.start, start + rows.stop)
        # each rank's block of its samples in the model's input layout (after Network.shard_input
        # no rank reads a whole sample), read as the loader reads them
        x_local = read_blocks(x, range(mine.start, mine.stop), n_global, layout, grid)
        x_local, y_local = backend.from_host(x_local, xp), backend.from_host(y[mine], xp)
        shape = check_batch(model.input_spec, x_local, y_local)
        with comm.inputs_checked():
            loss, right = loss_fn.forward(model.forward(x_local, shape=shape), y_local)
        total_loss += loss * n_global
        correct += right
    model.train()
    return total_loss / len(x), correct / y.size  # (per pixel for per-pixel labels)


def _weights_finite(grid, model):
    """True on every rank when no rank's shards hold NaN or infinity (collective)."""
    return cli.on_every_rank(grid.comm, all(bool(backend.get_array_module(p.data).isfinite(p.data).all())
                                            for p in model.parameters()))


def _diverged(cfg, rank0, step, what, history, epochs_log):
    """Stop a run whose loss or weights are no longer finite: the log (when asked for) keeps
    the finite steps and says that the run diverged; no checkpoint is written."""
    last = history[-1] if history else None
    message = (f"training diverged at step {step}: {what}"
               + (f"; the last finite loss was {last['loss']:.6g} at step {last['step']}" if last else "")
               + f". No checkpoint was written for it; try a smaller learning rate than --lr {cfg.lr:g}")
    if rank0 and cfg.log:
        save_json(cfg.log, {"config": dataclasses.asdict(cfg), "steps": history, "epochs": epochs_log,
                            "diverged": {"step": step, "reason": what, "message": message}, "summary": None})
    raise TrainingDiverged(message)


def _build(cfg, world, x_train, dtype, classes, threads):
    """The model of `cfg` on the ranks of `world`: on --grid, from the plan file, or as the
    planner chooses; the model owns its grids. Also the name of the profile the planner used."""
    config = {"width": cfg.width, "algorithm": cfg.algorithm, "filter_groups": cfg.filter_groups,
              "in_channels": x_train.shape[1], "classes": classes, "seed": cfg.seed, "dtype": dtype,
              "image": x_train.shape[2]}
    if MODELS[cfg.model].depth:
        config["depth"] = cfg.depth or WIDE_DEPTH
    profile = None
    if cfg.algorithm == "auto":
        arch = {k: config[k] for k in ("width", "depth", "in_channels", "classes", "image") if k in config}
        # what --overlap leaves to the planner: the chunks of each layer (their kernels measured
        # too), the bucket
        chunks = cfg.overlap == "all" and cfg.chunks == 1
        profile = machine_profile(cfg.profile, world, threads, layer_shapes(cfg.model, cfg.batch_size, **arch),
                                  chunks=chunks)
        config.update(batch=cfg.batch_size, profile=profile, choose_grids=cfg.grid is None,
                      memory_limit=None if cfg.memory_limit is None else cfg.memory_limit * 2 ** 20, chunks=chunks,
                      buckets=cfg.overlap in ("grads", "all") and not cfg.bucket_mb)
    elif cfg.plan:
        config.update(plan=read_plan(cfg.plan), batch=cfg.batch_size)
    base = ProcessGrid(cfg.grid or f"sample={world.Get_size()}", comm=world, node_axes=cfg.node_axes)
    try:
        model = build_model(cfg.model, base, grids=Grids(base, owns_base=True), **config)
    except BaseException:
        base.free()
        raise
    return model, None if profile is None else profile.name


def train(cfg, world=None):
    """Train as `cfg` says on the ranks of `world` (default COMM_WORLD); return the summary
    dict (also in the JSON log), whose "history" holds every step. Raises ValueError for bad
    options, alike on every rank."""
    summary, model = train_model(cfg, world)
    model.free()
    return summary


def train_model(cfg, world=None):
    """train(), returning (summary, the trained model); the caller frees the model's
    communicators with model.free() (collective)."""
    cfg.validate()
    world = MPI.COMM_WORLD if world is None else world
    alike_on_all_ranks(world, cfg.check_outputs)  # rank 0 writes them: a bad path fails now, not after the run
    threads = backend.set_blas_threads(cfg.threads, world)
    xp, where = backend.use_device(cfg.device, world)
    dtype = np.dtype(cfg.dtype)
    *data, classes, read = _dataset(cfg, dtype)  # every rank reads the same files: a bad one fails alike
    model, profile_name = _build(cfg, world, data[0], dtype, classes, threads)
    try:
        model.to(xp)
        session = _Session(cfg, model, data, xp, world.allgather(where))
        if session.rank0:
            print(read, flush=True)
        if session.rank0 and (cfg.algorithm == "auto" or cfg.plan):
            source = f"algorithm auto ({profile_name})" if cfg.algorithm == "auto" else f"plan {cfg.plan}"
            print(f"{source}:\n{model.describe_plan()}", flush=True)
            if model.plan is not None:
                print(f"predicted {model.plan.memory / 2 ** 20:.2f} MiB per rank for the convolutions", flush=True)
            if model.plan is not None and session.bucket_mb == model.plan.bucket_mb > 0:
                print(f"gradient sums in buckets of {session.bucket_mb:g} MiB (the planner's)", flush=True)
        if cfg.resume:
            session.resume()
        if cfg.eval_only:
            summary = session.evaluation(threads)
        else:
            seconds = session.run()
            summary = session.summary(seconds, threads)
    except BaseException:
        model.free()
        raise
    return summary, model


class _Session:
    """One training run's state: the loader, loss, optimizer and schedule of a model, and where
    training stands (`step` updates done; the next batch is `skip` of epoch `first_epoch`)."""

    def __init__(self, cfg, model, data, xp, devices):
        self.cfg, self.model, self.xp, self.devices = cfg, model, xp, devices
        x_train, y_train, self.x_test, self.y_test = data
        self.grid = model.grid  # where the data enters and the loss is computed
        self.rank0 = self.grid.rank == 0
        # an HDF5 dataset is read a sample at a time by slices (data.read_blocks), whole or (shard_input) by blocks
        layout = model.shard_input() if cfg.shard_input else \
            None if isinstance(x_train, np.ndarray) else model.input_spec[1]
        self.loader = ShardedLoader(x_train, y_train, cfg.batch_size, self.grid, shuffle=True, seed=cfg.seed,
                                    drop_last=True, augment=cfg.augment, layout=layout)
        if len(self.loader) == 0:
            raise ValueError(f"batch size {cfg.batch_size} is larger than the {len(x_train)} training samples")
        self.bucket_mb, self.chunks, self.halo_interior = cfg.overlap_settings()
        self._planned_overlap(cfg, model)
        check_chunks(model, self.chunks, cfg.batch_size, None if self.chunks == cfg.chunks else
                     "the plan's {k} chunks" if isinstance(self.chunks, dict) else f"--overlap {cfg.overlap}'s {{k}} chunks")
        self.loss_fn = SoftmaxCrossEntropy(self.grid)  # (logits whole but for samples: Network.logits_spec)
        self.positions = int(np.prod(y_train.shape[1:]))  # labels per sample: 1, or a label map's pixels
        self.optimizer = _optimizer(cfg, model.parameters())
        total_steps = cfg.epochs * len(self.loader)  # the schedule's length, also when stopped early
        self.stop_at = total_steps if cfg.max_steps is None else min(total_steps, cfg.max_steps)
        self.schedule = _schedule(cfg, self.optimizer, total_steps)
        self.history, self.epochs_log, self.step, self.first_epoch, self.skip = [], [], 0, 0, 0
        self.first_step, self.images, self.last_checkpoint = 0, 0, None
        self.ledger = comm.CommLedger()

    def _planned_overlap(self, cfg, model):
        """The plan's chunks per layer and, the planner's, its bucket, where the run leaves them
        to it: a plan pipelines layers in chunks under --overlap all only (--chunks not given;
        a plan the planner made with --overlap all says so for every layer, one chunk where it
        gave none); the planner's bucket serves --overlap grads and all where --bucket-mb is
        not given."""
        planned = {name: e["chunks"] for name, e in model.layers.items() if e.get("chunks", 1) > 1}
        if planned and cfg.overlap != "all":
            listed = ", ".join(f"{name} in {k} chunks" for name, k in planned.items())
            raise ValueError(f"the plan pipelines {listed}, which --overlap all runs: train it with --overlap all, "
                             f"or with a plan without \"chunks\"")
        if planned and cfg.chunks > 1:
            raise ValueError(f"--chunks {cfg.chunks} and the plan's \"chunks\" both say how the layers pipeline: "
                             f"give one or the other")
        if cfg.overlap == "all" and cfg.chunks == 1 and (planned or model.plan is not None):
            self.chunks = planned
        if model.plan is not None and model.plan.bucket_mb and not cfg.bucket_mb and cfg.overlap in ("grads", "all"):
            self.bucket_mb = model.plan.bucket_mb

    def resume(self):
        """Continue from the checkpoint resume_point picks (under any grid or plan)."""
        cfg = self.cfg
        path, skipped = resume_point(cfg.checkpoint_dir)
        if self.rank0:
            for bad, reason in skipped:
                print(f"checkpoint {bad} is corrupt ({reason}); resuming from {path} instead", flush=True)
        _check_trained_alike(path, load_meta(path), cfg)
        meta = load_checkpoint(path, self.model, self.optimizer, expect={"model": cfg.model_description()})
        missing = [k for k in ("schedule", "history", "epochs", "step", "epoch", "batch") if k not in meta]
        if missing:
            raise ValueError(f"checkpoint {path!r} was not written by cfp's training loop: its meta.json "
                             f"lacks {', '.join(missing)}")
        self.schedule.load_state_dict(meta["schedule"])
        self.history, self.epochs_log = meta["history"], meta["epochs"]
        self.step, self.first_epoch, self.skip = meta["step"], meta["epoch"], meta["batch"]
        self.first_step, self.last_checkpoint = self.step, path
        if self.rank0:
            print(f"resumed from {path} (saved on grid {meta['grid']}, step {self.step})", flush=True)

    def run(self):
        """The epochs, each ending with evaluation and a checkpoint; the seconds they took."""
        progress = _progress_bar(self.rank0 and self.cfg.progress, self.stop_at, self.step,
                                 f"epoch {self.first_epoch + 1}/{self.cfg.epochs}")
        start = time.perf_counter()
        try:
            # NaN and overflow are not warned about, rank by rank: the checks below stop the run.
            with comm.use_ledger(self.ledger), np.errstate(over="ignore", invalid="ignore"), cli.CtrlC() as ctrl_c, \
                    (comm.progress_thread() if self.cfg.mpi_progress == "thread" else contextlib.nullcontext()):
                for epoch in range(self.first_epoch, self.cfg.epochs):
                    if self.step >= self.stop_at:
                        break
                    if progress is not None:
                        progress.set_description(f"epoch {epoch + 1}/{self.cfg.epochs}", refresh=False)
                    batch = self._epoch(epoch, ctrl_c, progress, start)
                    self._end_of_epoch(epoch, finished=batch == len(self.loader), batch=batch)
        except KeyboardInterrupt:
            where = (f"the last checkpoint is {self.last_checkpoint} (continue with --resume)"
                     if self.last_checkpoint else "no checkpoint was saved")
            raise KeyboardInterrupt(f"at step {self.step}; {where}") from None
        finally:
            if progress is not None:
                progress.close()
        return time.perf_counter() - start

    def _epoch(self, epoch, ctrl_c, progress, start):
        """The steps of one epoch (from batch `skip` on); the number of its last batch."""
        self.loader.set_epoch(epoch)
        batch = 0
        for batch, (x_local, y_local, n_global) in enumerate(self.loader, start=1):
            if batch <= self.skip:  # resuming inside this epoch: these batches were done
                continue
            ctrl_c.check(self.grid.comm)
            # the batch to the model's device: one copy of each rank's block per step
            x_local, y_local = backend.from_host(x_local, self.xp), backend.from_host(y_local, self.xp)
            lr = self.optimizer.lr
            loss, correct = train_step(self.model, self.loss_fn, self.optimizer, x_local, y_local, self.bucket_mb,
                                       self.chunks, self.halo_interior)
            if not math.isfinite(loss):  # the same value on every rank: all stop here
                self._diverged(self.step + 1, f"the loss is {loss}")
            self.schedule.step()
            self.step += 1
            self.images += n_global
            accuracy = correct / (n_global * self.positions)
            self.history.append({"step": self.step, "epoch": epoch, "loss": float(loss),
                                 "accuracy": accuracy, "lr": lr})
            if progress is not None:
                elapsed = time.perf_counter() - start
                progress.set_postfix(loss=f"{loss:.4f}", acc=f"{accuracy:.3f}",
                                     img_s=f"{self.images / elapsed:.0f}", refresh=False)
                progress.update(1)
            if self.step >= self.stop_at:
                break
        self.skip = 0
        return batch

    def _end_of_epoch(self, epoch, finished, batch):
        if not _weights_finite(self.grid, self.model):  # the last update broke them: never save that
            self._diverged(self.step, "a weight is no longer finite")
        test_loss, test_accuracy = evaluate(self.model, self.loss_fn, self.x_test, self.y_test)
        self.epochs_log.append({"epoch": epoch, "step": self.step, "test_loss": test_loss,
                                "test_accuracy": test_accuracy})
        if self.cfg.checkpoint_dir:
            self.last_checkpoint = save_checkpoint(
                self.cfg.checkpoint_dir, self.step, self.model, self.optimizer, self.grid, {
                    "model": self.cfg.model_description(), "optimizer_name": self.cfg.optimizer,
                    "epoch": epoch + 1 if finished else epoch,
                    "batch": 0 if finished else batch, "schedule": self.schedule.state_dict(),
                    "history": self.history, "epochs": self.epochs_log})

    def evaluation(self, threads):
        """The test loss and accuracy of the model as loaded (--eval-only), on this grid."""
        test_loss, test_accuracy = evaluate(self.model, self.loss_fn, self.x_test, self.y_test)
        summary = {"grid": grids_of(self.model, self.grid), "ranks": self.grid.size, "threads_per_rank": threads,
                   "steps": self.step, "checkpoint": self.last_checkpoint, "test_loss": test_loss,
                   "test_accuracy": test_accuracy}
        if self.rank0:
            print(f"checkpoint {self.last_checkpoint} (step {self.step}) on {self.grid.size} rank(s), grid "
                  f"{summary['grid']}: test loss {test_loss:.6f}, test accuracy {test_accuracy:.4f}")
            if self.cfg.log:
                save_json(self.cfg.log, {"config": dataclasses.asdict(self.cfg), "evaluation": summary})
        summary["history"] = self.history
        return summary

    def _diverged(self, step, what):
        _diverged(self.cfg, self.rank0, step, what, self.history, self.epochs_log)

    def summary(self, seconds, threads):
        """The closing summary (JSON-able), printed and logged by rank 0, with the history."""
        cfg, model, grid = self.cfg, self.model, self.grid
        summary = {
            "grid": grids_of(model, grid), "ranks": grid.size,
            "algorithm": f"per layer from {cfg.plan}" if cfg.plan else cfg.algorithm, "threads_per_rank": threads,
            "devices": describe_devices(self.devices),  # None: NumPy on every rank
            "layers": model.layers,
            "steps": self.step, "steps_this_session": self.step - self.first_step, "seconds": seconds,
            "images_per_second": self.images / seconds if seconds > 0 else 0.0,
            "final_loss": self.history[-1]["loss"] if self.history else None,
            "test_accuracy": self.epochs_log[-1]["test_accuracy"] if self.epochs_log else None,
            "parameter_bytes_per_rank": cli.max_over_ranks(grid.comm, sum(p.data.nbytes for p in model.parameters())),
            "optimizer_bytes_per_rank": cli.max_over_ranks(grid.comm, self.optimizer.state_bytes()),
            "overlap": {k[0]: v for k, v in self.ledger.overlap(by=("phase",)).items()},
            "communication": [{"layer": k[0], "phase": k[1], "collective": k[2], **v}
                              for k, v in self.ledger.totals(by=("layer", "phase", "collective")).items()],
        }
        if self.rank0:
            wrote = []
            if cfg.log:
                save_json(cfg.log, {"config": dataclasses.asdict(cfg), "steps": self.history,
                                    "epochs": self.epochs_log, "summary": summary})
                wrote.append(f"log {cfg.log}")
            if cfg.plot:
                _plot(cfg.plot, self.history, self.epochs_log)
                wrote.append(f"plot {cfg.plot}")
            if self.last_checkpoint:
                wrote.append(f"checkpoint {self.last_checkpoint}")
            _print_summary(summary, self.ledger, cfg.comm_table, wrote)
        summary["history"] = self.history
        return summary


def _progress_bar(enabled, total, done, description):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=done, unit="step", file=sys.stderr, dynamic_ncols=True, mininterval=0.5,
                desc=description)


COMM_TABLE_ROWS = 10  # rows of the summary's communication table (--comm-table top)


def _print_summary(summary, ledger, comm_table="top", wrote=()):
    """The closing summary, ending with the result: what moved (the rows of most transfer time,
    or every row with --comm-table full), memory, the files written, then steps, time, images/s
    and the test accuracy last, where the eye lands when the run ends."""
    mib = 1024.0 ** 2
    full = comm_table == "full"
    print(f"\ncommunication of rank 0 by layer, phase and collective"
          f"{'' if full else f' ({COMM_TABLE_ROWS} rows of most transfer time; --comm-table full for all)'}; "
          f"transfer: in the MPI call once every rank arrived, wait: for the last to arrive, pack: local "
          f"copies around the call:")
    print(ledger.summary(by=("layer", "phase", "collective"), top=None if full else COMM_TABLE_ROWS))
    if any(r.started is not None for r in ledger.records):  # something was started early: how much it hid
        print("overlap of rank 0 by phase (communicating: a blocking call's transfer, a started one's start to "
              "its completion; exposed: the time blocked in them; hidden = 1 - exposed / communicating):")
        print(ledger.overlap_summary())
    print(f"memory per rank (most of any rank): parameters {summary['parameter_bytes_per_rank'] / mib:.2f} MiB, "
          f"optimizer state {summary['optimizer_bytes_per_rank'] / mib:.2f} MiB")
    if summary["devices"] is not None:  # a GPU run: which rank computed on which device
        print(f"devices: {summary['devices']}")
    if wrote:
        print("wrote " + ", ".join(wrote))
    this_session = summary["steps_this_session"]
    resumed = "" if this_session == summary["steps"] else f" ({summary['steps']} in all, resumed at step " \
        f"{summary['steps'] - this_session})"
    print(f"{this_session} steps in {summary['seconds']:.1f} s{resumed}, {summary['images_per_second']:.0f} "
          f"images/s on {summary['ranks']} rank(s), grid {summary['grid']}, algorithm {summary['algorithm']}, "
          f"{summary['threads_per_rank']} BLAS thread(s) per rank")
    acc = summary["test_accuracy"]
    print(f"test accuracy {acc:.4f}" if acc is not None else "no epoch finished")


def _plot(path, history, epochs_log):
    """The loss and accuracy curves as a PNG (check_outputs made sure matplotlib is there)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [h["step"] for h in history]
    ax_loss.plot(steps, [h["loss"] for h in history])
    ax_loss.set(xlabel="step", ylabel="training loss", yscale="log", title="loss")
    ax_acc.plot(steps, [h["accuracy"] for h in history], label="training batch")
    ax_acc.plot([e["step"] for e in epochs_log], [e["test_accuracy"] for e in epochs_log], "o-", label="test")
    ax_acc.set(xlabel="step", ylabel="accuracy", title="accuracy")
    ax_acc.legend()
    fig.tight_layout()
    save_figure(path, fig, dpi=100)
    plt.close(fig)
