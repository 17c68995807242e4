"""The halo exchange of a layer on a grid that splits the image over height and width: which
input rows and columns each rank's windows read (halo_plan, pure arithmetic), and one rank's
exchange of them and its adjoint (Halo). The convolutions (algorithms/base.py) and pooling
(nn/layers.py) run it; perfmodel counts it and cfp.explain draws it (docs/design.md, 3b).
"""
import functools
import math

import numpy as np

from . import backend, comm
from .grid import coords_of
from .kernels import conv_geometry, fold_index, pad_index
from .layout import gather_plan, index_set
from .partition import block_range
from .tensor import move


def window_options(options):
    """The options of conv_options that place a kernel's windows on each channel's image
    (stride, padding, dilation, padding_mode), as a new dict: all but groups, which the halo
    and the output size never read."""
    return {k: v for k, v in options.items() if k != "groups"}


@functools.lru_cache(maxsize=256)
def halo_plan(x_shape, layout, grid_shape, kernel_size, options):
    """The halo exchange of a convolution whose input (global x_shape, NCHW) is laid out by
    `layout` on a grid of `grid_shape` ((axis, size) pairs) that splits height and width, for
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
    ConvAlgorithm refuses, would need nothing.)"""
    N, C, H, W = x_shape
    shape = dict(grid_shape)
    g = conv_geometry((1, 1, H, W), (1, 1) + tuple(kernel_size), **dict(options))
    spans = {}
    for axis, extent, out, s, d, k, before, after in (("height", H, g.Ho, g.sh, g.dh, g.Kh, g.pt, g.pb),
                                                      ("width", W, g.Wo, g.sw, g.dw, g.Kw, g.pl, g.pr)):
        spans[axis] = []
        # the image row each padded row copies, for a padding mode other than zeros
        copies = None if g.mode == "zeros" else pad_index(extent, before, after, g.mode)
        for c in range(shape.get(axis, 1)):
            lo, hi = block_range(out, shape.get(axis, 1), c)
            if hi == lo:
                spans[axis].append((0, range(0), 0, 0, None))
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
    wanted = []
    for r in range(math.prod(shape.values())):
        c = coords_of(r, shape)
        n_ix, c_ix = layout.indices(x_shape, shape, c)[:2]
        wanted.append((n_ix, c_ix, spans["height"][c.get("height", 0)][1], spans["width"][c.get("width", 0)][1]))
    wanted = tuple(wanted)
    return {"spans": spans, "wanted": wanted, "pieces": gather_plan(x_shape, layout, grid_shape, wanted)}


def check_image_fits(plan, x_shape, grid_text, what):
    """ValueError unless every rank of the height and width axes of halo_plan's `plan` computes
    at least one output row and column: an image too small for the grid is refused."""
    for axis, name in (("height", "rows"), ("width", "columns")):
        outs = [span[0] for span in plan["spans"][axis]]
        if min(outs) == 0:
            raise ValueError(
                f"{what}: an input of {x_shape[2]}x{x_shape[3]} gives {sum(outs)} output {name}, too few "
                f"for the {len(outs)} ranks of the {axis} axis of grid {grid_text}: the image "
                f"is too small for the grid; use at most {sum(outs)} ranks along {axis}")


class Halo:
    """One rank's halo exchange for one global input shape (from halo_plan): its output block
    (out_rows x out_cols), the zero padding of its local kernel (top, bottom, left, right), and
    the exchange and its adjoint. `what` names the layer in the refusal of an image too small
    for the grid (fewer output rows or columns than ranks along that axis). Used by the
    convolutions and by pooling."""

    def __init__(self, x_shape, layout, grid, kernel_size, options, what):
        x_shape = tuple(int(n) for n in x_shape)
        plan = halo_plan(x_shape, layout, tuple(grid.shape.items()), tuple(kernel_size),
                         tuple(sorted(options.items())))
        check_image_fits(plan, x_shape, grid.describe(), what)
        self.out_rows, _, top, bottom, self.rows_at = plan["spans"]["height"][grid.coord("height")]
        self.out_cols, _, left, right, self.cols_at = plan["spans"]["width"][grid.coord("width")]
        self.padding = (top, bottom, left, right)  # the local kernel's zero padding
        self.pieces, self.wanted = plan["pieces"], plan["wanted"][grid.rank]
        self.held = layout.indices(x_shape, grid, grid.coords)
        self.comm = grid.comm

    def exchange(self, x, layer):
        """x's block extended by the rows and columns the windows read (phase 'halo')."""
        with comm.tag(layer=layer, phase="halo"):
            return move(x, self.held, self.pieces, self.wanted, self.comm)

    def pad(self, x):
        """The padded block the local kernel convolves without padding, gathered from the
        extended block x (the rows and columns the padded ones copy): x itself where the
        padding is zeros (the kernel's own) or this block meets no border."""
        xp = backend.get_array_module(x)
        if self.rows_at is not None:
            x = x[:, :, backend.index_array(np.asarray(self.rows_at), xp)]
        if self.cols_at is not None:
            x = x[:, :, :, backend.index_array(np.asarray(self.cols_at), xp)]
        return x

    def padded_shape(self, shape):
        """The shape pad() gives an extended block of `shape`."""
        n, c, h, w = shape
        return (n, c, h if self.rows_at is None else len(self.rows_at),
                w if self.cols_at is None else len(self.cols_at))

    def fold(self, d_padded, shape):
        """The adjoint of pad: the gradient of the padded block added onto the extended block's
        rows and columns (of `shape`) that its rows and columns copied."""
        d = d_padded
        for axis, at in ((2, self.rows_at), (3, self.cols_at)):
            if at is not None:
                d = fold_index(d, at, shape[axis], axis)
        return d

    def adjoint(self, dx_extended, layer):
        """The gradient of the extended block added back onto the blocks the rows came from."""
        back = [(d, s, piece) for s, d, piece in self.pieces]
        with comm.tag(layer=layer, phase="halo"):
            return move(dx_extended, self.wanted, back, self.held, self.comm)
