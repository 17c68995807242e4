"""Sample (data) parallelism: every rank holds the whole weight and its own samples.

forward: local. backward-data, backward-filter: local. Then the gradient allreduce over the
sample axis (the ranks of one channel coordinate compute the same thing, so a grid with
P_c > 1 runs P_c identical replicas; give it channel=1 to use every rank for samples).
x: (n, C, H, W) -> y: (n, F, H', W'), w: (F, C, Kh, Kw) on every rank.
"""
from .. import comm
from ..layout import Layout
from .base import GRADIENT_SYNC, ConvAlgorithm


class SampleParallel(ConvAlgorithm):
    name = "sample"
    weight_replicated = True
    messages = (GRADIENT_SYNC,)
    sums_before_data = True

    @classmethod
    def weight_layout_of(cls, p_f, groups=1):
        """w whole on every rank."""
        return Layout.replicated(4)

    @classmethod
    def filter_groups(cls, channel_parts, filter_groups=None):
        """p_f = 1: the weight is whole, nothing moves along the channel axis."""
        return cls.fixed_filter_groups(1, filter_groups)

    @classmethod
    def convolves_own(cls, input_whole):
        return True

    def forward(self, x, w, b=None, input_shape=None):
        self.check_input(x, w, b, input_shape)
        extended, compute = self.halo_then_forward(x, w, b if self.bias else None)
        with comm.tag(layer=self.layer, phase="forward"):
            y = compute(slice(None))
        self._saved = (extended(), w)
        return y

    def backward(self, dy):
        x, w = self.saved_for(dy)
        db = self.local_backward_bias(dy) if self.bias else None
        dw = self.local_backward_filter(x, dy, w.shape)
        # the sum first: started in a bucket (overlapped_gradient_sync), it moves while dx computes
        dw, db = self.sync_gradients(dw, db)
        dx = self.local_backward_data(dy, w, x.shape) if self.need_dx else None
        return self.halo_adjoint(dx), dw, db
