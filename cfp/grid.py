"""ProcessGrid: the ranks of a communicator factored into named axes.

`ProcessGrid("sample=2,channel=2")` arranges 4 ranks as a 2 x 2 grid and builds, by explicit
`Comm.Split` calls, one communicator per axis (the ranks that differ only in that axis: the group
of a collective along it) and its complement (the ranks that share that axis' coordinate: for
example the ranks holding the same channel shard, who allreduce its weight gradient).

A grid's own ranks (`grid.comm`, `grid.rank`) are always ordered sample, depth, height, width,
channel, channel varying fastest (depth splits volumes, N x C x D x H x W): every layout, plan
and message of cfp speaks of grid ranks and coordinates in that order. Which process of `comm` takes which grid rank is the grid's
*placement*: by default the same order (the process of rank r in `comm` is grid rank r), so
the ranks of a channel group are neighbours in `comm` and share a node when the launcher packs
ranks by node. `node_axes` chooses other axes to vary fastest in `comm`'s order, and so to
stay inside a node: `ProcessGrid("sample=2,channel=2", node_axes=("sample",))` on 2 nodes of 2
ranks puts each sample pair on one node and each channel pair across the two (docs/design.md,
"Rank placement"). Axes not named in the spec have size 1.
"""
import functools
import itertools
import math

from mpi4py import MPI

from .checks import positive_int
from .partition import check_filter_groups, row_and_column

AXES = ("sample", "depth", "height", "width", "channel")


def parse_grid_spec(spec):
    """{'sample': 2, 'channel': 2} from 'sample=2,channel=2' (or from a dict of the same).

    Raises ValueError naming the bad entry: an unknown axis, a repeated one, or a size that is
    not a positive integer.
    """
    if isinstance(spec, ProcessGrid):
        return dict(spec.shape)
    if isinstance(spec, dict):
        items = list(spec.items())
    elif isinstance(spec, str):
        items = []
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise ValueError(
                    f"grid entry {part!r} in {spec!r} is not of the form axis=size "
                    f"(for example 'sample=2,channel=2')"
                )
            name, size = (s.strip() for s in part.split("=", 1))
            items.append((name, size))
    else:
        raise ValueError(f"grid spec must be a string like 'sample=2,channel=2' or a dict, got {spec!r}")
    sizes = {}
    for name, size in items:
        if name not in AXES:
            raise ValueError(f"unknown grid axis {name!r}; expected one of {', '.join(AXES)}")
        if name in sizes:
            raise ValueError(f"grid axis {name!r} is given twice in {spec!r}")
        sizes[name] = _positive_int(size, f"size of grid axis {name!r}")
    return sizes


def _positive_int(value, what):
    """A size from the spec: an integer, or a string of digits."""
    if isinstance(value, str) and value.strip().isdigit() and int(value) >= 1:
        return int(value)
    if isinstance(value, str):
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return positive_int(value, what)


@functools.lru_cache(maxsize=None)
def _factorizations(size, naxes):
    divisors = [d for d in range(1, size + 1) if size % d == 0]
    return tuple(f for f in itertools.product(divisors, repeat=naxes) if math.prod(f) == size)


def coords_of(rank, shape, order=AXES):
    """{axis: coordinate} of `rank` on a grid of {axis: size} `shape`, row-major over `order`
    (default AXES: channel fastest, a grid's own rank order): the arithmetic behind
    ProcessGrid.coords_of, usable without MPI."""
    coords = {}
    for axis in reversed(order):
        rank, coords[axis] = divmod(rank, int(shape.get(axis, 1)))
    return {axis: coords.get(axis, 0) for axis in AXES}


def rank_of(coords, shape, order=AXES):
    """The rank at {axis: coordinate} on a grid of {axis: size} `shape` (axes left out: 0 and
    1), row-major over `order`: the inverse of coords_of, usable without MPI."""
    rank = 0
    for axis in order:
        rank = rank * int(shape.get(axis, 1)) + int(coords.get(axis, 0))
    return rank


def placement_order(shape, node_axes=None):
    """The split axes of a grid of {axis: size} `shape` from slowest to fastest in the order
    of the processes of its communicator: `node_axes` fastest (each in AXES order), the others
    before them; None: AXES order (channel fastest). ValueError when `node_axes` names an axis
    that is not one or that the grid does not split."""
    split = tuple(a for a in AXES if int(shape.get(a, 1)) > 1)
    if node_axes is None:
        return split
    node_axes = _named(node_axes)
    if not isinstance(node_axes, (tuple, list)) or not node_axes or not all(isinstance(a, str) for a in node_axes):
        raise ValueError(f"node axes {node_axes!r}: expected axis names, e.g. 'channel' or 'sample,height'")
    for a in node_axes:
        if a not in AXES:
            raise ValueError(f"node axis {a!r}: expected one of {', '.join(AXES)}")
        if a not in split:
            raise ValueError(f"node axis {a!r}: grid {ProcessGrid.describe_shape(shape)} does not split it "
                             f"(it splits {', '.join(split) or 'nothing'})")
    if len(set(node_axes)) != len(node_axes):
        raise ValueError(f"node axes {','.join(node_axes)}: an axis is named twice")
    return tuple(a for a in split if a not in node_axes) + tuple(a for a in split if a in node_axes)


def _named(node_axes):
    """('sample', 'height') from 'sample,height' (other values as given)."""
    if isinstance(node_axes, str):
        return tuple(a.strip() for a in node_axes.split(",") if a.strip())
    return node_axes


def placed_axes(shape, node_axes):
    """The node axes of a grid of {axis: size} `shape` in the order they vary (placement_order),
    or None where they place it as the default does (channel fastest): how a placement is
    recorded (plans, the planner's choices)."""
    order = placement_order(shape, node_axes)
    if node_axes is None or order == placement_order(shape):
        return None
    return tuple(a for a in order if a in _named(node_axes))


def process_ranks(shape, node_axes=None):
    """The rank in the communicator of the process holding each grid rank (index) of a grid of
    {axis: size} `shape` placed by `node_axes` (placement_order): the identity by default."""
    order = placement_order(shape, node_axes)
    return tuple(rank_of(coords_of(g, shape), shape, order) for g in range(math.prod(
        int(shape.get(a, 1)) for a in AXES)))


def factorizations(size, naxes=2):
    """Every ordered tuple of `naxes` positive integers whose product is `size`."""
    return list(_factorizations(size, naxes))


def node_layout(comm, strict=True):
    """(ranks per node, nodes) of `comm`: the ranks that share a node's memory (MPI's
    COMM_TYPE_SHARED split: hostnames, for the MPIs cfp runs with), which rank placement and
    the cost model take to be neighbours, as many on every node (the launchers' block
    placement). ValueError, the same on every rank, where nodes hold different numbers of ranks
    or a node's are not neighbours. strict=False: the ranks a node, wherever they are (a run
    with a profile measured elsewhere compares only that)."""
    rank = comm.Get_rank()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, rank)
    first, size = local.allreduce(rank, op=MPI.MIN), local.Get_size()
    local.Free()
    every = comm.allgather((first, size))
    per_node = every[0][1]
    if not strict:  # what a record compares (warn_if_foreign): the ranks a node, however placed
        return per_node, comm.Get_size() // per_node
    if any(s != per_node or f != r // per_node * per_node for r, (f, s) in enumerate(every)):
        raise ValueError(f"the nodes' ranks are not {per_node} neighbours each (ranks by node: "
                         f"{sorted({f: [r for r, (g, _) in enumerate(every) if g == f] for f, _ in every}.values())}); "
                         f"start the ranks in blocks, as many a node (mpiexec's default placement)")
    return per_node, comm.Get_size() // per_node


def check_node_fit(shape, node_axes, per_node, nodes):
    """ValueError unless the groups of ranks that differ only along `node_axes` (they vary
    fastest: neighbours) fit inside nodes of `per_node` ranks: their sizes multiply to a
    divisor of it."""
    named = [a for a in placement_order(shape, node_axes) if node_axes and a in _named(node_axes)]
    group = math.prod(int(shape[a]) for a in named)
    if per_node % group:
        kept = ",".join(f"{a}={shape[a]}" for a in named)
        raise ValueError(f"node axes {kept}: a group of {group} ranks does not fit inside the nodes of this job "
                         f"({nodes} node(s) of {per_node} rank(s)); expected node axes whose sizes multiply to a "
                         f"divisor of {per_node}")


class GridSizeError(ValueError):
    """A grid whose axes multiply to another number of ranks than the communicator has;
    `ranks_needed` is theirs (what a script run on one rank is told to start)."""

    def __init__(self, message, ranks_needed):
        super().__init__(message)
        self.ranks_needed = ranks_needed


class ProcessGrid:
    """Named axes over the ranks of `comm` (default COMM_WORLD).

    Attributes: `comm` (the grid's own duplicate of the communicator), `shape` ({axis: size}
    for all of AXES), `coords` ({axis: this rank's coordinate}). Methods: `axis_comm(axis)`,
    `complement_comm(axis)`, `coords_of(rank)`, `rank_of(coords)`.
    """

    def __init__(self, spec="", comm=None, node_axes=None):
        comm = MPI.COMM_WORLD if comm is None else comm
        sizes = parse_grid_spec(spec)
        self.shape = {axis: sizes.get(axis, 1) for axis in AXES}
        needed = math.prod(self.shape.values())
        if needed != comm.Get_size():
            raise GridSizeError(f"grid {self.describe()} needs {needed} ranks, the communicator has "
                                f"{comm.Get_size()}", needed)
        # the split axes in the order of comm's processes, slowest first (default: AXES order)
        self.placement = placement_order(self.shape, node_axes)
        self.node_axes = None if node_axes is None else tuple(a for a in self.placement if a in _named(node_axes))
        # Every rank has checked the same things above, so all ranks get here or none does.
        self.over = comm  # what the grid was made over: its placement speaks of comm's ranks
        if self.placement == placement_order(self.shape):
            self.comm = comm.Dup()
        else:
            self.comm = comm.Split(0, rank_of(coords_of(comm.Get_rank(), self.shape, self.placement), self.shape))
        if self.node_axes:
            self._check_nodes(comm)
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.coords = self.coords_of(self.rank)
        self._axis_comms = {}
        self._complement_comms = {}
        self._row_and_column_comms = {}  # p_f -> stationary-w's (row, column), made on first use
        for axis in AXES:  # same order on every rank: the splits are collective
            others = tuple(self.coords[a] for a in AXES if a != axis)
            color = self._index(others, [self.shape[a] for a in AXES if a != axis])
            self._axis_comms[axis] = self.comm.Split(color, self.coords[axis])
            self._complement_comms[axis] = self.comm.Split(self.coords[axis], self.rank)

    def _check_nodes(self, comm):
        """ValueError (on every rank alike) unless each group of ranks that differ only along
        the node axes (neighbours in comm's order: those axes vary fastest) lies inside one node."""
        try:
            check_node_fit(self.shape, self.node_axes, *node_layout(comm))
        except ValueError:
            self.comm.Free()
            raise

    @functools.cached_property
    def processes(self):
        """The rank, in the communicator the grid was made over, of the process at each grid
        rank (process_ranks: the identity for the default placement)."""
        return process_ranks(self.shape, self.node_axes)

    def describe_placement(self):
        """'' for the default placement, else ' (node axes: sample)'."""
        return f" (node axes: {','.join(self.node_axes)})" if self.node_axes and \
            self.placement != placement_order(self.shape) else ""

    @staticmethod
    def describe_shape(shape):
        """'sample=2,channel=2' for {axis: size}: the axes of size > 1 (or 'sample=1')."""
        named = [f"{a}={shape.get(a, 1)}" for a in AXES if shape.get(a, 1) > 1]
        return ",".join(named) if named else "sample=1"

    @staticmethod
    def shape_of(spec):
        """{axis: size} for all of AXES from a spec: 'channel=2' and 'sample=1,channel=2' alike."""
        sizes = parse_grid_spec(spec)
        return {axis: sizes.get(axis, 1) for axis in AXES}

    @staticmethod
    def _index(coords, shape):
        index = 0
        for c, n in zip(coords, shape):
            index = index * n + c
        return index

    def coords_of(self, rank):
        """{axis: coordinate} of `rank` (row-major over AXES, channel fastest)."""
        return coords_of(rank, self.shape)

    def rank_of(self, coords):
        """The rank at {axis: coordinate}; axes left out are at coordinate 0."""
        return rank_of(coords, self.shape)

    def axis_size(self, axis):
        return self.shape[self._check_axis(axis)]

    def coord(self, axis):
        return self.coords[self._check_axis(axis)]

    def axis_comm(self, axis):
        """Ranks that differ only in `axis`, ranked by their coordinate along it."""
        return self._axis_comms[self._check_axis(axis)]

    def complement_comm(self, axis):
        """Ranks with the same coordinate along `axis` as this one."""
        return self._complement_comms[self._check_axis(axis)]

    def row_and_column_comms(self, filter_groups):
        """Stationary-w's groups inside this rank's channel group for p_f = `filter_groups`:
        the row (the p_f channel ranks whose x blocks it gathers, ranked by column) and the
        column (the q = P_c / p_f ranks it reduce-scatters y with, ranked by row), channel rank
        c sitting at (row, column) = divmod(c, p_f) (partition.row_and_column). Made on the
        first request for this p_f (collective over the grid: every rank builds its layers in
        the same order), then cached, and freed with the grid."""
        check_filter_groups(self.shape["channel"], filter_groups)
        p_f = int(filter_groups)
        if p_f not in self._row_and_column_comms:
            row, column = row_and_column(self.coords["channel"], p_f)
            channel = self.axis_comm("channel")
            self._row_and_column_comms[p_f] = (channel.Split(row, column), channel.Split(column, row))
        return self._row_and_column_comms[p_f]

    def _check_axis(self, axis):
        if axis not in AXES:
            raise ValueError(f"unknown grid axis {axis!r}; expected one of {', '.join(AXES)}")
        return axis

    def describe(self):
        """'sample=2,channel=2': the axes of size > 1 (or 'sample=1' for one rank)."""
        return ProcessGrid.describe_shape(self.shape)

    def __repr__(self):
        coords = ", ".join(f"{a}={self.coords[a]}" for a in AXES if self.shape[a] > 1)
        where = f" rank {self.rank} at ({coords})" if hasattr(self, "coords") else ""
        return f"ProcessGrid({self.describe()}){where}"

    def free(self):
        """Release the communicators this grid made (collective over the grid)."""
        pairs = [c for pair in self._row_and_column_comms.values() for c in pair]
        for c in pairs + list(self._axis_comms.values()) + list(self._complement_comms.values()):
            c.Free()
        self._row_and_column_comms.clear()
        self._axis_comms.clear()
        self._complement_comms.clear()
        self.comm.Free()


class Grids:
    """The process grids of one model: one ProcessGrid per factorization of the same ranks,
    made on the first request for it (collective: every rank asks in the same order, as it
    builds the same layers) and freed together. `base`, a grid the caller made, is handed out
    for its own shape, and freed with the others when owns_base."""

    def __init__(self, base, owns_base=False):
        self.base, self.owns_base, self._made = base, owns_base, {}

    def get(self, spec, node_axes=None):
        """The grid of `spec` placed by `node_axes` (ProcessGrid), over the base grid's ranks
        in the base grid's order."""
        shape = ProcessGrid.shape_of(spec)
        placement = placement_order(shape, node_axes)
        if shape == self.base.shape and placement == self.base.placement:
            return self.base
        key = (tuple(shape.values()), placement)
        if key not in self._made:
            self._made[key] = ProcessGrid(shape, comm=self.base.over, node_axes=node_axes)
        return self._made[key]

    def __iter__(self):
        yield self.base
        yield from self._made.values()

    def free(self):
        """Release the grids made here, and `base` when owned (collective)."""
        for g in self._made.values():
            g.free()
        self._made.clear()
        if self.owns_base:
            self.base.free()
            self.owns_base = False
