"""The cost model and the planner: profile loading and its errors, the alpha-beta formulas, the
model's message sizes against predict_bytes, and the planner's choices and memory limit."""
import dataclasses
import re
import json

import pytest
from mpi4py import MPI

from cfp.grid import ProcessGrid
from cfp.kernels.conv.paths import taken
from cfp.models import build_model, layer_shapes
from cfp.perfmodel import LayerShape, MachineProfile, layer_cost, predict_bytes
from cfp.planner import plan, plan_entries


def profile_data(alpha=0.0, beta=1.0, rate=1e10, ranks_per_node=4, inter=None):
    links = {"intra": {c: [alpha, beta] for c in ("allgather", "reduce_scatter", "allreduce", "alltoall")}}
    if inter:
        links["inter"] = {c: list(inter) for c in ("allgather", "reduce_scatter", "allreduce", "alltoall")}
    points = {"*": [[1e6, 64, rate], [1e9, 4096, rate]], "winograd": [[1e6, 64, rate], [1e9, 4096, rate]]}
    return {"format": 2, "name": "test", "itemsize": 4, "ranks_per_node": ranks_per_node, "links": links,
            "kernels": {p: points for p in ("forward", "backward-data", "backward-filter")}}


def test_builtin_profiles_load():
    for name in ("cpu-dev", "reference-v100"):
        p = MachineProfile.load(name)
        assert p.name == name and p.source
        assert p.kernel_time("forward", "winograd", 1e9, 1024) > 0


def test_profile_errors(tmp_path):
    with pytest.raises(ValueError, match="machine profile 'missing.json' does not exist"):
        MachineProfile.load("missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        MachineProfile.load(str(bad))
    partial = tmp_path / "partial.json"
    data = profile_data()
    del data["links"]["intra"]["alltoall"]
    partial.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="is not a valid machine profile: missing or malformed 'alltoall'"):
        MachineProfile.load(str(partial))


def test_collective_formulas():
    p = MachineProfile(profile_data(alpha=2.0, beta=0.5, inter=(10.0, 1.0), ranks_per_node=4))
    assert p.collective_time("allgather", 4, 800) == 3 * 2.0 + 0.75 * 800 * 0.5
    assert p.collective_time("allreduce", 4, 800) == 6 * 2.0 + 1.5 * 800 * 0.5
    assert p.collective_time("allreduce", 4, 800, intra=False) == 6 * 10.0 + 1.5 * 800 * 1.0
    assert p.collective_time("reduce_scatter", 1, 800) == 0.0


def test_measured_collective_times_are_interpolated_where_the_group_was_measured():
    """A calibrated profile's `collective_times` price a collective over p ranks where groups of
    p were measured on the link: linear between the two sizes around m, the smallest size's
    time below it, the last two sizes' slope above the largest; a size measured twice at its
    mean; a time below a smaller size's lifted to it. Alpha-beta elsewhere (another p, another
    link), and the packing added either way."""
    data = profile_data(alpha=2.0, beta=0.5, inter=(10.0, 1.0), ranks_per_node=2)
    data["packing"] = {"allgather": 0.25}
    data["collective_times"] = {"intra": {
        "allgather": [[2, 1000, 30.0], [2, 100, 20.0], [2, 10000, 120.0], [3, 1000, 99.0]],
        "allreduce": [[2, 100, 40.0], [2, 100, 60.0], [2, 1000, 45.0], [2, 2000, 80.0]]}}
    p = MachineProfile(data)
    assert p.collective_time("allgather", 2, 550) == pytest.approx(25.0 + 0.25 * 550)
    assert p.collective_time("allgather", 2, 40) == pytest.approx(20.0 + 0.25 * 40)
    assert p.collective_time("allgather", 2, 20000) == pytest.approx(220.0 + 0.25 * 20000)
    assert p.collective_time("allgather", 3, 1000) == pytest.approx(99.0 + 250.0)
    assert p.collective_time("allgather", 4, 800) == pytest.approx(3 * 2.0 + 0.75 * 800 * 0.5 + 0.25 * 800)
    # 100 bytes: the mean of 40 and 60; 1000 bytes measured 45, lifted to 50
    assert p.collective_time("allreduce", 2, 100) == pytest.approx(50.0)
    assert p.collective_time("allreduce", 2, 1000) == pytest.approx(50.0)
    assert p.collective_time("allreduce", 2, 1500) == pytest.approx(65.0)
    assert p.collective_time("allreduce", 2, 0) == pytest.approx(50.0)  # an allreduce's latency
    assert p.collective_time("alltoall", 2, 800) == 1 * 2.0 + 0.5 * 800 * 0.5  # none measured
    assert p.collective_time("allgather", 2, 800, intra=False) == 1 * 10.0 + 0.5 * 800 * 1.0 + 0.25 * 800
    assert p.collective_time("allgather", 1, 800) == 0.25 * 800


@pytest.mark.parametrize("times, says", [
    ({"inter": {"allgather": [[2, 100, 1.0]]}}, "collective_times.inter"),
    ({"intra": {"broadcast": [[2, 100, 1.0]]}}, "collective_times.intra.broadcast"),
    ({"intra": {"allgather": [[1, 100, 1.0]]}}, r"\[1, 100, 1.0\] \(expected \[p, m bytes, seconds\]"),
    ({"intra": {"allgather": [[2, 0, 1.0]]}}, r"\[2, 0, 1.0\] \(expected"),
    ({"intra": {"allgather": [[2, 100]]}}, r"\[2, 100\] \(expected"),
])
def test_bad_collective_times_are_refused(times, says):
    data = profile_data()
    data["collective_times"] = times
    with pytest.raises(ValueError, match=f"not a valid machine profile: missing or malformed .*{says}"):
        MachineProfile(data)


def test_kernel_rates_are_read_at_the_measured_points():
    data = profile_data()
    data["kernels"]["forward"]["winograd"] = [[1e6, 64, 1e9], [1e9, 4096, 1e11]]
    p = MachineProfile(data)
    assert p.kernel_time("forward", "winograd", 1e9, 4096) == pytest.approx(1e9 / 1e11)
    assert p.kernel_time("forward", "winograd", 1e6, 64) == pytest.approx(1e6 / 1e9)
    assert p.kernel_time("forward", "im2col", 1e9, 4096) == pytest.approx(1e9 / 1e10)  # '*': any other path
    del data["kernels"]["forward"]["*"]
    with pytest.raises(ValueError, match="has no rates of kernel path 'im2col' \\(forward\\)"):
        MachineProfile(data).kernel_time("forward", "im2col", 1e9, 4096)
    between = p.kernel_time("forward", "winograd", 3e7, 512)
    assert 1e6 / 1e9 * 30 > between > 3e7 / 1e11


def test_a_variant_the_profile_did_not_measure_takes_its_paths_rates():
    """Winograd's F(2x2) ('winograd F(2x2)', paths.KernelPath.variant) in a profile measured
    before the kernel table chose tiles per layer is priced at 'winograd''s rates; where the
    profile has the variant's own, those."""
    data = profile_data()
    data["kernels"]["forward"]["winograd"] = [[1e6, 64, 1e9], [1e9, 4096, 1e11]]
    p = MachineProfile(data)
    assert p.kernel_time("forward", "winograd F(2x2)", 1e9, 4096) == p.kernel_time("forward", "winograd", 1e9, 4096)
    assert p.kernel_time("backward-data", "full-convolution/winograd F(2x2)", 1e9, 4096) == pytest.approx(1e9 / 1e10)
    data["kernels"]["forward"]["winograd F(2x2)"] = [[1e6, 64, 2e9], [1e9, 4096, 2e11]]
    assert MachineProfile(data).kernel_time("forward", "winograd F(2x2)", 1e9, 4096) == pytest.approx(1e9 / 2e11)


def test_a_point_measured_on_the_very_geometry_is_its_rate():
    """Two 1x1 layers of one path, flops and rows (128 -> 64 and 256 -> 32 channels over 8192
    pixels) run at different rates: each is priced at the point measured on it, and a shape
    without one between its neighbours."""
    from cfp.kernels.conv import conv_geometry
    from cfp.kernels.conv.paths import geometry_key, rate_key
    narrow, thin = (conv_geometry((32, c, 16, 16), (f, c, 1, 1), 1, 0, 1, 1) for c, f in ((128, 64), (256, 32)))
    assert rate_key("forward", narrow, "float32") == rate_key("forward", thin, "float32")
    assert geometry_key(narrow) != geometry_key(thin)
    data = profile_data()
    data["kernels"]["forward"]["pointwise"] = [[1e8, 8192, 2e10, geometry_key(narrow)],
                                               [1e8, 8192, 1e10, geometry_key(thin)], [1e9, 8192, 4e10]]
    p = MachineProfile(data)
    assert p.kernel_time("forward", "pointwise", 1e8, 8192, geometry_key(narrow)) == pytest.approx(1e8 / 2e10)
    assert p.kernel_time("forward", "pointwise", 1e8, 8192, geometry_key(thin)) == pytest.approx(1e8 / 1e10)
    assert 1e10 < 2e8 / p.kernel_time("forward", "pointwise", 2e8, 8192) < 4e10  # between the three


@pytest.mark.parametrize("algorithm,P_n,P_c,p_f", [("x", 1, 4, None), ("y", 2, 2, None), ("w", 1, 4, 2),
                                                  ("w", 2, 4, 4), ("sample", 4, 1, None)])
def test_model_moves_the_bytes_the_ledger_counts(algorithm, P_n, P_c, p_f):
    """With alpha 0 and beta 1 s/byte, the model's seconds per phase are the bytes rank 0 sends
    (predict_bytes, which the tests hold the ledger to): the model prices the same messages."""
    layer = LayerShape("L", 8, 16, 32, 6, 6, 3)
    cost = layer_cost(layer, algorithm, P_n, P_c, MachineProfile(profile_data()), p_f)
    sent = predict_bytes(algorithm, (8, 16, 6, 6), (32, 16, 3, 3), {"sample": P_n, "channel": P_c},
                         {"sample": 0, "channel": 0}, 1, 1, filter_groups=p_f, bias=False, itemsize=4)
    for phase, (bytes_sent, _) in sent.items():
        assert cost["comm"][phase] == pytest.approx(bytes_sent), phase


def test_predict_bytes_by_hand():
    """Three layers whose messages are counted here element by element (float64, 8 bytes), with
    uneven blocks. An allgather sends the rank's own block to each of the p - 1 others and
    receives the rest; a reduce-scatter the reverse; an allreduce of m elements is a
    reduce-scatter of m into p balanced blocks and an allgather of them."""
    none = (0, 0)
    # Stationary-y, sample=2 x channel=2, the rank at sample 1, channel 1: x (4, 5, 5, 5), w
    # (4, 5, 3, 3), padding 1. It holds samples 2-3 and channels 3-4 of 0-4 (2 of 5): forward,
    # x's allgather over the 2 channel ranks sends its 2 * 2 * 25 = 100 elements, receives the
    # other's 3 * 2 * 25 = 150; backward-data, dx's reduce-scatter sends 150, receives 100;
    # gradient-sync, its filters 2-3 with all 5 channels, 2 * 5 * 9 + 2 biases = 92 elements
    # allreduced over the 2 sample ranks: 46 out and 46 back, each way.
    assert predict_bytes("y", (4, 5, 5, 5), (4, 5, 3, 3), "sample=2,channel=2", {"sample": 1, "channel": 1},
                         padding=1) == {
        "forward": (800, 1200), "backward-data": (1200, 800), "backward-filter": none,
        "gradient-sync": (736, 736), "halo": none, "redistribute": none}
    # Stationary-x, channel=2, the rank at channel 0: x (3, 4, 4, 4), w (5, 4, 3, 3), stride 2,
    # padding 1, so y is (3, 5, 2, 2). Its filters are 0-2 of 0-4: forward, y's reduce-scatter
    # over the 2 channel ranks sends the other's 2 * 3 * 4 = 24 partial sums and receives 3 * 3 *
    # 4 = 36 for its own; backward-filter, dy's allgather sends 36 and receives 24. One sample
    # rank: no gradient allreduce.
    assert predict_bytes("x", (3, 4, 4, 4), (5, 4, 3, 3), "channel=2", {"channel": 0}, stride=2,
                         padding=1) == {
        "forward": (192, 288), "backward-data": none, "backward-filter": (288, 192),
        "gradient-sync": none, "halo": none, "redistribute": none}
    # Data parallel, sample=3, the rank at sample 2, w (4, 3, 3, 3) and 4 biases: 112 elements in
    # blocks of 38, 37, 37; its reduce-scatter sends the 112 - 37 = 75 it does not keep and its
    # allgather its 37 to 2 ranks: 149 each way, 596 bytes in float32.
    assert predict_bytes("sample", (6, 3, 5, 5), (4, 3, 3, 3), "sample=3", {"sample": 2}, padding=1,
                         itemsize=4) == {
        "forward": none, "backward-data": none, "backward-filter": none, "gradient-sync": (596, 596),
        "halo": none, "redistribute": none}


def test_planner_prefers_channels_when_the_batch_is_small_and_samples_when_it_is_large():
    profile = MachineProfile.load("reference-v100")
    wide_small_batch = [LayerShape("c", 4, 2048, 2048, 8, 8, 3)]
    assert plan(wide_small_batch, 16, profile).choices[0].P_c > 1
    narrow_big_batch = [LayerShape("c", 1024, 32, 32, 64, 64, 3)]  # activations dwarf weights
    assert plan(narrow_big_batch, 16, profile).choices[0].algorithm == "sample"


def test_memory_limit():
    profile = MachineProfile.load("reference-v100")
    layers = [LayerShape(f"c{i}", 64, 1024, 1024, 14, 14, 3) for i in range(3)]
    fastest = plan(layers, 16, profile)
    limited = plan(layers, 16, profile, memory_limit=fastest.memory * 0.95)
    assert limited.memory <= fastest.memory * 0.95 and limited.time >= fastest.time
    with pytest.raises(ValueError, match=r"memory limit 0.01 MiB per rank is impossible: the smallest plan"):
        plan(layers, 16, profile, memory_limit=0.01 * 2 ** 20)


def test_a_plans_memory_adds_the_largest_temporary_and_the_largest_workspace():
    """What each layer keeps adds up; the temporaries (alive inside one layer) and the kernels'
    workspace (one block kept between layers) are each counted once, at their largest. A wide
    layer with few pixels has the larger workspace (weight-sized), a narrow one with many
    pixels the larger temporary (partial y and dx): the plan holds both at once."""
    profile = MachineProfile.load("cpu-dev")
    layers = [LayerShape("wide", 2, 512, 512, 4, 4, 3), LayerShape("narrow", 64, 16, 16, 64, 64, 3)]
    result = plan(layers, 1, profile)
    memory = [c.cost["memory"] for c in result.choices]
    assert memory[0]["workspace"] > memory[1]["workspace"] and memory[1]["temporary"] > memory[0]["temporary"]
    kept = sum(sum(v for k, v in m.items() if k not in ("temporary", "workspace")) for m in memory)
    assert result.memory == kept + memory[1]["temporary"] + memory[0]["workspace"]


def test_fixed_grid():
    profile = MachineProfile.load("cpu-dev")
    layer = LayerShape("c", 8, 512, 512, 16, 16, 3)
    result = plan([layer], 4, profile, grid=(2, 2), algorithms=("x", "y", "w"))
    assert (result.choices[0].P_n, result.choices[0].P_c) == (2, 2)
    assert result.choices[0].algorithm in ("x", "y", "w")


def test_auto_model_builds_with_the_planners_choices():
    grid = ProcessGrid("sample=1", comm=MPI.COMM_SELF)
    model = build_model("resnet", grid, width=1, algorithm="auto", batch=64, image=8,
                        profile=MachineProfile.load("cpu-dev"))
    shapes = layer_shapes("resnet", 64, 1)
    assert [s.name for s in shapes] == [c.layer.name for c in model.plan.choices] == list(model.layers)
    assert all(e["algorithm"] in ("x", "y", "w") for e in model.layers.values())
    with pytest.raises(ValueError, match="algorithm 'auto' needs the global batch size and a machine profile"):
        build_model("resnet", grid, algorithm="auto")
    grid.free()


def test_the_plan_of_residual_blocks_is_the_best_of_all_plans():
    """The ResNet's first blocks on 2 ranks under sample and x, where a projection reads its
    block's input and the next block reads the body's output, not the projection's, and
    residual sums join branches that may lie on different grids (LayerShape.reads, merges):
    the planner's plan costs what the cheapest of every combination of the layers' options
    costs, found by trying them all. On these links (slow allgathers and allreduces) a program
    whose state is only the previous layer's choice misses it (60.64 against 60.25 ms): it
    keeps one path per choice of the projection and loses the body's."""
    import itertools
    from cfp.planner import layer_options, moves, price_plan, redistribution_time
    data = MachineProfile.load("cpu-dev").data
    data = dict(data, links={"intra": {"allgather": [2.67e-03, 1.8e-10], "allreduce": [4.99e-04, 2.29e-09],
                                       "alltoall": [1.56e-04, 2.03e-12], "reduce_scatter": [1.02e-05, 6.45e-10]}})
    profile = MachineProfile(data)
    shapes = layer_shapes("resnet", 64, width=4, in_channels=1, classes=10, image=8)[:7]
    assert (shapes[5].name, shapes[5].reads, shapes[5].merges) == ("layer2.proj", "layer1.conv2", "layer2.conv2")
    assert (shapes[6].name, shapes[6].reads) == ("layer3.conv1", "layer2.conv2") and shapes[2].merges == "stem.conv"
    algorithms = ("sample", "x")
    options = [layer_options(L, 2, profile, algorithms) for L in shapes]
    best = min(sum(c.cost["time"] + redistribution_time(list(combo[:k]), c, profile) for k, c in enumerate(combo))
               for combo in itertools.product(*options))
    planned = plan(shapes, 2, profile, algorithms=algorithms)
    assert planned.time == pytest.approx(best, rel=1e-12)
    assert price_plan(shapes, 2, profile, plan_entries(planned)).time == pytest.approx(best, rel=1e-12)
    chain = [(o.cost["time"], [o]) for o in options[0]]  # the previous layer's choice as the only state
    for opts in options[1:]:
        chain = [min(((t + redistribution_time(p, o, profile) + o.cost["time"], p + [o]) for t, p in chain),
                     key=lambda tp: tp[0]) for o in opts]
    assert min(t for t, _ in chain) > best * (1 + 1e-3)
    # a residual's own move: the stem channel-parallel, the first block data-parallel: the sum
    # brings the stem's output (the identity shortcut) to the body's grid
    stem = next(o for o in options[0] if o.P_c == 2)
    body = [next(o for o in opts if o.P_n == 2) for opts in options[1:3]]
    assert [(c.layer.name, v) for c, v in moves([stem, body[0]], body[1], 4)] == [("stem.conv", 64 * 64 * 8 * 8 * 4)]


def test_a_layer_alone_does_not_plan():
    """Planning is build_model's (a whole model at once); a Conv2d takes a named algorithm."""
    from cfp.nn import Conv2d
    grid = ProcessGrid("sample=1", comm=MPI.COMM_SELF)
    with pytest.raises(ValueError, match="unknown algorithm 'auto'"):
        Conv2d(grid, 64, 64, 3, algorithm="auto", name="c")
    grid.free()


def test_the_planner_splits_large_images_of_one_sample():
    """With one 128x128 sample on 4 ranks, data parallelism has nothing to split: asked to
    (spatial=True), the planner puts early layers on grids that split the image, prices them
    as price_plan does, and never splits an image into more blocks than it has rows. (At 64x64
    the cpu-dev profile's channel split is cheaper: the halo's all-to-all costs more than the
    image's kernels save.)"""
    from cfp.planner import price_plan
    profile = MachineProfile.load("cpu-dev")
    shapes = layer_shapes("resnet", 1, 1, image=128)
    flat = plan(shapes, 4, profile)
    spatial = plan(shapes, 4, profile, spatial=True)
    assert all(c.P_h == c.P_w == 1 for c in flat.choices)
    assert any(c.P_h * c.P_w > 1 for c in spatial.choices)
    assert spatial.time <= flat.time
    assert abs(price_plan(shapes, 4, profile, plan_entries(spatial)).time - spatial.time) < 1e-12
    for c in spatial.choices:
        Ho, Wo = c.layer.out_hw
        assert c.P_h <= Ho and c.P_w <= Wo and c.P_n * c.P_h * c.P_w * c.P_c == 4


def _unit_profile():
    """alpha 0, beta 1 s/byte, one kernel rate of 1e10 flop/s on every path, no packing."""
    return MachineProfile(profile_data())


def test_a_volume_split_by_depth_by_hand():
    """Conv3d, 2 samples, 4 -> 6 channels, 8 x 8 x 6, 3x3x3, padding 1, on depth=2: rank 0
    computes output planes 0..3, whose windows read input planes -1..4 (planes 0..4 of its own
    0..3 and one from rank 1; rank 1 likewise one plane, 3). Its kernels are the stacked 2-D
    convolution of 2 x 4 output planes, 3 x 4 channels, 8 x 6 with in-plane padding 1: 2 * 8 *
    12 * 6 * 48 * 9 = 497664 flops a pass, half the layer's. Halo: 2 * 4 * 48 elements of
    float32, 1536 bytes, received in an all-to-all over 2 (half of the 3072 it totals) and
    again with dx."""
    layer = LayerShape("v", 2, 4, 6, 8, 6, 3, op="conv3d", D=8)
    cost = layer_cost(layer, "sample", 1, 1, _unit_profile(), P_d=2)
    g = cost["geometry"]
    assert (g.N, g.C, g.H, g.W, g.F, g.Ho, g.Wo, g.pt, g.pl) == (8, 12, 8, 6, 6, 8, 6, 1, 1)
    assert layer.flops() == 2 * 497664
    assert cost["compute"] == {p: pytest.approx(497664 / 1e10, rel=1e-12) for p in cost["compute"]}
    assert cost["comm"]["halo"] == pytest.approx(2 * 1536, rel=1e-12)
    sent = [predict_bytes("sample", layer.x_shape, layer.w_shape, "depth=2", {"depth": r}, padding=1, itemsize=4,
                          op="conv3d")["halo"] for r in (0, 1)]
    assert sent == [(3072, 3072)] * 2  # each sends a plane forward and its gradient back
    # The copies of the planes around the 2-D passes (volume.copied_elements), at a profile's
    # 'volume' rate of 1 s (a third to each pass that copies) + 1e-3 s an element: forward and
    # backward-filter take Winograd (F(2x2): the 6 columns would overhang F(4x4)'s tiles), whose
    # ring would read the planes where they lie, but not on planes of 48 outputs (below
    # volume.RING_PIXELS): they stack the input 8 x 12 x 8 x 6 (4608) and turn y's (dy's) planes
    # 8 x 6 x 8 x 6 (2304) into samples; backward-data (the full convolution of dy's 6 channels,
    # by per-sample columns) unstacks the stacked gradient (4608) and turns dy's planes (2304)
    # into samples.
    assert taken(g, "float32") == {"forward": "winograd F(2x2)", "backward-data": "full-convolution/columns-per-sample",
                                   "backward-filter": "winograd F(2x2)"}
    copying = MachineProfile(dict(profile_data(), layers={"volume": [1.0, 1e-3]}))
    cost = layer_cost(layer, "sample", 1, 1, copying, P_d=2)
    copies = dict.fromkeys(cost["compute"], 1.0 / 3 + 6.912)
    assert cost["compute"] == {p: pytest.approx(497664 / 1e10 + copies[p], rel=1e-12) for p in cost["compute"]}


def test_a_transposed_layer_split_by_height_by_hand():
    """ConvTranspose2d, 2 samples, 4 -> 6 channels, 8 x 8 to 16 x 16 (stride 2, padding 1,
    output_padding 1), on height=2: rank 0 computes output rows 0..7, which input rows 0..4
    reach (ceil((0 + 1 - 2) / 2) to (7 + 1) // 2): its own 0..3 and row 4 of rank 1, whose
    rows 8..15 rows 4..7 reach, its own. Its kernels are the adjoint convolution of the 8 x 16
    output block to the 5 x 8 input rows (signed sides 1 and 2 on the split axis, 1 and 0 on
    the other): 2 * 2 * 6 * 4 * 40 * 9 = 34560 flops a pass, its forward priced at the
    adjoint's backward-data. Halo: 2 * 4 * 8 float32 (256 bytes), the most a rank receives."""
    layer = LayerShape("t", 2, 4, 6, 8, 8, 3, stride=2, padding=1, output_padding=1, op="conv_transpose2d")
    assert layer.out_size == (16, 16)
    cost = layer_cost(layer, "sample", 1, 1, _unit_profile(), P_h=2)
    g = cost["geometry"]
    assert (g.N, g.C, g.H, g.W, g.F, g.Ho, g.Wo, g.pt, g.pb, g.pl, g.pr) == (2, 6, 8, 16, 4, 5, 8, 1, 2, 1, 0)
    assert cost["passes"] == {"forward": "backward-data", "backward-data": "forward",
                              "backward-filter": "backward-filter"}
    assert cost["compute"] == {p: pytest.approx(34560 / 1e10, rel=1e-12) for p in cost["compute"]}
    assert cost["comm"]["halo"] == pytest.approx(2 * 256, rel=1e-12)
    received = [predict_bytes("sample", layer.x_shape, layer.w_shape, "height=2", {"height": r}, stride=2,
                              padding=1, itemsize=4, op="conv_transpose2d", output_padding=1)["halo"][1]
                for r in (0, 1)]
    assert received == [256, 256]  # rank 0 its halo row, rank 1 the row's gradient back
    whole = layer_cost(layer, "sample", 1, 1, _unit_profile())
    assert whole["compute"]["forward"] == pytest.approx(layer.flops() / 1e10, rel=1e-12) == 2 * 2 * 4 * 6 * 64 * 9 / 1e10


@pytest.mark.parametrize("progress,hidden", [(1.0, 480.0), (0.5, 300.0), (0.0, 0.0)])
def test_the_halo_moves_behind_the_interior_by_hand(progress, hidden):
    """As test_layer_cost_of_an_image_split_by_hand (a 4 x 3 x 10 x 7 batch, 5 filters 3 x 3,
    data parallel on height=2, width=2: 480 s of halo at 1 s/byte each way), with kernels slow
    enough that forward takes 1000 s: with halo_interior, rank 0's block of 5 x 4 outputs has
    4 x 3 whose windows read only its own rows and columns (one halo row and column each), 60%
    of its forward, so the halo hides behind progress x 600 s of it, at most all 480 s; the
    adjoint's 480 s stay blocking. x on a whole input (the first layer) gathers no channels
    but takes its own: it convolves no block of its own, and hides nothing."""
    layer = LayerShape("L", 4, 3, 5, 10, 7, 3)
    profile = MachineProfile(dict(profile_data(rate=21600 / 1000), progress={"intra": progress}))
    cost = layer_cost(layer, "sample", 1, 1, profile, P_h=2, P_w=2, halo_interior=True)
    assert cost["compute"]["forward"] == pytest.approx(1000, rel=1e-12)
    assert cost["hidden"]["halo"] == pytest.approx(hidden, rel=1e-12)
    assert cost["comm"]["halo"] == pytest.approx(480 - hidden + 480, rel=1e-12)
    blocking = layer_cost(layer, "sample", 1, 1, profile, P_h=2, P_w=2)
    assert blocking["comm"]["halo"] == pytest.approx(960, rel=1e-12)
    first = dataclasses.replace(layer, first=True)
    assert layer_cost(first, "x", 1, 1, profile, P_h=2, P_w=2, halo_interior=True)["hidden"]["halo"] == 0


@pytest.mark.parametrize("progress,hidden", [(1.0, 128.0), (0.1, 75.0), (0.0, 0.0)])
def test_a_volume_split_by_depth_hides_its_halo_behind_its_interior_planes_by_hand(progress, hidden):
    """A 1 x 2 x 8 x 4 x 4 volume, 2 filters 3 x 3 x 3, data parallel on depth=2: each rank's 4
    output planes read its 4 planes and one halo plane (128 bytes: 128 s at 1 s/byte), and 3
    of the 4 read only its own (or the zero padding): 75% of a forward of 1000 s (its 13824
    flops at 13.824 flop/s), so the forward halo hides behind progress x 750 s of it, at most
    all 128 s of it; the adjoint stays blocking."""
    layer = LayerShape("V", 1, 2, 2, 4, 4, 3, D=8, op="conv3d")
    profile = MachineProfile(dict(profile_data(rate=13824 / 1000), progress={"intra": progress}))
    blocking = layer_cost(layer, "sample", 1, 1, profile, P_d=2)
    cost = layer_cost(layer, "sample", 1, 1, profile, P_d=2, halo_interior=True)
    assert cost["compute"]["forward"] == pytest.approx(1000, rel=1e-9)
    halo = blocking["comm"]["halo"] / 2  # the forward's exchange; its adjoint the same
    assert halo == pytest.approx(128, rel=1e-9) and cost["hidden"]["halo"] == pytest.approx(hidden, rel=1e-9)
    assert cost["comm"]["halo"] == pytest.approx(2 * halo - cost["hidden"]["halo"], rel=1e-9)


def test_a_layer_shape_says_its_kind_and_depth():
    with pytest.raises(ValueError, match="layer v: a conv3d layer needs the depth D of its volume"):
        LayerShape("v", 1, 2, 2, 4, 4, 3, op="conv3d")
    with pytest.raises(ValueError, match="layer c: a conv2d layer has no depth"):
        LayerShape("c", 1, 2, 2, 4, 4, 3, D=4)
    with pytest.raises(ValueError, match="a depth axis of 2 ranks splits a volume; conv2d has none"):
        layer_cost(LayerShape("c", 1, 2, 2, 4, 4, 3), "sample", 1, 1, _unit_profile(), P_d=2)


def test_the_planner_splits_a_volume_of_one_sample():
    """One 32^3 volume on 2 ranks: with spatial grids, the planner splits the volume (its
    halo moves a plane where a channel split moves the whole activation), tries depth grids for
    volumes only, and prices its plan as price_plan does; the volume and unet models plan."""
    from cfp.planner import layer_options, price_plan
    volume = LayerShape("v", 1, 8, 8, 32, 32, 3, op="conv3d", D=32)
    chosen = plan([volume], 2, _unit_profile(), spatial=True).choices[0]
    assert chosen.P_d * chosen.P_h * chosen.P_w == 2 and chosen.P_c == 1
    assert any(o.P_d == 2 for o in layer_options(volume, 2, _unit_profile(), spatial=True))
    image = LayerShape("c", 1, 8, 8, 32, 32, 3)
    assert all(o.P_d == 1 for o in layer_options(image, 2, _unit_profile(), spatial=True))
    profile = MachineProfile.load("cpu-dev")
    for name in ("volume", "unet"):
        shapes = layer_shapes(name, 2, 1, image=16)
        planned = plan(shapes, 4, profile, spatial=True)
        assert price_plan(shapes, 4, profile, plan_entries(planned)).time == pytest.approx(planned.time, rel=1e-12)
        for c in planned.choices:
            assert all(parts <= size for parts, size in zip((c.P_d, c.P_h, c.P_w), (1,) * (3 - len(c.layer.out_size))
                                                          + c.layer.out_size))


@pytest.mark.parametrize("chunks,compute,gather,scatter,progress,expected", [
    (1, 1.0, 0.5, 0.5, 1.0, 2.0),  # one chunk: every collective blocking
    (2, 1.0, 0.5, 0.5, 0.0, 4.0),  # no progress: each chunk's collectives after its kernels
    # chunk 0's gather (0.5) waited for; while chunk 0 computes, chunk 1's gather moves; while
    # chunk 1 computes, chunk 0's reduce-scatter; chunk 1's (0.5) waited for at the end
    (2, 1.0, 0.5, 0.5, 1.0, 3.0),
    # reduce-scatters only, at half rate: after chunk 1, 0.1 of chunk 0's left (moved with chunk
    # 2), then 0.4 of chunk 1's moves and 0.2 of it and chunk 2's 0.6 are left at the end
    (3, 1.0, 0.0, 0.6, 0.5, 3.8),
    # gathers only, larger than a chunk's kernels: each wait moves what is left of the next one
    (3, 1.0, 2.0, 0.0, 1.0, 2.0 + 3 * 1.0 + 2 * 1.0),
])
def test_a_pipeline_of_chunks_by_hand(chunks, compute, gather, scatter, progress, expected):
    from cfp.perfmodel import pipeline_seconds
    assert pipeline_seconds(chunks, compute, gather, scatter, progress) == pytest.approx(expected, rel=1e-12)


def assert_two_chunks_of_x(cost, half, progress):
    """A stationary-x layer's cost in 2 chunks against `half`'s, the layer one chunk computes:
    twice its kernels, the forward's reduce-scatter and the backward's allgather of dy each a
    pipeline of two of its collectives (perfmodel.pipeline_seconds) at `progress`."""
    from cfp.perfmodel import pipeline_seconds
    assert cost["compute"] == pytest.approx({p: 2 * t for p, t in half["compute"].items()}, rel=1e-12)
    forward = pipeline_seconds(2, half["compute"]["forward"], 0.0, half["comm"]["forward"], progress)
    assert cost["comm"]["forward"] == pytest.approx(forward - 2 * half["compute"]["forward"], rel=1e-12)
    both = half["compute"]["backward-filter"] + half["compute"]["backward-data"]
    backward = pipeline_seconds(2, both, half["comm"]["backward-filter"], 0.0, progress)
    assert cost["comm"]["backward-filter"] == pytest.approx(backward - 2 * both, rel=1e-12)


def test_a_layer_in_chunks_is_priced_as_its_pipeline():
    """Stationary-x on channel=2 in 2 chunks, 8 samples: each chunk's kernels at 4 samples and
    each chunk's collectives at half the bytes (one more latency each), the forward's
    reduce-scatter and the backward's allgather of dy each a pipeline of their own; at progress
    0 nothing is hidden, at progress 1 the chunks' kernels hide all but the last chunk's."""
    layer = LayerShape("L", 8, 16, 16, 8, 8, 3)
    data = profile_data(alpha=1e-5, beta=1e-9)
    blocking = layer_cost(layer, "x", 1, 2, MachineProfile(data))
    for progress in (0.0, 1.0):
        profile = MachineProfile(dict(data, progress={"intra": progress}))
        cost = layer_cost(layer, "x", 1, 2, profile, chunks=2)
        half = layer_cost(dataclasses.replace(layer, N=4), "x", 1, 2, profile)
        assert_two_chunks_of_x(cost, half, progress)
        assert cost["comm"]["gradient-sync"] == blocking["comm"]["gradient-sync"]
        moved = 2 * (half["comm"]["forward"] + half["comm"]["backward-filter"])
        assert sum(cost["hidden"].values()) == pytest.approx(moved - cost["comm"]["forward"]
                                                            - cost["comm"]["backward-filter"], rel=1e-9)
        assert (sum(cost["hidden"].values()) > 1e-12) == (progress > 0)
    with pytest.raises(ValueError, match="layer L: chunks=2: its algorithm pipelines no collectives"):
        layer_cost(layer, "sample", 2, 1, MachineProfile(data), chunks=2)
    with pytest.raises(ValueError, match="layer L: chunks=9 is more than the 8 sample"):
        layer_cost(layer, "x", 1, 2, MachineProfile(data), chunks=9)


def test_a_one_sample_layer_in_chunks_is_priced_as_its_feature_pipeline():
    """One sample a rank on channel=2, 2 chunks: the passes cut along the features their
    collective moves (ConvAlgorithm.pipelined). Stationary-x: y's filters both ways, each
    chunk priced as the layer with half the filters (its kernels and its collectives' bytes).
    Stationary-y: x's channels both ways, as the layer with half the channels, its
    backward-filter whole. Stationary-w (p_f = 1, one row: nothing gathered of x): forward as
    x; backward dy gathered whole and blocking, dw whole, then dx's channels in chunks, their
    reduce-scatters pipelined; all of dx after the gradient sum. At progress 0 nothing hides;
    more chunks than the smallest block of features is refused."""
    from cfp.perfmodel import pipeline_seconds
    layer = LayerShape("L", 1, 16, 16, 8, 8, 3)
    data = profile_data(alpha=1e-5, beta=1e-9)
    for progress in (0.0, 1.0):
        profile = MachineProfile(dict(data, progress={"intra": progress}))
        cost = layer_cost(layer, "x", 1, 2, profile, chunks=2)
        half = layer_cost(dataclasses.replace(layer, F=8), "x", 1, 2, profile)
        assert_two_chunks_of_x(cost, half, progress)
        assert cost["data_after_sum"] == 0.5

        whole = layer_cost(layer, "y", 1, 2, profile)
        cost = layer_cost(layer, "y", 1, 2, profile, chunks=2)
        half = layer_cost(dataclasses.replace(layer, C=8), "y", 1, 2, profile)
        assert cost["compute"]["forward"] == pytest.approx(2 * half["compute"]["forward"], rel=1e-12)
        assert cost["compute"]["backward-data"] == pytest.approx(2 * half["compute"]["backward-data"], rel=1e-12)
        assert cost["compute"]["backward-filter"] == whole["compute"]["backward-filter"]
        forward = pipeline_seconds(2, half["compute"]["forward"], half["comm"]["forward"], 0.0, progress)
        assert cost["comm"]["forward"] == pytest.approx(forward - 2 * half["compute"]["forward"], rel=1e-12)
        data_pass = pipeline_seconds(2, half["compute"]["backward-data"], 0.0, half["comm"]["backward-data"],
                                     progress)
        assert cost["comm"]["backward-data"] == pytest.approx(data_pass - 2 * half["compute"]["backward-data"],
                                                              rel=1e-12)

        whole = layer_cost(layer, "w", 1, 2, profile, p_f=1)
        cost = layer_cost(layer, "w", 1, 2, profile, p_f=1, chunks=2)
        filters = layer_cost(dataclasses.replace(layer, F=8), "w", 1, 2, profile, p_f=1)
        channels = layer_cost(dataclasses.replace(layer, C=8), "w", 1, 2, profile, p_f=1)
        assert cost["compute"]["forward"] == pytest.approx(2 * filters["compute"]["forward"], rel=1e-12)
        assert cost["compute"]["backward-filter"] == whole["compute"]["backward-filter"]
        assert cost["compute"]["backward-data"] == pytest.approx(2 * channels["compute"]["backward-data"], rel=1e-12)
        c = channels["compute"]["backward-data"]
        # (w's backward-data of half the channels at p_f = 1 reduce-scatters nothing: its row is one rank)
        data_pass = pipeline_seconds(2, c, 0.0, channels["comm"]["backward-data"], progress)
        assert (cost["comm"]["backward-filter"] + cost["comm"]["backward-data"]) == pytest.approx(
            whole["comm"]["backward-filter"] + data_pass - 2 * c, rel=1e-12)
        assert cost["data_after_sum"] == 1.0
        if progress == 0:
            assert sum(cost["hidden"].values()) == pytest.approx(0.0, abs=1e-15)
    with pytest.raises(ValueError, match=re.escape("layer L: chunks=9 is more than the 1 sample(s) a rank holds "
                                                   "and the 8 channel(s) or filter(s)")):
        layer_cost(layer, "x", 1, 2, MachineProfile(data), chunks=9)


def test_the_chunks_geometries_are_what_calibration_tops_up_for_a_planner_choosing_chunks():
    """layer_cost names the geometries it priced a layer's chunks at (its "chunk_geometries":
    stationary-x's filters halved in feature chunks, its samples in chunks of samples), and
    planner.geometries(chunks=True), what calibration measures for a planner asked to choose
    chunks, includes them beside the whole layers' (and only then)."""
    from cfp.planner import geometries
    profile = MachineProfile(dict(profile_data(alpha=1e-5, beta=1e-9), progress={"intra": 1.0}))
    one, eight = LayerShape("a", 1, 64, 48, 8, 8, 3), LayerShape("b", 8, 64, 48, 8, 8, 3)
    features = layer_cost(one, "x", 1, 2, profile, chunks=2)["chunk_geometries"]
    assert {(g.N, g.C, g.F) for g, _ in features} == {(1, 32, 24)} and all(b is None for _, b in features)
    samples = layer_cost(eight, "x", 1, 2, profile, chunks=2)["chunk_geometries"]
    assert {(g.N, g.C, g.F) for g, _ in samples} == {(4, 32, 48)}
    assert layer_cost(one, "x", 1, 2, profile)["chunk_geometries"] == []
    whole, _ = geometries([one], 2, profile)
    chunked, _ = geometries([one], 2, profile, chunks=True)
    assert (1, 32, 24) not in {(g.N, g.C, g.F) for g in whole}
    assert (1, 32, 24) in {(g.N, g.C, g.F) for g in chunked} and set(whole) <= set(chunked)


def test_the_planner_pipelines_where_the_links_progress():
    """A wide layer of 8 samples on channel=4 whose collectives cost about its kernels: with a
    profile whose links move data while ranks compute the planner runs it in chunks and writes
    them into the plan (priced again the same by price_plan); where they do not (progress 0),
    or without chunks=True, it keeps one chunk. With buckets=True a data-parallel plan's
    gradient sums are bucketed where that beats blocking."""
    from cfp.planner import price_plan
    layers = [LayerShape("a", 8, 256, 256, 8, 8, 3), LayerShape("b", 8, 256, 256, 8, 8, 3)]
    data = profile_data(alpha=1e-6, beta=2e-9, rate=2e10)
    flowing = MachineProfile(dict(data, progress={"intra": 1.0}))
    chosen = plan(layers, 4, flowing, algorithms=("x", "y", "w"), chunks=True)
    assert all(c.chunks > 1 for c in chosen.choices), chosen.table()
    entries = plan_entries(chosen)
    assert all(e["chunks"] == c.chunks for e, c in zip(entries.values(), chosen.choices))
    assert price_plan(layers, 4, flowing, entries).time == pytest.approx(chosen.time, rel=1e-12)
    assert chosen.time < plan(layers, 4, flowing, algorithms=("x", "y", "w")).time
    for profile, chunks in ((MachineProfile(data), True), (flowing, False)):
        assert all(c.chunks == 1 for c in plan(layers, 4, profile, algorithms=("x", "y", "w"), chunks=chunks).choices)
    # the blocking plan's layers pipelined where that pays, grids and algorithms kept (simulate.py's
    # overlapped columns)
    blocking = plan(layers, 4, flowing, algorithms=("x", "y", "w"))
    piped = blocking.pipelined(flowing)
    assert [(c.grid, c.label.split(" in ")[0]) for c in piped.choices] == [(c.grid, c.label) for c in blocking.choices]
    assert all(c.chunks > 1 for c in piped.choices) and piped.time < blocking.time
    assert piped.time == pytest.approx(price_plan(layers, 4, flowing, plan_entries(piped)).time, rel=1e-12)
    assert all(c.chunks == 1 for c in plan(layers, 4, MachineProfile(data), algorithms=("x", "y", "w"))
               .pipelined(MachineProfile(data)).choices)
    bucketed = plan(layers, 4, flowing, algorithms=("sample",), buckets=True)
    assert bucketed.bucket_mb in (1, 4, 25) and bucketed.overlapped_time < bucketed.time
    assert plan(layers, 4, MachineProfile(data), algorithms=("sample",), buckets=True).bucket_mb == 0


def test_which_groups_stay_inside_a_node_follows_the_placement():
    """A 2 x 2 sample x channel grid on nodes of 2 ranks: channel fastest (the default) keeps
    each channel pair (the row of p_f = 2, the column of p_f = 1) on a node and sends the
    gradient allreduce (the sample pair) across; node axes 'sample' the other way round. A
    channel row of 3 of a 6-rank channel split on nodes of 4 straddles two nodes."""
    from cfp.perfmodel import inside_nodes
    profile = MachineProfile(profile_data(ranks_per_node=2, inter=(1.0, 1.0)))
    shape = {"sample": 2, "channel": 2}
    assert inside_nodes(shape, profile, 2) == {"row": True, "column": True, "gradient": False, "halo": True}
    assert inside_nodes(shape, profile, 1) == {"row": True, "column": True, "gradient": False, "halo": True}
    assert inside_nodes(shape, profile, 2, "sample") == {"row": False, "column": True, "gradient": True,
                                                         "halo": True}
    assert inside_nodes(shape, profile, 1, ("sample",)) == {"row": True, "column": False, "gradient": True,
                                                            "halo": True}
    four = MachineProfile(profile_data(ranks_per_node=4, inter=(1.0, 1.0)))
    assert not inside_nodes({"channel": 6}, four, 3)["row"]
    assert inside_nodes({"channel": 6}, four, 2)["column"] is False  # channel ranks 1, 3, 5: nodes 0 and 1
    assert inside_nodes({"channel": 4, "height": 2}, four, 4, "height")["halo"]


def test_a_layer_costs_its_placement():
    """The same layer on the same 2 x 2 grid across 2 nodes of 2, the link between nodes 100 x
    slower: y's channel collectives (its allgathers of x, reduce-scatters of dx) go over it
    when the channel pairs are split across nodes, the weight gradient's allreduce when they
    are not; kernels and memory do not move."""
    profile = MachineProfile(profile_data(beta=1e-10, ranks_per_node=2, inter=(0.0, 1e-8)))
    layer = LayerShape("c", 8, 64, 64, 16, 16, 3)
    inside = layer_cost(layer, "y", 2, 2, profile)
    across = layer_cost(layer, "y", 2, 2, profile, node_axes=("sample",))
    assert inside["compute"] == across["compute"] and inside["memory"] == across["memory"]
    channel = inside["comm"]["forward"] + inside["comm"]["backward-data"]
    assert channel > 0 and channel == pytest.approx((across["comm"]["forward"] + across["comm"]["backward-data"]) / 100)
    assert inside["comm"]["gradient-sync"] == pytest.approx(across["comm"]["gradient-sync"] * 100)
    assert layer_cost(layer, "y", 2, 2, profile, node_axes="channel") == inside


@pytest.mark.parametrize("batch, chosen", [(64, None), (2, ("sample",))])
def test_the_planner_chooses_the_placement_with_the_grid(batch, chosen):
    """On a fixed 2 x 2 grid across 2 nodes of 2 over a slow link between them, the planner
    keeps inside a node the groups that move more: the channel pairs where activations are
    large (a batch of 64: channel fastest, the default), the sample pairs that allreduce the
    weight gradients where they are (a batch of 2, wide layers); the plan's entries carry the
    placement, and price_plan prices them as the planner did. On one node, or with one link,
    placement changes nothing and is not priced."""
    from cfp.planner import layer_options, placements, price_plan
    profile = MachineProfile(profile_data(beta=1e-10, ranks_per_node=2, inter=(0.0, 1e-8)))
    layers = [LayerShape("a", batch, 256, 256, 8, 8, 3), LayerShape("b", batch, 256, 256, 8, 8, 3)]
    shape = {"sample": 2, "channel": 2}
    assert placements(shape, profile) == [None, ("sample",)]
    assert placements(shape, profile, "sample") == [("sample",)] and placements(shape, profile, "channel") == [None]
    assert placements(shape, MachineProfile(profile_data(ranks_per_node=4, inter=(0.0, 1e-8)))) == [None]
    assert placements(shape, MachineProfile(profile_data(ranks_per_node=2))) == [None]
    planned = plan(layers, 4, profile, grid=(2, 2), algorithms=("y",))
    assert [c.node_axes for c in planned.choices] == [chosen, chosen]
    entries = plan_entries(planned)
    assert all(e.get("node_axes") == (chosen and "sample") for e in entries.values())
    assert price_plan(layers, 4, profile, entries).time == pytest.approx(planned.time, rel=1e-12)
    others = [o for o in layer_options(layers[1], 4, profile, ("y",), (2, 2)) if o.node_axes != chosen]
    assert others and all(o.cost["time"] > planned.choices[1].cost["time"] for o in others)
    fixed = plan(layers, 4, profile, grid=(2, 2), algorithms=("y",), node_axes="channel")
    assert [c.node_axes for c in fixed.choices] == [None, None]


def _cost(backward, sync, gradient_bytes, intra=True, other=0.0):
    """A layer_cost-like cost: `backward` seconds of backward-filter, `sync` of gradient sum."""
    return {"compute": {"forward": other, "backward-data": 0.0, "backward-filter": backward},
            "comm": {"gradient-sync": sync}, "layers": {}, "memory": {"gradients": gradient_bytes},
            "gradient_intra": intra, "time": other + backward + sync}


def test_progress_is_read_per_link_and_clipped():
    data = profile_data(inter=(1.0, 1.0))
    assert MachineProfile(data).progress_of(True) == MachineProfile(data).progress_of(False) == 0.0
    data["progress"] = {"intra": 1.5, "inter": 0.25}
    p = MachineProfile(data)
    assert (p.progress_of(True), p.progress_of(False)) == (1.0, 0.25)
    data["progress"] = {"inter": 0.25}  # one link measured: it stands for both
    assert MachineProfile(data).progress_of(True) == 0.25
    assert MachineProfile.load("reference-v100").progress_of(False) == 1.0


@pytest.mark.parametrize("rate,bucket,expected_exposed", [
    (0.0, 1, 6.0),  # a transport that moves data only inside MPI calls hides nothing
    (1.0, 1, 4.0),  # below: 1 s of layer 1's sum and all of layer 0's exposed
    (0.5, 1, 5.0),  # layer 2's sum moves at half rate from 1 s to backward's end: the others wait
    (1.0, 100, 6.0),  # one bucket of every gradient, started when backward ends
])
def test_the_overlapped_step_is_the_pipeline_of_buckets_against_backward(rate, bucket, expected_exposed):
    """Three layers of 1 s of backward each; their sums take 3, 2 and 1 s (the first layer's is
    the largest) in buckets of one layer each (bucket 1 byte) or one of all (100 bytes). With
    progress 1, layer 2's 1 s sum (started at 1 s) is done by 2 s, layer 1's 2 s sum moves from
    2 s to backward's end at 3 s (1 s of it), then 1 s of it and layer 0's 3 s are exposed."""
    data = profile_data()
    data["progress"] = {"intra": rate}
    costs = [_cost(1.0, 3.0, 10), _cost(1.0, 2.0, 10), _cost(1.0, 1.0, 10)]
    from cfp.perfmodel import overlapped_step
    out = overlapped_step(costs, MachineProfile(data), bucket)
    assert out["blocking"] == pytest.approx(9.0) and out["gradient_sync"] == pytest.approx(6.0)
    assert out["exposed"] == pytest.approx(expected_exposed)
    assert out["time"] == pytest.approx(3.0 + expected_exposed)
    assert out["hidden"] == pytest.approx(6.0 - expected_exposed)
    assert overlapped_step(costs, MachineProfile(data), 0)["time"] == pytest.approx(9.0)  # no buckets: blocking


def test_a_layer_that_sums_before_its_dx_starts_its_bucket_before_backward_data():
    """Three layers of 1 s of backward-filter and 1 s of backward-data, sums of 1 s, a bucket a
    layer, progress 1. Summing after dx (an algorithm that declares no sums_before_data) the
    buckets start at 2, 4 and 6 s of backward: the last one at its end, 1 s exposed. Summing
    before dx (every cfp algorithm: ConvAlgorithm.sums_before_data, in layer_cost's cost as the
    share of backward-data after the sum) they start at 1, 3 and 5 s and each moves while its
    layer's dx computes: nothing exposed. Stationary-x and -w in 4 chunks sum before the last
    chunk's dx only: a quarter of it after the sum."""
    data = profile_data()
    data["progress"] = {"intra": 1.0}
    from cfp.perfmodel import overlapped_step, sum_start_seconds

    def cost(first):
        c = _cost(1.0, 1.0, 10)
        c["compute"]["backward-data"] = 1.0
        c["time"] += 1.0
        c["data_after_sum"] = 1.0 if first else 0.0
        return c
    assert sum_start_seconds(cost(True)) == pytest.approx(1.0) and sum_start_seconds(cost(False)) == pytest.approx(2.0)
    after = overlapped_step([cost(False)] * 3, MachineProfile(data), 1)
    before = overlapped_step([cost(True)] * 3, MachineProfile(data), 1)
    assert after["exposed"] == pytest.approx(1.0) and after["time"] == pytest.approx(7.0)
    assert before["exposed"] == pytest.approx(0.0) and before["time"] == pytest.approx(6.0)
    from cfp.algorithms import ALGORITHMS
    assert all(cls.sums_before_data for cls in ALGORITHMS.values())
    layer = LayerShape("L", 8, 16, 32, 6, 6, 3)
    assert [layer_cost(layer, a, 1, 2, MachineProfile(data))["data_after_sum"] for a in ("sample", "y", "x", "w")] \
        == [1.0, 1.0, 1.0, 1.0]
    # stationary-x and -w compute dw chunk by chunk beside dx: the sum starts before the last chunk's
    assert [layer_cost(layer, a, 1, 2, MachineProfile(data), chunks=4)["data_after_sum"] for a in ("y", "x", "w")] \
        == [1.0, 0.25, 0.25]
    half = cost(True)
    half["data_after_sum"] = 0.25
    assert sum_start_seconds(half) == pytest.approx(1.75)


def test_a_bucket_spanning_nodes_progresses_at_the_link_between_them():
    data = profile_data(inter=(1.0, 1.0))
    data["progress"] = {"intra": 1.0, "inter": 0.0}
    from cfp.perfmodel import overlapped_step
    costs = [_cost(1.0, 1.0, 10, intra=False), _cost(1.0, 1.0, 10)]
    assert overlapped_step(costs, MachineProfile(data), 1)["exposed"] == pytest.approx(1.0)  # the inter one
    assert overlapped_step(costs, MachineProfile(data), 100)["exposed"] == pytest.approx(2.0)  # both, at the end


def test_a_plan_overlapped_is_never_slower_and_hides_nothing_without_progress():
    layers = layer_shapes("wide", 16, width=64, depth=2, in_channels=1, classes=10, image=8)
    planned = plan(layers, 4, MachineProfile.load("reference-v100"), algorithms=("sample",))
    out = planned.overlapped(MachineProfile.load("reference-v100"), 1e-3)
    assert 0 < out["time"] <= planned.time * (1 + 1e-12) and out["hidden"] > 0
    data = MachineProfile.load("reference-v100").data
    still = MachineProfile({**data, "progress": {}})
    assert planned.overlapped(still, 1e-3)["time"] == pytest.approx(planned.time)
