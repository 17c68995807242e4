"""Modules made of modules, and the Redistribute step between layers of different layouts.

Between modules, activations travel as tensor.DistTensor (the block, the global shape, the
layout and the grid); a leaf module works on the block alone. `place(spec)`, called once on a
built model with the spec of its input, walks the modules in order and inserts a Redistribute
wherever a module's input must be elsewhere than the previous module's output, so that layers
of one model can run on different grids (factorizations of the same ranks) and layouts.

A gradient travels back in the layout of the value it belongs to. Each module returns the
whole gradient of its input on every rank holding a copy (replicas compute the same thing), so
the backward of a Redistribute is the exchange back into the source layout, taking one copy;
a layout marked partial would instead be summed (tensor.DistTensor.redistribute).
"""
from .. import comm
from ..tensor import DistTensor, Layout
from .module import Module, same_place


def _forward(module, x, inputs):
    """Run `module` on x (a DistTensor, or a bare block when no layouts are tracked)."""
    if isinstance(module, (Sequential, Residual, Redistribute)) or not isinstance(x, DistTensor):
        inputs.append(None)
        return module.forward(x)
    spec = (x.grid, x.layout)
    if module.input_spec is not None and not same_place(spec, module.input_spec):
        raise ValueError(f"{module.describe()}: input arrives on grid {x.grid.describe()} with layout "
                         f"{x.layout}, expected grid {module.input_spec[0].describe()} with layout "
                         f"{module.input_spec[1]} (call place() on the model to insert the Redistribute)")
    inputs.append((x.global_shape, x.layout, x.grid))
    module.input_shape = x.global_shape
    grid, layout = module.output_spec(spec)
    return DistTensor(module.forward(x.local), module.output_shape(x.global_shape), layout, grid)


def _backward(module, dy, saved):
    if saved is None or not isinstance(dy, DistTensor):
        return module.backward(dy)
    dx = module.backward(dy.local)
    shape, layout, grid = saved
    return None if dx is None else DistTensor(dx, shape, layout, grid)


class Sequential(Module):
    def __init__(self, *modules):
        self.modules = list(modules)
        self._inputs = []

    def children(self):
        return self.modules

    def place(self, spec):
        placed = []
        for m in self.modules:
            if isinstance(m, Redistribute):
                continue  # placing again starts afresh
            want = m.input_spec
            if want is not None and not same_place(spec, want):
                placed.append(Redistribute(spec, want, name=m.describe()))
                spec = want
            spec = m.place(spec)
            placed.append(m)
        self.modules = placed
        return spec

    def forward(self, x):
        self._inputs = []
        for m in self.modules:
            x = _forward(m, x, self._inputs)
        return x

    def backward(self, dy):
        for m, saved in zip(reversed(self.modules), reversed(self._inputs)):
            dy = _backward(m, dy, saved)
        return dy


class Residual(Module):
    """y = body(x) + shortcut(x), the shortcut being the identity or a module (a 1x1 projection
    convolution, usually with batch norm, when the body changes the shape). When the two
    branches end in different layouts, place() adds a Redistribute that brings the shortcut's
    result to the body's (`merge`), so the sum is local."""

    def __init__(self, body, shortcut=None, name="residual"):
        self.body, self.shortcut, self.name = body, shortcut, name
        self.merge = None

    def children(self):
        return [self.body] + ([self.shortcut] if self.shortcut is not None else [])

    def place(self, spec):
        out = self.body.place(spec)
        skip = spec if self.shortcut is None else self.shortcut.place(spec)
        self.merge = None if same_place(skip, out) else Redistribute(skip, out, name=f"{self.name}.add")
        return out

    def forward(self, x):
        skip = x if self.shortcut is None else self.shortcut.forward(x)
        if self.merge is not None:
            skip = self.merge.forward(skip)
        y = self.body.forward(x)
        if isinstance(y, DistTensor):
            if not same_place((skip.grid, skip.layout), (y.grid, y.layout)):
                raise ValueError(f"{self.name}: the shortcut ends on grid {skip.grid.describe()} with layout "
                                 f"{skip.layout}, the body on {y.grid.describe()} with {y.layout} "
                                 f"(call place() on the model to insert the Redistribute)")
            return DistTensor(y.local + skip.local, y.global_shape, y.layout, y.grid)
        return y + skip

    def backward(self, dy):
        d_body = self.body.backward(dy)
        d_skip = dy if self.merge is None else self.merge.backward(dy)
        if self.shortcut is not None:
            d_skip = self.shortcut.backward(d_skip)
        if isinstance(d_body, DistTensor):
            return DistTensor(d_body.local + d_skip.local, d_body.global_shape, d_body.layout, d_body.grid)
        return d_body + d_skip


class Redistribute(Module):
    """Move the activation from spec `source` (grid, layout) to spec `target`: forward is
    DistTensor.redistribute, backward the exchange of the gradient back. Both are recorded in
    the ledger under the layer `name` (the layer whose input it prepares) and the phase
    'redistribute'; `last_shape` and `moved_back` say what the last step moved, for
    perfmodel.redistribute_bytes."""

    def __init__(self, source, target, name="redistribute"):
        self.source, self.target, self.name = source, target, name
        self.last_shape, self.moved_back = None, False

    def output_spec(self, spec):
        return self.target

    def forward(self, x):
        if not isinstance(x, DistTensor):
            raise ValueError(f"{self.name}: a Redistribute needs a DistTensor (the global shape and "
                             f"layout), got a bare {type(x).__name__}")
        if not same_place((x.grid, x.layout), self.source):
            raise ValueError(f"{self.name}: input on grid {x.grid.describe()} with layout {x.layout}, "
                             f"this step moves grid {self.source[0].describe()} layout {self.source[1]}")
        self.last_shape, self.moved_back = x.global_shape, False
        with comm.tag(layer=self.name, phase="redistribute"):
            return x.redistribute(self.target[1], self.target[0])

    def backward(self, dy):
        if dy is None:
            return None
        self.moved_back = True
        with comm.tag(layer=self.name, phase="redistribute"):
            return dy.redistribute(self.source[1], self.source[0])

    def predicted_bytes(self, itemsize):
        """(sent, received) by this process in the last step's forward and backward exchanges
        (each exchange numbers the processes as the grid it starts from)."""
        from ..perfmodel import redistribute_bytes
        sent, received = redistribute_bytes(self.last_shape, self.source, self.target, self.source[0].rank, itemsize)
        if self.moved_back:
            back = redistribute_bytes(self.last_shape, self.target, self.source, self.target[0].rank, itemsize)
            sent, received = sent + back[0], received + back[1]
        return sent, received

    def __repr__(self):
        (g0, l0), (g1, l1) = self.source, self.target
        return f"Redistribute({self.name}: {g0.describe()} {l0} -> {g1.describe()} {l1})"


def walk(module):
    """`module` and every module inside it, Residual merges included, in order."""
    yield module
    for child in module.children():
        yield from walk(child)
    if isinstance(module, Residual) and module.merge is not None:
        yield module.merge


class Network(Sequential):
    """A whole model: its layers and where its data enters and leaves.

    The input is a batch of images (or volumes) split by sample on the grid of the first layer
    and whole over every other axis (`input_spec`), which is also where the logits end, whole over the
    channel axis, for the loss and the labels (`output_spec`): place() adds the Redistribute
    steps between, a last one named 'loss' included. forward(x, n) takes this rank's block of
    a global batch of n samples (or, shape=, of a batch of that global shape: what a sharded
    input needs, shard_input) and returns its block of the logits; backward(dlogits) the
    gradient of the input (None: the first layer computes none).

    Attributes: `grids` (grid.Grids: the grids the layers run on, freed by free()), `layers`
    ({layer name: {"grid", "algorithm", "filter_groups"[, "chunks"]}} as built, in order), `plan` (the
    planner's Plan when it chose them, else None).
    """

    def __init__(self, modules, grids, layers, plan=None):
        super().__init__(*modules)
        self.grids, self.layers, self.plan = grids, dict(layers), plan
        first = next(m for m in walk(self) if m is not self and getattr(m, "input_spec", None) is not None)
        self._first = first
        self.grid = first.input_spec[0]
        # NCHW images, or volumes (NCDHW) where the first layer that places its input takes them
        ndim = 5 if first.input_spec[1].ndim == 5 else 4
        self.input_spec = (self.grid, Layout(("sample",) + (None,) * (ndim - 1)))
        self.logits_spec = (self.grid, Layout(("sample", None)))
        self.place(self.input_spec)

    def shard_input(self):
        """Take the input in the first layer's own layout from now on (its input_spec: split by
        sample and by the depth, height and width the grid splits, whole over channels for the
        first layer), so that no rank ever holds a whole sample: what a ShardedLoader with that
        layout reads (data.ShardedLoader(layout=)). Returns the layout."""
        self.input_spec = self._first.input_spec
        self.place(self.input_spec)
        return self.input_spec[1]

    def place(self, spec):
        if self.modules and isinstance(self.modules[-1], Redistribute) and self.modules[-1].name == "loss":
            self.modules.pop()
        out = super().place(spec)
        # (n, K) logits, or a segmentation model's per position (n, K, *S): whole but for samples
        self.logits_spec = (self.grid, Layout(("sample",) + (None,) * (out[1].ndim - 1)))
        if not same_place(out, self.logits_spec):
            self.modules.append(Redistribute(out, self.logits_spec, name="loss"))
        return self.logits_spec

    def forward(self, x, n=None, shape=None):
        if shape is None:  # (whole but for the samples: after shard_input, the caller says the shape)
            shape = (len(x) if n is None else int(n),) + tuple(x.shape[1:])
        y = super().forward(DistTensor(x, tuple(shape), self.input_spec[1], self.grid))
        self._logits_shape = y.global_shape
        return y.local

    def backward(self, dy):
        dx = super().backward(DistTensor(dy, self._logits_shape, self.logits_spec[1], self.grid))
        return None if dx is None else dx.local

    def redistributions(self):
        """The Redistribute steps, in order."""
        return [m for m in walk(self) if isinstance(m, Redistribute)]

    def predicted_bytes(self, itemsize):
        """{(layer, phase): (bytes sent, bytes received)} this rank's ledger must show for the
        last training step: each convolution's phases (perfmodel.predict_bytes), each pooling
        and upsampling layer's halo on a split image (its halo plan's pieces) and each
        redistribution (phase 'redistribute', perfmodel.redistribute_bytes)."""
        out = {}
        for m in walk(self):
            if isinstance(m, Redistribute) and m.last_shape is not None:
                out[(m.name, "redistribute")] = m.predicted_bytes(itemsize)
            elif hasattr(m, "predicted_bytes") and getattr(m, "input_shape", None) is not None \
                    and not isinstance(m, Redistribute):
                for phase, (sent, received) in m.predicted_bytes(itemsize).items():
                    # (layers of one class and no name, pooling, share their ledger rows)
                    before = out.get((m.describe(), phase), (0, 0))
                    out[(m.describe(), phase)] = (before[0] + sent, before[1] + received)
        return out

    def describe_plan(self):
        """One line per layer and per redistribution: what runs where."""
        lines = []
        for m in walk(self):
            if isinstance(m, Redistribute):
                (g0, l0), (g1, l1) = m.source, m.target
                lines.append(f"  redistribute for {m.name}: {g0.describe()} {l0} -> {g1.describe()} {l1}")
            elif getattr(m, "name", None) in self.layers:
                e = self.layers[m.name]
                p_f = f" p_f={e['filter_groups']}" if e["filter_groups"] else ""
                chunks = f", {e['chunks']} chunks" if e.get("chunks", 1) > 1 else ""
                lines.append(f"  {m.name}: grid {e['grid']}, algorithm {e['algorithm']}{p_f}{chunks}")
        return "\n".join(lines)

    def free(self):
        """Release the grids the model made (collective)."""
        self.grids.free()
