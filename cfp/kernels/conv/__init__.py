"""Fast local 2-D convolution on NCHW blocks: forward, backward-data, backward-filter, bias.

GEMM-based kernels on the arrays of one rank (NumPy or CuPy); no MPI here, cfp.algorithms moves
data. Which path a layer's pass takes depends only on its geometry and dtype, and is decided in
one place, the path table (paths.py; docs/design.md, section 3c): Winograd F(4x4, 3x3) for
float32 3x3 stride-1 ungrouped layers (dilated ones by residue-class sub-grids, winograd.py);
banded GEMMs on residue classes of rows for depthwise layers (depthwise.py); pointwise GEMMs
for 1x1 layers and pixel-major im2col + GEMM for everything else (im2col.py); plane columns for
stride-1 layers with narrow groups (plane.py). The modules:

geometry.py   the options and sizes of a convolution (ConvGeometry), argument checks
padding.py    padding modes as index maps and their adjoint
volume.py     3-D convolution (NCDHW) as one stacked 2-D convolution: depth columns
transposed.py transposed convolution (2-D and 3-D) as the adjoint of the convolution
ops.py        the kinds a distributed layer runs (conv2d, conv3d, conv_transpose2d/3d), one set of passes each
paths.py      the path table: which path each pass takes, and the dispatch
passes.py     the public passes and the workspace count
im2col.py, plane.py, winograd.py, depthwise.py: the kernel families

Shapes: x (N, C, H, W), w (F, C/groups, Kh, Kw), b (F,), y and dy (N, F, Ho, Wo) (geometry.py
gives Ho and Wo with dilation and four-sided padding). Any of N, C, F may be 0: channel and
filter shards of a distributed layer can be empty.
"""
from cfp.kernels.conv.geometry import (PADDING_MODES, ConvGeometry, conv2d_flops, conv2d_output_shape,
                                       conv_geometry, conv_options)
from cfp.kernels.conv.padding import fold_index, pad_index
from cfp.kernels.conv.passes import (conv2d_backward_bias, conv2d_backward_data, conv2d_backward_filter,
                                     conv2d_forward, workspace_bytes)
from cfp.kernels.conv.ops import OPS, ConvOp, conv_op, to_conv_weight, to_torch_weight
from cfp.kernels.conv.paths import PATHS, KernelPath, choose
from cfp.kernels.conv.transposed import (conv_transpose_backward_bias, conv_transpose_backward_data,
                                         conv_transpose_backward_filter, conv_transpose_forward,
                                         conv_transpose_output_shape, transposed_geometry)
from cfp.kernels.conv.volume import (conv3d_backward_bias, conv3d_backward_data, conv3d_backward_filter,
                                     conv3d_flops, conv3d_forward, conv3d_output_shape, volume_geometry)
from cfp.kernels.conv.winograd import filters_kept, winograd_matrices

__all__ = ["PADDING_MODES", "ConvGeometry", "KernelPath", "PATHS", "choose", "conv2d_backward_bias",
           "conv2d_backward_data", "conv2d_backward_filter", "conv2d_flops", "conv2d_forward", "conv2d_output_shape",
           "conv_geometry", "conv_options", "filters_kept", "fold_index", "pad_index", "winograd_matrices",
           "workspace_bytes", "conv3d_backward_bias", "conv3d_backward_data", "conv3d_backward_filter",
           "conv3d_flops", "conv3d_forward", "conv3d_output_shape", "volume_geometry",
           "conv_transpose_backward_bias", "conv_transpose_backward_data", "conv_transpose_backward_filter",
           "conv_transpose_forward", "conv_transpose_output_shape", "transposed_geometry", "OPS", "ConvOp", "conv_op", "to_conv_weight",
           "to_torch_weight"]
