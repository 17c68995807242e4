"""Collectives along one tensor axis: values against the global computation, the adjoint
identity <F x, y> = <x, F* y> for every pair, and the ledger's byte accounting."""
import time

import numpy as np
import pytest
from mpi4py import MPI

from cfp import comm as C
from cfp.grid import ProcessGrid
from cfp.partition import block_range, block_sizes
from conftest import WORLD, assert_all_ranks, assert_close_all_ranks, grid_specs

pytestmark = pytest.mark.mpi

# (extent along the split axis, tensor axis): 7 over 3 ranks and 2 over 4 give uneven and
# empty blocks; the shapes put the split axis in front, in the middle and last.
CASES = [(7, 1), (2, 0), (5, 3), (1, 2)]


def make_shape(extent, axis):
    shape = [3, 2, 4, 2]
    shape[axis] = extent
    return tuple(shape)


def inner(a, b):
    """Sum over the world of the local inner products."""
    return WORLD.allreduce(float(np.vdot(a, b)), op=MPI.SUM)


def assert_adjoint(lhs, rhs, what):
    err = abs(lhs - rhs) / max(abs(lhs), abs(rhs), 1e-300)
    assert_all_ranks(err < 1e-12, f"{what}: <Fx, y> = {lhs!r}, <x, F*y> = {rhs!r}, rel err {err:.2e}")


def groups(spec):
    grid = ProcessGrid(spec)
    return grid, [(axis, grid.axis_comm(axis)) for axis in ("sample", "channel")]


@pytest.fixture(params=grid_specs())
def grid_and_groups(request):
    grid, comms = groups(request.param)
    yield comms
    grid.free()


@pytest.mark.parametrize("extent,axis", CASES)
def test_allgather_reduce_scatter(grid_and_groups, extent, axis):
    rng = np.random.default_rng(1000 + WORLD.Get_rank())
    for name, comm in grid_and_groups:
        p, r = comm.Get_size(), comm.Get_rank()
        sizes = block_sizes(extent, p)
        full = make_shape(extent, axis)
        local = list(full)
        local[axis] = sizes[r]
        # Values: gathering the blocks of one global array gives that array.
        glob = np.arange(np.prod(full), dtype=np.float64).reshape(full)
        start, stop = block_range(extent, p, r)
        mine = np.take(glob, range(start, stop), axis=axis)
        assert_close_all_ranks(C.allgather(comm, mine, axis, sizes), glob, 1e-15, f"allgather over {name}")
        summand = rng.standard_normal(full)
        total = comm.allreduce(summand, op=MPI.SUM)
        assert_close_all_ranks(C.reduce_scatter(comm, summand, axis, sizes),
                               np.take(total, range(start, stop), axis=axis), 1e-13,
                               f"reduce_scatter over {name}")
        # Adjoint pair.
        x = rng.standard_normal(local)
        y = rng.standard_normal(full)
        assert_adjoint(inner(C.allgather(comm, x, axis, sizes), y),
                       inner(x, C.reduce_scatter(comm, y, axis, sizes)), f"allgather over {name}")


def test_allreduce(grid_and_groups):
    rng = np.random.default_rng(2000 + WORLD.Get_rank())
    for name, comm in grid_and_groups:
        x = rng.standard_normal((3, 5))
        expected = comm.allreduce(x, op=MPI.SUM)
        assert_close_all_ranks(C.allreduce(comm, x), expected, 1e-13, f"allreduce over {name}")
        y = rng.standard_normal((3, 5))
        assert_adjoint(inner(C.allreduce(comm, x), y), inner(x, C.allreduce(comm, y)), f"allreduce over {name}")


@pytest.mark.parametrize("root_choice", ["first", "last"])
def test_broadcast_sum_reduce(grid_and_groups, root_choice):
    rng = np.random.default_rng(3000 + WORLD.Get_rank())
    for name, comm in grid_and_groups:
        p, r = comm.Get_size(), comm.Get_rank()
        root = 0 if root_choice == "first" else p - 1
        x = rng.standard_normal((4, 3))
        expected = comm.bcast(x, root=root)
        assert_close_all_ranks(C.broadcast(comm, x, root), expected, 1e-300, f"broadcast over {name}")
        y = rng.standard_normal((4, 3))
        total = comm.allreduce(y, op=MPI.SUM)
        assert_close_all_ranks(C.sum_reduce(comm, y, root), total if r == root else np.zeros_like(y),
                               1e-13, f"sum_reduce over {name}")
        # Only the root's x is in the domain of broadcast: the others' is ignored (zero here).
        x_dom = x if r == root else np.zeros_like(x)
        assert_adjoint(inner(C.broadcast(comm, x_dom, root), y),
                       inner(x_dom, C.sum_reduce(comm, y, root)), f"broadcast over {name}")


def test_broadcast_and_sum_reduce_default_to_root_0():
    r, p = WORLD.Get_rank(), WORLD.Get_size()
    x = np.full((2, 3), 10.0 + r)  # rank r holds 10 + r: rank 0's 10 everywhere after broadcast
    assert_close_all_ranks(C.broadcast(WORLD, x), np.full((2, 3), 10.0), 1e-300, "broadcast, default root")
    # the sum of 10 + r over the ranks, 10 p + p (p - 1) / 2, on rank 0, zeros elsewhere
    total = 10.0 * p + p * (p - 1) / 2
    assert_close_all_ranks(C.sum_reduce(WORLD, x), np.full((2, 3), total if r == 0 else 0.0), 1e-300,
                           "sum_reduce, default root")


@pytest.mark.parametrize("split,concat", [((7, 1), (5, 0)), ((2, 0), (7, 3)), ((1, 3), (2, 2))])
def test_alltoall(grid_and_groups, split, concat):
    rng = np.random.default_rng(4000 + WORLD.Get_rank())
    (s_extent, s_axis), (c_extent, c_axis) = split, concat
    for name, comm in grid_and_groups:
        p, r = comm.Get_size(), comm.Get_rank()
        s_sizes, c_sizes = block_sizes(s_extent, p), block_sizes(c_extent, p)
        full = [2, 3, 2, 3]
        full[s_axis], full[c_axis] = s_extent, c_extent
        glob = np.arange(np.prod(full), dtype=np.float64).reshape(full)
        c_start, c_stop = block_range(c_extent, p, r)
        s_start, s_stop = block_range(s_extent, p, r)
        x = np.take(glob, range(c_start, c_stop), axis=c_axis)
        expected = np.take(glob, range(s_start, s_stop), axis=s_axis)
        got = C.alltoall(comm, x, s_axis, c_axis, s_sizes, c_sizes)
        assert_close_all_ranks(got, expected, 1e-300, f"alltoall over {name}")
        x = rng.standard_normal(x.shape)
        y = rng.standard_normal(expected.shape)
        assert_adjoint(inner(C.alltoall(comm, x, s_axis, c_axis, s_sizes, c_sizes), y),
                       inner(x, C.alltoall(comm, y, c_axis, s_axis, c_sizes, s_sizes)),
                       f"alltoall over {name}")


def test_donated_summands_are_the_result_on_one_rank(grid_and_groups):
    """donate=True lets a sum over a group of one rank return its summand itself, no copy, and
    an allreduce over several take the sum in the summand's memory; without it the result is a
    new array and the summand is left as it was; the values are the same. A list of parts is
    summed as one message, whose parts are left as they were."""
    rng = np.random.default_rng(3000 + WORLD.Get_rank())
    for name, comm in grid_and_groups:
        p = comm.Get_size()
        sizes = block_sizes(5, p)
        x, b = rng.standard_normal((2, 5, 3)), rng.standard_normal(4)
        kept = x.copy()
        expected = comm.allreduce(x, op=MPI.SUM)
        for donate in (False, True):
            alias = donate and p == 1
            rs = C.reduce_scatter(comm, x, 1, sizes, donate=donate)
            dw, db = C.allreduce(comm, [x, b], donate=donate)
            for what, got in (("reduce_scatter", rs), ("allreduce of parts", dw)):
                assert_all_ranks(np.shares_memory(got, x) == alias,
                                 f"{what} over {name}, donate={donate}: shares x's memory: {np.shares_memory(got, x)}")
            assert_all_ranks(np.array_equal(x, kept), f"donate={donate} over {name} changed the summand")
            mine = x[:, :sizes[comm.Get_rank()]].copy()
            gathered = C.allgather(comm, mine, 1, sizes, may_alias=donate)
            assert_all_ranks(np.shares_memory(gathered, mine) == alias,
                             f"allgather over {name}, may_alias={donate}: shares x's memory")
            given = x.copy()
            ar = C.allreduce(comm, given, donate=donate)
            assert_all_ranks(np.shares_memory(ar, given) == donate, f"allreduce over {name}, donate={donate}: "
                             f"shares the summand's memory: {np.shares_memory(ar, given)}")
            assert_all_ranks(donate or np.array_equal(given, kept), f"allreduce over {name} changed the summand")
            assert_close_all_ranks(ar, expected, 1e-13, f"allreduce over {name}, donate={donate}")
            assert_close_all_ranks(dw, expected, 1e-13, f"allreduce of parts over {name}")
            assert_close_all_ranks(db, comm.allreduce(b, op=MPI.SUM), 1e-13, f"allreduce of parts over {name}")
            start, stop = block_range(5, p, comm.Get_rank())
            assert_close_all_ranks(rs, expected[:, start:stop], 1e-13, f"reduce_scatter over {name}, donate={donate}")


def test_allreduce_refuses_parts_of_two_dtypes():
    with pytest.raises(ValueError, match=r"allreduce: the parts of one message have dtypes \['float32', 'float64'\]"):
        C.allreduce(WORLD, [np.ones(2), np.ones(2, dtype=np.float32)])


def test_ledger_bytes_and_tags(grid_and_groups):
    ledger = C.CommLedger()
    for name, comm in grid_and_groups:
        p, r = comm.Get_size(), comm.Get_rank()
        sizes = block_sizes(7, p)
        x = np.ones((2, sizes[r], 3))
        with C.use_ledger(ledger), C.tag(layer=f"conv-{name}", phase="forward"):
            y = C.allgather(comm, x, 1, sizes)
            C.reduce_scatter(comm, y, 1, sizes)
            C.allreduce(comm, np.ones(12, dtype=np.float32))
            C.broadcast(comm, np.ones(5), 0)
            C.sum_reduce(comm, np.ones(5), 0)
        row = 2 * 3 * 8  # bytes of one entry along axis 1: 2 x 3 float64
        by_collective = {rec.collective: rec for rec in ledger.records if rec.layer == f"conv-{name}"}
        assert set(by_collective) == {"allgather", "reduce_scatter", "allreduce", "broadcast", "sum_reduce"}
        assert all(rec.phase == "forward" and rec.group_size == p for rec in by_collective.values())
        ag, rs = by_collective["allgather"], by_collective["reduce_scatter"]
        assert (ag.bytes_sent, ag.bytes_received) == ((p - 1) * sizes[r] * row, (7 - sizes[r]) * row)
        assert (rs.bytes_sent, rs.bytes_received) == ((7 - sizes[r]) * row, (p - 1) * sizes[r] * row)
        ar = by_collective["allreduce"]
        if 12 % p == 0:  # the ring volume 2 (p-1)/p m each way
            assert ar.bytes_sent == ar.bytes_received == 2 * (p - 1) * 12 * 4 // p
        bc, sr = by_collective["broadcast"], by_collective["sum_reduce"]
        assert (bc.bytes_sent, bc.bytes_received) == (((p - 1) * 40, 0) if r == 0 else (0, 40))
        assert (sr.bytes_sent, sr.bytes_received) == ((0, (p - 1) * 40) if r == 0 else (40, 0))
        # Every byte sent in the group is received by someone in it.
        for rec in by_collective.values():
            sent = comm.allreduce(rec.bytes_sent)
            received = comm.allreduce(rec.bytes_received)
            assert sent == received, (rec.collective, sent, received)
    assert ledger.layer == "-" and ledger.phase == "other"
    assert "allgather" in ledger.summary()
    assert C.get_ledger() is not ledger


def test_the_ledger_keeps_waiting_apart_from_transfer():
    """A rank that arrives at a collective before the others waits for them: that time is its
    wait_seconds (the barrier before the collective), not the collective's transfer seconds.
    Rank 0 arrives 0.3 s late; on one rank nothing waits."""
    import time
    ledger = C.CommLedger()
    WORLD.Barrier()  # every rank starts the test together
    with C.use_ledger(ledger):
        if WORLD.Get_rank() == 0:
            time.sleep(0.3)
        C.allreduce(WORLD, np.ones(4))
    (record,) = ledger.records
    late = WORLD.Get_rank() == 0 or WORLD.Get_size() == 1
    assert_all_ranks(record.wait_seconds < 0.15 if late else record.wait_seconds > 0.15,
                     f"rank {WORLD.Get_rank()} waited {record.wait_seconds:.3f} s")
    assert_all_ranks(record.seconds < 0.2, f"the transfer took {record.seconds:.3f} s")
    assert_all_ranks(WORLD.Get_size() > 1 or record.wait_seconds == 0.0, "a rank alone waited")
    assert_all_ranks(record.pack_seconds >= 0.0 and (WORLD.Get_size() > 1 or record.seconds == 0.0),
                     f"a rank alone spent {record.seconds} s in MPI, {record.pack_seconds} s packing")
    text = ledger.summary(top=1)
    assert "transfer s" in text and "wait s" in text and "pack s" in text
    assert text.splitlines()[-1].startswith("total")


def test_a_progress_thread_completes_what_is_in_flight_while_the_rank_calls_no_mpi(grid_and_groups):
    """Under comm.progress_thread, the four non-blocking collectives, started, complete while
    the main thread only sleeps (no MPI call of its own: only the thread's tests move them;
    without it the first rank to start an allreduce waits for the others' data forever), and
    wait() then returns what the blocking calls return, in the ledger as they would be."""
    rng = np.random.default_rng(4000 + WORLD.Get_rank())
    for name, comm in grid_and_groups:
        p, r = comm.Get_size(), comm.Get_rank()
        sizes = block_sizes(7, p)
        x, y, z = rng.standard_normal((3, sizes[r])), rng.standard_normal((3, 7)), rng.standard_normal(1 << 16)
        chunks = [rng.standard_normal(d + 1) for d in range(p)]
        counts = [r + 1] * p
        with C.use_ledger(C.CommLedger()):
            expected = [C.allgather(comm, x, 1, sizes), C.reduce_scatter(comm, y, 1, sizes), C.allreduce(comm, z),
                        C.alltoallv(comm, chunks, counts, np.float64)]
        ledger = C.CommLedger()
        with C.use_ledger(ledger), C.progress_thread(interval=1e-3):
            pending = [C.iallgather(comm, x, 1, sizes), C.ireduce_scatter(comm, y, 1, sizes), C.iallreduce(comm, z),
                       C.ialltoallv(comm, chunks, counts, np.float64)]

            def done():
                return [q._request is None or q._request == MPI.REQUEST_NULL for q in pending]
            deadline = time.monotonic() + 20
            while not all(done()) and time.monotonic() < deadline:
                time.sleep(0.005)
            completed = done()
            got = [q.wait() for q in pending]
        assert_all_ranks(all(completed), f"{name}: completed by the thread alone: {completed}")
        assert_all_ranks(np.array_equal(got[0], expected[0]), f"iallgather over {name}")
        assert_close_all_ranks(got[1], expected[1], 1e-12, f"ireduce_scatter over {name}")
        assert_close_all_ranks(got[2], expected[2], 1e-12, f"iallreduce over {name}")
        assert_all_ranks(all(np.array_equal(a, b) for a, b in zip(got[3], expected[3])), f"ialltoallv over {name}")
        assert_all_ranks([c.collective for c in ledger.records] == ["allgather", "reduce_scatter", "allreduce",
                                                                      "alltoall"], f"{name}: {ledger.records}")


def test_a_progress_thread_is_refused_a_bad_interval():
    for bad in (0, -1e-3, float("nan")):
        with pytest.raises(ValueError, match=r"progress_thread interval=.*expected a positive number of seconds"):
            with C.progress_thread(interval=bad):
                pass


def test_unknown_phase():
    with pytest.raises(ValueError, match="unknown phase 'sideways'"):
        with C.tag(phase="sideways"):
            pass


def test_float32_and_empty_blocks():
    comm = WORLD
    p = comm.Get_size()
    sizes = block_sizes(2, p)  # empty blocks on ranks >= 2
    x = np.full((sizes[comm.Get_rank()], 3), comm.Get_rank(), dtype=np.float32)
    y = C.allgather(comm, x, 0, sizes)
    assert y.dtype == np.float32 and y.shape == (2, 3)
    expected = np.repeat(np.arange(min(2, p)), [sizes[k] for k in range(min(2, p))])
    assert_close_all_ranks(y[:, 0], expected.astype(np.float32), 1e-300, "float32 allgather")


def test_collectives_refuse_blocks_that_do_not_fit_together():
    """Ranks passing different shapes or dtypes get one ValueError on every rank, not MPI's
    'Message truncated' or garbage; inside a layer's tag the collectives trust the layer."""
    from conftest import SIZE, raises_on_all_ranks
    if SIZE == 1:
        pytest.skip("one rank always agrees with itself")
    r = WORLD.Get_rank()
    sizes = block_sizes(SIZE, SIZE)
    taller = np.ones((2, 1, 3 + (r == SIZE - 1), 2))  # the last rank's H differs
    raises_on_all_ranks(ValueError, lambda: C.allgather(WORLD, taller, 1, sizes),
                        match=r"allgather: the ranks' arrays differ in dtype or shape \(except along axis 1\)")
    raises_on_all_ranks(ValueError, lambda: C.reduce_scatter(WORLD, np.ones((2, SIZE + (r == 0))), 1,
                                                             block_sizes(SIZE + (r == 0), SIZE)),
                        match="reduce_scatter: the ranks' arrays differ")
    mixed = np.ones(4, dtype=np.float32 if r == 0 else np.float64)
    raises_on_all_ranks(ValueError, lambda: C.allreduce(WORLD, mixed), match=r"allreduce: .*float32.*float64")
    raises_on_all_ranks(ValueError, lambda: C.broadcast(WORLD, np.ones(3 + r)), match="broadcast: ")
    raises_on_all_ranks(ValueError, lambda: C.sum_reduce(WORLD, np.ones(3 + r)), match="sum_reduce: ")
    # Rank 0 expects one element more from every peer than the peers send.
    send = [np.ones(1) for _ in range(SIZE)]
    recv = [1 + (r == 0 and s != 0) for s in range(SIZE)]
    raises_on_all_ranks(ValueError, lambda: C.alltoallv(WORLD, send, recv, np.float64),
                        match=r"alltoall: rank\(s\) \[0\] expect element counts")
    # The same blocks that fit pass, and nothing above moved any data into the ledger.
    ledger = C.CommLedger()
    with C.use_ledger(ledger):
        C.allgather(WORLD, np.ones((2, 1, 3, 2)), 1, sizes)
        with C.tag(layer="conv", phase="forward"):  # a layer's collective: no extra check
            C.allreduce(WORLD, np.ones(4))
    assert [rec.collective for rec in ledger.records] == ["allgather", "allreduce"]


def test_nonblocking_collectives_equal_the_blocking_ones(grid_and_groups):
    """iallgather, ireduce_scatter, iallreduce and ialltoallv, all four in flight at once and
    waited for in reverse order, return what the blocking ones return (the gathers and the
    all-to-all exactly, the sums to rounding: MPI does not fix a non-blocking sum's order), and
    are adjoint as theirs are. Each is recorded once, when waited for, under the layer and phase
    it was started in, with the blocking call's bytes, started before it was waited for."""
    rng = np.random.default_rng(3000 + WORLD.Get_rank())
    for name, comm in grid_and_groups:
        p, r = comm.Get_size(), comm.Get_rank()
        extent, axis = 7, 1
        sizes = block_sizes(extent, p)
        full = make_shape(extent, axis)
        local = list(full)
        local[axis] = sizes[r]
        x, y, z = rng.standard_normal(local), rng.standard_normal(full), rng.standard_normal((3, 5))
        chunks = [rng.standard_normal(d + 1) for d in range(p)]  # d + 1 values to rank d
        counts = [r + 1] * p  # and r + 1 from every rank
        blocking = C.CommLedger()
        with C.use_ledger(blocking):
            expected = [C.allgather(comm, x, axis, sizes), C.reduce_scatter(comm, y, axis, sizes),
                        C.allreduce(comm, z), C.alltoallv(comm, chunks, counts, np.float64)]
        ledger = C.CommLedger()
        with C.use_ledger(ledger):
            with C.tag(layer="L", phase="backward-filter"):
                pending = [C.iallgather(comm, x, axis, sizes), C.ireduce_scatter(comm, y, axis, sizes),
                           C.iallreduce(comm, z), C.ialltoallv(comm, chunks, counts, np.float64)]
            assert_all_ranks(ledger.records == [], f"{name}: recorded before any wait")
            got = [q.wait() for q in reversed(pending)][::-1]
            assert_all_ranks(all(q.test() for q in pending) and pending[0].wait() is got[0],
                             f"{name}: a completed collective's test() and second wait()")
        assert_all_ranks(np.array_equal(got[0], expected[0]), f"iallgather over {name}")
        assert_close_all_ranks(got[1], expected[1], 1e-12, f"ireduce_scatter over {name}")
        assert_close_all_ranks(got[2], expected[2], 1e-12, f"iallreduce over {name}")
        assert_all_ranks(all(np.array_equal(a, b) for a, b in zip(got[3], expected[3])), f"ialltoallv over {name}")
        records = ledger.records
        assert_all_ranks([c.collective for c in records] == ["alltoall", "allreduce", "reduce_scatter", "allgather"]
                         and all((c.layer, c.phase) == ("L", "backward-filter") for c in records)
                         and all(c.started <= c.waited and c.wait_seconds >= 0 for c in records),
                         f"{name}: the records {records}")
        sent = {c.collective: (c.bytes_sent, c.bytes_received) for c in blocking.records}
        assert_all_ranks(all((c.bytes_sent, c.bytes_received) == sent[c.collective] for c in records),
                         f"{name}: bytes {records} against the blocking calls' {sent}")
        v = rng.standard_normal(full)
        assert_adjoint(inner(C.iallgather(comm, x, axis, sizes).wait(), v),
                       inner(x, C.ireduce_scatter(comm, v, axis, sizes).wait()), f"iallgather over {name}")
