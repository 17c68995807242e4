"""Layout and DistTensor: blocks of global tensors, gather, and redistribute round trips
between every pair of layouts on every grid over the world (exact, not approximate)."""
import itertools

import numpy as np
import pytest
from mpi4py import MPI

from cfp import comm as C
from cfp.grid import ProcessGrid
from cfp.tensor import DistTensor, Layout
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
    with pytest.raises(ValueError, match="splits two dimensions over the same grid axis"):
        Layout(("channel", "channel"))


@pytest.mark.mpi
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=repr)
def test_from_global_and_gather(grids, spec, layout):
    grid = grids[spec]
    g = global_tensor()
    t = DistTensor.from_global(g, layout, grid)
    box = t.box()
    assert_all_ranks(np.array_equal(t.local, g[tuple(slice(a, b) for a, b in box)]), "block content")
    # The blocks of the distinct owners tile the global tensor exactly once.
    boxes = set(WORLD.allgather(box))
    assert sum(int(np.prod([b - a for a, b in bx])) for bx in boxes) == g.size
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
