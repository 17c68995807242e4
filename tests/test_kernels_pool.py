"""Pooling kernels against plain loops (and torch where installed)."""
import numpy as np
import pytest

from cfp.kernels.pool import (avg_pool2d_backward, avg_pool2d_forward, max_pool2d_backward,
                              max_pool2d_forward)

CASES = [(2, 2, 0), (3, 1, 1), (3, 2, 1), (2, 1, 0), (3, 3, 0)]  # kernel, stride, padding


def loops(x, dy, kernel, stride, padding, kind):
    N, C, H, W = x.shape
    fill = -np.inf if kind == "max" else 0.0
    xp = np.full((N, C, H + 2 * padding, W + 2 * padding), fill)
    xp[:, :, padding:padding + H, padding:padding + W] = x
    Ho, Wo = dy.shape[2:]
    y = np.zeros(dy.shape)
    dxp = np.zeros(xp.shape)
    for n in range(N):
        for c in range(C):
            for i in range(Ho):
                for j in range(Wo):
                    win = xp[n, c, i * stride:i * stride + kernel, j * stride:j * stride + kernel]
                    if kind == "max":
                        a, b = np.unravel_index(np.argmax(win), win.shape)
                        y[n, c, i, j] = win[a, b]
                        dxp[n, c, i * stride + a, j * stride + b] += dy[n, c, i, j]
                    else:
                        y[n, c, i, j] = win.mean()
                        dxp[n, c, i * stride:i * stride + kernel, j * stride:j * stride + kernel] += \
                            dy[n, c, i, j] / kernel ** 2
    return y, dxp[:, :, padding:padding + H, padding:padding + W]


def pool_pass(kind, x, kernel, stride, padding, rng):
    """(y, dy, dx) of one serial forward and backward pass of max or average pooling, dy drawn
    from rng."""
    if kind == "max":
        y, argmax = max_pool2d_forward(x, kernel, stride, padding)
        dy = rng.standard_normal(y.shape)
        return y, dy, max_pool2d_backward(dy, argmax, x.shape, kernel, stride, padding)
    y = avg_pool2d_forward(x, kernel, stride, padding)
    dy = rng.standard_normal(y.shape)
    return y, dy, avg_pool2d_backward(dy, x.shape, kernel, stride, padding)


@pytest.mark.parametrize("kernel,stride,padding", CASES)
@pytest.mark.parametrize("kind", ["max", "avg"])
def test_against_loops(kind, kernel, stride, padding):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 7, 6))
    y, dy, dx = pool_pass(kind, x, kernel, stride, padding, rng)
    y_ref, dx_ref = loops(x, dy, kernel, stride, padding, kind)
    assert np.allclose(y, y_ref, rtol=1e-13, atol=1e-14)
    assert np.allclose(dx, dx_ref, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("kernel,stride,padding", CASES)
def test_against_torch(kernel, stride, padding):
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(1).standard_normal((2, 3, 7, 6))
    t = torch.tensor(x, requires_grad=True)
    ty = torch.nn.functional.max_pool2d(t, kernel, stride, padding)
    y, argmax = max_pool2d_forward(x, kernel, stride, padding)
    ty.backward(torch.ones_like(ty))
    assert np.array_equal(y, ty.detach().numpy())
    dx = max_pool2d_backward(np.ones(y.shape), argmax, x.shape, kernel, stride, padding)
    assert np.array_equal(dx, t.grad.numpy())


def test_window_larger_than_input():
    with pytest.raises(ValueError, match="pooling window 5 is larger than the padded input 4x4"):
        max_pool2d_forward(np.zeros((1, 1, 4, 4)), 5, 1)
