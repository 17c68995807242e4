"""The convolution algorithms of Dryden et al. (SC'19) on a ProcessGrid of sample x height x
width x channel axes: each splits the samples, the image (a halo exchange) and, but for
sample parallelism, the channels and filters.

`make_conv(algorithm, grid, C, F, kernel, ...)` with algorithm one of 'sample', 'x', 'y', 'w'.
"""
from .base import ConvAlgorithm
from .grouped import GroupedChannels, grouped
from .sample import SampleParallel
from .stationary_w import StationaryW
from .stationary_x import StationaryX
from .stationary_y import StationaryY

ALGORITHMS = {"sample": SampleParallel, "x": StationaryX, "y": StationaryY, "w": StationaryW}


def algorithm_class(algorithm, groups=1):
    """The class that runs `algorithm` for a convolution of `groups` groups: a grouped layer
    under channel/filter parallelism moves nothing along the channel axis, whichever of x, y, w
    it is (algorithms/grouped.py: the grouped class keeps the name and p_f rule asked for)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")
    cls = ALGORITHMS[algorithm]
    return grouped(cls) if groups > 1 and not cls.weight_replicated else cls


def make_conv(algorithm, grid, in_channels, out_channels, kernel_size, filter_groups=None, **kwargs):
    """The distributed convolution `algorithm` ('sample', 'x', 'y' or 'w') on `grid`.

    filter_groups (p_f) applies to 'w' only (default: the divisor of P_c nearest sqrt(P_c);
    p_f = 1 is stationary-x's partition, p_f = P_c stationary-y's; each class's filter_groups
    says, and refuses a p_f it does not take). With groups > 1, x, y and w run as
    grouped(their class), a GroupedChannels.
    Other keywords: stride, padding, dilation, groups, padding_mode (nn.Conv2d's), bias,
    input_whole (x holds all C: the first layer), need_dx, layer, chunks (ConvAlgorithm.pipelined),
    halo_interior (ConvAlgorithm.halo_interior).
    """
    cls = algorithm_class(algorithm, kwargs.get("groups", 1))
    return cls(grid, in_channels, out_channels, kernel_size, filter_groups=filter_groups, **kwargs)


__all__ = ["ALGORITHMS", "ConvAlgorithm", "GroupedChannels", "SampleParallel", "StationaryW", "StationaryX",
           "StationaryY", "algorithm_class", "grouped", "make_conv"]
