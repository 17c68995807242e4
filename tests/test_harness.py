"""The test harness itself: a failing assertion on one rank inside a collective must make the
MPI run fail in bounded time instead of hanging."""
import os
import subprocess
import sys
import time

import pytest

from run_suite import mpiexec_path, single_thread_env

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.timeout(150)
def test_one_failing_rank_does_not_hang_the_run(tmp_path):
    launcher = mpiexec_path()
    if launcher is None:
        pytest.fail("no mpiexec: make test installs one (the mpich wheel)")
    case = os.path.join(HERE, "harness", "one_rank_fails_in_collective.py")
    cmd = [launcher, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "pytest", "--with-mpi",
           "-p", "no:cacheprovider", "-q", "--timeout=10", f"--rootdir={tmp_path}", case]
    start = time.time()
    proc = subprocess.run(cmd, env=single_thread_env(MPIEXEC_TIMEOUT=100), capture_output=True,
                          text=True, timeout=140, cwd=tmp_path)
    elapsed = time.time() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "rank 0 fails before the collective" in output, output
    assert elapsed < 120, f"the run took {elapsed:.0f} s to fail"
