"""Module and Parameter: the base of cfp's layers.

A Parameter is this rank's shard of a global tensor: `data` (the shard), `grad` (its gradient,
already summed over the ranks holding the same shard when backward returns), `global_shape`,
and `index`, the global indices the shard covers along each dimension (None: all of it), which
is what lets a checkpoint saved on one grid be loaded on another.
"""
import numpy as np


class Parameter:
    def __init__(self, name, data, global_shape, index=None):
        self.name = name
        self.data = data
        self.grad = None
        self.global_shape = tuple(int(n) for n in global_shape)
        self.index = tuple(index) if index is not None else (None,) * len(self.global_shape)
        if len(self.index) != len(self.global_shape):
            raise ValueError(f"parameter {name}: {len(self.index)} index sets for a "
                             f"{len(self.global_shape)}-D tensor")
        expected = tuple(n if ix is None else len(ix) for n, ix in zip(self.global_shape, self.index))
        if tuple(data.shape) != expected:
            raise ValueError(f"parameter {name}: shard has shape {tuple(data.shape)}, its index sets "
                             f"say {expected}")

    def take(self, global_array):
        """This shard's part of a global array of this parameter's shape."""
        out = global_array
        for dim, ix in enumerate(self.index):
            if ix is not None:
                out = np.take(out, ix, axis=dim)
        return np.ascontiguousarray(out)

    def full_index(self):
        """The index sets with None replaced by the whole range."""
        return tuple(range(n) if ix is None else ix for n, ix in zip(self.global_shape, self.index))

    def __repr__(self):
        return f"Parameter({self.name}, shard {tuple(self.data.shape)} of {self.global_shape})"


def assemble(global_shape, pieces, dtype):
    """The global array from (index sets, shard) pieces that cover it (replicas may repeat)."""
    out = np.zeros(global_shape, dtype=dtype)
    covered = np.zeros(global_shape, dtype=bool)
    for index, shard in pieces:
        full = tuple(range(n) if ix is None else ix for n, ix in zip(global_shape, index))
        out[np.ix_(*full)] = shard
        covered[np.ix_(*full)] = True
    if not covered.all():
        raise ValueError(f"the shards cover {int(covered.sum())} of the {covered.size} entries of a "
                         f"tensor of shape {tuple(global_shape)}")
    return out


class Module:
    """A layer: forward(x) -> y keeps what backward needs; backward(dy) -> dx sets the
    gradients of its parameters. Arrays are this rank's blocks of NCHW activations."""

    training = True

    def forward(self, x):
        raise NotImplementedError

    def backward(self, dy):
        raise NotImplementedError

    def __call__(self, x):
        return self.forward(x)

    def children(self):
        return []

    def own_parameters(self):
        return []

    def parameters(self):
        """Every Parameter of this module and its children, in a fixed order."""
        params = list(self.own_parameters())
        for child in self.children():
            params.extend(child.parameters())
        return params

    def buffers(self):
        """Non-trainable state ({name: Parameter}), e.g. batch-norm running statistics."""
        out = {}
        for child in self.children():
            out.update(child.buffers())
        return out

    def train(self, mode=True):
        self.training = mode
        for child in self.children():
            child.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def zero_grad(self):
        for p in self.parameters():
            p.grad = None
