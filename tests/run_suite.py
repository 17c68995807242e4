"""Run the test suite serially and under mpiexec at several rank counts; one report per count.

    python tests/run_suite.py [--ranks 1 2 3 4] [--timeout 60] [pytest args] [-- pytest args]

Arguments this script does not know go to pytest, in their order (`-k comm -x`, a test file),
as does everything after `--`; that is how `make test PYTEST_ARGS="-k comm -x"` reaches pytest.

Rank 0 of each MPI run prints its pytest report live; the other ranks write theirs to
.test-logs/np{P}/rank{r}.log, shown only when that rank failed. Every rank writes a JUnit XML
file from which the closing summary is made. A hung collective is bounded twice: pytest-timeout
ends the stuck test's process (which makes mpiexec end the job), and MPIEXEC_TIMEOUT ends the
whole run at that rank count. The run fails when any rank fails, or when a rank count's tests
all skipped. A run whose selection holds no test at all (pytest's exit status 5, e.g. `-k
partition` at 1 rank, where only 2-rank tests match) is shown as "no tests selected" and does
not fail; the whole run fails when no run selected any test.
"""
import argparse
import compileall
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

NO_TESTS_COLLECTED = int(pytest.ExitCode.NO_TESTS_COLLECTED)  # 5: the selection holds no test

from launcher import check_launcher, launch_env, launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# CFP_TEST_LOGS: where the reports go (a test that runs this script points it elsewhere)
LOGS = os.environ.get("CFP_TEST_LOGS") or os.path.join(ROOT, ".test-logs")


def mpiexec(nprocs, *args):
    """The command line that starts `args` on `nprocs` ranks with the launcher of these runs
    (tests/launcher.py: $MPIEXEC and $MPIEXEC_FLAGS, or the mpiexec of mpi4py's MPI)."""
    return launcher().argv(nprocs, *args)


def single_thread_env(device=None, **extra):
    """The environment of a test's child processes: one BLAS thread per rank, cfp importable,
    and what the launcher's MPI needs for these runs (launcher.launch_env). device: the device
    tests' runs ("gpu": a real CuPy that sees a GPU; "stand-in": tests/standin's CuPy first on
    the path, so that cfp's own `import cupy` finds it)."""
    env = launch_env()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = "1"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if device is not None:
        env["CFP_DEVICE_TESTS"] = device
        if device == "stand-in":
            env["PYTHONPATH"] = STANDIN + os.pathsep + env["PYTHONPATH"]
    env.update({k: str(v) for k, v in extra.items()})
    return env


# The device tests (tests/test_device.py): cfp on CuPy arrays, run in runs of their own (conftest.py
# leaves them out of the others), on a real GPU where CuPy sees one, else on the stand-in.
DEVICE_TESTS = os.path.join("tests", "test_device.py")
STANDIN = os.path.join(ROOT, "tests", "standin")


def device_kind():
    """"gpu" where a real CuPy imports and sees a GPU here, else "stand-in"."""
    probe = ("import cupy, sys; sys.exit(0 if not getattr(cupy, '__standin__', False) and "
             "cupy.cuda.runtime.getDeviceCount() > 0 else 1)")
    try:
        rc = subprocess.call([sys.executable, "-c", probe], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             timeout=120)
    except subprocess.TimeoutExpired:
        rc = 1
    return "gpu" if rc == 0 else "stand-in"


def split_paths(pytest_args):
    """(the test paths among pytest's arguments, the rest): a path is an argument that names an
    existing file or directory (before any ::test id)."""
    paths = [a for a in pytest_args if not a.startswith("-") and os.path.exists(os.path.join(ROOT, a.split("::")[0]))]
    return paths, [a for a in pytest_args if a not in paths]


def junit_counts(path):
    """{'tests', 'failures', 'errors', 'skipped', 'time'} of a JUnit XML file, or None."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["time"] = float(suite.get("time", 0.0))
    return counts


class _QuietMPIInformation:
    """pytest-mpi closes every rank's report with 20 lines of MPI build information; the suite
    prints the MPI library once instead. Its MPIPlugin writes the block in pytest_terminal_summary,
    which pytest calls after every pytest_sessionfinish implementation has run, and has no hook
    after that one: so it is unregistered at the end of the session (through the plugin manager,
    as it is registered under no name that `-p no:` could block)."""

    def pytest_sessionfinish(self, session):
        from pytest_mpi import MPIPlugin

        manager = session.config.pluginmanager
        for plugin in manager.get_plugins():
            if isinstance(plugin, MPIPlugin):
                manager.unregister(plugin)


def worker(logdir, pytest_args):
    """One rank of an MPI run: pytest with --with-mpi, non-zero ranks logging to a file."""
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    if rank != 0:
        log = os.open(os.path.join(logdir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        sys.stdout = os.fdopen(1, "w", buffering=1)
        sys.stderr = os.fdopen(2, "w", buffering=1)
    junit = os.path.join(logdir, f"rank{rank}.xml")
    if rank == 0:
        print(f"MPI: {MPI.Get_library_version().splitlines()[0].strip()}, {MPI.COMM_WORLD.Get_size()} "
              f"rank(s)", flush=True)
    rc = int(pytest.main(["--with-mpi", "-m", "mpi", f"--junitxml={junit}", *pytest_args],
                         plugins=[_QuietMPIInformation()]))
    with open(os.path.join(logdir, f"rank{rank}.rc"), "w") as f:
        f.write(str(rc))
    sys.stdout.flush()
    # A non-zero exit under `python -m mpi4py` aborts the whole job: wait until every rank has
    # written its report first. (A rank stuck in a test is ended by pytest-timeout instead.)
    MPI.COMM_WORLD.Barrier()
    return rc


def run_serial(pytest_args, timeout, device=None):
    what = "" if device is None else f" ({device})"
    print("=" * 30 + f" serial tests{what} " + "=" * 30, flush=True)
    logdir = os.path.join(LOGS, "serial" if device is None else "serial-device")
    os.makedirs(logdir, exist_ok=True)
    junit = os.path.join(logdir, "rank0.xml")
    start = time.time()
    rc = subprocess.call(
        [sys.executable, "-m", "pytest", "-m", "not mpi", f"--timeout={timeout}",
         f"--junitxml={junit}", *pytest_args],
        cwd=ROOT, env=single_thread_env(device),
    )
    return {"label": "serial" + what, "rc": rc, "counts": junit_counts(junit),
            "wall": time.time() - start, "failed_ranks": [0] if rc not in (0, NO_TESTS_COLLECTED) else []}


def run_mpi(nprocs, pytest_args, timeout, job_timeout, device=None):
    what = "" if device is None else f" ({device})"
    print("=" * 28 + f" MPI tests, {nprocs} rank{'s' if nprocs > 1 else ''}{what} " + "=" * 28, flush=True)
    logdir = os.path.join(LOGS, f"np{nprocs}" + ("" if device is None else "-device"))
    shutil.rmtree(logdir, ignore_errors=True)
    os.makedirs(logdir)
    cmd = mpiexec(nprocs, sys.executable, "-m", "mpi4py", os.path.abspath(__file__),
                  "--worker", logdir, "--", f"--timeout={timeout}", *pytest_args)
    start = time.time()
    rc = subprocess.call(cmd, cwd=ROOT, env=single_thread_env(device, MPIEXEC_TIMEOUT=job_timeout))
    wall = time.time() - start
    failed = []
    for r in range(nprocs):
        try:
            with open(os.path.join(logdir, f"rank{r}.rc")) as f:
                rank_rc = int(f.read().strip() or 1)
        except (OSError, ValueError):
            rank_rc = None  # the rank never finished (killed, aborted or timed out)
        if rank_rc not in (0, NO_TESTS_COLLECTED):
            failed.append(r)
    for r in failed:
        log = os.path.join(logdir, f"rank{r}.log")
        if r != 0 and os.path.exists(log):
            with open(log) as f:
                tail = f.read()[-6000:]
            print(f"----- rank {r} of {nprocs} failed; the end of its log ({log}) -----\n{tail}")
    return {"label": f"{nprocs} rank{'s' if nprocs > 1 else ''}{what}", "rc": rc,
            "counts": junit_counts(os.path.join(logdir, "rank0.xml")), "wall": wall,
            "failed_ranks": failed}


def summarize(results):
    print("\n" + "=" * 27 + " summary per rank count " + "=" * 27)
    header = f"{'run':<20}{'passed':>8}{'failed':>8}{'errors':>8}{'skipped':>9}{'seconds':>9}  status"
    print(header)
    all_ok, selected = True, False
    total = {"passed": 0, "failed": 0, "skipped": 0}
    for res in results:
        c = res["counts"]
        if c is not None and c["tests"] == 0 and res["rc"] in (0, NO_TESTS_COLLECTED) and not res["failed_ranks"]:
            print(f"{res['label']:<20}{0:>8}{0:>8}{0:>8}{0:>9}{res['wall']:>9.1f}  no tests selected")
            continue
        selected = True
        if c is None:
            status = f"no report (exit status {res['rc']})"
            ok = False
            print(f"{res['label']:<20}{'-':>8}{'-':>8}{'-':>8}{'-':>9}{res['wall']:>9.1f}  {status}")
        else:
            passed = c["tests"] - c["failures"] - c["errors"] - c["skipped"]
            ok = res["rc"] == 0 and not res["failed_ranks"] and passed > 0
            if res["failed_ranks"]:
                status = f"FAILED on rank(s) {res['failed_ranks']} (exit status {res['rc']})"
            elif res["rc"] != 0:
                status = f"FAILED (exit status {res['rc']})"
            elif passed == 0:
                status = "FAILED: no test executed"
            else:
                status = "ok"
            total["passed"] += passed
            total["failed"] += c["failures"] + c["errors"]
            total["skipped"] += c["skipped"]
            print(f"{res['label']:<20}{passed:>8}{c['failures']:>8}{c['errors']:>8}"
                  f"{c['skipped']:>9}{res['wall']:>9.1f}  {status}")
        all_ok &= ok
    print(f"{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    if not selected:
        print("FAILED: no test was selected at any rank count; check the -k expression, the markers "
              "and the test paths given to pytest")
    return all_ok and selected


def parse_args(argv):
    """(the options of this script, the pytest arguments) from the command line `argv`.

    Unknown arguments are pytest's and keep their order; so is everything after the first
    `--`. The rank counts after --ranks end at the first argument that is not an integer, so
    `--ranks 2 tests/test_grid.py` runs that file (serially and at 2 ranks)."""
    cut = argv.index("--") if "--" in argv else len(argv)
    ours, after = list(argv[:cut]), list(argv[cut + 1:])
    if "--ranks" in ours:  # argparse's nargs="*" would take a test file as a rank count
        i = ours.index("--ranks")
        j = i + 1
        while j < len(ours) and ours[j].isdigit():
            j += 1
        ours = ours[:i] + ours[j:] + ours[i:j]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                     epilog="Other arguments, and all after --, are passed to pytest.")
    parser.add_argument("--ranks", type=int, nargs="*", default=[1, 2, 3, 4])
    parser.add_argument("--timeout", type=int, default=60, help="seconds per test")
    parser.add_argument("--job-timeout", type=int, default=600, help="seconds per rank count")
    parser.add_argument("--no-serial", action="store_true")
    args, unknown = parser.parse_known_args(ours)
    return args, unknown + after


def compile_package():
    """Byte-compile cfp once, before the suite starts its interpreters. The tests start hundreds
    of them (every rank of every script they run), and where the environment says not to write
    bytecode (PYTHONDONTWRITEBYTECODE=1) each one compiled the whole package from source again:
    about 0.1 s of CPU a process, and test_bad_input.py with test_scripts.py took 169 s against
    133 s with the package compiled. A source edited later is compiled afresh on import, as
    always (its cached file no longer matches it)."""
    compileall.compile_dir(os.path.join(ROOT, "cfp"), quiet=1)


def main():
    if "--worker" in sys.argv:
        i = sys.argv.index("--worker")
        logdir = sys.argv[i + 1]
        rest = sys.argv[i + 2:]
        sys.exit(worker(logdir, rest[1:] if rest[:1] == ["--"] else rest))
    args, pytest_args = parse_args(sys.argv[1:])
    extra = ["-p", "no:cacheprovider", "-q", *pytest_args]
    if args.ranks:
        problem = check_launcher()
        if problem:
            sys.exit(f"run_suite.py: error: {problem}")
        print(launcher().describe(), flush=True)
    compile_package()
    # the device tests run where no path is given or where theirs is; the others unless only it is
    paths, options = split_paths(extra)
    device_paths = [a for a in paths if os.path.normpath(a.split("::")[0]) == DEVICE_TESTS]
    device_extra = (options + (device_paths or [DEVICE_TESTS])) if device_paths or not paths else None
    if paths and len(device_paths) == len(paths):
        extra = None
    elif device_paths:
        extra = [a for a in extra if a not in device_paths]
    device = device_kind() if device_extra is not None else None
    if device is not None:
        print(f"device tests on {'a GPU (CuPy)' if device == 'gpu' else 'the CuPy stand-in (tests/standin)'}",
              flush=True)
    results = []
    for run_extra, kind in ((extra, None), (device_extra, device)):
        if run_extra is None:
            continue
        if not args.no_serial:
            results.append(run_serial(run_extra, args.timeout, kind))
        for n in args.ranks:
            results.append(run_mpi(n, run_extra, args.timeout, args.job_timeout, kind))
    sys.exit(0 if summarize(results) else 1)


if __name__ == "__main__":
    main()
