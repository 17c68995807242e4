"""The MPI launcher of cfp's own test and demo runs, and what its MPI needs to run them here.

Which launcher: $MPIEXEC when set (`make test MPIEXEC=srun`, or a path), else the mpiexec next
to this Python (the mpich wheel's), else the one on the PATH; $MPIEXEC_FLAGS are added after
it. Which MPI it and mpi4py belong to is read from `<launcher> --version` and from mpi4py's
MPI_Get_library_version (without initialising MPI): MPICH (the wheel or a system one), Open
MPI, or others by name.

What is added, for these runs only (the environment of the child processes; nothing is set
for the user's own runs):
- Open MPI: OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 when running as
  root (containers, CI), which Open MPI otherwise refuses; oversubscription
  (OMPI_MCA_rmaps_base_oversubscribe=1 for its 4.x launcher, PRTE_MCA_rmaps_default_mapping_policy
  =:oversubscribe for 5.x), since the tests start up to 4 ranks on machines with fewer cores,
  and OMPI_MCA_mpi_yield_when_idle=1 so that waiting ranks give their core to the others;
  for 4.x OMPI_MCA_odls_base_sigkill_timeout=0, so that a job whose ranks exit with an error
  ends when they do, not two seconds later.
- MPICH's Hydra needs nothing: it runs as root and oversubscribes by itself.

A launcher of one MPI with an mpi4py of another starts P copies of a one-rank job, each rank
believing it is rank 0: `check_launcher` runs two ranks once and refuses that with a message
saying which MPI each belongs to.

    python tests/launcher.py -n 4 scripts/train.py ...   # what `make demo` runs: python -m mpi4py under it
    python tests/launcher.py --describe                  # which MPI, and what is added
    python tests/launcher.py --verified-row LOG "2 4"     # make test-system-mpi's row of docs/training.md
"""
import dataclasses
import functools
import os
import re
import shlex
import shutil
import subprocess
import sys

OPEN_MPI, MPICH = "Open MPI", "MPICH"


@dataclasses.dataclass(frozen=True)
class Launcher:
    command: tuple  # the launcher and its flags, before `-n P`
    family: str  # of the launcher: 'Open MPI', 'MPICH', 'Slurm', ... or 'unknown'
    version: str
    library: str  # mpi4py's MPI: its family and version, e.g. 'MPICH 5.0.2'
    env: tuple  # (name, value) pairs added to the children's environment

    def argv(self, nprocs, *args):
        """The command line that starts `args` on `nprocs` ranks."""
        return [*self.command, "-n", str(nprocs), *args]

    def describe(self):
        added = ", ".join(f"{k}={v}" for k, v in self.env) or "nothing"
        return (f"launcher {' '.join(self.command)} ({self.family} {self.version}); mpi4py uses {self.library}; "
                f"added for cfp's test and demo runs: {added}")


def _default_command():
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.access(here, os.X_OK) else shutil.which("mpiexec")


def _run(argv, timeout=30):
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        return proc.stdout + proc.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"<{e}>"


def family_of(text):
    """(family, version) of an MPI from what its launcher's --version or its library prints."""
    for family, pattern in ((OPEN_MPI, r"Open ?MPI\)? v?(\d+\.\d+(\.\d+)?)"), (OPEN_MPI, r"OpenRTE\) (\d+\.\d+(\.\d+)?)"),
                            (MPICH, r"MPICH Version:\s*(\S+)"), (MPICH, r"HYDRA build details:\s*Version:\s*(\S+)"),
                            ("Intel MPI", r"Intel\(R\) MPI Library.*?(\d{4}[.\d]*)"), ("Slurm", r"slurm (\S+)"),
                            ("MVAPICH", r"MVAPICH2? Version:\s*(\S+)")):
        m = re.search(pattern, text, re.S)
        if m:
            return family, m.group(1)
    return "unknown", ""


def library_version(python=sys.executable):
    """mpi4py's MPI library, as MPI_Get_library_version says (MPI is not initialised)."""
    code = ("import mpi4py; mpi4py.rc.initialize = False; mpi4py.rc.finalize = False; "
            "from mpi4py import MPI; print(MPI.Get_library_version())")
    return _run([python, "-c", code])


@functools.lru_cache(maxsize=None)
def launcher():
    """The Launcher of this environment (see the module's docstring); cached."""
    command = shlex.split(os.environ.get("MPIEXEC", "")) or [_default_command()]
    if command[0] is None:
        raise SystemExit("no mpiexec found: install an MPI (make test installs the mpich wheel), "
                         "or name one with MPIEXEC=")
    flags = shlex.split(os.environ.get("MPIEXEC_FLAGS", ""))
    family, version = family_of(_run([command[0], "--version"]))
    lib_family, lib_version = family_of(library_version())
    env = []
    if family == OPEN_MPI:
        if os.geteuid() == 0:
            env += [("OMPI_ALLOW_RUN_AS_ROOT", "1"), ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")]
        major = int(version.split(".")[0]) if version[:1].isdigit() else 4
        env += [("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")] if major >= 5 else \
            [("OMPI_MCA_rmaps_base_oversubscribe", "1")]
        env += [("OMPI_MCA_mpi_yield_when_idle", "1")]
        # a job whose ranks exit non-zero (every bad-input test) otherwise ends a second or two
        # after they did: mpiexec waits odls_base_sigkill_timeout (1 s) between its SIGTERM and
        # SIGKILL of each exited rank's daemon. cfp's messages are out before a rank exits
        # (cli.run's barrier); only a test of SIGTERM itself needs the grace back.
        # (Open MPI 4's orted; measured 2.4 s against 0.36 s a failing launch here)
        env += [] if major >= 5 else [("OMPI_MCA_odls_base_sigkill_timeout", "0")]
    return Launcher(tuple(command + flags), family, version, f"{lib_family} {lib_version}".strip(), tuple(env))


def launch_env(base=None):
    """`base` (default os.environ) with what the launcher's MPI needs added."""
    env = dict(os.environ if base is None else base)
    env.update(dict(launcher().env))
    return env


def check_launcher(python=sys.executable, timeout=60):
    """None when the launcher starts two ranks of one job with mpi4py; else the reason, saying
    which MPI the launcher and mpi4py belong to."""
    L = launcher()
    code = ("import sys; from mpi4py import MPI; "
            "sys.stdout.write('<size %d>\\n' % MPI.COMM_WORLD.Get_size()); sys.stdout.flush()")
    env = launch_env()
    env.setdefault("MPIEXEC_TIMEOUT", str(timeout))
    try:
        proc = subprocess.run(L.argv(2, python, "-c", code), capture_output=True, text=True, env=env,
                              timeout=timeout + 10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{' '.join(L.argv(2))} could not start two ranks: {e}"
    sizes = re.findall(r"<size (\d+)>", proc.stdout)
    if proc.returncode == 0 and sizes == ["2", "2"]:
        return None
    mismatch = L.family not in ("unknown", "Slurm") and not L.library.startswith(L.family)
    if sizes and set(sizes) == {"1"} or mismatch:
        return (f"the launcher {L.command[0]} belongs to {L.family} {L.version}, but mpi4py uses {L.library}: "
                f"its ranks would each run alone as rank 0. Use the mpiexec of mpi4py's MPI (MPIEXEC=...), or "
                f"install mpi4py against this one (pip install --no-binary mpi4py mpi4py)")
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
    return f"{' '.join(L.argv(2))} failed to run two ranks (exit {proc.returncode}): " + " | ".join(tail)


def verified_row(log, ranks):
    """The row of docs/training.md's table of verified MPIs for a run of the MPI tests at `ranks` and the demo
    whose JSON log is `log`: MPI, launcher, mpi4py, user, what passed, the date."""
    import datetime
    import getpass
    import json
    import mpi4py
    L = launcher()
    with open(log) as f:
        accuracy = json.load(f)["summary"]["test_accuracy"]
    import importlib.metadata
    tags = importlib.metadata.distribution("mpi4py").read_text("WHEEL") or ""
    built = "binary wheel" if re.search(r"Tag: .*(manylinux|musllinux|macosx|win)", tags) else "built from source"
    user = "root" if os.geteuid() == 0 else f"non-root ({getpass.getuser()})"
    return (f"| {L.library} | {os.path.basename(L.command[0])} ({L.family} {L.version}) | mpi4py {mpi4py.__version__}, "
            f"{built} | {user} | MPI tests at {', '.join(ranks.split())} ranks; demo {100 * accuracy:.1f}% | "
            f"{datetime.date.today().isoformat()} |")


def main(argv):
    if argv[:1] == ["--describe"]:
        print(launcher().describe())
        return 0
    if argv[:1] == ["--verified-row"] and len(argv) == 3:
        print("verified: | MPI | launcher | mpi4py | user | passed | date |")
        print("verified: " + verified_row(argv[1], argv[2]))
        return 0
    if len(argv) < 3 or argv[0] != "-n":
        sys.exit(__doc__)
    problem = check_launcher()
    if problem:
        print(f"launcher.py: error: {problem}", file=sys.stderr)
        return 2
    cmd = launcher().argv(argv[1], sys.executable, "-m", "mpi4py", *argv[2:])
    print(" ".join(shlex.quote(c) for c in cmd), flush=True)
    return subprocess.call(cmd, env=launch_env())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
