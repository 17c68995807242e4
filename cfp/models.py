"""Model definitions from cfp.nn: a small ResNet for 8x8 to 32x32 images with a width
multiplier, and a wide plain CNN whose width shows channel/filter parallelism at work.

Every convolution uses the same algorithm ('sample', 'x', 'y' or 'w' with p_f); the first takes
the images whole on every channel rank, and the logits are made whole before the loss.
"""
import numpy as np

from .checks import positive_int
from .nn import (BatchNorm2d, Conv2d, GatherChannels, GlobalAvgPool2d, Linear, MaxPool2d, Module,
                 ReLU, Residual, Sequential)

from .perfmodel import LayerShape
from .planner import CHANNEL_ALGORITHMS, plan

MODELS = ("resnet", "wide")


class _Builder:
    """Names layers, seeds their weights and gives every convolution its algorithm: the one
    asked for, or with algorithm 'auto' the one `choices` ({layer name: (algorithm, p_f)},
    the planner's) gives that layer."""

    def __init__(self, grid, algorithm, filter_groups, seed, dtype, choices=None):
        self.grid, self.algorithm, self.filter_groups = grid, algorithm, filter_groups
        self.seed, self.dtype = seed, dtype
        self.split = algorithm != "sample"
        if algorithm == "auto" and choices is None:
            raise ValueError("algorithm 'auto' is resolved by build_model (it needs the global batch "
                             "size and a machine profile)")
        self.choices = choices
        self.chosen = {}  # layer name -> (algorithm, p_f) as built

    def choose(self, name):
        if self.algorithm != "auto":
            return self.algorithm, self.filter_groups
        return self.choices[name]

    def conv(self, name, cin, cout, kernel, stride=1, size=None, first=False):
        algorithm, p_f = self.chosen[name] = self.choose(name)
        return Conv2d(self.grid, cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False,
                      algorithm=algorithm, filter_groups=p_f, input_replicated=first,
                      name=name, seed=self.seed, dtype=self.dtype)

    def bn(self, name, channels):
        return BatchNorm2d(self.grid, channels, channels_split=self.split, name=name, dtype=self.dtype)

    def head(self, channels, classes):
        algorithm, p_f = self.chosen["fc"] = self.choose("fc")
        return [GlobalAvgPool2d(),
                Linear(self.grid, channels, classes, algorithm=algorithm,
                       filter_groups=p_f, name="fc", seed=self.seed, dtype=self.dtype),
                GatherChannels(self.grid, classes, channels_split=self.split, name="fc.gather")]


def _check_width(value, what, narrowest, grid, algorithm):
    positive_int(value, what)
    P_c = grid.axis_size("channel")
    if algorithm != "sample" and narrowest < P_c:
        raise ValueError(f"{what}={value} gives {narrowest} channels in the narrowest layer, fewer than "
                         f"the {P_c} channel ranks of grid {grid.describe()}: use a larger {what} or "
                         f"a smaller channel axis")


def small_resnet(grid, width=1, in_channels=1, classes=10, algorithm="y", filter_groups=None, seed=0,
                 dtype=np.float32, image=8, choices=None):
    """A ResNet of three stages (16, 32, 64 channels times `width`), one basic block each,
    strides 1, 2, 2: 8x8 digits end at 2x2 before the global average pool."""
    _check_width(width, "width", 16 * width if isinstance(width, (int, np.integer)) else 0, grid, algorithm)
    b = _Builder(grid, algorithm, filter_groups, seed, dtype, choices)
    return _finish(_resnet_layers(b, width, in_channels, classes, image), b)


def wide_cnn(grid, width=256, depth=4, in_channels=1, classes=10, algorithm="y", filter_groups=None,
             seed=0, dtype=np.float32, image=8, choices=None):
    """A plain CNN: a stem convolution to `width` channels, then `depth` 3x3 convolutions of
    width x width (each with batch norm and ReLU, a 2x2 max pool after the first half), then
    the classifier. Nearly all its weights are in the wide layers."""
    _check_width(width, "width", width if isinstance(width, (int, np.integer)) else 0, grid, algorithm)
    positive_int(depth, "depth")
    b = _Builder(grid, algorithm, filter_groups, seed, dtype, choices)
    return _finish(_wide_layers(b, width, depth, in_channels, classes, image), b)


def _finish(layers, builder):
    model = Sequential(*layers)
    model.algorithms = builder.chosen  # {layer name: (algorithm, p_f)} as built
    return model


def _resnet_layers(b, width, in_channels, classes, image):
    base = 16 * width

    def block(name, cin, cout, stride, size):
        body = Sequential(b.conv(f"{name}.conv1", cin, cout, 3, stride, size), b.bn(f"{name}.bn1", cout), ReLU(),
                          b.conv(f"{name}.conv2", cout, cout, 3, 1, _after(size, 3, stride)),
                          b.bn(f"{name}.bn2", cout))
        shortcut = None
        if stride != 1 or cin != cout:
            shortcut = Sequential(b.conv(f"{name}.proj", cin, cout, 1, stride, size), b.bn(f"{name}.proj_bn", cout))
        return Sequential(Residual(body, shortcut), ReLU())

    half = _after(image, 3, 2)
    return [b.conv("stem.conv", in_channels, base, 3, 1, image, first=True), b.bn("stem.bn", base), ReLU(),
            block("layer1", base, base, 1, image),
            block("layer2", base, 2 * base, 2, image),
            block("layer3", 2 * base, 4 * base, 2, half),
            *b.head(4 * base, classes)]


def _wide_layers(b, width, depth, in_channels, classes, image):
    size = image
    layers = [b.conv("stem.conv", in_channels, width, 3, 1, size, first=True), b.bn("stem.bn", width), ReLU()]
    for i in range(depth):
        layers += [b.conv(f"wide{i}.conv", width, width, 3, 1, size), b.bn(f"wide{i}.bn", width), ReLU()]
        if i == (depth - 1) // 2:
            layers.append(MaxPool2d(2))
            size //= 2
    return layers + b.head(width, classes)


class _ShapeRecorder:
    """A builder that only records the convolutions' shapes: no grid, no weights."""

    def __init__(self, batch):
        self.batch, self.shapes = batch, []

    def conv(self, name, cin, cout, kernel, stride=1, size=None, first=False):
        self.shapes.append(LayerShape(name, self.batch, cin, cout, size, size, kernel, stride, first=first))
        return Module()

    def bn(self, name, channels):
        return Module()

    def head(self, channels, classes):
        self.shapes.append(LayerShape("fc", self.batch, channels, classes, 1, 1, 1))
        return []


def layer_shapes(name, batch, width, depth=4, in_channels=1, classes=10, image=8):
    """The LayerShape of every convolution of model `name` (for the planner), without building it."""
    for what, value in (("width", width), ("depth", depth), ("batch", batch), ("image", image)):
        positive_int(value, what)
    recorder = _ShapeRecorder(batch)
    if name == "resnet":
        _resnet_layers(recorder, width, in_channels, classes, image)
    elif name == "wide":
        _wide_layers(recorder, width, depth, in_channels, classes, image)
    else:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
    return recorder.shapes


def _after(size, kernel, stride):
    """The output side of a convolution with padding kernel // 2."""
    return (size + 2 * (kernel // 2) - kernel) // stride + 1


def build_model(name, grid, batch=None, profile=None, memory_limit=None, **config):
    """The model `name` ('resnet' or 'wide') on `grid`; config as the builder functions take.

    With algorithm='auto', the planner chooses each layer's algorithm and p_f on this grid for
    the global `batch` under `profile` (a perfmodel.MachineProfile) and `memory_limit` (bytes
    per rank, or None); the plan is kept as model.plan.
    """
    builders = {"resnet": small_resnet, "wide": wide_cnn}
    if name not in builders:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
    the_plan = None
    if config.get("algorithm") == "auto":
        if batch is None or profile is None:
            raise ValueError("algorithm 'auto' needs the global batch size and a machine profile")
        arch = {k: config[k] for k in ("width", "depth", "in_channels", "classes", "image") if k in config}
        shapes = layer_shapes(name, batch, **arch)
        the_plan = plan(shapes, grid.size, profile, memory_limit=memory_limit, algorithms=CHANNEL_ALGORITHMS,
                        grid=(grid.axis_size("sample"), grid.axis_size("channel")))
        config["choices"] = {c.layer.name: (c.algorithm, c.p_f if c.algorithm == "w" else None)
                             for c in the_plan.choices}
    model = builders[name](grid, **config)
    model.plan = the_plan
    return model
