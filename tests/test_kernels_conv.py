"""Serial checks of the local convolution kernels: loop reference, finite differences, torch.

Float64 results must match the plain-loop twin in cfp.kernels.conv_reference to 1e-12.
"""
import random

import numpy as np
import pytest

from cfp.kernels import conv as conv_module
from cfp.kernels.conv import im2col
from cfp.kernels import (
    conv2d_backward_bias,
    conv2d_backward_data,
    conv2d_backward_filter,
    conv2d_flops,
    conv2d_forward,
    conv2d_output_shape,
)
from cfp.kernels.conv_reference import (
    conv2d_backward_bias_loop,
    conv2d_backward_data_loop,
    conv2d_backward_filter_loop,
    conv2d_forward_loop,
)

TOLERANCE_FLOAT64 = 1e-12


def relative_error(actual, expected):
    """max |actual - expected| / max |expected| (an all-zero `expected` divides by `tiny`)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(float(np.abs(expected).max(initial=0.0)), np.finfo(np.float64).tiny)
    return float(np.abs(actual - expected).max(initial=0.0)) / scale


def numerical_gradient(array, loss_of_array, step=1e-6):
    """Central differences of the scalar loss_of_array() in each entry of `array` (changed in
    place and restored)."""
    grad = np.zeros_like(array)
    for index in np.ndindex(array.shape):
        saved = array[index]
        array[index] = saved + step
        plus = loss_of_array()
        array[index] = saved - step
        minus = loss_of_array()
        array[index] = saved
        grad[index] = (plus - minus) / (2 * step)
    return grad


def _pick(rng, values, pair_probability=0.2):
    """One of `values`, or now and then a pair of them (different per dimension)."""
    if rng.random() < pair_probability:
        return (rng.choice(values), rng.choice(values))
    return rng.choice(values)


def _as_pair(value):
    return value if isinstance(value, tuple) else (value, value)


def _make_cases(count=96, seed=2019):
    """Random small convolutions (N 1..3, C and F 1..5, H and W 1..9, kernel 1/3/5, stride 1/2,
    padding 0/1/2), skipping kernels larger than the padded input. Seeded: the same every run."""
    rng = random.Random(seed)
    cases = []
    while len(cases) < count:
        N, C, F = rng.randint(1, 3), rng.randint(1, 5), rng.randint(1, 5)
        H, W = rng.randint(1, 9), rng.randint(1, 9)
        Kh, Kw = _as_pair(_pick(rng, (1, 3, 5)))
        stride, padding = _pick(rng, (1, 2)), _pick(rng, (0, 1, 2))
        (ph, pw) = _as_pair(padding)
        if Kh > H + 2 * ph or Kw > W + 2 * pw:
            continue
        cases.append(((N, C, H, W), (F, C, Kh, Kw), stride, padding))
    return cases


CASES = _make_cases()


def _case_id(case):
    x_shape, w_shape, stride, padding = case
    return "x{}-w{}-s{}-p{}".format(
        "x".join(map(str, x_shape)), "x".join(map(str, w_shape)), stride, padding
    ).replace(" ", "")


def _random_problem(case, seed=0, dtype=np.float64):
    """x, w, b and dy of the right shapes for `case`, standard normal."""
    x_shape, w_shape, stride, padding = case
    rng = np.random.default_rng(seed)
    y_shape = conv2d_output_shape(x_shape, w_shape, stride, padding)
    x, w, dy = (rng.standard_normal(s).astype(dtype) for s in (x_shape, w_shape, y_shape))
    b = rng.standard_normal(w_shape[0]).astype(dtype)
    return x, w, b, dy


def test_cases_cover_every_value():
    """The seeded case list exercises each size, kernel, stride and padding value at least once."""
    seen = {key: set() for key in ("N", "C", "F", "H", "W", "K", "stride", "padding")}
    for (N, C, H, W), (F, _, Kh, Kw), stride, padding in CASES:
        for key, values in (("N", [N]), ("C", [C]), ("F", [F]), ("H", [H]), ("W", [W]),
                            ("K", [Kh, Kw]), ("stride", _as_pair(stride)),
                            ("padding", _as_pair(padding))):
            seen[key].update(values)
    assert seen["N"] == {1, 2, 3}
    assert seen["C"] == seen["F"] == set(range(1, 6))
    assert seen["H"] == seen["W"] == set(range(1, 10))
    assert seen["K"] == {1, 3, 5}
    assert seen["stride"] == {1, 2}
    assert seen["padding"] == {0, 1, 2}


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_forward_matches_loop(case):
    x, w, b, _ = _random_problem(case)
    _, _, stride, padding = case
    expected = conv2d_forward_loop(x, w, b, stride, padding)
    assert relative_error(conv2d_forward(x, w, b, stride, padding), expected) < TOLERANCE_FLOAT64


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_backward_data_matches_loop(case):
    x, w, _, dy = _random_problem(case)
    _, _, stride, padding = case
    expected = conv2d_backward_data_loop(dy, w, x.shape, stride, padding)
    actual = conv2d_backward_data(dy, w, x.shape, stride, padding)
    assert relative_error(actual, expected) < TOLERANCE_FLOAT64


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_backward_filter_matches_loop(case):
    x, w, _, dy = _random_problem(case)
    _, _, stride, padding = case
    expected = conv2d_backward_filter_loop(x, dy, w.shape, stride, padding)
    actual = conv2d_backward_filter(x, dy, w.shape, stride, padding)
    assert relative_error(actual, expected) < TOLERANCE_FLOAT64


@pytest.mark.parametrize("case", CASES[:12], ids=_case_id)
def test_backward_bias_matches_loop(case):
    *_, dy = _random_problem(case)
    expected = conv2d_backward_bias_loop(dy)
    assert relative_error(conv2d_backward_bias(dy), expected) < TOLERANCE_FLOAT64


@pytest.mark.parametrize("samples_per_block", [1, 2])
@pytest.mark.parametrize(
    "case",
    [((5, 3, 6, 7), (4, 3, 3, 3), 1, 1), ((5, 3, 6, 7), (4, 3, 3, 1), 2, (0, 1)),
     ((5, 3, 6, 7), (4, 3, 1, 1), 1, 0)],
    ids=_case_id,
)
def test_sample_blocks_with_a_short_last_block(monkeypatch, case, samples_per_block):
    """Several blocks of samples (the last one shorter) give the same result as one block."""
    x, w, b, dy = _random_problem(case)
    _, _, stride, padding = case
    g = conv_module.conv_geometry(x.shape, w.shape, stride, padding)
    monkeypatch.setattr(
        im2col, "_BLOCK_ELEMENTS", samples_per_block * g.C * g.Kh * g.Kw * g.Ho * g.Wo
    )
    assert im2col._samples_per_block(g) == samples_per_block
    checks = [
        (conv2d_forward(x, w, b, stride, padding), conv2d_forward_loop(x, w, b, stride, padding)),
        (conv2d_backward_data(dy, w, x.shape, stride, padding),
         conv2d_backward_data_loop(dy, w, x.shape, stride, padding)),
        (conv2d_backward_filter(x, dy, w.shape, stride, padding),
         conv2d_backward_filter_loop(x, dy, w.shape, stride, padding)),
    ]
    for actual, expected in checks:
        assert relative_error(actual, expected) < TOLERANCE_FLOAT64


def test_non_contiguous_inputs():
    """Views (sliced, transposed) give the same results as their contiguous copies."""
    case = ((2, 3, 7, 6), (4, 3, 3, 3), 2, 1)
    x, w, b, dy = _random_problem(case)
    x_view = np.ascontiguousarray(x.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    w_view = np.concatenate([w, w], axis=0)[::2]
    w_view[...] = w
    dy_view = np.concatenate([dy, dy], axis=3)[:, :, :, ::2]
    dy_view[...] = dy
    assert not (x_view.flags.c_contiguous or w_view.flags.c_contiguous
                or dy_view.flags.c_contiguous)
    np.testing.assert_array_equal(conv2d_forward(x_view, w_view, b, 2, 1),
                                  conv2d_forward(x, w, b, 2, 1))
    np.testing.assert_array_equal(conv2d_backward_data(dy_view, w_view, x.shape, 2, 1),
                                  conv2d_backward_data(dy, w, x.shape, 2, 1))
    np.testing.assert_array_equal(conv2d_backward_filter(x_view, dy_view, w.shape, 2, 1),
                                  conv2d_backward_filter(x, dy, w.shape, 2, 1))


@pytest.mark.parametrize(
    "case",
    [((2, 3, 5, 6), (2, 3, 3, 3), 2, 1), ((1, 2, 6, 5), (3, 2, 3, 5), 1, (2, 1)),
     ((2, 2, 4, 4), (2, 2, 1, 1), 1, 0)],
    ids=_case_id,
)
def test_gradients_match_central_differences(case):
    """dx, dw, db of the scalar loss sum(y * g), against central differences in float64.

    The loss is linear in each argument, so central differences are exact up to rounding:
    the tolerance only has to cover the rounding of the loss divided by the step.
    """
    x, w, b, g = _random_problem(case, seed=1)
    _, _, stride, padding = case

    def loss(x, w, b):
        return float(np.sum(conv2d_forward(x, w, b, stride, padding) * g))

    numerical_dx = numerical_gradient(x, lambda: loss(x, w, b))
    numerical_dw = numerical_gradient(w, lambda: loss(x, w, b))
    numerical_db = numerical_gradient(b, lambda: loss(x, w, b))
    dx = conv2d_backward_data(g, w, x.shape, stride, padding)
    dw = conv2d_backward_filter(x, g, w.shape, stride, padding)
    assert relative_error(dx, numerical_dx) < 1e-7
    assert relative_error(dw, numerical_dw) < 1e-7
    assert relative_error(conv2d_backward_bias(g), numerical_db) < 1e-7


@pytest.mark.parametrize(
    "case",
    [((2, 16, 12, 12), (8, 16, 3, 3), 1, 1), ((3, 8, 11, 9), (6, 8, 5, 3), 2, (2, 1)),
     ((2, 32, 6, 6), (16, 32, 1, 1), 1, 0)],
    ids=_case_id,
)
def test_float32_close_to_float64(case):
    """float32 in, float32 out, within float32 rounding of the float64 result."""
    x, w, b, dy = _random_problem(case)
    _, _, stride, padding = case
    single = [a.astype(np.float32) for a in (x, w, b, dy)]
    pairs = [
        (conv2d_forward(*single[:3], stride, padding), conv2d_forward(x, w, b, stride, padding)),
        (conv2d_backward_data(single[3], single[1], x.shape, stride, padding),
         conv2d_backward_data(dy, w, x.shape, stride, padding)),
        (conv2d_backward_filter(single[0], single[3], w.shape, stride, padding),
         conv2d_backward_filter(x, dy, w.shape, stride, padding)),
        (conv2d_backward_bias(single[3]), conv2d_backward_bias(dy)),
    ]
    for result32, result64 in pairs:
        assert result32.dtype == np.float32
        assert relative_error(result32.astype(np.float64), result64) < 1e-5


@pytest.mark.parametrize("empty", ["N", "C", "F"])
@pytest.mark.parametrize("kernel, stride, padding", [(3, 1, 1), (3, 2, 0), (1, 1, 0)])
def test_empty_blocks(empty, kernel, stride, padding):
    """Empty sample, channel or filter shards give correctly shaped (zero) results."""
    sizes = {"N": 2, "C": 3, "F": 4}
    sizes[empty] = 0
    N, C, F = sizes["N"], sizes["C"], sizes["F"]
    case = ((N, C, 5, 6), (F, C, kernel, kernel), stride, padding)
    x, w, b, dy = _random_problem(case)
    Ho, Wo = conv2d_output_shape(x.shape, w.shape, stride, padding)[2:]

    y = conv2d_forward(x, w, b, stride, padding)
    dx = conv2d_backward_data(dy, w, x.shape, stride, padding)
    dw = conv2d_backward_filter(x, dy, w.shape, stride, padding)
    db = conv2d_backward_bias(dy)
    assert (y.shape, dx.shape, dw.shape, db.shape) == ((N, F, Ho, Wo), x.shape, w.shape, (F,))
    if empty == "C":  # no input channels: the output is the bias alone
        np.testing.assert_array_equal(y, np.broadcast_to(b[:, None, None], y.shape))
    if empty == "F":  # no filters: nothing flows back to x
        np.testing.assert_array_equal(dx, np.zeros(x.shape))
    if empty == "N":  # no samples: no gradient
        np.testing.assert_array_equal(dw, np.zeros(w.shape))
        np.testing.assert_array_equal(db, np.zeros(F))
    checks = [
        (y, conv2d_forward_loop(x, w, b, stride, padding)),
        (dx, conv2d_backward_data_loop(dy, w, x.shape, stride, padding)),
        (dw, conv2d_backward_filter_loop(x, dy, w.shape, stride, padding)),
        (db, conv2d_backward_bias_loop(dy)),
    ]
    for actual, expected in checks:
        assert relative_error(actual, expected) < TOLERANCE_FLOAT64


def test_output_shape_and_flops():
    assert conv2d_output_shape((2, 3, 9, 8), (4, 3, 3, 5), stride=(2, 1), padding=(1, 2)) == (
        2, 4, 5, 8)
    assert conv2d_output_shape((1, 1, 4, 4), (1, 1, 1, 1), stride=3) == (1, 1, 2, 2)
    assert conv2d_flops((2, 3, 9, 8), (4, 3, 3, 5), (2, 1), (1, 2)) == 2 * 2 * 3 * 4 * 5 * 8 * 3 * 5


X = np.zeros((2, 3, 5, 5))
W = np.zeros((8, 3, 3, 3))
DY = np.zeros((2, 8, 3, 3))  # the output of X and W with stride 1, no padding


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: conv2d_forward(np.zeros((3, 5, 5)), W), r"x must be a 4-D array .*\(3, 5, 5\)"),
        (lambda: conv2d_forward(X, np.zeros((8, 3, 3))), r"w must be a 4-D array .*\(8, 3, 3\)"),
        (lambda: conv2d_forward(np.zeros((2, 3, 5, 5)), np.zeros((8, 4, 3, 3))),
         r"x has C=3 channels but w expects 4 \(w.shape=\(8, 4, 3, 3\)\)"),
        (lambda: conv2d_forward(X, np.zeros((8, 3, 7, 3))), r"kernel 7x3 .* padded input 5x5"),
        (lambda: conv2d_forward(X, np.zeros((8, 3, 7, 7)), padding=(1, 0)),
         r"kernel 7x7 .* padded input 7x5"),
        (lambda: conv2d_forward(X, W, stride=0), r"stride must be a positive integer .*got 0"),
        (lambda: conv2d_forward(X, W, stride=(1, -2)), r"stride .*got \(1, -2\)"),
        (lambda: conv2d_forward(X, W, stride=1.5), r"stride .*got 1.5"),
        (lambda: conv2d_forward(X, W, stride=(1, 1, 1)), r"stride .*got \(1, 1, 1\)"),
        (lambda: conv2d_forward(X, W, padding=-1), r"padding must be a non-negative .*got -1"),
        (lambda: conv2d_forward(X, W, np.zeros(7)),
         r"b must have shape \(8,\) .*F=8 .*got shape \(7,\)"),
        (lambda: conv2d_backward_data(np.zeros((2, 8, 3, 4)), W, X.shape),
         r"dy has shape \(2, 8, 3, 4\) but the convolution output is \(2, 8, 3, 3\)"),
        (lambda: conv2d_backward_data(DY, W, (2, 3, 5)), r"x must be 4-D .*\(2, 3, 5\)"),
        (lambda: conv2d_backward_data(DY, W, X.shape, padding=(0, -1)), r"padding .*\(0, -1\)"),
        (lambda: conv2d_backward_data(DY[0], W, X.shape), r"dy must be a 4-D array .*\(8, 3, 3\)"),
        (lambda: conv2d_backward_filter(X, np.zeros((2, 7, 3, 3)), W.shape),
         r"dy has shape \(2, 7, 3, 3\) but the convolution output is \(2, 8, 3, 3\)"),
        (lambda: conv2d_backward_filter(X, DY, (8, 4, 3, 3)),
         r"x has C=3 channels but w expects 4"),
        (lambda: conv2d_backward_filter(X, DY, W.shape, stride=0), r"stride .*got 0"),
        (lambda: conv2d_backward_bias(DY[0]), r"dy must be a 4-D array .*\(8, 3, 3\)"),
        (lambda: conv2d_output_shape((2, 3, 5, 5), (8, 3, 0, 3)), r"kernel 0x3"),
    ],
    ids=lambda value: None if callable(value) else value[:40],
)
def test_bad_input_raises_value_error_naming_the_value(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.fixture
def torch():
    """PyTorch, the optional independent oracle; the test skips where it is not installed."""
    return pytest.importorskip("torch")


@pytest.mark.parametrize(
    "case",
    [((2, 3, 9, 7), (4, 3, 3, 3), 1, 1), ((3, 4, 10, 11), (5, 4, 5, 3), (2, 1), (2, 0)),
     ((2, 6, 8, 8), (3, 6, 1, 1), 2, 0), ((1, 2, 5, 5), (2, 2, 5, 5), 1, 2)],
    ids=_case_id,
)
def test_matches_torch(torch, case):
    """Forward and autograd gradients of torch.nn.functional.conv2d, float64."""
    x, w, b, g = _random_problem(case, seed=3)
    _, _, stride, padding = case
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    ty = torch.nn.functional.conv2d(tx, tw, tb, stride=stride, padding=padding)
    (ty * torch.tensor(g)).sum().backward()
    pairs = [
        (conv2d_forward(x, w, b, stride, padding), ty),
        (conv2d_backward_data(g, w, x.shape, stride, padding), tx.grad),
        (conv2d_backward_filter(x, g, w.shape, stride, padding), tw.grad),
        (conv2d_backward_bias(g), tb.grad),
    ]
    for ours, theirs in pairs:
        assert relative_error(ours, theirs.detach().numpy()) < TOLERANCE_FLOAT64
