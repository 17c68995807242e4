"""Measure the constants of the cost model on this machine and save them as a machine profile.

    mpiexec -n 2 python -m mpi4py scripts/calibrate.py --out machine-profile.json [--quick]

Collectives: allgather, reduce-scatter, allreduce and all-to-all through cfp.comm, on messages
of 4 KiB to 16 MiB: their local packing (seconds per byte, on one rank), then over groups of
2..P neighbouring ranks alpha and beta fitted by least squares to t - packing * m =
steps * alpha + volume * beta (steps and volume as in cfp.perfmodel). Kernels:
forward, backward-data and backward-filter of 1x1, 3x3 and 5x5 convolutions over a range of
sizes at 1 BLAS thread, on rank 0 alone (the others sleep). All ranks are taken to share one
node (ranks_per_node = P).
"""
import datetime
import platform
import sys
import time

import _requirements  # noqa: F401 (first: says what is missing, outside cfp's environment)
import numpy as np
import scipy.optimize
from mpi4py import MPI

from cfp import backend, cli, comm
from cfp.benchtools import on_rank0, quiet_barrier, slowest_median, timed
from cfp.checks import alike_on_all_ranks, positive_int
from cfp.io import check_writable, save_json
from cfp.kernels import (conv2d_backward_data, conv2d_backward_filter, conv2d_flops,
                         conv2d_forward)
from cfp.partition import block_sizes

# The shapes measured per kernel size: output pixels (n H' W', the GEMM rows) times channels
# (C = F), the grid of shape classes the model interpolates in; the largest are left out.
PIXELS = [64, 256, 1024, 4096, 16384]
CHANNELS = {1: [32, 128, 512], 3: [16, 64, 256, 512], 5: [16, 64, 256]}
MAX_FLOPS = 6e9


def kernel_shapes(kernel, quick):
    """(N, C, F, H, W) for each (pixels, channels) class of `kernel` within MAX_FLOPS."""
    shapes = []
    for pixels in (PIXELS[::2] if quick else PIXELS):
        side = 16 if pixels >= 256 else 8
        n = max(1, pixels // (side * side))
        for c in (CHANNELS[kernel][::2] if quick else CHANNELS[kernel]):
            if 2 * n * side * side * c * c * kernel * kernel <= MAX_FLOPS:
                shapes.append((n, c, c, side, side))
    return shapes
MESSAGE_BYTES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]


def parse_args(argv):
    p = cli.ArgumentParser(description=cli.script_description(__doc__))
    p.add_argument("--out", required=True, help="the machine profile (JSON) to write")
    p.add_argument("--name", default=platform.node() or "this machine", help="the profile's name")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions of each measurement")
    p.add_argument("--quick", action="store_true", help="fewer shapes and messages (for tests)")
    args = p.parse_args(argv)
    positive_int(args.repeats, "--repeats")
    return args


def collective_call(name, group, m_bytes):
    """A zero-argument function running collective `name` with a whole result of ~m bytes.

    Allgather, reduce-scatter and all-to-all move activation-like tensors (8 samples, blocks
    along the channel axis, so they pay the packing an NCHW block needs); allreduce moves a
    flat gradient.
    """
    p, r = group.Get_size(), group.Get_rank()
    samples = 8
    channels = max(p, m_bytes // (4 * samples))
    sizes = block_sizes(channels, p)
    full = np.ones((samples, channels), dtype=np.float32)
    mine = np.ones((samples, sizes[r]), dtype=np.float32)
    if name == "allgather":
        return lambda: comm.allgather(group, mine, 1, sizes)
    if name == "reduce_scatter":
        return lambda: comm.reduce_scatter(group, full, 1, sizes)
    if name == "allreduce":
        return lambda: comm.allreduce(group, full.reshape(-1))
    split = block_sizes(samples, p)  # trade the sample split for the channel split
    x = np.ones((samples, sizes[r]), dtype=np.float32)
    return lambda: comm.alltoall(group, x, 0, 1, split, sizes)


def fit_alpha_beta(samples):
    """Non-negative least-squares (alpha, beta) from [(steps, volume bytes, seconds, measured seconds)]
    where `seconds` is what alpha and beta must explain (the measurement less the packing),
    minimising errors relative to the whole measurement (small and large messages alike). The
    weights come from the measurement, not the remainder: a remainder near zero (the packing
    is most of the time) must not outweigh every other sample."""
    a = np.array([[s, v] for s, v, _, _ in samples], dtype=np.float64)
    t = np.array([sec for _, _, sec, _ in samples])
    weights = 1.0 / np.maximum(np.array([total for *_, total in samples]), 1e-9)
    alpha, beta = scipy.optimize.nnls(a * weights[:, None], t * weights)[0]
    return float(alpha), float(beta)


def fit_packing(samples):
    """Seconds per byte of the whole result, through the origin, from [(bytes, seconds)]."""
    m = np.array([b for b, _ in samples], dtype=np.float64)
    t = np.array([sec for _, sec in samples])
    return max(float(np.dot(m, t) / np.dot(m, m)), 0.0)


def calibrate_collectives(world, args):
    """({collective: [alpha, beta]}, {collective: packing s/byte}).

    cfp's collectives pack and unpack NCHW blocks with local copies, which cost time even on
    one rank: that packing is measured on a group of one rank (rank 0 alone), and alpha and
    beta are fitted to what remains of the times over groups of 2..P neighbouring ranks.
    """
    P = world.Get_size()
    names = ("allgather", "reduce_scatter", "allreduce", "alltoall")
    messages = MESSAGE_BYTES[::2] if args.quick else MESSAGE_BYTES
    samples = {name: [] for name in names}
    with comm.use_ledger(comm.CommLedger()):  # calibration traffic stays out of any ledger
        def packing_samples():
            return {name: [(m, slowest_median(MPI.COMM_SELF, lambda: timed(collective_call(name, MPI.COMM_SELF, m)),
                                             args.repeats, 1)["total"]) for m in messages] for name in names}
        packing = {name: fit_packing(s) for name, s in on_rank0(world, packing_samples).items()}
        for p in range(2, P + 1):
            member = world.Get_rank() < p
            group = world.Split(0 if member else MPI.UNDEFINED, world.Get_rank())
            if member:
                for name in names:
                    for m in messages:
                        call = collective_call(name, group, m)
                        seconds = slowest_median(group, lambda: timed(call), args.repeats, 1)["total"]
                        steps, volume = (2 * (p - 1), 2 * (p - 1) / p * m) if name == "allreduce" \
                            else (p - 1, (p - 1) / p * m)
                        samples[name].append((steps, volume, max(seconds - packing[name] * m, 0.0), seconds))
                group.Free()
            quiet_barrier(world)
    fitted = np.array([fit_alpha_beta(samples[name]) if samples[name] else (0.0, 0.0) for name in names])
    world.Bcast(fitted, root=0)  # rank 0's fit, to every rank
    return {name: [float(a), float(b)] for name, (a, b) in zip(names, fitted)}, packing


def check_fits(links, packing, ranks):
    """ValueError when a fit is physically impossible: no ranks to fit on, or a collective whose
    large messages would cost zero seconds per byte (beta and the packing both zero), which is
    what a noisy machine produces. beta = 0 alone is possible: on two ranks the per-byte cost of
    the link and of the packing cannot be told apart, and the packing may carry all of it."""
    if ranks < 2:
        raise ValueError("calibration needs at least 2 ranks to fit the links (mpiexec -n 2 or more)")
    bad = [name for name, (alpha, beta) in links.items() if not beta + packing.get(name, 0.0) > 0]
    if bad:
        raise ValueError(f"the fit of {', '.join(bad)} gives zero seconds per byte, which no link has: "
                         f"the timings were too noisy; rerun on a quiet machine (or with more --repeats)")


def calibrate_kernels(args):
    """{pass: {K: [[flops, output pixels, flop/s], ...]}} measured at 1 BLAS thread."""
    rng = np.random.default_rng(0)
    table = {"forward": {}, "backward-data": {}, "backward-filter": {}}
    for K in CHANNELS:
        for N, C, F, H, W in kernel_shapes(K, args.quick):
            x = rng.standard_normal((N, C, H, W)).astype(np.float32)
            w = rng.standard_normal((F, C, K, K)).astype(np.float32)
            y = conv2d_forward(x, w, None, 1, K // 2)
            flops = conv2d_flops(x.shape, w.shape, 1, K // 2)
            passes = {"forward": lambda: conv2d_forward(x, w, None, 1, K // 2),
                      "backward-data": lambda: conv2d_backward_data(y, w, x.shape, 1, K // 2),
                      "backward-filter": lambda: conv2d_backward_filter(x, y, w.shape, 1, K // 2)}
            for name, call in passes.items():
                seconds = slowest_median(MPI.COMM_SELF, lambda: timed(call), args.repeats, 1)["total"]
                table[name].setdefault(str(K), []).append([float(flops), float(N * H * W), flops / seconds])
    return table


def main(argv=None):
    args = parse_args(argv)
    world = MPI.COMM_WORLD
    if world.Get_size() < 2:
        check_fits({}, {}, world.Get_size())
    alike_on_all_ranks(world, lambda: check_writable(args.out, "--out"))
    backend.set_blas_threads(1)
    start = time.time()
    links, packing = calibrate_collectives(world, args)
    check_fits(links, packing, world.Get_size())  # both are rank 0's: every rank judges alike
    kernels = on_rank0(world, lambda: calibrate_kernels(args))
    if world.Get_rank() == 0:
        profile = {
            "name": args.name, "itemsize": 4, "ranks_per_node": world.Get_size(),
            "source": (f"scripts/calibrate.py on {platform.node()} ({platform.processor() or platform.machine()}), "
                       f"{world.Get_size()} ranks, {datetime.date.today().isoformat()}, "
                       f"{'quick' if args.quick else 'full'} run, {time.time() - start:.0f} s"),
            "links": {"intra": links},
            "packing": packing,
            "kernels": kernels,
        }
        save_json(args.out, profile)
        print(f"wrote {args.out}")
        for name, (alpha, beta) in links.items():
            print(f"  {name:15s} alpha {alpha * 1e6:8.2f} us   beta {beta * 1e9:7.3f} ns/byte "
                  f"({1 / beta / 1e9 if beta else float('inf'):.2f} GB/s)   packing "
                  f"{packing[name] * 1e9:.3f} ns/byte")
        for name, per_k in kernels.items():
            rates = ", ".join(f"{k}x{k}: {min(p[-1] for p in pts) / 1e9:.0f}-{max(p[-1] for p in pts) / 1e9:.0f}"
                              for k, pts in per_k.items())
            print(f"  {name:15s} GF/s {rates}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
