"""Plane columns, for stride-1 layers with narrow groups (grouped layers that are not
depthwise): shifted copies of a block's tall image, a GEMM a kernel row or one for all.
"""
import time

import numpy as np

from cfp.kernels import settings, workspace
from cfp.kernels.conv.geometry import padded_size

# Plane columns, for stride-1 layers with narrow groups: im2col's pixel-row patches are copied in
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
# dropped. With one sample a block and R = Wo (a 'same' or 'valid' layer), the GEMMs write y.
_PLANE_RUN = 64  # below this Kw*C/G, stride-1 layers go by plane columns
_PLANE_ELEMENTS = 1 << 18  # values of a block's copies (1 MiB in float32: they stay in cache)


def applies(g, dtype):
    return (g.sh, g.sw) == (1, 1) and g.Kw * (g.C // g.G) < _PLANE_RUN and g.N * g.C * g.F > 0


class _PlaneColumns:
    """Blocks of samples of x (N, C, H, W) as shifted copies of their tall image, tall (G,
    C/G*Kw, step*Hp*R), rows (channel, kernel column): for each kernel row i, columns(tall, i, L)
    holds at column (s*Hp + h)*R + w the values that kernel row i meets for the output at
    (h, w) of sample start + s; L = outputs(n) = ((n - 1)*Hp + Ho)*R, and kernel row i's
    columns are the copies read i*shift further on. The buffers are reused: consume a block
    before the next."""

    def __init__(self, x, g, xp):
        self.x, self.g, self.xp = x, g, xp
        self.R = R = max(g.W, g.Wo)
        self.Hp = padded_size(g)[0]
        self.rows = (g.C // g.G) * g.Kw
        self.shift = g.dh * R  # from one kernel row's columns to the next one's
        # whole samples, at most _PLANE_ELEMENTS values in the copies
        self.step = max(1, min(g.N, _PLANE_ELEMENTS // (g.Kw * g.C * self.Hp * R)))
        # what x does not fill, the padding and the wrapped reads, stays zero
        self.shifted = workspace.zeros(xp, (g.C, g.Kw, self.step * self.Hp * R), x.dtype)

    def outputs(self, n):
        """L: the tall image's output positions for a block of n samples."""
        return ((n - 1) * self.Hp + self.g.Ho) * self.R

    def in_place(self, n):
        """A block of one sample with rows Wo wide: its outputs are laid out as y[start] (and dy)."""
        return n == 1 and self.R == self.g.Wo

    def columns(self, tall, i, L):
        """Kernel row i's (G, C/G*Kw, L) matrix of a block's copies, a view."""
        return tall[:, :, i * self.shift:i * self.shift + L]

    def blocks(self):
        """(start, n, tall) for each block of n samples, tall the block's copies."""
        g, R, Hp = self.g, self.R, self.Hp
        by_group = self.shifted.reshape(g.G, self.rows, -1)
        for start in range(0, g.N, self.step):
            n = min(self.step, g.N - start)
            x = self.x[start:start + n].transpose(1, 0, 2, 3)
            for j in range(g.Kw):
                # copy j holds at column w of a row what kernel column j reads there: x's column
                # w + j*dw - pl, or zero outside 0..W-1 (the padding, or a read past the row's end)
                shift = g.pl - j * g.dw
                first, last = max(0, shift), min(R, g.W + shift)
                if first >= last:
                    continue
                rows = self.shifted[:, j, :n * Hp * R].reshape(g.C, n, Hp, R)
                if R == g.W:
                    # rows as wide as x's: a sample's H rows are one run of x shifted by `shift`
                    # values (runs of H*W values, not of W), whose reads past a row's end are
                    # then zeroed (measured on the grouped benchmark layer: its copies 2.95
                    # against 3.6 ms by rows, its three passes 22.7 against 25.0 ms)
                    flat = rows[:, :, g.pt:g.pt + g.H].reshape(g.C, n, g.H * R)
                    lo, hi = max(0, shift), g.H * g.W + min(0, shift)
                    flat[..., lo:hi] = x.reshape(g.C, n, g.H * g.W)[..., lo - shift:hi - shift]
                    rows[:, :, g.pt:g.pt + g.H, :first] = 0
                    rows[:, :, g.pt:g.pt + g.H, last:] = 0
                else:
                    rows[:, :, g.pt:g.pt + g.H, first:last] = x[..., first - shift:last - shift]
            yield start, n, by_group


# The plane forward's two forms, which make the same products and sum them in the same order:
# a GEMM a kernel row, or the kernel rows stacked into one GEMM (its filters' rows are (kernel
# row, filter); kernel row i's products are read i*shift further on and summed). Which is faster
# depends on the machine's BLAS: on the Zen 3 guest stacking was 3-23% faster for few filters a
# group and a deep enough product ((F/G, C/G*Kw) = (8, 24), (4, 12), (2, 24)) and 9-39% slower
# otherwise; on an AVX-512 Intel guest, where GEMMs of 8 rows already run at 145 GF/s, it was
# never faster, 36% slower on the grouped benchmark layer (BENCHMARKS.md). So by default
# (the setting plane_stacking = None, cfp/kernels/settings.py) the forward measures: the first
# time a process meets a geometry and dtype it times its first block both ways, twice in turns,
# and keeps the faster form for that geometry (the settings' plane_forms). plane_stacking = True
# or False (CFP_PLANE_STACKING=1 or 0) fixes the form; CuPy arrays take a GEMM a kernel row (not
# measured: their calls return before the device has run them).
_MEASURE_ROUNDS = 2


def _plane_form(g, dtype, xp):
    """Whether the plane forward of geometry g stacks its kernel rows: never with one kernel
    row, as the setting plane_stacking says where it is set, a GEMM a kernel row on CuPy, else
    what was measured for g and dtype, or None if nothing was (above)."""
    chosen = settings.current()
    if g.Kh == 1:
        return False
    if chosen.plane_stacking is not None:
        return chosen.plane_stacking
    if xp is not np:
        return False
    return chosen.plane_forms.get((g, str(dtype)))


def _measure_plane_form(g, dtype, seconds):
    """The faster form for g and dtype, seconds(stacked) timing one block of it: the least of
    _MEASURE_ROUNDS timings each, taken in turns; kept for the rest of the process."""
    best = {True: float("inf"), False: float("inf")}
    for _ in range(_MEASURE_ROUNDS):
        for stacked in best:
            best[stacked] = min(best[stacked], seconds(stacked))
    settings.current().plane_forms[(g, str(dtype))] = stacked = best[True] < best[False]
    return stacked


def forward(x, w, g, xp, y):
    """y (N, F, Ho, Wo) by plane columns: for each kernel row its filters times its columns,
    summed, cropped to the outputs (or written straight into y for one sample Wo wide). Where
    it is the faster form (above), one GEMM a block gives every kernel row's products: the
    filters have a row for each (kernel row, filter), times the copies' columns that any kernel
    row reads, and kernel row i's products are read i*shift further on."""
    planes = _PlaneColumns(x, g, xp)
    G, Fg, Kh, shift = g.G, g.F // g.G, g.Kh, planes.shift
    # filters (G, Kh, F/G, C/G*Kw): columns (channel, kernel column)
    filters = workspace.empty(xp, (G, Kh, Fg, g.C // G, g.Kw), x.dtype)
    filters[...] = w.reshape(G, Fg, g.C // G, Kh, g.Kw).transpose(0, 3, 1, 2, 4)
    filters = filters.reshape(G, Kh, Fg, planes.rows)
    widest, reach = planes.outputs(planes.step), (Kh - 1) * shift
    out = workspace.empty(xp, g.F * widest, x.dtype)

    def room(stacked):
        """Values of a block's products: the stacked form's are Kh times more, each reach longer."""
        return g.F * (Kh * (widest + reach) if stacked else widest)

    def block(stacked, tall, L, total, products):
        """total (G, F/G, L) = the block's outputs at the tall image's positions."""
        if stacked:
            span = L + reach
            rows = xp.matmul(filters.reshape(G, Kh * Fg, planes.rows), tall[:, :, :span],
                             out=products[:g.F * Kh * span].reshape(G, Kh * Fg, span)).reshape(G, Kh, Fg, span)
            xp.add(rows[:, 0, :, :L], rows[:, 1, :, shift:shift + L], out=total)
            for i in range(2, Kh):
                xp.add(total, rows[:, i, :, i * shift:i * shift + L], out=total)
        else:
            term = products[:g.F * L].reshape(G, Fg, L)
            xp.matmul(filters[:, 0], planes.columns(tall, 0, L), out=total)
            for i in range(1, Kh):
                xp.add(total, xp.matmul(filters[:, i], planes.columns(tall, i, L), out=term), out=total)

    stacked = _plane_form(g, x.dtype, xp)
    products = None if stacked is None else workspace.empty(xp, room(stacked), x.dtype)
    for start, n, tall in planes.blocks():
        L = planes.outputs(n)
        direct = planes.in_place(n)
        total = y[start].reshape(G, Fg, L) if direct else out[:g.F * L].reshape(G, Fg, L)
        if products is None:
            # measured on the first block, in room for either form outside the workspace (which
            # then holds only what the faster form needs)
            scratch = xp.empty(room(True), x.dtype)
            stacked = _measure_plane_form(g, x.dtype, lambda form: _seconds(block, form, tall, L, total, scratch))
            products = workspace.empty(xp, room(stacked), x.dtype)
        block(stacked, tall, L, total, products)
        if not direct:
            # sample s's outputs: Ho rows from row s*Hp of the tall image, R columns each
            item, R = total.itemsize, planes.R
            samples = xp.lib.stride_tricks.as_strided(
                total, (g.F, n, g.Ho, R), (L * item, planes.Hp * R * item, R * item, item))
            y[start:start + n] = samples[..., :g.Wo].transpose(1, 0, 2, 3)


def _seconds(f, *args):
    """Seconds that f(*args) took."""
    begin = time.perf_counter()
    f(*args)
    return time.perf_counter() - begin


def backward_filter(x, dy, g, xp):
    """dw (F, C/G, Kh, Kw) by plane columns: dy laid out on the tall image's outputs (zero at the
    positions that are not outputs); for each kernel row, its columns times dy transposed,
    summed over the blocks. That product is dw^T (C/G*Kw rows, F/G columns), not dw: the same
    operands, and measured 8-23% faster on six of seven grouped layers on the Zen 3 guest, level
    on the seventh, and level on the Intel guest (BENCHMARKS.md)."""
    planes = _PlaneColumns(x, g, xp)
    G, Fg, R = g.G, g.F // g.G, planes.R
    dy_tall = workspace.zeros(xp, (g.F, planes.step * planes.Hp, R), x.dtype)
    dw = xp.zeros((g.Kh, G, planes.rows, Fg), x.dtype)
    product = workspace.empty(xp, (G, planes.rows, Fg), x.dtype)
    for start, n, tall in planes.blocks():
        L = planes.outputs(n)
        if planes.in_place(n):
            block = dy[start].reshape(G, Fg, L)
        else:
            dy_tall.reshape(g.F, planes.step, planes.Hp, R)[:, :n, :g.Ho, :g.Wo] = dy[start:start + n].transpose(1, 0, 2, 3)
            block = dy_tall.reshape(g.F, -1)[:, :L].reshape(G, Fg, L)
        for i in range(g.Kh):
            xp.matmul(planes.columns(tall, i, L), block.transpose(0, 2, 1), out=product)
            dw[i] += product
    # (Kh, G, C/G, Kw, F/G) -> (F, C/G, Kh, Kw)
    dw = dw.reshape(g.Kh, G, g.C // G, g.Kw, Fg).transpose(1, 4, 2, 0, 3)
    return xp.ascontiguousarray(dw).reshape(g.F, g.C // G, g.Kh, g.Kw)
