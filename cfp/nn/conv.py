"""Conv2d and Linear layers: parameters around one of the paper's distributed algorithms.

Weights are initialised as one global tensor from a seed (the same on every rank and every
grid) and each rank keeps its shard, so a model starts from the same numbers whatever the grid.
"""
import math

import numpy as np

from ..algorithms import make_conv
from ..perfmodel import LayerShape
from ..planner import CHANNEL_ALGORITHMS, plan
from .module import Module, Parameter


def _init_rng(seed, name):
    return np.random.default_rng([seed, *name.encode()])


class Conv2d(Module):
    """x: (n, C_c, H, W) -> y: (n, F_c, H', W') under algorithm 'x', 'y' or 'w' (channels split
    over the grid's channel axis), or (n, C, H, W) -> (n, F, H', W') under 'sample'.

    input_replicated: the input holds all C channels on every channel rank (the network's
    first layer): no gather of x and no dx.
    algorithm='auto': the planner's fastest channel/filter algorithm for this layer on `grid`,
    which needs plan_for={'batch': global N, 'size': input H (= W), 'profile': MachineProfile}.
    (A whole model is better planned at once: cfp.models.build_model(..., algorithm='auto').)
    """

    def __init__(self, grid, in_channels, out_channels, kernel_size, stride=1, padding=0, bias=True,
                 algorithm="y", filter_groups=None, input_replicated=False, name="conv", seed=0,
                 dtype=np.float32, plan_for=None):
        self.name = name
        if algorithm == "auto":
            algorithm, filter_groups = self._planned(grid, in_channels, out_channels, kernel_size, stride,
                                                     padding, input_replicated, plan_for)
        self.algorithm = algorithm
        self.conv = make_conv(algorithm, grid, in_channels, out_channels, kernel_size,
                              filter_groups=filter_groups, stride=stride, padding=padding, bias=bias,
                              input_replicated=input_replicated, layer=name)
        kh, kw = self.conv.kernel_size
        fan_in = in_channels * kh * kw
        rng = _init_rng(seed, name)
        # He (Kaiming) normal initialisation, for ReLU networks.
        w = rng.standard_normal((out_channels, in_channels, kh, kw)) * math.sqrt(2.0 / fan_in)
        whole = self.conv.weight_replicated
        self.weight = Parameter(f"{name}.weight", self.conv.shard_weight(w.astype(dtype)), w.shape,
                                index=None if whole else (self.conv.w_filters, self.conv.w_channels, None, None))
        self.bias = None
        if bias:
            b = np.zeros(out_channels, dtype=dtype)
            self.bias = Parameter(f"{name}.bias", self.conv.shard_bias(b), b.shape,
                                  index=None if whole else (self.conv.b_filters,))

    def _planned(self, grid, in_channels, out_channels, kernel_size, stride, padding, first, plan_for):
        if not plan_for or not {"batch", "size", "profile"} <= set(plan_for):
            raise ValueError(f"{self.name}: algorithm 'auto' needs plan_for with the global batch, the "
                             f"input size and a machine profile, got {plan_for!r}")
        if not isinstance(kernel_size, int) or not isinstance(stride, int) or not isinstance(padding, int):
            raise ValueError(f"{self.name}: algorithm 'auto' plans square kernels, strides and paddings")
        layer = LayerShape(self.name, plan_for["batch"], in_channels, out_channels, plan_for["size"],
                           plan_for["size"], kernel_size, stride, padding, first=first)
        choice = plan([layer], grid.size, plan_for["profile"], algorithms=CHANNEL_ALGORITHMS,
                      grid=(grid.axis_size("sample"), grid.axis_size("channel"))).choices[0]
        return choice.algorithm, choice.p_f if choice.algorithm == "w" else None

    @property
    def output_split(self):
        """True when the output's filters are split over the channel axis."""
        return not self.conv.weight_replicated

    def own_parameters(self):
        return [self.weight] + ([self.bias] if self.bias is not None else [])

    def forward(self, x):
        return self.conv.forward(x, self.weight.data, None if self.bias is None else self.bias.data)

    def backward(self, dy):
        dx, self.weight.grad, db = self.conv.backward(dy)
        if self.bias is not None:
            self.bias.grad = db
        return dx


class Linear(Conv2d):
    """A fully connected layer as a 1x1 convolution: x (n, C_c) -> y (n, F_c), channel/filter
    parallel under 'x', 'y', 'w' like Conv2d, or (n, C) -> (n, F) under 'sample'."""

    def __init__(self, grid, in_features, out_features, bias=True, algorithm="y", filter_groups=None,
                 input_replicated=False, name="linear", seed=0, dtype=np.float32):
        super().__init__(grid, in_features, out_features, 1, bias=bias, algorithm=algorithm,
                         filter_groups=filter_groups, input_replicated=input_replicated, name=name,
                         seed=seed, dtype=dtype)

    def forward(self, x):
        if x.ndim != 2:
            raise ValueError(f"{self.name}: expected (n, features) input, got shape {tuple(x.shape)}")
        return super().forward(x[:, :, None, None])[:, :, 0, 0]

    def backward(self, dy):
        dx = super().backward(dy[:, :, None, None])
        return None if dx is None else dx[:, :, 0, 0]
