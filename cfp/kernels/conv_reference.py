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
