"""The paper's algorithms against the serial convolution of the same global tensors: y, dx, dw,
db on every grid factorization and every p_f, and the ledger against perfmodel.predict_bytes."""
import math
import re

import numpy as np
import pytest

from cfp import comm as C
from cfp.algorithms import make_conv
from cfp.grid import ProcessGrid
from cfp.kernels import (conv2d_backward_bias, conv2d_backward_data, conv2d_backward_filter,
                         conv2d_forward, conv2d_output_shape)
from cfp.perfmodel import ledger_bytes, predict_bytes
from cfp.tensor import DistTensor, Layout
from conftest import SIZE, assert_all_ranks, assert_close_all_ranks, grid_specs, raises_on_all_ranks

pytestmark = pytest.mark.mpi

SPLIT = Layout(("sample", "channel", None, None))
WHOLE = Layout(("sample", None, None, None))


def configurations():
    """(grid spec, algorithm, p_f) for every factorization of the world and every valid p_f."""
    out = []
    for spec in grid_specs():
        P_c = int(spec.split("channel=")[1])
        out += [(spec, "sample", None), (spec, "x", None), (spec, "y", None)]
        out += [(spec, "w", p_f) for p_f in range(1, P_c + 1) if P_c % p_f == 0]
    return out


CONFIGS = configurations()
# N, C, F, H, W, kernel, stride, padding: uneven C and F (3 and 10 over 4), 5x5 with stride 2,
# 1x1, and one sample (N < P_n).
SHAPES = [
    (4, 3, 10, 6, 5, 3, 1, 1),
    (2, 7, 6, 7, 7, 5, 2, 2),
    (3, 5, 7, 4, 4, 1, 1, 0),
    (1, 6, 4, 5, 6, 3, 2, 0),
]


def ids(config):
    spec, alg, p_f = config
    return f"{spec}-{alg}" + (f"-pf{p_f}" if p_f else "")


def random_problem(shape, dtype=np.float64, seed=0):
    N, Cin, F, H, W, K, stride, pad = shape
    rng = np.random.default_rng(seed)  # the same global tensors on every rank
    x = rng.standard_normal((N, Cin, H, W)).astype(dtype)
    w = rng.standard_normal((F, Cin, K, K)).astype(dtype)
    b = rng.standard_normal(F).astype(dtype)
    y_shape = conv2d_output_shape(x.shape, w.shape, stride, pad)
    dy = rng.standard_normal(y_shape).astype(dtype)
    return x, w, b, dy


def serial(x, w, b, dy, stride, pad):
    y = conv2d_forward(x, w, b, stride, pad)
    return (y, conv2d_backward_data(dy, w, x.shape, stride, pad),
            conv2d_backward_filter(x, dy, w.shape, stride, pad), conv2d_backward_bias(dy))


def run_distributed(grid, algorithm, p_f, shape, bias=True, first=False, dtype=np.float64, chunks=1):
    """Distribute the global problem, run forward and backward, and gather the results."""
    N, Cin, F, H, W, K, stride, pad = shape
    x, w, b, dy = random_problem(shape, dtype)
    conv = make_conv(algorithm, grid, Cin, F, K, filter_groups=p_f, stride=stride, padding=pad,
                     bias=bias, input_whole=first, need_dx=not first, layer="conv", chunks=chunks)
    in_layout = WHOLE if conv.input_whole else SPLIT
    out_layout = WHOLE if algorithm == "sample" else SPLIT
    ledger = C.CommLedger()
    x_local = DistTensor.from_global(x, in_layout, grid).local
    dy_local = DistTensor.from_global(dy, out_layout, grid).local
    w_shard = conv.shard_weight(w)
    b_shard = conv.shard_bias(b) if bias else None
    with C.use_ledger(ledger):
        y_local = conv.forward(x_local, w_shard, b_shard)
        dx_local, dw, db = conv.backward(dy_local)
    results = {
        "y": DistTensor(y_local, dy.shape, out_layout, grid).gather(),
        "dx": None if dx_local is None else DistTensor(dx_local, x.shape, in_layout, grid).gather(),
        "dw": conv.weight_tensor(dw).gather(),
        "db": conv.bias_tensor(db).gather() if bias else None,
        "w_shard": w_shard,
    }
    return conv, ledger, results, (x, w, b, dy)


@pytest.fixture(scope="module")
def grids():
    made = {spec: ProcessGrid(spec) for spec in grid_specs()}
    yield made
    for g in made.values():
        g.free()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "N{}C{}F{}H{}W{}K{}s{}p{}".format(*s))
@pytest.mark.parametrize("config", CONFIGS, ids=ids)
def test_matches_serial_and_predicted_bytes(grids, config, shape):
    spec, algorithm, p_f = config
    grid = grids[spec]
    N, Cin, F, H, W, K, stride, pad = shape
    conv, ledger, got, (x, w, b, dy) = run_distributed(grid, algorithm, p_f, shape)
    y, dx, dw, db = serial(x, w, b, dy, stride, pad)
    for name, expected in (("y", y), ("dx", dx), ("dw", dw), ("db", db)):
        assert_close_all_ranks(got[name], expected, 1e-10, f"{ids(config)} {name}")
    predicted = predict_bytes(algorithm, x.shape, w.shape, spec, grid.coords, stride, pad,
                              filter_groups=p_f, itemsize=8)
    measured = ledger_bytes(ledger, layer="conv")
    assert_all_ranks(measured == predicted, f"{ids(config)}: ledger {measured} != predicted {predicted}")


# 6 samples: every sample block of a grid of up to 4 ranks holds at least 1 and 2 chunks fit
# wherever it holds 2 or more (the test asks for no more chunks than the smallest block holds,
# and one, the blocking pass, where 6 or 8 sample ranks leave a block empty: make test-scale)
CHUNKED = (6, 5, 7, 6, 5, 3, 1, 1)


def check_chunked(grid, config, shape, first, k):
    """A layer of `shape` in k chunks against the serial numbers and, in all, the bytes of the
    one-chunk pass; returns the layer and its ledger."""
    spec, algorithm, p_f = config
    conv, ledger, got, (x, w, b, dy) = run_distributed(grid, algorithm, p_f, shape, first=first, chunks=k)
    y, dx, dw, db = serial(x, w, b, dy, shape[6], shape[7])
    for name, expected in (("y", y), ("dx", None if first else dx), ("dw", dw), ("db", db)):
        if expected is None:
            assert_all_ranks(got[name] is None, f"{ids(config)} {name}: expected none")
        else:
            assert_close_all_ranks(got[name], expected, 1e-10, f"{ids(config)} chunks={k} {name}")
    predicted = predict_bytes(algorithm, x.shape, w.shape, spec, grid.coords, shape[6], shape[7], filter_groups=p_f,
                              input_whole=first, need_dx=not first, itemsize=8)
    measured = ledger_bytes(ledger, layer="conv")
    assert_all_ranks(measured == predicted, f"{ids(config)} chunks={k}: ledger {measured} != predicted {predicted}")
    return conv, ledger


@pytest.mark.parametrize("chunks", [2, 3])
@pytest.mark.parametrize("first", [False, True], ids=["inner", "first"])
@pytest.mark.parametrize("config", [c for c in CONFIGS if c[1] != "sample"], ids=ids)
def test_pipelined_chunks_match_serial_and_predicted_bytes(grids, config, first, chunks):
    """chunks=k: the block's samples in k chunks, each chunk's collectives non-blocking while
    the next computes: the serial numbers and, in all, the bytes of the one-chunk pass."""
    grid = grids[config[0]]
    k = max(1, min(chunks, CHUNKED[0] // grid.axis_size("sample")))
    _, ledger = check_chunked(grid, config, CHUNKED, first, k)
    calls = sum(1 for r in ledger.records if r.layer == "conv" and r.phase != "gradient-sync")
    if P_c_of(grid) > 1 and k > 1:  # one call per chunk and message: the pass was pipelined
        assert_all_ranks(calls % k == 0 and (first or calls >= k), f"{ids(config)}: {calls} layer calls for {k} chunks")


@pytest.mark.parametrize("config", [c for c in CONFIGS if c[1] != "sample"], ids=ids)
def test_chunks_under_winograd_transform_the_filters_once_a_pass(grids, config, monkeypatch):
    """Under Winograd (forced, float64: exact to rounding), a layer in 2 chunks of samples
    transforms its weight shard's filters as often as in one chunk (kernels filters_kept:
    once a pass and orientation, not once a chunk), with the serial numbers and the bytes."""
    from cfp.kernels import settings
    from cfp.kernels.conv import winograd
    made = []
    real = winograd._winograd_filters
    monkeypatch.setattr(winograd, "_winograd_filters", lambda *a, **k: made.append(1) or real(*a, **k))
    grid = grids[config[0]]
    k = max(1, min(2, CHUNKED[0] // grid.axis_size("sample")))
    with settings.winograd(True, tile=4):
        check_chunked(grid, config, CHUNKED, False, 1)
        once = len(made)
        made.clear()
        check_chunked(grid, config, CHUNKED, False, k)
    assert_all_ranks(once > 0 and len(made) == once, f"{ids(config)}: {len(made)} transforms in {k} chunks, "
                                                     f"{once} in one")


def P_c_of(grid):
    return grid.axis_size("channel")


# one sample per rank (N = P_n), 9 channels and 11 filters: at least 2 of each per rank of up to
# 4 channel ranks, uneven blocks
FEATURED = (None, 9, 11, 6, 5, 3, 1, 1)


@pytest.mark.parametrize("extra", [0, 1], ids=["one-a-rank", "one-more"])
@pytest.mark.parametrize("chunks", [2, 3])
@pytest.mark.parametrize("first", [False, True], ids=["inner", "first"])
@pytest.mark.parametrize("config", [c for c in CONFIGS if c[1] != "sample"], ids=ids)
def test_feature_chunks_match_serial_and_predicted_bytes(grids, config, first, chunks, extra):
    """chunks=k on a block of fewer samples than chunks (one sample a rank): the pass cut into
    k chunks of the features its collective moves (filters of x, channels of y, both of w),
    each chunk's collective non-blocking while the next computes: the serial numbers, the
    bytes of the one-chunk pass, and one call per chunk and message. With one sample more
    than ranks along the sample axis, the rank holding two goes by samples at 2 chunks while
    the others go by features."""
    grid = grids[config[0]]
    # (more channels and filters where more than 4 channel ranks would leave a block fewer than 2)
    C, F = max(FEATURED[1], 2 * P_c_of(grid) + 1), max(FEATURED[2], 2 * P_c_of(grid) + 3)
    shape = (grid.axis_size("sample") + extra, C, F) + FEATURED[3:]
    k = min(chunks, min(shape[1], shape[2]) // P_c_of(grid))
    conv, ledger = check_chunked(grid, config, shape, first, k)
    if P_c_of(grid) > 1 and k > 1 and conv.feature_chunk_limit() and not extra:  # started, one a chunk (not y first)
        started = sum(1 for r in ledger.records if r.layer == "conv" and r.phase != "gradient-sync"
                      and r.started is not None)
        assert_all_ranks(started % k == 0 and started >= k, f"{ids(config)}: {started} started calls for {k} chunks")


def test_chunks_more_than_the_samples_and_features_held_refused(grids):
    """One sample per rank and chunks=2 where a rank's block holds one channel: one message on
    every rank, before any message moves."""
    grid = grids[grid_specs()[-1]]
    P_c = P_c_of(grid)
    conv = make_conv("w", grid, P_c, 4 * P_c, 3, padding=1, layer="conv", chunks=2)
    x_local = DistTensor.from_global(np.zeros((grid.axis_size("sample"), P_c, 5, 5)), SPLIT, grid).local
    w, b = conv.shard_weight(np.zeros((4 * P_c, P_c, 3, 3))), conv.shard_bias(np.zeros(4 * P_c))
    raises_on_all_ranks(ValueError, lambda: conv.forward(x_local, w, b),
                        re.escape("conv: chunks=2 is more than the 1 sample(s) this rank's block holds and the 1 "
                                  "channel(s) or filter(s) of the smallest block"))


@pytest.mark.parametrize("config", CONFIGS, ids=ids)
def test_first_layer_with_whole_input_and_no_bias(grids, config):
    spec, algorithm, p_f = config
    grid = grids[spec]
    shape = (3, 3, 6, 5, 5, 3, 1, 1)
    conv, ledger, got, (x, w, b, dy) = run_distributed(grid, algorithm, p_f, shape, bias=False,
                                                       first=True)
    y, dx, dw, _ = serial(x, w, None, dy, 1, 1)
    assert_close_all_ranks(got["y"], y, 1e-10, "y")
    assert_close_all_ranks(got["dw"], dw, 1e-10, "dw")
    assert got["dx"] is None  # the first layer computes no dx
    predicted = predict_bytes(algorithm, x.shape, w.shape, spec, grid.coords, 1, 1, filter_groups=p_f,
                              bias=False, input_whole=True, need_dx=False)
    assert_all_ranks(ledger_bytes(ledger, "conv") == predicted, "bytes of a first layer")
    assert ledger_bytes(ledger, "conv")["forward"][1] == 0 or algorithm in ("x", "w")


@pytest.mark.parametrize("config", CONFIGS, ids=ids)
def test_float32_keeps_its_dtype(grids, config):
    spec, algorithm, p_f = config
    shape = (2, 4, 5, 5, 4, 3, 1, 1)
    conv, _, got, (x, w, b, dy) = run_distributed(grids[spec], algorithm, p_f, shape, dtype=np.float32)
    y, dx, dw, db = serial(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64),
                           dy.astype(np.float64), 1, 1)
    assert got["y"].dtype == got["dw"].dtype == np.float32
    for name, expected in (("y", y), ("dx", dx), ("dw", dw), ("db", db)):
        assert_close_all_ranks(got[name], expected, 1e-4, f"float32 {name}")


@pytest.mark.parametrize("config", [c for c in CONFIGS if c[1] != "sample"], ids=ids)
def test_weight_memory_is_one_shard(grids, config):
    spec, algorithm, p_f = config
    grid = grids[spec]
    P_c = grid.axis_size("channel")
    for Cin, F in ((8, 12), (3, 10)):
        conv = make_conv(algorithm, grid, Cin, F, 3, filter_groups=p_f)
        w = np.zeros((F, Cin, 3, 3))
        shard = conv.shard_weight(w)
        # The shards of the channel ranks tile w: together exactly |w|, each about |w| / P_c.
        total = conv.channel_comm.allreduce(shard.nbytes)
        assert total == w.nbytes
        bound = P_c * math.ceil(Cin / P_c) * math.ceil(F / P_c) * 9 * 8
        assert shard.nbytes <= bound
        if Cin % P_c == 0 and F % P_c == 0:
            assert shard.nbytes == w.nbytes // P_c


def test_gradient_allreduce_is_one_pc_th_of_data_parallel(grids):
    """Same grid, same layer: the segmented allreduce moves 1/P_c of the bytes that the
    data-parallel allreduce of the whole w moves over the same sample ranks."""
    checked = 0
    for spec, grid in grids.items():
        P_n, P_c = grid.axis_size("sample"), grid.axis_size("channel")
        if P_n < 2:
            continue
        # F a multiple of P_c * P_n: every shard's count (weights and bias) divides into the P_n
        # balanced blocks of the allreduce, so the ratio is exact (sample=3,channel=2 at 6 ranks
        # had 584 values a replica, whose blocks of 195 and 194 broke it)
        shape = (P_n * 2, 4 * P_c, 4 * P_c * P_n, 4, 4, 3, 1, 1)
        volume = {}
        for algorithm in ("sample", "x", "y", "w"):
            _, ledger, _, _ = run_distributed(grid, algorithm, None, shape)
            volume[algorithm] = ledger_bytes(ledger, "conv")["gradient-sync"][0]
        for algorithm in ("x", "y", "w"):
            assert volume[algorithm] * P_c == volume["sample"], (spec, volume)
        checked += 1
    if checked == 0:
        pytest.skip(f"no grid over {SIZE} rank(s) has two or more sample ranks")


def test_bad_input(grids):
    grid = grids[grid_specs()[-1]]  # the grid with the most channel ranks
    P_c = grid.axis_size("channel")
    bad_pf = P_c + 1
    raises_on_all_ranks(ValueError, lambda: make_conv("w", grid, 4, 4, 3, filter_groups=bad_pf),
                        match=f"filter groups p_f={bad_pf} does not divide the channel grid size P_c={P_c}")
    raises_on_all_ranks(ValueError, lambda: make_conv("z", grid, 4, 4, 3), match="unknown algorithm 'z'")
    raises_on_all_ranks(ValueError, lambda: make_conv("x", grid, 4, 4, 3, filter_groups=2),
                        match="applies to algorithm 'w' only")
    raises_on_all_ranks(ValueError, lambda: make_conv("y", grid, 0, 4, 3), match="in_channels must be")
    conv = make_conv("y", grid, 4, 4, 3)
    w = conv.shard_weight(np.zeros((4, 4, 3, 3)))
    x = np.zeros((1, 99, 5, 5))
    raises_on_all_ranks(ValueError, lambda: conv.forward(x, w, conv.shard_bias(np.zeros(4))),
                        match=r"x block has shape \(1, 99, 5, 5\)")
