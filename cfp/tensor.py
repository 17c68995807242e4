"""Layout and DistTensor: a global tensor as blocks over a ProcessGrid, and moves between layouts.

A `Layout` names, for each tensor dimension, the grid axis it is split over (balanced blocks,
see partition.py) or None (replicated over the grid axes no dimension uses). A `DistTensor`
is this rank's block plus the global shape, layout and grid; `redistribute` moves it to any
other layout, also on another grid over the same ranks, by one all-to-all of the
intersections of index boxes. `check_blocks` makes sure the ranks' blocks form one tensor
before a distributed layer works on them.
"""
import math

import numpy as np
from mpi4py import MPI

from . import backend, comm as collectives
from .grid import AXES
from .partition import block_range


class Layout:
    """Which grid axis each tensor dimension is split over: `Layout(("sample", "channel",
    None, None))` splits an NCHW tensor by sample and channel and replicates H and W."""

    def __init__(self, axes):
        axes = tuple(None if a in (None, "-") else a for a in axes)
        for a in axes:
            if a is not None and a not in AXES:
                raise ValueError(f"unknown grid axis {a!r} in layout {axes}; expected one of "
                                 f"{', '.join(AXES)} or None")
        used = [a for a in axes if a is not None]
        if len(used) != len(set(used)):
            raise ValueError(f"layout {axes} splits two dimensions over the same grid axis")
        self.axes = axes

    @classmethod
    def replicated(cls, ndim):
        return cls((None,) * ndim)

    @property
    def ndim(self):
        return len(self.axes)

    def box(self, global_shape, grid, coords):
        """((start, stop) per dimension) of the block at grid coordinates `coords`."""
        if len(global_shape) != self.ndim:
            raise ValueError(f"layout {self} has {self.ndim} dimensions, the tensor has shape "
                             f"{tuple(global_shape)}")
        return tuple(
            (0, extent) if axis is None else block_range(extent, grid.shape[axis], coords[axis])
            for extent, axis in zip(global_shape, self.axes)
        )

    def __eq__(self, other):
        return isinstance(other, Layout) and self.axes == other.axes

    def __hash__(self):
        return hash(self.axes)

    def __repr__(self):
        return "Layout(" + ", ".join(a or "-" for a in self.axes) + ")"


def _box_shape(box):
    return tuple(stop - start for start, stop in box)


def _intersect(a, b):
    """The intersection of two boxes, or None when it is empty."""
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return box if all(start < stop for start, stop in box) else None


def _slices(box, origin):
    """Slices selecting `box` inside an array whose first element is at `origin`."""
    return tuple(slice(start - o0, stop - o0) for (start, stop), (o0, _) in zip(box, origin))


def _same_ranks(grid_a, grid_b):
    return MPI.Comm.Compare(grid_a.comm, grid_b.comm) in (MPI.IDENT, MPI.CONGRUENT)


class DistTensor:
    """This rank's block `local` of a tensor of `global_shape`, laid out by `layout` on `grid`."""

    def __init__(self, local, global_shape, layout, grid):
        if not isinstance(layout, Layout):
            layout = Layout(layout)
        self.global_shape = tuple(int(n) for n in global_shape)
        self.layout = layout
        self.grid = grid
        expected = _box_shape(self.box())
        if tuple(local.shape) != expected:
            raise ValueError(
                f"local block has shape {tuple(local.shape)}, layout {layout} "
                f"of global shape {self.global_shape} on {grid.describe()} expects {expected}"
            )
        self.local = local

    @classmethod
    def from_global(cls, array, layout, grid):
        """Each rank takes its block of `array` (the same global array on every rank)."""
        if not isinstance(layout, Layout):
            layout = Layout(layout)
        box = layout.box(array.shape, grid, grid.coords)
        local = array[_slices(box, [(0, n) for n in array.shape])]
        xp = backend.get_array_module(array)
        return cls(xp.ascontiguousarray(local), array.shape, layout, grid)

    @property
    def dtype(self):
        return self.local.dtype

    @property
    def ndim(self):
        return len(self.global_shape)

    def box(self, rank=None):
        """((start, stop) per dimension) of the block held by `rank` (default: this rank)."""
        coords = self.grid.coords if rank is None else self.grid.coords_of(rank)
        return self.layout.box(self.global_shape, self.grid, coords)

    def gather(self, root=None):
        """The global array on every rank (root=None), or on `root` only (None elsewhere)."""
        whole = tuple((0, n) for n in self.global_shape)
        if root is None:
            return self.redistribute(Layout.replicated(self.ndim)).local
        empty = tuple((0, 0) for _ in self.global_shape)
        out = self._exchange(lambda r: whole if r == root else empty)
        return out if self.grid.rank == root else None

    def redistribute(self, layout, grid=None):
        """This tensor in `layout` on `grid` (default: the same grid).

        `grid` must span the same ranks as this tensor's grid (the same communicator or a
        duplicate of it); its shape may differ, so `sample=4` can become `sample=2,channel=2`.
        """
        grid = self.grid if grid is None else grid
        if not isinstance(layout, Layout):
            layout = Layout(layout)
        if layout.ndim != self.ndim:
            raise ValueError(f"layout {layout} has {layout.ndim} dimensions, the tensor has "
                             f"{self.ndim} (shape {self.global_shape})")
        if grid is not self.grid and not _same_ranks(grid, self.grid):
            raise ValueError(f"redistribute: grid {grid.describe()} is not over the same ranks "
                             f"as grid {self.grid.describe()}")
        local = self._exchange(lambda r: layout.box(self.global_shape, grid, grid.coords_of(r)))
        return DistTensor(local, self.global_shape, layout, grid)

    def _exchange(self, target_box):
        """Move data so that each rank r ends up holding `target_box(r)`; return this rank's.

        Each destination takes every piece from one holder: itself when it already holds the
        piece, otherwise one of the replicas, chosen by destination rank to spread the load.
        """
        p, me = self.grid.size, self.grid.rank
        holders = {}  # distinct source box -> the ranks holding a replica of it
        for r in range(p):
            holders.setdefault(self.box(r), []).append(r)
        sources = {}  # (source, destination) -> intersection box
        for d in range(p):
            target = target_box(d)
            for src_box, ranks in holders.items():
                piece = _intersect(src_box, target)
                if piece is not None:
                    s = d if d in ranks else ranks[d % len(ranks)]
                    sources[(s, d)] = piece

        xp = backend.get_array_module(self.local)
        host = backend.to_host(self.local)
        my_box = self.box()
        send = [
            np.ascontiguousarray(host[_slices(sources[(me, d)], my_box)]).reshape(-1)
            if (me, d) in sources else np.empty(0, dtype=host.dtype)
            for d in range(p)
        ]
        counts = [math.prod(_box_shape(sources[(s, me)])) if (s, me) in sources else 0
                  for s in range(p)]
        chunks = collectives.alltoallv(self.grid.comm, send, counts, host.dtype)

        my_target = target_box(me)
        out = np.empty(_box_shape(my_target), dtype=host.dtype)
        for s, chunk in enumerate(chunks):
            if (s, me) in sources:
                piece = sources[(s, me)]
                out[_slices(piece, my_target)] = chunk.reshape(_box_shape(piece))
        return backend.from_host(out, xp)

    def __repr__(self):
        return (f"DistTensor(global_shape={self.global_shape}, layout={self.layout}, "
                f"grid={self.grid.describe()}, local_shape={tuple(self.local.shape)})")


def check_blocks(local, layout, grid, what):
    """The global shape of the tensor whose blocks the ranks of `grid` hold as `local` under
    `layout`, after checking that they form one: the same dtype and number of dimensions
    everywhere, equal extents where a dimension is replicated, and along a split dimension
    the blocks of the balanced partition of one extent. Collective over grid.comm (one
    allgather of a few integers, outside the ledger); a ValueError naming `what`, the ranks
    and their shapes, alike on every rank. Skipped (returns None) inside
    comm.inputs_checked()."""
    if not collectives.checking(layer_trusted=False):
        return None
    if not isinstance(layout, Layout):
        layout = Layout(layout)
    every = collectives.gather_shapes(grid.comm, local)
    problem = _blocks_problem(every, layout, grid)
    if problem is None:
        return _global_shape(every, layout, grid)
    raise ValueError(f"{what}: the ranks' blocks do not form one tensor ({problem}) under layout "
                     f"{layout} on grid {grid.describe()}: {collectives.describe_shapes(every)}")


def _global_shape(every, layout, grid):
    """Each dimension's extent: rank 0's where replicated, the sum of the blocks along the
    grid axis (at the other coordinates of rank 0) where split."""
    ndim = int(every[0, 0])
    shape = []
    for d in range(ndim):
        axis = layout.axes[d]
        if axis is None:
            shape.append(int(every[0, 2 + d]))
        else:
            base = grid.coords_of(0)
            shape.append(sum(int(every[grid.rank_of({**base, axis: c}), 2 + d])
                             for c in range(grid.shape[axis])))
    return tuple(shape)


def _blocks_problem(every, layout, grid):
    """What is wrong with the blocks in `every` (one row per rank), or None."""
    if len(set(every[:, 0])) > 1:
        return "their numbers of dimensions differ"
    if len(set(every[:, 1])) > 1:
        return "their dtypes differ"
    ndim = int(every[0, 0])
    if ndim != layout.ndim:
        return f"they are {ndim}-D, the layout is {layout.ndim}-D"
    global_shape = _global_shape(every, layout, grid)
    for r, row in enumerate(every):
        box = layout.box(global_shape, grid, grid.coords_of(r))
        if tuple(int(n) for n in row[2:2 + ndim]) != _box_shape(box):
            return (f"rank {r} holds {tuple(int(n) for n in row[2:2 + ndim])} where a tensor of global "
                    f"shape {global_shape} has a block of {_box_shape(box)}")
    return None
