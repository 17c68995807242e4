"""Images per second of one training step in cfp, at 1 rank and at P ranks, against PyTorch
with 1 and P threads on the same model, batch and optimizer, side by side in one run.

    mpiexec -n 2 python -m mpi4py scripts/bench_train.py --model wide --width 256 --depth 4 \\
        --image 16 --batch-size 32 [--steps 5] [--warmup 2] [--overlap off,grads,all] \\
        [--mpi-progress calls,thread] [--device cpu|gpu] [--json out.json]

The 1-rank and PyTorch rows run on rank 0 while the other ranks sleep (not spin) in a
non-blocking barrier, so they have the cores to themselves. The P-rank rows run every grid
factorization with every algorithm; a step is timed on the slowest rank. float32, SGD with
momentum, synthetic 10-class data; BLAS threads 1 per rank. `--rounds R` measures every row R
times, the rows one after the other in each round, and reports each row's median over the
rounds: on a machine whose speed drifts from minute to minute, a row is then not just the
minute it happened to run in.
"""
import contextlib
import sys

import _requirements  # noqa: F401 (first: says what is missing, outside cfp's environment)
import numpy as np
from mpi4py import MPI

from cfp import backend, cli
from cfp.algorithms import ALGORITHMS
from cfp.benchtools import prepare, quiet_barrier, slowest_median, timed
from cfp.checks import finite_number, int_options
from cfp.data import synthetic
from cfp.grid import ProcessGrid, factorizations
from cfp.io import save_json
from cfp.models import MODELS, build_model
from cfp.nn import SoftmaxCrossEntropy
from cfp.optim import SGD
from cfp.comm import progress_thread
from cfp.train import MPI_PROGRESS, OVERLAP_BUCKET_MB, OVERLAP_CHUNKS, OVERLAPS, TrainConfig, check_chunks, train_step

try:
    import torch
except ImportError:  # the comparison is optional
    torch = None


def parse_args(argv):
    p = cli.ArgumentParser(description=cli.script_description(__doc__))
    p.add_argument("--model", default="wide", choices=list(MODELS),
                   help="the model to train; the PyTorch twin exists for wide only")
    p.add_argument("--width", type=int, default=256,
                   help="resnet: width multiplier; wide: channels per layer")
    p.add_argument("--depth", type=int, default=4, help="wide: number of wide layers")
    p.add_argument("--image", type=int, default=16, help="side of the square input images")
    p.add_argument("--batch-size", type=int, default=32, help="global mini-batch")
    p.add_argument("--steps", type=int, default=5,
                   help="timed training steps, of which the median is reported")
    p.add_argument("--warmup", type=int, default=2, help="untimed training steps before them")
    p.add_argument("--rounds", type=int, default=1,
                   help="times every row is measured, in turns; each row reports its median over them")
    p.add_argument("--algorithms", default="sample,x,y,w",
                   help=f"comma-separated algorithms to time at P ranks, of {', '.join(ALGORITHMS)}")
    p.add_argument("--overlap", default="off",
                   help="comma-separated overlap settings to time side by side, each as train.py --overlap: off, "
                        f"grads (gradient sums in {OVERLAP_BUCKET_MB} MiB buckets during backward), all (and the "
                        f"x/y/w layers' collectives over {OVERLAP_CHUNKS} chunks of samples or features)")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help=f"the buckets of --overlap grads and all, MiB (default {OVERLAP_BUCKET_MB}, train.py's)")
    p.add_argument("--mpi-progress", default="calls",
                   help="comma-separated, each as train.py --mpi-progress, timed side by side under every overlap "
                        "setting but off: calls (cfp's test() calls) or thread (and a thread testing every ms)")
    p.add_argument("--device", default="cpu", metavar=cli.one_of(backend.DEVICES),
                   help="cpu (NumPy; torch on the CPU) or gpu (CuPy on each rank's GPU; torch on CUDA)")
    p.add_argument("--json", help="write the rows to this JSON file (rank 0)")
    args = p.parse_args(argv)
    int_options(args, positive=("width", "depth", "image", "batch_size", "steps", "rounds"), nonnegative=("warmup",))
    if args.bucket_mb is not None:
        finite_number(args.bucket_mb, "--bucket-mb", above=0)
    args.overlaps = args.overlap.split(",")
    bad = [o for o in args.overlaps if o not in OVERLAPS]
    if bad or not args.overlaps:
        raise ValueError(f"--overlap {args.overlap!r}: expected a comma-separated list of {', '.join(OVERLAPS)}")
    args.progresses = args.mpi_progress.split(",")
    bad = [o for o in args.progresses if o not in MPI_PROGRESS]
    if bad or not args.progresses:
        raise ValueError(f"--mpi-progress {args.mpi_progress!r}: expected a comma-separated list of "
                         f"{', '.join(MPI_PROGRESS)}")
    unknown = [a for a in args.algorithms.split(",") if a not in ALGORITHMS]
    if unknown:
        raise ValueError(f"--algorithms {args.algorithms!r}: unknown {', '.join(map(repr, unknown))}; "
                         f"expected a comma-separated list of {', '.join(ALGORITHMS)}")
    if torch is not None and args.model != "wide":
        raise ValueError(f"--model {args.model}: the PyTorch comparison exists for --model wide only "
                         "(torch is installed, so it would run)")
    return args


def seconds_on_rank0(world, work):
    """work() (a number of seconds) on rank 0 alone, broadcast to every rank; the others wait
    in a quiet_barrier, so rank 0 has the machine's cores to itself (the one-rank rows)."""
    seconds = np.array([work() if world.Get_rank() == 0 else 0.0], dtype=np.float64)
    quiet_barrier(world)
    world.Bcast(seconds, root=0)
    return float(seconds[0])


def cfp_step_time(args, comm, spec, algorithm, x, y, xp=np, overlap="off", progress="calls"):
    grid = ProcessGrid(spec, comm=comm)
    config = {"width": args.width, "algorithm": algorithm, "in_channels": 1, "classes": 10,
              "dtype": np.float32}
    if MODELS[args.model].depth:
        config["depth"] = args.depth
    model = build_model(args.model, grid, **config).to(xp)
    loss_fn = SoftmaxCrossEntropy(grid)
    optimizer = SGD(model.parameters(), 0.01, momentum=0.9)
    (rows,) = model.input_spec[1].head(1).indices((len(x),), model.grid, model.grid.coords)
    x, y = (backend.from_host(a[rows.start:rows.stop], xp) for a in (x, y))  # the batch on the device once
    bucket_mb = args.bucket_mb if overlap != "off" and args.bucket_mb is not None else 0
    bucket_mb, chunks, halo_interior = TrainConfig(overlap=overlap, bucket_mb=bucket_mb).overlap_settings()
    check_chunks(model, chunks, args.batch_size, f"--overlap {overlap}'s {chunks} chunks")
    # (a step ends with its loss read on the host, so its clock stops after the device's work)
    with progress_thread() if progress == "thread" else contextlib.nullcontext():
        seconds = slowest_median(comm, lambda: timed(lambda: train_step(model, loss_fn, optimizer, x, y, bucket_mb,
                                                                        chunks, halo_interior)),
                                 args.steps, args.warmup)["total"]
    grid.free()
    return seconds


def torch_model(args):
    nn = torch.nn
    if args.model != "wide":  # parse_args refuses it before any work
        raise ValueError(f"--model {args.model}: the PyTorch twin exists for --model wide only")
    w = args.width
    layers = [nn.Conv2d(1, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU()]
    for i in range(args.depth):
        layers += [nn.Conv2d(w, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU()]
        if i == (args.depth - 1) // 2:
            layers.append(nn.MaxPool2d(2))
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(w, 10)]
    return nn.Sequential(*layers)


def torch_step_time(args, threads, x, y, device="cpu"):
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    where = "cuda" if device == "gpu" else "cpu"
    model = torch_model(args).to(where)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    tx, ty = torch.from_numpy(x).to(where), torch.from_numpy(y).to(where)

    def step():
        optimizer.zero_grad()
        loss = loss_fn(model(tx), ty)
        loss.backward()
        optimizer.step()
        loss.item()  # read on the host, as cfp's step reads its loss
    return slowest_median(MPI.COMM_SELF, lambda: timed(step), args.steps, args.warmup)["total"]


def main(argv=None):
    args = parse_args(argv)
    world = MPI.COMM_WORLD
    P = world.Get_size()
    prepare(world, args.json)
    xp, where = backend.use_device(args.device, world)
    if xp is not np and torch is not None and not torch.cuda.is_available():
        raise ValueError(f"--device gpu compares against PyTorch on CUDA, which this torch build lacks (torch "
                         f"{torch.__version__})")
    x, y = synthetic(args.batch_size, 1, args.image, args.image, 10, seed=0, dtype=np.float32)
    # (system, ranks, threads, config) -> how to time one median step
    measures = {("cfp", 1, 1, "sample=1"):
                lambda: seconds_on_rank0(world, lambda: cfp_step_time(args, MPI.COMM_SELF, "sample=1", "y", x, y, xp))}
    if torch is not None:
        measures["torch", 1, 1, "-"] = lambda: seconds_on_rank0(world, lambda: torch_step_time(args, 1, x, y,
                                                                                               args.device))
        if P > 1 and xp is np:  # (on a GPU, torch's CPU threads do not matter)
            measures["torch", 1, P, "-"] = lambda: seconds_on_rank0(world, lambda: torch_step_time(args, P, x, y))
    if P > 1:
        for P_n, P_c in factorizations(P):
            spec = f"sample={P_n},channel={P_c}"
            for algorithm in args.algorithms.split(","):
                if algorithm == "sample" and P_c > 1:
                    continue  # replicas over the channel axis: no faster than sample=P
                for overlap in args.overlaps:
                    for progress in ["calls"] if overlap == "off" else args.progresses:
                        label = f"{spec} {algorithm}" + ("" if args.overlaps == ["off"] else f" overlap {overlap}") \
                            + (f", progress {progress}" if len(args.progresses) > 1 and overlap != "off" else "")
                        measures["cfp", P, 1, label] = \
                            lambda spec=spec, algorithm=algorithm, overlap=overlap, progress=progress: cfp_step_time(
                                args, world, spec, algorithm, x, y, xp, overlap, progress)
    times = {key: [] for key in measures}
    for _ in range(args.rounds):
        for key, measure in measures.items():
            times[key].append(measure())
    rows = []
    for (system, ranks, threads, config), seconds in times.items():
        step = float(np.median(seconds))
        rows.append({"system": system, "ranks": ranks, "threads": threads, "config": config,
                     "step_s": step, "images_per_s": args.batch_size / step, "round_s": seconds})

    if world.Get_rank() == 0:
        torch_by_threads = {r["threads"]: r["images_per_s"] for r in rows if r["system"] == "torch"}
        print(f"# training step of {args.model} width {args.width}" +
              (f" depth {args.depth}" if args.model == "wide" else "") +
              f", {args.image}x{args.image} images, global batch {args.batch_size}, float32, SGD momentum; "
              f"median of {args.steps} steps after {args.warmup} warm-up; BLAS {backend.blas_description()}"
              + (f", each row the median of {args.rounds} rounds" if args.rounds > 1 else "") + "; torch "
              f"{torch.__version__ if torch else 'not installed'}"
              + (f"; on each rank's GPU ({where['name']}), {where['messages']}" if xp is not np else ""))
        print("| system | ranks | threads per rank | grid / algorithm | step s | images/s | vs torch at the same cores |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            cores = r["ranks"] * r["threads"]
            ref = torch_by_threads.get(cores)
            ratio = f"{r['images_per_s'] / ref:.2f}x" if ref and r["system"] == "cfp" else "-"
            print(f"| {r['system']} | {r['ranks']} | {r['threads']} | {r['config']} | {r['step_s']:.4f} | "
                  f"{r['images_per_s']:.1f} | {ratio} |")
        if args.json:
            save_json(args.json, {"arguments": vars(args), "rows": rows})
            print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
