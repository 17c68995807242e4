"""Winograd F(m x m, 3 x 3) for 3x3 stride-1 layers, and dilated 3x3 layers by residue-class
sub-grids that take it; with what its passes ask of the workspace, for the cost model.
"""
import contextlib
import functools
import threading

import numpy as np

from cfp import backend
from cfp.kernels import settings, workspace
from cfp.kernels.conv import columns
from cfp.kernels.conv.geometry import padded_size
from cfp.kernels.conv.im2col import spread_plane_size, spread_planes

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
# 256 channels); float64 equals direct convolution to about 1e-14. By default (the setting
# winograd = None, cfp/kernels/settings.py) float32 layers take it where it pays (_pays: outputs
# of 4x4 and more; measured on cfp's machines, BENCHMARKS.md: 0.96-1.5 times PyTorch's oneDNN on
# the 3x3 benchmark shapes, where im2col gives 0.8) and float64 layers, the dtype of
# verification, stay on im2col (exact to rounding, and faster there in float64). winograd = True
# (`with winograd()`, CFP_WINOGRAD=1) takes it for every dtype, False (`winograd(False)`,
# CFP_WINOGRAD=0) for none: the plain GEMM path stays one switch away. The output tile's side m
# is the setting winograd_tile, 2 or 4 for every layer, or by default (None) each layer's cheaper
# of the two by their measured cost (tile).

_WINOGRAD_ROWS = 128  # tiles per block: rows of the (m + 2)^2 GEMMs
_MIN_TILES = 32  # by default, fewer tiles a call go by another path (_pays)
# ... or 16 at F(4x4), where the call's filters go in blocks (filter_block: AVX2 GEMMs), which
# such layers took at F(2x2) before (4 times the tiles) or by columns: measured at one thread on
# the Zen 5 guest with OpenBLAS's Haswell kernels, three passes at F(4x4) against F(2x2) and
# columns, 4x512x512x7x7 24.2 against 26.8 and 28.6 ms, 6x512x512x7x7 28.2 against 34.0 and
# 41.6, 4x1024x1024x7x7 94.7 against 107.0 and 109.9, 4x384x384x7x7 13.9 against 14.1 and 16.3,
# 4x256x256x7x7 6.4 against 6.7 and 7.9; but 2x512x512x7x7 (8 tiles) 18.2 against 16.3 and
# 15.7. With SkylakeX's (AVX-512) kernels columns were faster (4x512x512x7x7 17.4 against 20.4
# ms). At F(2x2), whose U is 16/36 of F(4x4)'s, 16 tiles do not pay (4x512x512x4x4 11.3
# against columns' 10.7, 1x512x512x8x8 11.0 against 9.7 ms). BENCHMARKS.md, "The filters'
# transforms in blocks".
_MIN_BLOCKED_TILES = 16
# Interpolation points of F(m, 3) and the matrices they give: A^T (m x m+2) the output
# transform, G (m+2 x 3) the filter transform, B^T (m+2 x m+2) the input transform.
_WINOGRAD_POINTS = {2: (0, 1, -1), 4: (0, 1, -1, 2, -0.5)}


def applies(g, dtype):
    """Whether geometry g (zero padding) in `dtype` takes Winograd: a 3x3 stride-1 undilated
    ungrouped layer with something to compute, where the settings ask for it or it pays."""
    switch = settings.current().winograd
    wanted = switch if switch is not None else dtype == "float32" and _pays(g)
    return wanted and (g.Kh, g.Kw, g.sh, g.sw, g.dh, g.dw, g.G) == (3, 3, 1, 1, 1, 1, 1) \
        and g.N * g.C * g.F > 0 and g.mode == "zeros"


def tile_rows(g):
    """The rows of the layer's (m + 2)^2 GEMMs: its tiles, N ceil(Ho / m) ceil(Wo / m). How many
    fill them is what moves Winograd's rate (the cost model's shape feature, cfp/perfmodel.py)."""
    return g.N * plane_tiles(g)


def plane_tiles(g):
    """The tiles of one sample's output plane, ceil(Ho / m) ceil(Wo / m)."""
    m = tile(g)
    return -(-g.Ho // m) * -(-g.Wo // m)


# What the three passes of a layer cost by F(m x m, 3 x 3), in seconds, as the sum of what
# moves with the tile (a = m + 2, T = N ceil(Ho / m) ceil(Wo / m) tiles): the products, T a^2 C F
# multiply-adds; the filters' transforms (forward's, backward-data's flipped one, backward-
# filter's back to taps), a^2 C F values each, paid once a call; the tiles' transforms, T a^2
# (a^2 C + m^2 F) multiply-adds; their copies (padding, channel-last, gather), T a^2 (C + F)
# values; and where the tiles overhang the outputs, the copy through a block of whole tiles,
# T m^2 (C + F). The weights were fitted on 30 layers (7x7 to 56x56, 16 to 512 channels, 1 to
# 32 samples), each timed at both tiles in turns on the Zen 5 guest (BENCHMARKS.md, "Winograd's
# tile per layer"), once with OpenBLAS's AVX-512 (SkylakeX) kernels and once with its AVX2
# (Haswell) ones: the products and the tiles' transforms, which are GEMMs, cost 1.7-2.2 times
# as much with AVX2, which moves the choice (8x256x256 on 14x14: F(2x2) 10% faster with AVX-512,
# 4% slower with AVX2). Each set predicts its three passes within 5% at the median (26-27% at
# worst), and the tile it picks was the faster in 28 of the 30 (AVX-512; 6% and 1% slower in
# the other two) and 29 of the 30 (AVX2; 1% slower in the other).
_TILE_COST = {True: (0.0322e-9, 2.04e-9, 0.0256e-9, 1.45e-9, 2.05e-9),  # the BLAS runs AVX-512
              False: (0.0547e-9, 2.08e-9, 0.0558e-9, 1.77e-9, 1.63e-9)}  # AVX2


# Where a float32 call's filters go in blocks (filter_block), their transforms cost this part of
# _TILE_COST's price: on the four layers measured both ways (BENCHMARKS.md, "The filters'
# transforms in blocks"), the blocks' time less the other terms' prices is 0.54-0.86 of the
# filters' price. 0.7 picks the faster tile of each layer measured at both since (F(4x4) for
# 4x512x512x7x7, 6x512x512x7x7, 1x512x512x16x16; F(2x2) for 1x512x512x14x14,
# 1x1024x1024x14x14 and 2x256x256x14x14, the last 7.8-8.5 against 8.6-8.9 ms, predicted 2%
# apart; 0.65 would have put it at F(4x4)).
_BLOCKED_FILTERS = 0.7


def _in_filter_blocks(g, m, avx512=None):
    """Whether a float32 NumPy call on g at tile m transforms its filters in blocks (avx512:
    filter_block's)."""
    return filter_block(g, 4, np, m + 2, avx512) < g.F


def tile_cost(g, m, avx512=None):
    """The predicted seconds of a layer's three Winograd passes at tile m (_TILE_COST) with the
    BLAS loaded here (avx512: as if it ran AVX-512 GEMMs or not; default backend.blas_runs_avx512),
    the filters' transforms at _BLOCKED_FILTERS of their price where they go in blocks."""
    a, T = m + 2, g.N * -(-g.Ho // m) * -(-g.Wo // m)
    cropped = (m * -(-g.Ho // m), m * -(-g.Wo // m)) != (g.Ho, g.Wo)
    filters = a * a * g.C * g.F * (_BLOCKED_FILTERS if _in_filter_blocks(g, m, avx512) else 1)
    terms = (T * a * a * g.C * g.F, filters, T * a * a * (a * a * g.C + m * m * g.F),
             T * a * a * (g.C + g.F), cropped * T * m * m * (g.C + g.F))
    weights = _TILE_COST[backend.blas_runs_avx512() if avx512 is None else bool(avx512)]
    return sum(w * t for w, t in zip(weights, terms))


def tile_name(g):
    """What the path table's name of a Winograd pass on g adds: '' at F(4x4), ' F(2x2)' else."""
    m = tile(g)
    return "" if m == 4 else f" F({m}x{m})"


def tile(g):
    """The output tile m of geometry g's Winograd passes: the setting winograd_tile where it
    names one, else (None, the default) the cheaper of 2 and 4 by tile_cost: F(2x2) on the
    layers of few tiles a call, whose filters' transforms, 16 C F values against 36, weigh more
    than the products (4x512x512 on 8x8, 1x256x256 on 16x16), and with AVX-512 GEMMs on most of
    those whose F(4x4) tiles overhang their outputs (14x14: 196 of 256 outputs kept); F(4x4)
    elsewhere."""
    m = settings.current().winograd_tile
    if m is not None:
        return m
    if not _pays_at(g, 4) and _pays_at(g, 2):  # (the one tile a layer _pays admits by F(2x2) takes)
        return 2
    return 2 if tile_cost(g, 2) < tile_cost(g, 4) else 4


def _pays(g):
    """By default a layer takes Winograd where its outputs are at least a tile wide, its tiles
    multiply at most 1/2.25 as often as direct convolution (4 Ho Wo >= tiles (m+2)^2), the
    call has at least _MIN_TILES tiles to transform its filters for, and more than a few
    channels. Measured on cfp's machine, 32x256x256 float32, F(4x4) against im2col (three
    passes): 4x4 outputs 21 against 26 ms, 6x6 48 against 57 ms; but 1x1 21 against 5 ms, 2x2
    (32x512x512) 83 against 43 ms, 3x3 22 against 18 ms, 5x5 47 against 39 ms: tiles mostly
    cropped away, or too few of them to pay for the transforms. And by the tiles of the call (AMD EPYC guest): 4 to 16 of them
    1.06-1.55 times slower than im2col (1 to 4 samples of 512 channels on 7x7, 1 or 4 of 64 on
    8x8 and 14x14), 24 level (0.96-1.08), 32 and more faster (2x128x128x14x14 0.89, 8x512x512
    x7x7 0.82, 1x64x64x28x28 0.71): the filters' transform, 36 C F values written, is paid
    once a call whatever its tiles (those were measured with the whole U; where the filters go
    in blocks, with AVX2 GEMMs, 16 tiles of F(4x4) pay: _MIN_BLOCKED_TILES). Nor on layers of
    at most columns.FEW_CHANNELS channels (a network's first layer), whose GEMMs C deep
    per-sample columns outrun (columns.py).
    These were measured with F(4x4), whose tiles decide it where the setting names no tile;
    of the layers that take Winograd, tile() then picks each one's tile. Where the BLAS runs
    AVX2 GEMMs (not AVX-512: backend.blas_runs_avx512), a layer whose F(2x2) tiles meet the
    same rules takes Winograd too, at F(2x2) (tile()): the layers of a few samples on 16x16
    to 2x2 outputs, whose F(4x4) tiles are too few or mostly cropped. Measured on the Zen 5
    guest with OpenBLAS's Haswell kernels, three passes at one thread against the path they
    took before (BENCHMARKS.md, "Winograd F(2x2) where F(4x4) does not pay"): 0.59-1.01 of
    its time on 33 such layers (1x512x512x16x16 27.9 against 35.2 ms), 1.06 on the smallest
    (1x32x32x16x16, 0.36 ms); with AVX-512 GEMMs im2col's large GEMMs gain more than
    Winograd's small ones, and F(2x2) took 0.86-1.53 of their time, so those stay."""
    m = settings.current().winograd_tile
    if m is not None:
        return _pays_at(g, m)
    return _pays_at(g, 4) or (not backend.blas_runs_avx512() and _pays_at(g, 2))


def _pays_at(g, m):
    """_pays' rules at tile m: outputs at least a tile wide, at most 4 products an output (1/2.25
    of direct convolution's 9), at least _MIN_TILES tiles a call (_MIN_BLOCKED_TILES at F(4x4)
    where the call's filters go in blocks, filter_block), more than a few channels."""
    tiles = -(-g.Ho // m) * -(-g.Wo // m)
    least = _MIN_BLOCKED_TILES if m == 4 and _in_filter_blocks(g, m) else _MIN_TILES
    return min(g.Ho, g.Wo) >= m and tiles * (m + 2) ** 2 <= 4 * g.Ho * g.Wo and g.N * tiles >= least \
        and g.C > columns.FEW_CHANNELS


@functools.lru_cache(maxsize=None)
def winograd_matrices(m):
    """(A^T, G, B^T) of F(m, 3) as float64 NumPy arrays, built from its points (Toom-Cook): A^T
    evaluates at the points (and keeps the leading coefficient for the point at infinity), G
    evaluates the filter divided by the Lagrange denominators, B^T's rows are the coefficients
    of the products of (x - p) over the other points (and of all of them), with signs that make
    y = A^T [(G g) * (B^T d)] the correlation of d with g."""
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
    return tuple(xp.asarray(np.kron(a, a), dtype=dtype) for a in winograd_matrices(m)[::-1])


class _Kept(threading.local):
    """One thread's filters' transforms kept by filters_kept: [(w's elements, G2, flipped, w,
    U)], or None outside it."""

    def __init__(self):
        self.entries = None


_kept = _Kept()


@contextlib.contextmanager
def filters_kept():
    """Within it, a Winograd pass that transforms filters it has transformed before (the same
    elements of a weight array, _elements; the same tile and orientation) reads the U it kept
    instead of transforming them again: for a layer's pass run in chunks of samples (the
    pipelined passes of cfp.algorithms), whose chunks all convolve the one weight shard. The
    caller promises that the weights are not written while it lasts; each kept U lies in a
    lasting buffer of the workspace (workspace.lasting: its pages faulted in once, not once a
    pass; a fresh U a pass cost about what one transform saves), its w held (so that no other
    array can take its memory) until the outermost filters_kept ends. The whole U only: filters
    in blocks (filter_block) are transformed per block as before. Not under a workspace limit
    (workspace.set_limit: a model built under a memory limit), whose plan counts no U outside
    the kernel calls."""
    outer = _kept.entries is not None
    if not outer and workspace.limit() is None:
        _kept.entries = []
    try:
        yield
    finally:
        if not outer:
            _kept.entries = None


def _elements(w):
    """(address, shape, strides, dtype) of w's elements: the same for every view of one block of
    memory that reads it alike (a transposed layer's weight is a new view each call)."""
    address = w.data.ptr if hasattr(w.data, "ptr") else w.__array_interface__["data"][0]  # CuPy, NumPy
    return address, w.shape, w.strides, w.dtype


def _filters(w, G2, xp, flipped):
    """_winograd_filters(w, G2, xp, flipped), or within filters_kept the U kept for w's
    elements (each entry holds its w, so no other array can take that memory meanwhile)."""
    entries = _kept.entries
    if entries is None:
        return _winograd_filters(w, G2, xp, flipped)
    elements = _elements(w)
    for kept, kept_G2, kept_flipped, _, U in entries:
        if kept == elements and kept_G2 is G2 and kept_flipped == flipped:
            return U
    U = _winograd_filters(w, G2, xp, flipped, slot=len(entries))
    entries.append((elements, G2, flipped, w, U))
    return U


def _winograd_filters(w, G2, xp, flipped, slot=None):
    """U = G w G^T for each filter and channel, as (m+2)^2 contiguous (C', F') matrices, the
    layout the products' GEMMs read, for a convolution of C' channels to F': GEMMs of G (x) G
    with w's taps read where they lie, transposed by BLAS (copying them into a (9, C F) layout
    first took as long as the GEMM, 2.6 ms for 256 x 256 filters). For w (F, C, 3, 3) itself
    (C' = C, F' = F) one GEMM per channel c, G (x) G @ (w[:, c]'s taps)^T, written into
    U[:, c]. flipped: w are a layer's filters and this is its backward-data's full convolution
    (C' = F, F' = C, the taps flipped in space): U's (F, C) layout is then one GEMM of all the
    taps, with G (x) G's columns reversed (tap t of a flipped filter is tap 8 - t), so that
    the flipped filters are not copied either. slot: U in that lasting buffer of the workspace
    (workspace.lasting: filters_kept's), not in the call's workspace."""
    F, C = w.shape[:2]

    def empty(shape, dtype):
        return workspace.empty(xp, shape, dtype) if slot is None else workspace.lasting(xp, shape, dtype, slot)
    if flipped:
        U = empty((G2.shape[0], F * C), w.dtype)
        return xp.matmul(xp.ascontiguousarray(G2[:, ::-1]), w.reshape(F * C, 9).T, out=U).reshape(-1, F, C)
    U = empty((G2.shape[0], C, F), w.dtype)
    xp.matmul(G2, w.reshape(F, C, 9).transpose(1, 2, 0), out=U.transpose(1, 0, 2))
    return U


def _winograd_tile_sizes(g, m=None):
    """(m, a, th, tw, strip, Hp, Wp, step) of geometry g: the output tile's side m and the
    input's a = m + 2, tiles th x tw a sample, and the blocks the passes go through, about
    _WINOGRAD_ROWS tiles each: `step` whole samples (strip = th), or, where one sample has more
    tiles than that, `strip` tile rows of one sample (step = 1), so that a large image's tiles
    and products stay in cache as a batch of small ones do; Hp x Wp the zero-padded input of a
    block's tiles (m * strip + 2 rows, every tile whole). m: the tile, where another geometry
    chose it (default: tile(g))."""
    m = tile(g) if m is None else m
    th, tw = -(-g.Ho // m), -(-g.Wo // m)
    if th * tw <= _WINOGRAD_ROWS:
        step, strip = max(1, min(g.N, _WINOGRAD_ROWS // (th * tw))), th
    else:
        step, strip = 1, max(1, _WINOGRAD_ROWS // tw)
    return m, m + 2, th, tw, strip, m * strip + 2, m * tw + 2, step


def _copy_rows(source, lo, hi, target):
    """target[..., k, :] = source[..., lo + k, :] where that row exists (0 <= lo + k < the
    source's rows), zero elsewhere: a block's rows of a zero-extended plane, into a reused
    buffer whose other columns stay as they are."""
    rows = source.shape[-2]
    first, last = max(0, lo), min(rows, hi)
    target[..., :max(0, first - lo), :] = 0
    target[..., max(0, last - lo):hi - lo, :] = 0
    if last > first:
        target[..., first - lo:last - lo, :source.shape[-1]] = source[..., first:last, :]


def _copy_sample_rows(source, lo, hi, target):
    """_copy_rows of a block of samples: source (n, C, H, W), or (n, K, C', H, W) whose K C'
    channels are K groups of C' (a volume's stacked planes read where they lie, as a strided
    view of its input: kernels/conv/volume.py), each into its channels of target."""
    if source.ndim == 4:
        _copy_rows(source, lo, hi, target)
        return
    group = source.shape[2]
    for k in range(source.shape[1]):
        _copy_rows(source[:, k], lo, hi, target[:, k * group:(k + 1) * group])


class _WinogradTiles:
    """The input side shared by forward and backward-filter: blocks of x (samples, or strips of
    tile rows of one sample: _winograd_tile_sizes), zero padded, channel-last, cut into
    overlapping (m+2) x (m+2) tiles (m apart) and transformed: V ((m+2)^2, tiles, C) =
    (B^T (x) B^T) @ d. x may be any strided view, and (N, K, C / K, H, W) for C channels in K
    groups (_copy_sample_rows). m: the tile (default: tile(g))."""

    def __init__(self, x, g, xp, m=None):
        self.m, self.a, self.th, self.tw, self.strip, self.Hp, self.Wp, self.step = _winograd_tile_sizes(g, m)
        m, a = self.m, self.a
        self.x, self.g, self.xp = x, g, xp
        self.B2, self.G2, self.A2 = _winograd_transforms(m, xp.dtype(x.dtype), xp)
        tiles = self.step * self.strip * self.tw
        # _copy_rows writes every row of columns pl .. pl + W - 1; the side borders stay zero
        self.padded = spread_planes(xp, (self.step, g.C, self.Hp, self.Wp), x.dtype, (0, g.pl, self.Hp, g.W))
        self.channel_last = workspace.empty(xp, (self.step, self.Hp, self.Wp, g.C), x.dtype)
        self._d = workspace.empty(xp, a * a * tiles * g.C, x.dtype)
        self._v = workspace.empty(xp, a * a * tiles * g.C, x.dtype)

    def count(self):
        """How many blocks the passes go through."""
        return -(-self.g.N // self.step) * -(-self.th // self.strip)

    def blocks(self):
        """(start, n, t0, r, V) for each block: n samples from `start`, their tile rows t0 to
        t0 + r (all of them, or a strip of one sample), V ((m+2)^2, n * r * tw, C)."""
        for start in range(0, self.g.N, self.step):
            n = min(self.step, self.g.N - start)
            for t0 in range(0, self.th, self.strip):
                r = min(self.strip, self.th - t0)
                yield start, n, t0, r, self.transform(start, n, t0, r)

    def transform(self, start, n, t0, r):
        """V ((m+2)^2, n * r * tw, C) of the n samples from `start`, tile rows t0 to t0 + r
        (in the workspace: valid until the next call)."""
        g, xp, m, a, tw = self.g, self.xp, self.m, self.a, self.tw
        P, rows = n * r * tw, m * r + 2
        # the padded input's rows m t0 .. m (t0 + r) + 1 are x's rows from m t0 - pt
        padded = self.padded[:n, :, :rows]
        _copy_sample_rows(self.x[start:start + n], m * t0 - g.pt, m * t0 - g.pt + rows, padded[:, :, :, g.pl:])
        source = self.channel_last[:n, :rows]
        source[...] = padded.transpose(0, 2, 3, 1)
        d = self._d[:a * a * P * g.C].reshape(a, a, n, r, tw, g.C)
        for i in range(a):
            for j in range(a):
                d[i, j] = source[:, i:i + m * (r - 1) + 1:m, j:j + m * (tw - 1) + 1:m]
        v = self._v[:a * a * P * g.C].reshape(a * a, P * g.C)
        xp.matmul(self.B2, d.reshape(a * a, P * g.C), out=v)
        return v.reshape(a * a, P, g.C)


def _place(out, tiles, n, t0, r, F, y, start, whole):
    """The outputs of a block ((m m, n r tw F), from the output transform) into y (N, F, Ho,
    Wo; any strides) at samples start.., tile rows t0..t0 + r: whole tiles straight in,
    otherwise through `whole`, a block of whole tiles, cropped."""
    m, tw = tiles.m, tiles.tw
    Ho, Wo = y.shape[2:]
    tiled = out.reshape(m, m, n, r, tw, F).transpose(2, 5, 3, 0, 4, 1)  # (n, F, r, m, tw, m)
    top, bottom = m * t0, min(Ho, m * (t0 + r))
    if whole is not None:
        whole[:n, :, :m * r].reshape(tiled.shape)[...] = tiled
        y[start:start + n, :, top:bottom] = whole[:n, :, :bottom - top, :Wo]
    else:
        y[start:start + n, :, top:bottom].reshape(tiled.shape)[...] = tiled


def forward(x, w, g, xp, y, flipped=False):
    """y (N, F, Ho, Wo) of a 3x3 stride-1 convolution with zero padding, by Winograd F(m x m,
    3 x 3) over blocks of tiles: M_k = V_k @ U_k for each of the (m+2)^2 tile positions k,
    then the outputs (A^T (x) A^T) @ M, m x m per tile. (flipped: see _winograd_filters.) Where
    the filters' transforms outgrow the cache (filter_block), they go in blocks of filters
    instead (_forward_by_filter_blocks)."""
    tiles = _WinogradTiles(x, g, xp)
    if filter_block(g, x.dtype.itemsize, xp, tiles.a) < g.F:
        _forward_by_filter_blocks(tiles, w, g, xp, y, flipped)
        return
    m, a, tw = tiles.m, tiles.a, tiles.tw
    U = _filters(w, tiles.G2, xp, flipped)
    rows = tiles.step * tiles.strip * tw
    M, Y = workspace.empty(xp, a * a * rows * g.F, x.dtype), workspace.empty(xp, m * m * rows * g.F, x.dtype)
    # whole tiles go straight into y; otherwise through a block of whole tiles, then cropped
    cropped = (m * tiles.th, m * tw) != (g.Ho, g.Wo)
    whole = workspace.empty(xp, (tiles.step, g.F, m * tiles.strip, m * tw), x.dtype) if cropped else None
    for start, n, t0, r, V in tiles.blocks():
        P = n * r * tw
        products = M[:a * a * P * g.F].reshape(a * a, P, g.F)
        xp.matmul(V, U, out=products)
        out = Y[:m * m * P * g.F].reshape(m * m, P * g.F)
        xp.matmul(tiles.A2, products.reshape(a * a, P * g.F), out=out)
        _place(out, tiles, n, t0, r, g.F, y, start, whole)


# The filters' transforms of a wide layer, (m+2)^2 C F values, are larger than the cache: 151 MB
# at 1024 x 1024 channels in float32, written by one pass and read back from memory by the
# products' GEMMs (the 8x1024x1024 layer on 8x8 spent 30 of its 53 ms of forward in U = G w G^T,
# 5 GB/s; 256 x 512 channels, 19 MB, took a quarter of 512 x 512's time). Where one block of at
# most FILTER_BLOCK_TILES tiles holds the whole call, the passes go through the filters in
# blocks of FILTER_BLOCK_BYTES of transforms instead, each block's U computed, multiplied and
# taken to outputs (dU taken to dw) while it is in cache. Few tiles are where the transforms
# weigh most against the products: measured at one thread on the Zen 5 guest (AMD EPYC, 32 MiB
# L3), the three passes in blocks of 8 MiB against the whole U, median of 5 rounds in turns:
# with 32 tiles 0.84-0.91 of the time (8x512x512x7x7 0.84, 8x1024x512x8x8 0.86, 2x1024x1024x16x16
# 0.87, 2x2048x2048x8x8 at F(2x2) 0.87, 8x1024x1024x8x8 0.90), with 48 0.91 (3x512x512x16x16),
# with 64 0.93-1.03 (16x512x512x7x7, 4x512x512x16x16 0.99, 16x1024x1024x7x7 1.03), with 128
# (8x512x512x16x16, 32x512x512x7x7, 4x256x256x28x28) 1.07-1.10 in 3 rounds: the blocks'
# thinner GEMMs cost more than they save (BENCHMARKS.md, "The filters' transforms in blocks").
# Not with AVX-512 GEMMs (OpenBLAS's SkylakeX kernels on the same machine: 1.11-1.12 of the
# whole U's time on 8x1024x1024x8x8 and 8x1024x512x8x8, forward 1.22-1.31, 0.94 on two
# 512-wide layers), nor on CuPy (no cache to fit), nor where the tiles go in several blocks
# (each would transform every filter again).
FILTER_BLOCK_BYTES = 8 << 20
FILTER_BLOCK_TILES = 48
_MIN_FILTER_BLOCK = 8  # filters: fewer make GEMMs too thin to pay


def filter_block(g, itemsize, xp, a, avx512=None):
    """How many of its F filters a Winograd pass on g (input tile side a) transforms at once:
    all of them (the whole U), or where the call has at most FILTER_BLOCK_TILES tiles, all in
    one block (at most _WINOGRAD_ROWS: more go in several, _winograd_tile_sizes), the whole U
    is more than FILTER_BLOCK_BYTES, on NumPy with a BLAS of AVX2 GEMMs (avx512: as if it ran
    AVX-512 ones or not; default backend.blas_runs_avx512), as many as fit in that (at least
    _MIN_FILTER_BLOCK)."""
    whole = a * a * g.C * g.F * itemsize
    tiles = g.N * -(-g.Ho // (a - 2)) * -(-g.Wo // (a - 2))
    if xp is not np or tiles > min(FILTER_BLOCK_TILES, _WINOGRAD_ROWS) or whole <= FILTER_BLOCK_BYTES:
        return g.F
    if backend.blas_runs_avx512() if avx512 is None else avx512:
        return g.F
    return min(g.F, max(_MIN_FILTER_BLOCK, FILTER_BLOCK_BYTES // (a * a * g.C * itemsize)))


def _filter_block_transforms(w, f0, f1, G2, xp, flipped, out):
    """The transforms of filters f0..f1 of the pass (flipped: w's channels f0..f1, see
    _winograd_filters), one GEMM of G (x) G with their taps into out, as ((m+2)^2, C', k) where
    flipped and ((m+2)^2, k, C') otherwise (the products read it transposed: a GEMM per
    channel of a few filters each, U's own layout, took longer than the products)."""
    if flipped:
        F = w.shape[0]
        taps = w[:, f0:f1].reshape(F * (f1 - f0), 9)  # (a copy of the block's taps)
        return xp.matmul(xp.ascontiguousarray(G2[:, ::-1]), taps.T, out=out).reshape(-1, F, f1 - f0)
    C = w.shape[1]
    xp.matmul(G2, w[f0:f1].reshape((f1 - f0) * C, 9).T, out=out)
    return out.reshape(-1, f1 - f0, C).transpose(0, 2, 1)


def _forward_by_filter_blocks(tiles, w, g, xp, y, flipped):
    """forward with the filters' transforms in blocks of filter_block filters: for each block,
    its U, the products of the call's one block of tiles V with it, their output transform,
    placed into y's filters of the block."""
    m, a, tw = tiles.m, tiles.a, tiles.tw
    (start, n, t0, r, V), = tiles.blocks()
    P, k = n * r * tw, filter_block(g, y.dtype.itemsize, xp, a)
    U = workspace.empty(xp, (a * a, k * g.C), V.dtype)
    M, Y = workspace.empty(xp, a * a * P * k, V.dtype), workspace.empty(xp, m * m * P * k, V.dtype)
    cropped = (m * tiles.th, m * tw) != (g.Ho, g.Wo)
    whole = workspace.empty(xp, (n, k, m * r, m * tw), V.dtype) if cropped else None
    for f0 in range(0, g.F, k):
        f1 = min(g.F, f0 + k)
        kb = f1 - f0
        Uk = _filter_block_transforms(w, f0, f1, tiles.G2, xp, flipped, U[:, :kb * g.C])
        products = M[:a * a * P * kb].reshape(a * a, P, kb)
        xp.matmul(V, Uk, out=products)
        out = Y[:m * m * P * kb].reshape(m * m, P * kb)
        xp.matmul(tiles.A2, products.reshape(a * a, P * kb), out=out)
        _place(out, tiles, n, t0, r, kb, y[:, f0:f1], start, None if whole is None else whole[:, :kb])


def planes_forward(x, w, g, Kd, front, xp, y, flipped=False):
    """A volume's convolution at depth stride and dilation 1 (kernels/conv/volume.py) by
    Winograd with each input plane's tiles transformed once: y[n, :, o] (y (N, F, Do, Ho, Wo),
    any strides, written) sums over kernel planes k the 3x3 convolution (one plane of C channels
    to F, zero padding) of x's plane o - front + k (x (N, C, D, H, W), any strides; zero outside
    0..D-1) with w2's kernel plane k, w2 (F, Kd C, 3, 3) the stacked filters in (plane,
    channel) order (flipped: a full convolution's, with w2 (Kd C, F, 3, 3) the layer's,
    _winograd_filters' meaning). g: the volume's stacked 2-D convolution (Kd C channels to F),
    whose Winograd tile (tile(g), what the kernel table names for it) the planes take.

    The stacked convolution (volume.py) transforms each input plane Kd times, once for every
    output plane that reads it. Here, for each strip of tile rows of a sample, the planes'
    transforms V go into a ring of Kd slots, (m+2)^2 x tiles x (Kd, C), plane p in slot p mod
    Kd, one new plane for each output plane; output plane o's products are one GEMM of the ring
    (tiles x Kd C) with U's kernel planes rolled to the ring's order (slot j holds kernel plane
    (j - q) mod Kd for the window's first plane q)."""
    C, D = x.shape[1:3]
    Do = y.shape[2]
    # the planes as the samples of 2-D tiles, at the tile the volume's stacked convolution g takes
    tiles = _WinogradTiles(x[0].transpose(1, 0, 2, 3), g._replace(N=D, C=C), xp, tile(g))
    m, a, tw = tiles.m, tiles.a, tiles.tw
    U = _winograd_filters(w, tiles.G2, xp, flipped).reshape(a * a, Kd, C, g.F)
    rolled = [xp.roll(U, q, axis=1).reshape(a * a, Kd * C, g.F) for q in range(Kd)]
    rows = tiles.strip * tw
    M, Y = workspace.empty(xp, a * a * rows * g.F, x.dtype), workspace.empty(xp, m * m * rows * g.F, x.dtype)
    cropped = (m * tiles.th, m * tw) != (g.Ho, g.Wo)
    whole = workspace.empty(xp, (1, g.F, m * tiles.strip, m * tw), x.dtype) if cropped else None
    for n, t0, r, o, q, window in _ring_windows(tiles, x, Do, Kd, front):
        P = r * tw
        products = M[:a * a * P * g.F].reshape(a * a, P, g.F)
        xp.matmul(window, rolled[q % Kd], out=products)
        out = Y[:m * m * P * g.F].reshape(m * m, P * g.F)
        xp.matmul(tiles.A2, products.reshape(a * a, P * g.F), out=out)
        _place(out, tiles, 1, t0, r, g.F, y[n:n + 1, :, o], 0, whole)


def _ring_windows(tiles, x, Do, Kd, front):
    """(n, t0, r, o, q, window) for each sample n of x (N, C, D, H, W), strip of tile rows t0
    to t0 + r and output plane o, whose window begins at plane q = o - front: the ring
    ((m+2)^2, tiles of a strip, Kd, C; in the workspace) holding the transformed tiles of
    planes q..q + Kd - 1 (plane p in slot p mod Kd, zero outside 0..D-1, each plane
    transformed once a strip), as window ((m+2)^2, r tw, Kd C) (a view of the ring: valid
    until the next)."""
    N, C, D = x.shape[:3]
    ring = workspace.empty(tiles.xp, (tiles.a ** 2, tiles.strip * tiles.tw, Kd, C), x.dtype)
    for n in range(N):
        tiles.x = x[n].transpose(1, 0, 2, 3)  # the sample's planes as the samples of 2-D tiles
        for t0 in range(0, tiles.th, tiles.strip):
            r = min(tiles.strip, tiles.th - t0)
            P = r * tiles.tw
            held = [None] * Kd  # the plane each slot holds
            slots = ring[:, :P]
            for o in range(Do):
                q = o - front
                for p in range(q, q + Kd):
                    if held[p % Kd] != p:
                        slots[:, :, p % Kd] = tiles.transform(p, 1, t0, r) if 0 <= p < D else 0
                        held[p % Kd] = p
                yield n, t0, r, o, q, slots.reshape(tiles.a ** 2, P, Kd * C)


class _OutputTiles:
    """The output side of backward-filter: blocks of dy (as the input tiles' blocks), zero
    beyond Ho x Wo, channel-last, cut into m x m tiles and taken back through the output
    transform: dM ((m+2)^2, tiles, F) = (A^T (x) A^T)^T @ dy's tiles."""

    def __init__(self, tiles, g, dtype, xp):
        m, a, tw = tiles.m, tiles.a, tiles.tw
        rows = tiles.step * tiles.strip * tw
        self.tiles, self.g, self.xp = tiles, g, xp
        # dy's block channel-last (through planes an odd number of cache lines apart, as x's),
        # zero beyond Ho x Wo, so that the tiles' gather runs over contiguous F
        self.planes = spread_planes(xp, (tiles.step, g.F, m * tiles.strip, m * tw), dtype,
                                    (0, 0, m * tiles.strip, g.Wo))
        self.last = workspace.empty(xp, (tiles.step, m * tiles.strip, m * tw, g.F), dtype)
        self._tiles = workspace.empty(xp, m * m * rows * g.F, dtype)
        self._dM = workspace.empty(xp, a * a * rows * g.F, dtype)

    def back(self, dy, start, n, t0, r):
        """dM ((m+2)^2, n r tw, F) of dy's (N, F, Ho, Wo; any strides) n samples from `start`,
        tile rows t0 to t0 + r (in the workspace: valid until the next call)."""
        tiles, g, xp = self.tiles, self.g, self.xp
        m, a, tw = tiles.m, tiles.a, tiles.tw
        P = n * r * tw
        planes = self.planes[:n, :, :m * r]
        _copy_rows(dy[start:start + n], m * t0, m * (t0 + r), planes)
        block = self.last[:n, :m * r]
        block[...] = planes.transpose(0, 2, 3, 1)
        t = self._tiles[:m * m * P * g.F].reshape(m, m, n, r, tw, g.F)
        t[...] = block.reshape(n, r, m, tw, m, g.F).transpose(2, 4, 0, 1, 3, 5)
        back = self._dM[:a * a * P * g.F].reshape(a * a, P, g.F)
        xp.matmul(tiles.A2.T, t.reshape(m * m, P * g.F), out=back.reshape(a * a, P * g.F))
        return back


def _filters_from(dU_t, G2, xp):
    """dw (F, C, 3, 3) = dU^T (G (x) G) from dU_t ((m+2)^2, F, C), in w's layout."""
    aa, F, C = dU_t.shape
    dw = xp.empty((F, C, 3, 3), dU_t.dtype)
    xp.matmul(dU_t.reshape(aa, F * C).T, G2, out=dw.reshape(F * C, 9))
    return dw


def backward_filter(x, dy, g, xp):
    """dw (F, C, 3, 3) by the forward's tiles: dy's m x m tiles (zero beyond Ho x Wo) taken back
    through the output transform, dM = (A^T (x) A^T)^T @ dy_tiles, then dU_k^T = dM_k^T @ V_k
    (F x C) summed over the blocks, and dw (F C, 9) = dU^T @ (G (x) G), in w's layout."""
    tiles = _WinogradTiles(x, g, xp)
    outputs = _OutputTiles(tiles, g, x.dtype, xp)
    k = filter_block(g, x.dtype.itemsize, xp, tiles.a)
    if k < g.F:  # one block of tiles: dU and dw of k filters at a time, each block's dU in cache
        (start, n, t0, r, V), = tiles.blocks()
        back = outputs.back(dy, start, n, t0, r)
        dw = xp.empty((g.F, g.C, 3, 3), x.dtype)
        dU_t = workspace.empty(xp, (tiles.a ** 2, k, g.C), x.dtype)
        for f0 in range(0, g.F, k):
            f1 = min(g.F, f0 + k)
            block = dU_t[:, :f1 - f0]
            xp.matmul(back[:, :, f0:f1].transpose(0, 2, 1), V, out=block)
            xp.matmul(block.reshape(tiles.a ** 2, -1).T, tiles.G2, out=dw[f0:f1].reshape(-1, 9))
        return dw
    dU_t = workspace.empty(xp, (tiles.a ** 2, g.F, g.C), x.dtype)
    # the first block's product is dU itself: a mini-batch in one block (8 samples of 16x16)
    # needs neither a second buffer of (m+2)^2 C F values nor a pass adding it up
    product = workspace.empty(xp, (tiles.a ** 2, g.F, g.C), x.dtype) if tiles.count() > 1 else None
    first = True
    for start, n, t0, r, V in tiles.blocks():
        back = outputs.back(dy, start, n, t0, r)
        if first:
            xp.matmul(back.transpose(0, 2, 1), V, out=dU_t)
            first = False
        else:
            dU_t += xp.matmul(back.transpose(0, 2, 1), V, out=product)
    return _filters_from(dU_t, tiles.G2, xp)


def planes_backward_filter(x, dy, g, Kd, front, xp):
    """The stacked filters' gradient (F, Kd C, 3, 3) of planes_forward's convolution (x
    (N, C, D, H, W) and dy (N, F, Do, Ho, Wo), any strides), by the same ring of each plane's
    transformed tiles: for output plane o, whose window begins at plane q = o - front, dM_o^T
    @ ring (F x Kd C) goes to the accumulator of the ring's rotation q mod Kd; each is rolled
    back to the kernel planes' order at the end and summed."""
    C, D = x.shape[1:3]
    Do = dy.shape[2]
    # the planes as the samples of 2-D tiles, at the tile the volume's stacked convolution g takes
    tiles = _WinogradTiles(x[0].transpose(1, 0, 2, 3), g._replace(N=D, C=C), xp, tile(g))
    outputs = _OutputTiles(tiles, g, x.dtype, xp)
    a = tiles.a
    sums = workspace.zeros(xp, (Kd, a * a, g.F, Kd * C), x.dtype)  # per rotation of the ring
    product = workspace.empty(xp, (a * a, g.F, Kd * C), x.dtype)
    for n, t0, r, o, q, window in _ring_windows(tiles, x, Do, Kd, front):
        back = outputs.back(dy[n].transpose(1, 0, 2, 3), o, 1, t0, r)  # dy's output planes as samples
        sums[q % Kd] += xp.matmul(back.transpose(0, 2, 1), window, out=product)
    dU = sum(xp.roll(sums[q].reshape(a * a, g.F, Kd, C), -q, axis=2) for q in range(Kd))
    return _filters_from(xp.ascontiguousarray(dU).reshape(a * a, g.F, Kd * C), tiles.G2, xp)


# ---------------------------------------------------------------------------------------------
# Dilated stride-1 layers by sub-grids: with dilation d along an axis, output position r reads
# the padded input at r, r + d, r + 2d, ...: all of one residue class modulo d. Cut into its d
# classes (every d-th position), the layer is d undilated convolutions with the same filters,
# one per class; along both axes, dh * dw of them, run as one convolution over a batch dh * dw
# times larger. A dilated 3x3 layer then takes Winograd (measured in BENCHMARKS.md: 8x256x256
# x32x32 at dilation 2 from 0.75-0.8 to 1.1-1.25 times PyTorch's speed); other dilated layers stay on
# im2col, whose patches read the dilated windows directly at no extra cost.

def subgrids_apply(g, dtype):
    """A dilated stride-1 layer whose sub-grid convolution takes Winograd."""
    return (g.dh, g.dw) != (1, 1) and (g.sh, g.sw) == (1, 1) and applies(_subgrid_geometry(g), dtype)


def subgrids_tile_rows(g):
    """tile_rows of the sub-grid convolution the dilated layer is computed as."""
    return tile_rows(_subgrid_geometry(g))


def subgrids_tile_name(g):
    """tile_name of the sub-grid convolution the dilated layer is computed as."""
    return tile_name(_subgrid_geometry(g))


def _subgrid_geometry(g):
    """The undilated, unpadded convolution over the classes: dh * dw * N samples of
    ceil(Hp / dh) x ceil(Wp / dw) (the padded input, zero-extended to whole classes)."""
    Hp, Wp = padded_size(g)
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



def subgrids_forward(x, w, g, xp, y, flipped=False):
    """y (N, F, Ho, Wo) of a dilated layer: its classes convolved by Winograd (subgrids_apply),
    the classes' outputs put back in place."""
    s = _subgrid_geometry(g)
    classes = _to_subgrids(x, g.pt, g.pl, (g.dh, g.dw), (s.H, s.W), xp)
    out = xp.empty((s.N, s.F, s.Ho, s.Wo), x.dtype)
    forward(classes, w, s, xp, out, flipped)
    _from_subgrids(out, (g.dh, g.dw), y)


def subgrids_backward_filter(x, dy, g, xp):
    """dw of a dilated layer: the classes' backward-filter by Winograd, over the classes of x and
    of dy together (every class shares the filters)."""
    s, d = _subgrid_geometry(g), (g.dh, g.dw)
    return backward_filter(_to_subgrids(x, g.pt, g.pl, d, (s.H, s.W), xp),
                           _to_subgrids(dy, 0, 0, d, (s.Ho, s.Wo), xp), s, xp)


# ---------------------------------------------------------------------------------------------
# What the Winograd passes ask of the workspace (cfp/kernels/workspace.py), for the cost model:
# its 64-byte aligned pieces added up as the passes above take them, the largest of the three.
# tests/test_kernels_workspace.py checks these sums against what the passes ask for.

def _piece(count, itemsize):
    return workspace.piece_bytes(count * itemsize)


def _winograd_tiles_bytes(g, item):
    m, a, th, tw, strip, Hp, Wp, step = _winograd_tile_sizes(g)
    tiles = step * strip * tw
    return (_piece(step * g.C * spread_plane_size(Hp, Wp, item), item) + _piece(step * Hp * Wp * g.C, item)
            + 2 * _piece(a * a * tiles * g.C, item))


def _winograd_forward_bytes(g, item):
    m, a, th, tw, strip, Hp, Wp, step = _winograd_tile_sizes(g)
    rows = step * strip * tw
    cropped = (m * th, m * tw) != (g.Ho, g.Wo)
    k = filter_block(g, item, np, a)  # the filters transformed at once
    return (_winograd_tiles_bytes(g, item) + _piece(a * a * g.C * k, item)
            + _piece(a * a * rows * k, item) + _piece(m * m * rows * k, item)
            + (_piece(step * k * m * strip * m * tw, item) if cropped else 0))


def _winograd_backward_filter_bytes(g, item):
    m, a, th, tw, strip, Hp, Wp, step = _winograd_tile_sizes(g)
    rows = step * strip * tw
    dy_planes = step * g.F * spread_plane_size(m * strip, m * tw, item)
    blocks = -(-g.N // step) * -(-th // strip)
    k = filter_block(g, item, np, a)
    return (_winograd_tiles_bytes(g, item) + _piece(dy_planes, item) + _piece(step * m * strip * m * tw * g.F, item)
            + _piece(m * m * rows * g.F, item) + _piece(a * a * rows * g.F, item)
            + _piece(a * a * g.C * k, item) * (2 if blocks > 1 else 1))


def workspace_bytes(pass_name, g, dtype):
    """The workspace bytes the Winograd pass `pass_name` asks for on geometry g (zero padding)
    in dtype; None for a pass it does not run (its backward-data is a forward)."""
    item = np.dtype(dtype).itemsize
    if pass_name == "forward":
        return _winograd_forward_bytes(g, item)
    if pass_name == "backward-filter":
        return _winograd_backward_filter_bytes(g, item)
    return None


def subgrids_workspace_bytes(pass_name, g, dtype):
    """The same for a dilated layer by sub-grids: its classes, then the Winograd pass on them."""
    item, s = np.dtype(dtype).itemsize, _subgrid_geometry(g)
    classes = _piece(s.N * g.C * s.H * s.W, item)
    if pass_name == "forward":
        return classes + _winograd_forward_bytes(s, item)
    if pass_name == "backward-filter":
        return classes + _piece(s.N * g.F * s.Ho * s.Wo, item) + _winograd_backward_filter_bytes(s, item)
    return None
