"""Plain-loop 2-D convolution (forward, backward-data, backward-filter, bias) that tests trust.

One loop over output positions, the definition written out; it shares no code with
cfp.kernels.conv, so that a bug there cannot hide here. NumPy only, slow, for small shapes.
"""
import numpy as np


def _pair(value):
    return tuple(value) if isinstance(value, (tuple, list)) else (value, value)


def _padded(x, ph, pw):
    return np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))


def conv2d_forward_loop(x, w, b=None, stride=1, padding=0):
    """y[n, f, i, j] = b[f] + sum_{c, p, q} xpad[n, c, i*sh + p, j*sw + q] w[f, c, p, q].

    x: (N, C, H, W), w: (F, C, Kh, Kw), b: (F,) or None; returns y: (N, F, Ho, Wo).
    """
    (sh, sw), (ph, pw) = _pair(stride), _pair(padding)
    N, C, H, W = x.shape
    F, _, Kh, Kw = w.shape
    Ho, Wo = (H + 2 * ph - Kh) // sh + 1, (W + 2 * pw - Kw) // sw + 1
    xpad = _padded(x, ph, pw)
    y = np.zeros((N, F, Ho, Wo), np.result_type(x, w))
    for n in range(N):
        for i in range(Ho):
            for j in range(Wo):
                window = xpad[n, :, i * sh:i * sh + Kh, j * sw:j * sw + Kw]
                for f in range(F):
                    y[n, f, i, j] = np.sum(window * w[f])
    if b is not None:
        y += b[None, :, None, None]
    return y


def conv2d_backward_data_loop(dy, w, x_shape, stride=1, padding=0):
    """dx: (N, C, H, W); each output position sends dy[n, f, i, j] * w[f] back to its window."""
    (sh, sw), (ph, pw) = _pair(stride), _pair(padding)
    N, C, H, W = x_shape
    F, _, Kh, Kw = w.shape
    _, _, Ho, Wo = dy.shape
    dxpad = np.zeros((N, C, H + 2 * ph, W + 2 * pw), np.result_type(dy, w))
    for n in range(N):
        for i in range(Ho):
            for j in range(Wo):
                for f in range(F):
                    dxpad[n, :, i * sh:i * sh + Kh, j * sw:j * sw + Kw] += dy[n, f, i, j] * w[f]
    return dxpad[:, :, ph:ph + H, pw:pw + W]


def conv2d_backward_filter_loop(x, dy, w_shape, stride=1, padding=0):
    """dw: (F, C, Kh, Kw); dw[f] sums dy[n, f, i, j] * window over samples and output positions."""
    (sh, sw), (ph, pw) = _pair(stride), _pair(padding)
    F, C, Kh, Kw = w_shape
    N, _, Ho, Wo = dy.shape
    xpad = _padded(x, ph, pw)
    dw = np.zeros((F, C, Kh, Kw), np.result_type(x, dy))
    for n in range(N):
        for i in range(Ho):
            for j in range(Wo):
                window = xpad[n, :, i * sh:i * sh + Kh, j * sw:j * sw + Kw]
                for f in range(F):
                    dw[f] += dy[n, f, i, j] * window
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
