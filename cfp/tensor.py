"""DistTensor: a global tensor as blocks over a ProcessGrid, and moves between layouts.

A `DistTensor` is this rank's block plus the global shape, the layout (cfp/layout.py: which
grid axis splits each dimension, and which axes hold replicas or summands) and the grid;
`redistribute` moves it to any other layout, also on another grid over the same ranks, by one
all-to-all of the pieces layout.exchange_plan lists. `check_blocks` makes sure the ranks' blocks
form one tensor before a distributed layer works on them.
"""
import numpy as np
from mpi4py import MPI

from . import backend, comm as collectives
from .layout import Layout, Shard, exchange_plan, global_extent, piece_size, positions, selector, tiles

__all__ = ["DistTensor", "Layout", "Shard", "assemble", "check_blocks", "move", "start_move"]


def _same_ranks(grid_a, grid_b):
    """Whether two grids are over the same processes, numbered alike or (placed by other node
    axes) not: exchange_plan translates between them."""
    same = MPI.Comm.Compare(grid_a.comm, grid_b.comm) in (MPI.IDENT, MPI.CONGRUENT)
    return same or (MPI.Comm.Compare(grid_a.over, grid_b.over) in (MPI.IDENT, MPI.CONGRUENT)
                    and MPI.Comm.Compare(grid_a.comm, grid_b.comm) == MPI.SIMILAR)


class DistTensor:
    """This rank's block `local` of a tensor of `global_shape`, laid out by `layout` on `grid`."""

    def __init__(self, local, global_shape, layout, grid):
        if not isinstance(layout, Layout):
            layout = Layout(layout)
        self.global_shape = tuple(int(n) for n in global_shape)
        self.layout = layout
        self.grid = grid
        layout.check_fits(self.global_shape, grid)
        expected = layout.local_shape(self.global_shape, grid, grid.coords)
        if tuple(local.shape) != expected:
            raise ValueError(
                f"local block has shape {tuple(local.shape)}, layout {layout} "
                f"of global shape {self.global_shape} on {grid.describe()} expects {expected}"
            )
        self.local = local

    @classmethod
    def from_global(cls, array, layout, grid):
        """Each rank takes its block of `array` (the same global array on every rank); under a
        partial layout the coordinate-0 summand is the array and the others are zeros."""
        if not isinstance(layout, Layout):
            layout = Layout(layout)
        layout.check_fits(array.shape, grid)
        xp = backend.get_array_module(array)
        held = layout.indices(array.shape, grid, grid.coords)
        local = xp.ascontiguousarray(array[selector([positions(ix, range(n)) for ix, n in zip(held, array.shape)])])
        if not layout.first_summand(grid, grid.coords):
            local = xp.zeros_like(local)
        return cls(local, array.shape, layout, grid)

    @property
    def dtype(self):
        return self.local.dtype

    @property
    def ndim(self):
        return len(self.global_shape)

    def indices(self, rank=None):
        """The global indices held by `rank` (default: this rank), per dimension."""
        coords = self.grid.coords if rank is None else self.grid.coords_of(rank)
        return self.layout.indices(self.global_shape, self.grid, coords)

    def gather(self, root=None):
        """The global array on every rank (root=None), or on `root` only (None elsewhere): the
        one way cfp makes a distributed tensor whole (activations, weights and their gradients,
        parameters), by one all-to-all in which each rank receives what it lacks from one copy."""
        if root is None:
            return self.redistribute(Layout.replicated(self.ndim)).local
        if not 0 <= root < self.grid.size:
            raise ValueError(f"gather: root {root!r} outside 0..{self.grid.size - 1}")
        out = self._exchange_to_root(root)
        return out if self.grid.rank == root else None

    def redistribute(self, layout, grid=None):
        """This tensor in `layout` on `grid` (default: the same grid).

        `grid` must span the same ranks as this tensor's grid (the same communicator or a
        duplicate of it); its shape may differ, so `sample=4` can become `sample=2,channel=2`.
        From a partial layout the summands are added; to a partial one, coordinate 0 along
        its partial axes gets the tensor and the other ranks zeros.
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
        pieces = exchange_plan(self.global_shape, self.layout, self.grid, layout, grid, self.grid.size)
        wanted = layout.indices(self.global_shape, grid, grid.coords)
        local = self._exchange(pieces, wanted)
        return DistTensor(local, self.global_shape, layout, grid)

    def _exchange_to_root(self, root):
        whole = tuple(range(n) for n in self.global_shape)
        plan = exchange_plan(self.global_shape, self.layout, self.grid, Layout.replicated(self.ndim),
                             self.grid, self.grid.size)
        pieces = tuple(p for p in plan if p[1] == root)
        return self._exchange(pieces, whole if self.grid.rank == root else tuple(range(0) for _ in whole))

    def _exchange(self, pieces, wanted):
        """Send and receive `pieces` ((s, d, index sets), from layout.exchange_plan) with one
        all-to-all; return this rank's block of the indices `wanted`, the sum of what arrived."""
        return move(self.local, self.indices(), pieces, wanted, self.grid.comm)

    def __repr__(self):
        return (f"DistTensor(global_shape={self.global_shape}, layout={self.layout}, "
                f"grid={self.grid.describe()}, local_shape={tuple(self.local.shape)})")


def assemble(global_shape, pieces, dtype):
    """The global array of `global_shape` from shards in hand, [(index sets, shard)]: per
    dimension the global indices the shard covers (None: all), as a checkpoint's files keep
    them; the pieces must cover it (copies may repeat). A tensor on a grid is made whole by
    DistTensor.gather instead, which moves only what each rank lacks."""
    out = np.zeros(global_shape, dtype=dtype)
    covered = np.zeros(global_shape, dtype=bool)
    for index, shard in pieces:
        full = tuple(range(n) if ix is None else ix for n, ix in zip(global_shape, index))
        out[np.ix_(*full)] = shard
        covered[np.ix_(*full)] = True
    if not covered.all():
        raise ValueError(f"the shards cover {int(covered.sum())} of the {covered.size} entries of a "
                         f"tensor of shape {tuple(global_shape)}")
    return out


def move(local, held, pieces, wanted, comm, donate=False):
    """start_move's exchange, blocking: its result."""
    return start_move(local, held, pieces, wanted, comm, blocking=True, donate=donate).wait()


class Moving:
    """A move (start_move) whose all-to-all may be in flight: test() lets MPI progress it,
    wait() puts what arrived in place and returns move's result (once; waiting again returns
    it again). Until then `local` is MPI's to read: it must not be written."""

    def __init__(self, pending, place):
        self._pending, self._place, self._out = pending, place, None

    def test(self):
        return self._pending.test()

    def wait(self):
        if self._out is None:
            self._out = self._place(self._pending.wait())
        return self._out


class _Done:
    """A blocking all-to-all's chunks, as a Pending that has completed."""

    def __init__(self, chunks):
        self._chunks = chunks

    def test(self):
        return True

    def wait(self):
        return self._chunks


def start_move(local, held, pieces, wanted, comm, blocking=False, donate=False):
    """The exchange behind redistribute and the halo, started (a Moving; blocking=True: done
    before it returns): rank s sends, for each piece (s, d, index
    sets), that part of its `local` array (which holds the global indices `held`) to rank d;
    every rank returns an array over the indices `wanted`, zero where nothing arrived, the sum
    where several pieces arrive at one place. One all-to-all over `comm`, in the ledger. The
    pieces a rank keeps (s = d: the interior of a halo exchange, what a redistribution leaves
    in place) go into the result straight from `local`, never packed or sent; where the pieces
    arriving at a rank cover its `wanted` exactly once (layout.tiles: a halo exchange, a
    redistribution from a layout without summands) each is put in place, with no zeros to add
    onto, and where a kept piece is all of `wanted` the others are added onto its copy, or,
    with donate=True (`local` is the caller's to give up: the adjoint of a halo exchange), onto
    that piece of `local` itself, which the result then is (a view, strided where the piece is
    a slab of the block: no copy of the rank's own rows)."""
    p, me = comm.Get_size(), comm.Get_rank()
    xp = backend.get_array_module(local)
    send = [[] for _ in range(p)]
    arriving = [[] for _ in range(p)]
    kept = []

    def mine(piece):
        return local[backend.index_array(selector([positions(ix, m) for ix, m in zip(piece, held)]), xp)]
    for s, d, piece in pieces:
        if s == d == me:
            kept.append(piece)
            continue
        if s == me:
            send[d].append(xp.ascontiguousarray(mine(piece)).reshape(-1))
        if d == me:
            arriving[s].append(piece)
    # packed where the block lives (on a device: only the pieces sent are staged, comm.alltoallv)
    send = [xp.concatenate(chunks) if chunks else xp.empty(0, dtype=local.dtype) for chunks in send]
    counts = [sum(piece_size(piece) for piece in arriving[s]) for s in range(p)]
    if blocking:
        pending = _Done(collectives.alltoallv(comm, send, counts, local.dtype))
    else:
        pending = collectives.ialltoallv(comm, send, counts, local.dtype)
    exact = tiles(kept + [piece for s in range(p) for piece in arriving[s]], wanted)
    shape = tuple(len(ix) for ix in wanted)

    def place(chunks):
        # A kept piece that is all of `wanted` (the adjoint of a halo exchange: the rank's own
        # rows, onto which the neighbours' halo rows are added) starts the result as its copy,
        # or is the result itself where `local` is donated and the piece a view of it.
        mine_kept = list(kept)
        whole = next((k for k, piece in enumerate(mine_kept) if piece_size(piece) == piece_size(wanted)), None)
        if whole is not None and not exact:
            piece = mine_kept.pop(whole)
            out = mine(piece)
            if not (donate and all(isinstance(positions(ix, m), slice) for ix, m in zip(piece, held))):
                out = xp.array(out, order="C")
        else:
            out = (xp.empty if exact else xp.zeros)(shape, dtype=local.dtype)

        def land(piece, values):
            where = backend.index_array(selector([positions(ix, w) for ix, w in zip(piece, wanted)]), xp)
            if exact:
                out[where] = values
            else:
                out[where] += values
        for piece in mine_kept:
            land(piece, mine(piece))
        for s, chunk in enumerate(chunks):
            offset = 0
            for piece in arriving[s]:
                size = piece_size(piece)
                land(piece, chunk[offset:offset + size].reshape(tuple(len(ix) for ix in piece)))
                offset += size
        collectives.get_ledger().keep_result(out)
        return out
    return Moving(pending, place)


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
    base = grid.coords_of(0)
    return tuple(global_extent(layout, d, grid, lambda c: int(every[grid.rank_of({**base, **c}), 2 + d]))
                 for d in range(int(every[0, 0])))


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
        expected = layout.local_shape(global_shape, grid, grid.coords_of(r))
        if tuple(int(n) for n in row[2:2 + ndim]) != expected:
            return (f"rank {r} holds {tuple(int(n) for n in row[2:2 + ndim])} where a tensor of global "
                    f"shape {global_shape} has a block of {expected}")
    return None
