"""The test harness itself: a failing assertion on one rank inside a collective must make the
MPI run fail in bounded time instead of hanging; extra pytest arguments reach pytest in the form
the README gives (`make test PYTEST_ARGS="-k comm -x"`); the launcher knows which MPI it and
mpi4py belong to, takes MPIEXEC and MPIEXEC_FLAGS, and refuses a launcher of another MPI."""
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
                  "-p", "no:cacheprovider", "-q", "--timeout=4", f"--rootdir={tmp_path}", case)
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



def _summary(*runs):
    """run_suite.summarize over runs given as (label, rc, tests, failures, skipped, failed ranks)."""
    from run_suite import summarize
    return summarize([{"label": label, "rc": rc, "wall": 1.0, "failed_ranks": failed,
                       "counts": {"tests": tests, "failures": failures, "errors": 0, "skipped": skipped}}
                      for label, rc, tests, failures, skipped, failed in runs])


def test_a_rank_count_that_selects_nothing_is_shown_and_passes(capsys):
    """A selection with no test at some rank count (pytest's exit status 5) is "no tests
    selected" there and passes; the run fails if nothing was selected anywhere, or where a
    rank count's selected tests all skipped or one failed."""
    assert _summary(("serial", 0, 3, 0, 0, []), ("1 rank", 5, 0, 0, 0, []))
    out = capsys.readouterr().out
    assert re.search(r"^1 rank\s+0\s+0\s+0\s+0\s+1\.0\s+no tests selected$", out, re.M), out
    assert not _summary(("serial", 5, 0, 0, 0, []), ("1 rank", 5, 0, 0, 0, []))
    assert "FAILED: no test was selected at any rank count" in capsys.readouterr().out
    assert not _summary(("serial", 0, 3, 0, 0, []), ("2 ranks", 0, 2, 0, 2, []))  # all skipped
    assert "FAILED: no test executed" in capsys.readouterr().out
    assert not _summary(("serial", 0, 3, 0, 0, []), ("2 ranks", 1, 2, 1, 0, [0]))
    assert not _summary(("serial", 5, 0, 0, 0, []), ("2 ranks", 5, 0, 0, 0, [1]))  # a rank did not finish


@pytest.mark.timeout(150)
@pytest.mark.parametrize("selection,passes", [("test_block_sizes", True), ("no_test_has_this_name", False)])
def test_a_selection_empty_at_a_rank_count(tmp_path, selection, passes):
    """`-k test_block_sizes` in test_partition.py selects serial tests only: the 1-rank job
    shows "no tests selected" and the run passes; a selection that matches nothing anywhere
    fails with one clear line."""
    proc = subprocess.run([sys.executable, os.path.join(HERE, "run_suite.py"), "--ranks", "1",
                           os.path.join(HERE, "test_partition.py"), "-k", selection],
                          cwd=ROOT, capture_output=True, text=True, timeout=140,
                          env=single_thread_env(CFP_TEST_LOGS=tmp_path / "logs"))
    output = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == passes, output
    assert re.search(r"^1 rank\s+0\s+0\s+0\s+0\s+[\d.]+\s+no tests selected$", proc.stdout, re.M), output
    assert ("FAILED: no test was selected at any rank count" in proc.stdout) == (not passes), output


# -- the launcher (tests/launcher.py) --------------------------------------------------------

VERSIONS = [
    ("mpiexec (OpenRTE) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/\n", ("Open MPI", "4.1.4")),
    ("mpirun (Open MPI) 5.0.3\n\nReport bugs to https://www.open-mpi.org/community/help/\n", ("Open MPI", "5.0.3")),
    ("Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4, May 26, 2022", ("Open MPI", "4.1.4")),
    ("HYDRA build details:\n    Version:                                 5.0.2\n", ("MPICH", "5.0.2")),
    ("MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25 2026\n", ("MPICH", "5.0.2")),
    ("slurm 23.02.7\n", ("Slurm", "23.02.7")),
    ("something else\n", ("unknown", "")),
]


@pytest.mark.parametrize("text,expected", VERSIONS)
def test_which_mpi_from_what_it_prints(text, expected):
    from launcher import family_of
    assert family_of(text) == expected


def _launcher_with(monkeypatch, **env):
    import launcher
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    launcher.launcher.cache_clear()
    try:
        return launcher.launcher(), launcher
    finally:
        monkeypatch.undo()


def test_mpiexec_and_its_flags_come_from_the_environment(monkeypatch, tmp_path):
    fake = tmp_path / "my-launcher"
    fake.write_text("#!/bin/sh\necho 'mpiexec (OpenRTE) 4.1.4'\n")
    fake.chmod(0o755)
    L, module = _launcher_with(monkeypatch, MPIEXEC=str(fake), MPIEXEC_FLAGS="--bind-to none")
    try:
        assert L.argv(3, "python", "x.py") == [str(fake), "--bind-to", "none", "-n", "3", "python", "x.py"]
        assert (L.family, L.version) == ("Open MPI", "4.1.4")
        env = dict(L.env)
        assert env["OMPI_MCA_rmaps_base_oversubscribe"] == "1"
        assert ("OMPI_ALLOW_RUN_AS_ROOT" in env) == (os.geteuid() == 0)
    finally:
        module.launcher.cache_clear()


def test_a_launcher_of_another_mpi_is_refused_with_both_names(monkeypatch, tmp_path):
    """A launcher that starts the ranks as separate one-rank jobs (what an mpiexec of another
    MPI than mpi4py's does): the probe sees two jobs of size 1 and says so."""
    fake = tmp_path / "other-mpiexec"
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "mpiexec (OpenRTE) 4.1.4"; exit 0; }\n'
                    'n=$2; shift 2\nfor i in $(seq $n); do "$@" & done\nwait\n')
    fake.chmod(0o755)
    L, module = _launcher_with(monkeypatch, MPIEXEC=str(fake))
    try:
        problem = module.check_launcher()
    finally:
        module.launcher.cache_clear()
    assert problem is not None
    assert "belongs to Open MPI 4.1.4, but mpi4py uses" in problem and "each run alone as rank 0" in problem, problem


def test_the_launcher_of_these_runs_starts_two_ranks():
    from launcher import check_launcher
    assert check_launcher() is None
