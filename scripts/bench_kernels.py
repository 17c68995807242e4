"""Time cfp's local convolution kernels (forward, backward-data, backward-filter) against PyTorch.

Single process, no mpiexec: `python scripts/bench_kernels.py --threads 1 --repeats 5 [--json out.json]`.
`--winograd 4` (or 2, or off) picks the path of the 3x3 layers; the "error" column is the largest
difference of each pass from the float64 im2col result, relative to its largest value.
`--sweep` times the convolutions of ResNet-50, VGG-16 and a U-Net at their natural image sizes
(batches from `--batches`), and the half and quarter blocks that 2 and 4 ranks hold of their
wide 3x3 layers, with a summary of the torch/cfp ratios. `--device gpu` times cfp on CuPy arrays
against PyTorch on CUDA (cuDNN), each call synchronised before its clock stops. A shape of
seven sizes, N x C x F x D x H x W x K, is a volume's 3-D convolution (K x K x K kernel, against
PyTorch's conv3d); its paths are those of the stacked 2-D convolution it runs as
(kernels/conv/volume.py).
"""
import argparse
import re
import statistics
import sys
import time

import _requirements  # noqa: F401 (first: says what is missing, outside cfp's environment)
import numpy as np

from cfp import backend, cli
from cfp.backend import blas_description, cpu_name, set_blas_threads
from cfp.checks import int_options, positive_ints
from cfp.io import check_writable, save_json
from cfp.kernels import settings
from cfp.kernels import (
    conv2d_backward_data,
    conv2d_backward_filter,
    conv2d_flops,
    conv2d_forward,
    conv_geometry,
)
from cfp.kernels.conv import conv3d_backward_data, conv3d_backward_filter, conv3d_flops, conv3d_forward, paths
from cfp.kernels.conv import volume_geometry

# N x C x F x H x W x K[gG][dD][sS]: the shapes BENCHMARKS.md reports (3x3 "same" convolutions on
# a wide-ish and a very wide layer, a 1x1 channel-reducing layer; then a depthwise, a grouped
# and a dilated 3x3 layer).
DEFAULT_SHAPES = ("32x64x64x32x32x3", "8x256x256x16x16x3", "32x256x64x16x16x1",
                  "32x256x256x16x16x3g256", "32x256x256x16x16x3g32", "8x256x256x32x32x3d2")
PASSES = ("forward", "backward_data", "backward_filter")

# The sweep's networks: each convolution as (C, F, H, K, stride) on a square H x H input, in the
# order the network meets them (a layer repeated in a network is listed once). ResNet-50 as
# torchvision builds it (the stride on the bottleneck's 3x3 layer, 1x1 projections with stride
# 2), VGG-16's thirteen 3x3 layers, and a U-Net on 256x256 images of one channel with 64 to 1024
# channels (its 2x2 up-convolutions, transposed convolutions, are not in the sweep: it times conv2d).
SWEEP_NETWORKS = {
    "resnet50": ((3, 64, 224, 7, 2), (64, 64, 56, 1, 1), (64, 64, 56, 3, 1), (64, 256, 56, 1, 1),
                 (256, 64, 56, 1, 1), (256, 128, 56, 1, 1), (128, 128, 56, 3, 2), (256, 512, 56, 1, 2),
                 (128, 512, 28, 1, 1), (512, 128, 28, 1, 1), (128, 128, 28, 3, 1), (512, 256, 28, 1, 1),
                 (256, 256, 28, 3, 2), (512, 1024, 28, 1, 2), (256, 1024, 14, 1, 1), (1024, 256, 14, 1, 1),
                 (256, 256, 14, 3, 1), (1024, 512, 14, 1, 1), (512, 512, 14, 3, 2), (1024, 2048, 14, 1, 2),
                 (512, 2048, 7, 1, 1), (2048, 512, 7, 1, 1), (512, 512, 7, 3, 1)),
    "vgg16": ((3, 64, 224, 3, 1), (64, 64, 224, 3, 1), (64, 128, 112, 3, 1), (128, 128, 112, 3, 1),
              (128, 256, 56, 3, 1), (256, 256, 56, 3, 1), (256, 512, 28, 3, 1), (512, 512, 28, 3, 1),
              (512, 512, 14, 3, 1)),
    "unet": ((1, 64, 256, 3, 1), (64, 64, 256, 3, 1), (64, 128, 128, 3, 1), (128, 128, 128, 3, 1),
             (128, 256, 64, 3, 1), (256, 256, 64, 3, 1), (256, 512, 32, 3, 1), (512, 512, 32, 3, 1),
             (512, 1024, 16, 3, 1), (1024, 1024, 16, 3, 1), (1024, 512, 32, 3, 1), (512, 256, 64, 3, 1),
             (256, 128, 128, 3, 1), (128, 64, 256, 3, 1), (64, 2, 256, 1, 1)),
}
SWEEP_BATCHES = (1, 8, 32)
# The blocks 2 and 4 ranks hold of a layer, at BLOCK_BATCH samples: half and a quarter of the
# samples, the channels, the filters or the rows (a spatial split's rows, its halo left out),
# of the 3x3 stride-1 layers on images of at most BLOCK_IMAGE rows: the wide layers that
# channel and filter parallelism are for.
BLOCK_BATCH, BLOCK_IMAGE = 8, 64
BLOCK_SPLITS = ("samples", "channels", "filters", "rows")

try:
    import torch
except ImportError:  # the comparison is optional: cfp is timed alone
    torch = None


def parse_shape(text):
    """'32x64x64x32x32x3' -> (N, C, F, H, W, K, groups, dilation, stride), with 'g32', 'd2' and
    's2' after K for groups, dilation and stride; padding dilation * (K // 2) keeps H and W at
    stride 1 ("same"). A volume, 'N x C x F x D x H x W x K': the same with its depth D last."""
    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)(?:x(\d+))?x(\d+)x(\d+)x(\d+)(?:g(\d+))?(?:d(\d+))?(?:s(\d+))?",
                         text.lower())
    depth = int(match.group(4)) if match and match.group(4) else None
    groups = match.groups()[:3] + match.groups()[4:] if match else ()
    dims = tuple(int(d) if d else 1 for d in groups) + ((depth,) if depth is not None else ())
    if len(dims) < 9 or min(dims) < 1 or dims[1] % dims[6] or dims[2] % dims[6]:
        raise argparse.ArgumentTypeError(
            f"shape must be N x C x F x H x W x K (a volume: N x C x F x D x H x W x K) with positive integers "
            f"and optional gG (groups dividing C and F), dD (dilation) and sS (stride), e.g. 32x64x64x32x32x3, "
            f"32x256x256x16x16x3g32 or 1x32x32x64x64x64x3, got {text!r}"
        )
    return dims


def shape_text(shape):
    N, C, F, H, W, K, G, D, S = shape[:9]
    sizes = (N, C, F) + tuple(shape[9:]) + (H, W, K)
    return ("x".join(map(str, sizes)) + (f"g{G}" if G > 1 else "") + (f"d{D}" if D > 1 else "")
            + (f"s{S}" if S > 1 else ""))


def sweep_shapes(batches, networks=tuple(SWEEP_NETWORKS)):
    """[(shape, where)]: every convolution of `networks` at each batch, then the half and
    quarter blocks of their wide 3x3 layers (BLOCK_SPLITS); where (network, layer or block)
    names what it is, and a block's "of" its full layer. A shape met twice is timed once."""
    rows, seen = [], set()

    def add(shape, where):
        if shape not in seen:
            seen.add(shape)
            rows.append((shape, where))
    for N in batches:
        for network in networks:
            for C, F, H, K, S in SWEEP_NETWORKS[network]:
                add((N, C, F, H, H, K, 1, 1, S), {"network": network, "batch": N})
    for network in networks:
        for C, F, H, K, S in SWEEP_NETWORKS[network]:
            if (K, S) != (3, 1) or H > BLOCK_IMAGE:
                continue
            full = (BLOCK_BATCH, C, F, H, H, K, 1, 1, S)
            add(full, {"network": network, "batch": BLOCK_BATCH})
            for ranks in (2, 4):
                for split in BLOCK_SPLITS:
                    N, C_, F_, H_ = full[:4]
                    block = {"samples": (N // ranks, C_, F_, H_), "channels": (N, C_ // ranks, F_, H_),
                             "filters": (N, C_, F_ // ranks, H_), "rows": (N, C_, F_, H_ // ranks)}[split]
                    add(block + (H, K, 1, 1, S), {"network": network, "of": shape_text(full),
                                                  "split": f"{split}/{ranks}"})
    return rows


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


def _synchronised(run, sync):
    """run(), then sync() (a device's work ends only when its stream is synchronised)."""
    def call():
        out = run()
        sync()
        return out
    return call


def cfp_runs(x, w, dy, padding, groups, dilation, stride=1):
    """The three passes on x, w, dy (NumPy arrays, or CuPy arrays: each call then synchronised)."""
    kw = {"stride": stride, "padding": padding, "groups": groups, "dilation": dilation}
    forward, backward_data, backward_filter = ((conv3d_forward, conv3d_backward_data, conv3d_backward_filter)
                                               if x.ndim == 5 else
                                               (conv2d_forward, conv2d_backward_data, conv2d_backward_filter))
    runs = {
        "forward": lambda: forward(x, w, **kw),
        "backward_data": lambda: backward_data(dy, w, x.shape, **kw),
        "backward_filter": lambda: backward_filter(x, dy, w.shape, **kw),
    }
    if not backend.is_device_array(x):
        return runs
    return {name: _synchronised(run, lambda: backend.synchronize(x)) for name, run in runs.items()}


def torch_runs(x, w, dy, padding, groups, dilation, stride=1, device="cpu"):
    tx, tw, tdy = (torch.from_numpy(a).to("cuda" if device == "gpu" else "cpu") for a in (x, w, dy))
    axes = x.ndim - 2
    convolution = torch.nn.functional.conv3d if axes == 3 else torch.nn.functional.conv2d

    def backward(which):
        # aten.convolution_backward is what autograd calls for conv2d and conv3d; the mask
        # selects (input, weight, bias) gradients so each pass is timed on its own.
        mask = [which == "data", which == "filter", False]
        return torch.ops.aten.convolution_backward(
            tdy, tx, tw, None, [stride] * axes, [padding] * axes, [dilation] * axes, False, [0] * axes,
            groups, mask
        )

    runs = {
        "forward": lambda: convolution(tx, tw, stride=stride, padding=padding, groups=groups, dilation=dilation),
        "backward_data": lambda: backward("data"),
        "backward_filter": lambda: backward("filter"),
    }
    if device != "gpu":
        return runs
    return {name: _synchronised(run, torch.cuda.synchronize) for name, run in runs.items()}


def largest_error(x, w, dy, padding, groups, dilation, stride=1, xp=np):
    """The largest of the three passes' max |cfp - float64 im2col| / max |float64 im2col|, cfp's
    passes run on arrays of `xp` (the reference on NumPy)."""
    moved = [backend.from_host(a, xp) for a in (x, w, dy)]
    ours = {p: backend.to_host(run()) for p, run in cfp_runs(*moved, padding, groups, dilation, stride).items()}
    with settings.winograd(False):
        exact = {p: run() for p, run in cfp_runs(*(a.astype(np.float64) for a in (x, w, dy)),
                                                 padding, groups, dilation, stride).items()}
    return max(float(np.abs(ours[p] - exact[p]).max() / np.abs(exact[p]).max()) for p in PASSES)


def bench_shape(shape, dtype, repeats, rng, xp=np):
    N, C, F, H, W, K, G, D, S = shape[:9]
    padding = D * (K // 2)
    depth = tuple(shape[9:])  # (D,) for a volume
    x = rng.standard_normal((N, C) + depth + (H, W)).astype(dtype)
    w = rng.standard_normal((F, C // G) + (K,) * len(depth) + (K, K)).astype(dtype)
    if depth:
        v = volume_geometry(x.shape, w.shape, S, padding, D, G)
        g, out, flops = v.plane, (v.Do,), conv3d_flops(x.shape, w.shape, S, padding, D, G)
    else:
        g, out = conv_geometry(x.shape, w.shape, S, padding, D, G), ()
        flops = conv2d_flops(x.shape, w.shape, S, padding, D, G)
    dy = rng.standard_normal((N, F) + out + (g.Ho, g.Wo)).astype(dtype)
    row = {"shape": shape_text(shape), "padding": padding, "flops_per_pass": flops,
           "cfp_error": largest_error(x, w, dy, padding, G, D, S, xp), "paths": paths.taken(g, np.dtype(dtype))}
    implementations = {"cfp": cfp_runs(*(backend.from_host(a, xp) for a in (x, w, dy)), padding, G, D, S)}
    if torch is not None:
        implementations["torch"] = torch_runs(x, w, dy, padding, G, D, S, "cpu" if xp is np else "gpu")
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
    header = ["shape N x C x F x [D x] H x W x K [groups, dilation, stride]", "pad"]
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


def _geometric_mean(values):
    return float(np.exp(np.mean(np.log(values)))) if values else float("nan")


def sweep_summary(rows):
    """Lines that sum up a sweep's torch/cfp ratios: over every shape, over the shapes with at
    least 16 input channels, over the first layers (1 or 3 channels): the geometric mean and
    the worst with its shape."""
    lines = []
    classes = (("every shape", lambda C: True), ("C >= 16", lambda C: C >= 16),
               ("first layers (C <= 3)", lambda C: C <= 3))
    for name, keep in classes:
        chosen = [r for r in rows if keep(parse_shape(r["shape"])[1])]
        if not chosen:
            continue
        worst = min(chosen, key=lambda r: r["torch_over_cfp"])
        lines.append(f"{name}: {len(chosen)} shapes, torch/cfp geometric mean "
                     f"{_geometric_mean([r['torch_over_cfp'] for r in chosen]):.2f}, worst "
                     f"{worst['torch_over_cfp']:.2f} ({worst['shape']}, {worst['where'].get('network', '')})")
    return lines


def block_table(rows):
    """The blocks' times as fractions of their full layer's, cfp's and torch's (1/ranks is what
    a perfect split would take): a markdown table, or '' where the sweep had no blocks."""
    full = {r["shape"]: r for r in rows}
    lines = ["| layer | block | cfp block / layer | torch block / layer |", "|---|---|---|---|"]
    for r in rows:
        of = r["where"].get("of")
        if of is None or of not in full:
            continue
        cells = [of, f"{r['where']['split']}: {r['shape']}",
                 f"{r['cfp_total_s'] / full[of]['cfp_total_s']:.2f}"]
        cells.append(f"{r['torch_total_s'] / full[of]['torch_total_s']:.2f}" if torch is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def parse_args(argv):
    parser = cli.ArgumentParser(description=cli.script_description(__doc__))
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed calls per pass, of which the median is reported")
    parser.add_argument("--threads", type=int, default=1, help="BLAS and torch threads")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="element type")
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=None,
                        help="N x C x F x H x W x K[gG][dD][sS], padding D * (K // 2) "
                             f"(default: {' '.join(DEFAULT_SHAPES)})")
    parser.add_argument("--sweep", action="store_true",
                        help="time the layers of --networks at each of --batches and the half and quarter "
                             "blocks of their wide 3x3 layers (instead of --shapes), with a summary")
    parser.add_argument("--batches", type=_positive_list, default=SWEEP_BATCHES,
                        help="the sweep's batch sizes, comma-separated (default: "
                             f"{','.join(map(str, SWEEP_BATCHES))})")
    parser.add_argument("--networks", type=_network_list, default=tuple(SWEEP_NETWORKS),
                        help=f"the sweep's networks, comma-separated, of {', '.join(SWEEP_NETWORKS)} (default: all)")
    parser.add_argument("--winograd", choices=("off", "2", "4"), default=None,
                        help="3x3 stride-1 layers by im2col (off) or Winograd F(2x2) / F(4x4) in "
                             "every dtype (default: cfp's, Winograd in float32 where it pays, each layer at "
                             "its cheaper tile, and im2col in float64)")
    parser.add_argument("--device", choices=backend.DEVICES, default="cpu",
                        help="cpu (NumPy, torch on the CPU) or gpu (CuPy, torch on CUDA with cuDNN)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    int_options(args, positive=("repeats", "threads"))
    if args.sweep and args.shapes:
        parser.error("--sweep and --shapes choose the shapes both: give one of them")
    return args


def _positive_list(text):
    try:
        return positive_ints(text, "the list")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, e.g. 1,8,32, got "
                                         f"{text!r}") from None


def _network_list(text):
    names = tuple(text.split(","))
    unknown = [n for n in names if n not in SWEEP_NETWORKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected networks of {', '.join(SWEEP_NETWORKS)} separated by commas, "
                                         f"got {text!r}")
    return names


def main(argv=None):
    args = parse_args(argv)
    if args.json:
        check_writable(args.json, "--json")
    if args.sweep:
        shapes = sweep_shapes(args.batches, args.networks)
    else:
        shapes = [(shape, {}) for shape in args.shapes or [parse_shape(s) for s in DEFAULT_SHAPES]]

    switch = {}
    if args.winograd is not None:
        switch["winograd"] = args.winograd != "off"
        if args.winograd != "off":
            switch["winograd_tile"] = int(args.winograd)
    with settings.configured(**switch):
        return run(args, shapes)


def run(args, shapes):
    chosen = settings.current()
    m = chosen.winograd_tile
    tile = f"Winograd F({m}x{m}, 3x3)" if m else "Winograd F(2x2) or F(4x4), 3x3 (each layer's cheaper)"
    path = {True: tile, False: "im2col"}.get(chosen.winograd, f"{tile} in float32, im2col in float64")
    threads = set_blas_threads(args.threads)
    from mpi4py import MPI
    xp, where = backend.use_device(args.device, MPI.COMM_SELF)
    if torch is not None:
        torch.set_num_threads(threads)
        if xp is not np and not torch.cuda.is_available():
            raise ValueError("--device gpu compares against PyTorch on CUDA, which this torch build lacks "
                             f"(torch {torch.__version__}); install a CUDA build or uninstall torch")
    blas = blas_description()
    context = {
        "threads": threads,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "numpy": np.__version__,
        "blas": blas,
        "torch": torch.__version__ if torch is not None else None,
        "cpu": cpu_name(),
        "3x3 path": path,
        "device": where,
    }
    print(f"# cfp local conv kernels: threads={threads}, dtype={args.dtype}, median of {args.repeats} "
          f"after 1 warm-up, cfp's and torch's calls of a pass in turns, stride 1, 3x3 layers by {path}")
    print(f"# numpy {np.__version__}, BLAS: {blas}; torch {context['torch'] or 'not installed'}; "
          f"CPU: {context['cpu']}" + (f"; GPU {where['index']}: {where['name']} (CuPy {xp.__version__})"
                                       if xp is not np else ""))
    print()
    rng = np.random.default_rng(0)
    rows = []
    for shape, place in shapes:
        rows.append(dict(bench_shape(shape, np.dtype(args.dtype), args.repeats, rng, xp), where=place))
        if args.sweep:
            print(f"# {len(rows)}/{len(shapes)} {rows[-1]['shape']}", file=sys.stderr, flush=True)
    print(markdown_table(rows))
    if args.sweep and torch is not None:
        print()
        print("\n".join(sweep_summary(rows)))
    if args.sweep:
        blocks = block_table(rows)
        if blocks:
            print()
            print(blocks)
    if args.json:
        save_json(args.json, {"context": context, "rows": rows})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
