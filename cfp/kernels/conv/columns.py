"""Filter-major columns, for layers whose filters outweigh their pixels: few output pixels (one
sample of a 7x7 or 14x14 image, a rank's small block) and many filters.

Why: im2col's pixel-major patches (kernels/conv/im2col.py) need the filters as (Kh Kw C, F)
matrices, and backward-data's full convolution as flipped ones: copies of all F C Kh Kw
weights, transposed, in every pass. Where the outputs are few those copies cost more than the
GEMMs: on a 1x512x512x7x7 3x3 layer (AMD EPYC guest) 5.8 ms a copy against 3.5 ms for the
forward's GEMM, 20 of the three passes' 32 ms. Here the patches are the classic columns, one
row a (channel, kernel row, kernel column), one column an output pixel: (C Kh Kw, N Ho Wo),
the order of w's own (F, C, Kh, Kw) values, so that every pass reads the filters where they
lie and BLAS transposes them itself:

    forward          y (F, N Ho Wo)         = w (F, C Kh Kw) @ columns
    backward-filter  dw (F, C Kh Kw)        = dy (F, N Ho Wo) @ columns^T
    backward-data    dcolumns (C Kh Kw, ..) = w^T @ dy, added back at the input pixels (col2im)

The columns of all N samples are one matrix (no blocks: it holds C Kh Kw N Ho Wo values, at most
what the filters hold, since the path is taken only where N Ho Wo <= F). One group only;
any kernel, stride and dilation.
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


def _columns(x, g, xp):
    """x (N, C, H, W) as its (C Kh Kw, N Ho Wo) columns: row (c, i, j) holds, for each output
    pixel, the input value kernel offset (i, j) of channel c meets there (zero in the padding).
    One sample of a 1x1 stride-1 layer without padding is its own columns: x itself."""
    if g.N == 1 and im2col.pointwise_applies(g, x.dtype):
        return x.reshape(g.C, g.H * g.W)
    Hp, Wp = padded_size(g)
    padded = workspace.zeros(xp, (g.N, g.C, Hp, Wp), x.dtype)
    padded[:, :, g.pt:g.pt + g.H, g.pl:g.pl + g.W] = x
    item = padded.itemsize
    shape = (g.C, g.Kh, g.Kw, g.N, g.Ho, g.Wo)
    strides = (Hp * Wp * item, g.dh * Wp * item, g.dw * item, g.C * Hp * Wp * item, g.sh * Wp * item, g.sw * item)
    columns = workspace.empty(xp, shape, x.dtype)
    columns[...] = xp.lib.stride_tricks.as_strided(padded, shape, strides)
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
    padded = xp.zeros((g.N, g.C, Hp, Wp), dy.dtype)
    for i in range(g.Kh):
        rows = slice(i * g.dh, i * g.dh + g.sh * (g.Ho - 1) + 1, g.sh)
        for j in range(g.Kw):
            cols = slice(j * g.dw, j * g.dw + g.sw * (g.Wo - 1) + 1, g.sw)
            padded[:, :, rows, cols] += grads[:, i, j].transpose(1, 0, 2, 3)
    if (Hp, Wp) == (g.H, g.W):
        return padded
    return xp.ascontiguousarray(padded[:, :, g.pt:g.pt + g.H, g.pl:g.pl + g.W])
