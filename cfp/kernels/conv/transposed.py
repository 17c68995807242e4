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
output_padding (PyTorch's rule: smaller than the stride or the dilation) adds positions at
the end that the convolution's windows still cover; where output_padding >= stride (allowed
by a larger dilation) that convolution's output is longer than x by `extra` positions, which
x is taken to have as zeros (forward) and dx drops (backward-data).

PyTorch's transposed convolutions pad with zeros only and take integer padding (no 'same' or
'valid'); so do these. Arrays: 4-D (N, C, H, W) for ConvTranspose2d, 5-D (N, C, D, H, W) for
ConvTranspose3d.
"""
from collections import namedtuple

from cfp.backend import get_array_module
from cfp.checks import float_dtype, int_tuple, positive_int
from cfp.kernels.conv import passes, volume
from cfp.kernels.conv.geometry import conv_geometry

TransposedGeometry = namedtuple("TransposedGeometry", "x_shape w_shape out_shape extra options", module=__name__)
TransposedGeometry.__doc__ = """One transposed convolution: its input x_shape (N, C, *S), weight
w_shape (C, F/G, *K), output out_shape (N, F, *O); `extra`, per spatial axis, the positions the
adjoint convolution's output has beyond S (0 unless output_padding >= stride); `options`, that
convolution's stride, padding, dilation and groups (tuples per axis)."""

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
    ConvTranspose2d/3d meanings. Raises ValueError, naming the value, for what PyTorch rejects:
    shapes of other ranks, channels that do not match, groups that do not divide them, a
    non-positive stride or dilation, a negative or non-integer padding, an output_padding not
    smaller than the stride or the dilation, padding that leaves no output."""
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
    options = transposed_options(n, stride, padding, output_padding, dilation, G)
    stride, padding, dilation = options["stride"], options["padding"], options["dilation"]
    output_padding = options.pop("output_padding")
    out = tuple((i - 1) * s - 2 * p + d * (k - 1) + op + 1
                for i, s, p, d, k, op in zip(S, stride, padding, dilation, K, output_padding))
    if min(out) < 1 or min(S) < 1:
        raise ValueError(f"the transposed convolution of an input {S} with kernel {K}, stride {stride}, padding "
                         f"{padding}, dilation {dilation} and output_padding {output_padding} has output "
                         f"{out}: padding crops it all (each output side must be at least 1)")
    out_shape = (N, F) + out
    conv_out = _conv_output(out_shape, w_shape, options)
    return TransposedGeometry(x_shape, w_shape, out_shape, tuple(o - i for o, i in zip(conv_out, S)), options)


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


def _conv_output(shape, w_shape, options):
    if len(shape) == 4:
        g = conv_geometry(shape, w_shape, **options)
        return g.Ho, g.Wo
    v = volume.volume_geometry(shape, w_shape, **options)
    return v.Do, v.plane.Ho, v.plane.Wo


def conv_transpose_output_shape(x_shape, w_shape, stride=1, padding=0, output_padding=0, dilation=1, groups=1):
    """(N, F, *O) of conv_transpose_forward."""
    return transposed_geometry(x_shape, w_shape, stride, padding, output_padding, dilation, groups).out_shape


def _require(array, name, ndim=None):
    if getattr(array, "ndim", None) not in ((4, 5) if ndim is None else (ndim,)):
        expected = "4-D or 5-D" if ndim is None else f"{ndim}-D"
        raise ValueError(f"{name} must be a {expected} array, got shape {getattr(array, 'shape', None)!r}")
    float_dtype(array.dtype, name)


def _extended(x, t, xp):
    """x with t.extra zero positions at the end of each spatial axis (x itself when none)."""
    if not any(t.extra):
        return x
    out = xp.zeros(x.shape[:2] + tuple(s + e for s, e in zip(x.shape[2:], t.extra)), x.dtype)
    out[(slice(None), slice(None)) + tuple(slice(0, s) for s in x.shape[2:])] = x
    return out


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
    y = _PASSES[x.ndim - 2][1](_extended(x.astype(dtype, copy=False), t, xp), w.astype(dtype, copy=False),
                               t.out_shape, **t.options)
    if b is not None:
        y += b.astype(dtype, copy=False).reshape((1, -1) + (1,) * (x.ndim - 2))
    return y


def _require_dy(dy, t):
    _require(dy, "dy", len(t.out_shape))
    if tuple(dy.shape) != t.out_shape:
        raise ValueError(f"dy has shape {tuple(dy.shape)} but the transposed convolution's output is {t.out_shape}")


def conv_transpose_backward_data(dy, w, x_shape, stride=1, padding=0, output_padding=0, dilation=1, groups=1):
    """dx (N, C, *S) from dy (N, F, *O): the convolution's forward of dy (cropped where extra)."""
    _require(w, "w")
    t = transposed_geometry(x_shape, w.shape, stride, padding, output_padding, dilation, groups)
    _require_dy(dy, t)
    xp = get_array_module(dy, w)
    dtype = xp.result_type(dy.dtype, w.dtype)
    dx = _PASSES[dy.ndim - 2][0](dy.astype(dtype, copy=False), w.astype(dtype, copy=False), None, **t.options)
    if any(t.extra):
        dx = xp.ascontiguousarray(dx[(slice(None), slice(None)) + tuple(slice(0, s) for s in t.x_shape[2:])])
    return dx


def conv_transpose_backward_filter(x, dy, w_shape, stride=1, padding=0, output_padding=0, dilation=1, groups=1):
    """dw (C, F/groups, *K) from x (N, C, *S) and dy (N, F, *O): the convolution's
    backward-filter with dy as its input and x as its output's gradient."""
    _require(x, "x")
    t = transposed_geometry(x.shape, w_shape, stride, padding, output_padding, dilation, groups)
    _require_dy(dy, t)
    xp = get_array_module(x, dy)
    dtype = xp.result_type(x.dtype, dy.dtype)
    return _PASSES[x.ndim - 2][2](dy.astype(dtype, copy=False), _extended(x.astype(dtype, copy=False), t, xp),
                                  t.w_shape, **t.options)


def conv_transpose_backward_bias(dy):
    """db (F,) = dy summed over samples and output positions."""
    _require(dy, "dy")
    return passes.sum_over_positions(dy)
