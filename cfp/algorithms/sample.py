"""Sample (data) parallelism: every rank holds the whole weight and its own samples.

forward: local. backward-data, backward-filter: local. Then the gradient allreduce over the
sample axis (the ranks of one channel coordinate compute the same thing, so a grid with
P_c > 1 runs P_c identical replicas; give it channel=1 to use every rank for samples).
x: (n, C, H, W) -> y: (n, F, H', W'), w: (F, C, Kh, Kw) on every rank.
"""
from .. import comm
from ..kernels import conv2d_backward_bias, conv2d_backward_data, conv2d_backward_filter, conv2d_forward
from .base import GRADIENT_SYNC, ConvAlgorithm


class SampleParallel(ConvAlgorithm):
    name = "sample"
    weight_replicated = True
    messages = (GRADIENT_SYNC,)

    def forward(self, x, w, b=None):
        self.check_input(x, w, b)
        with comm.tag(layer=self.layer, phase="forward"):
            y = conv2d_forward(x, w, b if self.bias else None, **self.conv_args())
        self._saved = (x, w)
        return y

    def backward(self, dy):
        x, w = self.saved_for(dy)
        db = conv2d_backward_bias(dy) if self.bias else None
        dw = conv2d_backward_filter(x, dy, w.shape, **self.conv_args())
        dx = conv2d_backward_data(dy, w, x.shape, **self.conv_args()) if self.need_dx else None
        dw, db = self.sync_gradients(dw, db)
        return dx, dw, db
