"""Local single-rank math on NumPy or CuPy arrays: the kernels the distributed algorithms call.

No MPI anywhere in this package; cfp.algorithms does the communication around these kernels.
"""
from cfp.kernels.conv import (
    conv2d_backward_bias,
    conv2d_backward_data,
    conv2d_backward_filter,
    conv2d_flops,
    conv2d_forward,
    conv2d_output_shape,
    conv_geometry,
    conv_options,
    ConvGeometry,
    fold_index,
    pad_index,
    workspace_bytes,
)
from cfp.kernels.settings import winograd

__all__ = [
    "ConvGeometry",
    "conv_geometry",
    "conv_options",
    "conv2d_output_shape",
    "conv2d_flops",
    "conv2d_forward",
    "conv2d_backward_data",
    "conv2d_backward_filter",
    "conv2d_backward_bias",
    "fold_index",
    "pad_index",
    "winograd",
    "workspace_bytes",
]
