"""Layers that act on each channel alone (ReLU, pooling, flatten) and batch normalisation,
whose statistics are reduced over the ranks that hold the same channels, never across them.
"""
import numpy as np

from .. import backend, comm
from ..kernels.pool import avg_pool2d_backward, avg_pool2d_forward, max_pool2d_backward, max_pool2d_forward
from ..partition import block_range
from .module import Module, Parameter


class ReLU(Module):
    def forward(self, x):
        self._mask = x > 0
        return x * self._mask

    def backward(self, dy):
        return dy * self._mask


class MaxPool2d(Module):
    def __init__(self, kernel_size, stride=None, padding=0):
        self.kernel, self.stride, self.padding = kernel_size, stride or kernel_size, padding

    def forward(self, x):
        self._x_shape = x.shape
        y, self._argmax = max_pool2d_forward(x, self.kernel, self.stride, self.padding)
        return y

    def backward(self, dy):
        return max_pool2d_backward(dy, self._argmax, self._x_shape, self.kernel, self.stride, self.padding)


class AvgPool2d(Module):
    def __init__(self, kernel_size, stride=None, padding=0):
        self.kernel, self.stride, self.padding = kernel_size, stride or kernel_size, padding

    def forward(self, x):
        self._x_shape = x.shape
        return avg_pool2d_forward(x, self.kernel, self.stride, self.padding)

    def backward(self, dy):
        return avg_pool2d_backward(dy, self._x_shape, self.kernel, self.stride, self.padding)


class GlobalAvgPool2d(Module):
    """(n, C, H, W) -> (n, C): the mean over all positions of each channel."""

    def forward(self, x):
        self._x_shape = x.shape
        return x.mean(axis=(2, 3))

    def backward(self, dy):
        n, c, h, w = self._x_shape
        xp = backend.get_array_module(dy)
        return xp.broadcast_to(dy[:, :, None, None] / (h * w), self._x_shape).copy()


class Flatten(Module):
    """(n, C, H, W) -> (n, C*H*W)."""

    def forward(self, x):
        self._x_shape = x.shape
        return x.reshape(x.shape[0], -1)

    def backward(self, dy):
        return dy.reshape(self._x_shape)


class BatchNorm2d(Module):
    """Batch normalisation of (n, C_c, H, W) blocks over the global batch.

    Statistics are per channel, so they are summed only over the ranks holding the same
    channels (the sample axis), never over the channel axis. channels_split: whether the
    channels are split over the channel axis (after a 'x', 'y' or 'w' layer) or whole.
    Training uses the batch's biased variance; the running variance is the unbiased one
    (PyTorch's convention).
    """

    def __init__(self, grid, num_features, channels_split=True, eps=1e-5, momentum=0.1, name="bn",
                 dtype=np.float32):
        self.name, self.eps, self.momentum = name, eps, momentum
        self.stats_comm = grid.complement_comm("channel")
        if channels_split:
            channels = list(range(*block_range(num_features, grid.axis_size("channel"), grid.coord("channel"))))
            index = (channels,)
        else:
            channels, index = list(range(num_features)), None
        n = len(channels)
        self.weight = Parameter(f"{name}.weight", np.ones(n, dtype), (num_features,), index)
        self.bias = Parameter(f"{name}.bias", np.zeros(n, dtype), (num_features,), index)
        self.running_mean = Parameter(f"{name}.running_mean", np.zeros(n, dtype), (num_features,), index)
        self.running_var = Parameter(f"{name}.running_var", np.ones(n, dtype), (num_features,), index)

    def own_parameters(self):
        return [self.weight, self.bias]

    def buffers(self):
        return {p.name: p for p in (self.running_mean, self.running_var)}

    def _channel_sums(self, *arrays, count=None):
        """Per-channel sums of each (n, C_c, H, W) array over the ranks holding these channels;
        with `count`, also the sum of the counts, in the same message."""
        xp = backend.get_array_module(arrays[0])
        parts = [a.sum(axis=(0, 2, 3)) for a in arrays]
        if count is not None:
            parts.append(xp.asarray([count], dtype=arrays[0].dtype))
        total = comm.allreduce(self.stats_comm, xp.concatenate(parts))
        sums = xp.split(total[:len(arrays) * arrays[0].shape[1]], len(arrays))
        return sums if count is None else (sums, int(total[-1]))

    def forward(self, x):
        shape = (1, -1, 1, 1)
        with comm.tag(layer=self.name, phase="forward"):
            if self.training:
                # total: the positions per channel in the global batch
                (sums,), total = self._channel_sums(x, count=x.shape[0] * x.shape[2] * x.shape[3])
                mean = sums / total
                centred = x - mean.reshape(shape)
                (squares,) = self._channel_sums(centred * centred)
                var = squares / total
                m = self.momentum
                self.running_mean.data = (1 - m) * self.running_mean.data + m * mean
                self.running_var.data = (1 - m) * self.running_var.data + m * var * total / max(total - 1, 1)
                self._count = total
            else:
                mean, var = self.running_mean.data, self.running_var.data
                centred = x - mean.reshape(shape)
        self._inv_std = 1.0 / backend.get_array_module(x).sqrt(var + self.eps)
        self._x_hat = centred * self._inv_std.reshape(shape)
        return self._x_hat * self.weight.data.reshape(shape) + self.bias.data.reshape(shape)

    def backward(self, dy):
        shape = (1, -1, 1, 1)
        with comm.tag(layer=self.name, phase="backward-data"):
            # The two sums are the gradients of beta and gamma, summed over the global batch.
            sum_dy, sum_dy_xhat = self._channel_sums(dy, dy * self._x_hat)
        self.bias.grad, self.weight.grad = sum_dy, sum_dy_xhat
        scale = (self.weight.data * self._inv_std).reshape(shape)
        if not self.training:
            return dy * scale
        m = self._count
        return scale * (dy - (sum_dy / m).reshape(shape) - self._x_hat * (sum_dy_xhat / m).reshape(shape))
