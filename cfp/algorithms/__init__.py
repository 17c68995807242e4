"""The convolution algorithms of Dryden et al. (SC'19) on a sample x channel ProcessGrid.

`make_conv(algorithm, grid, C, F, kernel, ...)` with algorithm one of 'sample', 'x', 'y', 'w'.
"""
from .base import ConvAlgorithm
from .grouped import GroupedChannels
from .sample import SampleParallel
from .stationary_w import StationaryW
from .stationary_x import StationaryX
from .stationary_y import StationaryY

ALGORITHMS = {"sample": SampleParallel, "x": StationaryX, "y": StationaryY, "w": StationaryW}


def algorithm_class(algorithm, groups=1):
    """The class that runs `algorithm` for a convolution of `groups` groups: a grouped layer
    under channel/filter parallelism moves nothing along the channel axis, whichever of x, y, w
    it is (algorithms/grouped.py)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")
    return GroupedChannels if groups > 1 and algorithm != "sample" else ALGORITHMS[algorithm]


def make_conv(algorithm, grid, in_channels, out_channels, kernel_size, filter_groups=None, **kwargs):
    """The distributed convolution `algorithm` ('sample', 'x', 'y' or 'w') on `grid`.

    filter_groups (p_f) applies to 'w' only (default: the divisor of P_c nearest sqrt(P_c);
    p_f = 1 is stationary-x's partition, p_f = P_c stationary-y's). With groups > 1, x, y and w
    run as GroupedChannels.
    Other keywords: stride, padding, dilation, groups, padding_mode (nn.Conv2d's), bias,
    input_whole (x holds all C: the first layer), need_dx, layer.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")
    if filter_groups is not None and algorithm != "w":
        raise ValueError(f"filter_groups (p_f) applies to algorithm 'w' only, not {algorithm!r}")
    cls = algorithm_class(algorithm, kwargs.get("groups", 1))
    if cls is GroupedChannels:
        return cls(algorithm, grid, in_channels, out_channels, kernel_size, filter_groups=filter_groups, **kwargs)
    return cls(grid, in_channels, out_channels, kernel_size, filter_groups=filter_groups, **kwargs)


__all__ = ["ALGORITHMS", "ConvAlgorithm", "GroupedChannels", "SampleParallel", "StationaryW", "StationaryX",
           "StationaryY", "algorithm_class", "make_conv"]
