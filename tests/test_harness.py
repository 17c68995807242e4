"""The test harness itself: a failing assertion on one rank inside a collective must make the
MPI run fail in bounded time instead of hanging; extra pytest arguments reach pytest in the form
the README gives (`make test PYTEST_ARGS="-k comm -x"`)."""
import os
import re
import shlex
import subprocess
import sys
import time

import pytest

from run_suite import ROOT, mpiexec, parse_args, single_thread_env

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.timeout(150)
def test_one_failing_rank_does_not_hang_the_run(tmp_path):
    case = os.path.join(HERE, "harness", "one_rank_fails_in_collective.py")
    cmd = mpiexec(2, sys.executable, "-m", "mpi4py", "-m", "pytest", "--with-mpi",
                  "-p", "no:cacheprovider", "-q", "--timeout=10", f"--rootdir={tmp_path}", case)
    start = time.time()
    proc = subprocess.run(cmd, env=single_thread_env(MPIEXEC_TIMEOUT=100), capture_output=True,
                          text=True, timeout=140, cwd=tmp_path)
    elapsed = time.time() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "rank 0 fails before the collective" in output, output
    assert elapsed < 120, f"the run took {elapsed:.0f} s to fail"


def test_arguments_run_suite_does_not_know_go_to_pytest_in_order():
    # The Makefile's command line with PYTEST_ARGS="-k comm -x", and the older form after "--".
    make_line = ["--ranks", "1", "2", "3", "4", "--timeout", "60", "--job-timeout", "600"]
    for pytest_args in (["-k", "comm", "-x"], ["--", "-k", "comm", "-x"]):
        args, passed = parse_args(make_line + pytest_args)
        assert (args.ranks, args.timeout, args.job_timeout, args.no_serial) == ([1, 2, 3, 4], 60, 600, False)
        assert passed == ["-k", "comm", "-x"]
    # A test file right after the rank counts is pytest's, not a rank count; an abbreviation of
    # one of this script's options (--time) is not taken for it, and all after "--" is pytest's.
    args, passed = parse_args(["--ranks", "2", "tests/test_grid.py", "-x", "--timeout", "5", "--tb=short"])
    assert (args.ranks, args.timeout) == ([2], 5)
    assert passed == ["tests/test_grid.py", "-x", "--tb=short"]
    args, passed = parse_args(["--no-serial", "--time", "-k", "not slow", "--", "--ranks", "3"])
    assert (args.ranks, args.no_serial) == ([1, 2, 3, 4], True)
    assert passed == ["--time", "-k", "not slow", "--ranks", "3"]


@pytest.mark.timeout(150)
def test_the_readme_form_of_pytest_args_runs(tmp_path):
    """`make test RANKS=1 PYTEST_ARGS='-k "..." -x'` as make would run it (its command read from
    `make -n`, run by the shell): one serial and one MPI test selected, both pass."""
    selection = "test_parse_grid_spec or test_unknown_phase"  # one serial test, one MPI test
    # Not the variables of a `make test` this test may run under.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    dry = subprocess.run(["make", "-n", "test", "RANKS=1", f"PYTEST_ARGS=-k '{selection}' -x"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env=env)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    lines = [line for line in dry.stdout.splitlines() if "tests/run_suite.py" in line]
    assert len(lines) == 1, dry.stdout
    assert shlex.split(lines[0])[-3:] == ["-k", selection, "-x"], lines[0]
    proc = subprocess.run(lines[0], shell=True, cwd=ROOT, capture_output=True, text=True, timeout=140,
                          env=single_thread_env(CFP_TEST_LOGS=tmp_path / "logs"))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    rows = {m.group(1): (int(m.group(2)), int(m.group(3)))
            for m in re.finditer(r"^(serial|1 rank)\s+(\d+)\s+(\d+)", proc.stdout, re.M)}
    assert rows == {"serial": (1, 0), "1 rank": (1, 0)}, output
    assert os.path.exists(tmp_path / "logs" / "np1" / "rank0.xml")
