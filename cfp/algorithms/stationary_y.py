"""Stationary-y (filter parallelism): y never moves; w is split by output filter, F / P_c.

forward:          allgather x over P_c, local y for this rank's filters
backward-filter:  local dw with the gathered x (kept from forward)
backward-data:    local partial dx over all C, reduce-scatter over P_c
In k chunks (ConvAlgorithm.pipelined): of samples, or, on a block of fewer samples, of the
channels both ways (a chunk's channels of x gathered for its part of y, a chunk's partial dx
reduce-scattered).
x: (n, C_c, H, W) -> y: (n, F_c, H', W'), w shard: (F_c, C, Kh, Kw).
"""
from .. import backend, comm
from ..layout import Layout
from .base import GRADIENT_SYNC, ConvAlgorithm, Message, channel_block_sizes, with_channels


class StationaryY(ConvAlgorithm):
    name = "y"
    # (the gradient sum before backward-data: dw is whole once backward-filter ends)
    messages = (Message("forward", "allgather", "row", "x"), GRADIENT_SYNC,
                Message("backward-data", "reduce_scatter", "row", "x"))
    sums_before_data = True

    @classmethod
    def weight_layout_of(cls, p_f, groups=1):
        """w split by output filter: (F_c, C, Kh, Kw) at channel coordinate c."""
        return Layout(("channel", None, None, None))

    @classmethod
    def filter_groups(cls, channel_parts, filter_groups=None):
        """p_f = P_c: one row of all P_c (x gathered from all), columns of one rank."""
        return cls.fixed_filter_groups(channel_parts, filter_groups)

    @classmethod
    def convolves_own(cls, input_whole):
        return input_whole

    def forward(self, x, w, b=None, input_shape=None):
        self.check_input(x, w, b, input_shape)
        b = b if self.bias else None
        with comm.tag(layer=self.layer, phase="forward"):
            if self.input_whole:  # the first layer's input holds all channels: nothing to gather
                extended, compute = self.halo_then_forward(x, w, b)
                _, y = self.pipelined(x, lambda s, _, f: compute(s))
                x_all_channels = extended()
            else:
                # (in feature chunks: each chunk's channels of x with their columns of w, the parts
                # of y added up; the bias after them, as stationary-x and -w add theirs)
                x_all_channels, y = self.pipelined(
                    self.halo(x), lambda s, x_s, f: self.local_forward(x_s, w if f is None else backend.take(w, 1, f)),
                    gather=(self.channel_comm, channel_block_sizes(self.C, self.grid)))
                if b is not None:
                    self.with_bias(y, b)
        self._saved = (x_all_channels, w)
        return y

    def backward(self, dy):
        x_all_channels, w = self.saved_for(dy)
        db = self.local_backward_bias(dy) if self.bias else None
        with comm.tag(layer=self.layer, phase="backward-filter"):
            dw = self.local_backward_filter(x_all_channels, dy, w.shape)
        # the sum first: started in a bucket (overlapped_gradient_sync), it moves while dx computes
        dw, db = self.sync_gradients(dw, db)
        dx = None
        if self.need_dx:
            with comm.tag(layer=self.layer, phase="backward-data"):
                _, dx = self.pipelined(dy, lambda s, dy_s, f: self.local_backward_data(
                    dy_s, w if f is None else backend.take(w, 1, f), with_channels(x_all_channels[s].shape, f)),
                                       scatter=(self.channel_comm, channel_block_sizes(self.C, self.grid)))
        return self.halo_adjoint(dx), dw, db
