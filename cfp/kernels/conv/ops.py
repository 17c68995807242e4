"""The kinds of convolution a distributed layer runs, each as one set of passes on one rank's
blocks: 'conv2d', 'conv3d', 'conv_transpose2d', 'conv_transpose3d' (OPS).

A distributed algorithm (cfp/algorithms) needs of its local kernel only that the layer's output
is a sum over input channels of one kernel per (output, input) channel pair, so that channels
and filters can be split and partial outputs summed. Every kind here is that, and each takes
its weight in the convolution's orientation, (F, C/groups, *K): F the layer's output channels,
C its input channels. A transposed convolution's weight as PyTorch holds it, (C, F/groups, *K),
is the same numbers with the first two axes swapped within each group (to_conv_weight,
to_torch_weight), so weight layouts, shards, gradient allreduces and checkpoints are the
convolution's, and each algorithm's messages, stated in terms of the layer's input x and
output y, are unchanged. What changes is which kernel each local pass is: the transposed
forward is the convolution's backward-data kernel, its backward-data the convolution's
forward kernel (kernels/conv/transposed.py).

Each ConvOp's `options(...)` checks a layer's options without shapes (what a layer does when
it is made) and puts them in the form its passes take.
"""
import typing

from cfp.kernels.conv import passes, transposed, volume
from cfp.kernels.conv.geometry import conv2d_output_shape, conv_geometry, conv_options
from cfp.kernels.conv.paths import PASSES

_SAME_PASSES = {p: p for p in PASSES}
# a transposed convolution's passes as its adjoint convolution's (kernels/conv/transposed.py)
_ADJOINT_PASSES = {"forward": "backward-data", "backward-data": "forward", "backward-filter": "backward-filter"}


def _transposed_options(axes):
    def options(stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros", output_padding=0):
        if padding_mode != "zeros":
            raise ValueError(f"padding_mode {padding_mode!r}: a transposed convolution pads with zeros only "
                             f"(as PyTorch's ConvTranspose{axes}d)")
        return transposed.transposed_options(axes, stride, padding, output_padding, dilation, groups)
    return options


def to_torch_weight(w, groups):
    """A transposed convolution's weight from the convolution's orientation (F, C/G, *K) to
    PyTorch's (C, F/G, *K): within each group, the first two axes swapped (a view where it
    can be: copy it to keep it). The same swap takes PyTorch's back (to_conv_weight)."""
    A, B = w.shape[:2]
    rest = tuple(w.shape[2:])
    swapped = w.reshape((groups, A // groups, B) + rest).swapaxes(1, 2)
    return swapped.reshape((groups * B, A // groups) + rest)


to_conv_weight = to_torch_weight  # PyTorch's (C, F/G, *K) to (F, C/G, *K): the same swap


def _torch_shape(w_shape, groups):
    F, Cg = w_shape[:2]
    return (groups * Cg, F // groups) + tuple(w_shape[2:])


# The transposed passes with the weight in the convolution's orientation (any number of spatial
# axes: the arrays say).

def _transposed_forward(x, w, b=None, groups=1, **options):
    return transposed.conv_transpose_forward(x, to_torch_weight(w, groups), b, groups=groups, **options)


def _transposed_backward_data(dy, w, x_shape, groups=1, **options):
    return transposed.conv_transpose_backward_data(dy, to_torch_weight(w, groups), x_shape, groups=groups, **options)


def _transposed_backward_filter(x, dy, w_shape, groups=1, **options):
    dw = transposed.conv_transpose_backward_filter(x, dy, _torch_shape(w_shape, groups), groups=groups, **options)
    return to_conv_weight(dw, groups).copy()


def _transposed_output_shape(x_shape, w_shape, groups=1, **options):
    return transposed.conv_transpose_output_shape(x_shape, _torch_shape(w_shape, groups), groups=groups, **options)


def _conv2d_plane(x_shape, w_shape, **options):
    return conv_geometry(x_shape, w_shape, **options), _SAME_PASSES


def _conv3d_plane(x_shape, w_shape, **options):
    return volume.volume_geometry(x_shape, w_shape, **options).plane, _SAME_PASSES


def _transposed_plane(x_shape, w_shape, groups=1, **options):
    t = transposed.transposed_geometry(x_shape, _torch_shape(w_shape, groups), groups=groups, **options)
    _, read = transposed.adjoint_input(t)
    if read is None:  # no window reaches this block: its passes compute nothing
        return None, _ADJOINT_PASSES
    plane = _conv2d_plane if len(read) == 4 else _conv3d_plane
    return plane(read, t.w_shape, **t.options)[0], _ADJOINT_PASSES


class ConvOp(typing.NamedTuple):
    """One kind of convolution: its name, spatial axes, whether transposed, and its passes on
    NumPy/CuPy blocks, the weight in the convolution's orientation (F, C/groups, *K), keyword
    arguments those `options` returns."""
    name: str
    axes: int
    transposed: bool
    options: typing.Callable
    forward: typing.Callable
    backward_data: typing.Callable
    backward_filter: typing.Callable
    backward_bias: typing.Callable
    output_shape: typing.Callable
    # (the 2-D ConvGeometry whose passes compute this kind's passes on blocks of these shapes,
    # {pass: which of its passes computes it}): a volume's stacked planes (volume.py), a
    # transposed convolution's adjoint (transposed.py: its forward is the adjoint's
    # backward-data). None for a transposed block no window reaches. The cost model prices
    # each pass at that 2-D pass's rate (perfmodel.layer_cost).
    plane: typing.Callable


_TRANSPOSED = (_transposed_forward, _transposed_backward_data, _transposed_backward_filter,
               transposed.conv_transpose_backward_bias, _transposed_output_shape, _transposed_plane)
OPS = {
    "conv2d": ConvOp("conv2d", 2, False, conv_options, passes.conv2d_forward, passes.conv2d_backward_data,
                     passes.conv2d_backward_filter, passes.conv2d_backward_bias, conv2d_output_shape, _conv2d_plane),
    "conv3d": ConvOp("conv3d", 3, False, volume.volume_options, volume.conv3d_forward, volume.conv3d_backward_data,
                     volume.conv3d_backward_filter, volume.conv3d_backward_bias, volume.conv3d_output_shape,
                     _conv3d_plane),
    "conv_transpose2d": ConvOp("conv_transpose2d", 2, True, _transposed_options(2), *_TRANSPOSED),
    "conv_transpose3d": ConvOp("conv_transpose3d", 3, True, _transposed_options(3), *_TRANSPOSED),
}


def conv_op(name):
    """The ConvOp called `name`; ValueError naming the kinds for any other."""
    if isinstance(name, ConvOp):
        return name
    if name not in OPS:
        raise ValueError(f"unknown convolution kind {name!r}; expected one of {', '.join(OPS)}")
    return OPS[name]

