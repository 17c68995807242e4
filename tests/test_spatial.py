"""Spatial parallelism: every algorithm on every factorization of the world into sample x height
x width x channel, against the serial convolution of the same global tensors (float64): uneven
heights and widths, strides 1 and 2, paddings 0 to 2 and 'same', kernels 1 to 5, dilation,
groups, the padding modes (whose padded rows may copy another rank's rows); the halo exchange's
ledger against perfmodel.predict_bytes, and its adjoint."""
import numpy as np
import pytest

from cfp import comm as C
from cfp.algorithms import make_conv
from cfp.grid import ProcessGrid
from cfp.halo import halo_plan
from cfp.kernels import conv2d_backward_filter, conv2d_forward, fold_index
from cfp.layout import activation_layout
from cfp.perfmodel import ledger_bytes, predict_bytes
from cfp.tensor import DistTensor
from conftest import IMAGE_AXES, SIZE, WORLD, assert_all_ranks, assert_close_all_ranks, grid_specs, raises_on_all_ranks
from test_algorithm_options import check_against_serial, problem

pytestmark = pytest.mark.mpi

SPECS = [s for s in grid_specs(4, IMAGE_AXES) if "height=1,width=1" not in s or SIZE == 1]


def configs():
    out = []
    for spec in SPECS:
        P_c = int(spec.split("channel=")[1])
        out += [(spec, "sample", None), (spec, "x", None), (spec, "y", None)]
        out += [(spec, "w", p_f) for p_f in range(1, P_c + 1) if P_c % p_f == 0]
    return out


CONFIGS = configs()

# N, C, F, H, W, K, options: 7 rows over 2 or 3 ranks, even and odd kernels, strides, dilation
CASES = {
    "k3-p1": (2, 3, 5, 7, 6, 3, {"padding": 1}),
    "k5-p2-s2": (2, 4, 3, 9, 7, 5, {"padding": 2, "stride": 2}),
    "k1": (3, 2, 4, 7, 5, 1, {}),
    "k2-p0": (1, 3, 2, 7, 8, 2, {}),
    "k4-same": (2, 2, 3, 7, 7, 4, {"padding": "same"}),
    "k3-d2-p2": (2, 3, 3, 8, 7, 3, {"dilation": 2, "padding": 2}),
    "k3-s2-p0-pairs": (2, 3, 4, 9, 8, 3, {"stride": (2, 1), "padding": (0, 1)}),
    "groups2": (2, 4, 6, 7, 6, 3, {"groups": 2, "padding": 1}),
    # 3 rows and 5 columns padded by 2: at 4 ranks along an axis a rank holds no input row or
    # column yet has an output one, all of it from its neighbours and the padding
    "empty-input-blocks": (1, 2, 3, 3, 5, 3, {"padding": 2}),
    # 2 columns padded by 1 and 5: along width the last blocks read nothing but the padding
    "padding-only-blocks": (2, 2, 3, 5, 2, 2, {"padding": (1, 1, 1, 5)}),
    # padding modes: the padded rows copy image rows, at the border of the split on the ranks
    # at the image's edge, or (wrapped around, or reflected past a thin block) on other ranks
    "reflect": (2, 3, 4, 7, 6, 3, {"padding": 1, "padding_mode": "reflect"}),
    "replicate-k5-s2": (2, 4, 3, 9, 7, 5, {"padding": 2, "stride": 2, "padding_mode": "replicate"}),
    "circular-d2": (2, 3, 4, 8, 7, 3, {"padding": 2, "dilation": 2, "padding_mode": "circular"}),
    "same-even-reflect": (2, 2, 3, 7, 7, 4, {"padding": "same", "padding_mode": "reflect"}),
    "circular-wide-pairs": (1, 2, 3, 5, 5, 3, {"padding": (3, 4), "padding_mode": "circular"}),
    "depthwise-replicate": (2, 4, 8, 7, 6, 3, {"padding": 1, "groups": 4, "padding_mode": "replicate"}),
}


def fitted(case, spec):
    """The case with its image grown, a stride at a time, until every rank of the grid's height
    and width axes computes an output row and column (the image too small for the grid is
    refused, test_a_too_small_image...); at 1-4 ranks every case fits as written, and at 6 to 16
    ranks (make test-scale) a 1 x 6 or 8 x 2 split gets the rows and columns it needs."""
    from cfp.kernels import conv2d_output_shape
    N, Cin, F, H, W, K, opts = case
    sizes = dict(item.split("=") for item in spec.split(","))
    stride = opts.get("stride", 1)
    sh, sw = (stride, stride) if isinstance(stride, int) else stride

    def outputs(H, W):
        return conv2d_output_shape((1, Cin, H, W), (F, Cin // opts.get("groups", 1), K, K), **opts)[2:]
    while outputs(H, W)[0] < int(sizes.get("height", 1)):
        H += sh
    while outputs(H, W)[1] < int(sizes.get("width", 1)):
        W += sw
    return (N, Cin, F, H, W, K, opts)


def ids(config):
    spec, alg, p_f = config
    return f"{spec}-{alg}" + (f"-pf{p_f}" if p_f else "")


@pytest.fixture(scope="module")
def grids():
    made = {spec: ProcessGrid(spec) for spec in SPECS}
    yield made
    for g in made.values():
        g.free()


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("config", CONFIGS, ids=ids)
def test_spatial_grids_match_serial(grids, config, name):
    check_against_serial(grids[config[0]], config, fitted(CASES[name], config[0]), name)


# the cases whose windows leave an interior on some rank, and those (padding only, a rank
# holding no row, padding modes) where a rank has none and waits for its halo
INTERIOR_CASES = ["k3-p1", "k5-p2-s2", "k2-p0", "k4-same", "k3-d2-p2", "k3-s2-p0-pairs", "groups2",
                  "empty-input-blocks", "padding-only-blocks", "reflect", "depthwise-replicate"]


@pytest.mark.parametrize("name", INTERIOR_CASES)
@pytest.mark.parametrize("config", [c for c in CONFIGS if c[1] in ("sample", "x") and "height=1,width=1" not in c[0]],
                         ids=ids)
def test_the_interior_computed_while_the_halo_moves_matches_serial(grids, config, name):
    """halo_interior: the output rows and columns that read no halo computed from the block
    held while the halo moves, the border strips after: the same y, dx, dw, db as the serial
    kernels and the same messages as the blocking exchange (the ledger against
    predict_bytes). Grouped cases run every algorithm's GroupedChannels."""
    case = fitted(CASES[name], config[0])
    if name == "k3-p1":  # a 3x3 window over 2 rows and columns leaves an interior on the rank that has them
        N, Cin, F, H, W, K, opts = case
        grid = grids[config[0]]  # (7 x 6 as written at 1-4 ranks; a width of 6 ranks gets a column more than ranks)
        H, W = max(H, grid.axis_size("height") + 1), max(W, grid.axis_size("width") + 1)
        case = (N, Cin, F, H, W, K, opts)
    check_against_serial(grids[config[0]], config, case, name, halo_interior=True)
    if name == "k3-p1":
        conv = make_conv(config[1], grids[config[0]], Cin, F, K, layer="conv", halo_interior=True, **opts)
        some = grids[config[0]].comm.allreduce(conv.halo_plan((N, Cin, H, W)).interior is not None)
        assert_all_ranks(some > 0, f"{ids(config)}: no rank has an interior")


@pytest.mark.parametrize("spec", [s for s in SPECS if "height=1,width=1" not in s])
def test_the_first_layer_under_stationary_y_computes_its_interior_while_the_halo_moves(grids, spec):
    """Stationary-y with its input whole over the channel axis (the network's first layer)
    convolves its own block: with halo_interior its y and dw equal the serial ones, and its
    messages the blocking exchange's."""
    N, Cin, F, H, W, K, opts = fitted(CASES["k3-p1"], spec)
    x, w, b, dy = problem(fitted(CASES["k3-p1"], spec))
    grid = grids[spec]
    conv = make_conv("y", grid, Cin, F, K, layer="conv", input_whole=True, need_dx=False, halo_interior=True,
                     **opts)
    ledger = C.CommLedger()
    with C.use_ledger(ledger):
        y = conv.forward(DistTensor.from_global(x, conv.input_layout, grid).local, conv.shard_weight(w),
                         conv.shard_bias(b))
        _, dw, db = conv.backward(DistTensor.from_global(dy, conv.output_layout, grid).local)
    assert_close_all_ranks(DistTensor(y, dy.shape, conv.output_layout, grid).gather(),
                           conv2d_forward(x, w, b, **opts), 1e-10, f"{spec} y")
    assert_close_all_ranks(conv.weight_tensor(dw).gather(), conv2d_backward_filter(x, dy, w.shape, **opts),
                           1e-10, f"{spec} dw")
    predicted = predict_bytes("y", x.shape, w.shape, spec, grid.coords, itemsize=8, input_whole=True,
                              need_dx=False, **opts)
    measured = ledger_bytes(ledger, layer="conv")
    assert_all_ranks(measured == predicted, f"{spec}: ledger {measured} != predicted {predicted}")


@pytest.mark.parametrize("algorithm,first", [("y", False), ("w", False), ("x", True)])
def test_the_interior_is_refused_where_channels_move_before_the_kernel(grids, algorithm, first):
    """Where channels are gathered (stationary-y, -w) or taken (the first layer) between the
    halo and the kernel, halo_interior is refused, never run as the blocking exchange."""
    spec = SPECS[-1]
    raises_on_all_ranks(ValueError, lambda: make_conv(algorithm, grids[spec], 4, 4, 3, padding=1, layer="conv",
                                                      input_whole=first, need_dx=not first, halo_interior=True),
                        "halo_interior")


def test_the_halo_moves_what_the_windows_need(grids):
    """On height=P (when the world allows), a 3x3 'same' layer: each inner boundary sends one
    row each way, so a rank's halo bytes are its neighbours' edge rows, forward and back."""
    spec = f"sample=1,height={SIZE},width=1,channel=1"
    if SIZE == 1:
        pytest.skip("one rank has no neighbour")
    grid = grids[spec]
    x = np.random.default_rng(1).standard_normal((2, 3, 4 * SIZE, 5))
    conv = make_conv("sample", grid, 3, 2, 3, padding=1, layer="conv")
    ledger = C.CommLedger()
    with C.use_ledger(ledger):
        y = conv.forward(DistTensor.from_global(x, conv.input_layout, grid).local,
                         conv.shard_weight(np.ones((2, 3, 3, 3))), conv.shard_bias(np.zeros(2)))
        conv.backward(np.ones_like(y))
    neighbours = (grid.coord("height") > 0) + (grid.coord("height") < SIZE - 1)
    row = 2 * 3 * 5 * 8  # samples x channels x columns x bytes
    halo = ledger_bytes(ledger, "conv")["halo"]
    assert_all_ranks(halo == (2 * neighbours * row, 2 * neighbours * row), f"halo bytes {halo}")


def test_an_image_too_small_for_the_grid_is_refused(grids):
    """More ranks along height than output rows: one message on every rank, before any move."""
    if SIZE == 1:
        pytest.skip("one rank holds any image")
    grid = grids[f"sample=1,height={SIZE},width=1,channel=1"]
    conv = make_conv("x", grid, 2, 2, 3, stride=2, layer="conv")
    x = DistTensor.from_global(np.zeros((1, 2, 2 * SIZE - 1, 4)), conv.input_layout, grid).local
    raises_on_all_ranks(ValueError, lambda: conv.forward(x, conv.shard_weight(np.zeros((2, 2, 3, 3))),
                                                         conv.shard_bias(np.zeros(2))),
                        match=f"gives {SIZE - 1} output rows, too few for the {SIZE} ranks of the height axis")


def test_refusals(grids):
    spec = SPECS[-1]
    grid = grids[spec]
    if grid.axis_size("height") * grid.axis_size("width") == 1:
        pytest.skip("needs a spatial grid")
    conv = make_conv("y", grid, 4, 4, 3, padding=6, padding_mode="reflect", layer="conv")
    x = DistTensor.from_global(np.zeros((2, 4, 6, 6)), conv.input_layout, grid).local
    # a reflection as wide as the image, refused from the global shape as the kernels refuse it
    raises_on_all_ranks(ValueError, lambda: conv.forward(x, conv.shard_weight(np.zeros((4, 4, 3, 3))),
                                                         conv.shard_bias(np.zeros(4))),
                        match=r"padding \(6, 6, 6, 6\) .* with padding_mode 'reflect' must be smaller than the input 6x6")
    conv = make_conv("y", grid, 4, 4, 3, padding=1, layer="conv")
    with C.inputs_checked():  # a trusted caller must say the global shape
        raises_on_all_ranks(ValueError, lambda: conv.forward(x, conv.shard_weight(np.zeros((4, 4, 3, 3))),
                                                             conv.shard_bias(np.zeros(4))),
                            match="needs the global input shape")


# ---------------------------------------------------------------------------------------------
# Training on spatial grids: 20 float64 steps of the small ResNet, the same losses as one rank.

TRAIN_GRIDS = {2: [("height=2", "y"), ("width=2", "x"), ("height=2", "sample"), ("height=2", "x", "wide")],
               3: [("height=3", "w")],
               4: [("sample=2,height=2", "y"), ("height=2,channel=2", "w"), ("height=2,width=2", "x"),
                   ("height=2,width=2", "sample", "wide")],
               # make test-scale: three and four split axes, uneven blocks of 3, p_f of 2 and 3
               6: [("sample=2,height=3", "y"), ("height=2,channel=3", "w")],
               8: [("sample=2,height=2,width=2", "x"), ("height=2,width=2,channel=2", "w", "wide")],
               12: [("sample=2,height=2,width=3", "y"), ("height=2,width=2,channel=3", "w")],
               16: [("sample=2,height=2,width=2,channel=2", "w"), ("height=4,width=4", "sample")]}
_serial = {}


WIDE = {"model": "wide", "width": 8, "depth": 2}  # with a max pool, whose halo the image split needs


def _serial_losses(upsample, model="resnet"):
    from mpi4py import MPI
    from test_train import config
    from cfp.train import train
    if (upsample, model) not in _serial:
        extra = WIDE if model == "wide" else {}
        result = train(config(grid="sample=1", upsample=upsample, **extra), world=MPI.COMM_SELF)
        _serial[upsample, model] = np.array([h["loss"] for h in result["history"]])
    return _serial[upsample, model]


@pytest.mark.parametrize("case", TRAIN_GRIDS.get(SIZE, []), ids=lambda c: "-".join(c))
def test_training_on_spatial_grids_matches_one_rank(case):
    """Batch norm over sample x height x width ranks, global pooling over the spatial ranks, the
    classifier and the loss on copies along them, max pooling with its halo; 16x16 digits where
    more than 2 ranks share an image axis (the 2x2 outputs of the last stage of 8x8 digits do not
    split three ways)."""
    from test_train import config
    from cfp.train import train
    from cfp.grid import parse_grid_spec
    spec, algorithm, model = (case + ("resnet",))[:3]
    sizes = parse_grid_spec(spec)
    upsample = 2 if max(sizes.get("height", 1), sizes.get("width", 1)) > 2 else 1
    extra = WIDE if model == "wide" else {}
    result = train(config(grid=spec, algorithm=algorithm, upsample=upsample, **extra))
    assert_close_all_ranks(np.array([h["loss"] for h in result["history"]]), _serial_losses(upsample, model),
                           1e-9, f"{spec} {algorithm} {model} losses")


def test_a_plan_from_spatial_to_channel_parallelism(mpi_tmp_path):
    """The early 8x8 layers split the image, the late wide ones the channels: the planner's
    idea of spatial parallelism early, channel parallelism late, run as a plan."""
    if SIZE == 1:
        pytest.skip("one rank splits nothing")
    import json
    from test_train import config
    from cfp.train import train
    layers = {"stem.conv": {"grid": f"height={SIZE}", "algorithm": "sample"},
              "layer2.conv1": {"grid": f"channel={SIZE}", "algorithm": "y"},
              "layer2.proj": {"grid": f"width={SIZE}" if SIZE < 3 else f"channel={SIZE}", "algorithm": "x"},
              "layer3.conv1": {"grid": f"channel={SIZE}", "algorithm": "y"}}
    path = mpi_tmp_path / "plan.json"
    if WORLD.Get_rank() == 0:
        path.write_text(json.dumps({"layers": layers}))
    WORLD.Barrier()
    upsample = 1 if SIZE <= 8 else 2  # 16x16 digits where the stem's 8 rows would not split
    result = train(config(plan=str(path), upsample=upsample))
    assert_close_all_ranks(np.array([h["loss"] for h in result["history"]]), _serial_losses(upsample), 1e-9,
                           "spatial then channel plan losses")


@pytest.mark.parametrize("pool,kernel,stride,padding", [("max", 3, 2, 1), ("avg", 3, 1, 1), ("max", 2, 2, 0),
                                                         ("avg", 2, 2, 0)])
def test_pooling_on_split_images(grids, pool, kernel, stride, padding):
    """Max and average pooling of a 7x9 image split over height and width: the blocks' halos
    (also where stride = kernel: 7 rows in blocks of 4 and 3 pool to 2 and 1 output rows, whose
    windows cross the blocks' boundary), forward and backward, against one rank."""
    from cfp.nn import AvgPool2d, MaxPool2d, Sequential
    from cfp.tensor import Layout
    from test_kernels_pool import pool_pass
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 7, 9))
    y, dy, dx = pool_pass(pool, x, kernel, stride, padding, rng)
    for spec in SPECS:
        grid = grids[spec]
        if (y.shape[2] < grid.axis_size("height")) or (y.shape[3] < grid.axis_size("width")):
            continue
        layout = Layout(("sample", "channel" if grid.axis_size("channel") > 1 else None,
                         "height" if grid.axis_size("height") > 1 else None,
                         "width" if grid.axis_size("width") > 1 else None))
        model = Sequential((MaxPool2d if pool == "max" else AvgPool2d)(kernel, stride, padding))
        model.place((grid, layout))
        out = model.forward(DistTensor.from_global(x, layout, grid))
        back = model.backward(DistTensor.from_global(dy, layout, grid))
        assert_close_all_ranks(out.gather(), y, 1e-12, f"{pool} {spec} y")
        assert_close_all_ranks(back.gather(), dx, 1e-12, f"{pool} {spec} dx")


@pytest.mark.parametrize("mode,needed,at", [
    ("circular", (0, 1, 2, 3, 4, 7), (5, 0, 1, 2, 3, 4)),  # row -1 is row 7, on the other rank
    ("reflect", range(0, 5), (1, 0, 1, 2, 3, 4)),  # row -1 is row 1
    ("replicate", range(0, 5), (0, 0, 1, 2, 3, 4)),  # row -1 is row 0
])
def test_a_padding_mode_halo_brings_the_rows_the_padded_rows_copy(mode, needed, at):
    """halo_plan on height=2 for 8 rows, 3x3, padding 1: the top rank reads padded rows -1..4,
    so it needs the image rows they copy and gathers its padded block from them; the bottom
    rank's rows 3..7 and the copy of row 0 (circular) or row 6 (reflect) or row 7 (replicate)."""
    grid = (("sample", 1), ("height", 2), ("width", 1), ("channel", 1))
    options = (("dilation", 1), ("padding", 1), ("padding_mode", mode), ("stride", 1))
    plan = halo_plan((1, 1, 8, 4), activation_layout(grid, None), grid, (3, 3), options)
    top, bottom = plan["spans"]["height"]
    assert top == (4, needed, 0, 0, at)
    assert bottom[1] == {"circular": (0, 3, 4, 5, 6, 7), "reflect": range(3, 8), "replicate": range(3, 8)}[mode]
    assert plan["spans"]["width"] == [(4, range(0, 4), 0, 0, {"circular": (3, 0, 1, 2, 3, 0), "reflect": (1, 0, 1, 2, 3, 2),
                                                              "replicate": (0, 0, 1, 2, 3, 3)}[mode])]
    # on 3 blocks of 9 rows the middle one meets no border: its padded block is its extended one
    grid3 = (("sample", 1), ("height", 3), ("width", 1), ("channel", 1))
    middle = halo_plan((1, 1, 9, 4), activation_layout(grid3, None), grid3, (3, 3), options)["spans"]["height"][1]
    assert middle == (3, range(2, 7), 0, 0, None)
    if mode == "circular":  # with the halo rows, each rank sends the row the other's wrap reads
        assert (1, 0, (range(0, 1), range(0, 1), (4, 7), range(0, 4))) in plan["pieces"]
        assert (0, 1, (range(0, 1), range(0, 1), (0, 3), range(0, 4))) in plan["pieces"]


@pytest.mark.parametrize("at,extent", [((5, 0, 1, 2, 3, 4), 6), ((1, 0, 1, 2, 3, 2), 4), ((0, 0, 0, 1, 2, 2, 2), 3),
                                       ((0, 1, 2), 3), ((2, 0, 1, 2, 0), 3)])
def test_folding_a_padded_axis_is_the_adjoint_of_padding_it(at, extent):
    """fold_index(d, at) = S^T d for the 0/1 matrix S that pads (S[k, at[k]] = 1): repeated,
    reversed and wrapped-around positions added where they came from."""
    rng = np.random.default_rng(3)
    d = rng.standard_normal((2, 3, len(at), 4))
    S = np.zeros((len(at), extent))
    S[np.arange(len(at)), at] = 1
    assert np.allclose(fold_index(d, at, extent, 2), np.einsum("kh,nckw->nchw", S, d), rtol=0, atol=1e-15)
    assert np.allclose(fold_index(d.transpose(0, 1, 3, 2), at, extent, 3),
                       np.einsum("kh,nckw->ncwh", S, d), rtol=0, atol=1e-15)


@pytest.mark.parametrize("name", ["k5-p2-s2", "k4-same", "k3-d2-p2"])
def test_the_halo_exchange_is_the_adjoint_of_the_halo_add(grids, name):
    """<halo(x), y> = <x, halo_adjoint(y)> summed over the ranks, for random blocks x and random
    extended blocks y, on every spatial grid."""
    rng = np.random.default_rng(7 + WORLD.Get_rank())
    for spec in SPECS:
        N, Cin, F, H, W, K, opts = fitted(CASES[name], spec)
        grid = grids[spec]
        conv = make_conv("x", grid, Cin, F, K, layer="conv", **opts)
        if not conv.spatial:
            continue
        conv._halo = conv.halo_plan((N, Cin, H, W))
        x = rng.standard_normal(conv.input_layout.local_shape((N, Cin, H, W), grid, grid.coords))
        y = rng.standard_normal(tuple(len(ix) for ix in conv._halo.wanted))
        lhs = WORLD.allreduce(float(np.vdot(conv.halo(x), y)))
        rhs = WORLD.allreduce(float(np.vdot(x, conv.halo_adjoint(y))))
        assert_all_ranks(abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs)), f"{spec} {name}: {lhs} != {rhs}")


def test_the_planners_spatial_plan_trains_like_one_rank(mpi_tmp_path):
    """The planner's plan with grids that split the image considered layer by layer (plan.py
    --spatial), for the small ResNet on 32x32 digits four samples at a time, run as a plan file:
    at 4 ranks it splits the image of three layers (width=2,channel=2 under the cpu-dev profile)
    and redistributes between those and the channel-parallel rest."""
    import json
    from test_train import config
    from cfp.models import layer_shapes
    from cfp.perfmodel import MachineProfile
    from cfp.planner import plan, plan_entries
    from cfp.train import train
    shapes = layer_shapes("resnet", 1, 4, in_channels=1, classes=10, image=32)
    planned = plan(shapes, SIZE, MachineProfile.load("cpu-dev"), algorithms=("sample", "y"), spatial=True)
    if SIZE == 4:
        grids = [c.grid for c in planned.choices]
        assert any(c.P_h * c.P_w > 1 for c in planned.choices), grids
        assert any(c.P_h * c.P_w == 1 for c in planned.choices), grids
    path = mpi_tmp_path / "plan.json"
    if WORLD.Get_rank() == 0:
        path.write_text(json.dumps({"layers": plan_entries(planned)}))
    WORLD.Barrier()
    common = dict(upsample=4, batch_size=4, train_samples=16, max_steps=4)
    from mpi4py import MPI
    serial = train(config(grid="sample=1", **common), world=MPI.COMM_SELF)
    result = train(config(plan=str(path), **common))
    assert_close_all_ranks(np.array([h["loss"] for h in result["history"]]),
                           np.array([h["loss"] for h in serial["history"]]), 1e-9, "the planner's spatial plan")
