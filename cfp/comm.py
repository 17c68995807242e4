"""Collectives along one tensor axis, each paired with its adjoint, and the CommLedger.

Every tensor cfp moves between ranks goes through this module, which records each call in the
active `CommLedger` (layer, phase, collective, group size, bytes sent and received, seconds of
transfer and of waiting).

Time: a rank that enters a collective before the others waits for them inside it, and that
wait (the imbalance of the computation before it, not the network) would count as the
collective's time. So each collective of a group of more than one rank is preceded by a
barrier on its communicator: the seconds in the barrier are the rank's `wait_seconds` (for the
slowest rank to arrive, plus the barrier's own latency of a few microseconds), the seconds in
the collective after it its `seconds`, the transfer, which starts with every member present.
The barrier moves no data and the ledger's bytes do not count it.
Bookkeeping messages of a few numbers or words (the agreement checks below, train.py's flags
and statistics, the checkpoint's error exchange, cli's outcome, benchmark timings) use
mpi4py directly and are not recorded: the ledger is what the cost model predicts.

Adjoint pairs (for the inner products summed over the ranks of `comm`):

    allgather      <->  reduce_scatter
    allreduce      <->  allreduce
    broadcast      <->  sum_reduce
    alltoall(a, b) <->  alltoall(b, a)

Blocks along the tensor axis may be uneven or empty: `sizes[r]` is the block length held by
rank r of `comm` (usually `partition.block_sizes(extent, comm.size)`). The channel blocks of an
NCHW tensor with several samples are not contiguous in memory, so blocks travel packed, each in
the tensor's own layout, through the buffer-based (uppercase) mpi4py calls, and are put side
by side (allgather) or cut apart (reduce-scatter) with one copy; results are C-contiguous.

Byte accounting (what the ledger records, and what `cfp.perfmodel` predicts): each element is
counted once where it leaves a rank and once where it arrives, as in the direct algorithm of
each collective, never counting a rank's own block. For a group of p ranks, a result of m bytes
and own block b: allgather sends (p-1) b and receives m - b; reduce-scatter sends m - b and
receives (p-1) b; allreduce is a reduce-scatter followed by an allgather of the flattened array
in balanced blocks (2 (p-1)/p m each way when p divides it); broadcast: the root sends (p-1) m,
the others receive m; sum_reduce is the mirror; alltoall counts the blocks for other ranks.

Agreement: ranks that pass blocks of different shapes or dtypes would make MPI read past a
buffer or, worse, return garbage. Outside a layer (no `tag(layer=...)`) and outside
`inputs_checked()`, each collective first checks across its group, with one small allgather
that the ledger does not count, that the ranks' blocks fit together, and raises the same
ValueError on every rank when they do not. A layer checks its inputs where they enter
(tensor.check_blocks) and its collectives then work on what it derived from them.
"""
import collections
import contextlib
import dataclasses
import math
import threading
import time

import numpy as np
from mpi4py import MPI

from . import backend
from .partition import block_sizes
from .report import format_bytes, format_table

PHASES = ("forward", "backward-data", "backward-filter", "gradient-sync", "halo", "redistribute", "other")


@dataclasses.dataclass(frozen=True)
class CommRecord:
    layer: str
    phase: str
    collective: str
    group_size: int
    bytes_sent: int
    bytes_received: int
    seconds: float  # in the MPI call, after every member arrived (the transfer)
    wait_seconds: float = 0.0  # waiting for the group's last member to arrive
    pack_seconds: float = 0.0  # local copies around the MPI call (staging, packing, summing)
    # A non-blocking collective's (Pending): time.perf_counter() when it was started and when
    # it was waited for; `seconds` is then its starting call and `wait_seconds` its wait()
    started: float = None
    waited: float = None
    # bytes copied between device and host around the call (device arrays on an MPI that
    # cannot read them: backend.to_host / from_host of the MPI buffers only); 0 on NumPy
    staged_to_host: int = 0
    staged_to_device: int = 0


class CommLedger:
    """The collectives one rank took part in, tagged with layer and phase.

    keep_results=True also keeps a copy of what each collective returned (`results`, one per
    record; an all-to-all's is what tensor.move assembles from it): what cfp.explain's trace
    shows a rank holds after each step. For small tensors only."""

    def __init__(self, keep_results=False):
        self.records = []
        self.results = [] if keep_results else None
        self.layer = "-"
        self.phase = "other"

    @contextlib.contextmanager
    def tag(self, layer=None, phase=None):
        """Within the block, record collectives under `layer` and/or `phase`."""
        saved = self.layer, self.phase
        if layer is not None:
            self.layer = str(layer)
        if phase is not None:
            if phase not in PHASES:
                raise ValueError(f"unknown phase {phase!r}; expected one of {', '.join(PHASES)}")
            self.phase = phase
        try:
            yield self
        finally:
            self.layer, self.phase = saved

    def record(self, collective, group_size, bytes_sent, bytes_received, seconds, result=None, wait_seconds=0.0,
               pack_seconds=0.0, where=None, started=None, waited=None, staged=(0, 0)):
        """Append a record, under the current layer and phase or those of `where` (a (layer,
        phase) pair: a non-blocking collective's, tagged where it was started)."""
        layer, phase = where or (self.layer, self.phase)
        self.records.append(
            CommRecord(layer, phase, collective, int(group_size),
                       int(bytes_sent), int(bytes_received), float(seconds), float(wait_seconds),
                       float(pack_seconds), started, waited, int(staged[0]), int(staged[1]))
        )
        if self.results is not None:
            self.results.append(None if result is None else np.array(backend.to_host(result)))

    def keep_result(self, result):
        """The result of the last collective, when the caller assembles it (tensor.move)."""
        if self.results is not None:
            self.results[-1] = np.array(backend.to_host(result))

    def reset(self):
        self.records.clear()
        if self.results is not None:
            self.results.clear()

    def totals(self, by=("layer", "phase", "collective")):
        """{key tuple: {'calls', 'bytes_sent', 'bytes_received', 'seconds', 'wait_seconds',
        'pack_seconds'}} grouped by `by`, in the order each key first occurs."""
        out = {}
        for r in self.records:
            key = tuple(getattr(r, field) for field in by)
            t = out.setdefault(key, {"calls": 0, "bytes_sent": 0, "bytes_received": 0, "seconds": 0.0,
                                     "wait_seconds": 0.0, "pack_seconds": 0.0, "staged_to_host": 0,
                                     "staged_to_device": 0})
            t["calls"] += 1
            t["bytes_sent"] += r.bytes_sent
            t["bytes_received"] += r.bytes_received
            t["seconds"] += r.seconds
            t["wait_seconds"] += r.wait_seconds
            t["pack_seconds"] += r.pack_seconds
            t["staged_to_host"] += r.staged_to_host
            t["staged_to_device"] += r.staged_to_device
        return out

    def overlap(self, by=("phase",)):
        """{key: {'bytes', 'seconds', 'exposed_seconds', 'hidden'}} grouped by `by`: the bytes
        moved (sent and received), the time communicating (a blocking call: its transfer; a
        non-blocking one: from its start to its completion, while the rank went on computing),
        the part of it the rank spent blocked (a blocking call's transfer; a started one's
        starting call and its wait()), and the fraction hidden behind computation, 1 - exposed
        / communicating (0 where nothing was started early). Waiting for a group's last member
        is the computation's imbalance, not communication, and counts in neither."""
        out = {}
        for r in self.records:
            key = tuple(getattr(r, field) for field in by)
            t = out.setdefault(key, {"bytes": 0, "seconds": 0.0, "exposed_seconds": 0.0})
            t["bytes"] += r.bytes_sent + r.bytes_received
            if r.started is None:
                t["seconds"] += r.seconds
                t["exposed_seconds"] += r.seconds
            else:
                t["seconds"] += max(r.waited - r.started, r.seconds) + r.wait_seconds
                t["exposed_seconds"] += r.seconds + r.wait_seconds
        for t in out.values():
            t["hidden"] = 1.0 - t["exposed_seconds"] / t["seconds"] if t["seconds"] > 0 else 0.0
        return out

    def overlap_summary(self, by=("phase",)):
        """overlap(by) as a plain-text table, with a total row."""
        totals = self.overlap(by)
        rows = [list(by) + ["moved", "communicating s", "exposed s", "hidden"]]
        for key, t in totals.items():
            rows.append(list(key) + [format_bytes(t["bytes"]), f"{t['seconds']:.4f}", f"{t['exposed_seconds']:.4f}",
                                     f"{100 * t['hidden']:.0f}%"])
        seconds = sum(t["seconds"] for t in totals.values())
        exposed = sum(t["exposed_seconds"] for t in totals.values())
        rows.append(["total"] + [""] * (len(by) - 1) + [
            format_bytes(sum(t["bytes"] for t in totals.values())), f"{seconds:.4f}", f"{exposed:.4f}",
            f"{100 * (1 - exposed / seconds) if seconds > 0 else 0:.0f}%"])
        return format_table(rows)

    def summary(self, by=("layer", "phase", "collective"), top=None):
        """A plain-text table of `totals(by)`: transfer, waiting and packing seconds apart. With
        `top`, the `top` rows of most transfer time, a line for the rest, and the total."""
        totals = list(self.totals(by).items())
        shown = totals if top is None else sorted(totals, key=lambda kv: -kv[1]["seconds"])[:top]
        # device arrays staged through the host: a column of the bytes copied each way
        staged = any(t["staged_to_host"] or t["staged_to_device"] for _, t in totals)
        rows = [list(by) + ["calls", "sent", "received", "transfer s", "wait s", "pack s"]
                + (["staged (to host / to device)"] if staged else [])]
        for key, t in shown:
            rows.append(list(key) + _total_cells([t], staged))
        if top is not None:
            rest = [kv for kv in totals if kv not in shown]
            blank = [""] * (len(by) - 1)
            if rest:
                rows.append([f"({len(rest)} more row{'s' if len(rest) > 1 else ''})"] + blank
                            + _total_cells([t for _, t in rest], staged))
            rows.append(["total"] + blank + _total_cells([t for _, t in totals], staged))
        return format_table(rows)


def _total_cells(totals, staged=False):
    """The calls, bytes and seconds of a summary row adding up `totals` (and the staged bytes)."""
    cells = [str(sum(t["calls"] for t in totals)), format_bytes(sum(t["bytes_sent"] for t in totals)),
             format_bytes(sum(t["bytes_received"] for t in totals)), f"{sum(t['seconds'] for t in totals):.4f}",
             f"{sum(t['wait_seconds'] for t in totals):.4f}", f"{sum(t['pack_seconds'] for t in totals):.4f}"]
    if staged:
        cells.append(f"{format_bytes(sum(t['staged_to_host'] for t in totals))} / "
                     f"{format_bytes(sum(t['staged_to_device'] for t in totals))}")
    return cells


_ledgers = [CommLedger()]


def get_ledger():
    """The ledger collectives are recorded in now."""
    return _ledgers[-1]


@contextlib.contextmanager
def use_ledger(ledger):
    """Record into `ledger` within the block."""
    _ledgers.append(ledger)
    try:
        yield ledger
    finally:
        _ledgers.pop()


def tag(layer=None, phase=None):
    """Shorthand for `get_ledger().tag(layer, phase)`."""
    return get_ledger().tag(layer, phase)


_trusted = [0]


@contextlib.contextmanager
def inputs_checked():
    """Within the block, collectives and tensor.check_blocks trust their caller: whoever entered
    it has checked the tensors the computation starts from (train_step checks the batch once),
    and what is derived from them is consistent by construction. Every rank enters it on the
    same code path, so the ranks agree on whether to check."""
    _trusted[0] += 1
    try:
        yield
    finally:
        _trusted[0] -= 1


def checking(layer_trusted=True):
    """True where inputs are checked across ranks: outside inputs_checked() and (for the
    collectives, layer_trusted) outside a layer's tag."""
    return not _trusted[0] and not (layer_trusted and get_ledger().layer != "-")


MAX_NDIM = 8


def gather_shapes(comm, x):
    """Every rank's (ndim, dtype number, shape...) as rows of an int64 array (one allgather,
    not recorded in the ledger): what the agreement checks compare."""
    shape = tuple(x.shape)
    if len(shape) > MAX_NDIM:
        raise ValueError(f"tensors of more than {MAX_NDIM} dimensions are not supported, got shape {shape}")
    mine = np.full(2 + MAX_NDIM, -1, dtype=np.int64)
    mine[0], mine[1] = len(shape), np.dtype(x.dtype).num
    mine[2:2 + len(shape)] = shape
    every = np.empty((comm.Get_size(), mine.size), dtype=np.int64)
    comm.Allgather(mine, every)
    return every


def dtype_name(num):
    """The name of the dtype whose number (np.dtype.num) is `num`."""
    for scalar in set(np.sctypeDict.values()):
        if np.dtype(scalar).num == num:
            return np.dtype(scalar).name
    return f"dtype #{num}"


def describe_shapes(every):
    """'rank 0: (2, 3) float64; rank 1: ...' from gather_shapes' rows."""
    return "; ".join(f"rank {r}: {tuple(int(n) for n in row[2:2 + row[0]])} {dtype_name(row[1])}"
                     for r, row in enumerate(every))


def _agree(comm, x, collective, free_axis=None):
    """ValueError on every rank of `comm` unless all ranks pass arrays of one dtype and number
    of dimensions, equal in every dimension but `free_axis` (whose blocks the caller checked).
    Returns the seconds it took: the check waits for the group, and that time is the
    collective's waiting (_Timer.agree)."""
    if comm.Get_size() == 1 or not checking():
        return 0.0
    start = time.perf_counter()
    every = gather_shapes(comm, x)
    compared = every.copy()
    if free_axis is not None:
        compared[:, 2 + free_axis] = 0
    if (compared == compared[0]).all():
        return time.perf_counter() - start
    along = "" if free_axis is None else f" (except along axis {free_axis})"
    raise ValueError(f"{collective}: the ranks' arrays differ in dtype or shape{along}, so they cannot "
                     f"be combined: {describe_shapes(every)}")


# ---------------------------------------------------------------------------------------------
# helpers


def _check_sizes(comm, sizes):
    sizes = [int(s) for s in sizes]
    if len(sizes) != comm.Get_size():
        raise ValueError(f"{len(sizes)} block sizes given for a group of {comm.Get_size()} ranks")
    if any(s < 0 for s in sizes):
        raise ValueError(f"block sizes must be non-negative, got {sizes}")
    return sizes


def _block_counts(shape, axis, sizes):
    """Elements of each rank's block: `shape` with extent sizes[r] along `axis`."""
    inner = math.prod(int(n) for n in shape[:axis]) * math.prod(int(n) for n in shape[axis + 1:])
    return np.array(sizes, dtype=np.int64) * inner


def _displacements(counts):
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)


class _Timer:
    """The seconds of one collective call on `comm`, counted from where the call starts:
    `wait_seconds` in the agreement check (`agree`) and in a barrier before the transfer (for
    the group's last member; none on one rank or without a communicator), `seconds` in the MPI
    call (the `with` block), and `pack_seconds` the rest up to `record`: the local copies
    around the call (host staging, packing, summing the received blocks)."""

    def __init__(self, comm=None):
        self.comm = comm
        self.started = time.perf_counter()
        self.wait_seconds = 0.0
        self.seconds = 0.0
        self.staged = [0, 0]  # bytes to the host, to the device

    def buffer(self, x):
        """x as a C-contiguous buffer MPI reads (backend.mpi_buffer): on the device where MPI
        takes device buffers, else on the host, a device array then copied (staged, counted)."""
        out = backend.mpi_buffer(x)
        if backend.is_device_array(x) and not backend.is_device_array(out):
            self.staged[0] += out.nbytes
        return out

    def result(self, buf, xp):
        """An MPI buffer as an array of `xp`: itself where it is one (NumPy, or device buffers),
        else a device copy of the host buffer (staged, counted)."""
        if xp is np or backend.is_device_array(buf):
            return buf
        self.staged[1] += buf.nbytes
        return backend.from_host(buf, xp)

    def agree(self, x, collective, free_axis=None):
        self.wait_seconds += _agree(self.comm, x, collective, free_axis)

    def __enter__(self):
        if self.comm is not None and self.comm.Get_size() > 1:
            arrived = time.perf_counter()
            self.comm.Barrier()
            self.wait_seconds += time.perf_counter() - arrived
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds += time.perf_counter() - self.start

    def record(self, collective, group_size, bytes_sent, bytes_received, result=None):
        """The call's record in the active ledger."""
        pack = max(time.perf_counter() - self.started - self.wait_seconds - self.seconds, 0.0)
        get_ledger().record(collective, group_size, bytes_sent, bytes_received, self.seconds, result,
                            self.wait_seconds, pack, staged=self.staged)


_BLOCK_TYPES = collections.OrderedDict()  # (shape, axis, sizes, dtype) -> (types, offsets)
_BLOCK_TYPES_KEPT = 256  # the layouts a model's layers use, each kept from call to call


def _block_types(shape, axis, sizes, dtype):
    """(MPI datatypes, byte displacements) of each rank's block of the C-contiguous tensor of
    `shape` split along `axis` in blocks of `sizes`, as the block lies in the tensor: one run
    of sizes[r] * inner elements per index before `axis`, a whole row of the tensor apart. MPI
    reads and writes the blocks where they lie, so no block is packed or unpacked by a copy
    (the channel blocks of an NCHW tensor with several samples interleave in memory). The
    datatypes are made and committed once per layout and kept (the least recently used
    freed beyond _BLOCK_TYPES_KEPT): making, committing and freeing them at every call was a
    third of a small collective's Python (an 8x4096 float32 allgather's 44 us, hot)."""
    key = (tuple(int(n) for n in shape), int(axis), tuple(int(n) for n in sizes), np.dtype(dtype).str)
    kept = _BLOCK_TYPES.get(key)
    if kept is not None:
        _BLOCK_TYPES.move_to_end(key)
        return kept
    shape, sizes = key[0], key[2]
    outer, inner = math.prod(shape[:axis]), math.prod(shape[axis + 1:])
    item = np.dtype(dtype).itemsize
    base = MPI.Datatype.fromcode(np.dtype(dtype).char)
    types = [base.Create_vector(outer, n * inner, shape[axis] * inner).Commit() for n in sizes]
    offsets = [sum(sizes[:r]) * inner * item for r in range(len(sizes))]
    _BLOCK_TYPES[key] = kept = (types, offsets)
    if len(_BLOCK_TYPES) > _BLOCK_TYPES_KEPT:
        for t in _BLOCK_TYPES.popitem(last=False)[1][0]:
            t.Free()
    return kept


def _contiguous(dtype, p):
    """The datatype of a contiguous block, for each of p ranks."""
    return [MPI.Datatype.fromcode(np.dtype(dtype).char)] * p


# ---------------------------------------------------------------------------------------------
# allgather <-> reduce_scatter


def _blocking(t, comm, collective, setup, run):
    """A blocking collective from its setup's (done, plan): the one-rank (result, kept), or the
    exchange (buffers, finish, (bytes sent, received)) that run(*buffers) carries out in one
    MPI call; recorded in the ledger (kept: what a ledger keeping results keeps)."""
    done, plan = setup
    if done:
        result, kept = plan
        t.record(collective, 1, 0, 0, kept)
        return result
    buffers, finish, (sent, received) = plan
    with t:
        run(*buffers)
    result, kept = finish()
    t.record(collective, comm.Get_size(), sent, received, kept)
    return result


def _started(t, comm, collective, setup, start):
    """The same collective started by start(*buffers) (an MPI I-call): a Pending."""
    done, plan = setup
    if done:
        return Pending(t, collective, 1, (0, 0), None, lambda: plan)
    buffers, finish, moved = plan
    return Pending(t, collective, comm.Get_size(), moved, lambda: start(*buffers), finish)


def _allgather_setup(comm, x, axis, sizes, may_alias, t):
    """What allgather and iallgather share: the checks, and either the one-rank result
    (True, (result, kept)) or the exchange (False, ((send, recv) of one Alltoallw, finish,
    (bytes sent, received))), for _blocking and _started. Each rank's block is sent as it
    lies and received straight into its place in the result (_block_types), by every rank
    (itself too): an all-to-all whose send side is the same block for every destination."""
    sizes = _check_sizes(comm, sizes)
    rank, p = comm.Get_rank(), comm.Get_size()
    axis = axis % x.ndim
    if x.shape[axis] != sizes[rank]:
        raise ValueError(
            f"allgather: rank {rank} holds {x.shape[axis]} entries along axis {axis}, "
            f"the block sizes say {sizes[rank]}"
        )
    t.agree(x, "allgather", free_axis=axis)
    if p == 1:
        out = _alone(x, donate=may_alias)
        return True, (out, out)
    xp = backend.get_array_module(x)
    mine = t.buffer(x)
    counts = _block_counts(mine.shape, axis, sizes)
    out = backend.get_array_module(mine).empty(mine.shape[:axis] + (sum(sizes),) + mine.shape[axis + 1:], dtype=mine.dtype)
    types, offsets = _block_types(out.shape, axis, sizes, out.dtype)
    send = [mine, ([mine.size] * p, [0] * p), _contiguous(mine.dtype, p)]
    recv = [out, ([int(n > 0) for n in sizes], offsets), types]
    item = mine.dtype.itemsize
    moved = ((p - 1) * counts[rank] * item, (counts.sum() - counts[rank]) * item)
    return False, ((send, recv), lambda: (t.result(out, xp), out), moved)


def allgather(comm, x, axis, sizes, may_alias=False):
    """Concatenate the blocks of all ranks along `axis`.

    x: this rank's block, x.shape[axis] == sizes[rank]. Returns the whole tensor, of extent
    sum(sizes) along `axis`, on every rank (C-contiguous, a new array). may_alias=True: neither
    x nor the result is written while the other is in use (a layer's input and what it keeps
    of it), and on a group of one rank the result is x itself instead of a copy. Adjoint:
    `reduce_scatter(comm, dy, axis, sizes)`.
    """
    t = _Timer(comm)
    return _blocking(t, comm, "allgather", _allgather_setup(comm, x, axis, sizes, may_alias, t), comm.Alltoallw)


def iallgather(comm, x, axis, sizes, may_alias=False):
    """allgather, started: a Pending whose wait() returns what allgather returns."""
    t = _Timer(comm)
    return _started(t, comm, "allgather", _allgather_setup(comm, x, axis, sizes, may_alias, t), comm.Ialltoallw)


def _reduce_scatter_setup(comm, x, axis, sizes, donate, t):
    """What reduce_scatter and ireduce_scatter share (as _allgather_setup). Each rank sends
    every other rank that rank's block of its summand, read where it lies (_block_types), and
    receives its own block from each of the others, side by side in rank order (source s in
    slot s, or s - 1 past this rank); their sum with its own summand is the result (the direct
    algorithm the ledger counts)."""
    sizes = _check_sizes(comm, sizes)
    rank, p = comm.Get_rank(), comm.Get_size()
    axis = axis % x.ndim
    if x.shape[axis] != sum(sizes):
        raise ValueError(
            f"reduce_scatter: axis {axis} has extent {x.shape[axis]}, the block sizes "
            f"{sizes} add up to {sum(sizes)}"
        )
    t.agree(x, "reduce_scatter")
    if p == 1:
        out = _alone(x, donate)
        return True, (out, out)
    xp = backend.get_array_module(x)
    host = t.buffer(x)  # (on the device where MPI takes device buffers)
    bx = backend.get_array_module(host)
    counts, item = _block_counts(host.shape, axis, sizes), host.dtype.itemsize
    shape = host.shape[:axis] + (sizes[rank],) + host.shape[axis + 1:]
    received = bx.empty((p - 1,) + shape, dtype=host.dtype)
    block = received[0].nbytes
    types, offsets = _block_types(host.shape, axis, sizes, host.dtype)
    send = [host, ([int(d != rank and sizes[d] > 0) for d in range(p)], offsets), types]
    recv = [received, ([0 if s == rank else int(counts[rank]) for s in range(p)],
                       [(s - (s > rank)) * block for s in range(p)]), _contiguous(host.dtype, p)]

    def finish():
        start = int(np.sum(sizes[:rank]))
        own = host[(slice(None),) * axis + (slice(start, start + sizes[rank]),)]
        # With two ranks the one received block is exactly the result's memory: sum into it.
        out = bx.add(own, received[0], out=received[0] if p == 2 else None)
        for summand in received[1:]:
            out += summand
        return t.result(out, xp), out
    moved = ((counts.sum() - counts[rank]) * item, (p - 1) * counts[rank] * item)
    return False, ((send, recv), finish, moved)


def reduce_scatter(comm, x, axis, sizes, donate=False):
    """Sum `x` over the ranks and keep this rank's block along `axis`.

    x: the whole extent, x.shape[axis] == sum(sizes), a different summand on each rank.
    Returns the sum's block `rank`, of extent sizes[rank] (C-contiguous). donate=True: the
    caller does not use x afterwards, and on a group of one rank the result is x itself
    instead of a copy. Adjoint: `allgather`.
    """
    t = _Timer(comm)
    return _blocking(t, comm, "reduce_scatter", _reduce_scatter_setup(comm, x, axis, sizes, donate, t),
                     comm.Alltoallw)


def ireduce_scatter(comm, x, axis, sizes, donate=False):
    """reduce_scatter, started: a Pending whose wait() returns what reduce_scatter returns
    (x must not be written before then)."""
    t = _Timer(comm)
    return _started(t, comm, "reduce_scatter", _reduce_scatter_setup(comm, x, axis, sizes, donate, t),
                    comm.Ialltoallw)


# The started collectives not yet waited for. MPI writes into their buffers until they complete:
# a caller that drops one unwaited (an exception on its way up, while the other ranks still
# take part) must not free that memory, or MPI writes into freed memory the next time it makes
# progress (a segfault, and the rank's message lost). They stay here until waited for; a job
# that fails with some outstanding ends with its message, and the memory goes with the process.
_in_flight = set()


class Pending:
    """A collective started by iallreduce, iallgather, ireduce_scatter or ialltoallv and not
    yet completed: its buffers are MPI's until wait(). test() lets MPI progress it (most
    transports move data only inside MPI calls) and says whether it is done; wait() completes
    it and returns what the blocking collective returns, the same numbers, and records it in
    the ledger under the layer and phase it was started in: its bytes as the blocking call's,
    `seconds` in the call that started it, `wait_seconds` in wait() (no barrier before it:
    one would end the overlap), `pack_seconds` the local work before the start and after the
    wait, `started` and `waited` the times it was started and waited for. Waiting twice
    returns the same result."""

    _UNSET = object()

    def __init__(self, timer, collective, group_size, moved, start, finish):
        ledger = get_ledger()
        self._ledger, self._where, self._timer = ledger, (ledger.layer, ledger.phase), timer
        self._collective, self._group_size, self._moved, self._finish = collective, group_size, moved, finish
        self.started = time.perf_counter()
        self._setup = self.started - timer.started  # staging and checks before the start
        self._agree = timer.wait_seconds  # the agreement check's wait, where inputs are checked
        self._request = start() if start is not None else None
        self._seconds = time.perf_counter() - self.started
        self._result = Pending._UNSET
        self._lock = threading.Lock()  # one thread at a time in MPI on its request (progress_thread)
        if self._request is not None:
            _in_flight.add(self)  # its buffers stay alive until it completes, whoever drops it

    def test(self):
        """Whether the collective has completed (progressing it)."""
        if self._request is None or self._result is not Pending._UNSET:
            return True
        with self._lock:
            return bool(self._request.Test())

    def _progress(self):
        """progress_thread's test: skipped while another thread is in MPI on this request."""
        if self._lock.acquire(blocking=False):
            try:
                if self._result is Pending._UNSET:
                    self._request.Test()
            finally:
                self._lock.release()

    def wait(self):
        if self._result is not Pending._UNSET:
            return self._result
        waited = time.perf_counter()
        if self._request is not None:
            with self._lock:
                self._request.Wait()
            _in_flight.discard(self)
        done = time.perf_counter()
        result, kept = self._finish()
        pack = self._setup + time.perf_counter() - done
        sent, received = self._moved
        self._ledger.record(self._collective, self._group_size, sent, received, self._seconds, kept,
                            self._agree + done - waited, pack, where=self._where, started=self.started,
                            waited=waited, staged=self._timer.staged)
        self._result = result
        return result


PROGRESS_INTERVAL = 1e-3  # seconds between progress_thread's rounds of tests


@contextlib.contextmanager
def progress_thread(interval=PROGRESS_INTERVAL):
    """Within it, a thread tests every collective in flight (Pending) once each `interval`
    seconds, so that transports which move data only inside MPI calls (MPICH's and Open MPI's
    TCP, most shared-memory ones) move a started collective while the main thread computes:
    the kernels release Python's lock for their BLAS calls, and the thread sleeps between
    rounds, so it costs a core only the tests' own work (MPICH's own progress thread spins
    instead). The main thread's test() and wait() and the thread's tests take turns on each
    request; a request the main thread is waiting for is skipped. Needs MPI_THREAD_MULTIPLE
    (mpi4py's default): refused otherwise. Nothing it does changes a result or the ledger. The
    thread it yields counts its rounds (`rounds`), for benchmarks to say how often it ran."""
    if not interval > 0:
        raise ValueError(f"progress_thread interval={interval!r}: expected a positive number of seconds")
    level = MPI.Query_thread()
    if level != MPI.THREAD_MULTIPLE:
        names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled", MPI.THREAD_SERIALIZED: "serialized"}
        raise ValueError(f"a progress thread needs MPI_THREAD_MULTIPLE; this MPI was initialised with thread "
                         f"level {names.get(level, level)!r} (mpi4py.rc.thread_level): expected 'multiple'")
    stop = threading.Event()

    def run():
        while not stop.wait(interval):
            thread.rounds += 1
            for pending in list(_in_flight):
                pending._progress()
    thread = threading.Thread(target=run, name="cfp-progress", daemon=True)
    thread.rounds = 0
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join()


def _alone(x, donate):
    """The result of a sum over a group of one rank: x itself when donated (C-contiguous), a
    copy otherwise."""
    xp = backend.get_array_module(x)
    return xp.ascontiguousarray(x) if donate else xp.array(x, order="C", copy=True)


# ---------------------------------------------------------------------------------------------
# allreduce (self-adjoint)


def _allreduce_setup(comm, x, donate, t):
    """What allreduce and iallreduce share (as _allgather_setup): the checks, the one-rank
    sums, or the buffer and the splitting of the sum into the parts."""
    rank, p = comm.Get_rank(), comm.Get_size()
    parts = list(x) if isinstance(x, (list, tuple)) else [x]
    many = isinstance(x, (list, tuple))
    xp = backend.get_array_module(parts[0])
    if len(parts) > 1:
        kinds = {np.dtype(a.dtype) for a in parts}
        if len(kinds) > 1:
            raise ValueError(f"allreduce: the parts of one message have dtypes {sorted(map(str, kinds))}; "
                             f"expected one")
    if p == 1:  # nothing to sum, nothing to concatenate
        sums = [_alone(a, donate) for a in parts]
        kept = None  # what a ledger that keeps results keeps: the one message, as summed
        if get_ledger().results is not None:
            kept = sums[0] if len(parts) == 1 else xp.concatenate([a.reshape(-1) for a in sums])
        return True, (sums if many else sums[0], kept)
    one = parts[0] if len(parts) == 1 else xp.concatenate([a.reshape(-1) for a in parts])
    t.agree(one, "allreduce")
    n, item = one.size, np.dtype(one.dtype).itemsize
    host = t.buffer(one)
    bx = backend.get_array_module(host)
    # In place where the buffer is not the caller's (a concatenation, a staged or contiguous
    # copy) or the caller gave it up: no fresh result to fault in and no second buffer to read.
    ours = donate or len(parts) > 1 or bx is not xp or not bx.may_share_memory(host, parts[0])
    out = host if ours else bx.empty_like(host)

    def finish():
        total = t.result(out, xp)
        bounds = np.cumsum([a.size for a in parts])[:-1].tolist()  # host integers, for any xp
        sums = [piece.reshape(a.shape) for piece, a in zip(xp.split(total.reshape(-1), bounds), parts)]
        return (sums if many else sums[0]), out
    own = block_sizes(n, p)[rank]
    moved = ((n - own) + (p - 1) * own) * item
    return False, ((MPI.IN_PLACE if ours else host, out), finish, (moved, moved))


def allreduce(comm, x, donate=False):
    """The sum of `x` over the ranks of `comm`, on every rank (same shape as x).

    x: an array, or a list of arrays of one dtype summed as one message (their flattened
    concatenation, the segmented gradient allreduce's weight and bias), whose sums come back
    as a list of arrays of their shapes. Used for the segmented gradient allreduce: `comm` is
    then the group of ranks holding the same weight shard. donate=True: the caller does not use
    x afterwards: on a group of one rank the result is x itself instead of a copy, and on
    several the sum is taken in x's memory (MPI_IN_PLACE), as it always is in a concatenation
    of parts, which is cfp's own. Adjoint: itself.
    """
    t = _Timer(comm)
    return _blocking(t, comm, "allreduce", _allreduce_setup(comm, x, donate, t),
                     lambda send, out: comm.Allreduce(send, out, op=MPI.SUM))


def allreduce_over(comms, x, donate=False):
    """The sum of `x` over the ranks of each of `comms` in turn (the axis communicators of some
    of a grid's axes: the sum over every rank those axes span), one allreduce each; x itself
    where `comms` is empty. donate as allreduce's (the sums between are cfp's own)."""
    for c in comms:
        x = allreduce(c, x, donate=donate)
        donate = True
    return x


def iallreduce(comm, x, donate=False):
    """allreduce, started: a Pending whose wait() returns what allreduce returns (x must not be
    read or written before then). MPI does not promise that a non-blocking sum adds the
    ranks' contributions in the blocking one's order: equal to rounding."""
    t = _Timer(comm)
    return _started(t, comm, "allreduce", _allreduce_setup(comm, x, donate, t),
                    lambda send, out: comm.Iallreduce(send, out, op=MPI.SUM))


# ---------------------------------------------------------------------------------------------
# broadcast <-> sum_reduce


def broadcast(comm, x, root=0):
    """The root's `x` on every rank. Every rank passes an array of the root's shape and dtype
    (its content is ignored off the root). Adjoint: `sum_reduce(comm, dy, root)`."""
    t = _Timer(comm)
    rank, p = comm.Get_rank(), comm.Get_size()
    t.agree(x, "broadcast")
    xp = backend.get_array_module(x)
    out = t.buffer(x)
    if backend.get_array_module(out) is xp:  # not a staged copy: MPI writes it, so not x's memory
        out = xp.array(out, order="C", copy=True)
    if p > 1:
        with t:
            comm.Bcast(out, root=root)
    result = t.result(out, xp)
    m = out.nbytes
    sent, received = ((p - 1) * m, 0) if rank == root else (0, m)
    t.record("broadcast", p, sent, received)
    return result


def sum_reduce(comm, x, root=0):
    """The sum of `x` over the ranks, on the root; zeros of the same shape elsewhere.
    Adjoint: `broadcast(comm, dy, root)`."""
    t = _Timer(comm)
    rank, p = comm.Get_rank(), comm.Get_size()
    t.agree(x, "sum_reduce")
    xp = backend.get_array_module(x)
    host = t.buffer(x)
    out = backend.get_array_module(host).zeros_like(host)
    if p == 1:
        out[...] = host
    else:
        with t:
            comm.Reduce(host, out if rank == root else None, op=MPI.SUM, root=root)
    result = t.result(out, xp)
    m = host.nbytes
    sent, received = (0, (p - 1) * m) if rank == root else (m, 0)
    t.record("sum_reduce", p, sent, received)
    return result


# ---------------------------------------------------------------------------------------------
# all-to-all (adjoint: the same with the axes swapped)


def _alltoallv_setup(comm, send_chunks, recv_counts, dtype, t):
    """What alltoallv and ialltoallv share (as _allgather_setup)."""
    rank, p = comm.Get_rank(), comm.Get_size()
    if len(send_chunks) != p or len(recv_counts) != p:
        raise ValueError(f"alltoallv needs one chunk and one count per rank of a group of {p}")
    send_counts = np.array([c.size for c in send_chunks], dtype=np.int64)
    recv_counts = np.array(recv_counts, dtype=np.int64)
    if p > 1 and checking():
        t.wait_seconds += _agree_counts(comm, send_counts, recv_counts, dtype)
    xp = backend.get_array_module(*send_chunks)
    bounds = np.cumsum(recv_counts)[:-1].tolist()
    if p == 1:
        if send_counts[0] != recv_counts[0]:
            raise ValueError(f"alltoallv: one rank sends itself {send_counts[0]} elements and expects "
                             f"{recv_counts[0]}")
        return True, ([xp.ascontiguousarray(send_chunks[0], dtype=dtype)], None)
    sendbuf = t.buffer(xp.concatenate(send_chunks).astype(dtype, copy=False))
    recvbuf = backend.get_array_module(sendbuf).empty(int(recv_counts.sum()), dtype=dtype)

    def finish():
        return xp.split(t.result(recvbuf, xp), bounds), None
    item = np.dtype(dtype).itemsize
    moved = ((send_counts.sum() - send_counts[rank]) * item, (recv_counts.sum() - recv_counts[rank]) * item)
    send = [sendbuf, (send_counts, _displacements(send_counts))]
    recv = [recvbuf, (recv_counts, _displacements(recv_counts))]
    return False, ((send, recv), finish, moved)


def alltoallv(comm, send_chunks, recv_counts, dtype):
    """Send `send_chunks[d]` (a 1-D array) to rank d; return the chunk from each rank (arrays of
    the chunks' module: device chunks are packed on the device and only the packed send and
    receive buffers are staged).

    recv_counts[s]: the number of elements rank s sends here. The general exchange behind
    `alltoall` and `DistTensor.redistribute`.
    """
    t = _Timer(comm)
    return _blocking(t, comm, "alltoall", _alltoallv_setup(comm, send_chunks, recv_counts, dtype, t),
                     comm.Alltoallv)


def ialltoallv(comm, send_chunks, recv_counts, dtype):
    """alltoallv, started: a Pending whose wait() returns the chunk from each rank."""
    t = _Timer(comm)
    return _started(t, comm, "alltoall", _alltoallv_setup(comm, send_chunks, recv_counts, dtype, t),
                    comm.Ialltoallv)


def _agree_counts(comm, send_counts, recv_counts, dtype):
    """ValueError on every rank unless what each rank sends each other is what that rank
    expects from it, in one dtype (an all-to-all of the counts and one allgather). Returns the
    seconds it took, which are waiting (as _agree's)."""
    start = time.perf_counter()
    arriving = np.empty_like(send_counts)
    comm.Alltoall(send_counts, arriving)
    mine = np.array([np.dtype(dtype).num, int((arriving == recv_counts).all())], dtype=np.int64)
    every = np.empty((comm.Get_size(), 2), dtype=np.int64)
    comm.Allgather(mine, every)
    if len(set(every[:, 0])) > 1:
        raise ValueError("alltoall: the ranks exchange different dtypes: " +
                         ", ".join(f"rank {r} {dtype_name(n)}" for r, n in enumerate(every[:, 0])))
    wrong = [r for r, ok in enumerate(every[:, 1]) if not ok]
    if wrong:
        raise ValueError(f"alltoall: rank(s) {wrong} expect element counts that their peers do not send "
                         f"(the ranks' blocks do not fit together)")
    return time.perf_counter() - start


def alltoall(comm, x, split_axis, concat_axis, split_sizes, concat_sizes):
    """Trade a split along `concat_axis` for a split along `split_axis`.

    x: the whole extent sum(split_sizes) along `split_axis`, this rank's block
    (concat_sizes[rank]) along `concat_axis`. Returns this rank's block split_sizes[rank]
    along `split_axis` and the whole extent sum(concat_sizes) along `concat_axis`.
    Adjoint: `alltoall(comm, y, concat_axis, split_axis, concat_sizes, split_sizes)`.
    """
    split_sizes = _check_sizes(comm, split_sizes)
    concat_sizes = _check_sizes(comm, concat_sizes)
    rank = comm.Get_rank()
    split_axis, concat_axis = split_axis % x.ndim, concat_axis % x.ndim
    if split_axis == concat_axis:
        raise ValueError(f"alltoall: split and concatenation axis are both {split_axis}")
    if x.shape[split_axis] != sum(split_sizes) or x.shape[concat_axis] != concat_sizes[rank]:
        raise ValueError(
            f"alltoall: rank {rank} holds shape {tuple(x.shape)}; expected extent "
            f"{sum(split_sizes)} along axis {split_axis} and {concat_sizes[rank]} along axis {concat_axis}"
        )
    xp = backend.get_array_module(x)
    # Axis order (split, concat, rest...): each destination's block is contiguous, and each
    # received chunk is a contiguous (own split block, source's concat block, rest) array.
    rest = [a for a in range(x.ndim) if a not in (split_axis, concat_axis)]
    order = [split_axis, concat_axis] + rest
    packed = xp.ascontiguousarray(x.transpose(order))
    tail = packed.shape[2:]
    inner = math.prod(tail)
    bounds = np.cumsum(split_sizes)[:-1].tolist()
    send_chunks = [block.reshape(-1) for block in xp.split(packed, bounds, axis=0)]
    recv_counts = [split_sizes[rank] * c * inner for c in concat_sizes]
    chunks = alltoallv(comm, send_chunks, recv_counts, packed.dtype)
    blocks = [c.reshape((split_sizes[rank], n) + tail) for c, n in zip(chunks, concat_sizes)]
    out = xp.concatenate(blocks, axis=1)
    return xp.transpose(out, np.argsort(order).tolist())
