"""Fast local 2-D convolution on NCHW blocks: forward, backward-data, backward-filter, bias.

im2col + GEMM on the arrays of one rank (NumPy or CuPy); no MPI here, cfp.algorithms moves data.

Shapes: x (N, C, H, W), w (F, C, Kh, Kw), b (F,), y and dy (N, F, Ho, Wo) with
Ho = (H + 2 ph - Kh) // sh + 1 and Wo = (W + 2 pw - Kw) // sw + 1 (zero padding). Any of N, C, F
may be 0: channel and filter shards of a distributed layer can be empty.

How it is fast (measured with OpenBLAS, see BENCHMARKS.md): the patches are built pixel-major,
one row of Kh*Kw*C values per output pixel, because GEMMs with those rows run near the BLAS peak
even when F is small; samples go through in blocks whose patches are still in cache when the
GEMM reads them (the patches of a whole mini-batch would be Kh*Kw times the size of x); the
stride-1 backward-data pass is a forward convolution, so it needs no col2im.
"""
import operator
from collections import namedtuple

from cfp.backend import get_array_module
from cfp.checks import float_dtype, int_pair

# A block of samples holds about this many output pixels: the rows of the forward GEMM and the
# inner dimension of the backward-filter GEMM. OpenBLAS runs near its peak from about 512 on;
# more only makes the buffers larger.
_BLOCK_ROWS = 1024
# ...and at most this many patch values (4 MiB in float32), so the patches written by the copy
# are still in cache (L2/L3) when the GEMM reads them.
_BLOCK_ELEMENTS = 1 << 20
_CACHE_LINE_BYTES = 64

ConvGeometry = namedtuple(
    "ConvGeometry", "N C H W F Kh Kw sh sw ph pw Ho Wo", module=__name__
)
ConvGeometry.__doc__ = """Sizes of one convolution: input, kernel, stride, padding and output."""


def _shape4(shape, name, layout):
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise ValueError(f"{name} must be a 4-D shape {layout}, got {shape!r}") from None
    if len(dims) != 4 or min(dims) < 0:
        raise ValueError(f"{name} must be 4-D {layout}, got shape {tuple(shape)!r}")
    return dims


def conv_geometry(x_shape, w_shape, stride=1, padding=0):
    """The ConvGeometry of x_shape (N, C, H, W) convolved with w_shape (F, C, Kh, Kw).

    Raises ValueError, naming the bad value, for a shape that is not 4-D, mismatched channels,
    a non-positive stride, a negative padding or a kernel larger than the padded input.
    """
    N, C, H, W = _shape4(x_shape, "x", "(N, C, H, W)")
    F, Cw, Kh, Kw = _shape4(w_shape, "w", "(F, C, Kh, Kw)")
    if C != Cw:
        raise ValueError(
            f"x has C={C} channels but w expects {Cw} (w.shape={tuple(w_shape)})"
        )
    sh, sw = int_pair(stride, "stride", 1, "a positive integer")
    ph, pw = int_pair(padding, "padding", 0, "a non-negative integer")
    if Kh < 1 or Kw < 1 or Kh > H + 2 * ph or Kw > W + 2 * pw:
        raise ValueError(
            f"kernel {Kh}x{Kw} does not fit the padded input {H + 2 * ph}x{W + 2 * pw} "
            f"(H={H}, W={W}, padding={(ph, pw)}): each kernel side must be between 1 and the "
            f"padded input side"
        )
    Ho = (H + 2 * ph - Kh) // sh + 1
    Wo = (W + 2 * pw - Kw) // sw + 1
    return ConvGeometry(N, C, H, W, F, Kh, Kw, sh, sw, ph, pw, Ho, Wo)


def conv2d_output_shape(x_shape, w_shape, stride=1, padding=0):
    """(N, F, Ho, Wo) of conv2d_forward on x_shape (N, C, H, W) and w_shape (F, C, Kh, Kw)."""
    g = conv_geometry(x_shape, w_shape, stride, padding)
    return (g.N, g.F, g.Ho, g.Wo)


def conv2d_flops(x_shape, w_shape, stride=1, padding=0):
    """2 N C F Ho Wo Kh Kw: the multiply-adds, counted as 2 flops, of each of the three passes."""
    g = conv_geometry(x_shape, w_shape, stride, padding)
    return 2 * g.N * g.C * g.F * g.Ho * g.Wo * g.Kh * g.Kw


def _require_ndim4(array, name, layout):
    """A 4-D float32 or float64 array (integers and complex numbers are not convolved here)."""
    if getattr(array, "ndim", None) != 4:
        shape = getattr(array, "shape", None)
        raise ValueError(f"{name} must be a 4-D array {layout}, got shape {shape!r}")
    float_dtype(array.dtype, name)


def _require_dy(dy, g):
    expected = (g.N, g.F, g.Ho, g.Wo)
    _require_ndim4(dy, "dy", "(N, F, Ho, Wo)")
    if tuple(dy.shape) != expected:
        raise ValueError(
            f"dy has shape {tuple(dy.shape)} but the convolution output is {expected} "
            f"(N, F, Ho, Wo)"
        )


def _is_pointwise(g):
    """1x1 kernel, stride 1, no padding: x is its own patch matrix, no im2col needed."""
    return (g.Kh, g.Kw, g.sh, g.sw, g.ph, g.pw) == (1, 1, 1, 1, 0, 0)


def _samples_per_block(g):
    """Samples per block: about _BLOCK_ROWS output pixels, at most _BLOCK_ELEMENTS patch values."""
    patch_elements = g.C * g.Kh * g.Kw * g.Ho * g.Wo
    by_size = _BLOCK_ELEMENTS // max(1, patch_elements)
    by_rows = _BLOCK_ROWS // (g.Ho * g.Wo)
    return max(1, min(g.N, by_size, by_rows))


def _blocks(g):
    """(start, count) of each block of samples; the last block may be shorter."""
    step = _samples_per_block(g)
    return [(start, min(step, g.N - start)) for start in range(0, g.N, step)]


def _window(i, j, g):
    """Index, in a (n, Hp, Wp, C) array, of the input pixels that kernel offset (i, j) meets."""
    rows = slice(i, i + g.sh * (g.Ho - 1) + 1, g.sh)
    cols = slice(j, j + g.sw * (g.Wo - 1) + 1, g.sw)
    return (slice(None), rows, cols, slice(None))


def _filter_matrix(w):
    """w (F, C, Kh, Kw) as the (Kh*Kw*C, F) matrix that multiplies pixel patches."""
    F, C, Kh, Kw = w.shape
    return w.transpose(2, 3, 1, 0).reshape(Kh * Kw * C, F)


def _channel_major(a, start, n, out):
    """Samples start..start+n of a (N, K, Hs, Ws), copied into `out` as a (K, n*Hs*Ws) matrix.

    The block's samples stand side by side in each row, so that one GEMM sums over all of them;
    the copy moves whole contiguous (Hs, Ws) planes. `out` has room for at least n samples.
    """
    K, P = a.shape[1], a.shape[2] * a.shape[3]
    target = out[:, :n * P].reshape(K, n, P)
    target[...] = a[start:start + n].reshape(n, K, P).transpose(1, 0, 2)
    return target.reshape(K, n * P)


def _spread_planes(xp, shape, dtype):
    """A zeroed (n, C, Hp, Wp) array whose (Hp, Wp) planes lie an odd number of cache lines apart.

    Transposing to channel-last reads one value from each of C planes in turn; planes a multiple
    of 4 KiB apart (32x32 float32, for one) all fall into the same L1 cache sets and evict each
    other, which makes the transposition 5-10 times slower.
    """
    n, C, Hp, Wp = shape
    itemsize = xp.dtype(dtype).itemsize
    lines = -(-Hp * Wp * itemsize // _CACHE_LINE_BYTES)  # rounded up
    lines += 1 - lines % 2
    storage = xp.zeros((n, C, lines * _CACHE_LINE_BYTES // itemsize), dtype)
    return storage[:, :, :Hp * Wp].reshape(shape)


def _pixel_patches(x, g, xp):
    """Yield (start, n, patches) over the blocks of samples of x (N, C, H, W).

    patches: (n*Ho*Wo, Kh*Kw*C), one row per output pixel of the block, holding the input values
    its kernel window covers in (kernel row, kernel column, channel) order, so that
    patches @ _filter_matrix(w) is the convolution. With OpenBLAS, GEMMs on these pixel rows run
    near peak even for F = 64, where the classic (C*Kh*Kw, Ho*Wo) columns lose 15-25%.
    The buffers are reused from block to block: consume each block before asking for the next.
    """
    blocks = _blocks(g)
    step = blocks[0][1] if blocks else 0
    if _is_pointwise(g):
        # The patches are x itself, pixel-major: a transposed view of its channel-major copy
        # (that copy moves whole rows of H*W values, a transposing one would not).
        x_by_channel = xp.empty((g.C, step * g.H * g.W), x.dtype)
        for start, n in blocks:
            yield start, n, _channel_major(x, start, n, x_by_channel).T
        return
    Hp, Wp = g.H + 2 * g.ph, g.W + 2 * g.pw
    padded = _spread_planes(xp, (step, g.C, Hp, Wp), x.dtype)  # the border stays zero
    channel_last = xp.empty((step, Hp, Wp, g.C), x.dtype)
    patches = xp.empty((step, g.Ho, g.Wo, g.Kh, g.Kw * g.C), x.dtype)
    # In channel-last layout the Kw*C values of one kernel row are contiguous, so one strided
    # view, (sample, output row, output column, kernel row, Kw*C), holds all the patches and a
    # single copy gathers them (nine separate window copies cost twice as much for 3x3).
    item = channel_last.itemsize
    row, column = Wp * g.C * item, g.C * item
    window_strides = (Hp * row, g.sh * row, g.sw * column, row, item)
    for start, n in blocks:
        padded[:n, :, g.ph:g.ph + g.H, g.pw:g.pw + g.W] = x[start:start + n]
        channel_last[:n] = padded[:n].transpose(0, 2, 3, 1)
        windows = xp.lib.stride_tricks.as_strided(channel_last, patches[:n].shape, window_strides)
        patches[:n] = windows
        yield start, n, patches[:n].reshape(n * g.Ho * g.Wo, g.Kh * g.Kw * g.C)


def conv2d_forward(x, w, b=None, stride=1, padding=0):
    """y (N, F, Ho, Wo) = x (N, C, H, W) cross-correlated with w (F, C, Kh, Kw), plus b (F,).

    stride and padding: an int or a pair (rows, columns); padding adds zeros. The dtype of y is
    that of x and w combined (float32 stays float32). With C = 0, y is b broadcast (or zeros).
    """
    _require_ndim4(x, "x", "(N, C, H, W)")
    _require_ndim4(w, "w", "(F, C, Kh, Kw)")
    g = conv_geometry(x.shape, w.shape, stride, padding)
    if b is not None and tuple(getattr(b, "shape", ())) != (g.F,):
        raise ValueError(
            f"b must have shape ({g.F},) to match the F={g.F} filters of w, got shape "
            f"{getattr(b, 'shape', None)!r}"
        )
    xp = get_array_module(x, w)
    dtype = xp.result_type(x.dtype, w.dtype)
    x = xp.ascontiguousarray(x, dtype=dtype)
    filter_matrix = xp.ascontiguousarray(_filter_matrix(w.astype(dtype, copy=False)))
    y = xp.empty((g.N, g.F, g.Ho * g.Wo), dtype)
    if _is_pointwise(g):
        # Each sample's (C, H*W) slab of x is its patch matrix: no copy, y comes out in place.
        xp.matmul(filter_matrix.T, x.reshape(g.N, g.C, g.H * g.W), out=y)
    else:
        pixel_major = xp.empty((_samples_per_block(g) * g.Ho * g.Wo, g.F), dtype)
        for start, n, patches in _pixel_patches(x, g, xp):
            rows = pixel_major[:n * g.Ho * g.Wo]
            xp.matmul(patches, filter_matrix, out=rows)
            y[start:start + n] = rows.reshape(n, g.Ho * g.Wo, g.F).transpose(0, 2, 1)
    if b is not None:
        y += xp.asarray(b, dtype=dtype).reshape(g.F, 1)
    return y.reshape(g.N, g.F, g.Ho, g.Wo)


def conv2d_backward_data(dy, w, x_shape, stride=1, padding=0):
    """dx (N, C, H, W): the gradient of the loss with respect to x, from dy (N, F, Ho, Wo).

    x_shape is needed because with a stride > 1 several input sizes give the same output size.
    Input positions that no output position reads (stride > 1) get zero gradient.
    """
    _require_ndim4(w, "w", "(F, C, Kh, Kw)")
    g = conv_geometry(x_shape, w.shape, stride, padding)
    _require_dy(dy, g)
    xp = get_array_module(dy, w)
    dtype = xp.result_type(dy.dtype, w.dtype)
    if g.N * g.C * g.H * g.W == 0:
        return xp.zeros((g.N, g.C, g.H, g.W), dtype)
    w = w.astype(dtype, copy=False)
    if (g.sh, g.sw) == (1, 1):
        return _full_convolution(dy.astype(dtype, copy=False), w, g)
    return _col2im_backward_data(xp.ascontiguousarray(dy, dtype=dtype), w, g)


def _full_convolution(dy, w, g):
    """Stride-1 dx as a forward convolution: dy padded by K-1-p (cropped where p > K-1) and
    correlated with w flipped in space, its C and F swapped. This reuses the forward's cheap
    im2col copies instead of col2im's overlapping adds."""
    xp = get_array_module(dy, w)
    pad_h, pad_w = g.Kh - 1 - g.ph, g.Kw - 1 - g.pw
    # A padding larger than the kernel made output pixels that see only zeros: their dy
    # reaches no input, so those rows and columns are cropped instead of padded.
    crop_h, crop_w = max(0, -pad_h), max(0, -pad_w)
    dy = dy[:, :, crop_h:g.Ho - crop_h, crop_w:g.Wo - crop_w]
    flipped = xp.ascontiguousarray(w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3))
    return conv2d_forward(dy, flipped, padding=(max(0, pad_h), max(0, pad_w)))


def _col2im_backward_data(dy, w, g):
    """dx for any stride: the patch gradients dy^T @ _filter_matrix(w)^T of each sample, added
    back (col2im) at the input pixels their patches were taken from."""
    xp = get_array_module(dy, w)
    filter_matrix_t = _filter_matrix(w).T  # (F, Kh*Kw*C) view
    step = _samples_per_block(g)
    patch_grads = xp.empty((step, g.Ho, g.Wo, g.Kh, g.Kw, g.C), dy.dtype)
    channel_last = xp.empty((step, g.H + 2 * g.ph, g.W + 2 * g.pw, g.C), dy.dtype)
    dx = xp.empty((g.N, g.C, g.H, g.W), dy.dtype)
    for start, n in _blocks(g):
        xp.matmul(
            dy[start:start + n].reshape(n, g.F, g.Ho * g.Wo).transpose(0, 2, 1),
            filter_matrix_t,
            out=patch_grads[:n].reshape(n, g.Ho * g.Wo, g.Kh * g.Kw * g.C),
        )
        # col2im: every kernel offset adds its patch gradients back where its patches came from
        # (overlapping windows accumulate), then the padding border is dropped.
        target = channel_last[:n]
        target.fill(0)
        for i in range(g.Kh):
            for j in range(g.Kw):
                target[_window(i, j, g)] += patch_grads[:n, :, :, i, j, :]
        interior = target[:, g.ph:g.ph + g.H, g.pw:g.pw + g.W, :]
        dx[start:start + n] = interior.transpose(0, 3, 1, 2)
    return dx


def conv2d_backward_filter(x, dy, w_shape, stride=1, padding=0):
    """dw (F, C, Kh, Kw): the gradient of the loss with respect to w, from x and dy (N, F, Ho, Wo).

    w_shape gives the kernel size (Kh, Kw). With N = 0, dw is zeros.
    """
    _require_ndim4(x, "x", "(N, C, H, W)")
    g = conv_geometry(x.shape, w_shape, stride, padding)
    _require_dy(dy, g)
    xp = get_array_module(x, dy)
    dtype = xp.result_type(x.dtype, dy.dtype)
    x = xp.ascontiguousarray(x, dtype=dtype)
    dy = xp.ascontiguousarray(dy, dtype=dtype)
    # dw as (F, Kh*Kw*C) = sum over blocks of dy_block @ patches, one GEMM per block whose inner
    # dimension runs over all the block's output pixels.
    dw_matrix = xp.zeros((g.F, g.Kh * g.Kw * g.C), dtype)
    product = xp.empty_like(dw_matrix)
    dy_by_filter = xp.empty((g.F, _samples_per_block(g) * g.Ho * g.Wo), dtype)
    for start, n, patches in _pixel_patches(x, g, xp):
        dy_block = _channel_major(dy, start, n, dy_by_filter)  # (F, n*Ho*Wo)
        xp.matmul(dy_block, patches, out=product)
        dw_matrix += product
    dw = dw_matrix.reshape(g.F, g.Kh, g.Kw, g.C).transpose(0, 3, 1, 2)
    return xp.ascontiguousarray(dw)


def conv2d_backward_bias(dy):
    """db (F,) = dy (N, F, Ho, Wo) summed over samples and output positions."""
    _require_ndim4(dy, "dy", "(N, F, Ho, Wo)")
    xp = get_array_module(dy)
    N, F, Ho, Wo = dy.shape
    return xp.ascontiguousarray(dy).reshape(N, F, Ho * Wo).sum(axis=2).sum(axis=0)
