"""Layers that act on each channel alone (ReLU, pooling, flatten) and batch normalisation,
whose statistics are reduced over the ranks that hold the same channels, never across them.
"""
import numpy as np

from .. import backend, comm
from ..halo import Halo
from ..checks import int_tuple
from ..kernels.pool import (avg_pool2d_backward, avg_pool2d_forward, max_pool2d_backward, max_pool2d_forward,
                            pool_geometry)
from ..kernels.resample import upsample_nearest_backward, upsample_nearest_forward
from ..tensor import Layout
from .module import Module, Parameter


def _spatial_whole(module, spec, first=2):
    """ValueError unless the dimensions from `first` on (H and W) are whole: the pooling
    layers and flatten work within each rank's block of full images."""
    grid, layout = spec
    split = [d for d in layout.on(grid).dims[first:] if d is not None]
    if split:
        raise ValueError(f"{module.describe()}: input layout {layout} on grid {grid.describe()} splits "
                         f"the image over {split[0].axis}; this layer needs whole images")
    return spec


class _PerPosition(Module):
    """Pooling works within each channel of each sample: the layout stays. On a grid that splits
    the image, each rank pools its block of the output, after a halo exchange of the input rows
    and columns its windows read (cfp/halo.py's halo_plan, as for a convolution; phase
    'halo'), and its gradient goes back by the adjoint."""

    def output_shape(self, shape):
        """(N, C, Ho, Wo) (a volume's (N, C, Do, Ho, Wo)) as the pooling kernel computes it
        (padding an int or one pair of sides per spatial axis)."""
        out, _, _ = pool_geometry(shape, self.kernel, self.stride, self.padding)
        return tuple(shape[:2]) + out

    def output_spec(self, spec):
        grid, layout = spec
        self._split = grid if any(d is not None for d in layout.on(grid).dims[2:]) else None
        self._layout = layout
        return spec

    def _windows(self, axes):
        """(kernel, the halo's window options, the local padding where the image is whole) of
        this layer's windows over `axes` spatial axes: pooling's."""
        options = {"dilation": 1, "padding": self.padding, "padding_mode": "zeros", "stride": self.stride}
        return (self.kernel,) * axes, options, self.padding

    def _halo(self, x):
        """x extended by its halo (when the image is split) and the local padding to pool with
        (the halo plan's sides of this rank's block)."""
        kernel, options, padding = self._windows(x.ndim - 2)
        self._plan = None
        if getattr(self, "_split", None) is None:
            return x, padding
        self._plan = Halo(self.input_shape, self._layout, self._split, kernel, options, self.describe())
        return self._plan.exchange(x, self.describe()), self._plan.padding

    def _halo_back(self, dx):
        return dx if self._plan is None else self._plan.adjoint(dx, self.describe())

    def predicted_bytes(self, itemsize):
        """{"halo": (sent, received)} of the last forward's halo exchange and its adjoint (a
        training step runs both), {} where the image is whole (Network.predicted_bytes)."""
        if getattr(self, "_plan", None) is None:
            return {}
        sent, received = self._plan.bytes(itemsize)
        return {"halo": (sent + received, received + sent)}


class ReLU(Module):
    def forward(self, x):
        self._mask = x > 0
        return x * self._mask

    def backward(self, dy):
        return dy * self._mask


class MaxPool2d(_PerPosition):
    def __init__(self, kernel_size, stride=None, padding=0):
        self.kernel, self.stride, self.padding = kernel_size, stride or kernel_size, padding

    def forward(self, x):
        x, self._local_padding = self._halo(x)
        self._x_shape = x.shape
        y, self._argmax = max_pool2d_forward(x, self.kernel, self.stride, self._local_padding)
        return y

    def backward(self, dy):
        return self._halo_back(max_pool2d_backward(dy, self._argmax, self._x_shape, self.kernel, self.stride,
                                                   self._local_padding))


class AvgPool2d(_PerPosition):
    def __init__(self, kernel_size, stride=None, padding=0):
        self.kernel, self.stride, self.padding = kernel_size, stride or kernel_size, padding

    def forward(self, x):
        x, self._local_padding = self._halo(x)
        self._x_shape = x.shape
        return avg_pool2d_forward(x, self.kernel, self.stride, self._local_padding)

    def backward(self, dy):
        return self._halo_back(avg_pool2d_backward(dy, self._x_shape, self.kernel, self.stride,
                                                   self._local_padding))


class MaxPool3d(MaxPool2d):
    """MaxPool2d over a volume's (n, C, D, H, W) blocks: cubic windows, a halo over depth,
    height and width where the grid splits them."""


class AvgPool3d(AvgPool2d):
    """AvgPool2d over a volume's (n, C, D, H, W) blocks."""


class Upsample(_PerPosition):
    """Nearest upsampling by an integer `scale_factor` (an int, or one per spatial axis), of
    images or volumes: PyTorch's nn.Upsample(scale_factor=, mode='nearest'). The layout stays;
    on a grid that splits the image each rank computes its block of the output from the input
    rows that reach it, the halo of the transposed convolution it is (kernels/resample.py)."""

    def __init__(self, scale_factor=2, mode="nearest"):
        if mode != "nearest":
            raise ValueError(f"Upsample mode {mode!r}: cfp upsamples by 'nearest' only")
        axes = len(scale_factor) if isinstance(scale_factor, (tuple, list)) and len(scale_factor) in (2, 3) else 2
        int_tuple(scale_factor, axes, "scale_factor", 1, "a positive integer")  # (applied to an input's axes later)
        self.scale_factor = scale_factor

    def _factors(self, axes):
        """The factor of each of `axes` spatial axes (an integer given applies to each)."""
        return int_tuple(self.scale_factor, axes, "scale_factor", 1, "a positive integer")

    def _windows(self, axes):
        """Those of the transposed convolution nearest upsampling is: kernel and stride the
        factors (its halo brings the input rows that reach each block); unsplit, no sides."""
        factors = self._factors(axes)
        return factors, {"stride": factors, "padding": 0, "dilation": 1, "output_padding": 0}, None

    def output_shape(self, shape):
        return tuple(shape[:2]) + tuple(f * n for f, n in zip(self._factors(len(shape) - 2), shape[2:]))

    def forward(self, x):
        factors = self._factors(x.ndim - 2)
        x, self._sides = self._halo(x)
        self._x_shape = x.shape
        return upsample_nearest_forward(x, factors, self._sides)

    def backward(self, dy):
        dx = upsample_nearest_backward(dy, self._factors(dy.ndim - 2), self._x_shape, self._sides)
        return self._halo_back(dx)


class GlobalAvgPool2d(Module):
    """(n, C, H, W) -> (n, C): the mean over all positions of each channel (of a volume's
    (n, C, D, H, W) too: GlobalAvgPool3d). On a grid that splits the image, each rank sums its
    block and the sums are added over the depth, height and width axes it splits (phase
    'forward'), so every spatial rank holds the whole mean: the output is replicated there,
    and its gradient, the same on every copy, spreads back locally."""

    def output_spec(self, spec):
        grid, layout = spec
        self._spatial = [d.axis for d in layout.on(grid).dims[2:] if d is not None]
        self._grid = grid
        return grid, layout.head(2)

    def output_shape(self, shape):
        return tuple(shape[:2])

    def forward(self, x):
        self._x_shape = x.shape
        spatial = getattr(self, "_spatial", [])
        positions = tuple(range(2, x.ndim))
        if not spatial:
            return x.mean(axis=positions)
        sums = x.sum(axis=positions)
        with comm.tag(layer="global-pool", phase="forward"):
            sums = comm.allreduce_over([self._grid.axis_comm(axis) for axis in spatial], sums, donate=True)
        self._positions = int(np.prod(self.input_shape[2:]))
        return sums / self._positions

    def backward(self, dy):
        positions = self._positions if getattr(self, "_spatial", []) else int(np.prod(self._x_shape[2:]))
        xp = backend.get_array_module(dy)
        spread = dy.reshape(dy.shape + (1,) * (len(self._x_shape) - 2))
        return xp.broadcast_to(spread / positions, self._x_shape).copy()


class GlobalAvgPool3d(GlobalAvgPool2d):
    """(n, C, D, H, W) -> (n, C): GlobalAvgPool2d over a volume's positions."""


class Flatten(Module):
    """(n, C, H, W) -> (n, C*H*W), for inputs whose channels and images are whole."""

    def output_spec(self, spec):
        grid, layout = _spatial_whole(self, spec, first=1)
        return grid, layout.head(2)

    def output_shape(self, shape):
        n, *rest = shape
        return (n, int(np.prod(rest)))

    def forward(self, x):
        self._x_shape = x.shape
        return x.reshape(self.output_shape(x.shape))  # (not -1: a block of no samples has no size to infer)

    def backward(self, dy):
        return dy.reshape(self._x_shape)


def refuse_copies(what, layout, grid):
    """ValueError unless `layout` splits every axis of `grid` but the channel one: a
    normalisation sums its statistics over the ranks outside the channel axis, and an axis
    holding copies of each block would count it more than once."""
    copies = [a for a in layout.replica_axes(grid) if a != "channel"]
    if copies:
        raise ValueError(f"{what}: layout {layout} on grid {grid.describe()} leaves the {', '.join(copies)} "
                         f"axis holding copies of each block, which its statistics would count more than once; "
                         f"expected a layout that splits every axis of the grid but the channel one")


class BatchNorm2d(Module):
    """Batch normalisation of (n, C_c, H, W) blocks over the global batch (of a volume's
    (n, C_c, D, H, W) blocks: BatchNorm3d, whose default layout has the depth dimension).

    Statistics are per channel, so they are summed only over the ranks holding the same
    channels (the sample axis), never over the channel axis. layout: the activation's layout
    on `grid` (default split by sample and channel, as after a 'x', 'y' or 'w' layer); the
    parameters take its channel dimension's layout, so this rank's channels come from it.
    Training uses the batch's biased variance; the running variance is the unbiased one
    (PyTorch's convention).
    """

    ndim = 4  # NCHW; BatchNorm3d's NCDHW

    def __init__(self, grid, num_features, layout=None, eps=1e-5, momentum=0.1, name="bn",
                 dtype=np.float32):
        self.name, self.eps, self.momentum = name, eps, momentum
        self.grid = grid
        self.layout = Layout(("sample", "channel") + (None,) * (self.ndim - 2)) if layout is None else layout
        if self.layout.ndim != self.ndim or self.layout.dims[0] is None or self.layout.dims[0].axis != "sample" \
                or self.layout.partial:
            what = "NCDHW" if self.ndim == 5 else "NCHW"
            raise ValueError(f"{name}: batch norm takes {what} activations split by sample (and perhaps "
                             f"channel, {'depth, ' if self.ndim == 5 else ''}height and width); got layout "
                             f"{self.layout}")
        # the ranks holding the same channels: those of other samples and other image blocks,
        # whose statistics are summed
        refuse_copies(f"{name}: batch norm", self.layout, grid)
        self.stats_comm = grid.complement_comm("channel")
        self._counts = {}  # local input shape -> positions in the global batch (_positions_in_batch)
        channel_layout = Layout(self.layout.dims[1:2])
        n = len(channel_layout.indices((num_features,), grid, grid.coords)[0])
        self.weight, self.bias, self.running_mean, self.running_var = (
            Parameter(f"{name}.{what}", init(n, dtype), (num_features,), channel_layout, grid)
            for what, init in (("weight", np.ones), ("bias", np.zeros), ("running_mean", np.zeros),
                               ("running_var", np.ones)))

    @property
    def input_spec(self):
        return self.grid, self.layout

    def own_parameters(self):
        return [self.weight, self.bias]

    def buffers(self):
        return {p.name: p for p in (self.running_mean, self.running_var)}

    # The arithmetic works on (n, C_c * H * W) rows, a per-channel value expanded to one row of
    # C_c * H * W (xp.repeat): NumPy's inner loops then run along a whole row, not along H * W
    # elements per channel (4 on the last stages of a ResNet at 8x8 input: 0.54 against 0.2 ms
    # for a 32x256x2x2 forward and backward).

    def _channel_sums(self, *terms):
        """Per-channel sums over the ranks holding these channels of each term: an (n, C_c * H *
        W) row array, or a pair (a, b) of them for the sums of a * b (by einsum, without making
        the product)."""
        first = terms[0][0] if isinstance(terms[0], tuple) else terms[0]
        xp = backend.get_array_module(first)
        c, p = self._channels, self._positions

        def per_channel(term):
            if isinstance(term, tuple):
                return xp.einsum("nk,nk->k", *term).reshape(c, p).sum(axis=1)
            return term.sum(axis=0).reshape(c, p).sum(axis=1)
        parts = [per_channel(t) for t in terms]
        dtype = xp.result_type(*parts)  # one message of one dtype (a float32 block in float64 terms)
        return comm.allreduce(self.stats_comm, [a.astype(dtype, copy=False) for a in parts], donate=True)

    def _positions_in_batch(self, local_shape):
        """The positions per channel in the global batch (N H W), from the shapes alone: the
        global input shape where the container set it; else (a layer run on its own) the local
        blocks' counts summed once per local shape over the ranks holding these channels, as
        Python integers (never a value read back from the device, never a message per step)."""
        if self.input_shape is not None:
            return int(self.input_shape[0] * np.prod(self.input_shape[2:]))
        if local_shape not in self._counts:
            self._counts[local_shape] = self.stats_comm.allreduce(int(local_shape[0] * np.prod(local_shape[2:])))
        return self._counts[local_shape]

    def _row(self, per_channel):
        """A per-channel vector (C_c,) as one (1, C_c * H * W) row."""
        return backend.get_array_module(per_channel).repeat(per_channel, self._positions).reshape(1, -1)

    def forward(self, x):
        n, c = x.shape[:2]
        self._channels, self._positions, self._shape = c, int(np.prod(x.shape[2:])), x.shape
        rows = x.reshape(n, c * self._positions)
        with comm.tag(layer=self.name, phase="forward"):
            if self.training:
                total = self._positions_in_batch(tuple(x.shape))
                (sums,) = self._channel_sums(rows)
                mean = sums / total
                centred = rows - self._row(mean)
                (squares,) = self._channel_sums((centred, centred))
                var = squares / total
                m = self.momentum
                self.running_mean.data = (1 - m) * self.running_mean.data + m * mean
                self.running_var.data = (1 - m) * self.running_var.data + m * var * total / max(total - 1, 1)
                self._count = total
            else:
                mean, var = self.running_mean.data, self.running_var.data
                centred = rows - self._row(mean)
        xp = backend.get_array_module(x)
        self._inv_std = 1.0 / xp.sqrt(var + self.eps)
        # in place, into this layer's own arrays (a fresh 8 MiB array costs its page faults as
        # well as its pass); neither changes a dtype: centred and the statistics share x's in
        # training and NumPy's promotion of x and the parameters' in eval, and y has the
        # bias's dtype already
        self._x_hat = xp.multiply(centred, self._row(self._inv_std), out=centred)
        y = self._x_hat * self._row(self.weight.data)
        y += self._row(self.bias.data)
        return y.reshape(x.shape)

    def backward(self, dy):
        rows = dy.reshape(dy.shape[0], self._channels * self._positions)  # (a block of no samples too)
        with comm.tag(layer=self.name, phase="backward-data"):
            # The two sums are the gradients of beta and gamma, summed over the global batch.
            sum_dy, sum_dy_xhat = self._channel_sums(rows, (rows, self._x_hat))
        self.bias.grad, self.weight.grad = sum_dy, sum_dy_xhat
        scale = self._row(self.weight.data * self._inv_std)
        if not self.training:
            return (rows * scale).reshape(dy.shape)
        m = self._count
        mean_dy, mean_dy_xhat = self._row(sum_dy / m), self._row(sum_dy_xhat / m)
        # scale * (dy - mean_dy - x_hat * mean_dy_xhat) in one array, of the dtype NumPy would
        # promote the expression to
        xp = backend.get_array_module(dy)
        dx = xp.empty(rows.shape, xp.result_type(dy, self._x_hat, mean_dy, mean_dy_xhat, scale))
        xp.multiply(self._x_hat, mean_dy_xhat, out=dx)
        xp.subtract(rows, dx, out=dx)
        dx -= mean_dy
        dx *= scale
        return dx.reshape(dy.shape)


class BatchNorm3d(BatchNorm2d):
    """Batch normalisation of a volume's (n, C_c, D, H, W) blocks over the global batch, as
    BatchNorm2d (statistics summed over the sample, depth, height and width ranks holding the
    same channels)."""
    ndim = 5


class GroupNorm(Module):
    """Group normalisation (PyTorch's nn.GroupNorm) of (n, C_c, ...) blocks, images or volumes:
    per sample, the mean and variance over each group's C / num_groups channels and every
    position, then a per-channel affine map.

    A group may span channel ranks (balanced channel blocks need not follow the groups), and
    a rank may hold parts of several: each rank sums, per sample, its channels' part of each
    group (an (n, G) array, zero for the groups it holds none of), and the sums are added over
    the channel axis and the spatial axes the layout splits, so that every rank holding a part
    of a group sees the group's statistics. The parameters' gradients are summed, as batch
    norm's, over the ranks holding the same channels. `layout`: the activation's layout on
    `grid` (default NCHW split by sample and channel); an axis other than the channel one that
    holds copies of the blocks is refused, as in batch norm.
    """

    def __init__(self, grid, num_groups, num_channels, layout=None, eps=1e-5, name="gn", dtype=np.float32):
        self.name, self.eps, self.grid = name, eps, grid
        G = num_groups
        if not isinstance(G, (int, np.integer)) or G < 1 or num_channels % G:
            raise ValueError(f"{name}: num_groups={num_groups!r} must be a positive integer dividing "
                             f"num_channels={num_channels}")
        self.groups, self.C = int(G), int(num_channels)
        self.layout = Layout(("sample", "channel", None, None)) if layout is None else layout
        if self.layout.ndim not in (4, 5) or self.layout.dims[0] is None or self.layout.dims[0].axis != "sample" \
                or self.layout.partial:
            raise ValueError(f"{name}: group norm takes NCHW or NCDHW activations split by sample (and perhaps "
                             f"channel, depth, height and width); got layout {self.layout}")
        refuse_copies(f"{name}: group norm", self.layout, grid)
        on = self.layout.on(grid)
        # the ranks that hold other parts of a sample's groups: other channels, other image blocks
        self.group_comms = [grid.axis_comm(d.axis) for d in on.dims[1:] if d is not None]
        self.param_comm = grid.complement_comm("channel")
        channel_layout = Layout(self.layout.dims[1:2])
        (channels,) = channel_layout.indices((self.C,), grid, grid.coords)
        self.group_of = np.asarray([c // (self.C // self.groups) for c in channels], dtype=np.intp)
        n = len(channels)
        self.weight, self.bias = (Parameter(f"{name}.{what}", init(n, dtype), (self.C,), channel_layout, grid)
                                  for what, init in (("weight", np.ones), ("bias", np.zeros)))

    @property
    def input_spec(self):
        return self.grid, self.layout

    def own_parameters(self):
        return [self.weight, self.bias]

    def _membership(self, xp, dtype):
        """(C_c, G): 1 where this rank's channel belongs to the group."""
        m = np.zeros((len(self.group_of), self.groups))
        m[np.arange(len(self.group_of)), self.group_of] = 1
        return backend.from_host(m.astype(dtype), xp)

    def _group_sums(self, rows, member, extra=None, phase="forward"):
        """(n, G) sums over this rank's channels and positions of rows (n, C_c, P), added over
        the ranks holding the groups' other parts; `extra` (a (k, G) array) rides along."""
        xp = backend.get_array_module(rows)
        sums = xp.einsum("ncp,cg->ng", rows, member)
        if extra is not None:
            sums = xp.concatenate([sums, extra], axis=0)
        with comm.tag(layer=self.name, phase=phase):
            sums = comm.allreduce_over(self.group_comms, sums, donate=True)
        return sums

    def forward(self, x):
        xp = backend.get_array_module(x)
        n, c = x.shape[:2]
        positions = int(np.prod(x.shape[2:]))
        rows = x.reshape(n, c, positions)
        member = self._membership(xp, x.dtype)
        counts = member.sum(axis=0, keepdims=True) * positions  # (1, G): this rank's part of each group
        totals = self._group_sums(rows, member, extra=counts)
        self._count = totals[n:]  # (1, G): each group's values per sample, C/G times the positions
        mean = totals[:n] / self._count
        centred = rows - mean[:, self.group_of, None]
        var = self._group_sums(centred * centred, member) / self._count
        self._inv_std = 1.0 / xp.sqrt(var + self.eps)  # (n, G)
        self._x_hat = centred * self._inv_std[:, self.group_of, None]
        self._member, self._shape = member, x.shape
        y = self._x_hat * self.weight.data[None, :, None] + self.bias.data[None, :, None]
        return y.reshape(x.shape)

    def backward(self, dy):
        n, c = dy.shape[:2]
        rows = dy.reshape(n, c, int(np.prod(dy.shape[2:])))
        with comm.tag(layer=self.name, phase="backward-data"):
            db, dg = rows.sum(axis=(0, 2)), (rows * self._x_hat).sum(axis=(0, 2))
            self.bias.grad, self.weight.grad = comm.allreduce(self.param_comm, [db, dg], donate=True)
        g = rows * self.weight.data[None, :, None]
        mean_g = self._group_sums(g, self._member, phase="backward-data") / self._count
        mean_gx = self._group_sums(g * self._x_hat, self._member, phase="backward-data") / self._count
        at = self.group_of
        dx = self._inv_std[:, at, None] * (g - mean_g[:, at, None] - self._x_hat * mean_gx[:, at, None])
        return dx.reshape(self._shape)
