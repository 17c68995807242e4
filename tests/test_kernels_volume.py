"""Volumes and transposed convolutions in the local kernels: conv3d's three passes against the
plain-loop twin (float64, 1e-12) over random options (stride, 'same' / 'valid' / per-axis /
six-sided padding, the four padding modes, dilation, groups, empty batches); transposed
convolutions (2-D and 3-D) against their scatter definition, their backward passes by the
adjoint identities; where PyTorch is installed, against torch.nn.functional's conv3d and
conv_transpose2d/3d; a transposed convolution's blocks from their windows (the halo rule);
nearest upsampling against its definition and PyTorch; and the refusals, one message each."""
import random

import numpy as np
import pytest

from cfp.halo import _transposed_span, window_axes
from cfp.kernels.conv import (PADDING_MODES, conv3d_backward_bias, conv3d_backward_data, conv3d_backward_filter,
                              conv3d_flops, conv3d_forward, conv3d_output_shape, conv_transpose_backward_bias,
                              conv_transpose_backward_data, conv_transpose_backward_filter, conv_transpose_forward,
                              conv_transpose_output_shape)
from cfp.kernels.conv_reference import (conv_transpose_forward_loop, convnd_backward_data_loop,
                                        convnd_backward_filter_loop, convnd_forward_loop)
from test_kernels_conv import relative_error
from test_kernels_conv_semantics import fast_path  # noqa: F401 (a fixture: every check on each 2-D path)

TOLERANCE = 1e-12


def _valid3(case):
    try:
        conv3d_output_shape(case["x"], case["w"], **case["args"])
        return True
    except ValueError:
        return False


def _volume_cases(count=48, seed=17):
    """Small random 3-D convolutions, every option alone and combined."""
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        G = rng.choice([1, 1, 2, 3])
        Cg, Fg = rng.randint(1, 2), rng.randint(1, 2)
        K = tuple(rng.choice([1, 2, 3]) for _ in range(3)) if rng.random() < 0.5 else (3, 3, 3)
        stride = rng.choice([1, 1, 2, (2, 1, 1), (1, 2, 1)])
        dilation = rng.choice([1, 1, 2, (2, 1, 1), (1, 1, 2)])
        padding = rng.choice([0, 1, (1, 0, 2), (2, 1, 0), "valid"] + (["same"] * 2 if stride == 1 else []))
        mode = rng.choice(PADDING_MODES)
        N = 0 if rng.random() < 0.05 else rng.choice([1, 2])
        D, H, W = rng.randint(1, 6), rng.randint(1, 5), rng.randint(1, 5)
        case = {"x": (N, G * Cg, D, H, W), "w": (G * Fg, Cg) + K,
                "args": {"stride": stride, "padding": padding, "dilation": dilation, "groups": G,
                         "padding_mode": mode}}
        if _valid3(case):
            cases.append(case)
    return cases


VOLUME_CASES = _volume_cases()


def _id(case):
    a = case["args"]
    return (f"x{'x'.join(map(str, case['x']))}-w{'x'.join(map(str, case['w']))}-s{a['stride']}-p{a['padding']}"
            f"-d{a['dilation']}-g{a['groups']}-{a['padding_mode']}").replace(" ", "")


def _volume_problem(case, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(case["x"]).astype(dtype)
    w = rng.standard_normal(case["w"]).astype(dtype)
    b = rng.standard_normal(case["w"][0]).astype(dtype)
    dy = rng.standard_normal(conv3d_output_shape(case["x"], case["w"], **case["args"])).astype(dtype)
    return x, w, b, dy


@pytest.mark.parametrize("case", VOLUME_CASES, ids=_id)
def test_conv3d_matches_loops(case, fast_path):
    x, w, b, dy = _volume_problem(case, seed=1)
    a = case["args"]
    assert relative_error(conv3d_forward(x, w, b, **a), convnd_forward_loop(x, w, b, **a)) < TOLERANCE
    assert relative_error(conv3d_backward_data(dy, w, x.shape, **a),
                          convnd_backward_data_loop(dy, w, x.shape, **a)) < TOLERANCE
    assert relative_error(conv3d_backward_filter(x, dy, w.shape, **a),
                          convnd_backward_filter_loop(x, dy, w.shape, **a)) < TOLERANCE
    assert np.allclose(conv3d_backward_bias(dy), dy.sum(axis=(0, 2, 3, 4)), rtol=1e-13, atol=1e-13)


# Volumes whose 3x3 planes take Winograd read their planes where they lie (volume._in_place):
# depth kernels of 1 to 3 planes, depth strides and dilations, padding on either side or none
# (the stacked planes before and after the interior), one sample and two; backward-data
# stacked where the depth stride is 2, the padding beyond the kernel's extent or F > C.
IN_PLACE_CASES = [
    ((1, 3, 6, 5, 6), (3, 3, 3, 3, 3), {"padding": 1}),
    ((2, 3, 7, 6, 5), (3, 3, 3, 3, 3), {"padding": (2, 1, 1)}),
    ((2, 3, 5, 4, 6), (2, 3, 2, 3, 3), {"padding": "same"}),
    ((1, 2, 8, 5, 5), (2, 2, 3, 3, 3), {"padding": 1, "dilation": (2, 1, 1)}),
    ((2, 2, 9, 5, 4), (2, 2, 3, 3, 3), {"padding": (1, 0, 0), "stride": (2, 1, 1)}),
    ((1, 4, 4, 6, 6), (2, 4, 1, 3, 3), {"padding": (0, 1, 1)}),
    ((1, 2, 6, 4, 4), (2, 2, 3, 3, 3), {"padding": (3, 1, 1)}),
    ((2, 3, 5, 5, 5), (3, 3, 3, 3, 3), {"padding": "same"}),
    ((1, 2, 5, 4, 4), (3, 2, 3, 3, 3), {"padding": 1}),
    ((1, 2, 4, 26, 25), (2, 2, 3, 3, 3), {"padding": 1}),  # strips of tile rows at F(2x2): 13 x 13 tiles
    ((1, 2, 8, 4, 4), (3, 2, 3, 3, 3), {"padding": 1, "dilation": (2, 1, 1)}),
]


@pytest.mark.parametrize("tile", [2, 4])
@pytest.mark.parametrize("x_shape, w_shape, args", IN_PLACE_CASES)
def test_conv3d_winograd_reads_the_planes_in_place(x_shape, w_shape, args, tile, monkeypatch):
    """Every pass that reads the planes in place equals the loops (float64, 1e-12); each case
    takes it for forward and backward-filter (on planes of any size here), and backward-data
    where its depth stride is 1, its front and back padding within the kernel's extent and,
    at a depth dilation (the strided view), F <= C (the others by the stacked path)."""
    from cfp.kernels import settings
    from cfp.kernels.conv import volume
    monkeypatch.setattr(volume, "IN_PLACE_TILES", 1)
    monkeypatch.setattr(volume, "RING_PIXELS", 0)  # the ring on these small planes too
    x, w, b, dy = _volume_problem({"x": x_shape, "w": w_shape, "args": args}, seed=9)
    with settings.winograd(True, tile=tile):
        v = volume.volume_geometry(x_shape, w_shape, **args)
        assert volume._in_place(v, "forward", "float64") and volume._in_place(v, "backward-filter", "float64")
        full = volume._full_depth(v)
        ring = (v.sd, v.dd) == (1, 1)  # each plane transformed once; else the strided view
        assert volume._in_place(v, "backward-data", "float64") == (v.sd == 1 and min(full.pf, full.pk) >= 0
                                                                   and (ring or v.F <= v.C))
        assert relative_error(conv3d_forward(x, w, b, **args), convnd_forward_loop(x, w, b, **args)) < TOLERANCE
        assert relative_error(conv3d_backward_data(dy, w, x.shape, **args),
                              convnd_backward_data_loop(dy, w, x.shape, **args)) < TOLERANCE
        assert relative_error(conv3d_backward_filter(x, dy, w.shape, **args),
                              convnd_backward_filter_loop(x, dy, w.shape, **args)) < TOLERANCE
        strided = np.repeat(dy, 2, axis=2)[:, :, ::2]  # dy as a strided view (a halo adjoint's dx is one)
        assert relative_error(conv3d_backward_data(strided, w, x.shape, **args),
                              convnd_backward_data_loop(dy, w, x.shape, **args)) < TOLERANCE
        assert relative_error(conv3d_backward_filter(x, strided, w.shape, **args),
                              convnd_backward_filter_loop(x, dy, w.shape, **args)) < TOLERANCE


def test_which_volumes_read_their_planes_in_place():
    """By default (float32): every Winograd pass at depth stride and dilation 1 (each plane's
    tiles transformed once) on planes of at least RING_PIXELS outputs, or SMALL_RING_PIXELS with
    at least SMALL_RING_CHANNELS channels to no more filters; at a depth dilation (the strided
    view) planes of at least IN_PLACE_TILES tiles, backward-data where F <= C; float64 (im2col)
    stays stacked. What the cost model counts follows (copied_elements: none where a pass reads
    in place)."""
    from cfp.kernels.conv import volume
    passes = ("forward", "backward-data", "backward-filter")

    def reading(x_shape, w_shape, dtype="float32", **options):
        v = volume.volume_geometry(x_shape, w_shape, padding=options.pop("padding", 1), **options)
        return {p: volume._in_place(v, p, dtype) for p in passes}
    every = dict.fromkeys(passes, True)
    assert reading((1, 32, 64, 64, 64), (32, 32, 3, 3, 3)) == every
    assert reading((4, 64, 16, 16, 16), (64, 64, 3, 3, 3)) == every
    assert reading((2, 16, 32, 32, 32), (32, 16, 3, 3, 3)) == every
    assert reading((2, 32, 24, 24, 24), (64, 32, 3, 3, 3)) == every  # 576 outputs a plane
    assert reading((2, 32, 16, 16, 16), (16, 32, 3, 3, 3)) == every  # 256, 32 channels to 16 filters
    none = dict.fromkeys(passes, False)
    assert reading((2, 16, 16, 16, 16), (32, 16, 3, 3, 3)) == none  # 256 outputs, more filters than channels
    assert reading((1, 16, 16, 16, 16), (16, 16, 3, 3, 3)) == none  # 16 channels
    assert reading((2, 128, 8, 8, 8), (128, 128, 3, 3, 3)) == none  # 64 outputs a plane
    small = volume.volume_geometry((1, 16, 16, 16, 16), (16, 16, 3, 3, 3), padding=1).plane
    assert volume.copied_elements(small, 3) == volume.stacked_copies(small)
    assert reading((2, 32, 32, 32, 32), (32, 32, 3, 3, 3), "float64") == dict.fromkeys(passes, False)
    dilated = {"dilation": (2, 1, 1), "padding": (2, 1, 1)}
    assert reading((2, 32, 32, 32, 32), (32, 32, 3, 3, 3), **dilated) == every
    assert reading((2, 16, 32, 32, 32), (32, 16, 3, 3, 3), **dilated) == {"forward": True, "backward-data": False,
                                                                          "backward-filter": True}
    assert reading((4, 64, 16, 16, 16), (64, 64, 3, 3, 3), **dilated) == dict.fromkeys(passes, False)
    assert reading((2, 32, 32, 32, 32), (32, 32, 3, 3, 3), stride=(2, 1, 1)) == {
        "forward": True, "backward-data": False, "backward-filter": True}
    plane = volume.volume_geometry((2, 16, 32, 32, 32), (32, 16, 3, 3, 3), padding=1).plane
    stacked = volume.stacked_copies(plane)
    assert stacked["backward-data"] == 2 * 32 * 48 * 32 * 32 + 2 * 32 * 32 * 32 * 32
    assert volume.copied_elements(plane, 3) == dict.fromkeys(passes, 0)
    assert volume.copied_elements(plane, 3, ring=False) == {"forward": 0, "backward-data": stacked["backward-data"],
                                                            "backward-filter": 0}


def test_conv3d_six_sided_padding_is_the_padded_input():
    """cfp's own (front, back, top, bottom, left, right) padding equals zero-padding x first."""
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((2, 3, 4, 5, 6)), rng.standard_normal((4, 3, 3, 2, 3))
    sides = (2, 0, 1, 2, 0, 1)
    padded = np.pad(x, ((0, 0), (0, 0), (2, 0), (1, 2), (0, 1)))
    y = conv3d_forward(x, w, padding=sides, stride=(1, 2, 1))
    assert relative_error(y, convnd_forward_loop(padded, w, stride=(1, 2, 1))) < TOLERANCE
    dy = rng.standard_normal(y.shape)
    d_padded = convnd_backward_data_loop(dy, w, padded.shape, stride=(1, 2, 1))
    assert relative_error(conv3d_backward_data(dy, w, x.shape, padding=sides, stride=(1, 2, 1)),
                          d_padded[:, :, 2:, 1:6, :6]) < TOLERANCE


def test_conv3d_float32_error(fast_path):
    """float32 through the 2-D paths (Winograd for 3x3 planes) stays within float32 rounding."""
    case = {"x": (2, 8, 6, 9, 10), "w": (8, 8, 3, 3, 3), "args": {"padding": 1}}
    x, w, b, dy = _volume_problem(case, seed=3)
    a = case["args"]
    x32, w32, dy32 = (v.astype(np.float32) for v in (x, w, dy))
    y = conv3d_forward(x32, w32, **a)
    assert y.dtype == np.float32
    assert relative_error(y, convnd_forward_loop(x, w, **a)) < 1e-5
    assert relative_error(conv3d_backward_data(dy32, w32, x.shape, **a), convnd_backward_data_loop(dy, w, x.shape, **a)) < 1e-5
    assert relative_error(conv3d_backward_filter(x32, dy32, w.shape, **a),
                          convnd_backward_filter_loop(x, dy, w.shape, **a)) < 1e-5


def test_conv3d_flops():
    assert conv3d_flops((2, 4, 5, 6, 7), (6, 2, 3, 3, 3), padding=1, groups=2) == 2 * 2 * 2 * 6 * 5 * 6 * 7 * 27


def _transposed_cases(count=40, seed=23):
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        axes = rng.choice([2, 3])
        G = rng.choice([1, 1, 2])
        C, F = G * rng.randint(1, 2), G * rng.randint(1, 2)
        K = tuple(rng.choice([1, 2, 3]) for _ in range(axes))
        stride = tuple(rng.choice([1, 2, 3]) for _ in range(axes))
        dilation = tuple(rng.choice([1, 1, 2]) for _ in range(axes))
        padding = tuple(rng.choice([0, 0, 1, 2]) for _ in range(axes))
        output_padding = tuple(rng.randint(0, max(s, d) - 1) for s, d in zip(stride, dilation))
        S = tuple(rng.randint(1, 4) for _ in range(axes))
        case = {"x": (rng.choice([1, 2]), C) + S, "w": (C, F // G) + K,
                "args": {"stride": stride, "padding": padding, "output_padding": output_padding,
                         "dilation": dilation, "groups": G}}
        try:
            conv_transpose_output_shape(case["x"], case["w"], **case["args"])
        except ValueError:
            continue
        cases.append(case)
    return cases


TRANSPOSED_CASES = _transposed_cases()


def _transposed_id(case):
    a = case["args"]
    return (f"x{'x'.join(map(str, case['x']))}-w{'x'.join(map(str, case['w']))}-s{a['stride']}-p{a['padding']}"
            f"-op{a['output_padding']}-d{a['dilation']}-g{a['groups']}").replace(" ", "")


def _transposed_problem(case, seed=0):
    rng = np.random.default_rng(seed)
    x, w = rng.standard_normal(case["x"]), rng.standard_normal(case["w"])
    b = rng.standard_normal(case["w"][1] * case["args"]["groups"])
    dy = rng.standard_normal(conv_transpose_output_shape(case["x"], case["w"], **case["args"]))
    return x, w, b, dy


@pytest.mark.parametrize("case", TRANSPOSED_CASES, ids=_transposed_id)
def test_transposed_matches_its_definition(case, fast_path):
    """Forward against the scatter that defines it; backward-data and backward-filter by the
    adjoint identities <dy, T_w x> = <T_w* dy, x> = <dw(x, dy), w>, whose two sides share no
    code (T is linear in x and in w)."""
    x, w, b, dy = _transposed_problem(case, seed=4)
    a = case["args"]
    y = conv_transpose_forward(x, w, b, **a)
    assert relative_error(y, conv_transpose_forward_loop(x, w, b, **a)) < TOLERANCE
    plain = conv_transpose_forward_loop(x, w, None, **a)
    inner = float(np.sum(dy * plain))
    dx = conv_transpose_backward_data(dy, w, x.shape, **a)
    dw = conv_transpose_backward_filter(x, dy, w.shape, **a)
    assert dx.shape == x.shape and dw.shape == w.shape
    scale = np.sqrt(np.sum(dy ** 2) * np.sum(plain ** 2)) + 1e-300
    assert abs(float(np.sum(dx * x)) - inner) / scale < TOLERANCE
    assert abs(float(np.sum(dw * w)) - inner) / scale < TOLERANCE
    assert np.allclose(conv_transpose_backward_bias(dy), dy.sum(axis=tuple(i for i in range(dy.ndim) if i != 1)),
                       rtol=1e-13, atol=1e-13)


def test_transposed_is_the_convolutions_adjoint():
    """Stride 2, output_padding 1: the transposed convolution of dy is the convolution's dx."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((4, 3, 3, 3, 3))
    x_conv = (2, 3, 7, 8, 9)
    dy = rng.standard_normal(conv3d_output_shape(x_conv, w.shape, stride=2, padding=1))
    out = conv_transpose_forward(dy, w, stride=2, padding=1, output_padding=(0, 1, 0))
    assert out.shape == x_conv
    assert relative_error(out, conv3d_backward_data(dy, w, x_conv, stride=2, padding=1)) < TOLERANCE


@pytest.mark.parametrize("case", TRANSPOSED_CASES[:40], ids=_transposed_id)
def test_transposed_blocks_from_their_windows_make_the_whole(case):
    """The halo rule of a transposed convolution (halo._transposed_span): the output cut on one
    axis into every number of blocks up to one per position, each block computed from the input
    rows its span names with the block's signed sides, equals the whole; the blocks' dx, added
    onto those rows, and their dw, summed, equal the whole's. One-position blocks include those
    no input reaches (a stride larger than the kernel), whose windows are empty."""
    from cfp.partition import block_range
    x, w, b, dy = _transposed_problem(case, seed=6)
    a = case["args"]
    y = conv_transpose_forward(x, w, b, **a)
    dx = conv_transpose_backward_data(dy, w, x.shape, **a)
    dw = conv_transpose_backward_filter(x, dy, w.shape, **a)
    geometry, mode = window_axes(x.shape, w.shape[2:], {k: v for k, v in a.items() if k != "groups"})
    assert mode == "transposed"
    block_args = {"stride": a["stride"], "dilation": a["dilation"], "groups": a["groups"], "output_padding": 0}
    for axis, (_, extent, out, stride, dilation, k, before, _) in enumerate(geometry, start=2):
        for parts in range(1, out + 1):
            ys, dx_sum, dw_sum = [], np.zeros_like(dx), np.zeros_like(dw)
            for c in range(parts):
                lo, hi = block_range(out, parts, c)
                size, need, top, bottom, _ = _transposed_span(lo, hi, extent, stride, dilation, k, before)
                assert size == hi - lo
                sides = [0] * (2 * (x.ndim - 2))
                for i, (g_before, g_after) in enumerate((g[6], g[7]) for g in geometry):
                    sides[2 * i:2 * i + 2] = (top, bottom) if i == axis - 2 else (g_before, g_after)
                rows = (slice(None),) * axis + (slice(need.start, need.stop),)
                out_rows = (slice(None),) * axis + (slice(lo, hi),)
                ys.append(conv_transpose_forward(x[rows], w, b, padding=tuple(sides), **block_args))
                assert ys[-1].shape == y[out_rows].shape
                dx_sum[rows] += conv_transpose_backward_data(np.ascontiguousarray(dy[out_rows]), w, x[rows].shape,
                                                             padding=tuple(sides), **block_args)
                dw_sum += conv_transpose_backward_filter(x[rows], np.ascontiguousarray(dy[out_rows]), w.shape,
                                                         padding=tuple(sides), **block_args)
            assert relative_error(np.concatenate(ys, axis=axis), y) < TOLERANCE, (axis, parts)
            assert relative_error(dx_sum, dx) < TOLERANCE, (axis, parts)
            assert relative_error(dw_sum, dw) < TOLERANCE, (axis, parts)


# -- PyTorch as the independent oracle ------------------------------------------------------

@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def _torch_conv3d(torch, x, w, b, args):
    """torch.nn.functional.conv3d with nn.Conv3d's padding modes and cfp's six sides as F.pad."""
    F = torch.nn.functional
    a = dict(args)
    mode, padding = a.pop("padding_mode"), a.pop("padding")
    if mode == "zeros" and not (isinstance(padding, tuple) and len(padding) == 6):
        return F.conv3d(x, w, b, padding=padding, **a)
    k, d = w.shape[2:], a.get("dilation", 1)
    d = (d,) * 3 if isinstance(d, int) else d
    if padding == "same":
        sides = [(dd * (kk - 1) // 2, dd * (kk - 1) - dd * (kk - 1) // 2) for kk, dd in zip(k, d)]
    elif padding == "valid":
        sides = [(0, 0)] * 3
    elif isinstance(padding, tuple) and len(padding) == 6:
        sides = [padding[0:2], padding[2:4], padding[4:6]]
    else:
        p = (padding,) * 3 if isinstance(padding, int) else padding
        sides = [(q, q) for q in p]
    flat = [v for side in reversed(sides) for v in side]  # F.pad: last axis first
    return F.conv3d(F.pad(x, flat, mode="constant" if mode == "zeros" else mode), w, b, padding=0, **a)


ORACLE_VOLUMES = [
    ((2, 4, 6, 7, 8), (6, 4, 3, 3, 3), {"padding": 1}),
    ((1, 4, 7, 7, 7), (4, 4, 3, 3, 3), {"stride": 2, "padding": 1}),
    ((1, 4, 9, 8, 7), (4, 2, 3, 3, 3), {"dilation": 2, "padding": 2, "groups": 2}),
    ((2, 3, 5, 6, 7), (3, 1, 3, 3, 3), {"padding": 1, "groups": 3}),
    ((1, 2, 6, 6, 6), (4, 2, 2, 3, 1), {"padding": "same"}),
    ((1, 2, 6, 7, 8), (3, 2, 3, 3, 3), {"padding": (2, 0, 1, 1, 0, 2)}),
    ((1, 2, 6, 7, 8), (3, 2, 3, 2, 3), {"stride": (2, 1, 2), "padding": (1, 0, 2)}),
    ((2, 2, 5, 6, 7), (3, 2, 3, 3, 3), {"padding": 1, "padding_mode": "reflect"}),
    ((2, 2, 5, 6, 7), (3, 2, 3, 3, 3), {"padding": (2, 1, 1), "padding_mode": "replicate"}),
    ((2, 2, 5, 6, 7), (3, 2, 3, 3, 3), {"padding": (1, 2, 1), "padding_mode": "circular", "dilation": (1, 2, 1)}),
    ((1, 8, 6, 10, 10), (8, 8, 3, 3, 3), {"padding": 1}),
    ((2, 4, 4, 5, 6), (8, 4, 1, 1, 1), {"stride": 2}),
]


@pytest.mark.parametrize("case", range(len(ORACLE_VOLUMES)))
@pytest.mark.filterwarnings("ignore:Using padding=.same. with even kernel")
def test_conv3d_matches_torch(torch, case, fast_path):
    x_shape, w_shape, options = ORACLE_VOLUMES[case]
    args = {"stride": 1, "padding": 0, "dilation": 1, "groups": 1, "padding_mode": "zeros", **options}
    x, w, b, dy = _volume_problem({"x": x_shape, "w": w_shape, "args": args}, seed=6)
    tx, tw, tb = (torch.tensor(v, requires_grad=True) for v in (x, w, b))
    ty = _torch_conv3d(torch, tx, tw, tb, args)
    ty.backward(torch.tensor(dy))
    assert relative_error(conv3d_forward(x, w, b, **args), ty.detach().numpy()) < TOLERANCE
    assert relative_error(conv3d_backward_data(dy, w, x.shape, **args), tx.grad.numpy()) < TOLERANCE
    assert relative_error(conv3d_backward_filter(x, dy, w.shape, **args), tw.grad.numpy()) < TOLERANCE
    assert relative_error(conv3d_backward_bias(dy), tb.grad.numpy()) < TOLERANCE


ORACLE_TRANSPOSED = [
    ((2, 4, 5, 6), (4, 3, 3, 3), {}),
    ((2, 4, 5, 6), (4, 3, 3, 3), {"stride": 2, "padding": 1, "output_padding": 1}),
    ((2, 4, 5, 6), (4, 2, 3, 2), {"stride": (2, 3), "padding": (1, 0), "output_padding": (1, 2), "groups": 2}),
    ((2, 4, 5, 6), (4, 3, 3, 3), {"padding": 1, "output_padding": 1, "dilation": 2}),
    ((1, 6, 4, 4), (6, 1, 4, 4), {"stride": 2, "padding": 1, "groups": 6}),
    ((2, 3, 5, 4), (3, 2, 1, 1), {"stride": 2, "output_padding": 1}),
    ((1, 4, 3, 4, 5), (4, 3, 3, 3, 3), {"stride": 2, "padding": 1, "output_padding": 1}),
    ((1, 4, 3, 4, 5), (4, 1, 2, 3, 3), {"stride": (1, 2, 2), "padding": (0, 1, 2), "output_padding": (0, 1, 0),
                                        "dilation": (2, 1, 1), "groups": 4}),
    ((2, 2, 3, 3, 3), (2, 4, 2, 2, 2), {"stride": 2}),
    ((1, 4, 4, 3, 5), (4, 2, 3, 3, 3), {"dilation": 2, "padding": (2, 1, 0), "output_padding": (1, 0, 1),
                                        "groups": 2}),
]


@pytest.mark.parametrize("case", range(len(ORACLE_TRANSPOSED)))
def test_transposed_matches_torch(torch, case, fast_path):
    x_shape, w_shape, options = ORACLE_TRANSPOSED[case]
    args = {"stride": 1, "padding": 0, "output_padding": 0, "dilation": 1, "groups": 1, **options}
    x, w, b, dy = _transposed_problem({"x": x_shape, "w": w_shape, "args": args}, seed=7)
    tx, tw, tb = (torch.tensor(v, requires_grad=True) for v in (x, w, b))
    F = torch.nn.functional
    transposed = F.conv_transpose2d if len(x_shape) == 4 else F.conv_transpose3d
    ty = transposed(tx, tw, tb, args["stride"], args["padding"], args["output_padding"], args["groups"],
                    args["dilation"])
    ty.backward(torch.tensor(dy))
    assert relative_error(conv_transpose_forward(x, w, b, **args), ty.detach().numpy()) < TOLERANCE
    assert relative_error(conv_transpose_backward_data(dy, w, x.shape, **args), tx.grad.numpy()) < TOLERANCE
    assert relative_error(conv_transpose_backward_filter(x, dy, w.shape, **args), tw.grad.numpy()) < TOLERANCE
    assert relative_error(conv_transpose_backward_bias(dy), tb.grad.numpy()) < TOLERANCE


# -- bad input: one clear message each --------------------------------------------------------

@pytest.mark.parametrize("x_shape, w_shape, options, message", [
    ((1, 2, 2, 8, 8), (3, 2, 3, 3, 3), {}, r"kernel depth 3 does not fit the padded input depth 2"),
    ((1, 2, 4, 8, 8), (3, 2, 3, 3, 3), {"dilation": (2, 1, 1)}, r"dilation 2 \(extent 5\)"),
    ((1, 2, 8, 2, 8), (3, 2, 3, 3, 3), {}, r"kernel 3x3 does not fit the padded input 2x8.*volume 8x2x8"),
    ((1, 2, 4, 8, 8), (3, 2, 3, 3), {}, r"w must be a 5-D array"),
    ((1, 3, 4, 8, 8), (3, 2, 3, 3, 3), {}, r"x has C=3 channels but w expects 2"),
    ((1, 4, 4, 8, 8), (3, 2, 3, 3, 3), {"groups": 2}, r"groups=2 must divide .* F=3"),
    ((1, 2, 4, 8, 8), (3, 2, 3, 3, 3), {"stride": (1, 0, 1)}, r"stride must be a positive integer or a triple"),
    ((1, 2, 4, 8, 8), (3, 2, 3, 3, 3), {"stride": 2, "padding": "same"}, r"'same' is not supported for strided"),
    ((1, 2, 3, 8, 8), (3, 2, 1, 1, 1), {"padding": (3, 0, 0), "padding_mode": "reflect"},
     r"padding \(3, 3\) \(front, back\) with padding_mode 'reflect' must be smaller than the input depth D=3"),
    ((1, 2, 4, 8, 8), (3, 2, 3, 3, 3), {"padding_mode": "mirror"}, r"padding_mode 'mirror' is not one of"),
])
def test_conv3d_refusals(x_shape, w_shape, options, message):
    with pytest.raises(ValueError, match=message):
        conv3d_forward(np.zeros(x_shape), np.zeros(w_shape), **options)


@pytest.mark.parametrize("x_shape, w_shape, options, message", [
    ((1, 2, 4, 4), (2, 3, 3, 3), {"stride": 2, "output_padding": 2},
     r"output_padding \(2, 2\) must be smaller than the stride \(2, 2\) or the dilation \(1, 1\)"),
    ((1, 2, 4, 4, 4), (2, 3, 3, 3, 3), {"output_padding": (0, 1, 0)}, r"output_padding \(0, 1, 0\) must be smaller"),
    ((1, 2, 4, 4), (2, 3, 3, 3), {"padding": "same"}, r"integer padding .* not 'same' or 'valid'"),
    ((1, 2, 1, 1), (2, 3, 1, 1), {"padding": 1}, r"padding crops it all"),
    ((1, 3, 4, 4), (2, 3, 3, 3), {}, r"x has C=3 channels but the transposed convolution's w"),
    ((1, 2, 4, 4), (2, 3, 3, 3, 3), {}, r"w must be a 4-D array"),
    ((1, 2, 4), (2, 3, 3), {}, r"x must be a 4-D or 5-D array"),
    ((1, 4, 4, 4), (4, 3, 3, 3), {"groups": 3}, r"groups=3 must divide the input channels C=4"),
])
def test_transposed_refusals(x_shape, w_shape, options, message):
    with pytest.raises(ValueError, match=message):
        conv_transpose_forward(np.zeros(x_shape), np.zeros(w_shape), **options)


def test_bench_kernels_times_a_volume():
    """bench_kernels takes N x C x F x D x H x W x K as a volume: parsed, named back, timed, its
    float32 error against float64 at rounding."""
    from conftest import load_script
    bench = load_script("bench_kernels")
    shape = bench.parse_shape("2x3x4x5x6x7x3s2")
    assert shape == (2, 3, 4, 6, 7, 3, 1, 1, 2, 5)
    assert bench.shape_text(shape) == "2x3x4x5x6x7x3s2"
    assert bench.parse_shape("2x3x4x6x7x3") == (2, 3, 4, 6, 7, 3, 1, 1, 1)
    row = bench.bench_shape(bench.parse_shape("1x4x4x4x5x6x3"), np.dtype(np.float32), 1, np.random.default_rng(0))
    assert row["flops_per_pass"] == conv3d_flops((1, 4, 4, 5, 6), (4, 4, 3, 3, 3), padding=1)
    assert row["cfp_error"] < 1e-5 and row["cfp_total_s"] > 0


def _pool3d_loops(x, dy, kernel, stride, padding, kind):
    """Max or average pooling of a volume written out: each output position's cubic window."""
    fill = -np.inf if kind == "max" else 0.0
    xp = np.pad(x, ((0, 0), (0, 0)) + ((padding, padding),) * 3, constant_values=fill)
    y, dxp = np.zeros(dy.shape), np.zeros(xp.shape)
    for n, c, *o in np.ndindex(*dy.shape):
        at = (n, c) + tuple(slice(i * stride, i * stride + kernel) for i in o)
        win = xp[at]
        if kind == "max":
            k = np.unravel_index(np.argmax(win), win.shape)  # the first maximum, as PyTorch
            y[(n, c, *o)] = win[k]
            dxp[(n, c) + tuple(i * stride + a for i, a in zip(o, k))] += dy[(n, c, *o)]
        else:
            y[(n, c, *o)] = win.mean()
            dxp[at] += dy[(n, c, *o)] / kernel ** 3
    D, H, W = x.shape[2:]
    return y, dxp[:, :, padding:padding + D, padding:padding + H, padding:padding + W]


@pytest.mark.parametrize("kernel, stride, padding", [(2, 2, 0), (3, 1, 1), (3, 2, 1), (2, 1, 0)])
@pytest.mark.parametrize("kind", ["max", "avg"])
def test_pool3d_matches_loops(kernel, stride, padding, kind):
    from cfp.kernels.pool import avg_pool3d_backward, avg_pool3d_forward, max_pool3d_backward, max_pool3d_forward
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 3, 5, 4, 6))
    if kind == "max":
        y, argmax = max_pool3d_forward(x, kernel, stride, padding)
        dy = rng.standard_normal(y.shape)
        dx = max_pool3d_backward(dy, argmax, x.shape, kernel, stride, padding)
    else:
        y = avg_pool3d_forward(x, kernel, stride, padding)
        dy = rng.standard_normal(y.shape)
        dx = avg_pool3d_backward(dy, x.shape, kernel, stride, padding)
    y_loop, dx_loop = _pool3d_loops(x, dy, kernel, stride, padding, kind)
    assert relative_error(y, y_loop) < TOLERANCE and relative_error(dx, dx_loop) < TOLERANCE


def test_pool3d_matches_torch(torch):
    from cfp.kernels.pool import avg_pool3d_forward, max_pool3d_forward
    x = np.random.default_rng(13).standard_normal((2, 3, 6, 5, 7))
    tx = torch.tensor(x)
    assert relative_error(max_pool3d_forward(x, 3, 2, 1)[0],
                          torch.nn.functional.max_pool3d(tx, 3, 2, 1).numpy()) < TOLERANCE
    assert relative_error(avg_pool3d_forward(x, 2, 1, 0), torch.nn.functional.avg_pool3d(tx, 2, 1, 0).numpy()) < TOLERANCE


# -- nearest upsampling ----------------------------------------------------------------------

@pytest.mark.parametrize("shape, factor", [((2, 3, 4, 5), 2), ((1, 2, 3, 4), (3, 1)), ((2, 2, 3, 2, 4), 2),
                                           ((1, 1, 2, 3, 2), (1, 2, 3))])
def test_upsample_nearest_matches_its_definition_and_is_its_own_adjoint(shape, factor):
    """y[..., i, j] = x[..., i // f, j // f'] (a volume's too); a block's sides drop what they
    say; backward is forward's adjoint, <dy, up(x)> = <up*(dy), x>."""
    from cfp.kernels.resample import upsample_nearest_backward, upsample_nearest_forward
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shape)
    factors = (factor,) * (len(shape) - 2) if isinstance(factor, int) else factor
    y = upsample_nearest_forward(x, factor)
    index = np.ix_(*[np.arange(n * f) // f for n, f in zip(shape[2:], factors)])
    assert np.array_equal(y, x[(slice(None), slice(None)) + index])
    sides = tuple(v for f in factors for v in (min(1, f - 1), 0))
    block = upsample_nearest_forward(x, factor, sides)
    assert np.array_equal(block, y[(slice(None), slice(None)) + tuple(slice(s, None) for s in sides[::2])])
    dy = rng.standard_normal(block.shape)
    dx = upsample_nearest_backward(dy, factor, x.shape, sides)
    assert abs(float(np.sum(dx * x)) - float(np.sum(dy * block))) < 1e-12 * np.sqrt(np.sum(dy ** 2) * np.sum(x ** 2))


def test_upsample_matches_torch(torch):
    from cfp.kernels.resample import upsample_nearest_forward
    x = np.random.default_rng(8).standard_normal((2, 3, 3, 4, 5))
    want = torch.nn.functional.interpolate(torch.tensor(x), scale_factor=(2, 1, 3), mode="nearest").numpy()
    assert np.array_equal(upsample_nearest_forward(x, (2, 1, 3)), want)


def test_upsample_refusals():
    from cfp.nn import Upsample
    with pytest.raises(ValueError, match=r"Upsample mode 'bilinear': cfp upsamples by 'nearest' only"):
        Upsample(2, mode="bilinear")
    with pytest.raises(ValueError, match=r"scale_factor must be a positive integer or a pair of them, got 0"):
        Upsample(0)
    with pytest.raises(ValueError, match=r"scale_factor must be a positive integer or a pair of them, got 1.5"):
        Upsample(1.5)
