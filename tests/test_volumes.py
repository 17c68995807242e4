"""Volumes and transposed convolutions on every algorithm and every sample x channel grid, and
volumes on grids that split depth (with height, width and channel): Conv3d and
ConvTranspose2d/3d forward and backward from the global tensors against the serial kernels
(float64, 1e-10), the ledger equal to perfmodel.predict_bytes; the first layer (input whole);
transposed convolutions on grids that split the image or the volume (their own halo rule); and
the refusals of what is not supported yet (halo_interior beside a transposed convolution's
halo) or not meant (output_padding on a plain convolution, a 2-D layer on a depth split,
a volume too thin for its depth ranks)."""
import numpy as np
import pytest

from cfp import comm as C
from cfp.algorithms import make_conv
from cfp.grid import ProcessGrid, factorizations
from cfp.kernels.conv import OPS
from cfp.nn import (AvgPool3d, BatchNorm3d, Conv2d, Conv3d, ConvTranspose2d, ConvTranspose3d, GlobalAvgPool3d,
                    MaxPool3d, ReLU, Sequential, Upsample)
from cfp.perfmodel import ledger_bytes, predict_bytes
from cfp.nn import SoftmaxCrossEntropy
from cfp.tensor import DistTensor, Layout
from conftest import (SIZE, WORLD, assert_all_ranks, assert_close_all_ranks, grid_specs, raises_on_all_ranks,
                      spatial_at_most_four, split_grid)
from test_algorithms import CONFIGS, ids
from test_nn import CASES as NN_CASES
from test_nn import case_id, compare, data, fit, gather_parameter, grids  # noqa: F401 (grids: a fixture, every spec and "serial")

pytestmark = pytest.mark.mpi

# (op, N, C, F, spatial size, kernel, options): uneven channels and filters over 3 and 4 ranks,
# strides, dilation, groups, output_padding, asymmetric sizes, one sample
CASES = {
    "conv3d": ("conv3d", 3, 5, 7, (4, 5, 6), 3, {"padding": 1}),
    "conv3d-strided-dilated": ("conv3d", 2, 4, 6, (6, 5, 7), (3, 2, 3),
                               {"stride": (2, 1, 2), "padding": (2, 0, 1), "dilation": (2, 1, 1)}),
    "conv3d-groups-reflect": ("conv3d", 2, 6, 4, (4, 4, 5), 3,
                              {"groups": 2, "padding": 1, "padding_mode": "reflect"}),
    "conv3d-pointwise": ("conv3d", 1, 6, 10, (3, 4, 4), 1, {}),
    "transpose2d": ("conv_transpose2d", 3, 5, 7, (4, 5), 3, {"stride": 2, "padding": 1, "output_padding": 1}),
    "transpose2d-dilated-groups": ("conv_transpose2d", 2, 6, 4, (4, 3), (3, 2),
                                   {"dilation": 2, "padding": (1, 0), "output_padding": (1, 0), "groups": 2}),
    "transpose3d": ("conv_transpose3d", 2, 4, 6, (3, 4, 3), 3, {"stride": 2, "padding": 1, "output_padding": 1}),
    "transpose3d-pointwise": ("conv_transpose3d", 1, 6, 5, (2, 3, 3), 1, {"stride": (1, 2, 2)}),
}


def problem(case, seed=0):
    """The global x, w (the convolution's orientation), b, dy of a case, the same on every rank."""
    op, N, Cin, F, size, K, opts = case
    op = OPS[op]
    K = (K,) * op.axes if isinstance(K, int) else K
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, Cin) + size)
    w = rng.standard_normal((F, Cin // opts.get("groups", 1)) + K)
    b = rng.standard_normal(F)
    dy = rng.standard_normal(op.output_shape(x.shape, w.shape, **opts))
    return op, x, w, b, dy


def check_against_serial(grid, config, case, name, **conv_kwargs):
    spec, algorithm, p_f = config
    op, x, w, b, dy = problem(case)
    opts = case[-1]
    conv = make_conv(algorithm, grid, x.shape[1], w.shape[0], w.shape[2:], filter_groups=p_f, layer="conv",
                     op=op.name, **opts, **conv_kwargs)
    x_local = DistTensor.from_global(x, conv.input_layout, grid).local
    dy_local = DistTensor.from_global(dy, conv.output_layout, grid).local
    ledger = C.CommLedger()
    with C.use_ledger(ledger):
        y_local = conv.forward(x_local, conv.shard_weight(w), conv.shard_bias(b))
        dx_local, dw, db = conv.backward(dy_local)
    got = {"y": DistTensor(y_local, dy.shape, conv.output_layout, grid).gather(),
           "dw": conv.weight_tensor(dw).gather(), "db": conv.bias_tensor(db).gather()}
    expected = {"y": op.forward(x, w, b, **opts), "dw": op.backward_filter(x, dy, w.shape, **opts),
                "db": op.backward_bias(dy)}
    if conv.need_dx:
        got["dx"] = DistTensor(dx_local, x.shape, conv.input_layout, grid).gather()
        expected["dx"] = op.backward_data(dy, w, x.shape, **opts)
    for key in expected:
        assert_all_ranks(got[key].shape == expected[key].shape, f"{name} {ids(config)} {key} shape")
        assert_close_all_ranks(got[key], expected[key], 1e-10, f"{name} {ids(config)} {key}")
    moved = {k: v for k, v in opts.items()}
    predicted = predict_bytes(algorithm, x.shape, w.shape, spec, grid.coords, filter_groups=p_f, itemsize=8,
                              op=op.name, input_whole=conv.input_whole, need_dx=conv.need_dx, **moved)
    measured = ledger_bytes(ledger, layer="conv")
    assert_all_ranks(measured == predicted, f"{name} {ids(config)}: ledger {measured} != predicted {predicted}")


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("config", CONFIGS, ids=ids)
def test_volumes_and_transposed_match_serial_and_predicted_bytes(grids, config, name):
    check_against_serial(grids[config[0]], config, CASES[name], name)


# one sample a rank (N set to P_n), 9 channels and 10 filters: at least 2 of each per rank of up
# to 4 channel ranks, for chunks of the features
FEATURE_CASES = {name: (op, None, 9, 10) + tuple(rest) for name, (op, _, _, _, *rest) in CASES.items()
                 if name in ("conv3d", "transpose2d", "transpose3d")}


def feature_chunked(case, grid):
    """A case with one sample per rank of `grid`, and the chunks of features it takes (2, or 1
    where a rank holds fewer than 2 channels or filters)."""
    return (case[0], grid.axis_size("sample")) + case[2:], 1 + (min(case[2], case[3]) // grid.axis_size("channel") > 1)


@pytest.mark.parametrize("name", sorted(FEATURE_CASES))
@pytest.mark.parametrize("config", [c for c in CONFIGS if c[1] != "sample"], ids=ids)
def test_volumes_and_transposed_in_feature_chunks_match_serial(grids, config, name):
    """Conv3d, ConvTranspose2d and 3d with one sample a rank in 2 chunks of their features
    (ConvAlgorithm.pipelined): the serial numbers and the one-chunk pass's bytes."""
    case, chunks = feature_chunked(FEATURE_CASES[name], grids[config[0]])
    check_against_serial(grids[config[0]], config, case, name, chunks=chunks)


def depth_configs():
    """(grid spec, algorithm, p_f) on grids that split a volume: depth with sample or channel,
    and (at 4 ranks) depth with height, width and channel."""
    specs = [s for s in spatial_at_most_four(grid_specs(2, ("sample", "depth")) + grid_specs(2, ("depth", "channel")))
             if "depth=1" not in s]
    if SIZE == 4:
        specs += ["depth=2,height=2", "depth=2,width=2", "sample=1,depth=2,height=1,channel=2"]
    if SIZE == 1:
        specs = ["depth=1"]
    out = []
    for spec in dict.fromkeys(specs):
        out += [(spec, a, None) for a in ("sample", "x", "y", "w")]
    return out


DEPTH_CASES = {
    "conv3d": CASES["conv3d"],
    "strided-dilated": ("conv3d", 2, 4, 6, (9, 5, 7), (3, 2, 3),
                        {"stride": (2, 1, 2), "padding": (2, 0, 1), "dilation": (2, 1, 1)}),
    "reflect": ("conv3d", 2, 3, 5, (6, 5, 4), 3, {"padding": (2, 1, 1), "padding_mode": "reflect"}),
    "circular-same-groups": ("conv3d", 1, 4, 6, (5, 4, 4), (3, 3, 2),
                             {"padding": "same", "padding_mode": "circular", "groups": 2}),
    "six-sided": ("conv3d", 2, 3, 4, (6, 4, 5), 3, {"padding": (0, 2, 1, 0, 2, 1)}),
}


def _grids_of(configs):
    """The ProcessGrid of each spec of `configs`, freed once a fixture's tests are done."""
    made = {spec: ProcessGrid(spec) for spec in dict.fromkeys(c[0] for c in configs)}
    yield made
    for g in made.values():
        g.free()


@pytest.fixture(scope="module")
def depth_grids():
    yield from _grids_of(depth_configs())


@pytest.mark.parametrize("name", sorted(DEPTH_CASES))
@pytest.mark.parametrize("config", depth_configs(), ids=ids)
def test_depth_split_matches_serial_and_predicted_bytes(depth_grids, config, name):
    """A volume split by depth (and height, width): the halo over planes, rows and columns,
    the padding modes whose padded planes lie on other ranks, against serial; the ledger
    (halo included) equal to predict_bytes."""
    check_against_serial(depth_grids[config[0]], config, DEPTH_CASES[name], name)


def _channel_ranks(spec):
    """The channel axis's size in a grid spec ('depth=2,channel=2': 2)."""
    return dict(part.split("=") for part in spec.split(",")).get("channel", "1")


@pytest.mark.parametrize("config", [c for c in depth_configs() if _channel_ranks(c[0]) != "1" and c[1] != "sample"],
                         ids=ids)
def test_a_depth_split_in_feature_chunks_matches_serial(depth_grids, config):
    """A volume split by depth and channel, one sample a rank, in 2 chunks of its features: the
    halo once, the channel collectives chunk by chunk, the serial numbers and bytes."""
    grid = depth_grids[config[0]]
    case, chunks = feature_chunked(FEATURE_CASES["conv3d"], grid)
    check_against_serial(grid, config, case, "conv3d", chunks=chunks)


# Winograd's volumes on a depth split: each plane's tiles transformed once (depth stride and
# dilation 1), and the strided view at a depth dilation (kernels/conv/volume.py), halo planes
# included, forced on these small float64 planes
IN_PLACE_DEPTH_CASES = {
    "conv3d": CASES["conv3d"],
    "depth-dilated": ("conv3d", 2, 3, 3, (9, 5, 6), 3, {"padding": (2, 1, 1), "dilation": (2, 1, 1)}),
}


@pytest.mark.parametrize("name", sorted(IN_PLACE_DEPTH_CASES))
@pytest.mark.parametrize("config", depth_configs(), ids=ids)
def test_a_depth_split_reads_its_planes_in_place(depth_grids, config, name, monkeypatch):
    """The volume kernels that read their planes where they lie, on blocks extended by their
    depth halo, against serial (the same kernels on the whole volume) and predict_bytes."""
    from cfp.kernels import settings
    from cfp.kernels.conv import volume
    monkeypatch.setattr(volume, "IN_PLACE_TILES", 1)
    monkeypatch.setattr(volume, "RING_PIXELS", 0)  # the ring on these small planes too
    op, N, C_in, F, size, K, opts = IN_PLACE_DEPTH_CASES[name]
    v = volume.volume_geometry((N, C_in) + size, (F, C_in) + (K,) * 3, **opts)
    with settings.winograd(True, tile=4):
        assert_all_ranks(volume._in_place(v, "forward", "float64"), f"{name}: forward reads its planes in place")
        check_against_serial(depth_grids[config[0]], config, IN_PLACE_DEPTH_CASES[name], name)


# the cases whose blocks leave an interior on some rank (and six-sided, reflect: padding that
# falls to one rank, padded planes gathered from other ranks, where a block computes whole)
INTERIOR_DEPTH_CASES = ["conv3d", "strided-dilated", "six-sided", "reflect"]


@pytest.mark.parametrize("name", INTERIOR_DEPTH_CASES)
@pytest.mark.parametrize("config", [c for c in depth_configs() if c[1] in ("sample", "x")], ids=ids)
def test_a_volume_computes_its_interior_while_the_halo_moves(depth_grids, config, name):
    """halo_interior on a volume split by depth (and height, width): the output planes, rows
    and columns that read no halo computed from the block held while the halo moves, the
    border slabs after it arrives (halo.border_boxes): y, dx, dw, db as the serial kernels',
    the ledger the blocking exchange's (predict_bytes)."""
    grid = depth_grids[config[0]]
    check_against_serial(grid, config, DEPTH_CASES[name], name, halo_interior=True)
    op, N, C_in, F, size, K, opts = DEPTH_CASES[name]
    if name == "conv3d" and 1 < grid.axis_size("depth") <= size[0] // 2:  # a rank with 2 planes has one inside
        conv = make_conv(config[1], grid, C_in, F, (K,) * 3, layer="conv", op=op, halo_interior=True, **opts)
        some = grid.comm.allreduce(conv.halo_plan((N, C_in) + size).interior is not None)
        assert_all_ranks(some > 0, f"{ids(config)}: no rank has an interior")


def test_border_boxes_cover_the_block_around_its_interior_once():
    """halo.border_boxes: with the interior, every output position of the block once, for
    images and volumes, interiors at an edge or inside."""
    from cfp.halo import border_boxes
    for out_size, interior in (((5, 7), (range(1, 4), range(2, 7))), ((4, 3, 6), (range(0, 3), range(1, 2), range(1, 5))),
                               ((2, 2, 2), (range(0, 2), range(0, 2), range(0, 1))), ((3, 4), (range(0, 3), range(0, 4)))):
        count = np.zeros(out_size, int)
        for box in list(border_boxes(interior, out_size)) + [interior]:
            count[np.ix_(*box)] += 1
        assert (count == 1).all(), (out_size, interior, count)


def transposed_spatial_configs():
    """(grid spec, algorithm, p_f) on grids that split an image over height and width (with
    sample or channel), for the transposed convolutions' halo."""
    specs = [s for s in spatial_at_most_four(grid_specs(2, ("height", "width")) + grid_specs(2, ("sample", "height"))
                                             + grid_specs(2, ("width", "channel"))) if s.count("=1") < 2]
    if SIZE == 4:
        specs += ["height=1,width=2,channel=2", "height=2,width=2"]
    if SIZE == 1:
        specs = ["height=1"]
    return [(spec, a, None) for spec in dict.fromkeys(specs) for a in ("sample", "x", "y", "w")]


# The halo rule of a transposed convolution in its corner cases: stride 2 with output_padding 1,
# dilation 2, groups, a stride larger than the kernel (output rows no input reaches: a block's
# negative sides, blocks whose window holds no input), output_padding beyond the padding
# (positions at the end no input reaches), asymmetric sizes, a 1x1 kernel.
TRANSPOSED_SPATIAL_CASES = {
    "transpose2d": CASES["transpose2d"],
    "dilated-groups": CASES["transpose2d-dilated-groups"],
    "gaps": ("conv_transpose2d", 2, 3, 4, (5, 4), (2, 1), {"stride": (3, 2), "output_padding": (2, 1)}),
    "padded": ("conv_transpose2d", 1, 4, 3, (3, 6), (4, 3), {"stride": 2, "padding": (2, 1), "dilation": (1, 2)}),
    # 1x1 of stride 2: at 3 and 4 ranks along an axis, blocks of one odd row that no input reaches
    "empty-windows": ("conv_transpose2d", 2, 3, 4, (3, 2), 1, {"stride": 2, "output_padding": (0, 1)}),
}


@pytest.fixture(scope="module")
def transposed_grids():
    yield from _grids_of(transposed_spatial_configs())


@pytest.mark.parametrize("name", sorted(TRANSPOSED_SPATIAL_CASES))
@pytest.mark.parametrize("config", transposed_spatial_configs(), ids=ids)
def test_transposed_on_a_spatial_split_matches_serial_and_predicted_bytes(transposed_grids, config, name):
    """ConvTranspose2d on grids splitting height and width: each rank's output block from the
    input rows that reach it (halo._transposed_span), the adjoint summing dx back, against
    serial; the ledger equal to predict_bytes."""
    check_against_serial(transposed_grids[config[0]], config, TRANSPOSED_SPATIAL_CASES[name], name)


TRANSPOSED_DEPTH_CASES = {
    "transpose3d": CASES["transpose3d"],
    "pointwise-gaps": ("conv_transpose3d", 1, 4, 3, (4, 3, 3), 1, {"stride": (2, 1, 2), "output_padding": (1, 0, 0)}),
}


@pytest.mark.parametrize("name", sorted(TRANSPOSED_DEPTH_CASES))
@pytest.mark.parametrize("config", depth_configs(), ids=ids)
def test_transposed_volume_on_a_depth_split(depth_grids, config, name):
    """ConvTranspose3d on grids splitting depth (and height, width), against serial; with a
    1x1x1 kernel of stride 2, planes that no input reaches."""
    check_against_serial(depth_grids[config[0]], config, TRANSPOSED_DEPTH_CASES[name], name)


@pytest.mark.parametrize("name", ["conv3d", "transpose2d", "transpose3d"])
@pytest.mark.parametrize("config", [c for c in CONFIGS if c[1] in ("sample", "y")], ids=ids)
def test_first_layer(grids, config, name):
    """The network's first layer: the input whole on every channel rank, no dx."""
    check_against_serial(grids[config[0]], config, CASES[name], name, input_whole=True, need_dx=False)


def test_refusals():
    if SIZE > 1:
        grid = ProcessGrid(f"height={SIZE}")
        raises_on_all_ranks(ValueError, lambda: make_conv("sample", grid, 4, 4, 3, op="conv_transpose2d",
                                                          halo_interior=True),
                            match=r"halo_interior is built for convolutions' halos, not conv_transpose2d's")
        grid.free()
    if SIZE > 1:
        grid = ProcessGrid(f"depth={SIZE}")
        raises_on_all_ranks(ValueError, lambda: make_conv("sample", grid, 4, 4, 3),
                            match=r"conv2d on a grid splitting depth .*: depth splits volumes")
        conv = make_conv("sample", grid, 2, 2, 3, op="conv3d", stride=(2, 1, 1))
        too_thin = np.zeros((1, 2, 2 * SIZE - 1, 4, 4))
        raises_on_all_ranks(ValueError, lambda: conv.forward(DistTensor.from_global(too_thin, conv.input_layout, grid).local,
                                                             np.zeros(conv.weight_shape), np.zeros(conv.bias_shape)),
                            match=r"an input of \d+x4x4 gives \d+ output planes, too few for the \d+ ranks of the depth axis"
                                  r".*the volume is too small for the grid")
        grid.free()
    whole = ProcessGrid(f"sample={SIZE}")
    refused = [
        (dict(output_padding=1), r"output_padding=1 applies to transposed convolutions only"),
        (dict(op="conv_transpose2d", stride=2, output_padding=2),
         r"output_padding \(2, 2\) must be smaller than the stride \(2, 2\)"),
        (dict(op="conv_transpose3d", padding_mode="reflect"), r"pads with zeros only"),
        (dict(op="conv_transpose2d", padding="same"), r"takes integer padding"),
        (dict(op="conv4d"), r"unknown convolution kind 'conv4d'"),
    ]
    for kwargs, message in refused:
        raises_on_all_ranks(ValueError, lambda: make_conv("sample", whole, 4, 4, 3, **kwargs), match=message)
    raises_on_all_ranks(ValueError, lambda: make_conv("sample", whole, 4, 4, (3, 3), op="conv3d"),
                        match=r"kernel_size must be a positive integer or a triple")
    conv = make_conv("sample", whole, 4, 4, 3, op="conv3d")
    raises_on_all_ranks(ValueError, lambda: conv.forward(np.zeros((2, 4, 5, 5)), np.zeros(conv.weight_shape),
                                                         np.zeros(conv.bias_shape)),
                        match=r"x block has shape \(2, 4, 5, 5\), expected \(n, 4, D, H, W\)")
    whole.free()


@pytest.mark.parametrize("case", NN_CASES, ids=case_id)
def test_layers_end_to_end(grids, case):
    """Conv3d (first layer: input whole, no dx) -> ReLU -> ConvTranspose3d (stride 2,
    output_padding 1), and ConvTranspose2d -> ReLU -> Conv2d, against the same layers on one rank."""
    spec, alg, p_f = case
    split = alg != "sample"

    def volume(grid):
        kw = dict(algorithm=alg, filter_groups=fit(p_f, grid), dtype=np.float64)
        return Sequential(Conv3d(grid, 2, 6, 3, padding=1, input_whole=True, need_dx=False, name="c1", **kw), ReLU(),
                          ConvTranspose3d(grid, 6, 4, 3, stride=2, padding=1, output_padding=1, name="t2", **kw))

    def image(grid):
        kw = dict(algorithm=alg, filter_groups=fit(p_f, grid), dtype=np.float64)
        return Sequential(ConvTranspose2d(grid, 5, 6, 2, stride=2, name="t1", **kw), ReLU(),
                          Conv2d(grid, 6, 3, 3, padding=1, name="c2", **kw))
    compare(volume, grids, spec, data((3, 2, 3, 4, 3), 1), data((3, 4, 6, 8, 6), 2), in_split=False,
            out_split=split, what=f"volume {case_id(case)}")
    compare(image, grids, spec, data((3, 5, 3, 4), 3), data((3, 3, 6, 8), 4), in_split=split,
            out_split=split, what=f"image {case_id(case)}")


@pytest.mark.parametrize("case", NN_CASES, ids=case_id)
def test_volume_block_with_batch_norm_and_global_pooling(grids, case):
    """Conv3d (first layer) -> BatchNorm3d -> ReLU -> Conv3d (stride 2) -> BatchNorm3d -> ReLU
    -> GlobalAvgPool3d, against one rank: outputs, input-free gradients, batch-norm statistics
    (two passes: the running statistics move)."""
    spec, alg, p_f = case

    def block(grid):
        kw = dict(algorithm=alg, filter_groups=fit(p_f, grid), dtype=np.float64, bias=False)
        c1 = Conv3d(grid, 2, 6, 3, padding=1, input_whole=True, need_dx=False, name="c1", **kw)
        c2 = Conv3d(grid, 6, 4, 3, stride=2, padding=1, name="c2", **kw)
        return Sequential(c1, BatchNorm3d(grid, 6, layout=c1.conv.output_layout, name="bn1", dtype=np.float64),
                          ReLU(), c2, BatchNorm3d(grid, 4, layout=c2.conv.output_layout, name="bn2", dtype=np.float64),
                          ReLU(), GlobalAvgPool3d())
    compare(block, grids, spec, data((4, 2, 5, 6, 4), 5), data((4, 4), 6), in_split=False, out_split=alg != "sample",
            what=f"volume block {case_id(case)}", train_passes=2)


@pytest.mark.parametrize("config", [c for c in depth_configs() if c[1] in ("sample", "y")], ids=ids)
def test_volume_block_on_a_depth_split(grids, depth_grids, config):
    """Conv3d -> BatchNorm3d -> ReLU -> MaxPool3d -> AvgPool3d -> GlobalAvgPool3d on grids that
    split depth, placed (the containers insert what moves between layers): batch norm's
    statistics and global pooling's sums over the depth ranks too, the pooling layers' halos
    over planes, against one rank, forward and backward."""
    spec, alg, _ = config
    x, dy = data((3, 2, 10, 8, 6), 7), data((3, 4), 8)
    out = {}
    for which, grid in (("serial", grids["serial"]), (spec, depth_grids[spec])):
        kw = dict(algorithm=alg, dtype=np.float64, bias=False)
        c1 = Conv3d(grid, 2, 4, 3, padding=1, input_whole=True, need_dx=False, name="c1", **kw)
        model = Sequential(c1, BatchNorm3d(grid, 4, layout=c1.conv.output_layout, name="bn", dtype=np.float64),
                           ReLU(), MaxPool3d(3, 2, 1), AvgPool3d(2, 1), GlobalAvgPool3d())
        end = model.place((grid, c1.conv.input_layout))
        y = model.forward(DistTensor.from_global(x, c1.conv.input_layout, grid))
        model.backward(DistTensor.from_global(dy, end[1], grid))
        out[which] = (y.gather(), {p.name: gather_parameter(p) for p in model.parameters()})
    assert_close_all_ranks(out[spec][0], out["serial"][0], 1e-10, f"{spec} y")
    for name, want in out["serial"][1].items():
        assert_close_all_ranks(out[spec][1][name], want, 1e-10, f"{spec} {name}")


def _placed_against_serial(make, grid, serial, x, dy, what):
    """make(grid) placed on `grid` (its first layer's input whole) and on one rank, forward and
    backward: the outputs and the parameters' gradients equal."""
    out = {}
    for which, g in (("serial", serial), (what, grid)):
        model = make(g)
        first = model.modules[0]
        end = model.place((g, first.conv.input_layout))
        y = model.forward(DistTensor.from_global(x, first.conv.input_layout, g))
        model.backward(DistTensor.from_global(dy, end[1], g))
        out[which] = (y.gather(), {p.name: gather_parameter(p) for p in model.parameters()})
    assert_close_all_ranks(out[what][0], out["serial"][0], 1e-10, f"{what} y")
    for name, want in out["serial"][1].items():
        assert_close_all_ranks(out[what][1][name], want, 1e-10, f"{what} {name}")


@pytest.mark.parametrize("config", [c for c in transposed_spatial_configs() if c[1] in ("sample", "w")], ids=ids)
def test_upsampling_and_transposed_layers_on_a_spatial_split(grids, transposed_grids, config):
    """Conv2d -> ReLU -> Upsample(2) -> ConvTranspose2d (stride 2, output_padding 1) -> Upsample
    (1, 3) -> Conv2d on grids splitting height and width, placed: nearest upsampling's blocks
    from the input rows that reach them (the halo of a transposed convolution), against one
    rank, forward and backward."""
    spec, alg, _ = config

    def make(grid):
        kw = dict(algorithm=alg, dtype=np.float64)
        return Sequential(Conv2d(grid, 2, 4, 3, padding=1, input_whole=True, need_dx=False, name="c1", **kw),
                          ReLU(), Upsample(2),
                          ConvTranspose2d(grid, 4, 4, 3, stride=2, padding=1, output_padding=1, name="t2", **kw),
                          Upsample((1, 3)), Conv2d(grid, 4, 3, 3, padding=1, name="c3", **kw))
    _placed_against_serial(make, transposed_grids[spec], grids["serial"], data((2, 2, 5, 5), 9),
                           data((2, 3, 20, 60), 10), spec)


@pytest.mark.parametrize("config", [c for c in depth_configs() if c[1] in ("sample", "y")], ids=ids)
def test_volume_upsampling_on_a_depth_split(grids, depth_grids, config):
    """Conv3d -> Upsample((2, 1, 3)) -> ConvTranspose3d -> Conv3d on grids splitting depth."""
    spec, alg, _ = config

    def make(grid):
        kw = dict(algorithm=alg, dtype=np.float64)
        return Sequential(Conv3d(grid, 2, 4, 3, padding=1, input_whole=True, need_dx=False, name="c1", **kw),
                          Upsample((2, 1, 3)), ConvTranspose3d(grid, 4, 3, 2, stride=(1, 2, 1), name="t2", **kw),
                          Conv3d(grid, 3, 2, 1, name="c3", **kw))
    _placed_against_serial(make, depth_grids[spec], grids["serial"], data((2, 2, 5, 3, 2), 11),
                           data((2, 2, 11, 6, 7), 12), spec)


def test_a_volume_checkpoint_loads_on_another_grid(grids, mpi_tmp_path):
    """Conv3d, ConvTranspose3d and BatchNorm3d shards saved on one grid (depth-split, or channel
    at one rank) load on another (channel, and one rank), their global tensors unchanged."""
    from cfp.checkpoint import load_checkpoint, save_checkpoint
    from cfp.optim import SGD

    def model(grid, seed):
        c = Conv3d(grid, 2, 4, 3, padding=1, algorithm="y" if grid.shape["depth"] == 1 else "sample",
                   input_whole=True, need_dx=False, name="c", seed=seed, dtype=np.float64)
        t = ConvTranspose3d(grid, 4, 3, 2, stride=2, algorithm="y", name="t", seed=seed, dtype=np.float64)
        return Sequential(c, BatchNorm3d(grid, 4, layout=c.conv.output_layout, name="bn", dtype=np.float64), t)

    def global_tensors(m):
        return {p.name: gather_parameter(p, "data") for p in m.parameters()}
    source = ProcessGrid(split_grid("depth"))
    saved = model(source, seed=1)
    path = save_checkpoint(str(mpi_tmp_path / "ckpt"), 1, saved, SGD(saved.parameters(), 0.1), source, {})
    want = global_tensors(saved)
    for target in (ProcessGrid(f"channel={SIZE}"), grids["serial"]):
        loaded = model(target, seed=2)  # other numbers until the checkpoint is loaded
        load_checkpoint(path, loaded, SGD(loaded.parameters(), 0.1))
        got = global_tensors(loaded)
        for name in want:
            assert_all_ranks(np.array_equal(got[name], want[name]), f"{name} on {target.describe()}: not the saved tensor")
    source.free()


def test_sharded_loader_reads_only_each_ranks_block(mpi_tmp_path):
    """Samples in a memory-mapped .npy, read by a loader with the first layer's input layout on
    a depth split (and, at 4 ranks, depth x height): each rank's batches are the blocks whole
    loading gives (DistTensor.from_global of the batch), and with more than one depth rank its
    peak of allocated memory (tracemalloc) while it reads a batch of one sample stays below
    one sample."""
    import tracemalloc

    from cfp.data import ShardedLoader, open_npy
    rng = np.random.default_rng(11)
    x, y = rng.standard_normal((4, 2, 16, 32, 32)), rng.integers(0, 3, 4)  # 256 KiB a sample
    path = str(mpi_tmp_path / "volumes.npy")
    if WORLD.Get_rank() == 0:
        np.save(path, x)
    WORLD.Barrier()
    spec = _depth_split()
    grid = ProcessGrid(spec)
    conv = make_conv("sample", grid, 2, 4, 3, op="conv3d", padding=1)
    mapped = open_npy(path)
    whole = ShardedLoader(x, y, 1, grid, seed=4)
    expected = [(DistTensor.from_global(xb, conv.input_layout, grid).local, yb, n) for xb, yb, n in whole]
    sharded = ShardedLoader(mapped, y, 1, grid, seed=4, layout=conv.input_layout)
    batches = iter(sharded)
    tracemalloc.start()  # (what was allocated before is not traced: the expected blocks)
    peak = 0
    for b, (want, y_whole, n_whole) in enumerate(expected):
        tracemalloc.reset_peak()
        x_local, y_local, n = next(batches)
        peak = max(peak, tracemalloc.get_traced_memory()[1])
        assert_all_ranks(n == n_whole and np.array_equal(y_local, y_whole) and np.array_equal(x_local, want),
                         f"batch {b}: a block that is not whole loading's")
        del x_local, y_local  # before the next batch is read, as a training step would
    tracemalloc.stop()
    if SIZE > 1:
        assert_all_ranks(peak < 0.75 * x[0].nbytes, f"peak {peak} bytes, one sample is {x[0].nbytes}")
    raises_on_all_ranks(ValueError, lambda: ShardedLoader(mapped, y, 2, grid, layout=conv.input_layout, augment=True),
                        match="augmentation crops and flips")
    raises_on_all_ranks(ValueError, lambda: open_npy(str(mpi_tmp_path / "missing.npy")), match="does not exist")
    del mapped, sharded
    grid.free()


def test_a_run_on_sharded_input_holds_less_than_a_sample(mpi_tmp_path):
    """Training steps whose input blocks a loader reads from a memory-mapped .npy
    (Network.shard_input, ShardedLoader(layout=)) on a depth split (depth x height at 4 ranks):
    the same losses and weights as loading whole samples, and each rank's peak of memory
    allocated during the steps (tracemalloc: the reads, the layers' activations and
    temporaries, the gradients) below 0.7 of that of loading whole samples, and below one whole
    sample at 4 ranks. (Measured: 0.55, 0.48, 0.41 of it at 2, 3, 4 ranks; 212 KiB at 4 ranks,
    a sample being 256. At a rank the loader's block, the halo's extended copy of it, which the
    layer keeps for backward-filter, and what the step keeps are about three blocks: hence a
    first layer, a strided pointwise convolution, whose own temporaries are small; a 4x4x4
    one's depth-column stack and patches, each as large as the block, add two more.)"""
    import tracemalloc

    from cfp.data import ShardedLoader, open_npy
    from cfp.grid import Grids
    from cfp.nn import GlobalAvgPool3d, Linear, Network
    from cfp.optim import SGD
    rng = np.random.default_rng(12)
    x, y = rng.standard_normal((4, 1, 32, 32, 32)), rng.integers(0, 3, 4)  # 256 KiB a sample
    path = str(mpi_tmp_path / "run_volumes.npy")
    if WORLD.Get_rank() == 0:
        np.save(path, x)
    WORLD.Barrier()
    spec = _depth_split()

    def run(sharded):
        grid = ProcessGrid(spec)
        kw = dict(dtype=np.float64, seed=3)
        net = Network([Conv3d(grid, 1, 2, 1, stride=4, algorithm="sample", input_whole=True, need_dx=False,
                              name="c1", **kw), ReLU(), GlobalAvgPool3d(),
                       Linear(grid, 2, 3, algorithm="sample", name="fc", **kw)], grids=Grids(grid, owns_base=True),
                      layers={})
        layout = net.shard_input() if sharded else None
        loader = ShardedLoader(open_npy(path) if sharded else x, y, 1, grid, seed=5, layout=layout)
        from cfp.nn import SoftmaxCrossEntropy
        from cfp.train import train_step
        loss_fn, optimizer = SoftmaxCrossEntropy(grid), SGD(net.parameters(), 0.1)
        losses, peak = [], 0
        tracemalloc.start()
        for x_local, y_local, _ in loader:
            losses.append(train_step(net, loss_fn, optimizer, x_local, y_local)[0])
            del x_local, y_local
            peak = max(peak, tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        weights = {p.name: gather_parameter(p, "data") for p in net.parameters()}
        net.free()
        return losses, weights, peak

    losses, weights, whole_peak = run(sharded=False)
    sharded_losses, sharded_weights, peak = run(sharded=True)
    assert_close_all_ranks(np.array(sharded_losses), np.array(losses), 1e-12, "losses")
    for name, want in weights.items():
        assert_close_all_ranks(sharded_weights[name], want, 1e-12, name)
    if SIZE > 1:
        assert_all_ranks(peak < 0.7 * whole_peak and (SIZE < 4 or peak < x[0].nbytes),
                         f"peak {peak} bytes during the steps ({whole_peak} loading whole samples), one sample "
                         f"is {x[0].nbytes}")


def _depth_split():
    """The grid of the sharded-input tests, whose batches may hold one sample: every rank on
    the volume, over depth, height and width as evenly as the ranks divide (depth=2,height=2
    at 4 ranks, depth=3,height=2 at 6), no samples."""
    sizes = min((f for f in factorizations(SIZE, 3) if f[0] >= f[1] >= f[2]), key=max)
    return ",".join(f"{axis}={n}" for axis, n in zip(("depth", "height", "width"), sizes) if n > 1 or axis == "depth")


def _volume_files(where, kind, side):
    """24 training and 8 test volumes of side^3 voxels, 3 classes, as `kind` ('npy': a
    directory of .npy files; 'h5': one HDF5 file), written by rank 0: the --dataset value."""
    rng = np.random.default_rng(13)
    arrays = {f"{a}_{part}": rng.standard_normal((n, 1, side, side, side)) if a == "x" else rng.integers(0, 3, n)
              for part, n in (("train", 24), ("test", 8)) for a in ("x", "y")}
    if WORLD.Get_rank() == 0:
        if kind == "npy":
            where.mkdir()
            for name, a in arrays.items():
                np.save(where / f"{name}.npy", a)
        else:
            import h5py
            with h5py.File(where, "w") as f:
                for name, a in arrays.items():
                    f.create_dataset(name, data=a, chunks=(1, 1, 1) + a.shape[3:] if a.ndim > 1 else None)
    WORLD.Barrier()
    return f"{kind}:{where}"


@pytest.mark.parametrize("kind", ["npy", "h5"])
def test_training_on_memory_mapped_volumes_with_sharded_input(mpi_tmp_path, kind):
    """train.py's --dataset npy:DIR (memory-mapped samples) and h5:FILE (an HDF5 file, read by
    slices) with --shard-input on a depth split (depth x height at 4 ranks): 18 float64 steps
    and the test accuracy (evaluated on blocks too) equal one rank's reading whole samples; the
    bad datasets and options, one message each."""
    if kind == "h5":
        pytest.importorskip("h5py")
    spec = _depth_split()
    if not spatial_at_most_four([spec]):
        pytest.skip(f"{spec}: the volume model's pooled body of 4 planes, rows and columns takes at most 4 ranks "
                    f"along each, and {SIZE} ranks split the volume no other way")
    from cfp.train import TrainConfig, train_model
    from test_train import assert_trains_like, weights
    dataset = _volume_files(mpi_tmp_path / ("volumes" if kind == "npy" else "volumes.h5"), kind,
                            16 if SIZE > 2 else 8)
    cfg = dict(model="volume", dataset=dataset, width=1, epochs=3, batch_size=4, lr=0.05,
               dtype="float64", progress=False, seed=2)
    result, model = train_model(TrainConfig(grid="sample=1", **cfg), world=WORLD.Split(WORLD.Get_rank()))
    one_rank = ([h["loss"] for h in result["history"]], weights(model))
    accuracy = result["test_accuracy"]
    result, model = train_model(TrainConfig(grid=spec, shard_input=True, **cfg))
    assert_all_ranks(len(result["history"]) == 18, "18 steps")
    assert_trains_like(result, model, one_rank, f"sharded input on {spec}", tol=1e-10)
    assert_all_ranks(result["test_accuracy"] == accuracy, f"test accuracy {result['test_accuracy']} != {accuracy}")
    for options, message in ((dict(augment=True), r"--augment crops and flips whole images; --shard-input reads"),
                             (dict(dtype="float32"), r"array x_train has shape .* and dtype float64; expected .* of "
                                                     r"float32"),
                             (dict(model="resnet"), r"do not fit --model resnet, which takes images"),
                             (dict(dataset=f"npy:{mpi_tmp_path / 'nowhere'}"), r"is not a directory"),
                             (dict(dataset=f"h5:{mpi_tmp_path / 'nowhere.h5'}"), r"does not exist")):
        raises_on_all_ranks(ValueError, lambda: train_model(TrainConfig(**{**cfg, "grid": spec, "shard_input": True,
                                                                              **options})), match=message)


@pytest.mark.parametrize("spec", sorted({c[0] for c in depth_configs()} | {f"sample={SIZE}", split_grid("height")}))
def test_per_voxel_cross_entropy_on_any_split(grids, spec):
    """Segmentation's loss, per voxel (and per pixel): logits split by sample, depth, height
    and width, whole over classes; the loss, the correct count and dlogits equal one rank's."""
    rng = np.random.default_rng(14)
    for shape in ((3, 4, 6, 4, 5), (3, 4, 6, 5)):
        if "depth" in spec and len(shape) == 4:
            continue
        logits, labels = rng.standard_normal(shape), rng.integers(0, shape[1], (shape[0],) + shape[2:])
        grid = ProcessGrid(spec)
        layout = Layout(("sample", None) + tuple(a if grid.shape[a] > 1 else None
                                                for a in ("depth", "height", "width")[5 - len(shape):]))
        label_layout = Layout(layout.dims[:1] + layout.dims[2:])
        loss_fn = SoftmaxCrossEntropy(grid, layout=layout)
        loss, correct = loss_fn.forward(DistTensor.from_global(logits, layout, grid).local,
                                        DistTensor.from_global(labels, label_layout, grid).local)
        d = DistTensor(loss_fn.backward(), logits.shape, layout, grid).gather()
        serial = SoftmaxCrossEntropy(grids["serial"])
        want_loss, want_correct = serial.forward(logits, labels)
        assert_close_all_ranks(np.array([loss]), np.array([want_loss]), 1e-12, f"{spec} loss")
        assert_all_ranks(correct == want_correct, f"{spec}: {correct} correct, one rank {want_correct}")
        assert_close_all_ranks(d, serial.backward(), 1e-12, f"{spec} dlogits")
        grid.free()


# The models' grids that split samples or channels: a batch of 8 over at most 8 sample ranks
# (the volume's depth or the image's height beside them), and the narrowest layer's 8 channels
# over at most 4 channel ranks (samples beside them); every rank up to 8 and 4 ranks.
VOLUME_SAMPLES, UNET_SAMPLES = split_grid("sample", 8, "depth"), split_grid("sample", 8, "height")
MODEL_CHANNELS = split_grid("channel")


def volume_grids():
    """(grid, algorithm) of the volume model's training test at this rank count: samples,
    channels, depth, and depth with channels or height where the ranks allow; the planner's
    grids and algorithms (auto)."""
    if SIZE == 1:
        return [("sample=1", "y")]
    out = [(VOLUME_SAMPLES, "sample"), (MODEL_CHANNELS, "y"), (split_grid("depth"), "y"), (split_grid("depth"), "sample"),
           (None, "auto")]
    if SIZE == 4:
        out += [("depth=2,channel=2", "w"), ("sample=2,depth=2", "x"), ("depth=2,height=2", "y")]
    return out


_one_rank_volume = {}


@pytest.mark.parametrize("grid, algorithm", volume_grids())
def test_volume_model_trains_like_one_rank(grid, algorithm):
    """--model volume: 20 float64 steps of the 3-D CNN (Conv3d, BatchNorm3d, MaxPool3d,
    GlobalAvgPool3d, Linear) on synthetic volumes, on grids that split samples, channels,
    depth and height, and as the planner chooses, equal one rank's losses and final weights."""
    from cfp.train import TrainConfig, train_model
    from test_train import assert_trains_like, weights

    def cfg(**grid_and_algorithm):
        # (16^3 voxels where 3 or 4 ranks split depth: the pooled body keeps a plane a rank)
        return TrainConfig(model="volume", dataset="synthetic", width=1, epochs=1, batch_size=8, train_samples=160,
                           max_steps=20, lr=0.05, dtype="float64", progress=False, seed=1,
                           upsample=2 if SIZE > 2 else 1, **grid_and_algorithm)
    if not _one_rank_volume:
        result, model = train_model(cfg(grid="sample=1", algorithm="y"), world=WORLD.Split(WORLD.Get_rank()))
        _one_rank_volume["run"] = ([h["loss"] for h in result["history"]], weights(model))
    result, model = train_model(cfg(grid=grid, algorithm=algorithm, **_planned(algorithm)))
    assert_all_ranks(len(result["history"]) == 20, "20 steps")
    assert_trains_like(result, model, _one_rank_volume["run"], f"volume model on {grid}, {algorithm}", tol=1e-10)


def _planned(algorithm):
    """What a run with `algorithm` needs beyond it: the planner's (auto) machine profile."""
    return {"profile": "cpu-dev"} if algorithm == "auto" else {}


def _mixed_plan(path, layers):
    """A plan file giving each of `layers` (name -> (grid, algorithm)) its own grid, written by
    rank 0 and read by every rank."""
    from cfp.io import save_json
    if WORLD.Get_rank() == 0:
        save_json(str(path), {"layers": {name: {"grid": g, "algorithm": a} for name, (g, a) in layers.items()}})
    WORLD.Barrier()
    return str(path)


def _volume_plan(path):
    """--model volume's layers on three grids: samples, depth, channels."""
    return _mixed_plan(path, {"stem.conv": (VOLUME_SAMPLES, "sample"), "down.conv": (split_grid("depth"), "y"),
                              "body.conv": (MODEL_CHANNELS, "w"), "fc": (VOLUME_SAMPLES, "sample")})


def test_volume_model_on_a_mixed_plan_trains_like_one_rank(mpi_tmp_path):
    """--model volume on a plan that puts its layers on a sample, a depth and a channel grid
    (the containers redistribute between them): 20 float64 steps equal one rank's."""
    from cfp.train import TrainConfig, train_model
    from test_train import assert_trains_like, weights
    plan = _volume_plan(mpi_tmp_path / "volume_plan.json")
    cfg = dict(model="volume", dataset="synthetic", width=1, epochs=1, batch_size=8, train_samples=160, max_steps=20,
               lr=0.05, dtype="float64", progress=False, seed=1, upsample=2 if SIZE > 2 else 1)
    if not _one_rank_volume:  # (the same run as test_volume_model_trains_like_one_rank's)
        result, model = train_model(TrainConfig(grid="sample=1", algorithm="y", **cfg), world=WORLD.Split(WORLD.Get_rank()))
        _one_rank_volume["run"] = ([h["loss"] for h in result["history"]], weights(model))
    result, model = train_model(TrainConfig(plan=plan, algorithm="y", **cfg))
    assert_trains_like(result, model, _one_rank_volume["run"], "volume model on a mixed plan", tol=1e-10)


def unet_runs():
    """(grid, algorithm, plan name or None): --model unet on grids that split samples, height
    (and width), channels, on a mixed plan, and as the planner chooses (auto)."""
    if SIZE == 1:
        return [("sample=1", "y", None)]
    out = [(UNET_SAMPLES, "sample", None), (split_grid("height"), "y", None), (MODEL_CHANNELS, "x", None),
           (None, "y", "mixed"), (None, "auto", None)]
    if SIZE == 4:
        out += [("height=2,width=2", "w", None), ("sample=2,height=2", "y", None)]
    return out


_one_rank_unet = {}


@pytest.mark.parametrize("grid, algorithm, plan", unet_runs())
def test_unet_trains_like_one_rank(grid, algorithm, plan, mpi_tmp_path):
    """--model unet: 20 float64 steps of the encoder-decoder (Conv2d, BatchNorm2d, MaxPool2d,
    ConvTranspose2d, Upsample, a 1x1 convolution to per-pixel logits, the per-pixel loss) on
    synthetic label maps, on grids that split samples, height and width, channels, and on a
    plan mixing them, equal one rank's losses and final weights."""
    from cfp.train import TrainConfig, train_model
    from test_train import assert_trains_like, weights
    # (16 x 16 pixels where 3 or 4 ranks split height: the pooled body keeps a row a rank)
    cfg = dict(model="unet", dataset="synthetic", width=1, epochs=1, batch_size=8, train_samples=160, max_steps=20,
               lr=0.05, dtype="float64", progress=False, seed=1, upsample=2 if SIZE > 2 else 1)
    if not _one_rank_unet:
        result, model = train_model(TrainConfig(grid="sample=1", algorithm="y", **cfg),
                                    world=WORLD.Split(WORLD.Get_rank()))
        _one_rank_unet["run"] = ([h["loss"] for h in result["history"]], weights(model))
    if plan == "mixed":
        cfg["plan"] = _mixed_plan(mpi_tmp_path / "unet_plan.json", {
            "stem.conv": (UNET_SAMPLES, "sample"), "down.conv": (split_grid("height"), "y"),
            "body.conv": (MODEL_CHANNELS, "w"), "up.conv": (split_grid("width"), "x"), "head": (UNET_SAMPLES, "y")})
    else:
        cfg["grid"] = grid
    result, model = train_model(TrainConfig(algorithm=algorithm, **cfg, **_planned(algorithm)))
    assert_all_ranks(len(result["history"]) == 20, "20 steps")
    assert_trains_like(result, model, _one_rank_unet["run"], f"unet on {grid or plan}, {algorithm}", tol=1e-10)


def ledger_runs():
    """(model, grid, algorithm): the volume model on depth and channel splits, the unet on
    height, width and channel splits."""
    if SIZE == 1:
        return [("volume", "sample=1", "y"), ("unet", "sample=1", "y")]
    out = [("volume", split_grid("depth"), "y"), ("volume", split_grid("depth"), "sample"), ("volume", MODEL_CHANNELS, "x"),
           ("unet", split_grid("height"), "y"), ("unet", split_grid("width"), "w"), ("unet", MODEL_CHANNELS, "y")]
    if SIZE == 4:
        out += [("volume", "depth=2,height=2", "w"), ("unet", "sample=2,height=2", "sample")]
    return out


@pytest.mark.parametrize("model_name, spec, algorithm", ledger_runs())
def test_a_models_ledger_equals_its_predicted_bytes(model_name, spec, algorithm):
    """One training step of the volume and unet models: every convolution's (Conv3d,
    ConvTranspose2d, the classifier after a volume's global pooling, whose depth ranks hold
    copies), every pooling and upsampling layer's halo and every redistribution's bytes per
    phase are Network.predicted_bytes, exactly."""
    from cfp.grid import Grids
    from cfp.models import build_model
    from cfp.nn import SoftmaxCrossEntropy
    from cfp.optim import SGD
    from cfp.train import train_step
    base = ProcessGrid(spec)
    side = 16 if SIZE > 2 else 8
    model = build_model(model_name, base, grids=Grids(base, owns_base=True), width=1, dtype=np.float64,
                        in_channels=1, classes=4, image=side, algorithm=algorithm)
    rng = np.random.default_rng(14)
    batch = 4
    x = rng.standard_normal((batch, 1) + (side,) * (3 if model_name == "volume" else 2))
    y = rng.integers(0, 4, (batch,) if model_name == "volume" else (batch, side, side))
    (rows,) = model.input_spec[1].head(1).indices((batch,), model.grid, model.grid.coords)
    ledger = C.CommLedger()
    with C.use_ledger(ledger):
        train_step(model, SoftmaxCrossEntropy(model.grid), SGD(model.parameters(), 0.1), x[rows.start:rows.stop],
                   y[rows.start:rows.stop])
    predicted = model.predicted_bytes(itemsize=8)
    measured = {k: (t["bytes_sent"], t["bytes_received"]) for k, t in ledger.totals(by=("layer", "phase")).items()}
    wrong = {k: (measured.get(k, (0, 0)), v) for k, v in predicted.items() if measured.get(k, (0, 0)) != v}
    unpredicted = [k for k in measured if k[1] in ("redistribute", "halo") and k not in predicted]
    assert_all_ranks(not wrong and not unpredicted,
                     f"{model_name} on {spec}: (measured, predicted) {wrong}; not predicted {unpredicted}")
    pooled = [k for k in predicted if k[1] == "halo" and k[0] in ("MaxPool3d", "MaxPool2d", "Upsample")]
    split = any(base.shape[a] > 1 for a in ("depth", "height", "width"))
    assert_all_ranks(SIZE == 1 or pooled or not split, f"{model_name} on {spec}: no pooling halo predicted")
    model.free()


def test_volume_and_unet_models_refuse_other_datasets():
    from cfp.train import TrainConfig, train
    for model, options, message in (
            ("volume", dict(dataset="digits"), r"--model volume convolves volumes: expected --dataset synthetic"),
            ("unet", dict(dataset="digits"), r"--model unet labels every pixel: expected --dataset synthetic")):
        base = dict(model=model, dataset="synthetic", epochs=1, batch_size=8, train_samples=16, progress=False)
        raises_on_all_ranks(ValueError, lambda: train(TrainConfig(**{**base, **options})), match=message)


def _group_norm_by_hand(x, dy, G, w, b, eps=1e-5):
    """GroupNorm's forward and its gradients, written out in float64 on whole tensors."""
    n, C = x.shape[:2]
    xs = x.reshape(n, G, -1)
    mean, var = xs.mean(axis=2, keepdims=True), xs.var(axis=2, keepdims=True)
    x_hat = ((xs - mean) / np.sqrt(var + eps)).reshape(x.shape)
    shape = (1, C) + (1,) * (x.ndim - 2)
    y = x_hat * w.reshape(shape) + b.reshape(shape)
    axes = (0,) + tuple(range(2, x.ndim))
    g = (dy * w.reshape(shape)).reshape(n, G, -1)
    xh = x_hat.reshape(n, G, -1)
    dx = (g - g.mean(axis=2, keepdims=True) - xh * (g * xh).mean(axis=2, keepdims=True)) / np.sqrt(var + eps)
    return y, dx.reshape(x.shape), dy.sum(axis=axes), (dy * x_hat).sum(axis=axes)


@pytest.mark.parametrize("spec", sorted({f"channel={SIZE}", f"sample={SIZE}", split_grid("depth")}
                                        | ({"depth=2,channel=2", "sample=2,channel=2"} if SIZE == 4 else set())))
@pytest.mark.parametrize("G, C", [(3, 6), (2, 6), (6, 6), (1, 5)])
def test_group_norm_matches_its_formula_on_every_split(spec, G, C):
    """GroupNorm of a volume (and, off depth grids, an image) split by sample, channel (groups
    spanning channel ranks: 6 channels in 3 or 2 groups over 4 ranks) and depth: y, dx and the
    parameters' gradients equal the formula on the whole tensors (and PyTorch's group_norm
    where installed); the ledger names the layer's phases."""
    from cfp.nn import GroupNorm
    rng = np.random.default_rng(15)
    grid = ProcessGrid(spec)
    shapes = [(3, C, 4, 3, 5)] + ([] if "depth" in spec else [(3, C, 4, 5)])
    for shape in shapes:
        x, dy = rng.standard_normal(shape), rng.standard_normal(shape)
        w, b = rng.standard_normal(C), rng.standard_normal(C)
        spatial = ("depth", "height", "width")[5 - len(shape):]
        layout = Layout(("sample", "channel") + tuple(a if grid.shape[a] > 1 else None for a in spatial))
        if grid.shape["channel"] > C:
            continue
        gn = GroupNorm(grid, G, C, layout=layout, dtype=np.float64)
        gn.weight.data, gn.bias.data = gn.weight.take(w), gn.bias.take(b)
        y = DistTensor(gn.forward(DistTensor.from_global(x, layout, grid).local), shape, layout, grid).gather()
        dx = DistTensor(gn.backward(DistTensor.from_global(dy, layout, grid).local), shape, layout, grid).gather()
        want = _group_norm_by_hand(x, dy, G, w, b)
        for got, expected, what in zip((y, dx, gather_parameter(gn.bias), gather_parameter(gn.weight)), want,
                                       ("y", "dx", "dbias", "dweight")):
            assert_close_all_ranks(got, expected, 1e-11, f"{spec} G={G} {shape} {what}")
        try:
            import torch
        except ImportError:
            continue
        ty = torch.nn.functional.group_norm(torch.tensor(x), G, torch.tensor(w), torch.tensor(b), 1e-5).numpy()
        assert_close_all_ranks(y, ty, 1e-11, f"{spec} G={G} {shape} y against torch")
    grid.free()


def test_group_norm_refusals():
    from cfp.nn import GroupNorm
    grid = ProcessGrid(f"sample={SIZE}")
    raises_on_all_ranks(ValueError, lambda: GroupNorm(grid, 4, 6), match=r"num_groups=4 must be a positive integer dividing num_channels=6")
    if SIZE > 1:
        depth = ProcessGrid(f"depth={SIZE}")
        raises_on_all_ranks(ValueError, lambda: GroupNorm(depth, 2, 6, layout=Layout(("sample", None, None, None))),
                            match=r"leaves the depth axis holding copies")
        depth.free()
    grid.free()


@pytest.mark.parametrize("model", ["volume", "unet"])
def test_overlap_all_trains_volumes_and_the_unet_like_one_rank(model, monkeypatch):
    """--overlap all on a split volume (depth) and a split image with transposed layers
    (height), data parallel inside: the convolutions compute their interior while the halo
    moves (the halos started so are counted), the transposed ones, which refuse it, exchange
    theirs blocking (ConvAlgorithm.interior_applies), and 20 float64 steps equal one rank's."""
    from cfp.halo import Halo
    from cfp.train import TrainConfig, train_model
    from test_train import assert_trains_like, weights
    started = []
    monkeypatch.setattr(Halo, "start", lambda *a, real=Halo.start, **k: started.append(1) or real(*a, **k))
    cfg = dict(model=model, dataset="synthetic", width=1, epochs=1, batch_size=8, train_samples=160, max_steps=20,
               lr=0.05, dtype="float64", progress=False, seed=1, upsample=2 if SIZE > 2 else 1)
    cache = _one_rank_volume if model == "volume" else _one_rank_unet
    if not cache:
        result, trained = train_model(TrainConfig(grid="sample=1", algorithm="y", **cfg), world=WORLD.Split(WORLD.Get_rank()))
        cache["run"] = ([h["loss"] for h in result["history"]], weights(trained))
    started.clear()
    split = "depth" if model == "volume" else "height"
    spec = split_grid(split)  # (at 5 and 7 ranks its split axis has one rank: no halo to start)
    result, trained = train_model(TrainConfig(grid=spec, algorithm="sample", overlap="all", **cfg))
    if ProcessGrid.shape_of(spec)[split] > 1:
        assert_all_ranks(len(started) >= 20, f"{model}: {len(started)} halos started with the interior")
    assert_trains_like(result, trained, cache["run"], f"{model} on {spec} under --overlap all", tol=1e-10)
