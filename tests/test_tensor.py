"""Layout and DistTensor: blocks of global tensors, gather, and redistribute round trips
between every pair of layouts on every grid over the world (exact, not approximate)."""
import itertools

import numpy as np
import pytest
from mpi4py import MPI

from cfp import comm as C
from cfp.grid import ProcessGrid
from cfp.tensor import DistTensor, Layout, Shard
from conftest import SIZE, WORLD, assert_all_ranks, grid_specs, raises_on_all_ranks

SHAPE = (5, 7, 3, 2)  # N, C, H, W: uneven over 2, 3 and 4 ranks, empty blocks at 4
LAYOUTS = [
    Layout(("sample", "channel", None, None)),
    Layout(("sample", None, None, None)),
    Layout((None, "channel", None, None)),
    Layout((None, None, None, None)),
    Layout(("channel", "sample", None, None)),
    Layout((None, None, "sample", "channel")),
]
# sample=4, sample=2,channel=2 and channel=4 at 4 ranks, and so on at other sizes.
SPECS = grid_specs()


def global_tensor(dtype=np.float64):
    return np.arange(np.prod(SHAPE), dtype=dtype).reshape(SHAPE) * 0.5 - 3.0


@pytest.fixture(scope="module")
def grids():
    made = {spec: ProcessGrid(spec) for spec in SPECS}
    yield made
    for g in made.values():
        g.free()


def test_layout_basics():
    lay = Layout(("sample", "-", None, "channel"))
    assert lay.axes == ("sample", None, None, "channel")
    assert repr(lay) == "Layout(sample, -, -, channel)"
    assert Layout.replicated(2) == Layout((None, None))
    with pytest.raises(ValueError, match="unknown grid axis 'filter'"):
        Layout(("filter", None))
    with pytest.raises(ValueError, match="splits 2 dimensions over grid axis 'channel'"):
        Layout(("channel", "channel"))
    w = Layout((Shard("channel", "column", 2), Shard("channel", "row", 2)))
    assert repr(w) == "Layout(channel/column(p_f=2), channel/row(p_f=2))"
    with pytest.raises(ValueError, match="both splits and sums over grid axis 'sample'"):
        Layout(("sample", None), partial=("sample",))
    # Index sets: 7 over 4 blocks is 2, 2, 2, 1; p_f = 2 puts coordinate 1 at (row 0, column 1).
    grid = {"channel": 4}
    assert w.indices((7, 7), grid, {"channel": 1}) == ((2, 3, 6), range(0, 4))
    assert Layout(("channel",)).indices((7,), grid, {"channel": 3}) == (range(6, 7),)
    assert Layout(("sample", None)).on({"sample": 1}) == Layout.replicated(2)


def test_tiles_means_every_index_exactly_once():
    """layout.tiles, which lets an exchange put pieces in place instead of adding them onto
    zeros: true only where the pieces cover the wanted indices and no two share one."""
    from cfp.layout import tiles
    wanted = (range(0, 4), (1, 3, 5))
    halves = [(range(0, 2), (1, 3, 5)), (range(2, 4), (1, 3, 5))]
    assert tiles(halves, wanted)
    assert tiles([(range(0, 4), (1,)), (range(0, 4), (3, 5))], wanted)  # a tuple split
    assert not tiles(halves[:1], wanted)  # a gap
    assert not tiles(halves + [(range(1, 2), (3,))], wanted)  # an overlap
    # an overlap and a gap of the same size: the sizes add up, the pieces do not tile
    assert not tiles([(range(0, 3), (1, 3, 5)), (range(2, 3), (1, 3, 5))], wanted)
    assert not tiles([(range(0, 2), (1, 3, 5))] * 2, (range(0, 4), (1, 3, 5)))  # summands of one piece
    assert tiles([], (range(0), range(0, 3)))  # nothing wanted


@pytest.mark.mpi
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=repr)
def test_from_global_and_gather(grids, spec, layout):
    grid = grids[spec]
    g = global_tensor()
    t = DistTensor.from_global(g, layout, grid)
    held = t.indices()
    assert_all_ranks(np.array_equal(t.local, g[np.ix_(*[list(ix) for ix in held])]), "block content")
    # The blocks of the distinct owners tile the global tensor exactly once.
    boxes = set(WORLD.allgather(tuple(tuple(ix) for ix in held)))
    assert sum(int(np.prod([len(ix) for ix in bx])) for bx in boxes) == g.size
    assert_all_ranks(np.array_equal(t.gather(), g), "gather to all")
    for root in {0, SIZE - 1}:
        got = t.gather(root=root)
        ok = np.array_equal(got, g) if WORLD.Get_rank() == root else got is None
        assert_all_ranks(ok, f"gather to rank {root}")


@pytest.mark.mpi
@pytest.mark.parametrize("src_spec", SPECS)
@pytest.mark.parametrize("src_layout", LAYOUTS, ids=repr)
def test_redistribute_round_trips(grids, src_spec, src_layout):
    g = global_tensor()
    src = DistTensor.from_global(g, src_layout, grids[src_spec])
    for dst_spec, dst_layout in itertools.product(SPECS, LAYOUTS):
        dst = src.redistribute(dst_layout, grids[dst_spec])
        expected = DistTensor.from_global(g, dst_layout, grids[dst_spec]).local
        where = f"{src_spec} {src_layout} -> {dst_spec} {dst_layout}"
        assert_all_ranks(dst.local.shape == expected.shape and np.array_equal(dst.local, expected), where)
        back = dst.redistribute(src_layout, grids[src_spec])
        assert_all_ranks(np.array_equal(back.local, src.local), "round trip " + where)


@pytest.mark.mpi
def test_redistribute_between_sample_and_channel_grids():
    """The issue's grids at 4 ranks, by name; at other sizes their analogues."""
    specs = ["sample=4", "sample=2,channel=2", "channel=4"] if SIZE == 4 else SPECS
    made = [ProcessGrid(s) for s in specs]
    g = global_tensor(np.float32)
    lay = Layout(("sample", "channel", None, None))
    for a, b in itertools.product(made, made):
        t = DistTensor.from_global(g, lay, a)
        there = t.redistribute(lay, b)
        assert_all_ranks(np.array_equal(there.redistribute(lay, a).local, t.local),
                         f"{a.describe()} -> {b.describe()} -> back")
        assert there.dtype == np.float32
    for m in made:
        m.free()


@pytest.mark.mpi
def test_redistribute_moves_only_what_it_must():
    grid = ProcessGrid(f"sample={SIZE}")
    ledger = C.CommLedger()
    t = DistTensor.from_global(global_tensor(), Layout(("sample", None, None, None)), grid)
    with C.use_ledger(ledger):
        t.redistribute(t.layout)  # same layout: nothing moves
        t.redistribute(Layout.replicated(4))
    same, full = ledger.records
    assert same.bytes_sent == same.bytes_received == 0
    mine = t.local.nbytes
    assert full.bytes_received == global_tensor().nbytes - mine
    assert full.bytes_sent == (SIZE - 1) * mine
    grid.free()


@pytest.mark.mpi
def test_bad_input(grids):
    grid = grids[SPECS[0]]
    lay = Layout(("sample", "channel", None, None))
    raises_on_all_ranks(ValueError, lambda: DistTensor(np.zeros((9, 9, 9, 9)), SHAPE, lay, grid),
                        match=r"local block has shape \(9, 9, 9, 9\)")
    t = DistTensor.from_global(global_tensor(), lay, grid)
    raises_on_all_ranks(ValueError, lambda: t.redistribute(Layout((None, None))),
                        match="has 2 dimensions, the tensor has 4")
    if SIZE > 1:
        other = ProcessGrid("sample=1", comm=MPI.COMM_SELF)
        raises_on_all_ranks(ValueError, lambda: t.redistribute(lay, other),
                            match="is not over the same ranks")
        other.free()


@pytest.mark.mpi
def test_blocks_that_do_not_form_one_tensor_are_named():
    """check_blocks' diagnosis, one problem at a time, on sample=SIZE with (sample, None)."""
    from cfp.tensor import check_blocks
    grid = ProcessGrid(f"sample={SIZE}")
    r, last = WORLD.Get_rank(), SIZE - 1
    lay = Layout(("sample", None))
    assert check_blocks(np.zeros((2, 3)), lay, grid, "x") == (2 * SIZE, 3)
    raises_on_all_ranks(ValueError, lambda: _gather_to_a_rank_outside(grid),
                        match=rf"root {SIZE} outside 0\.\.{last}")
    if SIZE > 1:
        # the last rank's block is 3-D: the numbers of dimensions differ, the dtypes do not
        local = np.zeros((2, 3, 1) if r == last else (2, 3))
        raises_on_all_ranks(ValueError, lambda: check_blocks(local, lay, grid, "x"),
                            match=r"\(their numbers of dimensions differ\)")
        # the dtypes differ, the shapes do not
        local = np.zeros((2, 3), dtype=np.float32 if r == last else np.float64)
        raises_on_all_ranks(ValueError, lambda: check_blocks(local, lay, grid, "x"),
                            match=r"\(their dtypes differ\)")
        # the replicated dimension is 5 on the last rank, 3 (rank 0's) elsewhere
        local = np.zeros((2, 5) if r == last else (2, 3))
        raises_on_all_ranks(ValueError, lambda: check_blocks(local, lay, grid, "x"),
                            match=rf"\(rank {last} holds \(2, 5\) where a tensor of global shape "
                                  rf"\({2 * SIZE}, 3\) has a block of \(2, 3\)\)")
    grid.free()


def _gather_to_a_rank_outside(grid):
    DistTensor.from_global(np.zeros((SIZE, 2)), Layout(("sample", None)), grid).gather(root=SIZE)


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _specs_with_layouts(grids):
    """(grid, layout) pairs of the issue's layout kinds on every grid of the world: split by
    sample, split by sample and channel, the channel dimension in stationary-w's strided
    column blocks and a weight's (column, row) blocks for every p_f, and replicated."""
    out = []
    for spec in SPECS:
        grid = grids[spec]
        kinds = [Layout(("sample", None, None, None)), Layout(("sample", "channel", None, None)),
                 Layout.replicated(4)]
        for p_f in _divisors(grid.axis_size("channel")):
            kinds.append(Layout(("sample", Shard("channel", "column", p_f), None, None)))
            kinds.append(Layout((Shard("channel", "column", p_f), Shard("channel", "row", p_f), None, None)))
        out.extend((spec, k) for k in kinds)
    return out


def _with_replicas_summed(layout, grid):
    """The layout whose copies are summands: every local array is a valid block."""
    return layout.on(grid).with_partial(layout.copy_axes(grid))


def _dot(a, b):
    """The sum over ranks of the local inner products."""
    return WORLD.allreduce(float(np.vdot(a, b)))


@pytest.mark.mpi
def test_redistribute_is_exact_for_strided_and_weight_layouts(grids):
    """Every (grid, layout) to every other gives the blocks of the same global tensor."""
    g = global_tensor()
    pairs = _specs_with_layouts(grids)
    for (a_spec, a), (b_spec, b) in itertools.product(pairs, pairs):
        t = DistTensor.from_global(g, a, grids[a_spec]).redistribute(b, grids[b_spec])
        expected = DistTensor.from_global(g, b, grids[b_spec]).local
        assert_all_ranks(np.array_equal(t.local, expected), f"{a_spec} {a} -> {b_spec} {b}")


@pytest.mark.mpi
def test_redistribute_passes_the_adjoint_test(grids):
    """<R x, y> = <x, R* y> summed over ranks, for R the exchange from (grid A, layout A) to
    (grid B, layout B) of a tensor whose copies along A's replica axes are summands, and R*
    the exchange back with B's copies as summands: a replicated target's adjoint adds the
    copies, a partial source's adjoint copies. Random, non-matching local blocks (so a wrong
    choice of copy or a lost summand shows), uneven blocks (5 x 7 over 2, 3, 4)."""
    pairs = _specs_with_layouts(grids)
    rng = np.random.default_rng(1000 + WORLD.Get_rank())
    worst = 0.0
    for (a_spec, a), (b_spec, b) in itertools.product(pairs, pairs):
        ga, gb = grids[a_spec], grids[b_spec]
        a_sum, b_sum = _with_replicas_summed(a, ga), _with_replicas_summed(b, gb)
        x = DistTensor(rng.standard_normal(a.local_shape(SHAPE, ga, ga.coords)), SHAPE, a_sum, ga)
        y = DistTensor(rng.standard_normal(b.local_shape(SHAPE, gb, gb.coords)), SHAPE, b_sum, gb)
        forward = x.redistribute(b, gb)
        adjoint = y.redistribute(a, ga)
        lhs, rhs = _dot(forward.local, y.local), _dot(x.local, adjoint.local)
        # Rounding grows with the terms summed, not with their (cancelling) sum: the bound is
        # relative to the sum of the terms' magnitudes (about sqrt(terms) times |lhs|), which
        # at 12 ranks is what lets 1e-12 hold without loosening it at 1-4.
        scale = max(_dot(np.abs(forward.local), np.abs(y.local)), _dot(np.abs(x.local), np.abs(adjoint.local)))
        worst = max(worst, abs(lhs - rhs) / max(scale, 1e-300))
        assert_all_ranks(abs(lhs - rhs) <= 1e-12 * max(scale, 1.0),
                         f"{a_spec} {a} -> {b_spec} {b}: <Rx, y> = {lhs!r}, <x, R*y> = {rhs!r} "
                         f"(terms' magnitudes {scale!r})")
    assert worst < 1e-12


@pytest.mark.mpi
def test_partial_sums_and_partial_targets(grids):
    """A partial tensor's summands add up; a partial target puts the tensor on coordinate 0
    of its partial axes and zeros elsewhere, so its sum is the tensor again."""
    g = global_tensor()
    for spec in SPECS:
        grid = grids[spec]
        summed = Layout(("sample", None, None, None), partial=("channel",)) if grid.axis_size("channel") > 1 \
            else Layout(("sample", None, None, None))
        t = DistTensor.from_global(g, summed, grid)
        assert_all_ranks(np.array_equal(t.gather(), g), f"{spec}: partial from_global sums to the tensor")
        # Each summand equal to the tensor's block: the sum is P_c times it.
        same = DistTensor(DistTensor.from_global(g, summed.without_partial(), grid).local, SHAPE, summed, grid)
        assert_all_ranks(np.allclose(same.gather(), g * grid.axis_size("channel")), f"{spec}: P_c summands")


@pytest.mark.mpi
@pytest.mark.parametrize("spec", grid_specs(2))
def test_redistribute_between_placements(spec):
    """A tensor moved between grids that place their ranks on other processes (node_axes):
    every block is the global tensor's, both ways and between layouts, and gathers whole."""
    from cfp.grid import AXES
    shape = ProcessGrid.shape_of(spec)
    x = np.random.default_rng(3).standard_normal((4 * SIZE, 6, 5, 4))
    base = ProcessGrid(spec)
    a, b = Layout(("sample", "channel", None, None)), Layout(("channel", "sample", None, None))

    def block(t):
        return x[np.ix_(*[list(ix) for ix in t.indices()])]
    for axis in [a for a in AXES if shape[a] > 1]:
        placed = ProcessGrid(spec, node_axes=(axis,))
        moved = DistTensor.from_global(x, a, base).redistribute(a, placed)
        assert_all_ranks(np.array_equal(moved.local, block(moved)), f"{spec} -> node axes {axis}")
        back = moved.redistribute(b, base)
        assert_all_ranks(np.array_equal(back.local, block(back)), f"node axes {axis} -> {spec}, another layout")
        assert_all_ranks(np.array_equal(moved.gather(), x), "gather of the placed grid's tensor")
        placed.free()
    base.free()


@pytest.mark.mpi
def test_a_started_move_ends_as_the_blocking_one(grids):
    """start_move (the non-blocking all-to-all) returns, once waited for, what move returns,
    in the same ledger bytes, on every grid and pair of layouts; waiting twice gives the same
    array, and the source block is not written while the move is in flight."""
    from cfp.layout import exchange_plan
    from cfp.tensor import move, start_move
    x = global_tensor()
    for spec in SPECS:
        grid = grids[spec]
        for a, b in itertools.product(LAYOUTS, LAYOUTS):
            t = DistTensor.from_global(x, a, grid)
            pieces = exchange_plan(SHAPE, a, grid, b, grid, grid.size)
            wanted = b.indices(SHAPE, grid, grid.coords)
            held, before = t.indices(), t.local.copy()
            blocking, started = C.CommLedger(), C.CommLedger()
            with C.use_ledger(blocking):
                expected = move(t.local, held, pieces, wanted, grid.comm)
            with C.use_ledger(started):
                moving = start_move(t.local, held, pieces, wanted, grid.comm)
                moving.test()
                got = moving.wait()
            assert moving.wait() is got
            np.testing.assert_array_equal(t.local, before)
            assert_all_ranks(np.array_equal(got, expected), f"{spec}: {a} -> {b}")
            assert [(r.bytes_sent, r.bytes_received) for r in started.records] == \
                [(r.bytes_sent, r.bytes_received) for r in blocking.records]
