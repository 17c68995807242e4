"""Time every algorithm and grid on one convolution layer at the current rank count.

    mpiexec -n P python -m mpi4py scripts/bench_conv.py --shape 8,512,512,16,16,3 \\
        [--padding 1] [--stride 1] [--repeats 5] [--rounds 1] [--threads 1] [--dtype float32] [--spatial] \\
        [--grid SPEC] [--breakdown] [--chunks 1,2,4] [--mpi-progress calls,thread] [--device cpu|gpu]
        [--json out.json]

For each factorization P_n x P_c of the rank count (with --spatial, P_n x P_h x P_w x P_c,
the image split over height and width too; for a volume, --shape N,C,F,D,H,W,K, P_n x P_d x
P_h x P_w x P_c, split over depth as well) and each algorithm (stationary-w with every
p_f dividing P_c): forward and backward time (median over repeats of the slowest rank),
speedup over one rank (the serial kernels timed on rank 0 in the same run, while the other
ranks sleep), bytes sent per rank per iteration (the most of any rank, from the ledger), and
the bytes of the halo exchange and the weight and activation memory per rank. A table on
stdout; --json keeps the rows. --rounds R measures everything R times in turns (the serial
kernels, then every row, R times over): each row's times are then the median over the rounds,
and its speedup the median of each round's own (the serial kernels of that round over the row
of that round), with their range beside it, so that a spell of the machine running slower or
faster, which lasts seconds, falls on the baseline and the rows alike. --breakdown adds a
second table: where each rank's step goes (median of each part over the repeats; over rounds,
the round of the median step): its local kernels, the collectives' local copies
(packing), the MPI calls, waiting for the group (the barrier before each collective), and the
rest (the layer's own code around them). --chunks times each x, y and w layer again with its
collectives pipelined (of samples, or of features on a block of fewer samples; "feature chunks"
in the row), and --mpi-progress calls,thread times those rows (and --halo-interior's) both with
cfp's own test() calls and under a progress thread.
"""
import contextlib
import statistics
import sys
import time

import _requirements  # noqa: F401 (first: says what is missing, outside cfp's environment)
import numpy as np
from mpi4py import MPI

from cfp import backend, cli
from cfp.algorithms import ALGORITHMS, make_conv
from cfp.algorithms.base import by_features, chunks_fit, feature_chunk_limit
from cfp.comm import progress_thread
from cfp.benchtools import BREAKDOWN, measure_conv, on_rank0, slowest_median
from cfp.checks import alike_on_all_ranks, int_options, positive_int, positive_ints
from cfp.grid import ProcessGrid, factorizations
from cfp.partition import block_sizes
from cfp.perfmodel import pipelines
from cfp.train import MPI_PROGRESS
from cfp.io import check_writable, save_json
from cfp.grid import AXES
from cfp.kernels import conv2d_flops
from cfp.kernels.conv import OPS, conv3d_flops

MiB = 1024.0 ** 2


def parse_args(argv):
    p = cli.ArgumentParser(description=cli.script_description(__doc__))
    p.add_argument("--shape", required=True,
                   help="N,C,F,H,W,K: batch, input channels, output channels, height, width, kernel K x K; "
                        "a volume: N,C,F,D,H,W,K (depth D, kernel K x K x K)")
    p.add_argument("--stride", type=int, default=1, help="stride of the convolution")
    p.add_argument("--padding", type=int, help="zero padding on each side (default: K // 2)")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed iterations, of which the median is reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations before them")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure the serial kernels and every row this many times in turns; times are the "
                        "median over the rounds, speedups the median of each round's own")
    p.add_argument("--threads", type=int, default=1, help="BLAS threads per rank")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="element type")
    p.add_argument("--algorithms", default="sample,x,y,w",
                   help=f"comma-separated algorithms to time, of {', '.join(ALGORITHMS)}")
    p.add_argument("--spatial", action="store_true",
                   help="also split the image: every sample x height x width x channel factorization (a "
                        "volume's: sample x depth x height x width x channel)")
    p.add_argument("--halo-interior", action="store_true",
                   help="on grids that split the image (or the volume), time each layer that can compute its "
                        "interior while its halo moves (sample, x; ConvAlgorithm.halo_interior) a second time doing "
                        "so, beside the blocking exchange")
    p.add_argument("--chunks", default="1",
                   help="comma-separated chunk counts: each x, y and w layer with channel ranks is timed with its "
                        "collectives pipelined over each count of chunks of its samples, or where a rank holds "
                        "fewer, of its features (ConvAlgorithm.pipelined, train.py --chunks) beside the others; 1 is "
                        "the blocking layer")
    p.add_argument("--mpi-progress", default="calls",
                   help="comma-separated, of calls and thread (train.py --mpi-progress): the pipelined and interior "
                        "rows timed with the collectives in flight progressed only by cfp's test() calls between "
                        "chunks, and/or a second time under a progress thread (comm.progress_thread)")
    p.add_argument("--grid", action="append", dest="grids", metavar="SPEC",
                   help="time only this grid of the factorizations above (as train.py's --grid, e.g. depth=2; "
                        "repeatable); the serial kernels are always timed")
    p.add_argument("--breakdown", action="store_true",
                   help="also print each rank's step as kernels, packing, MPI, waiting and the rest")
    p.add_argument("--device", default="cpu", metavar=cli.one_of(backend.DEVICES),
                   help="cpu (NumPy) or gpu (CuPy: each rank its GPU, node-local rank modulo the GPUs)")
    p.add_argument("--json", help="write the rows to this JSON file (rank 0)")
    args = p.parse_args(argv)
    try:
        sizes = [int(v) for v in args.shape.split(",")]
        if len(sizes) not in (6, 7):
            raise ValueError
    except ValueError:
        raise ValueError(f"--shape must be N,C,F,H,W,K (six positive integers) or a volume's N,C,F,D,H,W,K "
                         f"(seven), got {args.shape!r}") from None
    names = "NCFDHWK" if len(sizes) == 7 else "NCFHWK"
    args.D = None
    for name, size in zip(names, sizes):
        setattr(args, name, positive_int(size, f"--shape {args.shape}: {name}"))
    args.op = "conv3d" if args.D else "conv2d"  # the kind of convolution (kernels/conv/ops.py)
    int_options(args, positive=("stride", "repeats", "rounds", "threads"), nonnegative=("warmup", "padding"))
    if args.padding is None:
        args.padding = args.K // 2
    args.progresses = args.mpi_progress.split(",")
    if not args.progresses or any(m not in MPI_PROGRESS for m in args.progresses):
        raise ValueError(f"--mpi-progress {args.mpi_progress!r}: expected a comma-separated list of "
                         f"{', '.join(MPI_PROGRESS)}")
    args.chunk_counts = sorted(set(positive_ints(args.chunks, "--chunks")))
    if args.chunk_counts[-1] > max(args.N, min(args.C, args.F)):
        raise ValueError(f"--chunks {args.chunks}: {args.chunk_counts[-1]} chunks is more than the {args.N} "
                         f"sample(s) and the {min(args.C, args.F)} channels or filters of --shape {args.shape}")
    try:  # the kernel must fit the padded input
        OPS[args.op].output_shape(x_shape(args), w_shape(args), stride=args.stride, padding=args.padding)
    except ValueError as e:
        raise ValueError(f"--shape {args.shape} with --padding {args.padding}: {e}") from None
    wanted = args.algorithms.split(",")
    unknown = [a for a in wanted if a not in ALGORITHMS]
    if unknown:
        raise ValueError(f"--algorithms {args.algorithms!r}: unknown {', '.join(map(repr, unknown))}; "
                         f"expected a comma-separated list of {', '.join(ALGORITHMS)}")
    return args


def x_shape(args):
    """(N, C, H, W), or a volume's (N, C, D, H, W)."""
    return (args.N, args.C) + ((args.D,) if args.D else ()) + (args.H, args.W)


def w_shape(args):
    return (args.F, args.C) + (args.K,) * OPS[args.op].axes


def serial_baseline(args, x, w, b, dy, xp=np):
    """The serial kernels, on rank 0 alone: the one-rank time of the layer. The results are
    kept to the end of the step, as a layer keeps its gradients (freeing each at once would let
    the next pass reuse its pages, which a real backward pass cannot). On a device, each pass
    is synchronised before its clock stops."""
    x, w, b, dy = (backend.from_host(a, xp) for a in (x, w, b, dy))

    def step():
        t0 = time.perf_counter()
        op, options = OPS[args.op], {"stride": args.stride, "padding": args.padding}
        y = op.forward(x, w, b, **options)
        backend.synchronize(x)
        t1 = time.perf_counter()
        db = op.backward_bias(dy)
        dw = op.backward_filter(x, dy, w.shape, **options)
        dx = op.backward_data(dy, w, x.shape, **options)
        backend.synchronize(x)
        t2 = time.perf_counter()
        del y, db, dw, dx
        return {"forward": t1 - t0, "backward": t2 - t1}
    return slowest_median(MPI.COMM_SELF, step, args.repeats, args.warmup)


def bench_one(args, world, grid, algorithm, p_f, x, w, b, dy, xp=np, halo_interior=False, chunks=1,
              progress="calls"):
    """One row: the layer timed (measure_conv), under a progress thread where `progress` is
    'thread' (comm.progress_thread, testing what its pipeline or halo has in flight)."""
    with progress_thread() if progress == "thread" else contextlib.nullcontext():
        row = measure_conv(world, grid, algorithm, p_f, x, w, b, dy, args.stride, args.padding,
                           args.repeats, args.warmup, xp, halo_interior, args.op, chunks=chunks)
    features = by_features(min(block_sizes(args.N, grid.axis_size("sample"))), chunks)
    return {"grid": grid.describe(), "algorithm": algorithm + (f" (p_f={p_f})" if p_f else "")
            + (" (interior while the halo moves)" if halo_interior else "")
            + (f" ({chunks} {'feature ' if features else ''}chunks)" if chunks > 1 else "")
            + (" (progress thread)" if progress == "thread" else ""), "chunks": chunks, "mpi_progress": progress,
            **row}


def interior_applies(args, grid, algorithm, p_f):
    """Whether the layer of `algorithm` can compute its interior while its halo moves (the
    layer says: ConvAlgorithm.interior_applies)."""
    return make_conv(algorithm, grid, args.C, args.F, args.K, filter_groups=p_f, stride=args.stride,
                     padding=args.padding, layer="conv", op=args.op).interior_applies()


def speedup_text(row):
    """A row's speedup, with the range of the rounds' own where there were several."""
    low, high = min(row["speedups"]), max(row["speedups"])
    return f"{row['speedup']:.2f}x" + (f" ({low:.2f}-{high:.2f})" if len(row["speedups"]) > 1 else "")


def print_breakdown(rows):
    """Each rank's median step of each distributed row, in milliseconds, part by part."""
    print("\n| grid | algorithm | rank | step ms | kernels | packing | MPI | wait | rest |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for rank, parts in enumerate(r.get("breakdown", [])):
            print(f"| {r['grid']} | {r['algorithm']} | {rank} | "
                  + " | ".join(f"{parts[k] * 1e3:.1f}" for k in BREAKDOWN) + " |")


def grid_shapes(args, P):
    """The grids this run times, {axis: size} each: every factorization of P over sample and
    channel (with --spatial the image's or volume's axes too), or of them those --grid names;
    a --grid that is none of them refused, naming them."""
    split = [a for a in AXES if a != "depth" or args.D] if args.spatial else ["sample", "channel"]
    shapes = [dict(zip(split, sizes)) for sizes in factorizations(P, len(split))]
    if not args.grids:
        return shapes
    every = {ProcessGrid.describe_shape(shape): shape for shape in shapes}
    chosen = []
    for spec in args.grids:
        name = ProcessGrid.describe_shape(ProcessGrid.shape_of(spec))
        if name not in every:
            raise ValueError(f"--grid {spec}: not a grid this run times on {P} rank(s); expected one of "
                             f"{', '.join(every)}" + ("" if args.spatial else " (--spatial adds the image's axes)"))
        if every[name] not in chosen:
            chosen.append(every[name])
    return chosen


def one_round(args, world, P, x, w, b, dy, xp):
    """One round: the serial kernels on rank 0, then every grid, algorithm and option's row, each
    with its speedup over this round's serial kernels."""
    baseline = on_rank0(world, lambda: serial_baseline(args, x, w, b, dy, xp))
    rows = [{"grid": "1 rank (serial kernels)", "algorithm": "-", "forward_s": baseline["forward"],
             "backward_s": baseline["backward"], "bytes_sent_per_rank": 0, "halo_bytes_per_rank": 0,
             "weight_bytes_per_rank": w.nbytes + b.nbytes, "kept_activation_bytes_per_rank": x.nbytes}]
    wanted = args.algorithms.split(",")
    for shape in grid_shapes(args, P):
        P_d, P_h, P_w, P_c = (shape.get(a, 1) for a in ("depth", "height", "width", "channel"))
        grid = ProcessGrid(shape)
        for algorithm in wanted:
            p_fs = [d for d in range(1, P_c + 1) if P_c % d == 0] if algorithm == "w" else [None]
            for p_f in p_fs:
                rows.append(bench_one(args, world, grid, algorithm, p_f, x, w, b, dy, xp))
                # pipelined: a layer with collectives of its own, each rank holding k samples, or,
                # holding fewer, k of the features its chunks split
                cls = ALGORITHMS[algorithm]
                for k in args.chunk_counts[1:] if P_c > 1 and pipelines(cls) else []:
                    if chunks_fit(min(block_sizes(args.N, shape.get("sample", 1))), k,
                                  feature_chunk_limit(cls, args.C, args.F, P_c, False, True)):
                        rows += [bench_one(args, world, grid, algorithm, p_f, x, w, b, dy, xp, chunks=k,
                                           progress=m) for m in args.progresses]
                if args.halo_interior and P_d * P_h * P_w > 1 and interior_applies(args, grid, algorithm, p_f):
                    rows += [bench_one(args, world, grid, algorithm, p_f, x, w, b, dy, xp, halo_interior=True,
                                       progress=m) for m in args.progresses]
        grid.free()
    one_rank = baseline["forward"] + baseline["backward"]
    for row in rows:
        row["speedup"] = one_rank / (row["forward_s"] + row["backward_s"])
    return rows


def combine_rounds(rounds):
    """The rows of several rounds (one_round's, the same rows in each) as one: forward and
    backward seconds the median over the rounds, the speedup the median of the rounds' own, with
    every round's (speedups), and each rank's breakdown that of its round of the median step."""
    rows = []
    for same in zip(*rounds):
        row = dict(same[0])
        for key in ("forward_s", "backward_s"):
            row[key] = statistics.median(r[key] for r in same)
        row["speedups"] = [r["speedup"] for r in same]
        row["speedup"] = statistics.median(row["speedups"])
        if "breakdown" in row:  # each rank's from its round of the median step, whose parts add up to it
            row["breakdown"] = [sorted((r["breakdown"][rank] for r in same), key=lambda parts: parts["step"])
                                [(len(same) - 1) // 2] for rank in range(len(row["breakdown"]))]
        rows.append(row)
    return rows


def main(argv=None):
    args = parse_args(argv)
    world = MPI.COMM_WORLD
    P, rank = world.Get_size(), world.Get_rank()
    if args.json:
        alike_on_all_ranks(world, lambda: check_writable(args.json, "--json"))
    grid_shapes(args, P)  # a --grid this run does not time refused before anything runs
    threads = backend.set_blas_threads(args.threads)
    xp, where = backend.use_device(args.device, world)
    dtype = np.dtype(args.dtype)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(x_shape(args)).astype(dtype)
    w = rng.standard_normal(w_shape(args)).astype(dtype)
    b = rng.standard_normal(args.F).astype(dtype)
    y_shape = OPS[args.op].output_shape(x.shape, w.shape, stride=args.stride, padding=args.padding)
    dy = rng.standard_normal(y_shape).astype(dtype)
    flops = 3 * (conv3d_flops if args.D else conv2d_flops)(x.shape, w.shape, args.stride, args.padding)

    rounds = [one_round(args, world, P, x, w, b, dy, xp) for _ in range(args.rounds)]
    rows = combine_rounds(rounds)
    for row in rows:
        row["gflops_per_s"] = flops / (row["forward_s"] + row["backward_s"]) / 1e9

    if rank == 0:
        size = "x".join(str(n) for n in x_shape(args)[2:])
        kernel = "x".join([str(args.K)] * OPS[args.op].axes)
        in_turns = (f"; {args.rounds} rounds in turns: times the median over the rounds, speedups the median "
                    f"of the rounds' own (their range)" if args.rounds > 1 else "")
        device = (f", on GPU {where['index']} ({where['name']}) of each node-local rank, {where['messages']}"
                  if xp is not np else "")
        print(f"# conv N={args.N} C={args.C} F={args.F} {size} kernel {kernel} stride {args.stride} padding "
              f"{args.padding}, {args.dtype}, {P} ranks, {threads} BLAS thread(s) per rank (BLAS "
              f"{backend.blas_description()}), median of {args.repeats} (after {args.warmup} warm-up), time of the "
              f"slowest rank{in_turns}{device}")
        print("| grid | algorithm | forward s | backward s | total s | speedup vs 1 rank | GFLOP/s "
              "| sent MiB/rank | of it halo MiB/rank | weights MiB/rank | kept for backward MiB/rank |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['grid']} | {r['algorithm']} | {r['forward_s']:.4f} | {r['backward_s']:.4f} | "
                  f"{r['forward_s'] + r['backward_s']:.4f} | {speedup_text(r)} | {r['gflops_per_s']:.1f} | "
                  f"{r['bytes_sent_per_rank'] / MiB:.2f} | {r['halo_bytes_per_rank'] / MiB:.2f} | "
                  f"{r['weight_bytes_per_rank'] / MiB:.2f} | "
                  f"{r['kept_activation_bytes_per_rank'] / MiB:.2f} |")
        if args.breakdown:
            print_breakdown(rows)
        if args.json:
            save_json(args.json, {"arguments": vars(args), "ranks": P, "threads": threads, "rows": rows})
            print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
