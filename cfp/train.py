"""The training loop: data, model, optimizer and schedule from a TrainConfig, on any grid;
evaluation, checkpoints (re-shardable), a progress bar, a JSON log and a closing summary.

`train(config)` is what scripts/train.py runs under mpiexec; the tests call it in-process.
"""
import dataclasses
import sys
import time

import numpy as np
from mpi4py import MPI

from . import backend, comm
from .algorithms import ALGORITHMS
from .checks import positive_int
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .data import ShardedLoader, load_digits, synthetic
from .grid import ProcessGrid
from .io import save_json
from .models import MODELS, build_model
from .nn import SoftmaxCrossEntropy
from .perfmodel import MachineProfile
from .optim import SGD, Adam, AdamW, CosineLR, LinearWarmup, StepLR
from .partition import block_range

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("cosine", "step", "constant")
DATASETS = ("digits", "synthetic")


@dataclasses.dataclass
class TrainConfig:
    model: str = "resnet"
    width: int = 1
    depth: int = 4  # wide CNN only
    grid: str = "sample=1"
    algorithm: str = "y"  # or "auto": the planner's choice per layer on this grid
    filter_groups: int = None
    profile: str = "cpu-dev"  # machine profile for "auto": a JSON file or a built-in name
    memory_limit: float = None  # MiB per rank the "auto" plan must fit
    epochs: int = 10
    batch_size: int = 64
    lr: float = 0.1
    optimizer: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 5e-4
    schedule: str = "cosine"
    warmup_steps: int = 0
    dtype: str = "float32"
    seed: int = 0
    dataset: str = "digits"
    upsample: int = 1
    train_samples: int = None  # use only the first n training samples (quick runs, tests)
    max_steps: int = None  # stop after this many steps in all
    threads: int = None  # BLAS threads per rank (default cores // ranks per node)
    log: str = None
    checkpoint_dir: str = None
    resume: bool = False
    plot: str = None
    progress: bool = True

    def validate(self):
        """ValueError naming the bad option; the same on every rank (no MPI involved)."""
        for field, allowed in (("model", MODELS), ("algorithm", tuple(ALGORITHMS) + ("auto",)),
                               ("optimizer", OPTIMIZERS), ("schedule", SCHEDULES),
                               ("dataset", DATASETS), ("dtype", ("float32", "float64"))):
            if getattr(self, field) not in allowed:
                raise ValueError(f"unknown {field} {getattr(self, field)!r}; expected one of "
                                 f"{', '.join(allowed)}")
        for field in ("epochs", "batch_size", "upsample"):
            positive_int(getattr(self, field), field)
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir")

    def model_description(self):
        """What a checkpoint must match to be loaded into this run's model."""
        return {"model": self.model, "width": self.width,
                "depth": self.depth if self.model == "wide" else None,
                "dataset": self.dataset, "upsample": self.upsample}


def _dataset(cfg, dtype):
    if cfg.dataset == "digits":
        x_train, y_train, x_test, y_test = load_digits(upsample=cfg.upsample, seed=cfg.seed, dtype=dtype)
    else:
        side = 8 * cfg.upsample
        x, y = synthetic(1200, 1, side, side, 10, seed=cfg.seed, dtype=dtype)
        x_train, y_train, x_test, y_test = x[:1000], y[:1000], x[1000:], y[1000:]
    if cfg.train_samples is not None:
        x_train, y_train = x_train[:cfg.train_samples], y_train[:cfg.train_samples]
    return x_train, y_train, x_test, y_test


def _optimizer(cfg, params):
    if cfg.optimizer == "sgd":
        return SGD(params, cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
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


def train_step(model, loss_fn, optimizer, x_local, y_local):
    """One step on this rank's block of a global batch: forward, loss, backward (gradients
    synchronised inside the layers), update. Returns (loss, correct in the global batch)."""
    loss, correct = loss_fn.forward(model.forward(x_local), y_local)
    model.backward(loss_fn.backward())
    optimizer.step()
    return loss, correct


def evaluate(model, loss_fn, grid, x, y, batch_size=256):
    """(mean loss, accuracy) over (x, y), in batches split over the sample axis like training."""
    model.eval()
    total_loss = correct = 0.0
    for start in range(0, len(x), batch_size):
        n_global = min(batch_size, len(x) - start)
        lo, hi = block_range(n_global, grid.axis_size("sample"), grid.coord("sample"))
        loss, right = loss_fn.forward(model.forward(x[start + lo:start + hi]), y[start + lo:start + hi])
        total_loss += loss * n_global
        correct += right
    model.train()
    return total_loss / len(x), correct / len(x)


def _max_over_ranks(grid, value):
    return grid.comm.allreduce(value, op=MPI.MAX)


def train(cfg, world=None, keep_model=False):
    """Train as `cfg` says on the ranks of `world` (default COMM_WORLD); return the summary
    dict (also in the JSON log). Raises ValueError for bad options, alike on every rank.

    keep_model: also return the trained model and its grid (summary["model"], ["grid_object"]),
    whose communicators the caller then frees (model.free(), grid.free()).
    """
    cfg.validate()
    world = MPI.COMM_WORLD if world is None else world
    threads = backend.set_blas_threads(cfg.threads, world)
    grid = ProcessGrid(cfg.grid, comm=world)
    rank0 = grid.rank == 0
    dtype = np.dtype(cfg.dtype)
    x_train, y_train, x_test, y_test = _dataset(cfg, dtype)
    loader = ShardedLoader(x_train, y_train, cfg.batch_size, grid, shuffle=True, seed=cfg.seed, drop_last=True)
    if len(loader) == 0:
        raise ValueError(f"batch size {cfg.batch_size} is larger than the {len(x_train)} training samples")
    config = {"width": cfg.width, "algorithm": cfg.algorithm, "filter_groups": cfg.filter_groups,
              "in_channels": x_train.shape[1], "classes": 10, "seed": cfg.seed, "dtype": dtype,
              "image": x_train.shape[2]}
    if cfg.algorithm == "auto":
        config.update(batch=cfg.batch_size, profile=MachineProfile.load(cfg.profile),
                      memory_limit=None if cfg.memory_limit is None else cfg.memory_limit * 2 ** 20)
    if cfg.model == "wide":
        config["depth"] = cfg.depth
    model = build_model(cfg.model, grid, **config)
    if cfg.algorithm == "auto" and rank0:
        chosen = ", ".join(f"{name} {a}" + (f"(p_f={p})" if p else "") for name, (a, p) in model.algorithms.items())
        print(f"algorithm auto ({config['profile'].name}): {chosen}; predicted "
              f"{model.plan.memory / 2 ** 20:.2f} MiB per rank for the convolutions", flush=True)
    loss_fn = SoftmaxCrossEntropy(grid)
    optimizer = _optimizer(cfg, model.parameters())
    total_steps = cfg.epochs * len(loader)  # the schedule's length, also when stopped early
    stop_at = total_steps if cfg.max_steps is None else min(total_steps, cfg.max_steps)
    schedule = _schedule(cfg, optimizer, total_steps)

    # Where training stands: `step` updates done, the next batch is `skip` of epoch `first_epoch`.
    history, epochs_log, step, first_epoch, skip = [], [], 0, 0, 0
    if cfg.resume:
        path = latest_checkpoint(cfg.checkpoint_dir)
        meta = load_checkpoint(path, model, optimizer, expect={"model": cfg.model_description()})
        schedule.load_state_dict(meta["schedule"])
        history, epochs_log = meta["history"], meta["epochs"]
        step, first_epoch, skip = meta["step"], meta["epoch"], meta["batch"]
        if rank0:
            print(f"resumed from {path} (saved on grid {meta['grid']}, step {step})", flush=True)

    ledger = comm.CommLedger()
    progress = _progress_bar(rank0 and cfg.progress, stop_at, step)
    start = time.perf_counter()
    images = 0
    with comm.use_ledger(ledger):
        for epoch in range(first_epoch, cfg.epochs):
            if step >= stop_at:
                break
            loader.set_epoch(epoch)
            batch = 0
            for batch, (x_local, y_local, n_global) in enumerate(loader, start=1):
                if batch <= skip:  # resuming inside this epoch: these batches were done
                    continue
                lr = optimizer.lr
                loss, correct = train_step(model, loss_fn, optimizer, x_local, y_local)
                schedule.step()
                step += 1
                images += n_global
                history.append({"step": step, "epoch": epoch, "loss": float(loss),
                                "accuracy": correct / n_global, "lr": lr})
                if progress is not None:
                    elapsed = time.perf_counter() - start
                    progress.set_postfix(loss=f"{loss:.4f}", acc=f"{correct / n_global:.3f}",
                                         img_s=f"{images / elapsed:.0f}", refresh=False)
                    progress.update(1)
                if step >= stop_at:
                    break
            skip = 0
            finished = batch == len(loader)
            test_loss, test_accuracy = evaluate(model, loss_fn, grid, x_test, y_test)
            epochs_log.append({"epoch": epoch, "step": step, "test_loss": test_loss,
                               "test_accuracy": test_accuracy})
            if cfg.checkpoint_dir:
                save_checkpoint(cfg.checkpoint_dir, step, model, optimizer, grid, {
                    "model": cfg.model_description(), "epoch": epoch + 1 if finished else epoch,
                    "batch": 0 if finished else batch, "schedule": schedule.state_dict(),
                    "history": history, "epochs": epochs_log})
    seconds = time.perf_counter() - start
    if progress is not None:
        progress.close()

    summary = {
        "grid": grid.describe(), "ranks": grid.size, "algorithm": cfg.algorithm, "threads_per_rank": threads,
        "steps": step, "seconds": seconds, "images_per_second": images / seconds if seconds > 0 else 0.0,
        "final_loss": history[-1]["loss"] if history else None,
        "test_accuracy": epochs_log[-1]["test_accuracy"] if epochs_log else None,
        "parameter_bytes_per_rank": _max_over_ranks(grid, sum(p.data.nbytes for p in model.parameters())),
        "optimizer_bytes_per_rank": _max_over_ranks(grid, optimizer.state_bytes()),
        "communication": [{"layer": k[0], "collective": k[1], **v}
                          for k, v in ledger.totals(by=("layer", "collective")).items()],
    }
    if rank0:
        _print_summary(summary, ledger)
        if cfg.log:
            save_json(cfg.log, {"config": dataclasses.asdict(cfg), "steps": history, "epochs": epochs_log,
                                "summary": summary})
        if cfg.plot:
            _plot(cfg.plot, history, epochs_log)
    summary["history"] = history
    if keep_model:
        summary["model"], summary["grid_object"] = model, grid
    else:
        model.free()
        grid.free()
    return summary


def _progress_bar(enabled, total, done):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=done, unit="step", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)


def _print_summary(summary, ledger):
    mib = 1024.0 ** 2
    acc = summary["test_accuracy"]
    print(f"\ntest accuracy {acc:.4f}" if acc is not None else "\nno epoch finished")
    print(f"{summary['steps']} steps in {summary['seconds']:.1f} s, {summary['images_per_second']:.0f} "
          f"images/s on {summary['ranks']} rank(s), grid {summary['grid']}, algorithm {summary['algorithm']}, "
          f"{summary['threads_per_rank']} BLAS thread(s) per rank")
    print(f"memory per rank (most of any rank): parameters {summary['parameter_bytes_per_rank'] / mib:.2f} MiB, "
          f"optimizer state {summary['optimizer_bytes_per_rank'] / mib:.2f} MiB")
    print("communication of rank 0 by layer and collective:")
    print(ledger.summary(by=("layer", "collective")))


def _plot(path, history, epochs_log):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib); no plot written", file=sys.stderr)
        return
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [h["step"] for h in history]
    ax_loss.plot(steps, [h["loss"] for h in history])
    ax_loss.set(xlabel="step", ylabel="training loss", yscale="log", title="loss")
    ax_acc.plot(steps, [h["accuracy"] for h in history], label="training batch")
    ax_acc.plot([e["step"] for e in epochs_log], [e["test_accuracy"] for e in epochs_log], "o-", label="test")
    ax_acc.set(xlabel="step", ylabel="accuracy", title="accuracy")
    ax_acc.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
