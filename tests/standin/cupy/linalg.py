"""cupy.linalg of the stand-in: NumPy's on stand-in arrays."""
import numpy as _np

from . import _function


def __getattr__(name):
    return _function(name, getattr(_np.linalg, name))
