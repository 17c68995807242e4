"""Measure the constants of the cost model on this machine and save them as a machine profile.

    mpiexec -n 2 python -m mpi4py scripts/calibrate.py --out machine-profile.json [--quick]
        [--threads 1] [--repeats 5]

What it measures is cfp.calibration's (docs/design.md section 4): collectives (allgather,
reduce-scatter, allreduce, all-to-all through cfp.comm on messages of 4 KiB to 16 MiB: their
local packing on one rank, then alpha and beta over groups of neighbouring ranks, fitted by
least squares: those inside a node give the link inside a node, those spanning nodes the link
between them), every kernel path of the kernel table for each pass over the shapes that move
its rate, and the layers between convolutions, on every rank at once, at --threads BLAS
threads. The ranks of a node are those sharing its memory (MPI's shared-memory split), R on
each node, neighbours in rank order (mpiexec's block placement; ranks_per_node = R in the
profile). Across nodes, e.g. on the emulated cluster: `python scripts/cluster.py run
--ranks-per-node 2 -- python -m mpi4py scripts/calibrate.py --out cluster.json`. `--algorithm auto`
without --profile calibrates by itself (quick) and caches the result; this script writes a
profile to keep, share or compare.
"""
import sys

import _requirements  # noqa: F401 (first: says what is missing, outside cfp's environment)
from mpi4py import MPI

from cfp import calibration, cli
from cfp.checks import alike_on_all_ranks, positive_int
from cfp.io import check_writable, save_json


def parse_args(argv):
    p = cli.ArgumentParser(description=cli.script_description(__doc__))
    p.add_argument("--out", required=True, help="the machine profile (JSON) to write")
    p.add_argument("--name", help="the profile's name (default: this host and the rank count)")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions of each measurement")
    p.add_argument("--threads", type=int, default=1, help="BLAS threads per rank, as the runs to plan will use")
    p.add_argument("--quick", action="store_true", help="fewer shapes and messages (seconds, what auto does)")
    args = p.parse_args(argv)
    positive_int(args.repeats, "--repeats")
    positive_int(args.threads, "--threads")
    return args


def main(argv=None):
    args = parse_args(argv)
    world = MPI.COMM_WORLD
    alike_on_all_ranks(world, lambda: check_writable(args.out, "--out"))
    profile = calibration.calibrate(world, quick=args.quick, repeats=args.repeats, threads=args.threads,
                                    name=args.name)
    if world.Get_rank() == 0:
        save_json(args.out, profile)
        print(f"wrote {args.out} ({profile['source']})")
        for link, table in profile["links"].items():
            for name, (alpha, beta) in table.items():
                print(f"  {link:5s} {name:15s} alpha {alpha * 1e6:8.2f} us   beta {beta * 1e9:7.3f} ns/byte "
                      f"({1 / beta / 1e9 if beta else float('inf'):.2f} GB/s)   packing "
                      f"{profile['packing'][name] * 1e9:.3f} ns/byte")
        for link, table in profile["collective_times"].items():
            for name, points in table.items():
                print(f"  {link:5s} {name:15s} measured " + ", ".join(
                    f"{m / 1024:g} KiB on {p}: {t * 1e6:.0f} us" for p, m, t in points))
        for name, per_path in profile["kernels"].items():
            rates = ", ".join(f"{path} {min(p[2] for p in pts) / 1e9:.0f}-{max(p[2] for p in pts) / 1e9:.0f}"
                              for path, pts in sorted(per_path.items()))
            print(f"  {name:15s} GF/s {rates}")
        print("  layers          " + ", ".join(f"{kind} {fixed * 1e6:.0f} us + {per * 1e9:.2f} ns/element"
                                               for kind, (fixed, per) in profile["layers"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
