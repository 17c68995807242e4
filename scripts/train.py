"""Train a CNN with channel/filter parallelism on the ranks of an MPI job.

    mpiexec -n 4 python -m mpi4py scripts/train.py --model resnet --width 1 \\
        --grid sample=2,channel=2 --algorithm y --epochs 10 --batch-size 64 --lr 0.1 \\
        --optimizer sgd --dtype float32 --seed 0 --log run.json \\
        [--checkpoint-dir DIR] [--resume] [--plot curves.png]

Rank 0 shows a progress bar and ends with a summary (test accuracy, time, images/s,
communication by layer and collective, memory per rank); --log keeps the per-step losses.
"""
import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mpi4py import MPI  # noqa: E402

from cfp.train import DATASETS, OPTIMIZERS, SCHEDULES, TrainConfig, train  # noqa: E402


def parse_args(argv):
    defaults = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=defaults.model, help="resnet (small ResNet) or wide (wide plain CNN)")
    p.add_argument("--width", type=int, default=defaults.width,
                   help="resnet: width multiplier (16, 32, 64 channels times W); wide: channels per layer")
    p.add_argument("--depth", type=int, default=defaults.depth, help="wide: number of wide layers")
    p.add_argument("--grid", default=defaults.grid, help="process grid, e.g. sample=2,channel=2")
    p.add_argument("--algorithm", default=defaults.algorithm,
                   help="sample, x, y, w, or auto (the planner's choice per layer on this grid)")
    p.add_argument("--profile", default=defaults.profile,
                   help="machine profile for --algorithm auto: a JSON file from scripts/calibrate.py "
                        "or a built-in name")
    p.add_argument("--filter-groups", type=int, default=None, help="p_f of algorithm w")
    p.add_argument("--memory-limit", type=float, default=None,
                   help="MiB per rank the --algorithm auto plan must fit (convolutions' predicted memory)")
    p.add_argument("--epochs", type=int, default=defaults.epochs)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="global mini-batch")
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--optimizer", default=defaults.optimizer, help=", ".join(OPTIMIZERS))
    p.add_argument("--momentum", type=float, default=defaults.momentum)
    p.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    p.add_argument("--schedule", default=defaults.schedule, help=", ".join(SCHEDULES))
    p.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    p.add_argument("--dtype", default=defaults.dtype, help="float32 or float64")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--dataset", default=defaults.dataset, help=", ".join(DATASETS))
    p.add_argument("--upsample", type=int, default=defaults.upsample, help="digits: 2 gives 16x16 images")
    p.add_argument("--train-samples", type=int, default=None, help="use only the first N training samples")
    p.add_argument("--max-steps", type=int, default=None, help="stop after N steps")
    p.add_argument("--threads", type=int, default=None, help="BLAS threads per rank")
    p.add_argument("--log", help="JSON log of the per-step losses and the summary")
    p.add_argument("--checkpoint-dir", help="save a checkpoint here after every epoch")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--plot", help="PNG of the loss and accuracy curves (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    config = {k: v for k, v in vars(args).items() if k in fields}
    return TrainConfig(progress=not args.no_progress, **config)


def main(argv=None):
    cfg = parse_args(argv)
    try:
        train(cfg)
    except ValueError as e:  # bad options or files: every rank raises the same error
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(f"train.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
