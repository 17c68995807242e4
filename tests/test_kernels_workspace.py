"""The kernels' workspace (cfp.kernels.workspace): temporaries of one kernel call in one block
kept from call to call. What must hold: no result lies in the block, so a later call cannot
change it; whatever an earlier call left in the block changes no result; the block holds what
the largest call asked for and is handed back by release(). Each path of the kernels is run
(float64 against the plain loops, Winograd forced on for its paths)."""
import numpy as np
import pytest

from cfp.kernels import conv2d_backward_data, conv2d_backward_filter, conv2d_forward, conv_geometry
from cfp.kernels import conv as conv_module
from cfp.kernels import settings
from cfp.kernels import workspace
from cfp.kernels.conv import columns, im2col, paths
from cfp.kernels.conv import winograd as winograd_kernels
from cfp.kernels.conv_reference import (conv2d_backward_data_loop, conv2d_backward_filter_loop,
                                        conv2d_forward_loop)
from test_kernels_conv import relative_error

@pytest.fixture(autouse=True)
def unlimited_workspace():
    """Each test starts from no block and no limit (a model built under a memory limit, in
    another test of the same process, sets one), and leaves none behind."""
    workspace.set_limit(None)
    workspace.release()
    yield
    workspace.set_limit(None)
    workspace.release()


# name: (x shape, w shape, arguments, Winograd on)
PATHS = {
    "winograd": ((2, 3, 8, 8), (4, 3, 3, 3), {"padding": 1}, True),
    "winograd, cropped tiles": ((2, 3, 7, 6), (4, 3, 3, 3), {"padding": 1}, True),
    "winograd, strips, padded sides": ((1, 3, 50, 46), (4, 3, 3, 3), {"padding": (0, 1)}, True),
    "dilated by sub-grids": ((2, 3, 9, 8), (4, 3, 3, 3), {"padding": 2, "dilation": 2}, True),
    "depthwise, multiplier 2": ((2, 4, 7, 9), (8, 1, 3, 3), {"padding": 1, "groups": 4}, False),
    "depthwise, strided strips": ((2, 4, 9, 40), (4, 1, 3, 3), {"stride": 2, "padding": 1, "groups": 4}, False),
    "depthwise, dilated": ((2, 4, 9, 9), (4, 1, 3, 3), {"padding": 2, "dilation": 2, "groups": 4}, False),
    "pointwise": ((2, 10, 6, 6), (3, 10, 1, 1), {}, False),
    "pointwise, one filter": ((2, 10, 6, 6), (1, 10, 1, 1), {}, False),
    "pointwise, widening": ((2, 9, 6, 6), (17, 9, 1, 1), {}, False),
    "pointwise, strided": ((2, 10, 7, 6), (3, 10, 1, 1), {"stride": (2, 3)}, False),
    "plane columns": ((2, 4, 6, 7), (4, 2, 3, 3), {"padding": 1, "groups": 2}, False),
    "filter-major columns": ((2, 3, 4, 3), (30, 3, 3, 3), {"padding": 1, "stride": (1, 2)}, False),
    "per-sample columns": ((3, 3, 7, 6), (4, 3, 3, 3), {"padding": 1, "dilation": (1, 2)}, False),
    "per-sample columns, 1x1": ((3, 2, 5, 6), (4, 2, 1, 1), {}, False),
    "im2col": ((2, 70, 5, 5), (3, 70, 3, 3), {"padding": 1}, False),
    "col2im, reflect": ((2, 70, 7, 7), (3, 70, 3, 3), {"stride": 2, "padding": 1, "padding_mode": "reflect"}, False),
}


def test_the_cases_take_every_path():
    """The cases run every path of the path table, each pass on every path that has it, as the
    table chooses (paths.choose, which the passes themselves call)."""
    taken = set()
    for x_shape, w_shape, args, on in PATHS.values():
        g = conv_geometry(x_shape, w_shape, **args)
        if g.mode != "zeros":  # the passes pad first, then choose for the padded geometry
            g = g._replace(H=g.H + g.pt + g.pb, W=g.W + g.pl + g.pr, pt=0, pb=0, pl=0, pr=0, mode="zeros")
        with settings.winograd(on):
            for pass_name in paths.PASSES:
                taken.add((paths.choose(pass_name, g, np.dtype("float64")).name, pass_name))
    expected = {(p.name, pass_name) for p in paths.PATHS for pass_name in paths.PASSES if p.run(pass_name)}
    assert taken == expected


def _problem(x_shape, w_shape, args, seed):
    rng = np.random.default_rng(seed)
    y_shape = conv_module.conv2d_output_shape(x_shape, w_shape, **args)
    return tuple(rng.standard_normal(s) for s in (x_shape, w_shape, (w_shape[0],), y_shape))


def _passes(name, seed):
    """(y, dx, dw) of path `name` by the kernels, and by the loops."""
    x_shape, w_shape, args, on = PATHS[name]
    x, w, b, dy = _problem(x_shape, w_shape, args, seed)
    with settings.winograd(on):
        fast = (conv2d_forward(x, w, b, **args), conv2d_backward_data(dy, w, x.shape, **args),
                conv2d_backward_filter(x, dy, w.shape, **args))
    loops = (conv2d_forward_loop(x, w, b, **args), conv2d_backward_data_loop(dy, w, x.shape, **args),
             conv2d_backward_filter_loop(x, dy, w.shape, **args))
    return fast, loops


def _check(name, fast, loops):
    for which, actual, expected in zip(("y", "dx", "dw"), fast, loops):
        assert relative_error(actual, expected) < 1e-12, (name, which)


def test_no_result_lies_in_the_workspace_and_later_calls_leave_them_alone():
    results = {}
    for name in PATHS:
        fast, loops = _passes(name, seed=1)
        _check(name, fast, loops)
        block = workspace._state.block
        for which, result in zip(("y", "dx", "dw"), fast):
            assert block is None or not np.shares_memory(result, block), (name, which)
        results[name] = (fast, [r.copy() for r in fast])
    for name in PATHS:  # every path again, on other values
        _passes(name, seed=2)
    for name, (fast, copies) in results.items():
        for which, result, copy in zip(("y", "dx", "dw"), fast, copies):
            assert np.array_equal(result, copy), (name, which)


@pytest.mark.parametrize("name", PATHS)
def test_what_an_earlier_call_left_in_the_workspace_changes_nothing(name):
    _passes(name, seed=3)  # each call finds a block as large as the largest call before it
    _passes(name, seed=3)  # ... so the block now holds what the largest pass of this path needs
    held = workspace.held_bytes()
    assert held > 0
    workspace._state.block.fill(0xFF)  # NaN in every float
    fast, loops = _passes(name, seed=4)
    _check(name, fast, loops)
    # the temporaries came from the block, and it did not have to grow
    assert 0 < workspace._state.used <= held == workspace.held_bytes()


def _forward(name, seed):
    x_shape, w_shape, args, on = PATHS[name]
    x, w, b, _ = _problem(x_shape, w_shape, args, seed)
    with settings.winograd(on):
        return conv2d_forward(x, w, b, **args), conv2d_forward_loop(x, w, b, **args)


def test_the_workspace_holds_what_the_largest_call_asked_for_until_release():
    workspace.release()
    assert workspace.held_bytes() == 0
    small, large = "plane columns", "im2col"
    _forward(small, seed=5)
    assert workspace.held_bytes() == 0  # the first call asks; the next one finds the block
    _forward(small, seed=5)
    small_need = workspace.held_bytes()
    assert small_need > 0 and workspace._state.used == small_need
    # a call that needs more than the block takes fresh arrays for the rest, correctly
    y, expected = _forward(large, seed=6)
    assert relative_error(y, expected) < 1e-12
    assert workspace.held_bytes() == small_need < workspace._state.needed
    _forward(small, seed=5)  # the next call makes the block as large as the largest call's need
    held = workspace.held_bytes()
    assert held == workspace._state.needed > small_need
    _forward(small, seed=5)
    assert workspace.held_bytes() == held  # a smaller call does not shrink it
    workspace.release()
    assert workspace.held_bytes() == 0 and workspace._state.block is None


def test_outside_a_kernel_call_temporaries_are_fresh_arrays():
    _passes("im2col", seed=7)
    before = workspace._state.used
    a = workspace.zeros(np, (4, 5), np.float32)
    assert a.shape == (4, 5) and a.dtype == np.float32 and not a.any()
    assert workspace._state.block is None or not np.shares_memory(a, workspace._state.block)
    assert workspace._state.used == before


_SHAPES = [(3, 5), (7,), (2, 2, 2), (1,)]


@workspace.call
def _take(dtype, inner=False):
    """Pieces of the workspace for _SHAPES (and, with inner, those of a nested call)."""
    pieces = [workspace.empty(np, s, dtype) for s in _SHAPES]
    return pieces + (_take(dtype) if inner else [])


def test_a_call_hands_out_aligned_disjoint_pieces_of_one_block():
    workspace.release()
    _take(np.float64, inner=True)  # asks: fresh arrays, and the block's size for the next call
    block = None
    for _ in range(2):
        pieces = _take(np.float64, inner=True)  # the nested call goes on where the outer one is
        block = block if block is not None else workspace._state.block
        assert workspace._state.block is block  # kept, not made again
        for piece, shape in zip(pieces, _SHAPES * 2):
            assert piece.shape == shape and piece.dtype == np.float64 and piece.flags.c_contiguous
            assert np.shares_memory(piece, block) and piece.ctypes.data % 64 == 0
        for i, a in enumerate(pieces):
            assert not any(np.shares_memory(a, b) for b in pieces[i + 1:])
    aligned = sum(-(-8 * int(np.prod(s)) // 64) * 64 for s in _SHAPES)
    assert workspace.held_bytes() == 2 * aligned
    # a block that does not start on a cache line (NumPy's allocator may give one): the pieces
    # still do
    raw = np.empty(workspace._state.block.size + 64, np.uint8)
    start = (1 - raw.ctypes.data) % 64  # raw's address + start: one byte past a line
    workspace._state.block = raw[start:start + workspace._state.block.size]
    assert workspace._state.block.ctypes.data % 64 == 1
    pieces = _take(np.float64, inner=True)
    assert all(p.ctypes.data % 64 == 0 and np.shares_memory(p, workspace._state.block) for p in pieces)


def test_each_thread_has_its_own_workspace():
    import threading
    _take(np.float32)
    _take(np.float32)
    main_block = workspace._state.block
    seen = {}

    def run():
        seen["before"] = workspace.held_bytes()
        _take(np.float32)
        seen["after one call"] = workspace.held_bytes()
        seen["pieces"] = _take(np.float32)
        seen["block"] = workspace._state.block
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen["before"] == seen["after one call"] == 0  # empty until its first call has asked
    assert seen["block"] is not main_block and workspace._state.block is main_block
    assert all(np.shares_memory(p, seen["block"]) for p in seen["pieces"])


def test_empty_pieces_and_empty_shards_need_no_block():
    """A channel shard can be empty: pieces of 0 bytes, asked for before any block exists, are
    fresh empty arrays, and the kernels on C = 0 or F = 0 still give zeros of the right shape."""
    @workspace.call
    def take_nothing():
        return workspace.zeros(np, (0, 3), np.float64)
    workspace.release()
    assert take_nothing().shape == (0, 3) and workspace.held_bytes() == 0
    for x_shape, w_shape in (((2, 0, 5, 5), (3, 0, 3, 3)), ((2, 4, 5, 5), (0, 4, 3, 3)), ((2, 0, 5, 5), (0, 0, 1, 1))):
        for on in (False, True):
            workspace.release()
            x, w, _, dy = _problem(x_shape, w_shape, {"padding": 1}, seed=8)
            with settings.winograd(on):
                results = (conv2d_forward(x, w, padding=1), conv2d_backward_data(dy, w, x_shape, padding=1),
                           conv2d_backward_filter(x, dy, w_shape, padding=1))
            expected = (conv2d_forward_loop(x, w, padding=1), conv2d_backward_data_loop(dy, w, x_shape, padding=1),
                        conv2d_backward_filter_loop(x, dy, w_shape, padding=1))
            for a, b in zip(results, expected):
                assert a.shape == b.shape and not a.any() and not b.any()


def test_a_limit_caps_the_block_and_0_keeps_none():
    for _ in range(2):
        _take(np.float64, inner=True)
    full = workspace.held_bytes()
    workspace.set_limit(full // 2)
    pieces = _take(np.float64, inner=True)  # the block shrinks to the limit at the call's start
    assert workspace.held_bytes() == full // 2 and workspace._state.needed == full
    inside = [np.shares_memory(p, workspace._state.block) for p in pieces]
    assert inside[0] and not inside[-1]  # the first pieces in the block, the last ones fresh
    workspace.set_limit(0)
    for name in ("winograd", "depthwise, multiplier 2", "im2col"):
        fast, loops = _passes(name, seed=9)
        _check(name, fast, loops)
        assert workspace.held_bytes() == 0 and workspace._state.block is None
    for bad in (-1, 2.5, True, "64"):
        with pytest.raises(ValueError, match=f"workspace limit must be a number of bytes >= 0 or None, got {bad!r}"):
            workspace.set_limit(bad)


def test_a_model_built_under_a_memory_limit_keeps_no_workspace():
    from cfp.grid import ProcessGrid
    from cfp.models import build_model
    from cfp.perfmodel import MachineProfile
    grid = ProcessGrid("sample=1")
    try:
        build_model("wide", grid, batch=4, profile=MachineProfile.load("cpu-dev"), algorithm="auto",
                    memory_limit=2 ** 40, width=8, depth=1, in_channels=1, classes=3, image=8)
        assert workspace._limit == 0
    finally:
        grid.free()


def _winograd_sizing_cases(count=30, seed=12):
    """3x3 stride-1 layers that take Winograd: odd and even sizes (cropped tiles), several
    blocks of samples, 'valid', wide and asymmetric padding, the padding modes, dilation."""
    import random
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        H, W = rng.randint(1, 13), rng.randint(1, 13)
        args = {"padding": rng.choice([0, 1, 2, (1, 0), (0, 3), "same", "valid"]),
                "dilation": rng.choice([1, 1, 1, 2, (1, 2)]),
                "padding_mode": rng.choice(["zeros", "zeros", "reflect", "circular"])}
        N = rng.choice([1, 2, 3, 40])
        x_shape, w_shape = (N, rng.randint(1, 5), H, W), (rng.randint(1, 5), 0, 3, 3)
        w_shape = (w_shape[0], x_shape[1], 3, 3)
        try:
            conv_module.conv2d_output_shape(x_shape, w_shape, **args)
        except ValueError:
            continue
        cases.append((x_shape, w_shape, args))
    return cases


@pytest.mark.parametrize("dtype,forced", [("float32", False), ("float32", True), ("float64", False),
                                          ("float64", True)],
                         ids=["float32", "float32-forced", "float64", "float64-forced"])
@pytest.mark.parametrize("rows,filter_bytes", [(128, winograd_kernels.FILTER_BLOCK_BYTES), (5, winograd_kernels.FILTER_BLOCK_BYTES),
                                               (128, 2000)],
                         ids=["blocks-of-128-tiles", "strips-of-5", "filter-blocks"])
def test_winograd_workspace_bytes_are_what_its_passes_ask_for(dtype, forced, rows, filter_bytes, monkeypatch):
    """The cost model's Winograd workspace (kernels.workspace_bytes) against the workspace each
    pass asks for, exactly, for the passes that take Winograd (seen by the tiles they make);
    the others are left out: by default the layers where Winograd does not pay (at any count of
    tiles, here) and float64, forced (winograd(True)) none. With blocks of 5 tiles, the larger images go through strips
    of tile rows; with 2000 bytes of filters' transforms at once, the calls of one block of tiles through blocks
    of filters (winograd.filter_block)."""
    monkeypatch.setattr(winograd_kernels, "_WINOGRAD_ROWS", rows)
    monkeypatch.setattr(winograd_kernels, "FILTER_BLOCK_BYTES", filter_bytes)
    monkeypatch.setattr(winograd_kernels, "_MIN_FILTER_BLOCK", 1)  # blocks of these layers' few filters
    monkeypatch.setattr(winograd_kernels, "FILTER_BLOCK_TILES", 1000)  # at any count of tiles in one block
    monkeypatch.setattr(winograd_kernels.backend, "blas_runs_avx512", lambda: False)  # (blocks with AVX2 GEMMs only)
    monkeypatch.setattr(winograd_kernels, "_MIN_TILES", 1)  # these small layers would take other paths,
    monkeypatch.setattr(columns, "FEW_CHANNELS", 0)  # and these narrow ones per-sample columns
    made = []

    class Tiles(winograd_kernels._WinogradTiles):
        def __init__(self, *args):
            made.append(1)
            super().__init__(*args)
    monkeypatch.setattr(winograd_kernels, "_WinogradTiles", Tiles)
    seen = set()
    with settings.winograd(True if forced else None):
        for x_shape, w_shape, args in _winograd_sizing_cases():
            x, w, _, dy = (a.astype(dtype) for a in _problem(x_shape, w_shape, args, seed=10))
            predicted = conv_module.workspace_bytes(x_shape, w_shape, dtype, **args)
            measured = {}
            for name, run in (("forward", lambda: conv2d_forward(x, w, **args)),
                              ("backward-data", lambda: conv2d_backward_data(dy, w, x_shape, **args)),
                              ("backward-filter", lambda: conv2d_backward_filter(x, dy, w_shape, **args))):
                workspace.release()
                made.clear()
                run()
                if made:
                    measured[name] = workspace._state.needed
            assert predicted == measured, (x_shape, w_shape, args)
            g = conv_geometry(x_shape, w_shape, **args)
            if measured:
                seen.add("dilated" if g.dh * g.dw > 1 else "cropped" if (g.Ho % 4 or g.Wo % 4) else "whole tiles")
                seen.add("blocks" if x_shape[0] == 40 else "one block")
                with settings.winograd(True):
                    m, _, th, _, strip, *_ = winograd_kernels._winograd_tile_sizes(
                        winograd_kernels._subgrid_geometry(g) if g.dh * g.dw > 1 else g)
                if strip < th:
                    seen.add("strips")
                if winograd_kernels.filter_block(g, np.dtype(dtype).itemsize, np, m + 2) < g.F:
                    seen.add("filter blocks")
            if len(measured) < 3:
                seen.add("some passes on other paths")
    expected = {"float32": {"dilated", "cropped", "whole tiles", "blocks", "one block", "some passes on other paths"},
                "float32-forced": {"dilated", "cropped", "whole tiles", "blocks", "one block"},
                "float64": {"some passes on other paths"},
                "float64-forced": {"dilated", "cropped", "whole tiles", "blocks", "one block"}}
    expected = expected[dtype + ("-forced" if forced else "")]
    if rows == 5 and "one block" in expected:
        expected = expected | {"strips"}
    if filter_bytes == 2000 and "one block" in expected:
        expected = expected | {"filter blocks"}
    assert seen == expected


def test_winograd_workspace_bytes_leave_out_other_paths():
    bytes_of = conv_module.workspace_bytes
    assert bytes_of((2, 4, 8, 8), (4, 1, 3, 3), "float32", padding=1, groups=4) == {}
    assert bytes_of((2, 4, 8, 8), (4, 4, 1, 1), "float32") == {}
    for x_shape, w_shape in (((0, 4, 8, 8), (4, 4, 3, 3)), ((2, 0, 8, 8), (4, 0, 3, 3)), ((2, 4, 8, 8), (0, 4, 3, 3))):
        assert bytes_of(x_shape, w_shape, "float32", padding=1) == {}  # an empty shard computes nothing
    # nn.Conv2d's defaults: padding 0 (6x6 outputs of 8x8, which Winograd pays on with 8 samples
    # of 4 tiles of 16 channels; not with 2 samples, nor with 8 channels), float32
    assert bytes_of((8, 16, 8, 8), (4, 16, 3, 3)) == bytes_of((8, 16, 8, 8), (4, 16, 3, 3), "float32", padding=0) != {}
    assert bytes_of((2, 16, 8, 8), (4, 16, 3, 3)) == {}
    assert bytes_of((8, 8, 8, 8), (4, 8, 3, 3)) == {}
    strided = conv_module.workspace_bytes((2, 4, 8, 8), (4, 4, 3, 3), "float32", stride=2, padding=1)
    assert strided == {}  # stride 2: im2col and col2im


def test_spread_planes_lie_an_odd_number_of_cache_lines_apart():
    """spread_planes' plane spacing, which its kernels and the Winograd workspace sums read:
    Hp*Wp values rounded up to whole 64-byte lines, one more line where that count is even."""
    size = im2col.spread_plane_size
    assert size(32, 32, 4) == 65 * 16  # 4096 bytes: 64 lines, even, so 65
    assert size(18, 18, 4) == 21 * 16  # 1296 bytes: 20.25 lines, 21
    assert size(3, 3, 8) == 3 * 8  # 72 bytes: 2 lines, even, so 3
    assert size(1, 1, 4) == 16  # 4 bytes: one line
    planes = im2col.spread_planes(np, (2, 3, 18, 18), np.float32, (1, 2, 16, 15))
    assert planes.shape == (2, 3, 18, 18) and planes.strides[1] == 21 * 64
    planes[:, :, 1:17, 2:17] = np.nan  # what the caller writes; the frame around it is zero
    frame = np.ones((18, 18), bool)
    frame[1:17, 2:17] = False
    assert not planes[:, :, frame].any()


def test_a_path_added_to_the_table_alone_is_taken_by_every_pass_and_the_workspace_count(monkeypatch):
    """A new kernel path is one entry of the path table: here one that wraps im2col's passes
    and counts its calls, for layers of 5 channels only. Forward, backward-data (also at
    stride 1, where the full convolution would otherwise take it), backward-filter and the
    workspace count the cost model reads all take it; a layer it does not apply to does not."""
    calls = []

    def counted(pass_name, run):
        return lambda *args: calls.append(pass_name) or run(*args)
    sizes = {"forward": 101, "backward-data": 102, "backward-filter": 103}
    fake = paths.KernelPath("counted-im2col", lambda g, dtype: g.C == 5,
                            forward=counted("forward", im2col.forward),
                            backward_data=counted("backward-data", im2col.col2im_backward_data),
                            backward_filter=counted("backward-filter", im2col.backward_filter),
                            workspace=lambda pass_name, g, dtype: sizes[pass_name])
    monkeypatch.setattr(paths, "PATHS", (fake,) + paths.PATHS)
    for x_shape, w_shape, args in (((2, 5, 7, 6), (3, 5, 3, 3), {"padding": 1}),
                                   ((2, 5, 9, 8), (4, 5, 3, 2), {"stride": 2, "padding": (1, 0)})):
        x, w, b, dy = _problem(x_shape, w_shape, args, seed=5)
        calls.clear()
        with settings.winograd(True):  # Winograd would take the first layer's forward
            fast = (conv2d_forward(x, w, b, **args), conv2d_backward_data(dy, w, x.shape, **args),
                    conv2d_backward_filter(x, dy, w.shape, **args))
            assert conv_module.workspace_bytes(x_shape, w_shape, "float64", **args) == sizes
        assert calls == ["forward", "backward-data", "backward-filter"]
        _check("counted-im2col", fast, (conv2d_forward_loop(x, w, b, **args),
                                        conv2d_backward_data_loop(dy, w, x.shape, **args),
                                        conv2d_backward_filter_loop(x, dy, w.shape, **args)))
    calls.clear()
    other = _problem((2, 4, 6, 6), (3, 4, 3, 3), {"padding": 1}, seed=6)
    conv2d_forward(other[0], other[1], padding=1)
    conv2d_backward_filter(other[0], other[3], (3, 4, 3, 3), padding=1)
    assert calls == [] and conv_module.workspace_bytes((2, 4, 6, 6), (3, 4, 3, 3), "float64", padding=1) == {}


def test_a_setting_the_kernels_do_not_know_is_refused():
    """The settings object takes True, False or None for its switches and 2 or 4 for the tile;
    anything else is refused before a block runs with it, naming the setting."""
    for change, message in (({"winograd": "yes"}, "kernel setting winograd='yes': expected True, False or None"),
                            ({"plane_stacking": 1}, "kernel setting plane_stacking=1: expected True, False or None"),
                            ({"winograd_tile": 3}, r"Winograd tile 3 is not one of \[2, 4\]")):
        with pytest.raises(ValueError, match=message):
            settings.configured(**change)
    before = settings.current()
    with settings.configured(winograd=False, plane_stacking=True) as chosen:
        assert settings.current() is chosen and (chosen.winograd, chosen.plane_stacking) == (False, True)
        assert chosen.plane_forms is before.plane_forms  # the measurements stay shared
    assert settings.current() is before
    # a value, not a place: changing it in place would change every thread's defaults
    import dataclasses
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.current().winograd = True


def test_lasting_buffers_are_reused_by_their_slot_until_release():
    """workspace.lasting: a slot's next request reuses its buffer (the same memory, 64-byte
    aligned), a larger one grows it, another slot has its own, release() drops them all; not
    NumPy: a fresh array."""
    a = workspace.lasting(np, (3, 5), np.float32, 0)
    assert a.ctypes.data % 64 == 0 and a.shape == (3, 5) and a.dtype == np.float32
    b = workspace.lasting(np, (15,), np.float32, 0)
    assert b.ctypes.data == a.ctypes.data
    assert workspace.lasting(np, (40,), np.float32, 0).nbytes == 160  # more than the buffer: grown
    other = workspace.lasting(np, (15,), np.float32, 1)
    assert other.ctypes.data != a.ctypes.data
    big = workspace.lasting(np, (1000,), np.float64, 0)
    assert big.nbytes == 8000 and big.ctypes.data % 64 == 0
    assert workspace.lasting(np, (1000,), np.float64, 0).ctypes.data == big.ctypes.data
    workspace.release()
    assert workspace._state.lasting == {}

    class Other:
        @staticmethod
        def empty(shape, dtype):
            return ("fresh", shape, dtype)
    assert workspace.lasting(Other, (2,), np.float32, 0) == ("fresh", (2,), np.float32)
