"""A grouped convolution (groups > 1, depthwise included) under channel/filter parallelism.

Group g convolves only its C/G input channels into its F/G filters, so when every channel rank
holds whole groups (block c of the G groups over P_c: the layout Shard('channel', 'groups', G),
uneven when P_c does not divide G, empty blocks when G < P_c) of x, of w and of y, nothing
moves along the channel axis at all: stationary-x, stationary-y and stationary-w coincide,
each rank convolving its own groups, and only the gradient is summed over the ranks holding the
same groups. When the previous layer's channel blocks are not whole groups, the Redistribute
before this layer (containers.py) moves x into group blocks.

forward:          local grouped convolution of this rank's groups
backward-filter:  local
backward-data:    local
x: (n, G_c C/G, H, W) -> y: (n, G_c F/G, H', W'), w shard: (G_c F/G, C/G, Kh, Kw), G_c groups here.
"""
import functools

import numpy as np

from .. import backend, comm
from ..layout import Shard
from ..tensor import Layout
from .base import GRADIENT_SYNC, ConvAlgorithm


class GroupedChannels(ConvAlgorithm):
    """Any of 'x', 'y', 'w' for groups > 1: run as `grouped(StationaryX)` etc., a subclass
    that keeps the name and the filter-group rule (p_f) of the algorithm asked for."""

    messages = (GRADIENT_SYNC,)
    sums_before_data = True

    def __init__(self, grid, in_channels, out_channels, kernel_size, **kwargs):
        super().__init__(grid, in_channels, out_channels, kernel_size, **kwargs)
        self.own_groups = len(self._groups.blocks(self.P_c, grid.coord("channel")))
        # the channels of this rank's groups (what the first layer takes from its whole input)
        self.group_channels = list(Layout((None, self._groups)).indices((1, self.C), grid, grid.coords)[1])

    @property
    def _groups(self):
        return Shard("channel", "groups", self.groups)

    @classmethod
    def input_channel(cls, input_whole, groups):
        return None if input_whole else Shard("channel", "groups", groups)

    @classmethod
    def output_channel(cls, groups):
        return Shard("channel", "groups", groups)

    @classmethod
    def weight_layout_of(cls, p_f, groups=1):
        """x, y, w (and so b) all split by whole groups over the channel axis (x whole when
        the input is, at the first layer); p_f moves nothing."""
        return Layout((Shard("channel", "groups", groups), None, None, None))

    def kernel_args(self):
        return {**super().kernel_args(), "groups": max(1, self.own_groups)}

    @classmethod
    def convolves_own(cls, input_whole):
        return not input_whole

    def forward(self, x, w, b=None, input_shape=None):
        self.check_input(x, w, b, input_shape)
        # (the first layer takes this rank's groups' channels of its whole input, no message)
        extended, compute = self.halo_then_forward(x, w, b if self.bias else None,
                                                   take=self.group_channels if self.input_whole else None)
        with comm.tag(layer=self.layer, phase="forward"):
            if self.own_groups:
                y = compute(slice(None))
            else:  # more channel ranks than groups: this one holds none
                y = backend.get_array_module(x).zeros(self._output_shape, x.dtype)
        self._saved = (extended(), w)
        return y

    def backward(self, dy):
        x, w = self.saved_for(dy)
        db = self.local_backward_bias(dy) if self.bias else None
        xp = backend.get_array_module(dy)
        dw = self.local_backward_filter(x, dy, w.shape) if self.own_groups else xp.zeros(w.shape, dy.dtype)
        # the sum first: started in a bucket (overlapped_gradient_sync), it moves while dx computes
        dw, db = self.sync_gradients(dw, db)
        if not self.need_dx:
            dx = None
        elif self.own_groups:
            dx = self.local_backward_data(dy, w, x.shape)
        else:
            dx = xp.zeros(x.shape, dy.dtype)
        return self.halo_adjoint(dx), dw, db


@functools.lru_cache(maxsize=None)
def grouped(cls):
    """The GroupedChannels class that runs algorithm class `cls` (StationaryX, StationaryY,
    StationaryW or another's) on a grouped layer: its name and its filter-group rule, whole
    groups' layouts and recipe. One class per `cls`, so a class compares equal to itself."""
    return type(f"Grouped{cls.__name__}", (GroupedChannels,),
                {"name": cls.name, "filter_groups": classmethod(cls.filter_groups.__func__),
                 "__doc__": f"{cls.__name__} on a grouped layer: whole groups per channel rank, nothing moves "
                            f"along the channel axis (GroupedChannels)."})
