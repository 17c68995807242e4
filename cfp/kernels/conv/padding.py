"""Padding modes other than zeros (reflect, replicate, circular) as index maps: the input
position each padded position copies (pad_index), the gather that pads an input by it, and
its adjoint (fold_index), which adds a padded input's gradient back where it was copied from.
Zero padding is each kernel path's own; the halo of a split image uses these maps too.
"""
import numpy as np

from cfp.backend import get_array_module, index_array
from cfp.kernels.conv.geometry import padded_geometry

def pad_index(extent, before, after, mode):
    """For each position of an axis padded by (before, after) in `mode`, the input position
    it copies: the padding modes of PyTorch (reflect without repeating the edge, replicate the
    edge, circular wrap-around)."""
    i = np.arange(-before, extent + after)
    if mode == "reflect":
        period = 2 * (extent - 1) if extent > 1 else 1
        i = np.abs(i) % period
        return np.where(i >= extent, period - i, i)
    if mode == "replicate":
        return np.clip(i, 0, extent - 1)
    return i % extent  # circular


def pad_input(x, g, xp):
    """x padded by the geometry's padding in its (non-zero) mode, and the geometry of a
    convolution without padding over it."""
    rows = index_array(pad_index(g.H, g.pt, g.pb, g.mode), xp)
    cols = index_array(pad_index(g.W, g.pl, g.pr, g.mode), xp)
    padded = xp.ascontiguousarray(x[:, :, rows][:, :, :, cols])
    return padded, padded_geometry(g)


def fold_padding(d_padded, g):
    """The adjoint of pad_input: the gradient of the padded input added back onto the input
    positions each padded position copied."""
    rows, cols = pad_index(g.H, g.pt, g.pb, g.mode), pad_index(g.W, g.pl, g.pr, g.mode)
    return fold_index(fold_index(d_padded, rows, g.H, 2), cols, g.W, 3)


def fold_index(d, at, extent, axis):
    """The adjoint of taking positions `at` along an axis (a gather such as pad_index's): d's
    slices along `axis` summed onto the `extent` positions they were taken from (slice k from
    position at[k]), each run of consecutive positions added as one slice."""
    xp = get_array_module(d)
    shape = list(d.shape)
    shape[axis] = extent
    out = xp.zeros(shape, d.dtype)
    k = 0
    while k < len(at):
        run = 1
        while k + run < len(at) and at[k + run] == at[k] + run:
            run += 1
        into, take = [slice(None)] * d.ndim, [slice(None)] * d.ndim
        into[axis], take[axis] = slice(int(at[k]), int(at[k]) + run), slice(k, k + run)
        out[tuple(into)] += d[tuple(take)]
        k += run
    return out
