"""Local pooling on NCHW blocks: max and average pooling, forward and backward.

Pooling acts on each channel alone, so under any channel or sample split it needs no
communication: the distributed layers call these on their local blocks. Square windows of
`kernel`, `stride` and `padding` (padding counts as -inf for max, as 0 for the average, as in
PyTorch's defaults). padding may also be (top, bottom, left, right): the local pooling of a
block of a split image pads only where the block meets the image's border.
"""
from cfp.backend import get_array_module


def _sides(padding):
    """(top, bottom, left, right) from an int or a 4-tuple."""
    return tuple(padding) if isinstance(padding, (tuple, list)) else (padding,) * 4


def pool_geometry(x_shape, kernel, stride, padding):
    """(Ho, Wo, window) where window(i, j) slices the padded input at offset (i, j) of every window."""
    N, C, H, W = x_shape
    top, bottom, left, right = _sides(padding)
    if kernel > H + top + bottom or kernel > W + left + right:
        raise ValueError(f"pooling window {kernel} is larger than the padded input "
                         f"{H + top + bottom}x{W + left + right}")
    Ho, Wo = (H + top + bottom - kernel) // stride + 1, (W + left + right - kernel) // stride + 1

    def window(i, j):
        return (slice(None), slice(None), slice(i, i + stride * (Ho - 1) + 1, stride),
                slice(j, j + stride * (Wo - 1) + 1, stride))
    return Ho, Wo, window


def _pad(x, padding, fill):
    top, bottom, left, right = _sides(padding)
    if not (top or bottom or left or right):
        return x
    xp = get_array_module(x)
    N, C, H, W = x.shape
    padded = xp.full((N, C, H + top + bottom, W + left + right), fill, dtype=x.dtype)
    padded[:, :, top:top + H, left:left + W] = x
    return padded


def _padded_zeros(x_shape, padding, xp, dtype):
    top, bottom, left, right = _sides(padding)
    N, C, H, W = x_shape
    return xp.zeros((N, C, H + top + bottom, W + left + right), dtype=dtype)


def _unpad(dpadded, x_shape, padding):
    top, _, left, _ = _sides(padding)
    H, W = x_shape[2:]
    return dpadded[:, :, top:top + H, left:left + W]


def max_pool2d_forward(x, kernel, stride, padding=0):
    """y (N, C, Ho, Wo) and each window's argmax offset i * kernel + j, kept for backward."""
    xp = get_array_module(x)
    Ho, Wo, window = pool_geometry(x.shape, kernel, stride, padding)
    padded = _pad(x, padding, -xp.inf)
    y = xp.full((x.shape[0], x.shape[1], Ho, Wo), -xp.inf, dtype=x.dtype)
    argmax = xp.zeros(y.shape, dtype=xp.int32)
    for i in range(kernel):
        for j in range(kernel):
            candidate = padded[window(i, j)]
            better = candidate > y  # the first maximum wins ties, as in PyTorch
            y = xp.where(better, candidate, y)
            argmax = xp.where(better, i * kernel + j, argmax)
    return y, argmax


def max_pool2d_backward(dy, argmax, x_shape, kernel, stride, padding=0):
    """dx: each window's gradient goes to the input position that was its maximum."""
    xp = get_array_module(dy)
    _, _, window = pool_geometry(x_shape, kernel, stride, padding)
    dpadded = _padded_zeros(x_shape, padding, xp, dy.dtype)
    for i in range(kernel):
        for j in range(kernel):
            dpadded[window(i, j)] += xp.where(argmax == i * kernel + j, dy, 0)
    return _unpad(dpadded, x_shape, padding)


def avg_pool2d_forward(x, kernel, stride, padding=0):
    """y (N, C, Ho, Wo): the mean of each window."""
    xp = get_array_module(x)
    Ho, Wo, window = pool_geometry(x.shape, kernel, stride, padding)
    padded = _pad(x, padding, 0)
    y = xp.zeros((x.shape[0], x.shape[1], Ho, Wo), dtype=x.dtype)
    for i in range(kernel):
        for j in range(kernel):
            y += padded[window(i, j)]
    return y / (kernel * kernel)


def avg_pool2d_backward(dy, x_shape, kernel, stride, padding=0):
    xp = get_array_module(dy)
    _, _, window = pool_geometry(x_shape, kernel, stride, padding)
    dpadded = _padded_zeros(x_shape, padding, xp, dy.dtype)
    share = dy / (kernel * kernel)
    for i in range(kernel):
        for j in range(kernel):
            dpadded[window(i, j)] += share
    return _unpad(dpadded, x_shape, padding)
