"""A new algorithm written outside cfp: a class that declares its own weight layout and filter
groups and reuses an existing recipe runs without any change to cfp, and equals the serial
float64 computation; a class that declares no layout is refused, never given another's.

FilterParallelW runs stationary-w's messages (allgather x within the row, reduce-scatter y
within the column, ...) as a filter-parallel partition: its rule is p_f = P_c (rows of all
P_c ranks, columns of one) and its weight is declared split by filter, Layout(("channel", -,
-, -)), rather than taken from stationary-w's row and column shards."""
import numpy as np
import pytest

from cfp import comm as C
from cfp.algorithms import StationaryW
from cfp.algorithms.base import ConvAlgorithm
from cfp.grid import ProcessGrid
from cfp.perfmodel import ledger_bytes, predict_bytes
from cfp.tensor import DistTensor, Layout
from conftest import SIZE, assert_all_ranks, assert_close_all_ranks, raises_on_all_ranks
from test_algorithms import SHAPES, random_problem, serial

pytestmark = pytest.mark.mpi


class FilterParallelW(StationaryW):
    """Stationary-w's recipe with p_f = P_c, its weight declared as filter blocks."""

    name = "filter-w"

    @classmethod
    def weight_layout_of(cls, p_f, groups=1):
        return Layout(("channel", None, None, None))

    @classmethod
    def filter_groups(cls, channel_parts, filter_groups=None):
        return channel_parts


class NoLayout(ConvAlgorithm):
    """Stationary-w's messages and a filter-group rule, but no weight layout."""

    name = "no-layout"
    messages = StationaryW.messages

    @classmethod
    def filter_groups(cls, channel_parts, filter_groups=None):
        return 1


class NoFilterGroups(ConvAlgorithm):
    """A weight layout, but no filter-group rule."""

    name = "no-p_f"

    @classmethod
    def weight_layout_of(cls, p_f, groups=1):
        return Layout(("channel", None, None, None))


def grid_of(P):
    """sample x channel with channel = P (2 or 4 ranks: channel=2, or sample=2 x channel=2 and
    channel=4)."""
    return [ProcessGrid(spec) for spec in ([f"channel={P}"] if P == 2 else ["sample=2,channel=2", "channel=4"])]


@pytest.fixture(scope="module")
def grids():
    if SIZE not in (2, 4):
        pytest.skip(f"the extension runs at 2 and 4 ranks, not {SIZE}")
    made = grid_of(SIZE)
    yield made
    for g in made:
        g.free()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "N{}C{}F{}H{}W{}K{}s{}p{}".format(*s))
def test_an_algorithm_defined_outside_cfp_equals_serial(grids, shape):
    N, Cin, F, H, W, K, stride, pad = shape
    x, w, b, dy = random_problem(shape)
    y, dx, dw, db = serial(x, w, b, dy, stride, pad)
    for grid in grids:
        what = f"{FilterParallelW.name} on {grid.describe()}"
        conv = FilterParallelW(grid, Cin, F, K, stride=stride, padding=pad, layer="conv")
        P_c = grid.axis_size("channel")
        # its own declarations, not stationary-w's: p_f = P_c and filter blocks of w
        assert_all_ranks(conv.p_f == P_c and conv.weight_layout == Layout(("channel", None, None, None)),
                         f"{what}: p_f {conv.p_f}, weight layout {conv.weight_layout}")
        x_local = DistTensor.from_global(x, conv.input_layout, grid).local
        dy_local = DistTensor.from_global(dy, conv.output_layout, grid).local
        w_shard, b_shard = conv.shard_weight(w), conv.shard_bias(b)
        (filters,) = Layout(("channel",)).indices((F,), grid, grid.coords)
        assert_all_ranks(w_shard.shape == (len(filters), Cin, K, K) and np.array_equal(w_shard, w[list(filters)]),
                         f"{what}: weight shard {w_shard.shape}, expected the filters {filters} of w")
        ledger = C.CommLedger()
        with C.use_ledger(ledger):
            y_local = conv.forward(x_local, w_shard, b_shard)
            dx_local, dw_shard, db_shard = conv.backward(dy_local)
        got = {"y": DistTensor(y_local, y.shape, conv.output_layout, grid).gather(),
               "dx": DistTensor(dx_local, x.shape, conv.input_layout, grid).gather(),
               "dw": conv.weight_tensor(dw_shard).gather(), "db": conv.bias_tensor(db_shard).gather()}
        for name, expected in (("y", y), ("dx", dx), ("dw", dw), ("db", db)):
            assert_close_all_ranks(got[name], expected, 1e-10, f"{what} {name}")
        # it ran stationary-w's collectives on stationary-w's p_f = P_c partition (the row's
        # allgather of x and reduce-scatter of dx over all P_c, the column's of y and dy over
        # one rank), so it moves what perfmodel predicts for that
        predicted = predict_bytes("w", x.shape, w.shape, grid.shape, grid.coords, stride, pad,
                                  filter_groups=P_c, itemsize=8)
        measured = ledger_bytes(ledger, layer="conv")
        assert_all_ranks(measured == predicted, f"{what}: ledger {measured} != predicted {predicted}")


def test_an_algorithm_without_a_declared_layout_is_refused(grids):
    for grid in grids:
        raises_on_all_ranks(TypeError, lambda: NoLayout(grid, 4, 4, 3),
                            match=r"algorithm class NoLayout \(name 'no-layout'\) declares no weight layout: "
                                  r"define the classmethod weight_layout_of\(p_f, groups\)")
        raises_on_all_ranks(TypeError, lambda: NoFilterGroups(grid, 4, 4, 3),
                            match=r"algorithm class NoFilterGroups \(name 'no-p_f'\) declares no filter-group rule")
    with pytest.raises(TypeError, match="declares no weight layout"):  # also where no layer is built
        NoLayout.layouts({"height": 1, "width": 1}, 1)
