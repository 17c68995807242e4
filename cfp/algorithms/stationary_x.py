"""Stationary-x (channel parallelism): x never moves; w is split by input channel, C / P_c.

forward:          local partial y over all F, reduce-scatter over P_c (each keeps its F block)
backward-filter:  allgather dy over P_c, local dw
backward-data:    local dx with the gathered dy, no communication
In k chunks (ConvAlgorithm.pipelined): of samples, or, on a block of fewer samples, of the
filters both ways (a chunk's partial y reduce-scattered, a chunk's dy gathered for its rows of
dw and its part of dx).
x: (n, C_c, H, W) -> y: (n, F_c, H', W'), w shard: (F, C_c, Kh, Kw).
"""
from .. import backend, comm
from ..layout import Layout
from .base import GRADIENT_SYNC, ConvAlgorithm, Message, channel_block_sizes


class StationaryX(ConvAlgorithm):
    name = "x"
    messages = (Message("forward", "reduce_scatter", "column", "y"),
                Message("backward-filter", "allgather", "column", "y"), GRADIENT_SYNC)
    sums_before_data = dw_by_chunks = True  # (before the last chunk's dx: pipelined_backward)

    @classmethod
    def weight_layout_of(cls, p_f, groups=1):
        """w split by input channel: (F, C_c, Kh, Kw) at channel coordinate c."""
        return Layout((None, "channel", None, None))

    @classmethod
    def filter_groups(cls, channel_parts, filter_groups=None):
        """p_f = 1: rows of one rank (nothing to gather of x), one column of all P_c."""
        return cls.fixed_filter_groups(1, filter_groups)

    @classmethod
    def convolves_own(cls, input_whole):
        return not input_whole

    def forward(self, x, w, b=None, input_shape=None):
        self.check_input(x, w, b, input_shape)
        # (the first layer takes this rank's channels of its whole input, no message)
        extended, compute = self.halo_then_forward(x, w, take=self.w_channels if self.input_whole else None)
        with comm.tag(layer=self.layer, phase="forward"):
            # (in feature chunks: the partial y of a chunk's filters, from their rows of w)
            _, y = self.pipelined(x, lambda s, _, f: compute(s) if f is None else compute(s, backend.take(w, 0, f)),
                                  scatter=(self.channel_comm, channel_block_sizes(self.F, self.grid)))
        if self.bias:
            self.with_bias(y, b)
        self._saved = (extended(), w)
        return y

    def backward(self, dy):
        x, w = self.saved_for(dy)
        db = self.local_backward_bias(dy) if self.bias else None
        # dy gathered over all filters; dx then needs no message
        dx, dw, db = self.pipelined_backward(x, w, dy, db,
                                             gather=(self.channel_comm, channel_block_sizes(self.F, self.grid)))
        return self.halo_adjoint(dx), dw, db
