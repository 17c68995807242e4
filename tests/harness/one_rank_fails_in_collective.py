"""A deliberately broken MPI test file, run only by tests/test_harness.py: rank 0 fails an
assertion while the other ranks wait for it in an allreduce, then waits itself in the next
test's barrier, which the others never reach. The harness must end such a run, not hang."""
import numpy as np
import pytest
from mpi4py import MPI


@pytest.mark.mpi(min_size=2)
def test_rank0_fails_while_others_wait():
    comm = MPI.COMM_WORLD.Dup()
    assert comm.Get_rank() != 0, "rank 0 fails before the collective"
    comm.Allreduce(np.ones(1), np.empty(1))


@pytest.mark.mpi(min_size=2)
def test_next_collective():
    MPI.COMM_WORLD.Barrier()
