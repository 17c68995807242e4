"""Tests written for the mutants that `make mutation` (tests/mutation/run.py) found surviving:
each holds one of cfp's numbers to a value worked out by hand, where the rest of the suite only
compared cfp with cfp or did not look."""
import dataclasses
import math

import numpy as np
import pytest

from cfp.layout import Layout
from cfp.perfmodel import LayerShape, MachineProfile, layer_cost, predict_bytes, redistribute_bytes

RATE = 1e10


def profile(ranks_per_node=4, inter_beta=None, itemsize=4, winograd_workspace=False):
    """alpha 0, beta 1 s/byte inside a node (inter_beta between nodes), one kernel rate; the
    kernels' workspace by the weight-and-patches bound alone unless winograd_workspace."""
    links = {"intra": {c: [0.0, 1.0] for c in ("allgather", "reduce_scatter", "allreduce", "alltoall")}}
    if inter_beta is not None:
        links["inter"] = {c: [0.0, inter_beta] for c in ("allgather", "reduce_scatter", "allreduce", "alltoall")}
    points = {"*": [[1e3, 8, RATE], [1e9, 4096, RATE]]}
    data = {"format": 2, "name": "test", "ranks_per_node": ranks_per_node, "links": links,
            "kernels": {p: points for p in ("forward", "backward-data", "backward-filter")},
            "winograd_workspace": winograd_workspace}
    if itemsize is not None:
        data["itemsize"] = itemsize
    return MachineProfile(data)


def test_a_profile_without_itemsize_prices_float32():
    assert profile(itemsize=None).itemsize == 4


def test_flops_and_output_size_by_hand():
    # 9 x 7 input, K 3, stride 2, padding 1, dilation 1: (9 + 2 - 3) // 2 + 1 = 5 rows,
    # (7 + 2 - 3) // 2 + 1 = 4 columns; flops 2 * 3 * (4 / 2) * 6 * 5 * 4 * 9 = 12960.
    layer = LayerShape("L", 3, 4, 6, 9, 7, 3, stride=2, padding=1, groups=2)
    assert layer.out_hw == (5, 4)
    assert layer.flops() == 12960
    assert layer.flops(1, 3, 2) == 2 * 1 * 3 * 2 * 5 * 4 * 9


def test_layer_cost_of_an_image_split_by_hand():
    """Data parallel on a 1 x 2 x 2 x 1 grid (sample, height, width, channel) of a 4 x 3 x 10 x 7
    batch, 5 filters 3 x 3, batch norm after: every number of the model worked out here."""
    layer = LayerShape("L", 4, 3, 5, 10, 7, 3, normed=True)
    cost = layer_cost(layer, "sample", 1, 1, profile(ranks_per_node=4, inter_beta=2.0), P_h=2, P_w=2)
    # Output 10 x 7; rank 0's block 5 x 4 (the first block the largest). Its windows read input
    # rows -1..5 and columns -1..4: 7 x 6 with the border's padding, the kernel's input. Of the
    # image, rows 0..5 and columns 0..4 (6 x 5 of its own 5 x 4); the most any rank needs, 6 of
    # 10 rows (rank 1: rows 4..9) and 5 of 7 columns (4 for columns 3..6).
    # flops of all 4 samples, 3 channels, 5 filters on its 20 of 70 output pixels: 21600.
    assert cost["compute"] == {k: pytest.approx(21600 / RATE, rel=1e-12)
                               for k in ("forward", "backward-filter", "backward-data")}
    # Gradient allreduce of 5 * 3 * 9 = 135 float32 over the 4 ranks, inside the node (4 <= 4):
    # 2 * 3 / 4 * 540 bytes = 810 s at 1 s/byte. Halo: 4 samples * 3 channels * (30 - 20)
    # pixels * 4 bytes = 480 received in an all-to-all over 4 (3/4 of the 640 it totals),
    # and as much again with dx.
    assert cost["comm"]["gradient-sync"] == pytest.approx(810, rel=1e-12)
    assert cost["comm"]["halo"] == pytest.approx(2 * 480, rel=1e-12)
    assert cost["comm"]["forward"] == cost["comm"]["backward-data"] == cost["comm"]["backward-filter"] == 0
    # Weights, gradients, one optimizer buffer: 540 each. Activations: x as kept for
    # backward-filter, its block with the halo (4 * 3 * 30), and y (4 * 5 * 20) in float32,
    # 3040, plus batch norm's x-hat and ReLU's mask (4 + 1 bytes per element of y), 2000.
    # Temporary: the partial y (400) and dx (4 * 3 * 30 = 360) in float32, 3040. Workspace:
    # three weight-sized buffers, 1620, and im2col patches 4 * 20 * 3 * 9 * 4 = 8640.
    assert cost["memory"] == {"weights": 540, "gradients": 540, "optimizer": 540,
                              "activations": 5040, "temporary": 3040, "workspace": 10260}
    assert cost["bytes"] == 19960
    # Batch norm's statistics: allreduces of 5, 5 and 10 float32 (80 bytes; its count comes from
    # the shapes) over the 4 ranks holding its channels, 2 * 3 / 4 * 80 = 120 s; the profile
    # times no layers.
    assert cost["layers"]["batchnorm"] == pytest.approx(120, rel=1e-12)
    assert cost["time"] == pytest.approx(3 * 21600 / RATE + 810 + 960 + 120, rel=1e-12)
    # One more rank than the node holds: the same allreduce between nodes at 2 s/byte.
    wide = layer_cost(layer, "sample", 1, 1, profile(ranks_per_node=3, inter_beta=2.0), P_h=2, P_w=2)
    assert wide["comm"]["gradient-sync"] == pytest.approx(1620, rel=1e-12)


def test_im2col_workspace_is_capped_at_4_mib():
    # 64 samples, 64 -> 64 channels of 32 x 32, K 3: patches would be 64 * 1024 * 64 * 9 * 4
    # bytes, capped at 4 MiB = 4194304; partial y and dx 2 * 64 * 64 * 1024 float32 and three
    # weight-sized buffers of 64 * 64 * 9 float32.
    layer = LayerShape("L", 64, 64, 64, 32, 32, 3)
    cost = layer_cost(layer, "sample", 1, 1, profile())
    assert cost["memory"]["temporary"] == 2 * 64 * 64 * 1024 * 4
    assert cost["memory"]["workspace"] == 3 * 64 * 64 * 9 * 4 + 4194304


@pytest.mark.parametrize("ranks_per_node,row_factor,column_factor", [(1, 10, 10), (2, 1, 10), (3, 10, 10),
                                                                    (4, 1, 1)])
def test_row_and_column_groups_inside_or_between_nodes(ranks_per_node, row_factor, column_factor):
    """Stationary-w on channel=4 with p_f = 2: the rows are ranks {0, 1} and {2, 3} (inside
    nodes of 2), the columns {0, 2} and {1, 3} (inside a node of 4). Nodes of 3 hold ranks
    {0, 1, 2} and {3}: the row {2, 3} and the column {1, 3} straddle them, and a collective
    lasts as long as its slowest group. Between nodes a byte costs 10 s, inside 1 s;
    predict_bytes gives the bytes (held to the ledger elsewhere)."""
    layer = LayerShape("L", 8, 16, 32, 6, 6, 3)
    sent = predict_bytes("w", (8, 16, 6, 6), (32, 16, 3, 3), {"sample": 1, "channel": 4},
                         {"sample": 0, "channel": 0}, 1, 1, filter_groups=2, bias=False, itemsize=4)
    cost = layer_cost(layer, "w", 1, 4, profile(ranks_per_node, inter_beta=10.0), 2)
    assert sent["backward-data"][0] > 0 and sent["backward-filter"][0] > 0
    assert cost["comm"]["backward-data"] == pytest.approx(row_factor * sent["backward-data"][0], rel=1e-12)
    assert cost["comm"]["backward-filter"] == pytest.approx(column_factor * sent["backward-filter"][0], rel=1e-12)


def test_redistribute_bytes_by_hand():
    """A 5 x 6 tensor from rows over 2 ranks (rows 0-2, 3-4) to columns over them (0-2, 3-5):
    rank 0 sends its rows 0-2 of columns 3-5 (9 elements) and receives rows 3-4 of columns 0-2
    (6); rank 1 the reverse."""
    grid = {"sample": 2}
    source, target = (grid, Layout(("sample", None))), (grid, Layout((None, "sample")))
    assert redistribute_bytes((5, 6), source, target, 0) == (72, 48)
    assert redistribute_bytes((5, 6), source, target, 1, itemsize=4) == (24, 36)


def test_collective_time_adds_the_local_packing():
    # allgather over 4 ranks of an 800-byte result at alpha 0, beta 1: 3/4 * 800 = 600 s of
    # messages, plus 0.25 s/byte of packing: 200 s; on one rank the packing alone.
    p = profile()
    p.packing = {"allgather": 0.25}
    assert p.collective_time("allgather", 4, 800) == pytest.approx(800.0, rel=1e-12)
    assert p.collective_time("allgather", 1, 800) == pytest.approx(200.0, rel=1e-12)


def test_grouped_convolution_shards_by_hand():
    """groups=4 (C 8, F 12: 2 channels and 3 filters a group) on channel=2: rank 0 owns
    groups 0-1, so 4 channels, 6 filters of 2 channels each: 6 * 2 * 9 = 108 weights."""
    layer = LayerShape("L", 2, 8, 12, 5, 5, 3, groups=4)
    cost = layer_cost(layer, "x", 1, 2, profile())
    assert cost["memory"]["weights"] == 108 * 4
    # activations: x (2 * 4 * 25) and y (2 * 6 * 25), float32
    assert cost["memory"]["activations"] == (200 + 300) * 4
    # flops: 2 samples, 2 channels each, 6 filters, 25 pixels, 9 taps, 2 flops each
    assert cost["compute"]["forward"] == pytest.approx(2 * 2 * 2 * 6 * 25 * 9 / RATE, rel=1e-12)


@pytest.mark.parametrize("channel_parts,expected", [(1, 1), (2, 1), (4, 2), (6, 2), (8, 2), (9, 3),
                                                    (12, 3), (16, 4)])
def test_default_filter_groups_by_hand(channel_parts, expected):
    from cfp.partition import default_filter_groups
    assert default_filter_groups(channel_parts) == expected


def test_filter_group_errors_name_the_divisors():
    from cfp.partition import check_filter_groups, default_filter_groups
    assert check_filter_groups(6, 3) == 2 and check_filter_groups(1, 1) == 1
    with pytest.raises(ValueError, match=r"expected one of \[1, 2, 3, 6\]$"):
        check_filter_groups(6, 4)
    with pytest.raises(ValueError, match="channel grid size"):
        default_filter_groups(0)


def test_predict_bytes_default_padding_is_zero():
    """Stationary-x, channel=2, rank 0, x (2, 4, 5, 5), w (6, 4, 3, 3), padding left out: y is
    (2, 6, 3, 3); rank 0's filters are 0-2 of 6, so y's reduce-scatter sends the other's 3 * 2 *
    9 = 54 partial sums and receives 54 for its own, and dy's allgather the same, float64."""
    none = (0, 0)
    assert predict_bytes("x", (2, 4, 5, 5), (6, 4, 3, 3), "channel=2", {"channel": 0}) == {
        "forward": (432, 432), "backward-data": none, "backward-filter": (432, 432),
        "gradient-sync": none, "halo": none, "redistribute": none}


@pytest.mark.parametrize("sample", [0, 1])
@pytest.mark.parametrize("height", [0, 1])
def test_halo_bytes_by_hand(sample, height):
    """Data parallel on sample=2 x height=2, x (2, 1, 4, 4), w (1, 1, 3, 3), padding 1: each
    rank holds one sample's 2 rows of 4 and needs 1 row of 4 from its neighbour in height,
    float64: 32 bytes out and 32 in, whichever the rank, and as many again when dx's halo
    goes back."""
    for need_dx, expected in ((False, (32, 32)), (True, (64, 64))):
        sent = predict_bytes("sample", (2, 1, 4, 4), (1, 1, 3, 3), "sample=2,height=2",
                             {"sample": sample, "height": height}, padding=1, bias=False, need_dx=need_dx)
        assert sent["halo"] == expected


def test_halo_bytes_of_a_grid_split_by_width_only():
    """width=2 and no height axis: rank 1 holds columns 2-3 of 4 and needs column 1, 4 rows of
    one sample and channel, float64, forward and back with dx."""
    sent = predict_bytes("sample", (1, 1, 4, 4), (1, 1, 3, 3), "width=2", {"width": 1}, padding=1,
                         bias=False)
    assert sent["halo"] == (64, 64)


def test_a_cosine_schedule_of_one_step():
    """total_steps = 1 is allowed: lr 0.5 at step 0, min_lr 0.1 from step 1 on."""
    import numpy as np

    from cfp.optim import SGD, CosineLR
    from cfp.nn.module import Parameter
    opt = SGD([Parameter("w", np.zeros(2), (2,))], lr=0.5)
    schedule = CosineLR(opt, total_steps=1, min_lr=0.1)
    assert schedule.lr_at(0) == pytest.approx(0.5, rel=1e-12)
    assert schedule.lr_at(1) == pytest.approx(0.1, rel=1e-12)
    assert schedule.lr_at(5) == pytest.approx(0.1, rel=1e-12)


def test_conv_output_shape_default_padding_is_zero():
    from cfp.kernels import conv2d_output_shape
    assert tuple(conv2d_output_shape((2, 3, 5, 6), (4, 3, 3, 3))) == (2, 4, 3, 4)


def test_pointwise_convolution_against_einsum():
    """A 1 x 1 convolution (cfp's fast path: x is its own patch matrix) in all three passes,
    float64, against sums written out with einsum."""
    import numpy as np

    from cfp.kernels import conv2d_backward_data, conv2d_backward_filter, conv2d_forward
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((3, 4, 5, 6)), rng.standard_normal((2, 4, 1, 1))
    dy = rng.standard_normal((3, 2, 5, 6))
    np.testing.assert_allclose(conv2d_forward(x, w), np.einsum("nchw,fc->nfhw", x, w[:, :, 0, 0]),
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(conv2d_backward_data(dy, w, x.shape),
                               np.einsum("nfhw,fc->nchw", dy, w[:, :, 0, 0]), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(conv2d_backward_filter(x, dy, w.shape),
                               np.einsum("nchw,nfhw->fc", x, dy)[:, :, None, None], rtol=1e-12, atol=1e-12)


def test_max_and_average_pooling_with_padding_by_hand():
    """2 x 2 windows, stride 2, padding 1 on a 3 x 3 input 1..9: windows of the padded 5 x 5
    (only 4 x 4 of it is read), so a 2 x 2 output; max pads with -inf, average counts the
    zeros of the padding."""
    import numpy as np

    from cfp.kernels.pool import avg_pool2d_forward, max_pool2d_forward
    x = np.arange(1.0, 10.0).reshape(1, 1, 3, 3)
    y = max_pool2d_forward(x, 2, 2, 1)
    y = y[0] if isinstance(y, tuple) else y
    np.testing.assert_array_equal(y, [[[[1.0, 3.0], [7.0, 9.0]]]])
    np.testing.assert_allclose(avg_pool2d_forward(x, 2, 2, 1), [[[[0.25, (2 + 3) / 4], [(4 + 7) / 4, 28 / 4]]]],
                               rtol=1e-12)


def test_backward_data_of_an_input_zero_columns_wide():
    # x (2, 3, 4, 0) padded by 1 and 2: the output (2, 5, 4, 2) is not empty, but no input
    # position exists, so dx is (2, 3, 4, 0) (the early return, not a division by W = 0).
    from cfp.kernels import conv2d_backward_data
    dy = np.ones((2, 5, 4, 2))
    dx = conv2d_backward_data(dy, np.ones((5, 3, 3, 3)), (2, 3, 4, 0), padding=(1, 2))
    assert dx.shape == (2, 3, 4, 0) and dx.dtype == np.float64


def test_ledger_keeps_the_last_result_and_totals_by_hand():
    from cfp.comm import CommLedger
    ledger = CommLedger(keep_results=True)
    a, b, c = np.array([1.0]), np.array([2.0]), np.array([3.0])
    ledger.record("allgather", 2, 10, 20, 0.5, a)
    ledger.record("allgather", 2, 30, 40, 0.25, b)
    ledger.record("alltoall", 4, 7, 0, 1.0, None, wait_seconds=0.125, pack_seconds=0.0625)
    ledger.keep_result(c)  # replaces the last record's result only
    assert [None if r is None else float(r[0]) for r in ledger.results] == [1.0, 2.0, 3.0]
    totals = ledger.totals(by=("collective",))
    assert totals == {("allgather",): {"calls": 2, "bytes_sent": 40, "bytes_received": 60, "seconds": 0.75,
                                       "wait_seconds": 0.0, "pack_seconds": 0.0, "staged_to_host": 0,
                                       "staged_to_device": 0},
                      ("alltoall",): {"calls": 1, "bytes_sent": 7, "bytes_received": 0, "seconds": 1.0,
                                      "wait_seconds": 0.125, "pack_seconds": 0.0625, "staged_to_host": 0,
                                      "staged_to_device": 0}}
    # the top row by transfer time, one row for the rest, the total
    lines = ledger.summary(by=("collective",), top=1).splitlines()
    assert lines[1].split() == ["alltoall", "1", "7", "B", "0", "B", "1.0000", "0.1250", "0.0625"]
    assert lines[2].split() == ["(1", "more", "row)", "2", "40", "B", "60", "B", "0.7500", "0.0000", "0.0000"]
    assert lines[3].split() == ["total", "3", "47", "B", "60", "B", "1.7500", "0.1250", "0.0625"]
    assert len(ledger.summary(by=("collective",)).splitlines()) == 3  # every row, no total


def test_staged_bytes_are_totalled_and_shown_only_when_there_are_some():
    from cfp.comm import CommLedger
    ledger = CommLedger()
    ledger.record("allgather", 2, 10, 20, 0.5, staged=(1024, 2048))
    ledger.record("allgather", 2, 30, 40, 0.25, staged=(1024, 0))
    (total,) = ledger.totals(by=("collective",)).values()
    assert (total["staged_to_host"], total["staged_to_device"]) == (2048, 2048)
    header, row = ledger.summary(by=("collective",)).splitlines()
    assert header.split()[-6:] == ["staged", "(to", "host", "/", "to", "device)"] and row.split()[-5:] == \
        ["2.0", "KiB", "/", "2.0", "KiB"]
    plain = CommLedger()
    plain.record("allgather", 2, 10, 20, 0.5)
    assert "staged" not in plain.summary(by=("collective",))


def test_gather_shapes_takes_eight_dimensions_and_describes_them():
    from mpi4py import MPI

    from cfp.comm import MAX_NDIM, describe_shapes, gather_shapes
    assert MAX_NDIM == 8
    row = gather_shapes(MPI.COMM_SELF, np.zeros((1, 2, 1, 1, 1, 1, 1, 3), dtype=np.float32))
    assert row.tolist() == [[8, np.dtype(np.float32).num, 1, 2, 1, 1, 1, 1, 1, 3]]
    with pytest.raises(ValueError, match="more than 8 dimensions"):
        gather_shapes(MPI.COMM_SELF, np.zeros((1,) * 9))
    rows = np.full((2, 10), -1, dtype=np.int64)
    rows[0, :4] = [2, np.dtype(np.float64).num, 2, 3]
    rows[1, :3] = [1, np.dtype(np.float32).num, 4]
    assert describe_shapes(rows) == "rank 0: (2, 3) float64; rank 1: (4,) float32"


def _self_grid(spec="sample=1,channel=1"):
    from mpi4py import MPI

    from cfp.grid import ProcessGrid
    return ProcessGrid(spec, comm=MPI.COMM_SELF)


def test_halo_plan_of_an_empty_output_block_by_hand():
    # 3x3 input, 3x3 kernel, padding 1: 3 output rows over 4 height ranks, 1, 1, 1 and 0.
    # Rank c computes row c and reads input rows c-1..c+1, clipped to 0..2, the rest padding.
    from cfp.halo import halo_plan
    plan = halo_plan((1, 1, 3, 3), Layout(("sample", None, "height", "width")),
                     (("sample", 1), ("height", 4), ("width", 1)), (3, 3), (("padding", 1),))
    assert plan["spans"]["height"] == [(1, range(0, 2), 1, 0, None), (1, range(0, 3), 0, 0, None),
                                       (1, range(1, 3), 0, 1, None), (0, range(0), 0, 0, None)]
    assert plan["spans"]["width"] == [(3, range(0, 3), 1, 1, None)]


def test_which_messages_a_first_layer_sends():
    # stationary-y's first layer (input whole, no dx): no allgather of x, no reduce-scatter of
    # dx, the gradient allreduce only; a later layer sends all three.
    from cfp.algorithms import make_conv
    grid = _self_grid()
    first = make_conv("y", grid, 4, 6, 3, input_whole=True, need_dx=False)
    later = make_conv("y", grid, 4, 6, 3)
    assert [(m.phase, m.collective) for m in first.messages] == [
        ("forward", "allgather"), ("gradient-sync", "allreduce"), ("backward-data", "reduce_scatter")]
    assert [first.sends(m) for m in first.messages] == [False, True, False]
    assert [later.sends(m) for m in later.messages] == [True, True, True]
    grid.free()


def test_batch_norm_default_eps_is_1e_5():
    # channel 0 holds 0.00, 0.01, 0.02, 0.03 (mean 0.015, biased variance 1.25e-4), channel 1
    # 1, 1, 3, 3 (mean 2, variance 1): y = (x - mean) / sqrt(variance + 1e-5).
    from cfp.nn import BatchNorm2d
    grid = _self_grid()
    bn = BatchNorm2d(grid, 2, dtype=np.float64)
    x = np.array([[[[0.00, 0.01]], [[1.0, 1.0]]], [[[0.02, 0.03]], [[3.0, 3.0]]]])  # (2, 2, 1, 2)
    y = bn.forward(x)
    d0 = np.array([-0.015, -0.005, 0.005, 0.015]) / np.sqrt(1.25e-4 + 1e-5)
    d1 = np.array([-1.0, -1.0, 1.0, 1.0]) / np.sqrt(1.0 + 1e-5)
    np.testing.assert_allclose(y[:, 0].reshape(-1), d0, rtol=1e-12)
    np.testing.assert_allclose(y[:, 1].reshape(-1), d1, rtol=1e-12)
    grid.free()


def test_a_network_of_flatten_and_a_layer_named_loss():
    # Flatten's output is 2-D (n, C*H*W), and place() drops only its own 'loss' Redistribute,
    # not a layer of the model that happens to bear the name: logits = x.reshape(2, 12) @ W^T + b.
    from cfp.nn import Flatten, Linear, Network
    grid = _self_grid("sample=1")
    flat, linear = Flatten(), Linear(grid, 12, 3, algorithm="sample", name="loss", dtype=np.float64)
    spec = (grid, Layout(("sample", None, None, None)))
    assert flat.output_spec(spec) == (grid, Layout(("sample", None)))
    net = Network([flat, linear], grids=None, layers={})
    net.place(net.input_spec)  # placing again changes nothing
    assert net.modules == [flat, linear]
    x = np.arange(24.0).reshape(2, 3, 2, 2) / 10
    W = linear.weight.data.reshape(3, 12)
    b = linear.bias.data
    expected = np.array([[sum(x.reshape(2, 12)[n, k] * W[f, k] for k in range(12)) + b[f] for f in range(3)]
                         for n in range(2)])
    np.testing.assert_allclose(net.forward(x), expected, rtol=1e-12)


def test_conv_padding_as_four_sides_and_its_refusals():
    from cfp.kernels import conv2d_forward, conv2d_output_shape
    # (top, bottom, left, right) = (0, 0, 1, 1): a 3x3 input, 3x3 kernel gives 1 x 3
    assert conv2d_output_shape((1, 1, 3, 3), (1, 1, 3, 3), padding=(0, 0, 1, 1)) == (1, 1, 1, 3)
    # all ones: the three windows cover 6, 9 and 6 ones
    y = conv2d_forward(np.ones((1, 1, 3, 3)), np.ones((1, 1, 3, 3)), padding=(0, 0, 1, 1))
    np.testing.assert_allclose(y, [[[[6.0, 9.0, 6.0]]]], rtol=1e-13)  # Winograd rounds 1e-16 off
    # replicate padding of an input of no columns has nothing to replicate, with rows or not
    with pytest.raises(ValueError, match="'replicate' cannot pad an empty 3x0 input"):
        conv2d_output_shape((1, 1, 3, 0), (1, 1, 1, 1), padding=1, padding_mode="replicate")
    # a dilated kernel too large for the input is reported with its dilation and extent
    with pytest.raises(ValueError, match=r"kernel 3x3 with dilation \(1, 2\) \(extent 3x5\) does not fit"):
        conv2d_output_shape((1, 1, 4, 4), (1, 1, 3, 3), dilation=(1, 2))


def test_reference_loop_defaults_to_stride_1():
    from cfp.kernels.conv_reference import conv2d_forward_loop
    # all ones, 3x3 input, 2x2 kernel, stride 1: four windows of four ones
    np.testing.assert_array_equal(conv2d_forward_loop(np.ones((1, 1, 3, 3)), np.ones((1, 1, 2, 2))),
                                  np.full((1, 1, 2, 2), 4.0))


def test_max_pool_ties_go_to_the_first_maximum():
    from cfp.kernels.pool import max_pool2d_backward, max_pool2d_forward
    # one 2x2 window of equal values: the maximum at (0, 0) gets the gradient (PyTorch's choice)
    x = np.full((1, 1, 2, 2), 5.0)
    y, argmax = max_pool2d_forward(x, 2, 2)
    assert y.tolist() == [[[[5.0]]]] and argmax.tolist() == [[[[0]]]]
    dx = max_pool2d_backward(np.array([[[[1.0]]]]), argmax, x.shape, 2, 2)
    np.testing.assert_array_equal(dx, [[[[1.0, 0.0], [0.0, 0.0]]]])


def test_parameter_full_index_and_batch_norm_layouts():
    from cfp.nn import BatchNorm2d
    from cfp.nn.module import Parameter
    grid = _self_grid()
    p = Parameter("p", np.zeros((3, 4)), (3, 4), None, grid)
    assert p.full_index() == (range(3), range(4))
    p.index = (None, [1, 2])  # a shard of columns 1 and 2
    assert p.full_index() == (range(3), [1, 2])
    with pytest.raises(ValueError, match="batch norm takes NCHW activations split by sample"):
        BatchNorm2d(grid, 2, layout=Layout((None, "channel", None, None)))
    grid.free()


def test_first_layer_exchanges_its_halo_once():
    # as test_layer_cost_of_an_image_split_by_hand, but the network's first layer: no dx, so
    # the halo's 480 bytes are received once, not again with dx
    layer = LayerShape("L", 4, 3, 5, 10, 7, 3, normed=True, first=True)
    cost = layer_cost(layer, "sample", 1, 1, profile(ranks_per_node=4, inter_beta=2.0), P_h=2, P_w=2)
    assert cost["comm"]["halo"] == pytest.approx(480, rel=1e-12)


def test_pooling_padding_and_defaults_by_hand():
    from cfp.kernels.pool import avg_pool2d_forward, max_pool2d_forward
    x = np.arange(16.0).reshape(1, 1, 4, 4)
    # default padding 0: the four 2x2 windows' means
    np.testing.assert_array_equal(avg_pool2d_forward(x, 2, 2), [[[[2.5, 4.5], [10.5, 12.5]]]])
    # a 3x3 window over a 1x1 input padded by 1 fits exactly: its maximum is the input
    np.testing.assert_array_equal(max_pool2d_forward(np.full((1, 1, 1, 1), 7.0), 3, 1, padding=1)[0],
                                  [[[[7.0]]]])
    # padding the top only, (1, 0, 0, 0), with a 2x2 window of stride 2: rows (pad, 0), (1, 2)
    y, _ = max_pool2d_forward(x, 2, 2, padding=(1, 0, 0, 0))
    np.testing.assert_array_equal(y, [[[[1.0, 3.0], [9.0, 11.0]]]])


def test_inputs_checked_restores_checking_and_layers_still_check_blocks():
    from cfp import comm
    from cfp.tensor import check_blocks
    assert comm.checking()
    with comm.inputs_checked():
        assert not comm.checking()
    assert comm.checking()
    grid = _self_grid("sample=1")
    with comm.tag(layer="L"):  # collectives trust a layer's inputs; check_blocks does not
        with pytest.raises(ValueError, match="they are 2-D, the layout is 3-D"):
            check_blocks(np.zeros((2, 3)), Layout(("sample", None, None)), grid, "x")
    grid.free()


def test_replicate_padding_and_winograd_with_a_short_last_block():
    from cfp.kernels import conv2d_forward
    from cfp.kernels import winograd
    # replicate padding of all ones is all ones: every 3x3 window sums 9 ones
    y = conv2d_forward(np.ones((1, 1, 3, 3)), np.ones((1, 1, 3, 3)), padding=1, padding_mode="replicate")
    np.testing.assert_array_equal(y, np.full((1, 1, 3, 3), 9.0))
    # Winograd on 32x32 images takes 1024 // 256 = 4 samples a block: 5 samples make a short last
    # block; 3x3 all-ones filters on all-ones images give 9 inside, 6 on edges, 4 at corners
    x = np.ones((5, 1, 32, 32))
    expected = np.full((32, 32), 9.0)
    expected[0, :] = expected[-1, :] = expected[:, 0] = expected[:, -1] = 6.0
    expected[0, 0] = expected[0, -1] = expected[-1, 0] = expected[-1, -1] = 4.0
    with winograd():
        y = conv2d_forward(x, np.ones((1, 1, 3, 3)), padding=1)
    np.testing.assert_allclose(y, np.broadcast_to(expected, (5, 1, 32, 32)), rtol=1e-12)


def test_alltoall_and_bias_refusals_name_the_shapes():
    from mpi4py import MPI

    from cfp import comm
    from cfp.algorithms import make_conv
    # 3 rows where the split sizes sum to 2 (the concatenation extent, 2, is right)
    with pytest.raises(ValueError, match=r"alltoall: rank 0 holds shape \(3, 2\); expected extent 2 along axis 0"):
        comm.alltoall(MPI.COMM_SELF, np.zeros((3, 2)), 0, 1, [2], [2])
    grid = _self_grid()
    conv = make_conv("sample", grid, 1, 5, 3)
    with pytest.raises(ValueError, match=r"bias shard has shape \(3,\), expected \(5,\)"):
        conv.check_input(np.zeros((2, 1, 4, 4)), np.zeros((5, 1, 3, 3)), np.zeros(3))
    grid.free()


def test_winograd_takes_3x3_kernels_only():
    # with Winograd on, 4x3 and 3x4 kernels still go by im2col: against the loop reference
    from cfp.kernels import conv2d_forward
    from cfp.kernels import winograd
    from cfp.kernels.conv_reference import conv2d_forward_loop
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 2, 6, 6))
    for kernel in ((4, 3), (3, 4), (3, 3)):
        w = rng.standard_normal((3, 2) + kernel)
        with winograd():
            y = conv2d_forward(x, w, padding=1)
        np.testing.assert_allclose(y, conv2d_forward_loop(x, w, padding=1), rtol=1e-10, atol=1e-12)


def test_a_profile_without_measured_points_is_refused():
    for kernels in ({}, {"3": []}):
        data = profile().data
        data = dict(data, kernels={p: kernels for p in ("forward", "backward-data", "backward-filter")})
        with pytest.raises(ValueError, match=r"missing or malformed 'kernels.forward \(no measured points\)'"):
            MachineProfile(data)


def test_a_missing_profile_names_the_builtin_ones():
    with pytest.raises(ValueError, match=r"\(built-in profiles: cpu-dev, reference-v100\)$"):
        MachineProfile.load("no-such-profile")


def _rates(points):
    """A profile whose kernels of every pass and path run at the rates of `points`."""
    return MachineProfile(dict(profile().data, kernels={
        p: {"*": points} for p in ("forward", "backward-data", "backward-filter")}))


def test_kernel_rate_between_points_by_hand():
    """Inverse-distance weights 1 / d^2 over the 3 nearest points in (log flops, log pixels):
    at 1e7 flops over 256 pixels, the points at 1e6 and 1e8 flops (256 pixels) are ln 10 away,
    1e10 is 3 ln 10 away and 1e12 (the fourth) is left out. Weights 1, 1, 1/9 of the log rates
    9, 11 and 12 (in ln 10): the rate is 10 ** ((9 + 11 + 12 / 9) / (2 + 1 / 9)) = 10 ** (192 / 19)."""
    p = _rates([[1e6, 256, 1e9], [1e8, 256, 1e11], [1e10, 256, 1e12], [1e12, 256, 1e6]])
    assert p.kernel_time("forward", "*", 1e7, 256) == pytest.approx(1e7 / 10 ** (192 / 19), rel=1e-12)


def test_kernel_rate_at_the_largest_measured_flops_interpolates_over_pixels():
    """At exactly the largest measured flops (1e8) but 16x its pixels the shape is inside the
    measured range: the two points weigh 1 / d^2, d = ln 16 (pixels only) and 2 ln 10 (flops only)."""
    p = _rates([[1e6, 256, 1e9], [1e8, 16, 1e11]])
    d_near, d_far = math.log(16), 2 * math.log(10)
    w_near, w_far = 1 / d_near ** 2, 1 / d_far ** 2
    log_rate = (w_near * math.log(1e11) + w_far * math.log(1e9)) / (w_near + w_far)
    assert p.kernel_time("forward", "*", 1e8, 256) == pytest.approx(1e8 / math.exp(log_rate), rel=1e-12)
    # beyond the range the nearest point's rate holds
    assert p.kernel_time("forward", "*", 1e9, 256) == pytest.approx(1e9 / 1e11, rel=1e-12)


def test_halo_of_a_strided_layer_by_hand():
    """Stride 2, padding 1, a 12 x 12 image over 2 x 2 ranks: the output is 6 x 6, rank 0's
    block 3 x 3, whose windows read min(12, (3 - 1) * 2 + 3) = 7 rows and 7 columns of the
    input, of which it holds 6 x 6. 2 samples x 3 channels x 13 halo pixels x 4 bytes = 312
    received at 1 s/byte, and as much again with dx."""
    layer = LayerShape("L", 2, 3, 4, 12, 12, 3, stride=2, padding=1)
    cost = layer_cost(layer, "sample", 1, 1, profile(), P_h=2, P_w=2)
    assert cost["comm"]["halo"] == pytest.approx(2 * 312, rel=1e-12)


def test_conv_options_keeps_four_sided_padding():
    from cfp.kernels.conv import conv_options
    assert conv_options(padding=(1, 2, 0, 3))["padding"] == (1, 2, 0, 3)
    assert conv_options(padding=(1, 2))["padding"] == (1, 2)


def test_padding_modes_at_the_edge_pytorch_accepts():
    """Reflection up to one less than the input, wrap-around up to the whole input, replication
    of any size: the output shapes by hand (a 5 x 4 input, a 3 x 3 kernel)."""
    from cfp.kernels import conv2d_output_shape
    assert conv2d_output_shape((1, 1, 5, 4), (1, 1, 3, 3), padding=(4, 3), padding_mode="reflect") == (1, 1, 11, 8)
    assert conv2d_output_shape((1, 1, 5, 4), (1, 1, 3, 3), padding=(1, 0), padding_mode="reflect") == (1, 1, 5, 2)
    assert conv2d_output_shape((1, 1, 5, 4), (1, 1, 3, 3), padding=(5, 4), padding_mode="circular") == (1, 1, 13, 10)
    assert conv2d_output_shape((1, 1, 5, 4), (1, 1, 3, 3), padding=7, padding_mode="replicate") == (1, 1, 17, 16)


class _Ranks:
    """A stand-in for a communicator of `size` ranks, seen from `rank`: what each collective
    receives from the others is scripted, and the calls are recorded."""

    def __init__(self, size, rank=0):
        self.size, self.rank, self.calls = size, rank, []

    def Get_size(self):
        return self.size

    def Get_rank(self):
        return self.rank

    def Allgather(self, mine, every):  # every rank passes what this one does
        every[...] = mine

    def Barrier(self):  # the ledger's wait probe before each collective: nothing to script
        pass


def test_alltoallv_inside_inputs_checked_sends_no_count_check():
    """Trusted (inside comm.inputs_checked) a 2-rank alltoallv is one Alltoallv; checked, the
    counts are agreed first (an Alltoall and an Allgather)."""
    from cfp import comm as C

    class TwoRanks(_Ranks):  # each peer sends what this rank sends it
        def Alltoall(self, send, recv):
            self.calls.append("Alltoall")
            recv[...] = send

        def Allgather(self, send, recv):
            self.calls.append("Allgather")
            recv[...] = send

        def Alltoallv(self, send, recv):
            self.calls.append("Alltoallv")
            recv[0][...] = send[0]

    chunks = [np.arange(2.0), np.arange(3.0)]
    trusted, checked = TwoRanks(2), TwoRanks(2)
    with C.inputs_checked():
        out = C.alltoallv(trusted, chunks, [2, 3], np.float64)
    assert trusted.calls == ["Alltoallv"] and [o.tolist() for o in out] == [[0, 1], [0, 1, 2]]
    C.alltoallv(checked, chunks, [2, 3], np.float64)
    assert checked.calls == ["Alltoall", "Allgather", "Alltoallv"]
    ledger = C.CommLedger()
    with C.use_ledger(ledger), C.inputs_checked():  # trusted: no check waited, the barrier took ~0 s
        C.alltoallv(TwoRanks(2), chunks, [2, 3], np.float64)
    assert 0.0 <= ledger.records[0].wait_seconds < 0.5


def test_assemble_takes_shards_that_cover_the_tensor_and_refuses_a_gap():
    """tensor.assemble (a checkpoint's shards in hand): pieces by their index sets (None: all
    of a dimension), copies may repeat; a gap is refused, naming how much is covered."""
    from cfp.tensor import assemble
    whole = np.arange(12.0).reshape(3, 4)
    pieces = [(([0, 1], None), whole[:2]), (([2], [0, 1]), whole[2:, :2]), (([2], [2, 3]), whole[2:, 2:]),
              (([0], None), whole[:1])]
    np.testing.assert_array_equal(assemble((3, 4), pieces, np.float64), whole)
    with pytest.raises(ValueError, match=r"the shards cover 10 of the 12 entries of a tensor of shape \(3, 4\)"):
        assemble((3, 4), pieces[:2], np.float64)


def test_filter_groups_each_algorithm_declares():
    from cfp.algorithms import algorithm_class

    def filter_groups_of(algorithm, channel_parts, given=None, groups=1):
        return algorithm_class(algorithm, groups).filter_groups(channel_parts, given)
    assert filter_groups_of("w", 4, 4) == 4 and filter_groups_of("w", 4, 1) == 1 and filter_groups_of("w", 4) == 2
    assert filter_groups_of("y", 4) == 4 and filter_groups_of("x", 4) == 1 and filter_groups_of("sample", 4) == 1
    assert filter_groups_of("y", 4, groups=2) == 4 and filter_groups_of("w", 4, groups=2) == 2
    for fixed in ("sample", "x", "y"):  # only stationary-w chooses a p_f
        with pytest.raises(ValueError, match=f"applies to algorithm 'w' only, not '{fixed}'"):
            filter_groups_of(fixed, 4, 2)
    with pytest.raises(ValueError, match=r"p_f=3 does not divide the channel grid size P_c=4; expected one of \[1, 2, 4\]"):
        filter_groups_of("w", 4, 3)


def test_message_bytes_counts_the_backward_data_by_default():
    """message_bytes' need_dx defaults to True, like predict_bytes': the stationary-y rank of
    test_predict_bytes_by_hand reduce-scatters dx (1200 bytes out, 800 in)."""
    from cfp.perfmodel import message_bytes
    moved = {m.phase: (s, r) for m, s, r in message_bytes(
        "y", (4, 5, 5, 5), (4, 5, 3, 3), "sample=2,channel=2", {"sample": 1, "channel": 1}, padding=1)}
    assert moved["backward-data"] == (1200, 800) and moved["forward"] == (800, 1200)
    # bias=True by default: the 2 filters' 90 weights and 2 biases, 46 out and 46 back
    assert moved["gradient-sync"] == (736, 736)


def test_a_grid_without_a_channel_axis_splits_no_channels():
    """Stationary-y on 'sample=2' (no channel axis: one channel rank) gathers nothing; its
    gradient, 4 * 5 * 9 + 4 = 184 float64, is allreduced over the 2 sample ranks: 92 values
    out in the reduce-scatter and 92 in the allgather, 1472 bytes each way."""
    moved = predict_bytes("y", (4, 5, 5, 5), (4, 5, 3, 3), "sample=2", {"sample": 0}, padding=1)
    assert moved["forward"] == moved["backward-data"] == (0, 0)
    assert moved["gradient-sync"] == (1472, 1472)


def test_gradient_allreduce_of_a_rank_below_the_top_of_the_image():
    """Data parallel on height=4, the rank at height 1: the 2 * 2 * 9 + 2 = 38 weights in
    blocks of 10, 10, 9 and 9; it keeps block 1 (10), sends the other 28 in the reduce-scatter
    and its 10 to 3 ranks in the allgather: 58 float32 each way, 232 bytes."""
    moved = predict_bytes("sample", (2, 2, 12, 5), (2, 2, 3, 3), "height=4", {"height": 1}, padding=1, itemsize=4)
    assert moved["gradient-sync"] == (232, 232)


def test_redistribute_bytes_of_uneven_pieces_by_hand():
    """A 5 x 7 tensor from rows over 2 ranks (0-2, 3-4) to columns (0-3, 4-6): rank 0 keeps rows
    0-2 of columns 0-3 (12), sends rows 0-2 of columns 4-6 (9), receives rows 3-4 of 0-3 (8)."""
    grid = {"sample": 2}
    source, target = (grid, Layout(("sample", None))), (grid, Layout((None, "sample")))
    assert redistribute_bytes((5, 7), source, target, 0) == (72, 64)
    assert redistribute_bytes((5, 7), source, target, 1) == (64, 72)


def test_ledger_bytes_of_every_layer_and_of_one():
    from cfp import comm as C
    from cfp.perfmodel import ledger_bytes
    ledger = C.CommLedger()
    with C.use_ledger(ledger):
        with C.tag(layer="c1", phase="forward"):
            C.get_ledger().record("allgather", 2, 100, 200, 0.0)
        with C.tag(layer="c2", phase="forward"):
            C.get_ledger().record("allgather", 2, 10, 20, 0.0)
        with C.tag(layer="c2", phase="gradient-sync"):
            C.get_ledger().record("allreduce", 2, 5, 5, 0.0)
    every = ledger_bytes(ledger)
    assert every["forward"] == (110, 220) and every["gradient-sync"] == (5, 5) and every["halo"] == (0, 0)
    assert ledger_bytes(ledger, "c1")["forward"] == (100, 200) and ledger_bytes(ledger, "c1")["gradient-sync"] == (0, 0)


def test_layer_shapes_are_immutable():
    import dataclasses
    layer = LayerShape("L", 2, 3, 4, 5, 5, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layer.N = 4
    assert {layer: 1}[LayerShape("L", 2, 3, 4, 5, 5, 3)] == 1


def test_grouped_filter_parallel_activations_by_hand():
    """groups=4 (C 8, F 12) on channel=2 under stationary-y: rank 0's 2 groups are 4 input
    channels (2 * 4 * 25) and 6 filters (2 * 6 * 25) of activations, float32."""
    layer = LayerShape("L", 2, 8, 12, 5, 5, 3, groups=4)
    assert layer_cost(layer, "y", 1, 2, profile())["memory"]["activations"] == (200 + 300) * 4


def test_gradient_group_inside_or_between_nodes():
    """sample=2 x channel=2 on nodes of 2 ranks: the grid spans 2 nodes, so the gradient
    allreduce (over the 2 sample ranks) is priced between nodes, at 3 s/byte against 1."""
    layer = LayerShape("L", 8, 16, 32, 6, 6, 3)
    inside = layer_cost(layer, "x", 2, 2, profile(ranks_per_node=4, inter_beta=3.0))
    between = layer_cost(layer, "x", 2, 2, profile(ranks_per_node=2, inter_beta=3.0))
    assert inside["comm"]["gradient-sync"] > 0
    assert between["comm"]["gradient-sync"] == pytest.approx(3 * inside["comm"]["gradient-sync"], rel=1e-12)


def test_adam_weight_decay_of_one_by_hand():
    """One step from p = -2 with gradient 1, lr 0.1. Adam with weight decay 1: the gradient
    becomes 1 + 1 * (-2) = -1, and the first bias-corrected step moves p by lr * g / (|g| + eps):
    -2 + 0.1 / (1 + 1e-8). AdamW decays p by 1 - lr * 1 first: -1.8, then steps with g = 1."""
    from cfp.nn.module import Parameter
    from cfp.optim import Adam, AdamW
    for make, expected in ((lambda ps: Adam(ps, lr=0.1, weight_decay=1.0), -2 + 0.1 / (1 + 1e-8)),
                           (lambda ps: AdamW(ps, lr=0.1, weight_decay=1.0), -1.8 - 0.1 / (1 + 1e-8))):
        p = Parameter("p", np.array([-2.0]), (1,))
        opt = make([p])
        p.grad = np.array([1.0])
        opt.step()
        assert p.data[0] == pytest.approx(expected, rel=1e-14, abs=0)


def test_adamw_decays_by_1e_2_by_default():
    from cfp.nn.module import Parameter
    from cfp.optim import AdamW
    p = Parameter("p", np.array([-2.0]), (1,))
    opt = AdamW([p], lr=0.1)
    p.grad = np.array([1.0])
    opt.step()
    assert p.data[0] == pytest.approx(-2 * (1 - 0.1 * 1e-2) - 0.1 / (1 + 1e-8), rel=1e-14, abs=0)


def test_message_bytes_defaults_to_stride_1_no_padding_no_dilation_one_group():
    """Stationary-x on channel=2, rank 0, x (3, 4, 4, 4), w (5, 4, 3, 3) with every option left
    out: y is (3, 5, 2, 2); y's reduce-scatter sends the other's 2 filters (2 * 3 * 4 = 24
    values) and receives 3 * 3 * 4 = 36 for its own, float64."""
    from cfp.perfmodel import message_bytes
    moved = {m.phase: (s, r) for m, s, r in message_bytes("x", (3, 4, 4, 4), (5, 4, 3, 3), "channel=2",
                                                          {"channel": 0})}
    assert moved["forward"] == (192, 288) and moved["backward-filter"] == (288, 192)


def test_grouped_gradient_without_bias_by_hand():
    """groups=2, w (4, 2, 3, 3) on sample=2 x channel=2 under stationary-x, no bias: each channel
    rank owns one group, 2 filters * 2 * 9 = 36 weights, allreduced over the 2 sample ranks:
    18 out in the reduce-scatter and 18 in the allgather, 288 bytes each way."""
    moved = predict_bytes("x", (4, 4, 5, 5), (4, 2, 3, 3), "sample=2,channel=2", {"sample": 0, "channel": 0},
                          padding=1, groups=2, bias=False)
    assert moved["gradient-sync"] == (288, 288)


def test_halo_of_an_even_kernel_goes_one_way_and_comes_back():
    """A 2x2 kernel without padding on height=2: x (1, 1, 4, 3), output rows 0-2 in blocks 0-1
    and 2. Rank 0's outputs read input rows 0-2, so it receives row 2 (3 values) from rank 1 and,
    with dx, sends it back; rank 1 needs nothing: (24, 24) bytes and (24, 24)."""
    for height, expected in ((0, (24, 24)), (1, (24, 24))):
        moved = predict_bytes("sample", (1, 1, 4, 3), (1, 1, 2, 2), "height=2", {"height": height})
        assert moved["halo"] == expected, height


def test_layer_shape_pads_half_the_kernel_by_default():
    assert LayerShape("L", 1, 1, 1, 7, 7, 5).out_hw == (7, 7)
    assert LayerShape("L", 1, 1, 1, 7, 7, 3, dilation=2).out_hw == (7, 7)


def test_kernel_time_of_no_work_and_of_two_number_points():
    p = profile()
    assert p.kernel_time("forward", "*", 0, 64) == 0.0
    two = _rates([[1e6, 1e9], [1e8, 1e11]])  # [flops, rate] points: no pixel count
    assert two.kernel_time("forward", "*", 1e6, 999) == pytest.approx(1e6 / 1e9, rel=1e-12)
    assert two.kernel_time("forward", "*", 1e8) == pytest.approx(1e8 / 1e11, rel=1e-12)


def test_kernel_rate_at_the_smallest_measured_flops_interpolates_over_pixels():
    """As at the largest: at exactly the smallest measured flops (1e6) but 1/16 of its pixels
    the two points weigh 1 / (ln 16)^2 and 1 / (2 ln 10)^2."""
    p = _rates([[1e6, 256, 1e9], [1e8, 16, 1e11]])
    w_near, w_far = 1 / math.log(16) ** 2, 1 / (2 * math.log(10)) ** 2
    log_rate = (w_near * math.log(1e9) + w_far * math.log(1e11)) / (w_near + w_far)
    assert p.kernel_time("forward", "*", 1e6, 16) == pytest.approx(1e6 / math.exp(log_rate), rel=1e-12)


def test_the_model_reads_the_kernel_rate_at_the_layers_pixels():
    """A 2 x 3 x 5 x 5 batch, 4 filters 3x3: 10800 flops a pass over 2 * 5 * 5 = 50 output
    pixels, exactly a measured point, so its rate (1e9) holds; the other points, at 1e6 pixels,
    would pull any other pixel count towards 1e12."""
    rates = _rates([[10800, 50, 1e9], [1e3, 1e6, 1e12], [1e9, 1e6, 1e12]])
    cost = layer_cost(LayerShape("L", 2, 3, 4, 5, 5, 3), "sample", 1, 1, rates)
    assert cost["compute"] == {k: pytest.approx(10800 / 1e9, rel=1e-12)
                               for k in ("forward", "backward-filter", "backward-data")}


def test_two_groups_on_two_channel_ranks_by_hand():
    """groups=2 (C 4, F 6) on channel=2 under stationary-x: rank 0 owns group 0, 3 filters of 2
    channels (3 * 2 * 9 = 54 weights); activations x 2 * 2 * 25 and y 2 * 3 * 25, float32."""
    cost = layer_cost(LayerShape("L", 2, 4, 6, 5, 5, 3, groups=2), "x", 1, 2, profile())
    assert cost["memory"]["weights"] == 54 * 4 and cost["memory"]["activations"] == (100 + 150) * 4


def test_halo_of_a_height_split_with_a_strided_kernel_by_hand():
    """A 1 x 1 x 8 x 6 image, K 3, stride 2, no padding, over height=2: the output is 3 x 2, rank
    0's block 2 rows, whose windows read (2 - 1) * 2 + 3 = 5 rows of all 6 columns; it holds 4
    rows: 6 halo values, 24 bytes in, and as much again with dx."""
    layer = LayerShape("L", 1, 1, 1, 8, 6, 3, stride=2, padding=0)
    cost = layer_cost(layer, "sample", 1, 1, profile(), P_h=2, P_w=1)
    assert cost["comm"]["halo"] == pytest.approx(2 * 24, rel=1e-12)


def test_a_winograd_layers_workspace_is_what_its_passes_ask_for():
    """A float32 3x3 layer on cfp's kernels: the workspace its largest Winograd pass asks for
    (cfp.kernels.workspace_bytes on the rank's shard: 2 samples of 16x16, 32 tiles, 16 channels, the 12 of
    24 filters of channel rank 0 under stationary-y), not the bound; without its backward-data
    as a first layer; the bound where no pass takes Winograd (groups 2, float64)."""
    from cfp.kernels import workspace_bytes
    layer = LayerShape("L", 4, 16, 24, 16, 16, 3)
    cost = layer_cost(layer, "y", 2, 2, profile(winograd_workspace=True))
    passes = workspace_bytes((2, 16, 16, 16), (12, 16, 3, 3), "float32", padding=1)
    assert sorted(passes) == ["backward-data", "backward-filter", "forward"]
    assert cost["memory"]["workspace"] == max(passes.values())
    first = layer_cost(dataclasses.replace(layer, first=True), "y", 2, 2, profile(winograd_workspace=True))
    assert first["memory"]["workspace"] == max(passes["forward"], passes["backward-filter"])
    bound = layer_cost(layer, "y", 2, 2, profile())["memory"]["workspace"]
    assert bound == 3 * 12 * 16 * 9 * 4 + 2 * 256 * 16 * 9 * 4
    for other in (dataclasses.replace(layer, groups=2), layer):
        itemsize = 8 if other is layer else 4
        same = layer_cost(other, "y", 2, 2, profile(winograd_workspace=True, itemsize=itemsize))
        assert same["memory"]["workspace"] == layer_cost(other, "y", 2, 2, profile(itemsize=itemsize))["memory"]["workspace"]
    from cfp.kernels import winograd
    with winograd(True):  # float64 by Winograd too (CFP_WINOGRAD=1): its passes in 8-byte values
        forced = workspace_bytes((2, 16, 16, 16), (12, 16, 3, 3), "float64", padding=1)
        cost64 = layer_cost(layer, "y", 2, 2, profile(winograd_workspace=True, itemsize=8))
    assert cost64["memory"]["workspace"] == max(forced.values()) > max(passes.values())
    # cfp's own kernels unless a profile says otherwise (the reference GPU profile models cuDNN)
    data = dict(profile().data)
    del data["winograd_workspace"]
    assert MachineProfile(data).winograd_workspace and MachineProfile.load("cpu-dev").winograd_workspace
    assert not MachineProfile.load("reference-v100").winograd_workspace


def test_a_first_layer_computes_no_dx_and_keeps_no_input_copy():
    """The first layer (no dx): no backward-data time; its temporary memory is the partial y
    (2 * 4 * 25 float32) without a dx, its workspace three weight-sized buffers (3 * 108 * 4)
    and the patches (2 * 25 * 3 * 9 * 4)."""
    layer = LayerShape("L", 2, 3, 4, 5, 5, 3, first=True)
    cost = layer_cost(layer, "sample", 1, 1, profile())
    assert cost["compute"]["backward-data"] == 0.0 and cost["compute"]["forward"] > 0
    assert cost["memory"]["temporary"] == 2 * 4 * 25 * 4
    assert cost["memory"]["workspace"] == 3 * 108 * 4 + 2 * 25 * 3 * 9 * 4


def test_reflect_padding_as_wide_as_the_input_is_refused():
    from cfp.kernels import conv2d_output_shape
    with pytest.raises(ValueError, match=r"padding \(0, 0, 2, 2\) .* with padding_mode 'reflect' must be smaller than the input 5x2"):
        conv2d_output_shape((1, 1, 5, 2), (1, 1, 3, 3), padding=(0, 2), padding_mode="reflect")


def test_sgd_without_momentum_has_no_buffers_to_restore():
    from cfp.nn.module import Parameter
    from cfp.optim import SGD
    p = Parameter("p", np.array([1.0]), (1,))
    opt = SGD([p], lr=0.5)
    p.grad = np.array([2.0])
    opt.step()
    assert p.data[0] == 0.0
    again = SGD([Parameter("p", np.array([0.0]), (1,))], lr=0.5)
    again.load_state_dict(opt.state_dict())


def test_sgd_weight_decay_of_one_by_hand():
    """p = 1, gradient 2, weight decay 1, lr 0.5: the step uses 2 + 1 * 1 = 3, so p = -0.5."""
    from cfp.nn.module import Parameter
    from cfp.optim import SGD
    p = Parameter("p", np.array([1.0]), (1,))
    opt = SGD([p], lr=0.5, weight_decay=1.0)
    p.grad = np.array([2.0])
    opt.step()
    assert p.data[0] == -0.5


def test_adam_defaults_and_a_zero_first_beta():
    """Adam's default lr is 1e-3 (as torch); beta1 = 0 is allowed (m is the last gradient)."""
    from cfp.nn.module import Parameter
    from cfp.optim import Adam
    p = Parameter("p", np.array([1.0]), (1,))
    assert Adam([p]).lr == 1e-3
    opt = Adam([p], lr=0.1, betas=(0.0, 0.999))
    p.grad = np.array([2.0])
    opt.step()
    assert p.data[0] == pytest.approx(1 - 0.1 * 2 / (2 + 1e-8), rel=1e-14, abs=0)


def test_three_groups_on_two_channel_ranks_by_hand():
    """groups=3 (C 6, F 6) on channel=2: the busiest rank, 0, owns groups 0-1, 4 filters of 2
    channels: 4 * 2 * 9 = 72 weights, float32."""
    cost = layer_cost(LayerShape("L", 2, 6, 6, 5, 5, 3, groups=3), "x", 1, 2, profile())
    assert cost["memory"]["weights"] == 72 * 4


def test_stationary_w_column_filters_of_the_busiest_rank_by_hand():
    """Stationary-w on channel=4, p_f=2, C 8 and F 7: rank 0 gathers the channels of its row
    {0, 1} (4 of 8) and computes the filters of its column {0, 2}, blocks 0 and 2 of
    [2, 2, 2, 1]: 4. Forward flops 2 * 2 * 4 * 4 * 25 * 9."""
    cost = layer_cost(LayerShape("L", 2, 8, 7, 5, 5, 3), "w", 1, 4, profile(), p_f=2)
    assert cost["compute"]["forward"] == pytest.approx(2 * 2 * 4 * 4 * 25 * 9 / RATE, rel=1e-12)


def test_halo_of_a_width_split_with_a_strided_kernel_by_hand():
    """test_halo_of_a_height_split_with_a_strided_kernel_by_hand turned on its side: 6 x 8 over
    width=2, 5 of 8 columns read by rank 0's 2 output columns, of all 6 rows; it holds 4."""
    layer = LayerShape("L", 1, 1, 1, 6, 8, 3, stride=2, padding=0)
    cost = layer_cost(layer, "sample", 1, 1, profile(), P_h=1, P_w=2)
    assert cost["comm"]["halo"] == pytest.approx(2 * 24, rel=1e-12)


def test_conv_flops_default_to_no_padding():
    from cfp.kernels import conv2d_flops
    assert conv2d_flops((1, 1, 5, 5), (1, 1, 3, 3)) == 2 * 9 * 9


def test_the_winograd_switch_runs_winograd(monkeypatch):
    """with winograd(): a 3x3 stride-1 layer goes by the Winograd forward (after any padding
    mode), with winograd(None), the default, only in float32; an exception inside the block
    still propagates (and the switch is restored)."""
    from cfp.kernels import conv2d_forward, settings
    from cfp.kernels.conv import paths
    calls = []
    spied = tuple(p._replace(forward=lambda *a, real=p.forward: calls.append(1) or real(*a))
                  if p.name == "winograd" else p for p in paths.PATHS)
    monkeypatch.setattr(paths, "PATHS", spied)
    x, w = np.ones((32, 9, 4, 4)), np.ones((3, 9, 3, 3))  # 32 tiles, 9 channels: Winograd's by default
    with settings.winograd():
        conv2d_forward(x, w, padding=1)
        assert calls == [1]
        conv2d_forward(x, w, padding=1, padding_mode="circular")  # padded first, then Winograd
        assert calls == [1, 1]
        conv2d_forward(x, w, padding=1, stride=2)  # not stride 2
        assert calls == [1, 1]
    with settings.winograd(False):
        conv2d_forward(x, w, padding=1)
    assert calls == [1, 1]
    with settings.winograd(None):  # the default: float32 layers only
        conv2d_forward(x, w, padding=1)
        assert calls == [1, 1]
        conv2d_forward(x.astype(np.float32), w.astype(np.float32), padding=1)
        assert calls == [1, 1, 1]
    before = settings.current()
    with pytest.raises(KeyError):
        with settings.winograd(not before.winograd):
            raise KeyError("inside")
    assert settings.current() == before


def test_convolutions_of_no_channels_are_zeros():
    from cfp.kernels import conv2d_backward_data, conv2d_backward_filter, conv2d_forward
    x, w, dy = np.zeros((2, 0, 4, 4)), np.zeros((3, 0, 3, 3)), np.ones((2, 3, 4, 4))
    np.testing.assert_array_equal(conv2d_forward(x, w, np.ones(3), padding=1), np.ones((2, 3, 4, 4)))
    assert conv2d_backward_data(dy, w, x.shape, padding=1).shape == (2, 0, 4, 4)
    assert conv2d_backward_filter(x, dy, w.shape, padding=1).shape == (3, 0, 3, 3)


def test_pooling_padded_on_one_side_by_hand():
    """(top, bottom, left, right) = (1, 0, 0, 0): max pooling of 2x2 windows, stride 2, of a 3x4
    input gets a -inf row on top; a refusal names the padded size (with a row at the bottom)."""
    from cfp.kernels.pool import avg_pool2d_backward, max_pool2d_forward
    x = np.arange(12.0).reshape(1, 1, 3, 4)
    y, _ = max_pool2d_forward(x, 2, 2, (1, 0, 0, 0))
    np.testing.assert_array_equal(y, [[[[1.0, 3.0], [9.0, 11.0]]]])
    with pytest.raises(ValueError, match="pooling window 5 is larger than the padded input 4x4"):
        max_pool2d_forward(x, 5, 1, (0, 1, 0, 0))
    # average pooling's backward defaults to no padding: each of the 4 values of a 2x2 window
    # gets a quarter of its dy
    np.testing.assert_array_equal(avg_pool2d_backward(np.ones((1, 1, 1, 2)), (1, 1, 2, 4), 2, 2),
                                  np.full((1, 1, 2, 4), 0.25))


def test_ledger_records_are_frozen_and_results_kept_only_on_request():
    import dataclasses
    from cfp import comm as C
    ledger = C.CommLedger()
    assert ledger.results is None and C.CommLedger(keep_results=True).results == []
    with C.use_ledger(ledger):
        C.get_ledger().record("allgather", 2, 1, 2, 0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ledger.records[0].bytes_sent = 5


def test_agreement_ignores_only_the_free_axis():
    """Two ranks with (3, 4) and (5, 4) blocks agree along axis 0 (the free axis) and not along
    axis 1; (3, 4) and (3, 5) the other way round."""
    from cfp import comm as C

    class TwoRanks(_Ranks):  # rank 1's block has the shape `other`
        def __init__(self, other):
            super().__init__(2)
            self.other = other

        def Allgather(self, mine, every):
            every[...] = mine
            every[1, 2:4] = self.other

    x = np.zeros((3, 4))
    C._agree(TwoRanks((5, 4)), x, "allgather", free_axis=0)
    with pytest.raises(ValueError, match=r"allgather: the ranks' arrays differ in dtype or shape \(except along axis 1\)"):
        C._agree(TwoRanks((5, 4)), x, "allgather", free_axis=1)
    C._agree(TwoRanks((3, 5)), x, "allgather", free_axis=1)
    with pytest.raises(ValueError, match="rank 0: \\(3, 4\\) float64; rank 1: \\(3, 5\\) float64"):
        C._agree(TwoRanks((3, 5)), x, "allgather", free_axis=0)


@pytest.mark.parametrize("padding,mode,message", [
    ((5, 0), "reflect", "with padding_mode 'reflect' must be smaller than the input 5x5"),
    ((0, 5), "reflect", "with padding_mode 'reflect' must be smaller than the input 5x5"),
    ((6, 0), "circular", "wraps around the input 5x5 more than once"),
    ((0, 6), "circular", "wraps around the input 5x5 more than once"),
])
def test_padding_too_wide_along_one_axis_is_refused(padding, mode, message):
    from cfp.kernels import conv2d_output_shape
    with pytest.raises(ValueError, match=message):
        conv2d_output_shape((1, 1, 5, 5), (1, 1, 3, 3), padding=padding, padding_mode=mode)


def test_replicate_pads_an_input_of_one_row():
    from cfp.kernels import conv2d_forward, conv2d_output_shape
    assert conv2d_output_shape((1, 1, 1, 4), (1, 1, 3, 3), padding=1, padding_mode="replicate") == (1, 1, 1, 4)
    # one row 0 1 2 3, replicated above and below: each 3x3 window of ones sums 3 columns 3 times
    y = conv2d_forward(np.arange(4.0).reshape(1, 1, 1, 4), np.ones((1, 1, 3, 3)), padding=1, padding_mode="replicate")
    np.testing.assert_allclose(y, [[[[3 * (0 + 0 + 1), 3 * 3, 3 * 6, 3 * (2 + 3 + 3)]]]], rtol=1e-13)


def test_ledger_reset_clears_records_and_kept_results():
    from cfp import comm as C
    for keep in (False, True):
        ledger = C.CommLedger(keep_results=keep)
        with C.use_ledger(ledger):
            C.get_ledger().record("allgather", 2, 1, 2, 0.0, np.ones(3))
        assert len(ledger.records) == 1 and (ledger.results is None or len(ledger.results) == 1)
        ledger.reset()
        assert ledger.records == [] and ledger.results == ([] if keep else None)


def test_checking_trusts_layers_unless_asked_not_to():
    from cfp import comm as C
    assert C.checking() and C.checking(layer_trusted=False)
    with C.tag(layer="c1", phase="forward"):
        assert not C.checking() and C.checking(layer_trusted=False)


def test_agreement_is_skipped_inside_inputs_checked():
    from cfp import comm as C

    class Counting(_Ranks):
        def Allgather(self, mine, every):
            self.calls.append("Allgather")
            every[...] = mine
    two = Counting(2)
    with C.inputs_checked():
        C._agree(two, np.zeros(3), "allgather")
    assert two.calls == []
    C._agree(two, np.zeros(3), "allgather")
    assert two.calls == ["Allgather"]


def test_displacements_of_three_blocks():
    from cfp import comm as C
    assert C._displacements(np.array([2, 3, 4])).tolist() == [0, 2, 5]


def test_timer_measures_the_time_inside():
    import time
    from cfp import comm as C
    with C._Timer() as t:
        time.sleep(0.01)
    assert 0.005 < t.seconds < 5


class _Alltoallw(_Ranks):
    """A stand-in whose Alltoallw carries out each message with the real datatypes and byte
    displacements cfp passes, on this process: the message from rank s is what `sends(s, spec)`
    returns, a contiguous array, received through the receive spec's datatype for s."""

    def Alltoallw(self, send, recv):
        from mpi4py import MPI
        buf, (counts, displs), types = recv
        whole = buf.reshape(-1).view(np.uint8)
        for s in range(self.size):
            if counts[s]:
                message = np.ascontiguousarray(self.sends(s, send))
                MPI.COMM_SELF.Sendrecv([message, MPI.Datatype.fromcode(message.dtype.char)], 0,
                                       recvbuf=[whole[displs[s]:], counts[s], types[s]], source=0)

    @staticmethod
    def read(spec, destination):
        """What `spec` (a send spec) sends `destination`: its datatype read at its displacement."""
        from mpi4py import MPI
        buf, (counts, displs), types = spec
        out = np.empty(types[destination].Get_size() // buf.itemsize * counts[destination], buf.dtype)
        whole = buf.reshape(-1).view(np.uint8)
        MPI.COMM_SELF.Sendrecv([whole[displs[destination]:], counts[destination], types[destination]], 0,
                               recvbuf=[out, MPI.Datatype.fromcode(out.dtype.char)], source=0)
        return out


def test_allgather_of_three_ranks_interleaves_the_blocks():
    """A (2, 1) block on each of 3 ranks along axis 1 (a sample axis before it): the result is
    (2, 3), column r from rank r, each block received into its interleaved place."""
    from cfp import comm as C

    class Three(_Alltoallw):
        def sends(self, s, spec):  # rank s holds this rank's block plus 10 s
            return self.read(spec, s) + 10 * s
    out = C.allgather(Three(3), np.array([[1.0], [2.0]]), axis=1, sizes=[1, 1, 1])
    np.testing.assert_array_equal(out, [[1, 11, 21], [2, 12, 22]])

    class Uneven(_Alltoallw):  # blocks of 1, 0 and 2 columns; this is rank 2
        def sends(self, s, spec):
            return {0: np.array([[5.0], [6.0]]), 2: self.read(spec, s)}[s]
    uneven = C.allgather(Uneven(3, rank=2), np.array([[1.0, 2.0], [3.0, 4.0]]), axis=1, sizes=[1, 0, 2])
    np.testing.assert_array_equal(uneven, [[5, 1, 2], [6, 3, 4]])


def test_reduce_scatter_of_three_ranks_sends_each_rank_its_block():
    """Rank 1 of 3 keeps column 1 of a (2, 3) sum: every other rank sends it its column 1 (as
    this rank's datatype for rank 1 reads it: 2 values, not columns 1-2), which it adds to its own."""
    from cfp import comm as C

    class Three(_Alltoallw):
        def sends(self, s, spec):  # every rank has the same summand: what this one would send rank 1
            buf, (counts, displs), types = spec
            return self.read((buf, ([1] * 3, displs), types), self.rank)
    x = np.arange(6.0).reshape(2, 3)
    out = C.reduce_scatter(Three(3, rank=1), x, axis=1, sizes=[1, 1, 1])
    np.testing.assert_array_equal(out, 3 * x[:, 1:2])


def test_alltoallv_needs_a_chunk_and_a_count_per_rank():
    from cfp import comm as C
    with pytest.raises(ValueError, match="alltoallv needs one chunk and one count per rank of a group of 2"):
        C.alltoallv(_Ranks(2), [np.zeros(1), np.zeros(1)], [1, 1, 1], np.float64)
    with pytest.raises(ValueError, match="alltoallv needs one chunk and one count per rank of a group of 2"):
        C.alltoallv(_Ranks(2), [np.zeros(1)], [1, 1], np.float64)


def test_alltoall_names_the_ranks_dtypes():
    from cfp import comm as C

    class OtherDtype(_Ranks):
        def Alltoall(self, send, recv):
            recv[...] = send

        def Allgather(self, mine, every):
            every[...] = mine
            every[1, 0] = np.dtype(np.float32).num
    with pytest.raises(ValueError, match="alltoall: the ranks exchange different dtypes: rank 0 float64, rank 1 float32$"):
        C.alltoallv(OtherDtype(2), [np.zeros(1), np.zeros(1)], [1, 1], np.float64)


def test_kept_bytes_before_and_after_forward():
    from cfp.algorithms import make_conv
    grid = _self_grid()
    conv = make_conv("sample", grid, 2, 3, 3, padding=1)
    assert conv.kept_bytes == 0
    conv.forward(np.zeros((4, 2, 5, 5)), np.zeros((3, 2, 3, 3)), np.zeros(3))
    assert conv.kept_bytes == 4 * 2 * 5 * 5 * 8
    grid.free()


def test_shards_of_three_channel_ranks_gather_back_in_place():
    """DistTensor.gather of a bias (7,) over channel=3 (blocks of 3, 2 and 2; rank 0 holds
    [1, 2, 3], ranks 1 and 2 send [4, 5] and [6, 7], scripted) puts each block at its place:
    rank 0 sends its block to every other rank and keeps it in its result without sending it
    to itself, and what arrives is split back by the senders' block sizes."""
    import types
    from cfp import comm as C
    from cfp.tensor import DistTensor, Layout

    class Three(_Ranks):
        def Alltoallv(self, send, recv):
            (sendbuf, (send_counts, _)), (recvbuf, (recv_counts, _)) = send, recv
            self.calls.append((sendbuf.tolist(), list(send_counts), list(recv_counts)))
            recvbuf[...] = np.arange(4.0, 8.0)  # nothing from itself
    comm = Three(3)
    grid = types.SimpleNamespace(shape={"channel": 3}, coords={"channel": 0}, rank=0, size=3, comm=comm)
    with C.inputs_checked():  # no count agreement: only the exchange is scripted
        whole = DistTensor(np.array([1.0, 2.0, 3.0]), (7,), Layout(("channel",)), grid).gather()
    assert whole.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert comm.calls == [([1, 2, 3] * 2, [0, 3, 3], [0, 2, 2])]


def test_conv_options_defaults():
    from cfp.kernels.conv import conv_options
    assert conv_options() == {"stride": (1, 1), "padding": (0, 0), "dilation": (1, 1), "groups": 1,
                              "padding_mode": "zeros"}


@pytest.mark.parametrize("tile", [None, 2, 4])
def test_empty_convolutions_under_every_path(tile):
    """No channels, samples or filters, with Winograd on or off: zeros (the bias where there are
    filters and no channels) of the right shapes."""
    from cfp.kernels import conv2d_backward_data, conv2d_backward_filter, conv2d_forward, winograd
    with winograd(tile is not None, tile=tile):
        for N, C, F in ((2, 0, 3), (0, 2, 3), (2, 2, 0)):
            x, w, dy = np.ones((N, C, 4, 4)), np.ones((F, C, 3, 3)), np.ones((N, F, 4, 4))
            np.testing.assert_array_equal(conv2d_forward(x, w, np.ones(F), padding=1),
                                          np.ones((N, F, 4, 4)) * (C == 0))
            np.testing.assert_array_equal(conv2d_backward_data(dy, w, x.shape, padding=1), np.zeros((N, C, 4, 4)))
            np.testing.assert_array_equal(conv2d_backward_filter(x, dy, w.shape, padding=1), np.zeros((F, C, 3, 3)))


def test_reference_backward_filter_defaults_to_no_padding():
    from cfp.kernels.conv_reference import conv2d_backward_filter_loop
    # a 3x3 kernel over a 3x3 input of ones has one output; its gradient 1 reaches every tap
    np.testing.assert_array_equal(conv2d_backward_filter_loop(np.ones((1, 1, 3, 3)), np.ones((1, 1, 1, 1)),
                                                              (1, 1, 3, 3)), np.ones((1, 1, 3, 3)))


def test_max_pooling_padded_at_the_bottom_only_by_hand():
    from cfp.kernels.pool import max_pool2d_forward
    # rows 11..8, 7..4, 3..0 and a -inf row below: windows of rows 0-1 and of row 2 with the padding
    y, _ = max_pool2d_forward(np.arange(12.0)[::-1].reshape(1, 1, 3, 4), 2, 2, (0, 1, 0, 0))
    np.testing.assert_array_equal(y, [[[[11.0, 9.0], [3.0, 1.0]]]])


def test_batch_norm_running_variance_of_two_values_by_hand():
    """Two values per channel, 1 and 3: mean 2, biased variance 1, unbiased 2 (n - 1 = 1); the
    running variance moves from 1 by momentum 0.1 towards 2: 1.1; the running mean to 0.2."""
    from cfp.nn import BatchNorm2d
    grid = _self_grid()
    bn = BatchNorm2d(grid, 1, name="bn", dtype=np.float64)
    bn.forward(np.array([1.0, 3.0]).reshape(2, 1, 1, 1))
    assert bn.running_var.data[0] == pytest.approx(1.1, rel=1e-15)
    assert bn.running_mean.data[0] == pytest.approx(0.2, rel=1e-15)
    grid.free()


def test_max_pooling_padded_on_the_right_only_by_hand():
    from cfp.kernels.pool import max_pool2d_forward
    # one row 3, 2, 1 and a -inf column on the right: 1x2 windows need 2 rows, so 2 rows of
    # 5, 4, 3 over 3, 2, 1: windows of columns 0-1 and of column 2 with the padding
    x = np.array([[[[5.0, 4.0, 3.0], [3.0, 2.0, 1.0]]]])
    y, _ = max_pool2d_forward(x, 2, 2, (0, 0, 0, 1))
    np.testing.assert_array_equal(y, [[[[5.0, 3.0]]]])


def test_conv_geometry_defaults_to_stride_1_and_no_padding():
    from cfp.kernels.conv import conv_geometry
    g = conv_geometry((1, 1, 5, 6), (1, 1, 3, 3))
    assert (g.Ho, g.Wo, g.pt, g.pb, g.pl, g.pr, g.sh, g.sw) == (3, 4, 0, 0, 0, 0, 1, 1)


def test_replicate_cannot_pad_an_input_of_no_rows():
    from cfp.kernels import conv2d_output_shape
    with pytest.raises(ValueError, match="'replicate' cannot pad an empty 0x3 input"):
        conv2d_output_shape((1, 1, 0, 3), (1, 1, 1, 1), padding=1, padding_mode="replicate")


def test_an_undilated_kernel_too_large_is_named_without_dilation():
    from cfp.kernels import conv2d_output_shape
    with pytest.raises(ValueError, match=r"^kernel 3x3 does not fit the padded input 2x2 "):
        conv2d_output_shape((1, 1, 2, 2), (1, 1, 3, 3))


def test_reference_backward_data_defaults_to_stride_1():
    from cfp.kernels.conv_reference import conv2d_backward_data_loop
    # 2x2 kernel of ones over a 3x3 input, stride 1: dy of ones (2x2) reaches the centre 4 times
    dx = conv2d_backward_data_loop(np.ones((1, 1, 2, 2)), np.ones((1, 1, 2, 2)), (1, 1, 3, 3))
    np.testing.assert_array_equal(dx, [[[[1, 2, 1], [2, 4, 2], [1, 2, 1]]]])


def test_pooling_windows_larger_than_one_side_are_refused():
    from cfp.kernels.pool import max_pool2d_forward
    with pytest.raises(ValueError, match="pooling window 3 is larger than the padded input 2x5"):
        max_pool2d_forward(np.zeros((1, 1, 2, 5)), 3, 1)
    with pytest.raises(ValueError, match="pooling window 5 is larger than the padded input 3x5"):
        max_pool2d_forward(np.zeros((1, 1, 3, 4)), 5, 1, (0, 0, 0, 1))


def test_activation_layout_splits_only_the_axes_the_grid_splits():
    from cfp.layout import activation_layout
    one = {"sample": 2, "height": 1, "width": 1, "channel": 1}
    assert activation_layout(one, "channel") == Layout(("sample", "channel", None, None))
    assert activation_layout(dict(one, height=2), None) == Layout(("sample", None, "height", None))
    assert activation_layout(dict(one, width=2), None) == Layout(("sample", None, None, "width"))


def test_a_linear_layer_called_on_its_own_by_hand():
    """Outside a container (no input_shape): y = x w^T + b for the (n, C) input."""
    from cfp.nn import Linear
    grid = _self_grid()
    fc = Linear(grid, 3, 2, algorithm="sample", dtype=np.float64)
    fc.weight.data[...] = np.arange(6.0).reshape(2, 3, 1, 1)
    fc.bias.data[...] = [1.0, -1.0]
    y = fc.forward(np.array([[1.0, 0.0, 2.0]]))
    np.testing.assert_array_equal(y, [[0 + 0 + 4 + 1, 3 + 0 + 10 - 1]])
    grid.free()


def test_reflect_padding_of_a_one_row_input_along_its_columns():
    """Reflection along W of a 1 x 3 input (nothing to reflect along H): no division by a zero
    period, and the columns 1 | 0 1 2 | 1 by hand."""
    import warnings
    from cfp.kernels import conv2d_forward
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = conv2d_forward(np.array([[[[0.0, 1.0, 2.0]]]]), np.ones((1, 1, 1, 3)), padding=(0, 1),
                           padding_mode="reflect")
    np.testing.assert_array_equal(y, [[[[1 + 0 + 1, 0 + 1 + 2, 1 + 2 + 1]]]])


def test_reference_backward_filter_defaults_to_stride_1():
    from cfp.kernels.conv_reference import conv2d_backward_filter_loop
    # a 3x3 kernel over a 4x4 input of ones at stride 1 has 2x2 outputs: each tap sums 4 ones
    np.testing.assert_array_equal(conv2d_backward_filter_loop(np.ones((1, 1, 4, 4)), np.ones((1, 1, 2, 2)),
                                                              (1, 1, 3, 3)), np.full((1, 1, 3, 3), 4.0))


def test_backward_data_of_one_pixel_by_hand():
    from cfp.kernels import conv2d_backward_data
    dx = conv2d_backward_data(np.full((1, 1, 1, 1), 3.0), np.full((1, 1, 1, 1), 2.0), (1, 1, 1, 1))
    np.testing.assert_array_equal(dx, [[[[6.0]]]])


def test_a_residual_block_on_bare_arrays_by_hand():
    """Without layouts (NumPy blocks): y = relu(x) + x, dx = dy (x > 0) + dy."""
    from cfp.nn import ReLU, Residual, Sequential
    x, dy = np.array([[-1.0, 2.0]]), np.array([[10.0, 20.0]])
    block = Residual(Sequential(ReLU()))
    np.testing.assert_array_equal(block.forward(x), [[-1.0, 4.0]])
    np.testing.assert_array_equal(block.backward(dy), [[10.0, 40.0]])


def test_conv2d_default_seed_is_0():
    from cfp.nn import Conv2d
    grid = _self_grid()
    a, b = Conv2d(grid, 2, 3, 3, name="c"), Conv2d(grid, 2, 3, 3, name="c", seed=0)
    np.testing.assert_array_equal(a.weight.data, b.weight.data)
    assert not np.array_equal(a.weight.data, Conv2d(grid, 2, 3, 3, name="c", seed=1).weight.data)
    grid.free()


def test_halo_plan_of_a_block_in_the_padding_only_by_hand():
    # 2 columns padded by 1 on the left and 5 on the right, 2x2 kernel: 7 output columns over
    # 2 width ranks, 4 and 3. Rank 0 reads padded columns -1..3: image columns 0..1, one zero
    # column before and two after; rank 1 reads 3..6, all beyond the image: four zero columns.
    from cfp.halo import halo_plan
    plan = halo_plan((1, 1, 1, 2), Layout(("sample", None, "height", "width")),
                     (("sample", 1), ("height", 1), ("width", 2)), (1, 2), (("padding", (0, 0, 1, 5)),))
    assert plan["spans"]["width"] == [(4, range(0, 2), 1, 2, None), (3, range(2, 2), 0, 4, None)]
    # and the mirror image: rank 0 reads only the padding before the image
    plan = halo_plan((1, 1, 1, 2), Layout(("sample", None, "height", "width")),
                     (("sample", 1), ("height", 1), ("width", 2)), (1, 2), (("padding", (0, 0, 5, 1)),))
    assert plan["spans"]["width"] == [(4, range(0, 0), 5, 0, None), (3, range(0, 2), 1, 1, None)]
    # further in: rank 0 reads padded columns -6..-2, five zero columns and none of the image
    plan = halo_plan((1, 1, 1, 2), Layout(("sample", None, "height", "width")),
                     (("sample", 1), ("height", 1), ("width", 2)), (1, 2), (("padding", (0, 0, 6, 1)),))
    assert plan["spans"]["width"] == [(4, range(0, 0), 5, 0, None), (4, range(0, 2), 2, 1, None)]


def test_halo_plan_of_two_empty_output_blocks_by_hand():
    # 2x3 input, 3x3 kernel, padding 1: 2 output rows over 4 height ranks, 1, 1, 0 and 0.
    from cfp.halo import halo_plan
    plan = halo_plan((1, 1, 2, 3), Layout(("sample", None, "height", "width")),
                     (("sample", 1), ("height", 4), ("width", 1)), (3, 3), (("padding", 1),))
    assert plan["spans"]["height"] == [(1, range(0, 2), 1, 0, None), (1, range(0, 2), 0, 1, None),
                                       (0, range(0), 0, 0, None), (0, range(0), 0, 0, None)]


def test_check_input_names_a_weight_or_bias_of_another_dtype():
    from cfp.algorithms import make_conv
    grid = _self_grid()
    conv = make_conv("sample", grid, 1, 2, 3)
    x = np.zeros((1, 1, 4, 4))
    with pytest.raises(ValueError, match="weight shard has dtype float32, x has float64; expected one dtype for both"):
        conv.check_input(x, np.zeros((2, 1, 3, 3), np.float32), np.zeros(2))
    with pytest.raises(ValueError, match="bias shard has dtype float32, x has float64"):
        conv.check_input(x, np.zeros((2, 1, 3, 3)), np.zeros(2, np.float32))
    grid.free()


def test_depthwise_blocks_of_samples_with_a_short_last_one():
    """32 channels of 62x62 (64x64 padded) make blocks of 2 samples: with 3 samples the last
    block has 1. The result equals the samples convolved one at a time."""
    from cfp.kernels import conv2d_backward_data, conv2d_backward_filter, conv2d_forward
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((3, 32, 62, 62)), rng.standard_normal((32, 1, 3, 3))
    dy = rng.standard_normal((3, 32, 62, 62))
    kw = {"padding": 1, "groups": 32}
    y = conv2d_forward(x, w, **kw)
    dx = conv2d_backward_data(dy, w, x.shape, **kw)
    dw = conv2d_backward_filter(x, dy, w.shape, **kw)
    for n in range(3):
        np.testing.assert_allclose(y[n:n + 1], conv2d_forward(x[n:n + 1], w, **kw), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(dx[n:n + 1], conv2d_backward_data(dy[n:n + 1], w, x[n:n + 1].shape, **kw),
                                   rtol=1e-12, atol=1e-12)
    dw_each = sum(conv2d_backward_filter(x[n:n + 1], dy[n:n + 1], w.shape, **kw) for n in range(3))
    np.testing.assert_allclose(dw, dw_each, rtol=1e-10, atol=1e-10)


def test_pooling_refusals_name_the_padded_size_with_top_or_left_padding():
    from cfp.kernels.pool import max_pool2d_forward
    with pytest.raises(ValueError, match="pooling window 5 is larger than the padded input 4x4"):
        max_pool2d_forward(np.zeros((1, 1, 3, 4)), 5, 1, (1, 0, 0, 0))
    with pytest.raises(ValueError, match="pooling window 5 is larger than the padded input 3x5"):
        max_pool2d_forward(np.zeros((1, 1, 3, 4)), 5, 1, (0, 0, 1, 0))


def test_winograd_over_blocks_of_tall_narrow_images():
    """17 samples of 64x4 (16 x 1 tiles of F(4x4)) go 16 to a block, the last block 1: against
    im2col in float64."""
    from cfp.kernels import conv2d_backward_filter, conv2d_forward, winograd
    rng = np.random.default_rng(4)
    x, w, dy = rng.standard_normal((17, 2, 64, 4)), rng.standard_normal((3, 2, 3, 3)), rng.standard_normal((17, 3, 64, 4))
    with winograd(False):
        y0, dw0 = conv2d_forward(x, w, padding=1), conv2d_backward_filter(x, dy, w.shape, padding=1)
    with winograd(True, tile=4):
        y1, dw1 = conv2d_forward(x, w, padding=1), conv2d_backward_filter(x, dy, w.shape, padding=1)
    np.testing.assert_allclose(y1, y0, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dw1, dw0, rtol=1e-11, atol=1e-11)


def test_an_input_of_no_rows_padded_into_outputs():
    """x of 0 rows padded by one above and below: a 1x1 kernel gives 2 output rows of the bias,
    and the gradients are empty and zero."""
    from cfp.kernels import conv2d_backward_data, conv2d_backward_filter, conv2d_forward
    x, w, dy = np.zeros((1, 1, 0, 3)), np.ones((2, 1, 1, 1)), np.ones((1, 2, 2, 3))
    np.testing.assert_array_equal(conv2d_forward(x, w, np.array([1.0, 2.0]), padding=(1, 0)),
                                  np.array([1.0, 2.0]).reshape(1, 2, 1, 1) * np.ones((1, 2, 2, 3)))
    assert conv2d_backward_data(dy, w, x.shape, padding=(1, 0)).shape == (1, 1, 0, 3)
    np.testing.assert_array_equal(conv2d_backward_filter(x, dy, w.shape, padding=(1, 0)), np.zeros((2, 1, 1, 1)))


def test_a_too_small_image_names_its_height_and_width():
    from cfp.halo import check_image_fits, halo_plan
    plan = halo_plan((1, 1, 1, 5), Layout(("sample", None, "height", None)),
                     (("sample", 1), ("height", 2), ("width", 1)), (1, 1), ())
    with pytest.raises(ValueError, match=r"^c1: an input of 1x5 gives 1 output rows, too few for the 2 ranks of the "
                                         r"height axis of grid height=2"):
        check_image_fits(plan, (1, 1, 1, 5), "height=2", "c1")


def test_a_linear_layers_default_seed_is_0():
    from cfp.nn import Linear
    grid = _self_grid()
    a, b = Linear(grid, 3, 2, name="fc"), Linear(grid, 3, 2, name="fc", seed=0)
    np.testing.assert_array_equal(a.weight.data, b.weight.data)
    assert not np.array_equal(a.weight.data, Linear(grid, 3, 2, name="fc", seed=1).weight.data)
    grid.free()


def test_relu_passes_no_gradient_at_zero():
    from cfp.nn import ReLU
    relu = ReLU()
    relu.forward(np.array([-1.0, 0.0, 2.0]))
    np.testing.assert_array_equal(relu.backward(np.ones(3)), [0.0, 0.0, 1.0])


def test_a_parameter_without_layout_is_written_by_every_rank():
    from cfp.nn.module import Parameter
    assert Parameter("p", np.zeros(2), (2,)).primary


@pytest.mark.parametrize("layout", [Layout(("channel", None, None, None)), Layout((None, "channel", None, None)),
                                    Layout(("sample", "channel", None, None), partial=("height",))],
                         ids=["channel-first", "no-sample", "partial"])
def test_batch_norm_refuses_a_layout_not_split_by_sample_first(layout):
    from cfp.nn import BatchNorm2d
    grid = _self_grid()
    with pytest.raises(ValueError, match="bn: batch norm takes NCHW activations split by sample"):
        BatchNorm2d(grid, 2, layout=layout, name="bn")
    grid.free()


def test_gradient_allreduce_of_a_rank_right_of_the_first_column_block():
    """test_gradient_allreduce_of_a_rank_below_the_top_of_the_image along the width: the rank
    at width 1 of 4 keeps block 1 (10) of the 38 weights: 58 float32 each way, 232 bytes."""
    moved = predict_bytes("sample", (2, 2, 5, 12), (2, 2, 3, 3), "width=4", {"width": 1}, padding=1, itemsize=4)
    assert moved["gradient-sync"] == (232, 232)


def test_adamw_default_learning_rate_is_1e_3():
    from cfp.nn.module import Parameter
    from cfp.optim import AdamW
    assert AdamW([Parameter("p", np.zeros(1), (1,))]).lr == 1e-3


def test_batch_norm_backward_in_eval_mode_by_hand():
    """Eval mode normalises by the running statistics (mean 0, variance 1 at the start): with
    weight 2, dx = dy * 2 / sqrt(1 + 1e-5)."""
    from cfp.nn import BatchNorm2d
    grid = _self_grid()
    bn = BatchNorm2d(grid, 1, name="bn", dtype=np.float64)
    bn.weight.data[...] = 2.0
    bn.eval()
    bn.forward(np.array([1.0, 3.0]).reshape(2, 1, 1, 1))
    dx = bn.backward(np.array([1.0, -1.0]).reshape(2, 1, 1, 1))
    np.testing.assert_allclose(dx.ravel(), np.array([1.0, -1.0]) * 2 / math.sqrt(1 + 1e-5), rtol=1e-15)
    grid.free()


def test_groups_must_divide_the_filters_too():
    from cfp.algorithms import make_conv
    grid = _self_grid()
    with pytest.raises(ValueError, match="groups=2 must divide in_channels=4 and out_channels=3"):
        make_conv("sample", grid, 4, 3, 3, groups=2)
    with pytest.raises(ValueError, match="groups=2 must divide in_channels=3 and out_channels=4"):
        make_conv("sample", grid, 3, 4, 3, groups=2)
    grid.free()


def test_backward_refuses_a_dy_of_another_dtype():
    from cfp.algorithms import make_conv
    grid = _self_grid()
    conv = make_conv("sample", grid, 1, 2, 3, padding=1)
    conv.forward(np.zeros((1, 1, 4, 4)), np.zeros((2, 1, 3, 3)), np.zeros(2))
    with pytest.raises(ValueError, match=r"dy block has shape \(1, 2, 4, 4\) and dtype float32; expected \(1, 2, 4, 4\) float64"):
        conv.backward(np.zeros((1, 2, 4, 4), np.float32))
    grid.free()


def test_a_networks_plan_description_by_hand():
    from cfp.nn import Conv2d, GlobalAvgPool2d, Linear, Network
    grid = _self_grid()
    net = Network([Conv2d(grid, 1, 2, 3, algorithm="sample", input_whole=True, name="c1"), GlobalAvgPool2d(),
                   Linear(grid, 2, 3, algorithm="sample", name="fc")], grids=None,
                  layers={"c1": {"grid": "sample=1", "algorithm": "sample", "filter_groups": None},
                          "fc": {"grid": "sample=1", "algorithm": "w", "filter_groups": 1}})
    assert net.describe_plan() == "  c1: grid sample=1, algorithm sample\n  fc: grid sample=1, algorithm w p_f=1"
    grid.free()


@pytest.mark.parametrize("variable,setting", [("CFP_WINOGRAD", "winograd"), ("CFP_PLANE_STACKING", "plane_stacking")])
def test_the_environment_sets_the_kernel_switches(variable, setting):
    import subprocess
    import sys
    code = f"from cfp.kernels import settings; print(settings.current().{setting})"
    seen = {}
    for value in ("1", "0", None):
        env = {k: v for k, v in __import__("os").environ.items() if k != variable}
        if value is not None:
            env[variable] = value
        seen[value] = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                     check=True).stdout.strip()
    assert seen == {"1": "True", "0": "False", None: "None"}
    refused = subprocess.run([sys.executable, "-c", code], env={**env, variable: "yes"}, capture_output=True,
                             text=True)
    assert refused.returncode != 0
    assert f"ValueError: {variable}='yes': expected '1' (on), '0' (off) or unset" in refused.stderr


def test_the_cached_winograd_matrices_are_read_only():
    from cfp.kernels.conv.winograd import winograd_matrices
    for a in winograd_matrices(4):
        with pytest.raises(ValueError, match="read-only"):
            a[0, 0] = 7.0
