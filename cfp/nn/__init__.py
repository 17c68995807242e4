"""cfp's layers: distributed convolutions and the layers around them, with manual backward.

Activations are this rank's blocks: split by sample over the grid's sample axis, and by
channel over its channel axis after a channel/filter-parallel ('x', 'y', 'w') layer. Each
layer declares the grid and layout it expects (module.py); containers move activations
between layers that differ (Redistribute).
"""
from .containers import Network, Redistribute, Residual, Sequential
from .conv import Conv2d, Conv3d, ConvTranspose2d, ConvTranspose3d, Linear
from .layers import (AvgPool2d, AvgPool3d, BatchNorm2d, BatchNorm3d, Flatten, GlobalAvgPool2d, GlobalAvgPool3d, GroupNorm,
                     MaxPool2d, MaxPool3d, ReLU, Upsample)
from .loss import SoftmaxCrossEntropy
from .module import Module, Parameter

__all__ = ["AvgPool2d", "AvgPool3d", "GroupNorm", "MaxPool3d", "BatchNorm2d", "BatchNorm3d", "GlobalAvgPool3d", "Conv2d", "Conv3d", "ConvTranspose2d", "ConvTranspose3d", "Flatten", "GlobalAvgPool2d", "Linear", "MaxPool2d",
           "Module", "Network", "Parameter", "ReLU", "Redistribute", "Residual", "Sequential",
           "SoftmaxCrossEntropy", "Upsample"]
