"""The end of a network: the softmax cross-entropy averaged over the global batch, of logits
split by sample and whole over the channel axis (Network's last Redistribute puts them so);
per position (pixel, voxel) for segmentation, of logits that the grid may also split over
depth, height and width."""

import numpy as np

from .. import backend, comm


class SoftmaxCrossEntropy:
    """loss = mean over the global batch of -log softmax(logits)[label].

    forward(logits (n, K), labels (n,)) -> (loss, correct): the loss (the same value on every
    rank) and the number of correct predictions in the global batch; backward() -> dlogits.
    Per position, for segmentation: logits (n, K, *S) (S: the image's H, W or a volume's D, H,
    W) and labels (n, *S), the mean over every sample's every position of the global batch,
    `correct` counting positions. The sums run over the ranks holding different logits: the
    grid's sample axis, and the spatial axes that `layout` (the logits' layout on the grid,
    its class dimension whole) splits; the ranks of the other axes hold copies.
    """

    def __init__(self, grid, name="loss", layout=None):
        self.grid = grid
        spatial = [d.axis for d in layout.on(grid).dims[2:] if d is not None] if layout is not None else []
        self.comms = [grid.axis_comm(a) for a in ["sample"] + spatial]
        self.name = name

    def forward(self, logits, labels):
        xp = backend.get_array_module(logits)
        self._shape = logits.shape
        if logits.ndim > 2:  # one row of K logits per position, as per sample
            K = logits.shape[1]
            logits = xp.moveaxis(logits, 1, -1).reshape(-1, K)
            labels = labels.reshape(-1)
        n, K = logits.shape
        shifted = logits - logits.max(axis=1, keepdims=True) if n else logits
        log_z = xp.log(xp.exp(shifted).sum(axis=1))
        picked = shifted[xp.arange(n), labels] if n else xp.zeros(0, logits.dtype)
        local = xp.zeros(3, np.float64)  # filled on the array's device: nothing crosses to the host here
        if n:
            local[0], local[1] = (log_z - picked).sum(), (shifted.argmax(axis=1) == labels).sum()
        local[2] = n
        with comm.tag(layer=self.name, phase="forward"):
            local = comm.allreduce_over(self.comms, local)
        total_loss, correct, count = (float(v) for v in backend.to_host(local))
        self._saved = (shifted, log_z, labels, count)  # count: a Python float, so float32 stays float32
        return total_loss / count, int(correct)

    def backward(self):
        shifted, log_z, labels, count = self._saved
        xp = backend.get_array_module(shifted)
        probs = xp.exp(shifted - log_z[:, None])
        probs[xp.arange(len(labels)), labels] -= 1
        grad = probs / count
        if len(self._shape) > 2:  # back to (n, K, *S)
            n, K = self._shape[:2]
            grad = xp.ascontiguousarray(xp.moveaxis(grad.reshape((n,) + self._shape[2:] + (K,)), -1, 1))
        return grad
