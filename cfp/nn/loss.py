"""The end of a network: the softmax cross-entropy averaged over the global batch, of logits
split by sample and whole over the channel axis (Network's last Redistribute puts them so)."""
import numpy as np

from .. import backend, comm


class SoftmaxCrossEntropy:
    """loss = mean over the global batch of -log softmax(logits)[label].

    forward(logits (n, K), labels (n,)) -> (loss, correct): the loss (the same value on every
    rank) and the number of correct predictions in the global batch; backward() -> dlogits.
    The sums run over the ranks holding different samples (the grid's sample axis).
    """

    def __init__(self, grid, name="loss"):
        self.grid = grid
        self.comm = grid.axis_comm("sample")  # the ranks of other samples (the rest hold copies)
        self.name = name

    def forward(self, logits, labels):
        xp = backend.get_array_module(logits)
        n, K = logits.shape
        shifted = logits - logits.max(axis=1, keepdims=True) if n else logits
        log_z = xp.log(xp.exp(shifted).sum(axis=1))
        picked = shifted[xp.arange(n), labels] if n else xp.zeros(0, logits.dtype)
        local = xp.zeros(3, np.float64)  # filled on the array's device: nothing crosses to the host here
        if n:
            local[0], local[1] = (log_z - picked).sum(), (shifted.argmax(axis=1) == labels).sum()
        local[2] = n
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
