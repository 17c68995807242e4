"""Time cfp's local convolution kernels (forward, backward-data, backward-filter) against PyTorch.

Single process, no mpiexec: `python scripts/bench_kernels.py --threads 1 --repeats 5 [--json out.json]`.
"""
import argparse
import platform
import statistics
import sys
import time

import numpy as np

from cfp import cli
from cfp.backend import blas_info, set_blas_threads
from cfp.checks import int_options
from cfp.io import check_writable, save_json
from cfp.kernels import (
    conv2d_backward_data,
    conv2d_backward_filter,
    conv2d_flops,
    conv2d_forward,
)

# N x C x F x H x W x K: the three shapes BENCHMARKS.md reports (3x3 "same" convolutions on a
# wide-ish and a very wide layer, and a 1x1 channel-reducing layer).
DEFAULT_SHAPES = ("32x64x64x32x32x3", "8x256x256x16x16x3", "32x256x64x16x16x1")
PASSES = ("forward", "backward_data", "backward_filter")

try:
    import torch
except ImportError:  # the comparison is optional: cfp is timed alone
    torch = None


def cpu_name():
    """The processor's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def parse_shape(text):
    """'32x64x64x32x32x3' -> (N, C, F, H, W, K); padding K // 2 keeps H and W ("same")."""
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        dims = ()
    if len(dims) != 6 or min(dims) < 1:
        raise argparse.ArgumentTypeError(
            f"shape must be N x C x F x H x W x K with positive integers, e.g. 32x64x64x32x32x3, "
            f"got {text!r}"
        )
    return dims


def median_seconds(run, repeats, warmup=1):
    """Median wall time of `run()` over `repeats` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cfp_runs(x, w, dy, padding):
    return {
        "forward": lambda: conv2d_forward(x, w, padding=padding),
        "backward_data": lambda: conv2d_backward_data(dy, w, x.shape, padding=padding),
        "backward_filter": lambda: conv2d_backward_filter(x, dy, w.shape, padding=padding),
    }


def torch_runs(x, w, dy, padding):
    tx, tw, tdy = (torch.from_numpy(a) for a in (x, w, dy))

    def backward(which):
        # aten.convolution_backward is what autograd calls for conv2d; the mask selects
        # (input, weight, bias) gradients so each pass is timed on its own.
        mask = [which == "data", which == "filter", False]
        return torch.ops.aten.convolution_backward(
            tdy, tx, tw, None, [1, 1], [padding, padding], [1, 1], False, [0, 0], 1, mask
        )

    return {
        "forward": lambda: torch.nn.functional.conv2d(tx, tw, padding=padding),
        "backward_data": lambda: backward("data"),
        "backward_filter": lambda: backward("filter"),
    }


def bench_shape(shape, dtype, repeats, rng):
    N, C, F, H, W, K = shape
    padding = K // 2
    x = rng.standard_normal((N, C, H, W)).astype(dtype)
    w = rng.standard_normal((F, C, K, K)).astype(dtype)
    dy = rng.standard_normal((N, F, H + 2 * padding - K + 1, W + 2 * padding - K + 1)).astype(dtype)
    flops = conv2d_flops(x.shape, w.shape, 1, padding)
    row = {"shape": "x".join(map(str, shape)), "padding": padding, "flops_per_pass": flops}
    implementations = {"cfp": cfp_runs(x, w, dy, padding)}
    if torch is not None:
        implementations["torch"] = torch_runs(x, w, dy, padding)
    for name, runs in implementations.items():
        for pass_name in PASSES:
            seconds = median_seconds(runs[pass_name], repeats)
            row[f"{name}_{pass_name}_s"] = seconds
            row[f"{name}_{pass_name}_gflops"] = flops / seconds / 1e9
        row[f"{name}_total_s"] = sum(row[f"{name}_{p}_s"] for p in PASSES)
    if torch is not None:
        row["torch_over_cfp"] = row["torch_total_s"] / row["cfp_total_s"]
    return row


def markdown_table(rows):
    names = ["cfp"] + (["torch"] if torch is not None else [])
    header = ["shape N x C x F x H x W x K", "pad"]
    for name in names:
        header += [f"{name} fwd ms (GF/s)", f"{name} bwd-data ms (GF/s)",
                   f"{name} bwd-filter ms (GF/s)", f"{name} total ms"]
    if torch is not None:
        header.append("torch/cfp total")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row["shape"], str(row["padding"])]
        for name in names:
            for p in PASSES:
                cells.append(f"{row[f'{name}_{p}_s'] * 1e3:.3g} ({row[f'{name}_{p}_gflops']:.0f})")
            cells.append(f"{row[f'{name}_total_s'] * 1e3:.3g}")
        if torch is not None:
            cells.append(f"{row['torch_over_cfp']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv):
    parser = cli.ArgumentParser(description=cli.script_description(__doc__))
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed calls per pass, of which the median is reported")
    parser.add_argument("--threads", type=int, default=1, help="BLAS and torch threads")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="element type")
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=None,
                        help="N x C x F x H x W x K, stride 1, padding K // 2 "
                             f"(default: {' '.join(DEFAULT_SHAPES)})")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    int_options(args, positive=("repeats", "threads"))
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.json:
        check_writable(args.json, "--json")
    shapes = args.shapes or [parse_shape(s) for s in DEFAULT_SHAPES]

    threads = set_blas_threads(args.threads)
    if torch is not None:
        torch.set_num_threads(threads)
    blas = ", ".join(f"{lib} {version} ({arch})" for lib, version, _, arch in blas_info())
    context = {
        "threads": threads,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "numpy": np.__version__,
        "blas": blas,
        "torch": torch.__version__ if torch is not None else None,
        "cpu": cpu_name(),
    }
    print(f"# cfp local conv kernels: threads={threads}, dtype={args.dtype}, "
          f"median of {args.repeats} after 1 warm-up, stride 1")
    print(f"# numpy {np.__version__}, BLAS: {blas}; torch {context['torch'] or 'not installed'}; "
          f"CPU: {context['cpu']}")
    print()
    rng = np.random.default_rng(0)
    rows = []
    for shape in shapes:
        rows.append(bench_shape(shape, np.dtype(args.dtype), args.repeats, rng))
    print(markdown_table(rows))
    if args.json:
        save_json(args.json, {"context": context, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
