"""The halo exchange of a layer on a grid that splits the image over height and width (a volume
also over depth): which input rows and columns (and planes) each rank's windows read
(halo_plan, pure arithmetic), and one rank's
exchange of them and its adjoint (Halo), and the exchange started with a block's interior
computed while it moves (Halo.start, HaloInFlight). The convolutions (algorithms/base.py) and
pooling (nn/layers.py) run it; perfmodel counts it and cfp.explain draws it (docs/design.md, 3b).
"""
import functools
import math

import numpy as np

from . import backend, comm
from .grid import coords_of
from .kernels import conv_geometry, fold_index, pad_index
from .kernels.conv import volume_geometry
from .kernels.conv.transposed import transposed_geometry
from .layout import gather_plan, index_set, piece_size
from .partition import block_range
from .tensor import move, start_move


def window_options(options):
    """The options of conv_options that place a kernel's windows on each channel's image
    (stride, padding, dilation, padding_mode), as a new dict: all but groups, which the halo
    and the output size never read."""
    return {k: v for k, v in options.items() if k != "groups"}


def window_axes(x_shape, kernel_size, options):
    """Per spatial axis of x_shape (NCHW or NCDHW), the windows of a kernel of kernel_size
    with the spatial `options` (a dict: stride, padding, dilation, padding_mode): (grid axis,
    extent, output extent, stride, dilation, kernel, padding before, padding after), and the
    padding mode; from the kernels' own geometry, so that the halo and the kernels agree.
    A transposed convolution's options (stride, padding, dilation, output_padding) give its
    adjoint convolution's windows, which lie on the output: padding before and after are then
    the signed sides of kernels/conv/transposed.py, and the mode 'transposed'."""
    if "output_padding" in options:
        w_shape = (1, 1) + tuple(kernel_size)
        t = transposed_geometry((1, 1) + tuple(x_shape[2:]), w_shape, groups=1, **options)
        names = ("depth", "height", "width")[3 - len(kernel_size):]
        stride, dilation = t.options["stride"], t.options["dilation"]
        return [(axis, n, o, s, d, k, before, after) for axis, n, o, s, d, k, (before, after)
                in zip(names, x_shape[2:], t.out_shape[2:], stride, dilation, kernel_size, t.sides)], "transposed"
    if len(x_shape) == 5:
        v = volume_geometry((1, 1) + tuple(x_shape[2:]), (1, 1) + tuple(kernel_size), **options)
        g = v.plane
        depth = [("depth", v.D, v.Do, v.sd, v.dd, v.Kd, v.pf, v.pk)]
    else:
        g = conv_geometry((1, 1) + tuple(x_shape[2:]), (1, 1) + tuple(kernel_size), **options)
        depth = []
    return depth + [("height", g.H, g.Ho, g.sh, g.dh, g.Kh, g.pt, g.pb),
                    ("width", g.W, g.Wo, g.sw, g.dw, g.Kw, g.pl, g.pr)], g.mode


@functools.lru_cache(maxsize=256)
def halo_plan(x_shape, layout, grid_shape, kernel_size, options):
    """The halo exchange of a convolution whose input (global x_shape, NCHW, or a volume's
    NCDHW) is laid out by `layout` on a grid of `grid_shape` ((axis, size) pairs) that splits
    height and width (and a volume's depth), for
    kernel_size and the spatial `options` ((name, value) pairs: stride, padding, dilation,
    padding_mode): per axis and coordinate (output extent, input indices needed, zero padding
    before, zero padding after, the padded block's positions in the needed ones or None), the
    indices each rank wants, and the pieces that bring them (layout.gather_plan). Pure
    arithmetic: the algorithms run it, perfmodel counts it.

    Coordinate c of an axis computes output rows o_lo..o_hi-1 (balanced blocks of the output)
    and reads padded input rows s*o_lo - p_before to s*(o_hi - 1) + d*(k - 1) - p_before. With
    zero padding it needs those rows clipped to the image, and the rows beyond the image are
    its local zero padding. With another padding mode a padded row is a copy of an image row
    (kernels.pad_index: reflected, the edge's, wrapped around), which may lie on another rank:
    it needs the image rows its padded rows copy, and builds its padded block from them by an
    index gather (Halo.pad; positions None where that gather is the identity). What it does
    not hold arrives in one all-to-all from whichever ranks hold it, however wide the halo (no
    multi-hop); what it holds but does not need is skipped. (An empty output block, which
    ConvAlgorithm refuses, would need nothing.) A transposed convolution's options (with
    output_padding) give the input rows that reach each output block (_transposed_span) and
    the block's signed sides in place of its zero padding."""
    shape = dict(grid_shape)
    geometry, mode, spans = window_spans(x_shape, grid_shape, kernel_size, options)
    wanted = []
    for r in range(math.prod(shape.values())):
        c = coords_of(r, shape)
        n_ix, c_ix = layout.indices(x_shape, shape, c)[:2]
        wanted.append((n_ix, c_ix) + tuple(spans[axis][c.get(axis, 0)][1] for axis, *_ in geometry))
    wanted = tuple(wanted)
    return {"axes": geometry, "mode": mode, "spans": spans, "wanted": wanted,
            "pieces": gather_plan(x_shape, layout, grid_shape, wanted)}


@functools.lru_cache(maxsize=1024)
def window_spans(x_shape, grid_shape, kernel_size, options):
    """(window_axes' geometry, its mode, {axis: [span of each coordinate]}): halo_plan's spans
    alone, per axis of the windows (output extent, input indices needed, zero padding before,
    after, the padded block's positions or None), arithmetic over each axis's coordinates only
    (what the cost model reads of a halo at any rank count: perfmodel.layer_cost). Arguments as
    halo_plan's."""
    shape = dict(grid_shape)
    geometry, mode = window_axes(x_shape, kernel_size, dict(options))
    spans = {}
    for axis, extent, out, s, d, k, before, after in geometry:
        spans[axis] = []
        # the image row each padded row copies, for a padding mode other than zeros
        copies = None if mode in ("zeros", "transposed") else pad_index(extent, before, after, mode)
        for c in range(shape.get(axis, 1)):
            lo, hi = block_range(out, shape.get(axis, 1), c)
            if hi == lo:
                spans[axis].append((0, range(0), 0, 0, None))
                continue
            if mode == "transposed":
                spans[axis].append(_transposed_span(lo, hi, extent, s, d, k, before))
                continue
            first, last = s * lo - before, s * (hi - 1) + d * (k - 1) - before  # inclusive
            if copies is None:  # the rows read, clipped to the image; the rest zero padding
                start = min(max(0, first), extent)  # a block may read padding only
                need = range(start, max(start, min(extent, last + 1)))
                top = min(max(0, -first), last - first + 1)
                spans[axis].append((hi - lo, need, top, last - first + 1 - top - len(need), None))
                continue
            reads = copies[first + before:last + before + 1]
            rows = np.unique(reads)
            need = index_set(rows)
            at = np.searchsorted(rows, reads)
            identity = np.array_equal(at, np.arange(rows.size))  # a block that meets no border
            spans[axis].append((hi - lo, need, 0, 0, None if identity else tuple(int(i) for i in at)))
    return geometry, mode, spans


def _transposed_span(lo, hi, extent, s, d, k, before):
    """A transposed convolution's span of output rows lo..hi-1 (halo_plan's tuple), from its
    adjoint convolution, whose input row i reads output rows s*i - before + d*j (j < k): the
    input rows reaching the block are those from ceil((lo + before - d*(k - 1)) / s) to
    (hi - 1 + before) // s, clipped to the image, and the block's own signed sides (before,
    after) say where those rows' windows lie on it (kernels/conv/transposed.py): the local
    kernel's output is exactly the block."""
    first = min(extent, max(0, -(-(lo + before - d * (k - 1)) // s)))
    last = min(extent - 1, (hi - 1 + before) // s)
    need = range(first, max(first, last + 1))
    top = lo + before - s * first
    return hi - lo, need, top, s * (len(need) - 1) + d * (k - 1) + 1 - (hi - lo) - top, None


def check_image_fits(plan, x_shape, grid_text, what):
    """ValueError unless every rank of the depth, height and width axes of halo_plan's `plan`
    computes at least one output plane, row and column: an image too small for the grid is
    refused."""
    for axis, name in (("depth", "planes"), ("height", "rows"), ("width", "columns")):
        if axis not in plan["spans"]:
            continue
        outs = [span[0] for span in plan["spans"][axis]]
        if min(outs) == 0:
            size = "x".join(str(n) for n in x_shape[2:])
            raise ValueError(
                f"{what}: an input of {size} gives {sum(outs)} output {name}, too few "
                f"for the {len(outs)} ranks of the {axis} axis of grid {grid_text}: the "
                f"{'volume' if len(x_shape) == 5 else 'image'} is too small for the grid; use at most "
                f"{sum(outs)} ranks along {axis}")


class Halo:
    """One rank's halo exchange for one global input shape (from halo_plan): its output block
    (out_size: (D',) H', W'), the zero padding of its local kernel (two sides an axis), and
    the exchange and its adjoint. `what` names the layer in the refusal of an image too small
    for the grid (fewer output rows or columns than ranks along that axis). Used by the
    convolutions and by pooling."""

    def __init__(self, x_shape, layout, grid, kernel_size, options, what):
        x_shape = tuple(int(n) for n in x_shape)
        plan = halo_plan(x_shape, layout, tuple(grid.shape.items()), tuple(kernel_size),
                         tuple(sorted(options.items())))
        check_image_fits(plan, x_shape, grid.describe(), what)
        geometry = plan["axes"]
        # per spatial axis: (output extent, the rows needed (a range of the image's), the zero
        # rows before and after them, the padded block's positions in the needed ones or None)
        spans = [plan["spans"][axis][grid.coord(axis)] for axis, *_ in geometry]
        self.out_size = tuple(span[0] for span in spans)  # this rank's output block, (D',) H', W'
        self.at = tuple(span[4] for span in spans)
        # the local kernel's zero padding (a transposed convolution's: its block's signed sides)
        self.padding = tuple(side for span in spans for side in span[2:4])
        self.pieces, self.wanted, self.rank = plan["pieces"], plan["wanted"][grid.rank], grid.rank
        self.held = layout.indices(x_shape, grid, grid.coords)
        self.comm = grid.comm
        # per axis: stride, dilation, kernel, the padded block's zero rows before, the rows
        # needed, the zero rows after
        self._axes = [(s, d, k, span[2], span[1], span[3]) for (_, _, _, s, d, k, _, _), span in zip(geometry, spans)]
        self.interior = None if plan["mode"] == "transposed" else self._interior()

    def _interior(self):
        """A range of output positions per spatial axis ((planes,) rows, columns): the part of
        this rank's output block whose windows read only what it holds (or the zero padding
        beside it), which it computes while the halo moves (HaloInFlight); None where there is
        none, or where another padding mode's rows are gathered into the block (Halo.pad).

        In the padded block (`top` zero rows, the needed rows, the zero rows after) the held
        rows are positions own_lo..own_hi-1, widened to the block's first position where it
        holds the first needed row and to its last where it holds the last. Output row o reads
        positions s*o .. s*o + d*(k - 1), so the interior rows are ceil(own_lo / s) ..
        (own_hi - 1 - d*(k - 1)) // s."""
        if any(at is not None for at in self.at):
            return None
        spans = []
        for (s, d, k, top, need, after), held, out in zip(self._axes, self.held[2:], self.out_size):
            own_lo = top + max(held.start, need.start) - need.start
            own_hi = top + min(held.stop, need.stop) - need.start
            if own_hi <= own_lo:
                return None
            if held.start <= need.start:
                own_lo = 0
            if held.stop >= need.stop:
                own_hi = top + len(need) + after
            first, last = -(-own_lo // s), min(out, (own_hi - 1 - d * (k - 1)) // s + 1)
            if last <= first:
                return None
            spans.append(range(first, last))
        return tuple(spans)

    def window(self, outs, source="extended"):
        """What the local kernel convolves to give the output positions `outs` (a range per
        spatial axis: (planes,) rows, columns) of this rank's block: a slice per axis of the
        extended block (source 'extended') or of the block held before the exchange ('held'),
        and the zero padding (two sides an axis, in the kernels' order) to put around them."""
        slices, padding = [], []
        for (s, d, k, top, need, _), held, out in zip(self._axes, self.held[2:], outs):
            a, b = s * out.start, s * (out.stop - 1) + d * (k - 1) + 1  # the padded positions read
            lo, hi = max(a, top), min(b, top + len(need))  # of them, the image's rows
            if hi <= lo:  # a window over padding only
                slices.append(slice(0, 0))
                padding += [b - a, 0]
                continue
            shift = top if source == "extended" else top - need.start + held.start
            slices.append(slice(lo - shift, hi - shift))
            padding += [lo - a, b - hi]
        return tuple(slices), tuple(padding)

    def start(self, x, layer):
        """The exchange of exchange(x) started, as a HaloInFlight that computes the interior
        while it moves (phase 'halo'; the same messages and bytes as exchange)."""
        with comm.tag(layer=layer, phase="halo"):
            return HaloInFlight(self, x, start_move(x, self.held, self.pieces, self.wanted, self.comm))

    def bytes(self, itemsize):
        """(sent, received) by this rank in one exchange (the adjoint moves the same pieces back),
        counted as the ledger counts them: each piece that leaves it or reaches it from another."""
        sent = sum(piece_size(p) for s, d, p in self.pieces if s == self.rank != d)
        received = sum(piece_size(p) for s, d, p in self.pieces if d == self.rank != s)
        return sent * itemsize, received * itemsize

    def exchange(self, x, layer):
        """x's block extended by the rows and columns the windows read (phase 'halo')."""
        with comm.tag(layer=layer, phase="halo"):
            return move(x, self.held, self.pieces, self.wanted, self.comm)

    def pad(self, x):
        """The padded block the local kernel convolves without padding, gathered from the
        extended block x (the rows and columns the padded ones copy): x itself where the
        padding is zeros (the kernel's own) or this block meets no border."""
        xp = backend.get_array_module(x)
        for axis, at in enumerate(self.at, start=2):
            if at is not None:
                x = x[(slice(None),) * axis + (backend.index_array(np.asarray(at), xp),)]
        return x

    def padded_shape(self, shape):
        """The shape pad() gives an extended block of `shape`."""
        return tuple(shape[:2]) + tuple(n if at is None else len(at) for n, at in zip(shape[2:], self.at))

    def fold(self, d_padded, shape):
        """The adjoint of pad: the gradient of the padded block added onto the extended block's
        rows and columns (of `shape`) that its rows and columns copied."""
        d = d_padded
        for axis, at in enumerate(self.at, start=2):
            if at is not None:
                d = fold_index(d, at, shape[axis], axis)
        return d

    def adjoint(self, dx_extended, layer, donate=False):
        """The gradient of the extended block added back onto the blocks the rows came from.
        donate: dx_extended is the caller's to give up (a convolution's fresh dx), and the
        neighbours' rows are added onto this rank's own rows of it in place, which the result
        is a view of (tensor.start_move's donate), instead of onto a copy of them."""
        back = [(d, s, piece) for s, d, piece in self.pieces]
        with comm.tag(layer=layer, phase="halo"):
            return move(dx_extended, self.wanted, back, self.held, self.comm, donate=donate)


class HaloInFlight:
    """A halo exchange in flight (Halo.start): forward(s, conv) gives the output of samples s
    of the block, computing first the interior from the block held (Halo.interior), then,
    once the extended block has arrived, the border around it (border_boxes: the slabs before
    and after the interior along each spatial axis in turn, across the interior's extent of
    the axes before it and the whole of those after). conv(block, padding) is the local kernel
    on a window with that zero padding, or (padding None) on the extended block as the exchange
    left it. Later calls, and every call where the block has no interior, convolve the
    extended block whole (x must not be written until the first call)."""

    def __init__(self, halo, x, moving):
        self.halo, self._x, self._moving = halo, x, moving

    def wait(self):
        """The extended block (exchange's result)."""
        return self._moving.wait()

    def forward(self, s, conv):
        halo, x, self._x = self.halo, self._x, None
        if x is None or halo.interior is None:  # a later call, or no interior: the block whole
            return conv(self.wait()[s], None)
        slices, padding = halo.window(halo.interior, source="held")
        inner = conv(x[s][_ALL2 + slices], padding)
        extended = self.wait()[s]
        xp = backend.get_array_module(inner)
        y = xp.empty(inner.shape[:2] + tuple(halo.out_size), inner.dtype)
        y[_ALL2 + _slices(halo.interior)] = inner
        for box in border_boxes(halo.interior, halo.out_size):
            slices, padding = halo.window(box)
            y[_ALL2 + _slices(box)] = conv(extended[_ALL2 + slices], padding)
        return y


_ALL2 = (slice(None), slice(None))  # every sample and channel of a block


def _slices(box):
    """The slices of a box (a range per spatial axis)."""
    return tuple(slice(r.start, r.stop) for r in box)


def border_boxes(interior, out_size):
    """The boxes (a range per axis) that cover an output block of out_size around its
    `interior` box once each: along each axis in turn, the slabs before and after the
    interior, across the interior's ranges of the axes before it and the whole of the axes
    after it (an image's rows above and below at full width, then the columns beside the
    interior; a volume's planes first)."""
    boxes = []
    for a, inner in enumerate(interior):
        for part in (range(0, inner.start), range(inner.stop, out_size[a])):
            box = tuple(interior[:a]) + (part,) + tuple(range(n) for n in out_size[a + 1:])
            if all(len(r) for r in box):
                boxes.append(box)
    return boxes
