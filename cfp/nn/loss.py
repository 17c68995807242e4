"""The end of a network: make the logits whole over the channel axis, then the softmax
cross-entropy averaged over the global batch."""
import numpy as np

from .. import backend, comm
from ..partition import block_range, block_sizes
from .module import Module


class GatherChannels(Module):
    """(n, K_c) logits split over the channel axis -> (n, K) on every channel rank.

    Backward keeps this rank's block of the gradient. It is not the allgather's adjoint
    (a reduce-scatter) because every channel rank then computes the same loss from the same
    whole logits: the replicas are one computation, not P_c summands.
    """

    def __init__(self, grid, num_features, channels_split=True, name="gather"):
        self.grid, self.K, self.split, self.name = grid, num_features, channels_split, name
        self.sizes = block_sizes(num_features, grid.axis_size("channel"))
        self.mine = block_range(num_features, grid.axis_size("channel"), grid.coord("channel"))

    def forward(self, x):
        if not self.split:
            return x
        with comm.tag(layer=self.name, phase="forward"):
            return comm.allgather(self.grid.axis_comm("channel"), x, 1, self.sizes)

    def backward(self, dy):
        if not self.split:
            return dy
        start, stop = self.mine
        return dy[:, start:stop].copy()


class SoftmaxCrossEntropy:
    """loss = mean over the global batch of -log softmax(logits)[label].

    forward(logits (n, K), labels (n,)) -> (loss, correct): the loss (the same value on every
    rank) and the number of correct predictions in the global batch; backward() -> dlogits.
    The sums run over the ranks holding different samples (the grid's sample axis).
    """

    def __init__(self, grid, name="loss"):
        self.grid = grid
        self.comm = grid.complement_comm("channel")
        self.name = name

    def forward(self, logits, labels):
        xp = backend.get_array_module(logits)
        n, K = logits.shape
        shifted = logits - logits.max(axis=1, keepdims=True) if n else logits
        log_z = xp.log(xp.exp(shifted).sum(axis=1))
        picked = shifted[xp.arange(n), labels] if n else xp.zeros(0, logits.dtype)
        local = xp.asarray([(log_z - picked).sum(), (shifted.argmax(axis=1) == labels).sum() if n else 0,
                            n], dtype=np.float64)
        with comm.tag(layer=self.name, phase="forward"):
            total_loss, correct, count = (float(v) for v in backend.to_host(comm.allreduce(self.comm, local)))
        self._saved = (shifted, log_z, labels, count)  # count: a Python float, so float32 stays float32
        return total_loss / count, int(correct)

    def backward(self):
        shifted, log_z, labels, count = self._saved
        xp = backend.get_array_module(shifted)
        probs = xp.exp(shifted - log_z[:, None])
        probs[xp.arange(len(labels)), labels] -= 1
        return probs / count
