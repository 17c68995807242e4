"""ProcessGrid: spec parsing, coordinates, and the communicators made by Comm.Split."""

import pytest
from mpi4py import MPI

from cfp.grid import AXES, ProcessGrid, factorizations, parse_grid_spec
from conftest import SIZE, WORLD, assert_all_ranks, grid_specs, raises_on_all_ranks


def test_parse_grid_spec():
    assert parse_grid_spec("sample=2,channel=2") == {"sample": 2, "channel": 2}
    assert parse_grid_spec(" channel = 4 ") == {"channel": 4}
    assert parse_grid_spec({"sample": 3}) == {"sample": 3}
    assert parse_grid_spec("") == {}


@pytest.mark.parametrize("spec,match", [
    ("sample=0", r"size of grid axis 'sample' must be a positive integer, got '0'"),
    ("sample=-2", r"must be a positive integer, got '-2'"),
    ("sample=1.5", r"must be a positive integer, got '1.5'"),
    ("channel=two", r"must be a positive integer, got 'two'"),
    ({"sample": 2.0}, r"must be a positive integer, got 2.0"),
    ({"sample": True}, r"must be a positive integer, got True"),
    ("filter=2", r"unknown grid axis 'filter'; expected one of sample, depth, height, width, channel"),
    ("sample=2,sample=2", r"grid axis 'sample' is given twice"),
    ("sample2", r"grid entry 'sample2' .* is not of the form axis=size"),
])
def test_parse_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_grid_spec(spec)


def test_factorizations():
    assert factorizations(4) == [(1, 4), (2, 2), (4, 1)]
    assert factorizations(3, 3) == [(1, 1, 3), (1, 3, 1), (3, 1, 1)]


def test_grid_on_comm_self():
    grid = ProcessGrid("sample=1", comm=MPI.COMM_SELF)
    assert grid.shape == {a: 1 for a in AXES}
    assert grid.axis_comm("channel").Get_size() == 1
    assert repr(grid) == "ProcessGrid(sample=1) rank 0 at ()"
    grid.free()


def test_grid_size_mismatch_on_comm_self():
    with pytest.raises(ValueError, match="grid sample=2,channel=3 needs 6 ranks, the communicator has 1"):
        ProcessGrid("sample=2,channel=3", comm=MPI.COMM_SELF)


@pytest.mark.mpi
@pytest.mark.parametrize("spec", grid_specs(2) + grid_specs(len(AXES), AXES))
def test_grid_communicators(spec):
    grid = ProcessGrid(spec)
    sizes = parse_grid_spec(spec)
    assert grid.size == SIZE
    assert grid.rank_of(grid.coords) == grid.rank
    everyone = WORLD.allgather(tuple(grid.coords[a] for a in AXES))
    assert_all_ranks(len(set(everyone)) == SIZE, "coordinates are not unique")
    for axis in AXES:
        n = sizes.get(axis, 1)
        assert grid.axis_size(axis) == n
        along = grid.axis_comm(axis)
        assert along.Get_size() == n
        assert along.Get_rank() == grid.coord(axis)
        # The members of the axis communicator differ from this rank only in `axis`.
        members = along.allgather(grid.coords)
        assert [m[axis] for m in members] == list(range(n))
        for m in members:
            assert all(m[a] == grid.coords[a] for a in AXES if a != axis)
        # The complement holds every rank with this rank's coordinate along `axis`.
        same = grid.complement_comm(axis).allgather(grid.coords)
        assert len(same) == SIZE // n
        assert all(m[axis] == grid.coords[axis] for m in same)
    grid.free()


@pytest.mark.mpi
def test_channel_varies_fastest():
    grid = ProcessGrid(f"channel={SIZE}")
    assert grid.coords["channel"] == WORLD.Get_rank()
    grid.free()


@pytest.mark.mpi
@pytest.mark.parametrize("spec,match", [
    (f"sample={SIZE + 1}", f"grid sample={SIZE + 1} needs {SIZE + 1} ranks, the communicator has {SIZE}"),
    (f"sample={SIZE},channel=2", f"needs {2 * SIZE} ranks, the communicator has {SIZE}"),
    ("sample=0", "must be a positive integer, got '0'"),
    ("sample=x", "must be a positive integer, got 'x'"),
    ("time=2", "unknown grid axis 'time'"),
])
def test_bad_grid_raises_on_every_rank(spec, match):
    raises_on_all_ranks(ValueError, lambda: ProcessGrid(spec), match=match)


@pytest.mark.mpi
def test_the_grid_owns_stationary_w_row_and_column_groups():
    """row_and_column_comms(p_f): made once per p_f and shared by every layer, the row holding
    the p_f channel ranks of this rank's row in column order, the column the q ranks of its
    column in row order; freed with the grid."""
    from cfp.algorithms import make_conv
    from cfp.partition import row_and_column
    size = MPI.COMM_WORLD.Get_size()
    grid = ProcessGrid(f"channel={size}")
    c = grid.coord("channel")
    for p_f in [d for d in range(1, size + 1) if size % d == 0]:
        row, column = grid.row_and_column_comms(p_f)
        assert grid.row_and_column_comms(p_f) == (row, column)  # cached, not split again
        i, j = row_and_column(c, p_f)
        assert (row.Get_size(), row.Get_rank()) == (p_f, j)
        assert (column.Get_size(), column.Get_rank()) == (size // p_f, i)
        members = row.allgather(c)
        assert members == [i * p_f + k for k in range(p_f)], members
        a = make_conv("w", grid, 4 * size, 4 * size, 3, filter_groups=p_f)
        b = make_conv("w", grid, 4 * size, 4 * size, 1, filter_groups=p_f)
        assert a.row_comm is b.row_comm and a.column_comm is b.column_comm
    with pytest.raises(ValueError, match="does not divide"):
        grid.row_and_column_comms(size + 1)
    grid.free()


def test_placement_orders_the_processes_not_the_grid():
    """node_axes: the named axes vary fastest in the processes' order, the grid's own ranks stay
    channel fastest; the default, and naming channel alone, keep process r at grid rank r."""
    from cfp.grid import placement_order, process_ranks
    shape = {"sample": 2, "channel": 2}
    assert placement_order(shape) == ("sample", "channel") == placement_order(shape, ("channel",))
    assert placement_order(shape, "sample") == ("channel", "sample")
    assert process_ranks(shape) == (0, 1, 2, 3)
    # grid rank 1 (sample 0, channel 1) is process 2: the sample pairs (0, 1), (2, 3) of the
    # processes are nodes of 2, channel pairs span them
    assert process_ranks(shape, ("sample",)) == (0, 2, 1, 3)
    three = {"sample": 2, "height": 3, "channel": 2}
    assert placement_order(three, "sample,height") == ("channel", "sample", "height")
    assert sorted(process_ranks(three, ("height",))) == list(range(12))
    for bad, match in (("filter", "node axis 'filter': expected one of sample, depth, height, width, channel"),
                       ("width", "node axis 'width': grid sample=2,channel=2 does not split it \\(it splits "
                                 "sample, channel\\)"),
                       (("sample", "sample"), "an axis is named twice")):
        with pytest.raises(ValueError, match=match):
            placement_order(shape, bad)


@pytest.mark.mpi
@pytest.mark.parametrize("spec", grid_specs(2))
def test_a_placed_grid_has_the_same_groups_on_other_processes(spec):
    """Every placement of a grid: the same coordinates on the processes process_ranks names,
    each axis group the ranks of that axis (one node here: every group fits)."""
    from cfp.grid import process_ranks
    shape = ProcessGrid.shape_of(spec)
    split = [a for a in AXES if shape[a] > 1]
    for node_axes in [None] + [(a,) for a in split]:
        grid = ProcessGrid(spec, node_axes=node_axes)
        assert grid.processes == process_ranks(shape, node_axes)
        assert grid.processes[grid.rank] == WORLD.Get_rank()
        assert grid.rank_of(grid.coords) == grid.rank
        for axis in AXES:
            members = grid.axis_comm(axis).allgather(grid.coords)
            assert [m[axis] for m in members] == list(range(shape[axis]))
        grid.free()


@pytest.mark.mpi
def test_node_axes_that_do_not_fit_a_node_are_refused_on_every_rank(monkeypatch):
    """Node axes whose groups would span nodes: refused, naming the nodes (here: every process
    made its own node, as on a cluster of one rank a node)."""
    if SIZE < 2:
        pytest.skip("one rank is one node: every group fits")
    import cfp.grid
    monkeypatch.setattr(cfp.grid, "node_layout", lambda comm: (1, comm.Get_size()))
    raises_on_all_ranks(ValueError, lambda: ProcessGrid(f"channel={SIZE}", node_axes="channel"),
                        match=f"node axes channel={SIZE}: a group of {SIZE} ranks does not fit inside the "
                              f"nodes of this job \\({SIZE} node\\(s\\) of 1 rank\\(s\\)\\); expected node axes "
                              f"whose sizes multiply to a divisor of 1")
