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


FOUR_SIDED = [(3, 2, (1, 0, 0, 1)), (2, 2, (0, 1, 1, 0)), (3, 1, (2, 0, 1, 1))]  # kernel, stride, padding


def four_sided_layer(kind, kernel, stride, padding):
    from cfp.nn import AvgPool2d, MaxPool2d
    return (MaxPool2d if kind == "max" else AvgPool2d)(kernel, stride, padding)


@pytest.mark.parametrize("kernel,stride,padding", FOUR_SIDED)
@pytest.mark.parametrize("kind", ["max", "avg"])
def test_the_layers_four_sided_padding_is_the_kernels(kind, kernel, stride, padding):
    """MaxPool2d and AvgPool2d with padding (top, bottom, left, right): the layer's output shape
    is the kernel's pool_geometry (a formula of one padding per side once refused it), and its
    forward and backward on one rank are the kernel's."""
    from mpi4py import MPI

    from cfp.grid import ProcessGrid
    from cfp.kernels.pool import pool_geometry
    from cfp.nn import Sequential
    from cfp.tensor import DistTensor, Layout
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 7, 6))
    y, dy, dx = pool_pass(kind, x, kernel, stride, padding, rng)
    layer = four_sided_layer(kind, kernel, stride, padding)
    assert layer.output_shape(x.shape) == (2, 3) + pool_geometry(x.shape, kernel, stride, padding)[0] == y.shape
    grid = ProcessGrid("sample=1", comm=MPI.COMM_SELF)
    layout = Layout(("sample", None, None, None))
    model = Sequential(layer)
    model.place((grid, layout))
    out = model.forward(DistTensor.from_global(x, layout, grid))
    back = model.backward(DistTensor.from_global(dy, layout, grid))
    assert np.array_equal(out.gather(), y) and np.array_equal(back.gather(), dx)
    grid.free()


@pytest.mark.mpi
@pytest.mark.parametrize("kernel,stride,padding", FOUR_SIDED)
@pytest.mark.parametrize("kind", ["max", "avg"])
def test_four_sided_padding_on_split_images_is_the_kernels(kind, kernel, stride, padding):
    """The same layers on every height x width split of the ranks: each block pools with its
    halo and the padding of the image's sides it meets; y and dx are the serial kernel's."""
    from conftest import SIZE, assert_close_all_ranks, grid_specs

    from cfp.grid import ProcessGrid
    from cfp.nn import Sequential
    from cfp.tensor import DistTensor, Layout
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 3, 9, 8))
    y, dy, dx = pool_pass(kind, x, kernel, stride, padding, rng)
    for spec in grid_specs(2, ("height", "width")):
        grid = ProcessGrid(spec)
        if y.shape[2] < grid.axis_size("height") or y.shape[3] < grid.axis_size("width"):
            grid.free()
            continue
        layout = Layout((None, None, "height" if grid.axis_size("height") > 1 else None,
                         "width" if grid.axis_size("width") > 1 else None))
        model = Sequential(four_sided_layer(kind, kernel, stride, padding))
        model.place((grid, layout))
        out = model.forward(DistTensor.from_global(x, layout, grid))
        back = model.backward(DistTensor.from_global(dy, layout, grid))
        assert_close_all_ranks(out.gather(), y, 1e-12, f"{kind} {spec} y on {SIZE} ranks")
        assert_close_all_ranks(back.gather(), dx, 1e-12, f"{kind} {spec} dx on {SIZE} ranks")
        grid.free()
