"""What the distributed convolution algorithms share: geometry, weight shards and their index
sets, the segmented gradient allreduce. Each algorithm module holds only its recipe.

Shapes, with n the local sample count (N over P_n) and C_c, F_c this rank's block of C and F
over P_c: x arrives as (n, C_c, H, W) (or (n, C, H, W) when the input is whole over the
channel axis), y leaves as (n, F_c, H', W'), and the weight shard is w[F_idx][:, C_idx]. All
of these are layouts (cfp/layout.py): `input_layout`, `output_layout`, `weight_layout`,
`bias_layout`, and every index set below is read from them.
"""
import collections
import contextlib
import functools
import types

from .. import backend, comm
from ..checks import float_dtype, int_tuple, positive_int
from ..halo import Halo, window_options
from ..kernels.conv import conv_op, filters_kept
from ..layout import activation_layout
from ..partition import block_range, block_sizes
from ..tensor import DistTensor, Layout, check_blocks


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
# all-to-all over the grid each; cfp/halo.py).
HALO = Message("halo", "alltoall", "grid", "x")
HALO_ADJOINT = Message("halo", "alltoall", "grid", "dx")


def run_order(messages, spatial):
    """The collectives of one forward and backward pass in the order a layer runs them: the
    halo exchange, `messages` in their order (forward, then backward's), the halo's adjoint."""
    return ((HALO,) if spatial else ()) + tuple(messages) + ((HALO_ADJOINT,) if spatial else ())


def by_features(n, chunks):
    """Whether a pass in `chunks` chunks of a block of n samples splits its features instead:
    a block of at least as many samples as chunks is cut by sample, a smaller one (one sample
    of a large image) along the channel axis its pipelined collective moves (feature_chunks).
    The layer (ConvAlgorithm.pipelined) and perfmodel both ask here."""
    return chunks > 1 and n < chunks


def feature_chunk_tensors(cls, input_whole, need_dx):
    """{'forward', 'backward'}: the tensor ('x' or 'y', None where the pass moves nothing of its
    own) whose channel axis each pass of `cls` splits into feature chunks: its reduce-scatter's,
    where it has one (the partial results summed over the group, chunk by chunk), else its
    allgather's (the gathered input, chunk by chunk; the results added up). Read from the
    algorithm's `messages`: stationary-x chunks its filters both ways, stationary-y its
    channels, stationary-w its filters forward and its channels backward (its filters where it
    computes no dx)."""
    out = {}
    for stage, phases in (("forward", ("forward",)), ("backward", ("backward-filter", "backward-data"))):
        sent = [m for m in cls.messages if m.phase in phases and m.group in ("row", "column")
                and message_sent(m, input_whole, need_dx)]
        by = [m for m in sent if m.collective == "reduce_scatter"] or sent
        out[stage] = by[0].tensor if by else None
    return out


def feature_chunk_limit(cls, C, F, P_c, input_whole, need_dx):
    """The most feature chunks a layer of `cls` (C channels in, F filters, P_c channel ranks)
    takes: the smallest block, over P_c, of the axes its passes split (feature_chunk_tensors),
    so that every rank holds at least one feature of each chunk; 0 where no pass moves
    anything of its own."""
    extent = {"x": C, "y": F}
    split = [extent[t] // P_c for t in feature_chunk_tensors(cls, input_whole, need_dx).values() if t]
    return min(split) if split else 0


def chunks_fit(n, chunks, limit):
    """Whether a pass over a block of n samples runs in `chunks` chunks: of samples where it
    holds that many, else of features where the smallest feature block (feature_chunk_limit)
    holds that many, or as one chunk where nothing of its own moves (limit 0). What the layer,
    train.check_chunks, the cost model and the planner all ask."""
    return chunks <= n or not limit or chunks <= limit


def feature_chunks(sizes, k):
    """The k feature chunks of an axis held in blocks of `sizes` by a group's ranks: chunk j
    is the j-th of k balanced pieces of every rank's block (partition.block_range), as (its
    indices in the whole axis, in rank order, and its pieces' sizes, rank by rank: the block
    sizes of chunk j's collective). Each rank's pieces, chunk after chunk, are its block."""
    offsets = [sum(sizes[:r]) for r in range(len(sizes))]
    chunks = []
    for j in range(k):
        ranges = [block_range(size, k, j) for size in sizes]
        chunks.append(([o + i for o, (a, b) in zip(offsets, ranges) for i in range(a, b)],
                       [b - a for a, b in ranges]))
    return chunks


def with_channels(shape, features):
    """`shape` (n, C, ...) with the channel extent of `features` (None: as it is)."""
    return tuple(shape) if features is None else (shape[0], len(features)) + tuple(shape[2:])


def message_sent(message, input_whole, need_dx):
    """Whether a layer sends `message` (one of its algorithm's `messages`): not the forward's
    gather of x when its input is whole over the channel axis (the first layer), nor anything
    of backward-data when it computes no dx. The layer (ConvAlgorithm.sends) and perfmodel
    both ask here."""
    if message.phase == "backward-data":
        return need_dx
    return not (message.phase == "forward" and message.tensor == "x" and input_whole)


class ConvAlgorithm:
    """Base of the distributed convolutions on a ProcessGrid of sample x depth x height x width
    x channel axes (the image split over height and width, a volume's also over depth, by a
    halo exchange, cfp/halo.py; depth splits volumes only).

    Subclasses set `name` and `messages`, declare their weight layout (`weight_layout_of`) and
    their filter groups (`filter_groups`), and implement `forward(x, w, b)` and `backward(dy)`;
    `p_f` is the algorithm's filter groups in the stationary-w view (1 for stationary-x, P_c
    for stationary-y, given or default for stationary-w).
    `backward` returns (dx, dw, db) with dw and db already summed over the ranks holding the
    same shard (the segmented allreduce), so they equal the shard of the serial gradient.
    """

    name = "?"
    weight_replicated = False  # True for sample parallelism: every rank holds all of w
    messages = ()  # the collectives of one forward and backward pass (Message)
    # whether backward starts the gradient sum before it computes dx, so that a sum started in
    # a bucket moves while dx computes; dw_by_chunks: dw is computed chunk by chunk beside dx
    # (pipelined_backward), so the sum starts before the last chunk's dx only (perfmodel's
    # layer_cost and overlapped_step read both)
    sums_before_data = False
    dw_by_chunks = False

    def __init__(self, grid, in_channels, out_channels, kernel_size, stride=1, padding=0,
                 bias=True, input_whole=False, need_dx=True, layer="conv", filter_groups=None,
                 dilation=1, groups=1, padding_mode="zeros", split_image=True, chunks=1, halo_interior=False,
                 op="conv2d", output_padding=0):
        self.grid = grid
        # the kind of convolution (kernels/conv/ops.py): conv2d, conv3d, conv_transpose2d/3d, each
        # with its weight in the convolution's orientation (F, C/groups, *K)
        self.op = conv_op(op)
        # k: forward and backward run the block in k chunks of samples (or features), the collectives of one
        # chunk in flight while the next computes (pipelined); 1 is one blocking call each
        self.chunks = positive_int(chunks, "chunks")
        self.C = positive_int(in_channels, "in_channels")
        self.F = positive_int(out_channels, "out_channels")
        self.kernel_size = int_tuple(kernel_size, self.op.axes, "kernel_size", 1, "a positive integer")
        # PyTorch's nn.Conv2d (Conv3d, ConvTranspose2d/3d) options: checked now, the shapes at forward
        if self.op.transposed:
            self.options = self.op.options(stride, padding, dilation, groups, padding_mode, output_padding)
        elif output_padding != 0:
            raise ValueError(f"{layer}: output_padding={output_padding!r} applies to transposed convolutions only; "
                             f"expected 0 for {self.op.name}")
        else:
            self.options = self.op.options(stride, padding, dilation, groups, padding_mode)
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
        # depth splits volumes only: a 2-D layer on a depth-split grid is refused below
        self.P_d = grid.axis_size("depth") if split_image else 1
        self.spatial = self.P_d * self.P_h * self.P_w > 1
        if self.P_d > 1 and self.op.axes != 3:
            raise ValueError(f"{layer}: {self.op.name} on a grid splitting depth ({grid.describe()}): depth splits "
                             f"volumes (N, C, D, H, W); expected a grid without a depth axis for an image's layer")
        self.P_n, self.P_c = grid.axis_size("sample"), grid.axis_size("channel")
        self.p_f = self.filter_groups(self.P_c, filter_groups)
        c = grid.coord("channel")
        self.channel_comm = grid.axis_comm("channel")
        # the ranks holding the same shard: other samples and (when it splits the image) other blocks
        self.gradient_comm = grid.complement_comm("channel") if split_image else grid.axis_comm("sample")
        self.w_filters, self.w_channels, self.b_filters = self.shard_indices(c)
        self.x_channels = list(self.input_layout.indices((1, self.C) + (1,) * self.op.axes, grid, grid.coords)[1])
        self._saved = None
        self._output_shape = None
        self._halo, self._halo_plans = None, {}
        self.halo_interior = halo_interior

    @property
    def halo_interior(self):
        """On a spatial grid, whether forward computes the output positions that need no halo
        (an image's rows and columns, a volume's planes too) while the halo moves (the rest
        after it arrives; Halo.interior), instead of after a blocking exchange. Only where
        forward convolves the rank's own block straight after the halo (convolves_own_block)
        and the layer is a convolution, not a transposed one (interior_applies); elsewhere
        refused. Off a spatial grid nothing moves and it changes nothing."""
        return self._halo_interior

    @halo_interior.setter
    def halo_interior(self, on):
        if on and self.op.transposed:
            raise ValueError(f"{self.layer}: halo_interior is built for convolutions' halos, not "
                             f"{self.op.name}'s (its input rows reach its output blocks by another rule): "
                             f"expected halo_interior=False here")
        if on and not self.convolves_own_block():
            raise ValueError(f"{self.layer}: halo_interior computes the interior of this rank's block while its halo "
                             f"moves; algorithm {self.name!r}"
                             f"{' with its input whole over the channel axis' if self.input_whole else ''} "
                             f"gathers or selects channels between the halo and the kernel: expected "
                             f"halo_interior=False here")
        self._halo_interior = bool(on)

    def interior_applies(self):
        """Whether halo_interior may be set on this layer: a convolution (not a transposed one,
        whose input rows reach its output blocks by their own rule) that convolves its own
        block (convolves_own_block). train_step asks it of every layer on a split image."""
        return not self.op.transposed and self.convolves_own_block()

    def convolves_own_block(self):
        """Whether forward convolves this rank's own (extended) block as the halo leaves it,
        with no channels gathered or taken in between, which halo_interior needs
        (convolves_own, of this layer's input)."""
        return self.convolves_own(self.input_whole)

    @classmethod
    def convolves_own(cls, input_whole):
        """convolves_own_block of a layer of this class whose input is whole over the channel
        axis or not (the cost model asks it of a layer it has not built). The algorithms where
        it does say so."""
        return False

    def halo_then_forward(self, x, w, b=None, take=None):
        """(extended, compute) for forward of this rank's block x: extended() is x's block
        extended by its halo (of it only the channels `take`, where the first layer convolves
        its own of a whole input), compute(s) the local forward of that block's samples s (compute(s,
        w_s): with the weight w_s instead, a feature chunk's filters of w: pipelined). With
        halo_interior on a spatial grid the halo is started here and the first compute() call
        convolves the interior while it moves (HaloInFlight), the border strips once it has
        arrived; else the halo is exchanged first, blocking (always with `take`: such a layer
        refuses halo_interior)."""
        if not (self.spatial and self.halo_interior):
            x = self.halo(x)
            if take is not None:
                x = backend.take(x, 1, take)
            return (lambda: x), (lambda s, w_s=w: self.local_forward(x[s], w_s, b))
        incoming = self._halo.start(x, self.layer)
        return incoming.wait, (lambda s, w_s=w: incoming.forward(
            s, lambda block, padding: self.local_forward(block, w_s, b, padding)))

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

    # -- what each algorithm declares: its weight layout and its filter groups ------------------

    @classmethod
    def weight_layout_of(cls, p_f, groups=1):
        """The layout of w (F, C/groups, Kh, Kw) over the channel axis with p_f filter groups:
        each algorithm declares its own (an algorithm without one is refused, never given
        another's)."""
        raise TypeError(f"algorithm class {cls.__name__} (name {cls.name!r}) declares no weight layout: "
                        f"define the classmethod weight_layout_of(p_f, groups) returning a Layout of w")

    @classmethod
    def filter_groups(cls, channel_parts, filter_groups=None):
        """This algorithm's p_f on P_c = channel_parts channel ranks, in the stationary-w view
        (rank c at (row, column) = divmod(c, p_f): its `messages` gather x within the row of p_f
        ranks and reduce-scatter y within the column of P_c / p_f), from the p_f asked for
        (None: the algorithm's own). Each algorithm declares its own rule."""
        raise TypeError(f"algorithm class {cls.__name__} (name {cls.name!r}) declares no filter-group rule: "
                        f"define the classmethod filter_groups(channel_parts, filter_groups=None) returning p_f")

    @classmethod
    def fixed_filter_groups(cls, p_f, filter_groups):
        """p_f for an algorithm whose p_f is fixed (1 for stationary-x, P_c for stationary-y):
        a p_f asked for is refused, as only stationary-w chooses one."""
        if filter_groups is not None:
            raise ValueError(f"filter_groups (p_f) applies to algorithm 'w' only, not {cls.name!r} "
                             f"(got filter_groups={filter_groups!r}; {cls.name!r} always has p_f={p_f})")
        return p_f

    @classmethod
    def input_channel(cls, input_whole, groups):
        """How x's channels are split over the channel axis: by block, or not at all when the
        input is whole (the first layer; sample parallelism)."""
        return None if input_whole or cls.weight_replicated else "channel"

    @classmethod
    def output_channel(cls, groups):
        """How y's filters are split over the channel axis: by block, or not at all when the
        weight is whole on every rank (sample parallelism)."""
        return None if cls.weight_replicated else "channel"

    @classmethod
    def layouts(cls, image_split, p_f, input_whole=False, groups=1, axes=2):
        """{'x', 'y', 'w', 'b'}: the layouts of x, y (and dy), the weight and the bias of this
        algorithm with p_f filter groups, on a grid splitting the image as `image_split`
        ({'height': P_h, 'width': P_w}). Pure: the layer reads its layouts from here, and so
        do perfmodel and cfp.explain, which have no grid.

        x: split by sample, by channel unless every rank holds all of C (input_channel), and
        by height and width (balanced blocks of the image's rows and columns). y: by sample,
        by filter unless w is whole everywhere (output_channel), by height and width in
        blocks of the output. w (F, C/groups, Kh, Kw): as the algorithm declares it
        (weight_layout_of). b (F,): added where y's filter block is, so it follows y's filter
        split. axes: the spatial axes (3 for volumes: a depth axis, whole, before the rows, and
        a third kernel axis, whole)."""
        y = activation_layout(image_split, cls.output_channel(groups), axes)
        w = cls.weight_layout_of(p_f, groups)
        return {"x": activation_layout(image_split, cls.input_channel(input_whole, groups), axes), "y": y,
                "w": Layout(w.dims + (None,) * (axes - 2), w.partial), "b": Layout((y.dims[1],))}

    @property
    def _layouts(self):
        return _layouts_of(type(self), self.P_d, self.P_h, self.P_w, self.p_f, self.input_whole, self.groups,
                           self.op.axes)

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
        """{'depth': P_d, 'height': P_h, 'width': P_w}: how this layer splits the image (1 x 1 x 1
        when it does not; depth only a volume's)."""
        return {"depth": self.P_d, "height": self.P_h, "width": self.P_w}

    @property
    def weight_layout(self):
        """w's layout (layouts()['w'])."""
        return self._layouts["w"]

    @property
    def bias_layout(self):
        """b's layout (layouts()['b'])."""
        return self._layouts["b"]

    def output_size(self, size):
        """The output's spatial size (H', W') (or (D', H', W')) for an input of spatial `size`."""
        return tuple(self.op.output_shape((1, 1) + tuple(size), (1, 1) + self.kernel_size,
                                          **window_options(self.options))[2:])

    # -- spatial splits: the halo ---------------------------------------------------------------

    def halo_plan(self, x_shape):
        """This rank's Halo for a global input of x_shape (cached per shape)."""
        key = tuple(int(n) for n in x_shape)
        if key not in self._halo_plans:
            self._halo_plans[key] = Halo(key, self.input_layout, self.grid, self.kernel_size,
                                         window_options(self.options), self.layer)
        return self._halo_plans[key]

    def halo(self, x):
        """x's block extended by the rows and columns its kernel windows read (phase 'halo')."""
        return self._halo.exchange(x, self.layer) if self.spatial else x

    def halo_adjoint(self, dx_extended):
        """The adjoint of halo: each rank's gradient of its extended block added back onto the
        blocks of the ranks the rows came from (phase 'halo'). dx_extended is the layer's own
        (its local kernels' output, or the sum of them), so the rows are added onto it in place
        (Halo.adjoint's donate): the result is a view of it, not a copy of this rank's rows."""
        if not self.spatial or dx_extended is None:
            return dx_extended
        return self._halo.adjoint(dx_extended, self.layer, donate=True)

    # -- the local kernels, on this rank's (extended) block ------------------------------------

    def kernel_args(self):
        """The kernels' arguments for this rank's block: the layer's options, on a spatial grid
        with the padding of the halo plan (zero rows only where the block meets the border), or
        none where another padding mode's rows were gathered into the block (Halo.pad); a
        transposed convolution's with its block's signed sides (kernels/conv/transposed.py)."""
        args = dict(self.options)
        if self.spatial:
            args["padding"] = self._halo.padding
            if self.op.transposed:
                args["output_padding"] = 0  # the sides say where the block's output ends
            else:
                args["padding_mode"] = "zeros"  # a non-zero mode's padded rows are in the block
        return args

    def local_forward(self, x, w, b=None, padding=None):
        """The local kernel on x, this rank's extended block (padding None), or on a window of
        it given with its own zero padding (HaloInFlight's interior and border strips)."""
        if padding is None:
            return self.op.forward(self._padded(x), w, b, **self.kernel_args())
        return self.op.forward(x, w, b, **{**self.kernel_args(), "padding": padding})

    def local_backward_data(self, dy, w, x_shape):
        if not self.spatial:
            return self.op.backward_data(dy, w, x_shape, **self.kernel_args())
        d_padded = self.op.backward_data(dy, w, self._halo.padded_shape(x_shape), **self.kernel_args())
        return self._halo.fold(d_padded, x_shape)

    def local_backward_filter(self, x, dy, w_shape):
        return self.op.backward_filter(self._padded(x), dy, w_shape, **self.kernel_args())

    def local_backward_bias(self, dy):
        """db of this rank's block of dy: summed over its samples and positions."""
        return self.op.backward_bias(dy)

    def with_bias(self, y, b):
        """y += b along the channel axis (y's block of filters), in place."""
        y += b.reshape((1, -1) + (1,) * self.op.axes)
        return y

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
        if x.ndim != 2 + self.op.axes or x.shape[1] != len(self.x_channels):
            spatial = "D, H, W" if self.op.axes == 3 else "H, W"
            raise ValueError(
                f"{self.layer}: x block has shape {tuple(x.shape)}, expected (n, "
                f"{len(self.x_channels)}, {spatial}) for C={self.C} on {self.grid.describe()}"
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
        if self.spatial:
            self._halo = self.halo_plan((shape[0], self.C) + tuple(shape[2:]))
            self._output_shape = (n, filters) + self._halo.out_size
        else:
            self._halo = None
            self._output_shape = (n, filters) + self.output_size(x.shape[2:])

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
        """Whether `message` (one of self.messages) is sent by this layer (message_sent)."""
        return message_sent(message, self.input_whole, self.need_dx)

    def conv_args(self):
        """The kernels' keyword arguments: stride, padding, dilation, groups, padding_mode."""
        return dict(self.options)

    def feature_chunk_limit(self):
        """The most feature chunks this layer's passes take (feature_chunk_limit): the same on
        every rank, as it depends on the layer's extents and grid only."""
        return feature_chunk_limit(type(self), self.C, self.F, self.P_c, self.input_whole, self.need_dx)

    def pipelined(self, block, compute, gather=None, scatter=None):
        """One pass of a layer in self.chunks chunks: each chunk's channels gathered (gather =
        (group, sizes): an allgather along axis 1, may_alias), then compute(samples, gathered
        chunk, features), then the result reduce-scattered along axis 1 (scatter = (group,
        sizes), donated; compute may return None: nothing to scatter). A third entry of gather
        or scatter names the ledger phase of its messages (else the phase in force). Returns
        (the gathered block, the result).

        A block of at least k samples is cut into k chunks of samples (features None: all of
        them): chunk i + 1's gather is started before chunk i computes and chunk i's
        reduce-scatter runs while chunk i + 1 computes (non-blocking collectives, each one's
        bytes a k-th of the whole). A smaller block (by_features: one sample of a large image)
        is cut along the channel axis its collective moves instead (_pipelined_features). With
        one chunk, the blocking calls."""
        n, k = block.shape[0], self.chunks
        gather_phase = gather[2] if gather is not None and len(gather) > 2 else None
        scatter_phase = scatter[2] if scatter is not None and len(scatter) > 2 else None
        if by_features(n, k) and (gather is not None or scatter is not None):
            limit = self.feature_chunk_limit()
            if not chunks_fit(n, k, limit):
                raise ValueError(f"{self.layer}: chunks={k} is more than the {n} sample(s) this rank's block holds "
                                 f"and the {limit} channel(s) or filter(s) of the smallest block its feature chunks "
                                 f"split (C={self.C}, F={self.F} over {self.P_c} channel rank(s)); expected chunks "
                                 f"<= {max(n, limit)}")
            return self._pipelined_features(block, compute, gather, scatter, gather_phase, scatter_phase)
        if by_features(n, k):
            k = 1  # nothing of its own moves: the pass in one chunk
        if k == 1:
            if gather is None:
                g = block
            else:
                with comm.tag(phase=gather_phase):
                    g = comm.allgather(gather[0], block, 1, gather[1], may_alias=True)
            r = compute(slice(0, n), g, None)
            if scatter is not None and r is not None:
                with comm.tag(phase=scatter_phase):
                    r = comm.reduce_scatter(scatter[0], r, 1, scatter[1], donate=True)
            return g, r
        samples = [slice(*block_range(n, k, i)) for i in range(k)]

        def start_gather(s):
            if gather is None:
                return None
            with comm.tag(phase=gather_phase):
                return comm.iallgather(gather[0], block[s], 1, gather[1], may_alias=True)

        gathered, results, in_flight = [], [], []
        next_gather = start_gather(samples[0])
        with filters_kept():  # every chunk convolves the same weights: their transforms once a pass
            for i, s in enumerate(samples):
                g = block[s] if gather is None else next_gather.wait()
                if i + 1 < k:
                    next_gather = start_gather(samples[i + 1])
                for pending in in_flight:  # most transports move data only inside MPI calls
                    pending.test()
                r = compute(s, g, None)
                if gather is not None:
                    gathered.append(g)
                if scatter is not None and r is not None:
                    with comm.tag(phase=scatter_phase):
                        in_flight.append(comm.ireduce_scatter(scatter[0], r, 1, scatter[1], donate=True))
                else:
                    results.append(r)
        if in_flight:
            results = [pending.wait() for pending in in_flight]
        xp = backend.get_array_module(block)
        return (xp.concatenate(gathered, axis=0) if gathered else block,
                None if results[0] is None else xp.concatenate(results, axis=0))

    def _pipelined_features(self, block, compute, gather, scatter, gather_phase, scatter_phase):
        """pipelined's pass in k feature chunks (feature_chunks) of the channel axis its
        collective moves, every chunk on all of the block's samples. With a reduce-scatter,
        the result's axis: the input gathered whole first (blocking), then compute(samples,
        gathered, features) gives the partial result of chunk j's features, reduce-scattered
        while chunk j + 1 computes; this rank's pieces side by side are its block. Without
        one, the gathered axis: chunk j + 1's gather started before chunk j computes on chunk
        j's channels (features: their indices in the gathered axis), and the chunks' results
        added up (a sum over the channels, in k parts: equal to rounding)."""
        k, n = self.chunks, block.shape[0]
        xp = backend.get_array_module(block)
        whole = slice(0, n)
        if scatter is not None:
            if gather is None:
                g = block
            else:
                with comm.tag(phase=gather_phase):
                    g = comm.allgather(gather[0], block, 1, gather[1], may_alias=True)
            in_flight = []
            for features, sizes in feature_chunks(scatter[1], k):
                for pending in in_flight:  # most transports move data only inside MPI calls
                    pending.test()
                r = compute(whole, g, features)
                with comm.tag(phase=scatter_phase):
                    in_flight.append(comm.ireduce_scatter(scatter[0], r, 1, sizes, donate=True))
            return g, xp.concatenate([pending.wait() for pending in in_flight], axis=1)
        group, held = gather[0], gather[1][gather[0].Get_rank()]
        chunks = feature_chunks(gather[1], k)

        def start_gather(j):
            with comm.tag(phase=gather_phase):
                return comm.iallgather(group, block[:, slice(*block_range(held, k, j))], 1, chunks[j][1],
                                       may_alias=True)

        gathered = xp.empty(block.shape[:1] + (sum(gather[1]),) + block.shape[2:], dtype=block.dtype)
        total, next_gather = None, start_gather(0)
        for j, (features, _) in enumerate(chunks):
            g = next_gather.wait()
            if j + 1 < k:
                next_gather = start_gather(j + 1)
            backend.put(gathered, 1, features, g)
            r = compute(whole, g, features)
            if r is not None:
                if total is None:
                    total = r
                else:
                    total += r
        return gathered, total

    def pipelined_backward(self, x, w, dy, db, gather, scatter=None):
        """(dx, dw, db) of stationary-x and -w, whose backward gathers dy (gather, phase
        backward-filter) and computes both from it: per chunk of samples, that chunk's dw
        (summed over the chunks) and partial dx, the latter reduce-scattered (scatter, phase
        backward-data; stationary-w) or kept as it is (stationary-x); dx is None when the layer
        needs none. dw (with db) is summed over the ranks sharing the shard (sync_gradients) as
        soon as it is whole: after the last chunk's dw, before that chunk's dx, so that a sum
        started in a bucket moves while it computes (sums_before_data). x is what forward
        kept. In feature chunks (pipelined): per chunk of dy's filters, their rows of dw and a
        part of dx, added up; where dx is reduce-scattered, per chunk of dx's channels instead,
        after dw, whole from the gathered dy, and its sum."""
        dw, summed, done = None, None, 0
        scatter = scatter if self.need_dx else None
        by_channels = scatter is not None and by_features(dy.shape[0], self.chunks)

        def chunk(s, dy_s, features):
            nonlocal dw, summed, done
            if by_channels:  # dy whole in every chunk: dw and its sum before the first chunk's dx
                if dw is None:
                    dw = self.local_backward_filter(x, dy_s, w.shape)
                    summed = self.sync_gradients(dw, db)
                return self.local_backward_data(dy_s, backend.take(w, 1, features),
                                                with_channels(x.shape, features))
            done += 1
            if features is None:
                part = self.local_backward_filter(x[s], dy_s, w.shape)
                if dw is None:
                    dw = part
                else:
                    dw += part
                last = s.stop >= x.shape[0]
            else:  # these filters' rows of dw
                if dw is None:
                    dw = backend.get_array_module(w).empty_like(w)
                backend.put(dw, 0, features, self.local_backward_filter(x, dy_s, (len(features),) + tuple(w.shape[1:])))
                last = done == self.chunks
            if last:  # dw is whole
                summed = self.sync_gradients(dw, db)
            if not self.need_dx:
                return None
            return self.local_backward_data(dy_s, w if features is None else backend.take(w, 0, features), x[s].shape)

        with comm.tag(layer=self.layer, phase="backward-filter"):
            _, dx = self.pipelined(dy, chunk, gather=gather,
                                   scatter=None if scatter is None else (*scatter, "backward-data"))
        return (dx,) + summed

    # -- shards of global tensors ------------------------------------------------------------

    def shard_weight(self, w):
        """This rank's shard of the global weight (F, C, Kh, Kw)."""
        xp = backend.get_array_module(w)
        return xp.ascontiguousarray(w[self.w_filters][:, self.w_channels])

    def shard_bias(self, b):
        return b[self.b_filters].copy()

    def weight_tensor(self, w_shard):
        """A weight shard (the weight, dw) as the DistTensor of the global (F, C/groups, Kh, Kw)
        in weight_layout: gather() makes it whole."""
        return DistTensor(w_shard, self.w_global_shape, self.weight_layout, self.grid)

    def bias_tensor(self, b_shard):
        """A bias shard (the bias, db) as the DistTensor of the global (F,) in bias_layout."""
        return DistTensor(b_shard, (self.F,), self.bias_layout, self.grid)

    # -- gradient synchronisation ------------------------------------------------------------

    def sync_gradients(self, dw, db):
        """Segmented allreduce: sum dw (and db) over the P/P_c ranks holding the same shard,
        as one message. With P_c = 1 it is the data-parallel allreduce. Inside
        overlapped_gradient_sync, the sum is only started (in a bucket): dw and db are returned
        as they are and hold the sums once the context ends."""
        parts = [dw] + ([db] if db is not None else [])
        if _buckets:
            _buckets[-1].add(self.gradient_comm, self.layer, parts)
            return dw, db
        with comm.tag(layer=self.layer, phase="gradient-sync"):
            sums = comm.allreduce(self.gradient_comm, parts, donate=True)
        return sums[0], (sums[1] if db is not None else None)

    def __repr__(self):
        return (f"{type(self).__name__}({self.layer}: C={self.C}, F={self.F}, "
                f"kernel={self.kernel_size}, grid {self.grid.describe()})")


_buckets = []  # the GradientBuckets of the overlapped_gradient_sync in force, innermost last


class GradientBuckets:
    """The weight gradients of one backward pass, summed while it runs: each layer's (dw, db)
    joins the open bucket of its gradient group (the ranks holding the same shards, in the
    order the layers finish), and a bucket of at least `bucket_bytes` starts its sum at once,
    one non-blocking allreduce of the bucket's arrays as one message (comm.iallreduce, phase
    'gradient-sync', under its layers' names), while the layers before it compute. finish()
    starts what is left, waits for every sum and writes each into its gradient's own array,
    so the optimizer reads the same arrays it always did, holding the same sums (to rounding:
    MPI does not fix a sum's order, nor is a bucket's message split as each layer's was)."""

    def __init__(self, bucket_bytes):
        self.bucket_bytes = bucket_bytes
        self._open = {}  # id(group) -> (group, [layer names], [arrays]): the buckets not started
        self._started = []  # (Pending, arrays)

    def add(self, group, layer, arrays):
        for pending, _ in self._started:  # most transports move data only inside MPI calls
            pending.test()
        _, layers, held = self._open.setdefault(id(group), (group, [], []))
        layers.append(layer)
        held.extend(arrays)
        if sum(a.nbytes for a in held) >= self.bucket_bytes:
            self._start(id(group))

    def _start(self, key):
        group, layers, arrays = self._open.pop(key)
        name = layers[0] if len(layers) == 1 else f"{layers[0]}..{layers[-1]}"
        with comm.tag(layer=name, phase="gradient-sync"):
            self._started.append((comm.iallreduce(group, arrays, donate=True), arrays))

    def finish(self):
        """Start the open buckets (in the order they were opened: the same on every rank), wait
        for every sum, and put each into its gradient's array."""
        for key in list(self._open):
            self._start(key)
        for pending, arrays in self._started:
            for a, total in zip(arrays, pending.wait()):
                if not backend.get_array_module(a).may_share_memory(a, total):  # (summed in place)
                    a[...] = total
        self._started = []


@contextlib.contextmanager
def overlapped_gradient_sync(bucket_bytes):
    """Within the block, the layers' gradient allreduces are started in buckets of
    `bucket_bytes` as backward produces them (GradientBuckets), and when the block ends every
    sum is in its gradient: what train_step does around backward with a bucket size."""
    buckets = GradientBuckets(bucket_bytes)
    _buckets.append(buckets)
    try:
        yield buckets
        buckets.finish()
    finally:
        _buckets.pop()


@functools.lru_cache(maxsize=None)
def _layouts_of(cls, P_d, P_h, P_w, p_f, input_whole, groups, axes):
    """cls.layouts of a layer with these settings, made once: a layer reads its layouts at
    every pass, and the layouts (immutable) depend on nothing else."""
    return types.MappingProxyType(cls.layouts({"depth": P_d, "height": P_h, "width": P_w}, p_f, input_whole,
                                              groups, axes))


def channel_block_sizes(extent, grid):
    """Block sizes of `extent` over the channel axis of `grid`."""
    return block_sizes(extent, grid.axis_size("channel"))
