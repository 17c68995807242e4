"""Filter-major columns, for layers whose filters outweigh their pixels (few output pixels: one
sample of a 7x7 or 14x14 image, a rank's small block; many filters) and for layers with few
channels (a network's first layer, on 1 or 3 channels of a large image).

Why: im2col's pixel-major patches (kernels/conv/im2col.py) need the filters as (Kh Kw C, F)
matrices, and backward-data's full convolution as flipped ones: copies of all F C Kh Kw
weights, transposed, in every pass. Where the outputs are few those copies cost more than the
GEMMs: on a 1x512x512x7x7 3x3 layer (AMD EPYC guest) 5.8 ms a copy against 3.5 ms for the
forward's GEMM, 20 of the three passes' 32 ms. Here the patches are the classic columns, one
row a (channel, kernel row, kernel column), one column an output pixel: (C Kh Kw, Ho Wo), the
order of w's own (F, C, Kh, Kw) values, so that every pass reads the filters where they lie
and BLAS transposes them itself:

    forward          y (F, Ho Wo)          = w (F, C Kh Kw) @ columns
    backward-filter  dw (F, C Kh Kw)       = dy (F, Ho Wo) @ columns^T
    backward-data    dcolumns (C Kh Kw, ..) = w^T @ dy, added back at the input pixels (col2im)

Two forms of it, two entries of the path table (kernels/conv/paths.py):

- "columns", where N Ho Wo <= F: the columns of all N samples side by side, one matrix
  (C Kh Kw, N Ho Wo), so that the weights are streamed once a pass, not once a sample. It
  holds C Kh Kw N Ho Wo values, at most what the filters hold.
- "columns-per-sample", where C <= FEW_CHANNELS: one (C Kh Kw, Ho Wo) matrix a sample, in
  blocks of samples, each GEMM writing straight into its sample of y (N, F, Ho, Wo). With
  few channels, Winograd's and im2col's GEMMs are C or C Kh Kw deep and memory bound, and
  their pixel-major products are transposed into NCHW afterwards; here the GEMM's long side
  is the image and y is written once where it lies.

One group only; any kernel, stride and dilation.
"""
from cfp.kernels import workspace
from cfp.kernels.conv import im2col
from cfp.kernels.conv.geometry import padded_size

# A layer takes filter-major columns where its output pixels N Ho Wo are at most this many a
# filter. Measured against the paths before (three passes, float32, AMD EPYC guest): 3x3
# layers of 512 channels on 7x7, 1, 2, 4 and 8 samples (pixels 0.1 to 0.77 a filter), took
# 0.25, 0.47, 0.65 and 1.00 of the time; 1x256x256x14x14 (0.77) 0.70, 2x256x256x14x14 (1.5)
# 0.98, 1x128x128x28x28 (6.1) 1.50; 1x1 layers 1x2048x512x7x7 0.48, 1x1024x256x14x14 0.86,
# 4x1024x256x14x14 (3.1) 1.05; 1x512x512x14x14 at stride 2 0.48.
_PIXELS_PER_FILTER = 1.0


def applies(g, dtype):
    """One group, something to compute, and output pixels N Ho Wo at most _PIXELS_PER_FILTER F:
    the filters' copies, C Kh Kw F values each, then outweigh the patches' C Kh Kw N Ho Wo."""
    return g.G == 1 and g.N * g.C * g.F * g.Ho * g.Wo > 0 and g.N * g.Ho * g.Wo <= _PIXELS_PER_FILTER * g.F


# A layer of one group takes per-sample columns where it has at most this many channels.
# Measured against the paths before (three passes, float32, AMD EPYC guest; Winograd F(4x4)
# or im2col): 1x1x64x256x256 3x3 0.17 of the time, 1x3x64x224x224 3x3 0.35, 32x3x64x32x32 0.38,
# 1x3x64x224x224 7x7 stride 2 0.49; 8x4x64x64x64 0.41, 8 channels 0.61-0.64, 16 channels
# 1.09-1.11, 32 channels 1.67: from 16 channels on, the other paths' GEMMs are deep enough.
FEW_CHANNELS = 8
# Column values a block of samples holds at most (4 MiB in float32); a block has at least one.
_BLOCK_VALUES = 1 << 20


def per_sample_applies(g, dtype):
    """One group, something to compute, and at most FEW_CHANNELS input channels."""
    return g.G == 1 and g.N * g.C * g.F * g.Ho * g.Wo > 0 and g.C <= FEW_CHANNELS


def _samples_per_block(g):
    return max(1, min(g.N, _BLOCK_VALUES // (g.C * g.Kh * g.Kw * g.Ho * g.Wo)))


class _SampleColumns:
    """The per-sample columns of blocks of x's samples, (n, C Kh Kw, Ho Wo), in two workspace
    buffers made once a call (its padded input, its columns) and refilled for each block. A 1x1
    stride-1 layer without padding is its own columns: x itself."""

    def __init__(self, x, g, xp):
        self.x, self.g, self.xp = x, g, xp
        self.own = im2col.is_own_patches(g)
        if not self.own:
            n = _samples_per_block(g)
            Hp, Wp = padded_size(g)
            self.padded = workspace.zeros(xp, (n, g.C, Hp, Wp), x.dtype)  # its border stays zero
            self.columns = workspace.empty(xp, (n, g.C, g.Kh, g.Kw, g.Ho, g.Wo), x.dtype)

    def __call__(self, block):
        g, x = self.g, self.x[block]
        n = x.shape[0]
        if self.own:
            return x.reshape(n, g.C, g.H * g.W)
        padded, columns = self.padded[:n], self.columns[:n]
        padded[:, :, g.pt:g.pt + g.H, g.pl:g.pl + g.W] = x
        columns[...] = _windows(padded, g, self.xp)
        return columns.reshape(n, g.C * g.Kh * g.Kw, g.Ho * g.Wo)


def _windows(padded, g, xp):
    """The windows of padded (n, C, Hp, Wp), a view (n, C, Kh, Kw, Ho, Wo): [s, c, i, j] is
    the plane of the values kernel offset (i, j) of channel c meets at each output pixel."""
    n, C, Hp, Wp = padded.shape
    item = padded.itemsize
    strides = (C * Hp * Wp * item, Hp * Wp * item, g.dh * Wp * item, g.dw * item, g.sh * Wp * item, g.sw * item)
    return xp.lib.stride_tricks.as_strided(padded, (n, C, g.Kh, g.Kw, g.Ho, g.Wo), strides)


def _blocks(g):
    n = _samples_per_block(g)
    return [slice(s, min(s + n, g.N)) for s in range(0, g.N, n)]


def per_sample_forward(x, w, g, xp, y):
    """y[n] (F, Ho Wo) = w (F, C Kh Kw) @ the columns of sample n, for blocks of samples."""
    columns = _SampleColumns(x, g, xp)
    filters = w.reshape(g.F, g.C * g.Kh * g.Kw)
    out = y.reshape(g.N, g.F, g.Ho * g.Wo)
    for block in _blocks(g):
        xp.matmul(filters, columns(block), out=out[block])


def per_sample_backward_filter(x, dy, g, xp):
    """dw (F, C, Kh, Kw): the sum over samples of dy[n] (F, Ho Wo) @ the columns of n, transposed."""
    columns = _SampleColumns(x, g, xp)
    dw = xp.zeros((g.F, g.C * g.Kh * g.Kw), x.dtype)
    parts = workspace.empty(xp, (_samples_per_block(g), g.F, g.C * g.Kh * g.Kw), x.dtype)
    grads = dy.reshape(g.N, g.F, g.Ho * g.Wo)
    for block in _blocks(g):
        part = columns(block)
        part = xp.matmul(grads[block], part.transpose(0, 2, 1), out=parts[:part.shape[0]])
        dw += part.sum(axis=0)
    return dw.reshape(g.F, g.C, g.Kh, g.Kw)


def per_sample_backward_data(dy, w, g, xp):
    """dx (N, C, H, W): for each block of samples, the columns' gradients w^T @ dy[n], each
    kernel offset's rows added back at the input pixels they were read from (_add_back)."""
    dx = xp.empty((g.N, g.C, g.H, g.W), dy.dtype)
    n = _samples_per_block(g)
    filters = w.reshape(g.F, g.C * g.Kh * g.Kw).T
    grads = dy.reshape(g.N, g.F, g.Ho * g.Wo)
    if im2col.is_own_patches(g):  # the columns are x: their gradients are dx
        for block in _blocks(g):
            xp.matmul(filters, grads[block], out=dx[block].reshape(-1, g.C, g.H * g.W))
        return dx
    Hp, Wp = padded_size(g)
    columns = workspace.empty(xp, (n, g.C, g.Kh, g.Kw, g.Ho, g.Wo), dy.dtype)
    padded = workspace.empty(xp, (n, g.C, Hp, Wp), dy.dtype)
    for block in _blocks(g):
        b = block.stop - block.start
        xp.matmul(filters, grads[block], out=columns[:b].reshape(b, g.C * g.Kh * g.Kw, g.Ho * g.Wo))
        _add_back(columns[:b], g, padded[:b])
        dx[block] = padded[:b, :, g.pt:g.pt + g.H, g.pl:g.pl + g.W]
    return dx


def _add_back(grads, g, padded):
    """padded (n, C, Hp, Wp) = the column gradients grads (n, C, Kh, Kw, Ho, Wo) added at the
    padded input pixels each kernel offset read (overlapping windows accumulate)."""
    padded[...] = 0
    for i in range(g.Kh):
        rows = slice(i * g.dh, i * g.dh + g.sh * (g.Ho - 1) + 1, g.sh)
        for j in range(g.Kw):
            cols = slice(j * g.dw, j * g.dw + g.sw * (g.Wo - 1) + 1, g.sw)
            padded[:, :, rows, cols] += grads[:, :, i, j]


def _columns(x, g, xp):
    """x (N, C, H, W) as its (C Kh Kw, N Ho Wo) columns: row (c, i, j) holds, for each output
    pixel, the input value kernel offset (i, j) of channel c meets there (zero in the padding).
    One sample of a 1x1 stride-1 layer without padding is its own columns: x itself."""
    if g.N == 1 and im2col.is_own_patches(g):
        return x.reshape(g.C, g.H * g.W)
    padded = workspace.zeros(xp, (g.N, g.C) + padded_size(g), x.dtype)
    padded[:, :, g.pt:g.pt + g.H, g.pl:g.pl + g.W] = x
    columns = workspace.empty(xp, (g.C, g.Kh, g.Kw, g.N, g.Ho, g.Wo), x.dtype)
    columns[...] = _windows(padded, g, xp).transpose(1, 2, 3, 0, 4, 5)
    return columns.reshape(g.C * g.Kh * g.Kw, g.N * g.Ho * g.Wo)


def _by_filter(a, g, xp):
    """a (N, F, Ho, Wo) as (F, N Ho Wo): a view for one sample, else a copy in the workspace."""
    if g.N == 1:
        return a.reshape(g.F, g.Ho * g.Wo)
    out = workspace.empty(xp, (g.F, g.N, g.Ho * g.Wo), a.dtype)
    out[...] = a.reshape(g.N, g.F, g.Ho * g.Wo).transpose(1, 0, 2)
    return out.reshape(g.F, g.N * g.Ho * g.Wo)


def forward(x, w, g, xp, y):
    """y (N, F, Ho, Wo) = w (F, C Kh Kw) @ the columns of x, straight into y for one sample."""
    columns = _columns(x, g, xp)
    filters = w.reshape(g.F, g.C * g.Kh * g.Kw)
    if g.N == 1:
        xp.matmul(filters, columns, out=y.reshape(g.F, g.Ho * g.Wo))
        return
    out = workspace.empty(xp, (g.F, g.N, g.Ho * g.Wo), x.dtype)
    xp.matmul(filters, columns, out=out.reshape(g.F, g.N * g.Ho * g.Wo))
    y.reshape(g.N, g.F, g.Ho * g.Wo)[...] = out.transpose(1, 0, 2)


def backward_filter(x, dy, g, xp):
    """dw (F, C, Kh, Kw) = dy (F, N Ho Wo) @ the columns of x, transposed: in w's layout."""
    columns = _columns(x, g, xp)
    dw = xp.empty((g.F, g.C, g.Kh, g.Kw), x.dtype)
    xp.matmul(_by_filter(dy, g, xp), columns.T, out=dw.reshape(g.F, g.C * g.Kh * g.Kw))
    return dw


def backward_data(dy, w, g, xp):
    """dx (N, C, H, W): the columns' gradients w^T @ dy (F, N Ho Wo), each kernel offset's rows
    added back at the input pixels they were read from (overlapping windows accumulate), the
    padding border dropped."""
    Hp, Wp = padded_size(g)
    grads = workspace.empty(xp, (g.C, g.Kh, g.Kw, g.N, g.Ho, g.Wo), dy.dtype)
    xp.matmul(w.reshape(g.F, g.C * g.Kh * g.Kw).T, _by_filter(dy, g, xp),
              out=grads.reshape(g.C * g.Kh * g.Kw, g.N * g.Ho * g.Wo))
    # a fresh array (the result itself where there is no padding), not the workspace's
    padded = xp.empty((g.N, g.C, Hp, Wp), dy.dtype)
    _add_back(grads.transpose(3, 0, 1, 2, 4, 5), g, padded)
    if (Hp, Wp) == (g.H, g.W):
        return padded
    return xp.ascontiguousarray(padded[:, :, g.pt:g.pt + g.H, g.pl:g.pl + g.W])
