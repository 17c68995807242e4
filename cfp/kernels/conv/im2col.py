"""im2col + GEMM, the path every layer can take, and the pointwise (1x1) GEMMs.

How im2col is fast (measured with OpenBLAS, see BENCHMARKS.md): the patches are built pixel-major,
one row of Kh*Kw*C values per output pixel, because GEMMs with those rows run near the BLAS peak
even when F is small; samples go through in blocks whose patches are still in cache when the
GEMM reads them (the patches of a whole mini-batch would be Kh*Kw times the size of x); the
stride-1 backward-data pass is a forward convolution (kernels/conv/paths.py), so only strided
layers take col2im. Pointwise layers need no patches: x is its own patch matrix, or at a stride
the pixels the stride keeps, copied once.
"""
from cfp.kernels import workspace
from cfp.kernels.conv.geometry import padded_size

# A block of samples holds about this many output pixels: the rows of the forward GEMM and the
# inner dimension of the backward-filter GEMM. OpenBLAS runs near its peak from about 512 on;
# more only makes the buffers larger.
_BLOCK_ROWS = 1024
# ...and at most this many patch values (4 MiB in float32), so the patches written by the copy
# are still in cache (L2/L3) when the GEMM reads them.
_BLOCK_ELEMENTS = 1 << 20
_CACHE_LINE_BYTES = 64


def pointwise_applies(g, dtype):
    """1x1 kernel, no padding, one group: x is its own patch matrix, no im2col needed; at a
    stride, the pixels the stride keeps are (a ResNet's strided shortcut)."""
    return (g.Kh, g.Kw, g.pt, g.pb, g.pl, g.pr, g.G) == (1, 1, 0, 0, 0, 0, 1)


def is_own_patches(g):
    """A pointwise layer at stride 1: x (N, C, H, W) is, as it lies, its patch matrix."""
    return pointwise_applies(g, None) and (g.sh, g.sw) == (1, 1)



def _samples_per_block(g):
    """Samples per block: about _BLOCK_ROWS output pixels, at most _BLOCK_ELEMENTS patch values."""
    patch_elements = g.C * g.Kh * g.Kw * g.Ho * g.Wo
    by_size = _BLOCK_ELEMENTS // max(1, patch_elements)
    by_rows = _BLOCK_ROWS // max(1, g.Ho * g.Wo)
    return max(1, min(g.N, by_size, by_rows))


def _blocks(g):
    """(start, count) of each block of samples; the last block may be shorter."""
    step = _samples_per_block(g)
    return [(start, min(step, g.N - start)) for start in range(0, g.N, step)]



def _window(i, j, g):
    """Index, in a (n, Hp, Wp, ...) array, of the input pixels that kernel offset (i, j) meets."""
    rows = slice(i * g.dh, i * g.dh + g.sh * (g.Ho - 1) + 1, g.sh)
    cols = slice(j * g.dw, j * g.dw + g.sw * (g.Wo - 1) + 1, g.sw)
    return (slice(None), rows, cols)


def filter_matrices(w, G):
    """w (F, C/G, Kh, Kw) as G matrices (G, Kh*Kw*C/G, F/G) that multiply pixel patches."""
    F, Cg, Kh, Kw = w.shape
    return w.reshape(G, F // G, Cg, Kh, Kw).transpose(0, 3, 4, 2, 1).reshape(G, Kh * Kw * Cg, F // G)


def _channel_major(a, start, n, out):
    """Samples start..start+n of a (N, K, Hs, Ws), copied into `out` as a (K, n*Hs*Ws) matrix.

    The block's samples stand side by side in each row, so that one GEMM sums over all of them;
    the copy moves whole contiguous (Hs, Ws) planes. `out` has room for at least n samples.
    """
    K, P = a.shape[1], a.shape[2] * a.shape[3]
    target = out[:, :n * P].reshape(K, n, P)
    target[...] = a[start:start + n].reshape(n, K, P).transpose(1, 0, 2)
    return target.reshape(K, n * P)


def spread_planes(xp, shape, dtype, interior):
    """An (n, C, Hp, Wp) temporary whose (Hp, Wp) planes lie an odd number of cache lines apart,
    zero outside `interior` = (top, left, height, width), the window of every plane that the
    caller writes before it reads (only the frame is zeroed: measured against zeroing whole
    planes, 0.99-1.00 of the time of 3x3 layers' three passes).

    Transposing to channel-last reads one value from each of C planes in turn; planes a multiple
    of 4 KiB apart (32x32 float32, for one) all fall into the same L1 cache sets and evict each
    other, which makes the transposition 5-10 times slower.
    """
    n, C, Hp, Wp = shape
    plane = spread_plane_size(Hp, Wp, xp.dtype(dtype).itemsize)
    planes = workspace.empty(xp, (n, C, plane), dtype)[:, :, :Hp * Wp].reshape(shape)
    top, left, height, width = interior
    bottom, right = top + height, left + width
    planes[:, :, :top] = 0
    planes[:, :, bottom:] = 0
    planes[:, :, top:bottom, :left] = 0
    planes[:, :, top:bottom, right:] = 0
    return planes


def spread_plane_size(Hp, Wp, itemsize):
    """Values from one plane of spread_planes to the next: Hp*Wp rounded up to an odd number of
    cache lines."""
    lines = -(-Hp * Wp * itemsize // _CACHE_LINE_BYTES)  # rounded up
    lines += 1 - lines % 2
    return lines * _CACHE_LINE_BYTES // itemsize




def pixel_patches(x, g, xp):
    """Yield (start, n, patches) over the blocks of samples of x (N, C, H, W).

    patches: (G, n*Ho*Wo, Kh*Kw*C/G), for each group one row per output pixel of the block,
    holding the input values its kernel window covers in (kernel row, kernel column, channel)
    order, so that patches @ filter_matrices(w) is the convolution. With OpenBLAS, GEMMs on
    these pixel rows run near peak even for F = 64, where the classic (C*Kh*Kw, Ho*Wo) columns
    lose 15-25%. The buffers are reused from block to block: consume each block before asking
    for the next. x is zero-padded here (other padding modes are applied before). Pointwise
    layers (pointwise_applies) need no patches: their callers multiply x itself (is_own_patches)
    or the pixels a stride keeps.
    """
    blocks = _blocks(g)
    step = blocks[0][1] if blocks else 0
    Hp, Wp = padded_size(g)
    G, Cg = g.G, g.C // g.G
    padded = spread_planes(xp, (step, g.C, Hp, Wp), x.dtype, (g.pt, g.pl, g.H, g.W))  # the border stays zero
    # Channel-last within each group, (sample, group, row, column, channel of the group): a
    # kernel row's Kw*Cg values are then contiguous (without dilation), and one strided view,
    # (group, sample, output row, output column, kernel row, kernel column, channel), holds all
    # the patches, which a single copy gathers in runs of Kw*Cg values (nine separate window
    # copies cost twice as much for 3x3).
    channel_last = workspace.empty(xp, (step, G, Hp, Wp, Cg), x.dtype)
    per_sample = g.Ho * g.Wo * g.Kh * g.Kw * Cg
    patches = workspace.empty(xp, (G, step * per_sample), x.dtype)  # sliced per block: views, never copies
    item = channel_last.itemsize
    row, column = Wp * Cg * item, Cg * item
    window_strides = (Hp * row, G * Hp * row, g.sh * row, g.sw * column, g.dh * row, g.dw * column, item)
    for start, n in blocks:
        padded[:n, :, g.pt:g.pt + g.H, g.pl:g.pl + g.W] = x[start:start + n]
        channel_last[:n] = padded[:n].reshape(n, G, Cg, Hp, Wp).transpose(0, 1, 3, 4, 2)
        shape = (G, n, g.Ho, g.Wo, g.Kh, g.Kw, Cg)
        target = patches[:, :n * per_sample]
        target.reshape(shape)[...] = xp.lib.stride_tricks.as_strided(channel_last, shape, window_strides)
        yield start, n, target.reshape(G, n * g.Ho * g.Wo, g.Kh * g.Kw * Cg)


# Plane columns, for stride-1 layers with narrow groups: the pixel-row patches above are copied in
# runs of Kw*C/G values, 24 for a 3x3 layer with 8 channels a group, and those short copies cost
# twice the GEMM. Here a block of samples stands as one tall image, each sample's padded rows
# below the last one's, every row R = max(W, Wo) wide, each channel one flat run of values; the
# output is computed at every position of it. Kernel offset (i, j) of every output is then
# the same shift of the flat runs, i*dh*R + j*dw: Kw copies of the block shifted by j*dw make,
# for each kernel row i, one (C/G*Kw, outputs) matrix (rows (channel, j)), a view i*dh*R
# further on, with Kw times less copying than im2col (a GEMM each, or one for all). The left
# and right padding is not stored: where a shifted run would cross a row's end into the next
# row, copy j is not written and stays zero, which the padding holds.
# Outputs at the Hp - Ho rows that straddle two samples, and at columns Wo..R-1, are computed and


def forward(x, w, g, xp, y):
    """y (N, F, Ho, Wo) by im2col: for each block of samples, its pixel patches times the
    filter matrices, one GEMM a group."""
    Fg = g.F // g.G
    filters = workspace.empty(xp, (g.G, g.Kh * g.Kw * g.C // g.G, Fg), x.dtype)
    filters[...] = filter_matrices(w, g.G)
    pixel_major = workspace.empty(xp, (g.G, _samples_per_block(g) * g.Ho * g.Wo, Fg), x.dtype)
    for start, n, patches in pixel_patches(x, g, xp):
        rows = pixel_major[:, :n * g.Ho * g.Wo]
        xp.matmul(patches, filters, out=rows)
        y[start:start + n].reshape(n, g.G, Fg, g.Ho * g.Wo)[...] = \
            rows.reshape(g.G, n, g.Ho * g.Wo, Fg).transpose(1, 0, 3, 2)


def backward_filter(x, dy, g, xp):
    """dw (F, C/G, Kh, Kw) as (G, F/G, Kh*Kw*C/G) = the sum over blocks of dy_block @ patches,
    one GEMM per block and group whose inner dimension runs over all the block's output pixels."""
    G, Fg, Cg = g.G, g.F // g.G, g.C // g.G
    dw_matrix = xp.zeros((G, Fg, g.Kh * g.Kw * Cg), x.dtype)
    product = workspace.empty(xp, dw_matrix.shape, x.dtype)
    dy_by_filter = workspace.empty(xp, (g.F, _samples_per_block(g) * g.Ho * g.Wo), x.dtype)
    for start, n, patches in pixel_patches(x, g, xp):
        dy_block = _channel_major(dy, start, n, dy_by_filter).reshape(G, Fg, n * g.Ho * g.Wo)
        xp.matmul(dy_block, patches, out=product)
        dw_matrix += product
    dw = dw_matrix.reshape(G, Fg, g.Kh, g.Kw, Cg).transpose(0, 1, 4, 2, 3)
    return xp.ascontiguousarray(dw.reshape(g.F, Cg, g.Kh, g.Kw))


def flipped_filters(w, g, xp):
    """The filters (F, C/G, Kh, Kw) of a layer flipped in space, C and F swapped within each
    group: (C, F/G, Kh, Kw), those of its backward-data's full convolution, whose geometry g
    is (its C is the layer's F)."""
    G, Fg, Cg = g.G, g.C // g.G, g.F // g.G  # the layer's F/G and C/G
    flipped = workspace.empty(xp, (g.F, Fg, g.Kh, g.Kw), w.dtype)
    flipped.reshape(G, Cg, Fg, g.Kh, g.Kw)[...] = \
        w[:, :, ::-1, ::-1].reshape(G, Fg, Cg, g.Kh, g.Kw).transpose(0, 2, 1, 3, 4)
    return flipped


def col2im_backward_data(dy, w, g, xp):
    """dx for any stride: the patch gradients dy^T @ filter_matrices(w)^T of each sample and
    group, added back (col2im) at the input pixels their patches were taken from."""
    G, Fg, Cg = g.G, g.F // g.G, g.C // g.G
    filters_t = filter_matrices(w, G).transpose(0, 2, 1)  # (G, F/G, Kh*Kw*C/G) view
    step = _samples_per_block(g)
    Hp, Wp = padded_size(g)
    rows_per_sample, row = g.Ho * g.Wo, g.Kh * g.Kw * Cg
    patch_grads = workspace.empty(xp, (G, step * rows_per_sample * row), dy.dtype)  # sliced per block: views
    channel_last = workspace.empty(xp, (step, Hp, Wp, G, Cg), dy.dtype)
    dx = xp.empty((g.N, g.C, g.H, g.W), dy.dtype)
    for start, n in _blocks(g):
        flat = patch_grads[:, :n * rows_per_sample * row]
        grads = flat.reshape(G, n, g.Ho, g.Wo, g.Kh, g.Kw, Cg)
        dy_block = dy[start:start + n].reshape(n, G, Fg, rows_per_sample).transpose(1, 0, 3, 2)
        xp.matmul(dy_block.reshape(G, n * rows_per_sample, Fg), filters_t,
                  out=flat.reshape(G, n * rows_per_sample, row))
        # col2im: every kernel offset adds its patch gradients back where its patches came from
        # (overlapping windows accumulate), then the padding border is dropped.
        target = channel_last[:n]
        target.fill(0)
        for i in range(g.Kh):
            for j in range(g.Kw):
                target[_window(i, j, g)] += grads[:, :, :, :, i, j, :].transpose(1, 2, 3, 0, 4)
        interior = target[:, g.pt:g.pt + g.H, g.pl:g.pl + g.W].reshape(n, g.H, g.W, g.C)
        dx[start:start + n] = interior.transpose(0, 3, 1, 2)
    return dx




def _kept_pixels(x, g, xp):
    """x (N, C, H, W) itself at stride 1; at a stride, the (N, C, Ho, Wo) pixels the stride
    keeps, copied into a workspace buffer (one pass over x, against im2col's copy of patches
    of one value, channel-last, and its transpose back)."""
    if is_own_patches(g):
        return x
    kept = workspace.empty(xp, (g.N, g.C, g.Ho, g.Wo), x.dtype)
    kept[...] = x[:, :, ::g.sh, ::g.sw]
    return kept


def pointwise_forward(x, w, g, xp, y):
    """y (N, F, Ho, Wo) of a 1x1 layer: each sample's (C, Ho*Wo) slab of the kept pixels is its
    patch matrix, so no patches are built and y comes out in place."""
    kept = _kept_pixels(x, g, xp)
    xp.matmul(filter_matrices(w, 1)[0].T, kept.reshape(g.N, g.C, g.Ho * g.Wo), out=y.reshape(g.N, g.F, g.Ho * g.Wo))


def pointwise_backward_data(dy, w, g, xp):
    """dx (N, C, H, W) of a strided 1x1 layer: w^T (C, F) @ dy_n (F, Ho*Wo) at the pixels the
    stride kept, zero at the others. (At stride 1 the full convolution computes it, the same
    GEMM.)"""
    kept = workspace.empty(xp, (g.N, g.C, g.Ho * g.Wo), dy.dtype)
    xp.matmul(w.reshape(g.F, g.C).T, dy.reshape(g.N, g.F, g.Ho * g.Wo), out=kept)
    dx = xp.zeros((g.N, g.C, g.H, g.W), dy.dtype)
    dx[:, :, ::g.sh, ::g.sw] = kept.reshape(g.N, g.C, g.Ho, g.Wo)
    return dx


def pointwise_backward_filter(x, dy, g, xp):
    """dw (F, C, 1, 1) = the sum over samples of dy_n (F, Ho*Wo) @ x_n^T (Ho*Wo, C) over the kept
    pixels, or dw^T = the sum of x_n @ dy_n^T: BLAS reads the second operand transposed, so
    neither tensor is copied (but for the stride's kept pixels). The one whose result has
    max(C, F) rows is the faster (measured 20% on 1x1 layers 256 -> 64 and 64 -> 256 channels,
    16x16)."""
    kept = _kept_pixels(x, g, xp)
    P = g.Ho * g.Wo
    rows, columns = (dy, kept) if g.F >= g.C else (kept, dy)
    total = workspace.zeros(xp, (rows.shape[1], columns.shape[1]), x.dtype)
    product = workspace.empty(xp, total.shape, x.dtype)
    for n in range(g.N):
        xp.matmul(rows[n].reshape(total.shape[0], P), columns[n].reshape(total.shape[1], P).T, out=product)
        total += product
    dw = total if g.F >= g.C else total.T
    return dw.copy().reshape(g.F, g.C, 1, 1)  # a fresh array, not the workspace's
