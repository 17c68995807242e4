"""What the distributed convolution algorithms share: geometry, weight shards and their index
sets, the segmented gradient allreduce. Each algorithm module holds only its recipe.

Shapes, with n the local sample count (N over P_n) and C_c, F_c this rank's block of C and F
over P_c: x arrives as (n, C_c, H, W) (or (n, C, H, W) when the input is whole over the
channel axis), y leaves as (n, F_c, H', W'), and the weight shard is w[F_idx][:, C_idx]. All
of these are layouts (cfp/layout.py): `input_layout`, `output_layout`, `weight_layout`,
`bias_layout`, and every index set below is read from them.
"""
import collections
import functools
import math

import numpy as np

from .. import backend, comm
from ..checks import float_dtype, int_pair, positive_int
from ..kernels import (conv2d_backward_data, conv2d_backward_filter, conv2d_forward, conv2d_output_shape,
                       conv_geometry, conv_options, fold_index, pad_index)
from ..grid import coords_of
from ..layout import Shard, gather_plan, index_set
from ..partition import block_range, block_sizes, filter_groups_of
from ..tensor import Layout, check_blocks, move


Message = collections.namedtuple("Message", "phase collective group tensor")
Message.__doc__ = """One collective of an algorithm's forward and backward pass, in the stationary-w view
of the channel group (channel rank c at (row, column) = divmod(c, p_f)):

phase:      the ledger phase ('forward', 'backward-filter', 'backward-data', 'gradient-sync')
collective: 'allgather', 'reduce_scatter' or 'allreduce'
group:      'row' (the p_f ranks whose x blocks c gathers), 'column' (the q = P_c / p_f ranks it
            reduce-scatters y with) or 'gradient' (the ranks holding the same shard)
tensor:     'x' (x or dx: the row's channel blocks), 'y' (y or dy: the column's filter blocks)
            or 'w' (the weight and bias shards)

Each algorithm's `messages` is the one description of its communication: its forward and
backward run exactly these collectives (the ledger test checks it), and perfmodel's
predict_bytes and layer_cost price them, so a new algorithm is written once. A forward gather
of x is not sent when the input is whole (the first layer), nor is anything of backward-data
when no dx is wanted."""

GRADIENT_SYNC = Message("gradient-sync", "allreduce", "gradient", "w")
# On a grid that splits the image, a layer's forward begins with the halo exchange of x and its
# backward ends with the adjoint, which sends the gradient of the same rows back (one
# all-to-all over the grid each; Halo below).
HALO = Message("halo", "alltoall", "grid", "x")
HALO_ADJOINT = Message("halo", "alltoall", "grid", "dx")


def run_order(messages, spatial):
    """The collectives of one forward and backward pass in the order a layer runs them: the
    halo exchange, `messages` in their order (forward, then backward's), the halo's adjoint."""
    return ((HALO,) if spatial else ()) + tuple(messages) + ((HALO_ADJOINT,) if spatial else ())


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
            x = x[:, :, xp.asarray(self.rows_at)]
        if self.cols_at is not None:
            x = x[:, :, :, xp.asarray(self.cols_at)]
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


def activation_layout(grid_shape, channel):
    """NCHW split by sample, by `channel` over the channel axis (a Shard, 'channel' or None),
    and by height and width where the grid has those axes."""
    shape = dict(grid_shape)
    return Layout(("sample", channel, "height" if shape.get("height", 1) > 1 else None,
                   "width" if shape.get("width", 1) > 1 else None))


class ConvAlgorithm:
    """Base of the distributed convolutions on a sample x channel ProcessGrid.

    Subclasses set `name` and implement `forward(x, w, b)` and `backward(dy)`; `p_f` is the
    algorithm's filter groups in the stationary-w view (1 for stationary-x, P_c for
    stationary-y, given or default for stationary-w; partition.filter_groups_of).
    `backward` returns (dx, dw, db) with dw and db already summed over the ranks holding the
    same shard (the segmented allreduce), so they equal the shard of the serial gradient.
    """

    name = "?"
    weight_replicated = False  # True for sample parallelism: every rank holds all of w
    messages = ()  # the collectives of one forward and backward pass (Message)

    def __init__(self, grid, in_channels, out_channels, kernel_size, stride=1, padding=0,
                 bias=True, input_whole=False, need_dx=True, layer="conv", filter_groups=None,
                 dilation=1, groups=1, padding_mode="zeros", split_image=True):
        self.grid = grid
        self.C = positive_int(in_channels, "in_channels")
        self.F = positive_int(out_channels, "out_channels")
        self.kernel_size = int_pair(kernel_size, "kernel_size", 1, "a positive integer")
        # PyTorch's nn.Conv2d options (kernels/conv.py): checked now, the shapes at forward
        self.options = conv_options(stride, padding, dilation, groups, padding_mode)
        self.stride, self.padding = self.options["stride"], self.options["padding"]
        self.groups = self.options["groups"]
        if self.C % self.groups or self.F % self.groups:
            raise ValueError(f"{layer}: groups={self.groups} must divide in_channels={self.C} and "
                             f"out_channels={self.F}")
        self.w_global_shape = (self.F, self.C // self.groups) + self.kernel_size
        self.bias = bool(bias)
        # Two separate facts: x holds all C channels on every channel rank (the images at the
        # network's first layer; always so under sample parallelism), and whether backward
        # computes dx at all (not for the first layer, whose input is data).
        self.input_whole = bool(input_whole) or self.weight_replicated
        self.need_dx = bool(need_dx)
        self.layer = layer
        if self.input_whole and self.need_dx and not self.weight_replicated:
            raise ValueError(f"{layer}: algorithm {self.name!r} with its input whole over the channel axis "
                             f"computes no dx (the network's first layer); give it a channel-split input "
                             f"(a Redistribute before it) or need_dx=False")
        # split_image=False: a layer on a spatial grid whose input is not split over height and
        # width (the classifier after global pooling): those ranks then hold copies
        self.P_h, self.P_w = (grid.axis_size("height"), grid.axis_size("width")) if split_image else (1, 1)
        self.spatial = self.P_h * self.P_w > 1
        self.P_n, self.P_c = grid.axis_size("sample"), grid.axis_size("channel")
        self.p_f = filter_groups_of(self.name, self.P_c, filter_groups)
        c = grid.coord("channel")
        self.channel_comm = grid.axis_comm("channel")
        # the ranks holding the same shard: other samples and (when it splits the image) other blocks
        self.gradient_comm = grid.complement_comm("channel") if split_image else grid.axis_comm("sample")
        self.w_filters, self.w_channels, self.b_filters = self.shard_indices(c)
        self.x_channels = list(self.input_layout.indices((1, self.C, 1, 1), grid, grid.coords)[1])
        self._saved = None
        self._output_shape = None
        self._halo, self._halo_plans = None, {}

    def shard_indices(self, c):
        """(filters, channels, bias filters): the global indices of the weight and bias shard
        held at channel coordinate c, read from weight_layout and bias_layout."""
        coords = {**self.grid.coords, "channel": c}
        filters, channels = self.weight_layout.indices(self.w_global_shape, self.grid, coords)[:2]
        (bias_filters,) = self.bias_layout.indices((self.F,), self.grid, coords)
        return list(filters), list(channels), list(bias_filters)

    # -- shapes ------------------------------------------------------------------------------

    @property
    def weight_shape(self):
        """Shape of this rank's weight shard."""
        return (len(self.w_filters), len(self.w_channels)) + self.kernel_size

    @property
    def bias_shape(self):
        return (len(self.b_filters),)

    @classmethod
    def input_channel(cls, input_whole, groups):
        """How x's channels are split over the channel axis: by block, or not at all when the
        input is whole (the first layer; sample parallelism)."""
        return None if input_whole or cls.weight_replicated else "channel"

    @classmethod
    def layouts(cls, image_split, p_f, input_whole=False, groups=1):
        """{'x', 'y', 'w', 'b'}: the layouts of x, y (and dy), the weight and the bias of this
        algorithm with p_f filter groups, on a grid splitting the image as `image_split`
        ({'height': P_h, 'width': P_w}). Pure: the layer reads its layouts from here, and so
        does cfp.explain, which has no grid.

        x: split by sample, by channel unless every rank holds all of C, and by height and
        width (balanced blocks of the image's rows and columns). y: by sample, by filter unless
        w is whole everywhere, by height and width in blocks of the output. w (F, C, Kh, Kw)
        over the channel axis: whole under sample parallelism; by input channel under
        stationary-x, by filter under stationary-y; under stationary-w the filters of the
        column's blocks and the channels of the row's (partition.py). b (F,): added where y's
        filter block is, so it follows y's filter split."""
        whole = input_whole or cls.weight_replicated
        out = {"x": activation_layout(image_split, cls.input_channel(whole, groups)),
               "y": activation_layout(image_split, None if cls.weight_replicated else "channel"),
               "b": Layout((None if cls.weight_replicated else "channel",))}
        if cls.weight_replicated:
            out["w"] = Layout.replicated(4)
        elif cls.name == "x":
            out["w"] = Layout((None, "channel", None, None))
        elif cls.name == "y":
            out["w"] = Layout(("channel", None, None, None))
        else:
            out["w"] = Layout((Shard("channel", "column", p_f), Shard("channel", "row", p_f), None, None))
        return out

    @property
    def _layouts(self):
        return self.layouts(self.image_split, self.p_f, self.input_whole, self.groups)

    @property
    def input_layout(self):
        """x's layout (layouts()['x'])."""
        return self._layouts["x"]

    @property
    def output_layout(self):
        """y's (and dy's) layout (layouts()['y'])."""
        return self._layouts["y"]

    @property
    def image_split(self):
        """{'height': P_h, 'width': P_w}: how this layer splits the image (1 x 1 when it does not)."""
        return {"height": self.P_h, "width": self.P_w}

    @property
    def weight_layout(self):
        """w's layout (layouts()['w'])."""
        return self._layouts["w"]

    @property
    def bias_layout(self):
        """b's layout (layouts()['b'])."""
        return self._layouts["b"]

    def output_hw(self, H, W):
        """The output's (H', W') for an input of H x W."""
        spatial = {k: v for k, v in self.options.items() if k != "groups"}
        return conv2d_output_shape((1, 1, H, W), (1, 1) + self.kernel_size, **spatial)[2:]

    # -- spatial splits: the halo ---------------------------------------------------------------

    def halo_plan(self, x_shape):
        """This rank's Halo for a global input of x_shape (cached per shape)."""
        key = tuple(int(n) for n in x_shape)
        if key not in self._halo_plans:
            spatial = {k: v for k, v in self.options.items() if k != "groups"}
            self._halo_plans[key] = Halo(key, self.input_layout, self.grid, self.kernel_size, spatial, self.layer)
        return self._halo_plans[key]

    def halo(self, x):
        """x's block extended by the rows and columns its kernel windows read (phase 'halo')."""
        return self._halo.exchange(x, self.layer) if self.spatial else x

    def halo_adjoint(self, dx_extended):
        """The adjoint of halo: each rank's gradient of its extended block added back onto the
        blocks of the ranks the rows came from (phase 'halo')."""
        if not self.spatial or dx_extended is None:
            return dx_extended
        return self._halo.adjoint(dx_extended, self.layer)

    # -- the local kernels, on this rank's (extended) block ------------------------------------

    def kernel_args(self):
        """The kernels' arguments for this rank's block: the layer's options, on a spatial grid
        with the padding of the halo plan (zero rows only where the block meets the border), or
        none where another padding mode's rows were gathered into the block (Halo.pad)."""
        args = dict(self.options)
        if self.spatial:
            args["padding"] = self._halo.padding
            args["padding_mode"] = "zeros"  # a non-zero mode's padded rows are in the block
        return args

    def local_forward(self, x, w, b=None):
        return conv2d_forward(self._padded(x), w, b, **self.kernel_args())

    def local_backward_data(self, dy, w, x_shape):
        if not self.spatial:
            return conv2d_backward_data(dy, w, x_shape, **self.kernel_args())
        d_padded = conv2d_backward_data(dy, w, self._halo.padded_shape(x_shape), **self.kernel_args())
        return self._halo.fold(d_padded, x_shape)

    def local_backward_filter(self, x, dy, w_shape):
        return conv2d_backward_filter(self._padded(x), dy, w_shape, **self.kernel_args())

    def _padded(self, x):
        return self._halo.pad(x) if self.spatial else x

    def check_input(self, x, w, b, input_shape=None):
        """The checks of forward's inputs: dtypes (float32 or float64, one for all), this rank's
        shapes, then, collectively, that the ranks' x blocks form one tensor (tensor.check_blocks,
        skipped inside comm.inputs_checked()), so that no rank computes on a tensor the others
        do not share. Remembers the output block's shape for backward's check of dy."""
        float_dtype(x.dtype, f"{self.layer}: x")
        for name, a in (("weight shard", w), ("bias shard", b)):
            if a is not None and a.dtype != x.dtype:
                raise ValueError(f"{self.layer}: {name} has dtype {a.dtype}, x has {x.dtype}; "
                                 f"expected one dtype for both")
        if x.ndim != 4 or x.shape[1] != len(self.x_channels):
            raise ValueError(
                f"{self.layer}: x block has shape {tuple(x.shape)}, expected (n, "
                f"{len(self.x_channels)}, H, W) for C={self.C} on {self.grid.describe()}"
            )
        if tuple(w.shape) != self.weight_shape:
            raise ValueError(f"{self.layer}: weight shard has shape {tuple(w.shape)}, "
                             f"expected {self.weight_shape}")
        if self.bias and (b is None or tuple(b.shape) != self.bias_shape):
            got = None if b is None else tuple(b.shape)
            raise ValueError(f"{self.layer}: bias shard has shape {got}, expected {self.bias_shape}")
        checked = check_blocks(x, self.input_layout, self.grid, f"{self.layer}: x")
        shape = tuple(input_shape) if input_shape is not None else checked
        if shape is None and self.spatial:
            raise ValueError(f"{self.layer}: on a spatial grid forward needs the global input shape "
                             f"(input_shape=), which a trusted caller passes")
        n = x.shape[0]
        filters = self.F if self.weight_replicated else len(self.b_filters)
        H, W = (shape[2], shape[3]) if self.spatial else x.shape[2:]
        self._halo = self.halo_plan((shape[0] if shape else n, self.C, H, W)) if self.spatial else None
        rows, cols = (self._halo.out_rows, self._halo.out_cols) if self.spatial else self.output_hw(H, W)
        self._output_shape = (n, filters, rows, cols)

    @property
    def kept_bytes(self):
        """Bytes forward keeps for backward: the input as the kernel used it (this rank's block,
        or the channels gathered for it). 0 before the first forward."""
        return 0 if self._saved is None else int(self._saved[0].nbytes)

    def saved_for(self, dy):
        """What forward kept for backward, after checking that dy is the gradient of the block
        forward returned (its shape and dtype)."""
        if self._saved is None:
            raise ValueError(f"{self.layer}: backward called before forward")
        x, w = self._saved
        if tuple(dy.shape) != tuple(self._output_shape) or dy.dtype != x.dtype:
            raise ValueError(f"{self.layer}: dy block has shape {tuple(dy.shape)} and dtype {dy.dtype}; "
                             f"expected {tuple(self._output_shape)} {x.dtype}, the output block of forward")
        return x, w

    def sends(self, message):
        """Whether `message` (one of self.messages) is sent by this layer."""
        if message.phase == "backward-data":
            return self.need_dx
        return not (message.phase == "forward" and message.tensor == "x" and self.input_whole)

    def conv_args(self):
        """The kernels' keyword arguments: stride, padding, dilation, groups, padding_mode."""
        return dict(self.options)

    # -- shards of global tensors ------------------------------------------------------------

    def shard_weight(self, w):
        """This rank's shard of the global weight (F, C, Kh, Kw)."""
        xp = backend.get_array_module(w)
        return xp.ascontiguousarray(w[self.w_filters][:, self.w_channels])

    def shard_bias(self, b):
        return b[self.b_filters].copy()

    def gather_weight(self, w_shard):
        """The global weight (F, C/groups, Kh, Kw) on every rank, from the channel ranks' shards."""
        pieces = [self.shard_indices(c)[:2] for c in range(self.P_c)]
        per_filter_channel = self.kernel_size[0] * self.kernel_size[1]
        flat = self._gather_flat(w_shard, [len(f) * len(ch) * per_filter_channel for f, ch in pieces])
        out = np.zeros(self.w_global_shape, dtype=w_shard.dtype)
        for (f, ch), block in zip(pieces, flat):
            out[np.ix_(f, ch)] = block.reshape((len(f), len(ch)) + self.kernel_size)
        return out

    def gather_bias(self, b_shard):
        """The global bias (F,) on every rank."""
        pieces = [self.shard_indices(c)[2] for c in range(self.P_c)]
        flat = self._gather_flat(b_shard, [len(f) for f in pieces])
        out = np.zeros(self.F, dtype=b_shard.dtype)
        for f, block in zip(pieces, flat):
            out[f] = block.reshape(-1)
        return out

    def _gather_flat(self, shard, sizes):
        """The flattened shards of all channel ranks (sizes[c] elements at coordinate c)."""
        flat = np.ascontiguousarray(backend.to_host(shard)).reshape(-1)
        return np.split(comm.allgather(self.channel_comm, flat, 0, sizes), np.cumsum(sizes)[:-1])

    # -- gradient synchronisation ------------------------------------------------------------

    def sync_gradients(self, dw, db):
        """Segmented allreduce: sum dw (and db) over the P/P_c ranks holding the same shard,
        as one message. With P_c = 1 it is the data-parallel allreduce."""
        xp = backend.get_array_module(dw)
        parts = [dw.reshape(-1)] + ([db.reshape(-1)] if db is not None else [])
        with comm.tag(layer=self.layer, phase="gradient-sync"):
            total = comm.allreduce(self.gradient_comm, xp.concatenate(parts))
        dw = total[:dw.size].reshape(dw.shape)
        db = total[dw.size:].reshape(db.shape) if db is not None else None
        return dw, db

    def __repr__(self):
        return (f"{type(self).__name__}({self.layer}: C={self.C}, F={self.F}, "
                f"kernel={self.kernel_size}, grid {self.grid.describe()})")


def channel_block_sizes(extent, grid):
    """Block sizes of `extent` over the channel axis of `grid`."""
    return block_sizes(extent, grid.axis_size("channel"))
