"""Plain-loop 2-D convolution (forward, backward-data, backward-filter, bias) that tests trust.

One loop over output positions, the definition written out, with PyTorch's nn.Conv2d meaning
of stride, padding (int, pair, 'same', 'valid'), dilation, groups and padding_mode; it shares no
code with cfp.kernels.conv, so that a bug there cannot hide here. NumPy only, slow, for small
shapes. The padding modes are NumPy's np.pad modes under PyTorch's names.
"""
import numpy as np

_NUMPY_MODE = {"zeros": "constant", "reflect": "reflect", "replicate": "edge", "circular": "wrap"}


def _pair(value):
    return tuple(value) if isinstance(value, (tuple, list)) else (value, value)


def _sides(padding, kernel, dilation):
    """((top, bottom), (left, right))."""
    if padding == "valid":
        return (0, 0), (0, 0)
    if padding == "same":
        out = []
        for k, d in zip(kernel, dilation):
            total = d * (k - 1)
            out.append((total // 2, total - total // 2))
        return tuple(out)
    ph, pw = _pair(padding)
    return (ph, ph), (pw, pw)


def _geometry(x_shape, w_shape, stride, padding, dilation):
    (sh, sw), (dh, dw) = _pair(stride), _pair(dilation)
    N, C, H, W = x_shape
    F, Cg, Kh, Kw = w_shape
    (pt, pb), (pl, pr) = _sides(padding, (Kh, Kw), (dh, dw))
    Ho = (H + pt + pb - dh * (Kh - 1) - 1) // sh + 1
    Wo = (W + pl + pr - dw * (Kw - 1) - 1) // sw + 1
    return (sh, sw), (dh, dw), ((pt, pb), (pl, pr)), Ho, Wo


def _padded(x, sides, padding_mode):
    return np.pad(x, ((0, 0), (0, 0)) + tuple(sides), mode=_NUMPY_MODE[padding_mode])


def _window(a, n, channels, i, j, strides, dilations, kernel):
    (sh, sw), (dh, dw), (Kh, Kw) = strides, dilations, kernel
    return a[n, channels, i * sh:i * sh + dh * (Kh - 1) + 1:dh, j * sw:j * sw + dw * (Kw - 1) + 1:dw]


def conv2d_forward_loop(x, w, b=None, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """y[n, f, i, j] = b[f] + sum_{c in f's group, p, q} xpad[n, c, i*sh + p*dh, j*sw + q*dw] w[f, c, p, q].

    x: (N, C, H, W), w: (F, C/groups, Kh, Kw), b: (F,) or None; returns y: (N, F, Ho, Wo).
    """
    N, C, H, W = x.shape
    F, Cg, Kh, Kw = w.shape
    strides, dilations, sides, Ho, Wo = _geometry(x.shape, w.shape, stride, padding, dilation)
    xpad = _padded(x, sides, padding_mode)
    Fg = F // groups
    y = np.zeros((N, F, Ho, Wo), np.result_type(x, w))
    for n in range(N):
        for f in range(F):
            channels = slice(f // Fg * Cg, (f // Fg + 1) * Cg)
            for i in range(Ho):
                for j in range(Wo):
                    window = _window(xpad, n, channels, i, j, strides, dilations, (Kh, Kw))
                    y[n, f, i, j] = np.sum(window * w[f])
    if b is not None:
        y += b[None, :, None, None]
    return y


def _fold(dxpad, x_shape, sides, padding_mode):
    """The gradient of the padded input added back onto the input position each padded position
    came from: the index maps are np.pad of the positions themselves."""
    N, C, H, W = x_shape
    (pt, pb), (pl, pr) = sides
    mode = _NUMPY_MODE[padding_mode]
    kwargs = {"constant_values": -1} if mode == "constant" else {}
    rows = np.pad(np.arange(H), (pt, pb), mode=mode, **kwargs)
    cols = np.pad(np.arange(W), (pl, pr), mode=mode, **kwargs)
    dx = np.zeros(x_shape, dxpad.dtype)
    for r, source_row in enumerate(rows):
        for c, source_col in enumerate(cols):
            if source_row >= 0 and source_col >= 0:
                dx[:, :, source_row, source_col] += dxpad[:, :, r, c]
    return dx


def conv2d_backward_data_loop(dy, w, x_shape, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """dx: (N, C, H, W); each output position sends dy[n, f, i, j] * w[f] back to its window."""
    N, C, H, W = x_shape
    F, Cg, Kh, Kw = w.shape
    strides, dilations, sides, Ho, Wo = _geometry(x_shape, w.shape, stride, padding, dilation)
    (pt, pb), (pl, pr) = sides
    dxpad = np.zeros((N, C, H + pt + pb, W + pl + pr), np.result_type(dy, w))
    Fg = F // groups
    for n in range(N):
        for f in range(F):
            channels = slice(f // Fg * Cg, (f // Fg + 1) * Cg)
            for i in range(Ho):
                for j in range(Wo):
                    _window(dxpad, n, channels, i, j, strides, dilations, (Kh, Kw))[...] += dy[n, f, i, j] * w[f]
    return _fold(dxpad, x_shape, sides, padding_mode)


def conv2d_backward_filter_loop(x, dy, w_shape, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """dw: (F, C/groups, Kh, Kw); dw[f] sums dy[n, f, i, j] * window over samples and positions."""
    F, Cg, Kh, Kw = w_shape
    N, _, Ho, Wo = dy.shape
    strides, dilations, sides, _, _ = _geometry(x.shape, w_shape, stride, padding, dilation)
    xpad = _padded(x, sides, padding_mode)
    Fg = F // groups
    dw = np.zeros((F, Cg, Kh, Kw), np.result_type(x, dy))
    for n in range(N):
        for f in range(F):
            channels = slice(f // Fg * Cg, (f // Fg + 1) * Cg)
            for i in range(Ho):
                for j in range(Wo):
                    dw[f] += dy[n, f, i, j] * _window(xpad, n, channels, i, j, strides, dilations, (Kh, Kw))
    return dw


def conv2d_backward_bias_loop(dy):
    """db: (F,); db[f] = sum over samples and output positions of dy[n, f, i, j]."""
    N, F, Ho, Wo = dy.shape
    db = np.zeros(F, dy.dtype)
    for n in range(N):
        for i in range(Ho):
            for j in range(Wo):
                db += dy[n, :, i, j]
    return db


# -- any number of spatial axes: the volumes' convolution (N, C, D, H, W) and the transposed
# convolution, written out the same way (padding: an int, one per axis, or 'same' / 'valid';
# for cfp's own asymmetric padding, pad x with np.pad first).

def _tuple(value, n):
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * n


def _nd_sides(padding, kernel, dilation):
    """((before, after), ...) per spatial axis."""
    n = len(kernel)
    if padding == "valid":
        return ((0, 0),) * n
    if padding == "same":
        return tuple((d * (k - 1) // 2, d * (k - 1) - d * (k - 1) // 2) for k, d in zip(kernel, dilation))
    return tuple((p, p) for p in _tuple(padding, n))


def _nd_window(a, n, channels, out, strides, dilations, kernel):
    at = tuple(slice(o * s, o * s + d * (k - 1) + 1, d) for o, s, d, k in zip(out, strides, dilations, kernel))
    return a[(n, channels) + at]


def _nd_geometry(x_shape, w_shape, stride, padding, dilation):
    kernel = tuple(w_shape[2:])
    n = len(kernel)
    strides, dilations = _tuple(stride, n), _tuple(dilation, n)
    sides = _nd_sides(padding, kernel, dilations)
    out = tuple((size + a + b - d * (k - 1) - 1) // s + 1
                for size, (a, b), d, k, s in zip(x_shape[2:], sides, dilations, kernel, strides))
    return kernel, strides, dilations, sides, out


def convnd_forward_loop(x, w, b=None, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """y[n, f, o] = b[f] + sum_{c in f's group, k} xpad[n, c, o*s + k*d] w[f, c, k] over every
    output position o and kernel offset k of any number of spatial axes (x (N, C, D, H, W) for
    a volume, w (F, C/groups, Kd, Kh, Kw))."""
    kernel, strides, dilations, sides, out = _nd_geometry(x.shape, w.shape, stride, padding, dilation)
    xpad = np.pad(x, ((0, 0), (0, 0)) + sides, mode=_NUMPY_MODE[padding_mode])
    N, F, Cg = x.shape[0], w.shape[0], w.shape[1]
    Fg = F // groups
    y = np.zeros((N, F) + out, np.result_type(x, w))
    for n in range(N):
        for f in range(F):
            channels = slice(f // Fg * Cg, (f // Fg + 1) * Cg)
            for o in np.ndindex(*out):
                y[(n, f) + o] = np.sum(_nd_window(xpad, n, channels, o, strides, dilations, kernel) * w[f])
    if b is not None:
        y += b.reshape((1, F) + (1,) * len(out))
    return y


def _nd_fold(dxpad, x_shape, sides, padding_mode):
    """The padded input's gradient added back onto the input position each padded one copied."""
    mode = _NUMPY_MODE[padding_mode]
    kwargs = {"constant_values": -1} if mode == "constant" else {}
    sources = [np.pad(np.arange(size), side, mode=mode, **kwargs) for size, side in zip(x_shape[2:], sides)]
    dx = np.zeros(x_shape, dxpad.dtype)
    for p in np.ndindex(*dxpad.shape[2:]):
        source = tuple(int(s[i]) for s, i in zip(sources, p))
        if min(source) >= 0:
            dx[(slice(None), slice(None)) + source] += dxpad[(slice(None), slice(None)) + p]
    return dx


def convnd_backward_data_loop(dy, w, x_shape, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """dx: each output position sends dy[n, f, o] * w[f] back to its window (any spatial axes)."""
    kernel, strides, dilations, sides, out = _nd_geometry(x_shape, w.shape, stride, padding, dilation)
    padded = tuple(size + a + b for size, (a, b) in zip(x_shape[2:], sides))
    dxpad = np.zeros(tuple(x_shape[:2]) + padded, np.result_type(dy, w))
    N, F, Cg = x_shape[0], w.shape[0], w.shape[1]
    Fg = F // groups
    for n in range(N):
        for f in range(F):
            channels = slice(f // Fg * Cg, (f // Fg + 1) * Cg)
            for o in np.ndindex(*out):
                _nd_window(dxpad, n, channels, o, strides, dilations, kernel)[...] += dy[(n, f) + o] * w[f]
    return _nd_fold(dxpad, tuple(x_shape), sides, padding_mode)


def convnd_backward_filter_loop(x, dy, w_shape, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """dw[f] = the sum over samples and output positions of dy[n, f, o] * window (any spatial axes)."""
    kernel, strides, dilations, sides, out = _nd_geometry(x.shape, w_shape, stride, padding, dilation)
    xpad = np.pad(x, ((0, 0), (0, 0)) + sides, mode=_NUMPY_MODE[padding_mode])
    F, Cg = w_shape[0], w_shape[1]
    Fg = F // groups
    dw = np.zeros(tuple(w_shape), np.result_type(x, dy))
    for n in range(x.shape[0]):
        for f in range(F):
            channels = slice(f // Fg * Cg, (f // Fg + 1) * Cg)
            for o in np.ndindex(*out):
                dw[f] += dy[(n, f) + o] * _nd_window(xpad, n, channels, o, strides, dilations, kernel)
    return dw


def conv_transpose_forward_loop(x, w, b=None, stride=1, padding=0, output_padding=0, dilation=1, groups=1):
    """PyTorch's ConvTranspose2d/3d by its definition, a scatter: each input position i of
    x (N, C, ...) adds x[n, c, i] w[c, f] (w: (C, F/groups, K...)) onto the output window
    starting at i*s - p, position i*s - p + k*d for kernel offset k; output positions outside
    0..(size_in - 1) s - 2p + d (K - 1) + output_padding are dropped (what padding crops)."""
    n_axes = x.ndim - 2
    strides, pads, dilations = _tuple(stride, n_axes), _tuple(padding, n_axes), _tuple(dilation, n_axes)
    extra = _tuple(output_padding, n_axes)
    kernel = w.shape[2:]
    out = tuple((i - 1) * s - 2 * p + d * (k - 1) + e + 1
                for i, s, p, d, k, e in zip(x.shape[2:], strides, pads, dilations, kernel, extra))
    N, C, Fg = x.shape[0], x.shape[1], w.shape[1]
    Cg = C // groups
    y = np.zeros((N, Fg * groups) + out, np.result_type(x, w))
    for n in range(N):
        for c in range(C):
            filters = slice(c // Cg * Fg, (c // Cg + 1) * Fg)
            for i in np.ndindex(*x.shape[2:]):
                for k in np.ndindex(*kernel):
                    at = tuple(a * s - p + b * d for a, s, p, b, d in zip(i, strides, pads, k, dilations))
                    if all(0 <= a < size for a, size in zip(at, out)):
                        y[(n, filters) + at] += x[(n, c) + i] * w[(c, slice(None)) + k]
    if b is not None:
        y += b.reshape((1, -1) + (1,) * n_axes)
    return y
