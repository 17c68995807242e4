"""Module and Parameter: the base of cfp's layers.

A Parameter is this rank's shard of a global tensor: `data` (the shard), `grad` (its gradient,
already summed over the ranks holding the same shard when backward returns), `global_shape`,
its `layout` on `grid` (cfp/layout.py; None: whole on every rank), and `index`, the global
indices the shard covers along each dimension (None: all of it) read from the layout, which is
what lets a checkpoint saved on one grid or plan be loaded on another.

A Module declares where its input must be (`input_spec`: a grid and a layout, or None when it
takes whatever comes) and where its output is (`output_spec`); containers (containers.py)
insert a Redistribute wherever one module's output is not where the next one's input must be.
"""
import numpy as np

from ..tensor import DistTensor, Layout


class Parameter:
    def __init__(self, name, data, global_shape, layout=None, grid=None):
        self.name = name
        self.data = data
        self.grad = None
        self.global_shape = tuple(int(n) for n in global_shape)
        self.layout, self.grid = layout, grid
        if layout is None:
            self.index = (None,) * len(self.global_shape)
        else:
            held = layout.indices(self.global_shape, grid, grid.coords)
            self.index = tuple(None if ix == range(n) else list(ix) for ix, n in zip(held, self.global_shape))
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

    @property
    def primary(self):
        """True on one rank of each set of ranks holding the same shard (what a checkpoint
        writes once)."""
        return self.layout is None or self.layout.is_primary(self.grid, self.grid.coords)

    def tensor(self, value=None):
        """This shard (or `value`, an array of its shape: its gradient, an optimizer buffer)
        as a DistTensor of global_shape in the parameter's layout, whose gather() is the
        global array."""
        layout = self.layout if self.layout is not None else Layout.replicated(len(self.global_shape))
        return DistTensor(self.data if value is None else value, self.global_shape, layout, self.grid)

    def full_index(self):
        """The index sets with None replaced by the whole range."""
        return tuple(range(n) if ix is None else ix for n, ix in zip(self.global_shape, self.index))

    def __repr__(self):
        return f"Parameter({self.name}, shard {tuple(self.data.shape)} of {self.global_shape})"


def same_place(a, b):
    """Whether two (grid, layout) specs put every element on the same ranks: equal grid shapes
    placed alike on the processes (grid.ProcessGrid's node_axes) and equal layouts once the axes
    of size 1 are dropped."""
    (grid_a, layout_a), (grid_b, layout_b) = a, b
    return grid_a.shape == grid_b.shape and layout_a.on(grid_a) == layout_b.on(grid_b) and \
        getattr(grid_a, "processes", None) == getattr(grid_b, "processes", None)


class Module:
    """A layer: forward(x) -> y keeps what backward needs; backward(dy) -> dx sets the
    gradients of its parameters. Arrays are this rank's blocks of NCHW activations.

    input_spec: (grid, layout) the input must have, or None (any: the output stays where the
    input was, output_spec says how its layout changes). output_shape: the global shape of
    the output for a global input shape."""

    training = True
    input_spec = None
    input_shape = None  # the global shape of the last input (set by the container that runs it)

    def output_spec(self, spec):
        """(grid, layout) of the output for an input at `spec`."""
        return spec

    def output_shape(self, shape):
        return tuple(shape)

    def place(self, spec):
        """Check that the input may come at `spec` and return the output's spec (containers
        also insert their Redistribute steps here)."""
        if self.input_spec is not None and not same_place(spec, self.input_spec):
            raise ValueError(f"{self.describe()}: input on grid {spec[0].describe()} with layout "
                             f"{spec[1]}, expected grid {self.input_spec[0].describe()} with layout "
                             f"{self.input_spec[1]}")
        return self.output_spec(spec)

    def describe(self):
        return getattr(self, "name", type(self).__name__)

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

    def to(self, xp):
        """Move every parameter and buffer of this module to array module `xp` (numpy or
        cupy; backend.use_device): one copy each, made once; gradients are dropped. Optimizer
        state is made later, beside the parameters it belongs to."""
        from .. import backend
        for p in self.parameters() + list(self.buffers().values()):
            if backend.get_array_module(p.data) is not xp:
                p.data = backend.from_host(backend.to_host(p.data), xp)
            p.grad = None
        return self

    def zero_grad(self):
        for p in self.parameters():
            p.grad = None
