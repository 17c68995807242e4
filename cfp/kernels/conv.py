"""Fast local 2-D convolution on NCHW blocks: forward, backward-data, backward-filter, bias.

GEMM-based kernels on the arrays of one rank (NumPy or CuPy); no MPI here, cfp.algorithms moves
data. Which path a layer takes depends only on its geometry (docs/design.md, section 3c):
pointwise GEMMs for 1x1 layers; Winograd F(4x4, 3x3) for float32 3x3 stride-1 ungrouped layers
(dilated ones by residue-class sub-grids); banded GEMMs on residue classes of rows for
depthwise layers; plane columns (shifted copies of a tall image, a GEMM a kernel row or one for
all, whichever the process measured faster) for stride-1 layers with narrow groups; pixel-major
im2col + GEMM for everything else.

Shapes: x (N, C, H, W), w (F, C, Kh, Kw), b (F,), y and dy (N, F, Ho, Wo) with
Ho = (H + 2 ph - Kh) // sh + 1 and Wo = (W + 2 pw - Kw) // sw + 1 (zero padding). Any of N, C, F
may be 0: channel and filter shards of a distributed layer can be empty.

How im2col is fast (measured with OpenBLAS, see BENCHMARKS.md): the patches are built pixel-major,
one row of Kh*Kw*C values per output pixel, because GEMMs with those rows run near the BLAS peak
even when F is small; samples go through in blocks whose patches are still in cache when the
GEMM reads them (the patches of a whole mini-batch would be Kh*Kw times the size of x); the
stride-1 backward-data pass is a forward convolution, so it needs no col2im.
"""
import functools
import operator
import os
import time
from collections import namedtuple

from cfp.backend import get_array_module
from cfp.kernels import workspace
from cfp.checks import float_dtype, int_pair, positive_int


def _switch(variable):
    """A kernel switch read from the environment: '1' on (True), '0' off (False), unset or empty
    None (cfp chooses); any other value is refused, never taken as one of those."""
    value = os.environ.get(variable, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{variable}={value!r}: expected '1' (on), '0' (off) or unset (cfp chooses)")
    return {"1": True, "0": False}.get(value)


# A block of samples holds about this many output pixels: the rows of the forward GEMM and the
# inner dimension of the backward-filter GEMM. OpenBLAS runs near its peak from about 512 on;
# more only makes the buffers larger.
_BLOCK_ROWS = 1024
# ...and at most this many patch values (4 MiB in float32), so the patches written by the copy
# are still in cache (L2/L3) when the GEMM reads them.
_BLOCK_ELEMENTS = 1 << 20
_CACHE_LINE_BYTES = 64

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")

ConvGeometry = namedtuple(
    "ConvGeometry", "N C H W F Kh Kw sh sw pt pb pl pr dh dw G mode Ho Wo", module=__name__
)
ConvGeometry.__doc__ = """Sizes of one convolution: input (N, C, H, W), kernel (F, C/G, Kh, Kw),
stride (sh, sw), padding top, bottom, left, right (pt, pb, pl, pr), dilation (dh, dw), groups G,
padding mode, and output (Ho, Wo)."""


def _shape4(shape, name, layout):
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise ValueError(f"{name} must be a 4-D shape {layout}, got {shape!r}") from None
    if len(dims) != 4 or min(dims) < 0:
        raise ValueError(f"{name} must be 4-D {layout}, got shape {tuple(shape)!r}")
    return dims


def _padding(padding, kernel, dilation, stride):
    """(top, bottom, left, right) from an int, a pair, 'valid' or 'same' (PyTorch's meaning:
    the output as large as the input at stride 1; with an even kernel the extra row and column
    go to the bottom and the right)."""
    if isinstance(padding, str):
        if padding == "valid":
            return 0, 0, 0, 0
        if padding != "same":
            raise ValueError(f"padding {padding!r} is not one of 'valid', 'same', an integer or a pair")
        if stride != (1, 1):
            raise ValueError(f"padding 'same' is not supported for strided convolutions (stride={stride})")
        out = []
        for k, d in zip(kernel, dilation):
            total = d * (k - 1)
            out += [total // 2, total - total // 2]
        return tuple(out)
    if isinstance(padding, (tuple, list)) and len(padding) == 4:  # cfp's own: (top, bottom, left, right)
        sides = tuple(int_pair(padding[i:i + 2], "padding", 0, "non-negative integers") for i in (0, 2))
        return sides[0] + sides[1]
    ph, pw = int_pair(padding, "padding", 0, "a non-negative integer, a pair, 'same' or 'valid'")
    return ph, ph, pw, pw


def conv_options(stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """The convolution's options checked without shapes and put in one form: stride and
    dilation pairs, padding a pair or 'same' / 'valid', groups, padding_mode. What a layer
    checks when it is made, before it sees an input."""
    stride = int_pair(stride, "stride", 1, "a positive integer")
    dilation = int_pair(dilation, "dilation", 1, "a positive integer")
    groups = positive_int(groups, "groups")
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"padding_mode {padding_mode!r} is not one of {', '.join(PADDING_MODES)}")
    if isinstance(padding, (tuple, list)) and len(padding) == 4:
        padding = _padding(padding, (1, 1), dilation, stride)
    elif not isinstance(padding, str):
        padding = int_pair(padding, "padding", 0, "a non-negative integer, a pair, 'same' or 'valid'")
    else:
        _padding(padding, (1, 1), dilation, stride)  # the string's own checks
    return {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups,
            "padding_mode": padding_mode}


def conv_geometry(x_shape, w_shape, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """The ConvGeometry of x_shape (N, C, H, W) convolved with w_shape (F, C/groups, Kh, Kw),
    with PyTorch's nn.Conv2d meanings of stride, padding, dilation, groups and padding_mode.

    Raises ValueError, naming the bad value, for everything PyTorch rejects: a shape that is not
    4-D, channels that do not match, groups that do not divide C and F, a non-positive stride or
    dilation, a negative or unknown padding, 'same' with a stride, an unknown padding mode, a
    reflection wider than the input or a wrap-around more than once, or a kernel larger than
    the padded input.
    """
    N, C, H, W = _shape4(x_shape, "x", "(N, C, H, W)")
    F, Cw, Kh, Kw = _shape4(w_shape, "w", "(F, C / groups, Kh, Kw)")
    G = positive_int(groups, "groups")
    if C % G or F % G:
        raise ValueError(f"groups={G} must divide the input channels C={C} and the filters F={F}")
    if C // G != Cw:
        grouped = f" ({C} channels in {G} groups)" if G > 1 else ""
        raise ValueError(
            f"x has C={C} channels but w expects {Cw * G}{grouped} (w.shape={tuple(w_shape)})"
        )
    sh, sw = int_pair(stride, "stride", 1, "a positive integer")
    dh, dw = int_pair(dilation, "dilation", 1, "a positive integer")
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"padding_mode {padding_mode!r} is not one of {', '.join(PADDING_MODES)}")
    pt, pb, pl, pr = _padding(padding, (Kh, Kw), (dh, dw), (sh, sw))
    if padding_mode == "reflect" and (max(pt, pb) >= H and pt + pb or max(pl, pr) >= W and pl + pr):
        raise ValueError(f"padding {(pt, pb, pl, pr)} (top, bottom, left, right) with padding_mode 'reflect' "
                         f"must be smaller than the input {H}x{W}")
    if padding_mode == "circular" and (max(pt, pb) > H or max(pl, pr) > W):
        raise ValueError(f"padding {(pt, pb, pl, pr)} (top, bottom, left, right) with padding_mode 'circular' "
                         f"wraps around the input {H}x{W} more than once")
    if padding_mode == "replicate" and (H == 0 and pt + pb or W == 0 and pl + pr):
        raise ValueError(f"padding_mode 'replicate' cannot pad an empty {H}x{W} input")
    Hp, Wp = H + pt + pb, W + pl + pr
    eh, ew = dh * (Kh - 1) + 1, dw * (Kw - 1) + 1  # the kernel's extent
    if Kh < 1 or Kw < 1 or eh > Hp or ew > Wp:
        dilated = f" with dilation {(dh, dw)} (extent {eh}x{ew})" if (dh, dw) != (1, 1) else ""
        raise ValueError(
            f"kernel {Kh}x{Kw}{dilated} does not fit the padded input {Hp}x{Wp} "
            f"(H={H}, W={W}, padding={(pt, pb, pl, pr)}): each kernel side must be between 1 and the "
            f"padded input side"
        )
    Ho = (Hp - eh) // sh + 1
    Wo = (Wp - ew) // sw + 1
    return ConvGeometry(N, C, H, W, F, Kh, Kw, sh, sw, pt, pb, pl, pr, dh, dw, G, padding_mode, Ho, Wo)


def conv2d_output_shape(x_shape, w_shape, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """(N, F, Ho, Wo) of conv2d_forward on x_shape (N, C, H, W) and w_shape (F, C/groups, Kh, Kw)."""
    g = conv_geometry(x_shape, w_shape, stride, padding, dilation, groups, padding_mode)
    return (g.N, g.F, g.Ho, g.Wo)


def conv2d_flops(x_shape, w_shape, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """2 N (C/G) F Ho Wo Kh Kw: the multiply-adds, counted as 2 flops, of each of the three passes."""
    g = conv_geometry(x_shape, w_shape, stride, padding, dilation, groups, padding_mode)
    return 2 * g.N * (g.C // g.G) * g.F * g.Ho * g.Wo * g.Kh * g.Kw


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
    """1x1 kernel, stride 1, no padding, one group: x is its own patch matrix, no im2col needed."""
    return (g.Kh, g.Kw, g.sh, g.sw, g.pt, g.pb, g.pl, g.pr, g.G) == (1, 1, 1, 1, 0, 0, 0, 0, 1)


def _is_depthwise(g):
    """One input channel per group (depthwise, with a channel multiplier F / C): a direct
    kernel of Kh*Kw multiply-adds beats a GEMM per group."""
    return g.G > 1 and g.C == g.G


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


def _padded_size(g):
    return g.H + g.pt + g.pb, g.W + g.pl + g.pr


def _window(i, j, g):
    """Index, in a (n, Hp, Wp, ...) array, of the input pixels that kernel offset (i, j) meets."""
    rows = slice(i * g.dh, i * g.dh + g.sh * (g.Ho - 1) + 1, g.sh)
    cols = slice(j * g.dw, j * g.dw + g.sw * (g.Wo - 1) + 1, g.sw)
    return (slice(None), rows, cols)


def _filter_matrices(w, G):
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


def _spread_planes(xp, shape, dtype):
    """A zeroed (n, C, Hp, Wp) temporary whose (Hp, Wp) planes lie an odd number of cache lines apart.

    Transposing to channel-last reads one value from each of C planes in turn; planes a multiple
    of 4 KiB apart (32x32 float32, for one) all fall into the same L1 cache sets and evict each
    other, which makes the transposition 5-10 times slower.
    """
    n, C, Hp, Wp = shape
    storage = workspace.zeros(xp, (n, C, _spread_plane_size(Hp, Wp, xp.dtype(dtype).itemsize)), dtype)
    return storage[:, :, :Hp * Wp].reshape(shape)


def _pixel_patches(x, g, xp):
    """Yield (start, n, patches) over the blocks of samples of x (N, C, H, W).

    patches: (G, n*Ho*Wo, Kh*Kw*C/G), for each group one row per output pixel of the block,
    holding the input values its kernel window covers in (kernel row, kernel column, channel)
    order, so that patches @ _filter_matrices(w) is the convolution. With OpenBLAS, GEMMs on
    these pixel rows run near peak even for F = 64, where the classic (C*Kh*Kw, Ho*Wo) columns
    lose 15-25%. The buffers are reused from block to block: consume each block before asking
    for the next. x is zero-padded here (other padding modes are applied before). Pointwise
    layers (_is_pointwise) need no patches: their callers multiply x itself.
    """
    blocks = _blocks(g)
    step = blocks[0][1] if blocks else 0
    Hp, Wp = _padded_size(g)
    G, Cg = g.G, g.C // g.G
    padded = _spread_planes(xp, (step, g.C, Hp, Wp), x.dtype)  # the border stays zero
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
# dropped. With one sample a block and R = Wo (a 'same' or 'valid' layer), the GEMMs write y.
_PLANE_RUN = 64  # below this Kw*C/G, stride-1 layers go by plane columns
_PLANE_ELEMENTS = 1 << 18  # values of a block's copies (1 MiB in float32: they stay in cache)


def _plane_columns_apply(g):
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
        self.Hp = _padded_size(g)[0]
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
# (PLANE_STACKING = None) the forward measures: the first time a process meets a geometry and
# dtype it times its first block both ways, twice in turns, and keeps the faster form for that
# geometry (_plane_forms). PLANE_STACKING = True or False (CFP_PLANE_STACKING=1 or 0) fixes
# the form; CuPy arrays take a GEMM a kernel row (not measured: their calls return before the
# device has run them).
PLANE_STACKING = _switch("CFP_PLANE_STACKING")
_plane_forms = {}  # (geometry, dtype) -> whether that forward stacks: what it measured
_MEASURE_ROUNDS = 2


def _plane_form(g, dtype, xp):
    """Whether the plane forward of geometry g stacks its kernel rows: never with one kernel
    row, as PLANE_STACKING says where it is set, a GEMM a kernel row on CuPy, else what was
    measured for g and dtype, or None if nothing was (above)."""
    import numpy as np
    if g.Kh == 1:
        return False
    if PLANE_STACKING is not None:
        return PLANE_STACKING
    if xp is not np:
        return False
    return _plane_forms.get((g, str(dtype)))


def _measure_plane_form(g, dtype, seconds):
    """The faster form for g and dtype, seconds(stacked) timing one block of it: the least of
    _MEASURE_ROUNDS timings each, taken in turns; kept for the rest of the process."""
    best = {True: float("inf"), False: float("inf")}
    for _ in range(_MEASURE_ROUNDS):
        for stacked in best:
            best[stacked] = min(best[stacked], seconds(stacked))
    _plane_forms[(g, str(dtype))] = stacked = best[True] < best[False]
    return stacked


def _plane_forward(x, w, g, xp, y):
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


def _plane_backward_filter(x, dy, g, xp):
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


def pad_index(extent, before, after, mode):
    """For each position of an axis padded by (before, after) in `mode`, the input position
    it copies: the padding modes of PyTorch (reflect without repeating the edge, replicate the
    edge, circular wrap-around)."""
    import numpy as np
    i = np.arange(-before, extent + after)
    if mode == "reflect":
        period = 2 * (extent - 1) if extent > 1 else 1
        i = np.abs(i) % period
        return np.where(i >= extent, period - i, i)
    if mode == "replicate":
        return np.clip(i, 0, extent - 1)
    return i % extent  # circular


def _pad_input(x, g, xp):
    """x padded by the geometry's padding in its (non-zero) mode, and the geometry of a
    convolution without padding over it."""
    rows = xp.asarray(pad_index(g.H, g.pt, g.pb, g.mode))
    cols = xp.asarray(pad_index(g.W, g.pl, g.pr, g.mode))
    padded = xp.ascontiguousarray(x[:, :, rows][:, :, :, cols])
    Hp, Wp = _padded_size(g)
    return padded, g._replace(H=Hp, W=Wp, pt=0, pb=0, pl=0, pr=0, mode="zeros")


def _fold_padding(d_padded, g):
    """The adjoint of _pad_input: the gradient of the padded input added back onto the input
    positions each padded position copied."""
    rows, cols = pad_index(g.H, g.pt, g.pb, g.mode), pad_index(g.W, g.pl, g.pr, g.mode)
    return fold_index(fold_index(d_padded, rows, g.H, 2), cols, g.W, 3)


def fold_index(d, at, extent, axis):
    """The adjoint of taking positions `at` along an axis (a gather such as pad_index's): d's
    slices along `axis` summed onto the `extent` positions they were taken from (slice k from
    position at[k]), each run of consecutive positions added as one slice."""
    xp = get_array_module(d)
    shape = list(d.shape)
    shape[axis] = extent
    out = xp.zeros(shape, d.dtype)
    k = 0
    while k < len(at):
        run = 1
        while k + run < len(at) and at[k + run] == at[k] + run:
            run += 1
        into, take = [slice(None)] * d.ndim, [slice(None)] * d.ndim
        into[axis], take[axis] = slice(int(at[k]), int(at[k]) + run), slice(k, k + run)
        out[tuple(into)] += d[tuple(take)]
        k += run
    return out


def _check_bias(b, g):
    if b is not None and tuple(getattr(b, "shape", ())) != (g.F,):
        raise ValueError(
            f"b must have shape ({g.F},) to match the F={g.F} filters of w, got shape "
            f"{getattr(b, 'shape', None)!r}"
        )


@workspace.call
def conv2d_forward(x, w, b=None, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """y (N, F, Ho, Wo) = x (N, C, H, W) cross-correlated with w (F, C/groups, Kh, Kw), plus b (F,).

    The arguments mean what they mean to PyTorch's nn.Conv2d: stride and dilation an int or a
    pair (rows, columns); padding an int, a pair, 'valid' or 'same'; groups splitting C and F
    into groups convolved separately (groups = C: depthwise); padding_mode 'zeros', 'reflect',
    'replicate' or 'circular'. The dtype of y is that of x and w combined (float32 stays
    float32). With C = 0, y is b broadcast (or zeros).
    """
    _require_ndim4(x, "x", "(N, C, H, W)")
    _require_ndim4(w, "w", "(F, C / groups, Kh, Kw)")
    g = conv_geometry(x.shape, w.shape, stride, padding, dilation, groups, padding_mode)
    _check_bias(b, g)
    xp = get_array_module(x, w)
    dtype = xp.result_type(x.dtype, w.dtype)
    return _forward(xp.ascontiguousarray(x, dtype=dtype), w.astype(dtype, copy=False), b, g, xp)


def _forward(x, w, b, g, xp, flipped=False):
    """flipped: w are a layer's filters, and this convolution (backward-data's full one) takes
    them flipped in space with C and F swapped in each group: Winograd transforms them so
    itself (_winograd_filters); every other path is given the flipped copy."""
    dtype = x.dtype
    if g.mode != "zeros":
        x, g = _pad_input(x, g, xp)
    y = xp.empty((g.N, g.F, g.Ho * g.Wo), dtype)
    subgrids, winograd = _subgrids_apply(g, dtype), _winograd_applies(g, dtype)
    if flipped and not (subgrids or winograd):
        w = _flipped_filters(w, g, xp)
    if subgrids:  # whose sub-grid convolution takes Winograd
        s = _subgrid_geometry(g)
        classes = _to_subgrids(x, g.pt, g.pl, (g.dh, g.dw), (s.H, s.W), xp)
        _from_subgrids(_forward(classes, w, None, s, xp, flipped), (g.dh, g.dw), y.reshape(g.N, g.F, g.Ho, g.Wo))
    elif winograd:
        _winograd_forward(x, w, g, xp, y.reshape(g.N, g.F, g.Ho, g.Wo), flipped)
    elif _is_depthwise(g):
        _depthwise_forward(x, w, g, xp, y.reshape(g.N, g.F, g.Ho, g.Wo))
    elif _is_pointwise(g):
        # Each sample's (C, H*W) slab of x is its patch matrix: no copy, y comes out in place.
        xp.matmul(_filter_matrices(w, 1)[0].T, x.reshape(g.N, g.C, g.H * g.W), out=y)
    elif _plane_columns_apply(g):
        _plane_forward(x, w, g, xp, y.reshape(g.N, g.F, g.Ho, g.Wo))
    else:
        Fg = g.F // g.G
        filters = workspace.empty(xp, (g.G, g.Kh * g.Kw * g.C // g.G, Fg), dtype)
        filters[...] = _filter_matrices(w, g.G)
        pixel_major = workspace.empty(xp, (g.G, _samples_per_block(g) * g.Ho * g.Wo, Fg), dtype)
        for start, n, patches in _pixel_patches(x, g, xp):
            rows = pixel_major[:, :n * g.Ho * g.Wo]
            xp.matmul(patches, filters, out=rows)
            y[start:start + n].reshape(n, g.G, Fg, g.Ho * g.Wo)[...] = \
                rows.reshape(g.G, n, g.Ho * g.Wo, Fg).transpose(1, 0, 3, 2)
    if b is not None:
        y += xp.asarray(b, dtype=dtype).reshape(g.F, 1)
    return y.reshape(g.N, g.F, g.Ho, g.Wo)


# ---------------------------------------------------------------------------------------------
# Winograd F(m x m, 3 x 3) (Lavin and Gray, 2016): a 3x3 stride-1 convolution computed on
# (m + 2) x (m + 2) input tiles, each giving an m x m output tile, with (m + 2)^2 products per
# tile and channel pair where direct convolution needs 9 m^2: 2.25 times fewer for m = 2, 4
# times fewer for m = 4 (the default). Each of the three transforms (of the input tiles, of the
# filters, of the products back to outputs) is linear in a tile's values, so each is one GEMM
# with a small Kronecker-product matrix, (m + 2)^2 x (m + 2)^2 for the input: BLAS speed instead
# of one pass of NumPy over memory per addition. The products are (m + 2)^2 batched GEMMs
# (tiles x C) @ (C x F), the ones im2col makes, 4 times smaller. Backward-filter runs the same
# tiles: dU_k = V_k^T dM_k with dM the adjoint of the output transform applied to dy's tiles,
# and dw = G^T dU G. F(4x4) uses the points 0, 1, -1, 2, -1/2 (and infinity), whose float32
# error is half that of 0, +-1, +-2 (measured: 4e-6 of the largest output, against 1e-5, with
# 256 channels); float64 equals direct convolution to about 1e-14. By default (WINOGRAD = None)
# float32 layers take it where it pays (_winograd_pays: outputs of 4x4 and more; measured on
# cfp's machines, BENCHMARKS.md: 0.96-1.5 times PyTorch's oneDNN on the 3x3 benchmark shapes,
# where im2col gives 0.8) and float64 layers, the dtype of
# verification, stay on im2col (exact to rounding, and faster there in float64). WINOGRAD = True
# (`with winograd()`, CFP_WINOGRAD=1) takes it for every dtype, False (`winograd(False)`,
# CFP_WINOGRAD=0) for none: the plain GEMM path stays one switch away.

WINOGRAD = _switch("CFP_WINOGRAD")
WINOGRAD_TILE = 4  # m: the output tile's side, 2 or 4
_WINOGRAD_ROWS = 128  # tiles per block: rows of the (m + 2)^2 GEMMs
# Interpolation points of F(m, 3) and the matrices they give: A^T (m x m+2) the output
# transform, G (m+2 x 3) the filter transform, B^T (m+2 x m+2) the input transform.
_WINOGRAD_POINTS = {2: (0, 1, -1), 4: (0, 1, -1, 2, -0.5)}


def _winograd_applies(g, dtype):
    wanted = WINOGRAD if WINOGRAD is not None else dtype == "float32" and _winograd_pays(g)
    return wanted and (g.Kh, g.Kw, g.sh, g.sw, g.dh, g.dw, g.G) == (3, 3, 1, 1, 1, 1, 1) \
        and g.N * g.C * g.F > 0 and g.mode == "zeros"


def _winograd_pays(g):
    """By default a layer takes Winograd where its outputs are at least a tile wide and its
    tiles multiply at most 1/2.25 as often as direct convolution (4 Ho Wo >= tiles (m+2)^2).
    Measured on cfp's machine, 32x256x256 float32, F(4x4) against im2col (three passes): 4x4
    outputs 21 against 26 ms, 6x6 48 against 57 ms; but 1x1 21 against 5 ms, 2x2 (32x512x512)
    83 against 43 ms, 3x3 22 against 18 ms, 5x5 47 against 39 ms: tiles mostly cropped away,
    or too few of them to pay for the transforms."""
    m = WINOGRAD_TILE
    tiles = -(-g.Ho // m) * -(-g.Wo // m)
    return min(g.Ho, g.Wo) >= m and tiles * (m + 2) ** 2 <= 4 * g.Ho * g.Wo


class winograd:
    """with winograd(): ... runs 3x3 stride-1 convolutions of every dtype by Winograd F(m x m,
    3 x 3) (tile=2 or 4, default WINOGRAD_TILE); winograd(False) by im2col + GEMM;
    winograd(None) as by default (float32 by Winograd where it pays, float64 by im2col)."""

    def __init__(self, enabled=True, tile=None):
        self.enabled = None if enabled is None else bool(enabled)
        self.tile = WINOGRAD_TILE if tile is None else tile
        if self.tile not in _WINOGRAD_POINTS:
            raise ValueError(f"Winograd tile {tile!r} is not one of {sorted(_WINOGRAD_POINTS)}")

    def __enter__(self):
        global WINOGRAD, WINOGRAD_TILE
        self._before = WINOGRAD, WINOGRAD_TILE
        WINOGRAD, WINOGRAD_TILE = self.enabled, self.tile
        return self

    def __exit__(self, *exc):
        global WINOGRAD, WINOGRAD_TILE
        WINOGRAD, WINOGRAD_TILE = self._before
        return False


@functools.lru_cache(maxsize=None)
def winograd_matrices(m):
    """(A^T, G, B^T) of F(m, 3) as float64 NumPy arrays, built from its points (Toom-Cook): A^T
    evaluates at the points (and keeps the leading coefficient for the point at infinity), G
    evaluates the filter divided by the Lagrange denominators, B^T's rows are the coefficients
    of the products of (x - p) over the other points (and of all of them), with signs that make
    y = A^T [(G g) * (B^T d)] the correlation of d with g."""
    import numpy as np
    points = _WINOGRAD_POINTS[m]
    n = m + 2
    AT, G = np.zeros((m, n)), np.zeros((n, 3))
    BT = np.zeros((n, n))
    for j, p in enumerate(points):
        AT[:, j] = [p ** i for i in range(m)]
        others = [q for q in points if q != p]
        G[j] = [p ** k / np.prod([p - q for q in others]) for k in range(3)]
        # M_j(x) = prod over the other finite points of (x - q): B^T row j holds its
        # coefficients (lowest power first), read as the correlation's input weights
        BT[j, :n - 1] = np.polynomial.polynomial.polyfromroots(others)
    AT[m - 1, n - 1] = G[n - 1, 2] = 1.0
    BT[n - 1] = np.polynomial.polynomial.polyfromroots(points)
    for a in (AT, G, BT):
        a.setflags(write=False)  # cached: shared by every call
    return AT, G, BT


@functools.lru_cache(maxsize=64)
def _winograd_transforms(m, dtype, xp):
    """The Kronecker products that transform whole tiles, in `dtype`: B^T (x) B^T ((m+2)^2 x
    (m+2)^2), A^T (x) A^T (m^2 x (m+2)^2) and G (x) G ((m+2)^2 x 9)."""
    import numpy as np
    return tuple(xp.asarray(np.kron(a, a), dtype=dtype) for a in winograd_matrices(m)[::-1])


def _winograd_filters(w, G2, xp, flipped):
    """U = G w G^T for each filter and channel, as (m+2)^2 contiguous (C', F') matrices, the
    layout the products' GEMMs read, for a convolution of C' channels to F': GEMMs of G (x) G
    with w's taps read where they lie, transposed by BLAS (copying them into a (9, C F) layout
    first took as long as the GEMM, 2.6 ms for 256 x 256 filters). For w (F, C, 3, 3) itself
    (C' = C, F' = F) one GEMM per channel c, G (x) G @ (w[:, c]'s taps)^T, written into
    U[:, c]. flipped: w are a layer's filters and this is its backward-data's full convolution
    (C' = F, F' = C, the taps flipped in space): U's (F, C) layout is then one GEMM of all the
    taps, with G (x) G's columns reversed (tap t of a flipped filter is tap 8 - t), so that
    the flipped filters are not copied either."""
    F, C = w.shape[:2]
    if flipped:
        U = workspace.empty(xp, (G2.shape[0], F * C), w.dtype)
        return xp.matmul(xp.ascontiguousarray(G2[:, ::-1]), w.reshape(F * C, 9).T, out=U).reshape(-1, F, C)
    U = workspace.empty(xp, (G2.shape[0], C, F), w.dtype)
    xp.matmul(G2, w.reshape(F, C, 9).transpose(1, 2, 0), out=U.transpose(1, 0, 2))
    return U


def _winograd_tile_sizes(g):
    """(m, a, th, tw, Hp, Wp, step) of geometry g: the output tile's side m and the input's
    a = m + 2, tiles th x tw a sample, the zero-padded input Hp x Wp (every tile whole), and
    samples a block (about _WINOGRAD_ROWS tiles)."""
    m = WINOGRAD_TILE
    th, tw = -(-g.Ho // m), -(-g.Wo // m)
    step = max(1, min(g.N, _WINOGRAD_ROWS // (th * tw)))
    return m, m + 2, th, tw, m * th + 2, m * tw + 2, step


class _WinogradTiles:
    """The input side shared by forward and backward-filter: blocks of samples of x, zero
    padded, channel-last, cut into overlapping (m+2) x (m+2) tiles (m apart) and transformed:
    V ((m+2)^2, tiles, C) = (B^T (x) B^T) @ d."""

    def __init__(self, x, g, xp):
        self.m, self.a, self.th, self.tw, self.Hp, self.Wp, self.step = _winograd_tile_sizes(g)
        m, a = self.m, self.a
        self.x, self.g, self.xp = x, g, xp
        self.B2, self.G2, self.A2 = _winograd_transforms(m, xp.dtype(x.dtype), xp)
        tiles = self.step * self.th * self.tw
        self.padded = _spread_planes(xp, (self.step, g.C, self.Hp, self.Wp), x.dtype)  # border stays zero
        self.channel_last = workspace.empty(xp, (self.step, self.Hp, self.Wp, g.C), x.dtype)
        self._d = workspace.empty(xp, a * a * tiles * g.C, x.dtype)
        self._v = workspace.empty(xp, a * a * tiles * g.C, x.dtype)

    def blocks(self):
        """(start, n, V) for each block of n samples: V ((m+2)^2, n * th * tw, C)."""
        g, xp, m, a, th, tw = self.g, self.xp, self.m, self.a, self.th, self.tw
        for start in range(0, g.N, self.step):
            n = min(self.step, g.N - start)
            P = n * th * tw
            self.padded[:n, :, g.pt:g.pt + g.H, g.pl:g.pl + g.W] = self.x[start:start + n]
            source = self.channel_last[:n]
            source[...] = self.padded[:n].transpose(0, 2, 3, 1)
            d = self._d[:a * a * P * g.C].reshape(a, a, n, th, tw, g.C)
            for i in range(a):
                for j in range(a):
                    d[i, j] = source[:, i:i + m * (th - 1) + 1:m, j:j + m * (tw - 1) + 1:m]
            v = self._v[:a * a * P * g.C].reshape(a * a, P * g.C)
            xp.matmul(self.B2, d.reshape(a * a, P * g.C), out=v)
            yield start, n, v.reshape(a * a, P, g.C)


def _winograd_forward(x, w, g, xp, y, flipped):
    """y (N, F, Ho, Wo) of a 3x3 stride-1 convolution with zero padding, by Winograd F(m x m,
    3 x 3) over blocks of samples: M_k = V_k @ U_k for each of the (m+2)^2 tile positions k,
    then the outputs (A^T (x) A^T) @ M, m x m per tile. (flipped: see _winograd_filters.)"""
    tiles = _WinogradTiles(x, g, xp)
    m, a, th, tw = tiles.m, tiles.a, tiles.th, tiles.tw
    U = _winograd_filters(w, tiles.G2, xp, flipped)
    rows = tiles.step * th * tw
    M, Y = workspace.empty(xp, a * a * rows * g.F, x.dtype), workspace.empty(xp, m * m * rows * g.F, x.dtype)
    # whole tiles go straight into y; otherwise through a block of whole tiles, then cropped
    cropped = (m * th, m * tw) != (g.Ho, g.Wo)
    whole = workspace.empty(xp, (tiles.step, g.F, m * th, m * tw), x.dtype) if cropped else None
    for start, n, V in tiles.blocks():
        P = n * th * tw
        products = M[:a * a * P * g.F].reshape(a * a, P, g.F)
        xp.matmul(V, U, out=products)
        out = Y[:m * m * P * g.F].reshape(m * m, P * g.F)
        xp.matmul(tiles.A2, products.reshape(a * a, P * g.F), out=out)
        tiled = out.reshape(m, m, n, th, tw, g.F).transpose(2, 5, 3, 0, 4, 1)  # (n, F, th, m, tw, m)
        if cropped:
            whole[:n].reshape(tiled.shape)[...] = tiled
            y[start:start + n] = whole[:n, :, :g.Ho, :g.Wo]
        else:
            y[start:start + n].reshape(tiled.shape)[...] = tiled


def _winograd_backward_filter(x, dy, g, xp):
    """dw (F, C, 3, 3) by the forward's tiles: dy's m x m tiles (zero beyond Ho x Wo) taken back
    through the output transform, dM = (A^T (x) A^T)^T @ dy_tiles, then dU_k^T = dM_k^T @ V_k
    (F x C) summed over the blocks, and dw (F C, 9) = dU^T @ (G (x) G), in w's layout."""
    tiles = _WinogradTiles(x, g, xp)
    m, a, th, tw = tiles.m, tiles.a, tiles.th, tiles.tw
    rows = tiles.step * th * tw
    # dy's block channel-last (through planes an odd number of cache lines apart, as x's), zero
    # beyond Ho x Wo, so that the tiles' gather runs over contiguous F
    dy_planes = _spread_planes(xp, (tiles.step, g.F, m * th, m * tw), x.dtype)
    dy_last = workspace.empty(xp, (tiles.step, m * th, m * tw, g.F), x.dtype)
    dy_tiles = workspace.empty(xp, m * m * rows * g.F, x.dtype)
    dM = workspace.empty(xp, a * a * rows * g.F, x.dtype)
    dU_t = workspace.empty(xp, (a * a, g.F, g.C), x.dtype)
    # the first block's product is dU itself: a mini-batch in one block (8 samples of 16x16)
    # needs neither a second buffer of (m+2)^2 C F values nor a pass adding it up
    product = workspace.empty(xp, (a * a, g.F, g.C), x.dtype) if g.N > tiles.step else None
    for start, n, V in tiles.blocks():
        P = n * th * tw
        dy_planes[:n, :, :g.Ho, :g.Wo] = dy[start:start + n]
        dy_last[:n] = dy_planes[:n].transpose(0, 2, 3, 1)
        t = dy_tiles[:m * m * P * g.F].reshape(m, m, n, th, tw, g.F)
        t[...] = dy_last[:n].reshape(n, th, m, tw, m, g.F).transpose(2, 4, 0, 1, 3, 5)
        back = dM[:a * a * P * g.F].reshape(a * a, P, g.F)
        xp.matmul(tiles.A2.T, t.reshape(m * m, P * g.F), out=back.reshape(a * a, P * g.F))
        if start == 0:
            xp.matmul(back.transpose(0, 2, 1), V, out=dU_t)
        else:
            dU_t += xp.matmul(back.transpose(0, 2, 1), V, out=product)
    dw = xp.empty((g.F, g.C, 3, 3), x.dtype)
    xp.matmul(dU_t.reshape(a * a, g.F * g.C).T, tiles.G2, out=dw.reshape(g.F * g.C, 9))
    return dw


# ---------------------------------------------------------------------------------------------
# Dilated stride-1 layers by sub-grids: with dilation d along an axis, output position r reads
# the padded input at r, r + d, r + 2d, ...: all of one residue class modulo d. Cut into its d
# classes (every d-th position), the layer is d undilated convolutions with the same filters,
# one per class; along both axes, dh * dw of them, run as one convolution over a batch dh * dw
# times larger. A dilated 3x3 layer then takes Winograd (measured in BENCHMARKS.md: 8x256x256
# x32x32 at dilation 2 from 0.75-0.8 to 1.1-1.25 times PyTorch's speed); other dilated layers stay on
# im2col, whose patches read the dilated windows directly at no extra cost.

def _subgrids_apply(g, dtype):
    return (g.dh, g.dw) != (1, 1) and (g.sh, g.sw) == (1, 1) and _winograd_applies(_subgrid_geometry(g), dtype)


def _subgrid_geometry(g):
    """The undilated, unpadded convolution over the classes: dh * dw * N samples of
    ceil(Hp / dh) x ceil(Wp / dw) (the padded input, zero-extended to whole classes)."""
    Hp, Wp = _padded_size(g)
    H, W = -(-Hp // g.dh), -(-Wp // g.dw)
    return g._replace(N=g.dh * g.dw * g.N, H=H, W=W, pt=0, pb=0, pl=0, pr=0, dh=1, dw=1,
                      Ho=H - g.Kh + 1, Wo=W - g.Kw + 1)


def _to_subgrids(a, top, left, d, shape, xp):
    """a (N, K, H, W) placed at (top, left) in a zero grid and cut into its d = (dh, dw) residue
    classes: (dh * dw * N, K, *shape), class (p, q) holding the grid positions p::dh, q::dw."""
    dh, dw = d
    N, K = a.shape[:2]
    out = workspace.zeros(xp, (dh, dw, N, K, *shape), a.dtype)
    for p in range(dh):
        r = (p - top) % dh  # the first row of a in class p, at row (r + top) // dh of the class
        rows = a[:, :, r::dh]
        for q in range(dw):
            c = (q - left) % dw
            part = rows[:, :, :, c::dw]
            k, l = (r + top) // dh, (c + left) // dw
            out[p, q, :, :, k:k + part.shape[2], l:l + part.shape[3]] = part
    return out.reshape(dh * dw * N, K, *shape)


def _from_subgrids(s, d, out):
    """The classes s (dh * dw * N, K, Hs, Ws) put back: class (p, q) to out[:, :, p::dh, q::dw]
    (out (N, K, Ho, Wo); what a class holds beyond out is dropped)."""
    dh, dw = d
    s = s.reshape(dh, dw, out.shape[0], out.shape[1], *s.shape[2:])
    for p in range(dh):
        for q in range(dw):
            target = out[:, :, p::dh, q::dw]
            target[...] = s[p, q, :, :, :target.shape[2], :target.shape[3]]
    return out


# ---------------------------------------------------------------------------------------------
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


def _depthwise_forward(x, w, g, xp, y):
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


def _depthwise_backward_filter(x, dy, g, xp):
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


def _depthwise_backward_data(dy, w, g, xp):
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


@workspace.call
def conv2d_backward_data(dy, w, x_shape, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """dx (N, C, H, W): the gradient of the loss with respect to x, from dy (N, F, Ho, Wo).

    x_shape is needed because with a stride > 1 several input sizes give the same output size.
    Input positions that no output position reads (stride > 1) get zero gradient; under a
    padding mode other than zeros, the gradients of the padded border go back to the input
    positions the border copied.
    """
    _require_ndim4(w, "w", "(F, C / groups, Kh, Kw)")
    g = conv_geometry(x_shape, w.shape, stride, padding, dilation, groups, padding_mode)
    _require_dy(dy, g)
    xp = get_array_module(dy, w)
    dtype = xp.result_type(dy.dtype, w.dtype)
    if g.N * g.C * g.H * g.W == 0:
        return xp.zeros((g.N, g.C, g.H, g.W), dtype)
    dy = xp.ascontiguousarray(dy, dtype=dtype)
    w = w.astype(dtype, copy=False)
    if g.mode != "zeros":
        Hp, Wp = _padded_size(g)
        inner = g._replace(H=Hp, W=Wp, pt=0, pb=0, pl=0, pr=0, mode="zeros")
        return _fold_padding(_backward_data(dy, w, inner, xp), g)
    return _backward_data(dy, w, g, xp)


def _backward_data(dy, w, g, xp):
    # stride-1 depthwise without a multiplier: the full convolution is a depthwise forward,
    # whose GEMMs are the long ones (K = eh*Wi, where the transposed product has K = k*Ws)
    if _is_depthwise(g) and ((g.sh, g.sw) != (1, 1) or g.F != g.C):
        return _depthwise_backward_data(dy, w, g, xp)
    if (g.sh, g.sw) == (1, 1):
        return _full_convolution(dy, w, g, xp)
    return _col2im_backward_data(dy, w, g, xp)


def _full_geometry(g):
    """The stride-1 backward-data's forward convolution: ((top, bottom, left, right) cropped off
    dy, its geometry). dy is padded by d(K-1) - p on each side, or cropped where that is
    negative: a padding larger than the kernel's extent made output pixels that see only
    zeros, whose dy reaches no input."""
    sides = (g.dh * (g.Kh - 1) - g.pt, g.dh * (g.Kh - 1) - g.pb,
             g.dw * (g.Kw - 1) - g.pl, g.dw * (g.Kw - 1) - g.pr)
    top, bottom, left, right = crop = tuple(max(0, -p) for p in sides)
    pt, pb, pl, pr = (max(0, p) for p in sides)
    return crop, ConvGeometry(g.N, g.F, g.Ho - top - bottom, g.Wo - left - right, g.C, g.Kh, g.Kw, 1, 1,
                              pt, pb, pl, pr, g.dh, g.dw, g.G, "zeros", g.H, g.W)


def _full_convolution(dy, w, g, xp):
    """Stride-1 dx as a forward convolution (_full_geometry): dy correlated with w flipped in
    space, C and F swapped within each group, at the same dilation. This reuses the forward's
    cheap im2col copies instead of col2im's overlapping adds."""
    (top, bottom, left, right), full = _full_geometry(g)
    dy = xp.ascontiguousarray(dy[:, :, top:g.Ho - bottom, left:g.Wo - right])
    return _forward(dy, w, None, full, xp, flipped=True)


def _flipped_filters(w, g, xp):
    """The filters (F, C/G, Kh, Kw) of a layer flipped in space, C and F swapped within each
    group: (C, F/G, Kh, Kw), those of its backward-data's full convolution, whose geometry g
    is (its C is the layer's F)."""
    G, Fg, Cg = g.G, g.C // g.G, g.F // g.G  # the layer's F/G and C/G
    flipped = workspace.empty(xp, (g.F, Fg, g.Kh, g.Kw), w.dtype)
    flipped.reshape(G, Cg, Fg, g.Kh, g.Kw)[...] = \
        w[:, :, ::-1, ::-1].reshape(G, Fg, Cg, g.Kh, g.Kw).transpose(0, 2, 1, 3, 4)
    return flipped


def _col2im_backward_data(dy, w, g, xp):
    """dx for any stride: the patch gradients dy^T @ _filter_matrices(w)^T of each sample and
    group, added back (col2im) at the input pixels their patches were taken from."""
    G, Fg, Cg = g.G, g.F // g.G, g.C // g.G
    filters_t = _filter_matrices(w, G).transpose(0, 2, 1)  # (G, F/G, Kh*Kw*C/G) view
    step = _samples_per_block(g)
    Hp, Wp = _padded_size(g)
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


@workspace.call
def conv2d_backward_filter(x, dy, w_shape, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros"):
    """dw (F, C/groups, Kh, Kw): the gradient of the loss with respect to w, from x and dy
    (N, F, Ho, Wo). w_shape gives the kernel size (Kh, Kw). With N = 0, dw is zeros.
    """
    _require_ndim4(x, "x", "(N, C, H, W)")
    g = conv_geometry(x.shape, w_shape, stride, padding, dilation, groups, padding_mode)
    _require_dy(dy, g)
    xp = get_array_module(x, dy)
    dtype = xp.result_type(x.dtype, dy.dtype)
    x = xp.ascontiguousarray(x, dtype=dtype)
    dy = xp.ascontiguousarray(dy, dtype=dtype)
    if g.mode != "zeros":
        x, g = _pad_input(x, g, xp)
    G, Fg, Cg = g.G, g.F // g.G, g.C // g.G
    if _subgrids_apply(g, dtype):
        s, d = _subgrid_geometry(g), (g.dh, g.dw)
        return _winograd_backward_filter(_to_subgrids(x, g.pt, g.pl, d, (s.H, s.W), xp),
                                         _to_subgrids(dy, 0, 0, d, (s.Ho, s.Wo), xp), s, xp)
    if _winograd_applies(g, dtype):
        return _winograd_backward_filter(x, dy, g, xp)
    if _is_depthwise(g):
        return _depthwise_backward_filter(x, dy, g, xp)
    if _is_pointwise(g):
        # dw = sum over samples of dy_n (F, H*W) @ x_n^T (H*W, C), or dw^T = the sum of
        # x_n @ dy_n^T: BLAS reads the second operand transposed, so neither tensor is copied.
        # The one whose result has max(C, F) rows is the faster (measured 20% on 1x1 layers
        # 256 -> 64 and 64 -> 256 channels, 16x16).
        rows, columns = (dy, x) if g.F >= g.C else (x, dy)
        total = workspace.zeros(xp, (rows.shape[1], columns.shape[1]), dtype)
        product = workspace.empty(xp, total.shape, dtype)
        for n in range(g.N):
            xp.matmul(rows[n].reshape(total.shape[0], g.H * g.W), columns[n].reshape(total.shape[1], g.H * g.W).T,
                      out=product)
            total += product
        dw = total if g.F >= g.C else total.T
        return dw.copy().reshape(g.F, g.C, 1, 1)  # a fresh array, not the workspace's
    if _plane_columns_apply(g):
        return _plane_backward_filter(x, dy, g, xp)
    # dw as (G, F/G, Kh*Kw*C/G) = sum over blocks of dy_block @ patches, one GEMM per block and
    # group whose inner dimension runs over all the block's output pixels.
    dw_matrix = xp.zeros((G, Fg, g.Kh * g.Kw * Cg), dtype)
    product = workspace.empty(xp, dw_matrix.shape, dtype)
    dy_by_filter = workspace.empty(xp, (g.F, _samples_per_block(g) * g.Ho * g.Wo), dtype)
    for start, n, patches in _pixel_patches(x, g, xp):
        dy_block = _channel_major(dy, start, n, dy_by_filter).reshape(G, Fg, n * g.Ho * g.Wo)
        xp.matmul(dy_block, patches, out=product)
        dw_matrix += product
    dw = dw_matrix.reshape(G, Fg, g.Kh, g.Kw, Cg).transpose(0, 1, 4, 2, 3)
    return xp.ascontiguousarray(dw.reshape(g.F, Cg, g.Kh, g.Kw))


def conv2d_backward_bias(dy):
    """db (F,) = dy (N, F, Ho, Wo) summed over samples and output positions."""
    _require_ndim4(dy, "dy", "(N, F, Ho, Wo)")
    xp = get_array_module(dy)
    N, F, Ho, Wo = dy.shape
    return xp.ascontiguousarray(dy).reshape(N, F, Ho * Wo).sum(axis=2).sum(axis=0)


# ---------------------------------------------------------------------------------------------
# What the Winograd passes ask of the workspace (cfp/kernels/workspace.py), for the cost model:
# its 64-byte aligned pieces added up as the passes above take them, the largest of the three.
# tests/test_kernels_workspace.py checks these sums against what the passes ask for.

def _piece(count, itemsize):
    return workspace.piece_bytes(count * itemsize)


def _spread_plane_size(Hp, Wp, itemsize):
    """Values from one plane of _spread_planes to the next: Hp*Wp rounded up to an odd number of
    cache lines."""
    lines = -(-Hp * Wp * itemsize // _CACHE_LINE_BYTES)  # rounded up
    lines += 1 - lines % 2
    return lines * _CACHE_LINE_BYTES // itemsize




def _winograd_tiles_bytes(g, item):
    m, a, th, tw, Hp, Wp, step = _winograd_tile_sizes(g)
    tiles = step * th * tw
    return (_piece(step * g.C * _spread_plane_size(Hp, Wp, item), item) + _piece(step * Hp * Wp * g.C, item)
            + 2 * _piece(a * a * tiles * g.C, item))


def _winograd_forward_bytes(g, item):
    m, a, th, tw, Hp, Wp, step = _winograd_tile_sizes(g)
    rows = step * th * tw
    cropped = (m * th, m * tw) != (g.Ho, g.Wo)
    return (_winograd_tiles_bytes(g, item) + _piece(a * a * g.C * g.F, item)
            + _piece(a * a * rows * g.F, item) + _piece(m * m * rows * g.F, item)
            + (_piece(step * g.F * m * th * m * tw, item) if cropped else 0))


def _winograd_backward_filter_bytes(g, item):
    m, a, th, tw, Hp, Wp, step = _winograd_tile_sizes(g)
    rows = step * th * tw
    dy_planes = step * g.F * _spread_plane_size(m * th, m * tw, item)
    return (_winograd_tiles_bytes(g, item) + _piece(dy_planes, item) + _piece(step * m * th * m * tw * g.F, item)
            + _piece(m * m * rows * g.F, item) + _piece(a * a * rows * g.F, item)
            + _piece(a * a * g.C * g.F, item) * (2 if g.N > step else 1))


def _forward_bytes(g, item, dtype):
    """The workspace bytes of a forward pass on geometry g (zero padding) by Winograd, directly
    or by sub-grids; None on any other path."""
    if _subgrids_apply(g, dtype):
        s = _subgrid_geometry(g)
        inner = _forward_bytes(s, item, dtype)
        return None if inner is None else _piece(s.N * g.C * s.H * s.W, item) + inner
    if _winograd_applies(g, dtype):
        return _winograd_forward_bytes(g, item)
    return None


def winograd_workspace_bytes(x_shape, w_shape, dtype="float32", stride=1, padding=0, dilation=1, groups=1,
                             padding_mode="zeros"):
    """{pass: bytes} of the kernels' workspace each pass of this layer asks for where it takes
    Winograd (directly, or dilated by sub-grids); a pass on another path is left out (its
    workspace is bounded by the cost model's estimate, cfp/perfmodel.py). Which passes take
    Winograd follows the kernels' own choice (WINOGRAD, _winograd_pays) for dtype."""
    g = conv_geometry(x_shape, w_shape, stride, padding, dilation, groups, padding_mode)
    dtype = str(float_dtype(dtype, "dtype"))
    item = 4 if dtype == "float32" else 8
    if g.mode != "zeros":  # padded first (a fresh array, not the workspace's), then zero padding
        Hp, Wp = _padded_size(g)
        g = g._replace(H=Hp, W=Wp, pt=0, pb=0, pl=0, pr=0, mode="zeros")
    found = {"forward": _forward_bytes(g, item, dtype)}
    if (g.sh, g.sw) == (1, 1):
        full = _full_geometry(g)[1]
        inner = _forward_bytes(full, item, dtype)
        found["backward-data"] = inner  # Winograd reads the layer's filters flipped in place
    if _subgrids_apply(g, dtype):
        s = _subgrid_geometry(g)
        found["backward-filter"] = (_piece(s.N * g.C * s.H * s.W, item) + _piece(s.N * g.F * s.Ho * s.Wo, item)
                                    + _winograd_backward_filter_bytes(s, item))
    elif _winograd_applies(g, dtype):
        found["backward-filter"] = _winograd_backward_filter_bytes(g, item)
    return {k: v for k, v in found.items() if v is not None}
