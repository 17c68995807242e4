"""How much of a started allreduce moves behind computation, per way of progressing it: the
question behind --overlap (docs/design.md section 5), asked of this MPI and transport alone.

    mpiexec -n P python -m mpi4py scripts/bench_progress.py [--mib 8] [--gemms 4] \\
        [--gemm 4096,2304,256] [--intervals 1,0.2] [--repeats 7] [--json out.json]

Every rank times (the slowest rank's median over the repeats, milliseconds): its GEMMs alone
(`--gemms` products of M x K by K x N, `--gemm M,K,N`, float32, one BLAS thread; the default
about a wide layer's backward pass each), the blocking allreduce of `--mib` MiB alone, the GEMMs
followed by that allreduce (what --overlap off does), and the allreduce started before the
GEMMs and waited for after them: with no MPI call in between, with a test() after each GEMM
(cfp's calls as layers end: --mpi-progress calls), and under comm.progress_thread at each of
`--intervals` (ms; --mpi-progress thread uses comm.PROGRESS_INTERVAL), with the GEMMs alone
beside that thread too (what its wakeups cost) and how often its rounds came while the
allreduce was in flight. Hidden = (blocking - started) / allreduce: the share of the
allreduce's time the overlap saved.
"""
import sys
import time

import _requirements  # noqa: F401 (first: says what is missing, outside cfp's environment)
import numpy as np
from mpi4py import MPI

from cfp import cli, comm
from cfp.benchtools import prepare, slowest_median
from cfp.checks import finite_number, int_options, positive_ints
from cfp.io import save_json


def parse_args(argv):
    p = cli.ArgumentParser(description=cli.script_description(__doc__))
    p.add_argument("--mib", type=float, default=8.0, help="the allreduce's size, MiB (a gradient bucket's)")
    p.add_argument("--gemms", type=int, default=4, help="GEMMs computed while it moves")
    p.add_argument("--gemm", default="4096,2304,256",
                   help="M,K,N: each GEMM multiplies an M x K matrix by a K x N one (192,192,192: small products, "
                        "whose Python between them leaves a thread room)")
    p.add_argument("--intervals", default="1",
                   help="comma-separated progress-thread intervals to time, milliseconds")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats of each row, of which the median")
    p.add_argument("--json", help="write the rows to this JSON file (rank 0)")
    args = p.parse_args(argv)
    int_options(args, positive=("gemms", "repeats"))
    finite_number(args.mib, "--mib", above=0)
    try:
        args.interval_list = [float(v) for v in args.intervals.split(",")]
    except ValueError:
        raise ValueError(f"--intervals {args.intervals!r}: expected comma-separated milliseconds") from None
    for v in args.interval_list:
        finite_number(v, "--intervals", above=0)
    args.gemm_shape = positive_ints(args.gemm, "--gemm (M,K,N)", count=3)
    return args


def main(argv=None):
    args = parse_args(argv)
    world = MPI.COMM_WORLD
    prepare(world, args.json)
    data = np.ones(int(args.mib * 2 ** 20) // 4, np.float32)
    M, K, N = args.gemm_shape
    a, b = np.ones((M, K), np.float32), np.ones((K, N), np.float32)

    def compute(pending=None):
        for _ in range(args.gemms):
            a @ b
            if pending is not None:
                pending.test()

    def row(work):
        def step():
            start = time.perf_counter()
            work()
            return {"total": time.perf_counter() - start}
        return slowest_median(world, step, args.repeats, 1)["total"]

    def started(tests=False):
        pending = comm.iallreduce(world, data.copy(), donate=True)
        compute(pending if tests else None)
        pending.wait()

    with comm.use_ledger(comm.CommLedger()), comm.inputs_checked():
        rows = {"GEMMs alone": row(compute),
                "allreduce alone": row(lambda: comm.allreduce(world, data.copy(), donate=True)),
                "GEMMs, then the allreduce (blocking)": row(lambda: (compute(), comm.allreduce(world, data.copy(),
                                                                                                donate=True))),
                "allreduce started, GEMMs, wait (no call between)": row(started),
                "allreduce started, GEMMs, wait (a test() after each GEMM)": row(lambda: started(tests=True))}
        rounds = {}
        for ms in args.interval_list:
            with comm.progress_thread(ms * 1e-3) as thread:
                name = f"allreduce started, GEMMs, wait (thread every {ms:g} ms)"
                begin, first = time.perf_counter(), thread.rounds
                rows[name] = row(started)
                # (the rounds counted over the row, between repeats too: the thread's own pace)
                rounds[name] = (time.perf_counter() - begin) / max(1, thread.rounds - first)
                rows[f"GEMMs alone beside the thread every {ms:g} ms"] = row(compute)
    if world.Get_rank() == 0:
        blocking, alone = rows["GEMMs, then the allreduce (blocking)"], rows["allreduce alone"]
        print(f"# {world.Get_size()} ranks, {MPI.Get_library_version().splitlines()[0].strip()}; allreduce of "
              f"{args.mib:g} MiB, {args.gemms} GEMMs; the slowest rank's median of {args.repeats}")
        print("| row | ms | hidden | a thread round every ms |")
        print("|---|---|---|---|")
        for name, seconds in rows.items():
            hidden = f"{(blocking - seconds) / alone:.0%}" if "started" in name and alone > 0 else "-"
            pace = f"{rounds[name] * 1e3:.2f}" if name in rounds else "-"
            print(f"| {name} | {seconds * 1e3:.1f} | {hidden} | {pace} |")
        if args.json:
            save_json(args.json, {"ranks": world.Get_size(), "mib": args.mib, "gemms": args.gemms,
                                  "gemm": list(args.gemm_shape), "rows_ms": {k: v * 1e3 for k, v in rows.items()},
                                  "thread_round_ms": {k: v * 1e3 for k, v in rounds.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
