"""Stationary-w (channel x filter): w never moves; split by C over q and by F over p_f,
P_c = q * p_f. Channel rank c sits at (row, column) = divmod(c, p_f).

forward:          allgather x within the row (p_f ranks), partial y, reduce-scatter within the
                  column (q ranks)
backward-filter:  allgather dy within the column, local dw
backward-data:    local partial dx, reduce-scatter within the row
In k chunks (ConvAlgorithm.pipelined): of samples, or, on a block of fewer samples, of the
filters forward (x gathered whole, a chunk's partial y reduce-scattered) and of the channels
backward (dy gathered whole, dw and its sum, then a chunk's partial dx reduce-scattered; of the
filters where it computes no dx).
x: (n, C_c, H, W) -> y: (n, F_c, H', W'), w shard: (F / p_f, C / q, Kh, Kw): the filters of the
column's F blocks and the channels of the row's C blocks (partition.union_of_blocks).
"""
from .. import backend, comm
from ..layout import Layout, Shard
from ..partition import block_size, check_filter_groups, default_filter_groups, gather_group, scatter_group
from .base import GRADIENT_SYNC, ConvAlgorithm, Message


class StationaryW(ConvAlgorithm):
    name = "w"
    messages = (Message("forward", "allgather", "row", "x"), Message("forward", "reduce_scatter", "column", "y"),
                Message("backward-filter", "allgather", "column", "y"), GRADIENT_SYNC,
                Message("backward-data", "reduce_scatter", "row", "x"))
    sums_before_data = dw_by_chunks = True  # (before the last chunk's dx: pipelined_backward)

    @classmethod
    def weight_layout_of(cls, p_f, groups=1):
        """w (F / p_f, C / q, Kh, Kw) at channel coordinate c: the filters of the blocks of
        c's column, the channels of the blocks of c's row."""
        return Layout((Shard("channel", "column", p_f), Shard("channel", "row", p_f), None, None))

    @classmethod
    def filter_groups(cls, channel_parts, filter_groups=None):
        """The p_f asked for, or the divisor of P_c nearest sqrt(P_c) from below; it must
        divide P_c."""
        p_f = default_filter_groups(channel_parts) if filter_groups is None else filter_groups
        check_filter_groups(channel_parts, p_f)
        return p_f

    def __init__(self, grid, in_channels, out_channels, kernel_size, **kwargs):
        super().__init__(grid, in_channels, out_channels, kernel_size, **kwargs)
        P_c, c = self.P_c, grid.coord("channel")
        self.row_comm, self.column_comm = grid.row_and_column_comms(self.p_f)
        self.row_channel_sizes = [block_size(self.C, P_c, k) for k in gather_group(c, P_c, self.p_f)]
        self.column_filter_sizes = [block_size(self.F, P_c, k) for k in scatter_group(c, P_c, self.p_f)]

    def forward(self, x, w, b=None, input_shape=None):
        self.check_input(x, w, b, input_shape)
        x = self.halo(x)
        with comm.tag(layer=self.layer, phase="forward"):
            if self.input_whole:  # the first layer: take the row's channels, no message
                x = backend.take(x, 1, self.w_channels)
            # (in feature chunks: x gathered whole, the partial y of a chunk's filters of the column)
            x_row, y = self.pipelined(x, lambda s, x_s, f: self.local_forward(
                x_s, w if f is None else backend.take(w, 0, f)),
                                      gather=None if self.input_whole else (self.row_comm, self.row_channel_sizes),
                                      scatter=(self.column_comm, self.column_filter_sizes))
        if self.bias:
            self.with_bias(y, b)
        self._saved = (x_row, w)
        return y

    def backward(self, dy):
        x_row, w = self.saved_for(dy)
        db = self.local_backward_bias(dy) if self.bias else None
        dx, dw, db = self.pipelined_backward(x_row, w, dy, db, gather=(self.column_comm, self.column_filter_sizes),
                                             scatter=(self.row_comm, self.row_channel_sizes))
        return self.halo_adjoint(dx), dw, db
