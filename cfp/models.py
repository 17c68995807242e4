"""Model definitions from cfp.nn: a small ResNet for 8x8 to 32x32 images with a width
multiplier, a wide plain CNN whose width shows channel/filter parallelism at work, a
MobileNet-like stack of depthwise, dilated and grouped convolutions, a small 3-D CNN for
volumes (whose grids may split depth), and a small encoder-decoder for segmentation with a
transposed convolution and nearest upsampling (per-pixel logits).

Each convolution and the classifier run on a grid (a factorization of the ranks) with an
algorithm ('sample', 'x', 'y' or 'w' with p_f): one for all layers, or per layer from a plan
(a plan file, or the planner's choice). The first layer takes the images whole on every
channel rank; Network.place inserts the redistributions between layers of different layouts
and brings the logits to the loss, whole over the channel axis.
"""
import dataclasses

import numpy as np

from .checks import positive_int
from .grid import Grids
from .kernels import workspace
from .nn import (BatchNorm2d, BatchNorm3d, Conv2d, Conv3d, ConvTranspose2d, GlobalAvgPool2d, GlobalAvgPool3d, Linear,
                 MaxPool2d, MaxPool3d, Module, Network, ReLU, Residual, Sequential, Upsample)
from .perfmodel import LayerShape
from .planner import CHANNEL_ALGORITHMS, plan as _planner, plan_entries


def plan_choice(current, entry):
    """The grid, algorithm, p_f and placement of a layer whose plan entry is `entry` (None: not
    listed) when the layer before runs as `current`: what the entry gives, the rest kept (p_f
    only where grid and algorithm stay; the placement only where the entry names no grid: an
    entry's grid is placed by its own node_axes, channel fastest without)."""
    if entry is None:
        return dict(current)
    keeps_grid = entry.get("grid", current["grid"]) == current["grid"]
    keeps_p_f = keeps_grid and entry.get("algorithm", current["algorithm"]) == current["algorithm"]
    return {"grid": entry.get("grid", current["grid"]), "algorithm": entry.get("algorithm", current["algorithm"]),
            "filter_groups": entry.get("filter_groups", current["filter_groups"] if keeps_p_f else None),
            "node_axes": entry.get("node_axes", None if "grid" in entry else current.get("node_axes"))}


class _Builder:
    """Names layers, seeds their weights and puts every convolution (and the classifier) on its
    grid with its algorithm: the layer's entry of `plan` ({layer name: {"grid", "algorithm",
    "filter_groups", optionally "node_axes" (grid.ProcessGrid's placement)}}), or, for a layer
    the plan does not list, those of the layer before it (the first layer: `grid`, `algorithm`,
    `filter_groups`; plan_choice). Batch norm follows the convolution before it; ReLU and
    pooling take whatever comes."""

    # the layers of an image's model, or (volumes=True) of a volume's
    VOLUME = {False: (Conv2d, BatchNorm2d, MaxPool2d, GlobalAvgPool2d), True: (Conv3d, BatchNorm3d, MaxPool3d,
                                                                               GlobalAvgPool3d)}

    def __init__(self, grids, grid, algorithm, filter_groups, seed, dtype, plan=None, volumes=False):
        self.grids, self.seed, self.dtype = grids, seed, dtype
        self.conv_class, self.bn_class, self.pool_class, self.global_pool_class = self.VOLUME[volumes]
        self.plan = dict(plan or {})
        self.current = {"grid": grid.describe(), "algorithm": algorithm, "filter_groups": filter_groups,
                        "node_axes": grid.node_axes}
        self.chosen = {}  # layer name -> {"grid", "algorithm", "filter_groups"} as built
        self.last = None  # the last convolution built

    def choose(self, name):
        entry = self.plan.pop(name, None)
        self.current = plan_choice(self.current, entry)
        spec = dict(self.current, chunks=(entry or {}).get("chunks", 1))  # the layer's own, never the one before's
        try:
            grid = self.grids.get(spec["grid"], spec.get("node_axes"))
        except ValueError as e:
            raise ValueError(f"layer {name}: {e}") from None
        return grid, spec

    def _layer(self, cls, name, cin, cout, first=False, classifier=False, **kwargs):
        grid, spec = self.choose(name)
        P_c = grid.axis_size("channel")
        # A convolution needs an output channel on every channel rank (batch norm and the next
        # layer's input split follow its channels); the classifier does not: its ranks without
        # a class hold empty blocks, and the loss gathers the logits whole.
        if spec["algorithm"] != "sample" and cout < P_c and not classifier:
            raise ValueError(f"layer {name}: {cout} output channels over the {P_c} channel ranks of grid "
                             f"{grid.describe()} leave a rank without any; use a smaller channel axis")
        layer = cls(grid, cin, cout, algorithm=spec["algorithm"], filter_groups=spec["filter_groups"],
                    input_whole=first, need_dx=not first, name=name, seed=self.seed, dtype=self.dtype, **kwargs)
        self.chosen[name] = {"grid": grid.describe(), "algorithm": spec["algorithm"],
                             "filter_groups": layer.filter_groups}
        if spec["chunks"] > 1:  # (what training pipelines, --overlap all: train.train_step)
            self.chosen[name]["chunks"] = spec["chunks"]
        if grid.node_axes:
            self.chosen[name]["node_axes"] = ",".join(grid.node_axes)
        self.last = layer
        return layer

    def conv(self, name, cin, cout, kernel, stride=1, size=None, first=False, groups=1, dilation=1):
        return self._layer(self.conv_class, name, cin, cout, first, kernel_size=kernel, stride=stride,
                           padding=dilation * (kernel // 2), bias=False, groups=groups, dilation=dilation)

    def bn(self, name, channels):
        grid, layout = self.last.output_spec(None)
        return self.bn_class(grid, channels, layout=layout, name=name, dtype=self.dtype)

    def relu(self):
        return ReLU()

    def pool(self, kernel):
        return self.pool_class(kernel)

    def residual(self, body, shortcut, name):
        return Residual(body, shortcut, name=name)

    def transposed(self, name, cin, cout, kernel, stride, size=None):
        """A transposed convolution (2-D) that multiplies the image's side by `stride`."""
        padding, output_padding = _multiplying(kernel, stride)
        return self._layer(ConvTranspose2d, name, cin, cout, kernel_size=kernel, stride=stride,
                           padding=padding, output_padding=output_padding, bias=False)

    def upsample(self, factor):
        return Upsample(factor)

    def head(self, channels, classes):
        return [self.global_pool_class(), self._layer(Linear, "fc", channels, classes, classifier=True)]

    def pixel_head(self, channels, classes, size=None):
        """The per-pixel classifier of a segmentation model: a 1x1 convolution to the classes."""
        return [self._layer(self.conv_class, "head", channels, classes, classifier=True, kernel_size=1)]


def _check_width(value, what, narrowest, grid, algorithm):
    positive_int(value, what)
    P_c = grid.axis_size("channel")
    if algorithm != "sample" and narrowest < P_c:
        raise ValueError(f"{what}={value} gives {narrowest} channels in the narrowest layer, fewer than "
                         f"the {P_c} channel ranks of grid {grid.describe()}: use a larger {what} or "
                         f"a smaller channel axis")


def small_resnet(grid, width=1, in_channels=1, classes=10, algorithm="y", filter_groups=None, seed=0,
                 dtype=np.float32, image=8, plan=None, grids=None, planned=None):
    """A ResNet of three stages (16, 32, 64 channels times `width`), one basic block each,
    strides 1, 2, 2: 8x8 digits end at 2x2 before the global average pool."""
    if plan is None:
        _check_width(width, "width", 16 * width if isinstance(width, (int, np.integer)) else 0, grid, algorithm)
    b = _Builder(grids or Grids(grid), grid, algorithm, filter_groups, seed, dtype, plan)
    return _finish(_resnet_layers(b, width, in_channels, classes, image), b, planned)


def wide_cnn(grid, width=256, depth=4, in_channels=1, classes=10, algorithm="y", filter_groups=None,
             seed=0, dtype=np.float32, image=8, plan=None, grids=None, planned=None):
    """A plain CNN: a stem convolution to `width` channels, then `depth` 3x3 convolutions of
    width x width (each with batch norm and ReLU, a 2x2 max pool after the first half), then
    the classifier. Nearly all its weights are in the wide layers."""
    if plan is None:
        _check_width(width, "width", width if isinstance(width, (int, np.integer)) else 0, grid, algorithm)
    positive_int(depth, "depth")
    b = _Builder(grids or Grids(grid), grid, algorithm, filter_groups, seed, dtype, plan)
    return _finish(_wide_layers(b, width, depth, in_channels, classes, image), b, planned)


def _finish(layers, builder, planned):
    if builder.plan:
        raise ValueError(f"the plan names layers this model does not have: {', '.join(sorted(builder.plan))}")
    return Network(layers, grids=builder.grids, layers=builder.chosen, plan=planned)


def _resnet_layers(b, width, in_channels, classes, image):
    base = 16 * width

    def block(name, cin, cout, stride, size):
        body = Sequential(b.conv(f"{name}.conv1", cin, cout, 3, stride, size), b.bn(f"{name}.bn1", cout), b.relu(),
                          b.conv(f"{name}.conv2", cout, cout, 3, 1, _after(size, 3, stride)),
                          b.bn(f"{name}.bn2", cout))
        shortcut = None
        if stride != 1 or cin != cout:
            shortcut = Sequential(b.conv(f"{name}.proj", cin, cout, 1, stride, size), b.bn(f"{name}.proj_bn", cout))
        return Sequential(b.residual(body, shortcut, name), b.relu())

    half = _after(image, 3, 2)
    return [b.conv("stem.conv", in_channels, base, 3, 1, image, first=True), b.bn("stem.bn", base), b.relu(),
            block("layer1", base, base, 1, image),
            block("layer2", base, 2 * base, 2, image),
            block("layer3", 2 * base, 4 * base, 2, half),
            *b.head(4 * base, classes)]


def mobile_cnn(grid, width=1, in_channels=1, classes=10, algorithm="y", filter_groups=None, seed=0,
               dtype=np.float32, image=8, plan=None, grids=None, planned=None):
    """A MobileNet-like stack for small images: a 3x3 stem to 16 x width channels, then blocks
    of a depthwise 3x3 convolution (groups = channels) and a pointwise 1x1 one, each with batch
    norm and ReLU, widening 16 -> 32 -> 64 (times width) with a stride 2 in the second block;
    the third block's depthwise layer is dilated (2), and a grouped 3x3 layer (4 groups) comes
    before the classifier. It exercises every grouped path of the algorithms."""
    if plan is None:
        _check_width(width, "width", 16 * width if isinstance(width, (int, np.integer)) else 0, grid, algorithm)
    b = _Builder(grids or Grids(grid), grid, algorithm, filter_groups, seed, dtype, plan)
    return _finish(_mobile_layers(b, width, in_channels, classes, image), b, planned)


def _mobile_layers(b, width, in_channels, classes, image):
    base = 16 * width
    size = image
    layers = [b.conv("stem.conv", in_channels, base, 3, 1, size, first=True), b.bn("stem.bn", base), b.relu()]
    for name, cin, cout, stride, dilation in (("block1", base, 2 * base, 1, 1), ("block2", 2 * base, 4 * base, 2, 1),
                                              ("block3", 4 * base, 4 * base, 1, 2)):
        layers += [b.conv(f"{name}.dw", cin, cin, 3, stride, size, groups=cin, dilation=dilation),
                   b.bn(f"{name}.dw_bn", cin), b.relu()]
        size = _after(size, 3, stride)
        layers += [b.conv(f"{name}.pw", cin, cout, 1, 1, size), b.bn(f"{name}.pw_bn", cout), b.relu()]
    top = 4 * base
    layers += [b.conv("head.grouped", top, top, 3, 1, size, groups=4), b.bn("head.grouped_bn", top), b.relu()]
    return layers + b.head(top, classes)


def volume_cnn(grid, width=1, in_channels=1, classes=10, algorithm="y", filter_groups=None, seed=0,
               dtype=np.float32, image=8, plan=None, grids=None, planned=None):
    """A small 3-D CNN for volumes of image^3 voxels: a 3x3x3 stem to 8 x width channels, a
    3x3x3 convolution to 16 x width with stride 2, a 2x2x2 max pool, a 3x3x3 convolution at 16
    x width (each convolution with batch norm and ReLU), then the classifier. Its grids may
    split depth, height and width as well as samples and channels."""
    if plan is None:
        _check_width(width, "width", 8 * width if isinstance(width, (int, np.integer)) else 0, grid, algorithm)
    b = _Builder(grids or Grids(grid), grid, algorithm, filter_groups, seed, dtype, plan, volumes=True)
    return _finish(_volume_layers(b, width, in_channels, classes, image), b, planned)


def _volume_layers(b, width, in_channels, classes, image):
    base = 8 * width
    size = _after(image, 3, 2)
    return [b.conv("stem.conv", in_channels, base, 3, 1, image, first=True), b.bn("stem.bn", base), b.relu(),
            b.conv("down.conv", base, 2 * base, 3, 2, image), b.bn("down.bn", 2 * base), b.relu(), b.pool(2),
            b.conv("body.conv", 2 * base, 2 * base, 3, 1, size // 2), b.bn("body.bn", 2 * base), b.relu(),
            *b.head(2 * base, classes)]


def unet(grid, width=1, in_channels=1, classes=4, algorithm="y", filter_groups=None, seed=0, dtype=np.float32,
         image=8, plan=None, grids=None, planned=None):
    """A small encoder-decoder for segmentation of image x image pixels into `classes`: a 3x3
    stem to 8 x width channels, a 3x3 convolution to 16 x width with stride 2 and a 2x2 max
    pool (a quarter of the side), a 3x3 convolution at 16 x width, a 3x3 transposed convolution
    of stride 2 back to 8 x width (half the side), nearest upsampling by 2 (the whole side),
    each convolution with batch norm and ReLU, and a 1x1 convolution to per-pixel logits (n,
    classes, image, image). Its grids may split height and width as well as samples and
    channels."""
    if plan is None:
        _check_width(width, "width", 8 * width if isinstance(width, (int, np.integer)) else 0, grid, algorithm)
    if image % 4:
        raise ValueError(f"model 'unet' halves the image's side twice and doubles it back: expected a side "
                         f"divisible by 4, got {image}")
    b = _Builder(grids or Grids(grid), grid, algorithm, filter_groups, seed, dtype, plan)
    return _finish(_unet_layers(b, width, in_channels, classes, image), b, planned)


def _unet_layers(b, width, in_channels, classes, image):
    base = 8 * width
    return [b.conv("stem.conv", in_channels, base, 3, 1, image, first=True), b.bn("stem.bn", base), b.relu(),
            b.conv("down.conv", base, 2 * base, 3, 2, image), b.bn("down.bn", 2 * base), b.relu(), b.pool(2),
            b.conv("body.conv", 2 * base, 2 * base, 3, 1, image // 4), b.bn("body.bn", 2 * base), b.relu(),
            b.transposed("up.conv", 2 * base, base, 3, 2, image // 4), b.bn("up.bn", base), b.relu(),
            b.upsample(2), *b.pixel_head(base, classes, image)]


def _wide_layers(b, width, depth, in_channels, classes, image):
    size = image
    layers = [b.conv("stem.conv", in_channels, width, 3, 1, size, first=True), b.bn("stem.bn", width), b.relu()]
    for i in range(depth):
        layers += [b.conv(f"wide{i}.conv", width, width, 3, 1, size), b.bn(f"wide{i}.bn", width), b.relu()]
        if i == (depth - 1) // 2:
            layers.append(b.pool(2))
            size //= 2
    return layers + b.head(width, classes)


def _multiplying(kernel, stride):
    """(padding, output_padding) of a transposed convolution whose output side is `stride`
    times its input's."""
    return (kernel - 1) // 2, stride - 1 - (kernel - 1) % 2


class _Recorded(Module):
    """What the shape recorder returns for a convolution: which shape it recorded."""

    def __init__(self, index):
        self.index = index


class _ShapeRecorder:
    """A builder that only records the convolutions' shapes: no grid, no weights. It also
    records what feeds each one where that is not the layer before it (LayerShape.reads,
    merges): the stream is the layer whose output flows on, a residual block's body's last."""

    def __init__(self, batch, volumes=False):
        self.batch, self.shapes = batch, []
        self.op = "conv3d" if volumes else "conv2d"  # the kind of the convolutions (kernels/conv/ops.py)
        self.stream = None  # index of the layer whose output the next layer reads

    def _record(self, shape):
        """Append `shape`, reading the stream, and make it the stream."""
        index = len(self.shapes)
        reads = None if self.stream in (None, index - 1) else self.shapes[self.stream].name
        self.shapes.append(dataclasses.replace(shape, reads=reads))
        self.stream = index
        return _Recorded(index)

    def conv(self, name, cin, cout, kernel, stride=1, size=None, first=False, groups=1, dilation=1):
        return self._record(LayerShape(name, self.batch, cin, cout, size, size, kernel, stride, first=first,
                                       groups=groups, dilation=dilation, op=self.op,
                                       D=size if self.op == "conv3d" else None))

    def bn(self, name, channels):
        self.shapes[-1] = dataclasses.replace(self.shapes[-1], normed=True)
        return Module()

    def _after(self, kind, shape=-1):
        """`kind` among the layers after shape `shape` (the last convolution recorded)."""
        self.shapes[shape] = dataclasses.replace(self.shapes[shape], after=self.shapes[shape].after + (kind,))

    def relu(self):
        self._after("relu")
        return Module()

    def pool(self, kernel):
        self._after("maxpool")
        return Module()

    def residual(self, body, shortcut, name):
        self._after("add")  # on the branch recorded last: the sum has its output's size
        convs = [m.index for m in body.modules if isinstance(m, _Recorded)]
        first, last = convs[0], convs[-1]
        # what the block's input is: what its body's first convolution reads
        source = self.shapes[first].reads or (self.shapes[first - 1].name if first else None)
        if shortcut is None:  # the identity: the block's input is added to the body's output
            if source is not None:
                self.shapes[last] = dataclasses.replace(self.shapes[last], merges=source)
        else:  # a projection reads the block's input; its output is added to the body's
            skips = [m.index for m in shortcut.modules if isinstance(m, _Recorded)]
            self.shapes[skips[0]] = dataclasses.replace(self.shapes[skips[0]], reads=source)
            self.shapes[skips[-1]] = dataclasses.replace(self.shapes[skips[-1]], merges=self.shapes[last].name)
        self.stream = last
        return Module()

    def head(self, channels, classes):
        self._after("loss")  # the global pool of the last convolution's output, then the loss
        self._record(LayerShape("fc", self.batch, channels, classes, 1, 1, 1))
        return []

    def transposed(self, name, cin, cout, kernel, stride, size=None):
        padding, output_padding = _multiplying(kernel, stride)
        return self._record(LayerShape(name, self.batch, cin, cout, size, size, kernel, stride, padding=padding,
                                       op="conv_transpose2d", output_padding=output_padding))

    def upsample(self, factor):
        self._after("upsample")
        return Module()

    def pixel_head(self, channels, classes, size=None):
        self._after("loss")
        self._record(LayerShape("head", self.batch, channels, classes, size, size, 1))
        return []


@dataclasses.dataclass(frozen=True)
class ModelKind:
    """A model cfp builds: `build` makes it (a Network on a grid), `layers` is the recipe of its
    layers, which `build` runs with a real builder and layer_shapes with a shape recorder;
    `depth`: whether it takes a depth (the wide CNN's number of wide layers); `volumes`: whether
    its inputs are volumes (N, C, D, H, W) (the planner and cost model price 2-D layers only);
    `segments`: whether it labels every pixel (logits (n, classes, H, W), labels (n, H, W))
    rather than every image."""
    build: object
    layers: object
    depth: bool = False
    volumes: bool = False
    segments: bool = False


# The one registry of models, by name: build_model, layer_shapes, train.py and the scripts read it.
MODELS = {"resnet": ModelKind(small_resnet, _resnet_layers), "wide": ModelKind(wide_cnn, _wide_layers, depth=True),
          "mobile": ModelKind(mobile_cnn, _mobile_layers), "volume": ModelKind(volume_cnn, _volume_layers, volumes=True),
          "unet": ModelKind(unet, _unet_layers, segments=True)}


def model_kind(name):
    """MODELS[name], or ValueError naming the models there are."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
    return MODELS[name]


def layer_shapes(name, batch, width, depth=4, in_channels=1, classes=10, image=8):
    """The LayerShape of every convolution of model `name` (for the planner), without building
    it."""
    return _recorded(name, batch, width, depth, in_channels, classes, image)


def layer_names(name, batch, width, depth=4, in_channels=1, classes=10, image=8):
    """The names of model `name`'s convolutions (and classifier), in order: what a plan may list."""
    return [s.name for s in _recorded(name, batch, width, depth, in_channels, classes, image)]


def _recorded(name, batch, width, depth, in_channels, classes, image):
    for what, value in (("width", width), ("depth", depth), ("batch", batch), ("image", image)):
        positive_int(value, what)
    kind = model_kind(name)
    recorder = _ShapeRecorder(batch, kind.volumes)
    kind.layers(recorder, width, *((depth,) if kind.depth else ()), in_channels, classes, image)
    return recorder.shapes


def _after(size, kernel, stride):
    """The output side of a convolution with padding kernel // 2."""
    return (size + 2 * (kernel // 2) - kernel) // stride + 1


PLAN_KEYS = ("grid", "algorithm", "filter_groups", "node_axes", "chunks")


def read_plan(path):
    """The "layers" of a plan file ({"layers": {layer name: {"grid", "algorithm",
    "filter_groups"}}}, as scripts/plan.py --out writes), checked for its form."""
    import os

    from .io import load_json
    if not os.path.exists(path):
        raise ValueError(f"plan file {path!r} does not exist; make one with scripts/plan.py, e.g. "
                         f"`python scripts/plan.py --model resnet --width 4 --batch 64 --ranks 2 --out {path}`")
    data = load_json(path, "plan file")
    if not isinstance(data, dict) or not isinstance(data.get("layers"), dict) or set(data) - {"layers", "about"}:
        raise ValueError(f"plan file {path!r}: expected an object {{\"layers\": {{layer name: {{\"grid\": ..., "
                         f"\"algorithm\": ..., \"filter_groups\": ...}}}}}}")
    for name, entry in data["layers"].items():
        try:
            _check_plan_entry(name, entry)
        except ValueError as e:
            raise ValueError(f"plan file {path!r}: {e}") from None
    return data["layers"]


def check_plan(plan, names, ranks):
    """ValueError unless `plan` ({layer name: {"grid", "algorithm", "filter_groups"}}) names
    only layers in `names` with grids of `ranks` ranks and known algorithms: the checks that
    need no MPI, alike on every rank, before anything is built."""
    if not isinstance(plan, dict):
        raise ValueError(f"a plan maps layer names to entries, got {type(plan).__name__}")
    unknown = [n for n in plan if n not in names]
    if unknown:
        raise ValueError(f"the plan names layer(s) {', '.join(map(repr, unknown))} that this model does not "
                         f"have; its layers are {', '.join(names)}")
    for name, entry in plan.items():
        _check_plan_entry(name, entry, ranks)


def _check_plan_entry(name, entry, ranks=None):
    """ValueError naming the layer unless its plan entry has known keys, a known algorithm, a
    grid spec (of `ranks` ranks, where given) and a p_f only for algorithm 'w'."""
    from .algorithms import ALGORITHMS
    from .grid import parse_grid_spec
    if not isinstance(entry, dict) or set(entry) - set(PLAN_KEYS):
        extra = sorted(set(entry) - set(PLAN_KEYS)) if isinstance(entry, dict) else entry
        raise ValueError(f"plan entry of layer {name}: expected an object with keys among "
                         f"{', '.join(PLAN_KEYS)}, got {extra!r}")
    if "algorithm" in entry and entry["algorithm"] not in ALGORITHMS:
        raise ValueError(f"plan entry of layer {name}: unknown algorithm {entry['algorithm']!r}; expected "
                         f"one of {', '.join(ALGORITHMS)}")
    if "grid" in entry:
        try:
            sizes = parse_grid_spec(entry["grid"])
        except ValueError as e:
            raise ValueError(f"plan entry of layer {name}: {e}") from None
        needed = int(np.prod(list(sizes.values())))
        if ranks is not None and needed != ranks:
            raise ValueError(f"plan entry of layer {name}: grid {entry['grid']!r} needs {needed} ranks, "
                             f"this run has {ranks}")
    if entry.get("node_axes") is not None:
        from .grid import placement_order
        if "grid" not in entry:
            raise ValueError(f"plan entry of layer {name}: node_axes places the ranks of the entry's grid; "
                             f"give its \"grid\" too")
        try:
            placement_order(parse_grid_spec(entry["grid"]), entry["node_axes"])
        except ValueError as e:
            raise ValueError(f"plan entry of layer {name}: {e}") from None
    if "chunks" in entry:
        positive_int(entry["chunks"], f"chunks of layer {name}")
        if entry["chunks"] > 1 and entry.get("algorithm") not in ("x", "y", "w"):
            raise ValueError(f"plan entry of layer {name}: chunks pipeline the collectives of algorithms x, y and w; "
                             f"give one of them as its \"algorithm\", not {entry.get('algorithm')!r}")
    p_f = entry.get("filter_groups")
    if p_f is not None:
        positive_int(p_f, f"filter_groups of layer {name}")
        if entry.get("algorithm", "w") != "w":
            raise ValueError(f"plan entry of layer {name}: filter_groups applies to algorithm 'w' only, "
                             f"not {entry['algorithm']!r}")


def build_model(name, grid, batch=None, profile=None, memory_limit=None, plan=None, choose_grids=False,
                chunks=False, buckets=False, **config):
    """The model `name` (one of MODELS), a Network; config as the builder functions take.

    `grid` is the grid of every layer that no plan entry places elsewhere. `plan`: {layer name:
    {"grid", "algorithm", "filter_groups"}} (a plan file's "layers"). With algorithm='auto',
    the planner chooses each layer's algorithm and p_f, and with choose_grids also its grid, for
    the global `batch` under `profile` (a perfmodel.MachineProfile) and `memory_limit` (bytes
    per rank, or None); the planner's Plan is kept as model.plan. chunks, buckets: the planner
    also chooses each layer's chunks and the gradient buckets (planner.plan).
    """
    kind = model_kind(name)
    arch = {k: config[k] for k in ("width", "depth", "in_channels", "classes", "image") if k in config}
    the_plan = None
    if config.get("algorithm") == "auto":
        if plan is not None:
            raise ValueError("algorithm 'auto' makes its own plan; it takes no plan file")
        if batch is None or profile is None:
            raise ValueError("algorithm 'auto' needs the global batch size and a machine profile")
        shapes = layer_shapes(name, batch or 1, **arch)
        fixed = None if choose_grids else (grid.axis_size("sample"), grid.axis_size("channel"))
        the_plan = _planner(shapes, grid.size, profile, memory_limit=memory_limit, grid=fixed,
                            node_axes=None if choose_grids else grid.node_axes, chunks=chunks, buckets=buckets,
                            **({} if choose_grids else {"algorithms": CHANNEL_ALGORITHMS}))
        plan = plan_entries(the_plan)
        config["algorithm"] = the_plan.choices[0].algorithm
        if memory_limit is not None:
            # The kernels keep no block between calls: the plan's memory counts their temporaries
            # as alive inside a layer only (a kept block holds all of a call's pieces at once:
            # 90 against 79 MiB measured on the plan of validate_model's memory check)
            workspace.set_limit(0)
    if plan is not None:
        check_plan(plan, layer_names(name, batch or 1, **arch), grid.size)
    return kind.build(grid, plan=plan, planned=the_plan, **config)


# ---------------------------------------------------------------------------------------------
# Layer shapes of models at the scale of the paper (ImageNet, 1000 classes), for the cost model
# and the planner alone (scripts/simulate.py): ResNet-50 is not a model cfp builds, so it is
# described as LayerShapes directly; the wide CNN's come from layer_shapes.

RESNET50_STAGES = ((64, 3), (128, 4), (256, 6), (512, 3))  # (base width, bottleneck blocks)
RESNET50_EXPANSION = 4  # a bottleneck's output has 4x its base width
IMAGENET_CLASSES = 1000


def wide_resnet50_layers(width, batch, image=224):
    """The 53 convolutions and the classifier of ResNet-50 with every channel count times
    `width`, as LayerShapes in the order the planner chains them (padding K // 2 throughout).

    The projection shortcut of a stage's first block comes after that block's conv3, reading
    the block's input and added to conv3's output; an identity shortcut adds the block's input
    to conv3's (LayerShape.reads, merges, as layer_shapes records them for the small ResNet),
    so the planner charges every redistribution a change of grid makes. Pooling is not a layer
    here; it only changes the spatial size.
    """
    layers = [LayerShape("conv1", batch, 3, 64 * width, image, image, 7, stride=2, first=True)]
    size = (layers[0].out_hw[0] + 1) // 2  # the 3x3/2 max pool with padding 1: 112 -> 56
    channels = 64 * width
    block_input = "conv1"  # the layer whose output is the next block's input
    for stage, (base, blocks) in enumerate(RESNET50_STAGES, start=1):
        mid, out = base * width, base * width * RESNET50_EXPANSION
        for block in range(blocks):
            name = f"layer{stage}.{block}"
            stride = 2 if stage > 1 and block == 0 else 1
            reads = None if layers[-1].name == block_input else block_input
            reduce_ = LayerShape(f"{name}.conv1", batch, channels, mid, size, size, 1, reads=reads)
            spatial = LayerShape(f"{name}.conv2", batch, mid, mid, size, size, 3, stride=stride)
            after = spatial.out_hw[0]
            expand = LayerShape(f"{name}.conv3", batch, mid, out, after, after, 1,
                                merges=None if block == 0 else block_input)
            layers += [reduce_, spatial, expand]
            if block == 0:
                layers.append(LayerShape(f"{name}.downsample", batch, channels, out, size, size, 1,
                                         stride=stride, reads=block_input, merges=expand.name))
            channels, size, block_input = out, after, expand.name
    # Global average pooling leaves 1x1: the classifier is a 1x1 convolution on it.
    layers.append(LayerShape("fc", batch, channels, IMAGENET_CLASSES, 1, 1, 1))
    return layers


def wide_cnn_layers(width, depth, batch, image, in_channels=3):
    """The convolutions of wide_cnn with a 1000-class classifier: a 3x3 stem to `width`
    channels, `depth` 3x3 width x width convolutions with a 2x2 max pool after the first half,
    and the classifier as a 1x1 convolution after global average pooling. Taken from the
    model's own description (layer_shapes), so that the simulation cannot drift from the model
    cfp trains."""
    return layer_shapes("wide", batch, width, depth, in_channels=in_channels, classes=IMAGENET_CLASSES,
                        image=image)
