"""Model definitions from cfp.nn: a small ResNet for 8x8 to 32x32 images with a width
multiplier, and a wide plain CNN whose width shows channel/filter parallelism at work.

Every convolution uses the same algorithm ('sample', 'x', 'y' or 'w' with p_f); the first takes
the images whole on every channel rank, and the logits are made whole before the loss.
"""
import numpy as np

from .nn import (BatchNorm2d, Conv2d, GatherChannels, GlobalAvgPool2d, Linear, MaxPool2d, ReLU,
                 Residual, Sequential)

MODELS = ("resnet", "wide")


class _Builder:
    """Names layers, seeds their weights and passes the algorithm to every convolution."""

    def __init__(self, grid, algorithm, filter_groups, seed, dtype):
        self.grid, self.algorithm, self.filter_groups = grid, algorithm, filter_groups
        self.seed, self.dtype = seed, dtype
        self.split = algorithm != "sample"

    def conv(self, name, cin, cout, kernel, stride=1, first=False):
        return Conv2d(self.grid, cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False,
                      algorithm=self.algorithm, filter_groups=self.filter_groups, input_replicated=first,
                      name=name, seed=self.seed, dtype=self.dtype)

    def bn(self, name, channels):
        return BatchNorm2d(self.grid, channels, channels_split=self.split, name=name, dtype=self.dtype)

    def head(self, channels, classes):
        return [GlobalAvgPool2d(),
                Linear(self.grid, channels, classes, algorithm=self.algorithm,
                       filter_groups=self.filter_groups, name="fc", seed=self.seed, dtype=self.dtype),
                GatherChannels(self.grid, classes, channels_split=self.split, name="fc.gather")]


def _check_width(value, what, narrowest, grid, algorithm):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    P_c = grid.axis_size("channel")
    if algorithm != "sample" and narrowest < P_c:
        raise ValueError(f"{what}={value} gives {narrowest} channels in the narrowest layer, fewer than "
                         f"the {P_c} channel ranks of grid {grid.describe()}: use a larger {what} or "
                         f"a smaller channel axis")


def small_resnet(grid, width=1, in_channels=1, classes=10, algorithm="y", filter_groups=None, seed=0,
                 dtype=np.float32):
    """A ResNet of three stages (16, 32, 64 channels times `width`), one basic block each,
    strides 1, 2, 2: 8x8 digits end at 2x2 before the global average pool."""
    base = 16 * width if isinstance(width, (int, np.integer)) else 0
    _check_width(width, "width", base, grid, algorithm)
    b = _Builder(grid, algorithm, filter_groups, seed, dtype)

    def block(name, cin, cout, stride):
        body = Sequential(b.conv(f"{name}.conv1", cin, cout, 3, stride), b.bn(f"{name}.bn1", cout), ReLU(),
                          b.conv(f"{name}.conv2", cout, cout, 3), b.bn(f"{name}.bn2", cout))
        shortcut = None
        if stride != 1 or cin != cout:
            shortcut = Sequential(b.conv(f"{name}.proj", cin, cout, 1, stride), b.bn(f"{name}.proj_bn", cout))
        return Sequential(Residual(body, shortcut), ReLU())

    return Sequential(
        b.conv("stem.conv", in_channels, base, 3, first=True), b.bn("stem.bn", base), ReLU(),
        block("layer1", base, base, 1),
        block("layer2", base, 2 * base, 2),
        block("layer3", 2 * base, 4 * base, 2),
        *b.head(4 * base, classes),
    )


def wide_cnn(grid, width=256, depth=4, in_channels=1, classes=10, algorithm="y", filter_groups=None,
             seed=0, dtype=np.float32):
    """A plain CNN: a stem convolution to `width` channels, then `depth` 3x3 convolutions of
    width x width (each with batch norm and ReLU, a 2x2 max pool after the first half), then
    the classifier. Nearly all its weights are in the wide layers."""
    _check_width(width, "width", width if isinstance(width, (int, np.integer)) else 0, grid, algorithm)
    if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)) or depth < 1:
        raise ValueError(f"depth must be a positive integer, got {depth!r}")
    b = _Builder(grid, algorithm, filter_groups, seed, dtype)
    layers = [b.conv("stem.conv", in_channels, width, 3, first=True), b.bn("stem.bn", width), ReLU()]
    for i in range(depth):
        layers += [b.conv(f"wide{i}.conv", width, width, 3), b.bn(f"wide{i}.bn", width), ReLU()]
        if i == (depth - 1) // 2:
            layers.append(MaxPool2d(2))
    return Sequential(*layers, *b.head(width, classes))


def build_model(name, grid, **config):
    """The model `name` ('resnet' or 'wide') on `grid`; config as the builder functions take."""
    if name == "resnet":
        return small_resnet(grid, **config)
    if name == "wide":
        return wide_cnn(grid, **config)
    raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
