"""How cfp's scripts start and stop under mpiexec: one way to fail, said once, never lost.

A script's `main(argv)` raises ValueError for bad input (options, files, a diverged run) and
returns an exit status otherwise; `sys.exit(cli.run(main))` runs it on every rank. On the way
out every rank reports its outcome on a communicator kept for this alone (docs/design.md,
section 8):

- all ranks arrive (the usual case: the checks fail alike everywhere, or all succeed): rank 0
  prints one line `script.py: error: <what>` (and, indented, what other ranks said that
  differs), a barrier makes sure it is out, and every rank finalises MPI and exits with the
  same status. Nobody calls MPI_Abort, so no rank can kill rank 0 before its message is out.
- a failing rank whose peers never arrive within `CFP_FAILURE_WAIT` seconds (default 10; they
  wait in a collective for it) prints its own message, naming its rank, and aborts the job.

Exit statuses: 2 for bad input and diverged runs, 130 for Ctrl-C (one line, plus what the
script adds, e.g. where the last checkpoint is), 1 for an unexpected exception (its traceback,
printed once). argparse's messages and --help are printed by rank 0 only.

Also the flags every rank agrees on (`max_over_ranks`, `on_every_rank`) and `CtrlC`, which
takes Ctrl-C or SIGTERM at a step boundary on all ranks together (cfp/train.py's loop).
"""
import argparse
import difflib
import os
import signal
import sys
import threading
import time
import traceback

import numpy as np
from mpi4py import MPI

USAGE_ERROR = 2
INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
UNEXPECTED = 1


class UsageError(ValueError):
    """A bad command line (argparse's complaint), reported like any other bad input."""


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default, except where there is none to show."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse for scripts that run on many ranks: its errors raise UsageError (so they take
    the same way out as every other error) and its help is printed by rank 0 alone. An option
    is taken only as written (no abbreviations: `--epoch` is not `--epochs`), and one it does
    not know gets the nearest of its options as a hint ("did you mean --epochs?")."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise UsageError(f"{message}{self._hint(message)} (see {self.prog} --help)")

    def _hint(self, message):
        """'; did you mean --x?' for each unknown option of an 'unrecognized arguments' message
        that is close to one of this parser's options (difflib), else ''."""
        if not message.startswith("unrecognized arguments:"):
            return ""
        known = [s for s in self._option_string_actions if s.startswith("--")]
        unknown = [w.split("=", 1)[0] for w in message.split(":", 1)[1].split() if w.startswith("--")]
        hints = []
        for option in unknown:
            close = difflib.get_close_matches(option, known, n=1, cutoff=0.6)
            if close:
                hints.append(f"did you mean {close[0]}?" if len(unknown) == 1 else f"did you mean {close[0]} for {option}?")
        return "; " + "; ".join(hints) if hints else ""

    def _print_message(self, message, file=None):
        if MPI.COMM_WORLD.Get_rank() == 0:
            super()._print_message(message, file)


def one_of(names):
    """The metavar that shows an option's choices in --help, '{a,b,c}', where the script checks
    the value itself (with its own message naming it) rather than by argparse's choices."""
    return "{" + ",".join(str(n) for n in names) + "}"


def script_description(doc):
    """The first paragraph of a script's docstring, as one line: its --help description
    (the first line alone may stop mid-sentence)."""
    return " ".join(doc.strip().split("\n\n")[0].split())


ABORT_GRACE = 0.5  # seconds between a failing rank's last line and its abort of the job


def failure_wait():
    """Seconds a failing rank waits for the others to report before it aborts the job."""
    try:
        return max(0.0, float(os.environ.get("CFP_FAILURE_WAIT", "10")))
    except ValueError:
        return 10.0


def _outcome(main, argv):
    """(status, message) of running main(argv) on this rank; message is None on success."""
    try:
        status = main(argv)
        return (0 if status is None else int(status)), None
    except KeyboardInterrupt as e:
        detail = str(e)
        return INTERRUPTED, "interrupted" + (f": {detail}" if detail else "")
    except ValueError as e:
        return USAGE_ERROR, f"error: {e}{_launch_hint(e)}"
    except SystemExit as e:  # a script that exits by itself keeps its status
        if e.code in (None, 0):
            return 0, None
        if isinstance(e.code, int):
            return e.code, None
        return USAGE_ERROR, f"error: {e.code}"
    except Exception:  # noqa: BLE001 - a bug: show where, once
        return UNEXPECTED, "error: unexpected failure (a bug in cfp)\n" + traceback.format_exc().rstrip()


def _launch_hint(error):
    """How to start the ranks a grid needs, when a job of one rank was given a larger grid
    (the script was run without mpiexec, or with -n 1)."""
    needed = getattr(error, "ranks_needed", None)
    if needed is None or MPI.COMM_WORLD.Get_size() != 1:
        return ""
    script = sys.argv[0] if sys.argv and sys.argv[0] else "SCRIPT"  # as the user typed it
    return f"; run it on {needed} ranks: mpiexec -n {needed} python -m mpi4py {script} ..."


def _wait(request, seconds):
    """True when the non-blocking `request` completed within `seconds` (None: no limit)."""
    deadline = None if seconds is None else time.monotonic() + seconds
    while not request.Test():
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def _closing_lines(name, messages):
    """The lines rank 0 prints: the first failing rank's message, then, indented, what other
    ranks said that differs from it (each distinct message once, with its ranks). None when no
    rank has a message (a script that exited with a status of its own says nothing more)."""
    distinct = {}
    for rank, message in enumerate(messages):
        if message is not None:
            distinct.setdefault(message, []).append(rank)
    if not distinct:
        return []
    first, *others = distinct.items()
    lines = [f"{name}: {first[0]}"]
    for message, ranks in others:
        lines.append(f"  rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} said: {message}")
    return lines


def run(main, argv=None, name=None):
    """Run `main(argv)` on every rank of COMM_WORLD and return the exit status all ranks agree
    on (0 when every rank succeeded). Call it as `sys.exit(cli.run(main))`."""
    name = name or os.path.basename(sys.argv[0]) or "cfp"
    world = MPI.COMM_WORLD
    outcomes = world.Dup()  # used by nothing else, so no other collective can be in its way
    status, message = _outcome(main, argv)
    mine = np.array([status], dtype=np.int64)
    worst = np.zeros(1, dtype=np.int64)
    request = outcomes.Iallreduce(mine, worst, op=MPI.MAX)
    # A rank that succeeded waits as long as it takes (rank 0 may still be writing its files);
    # a failing one only as long as the others can take to fail the same way.
    if not _wait(request, None if message is None and status == 0 else failure_wait()):
        where = f" (rank {world.Get_rank()} of {world.Get_size()}; the other ranks did not report " \
                f"within {failure_wait():g} s, so the job is aborted)"
        sys.stdout.flush()
        print(f"{name}: {message or f'exit status {status}'}{where}", file=sys.stderr, flush=True)
        # The launcher forwards the line from a pipe that it stops reading once the abort
        # reaches it: give it time to read the line first (without it, 5 in 100 aborts with
        # collectives in flight lost the line at 4 ranks under MPICH's Hydra).
        time.sleep(ABORT_GRACE)
        world.Abort(status or UNEXPECTED)
    if worst[0] == 0:
        outcomes.Free()
        return 0
    messages = outcomes.gather(message, root=0)  # text, so the pickling form is the right one
    if world.Get_rank() == 0:
        sys.stdout.flush()
        for line in _closing_lines(name, messages):
            print(line, file=sys.stderr)
        sys.stderr.flush()
    outcomes.Barrier()  # rank 0's lines are out before any rank leaves
    outcomes.Free()
    MPI.Finalize()  # a clean end: `python -m mpi4py` then exits with the status, no MPI_Abort
    return int(worst[0])


# ---------------------------------------------------------------------------------------------
# Flags every rank agrees on, and Ctrl-C taken by all ranks at the same step


def max_over_ranks(comm, value):
    """The largest of every rank's integer `value` (collective over comm)."""
    out = np.zeros(1, dtype=np.int64)
    comm.Allreduce(np.array([value], dtype=np.int64), out, op=MPI.MAX)
    return int(out[0])


def on_every_rank(comm, flag):
    """True on every rank when `flag` is true on every rank (collective over comm)."""
    everyone = np.zeros(1, dtype=np.int64)
    comm.Allreduce(np.array([bool(flag)], dtype=np.int64), everyone, op=MPI.MIN)
    return bool(everyone[0])


class CtrlC:
    """Ctrl-C (SIGINT) or SIGTERM during training, taken at a step boundary by all ranks together.

    MPICH's mpiexec passes SIGINT to every rank; Open MPI's answers it by sending the ranks
    SIGTERM (then SIGKILL after a few seconds), as batch schedulers do before a job's time runs
    out. A rank blocked inside a collective cannot raise until the collective returns, which it
    never does once another rank has left it. So the first signal only sets a flag; at the start
    of every step the ranks OR their flags (one small allreduce) and, when any is set, all raise
    KeyboardInterrupt at the same step. A second signal acts at once, as usual."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested = False
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handler) for s in self.SIGNALS}
        return self

    def _handler(self, signum, frame):
        self.requested = True
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)

    def __exit__(self, *exc):
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        return False

    def check(self, comm):
        """Raise KeyboardInterrupt on every rank of comm when any has seen Ctrl-C (collective)."""
        if max_over_ranks(comm, int(self.requested)):
            raise KeyboardInterrupt
