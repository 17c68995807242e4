"""Conv2d, Conv3d, ConvTranspose2d/3d and Linear layers: parameters around one of the paper's
distributed algorithms.

Weights are initialised as one global tensor from a seed (the same on every rank and every
grid) and each rank keeps its shard, so a model starts from the same numbers whatever the grid
or plan. Which algorithm and grid a layer uses is decided by whoever builds the model
(cfp.models.build_model, from a plan); the layer only runs it.
"""
import math

import numpy as np

from ..algorithms import make_conv
from ..perfmodel import predict_bytes
from .module import Module, Parameter


def _init_rng(seed, name):
    return np.random.default_rng([seed, *name.encode()])


class Conv2d(Module):
    """x: (n, C_c, H, W) -> y: (n, F_c, H', W') under algorithm 'x', 'y' or 'w' (channels split
    over the grid's channel axis), or (n, C, H, W) -> (n, F, H', W') under 'sample'.

    stride, padding (an int, a pair, 'same' or 'valid'), dilation, groups and padding_mode
    ('zeros', 'reflect', 'replicate', 'circular') mean what they mean to PyTorch's nn.Conv2d;
    a grouped layer keeps whole groups on each channel rank (algorithms/grouped.py).
    input_whole: the input holds all C channels on every channel rank (the network's first
    layer, fed the images). need_dx: whether backward computes the input's gradient (not for
    the first layer). input_spec and output_spec are the algorithm's layouts on `grid`.
    chunks: the layer's collectives pipelined over that many chunks of samples (or features)
    (ConvAlgorithm.pipelined; 1: blocking).
    """
    op = "conv2d"  # the kind of convolution (kernels/conv/ops.py); Conv3d and the transposed layers differ

    def __init__(self, grid, in_channels, out_channels, kernel_size, stride=1, padding=0, bias=True,
                 algorithm="y", filter_groups=None, input_whole=False, need_dx=True, name="conv", seed=0,
                 dtype=np.float32, dilation=1, groups=1, padding_mode="zeros", split_image=True, chunks=1,
                 **transposed):
        self.name, self.grid = name, grid
        self.algorithm = algorithm
        self.conv = make_conv(algorithm, grid, in_channels, out_channels, kernel_size,
                              filter_groups=filter_groups, stride=stride, padding=padding, bias=bias,
                              input_whole=input_whole, need_dx=need_dx, layer=name, dilation=dilation,
                              groups=groups, padding_mode=padding_mode, split_image=split_image,
                              chunks=chunks, op=self.op, **transposed)
        fan_in = in_channels // self.conv.groups * math.prod(self.conv.kernel_size)
        rng = _init_rng(seed, name)
        # He (Kaiming) normal initialisation, for ReLU networks.
        w = rng.standard_normal(self.conv.w_global_shape) * math.sqrt(2.0 / fan_in)
        self.weight = Parameter(f"{name}.weight", self.conv.shard_weight(w.astype(dtype)), w.shape,
                                self.conv.weight_layout, grid)
        self.bias = None
        if bias:
            b = np.zeros(out_channels, dtype=dtype)
            self.bias = Parameter(f"{name}.bias", self.conv.shard_bias(b), b.shape, self.conv.bias_layout, grid)

    @property
    def filter_groups(self):
        """p_f of a stationary-w layer, else None."""
        return self.conv.p_f if self.algorithm == "w" else None

    @property
    def input_spec(self):
        return self.grid, self.conv.input_layout

    def output_spec(self, spec):
        return self.grid, self.conv.output_layout

    def output_shape(self, shape):
        return self.conv.op.output_shape(tuple(shape), self.conv.w_global_shape, **self.conv.conv_args())

    def own_parameters(self):
        return [self.weight] + ([self.bias] if self.bias is not None else [])

    def predicted_bytes(self, itemsize):
        """{phase: (sent, received)} of this rank in one forward and backward pass of the last
        input's global shape (set by the container): perfmodel.predict_bytes."""
        c = self.conv
        x_shape = tuple(self.input_shape) + (1, 1) * (len(self.input_shape) == 2)
        shape, coords = dict(self.grid.shape), dict(self.grid.coords)
        if not c.spatial:  # the spatial ranks hold copies: the layer moves what it would on one
            shape.update(depth=1, height=1, width=1)
            coords.update(depth=0, height=0, width=0)
        moved = predict_bytes(self.algorithm, x_shape, c.w_global_shape, shape, coords,
                              filter_groups=self.filter_groups, bias=c.bias, input_whole=c.input_whole,
                              need_dx=c.need_dx, itemsize=itemsize, op=c.op.name, **c.conv_args())
        return {phase: v for phase, v in moved.items() if phase != "redistribute"}

    def forward(self, x):
        return self.conv.forward(x, self.weight.data, None if self.bias is None else self.bias.data,
                                 input_shape=self.input_shape)

    def backward(self, dy):
        dx, self.weight.grad, db = self.conv.backward(dy)
        if self.bias is not None:
            self.bias.grad = db
        return dx


class Conv3d(Conv2d):
    """x: (n, C_c, D, H, W) -> y: (n, F_c, D', H', W'): Conv2d's algorithms and options on
    volumes, as PyTorch's nn.Conv3d (kernel_size, stride, dilation an int or a triple; padding
    an int, a triple, 'same', 'valid' or six sides). Grids of sample and channel axes (a grid
    splitting the volume is refused, for now)."""
    op = "conv3d"


class ConvTranspose2d(Conv2d):
    """x: (n, C_c, H, W) -> y: (n, F_c, H', W') with H' = (H - 1) stride - 2 padding +
    dilation (K - 1) + output_padding + 1, as PyTorch's nn.ConvTranspose2d (zero padding only),
    on every algorithm of Conv2d. The weight is kept in the convolution's orientation, global
    (out_channels, in_channels / groups, Kh, Kw), so that its shards, gradient allreduce and
    checkpoints are a convolution's (kernels/conv/ops.py); PyTorch's (in_channels,
    out_channels / groups, Kh, Kw) weight converts with cfp.kernels.conv.to_conv_weight (and
    back with to_torch_weight)."""
    op = "conv_transpose2d"

    def __init__(self, grid, in_channels, out_channels, kernel_size, stride=1, padding=0, output_padding=0,
                 **kwargs):
        super().__init__(grid, in_channels, out_channels, kernel_size, stride, padding,
                         output_padding=output_padding, **kwargs)


class ConvTranspose3d(ConvTranspose2d):
    """ConvTranspose2d on volumes (n, C_c, D, H, W), as PyTorch's nn.ConvTranspose3d."""
    op = "conv_transpose3d"


class Linear(Conv2d):
    """A fully connected layer as a 1x1 convolution: x (n, C_c) -> y (n, F_c), channel/filter
    parallel under 'x', 'y', 'w' like Conv2d, or (n, C) -> (n, F) under 'sample'."""

    def __init__(self, grid, in_features, out_features, bias=True, algorithm="y", filter_groups=None,
                 input_whole=False, need_dx=True, name="linear", seed=0, dtype=np.float32):
        super().__init__(grid, in_features, out_features, 1, bias=bias, algorithm=algorithm,
                         filter_groups=filter_groups, input_whole=input_whole, need_dx=need_dx, name=name,
                         seed=seed, dtype=dtype, split_image=False)

    @property
    def input_spec(self):
        return self.grid, self.conv.input_layout.head(2)

    def output_spec(self, spec):
        return self.grid, self.conv.output_layout.head(2)

    def output_shape(self, shape):
        return (shape[0], self.conv.F)

    def forward(self, x):
        if x.ndim != 2:
            raise ValueError(f"{self.name}: expected (n, features) input, got shape {tuple(x.shape)}")
        shape = None if self.input_shape is None else tuple(self.input_shape) + (1, 1)
        return self.conv.forward(x[:, :, None, None], self.weight.data,
                                 None if self.bias is None else self.bias.data, input_shape=shape)[:, :, 0, 0]

    def backward(self, dy):
        dx = super().backward(dy[:, :, None, None])
        return None if dx is None else dx[:, :, 0, 0]
