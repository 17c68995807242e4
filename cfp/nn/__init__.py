"""cfp's layers: distributed convolutions and the layers around them, with manual backward.

Activations are this rank's blocks: split by sample over the grid's sample axis, and by
channel over its channel axis after a channel/filter-parallel ('x', 'y', 'w') layer.
"""
from .containers import Residual, Sequential
from .conv import Conv2d, Linear
from .layers import AvgPool2d, BatchNorm2d, Flatten, GlobalAvgPool2d, MaxPool2d, ReLU
from .loss import GatherChannels, SoftmaxCrossEntropy
from .module import Module, Parameter

__all__ = ["AvgPool2d", "BatchNorm2d", "Conv2d", "Flatten", "GatherChannels", "GlobalAvgPool2d",
           "Linear", "MaxPool2d", "Module", "Parameter", "ReLU", "Residual", "Sequential",
           "SoftmaxCrossEntropy"]
