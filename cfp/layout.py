"""Layout: how a global tensor is laid out over the axes of a process grid, and the exchange
that moves it from one layout (and grid) to another over the same ranks.

A layout says, for each tensor dimension, whether it is whole or split over a grid axis, and
which of the axis' blocks a coordinate holds (`Shard`); a grid axis that splits no dimension
holds replicas, unless the layout names it `partial`, in which case the ranks along it hold
summands of the tensor (a pending sum). The blocks are partition.py's balanced blocks, so this
module and partition.py are the one place where cfp computes index sets: an activation's block,
a weight shard (also stationary-w's strided ones), a batch-norm channel range, the logits'
slice and the loader's sample block all come from `Layout.indices`.

Nothing here communicates: `exchange_plan` lists the pieces an exchange moves, which
`tensor.DistTensor.redistribute` sends and `perfmodel.redistribute_bytes` counts, so the
prediction and the run cannot disagree (docs/design.md, section 3).
"""
import dataclasses
import functools
import math

import numpy as np

from .grid import AXES, coords_of
from .partition import block_range, check_filter_groups, gather_group, scatter_group, union_of_blocks

PARTS = ("block", "row", "column", "groups")


@dataclasses.dataclass(frozen=True)
class Shard:
    """A tensor dimension cut into the balanced blocks of one grid axis of size P.

    part 'block': coordinate c holds block c. With `groups` = p_f (stationary-w's P = q x p_f
    arrangement, coordinate c at (row, column) = divmod(c, p_f)), part 'row' holds the p_f
    blocks of c's row and part 'column' the q blocks of c's column: a union of blocks, strided
    for a column (partition.gather_group, scatter_group). Part 'groups' (a grouped
    convolution's channels or filters, `groups` = G equal groups of the dimension) holds whole
    groups: coordinate c the groups of block c of G over P.
    """
    axis: str
    part: str = "block"
    groups: int = 1

    def __post_init__(self):
        if self.axis not in AXES:
            raise ValueError(f"unknown grid axis {self.axis!r}; expected one of {', '.join(AXES)}")
        if self.part not in PARTS:
            raise ValueError(f"unknown shard part {self.part!r}; expected one of {', '.join(PARTS)}")
        if self.part == "block" and self.groups != 1:
            raise ValueError("a 'block' shard has no filter groups")
        if self.part == "groups" and self.groups < 1:
            raise ValueError(f"a 'groups' shard needs a positive number of groups, got {self.groups}")

    def blocks(self, parts, coord):
        """The block numbers (of `parts` blocks) coordinate `coord` holds, in increasing order;
        for part 'groups', the groups (of `groups`)."""
        if self.part == "groups":
            return list(range(*block_range(self.groups, parts, coord)))
        if self.part == "block":
            return [coord]
        check_filter_groups(parts, self.groups)
        group = gather_group if self.part == "row" else scatter_group
        return group(coord, parts, self.groups)

    def holders(self, parts):
        """Coordinates whose blocks are disjoint and cover the dimension (one per shard)."""
        if self.part in ("block", "groups"):
            return range(parts)
        if self.part == "row":
            return range(0, parts, self.groups)
        return range(self.groups)

    def __str__(self):
        if self.part == "block":
            return self.axis
        if self.part == "groups":
            return f"{self.axis}/groups({self.groups})"
        return f"{self.axis}/{self.part}(p_f={self.groups})"


def _as_dim(d):
    if d is None or d == "-":
        return None
    if isinstance(d, Shard):
        return d
    return Shard(d)


class Layout:
    """Per tensor dimension a Shard or None (whole); `partial`: the grid axes along which the
    ranks hold summands. `Layout(("sample", "channel", None, None))` is an NCHW activation split
    by sample and channel; grid axes no dimension uses hold replicas."""

    def __init__(self, dims, partial=()):
        self.dims = tuple(_as_dim(d) for d in dims)
        self.partial = tuple(sorted(set(partial), key=AXES.index))
        for a in self.partial:
            if a not in AXES:
                raise ValueError(f"unknown grid axis {a!r} in partial; expected one of {', '.join(AXES)}")
        by_axis = {}
        for d in self.dims:
            if d is not None:
                by_axis.setdefault(d.axis, []).append(d)
        for axis, shards in by_axis.items():
            pair = sorted(s.part for s in shards) == ["column", "row"] and len({s.groups for s in shards}) == 1
            if len(shards) > 1 and not pair:
                raise ValueError(f"layout {self._text()} splits {len(shards)} dimensions over grid axis "
                                 f"{axis!r}; only a row and a column of one p_f may share an axis")
            if axis in self.partial and (len(shards) > 1 or shards[0].part in ("block", "groups")):
                raise ValueError(f"layout {self._text()} both splits and sums over grid axis {axis!r} "
                                 f"(only the copies of a row or a column shard can be summands)")

    @classmethod
    def replicated(cls, ndim):
        return cls((None,) * ndim)

    @property
    def ndim(self):
        return len(self.dims)

    @property
    def axes(self):
        """The grid axis of each dimension (None where whole)."""
        return tuple(None if d is None else d.axis for d in self.dims)

    def used_axes(self):
        return {d.axis for d in self.dims if d is not None}

    def copy_axes(self, grid):
        """Grid axes along which some ranks hold the same indices: the replica axes, and an axis
        that only a row or only a column shard uses (the ranks of a column hold one set)."""
        normal = self.on(grid)
        alone = [d.axis for d in normal.dims if d is not None and d.part in ("row", "column")
                 and sum(e is not None and e.axis == d.axis for e in normal.dims) == 1]
        return [a for a in AXES if a in alone or a in self.replica_axes(grid)]

    def first_summand(self, grid, coords):
        """Whether the rank at `coords` holds the first summand of its copy (along a partial
        axis: coordinate 0, or, in a column shard's axis, row 0, in a row shard's, column 0):
        where a tensor put into a partial layout lands, the other summands being zeros."""
        for a in self.partial:
            d = next((d for d in self.dims if d is not None and d.axis == a), None)
            c = coords.get(a, 0)
            position = c if d is None else c // d.groups if d.part == "column" else c % d.groups  # row
            if position:
                return False
        return True

    def replica_axes(self, grid):
        """Grid axes of size > 1 along which ranks hold equal copies."""
        shape, used = _shape(grid), self.on(grid).used_axes()
        return [a for a in AXES if shape[a] > 1 and a not in used and a not in self.partial]

    def without_partial(self):
        return Layout(self.dims)

    def with_partial(self, axes):
        return Layout(self.dims, tuple(self.partial) + tuple(axes))

    def on(self, grid):
        """This layout with what axes of size 1 do dropped: a shard over one rank is whole, a
        sum over one rank is no sum. Two layouts equal after `on(grid)` place every element
        alike on that grid."""
        shape = _shape(grid)

        def kept(d):  # a column of p_f = 1 and a row of p_f = P hold every block: whole
            return d is not None and shape[d.axis] > 1 and not (
                d.part == "column" and d.groups == 1 or d.part == "row" and d.groups == shape[d.axis])

        def plain(d):  # whole groups, P dividing G: the balanced blocks themselves
            return Shard(d.axis) if d.part == "groups" and d.groups % shape[d.axis] == 0 else d
        return Layout([plain(d) if kept(d) else None for d in self.dims],
                      [a for a in self.partial if shape[a] > 1])

    def head(self, ndim):
        """The layout of the first `ndim` dimensions (GlobalAvgPool2d's (n, C) from NCHW)."""
        return Layout(self.dims[:ndim], self.partial)

    def indices(self, global_shape, grid, coords):
        """Per dimension, the global indices held at grid coordinates `coords` (a dict), sorted:
        a `range` where they are contiguous, else a tuple."""
        return _indices(self, tuple(int(n) for n in global_shape), _shape_key(grid), _coords_key(coords))

    def local_shape(self, global_shape, grid, coords):
        return tuple(len(ix) for ix in self.indices(global_shape, grid, coords))

    def check_fits(self, global_shape, grid, what="tensor"):
        """ValueError unless this layout can lay out a tensor of `global_shape` on `grid`."""
        if len(global_shape) != self.ndim:
            raise ValueError(f"{what}: layout {self} has {self.ndim} dimensions, the tensor has shape "
                             f"{tuple(global_shape)}")
        shape = _shape(grid)
        for extent, d in zip(global_shape, self.dims):
            if d is not None and d.part in ("row", "column"):
                check_filter_groups(shape[d.axis], d.groups)
            if d is not None and d.part == "groups" and extent % d.groups:
                raise ValueError(f"{what}: layout {self} cuts dimension of {extent} into {d.groups} equal groups")

    def is_primary(self, grid, coords):
        """True for one rank of every set of replicas (coordinate 0 along the replica axes):
        the copy a checkpoint writes."""
        return all(coords[a] == 0 for a in self.replica_axes(grid))

    def _text(self):
        text = ", ".join("-" if d is None else str(d) for d in self.dims)
        return text + (f"; partial over {', '.join(self.partial)}" if self.partial else "")

    def __eq__(self, other):
        return isinstance(other, Layout) and (self.dims, self.partial) == (other.dims, other.partial)

    def __hash__(self):
        return hash((self.dims, self.partial))

    def __repr__(self):
        return f"Layout({self._text()})"


def activation_layout(grid_shape, channel, axes=2):
    """The layout of an NCHW activation (NCDHW with axes=3): split by sample, by `channel` over
    the channel axis (a Shard, 'channel' or None), and by depth (a volume's), height and width
    where `grid_shape` ({axis: size} or (axis, size) pairs) has those axes larger than 1."""
    shape = dict(grid_shape)
    spatial = ("depth", "height", "width")[3 - axes:]
    return Layout(("sample", channel) + tuple(a if shape.get(a, 1) > 1 else None for a in spatial))


def _shape(grid):
    """{axis: size} of a ProcessGrid, a dict of sizes or a sorted tuple key."""
    shape = getattr(grid, "shape", grid)
    if isinstance(shape, tuple):
        shape = dict(shape)
    return {a: int(shape.get(a, 1)) for a in AXES}


def _shape_key(grid):
    return tuple(_shape(grid).items())


def _coords_key(coords):
    return tuple((a, int(coords.get(a, 0))) for a in AXES)


@functools.lru_cache(maxsize=4096)
def _indices(layout, global_shape, shape_key, coords_key):
    shape, coords = dict(shape_key), dict(coords_key)
    if len(global_shape) != layout.ndim:
        raise ValueError(f"layout {layout} has {layout.ndim} dimensions, the tensor has shape {global_shape}")
    out = []
    for extent, d in zip(global_shape, layout.dims):
        if d is None:
            out.append(range(extent))
            continue
        parts = shape[d.axis]
        if d.part == "groups":
            if extent % d.groups:
                raise ValueError(f"layout {layout}: {extent} is not {d.groups} equal groups")
            size = extent // d.groups
            held = d.blocks(parts, coords[d.axis])
            out.append(range(held[0] * size, (held[-1] + 1) * size) if held else range(0))
            continue
        out.append(index_set(union_of_blocks(extent, parts, d.blocks(parts, coords[d.axis]))))
    return tuple(out)


def index_set(indices):
    """Sorted distinct global indices as layouts and plans hold them: a range where they are
    contiguous (range(0) for none), otherwise a tuple."""
    ix = np.asarray(indices, dtype=np.int64)
    if not ix.size:
        return range(0)
    if ix[-1] - ix[0] + 1 == ix.size:
        return range(int(ix[0]), int(ix[-1]) + 1)
    return tuple(int(i) for i in ix)


def global_extent(layout, dim, grid, local_extent_at):
    """The extent of dimension `dim` from the local extents `local_extent_at(coords)` of the
    ranks: the sum over a set of coordinates whose blocks are disjoint and cover it."""
    d = layout.dims[dim]
    if d is None:
        return local_extent_at({})
    shape = _shape(grid)
    return sum(local_extent_at({d.axis: c}) for c in d.holders(shape[d.axis]))


# ---------------------------------------------------------------------------------------------
# The exchange between two layouts over the same ranks.

def _intersect(a, b):
    """The sorted indices in both a and b (each a range or a sorted tuple), or None if empty."""
    if isinstance(a, range) and isinstance(b, range):
        r = range(max(a.start, b.start), min(a.stop, b.stop))
        return r if len(r) else None
    common = np.intersect1d(np.asarray(a), np.asarray(b), assume_unique=True)
    return index_set(common) if common.size else None


def exchange_plan(global_shape, source, source_grid, target, target_grid, ranks):
    """The pieces an exchange from `source` on `source_grid` to `target` on `target_grid`
    moves: [(s, d, index sets)], rank s sending the part of the tensor at those global indices
    to rank d. Each destination takes each piece from one set of holders: itself when it holds
    one, otherwise the copy at `d` modulo the number of copies (spreading the load); from a
    partial source it takes the piece from every summand of that copy and adds them. A target
    that is itself partial gets the tensor on its coordinate 0 along those axes and zeros on
    the others. Ranks s and d are the source grid's: where the two grids place their ranks on
    the processes differently (ProcessGrid's node_axes), each destination's target
    coordinates are those of the same process in the target grid. Pure arithmetic:
    DistTensor.redistribute runs it, perfmodel counts it."""
    global_shape = tuple(int(n) for n in global_shape)
    source.check_fits(global_shape, source_grid, "redistribute source")
    target.check_fits(global_shape, target_grid, "redistribute target")
    s_shape, t_shape = _shape(source_grid), _shape(target_grid)
    for what, shape in (("source", s_shape), ("target", t_shape)):
        if math.prod(shape.values()) != ranks:
            raise ValueError(f"redistribute: the {what} grid has {math.prod(shape.values())} ranks, "
                             f"the exchange {ranks}")
    return _plan(global_shape, source, _shape_key(s_shape), target, _shape_key(t_shape), ranks,
                 _target_ranks(source_grid, target_grid, ranks))


def _target_ranks(source_grid, target_grid, ranks):
    """For each rank of the source grid, the same process's rank in the target grid; None where
    both number the processes alike (grids of one placement, or shapes: no processes)."""
    s, t = (getattr(g, "processes", None) for g in (source_grid, target_grid))
    if s is None or t is None or s == t:
        return None
    target_of = {p: r for r, p in enumerate(t)}
    return tuple(target_of[p] for p in s)


@functools.lru_cache(maxsize=512)
def _plan(global_shape, source, s_key, target, t_key, ranks, target_ranks=None):
    t_shape = dict(t_key)
    wanted = []
    for d in range(ranks):
        tc = coords_of(d if target_ranks is None else target_ranks[d], t_shape)
        # the other summands of a partial target are zeros: they want nothing
        wanted.append(target.indices(global_shape, t_shape, tc) if target.first_summand(t_shape, tc) else None)
    return gather_plan(global_shape, source, s_key, tuple(wanted))


@functools.lru_cache(maxsize=512)
def gather_plan(global_shape, source, source_grid, wanted):
    """The pieces [(s, d, index sets)] that give each rank d the global indices wanted[d] (per
    dimension a range or sorted tuple; None: nothing) of a tensor laid out by `source` on
    `source_grid`: the exchange of exchange_plan, for any wanted sets, overlapping ones
    included (a halo: the rows a convolution needs beyond its own block)."""
    s_shape = _shape(source_grid)
    ranks = len(wanted)
    # Ranks holding the same indices hold copies, unless they differ only along the partial
    # axes: then they hold summands of one copy.
    copies = {}  # held index sets -> {coordinates off the partial axes: [the summands' ranks]}
    for r in range(ranks):
        c = coords_of(r, s_shape)
        held = source.indices(global_shape, s_shape, c)
        copy = tuple(c[a] for a in AXES if a not in source.partial)
        copies.setdefault(held, {}).setdefault(copy, []).append(r)
    pieces = []
    for d in range(ranks):
        if wanted[d] is None:
            continue
        for held, by_copy in copies.items():
            piece = tuple(_intersect(h, w) for h, w in zip(held, wanted[d]))
            if any(p is None for p in piece):
                continue
            keys = list(by_copy)
            senders = next((by_copy[k] for k in keys if d in by_copy[k]), None)
            if senders is None:
                senders = by_copy[keys[d % len(keys)]]
            pieces.extend((s, d, piece) for s in senders)
    return tuple(pieces)


def tiles(pieces, wanted):
    """Whether `pieces` (index sets per dimension, each inside `wanted`) cover the indices
    `wanted` exactly once: no two share an index and their sizes add up to wanted's. Then an
    exchange can put each piece in place instead of adding it onto zeros (tensor.move)."""
    if sum(piece_size(piece) for piece in pieces) != piece_size(wanted):
        return False
    return all(any(_intersect(a, b) is None for a, b in zip(first, second))
               for k, first in enumerate(pieces) for second in pieces[k + 1:])


def positions(indices, within):
    """Where the global `indices` sit inside a block holding `within` (both sorted): a slice
    when they are contiguous there, else an index array."""
    if isinstance(within, range) and isinstance(indices, range):
        start = indices.start - within.start
        return slice(start, start + len(indices))
    at = np.searchsorted(np.asarray(within), np.asarray(indices))
    if at.size and at[-1] - at[0] + 1 == at.size:
        return slice(int(at[0]), int(at[-1]) + 1)
    return at


def selector(pos):
    """An indexing tuple from per-dimension slices or index arrays (np.ix_ where needed)."""
    if sum(not isinstance(p, slice) for p in pos) <= 1:
        return tuple(pos)
    arrays = [np.arange(p.start, p.stop) if isinstance(p, slice) else p for p in pos]
    return np.ix_(*arrays)


def piece_size(piece):
    return math.prod(len(ix) for ix in piece)
