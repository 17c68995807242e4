"""Local pooling on NCHW blocks (and a volume's NCDHW): max and average pooling, forward and
backward.

Pooling acts on each channel alone, so under any channel or sample split it needs no
communication: the distributed layers call these on their local blocks. Square (cubic) windows
of `kernel`, `stride` and `padding` (padding counts as -inf for max, as 0 for the average, as
in PyTorch's defaults). padding may also be given per side, (top, bottom, left, right) (a
volume's (front, back, top, bottom, left, right)): the local pooling of a block of a split
image pads only where the block meets the image's border. The spatial axes are x's past the
first two, two for an image and three for a volume, and every function takes either.
"""
import itertools

from cfp.backend import get_array_module


def _sides(padding, axes):
    """((before, after), ...) per spatial axis from an int or 2 * axes sides."""
    sides = tuple(padding) if isinstance(padding, (tuple, list)) else (padding,) * (2 * axes)
    if len(sides) != 2 * axes:
        raise ValueError(f"pooling padding {padding!r}: expected an integer or {2 * axes} sides")
    return tuple(zip(sides[::2], sides[1::2]))


def pool_geometry(x_shape, kernel, stride, padding):
    """(output size per spatial axis, offsets, window) where window(offset) slices the padded
    input at kernel offset `offset` (a tuple, one per axis) of every window, and offsets are
    the kernel's offsets in the order the passes visit them."""
    size = tuple(x_shape[2:])
    sides = _sides(padding, len(size))
    padded = tuple(n + a + b for n, (a, b) in zip(size, sides))
    if any(kernel > p for p in padded):
        raise ValueError(f"pooling window {kernel} is larger than the padded input {'x'.join(map(str, padded))}")
    out = tuple((p - kernel) // stride + 1 for p in padded)

    def window(offset):
        return (slice(None), slice(None)) + tuple(slice(i, i + stride * (o - 1) + 1, stride)
                                                  for i, o in zip(offset, out))
    return out, list(itertools.product(range(kernel), repeat=len(size))), window


def _pad(x, padding, fill):
    sides = _sides(padding, x.ndim - 2)
    if not any(a or b for a, b in sides):
        return x
    xp = get_array_module(x)
    padded = xp.full(x.shape[:2] + tuple(n + a + b for n, (a, b) in zip(x.shape[2:], sides)), fill, dtype=x.dtype)
    padded[_interior(x.shape, sides)] = x
    return padded


def _interior(x_shape, sides):
    return (slice(None), slice(None)) + tuple(slice(a, a + n) for n, (a, _) in zip(x_shape[2:], sides))


def _padded_zeros(x_shape, padding, xp, dtype):
    sides = _sides(padding, len(x_shape) - 2)
    return xp.zeros(tuple(x_shape[:2]) + tuple(n + a + b for n, (a, b) in zip(x_shape[2:], sides)), dtype=dtype)


def _unpad(dpadded, x_shape, padding):
    return dpadded[_interior(x_shape, _sides(padding, len(x_shape) - 2))]


def max_pool2d_forward(x, kernel, stride, padding=0):
    """y (N, C, *out) and each window's argmax, the number of its kernel offset (in
    pool_geometry's order), kept for backward."""
    xp = get_array_module(x)
    out, offsets, window = pool_geometry(x.shape, kernel, stride, padding)
    padded = _pad(x, padding, -xp.inf)
    y = xp.full(x.shape[:2] + out, -xp.inf, dtype=x.dtype)
    argmax = xp.zeros(y.shape, dtype=xp.int32)
    for number, offset in enumerate(offsets):
        candidate = padded[window(offset)]
        better = candidate > y  # the first maximum wins ties, as in PyTorch
        y = xp.where(better, candidate, y)
        argmax = xp.where(better, number, argmax)
    return y, argmax


def max_pool2d_backward(dy, argmax, x_shape, kernel, stride, padding=0):
    """dx: each window's gradient goes to the input position that was its maximum."""
    xp = get_array_module(dy)
    _, offsets, window = pool_geometry(x_shape, kernel, stride, padding)
    dpadded = _padded_zeros(x_shape, padding, xp, dy.dtype)
    for number, offset in enumerate(offsets):
        dpadded[window(offset)] += xp.where(argmax == number, dy, 0)
    return _unpad(dpadded, x_shape, padding)


def avg_pool2d_forward(x, kernel, stride, padding=0):
    """y (N, C, *out): the mean of each window."""
    xp = get_array_module(x)
    out, offsets, window = pool_geometry(x.shape, kernel, stride, padding)
    padded = _pad(x, padding, 0)
    y = xp.zeros(x.shape[:2] + out, dtype=x.dtype)
    for offset in offsets:
        y += padded[window(offset)]
    return y / len(offsets)


def avg_pool2d_backward(dy, x_shape, kernel, stride, padding=0):
    xp = get_array_module(dy)
    _, offsets, window = pool_geometry(x_shape, kernel, stride, padding)
    dpadded = _padded_zeros(x_shape, padding, xp, dy.dtype)
    share = dy / len(offsets)
    for offset in offsets:
        dpadded[window(offset)] += share
    return _unpad(dpadded, x_shape, padding)


# a volume's passes are the same functions (the spatial axes are x's past the first two)
max_pool3d_forward, max_pool3d_backward = max_pool2d_forward, max_pool2d_backward
avg_pool3d_forward, avg_pool3d_backward = avg_pool2d_forward, avg_pool2d_backward
