"""Measure the constants of the cost model on this machine and save them as a machine profile.

    mpiexec -n 2 python -m mpi4py scripts/calibrate.py --out machine-profile.json [--quick]

Collectives: allgather, reduce-scatter, allreduce and all-to-all through cfp.comm, over groups
of 2..P neighbouring ranks and messages of 4 KiB to 8 MiB; alpha and beta fitted by least
squares to t = steps * alpha + volume * beta (steps and volume as in cfp.perfmodel). Kernels:
forward, backward-data and backward-filter of 1x1, 3x3 and 5x5 convolutions over a range of
sizes at 1 BLAS thread, on rank 0 alone (the others sleep). All ranks are taken to share one
node (ranks_per_node = P).
"""
import argparse
import datetime
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from cfp import backend, comm  # noqa: E402
from cfp.benchtools import on_rank0, quiet_barrier, slowest_median, timed  # noqa: E402
from cfp.io import save_json  # noqa: E402
from cfp.kernels import (conv2d_backward_data, conv2d_backward_filter, conv2d_flops,  # noqa: E402
                         conv2d_forward)
from cfp.partition import block_sizes  # noqa: E402

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
MESSAGE_BYTES = [4 << 10, 64 << 10, 1 << 20, 8 << 20]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="the machine profile (JSON) to write")
    p.add_argument("--name", default=platform.node() or "this machine")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="fewer shapes and messages (for tests)")
    return p.parse_args(argv)


def collective_call(name, group, m_bytes):
    """A zero-argument function running collective `name` with a whole result of ~m bytes."""
    p, r = group.Get_size(), group.Get_rank()
    count = max(p, m_bytes // 4)
    sizes = block_sizes(count, p)
    full = np.ones(count, dtype=np.float32)
    mine = np.ones(sizes[r], dtype=np.float32)
    if name == "allgather":
        return lambda: comm.allgather(group, mine, 0, sizes)
    if name == "reduce_scatter":
        return lambda: comm.reduce_scatter(group, full, 0, sizes)
    if name == "allreduce":
        return lambda: comm.allreduce(group, full)
    chunks = [np.ones(s, dtype=np.float32) for s in block_sizes(count, p)]  # this rank's share, spread
    per_peer = [c[:len(c) // p] for c in chunks]
    return lambda: comm.alltoallv(group, per_peer, [len(per_peer[r])] * p, np.float32)


def fit_alpha_beta(samples):
    """Least-squares (alpha, beta) >= 0 from [(steps, volume bytes, seconds)]."""
    a = np.array([[s, v] for s, v, _ in samples], dtype=np.float64)
    t = np.array([sec for _, _, sec in samples])
    # Relative errors matter (small and large messages alike): weight each row by 1 / t.
    weights = 1.0 / np.maximum(t, 1e-9)
    solution, *_ = np.linalg.lstsq(a * weights[:, None], t * weights, rcond=None)
    alpha, beta = (max(float(v), 0.0) for v in solution)
    return alpha, beta


def calibrate_collectives(world, args):
    """{collective: [alpha, beta]} fitted over groups of 2..P neighbouring ranks."""
    P = world.Get_size()
    messages = MESSAGE_BYTES[::2] if args.quick else MESSAGE_BYTES
    samples = {name: [] for name in ("allgather", "reduce_scatter", "allreduce", "alltoall")}
    with comm.use_ledger(comm.CommLedger()):  # calibration traffic stays out of any ledger
        for p in range(2, P + 1):
            member = world.Get_rank() < p
            group = world.Split(0 if member else MPI.UNDEFINED, world.Get_rank())
            if member:
                for name in samples:
                    for m in messages:
                        call = collective_call(name, group, m)
                        seconds = slowest_median(group, lambda: timed(call), args.repeats, 1)["total"]
                        steps, volume = (2 * (p - 1), 2 * (p - 1) / p * m) if name == "allreduce" \
                            else (p - 1, (p - 1) / p * m)
                        samples[name].append((steps, volume, seconds))
                group.Free()
            quiet_barrier(world)
    fitted = {name: list(fit_alpha_beta(s)) if s else [0.0, 0.0] for name, s in samples.items()}
    return world.bcast(fitted, root=0)


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
    backend.set_blas_threads(1)
    start = time.time()
    links = calibrate_collectives(world, args) if world.Get_size() > 1 else None
    kernels = on_rank0(world, lambda: calibrate_kernels(args))
    if world.Get_rank() == 0:
        if links is None:  # one rank: no link to measure; keep the profile loadable
            links = {name: [0.0, 0.0] for name in ("allgather", "reduce_scatter", "allreduce", "alltoall")}
        profile = {
            "name": args.name, "itemsize": 4, "ranks_per_node": world.Get_size(),
            "source": (f"scripts/calibrate.py on {platform.node()} ({platform.processor() or platform.machine()}), "
                       f"{world.Get_size()} ranks, {datetime.date.today().isoformat()}, "
                       f"{'quick' if args.quick else 'full'} run, {time.time() - start:.0f} s"),
            "links": {"intra": links},
            "kernels": kernels,
        }
        save_json(args.out, profile)
        print(f"wrote {args.out}")
        for name, (alpha, beta) in links.items():
            print(f"  {name:15s} alpha {alpha * 1e6:8.2f} us   beta {beta * 1e9:7.3f} ns/byte "
                  f"({1 / beta / 1e9 if beta else float('inf'):.2f} GB/s)")
        for name, per_k in kernels.items():
            rates = ", ".join(f"{k}x{k}: {min(p[-1] for p in pts) / 1e9:.0f}-{max(p[-1] for p in pts) / 1e9:.0f}"
                              for k, pts in per_k.items())
            print(f"  {name:15s} GF/s {rates}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
