"""Depthwise layers (one input channel a group, F = k C) as banded GEMMs on residue classes of
rows: forward, backward-data and backward-filter.
"""
from cfp.kernels import workspace


def applies(g, dtype):
    """One input channel per group (depthwise, with a channel multiplier F / C): banded GEMMs,
    one a residue class of output rows, beat a GEMM per group."""
    return g.G > 1 and g.C == g.G


def backward_data_applies(g, dtype):
    """A strided depthwise layer, or one with a multiplier, takes the banded backward-data; a
    stride-1 one without (F = C) takes the full convolution (kernels/conv/paths.py), a depthwise
    forward whose GEMMs are the long ones (K = eh*Wi, where the transposed product has K = k*Ws)."""
    return applies(g, dtype) and ((g.sh, g.sw) != (1, 1) or g.F != g.C)


# Depthwise layers (one input channel a group; F = k C with a channel multiplier k) as banded
# GEMMs. A depthwise layer has no sum over channels, so im2col's GEMM has nothing to reduce; but
# along one output row it is a product with a banded (Toeplitz) matrix. Cut each channel's
# output into strips Ws = _BAND_COLUMNS columns wide (one strip for Wo <= Ws); a strip reads
# Wi = (Ws - 1) sw + dw (Kw - 1) + 1 input columns of eh = dh (Kh - 1) + 1 consecutive input
# rows. Those eh rows of Wi values, one after the other, are one row of eh*Wi values, and
#     output row of a strip (k*Ws values) = that row @ T_c (eh*Wi, k*Ws),
# T_c holding filter (c, m)'s tap (i, j) at [i dh Wi + v sw + j dw, m Ws + v] for each output
# column v, zero elsewhere. A block's input is laid out a channel and strip at a time, its
# samples' rows one under the other, Wi wide, with zero rows between samples (at least
# max(pt, pb), and a sample's period P a multiple of sh) and zero columns where a strip reads
# padding. The row for output row q then starts at row q*sh of the buffer: rows of the patch
# matrix are runs of the buffer eh*Wi long, sh*Wi apart. BLAS needs rows at least as far apart
# as they are long, so the output rows are taken in m = ceil(eh / sh) residue classes, q = s
# mod m, each one GEMM over an as_strided view of the buffer: no patch is copied. Outputs at
# the rows between samples and the columns past Wo are computed and dropped.
# The GEMMs multiply eh*Wi values per output where Kh*Kw are needed (48 against 9 on the 16x16
# 3x3 benchmark layer), at BLAS speed: the three passes of that layer took 12.2 ms where the
# flat kernel before them, 17 NumPy passes over a block a pass, took 16.3 ms (BENCHMARKS.md).
# Backward-filter is the transposed product, for each kernel row the rows it read^T @ dy's rows,
# whose band holds dw; backward-data is dy's rows @ T_c^T added back at the rows' runs (no
# scatter), then the strips' overlapping columns added into dx.
_BAND_COLUMNS = 16  # output columns of a strip
_BAND_ELEMENTS = 1 << 17  # input values of a block's strips (512 KiB in float32: with the outputs, in L2)


class _DepthwiseBands:
    """The banded GEMMs of a depthwise layer: blocks() of (samples, channels); input_strips()
    and output_strips() pair a block of x or dx, y or dy with where its buffer holds it, which
    load() x, store() y and load_grads() dy copy; patches(s) and rows(s) the residue class s
    of both, read(i) the input rows kernel row i reads, each batched over the block's
    (channel, strip) pairs; filters(w) the T_c of every strip and taps(dT) dw. Buffers are
    reused from block to block: consume one before asking for the next."""

    def __init__(self, g, xp, dtype):
        self.g, self.xp = g, xp
        self.k = g.F // g.C
        self.eh = g.dh * (g.Kh - 1) + 1  # input rows of a band
        self.Ws = min(g.Wo, _BAND_COLUMNS)  # Wo >= 1: conv_geometry refuses a kernel wider than the padded input
        self.strips = -(-g.Wo // self.Ws)
        if self.strips == 1:  # x's own columns: T leaves out the taps that read padding
            self.Wi, self.left = g.W, 0
        else:  # a strip's columns, the padding's zeros included
            self.Wi, self.left = (self.Ws - 1) * g.sw + g.dw * (g.Kw - 1) + 1, g.pl
        self.Hgo = max(g.Ho, -(-(g.H + max(g.pt, g.pb)) // g.sh))  # output rows a sample
        self.P = self.Hgo * g.sh  # input rows a sample: H of x, then zeros
        self.m = -(-self.eh // g.sh)  # residue classes of output rows: GEMMs a block
        per_sample = max(1, self.strips * self.P * self.Wi)  # x may have no columns (Wi = W = 0)
        self.n = max(1, min(g.N, _BAND_ELEMENTS // per_sample))
        self.c = max(1, min(g.C, _BAND_ELEMENTS // (self.n * per_sample)))
        self.Q = -(-self.n * self.Hgo // self.m)  # output rows a class (a whole block)
        rows = max(g.pt + self.n * self.P, (self.Q * self.m - 1) * g.sh + self.eh)
        # what a load does not write, the padding and the rows between samples, stays zero
        self.input = workspace.zeros(xp, (self.c, self.strips, rows, self.Wi), dtype)
        self.output = workspace.zeros(xp, (self.c, self.strips, self.Q * self.m, self.k * self.Ws), dtype)
        # the GEMMs' operands batched over (channel, strip) pairs, made once: a block takes
        # the first c*strips of them
        pairs = self.c * self.strips
        self._inputs = self.input.reshape(pairs, rows, self.Wi)
        self._outputs = self.output.reshape(pairs, self.Q * self.m, self.k * self.Ws)
        item, step = self.input.itemsize, self.m * g.sh * self.Wi
        self._classes = [xp.lib.stride_tricks.as_strided(
            self._inputs[:, s * g.sh:], (pairs, self.Q, self.eh * self.Wi),
            (self._inputs.strides[0], step * item, item)) for s in range(self.m)]

    def blocks(self):
        """(start, n, c0, c, Q): samples start..start+n, channels c0..c0+c, Q rows a class."""
        g = self.g
        for start in range(0, g.N, self.n):
            n = min(self.n, g.N - start)
            for c0 in range(0, g.C, self.c):
                yield start, n, c0, min(self.c, g.C - c0), -(-n * self.Hgo // self.m)

    def pairs(self, c0, c):
        """The (channel, strip) pairs of channels c0..c0+c, as a slice of filters()."""
        return slice(c0 * self.strips, (c0 + c) * self.strips)

    def input_strips(self, a, start, n, c0, c):
        """For each strip, (the columns of a's block it reads, (n, c, H, w)) and (where the input
        buffer holds them, the same shape): a is x or dx (N, C, H, W), each sample at buffer
        rows pt + p*P."""
        g = self.g
        block = a[start:start + n, c0:c0 + c]
        planes = self.input[:c, :, g.pt:g.pt + n * self.P].reshape(c, self.strips, n, self.P, self.Wi)
        for strip in range(self.strips):
            left = strip * self.Ws * g.sw - self.left  # a's column at the strip's first
            first, last = max(0, left), min(g.W, left + self.Wi)
            if first < last:
                held = planes[:, strip, :, :g.H, first - left:last - left]
                yield block[..., first:last], held.transpose(1, 0, 2, 3)

    def output_strips(self, a, start, n, c0, c):
        """For each strip, (its columns of a's block, (n, c, k, Ho, w)) and (where the output
        buffer holds them, the same shape): a is y or dy (N, F, Ho, Wo)."""
        g = self.g
        block = a[start:start + n].reshape(n, g.C, self.k, g.Ho, g.Wo)[:, c0:c0 + c]
        out = self.output[:c, :, :n * self.Hgo].reshape(c, self.strips, n, self.Hgo, self.k, self.Ws)
        for strip in range(self.strips):
            first = strip * self.Ws
            width = min(self.Ws, g.Wo - first)
            yield block[..., first:first + width], out[:, strip, :, :g.Ho, :, :width].transpose(1, 0, 3, 2, 4)

    def load(self, x, start, n, c0, c):
        """x's block (n samples, c channels) into the input buffer."""
        for part, held in self.input_strips(x, start, n, c0, c):
            held[...] = part

    def store(self, y, start, n, c0, c):
        """The block's outputs, cropped, into y (N, F, Ho, Wo)."""
        for part, held in self.output_strips(y, start, n, c0, c):
            part[...] = held

    def load_grads(self, dy, start, n, c0, c):
        """dy's block into the output buffer, zero at every row and column of its samples that is
        not an output. (Rows past the samples, which the last classes of a shorter block reach,
        keep an earlier block's values: what they give lands past the samples' rows, unread.)"""
        for part, held in self.output_strips(dy, start, n, c0, c):
            held[...] = part

    def patches(self, s, c, Q):
        """Class s of the block's patch rows, (c*strips, Q, eh*Wi): output rows s, s+m, ...,
        each the eh input rows from row q*sh, as a view of the input buffer."""
        return self._classes[s][:c * self.strips, :Q]

    def read(self, i, c, rows):
        """The input rows kernel row i reads for the block's first `rows` output rows (output
        row q reads row q*sh + i*dh), (c*strips, rows, Wi), a view."""
        g = self.g
        return self._inputs[:c * self.strips, i * g.dh:i * g.dh + rows * g.sh:g.sh]

    def rows(self, s, c, Q):
        """Class s of the output buffer's rows, (c*strips, Q, k*Ws)."""
        return self._outputs[:c * self.strips, s:s + Q * self.m:self.m]

    def outputs(self, c, rows):
        """The output buffer's first `rows` rows, (c*strips, rows, k*Ws)."""
        return self._outputs[:c * self.strips, :rows]

    def _band(self, j):
        """(v0, v1, u0): the output columns v0..v1-1 of a strip whose kernel column j reads a
        column of the buffer (of x or of stored padding), and the column u0 that v0 reads; column
        v reads u0 + (v - v0) sw. (v0 = v1 where the tap reads padding only.)"""
        g = self.g
        offset = j * g.dw - g.pl + self.left  # the column output column 0 reads
        v0 = min(self.Ws, max(0, -(-(-offset) // g.sw)))
        v1 = max(v0, min(self.Ws, -(-(self.Wi - offset) // g.sw)))
        return v0, v1, v0 * g.sw + offset

    def _diagonal(self, band, i, j, m):
        """The entries of tap (i, j) of multiplier m in a band (pairs, eh or Kh, Wi, k, Ws) as a
        strided view (pairs, count): entry [u, m, v] lies at u*k*Ws + m*Ws + v of a row's
        values, and the tap's lie (sw*k*Ws + 1) apart."""
        v0, v1, u0 = self._band(j)
        kWs = self.k * self.Ws
        flat = band.reshape(band.shape[0], band.shape[1], -1)[:, i]
        start, step = u0 * kWs + m * self.Ws + v0, self.g.sw * kWs + 1
        return flat[:, start:start + (v1 - v0 - 1) * step + 1:step] if v1 > v0 else flat[:, :0]

    def filters(self, w):
        """T (C*strips, eh*Wi, k*Ws): T_c of every channel, once for each of its strips."""
        g, xp = self.g, self.xp
        T = workspace.zeros(xp, (g.C, self.strips, self.eh, self.Wi, self.k, self.Ws), w.dtype)
        taps = w.reshape(g.C, self.k, g.Kh, g.Kw)
        band = T[:, 0]
        for i in range(g.Kh):
            for j in range(g.Kw):
                for m in range(self.k):
                    self._diagonal(band, i * g.dh, j, m)[...] = taps[:, m, i, j, None]
        T[:, 1:] = band[:, None]
        return T.reshape(g.C * self.strips, self.eh * self.Wi, self.k * self.Ws)

    def taps(self, dT):
        """dw (F, 1, Kh, Kw) from dT (Kh, C*strips, Wi, k*Ws), kernel row i's input columns times
        output columns: the band, summed over strips and output columns."""
        g, xp = self.g, self.xp
        dT = dT.reshape(g.Kh, g.C, self.strips, self.Wi * self.k * self.Ws).sum(axis=2)
        band = dT.transpose(1, 0, 2)  # (C, Kh, values)
        dw = xp.empty((g.C, self.k, g.Kh, g.Kw), dT.dtype)
        for i in range(g.Kh):
            for j in range(g.Kw):
                for m in range(self.k):
                    dw[:, m, i, j] = self._diagonal(band, i, j, m).sum(axis=1)
        return dw.reshape(g.F, 1, g.Kh, g.Kw)


def forward(x, w, g, xp, y):
    """Depthwise y (N, F, Ho, Wo), F = k C: output channel c*k + m is input channel c
    correlated with filter c*k + m, m GEMMs a block. A dilated layer's band has rows that no
    tap reads (dh - 1 of every dh), which the GEMMs would multiply by zeros: it takes one
    GEMM a kernel row instead (K = Wi), their products summed (measured 20% faster at dilation
    2; undilated, the one long GEMM a class is the faster)."""
    bands = _DepthwiseBands(g, xp, x.dtype)
    T = bands.filters(w)
    by_rows = g.dh > 1 and g.Kh > 1
    if by_rows:
        T_rows = T.reshape(T.shape[0], bands.eh, bands.Wi, bands.k * bands.Ws)
        term = workspace.empty(xp, bands.output.shape, x.dtype).reshape(bands._outputs.shape)
    for start, n, c0, c, Q in bands.blocks():
        bands.load(x, start, n, c0, c)
        pairs = bands.pairs(c0, c)
        if by_rows:
            rows = n * bands.Hgo
            total = bands.outputs(c, rows)
            for i in range(g.Kh):
                product = xp.matmul(bands.read(i, c, rows), T_rows[pairs, i * g.dh],
                                    out=term[:total.shape[0], :rows] if i else total)
                if i:
                    total += product
        else:
            for s in range(bands.m):
                xp.matmul(bands.patches(s, c, Q), T[pairs], out=bands.rows(s, c, Q))
        bands.store(y, start, n, c0, c)


def backward_filter(x, dy, g, xp):
    """Depthwise dw (F, 1, Kh, Kw): for each kernel row i, dT_i = the input rows it read,
    transposed, times dy's rows (one GEMM over all the block's rows, where a class's patch rows
    would split them in m), summed over blocks, strips and output columns: dw is dT's band."""
    bands = _DepthwiseBands(g, xp, x.dtype)
    dT = workspace.zeros(xp, (g.Kh, g.C * bands.strips, bands.Wi, bands.k * bands.Ws), x.dtype)
    product = workspace.empty(xp, (bands.c * bands.strips,) + dT.shape[2:], x.dtype)
    for start, n, c0, c, Q in bands.blocks():
        bands.load(x, start, n, c0, c)
        bands.load_grads(dy, start, n, c0, c)
        rows, pairs = n * bands.Hgo, bands.pairs(c0, c)
        for i in range(g.Kh):
            dT[i, pairs] += xp.matmul(bands.read(i, c, rows).transpose(0, 2, 1), bands.outputs(c, rows),
                                      out=product[:c * bands.strips])
    return bands.taps(dT)


def backward_data(dy, w, g, xp):
    """Depthwise dx (N, C, H, W): each class's dy rows @ T_c^T added back at the runs its patch
    rows were read from, then each strip's columns added into dx."""
    bands = _DepthwiseBands(g, xp, dy.dtype)
    T_t = bands.filters(w).transpose(0, 2, 1)
    grads = workspace.empty(xp, (bands.c * bands.strips, bands.Q, bands.eh * bands.Wi), dy.dtype)
    dx = xp.zeros((g.N, g.C, g.H, g.W), dy.dtype)
    for start, n, c0, c, Q in bands.blocks():
        bands.load_grads(dy, start, n, c0, c)
        bands.input[:c] = 0
        pairs = bands.pairs(c0, c)
        for s in range(bands.m):
            # the rows of one class do not overlap (m*sh >= eh), so the view takes += safely
            bands.patches(s, c, Q)[...] += xp.matmul(bands.rows(s, c, Q), T_t[pairs],
                                                     out=grads[:c * bands.strips, :Q])
        for part, held in bands.input_strips(dx, start, n, c0, c):
            part += held  # strips overlap by their halo
    return dx
