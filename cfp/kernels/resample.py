"""Nearest upsampling on one rank's NCHW (or a volume's NCDHW) block: each position of the
input repeated `factor` times along each spatial axis (PyTorch's nn.Upsample(mode='nearest')
with an integer scale factor), forward and backward.

It is a transposed convolution with stride `factor`, a kernel of `factor` ones and one filter
per channel, which is how a split image's blocks get their halo (cfp/halo.py's rule for
transposed convolutions): a block of output rows lo..hi-1 reads the input rows lo // f to
(hi - 1) // f, and its sides (before, after) are the repeated rows it drops in front and
behind (before = lo - f (lo // f), both never negative). Unsplit, the sides are zero.
"""
from cfp.backend import get_array_module
from cfp.checks import int_tuple


def _factors(factor, axes):
    return int_tuple(factor, axes, "upsampling factor", 1, "a positive integer")


def _sides(sides, axes):
    sides = (0,) * (2 * axes) if sides is None else tuple(sides)
    if len(sides) != 2 * axes or min(sides) < 0:
        raise ValueError(f"upsampling sides {sides!r}: expected {2 * axes} non-negative integers")
    return tuple(zip(sides[::2], sides[1::2]))


def upsample_nearest_forward(x, factor, sides=None):
    """y (n, C, *(f S - before - after)): x repeated f times along each spatial axis, the
    `sides` (before, after of each axis: a block's) dropped."""
    axes = x.ndim - 2
    xp = get_array_module(x)
    for axis, (f, (before, after)) in enumerate(zip(_factors(factor, axes), _sides(sides, axes)), start=2):
        if f > 1:
            x = xp.repeat(x, f, axis=axis)
        if before or after:
            x = x[(slice(None),) * axis + (slice(before, x.shape[axis] - after),)]
    return xp.ascontiguousarray(x)


def upsample_nearest_backward(dy, factor, x_shape, sides=None):
    """dx (x_shape): each input position's gradient, the sum of dy over its f^axes copies."""
    axes = len(x_shape) - 2
    xp = get_array_module(dy)
    for axis, (f, (before, after), n) in enumerate(zip(_factors(factor, axes), _sides(sides, axes), x_shape[2:]),
                                                  start=2):
        if before or after:
            full = xp.zeros(dy.shape[:axis] + (f * n,) + dy.shape[axis + 1:], dy.dtype)
            full[(slice(None),) * axis + (slice(before, f * n - after),)] = dy
            dy = full
        if f > 1:
            dy = dy.reshape(dy.shape[:axis] + (n, f) + dy.shape[axis + 1:]).sum(axis=axis + 1)
    return dy
