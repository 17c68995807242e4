"""Time cfp's local convolution kernels (forward, backward-data, backward-filter) against PyTorch.

Single process, no mpiexec: `python scripts/bench_kernels.py --threads 1 --repeats 5 [--json out.json]`.
`--winograd 4` (or 2, or off) picks the path of the 3x3 layers; the "error" column is the largest
difference of each pass from the float64 im2col result, relative to its largest value.
"""
import argparse
import re
import statistics
import sys
import time

import _requirements  # noqa: F401 (first: says what is missing, outside cfp's environment)
import numpy as np

from cfp import cli
from cfp.backend import blas_info, cpu_name, set_blas_threads
from cfp.checks import int_options
from cfp.io import check_writable, save_json
from cfp.kernels import settings
from cfp.kernels import (
    conv2d_backward_data,
    conv2d_backward_filter,
    conv2d_flops,
    conv2d_forward,
    conv_geometry,
)
from cfp.kernels.conv import paths

# N x C x F x H x W x K[gG][dD]: the shapes BENCHMARKS.md reports (3x3 "same" convolutions on a
# wide-ish and a very wide layer, a 1x1 channel-reducing layer; then a depthwise, a grouped
# and a dilated 3x3 layer).
DEFAULT_SHAPES = ("32x64x64x32x32x3", "8x256x256x16x16x3", "32x256x64x16x16x1",
                  "32x256x256x16x16x3g256", "32x256x256x16x16x3g32", "8x256x256x32x32x3d2")
PASSES = ("forward", "backward_data", "backward_filter")

try:
    import torch
except ImportError:  # the comparison is optional: cfp is timed alone
    torch = None


def parse_shape(text):
    """'32x64x64x32x32x3' -> (N, C, F, H, W, K, groups, dilation), with 'g32' and 'd2' after K
    for groups and dilation; padding dilation * (K // 2) keeps H and W ("same")."""
    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)x(\d+)x(\d+)x(\d+)(?:g(\d+))?(?:d(\d+))?", text.lower())
    dims = tuple(int(d) if d else 1 for d in match.groups()) if match else ()
    if len(dims) != 8 or min(dims) < 1 or dims[1] % dims[6] or dims[2] % dims[6]:
        raise argparse.ArgumentTypeError(
            f"shape must be N x C x F x H x W x K with positive integers and optional gG (groups dividing "
            f"C and F) and dD (dilation), e.g. 32x64x64x32x32x3 or 32x256x256x16x16x3g32, got {text!r}"
        )
    return dims


def shape_text(shape):
    N, C, F, H, W, K, G, D = shape
    return f"{N}x{C}x{F}x{H}x{W}x{K}" + (f"g{G}" if G > 1 else "") + (f"d{D}" if D > 1 else "")


def median_seconds(runs, repeats, warmup=1):
    """{name: median wall time of runs[name]()} over `repeats` rounds after `warmup` untimed ones.

    Each round calls every implementation once, in turns (in the reverse order every other
    round), so that a machine whose speed drifts (a shared host, another tenant's memory
    traffic) slows them alike rather than whichever happened to run in its slow minute."""
    for _ in range(warmup):
        for run in runs.values():
            run()
    times = {name: [] for name in runs}
    for r in range(repeats):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def cfp_runs(x, w, dy, padding, groups, dilation):
    kw = {"padding": padding, "groups": groups, "dilation": dilation}
    return {
        "forward": lambda: conv2d_forward(x, w, **kw),
        "backward_data": lambda: conv2d_backward_data(dy, w, x.shape, **kw),
        "backward_filter": lambda: conv2d_backward_filter(x, dy, w.shape, **kw),
    }


def torch_runs(x, w, dy, padding, groups, dilation):
    tx, tw, tdy = (torch.from_numpy(a) for a in (x, w, dy))

    def backward(which):
        # aten.convolution_backward is what autograd calls for conv2d; the mask selects
        # (input, weight, bias) gradients so each pass is timed on its own.
        mask = [which == "data", which == "filter", False]
        return torch.ops.aten.convolution_backward(
            tdy, tx, tw, None, [1, 1], [padding, padding], [dilation, dilation], False, [0, 0], groups, mask
        )

    return {
        "forward": lambda: torch.nn.functional.conv2d(tx, tw, padding=padding, groups=groups, dilation=dilation),
        "backward_data": lambda: backward("data"),
        "backward_filter": lambda: backward("filter"),
    }


def largest_error(x, w, dy, padding, groups, dilation):
    """The largest of the three passes' max |cfp - float64 im2col| / max |float64 im2col|."""
    ours = {p: run() for p, run in cfp_runs(x, w, dy, padding, groups, dilation).items()}
    with settings.winograd(False):
        exact = {p: run() for p, run in cfp_runs(*(a.astype(np.float64) for a in (x, w, dy)),
                                                 padding, groups, dilation).items()}
    return max(float(np.abs(ours[p] - exact[p]).max() / np.abs(exact[p]).max()) for p in PASSES)


def bench_shape(shape, dtype, repeats, rng):
    N, C, F, H, W, K, G, D = shape
    padding = D * (K // 2)
    x = rng.standard_normal((N, C, H, W)).astype(dtype)
    w = rng.standard_normal((F, C // G, K, K)).astype(dtype)
    extent = D * (K - 1) + 1
    dy = rng.standard_normal((N, F, H + 2 * padding - extent + 1, W + 2 * padding - extent + 1)).astype(dtype)
    flops = conv2d_flops(x.shape, w.shape, 1, padding, D, G)
    g = conv_geometry(x.shape, w.shape, 1, padding, D, G)
    row = {"shape": shape_text(shape), "padding": padding, "flops_per_pass": flops,
           "cfp_error": largest_error(x, w, dy, padding, G, D), "paths": paths.taken(g, np.dtype(dtype))}
    implementations = {"cfp": cfp_runs(x, w, dy, padding, G, D)}
    if torch is not None:
        implementations["torch"] = torch_runs(x, w, dy, padding, G, D)
    for pass_name in PASSES:
        seconds = median_seconds({name: runs[pass_name] for name, runs in implementations.items()}, repeats)
        for name in implementations:
            row[f"{name}_{pass_name}_s"] = seconds[name]
            row[f"{name}_{pass_name}_gflops"] = flops / seconds[name] / 1e9
    for name in implementations:
        row[f"{name}_total_s"] = sum(row[f"{name}_{p}_s"] for p in PASSES)
    if torch is not None:
        row["torch_over_cfp"] = row["torch_total_s"] / row["cfp_total_s"]
    return row


def markdown_table(rows):
    names = ["cfp"] + (["torch"] if torch is not None else [])
    header = ["shape N x C x F x H x W x K [groups, dilation]", "pad"]
    for name in names:
        header += [f"{name} fwd ms (GF/s)", f"{name} bwd-data ms (GF/s)",
                   f"{name} bwd-filter ms (GF/s)", f"{name} total ms"]
    header += ["cfp error", "cfp paths (fwd, bwd-data, bwd-filter)"]
    if torch is not None:
        header.append("torch/cfp total")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row["shape"], str(row["padding"])]
        for name in names:
            for p in PASSES:
                cells.append(f"{row[f'{name}_{p}_s'] * 1e3:.3g} ({row[f'{name}_{p}_gflops']:.0f})")
            cells.append(f"{row[f'{name}_total_s'] * 1e3:.3g}")
        cells.append(f"{row['cfp_error']:.1e}")
        cells.append(", ".join(row["paths"].values()))
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
                        help="N x C x F x H x W x K[gG][dD], stride 1, padding D * (K // 2) "
                             f"(default: {' '.join(DEFAULT_SHAPES)})")
    parser.add_argument("--winograd", choices=("off", "2", "4"), default=None,
                        help="3x3 stride-1 layers by im2col (off) or Winograd F(2x2) / F(4x4) in "
                             "every dtype (default: cfp's, F(4x4) in float32 and im2col in float64)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    int_options(args, positive=("repeats", "threads"))
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.json:
        check_writable(args.json, "--json")
    shapes = args.shapes or [parse_shape(s) for s in DEFAULT_SHAPES]

    switch = {}
    if args.winograd is not None:
        switch["winograd"] = args.winograd != "off"
        if args.winograd != "off":
            switch["winograd_tile"] = int(args.winograd)
    with settings.configured(**switch):
        return run(args, shapes)


def run(args, shapes):
    chosen = settings.current()
    tile = f"Winograd F({chosen.winograd_tile}x{chosen.winograd_tile}, 3x3)"
    path = {True: tile, False: "im2col"}.get(chosen.winograd, f"{tile} in float32, im2col in float64")
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
        "3x3 path": path,
    }
    print(f"# cfp local conv kernels: threads={threads}, dtype={args.dtype}, median of {args.repeats} "
          f"after 1 warm-up, cfp's and torch's calls of a pass in turns, stride 1, 3x3 layers by {path}")
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
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
