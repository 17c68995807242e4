"""Run one distributed convolution, forward and backward, on global tensors from .npy files.

    mpiexec -n P python -m mpi4py scripts/run_conv.py --input x.npy --weight w.npy \\
        --grad-output dy.npy [--bias b.npy] [--stride S|SH,SW] [--padding P|PH,PW|same|valid] \\
        [--dilation D|DH,DW] [--groups G] [--padding-mode zeros|reflect|replicate|circular] \\
        --algorithm {sample,x,y,w} --grid sample=A,channel=B [--filter-groups p_f] --out result.npz \\
        [--allow-nonfinite] [--device cpu|gpu] [--transposed [--output-padding OP]]

The convolution's options mean what they mean to PyTorch's nn.Conv2d; the weight is
(F, C / groups, Kh, Kw). A 5-D input (N, C, D, H, W) is a volume: nn.Conv3d's meaning, the
weight (F, C / groups, Kd, Kh, Kw), the options an integer or three (depth, rows, columns).
--transposed runs nn.ConvTranspose2d (ConvTranspose3d for a volume) with PyTorch's weight,
(C, F / groups, *K), and writes dw in that orientation too (cfp's layer keeps it as the
convolution's, kernels/conv/ops.py); --output-padding is its output_padding.

Every rank reads the global tensors and takes its block; the results y, dx, dw (and db) are
gathered and written by rank 0 to the .npz file, and the communication ledger is printed. Use
it to check another implementation against cfp, or to watch an algorithm's traffic.
"""
import argparse
import sys
import time

import _requirements  # noqa: F401 (first: says what is missing, outside cfp's environment)
import numpy as np
from mpi4py import MPI

from cfp import backend, cli, comm
from cfp.algorithms import ALGORITHMS, make_conv
from cfp.grid import ProcessGrid
from cfp.checks import alike_on_all_ranks
from cfp.kernels.conv import OPS, PADDING_MODES, to_conv_weight, to_torch_weight
from cfp.io import check_writable, load_array, save_npz
from cfp.report import format_bytes, format_table
from cfp.tensor import DistTensor


def _ints(option, words=(), pairs=True):
    """An argparse type: an integer, 'A,B' or 'A,B,C' (when pairs: per axis of an image or a
    volume), or one of `words`."""
    def parse(text):
        if text in words:
            return text
        parts = text.split(",")
        try:
            values = tuple(int(v) for v in parts)
        except ValueError:
            values = ()
        if len(values) == 1 or pairs and len(values) in (2, 3):
            return values[0] if len(values) == 1 else values
        expected = ("an integer" + (" or one per axis, A,B (A,B,C for a volume)" if pairs else "")
                    + "".join(f" or {w!r}" for w in words))
        raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}")
    parse.__name__ = option.lstrip("-")
    return parse


def parse_args(argv):
    p = cli.ArgumentParser(description=cli.script_description(__doc__))
    p.add_argument("--input", required=True, help="x: (N, C, H, W) .npy, or a volume (N, C, D, H, W)")
    p.add_argument("--weight", required=True,
                   help="w: (F, C / groups, Kh, Kw) .npy ((F, C / groups, Kd, Kh, Kw) for a volume; "
                        "with --transposed PyTorch's (C, F / groups, ...))")
    p.add_argument("--grad-output", required=True, help="dy: (N, F, Ho, Wo) .npy (N, F, Do, Ho, Wo) for a volume")
    p.add_argument("--bias", help="b: (F,) .npy (optional)")
    p.add_argument("--stride", type=_ints("--stride"), default=1,
                   help="stride: S for rows and columns, or SH,SW")
    p.add_argument("--padding", type=_ints("--padding", words=("same", "valid")), default=0,
                   help="padding on each side: P, PH,PW, same (the output as large as the input, stride 1) "
                        "or valid (none)")
    p.add_argument("--dilation", type=_ints("--dilation"), default=1, help="dilation: D or DH,DW")
    p.add_argument("--groups", type=_ints("--groups", pairs=False), default=1,
                   help="groups: C and F in G groups convolved apart (G = C: depthwise)")
    p.add_argument("--padding-mode", default="zeros", metavar=cli.one_of(PADDING_MODES), help="the padding's values")
    p.add_argument("--transposed", action="store_true",
                   help="a transposed convolution (nn.ConvTranspose2d / ConvTranspose3d), zero padding only")
    p.add_argument("--output-padding", type=_ints("--output-padding"), default=0,
                   help="the transposed convolution's output_padding (smaller than the stride or the dilation)")
    p.add_argument("--algorithm", required=True, metavar=cli.one_of(ALGORITHMS), help="the algorithm")
    p.add_argument("--grid", required=True, help="e.g. sample=2,channel=2")
    p.add_argument("--filter-groups", type=int, help="p_f of algorithm w (dividing P_c)")
    p.add_argument("--threads", type=int, help="BLAS threads per rank (default cores // ranks per node)")
    p.add_argument("--device", default="cpu", metavar=cli.one_of(backend.DEVICES),
                   help="cpu (NumPy) or gpu (CuPy: one GPU per rank, node-local rank modulo the GPUs)")
    p.add_argument("--out", required=True, help="result .npz (written by rank 0)")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="convolve inputs that hold NaN or infinity (refused otherwise)")
    return p.parse_args(argv)


def load_problem(args):
    """The global tensors, checked against each other; ValueError naming what is wrong."""
    x = load_array(args.input, "input")
    w = load_array(args.weight, "weight")
    dy = load_array(args.grad_output, "grad-output")
    b = load_array(args.bias, "bias") if args.bias else None
    named = [("input", x), ("weight", w), ("grad-output", dy)] + ([("bias", b)] if b is not None else [])
    for name, a in named:
        if a.dtype not in (np.float32, np.float64):
            raise ValueError(f"{name} has dtype {a.dtype}; expected float32 or float64")
    dtypes = {name: a.dtype for name, a in named}
    if len(set(dtypes.values())) > 1:
        raise ValueError(f"the tensors must share one dtype, got {dtypes}")
    if not args.allow_nonfinite:
        for name, a in named:
            bad = int(a.size - np.count_nonzero(np.isfinite(a)))
            if bad:
                raise ValueError(f"{name} holds {bad} NaN or infinite value(s); pass --allow-nonfinite "
                                 f"to convolve them anyway")
    if x.ndim not in (4, 5) or w.ndim != x.ndim:
        raise ValueError(f"input must be (N, C, H, W) and weight (F, C, Kh, Kw), or a volume (N, C, D, H, W) and "
                         f"(F, C, Kd, Kh, Kw); got shapes {x.shape} and {w.shape}")
    op = kind(args, x)
    if op.transposed:
        groups = args.groups if isinstance(args.groups, int) and args.groups >= 1 and w.shape[0] % args.groups == 0 \
            else None
        if groups is None:
            raise ValueError(f"--groups {args.groups} must divide the weight's first dimension {w.shape[0]} "
                             f"(the input channels of PyTorch's transposed weight (C, F / groups, ...))")
        w = to_conv_weight(w, groups).copy()
    y_shape = op.output_shape(x.shape, w.shape, **options(args))
    if dy.shape != y_shape:
        raise ValueError(f"grad-output has shape {dy.shape}; the convolution's output has shape {y_shape}")
    if b is not None and b.shape != (w.shape[0],):
        raise ValueError(f"bias has shape {b.shape}; expected ({w.shape[0]},) for F={w.shape[0]}")
    return x, w, b, dy


def kind(args, x):
    """The ConvOp of the command line: a volume or an image, transposed or not."""
    return OPS[("conv_transpose" if args.transposed else "conv") + ("3d" if x.ndim == 5 else "2d")]


def options(args):
    """The convolution's keyword arguments from the command line (a transposed one's with its
    output_padding and no padding mode, which it must leave at zeros)."""
    out = {"stride": args.stride, "padding": args.padding, "dilation": args.dilation, "groups": args.groups}
    if args.transposed:
        if args.padding_mode != "zeros":
            raise ValueError(f"--padding-mode {args.padding_mode}: a transposed convolution pads with zeros only")
        return {**out, "output_padding": args.output_padding}
    if args.output_padding != 0:
        raise ValueError(f"--output-padding {args.output_padding} applies to --transposed only")
    return {**out, "padding_mode": args.padding_mode}


def ledger_table(ledger, world):
    """Bytes per collective and phase: this rank's, and the max and sum over all ranks."""
    mine = ledger.totals(by=("phase", "collective"))
    everyone = world.gather(mine, root=0)
    if world.Get_rank() != 0:
        return None
    keys = sorted({k for t in everyone for k in t})
    rows = [("phase", "collective", "calls", "rank 0 sent", "rank 0 received", "max sent/rank",
             "total sent")]
    for key in keys:
        per_rank = [t.get(key, {"calls": 0, "bytes_sent": 0, "bytes_received": 0}) for t in everyone]
        rows.append((key[0], key[1], str(per_rank[0]["calls"]),
                     format_bytes(per_rank[0]["bytes_sent"]), format_bytes(per_rank[0]["bytes_received"]),
                     format_bytes(max(t["bytes_sent"] for t in per_rank)),
                     format_bytes(sum(t["bytes_sent"] for t in per_rank))))
    return format_table(rows)


def main(argv=None):
    args = parse_args(argv)
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    # Every rank reads the same files and arguments, so these checks fail alike everywhere.
    alike_on_all_ranks(world, lambda: check_writable(args.out, "--out"))
    backend.set_blas_threads(args.threads)
    xp, where = backend.use_device(args.device, world)
    x, w, b, dy = load_problem(args)
    grid = ProcessGrid(args.grid)
    op = kind(args, x)
    conv = make_conv(args.algorithm, grid, x.shape[1], w.shape[0], w.shape[2:],
                     filter_groups=args.filter_groups, bias=b is not None, layer="conv", op=op.name, **options(args))

    x_local = backend.from_host(DistTensor.from_global(x, conv.input_layout, grid).local, xp)
    dy_local = backend.from_host(DistTensor.from_global(dy, conv.output_layout, grid).local, xp)
    w_shard = backend.from_host(conv.shard_weight(w), xp)
    b_shard = backend.from_host(conv.shard_bias(b), xp) if b is not None else None

    ledger = comm.CommLedger()
    with comm.use_ledger(ledger):
        start = time.perf_counter()
        y_local = conv.forward(x_local, w_shard, b_shard)
        middle = time.perf_counter()
        dx_local, dw, db = conv.backward(dy_local)
        end = time.perf_counter()

    results = {
        "y": DistTensor(y_local, dy.shape, conv.output_layout, grid).gather(root=0),
        "dx": DistTensor(dx_local, x.shape, conv.input_layout, grid).gather(root=0),
        "dw": conv.weight_tensor(dw).gather(root=0),
    }
    if b is not None:
        results["db"] = conv.bias_tensor(db).gather(root=0)
    results = {k: backend.to_host(v) for k, v in results.items()}
    if op.transposed and rank == 0:  # dw in the orientation of the weight file (PyTorch's)
        results["dw"] = np.ascontiguousarray(to_torch_weight(results["dw"], args.groups))
    table = ledger_table(ledger, world)
    if rank == 0:
        save_npz(args.out, **results)
        print(f"{conv!r}, {world.Get_size()} ranks, dtype {x.dtype}"
              + (f", on GPUs ({where['messages']})" if where["device"] == "gpu" else ""))
        print(f"forward {middle - start:.4f} s, backward {end - middle:.4f} s (rank 0)")
        print(f"wrote {', '.join(results)} to {args.out}")
        print("communication (the gathers of the results are not counted):")
        print(table)
    grid.free()
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
