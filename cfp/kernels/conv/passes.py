"""The public passes of a 2-D convolution on one rank's NCHW arrays: forward, backward-data,
backward-filter and bias, with PyTorch's nn.Conv2d arguments; and the workspace each pass asks
for. Each checks its arrays, applies a padding mode other than zeros (kernels/conv/padding.py),
then runs the kernel path the path table chooses (kernels/conv/paths.py).
"""
from cfp.backend import get_array_module
from cfp.checks import float_dtype
from cfp.kernels import workspace
from cfp.kernels.conv import paths
from cfp.kernels.conv.geometry import check_bias, conv_geometry, padded_geometry, require_dy, require_ndim4
from cfp.kernels.conv.padding import fold_padding, pad_input


@workspace.call
def conv2d_forward(x, w, b=None, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """y (N, F, Ho, Wo) = x (N, C, H, W) cross-correlated with w (F, C/groups, Kh, Kw), plus b (F,).

    The arguments mean what they mean to PyTorch's nn.Conv2d: stride and dilation an int or a
    pair (rows, columns); padding an int, a pair, (top, bottom, left, right), 'valid' or 'same';
    groups splitting C and F into groups convolved separately (groups = C: depthwise);
    padding_mode 'zeros', 'reflect', 'replicate' or 'circular'. The dtype of y is that of x and
    w combined (float32 stays float32). With C = 0, y is b broadcast (or zeros).
    """
    require_ndim4(x, "x", "(N, C, H, W)")
    require_ndim4(w, "w", "(F, C / groups, Kh, Kw)")
    g = conv_geometry(x.shape, w.shape, stride, padding, dilation, groups, padding_mode)
    check_bias(b, g)
    xp = get_array_module(x, w)
    dtype = xp.result_type(x.dtype, w.dtype)
    x = xp.ascontiguousarray(x, dtype=dtype)
    if g.mode != "zeros":
        x, g = pad_input(x, g, xp)
    return paths.forward(x, w.astype(dtype, copy=False), b, g, xp)


@workspace.call
def conv2d_backward_data(dy, w, x_shape, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """dx (N, C, H, W): the gradient of the loss with respect to x, from dy (N, F, Ho, Wo).

    x_shape is needed because with a stride > 1 several input sizes give the same output size.
    Input positions that no output position reads (stride > 1) get zero gradient; under a
    padding mode other than zeros, the gradients of the padded border go back to the input
    positions the border copied.
    """
    require_ndim4(w, "w", "(F, C / groups, Kh, Kw)")
    g = conv_geometry(x_shape, w.shape, stride, padding, dilation, groups, padding_mode)
    require_dy(dy, g)
    xp = get_array_module(dy, w)
    dtype = xp.result_type(dy.dtype, w.dtype)
    if g.N * g.C * g.H * g.W == 0:
        return xp.zeros((g.N, g.C, g.H, g.W), dtype)
    dy = xp.ascontiguousarray(dy, dtype=dtype)
    w = w.astype(dtype, copy=False)
    if g.mode != "zeros":
        return fold_padding(paths.backward_data(dy, w, padded_geometry(g), xp), g)
    return paths.backward_data(dy, w, g, xp)


@workspace.call
def conv2d_backward_filter(x, dy, w_shape, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """dw (F, C/groups, Kh, Kw): the gradient of the loss with respect to w, from x and dy
    (N, F, Ho, Wo). w_shape gives the kernel size (Kh, Kw). With N = 0, dw is zeros.
    """
    require_ndim4(x, "x", "(N, C, H, W)")
    g = conv_geometry(x.shape, w_shape, stride, padding, dilation, groups, padding_mode)
    require_dy(dy, g)
    xp = get_array_module(x, dy)
    dtype = xp.result_type(x.dtype, dy.dtype)
    x = xp.ascontiguousarray(x, dtype=dtype)
    dy = xp.ascontiguousarray(dy, dtype=dtype)
    if g.mode != "zeros":
        x, g = pad_input(x, g, xp)
    return paths.backward_filter(x, dy, g, xp)


def conv2d_backward_bias(dy):
    """db (F,) = dy (N, F, Ho, Wo) summed over samples and output positions."""
    require_ndim4(dy, "dy", "(N, F, Ho, Wo)")
    return sum_over_positions(dy)


def sum_over_positions(dy):
    """(F,): dy (N, F, ...) summed over samples and every position (any number of spatial
    axes): the bias gradient of every kind of convolution."""
    xp = get_array_module(dy)
    N, F = dy.shape[:2]
    positions = 1
    for n in dy.shape[2:]:
        positions *= int(n)
    return xp.ascontiguousarray(dy).reshape(N, F, positions).sum(axis=2).sum(axis=0)


def workspace_bytes(x_shape, w_shape, dtype="float32", stride=1, padding=0, dilation=1, groups=1,
                    padding_mode="zeros"):
    """{pass: bytes} of the kernels' workspace each pass of this layer asks for, on the path the
    path table chooses for it in dtype; a pass whose path does not count its workspace is left
    out (the cost model bounds it, cfp/perfmodel.py). Today the Winograd paths count theirs
    (directly, by sub-grids, and as backward-data's full convolution)."""
    g = conv_geometry(x_shape, w_shape, stride, padding, dilation, groups, padding_mode)
    dtype = str(float_dtype(dtype, "dtype"))
    if g.mode != "zeros":  # padded first (a fresh array, not the workspace's), then zero padding
        g = padded_geometry(g)
    found = {p: paths.pass_bytes(p, g, dtype) for p in paths.PASSES}
    return {p: n for p, n in found.items() if n is not None}
