"""Timing helpers shared by the scripts/bench_*.py programs."""
import statistics
import time

from mpi4py import MPI


def slowest_median(world, step, repeats, warmup):
    """Median over `repeats` (after `warmup`) of the slowest rank's time for each part.

    step() runs one iteration on every rank of `world` and returns {part: seconds}.
    """
    samples = []
    for i in range(warmup + repeats):
        world.Barrier()
        parts = step()
        slowest = {k: world.allreduce(v, op=MPI.MAX) for k, v in parts.items()}
        if i >= warmup:
            samples.append(slowest)
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def timed(func):
    """{'total': seconds} of one call of func(): a step for slowest_median."""
    start = time.perf_counter()
    func()
    return {"total": time.perf_counter() - start}


def quiet_barrier(world):
    """A barrier that sleeps instead of spinning while it waits, leaving the cores to the
    ranks still working."""
    request = world.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


def on_rank0(world, work):
    """work() on rank 0 alone, its result broadcast to every rank; the others wait in a
    quiet_barrier, so rank 0 has the machine's cores to itself (a one-rank baseline measured
    inside a P-rank job)."""
    result = work() if world.Get_rank() == 0 else None
    quiet_barrier(world)
    return world.bcast(result, root=0)
