"""Shared test helpers: the world size, grids over every factorization, collective assertions."""
import atexit
import importlib.util
import os
import re
import shutil
import sys
import tempfile

import numpy as np
from mpi4py import MPI

from cfp.grid import AXES, ProcessGrid, factorizations

WORLD = MPI.COMM_WORLD
SIZE = WORLD.Get_size()

# A profile a test calibrates (--algorithm auto without --profile) is cached in a directory of
# this test process, removed at its end, never in the user's cache (cfp/calibration.py).
if not os.environ.get("CFP_CACHE_DIR"):
    os.environ["CFP_CACHE_DIR"] = tempfile.mkdtemp(prefix="cfp-test-cache-")
    atexit.register(shutil.rmtree, os.environ["CFP_CACHE_DIR"], True)


IMAGE_AXES = ("sample", "height", "width", "channel")  # the grid axes of an image's layers (no depth)


def at_most(cap):
    """The largest count of ranks of at most `cap` that divides the world's."""
    return max(n for n in range(1, min(SIZE, cap) + 1) if SIZE % n == 0)


def at_most_four():
    """The ranks of a test's one split axis where its tensors are small: every rank up to 4;
    at 6 to 16 ranks (make test-scale) the largest count of at most 4 that divides them, so
    that small images, volumes and classifiers leave no rank of that axis without a row, plane
    or filter (the other ranks go beside it: split_grid)."""
    return at_most(4)


def split_grid(axis, cap=4, beside="sample"):
    """A grid of every rank splitting `axis` over at_most(cap) of them and `beside` over the
    rest: 'depth=4' at 4 ranks, 'sample=2,depth=3' at 6; 'sample=6,height=2' for
    split_grid("sample", 8, "height") at 12 (a batch of 8 over at most 8 sample ranks)."""
    n = at_most(cap)
    sizes = {axis: n} if n == SIZE else {axis: n, beside: SIZE // n}
    return ",".join(f"{a}={sizes[a]}" for a in AXES if a in sizes)


def spatial_at_most_four(specs):
    """The specs of `specs` that split no spatial axis (depth, height, width) over more than
    4 ranks: every spec up to 4 ranks; at 6 to 16 the ones whose small volumes and images
    still give every rank of those axes a plane, row and column."""
    return [s for s in specs if all(ProcessGrid.shape_of(s)[a] <= 4 for a in ("depth", "height", "width"))]


def grid_specs(naxes=2, axes=("sample", "channel")):
    """'sample=a,channel=b' for every factorization a * b of the world size."""
    return [",".join(f"{a}={n}" for a, n in zip(axes, f)) for f in factorizations(SIZE, naxes)]


def load_script(name):
    """scripts/NAME.py as a module, for tests that call its functions in-process."""
    scripts = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
    if scripts not in sys.path:  # as when the script runs: its own directory first (scripts/_requirements.py)
        sys.path.insert(0, scripts)
    spec = importlib.util.spec_from_file_location(name, os.path.join(scripts, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rel_err(a, b):
    """max |a - b| / max |b| (absolute error when b is all zero)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        raise AssertionError(f"shapes differ: {a.shape} vs {b.shape}")
    if a.size == 0:
        return 0.0
    scale = float(np.max(np.abs(b)))
    return float(np.max(np.abs(a - b))) / (scale if scale > 0 else 1.0)


def assert_all_ranks(ok, message, comm=WORLD):
    """Fail on every rank when `ok` is false on any, so no rank goes on alone into a collective
    the others never reach (which would hang the run)."""
    flags = comm.allgather(bool(ok))
    if not all(flags):
        bad = [r for r, f in enumerate(flags) if not f]
        raise AssertionError(f"{message} (failed on rank(s) {bad} of {comm.Get_size()})")


def assert_close_all_ranks(actual, expected, tol, what="", comm=WORLD):
    err = rel_err(actual, expected)
    errors = comm.allgather(err)
    worst = max(errors)
    if not worst < tol:
        raise AssertionError(f"{what}: relative error {worst:.3e} >= {tol:.0e} "
                             f"(per rank: {', '.join(f'{e:.1e}' for e in errors)})")


def raises_on_all_ranks(exc_type, func, match=None, comm=WORLD):
    """Call func(); every rank must raise `exc_type` with a message matching `match`.

    The outcomes are compared collectively, so a rank that did not raise fails the test on
    every rank instead of leaving the others waiting. Returns this rank's exception.
    """
    caught = None
    try:
        func()
        outcome = "raised nothing"
    except exc_type as e:
        caught = e
        outcome = None if match is None or re.search(match, str(e)) else (
            f"raised {str(e)!r}, which does not match {match!r}")
    except Exception as e:  # noqa: BLE001 - reported below, on every rank
        outcome = f"raised {type(e).__name__}: {e}"
    outcomes = comm.allgather(outcome)
    bad = {r: o for r, o in enumerate(outcomes) if o is not None}
    if bad:
        raise AssertionError(f"expected {exc_type.__name__} on every rank: " +
                             "; ".join(f"rank {r} {o}" for r, o in bad.items()))
    return caught


def pytest_runtest_logreport(report):
    """Under several ranks, print a failure the moment it happens: a rank that fails while the
    others wait in a collective may never reach pytest's closing report."""
    if report.failed and SIZE > 1:
        sys.stderr.write(f"\n[rank {WORLD.Get_rank()} of {SIZE}] FAILED {report.nodeid} "
                         f"({report.when}):\n{report.longreprtext}\n")
        sys.stderr.flush()


# tests/test_device.py runs only in run_suite.py's device runs (CFP_DEVICE_TESTS names the kind:
# "gpu" on a real CuPy, "stand-in" on tests/standin's), where `import cupy` finds one of them.
collect_ignore = [] if os.environ.get("CFP_DEVICE_TESTS") else ["test_device.py"]
