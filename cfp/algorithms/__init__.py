"""The convolution algorithms of Dryden et al. (SC'19) on a sample x channel ProcessGrid.

`make_conv(algorithm, grid, C, F, kernel, ...)` with algorithm one of 'sample', 'x', 'y', 'w'.
"""
from .base import ConvAlgorithm
from .sample import SampleParallel
from .stationary_w import StationaryW
from .stationary_x import StationaryX
from .stationary_y import StationaryY

ALGORITHMS = {"sample": SampleParallel, "x": StationaryX, "y": StationaryY, "w": StationaryW}


def make_conv(algorithm, grid, in_channels, out_channels, kernel_size, filter_groups=None, **kwargs):
    """The distributed convolution `algorithm` ('sample', 'x', 'y' or 'w') on `grid`.

    filter_groups (p_f) applies to 'w' only (default: the divisor of P_c nearest sqrt(P_c);
    p_f = 1 is stationary-x's partition, p_f = P_c stationary-y's).
    Other keywords: stride, padding, bias, input_whole (x holds all C: the first layer), need_dx,
    layer.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")
    if filter_groups is not None and algorithm != "w":
        raise ValueError(f"filter_groups (p_f) applies to algorithm 'w' only, not {algorithm!r}")
    return ALGORITHMS[algorithm](grid, in_channels, out_channels, kernel_size,
                                 filter_groups=filter_groups, **kwargs)


__all__ = ["ALGORITHMS", "ConvAlgorithm", "SampleParallel", "StationaryW", "StationaryX",
           "StationaryY", "make_conv"]
