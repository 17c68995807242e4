"""The kernels' workspace: one block of memory, kept from call to call, that holds the
temporaries of a kernel call (docs/design.md, section 3c).

Why: a NumPy temporary of a few MiB is mapped by malloc when it is made and unmapped when it
is freed, so every call of a kernel touches its buffers' pages for the first time again, and
each first touch is a page fault in the operating system. On cfp's machine, when the system
has no huge pages to give, that is about 2.7 us a 4 KiB page: the 8x256x16x16 3x3 Winograd
forward asked for about 20 MiB of temporaries, took 5000 faults and spent 13 ms of its 26 ms
in the kernel; with its temporaries here it takes 15 ms (BENCHMARKS.md). PyTorch's oneDNN
keeps its scratchpad the same way.

How: each public kernel is wrapped in `call`; inside it, `empty` and `zeros` hand out
consecutive, 64-byte aligned pieces of the block, and the next call starts again from its
beginning. The block grows to what the largest call asked for (a call that asks for more than
it holds gets fresh arrays for the rest and leaves the block larger for the next one), so it
holds what one call needs at most: the "workspace" the cost model adds to a plan's memory.
`release()` hands it back; `set_limit(n)` keeps it at most n bytes. Only temporaries live here,
never a result: a kernel's outputs are fresh arrays, which the next call cannot overwrite.
CuPy arrays are not pooled here: CuPy's own memory pool already reuses device memory.
"""
import functools
import math
import threading

import numpy as np

_ALIGNMENT = 64  # bytes: a cache line, and what AVX-512 loads like
_limit = None  # the most bytes the block may hold (None: what the largest call asked for)


class _Workspace(threading.local):
    """One thread's block (uint8), the bytes handed out in the current call, the most any call
    asked for, and how deep in nested kernel calls the thread is."""

    def __init__(self):
        self.block = None
        self.used = 0
        self.needed = 0
        self.depth = 0
        self.lasting = {}  # slot: uint8 buffer (lasting)


_state = _Workspace()


def call(kernel):
    """Run `kernel` with the workspace: the outermost call starts handing out the block from its
    beginning (made large enough for the largest call so far); nested ones go on from there."""
    @functools.wraps(kernel)
    def with_workspace(*args, **kwargs):
        state = _state
        if state.depth == 0:
            state.used = 0
            size = state.needed if _limit is None else min(state.needed, _limit)
            if size > held_bytes() or (_limit is not None and held_bytes() > _limit):
                state.block = None  # the old block goes before the new one is made
                state.block = np.empty(size + _ALIGNMENT, np.uint8) if size else None
        state.depth += 1
        try:
            return kernel(*args, **kwargs)
        finally:
            state.depth -= 1
    return with_workspace


def empty(xp, shape, dtype):
    """An uninitialised temporary of `shape` and `dtype`: a piece of the workspace inside a
    kernel call on NumPy arrays, a fresh array otherwise."""
    state = _state
    if xp is not np or state.depth == 0:
        return xp.empty(shape, dtype)
    dtype = np.dtype(dtype)
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    nbytes = math.prod(shape) * dtype.itemsize
    start = state.used
    state.used += piece_bytes(nbytes)
    state.needed = max(state.needed, state.used)
    if state.used > held_bytes() or state.block is None:  # (a piece of 0 bytes fits in no block)
        return np.empty(shape, dtype)
    offset = -state.block.ctypes.data % _ALIGNMENT + start
    return state.block[offset:offset + nbytes].view(dtype).reshape(shape)


def lasting(xp, shape, dtype, slot):
    """An uninitialised array that outlives the kernel call that makes it, in this thread's
    lasting buffer `slot` (0, 1, ...), which the next request of that slot reuses (and grows to
    its size): for what several calls of one pass share (winograd.filters_kept's transforms),
    so that its pages are faulted in once, not once a pass. Valid until the next request of its
    slot; NumPy only (a fresh array otherwise: CuPy's pool reuses device memory); release()
    drops the buffers. Not counted in the cost model's workspace: nothing asks for one under a
    limit (set_limit)."""
    if xp is not np:
        return xp.empty(shape, dtype)
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = _state.lasting.get(slot)
    if buffer is None or buffer.size - _ALIGNMENT < nbytes:
        _state.lasting[slot] = None  # the old buffer goes before the new one is made
        buffer = _state.lasting[slot] = np.empty(nbytes + _ALIGNMENT, np.uint8)
    offset = -buffer.ctypes.data % _ALIGNMENT
    return buffer[offset:offset + nbytes].view(dtype).reshape(shape)


def piece_bytes(nbytes):
    """What a temporary of `nbytes` takes of the block: rounded up to whole 64-byte lines."""
    return -(-nbytes // _ALIGNMENT) * _ALIGNMENT


def zeros(xp, shape, dtype):
    """A zeroed temporary (the workspace holds whatever the last call left there)."""
    a = empty(xp, shape, dtype)
    a.fill(0)
    return a


def held_bytes():
    """Bytes of the block this thread holds (0 before the first call and after release())."""
    block = _state.block
    return 0 if block is None else block.size - _ALIGNMENT


def set_limit(nbytes):
    """Let the block hold at most `nbytes` (None: as much as the largest call asks for, the
    default). Pieces past the limit are fresh arrays, freed as their kernel lets go of them. A
    model built under a memory limit sets 0 (cfp.models.build_model): no block is kept, the
    temporaries live inside each call only, as the plan's memory counts them; the speed of the
    kept block is traded for the memory the plan promised."""
    global _limit
    if nbytes is not None and (not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0):
        raise ValueError(f"workspace limit must be a number of bytes >= 0 or None, got {nbytes!r}")
    _limit = nbytes


def limit():
    """The limit set_limit set (None: none)."""
    return _limit


def release():
    """Hand the block and the lasting buffers back; the next kernel call starts a new one."""
    _state.block, _state.needed, _state.lasting = None, 0, {}
