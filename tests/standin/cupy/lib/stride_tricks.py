"""cupy.lib.stride_tricks of the stand-in: views of device arrays."""
import numpy as _np

from .. import _unwrap, _wrap


def as_strided(x, shape=None, strides=None):
    return _wrap(_np.lib.stride_tricks.as_strided(_unwrap(x, "as_strided"), shape, strides))


def sliding_window_view(x, window_shape, axis=None, *, subok=False, writeable=False):
    return _wrap(_np.lib.stride_tricks.sliding_window_view(_unwrap(x, "sliding_window_view"), window_shape,
                                                           axis=axis, writeable=writeable))
