"""nn.Conv2d's options on every algorithm and grid: dilation, 'same' with even kernels, pairs,
the padding modes, groups (uneven and fewer than the channel ranks), depthwise with a channel
multiplier and an empty batch, against the serial kernels of the same global tensors (float64),
with the ledger equal to perfmodel.predict_bytes."""
import numpy as np
import pytest

from cfp import comm as C
from cfp.algorithms import make_conv
from cfp.grid import ProcessGrid
from cfp.kernels import (conv2d_backward_bias, conv2d_backward_data, conv2d_backward_filter,
                         conv2d_forward, conv2d_output_shape)
from cfp.perfmodel import ledger_bytes, predict_bytes
from cfp.tensor import DistTensor
from conftest import assert_all_ranks, assert_close_all_ranks, grid_specs
from test_algorithms import CONFIGS, ids

pytestmark = pytest.mark.mpi

# (N, C, F, H, W, K, options)
CASES = {
    "dilation": (3, 5, 7, 7, 6, 3, {"dilation": 2, "padding": 2}),
    "same-even-reflect": (3, 5, 6, 6, 5, 4, {"padding": "same", "padding_mode": "reflect"}),
    "pairs-replicate": (2, 4, 5, 7, 6, 3, {"stride": (2, 1), "padding": (1, 0), "dilation": (1, 2),
                                           "padding_mode": "replicate"}),
    "circular": (3, 3, 10, 5, 5, 3, {"padding": 1, "padding_mode": "circular"}),
    "groups2": (3, 6, 10, 5, 5, 3, {"groups": 2, "padding": 1}),
    "groups3-strided": (2, 9, 6, 7, 7, 3, {"groups": 3, "stride": 2, "dilation": 2, "padding": 2,
                                           "padding_mode": "circular"}),
    "groups4": (3, 8, 4, 4, 5, 1, {"groups": 4}),
    "depthwise-multiplier": (3, 6, 12, 6, 6, 3, {"groups": 6, "padding": "same", "padding_mode": "reflect"}),
    "empty-batch": (0, 4, 6, 5, 5, 3, {"padding": 1, "groups": 2}),
}


@pytest.fixture(scope="module")
def grids():
    made = {spec: ProcessGrid(spec) for spec in grid_specs()}
    yield made
    for g in made.values():
        g.free()


def problem(case, seed=0):
    N, Cin, F, H, W, K, opts = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, Cin, H, W))
    w = rng.standard_normal((F, Cin // opts.get("groups", 1), K, K))
    b = rng.standard_normal(F)
    dy = rng.standard_normal(conv2d_output_shape(x.shape, w.shape, **opts))
    return x, w, b, dy


def check_against_serial(grid, config, case, name, **conv_kwargs):
    """Run `case` (N, C, F, H, W, K, options) under config (spec, algorithm, p_f) on `grid`,
    forward and backward from the global tensors, and check y, dx, dw, db against the serial
    kernels (float64, 1e-10) and the ledger against predict_bytes. conv_kwargs: more of
    make_conv's keywords. Returns the ledger's bytes."""
    spec, algorithm, p_f = config
    N, Cin, F, H, W, K, opts = case
    x, w, b, dy = problem(case)
    conv = make_conv(algorithm, grid, Cin, F, K, filter_groups=p_f, layer="conv", **opts, **conv_kwargs)
    x_local = DistTensor.from_global(x, conv.input_layout, grid).local
    dy_local = DistTensor.from_global(dy, conv.output_layout, grid).local
    ledger = C.CommLedger()
    with C.use_ledger(ledger):
        y_local = conv.forward(x_local, conv.shard_weight(w), conv.shard_bias(b))
        dx_local, dw, db = conv.backward(dy_local)
    got = {"y": DistTensor(y_local, dy.shape, conv.output_layout, grid).gather(),
           "dx": DistTensor(dx_local, x.shape, conv.input_layout, grid).gather(),
           "dw": conv.weight_tensor(dw).gather(), "db": conv.bias_tensor(db).gather()}
    expected = {"y": conv2d_forward(x, w, b, **opts), "dx": conv2d_backward_data(dy, w, x.shape, **opts),
                "dw": conv2d_backward_filter(x, dy, w.shape, **opts), "db": conv2d_backward_bias(dy)}
    for key in expected:
        assert_all_ranks(got[key].shape == expected[key].shape, f"{name} {ids(config)} {key} shape")
        if expected[key].size and np.abs(expected[key]).max() > 0:
            assert_close_all_ranks(got[key], expected[key], 1e-10, f"{name} {ids(config)} {key}")
        else:
            assert_all_ranks(not np.abs(got[key]).max(initial=0.0), f"{name} {ids(config)} {key} zero")
    predicted = predict_bytes(algorithm, x.shape, w.shape, spec, grid.coords, filter_groups=p_f, itemsize=8,
                              **opts)
    measured = ledger_bytes(ledger, layer="conv")
    assert_all_ranks(measured == predicted, f"{name} {ids(config)}: ledger {measured} != predicted {predicted}")
    return measured


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("config", CONFIGS, ids=ids)
def test_options_match_serial_and_predicted_bytes(grids, config, name):
    spec, algorithm, p_f = config
    opts = CASES[name][-1]
    measured = check_against_serial(grids[spec], config, CASES[name], name)
    if opts.get("groups", 1) > 1 and algorithm != "sample":  # whole groups per rank: nothing else moves
        assert_all_ranks(all(v == (0, 0) for k, v in measured.items() if k != "gradient-sync"),
                         f"{name} {ids(config)}: a grouped layer moved activations: {measured}")
