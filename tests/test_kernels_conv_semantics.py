"""nn.Conv2d's full semantics in the local kernels: dilation, groups (depthwise with a channel
multiplier), 'same' and 'valid' and asymmetric padding, the four padding modes, pairs of every
argument, and empty batches; the fast kernels against the plain-loop twin (float64, 1e-12) and,
where PyTorch is installed, against torch.nn.functional (values, gradients and refusals)."""
import dataclasses
import random

import numpy as np
import pytest

from cfp.kernels import (conv2d_backward_bias, conv2d_backward_data, conv2d_backward_filter, conv2d_flops,
                         conv2d_forward, conv2d_output_shape)
from cfp.kernels import conv as conv_module
from cfp.kernels import settings
from cfp.kernels.conv import columns, depthwise, paths, plane
from cfp.kernels.conv import winograd as winograd_kernels
from cfp.kernels.conv import PADDING_MODES
from cfp.kernels.conv_reference import (conv2d_backward_data_loop, conv2d_backward_filter_loop,
                                        conv2d_forward_loop)
from test_kernels_conv import relative_error

TOLERANCE = 1e-12


def _valid(case):
    try:
        conv2d_output_shape(case["x"], case["w"], **case["args"])
        return True
    except ValueError:
        return False


def _make_cases(count=160, seed=11):
    """Random small grouped, dilated, padded convolutions, every option alone and combined."""
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        G = rng.choice([1, 1, 2, 3, 4])
        depthwise = G > 1 and rng.random() < 0.35
        Cg = 1 if depthwise else rng.randint(1, 3)
        Fg = rng.randint(1, 3)
        K = (rng.randint(1, 4), rng.randint(1, 4)) if rng.random() < 0.3 else (rng.choice([1, 2, 3, 4, 5]),) * 2
        stride = rng.choice([1, 1, 2, (2, 1), (1, 2)])
        dilation = rng.choice([1, 1, 2, (1, 2), (2, 1)])
        padding = rng.choice([0, 1, 2, (1, 0), (0, 2), "valid"] + (["same"] * 3 if stride == 1 else []))
        mode = rng.choice(PADDING_MODES)
        N = rng.choice([0, 1, 2, 3]) if rng.random() < 0.1 else rng.choice([1, 2, 3])
        H, W = rng.randint(1, 8), rng.randint(1, 8)
        case = {"x": (N, G * Cg, H, W), "w": (G * Fg, Cg) + K,
                "args": {"stride": stride, "padding": padding, "dilation": dilation, "groups": G,
                         "padding_mode": mode}}
        if _valid(case):
            cases.append(case)
    return cases


CASES = _make_cases()


def _id(case):
    a = case["args"]
    return (f"x{'x'.join(map(str, case['x']))}-w{'x'.join(map(str, case['w']))}-s{a['stride']}-p{a['padding']}"
            f"-d{a['dilation']}-g{a['groups']}-{a['padding_mode']}").replace(" ", "")


def _problem(case, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    y_shape = conv2d_output_shape(case["x"], case["w"], **case["args"])
    x, w, dy = (rng.standard_normal(s).astype(dtype) for s in (case["x"], case["w"], y_shape))
    return x, w, rng.standard_normal(case["w"][0]).astype(dtype), dy


def test_cases_cover_every_option():
    seen = {"groups": set(), "mode": set(), "padding": set(), "dilation": set(), "stride": set(),
            "kernel": set(), "depthwise multiplier": set()}
    for c in CASES:
        a = c["args"]
        seen["groups"].add(a["groups"])
        seen["mode"].add(a["padding_mode"])
        seen["padding"].add(str(a["padding"]))
        seen["dilation"].add(str(a["dilation"]))
        seen["stride"].add(str(a["stride"]))
        seen["kernel"].update(c["w"][2:])
        if a["groups"] > 1 and c["x"][1] == a["groups"]:
            seen["depthwise multiplier"].add(c["w"][0] // a["groups"])
    assert seen["groups"] == {1, 2, 3, 4}
    assert seen["mode"] == set(PADDING_MODES)
    assert {"same", "valid", "0", "1", "2", "(1, 0)", "(0, 2)"} <= seen["padding"]
    assert {"1", "2", "(1, 2)", "(2, 1)"} <= seen["dilation"] and {"1", "2", "(2, 1)"} <= seen["stride"]
    assert {1, 2, 3, 4, 5} <= seen["kernel"]  # odd and even kernels
    assert {1, 2, 3} <= seen["depthwise multiplier"]
    assert any(c["x"][0] == 0 for c in CASES)  # an empty batch
    assert any(c["args"]["padding"] == "same" and c["w"][2] % 2 == 0 and c["args"]["padding_mode"] != "zeros"
               for c in CASES)  # asymmetric padding in a non-zero mode


def _set(monkeypatch, **changes):
    """The kernel settings changed for the rest of one test (cfp/kernels/settings.py)."""
    monkeypatch.setattr(settings._current, "settings", dataclasses.replace(settings.current(), **changes))


@pytest.fixture(params=[None, "columns", 2, 4], ids=["im2col", "columns", "winograd2", "winograd4"])
def fast_path(request, monkeypatch):
    """Every check of the fast kernels runs on the im2col path (the layers of few channels too,
    which by default take per-sample columns), on the default paths without Winograd (those
    per-sample columns), and with Winograd F(2x2, 3x3) and F(4x4, 3x3) for the 3x3 stride-1
    layers."""
    if request.param is None:
        monkeypatch.setattr(columns, "FEW_CHANNELS", 0)
    tile = request.param if request.param != "columns" else None
    with settings.winograd(tile is not None, tile=tile):
        yield request.param


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fast_kernels_match_the_loops(case, fast_path):
    x, w, b, dy = _problem(case)
    a = case["args"]
    checks = [
        ("y", conv2d_forward(x, w, b, **a), conv2d_forward_loop(x, w, b, **a)),
        ("dx", conv2d_backward_data(dy, w, x.shape, **a), conv2d_backward_data_loop(dy, w, x.shape, **a)),
        ("dw", conv2d_backward_filter(x, dy, w.shape, **a), conv2d_backward_filter_loop(x, dy, w.shape, **a)),
    ]
    for name, actual, expected in checks:
        assert actual.shape == expected.shape and actual.dtype == np.float64, name
        assert relative_error(actual, expected) < TOLERANCE, name


@pytest.mark.parametrize("case", CASES[::8], ids=_id)
def test_float32_stays_close(case, fast_path):
    x, w, b, dy = _problem(case)
    a = case["args"]
    single = [v.astype(np.float32) for v in (x, w, b, dy)]
    pairs = [(conv2d_forward(*single[:3], **a), conv2d_forward(x, w, b, **a)),
             (conv2d_backward_data(single[3], single[1], x.shape, **a), conv2d_backward_data(dy, w, x.shape, **a)),
             (conv2d_backward_filter(single[0], single[3], w.shape, **a), conv2d_backward_filter(x, dy, w.shape, **a))]
    for r32, r64 in pairs:
        assert r32.dtype == np.float32
        assert relative_error(r32.astype(np.float64), r64) < 1e-5


def test_each_winograd_layer_takes_its_cheaper_tile():
    """By default (winograd_tile None) each Winograd layer runs at the tile winograd.tile picks
    by tile_cost for the BLAS loaded (AVX-512 GEMMs or AVX2 ones): F(2x2) where a call has few
    tiles for its filters' transforms, and with AVX-512 where F(4x4)'s tiles overhang a 14x14
    output; F(4x4) on larger images of many tiles. The passes run at that tile (bit for bit the
    explicit setting's results, not the other tile's), taken() names it, and an explicit tile
    holds for every layer."""
    from cfp import backend
    from cfp.kernels.conv.geometry import conv_geometry
    # (N, C, F, H): the tile with AVX-512 GEMMs, with AVX2 ones
    picks = {(2, 256, 256, 14): (2, 2), (4, 512, 512, 8): (2, 4), (8, 256, 256, 14): (2, 4),
             (8, 512, 512, 8): (2, 4), (8, 256, 256, 16): (4, 4), (32, 64, 64, 32): (4, 4), (8, 64, 64, 56): (4, 4)}
    for (N, C, F, H), tiles in picks.items():
        g = conv_geometry((N, C, H, H), (F, C, 3, 3), padding=1)
        for avx512, m in zip((True, False), tiles):
            assert winograd_kernels.tile_cost(g, m, avx512) < winograd_kernels.tile_cost(g, 6 - m, avx512), (N, C, F, H)
        m = tiles[0] if backend.blas_runs_avx512() else tiles[1]
        assert winograd_kernels.tile(g) == m, (N, C, F, H)
        name = "winograd" + ("" if m == 4 else " F(2x2)")
        with settings.winograd(True):  # (4x512x512 on 8x8 has too few tiles to take it by default)
            taken = paths.taken(g, "float32")
        assert taken == {"forward": name, "backward-data": "full-convolution/" + name,
                                             "backward-filter": name}
        for tile in (2, 4):
            with settings.winograd(None, tile=tile):
                assert winograd_kernels.tile(g) == tile
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 8, 14, 14)).astype(np.float32)
    w = rng.standard_normal((16, 8, 3, 3)).astype(np.float32)
    g = conv_geometry(x.shape, w.shape, padding=1)
    chosen = winograd_kernels.tile(g)
    with settings.winograd(True):
        y = conv2d_forward(x, w, padding=1)
    with settings.winograd(True, tile=chosen):
        assert np.array_equal(conv2d_forward(x, w, padding=1), y)
    with settings.winograd(True, tile=6 - chosen):
        assert not np.array_equal(conv2d_forward(x, w, padding=1), y)


def test_same_padding_puts_the_extra_row_and_column_last():
    """An even kernel under 'same': PyTorch's choice, total // 2 before and the rest after."""
    x = np.zeros((1, 1, 4, 4))
    x[0, 0, 3, 3] = 1.0
    w = np.zeros((1, 1, 2, 2))
    w[0, 0, 1, 1] = 1.0  # y[i, j] is the padded input at (i + 1, j + 1)
    y = conv2d_forward(x, w, padding="same")
    # padding (0, 1, 0, 1): y[i, j] = x[i + 1, j + 1], and the last row and column read zeros
    assert y.shape == (1, 1, 4, 4) and y[0, 0, 2, 2] == 1.0 and y.sum() == 1.0
    assert conv2d_output_shape((2, 4, 7, 6), (4, 1, 4, 3), padding="same", dilation=(1, 2), groups=4) == (2, 4, 7, 6)


def test_flops_divide_by_groups():
    assert conv2d_flops((2, 8, 6, 6), (8, 2, 3, 3), padding=1, groups=4) == 2 * 2 * 2 * 8 * 6 * 6 * 9


X = np.zeros((2, 4, 5, 5))


@pytest.mark.parametrize("kwargs,w_shape,message", [
    ({"groups": 3}, (6, 1, 3, 3), "groups=3 must divide the input channels C=4 and the filters F=6"),
    ({"groups": 2}, (6, 1, 3, 3), r"x has C=4 channels but w expects 2 \(4 channels in 2 groups\)"),
    ({"groups": 0}, (4, 4, 3, 3), "groups must be a positive integer, got 0"),
    ({"padding": "same", "stride": 2}, (4, 4, 3, 3), "padding 'same' is not supported for strided convolutions"),
    ({"padding": "full"}, (4, 4, 3, 3), "padding 'full' is not one of 'valid', 'same'"),
    ({"padding": -1}, (4, 4, 3, 3), "padding must be a non-negative integer"),
    ({"dilation": 0}, (4, 4, 3, 3), "dilation must be a positive integer"),
    ({"dilation": 3}, (4, 4, 3, 3), r"kernel 3x3 with dilation \(3, 3\) \(extent 7x7\) does not fit the padded input 5x5"),
    ({"padding_mode": "mirror"}, (4, 4, 3, 3), "padding_mode 'mirror' is not one of zeros, reflect, replicate, circular"),
    ({"padding": 5, "padding_mode": "reflect"}, (4, 4, 3, 3), "with padding_mode 'reflect' must be smaller than the input 5x5"),
    ({"padding": 6, "padding_mode": "circular"}, (4, 4, 3, 3), "wraps around the input 5x5 more than once"),
])
def test_refusals_name_the_value(kwargs, w_shape, message):
    with pytest.raises(ValueError, match=message):
        conv2d_forward(X, np.zeros(w_shape), **kwargs)


@pytest.fixture
def torch():
    """PyTorch, the optional independent oracle; the test skips where it is not installed."""
    return pytest.importorskip("torch")


def _torch_conv(torch, x, w, b, args):
    """torch.nn.functional's convolution with nn.Conv2d's handling of padding_mode."""
    F = torch.nn.functional
    a = dict(args)
    mode, padding = a.pop("padding_mode"), a.pop("padding")
    if mode == "zeros":
        return F.conv2d(x, w, b, padding=padding, **a)
    kh, kw = w.shape[2:]
    dh, dw = (a["dilation"],) * 2 if isinstance(a["dilation"], int) else a["dilation"]
    if padding == "same":
        sides = []
        for k, d in ((kw, dw), (kh, dh)):
            total = d * (k - 1)
            sides += [total // 2, total - total // 2]
    elif padding == "valid":
        sides = [0, 0, 0, 0]
    else:
        ph, pw = (padding, padding) if isinstance(padding, int) else padding
        sides = [pw, pw, ph, ph]
    return F.conv2d(F.pad(x, sides, mode=mode), w, b, padding=0, **a)


@pytest.mark.parametrize("case", CASES[::4], ids=_id)
def test_matches_torch(torch, case, fast_path):
    x, w, b, dy = _problem(case, seed=5)
    a = case["args"]
    tx, tw, tb = (torch.tensor(v, requires_grad=True) for v in (x, w, b))
    ty = _torch_conv(torch, tx, tw, tb, a)
    ty.backward(torch.tensor(dy))
    assert relative_error(conv2d_forward(x, w, b, **a), ty.detach().numpy()) < 1e-12
    assert relative_error(conv2d_backward_data(dy, w, x.shape, **a), tx.grad.numpy()) < 1e-12
    assert relative_error(conv2d_backward_filter(x, dy, w.shape, **a), tw.grad.numpy()) < 1e-12
    assert relative_error(conv2d_backward_bias(dy), tb.grad.numpy()) < 1e-12


def test_refuses_what_torch_refuses(torch):
    """Over random argument combinations (including invalid ones), cfp raises exactly where
    nn.Conv2d's computation raises."""
    rng = random.Random(3)
    disagreements, refused = [], 0
    for _ in range(400):
        C, F, G = rng.choice([2, 4, 6]), rng.choice([2, 3, 4]), rng.choice([1, 2, 3])
        K = rng.choice([1, 2, 3, 5])
        H = rng.choice([1, 2, 3, 5])
        args = {"stride": rng.choice([1, 2]), "padding": rng.choice([0, 1, 2, 3, 5, "same", "valid"]),
                "dilation": rng.choice([1, 2, 3]), "groups": G, "padding_mode": rng.choice(PADDING_MODES)}
        Cg = max(1, C // G)
        x, w = np.zeros((1, C, H, H)), np.zeros((F, Cg, K, K))
        try:
            conv2d_forward(x, w, **args)
            ours = None
        except ValueError as e:
            ours = str(e)
        try:
            theirs_layer = torch.nn.Conv2d(C, F, K, stride=args["stride"], padding=args["padding"],
                                           dilation=args["dilation"], groups=G, padding_mode=args["padding_mode"],
                                           bias=False).double()
            theirs_layer(torch.zeros(1, C, H, H, dtype=torch.float64))
            theirs = None
        except (ValueError, RuntimeError) as e:
            theirs = str(e)
        if (ours is None) != (theirs is None):
            disagreements.append((C, F, K, H, args, ours, theirs))
        refused += ours is not None
    assert not disagreements, disagreements[:5]
    assert 50 < refused < 350  # both outcomes were tried


@pytest.mark.parametrize("tile", [2, 4])
def test_winograd_is_exact_in_float64_and_close_in_float32(tile):
    """On the benchmark's 3x3 shapes (scaled down), Winograd F(2x2, 3x3) and F(4x4, 3x3)
    against im2col, all three passes: float64 to 1e-12, float32 to 1e-5 relative."""
    rng = np.random.default_rng(9)
    for N, C, F, H in ((4, 64, 64, 32), (2, 256, 256, 16)):
        x, w = rng.standard_normal((N, C, H, H)), rng.standard_normal((F, C, 3, 3))
        dy = rng.standard_normal((N, F, H, H))

        def passes(dtype):
            a, b, d = (v.astype(dtype) for v in (x, w, dy))
            return (conv2d_forward(a, b, padding=1), conv2d_backward_data(d, b, x.shape, padding=1),
                    conv2d_backward_filter(a, d, w.shape, padding=1))
        with settings.winograd(False):
            plain = passes(np.float64)
        for dtype, tolerance in ((np.float64, 1e-12), (np.float32, 1e-5)):
            with settings.winograd(True, tile=tile):
                fast = passes(dtype)
            for a, b in zip(fast, plain):
                assert a.dtype == dtype and relative_error(a.astype(np.float64), b) < tolerance


@pytest.mark.parametrize("tile", [2, 4])
@pytest.mark.parametrize("rows", [1, 3, 7])
def test_winograd_strips_of_large_images_match_the_loops(tile, rows, monkeypatch):
    """Where a sample has more tiles than a block holds, Winograd goes through strips of its
    tile rows: with blocks of 1, 3 or 7 tiles, every pass equals the plain loops in float64,
    for images of whole and cropped tiles, padding on every side or none, one sample and
    several, the last strip shorter; and strips were taken (more blocks than samples)."""
    monkeypatch.setattr(winograd_kernels, "_WINOGRAD_ROWS", rows)
    counted = []
    real = winograd_kernels._WinogradTiles.count
    monkeypatch.setattr(winograd_kernels._WinogradTiles, "count",
                        lambda self: counted.append((self.g.N, real(self))) or real(self))
    rng = np.random.default_rng(rows + tile)
    for x_shape, F, padding in (((1, 3, 13, 11), 4, 1), ((2, 2, 9, 17), 3, (2, 0)), ((3, 2, 16, 16), 2, 1),
                                ((1, 2, 21, 10), 2, 0)):
        x, w = rng.standard_normal(x_shape), rng.standard_normal((F, x_shape[1], 3, 3))
        dy = rng.standard_normal(conv_module.conv2d_output_shape(x_shape, w.shape, padding=padding))
        counted.clear()
        with settings.winograd(True, tile=tile):
            fast = (conv2d_forward(x, w, padding=padding), conv2d_backward_data(dy, w, x_shape, padding=padding),
                    conv2d_backward_filter(x, dy, w.shape, padding=padding))
        loops = (conv2d_forward_loop(x, w, None, padding=padding),
                 conv2d_backward_data_loop(dy, w, x_shape, padding=padding),
                 conv2d_backward_filter_loop(x, dy, w.shape, padding=padding))
        for actual, expected in zip(fast, loops):
            assert actual.shape == expected.shape and relative_error(actual, expected) < TOLERANCE
        assert counted and all(blocks > samples for samples, blocks in counted), counted


@pytest.mark.parametrize("tile", [2, 4])
@pytest.mark.parametrize("filters_at_once", [1, 2, 3])
def test_winograd_in_blocks_of_filters_matches_the_loops(tile, filters_at_once, monkeypatch):
    """Where one block of tiles holds the call and the filters' transforms outgrow
    FILTER_BLOCK_BYTES, the passes go through the filters in blocks (backward-data through the
    layer's channels, its full convolution's filters): with blocks of 1, 2 or 3 filters
    (the last one shorter), every pass equals the plain loops in float64, for whole and
    cropped tiles, padding on every side, one sided or none, dilated layers' sub-grids; and
    each pass went by blocks (filter_block below F: forward, backward-data and
    backward-filter, on their geometries)."""
    blocked = []
    real = winograd_kernels.filter_block
    monkeypatch.setattr(winograd_kernels, "_MIN_FILTER_BLOCK", 1)
    monkeypatch.setattr(winograd_kernels, "FILTER_BLOCK_TILES", 1000)  # (the dilated layer's classes: 72 tiles)
    monkeypatch.setattr(winograd_kernels.backend, "blas_runs_avx512", lambda: False)  # (blocks with AVX2 GEMMs only)
    monkeypatch.setattr(winograd_kernels, "filter_block",
                        lambda g, *a: blocked.append(real(g, *a) < g.F) or real(g, *a))
    rng = np.random.default_rng(filters_at_once + tile)
    for x_shape, F, args in (((2, 3, 8, 8), 5, {"padding": 1}), ((1, 4, 9, 11), 4, {"padding": (2, 0)}),
                             ((3, 5, 6, 7), 7, {"padding": 0}), ((2, 3, 10, 9), 4, {"padding": 2, "dilation": 2})):
        x, w = rng.standard_normal(x_shape), rng.standard_normal((F, x_shape[1], 3, 3))
        dy = rng.standard_normal(conv_module.conv2d_output_shape(x_shape, w.shape, **args))
        a = tile + 2
        # at most `filters_at_once` filters' transforms (C' channels deep, C or F) at a time
        monkeypatch.setattr(winograd_kernels, "FILTER_BLOCK_BYTES", a * a * min(x_shape[1], F) * 8 * filters_at_once)
        blocked.clear()
        with settings.winograd(True, tile=tile):
            fast = (conv2d_forward(x, w, **args), conv2d_backward_data(dy, w, x_shape, **args),
                    conv2d_backward_filter(x, dy, w.shape, **args))
        loops = (conv2d_forward_loop(x, w, None, **args), conv2d_backward_data_loop(dy, w, x_shape, **args),
                 conv2d_backward_filter_loop(x, dy, w.shape, **args))
        for actual, expected in zip(fast, loops):
            assert actual.shape == expected.shape and relative_error(actual, expected) < TOLERANCE, (x_shape, args)
        assert blocked.count(True) >= 3, (x_shape, args, blocked)


def test_winograd_takes_blocks_of_filters_only_for_few_tiles_and_large_transforms(monkeypatch):
    """filter_block's rule: blocks of 8 MiB of transforms where one block of at most 48 tiles
    holds the call, U is larger (8x1024x1024 on 8x8: 32 tiles, 151 MB of U in float32: 56
    filters at once) and the BLAS runs AVX2 GEMMs; the whole U with more tiles, several blocks
    of tiles, a U that fits, AVX-512 GEMMs, or CuPy's arrays."""
    def rule(g, xp=np, avx512=False):
        return winograd_kernels.filter_block(g, 4, xp, 6, avx512)
    wide = conv_module.conv_geometry((8, 1024, 8, 8), (1024, 1024, 3, 3), padding=1)
    assert rule(wide) == (8 << 20) // (36 * 1024 * 4) == 56
    assert rule(wide._replace(N=12)) == 56  # 48 tiles
    assert rule(wide._replace(N=16)) == 1024  # 64 tiles
    assert rule(conv_module.conv_geometry((1, 1024, 28, 28), (1024, 1024, 3, 3), padding=1)) == 1024  # 49
    monkeypatch.setattr(winograd_kernels, "_WINOGRAD_ROWS", 16)
    assert rule(wide) == 1024  # its 32 tiles in 2 blocks
    monkeypatch.undo()
    assert rule(wide._replace(C=64, F=64)) == 64  # 0.6 MB of U
    assert rule(wide, avx512=True) == 1024
    assert rule(wide, xp=object()) == 1024  # not NumPy
    assert rule(wide._replace(C=100000)) == 8  # never thinner than 8 filters


def test_the_model_knows_which_calls_go_in_filter_blocks(monkeypatch):
    """_in_filter_blocks (what tile_cost and _pays read) counts the call's blocks of tiles as
    the passes do: 8x1024x1024 on 8x8 goes in blocks of filters in one block of 32 tiles, not
    in 2 blocks of 16 tiles (samples) or in strips of 2 tiles (one sample); and a 224 x 224
    layer's 7.2 MB of float32 U fits."""
    blocked = winograd_kernels._in_filter_blocks
    wide = conv_module.conv_geometry((8, 1024, 8, 8), (1024, 1024, 3, 3), padding=1)
    assert blocked(wide, 4, False) and not blocked(wide, 4, True)
    monkeypatch.setattr(winograd_kernels, "_WINOGRAD_ROWS", 16)
    assert not blocked(wide, 4, False)  # 2 blocks of 4 samples
    monkeypatch.setattr(winograd_kernels, "_WINOGRAD_ROWS", 2)
    assert not blocked(wide._replace(N=1), 4, False)  # one sample in 2 strips of a tile row
    monkeypatch.setattr(winograd_kernels, "_WINOGRAD_ROWS", 128)
    assert blocked(wide._replace(N=1), 4, False)
    assert not blocked(conv_module.conv_geometry((8, 224, 8, 8), (224, 224, 3, 3), padding=1), 4, False)


@pytest.mark.parametrize("avx512", [True, False], ids=["avx512", "avx2"])
def test_a_wide_layer_of_16_tiles_takes_winograd_where_its_filters_go_in_blocks(avx512, monkeypatch):
    """With AVX2 GEMMs, a call whose filters go in blocks takes Winograd from 16 tiles on
    (_MIN_BLOCKED_TILES; 32 otherwise): 4x512x512 on 7x7 (16 tiles of F(4x4)) does, at F(4x4),
    with AVX-512 GEMMs it stays on columns, and so do 2x512x512 (8 tiles) and 4x512x512 on 4x4
    (16 tiles of F(2x2) only) with either; a narrow layer of 16 tiles (4x64x64, its U 0.6 MB)
    keeps the rule of 32."""
    monkeypatch.setattr(winograd_kernels.backend, "blas_runs_avx512", lambda: avx512)
    float32 = np.dtype(np.float32)

    def geometry(N, C, H):
        return conv_module.conv_geometry((N, C, H, H), (C, C, 3, 3), padding=1)
    assert winograd_kernels.applies(geometry(4, 512, 7), float32) == (not avx512)
    if not avx512:
        assert winograd_kernels.tile(geometry(4, 512, 7)) == 4
    assert not winograd_kernels.applies(geometry(4, 512, 4), float32)  # F(2x2) only: 16 tiles, 16 MB of U
    assert not winograd_kernels.applies(geometry(2, 512, 7), float32)
    assert not winograd_kernels.applies(geometry(4, 64, 7), float32)


def test_filters_kept_transforms_each_weights_filters_once(monkeypatch):
    """Within filters_kept, forward and backward-data on chunks of samples with one weight
    array transform its filters once each (forward's U and the flipped U), bit for bit the
    results without it; another array of the same values, or the same one after the scope, is
    transformed again; nested scopes keep until the outermost ends; under a workspace limit
    nothing is kept."""
    from cfp.kernels import workspace
    made = []
    real = winograd_kernels._winograd_filters
    monkeypatch.setattr(winograd_kernels, "_winograd_filters",
                        lambda w, G2, xp, flipped, slot=None: made.append(flipped) or real(w, G2, xp, flipped, slot))
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 6, 8, 8))
    w = rng.standard_normal((5, 6, 3, 3))
    dy = rng.standard_normal((4, 5, 8, 8))
    chunks = (slice(0, 1), slice(1, 3), slice(3, 4))

    def passes():
        return ([conv2d_forward(x[s], w, padding=1) for s in chunks],
                [conv2d_backward_data(dy[s], w, x[s].shape, padding=1) for s in chunks])
    with settings.winograd(True, tile=4):
        plain = passes()
        assert made == [False] * 3 + [True] * 3
        made.clear()
        with winograd_kernels.filters_kept():
            with winograd_kernels.filters_kept():
                kept = passes()
            assert made == [False, True]
            again = conv2d_forward(x, w.copy(), padding=1)  # the same values elsewhere: transformed again
            assert made == [False, True, False]
            conv2d_forward(x, w, padding=1)
            assert made == [False, True, False]  # the inner scope's end kept them
        for a, b in zip(plain[0] + plain[1], kept[0] + kept[1]):
            assert np.array_equal(a, b)
        assert np.array_equal(again, conv2d_forward(x, w, padding=1))
        assert made == [False, True, False, False]  # after the scope: transformed again
        made.clear()
        workspace.set_limit(0)
        try:
            with winograd_kernels.filters_kept():
                passes()
        finally:
            workspace.set_limit(None)
        assert made == [False] * 3 + [True] * 3


def _dilated_3x3_cases(count=40, seed=4):
    """Dilated 3x3 stride-1 layers (dilation 2 or 3 on either axis or both), with odd and even
    sizes, symmetric, asymmetric ('same') and one-sided padding in every mode: the layers that
    go by residue-class sub-grids into Winograd."""
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        dilation = rng.choice([2, 3, (1, 2), (2, 1), (2, 3)])
        padding = rng.choice([0, 1, 2, 3, (2, 1), (0, 3), "same", "valid"])
        H, W = rng.randint(5, 13), rng.randint(5, 13)
        case = {"x": (rng.randint(1, 3), rng.randint(1, 4), H, W), "w": (rng.randint(1, 4), 0, 3, 3),
                "args": {"stride": 1, "padding": padding, "dilation": dilation, "groups": 1,
                         "padding_mode": rng.choice(PADDING_MODES)}}
        case["w"] = (case["w"][0], case["x"][1], 3, 3)
        if _valid(case):
            cases.append(case)
    return cases


@pytest.mark.parametrize("tile", [2, 4])
def test_dilated_3x3_layers_by_subgrids_match_the_loops(tile, monkeypatch):
    """Under Winograd, a dilated 3x3 stride-1 layer is cut into its residue classes (dilation d:
    every d-th row and column) and convolved undilated: all three passes equal the plain loops
    in float64, and the classes were taken (forward, backward-data's full convolution and
    backward-filter each once)."""
    taken = []
    real = winograd_kernels._to_subgrids
    monkeypatch.setattr(winograd_kernels, "_to_subgrids", lambda *a: taken.append(a[3]) or real(*a))
    for case in _dilated_3x3_cases():
        x, w, b, dy = _problem(case, seed=len(taken))
        a = case["args"]
        before = len(taken)
        with settings.winograd(True, tile=tile):
            fast = (conv2d_forward(x, w, b, **a), conv2d_backward_data(dy, w, x.shape, **a),
                    conv2d_backward_filter(x, dy, w.shape, **a))
        assert len(taken) - before == 4, case  # x forward, dy backward-data, x and dy backward-filter
        loops = (conv2d_forward_loop(x, w, b, **a), conv2d_backward_data_loop(dy, w, x.shape, **a),
                 conv2d_backward_filter_loop(x, dy, w.shape, **a))
        for actual, expected in zip(fast, loops):
            assert actual.shape == expected.shape and relative_error(actual, expected) < TOLERANCE, case


@pytest.mark.parametrize("avx512", [True, False], ids=["avx512", "avx2"])
@pytest.mark.parametrize("side,by4,by2", [(1, False, False), (2, False, True), (3, False, False), (4, True, True),
                                         (5, False, False), (6, True, True), (8, True, True), (16, True, True),
                                         (15, True, False), (9, True, False), ((5, 6), False, False)])
def test_float32_layers_take_winograd_by_default_where_it_pays(side, by4, by2, avx512, monkeypatch):
    """4 Ho Wo >= tiles * (m + 2)^2, outputs at least m wide, at least 32 tiles a call and more
    than 8 channels, at F(4x4) (by4) or, where the BLAS runs AVX2 GEMMs, at F(2x2) (by2, then
    the tile it takes): not on 1x1 to 3x3 outputs or 5x5 at F(4x4) (measured slower than
    im2col), on 4x4, 6x6 and larger; 2x2 and the layers of too few F(4x4) tiles at F(2x2) with
    AVX2; not on fewer tiles or channels (those take other paths); every size when forced."""
    monkeypatch.setattr(winograd_kernels.backend, "blas_runs_avx512", lambda: avx512)
    H, W = side if isinstance(side, tuple) else (side, side)  # 5x6: 4 tiles * 36 = 144 > 4 * 30
    g = conv_module.conv_geometry((32, 16, H, W), (8, 16, 3, 3), padding=1)
    takes = by4 or (by2 and not avx512)
    assert winograd_kernels.applies(g, np.dtype(np.float32)) == takes
    assert not winograd_kernels.applies(g, np.dtype(np.float64))
    if takes and not by4:
        assert winograd_kernels.tile(g) == 2  # the tile that pays
    wide = conv_module.conv_geometry((32, 16, 16, W), (8, 16, 3, 3), padding=1)  # the narrow side decides
    # (16x5: 288 <= 320 at F(4x4); 16x2 at F(2x2): 128 <= 128)
    assert winograd_kernels.applies(wide, np.dtype(np.float32)) == (W >= 4 or (W == 2 and not avx512))
    tiles = -(-H // 2) * -(-W // 2) if not avx512 else -(-H // 4) * -(-W // 4)
    fewer = conv_module.conv_geometry((-(-32 // tiles) - 1, 16, H, W), (8, 16, 3, 3), padding=1)
    assert not winograd_kernels.applies(fewer, np.dtype(np.float32))  # fewer than 32 tiles at either tile
    narrow = conv_module.conv_geometry((32, 8, H, W), (8, 8, 3, 3), padding=1)
    assert not winograd_kernels.applies(narrow, np.dtype(np.float32))  # 8 channels: per-sample columns
    with settings.winograd(True):
        assert winograd_kernels.applies(g, np.dtype(np.float32))
        assert winograd_kernels.applies(narrow, np.dtype(np.float32))
        assert winograd_kernels.applies(fewer, np.dtype(np.float32)) == (fewer.N > 0)


def test_dilated_layers_take_subgrids_only_where_winograd_would():
    """The sub-grids serve Winograd: float32 3x3 stride-1 ungrouped dilated layers by default;
    not float64 (im2col reads dilated windows directly), not strided, grouped or 5x5 layers."""
    g = conv_module.conv_geometry((2, 16, 17, 17), (4, 16, 3, 3), padding=2, dilation=2)  # classes 9x9 outputs
    assert winograd_kernels.subgrids_apply(g, np.dtype(np.float32))
    small = conv_module.conv_geometry((2, 16, 9, 9), (4, 16, 3, 3), padding=2, dilation=2)  # classes 5x5 outputs
    assert not winograd_kernels.subgrids_apply(small, np.dtype(np.float32))  # Winograd would not pay there
    with settings.winograd(True):
        assert winograd_kernels.subgrids_apply(small, np.dtype(np.float32))
    assert not winograd_kernels.subgrids_apply(g, np.dtype(np.float64))
    assert not winograd_kernels.subgrids_apply(g._replace(dh=1, dw=1), np.dtype(np.float32))  # undilated
    for other in ({"stride": 2}, {"groups": 2}):
        geometry = conv_module.conv_geometry((2, 16, 17, 17), (4, 16 // other.get("groups", 1), 3, 3),
                                             padding=2, dilation=2, **other)
        assert not winograd_kernels.subgrids_apply(geometry, np.dtype(np.float32)), other
    g5 = conv_module.conv_geometry((2, 16, 9, 9), (4, 16, 5, 5), padding=4, dilation=2)
    assert not winograd_kernels.subgrids_apply(g5, np.dtype(np.float32))
    s = winograd_kernels._subgrid_geometry(conv_module.conv_geometry((1, 1, 8, 7), (1, 1, 3, 3), padding=(2, 1),
                                                                dilation=(2, 3)))
    # padded 12 x 9: classes of ceil(12 / 2) = 6 rows and ceil(9 / 3) = 3 columns, 2 * 3 of them
    assert (s.N, s.H, s.W, s.Ho, s.Wo, s.dh, s.dw, s.pt + s.pb + s.pl + s.pr) == (6, 6, 3, 4, 1, 1, 1, 0)


@pytest.mark.parametrize("x_shape,w_shape,args", [
    ((1, 5, 3, 3), (9, 5, 1, 1), {}),  # one sample of a 1x1 layer: x is its own columns
    ((3, 5, 2, 2), (12, 5, 1, 1), {}),
    ((1, 3, 4, 5), (30, 3, 3, 3), {"padding": 1}),
    ((2, 2, 5, 6), (40, 2, 2, 3), {"padding": (1, 0), "stride": (2, 1), "dilation": (1, 2)}),
    ((2, 3, 4, 4), (40, 3, 3, 3), {"padding": 1, "padding_mode": "reflect"}),
    ((1, 2, 7, 7), (20, 2, 5, 5), {"padding": 1, "stride": 2}),
])
def test_filter_major_columns_match_the_loops(x_shape, w_shape, args):
    """Layers with more filters than output pixels take filter-major columns for all three
    passes, in float64 and float32, and equal the plain loops: one 1x1 sample and several,
    padding on some sides, stride, dilation, even kernels, a padding mode."""
    g = conv_module.conv_geometry(x_shape, w_shape, **args)
    if g.mode != "zeros":  # the passes pad first, then choose for the padded geometry
        g = g._replace(H=g.H + g.pt + g.pb, W=g.W + g.pl + g.pr, pt=0, pb=0, pl=0, pr=0, mode="zeros")
    for dtype in ("float64", "float32"):
        assert set(paths.taken(g, np.dtype(dtype)).values()) == {"columns"}
    case = {"x": x_shape, "w": w_shape, "args": args}
    x, w, b, dy = _problem(case, seed=5)
    fast = (conv2d_forward(x, w, b, **args), conv2d_backward_data(dy, w, x.shape, **args),
            conv2d_backward_filter(x, dy, w.shape, **args))
    loops = (conv2d_forward_loop(x, w, b, **args), conv2d_backward_data_loop(dy, w, x.shape, **args),
             conv2d_backward_filter_loop(x, dy, w.shape, **args))
    for actual, expected in zip(fast, loops):
        assert actual.shape == expected.shape and relative_error(actual, expected) < TOLERANCE


@pytest.mark.parametrize("block", [1, 2, 64], ids=["sample-blocks", "short-last-block", "one-block"])
@pytest.mark.parametrize("x_shape,w_shape,args", [
    ((3, 1, 6, 7), (4, 1, 3, 3), {"padding": 1}),  # one channel
    ((3, 3, 9, 8), (5, 3, 7, 7), {"padding": 3, "stride": 2}),  # ResNet's first layer, small
    ((3, 8, 5, 5), (6, 8, 1, 1), {}),  # 1x1: x is its own columns
    ((3, 2, 6, 5), (3, 2, 1, 1), {"stride": 2}),
    ((3, 4, 7, 8), (6, 4, 2, 3), {"padding": (1, 0), "stride": (2, 1), "dilation": (1, 2)}),
    ((3, 3, 6, 6), (4, 3, 3, 3), {"padding": 2, "dilation": 2, "padding_mode": "reflect"}),
    ((3, 3, 5, 6), (2, 3, 3, 3), {"padding": "valid"}),
])
def test_per_sample_columns_match_the_loops(block, x_shape, w_shape, args, monkeypatch):
    """Layers of one group and at most 8 channels take per-sample columns for all three passes,
    in float64 and float32, and equal the plain loops: blocks of one sample, of two of three
    (a short last one) and all three; a stride, dilation, even kernels, a padding mode."""
    g = conv_module.conv_geometry(x_shape, w_shape, **args)
    if g.mode != "zeros":  # the passes pad first, then choose for the padded geometry
        g = g._replace(H=g.H + g.pt + g.pb, W=g.W + g.pl + g.pr, pt=0, pb=0, pl=0, pr=0, mode="zeros")
    for dtype in ("float64", "float32"):
        assert set(paths.taken(g, np.dtype(dtype)).values()) == {"columns-per-sample"}
    monkeypatch.setattr(columns, "_BLOCK_VALUES", block * g.C * g.Kh * g.Kw * g.Ho * g.Wo)
    assert len(columns._blocks(g)) == -(-x_shape[0] // block)
    case = {"x": x_shape, "w": w_shape, "args": args}
    x, w, b, dy = _problem(case, seed=block)
    fast = (conv2d_forward(x, w, b, **args), conv2d_backward_data(dy, w, x.shape, **args),
            conv2d_backward_filter(x, dy, w.shape, **args))
    loops = (conv2d_forward_loop(x, w, b, **args), conv2d_backward_data_loop(dy, w, x.shape, **args),
             conv2d_backward_filter_loop(x, dy, w.shape, **args))
    for actual, expected in zip(fast, loops):
        assert actual.shape == expected.shape and relative_error(actual, expected) < TOLERANCE


@pytest.mark.parametrize("stacked", [True, False], ids=["kernel-rows-stacked", "a-GEMM-a-kernel-row"])
@pytest.mark.parametrize("samples", [1, 2, 64], ids=["sample-blocks", "short-last-block", "one-block"])
@pytest.mark.parametrize("args,x_shape,w_shape", [
    ({"padding": 1, "groups": 4}, (3, 8, 6, 5), (8, 2, 3, 3)),  # 'same': one sample a block writes y
    ({"padding": 0, "groups": 2}, (3, 8, 5, 4), (6, 4, 1, 3)),  # a 1-row kernel: nothing to stack
    ({"padding": "same", "groups": 2}, (3, 4, 5, 6), (6, 2, 2, 4)),  # even kernel, asymmetric
    ({"padding": "valid", "groups": 1}, (2, 3, 6, 7), (2, 3, 3, 2)),  # Wo < W
    ({"padding": (3, 4), "groups": 2}, (3, 4, 4, 3), (4, 2, 3, 3)),  # Wo > W: rows wider than x
    ({"padding": 2, "dilation": (1, 2), "groups": 3}, (2, 6, 5, 6), (6, 2, 3, 3)),
    ({"padding": (2, 1), "dilation": (2, 1), "groups": 1, "padding_mode": "reflect"}, (3, 2, 6, 6), (4, 2, 3, 2)),
])
def test_plane_columns_match_the_loops(stacked, samples, args, x_shape, w_shape, monkeypatch):
    """Stride-1 layers with narrow groups go by plane columns (shifted copies of a tall image of
    the block's samples; the forward's kernel rows in one GEMM or a GEMM each): every padding
    shape, dilation and block size (1, 2 of 3 samples, all) gives the loops' three passes, in
    either form of the forward, and the path is taken."""
    _set(monkeypatch, plane_stacking=stacked)
    monkeypatch.setattr(columns, "FEW_CHANNELS", 0)  # the layers of one group here would take per-sample columns
    case = {"x": x_shape, "w": w_shape, "args": {"stride": 1, "padding_mode": "zeros", "dilation": 1, **args}}
    g = conv_module.conv_geometry(x_shape, w_shape, **case["args"])
    width = g.W if g.mode == "zeros" else g.W + g.pl + g.pr  # other modes pad x first
    per_sample = g.Kw * g.C * (g.H + g.pt + g.pb) * max(width, g.Wo)  # the copies of one sample
    monkeypatch.setattr(plane, "_PLANE_ELEMENTS", samples * per_sample)
    taken = []
    real = plane._PlaneColumns
    monkeypatch.setattr(plane, "_PlaneColumns", lambda *a: taken.append(real(*a)) or taken[-1])
    x, w, b, dy = _problem(case, seed=samples)
    a = case["args"]
    with settings.winograd(False):
        fast = (conv2d_forward(x, w, b, **a), conv2d_backward_data(dy, w, x.shape, **a),
                conv2d_backward_filter(x, dy, w.shape, **a))
    assert len(taken) == 3  # forward, backward-data's forward, backward-filter
    assert taken[0].step == min(samples, x.shape[0])
    loops = (conv2d_forward_loop(x, w, b, **a), conv2d_backward_data_loop(dy, w, x.shape, **a),
             conv2d_backward_filter_loop(x, dy, w.shape, **a))
    for actual, expected in zip(fast, loops):
        assert actual.shape == expected.shape and relative_error(actual, expected) < TOLERANCE


@pytest.mark.parametrize("faster", [True, False], ids=["stacked-faster", "a-GEMM-a-kernel-row-faster"])
def test_plane_forward_takes_the_form_it_measured_faster(faster, monkeypatch):
    """By default the plane forward times its first block both ways, in turns, the first time
    it meets a geometry and dtype, keeps the faster form for it, and takes that form from then
    on, measuring no more; the result is the loops' either way."""
    _set(monkeypatch, plane_stacking=None, plane_forms={})
    timed = []

    def seconds(block, stacked, *args):  # the timed form's block runs; `faster` has the least time
        timed.append(stacked)
        block(stacked, *args)
        if stacked != faster:
            return 2.0
        return 1.0 if len(timed) <= 2 else 3.0  # (its slower second round is not what counts)

    monkeypatch.setattr(plane, "_seconds", seconds)
    gemms = []
    real_matmul = np.matmul
    monkeypatch.setattr(np, "matmul", lambda *a, **k: gemms.append(a[0].shape) or real_matmul(*a, **k))
    case = {"x": (3, 8, 6, 5), "w": (8, 2, 3, 3), "args": {"padding": 1, "groups": 4}}
    x, w, b, _ = _problem(case)
    with settings.winograd(False):
        first = conv2d_forward(x, w, b, **case["args"])
        assert timed == [True, False, True, False]  # two rounds, in turns
        gemms.clear()
        again = conv2d_forward(x, w, b, **case["args"])
    assert timed == [True, False, True, False]  # measured once
    g = conv_module.conv_geometry(x.shape, w.shape, **case["args"])
    assert settings.current().plane_forms == {(g, "float64"): faster}
    # the three samples in one block: one GEMM of Kh F/G = 6 rows, or Kh = 3 of F/G = 2
    assert gemms == ([(4, 6, 6)] if faster else [(4, 2, 6)] * 3)
    expected = conv2d_forward_loop(x, w, b, **case["args"])
    for actual in (first, again):
        assert relative_error(actual, expected) < TOLERANCE


def test_plane_forward_measures_only_what_has_two_forms(monkeypatch):
    """Nothing is timed for a one-row kernel (nothing to stack), with the form fixed by
    the setting plane_stacking, or for a geometry already measured; each new geometry or dtype is."""
    _set(monkeypatch, plane_forms={})
    timed = []
    monkeypatch.setattr(plane, "_seconds", lambda block, stacked, *args: timed.append(stacked) or 1.0)
    x = np.ones((2, 16, 6, 5))

    def forward(kernel=(3, 3), dtype=np.float64, channels=8):
        return conv2d_forward(x[:, :channels].astype(dtype), np.ones((8, channels // 4) + kernel, dtype),
                              padding=1, groups=4)
    with settings.winograd(False):
        for fixed in (True, False):
            _set(monkeypatch, plane_stacking=fixed)
            forward()
        assert timed == []
        _set(monkeypatch, plane_stacking=None)
        forward(kernel=(1, 3))
        assert timed == [] and settings.current().plane_forms == {}
        for args in ({}, {}, {"dtype": np.float32}, {"channels": 16}):
            forward(**args)
    assert len(timed) == 12 and len(settings.current().plane_forms) == 3


def test_plane_forms_tie_cupy_and_the_clock(monkeypatch):
    """Equal times keep a GEMM a kernel row (the simpler form); arrays of another module than
    NumPy (CuPy) take it unmeasured; a block's seconds are the clock's difference."""
    _set(monkeypatch, plane_stacking=None, plane_forms={})
    g = conv_module.conv_geometry((2, 16, 6, 5), (8, 4, 3, 3), padding=1, groups=4)
    assert plane._measure_plane_form(g, "float64", lambda stacked: 1.0) is False
    assert settings.current().plane_forms == {(g, "float64"): False}
    settings.current().plane_forms[(g, "float32")] = True
    assert plane._plane_form(g, "float32", np) is True
    assert plane._plane_form(g, "float32", object()) is False  # not NumPy: never measured
    clock = iter([10.0, 13.5])
    monkeypatch.setattr(plane.time, "perf_counter", lambda: next(clock))
    ran = []
    assert plane._seconds(lambda *a: ran.append(a), 1, 2) == 3.5 and ran == [(1, 2)]


def test_plane_columns_serve_narrow_stride_1_groups_only():
    """Plane columns where the pixel-row patches would copy runs shorter than _PLANE_RUN
    (Kw*C/G values), stride 1 only; wide groups, strided and depthwise layers go elsewhere."""
    def applies(x_shape, w_shape, **args):
        return plane.applies(conv_module.conv_geometry(x_shape, w_shape, **args), "float64")
    assert applies((2, 256, 8, 8), (256, 8, 3, 3), padding=1, groups=32)  # 24-value runs
    assert not applies((2, 256, 8, 8), (256, 32, 3, 3), padding=1, groups=8)  # 96-value runs
    assert applies((2, 21, 8, 8), (4, 21, 3, 3), padding=1) and not applies((2, 22, 8, 8), (4, 22, 3, 3), padding=1)
    assert applies((2, 31, 8, 8), (4, 31, 2, 2)) and not applies((2, 32, 8, 8), (4, 32, 2, 2))  # 62, 64 values
    assert not applies((2, 8, 8, 8), (8, 2, 3, 3), padding=1, groups=4, stride=2)
    assert not applies((0, 8, 8, 8), (8, 2, 3, 3), padding=1, groups=4)  # nothing to convolve


@pytest.mark.parametrize("blocks", ["one", "channels", "samples", "tiny"])
@pytest.mark.parametrize("columns", [16, 2], ids=["one-strip", "strips"])
@pytest.mark.parametrize("args,x_shape,w_shape", [
    ({"padding": 1}, (3, 4, 5, 6), (4, 1, 3, 3)),  # 'same'
    ({"padding": "same", "dilation": (2, 1)}, (3, 3, 7, 5), (3, 1, 2, 4)),  # even kernel, asymmetric
    ({"padding": "valid"}, (3, 2, 6, 7), (4, 1, 3, 2)),  # a channel multiplier, Ho < H
    ({"padding": (3, 4)}, (3, 3, 4, 3), (6, 1, 3, 3)),  # Ho > H, Wo > W: padding wider than the kernel
    ({"padding": (2, 1), "padding_mode": "circular", "dilation": 2}, (3, 2, 6, 6), (2, 1, 3, 2)),
    ({"padding": 1, "stride": 2}, (3, 4, 7, 8), (4, 1, 3, 3)),  # stride 2: m = 2 classes of rows
    ({"padding": 1, "stride": 2}, (3, 2, 6, 7), (2, 1, 3, 3)),  # the last output's right tap reads padding
    ({"padding": (0, 2), "stride": (3, 1)}, (3, 2, 8, 5), (4, 1, 2, 3)),  # sh > eh: m = 1, rows skipped
    ({"padding": (1, 0), "stride": (1, 2), "dilation": (1, 2)}, (3, 3, 5, 9), (6, 1, 3, 2)),
    ({"padding": 2, "stride": 2, "dilation": (2, 3)}, (3, 2, 9, 8), (4, 1, 3, 2)),  # dilated rows, strided
])
def test_depthwise_bands_match_the_loops(blocks, columns, args, x_shape, w_shape, monkeypatch):
    """Depthwise layers run as banded GEMMs on residue classes of rows (docs/design.md 3c):
    every padding shape and mode, stride, dilation, multiplier, strip width (one strip, or
    strips 2 output columns wide, whose edge strips hold padding) and block shape (all at
    once, blocks of channels, blocks of 2 of 3 samples, one sample and channel) gives the
    loops' three passes, and the bands are taken in each pass."""
    case = {"x": x_shape, "w": w_shape, "args": {"stride": 1, "padding_mode": "zeros", "dilation": 1,
                                                 "groups": x_shape[1], **args}}
    monkeypatch.setattr(depthwise, "_BAND_COLUMNS", columns)
    g = conv_module.conv_geometry(x_shape, w_shape, **case["args"])
    if g.mode != "zeros":
        g = conv_module.conv_geometry((g.N, g.C, g.H + g.pt + g.pb, g.W + g.pl + g.pr), w_shape,
                                      stride=(g.sh, g.sw), dilation=(g.dh, g.dw), groups=g.G)
    whole = depthwise._DepthwiseBands(g, np, np.float64)
    per_sample = whole.strips * whole.P * whole.Wi
    budget = {"one": 1 << 30, "channels": 2 * g.N * per_sample, "samples": 2 * per_sample, "tiny": 1}[blocks]
    monkeypatch.setattr(depthwise, "_BAND_ELEMENTS", budget)
    taken = []
    real = depthwise._DepthwiseBands
    monkeypatch.setattr(depthwise, "_DepthwiseBands", lambda *a: taken.append(real(*a)) or taken[-1])
    x, w, b, dy = _problem(case, seed=columns)
    a = case["args"]
    fast = (conv2d_forward(x, w, b, **a), conv2d_backward_data(dy, w, x.shape, **a),
            conv2d_backward_filter(x, dy, w.shape, **a))
    assert len(taken) == 3  # forward, backward-data (its own or the full convolution's), backward-filter
    expected_blocks = {"one": (g.N, g.C), "channels": (g.N, min(2, g.C)), "samples": (min(2, g.N), 1),
                       "tiny": (1, 1)}[blocks]  # a sample larger than the budget: one sample and channel
    assert (taken[0].n, taken[0].c) == expected_blocks
    assert taken[0].strips == -(-g.Wo // min(g.Wo, columns))
    loops = (conv2d_forward_loop(x, w, b, **a), conv2d_backward_data_loop(dy, w, x.shape, **a),
             conv2d_backward_filter_loop(x, dy, w.shape, **a))
    for actual, expected in zip(fast, loops):
        assert actual.shape == expected.shape and relative_error(actual, expected) < TOLERANCE


def test_dilated_depthwise_forward_takes_one_gemm_a_kernel_row(monkeypatch):
    """A forward whose band has rows without taps (dh > 1, Kh > 1) reads each kernel row's
    input rows (Kh GEMMs a block); every other depthwise forward takes the classes' patch rows."""
    calls = []
    for name in ("read", "patches"):
        real = getattr(depthwise._DepthwiseBands, name)
        monkeypatch.setattr(depthwise._DepthwiseBands, name,
                            lambda self, *a, _real=real, _name=name: calls.append(_name) or _real(self, *a))
    x = np.ones((2, 4, 9, 9))
    cases = ((3, (2, 1), True), (2, 2, True), (1, (2, 2), False), (3, (1, 2), False), (3, 1, False))
    for Kh, dilation, by_rows in cases:
        del calls[:]
        conv2d_forward(x, np.ones((4, 1, Kh, 3)), padding=2, dilation=dilation, groups=4)
        assert calls == (["read"] * Kh if by_rows else ["patches"] * len(calls)) and calls, (Kh, dilation)


@pytest.mark.parametrize("x_shape,padding,stride", [((1, 2, 5, 0), (0, 0, 2, 3), 1), ((2, 3, 0, 4), (2, 2, 1, 1), 2),
                                                   ((2, 3, 0, 0), (2, 2, 2, 2), 1)])
def test_depthwise_bands_of_an_input_without_rows_or_columns(x_shape, padding, stride):
    """A depthwise block with no input columns or rows (a rank of a split image holding only
    padding) reads zeros only: y is the bias, dw is zero, dx is empty."""
    C = x_shape[1]
    rng = np.random.default_rng(2)
    x, w, b = np.zeros(x_shape), rng.standard_normal((2 * C, 1, 2, 2)), rng.standard_normal(2 * C)
    args = {"padding": padding, "stride": stride, "groups": C}
    y = conv2d_forward(x, w, b, **args)
    assert y.size and np.array_equal(y, np.broadcast_to(b.reshape(1, -1, 1, 1), y.shape))
    dy = rng.standard_normal(y.shape)
    assert conv2d_backward_data(dy, w, x_shape, **args).shape == x_shape
    assert np.array_equal(conv2d_backward_filter(x, dy, w.shape, **args), np.zeros(w.shape))


def test_depthwise_backward_data_is_a_forward_only_without_a_multiplier_or_stride(monkeypatch):
    """Stride-1 depthwise backward-data without a channel multiplier is the full convolution, a
    depthwise forward of dy (GEMMs with K = eh*Wi); with a multiplier (its full convolution is
    no longer depthwise) or a stride it is the transposed banded GEMMs."""
    x = np.ones((2, 4, 6, 6))
    for F, stride, transposed in ((4, 1, False), (8, 1, True), (4, 2, True), (4, (1, 2), True)):
        w = np.ones((F, 1, 3, 3))
        g = conv_module.conv_geometry(x.shape, w.shape, stride=stride, padding=1, groups=4)
        taken = paths.choose("backward-data", g, np.dtype(np.float64)).name
        assert taken == ("depthwise" if transposed else "full-convolution"), (F, stride)
        if not transposed:  # whose forward is a depthwise one
            full = paths.full_geometry(g)[1]
            assert paths.choose("forward", full, np.dtype(np.float64)).name == "depthwise"
        y_shape = conv2d_output_shape(x.shape, w.shape, stride=stride, padding=1, groups=4)
        dx = conv2d_backward_data(np.ones(y_shape), w, x.shape, stride=stride, padding=1, groups=4)
        assert relative_error(dx, conv2d_backward_data_loop(np.ones(y_shape), w, x.shape, stride=stride, padding=1,
                                                            groups=4)) < TOLERANCE


def test_winograd_refuses_an_unknown_tile():
    with pytest.raises(ValueError, match=r"Winograd tile 3 is not one of \[2, 4\]"):
        settings.winograd(True, tile=3)