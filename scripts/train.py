"""Train a CNN with channel/filter parallelism on the ranks of an MPI job.

    mpiexec -n 4 python -m mpi4py scripts/train.py --model resnet --width 1 \\
        --grid sample=2,channel=2 --algorithm y --epochs 10 --batch-size 64 --lr 0.1 \\
        --optimizer sgd --dtype float32 --seed 0 --log run.json \\
        [--dataset npz:PATH | cifar10:DIR | npy:DIR | h5:FILE] [--augment] [--shard-input] \\
        [--checkpoint-dir DIR] [--resume [--eval-only]] [--plot curves.png]
    mpiexec -n 2 python -m mpi4py scripts/train.py --plan plan.json ...   # a grid per layer
    mpiexec -n 2 python -m mpi4py scripts/train.py --algorithm auto ...   # the planner's plan

Rank 0 shows a progress bar and ends with a summary (test accuracy, time, images/s,
communication by layer and collective, memory per rank); --log keeps the per-step losses.
"""
import dataclasses
import sys

import _requirements  # noqa: F401 (first: says what is missing, outside cfp's environment)
from cfp import backend, cli
from cfp.algorithms import ALGORITHMS
from cfp.models import MODELS
from cfp.train import (COMM_TABLES, DTYPES, MPI_PROGRESS, OPTIMIZERS, OVERLAP_BUCKET_MB, OVERLAP_CHUNKS, OVERLAPS,
                       SCHEDULES, SGD_MOMENTUM, WIDE_DEPTH, TrainConfig, train)


def parse_args(argv):
    defaults = TrainConfig()
    p = cli.ArgumentParser(description=cli.script_description(__doc__))
    p.add_argument("--model", default=defaults.model, metavar=cli.one_of(MODELS), help="resnet (small ResNet), wide (wide plain CNN), mobile (depthwise, dilated and "
                        "grouped convolutions), volume (a 3-D CNN on synthetic volumes: --dataset synthetic; "
                        "its grids may split depth) or unet (per-pixel segmentation of synthetic label maps: "
                        "--dataset synthetic)")
    p.add_argument("--width", type=int, default=defaults.width,
                   help="resnet: width multiplier (16, 32, 64 channels times W); wide: channels per layer")
    p.add_argument("--depth", type=int, default=defaults.depth,
                   help=f"--model wide only: number of wide layers (default: {WIDE_DEPTH})")
    p.add_argument("--grid", default=defaults.grid,
                   help="process grid, e.g. sample=2,channel=2 (default: sample=<ranks>; with --algorithm "
                        "auto and no --grid the planner chooses a grid per layer)")
    p.add_argument("--node-axes", default=defaults.node_axes,
                   help="the axes of --grid whose ranks share a node, e.g. sample (default: channel, the "
                        "ranks of a channel group neighbours); refused when they do not fit in a node")
    p.add_argument("--algorithm", default=defaults.algorithm, metavar=cli.one_of([*ALGORITHMS, "auto"]),
                   help="sample, x, y, w, or auto (the planner's choice per layer: on --grid when given)")
    p.add_argument("--plan", default=None,
                   help="plan file (JSON, as scripts/plan.py --out writes): a grid and algorithm per layer; "
                        "layers it does not list keep those of the layer before")
    p.add_argument("--profile", default=defaults.profile,
                   help="--algorithm auto only: machine profile, a JSON file from scripts/calibrate.py "
                        "or a built-in name (default: this machine's, calibrated once and cached)")
    p.add_argument("--filter-groups", type=int, default=None,
                   help="--algorithm w only: p_f, the filter groups (dividing the channel axis)")
    p.add_argument("--memory-limit", type=float, default=None,
                   help="--algorithm auto only: MiB per rank the plan must fit (convolutions' predicted memory)")
    p.add_argument("--epochs", type=int, default=defaults.epochs, help="passes over the training set")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="global mini-batch")
    p.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate")
    p.add_argument("--optimizer", default=defaults.optimizer, metavar=cli.one_of(OPTIMIZERS), help="the optimizer")
    p.add_argument("--momentum", type=float, default=defaults.momentum,
                   help=f"--optimizer sgd only: momentum (default: {SGD_MOMENTUM})")
    p.add_argument("--weight-decay", type=float, default=defaults.weight_decay,
                   help="L2 penalty (sgd, adam) or decoupled decay (adamw)")
    p.add_argument("--schedule", default=defaults.schedule, metavar=cli.one_of(SCHEDULES), help="learning-rate schedule")
    p.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps,
                   help="steps of linear warm-up before the schedule")
    p.add_argument("--dtype", default=defaults.dtype, metavar=cli.one_of(DTYPES), help="element type")
    p.add_argument("--seed", type=int, default=defaults.seed, help="seeds the weights, the data and the shuffling")
    p.add_argument("--dataset", default=defaults.dataset,
                   help="digits (scikit-learn's), synthetic, npz:PATH (arrays x, y and optionally x_test, "
                        "y_test), cifar10:DIR (CIFAR-10's binary batches) or npy:DIR (x_train.npy, y_train.npy, "
                        "x_test.npy, y_test.npy; the samples memory-mapped, for --shard-input) or h5:FILE (the same "
                        "arrays in an HDF5 file, read with h5py)")
    p.add_argument("--shard-input", action="store_true",
                   help="each rank reads only its first layer's block of each sample (of a grid splitting depth, "
                        "height or width): no rank holds a whole sample")
    p.add_argument("--upsample", type=int, default=defaults.upsample, help="digits: 2 gives 16x16 images")
    p.add_argument("--augment", action="store_true",
                   help="random crop (zero padding of 4 pixels) and horizontal flip of the training batches, "
                        "seeded: the same batches on every grid; never the test set")
    p.add_argument("--train-samples", type=int, default=None, help="use only the first N training samples")
    p.add_argument("--max-steps", type=int, default=None, help="stop after N steps")
    p.add_argument("--threads", type=int, default=None,
                   help="BLAS threads per rank (default: cores / ranks on the node)")
    p.add_argument("--log", help="JSON log of the per-step losses and the summary")
    p.add_argument("--checkpoint-dir", help="save a checkpoint here after every epoch")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--eval-only", action="store_true",
                   help="with --resume: print the checkpoint's test loss and accuracy (on any grid), no training")
    p.add_argument("--plot", help="the loss and accuracy curves, .png, .pdf or .svg (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--comm-table", default=defaults.comm_table, metavar=cli.one_of(COMM_TABLES),
                   help="the summary's communication table: the rows of most transfer time, or every row")
    p.add_argument("--bucket-mb", type=float, default=defaults.bucket_mb,
                   help="start the weight gradients' allreduces during backward, in buckets of this many MiB "
                        "(0, the default: each layer sums its own when it has them)")
    p.add_argument("--chunks", type=int, default=defaults.chunks,
                   help="pipeline each x/y/w layer's collectives over this many chunks of a rank's samples (of its "
                        "features where a rank holds fewer samples) "
                        "(1, the default: blocking; measured slower on 2 cores, docs/design.md)")
    p.add_argument("--overlap", default=defaults.overlap, metavar=cli.one_of(OVERLAPS),
                   help="overlap communication with computation: off (every collective blocking, what measured "
                        f"best on 2 cores), grads (the gradient sums in buckets during backward, {OVERLAP_BUCKET_MB} "
                        f"MiB unless --bucket-mb says) or all (and the x/y/w layers' collectives pipelined over "
                        f"{OVERLAP_CHUNKS} chunks unless --chunks says); default: as --bucket-mb and --chunks say")
    p.add_argument("--mpi-progress", default=defaults.mpi_progress, metavar=cli.one_of(MPI_PROGRESS),
                   help="what moves a started collective while the rank computes: calls (cfp's test() calls as "
                        "layers and chunks end, the default) or thread (and a thread testing them every ms: "
                        "transports that move data only inside MPI calls, such as TCP; docs/design.md section 5)")
    p.add_argument("--device", default=defaults.device, metavar=cli.one_of(backend.DEVICES),
                   help="cpu (NumPy) or gpu (CuPy: one GPU per rank, node-local rank modulo the GPUs)")
    args = p.parse_args(argv)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    config = {k: v for k, v in vars(args).items() if k in fields}
    return TrainConfig(progress=not args.no_progress, **config)


def main(argv=None):
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
