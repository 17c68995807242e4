"""Transposed convolution (PyTorch's ConvTranspose2d and ConvTranspose3d) on one rank's blocks,
as the convolution it is the adjoint of. A transposed convolution of x (N, C, *S) with w
(C, F/groups, *K) is the backward-data pass of the convolution with the same w, stride,
padding, dilation and groups whose input is the transposed one's output y (N, F, *O) and whose
output is x:

    forward          y  = conv backward-data (x, w, y's shape)
    backward-data    dx = conv forward (dy, w)
    backward-filter  dw = conv backward-filter (dy in x's place, x in dy's place)

so every kernel path of the convolution (2-D and 3-D, kernels/conv/paths.py and volume.py)
serves it. The output size is O = (S - 1) s - 2 p + d (K - 1) + output_padding + 1 per axis.

Where that convolution's windows sit on y is said, per axis, by two signed sides (before,
after), with O + before + after = (S - 1) s + d (K - 1) + 1: the convolution pads y with
`before` zeros in front and `after` behind, and a negative side means instead that y's first
(or last) -side positions are read by no window, so they receive nothing (the output there is
zero, or the bias). A layer's padding p and output_padding op are the sides (p, p - op): an
output_padding beyond the padding gives positions at the end that no input reaches. A block of
a spatially split output has its own sides, from the halo plan (cfp/halo.py), which the passes
take as padding in the convolution's per-side form, (before, after) of each axis in order, with
output_padding 0.

PyTorch's transposed convolutions pad with zeros only and take integer padding (no 'same' or
'valid'); so do these. Arrays: 4-D (N, C, H, W) for ConvTranspose2d, 5-D (N, C, D, H, W) for
ConvTranspose3d.
"""
from collections import namedtuple

from cfp.backend import get_array_module
from cfp.checks import float_dtype, int_tuple, positive_int
from cfp.kernels.conv import passes, volume

TransposedGeometry = namedtuple("TransposedGeometry", "x_shape w_shape out_shape sides crop options", module=__name__)
TransposedGeometry.__doc__ = """One transposed convolution: its input x_shape (N, C, *S), weight
w_shape (C, F/G, *K), output out_shape (N, F, *O); `sides`, per spatial axis, the signed
(before, after) of the adjoint convolution's windows on y (the module's docstring); `options`,
that convolution's stride, padding (the sides' non-negative parts, per side), dilation and
groups; `crop`, per axis, the (front, back) positions of y no window reads."""

_PASSES = {2: (passes.conv2d_forward, passes.conv2d_backward_data, passes.conv2d_backward_filter),
           3: (volume.conv3d_forward, volume.conv3d_backward_data, volume.conv3d_backward_filter)}
_LAYOUT = {2: "(N, C, H, W)", 3: "(N, C, D, H, W)"}


def _spatial_axes(shape, name):
    try:
        dims = tuple(int(d) for d in shape)
    except TypeError:
        raise ValueError(f"{name} must be a 4-D or 5-D shape, got {shape!r}") from None
    if len(dims) not in (4, 5) or min(dims) < 0:
        raise ValueError(f"{name} must be 4-D {_LAYOUT[2]} or 5-D {_LAYOUT[3]}, got shape {tuple(shape)!r}")
    return dims


def transposed_geometry(x_shape, w_shape, stride=1, padding=0, output_padding=0, dilation=1, groups=1):
    """The TransposedGeometry of x_shape (N, C, *S) and w_shape (C, F/groups, *K), with PyTorch's
    ConvTranspose2d/3d meanings, or (padding of two signed sides an axis, output_padding 0) a
    block's own sides (the module's docstring). Raises ValueError, naming the value, for what
    PyTorch rejects: shapes of other ranks, channels that do not match, groups that do not
    divide them, a non-positive stride or dilation, a negative or non-integer padding, an
    output_padding not smaller than the stride or the dilation, padding that leaves no output."""
    x_shape, w_shape = _spatial_axes(x_shape, "x"), _spatial_axes(w_shape, "w")
    n = len(x_shape) - 2
    if len(w_shape) != len(x_shape):
        raise ValueError(f"w {w_shape} must have the {len(x_shape)} dimensions of x {x_shape} (C, F / groups, "
                         f"{'Kd, ' if n == 3 else ''}Kh, Kw)")
    G = positive_int(groups, "groups")
    N, C, S = x_shape[0], x_shape[1], x_shape[2:]
    if w_shape[0] != C:
        raise ValueError(f"x has C={C} channels but the transposed convolution's w {w_shape} expects "
                         f"{w_shape[0]} (w is (in_channels, out_channels / groups, ...))")
    if C % G:
        raise ValueError(f"groups={G} must divide the input channels C={C}")
    K, F = w_shape[2:], w_shape[1] * G
    if min(K) < 1:
        raise ValueError(f"the kernel {K} must be at least 1 on every axis")
    block = isinstance(padding, (tuple, list)) and len(padding) == 2 * n and not any(_as_tuple(output_padding))
    if block:
        options = transposed_options(n, stride, 0, 0, dilation, G)
        sides = tuple((int(padding[2 * i]), int(padding[2 * i + 1])) for i in range(n))
    else:
        options = transposed_options(n, stride, padding, output_padding, dilation, G)
        sides = tuple((p, p - op) for p, op in zip(options["padding"], options["output_padding"]))
    del options["output_padding"]
    stride, dilation = options["stride"], options["dilation"]
    out = tuple((i - 1) * s + d * (k - 1) + 1 - before - after
                for i, s, d, k, (before, after) in zip(S, stride, dilation, K, sides))
    if min(out) < 1 or min(S) < (0 if block else 1):  # (a block's window may hold no input)
        raise ValueError(f"the transposed convolution of an input {S} with kernel {K}, stride {stride}, padding "
                         f"{padding}, dilation {dilation} and output_padding {output_padding} has output "
                         f"{out}: padding crops it all (each output side must be at least 1)")
    options["padding"] = tuple(max(0, side) for pair in sides for side in pair)
    crop = tuple((max(0, -before), max(0, -after)) for before, after in sides)
    return TransposedGeometry(x_shape, w_shape, (N, F) + out, sides, crop, options)


def _as_tuple(value):
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def transposed_options(axes, stride=1, padding=0, output_padding=0, dilation=1, groups=1):
    """A transposed convolution's options over `axes` spatial axes, checked and put in one form
    (tuples per axis): integer padding only (no 'same' or 'valid', as PyTorch's), and
    output_padding smaller than the stride or the dilation on each axis (PyTorch's rule)."""
    stride = int_tuple(stride, axes, "stride", 1, "a positive integer")
    dilation = int_tuple(dilation, axes, "dilation", 1, "a positive integer")
    if isinstance(padding, str):
        raise ValueError(f"padding {padding!r}: a transposed convolution takes integer padding (as PyTorch's "
                         f"ConvTranspose{axes}d), not 'same' or 'valid'")
    padding = int_tuple(padding, axes, "padding", 0, "a non-negative integer")
    output_padding = int_tuple(output_padding, axes, "output_padding", 0, "a non-negative integer")
    for op, s, d in zip(output_padding, stride, dilation):
        if op >= s and op >= d:
            raise ValueError(f"output_padding {output_padding} must be smaller than the stride {stride} or the "
                             f"dilation {dilation} on each axis (PyTorch's rule)")
    return {"stride": stride, "padding": padding, "dilation": dilation, "groups": positive_int(groups, "groups"),
            "output_padding": output_padding}


def conv_transpose_output_shape(x_shape, w_shape, stride=1, padding=0, output_padding=0, dilation=1, groups=1):
    """(N, F, *O) of conv_transpose_forward."""
    return transposed_geometry(x_shape, w_shape, stride, padding, output_padding, dilation, groups).out_shape


def _require(array, name, ndim=None):
    if getattr(array, "ndim", None) not in ((4, 5) if ndim is None else (ndim,)):
        expected = "4-D or 5-D" if ndim is None else f"{ndim}-D"
        raise ValueError(f"{name} must be a {expected} array, got shape {getattr(array, 'shape', None)!r}")
    float_dtype(array.dtype, name)


def adjoint_input(t):
    """The index of the part of y (or dy) the adjoint convolution's windows read (all of it but
    the crop), and that part's shape; None where they read nothing (an input with no positions,
    or windows that miss this block of y): its output is then zero."""
    read = t.out_shape[:2] + tuple(o - lo - hi for o, (lo, hi) in zip(t.out_shape[2:], t.crop))
    if min(read[2:]) < 1 or min(t.x_shape[2:]) < 1:
        return None, None
    return (slice(None), slice(None)) + tuple(slice(lo, o - hi) for o, (lo, hi) in zip(t.out_shape[2:], t.crop)), read


def conv_transpose_forward(x, w, b=None, stride=1, padding=0, output_padding=0, dilation=1, groups=1):
    """y (N, F, *O) = the transposed convolution of x (N, C, *S) with w (C, F/groups, *K), plus
    b (F,): PyTorch's ConvTranspose2d (4-D arrays) or ConvTranspose3d (5-D)."""
    _require(x, "x")
    _require(w, "w", x.ndim)
    t = transposed_geometry(x.shape, w.shape, stride, padding, output_padding, dilation, groups)
    if b is not None and tuple(getattr(b, "shape", ())) != (t.out_shape[1],):
        raise ValueError(f"b must have shape ({t.out_shape[1]},) to match the F={t.out_shape[1]} output channels, "
                         f"got shape {getattr(b, 'shape', None)!r}")
    xp = get_array_module(x, w)
    dtype = xp.result_type(x.dtype, w.dtype)
    index, read = adjoint_input(t)
    if read is None:  # no window reaches this block of y
        y = xp.zeros(t.out_shape, dtype)
    else:
        y = _PASSES[x.ndim - 2][1](x.astype(dtype, copy=False), w.astype(dtype, copy=False), read, **t.options)
        if read != t.out_shape:
            full = xp.zeros(t.out_shape, dtype)
            full[index] = y
            y = full
    if b is not None:
        y += b.astype(dtype, copy=False).reshape((1, -1) + (1,) * (x.ndim - 2))
    return y


def _require_dy(dy, t):
    _require(dy, "dy", len(t.out_shape))
    if tuple(dy.shape) != t.out_shape:
        raise ValueError(f"dy has shape {tuple(dy.shape)} but the transposed convolution's output is {t.out_shape}")


def conv_transpose_backward_data(dy, w, x_shape, stride=1, padding=0, output_padding=0, dilation=1, groups=1):
    """dx (N, C, *S) from dy (N, F, *O): the convolution's forward of the part of dy its windows
    read."""
    _require(w, "w")
    t = transposed_geometry(x_shape, w.shape, stride, padding, output_padding, dilation, groups)
    _require_dy(dy, t)
    xp = get_array_module(dy, w)
    dtype = xp.result_type(dy.dtype, w.dtype)
    index, read = adjoint_input(t)
    if read is None:
        return xp.zeros(t.x_shape, dtype)
    dy = xp.ascontiguousarray(dy[index]) if read != t.out_shape else dy
    return _PASSES[dy.ndim - 2][0](dy.astype(dtype, copy=False), w.astype(dtype, copy=False), None, **t.options)


def conv_transpose_backward_filter(x, dy, w_shape, stride=1, padding=0, output_padding=0, dilation=1, groups=1):
    """dw (C, F/groups, *K) from x (N, C, *S) and dy (N, F, *O): the convolution's
    backward-filter with dy as its input and x as its output's gradient."""
    _require(x, "x")
    t = transposed_geometry(x.shape, w_shape, stride, padding, output_padding, dilation, groups)
    _require_dy(dy, t)
    xp = get_array_module(x, dy)
    dtype = xp.result_type(x.dtype, dy.dtype)
    index, read = adjoint_input(t)
    if read is None:
        return xp.zeros(t.w_shape, dtype)
    dy = xp.ascontiguousarray(dy[index]) if read != t.out_shape else dy
    return _PASSES[x.ndim - 2][2](dy.astype(dtype, copy=False), x.astype(dtype, copy=False), t.w_shape,
                                  **t.options)


def conv_transpose_backward_bias(dy):
    """db (F,) = dy summed over samples and output positions."""
    _require(dy, "dy")
    return passes.sum_over_positions(dy)
