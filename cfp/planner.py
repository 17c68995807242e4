"""The per-layer planner: for each convolution, the grid factorization, algorithm and p_f that
minimise the predicted iteration time, counting redistribution between layers of different
layouts, under a per-rank memory limit.

A plan is a shortest path through the layers (dynamic programming over each layer's options,
with a redistribution cost between consecutive choices). A layer fed by another than the one
before it, or whose output is added to another branch's (a residual block's projection and
sum: LayerShape.reads, merges), is priced against that layer's choice: the program's state
holds the grid of every layer a later one still refers to, so the plan is the best of all.
The memory limit is met by pricing memory: the plans minimising time + lambda * memory, with
lambda bisected towards the smallest whose plan fits, the fastest fitting one kept.
"""
import dataclasses
import functools
import itertools
import math

from .grid import AXES, ProcessGrid, factorizations, placed_axes, placement_order
from .perfmodel import chunk_counts, layer_cost, overlapped_step, pipelines
from .algorithms import algorithm_class
from .report import format_table

CHANNEL_ALGORITHMS = ("x", "y", "w")
CHUNKS = (1, 2, 4)  # the chunks (of samples, or features) a pipelined layer may run in (plan(..., chunks=True))
BUCKETS_MB = (1, 4, 25)  # the gradient buckets a plan may sum in during backward (plan(..., buckets=True))


@dataclasses.dataclass
class Choice:
    layer: object  # perfmodel.LayerShape
    P_n: int
    P_c: int
    algorithm: str
    p_f: int
    cost: dict  # perfmodel.layer_cost's result
    redistribution: float = 0.0  # seconds to bring this layer its input and its residual sum's other branch
    P_h: int = 1
    P_w: int = 1
    node_axes: tuple = None  # the grid's placement (grid.ProcessGrid); None: channel fastest
    P_d: int = 1  # a volume's depth axis
    chunks: int = 1  # > 1: its passes pipelined over that many chunks (of samples or features; perfmodel's)

    @property
    def grid(self):
        if self.P_d > 1:
            return f"sample={self.P_n},depth={self.P_d},height={self.P_h},width={self.P_w},channel={self.P_c}"
        if self.P_h * self.P_w > 1:
            return f"sample={self.P_n},height={self.P_h},width={self.P_w},channel={self.P_c}"
        return f"sample={self.P_n},channel={self.P_c}"

    @property
    def shape(self):
        return {"sample": self.P_n, "depth": self.P_d, "height": self.P_h, "width": self.P_w, "channel": self.P_c}

    @functools.cached_property
    def where(self):
        """Where the choice's blocks lie: its grid and the grid's placement (what redistribution
        compares; computed once, the planner asks for it on every transition)."""
        return self.P_n, self.P_d, self.P_h, self.P_w, self.P_c, placement_order(self.shape, self.node_axes)

    @property
    def placed(self):
        """The grid with its placement where that is not the default: 'sample=2,channel=2
        (node axes: sample)'."""
        return self.grid + (f" (node axes: {','.join(self.node_axes)})" if self.node_axes else "")

    @property
    def label(self):
        return self.algorithm + (f" (p_f={self.p_f})" if self.algorithm == "w" else "") + \
            (f" in {self.chunks} chunks" if self.chunks > 1 else "")


def placements(shape, profile, node_axes=None):
    """The placements (grid.ProcessGrid's node_axes, as grid.placed_axes records them) worth
    pricing for a grid of {axis: size} `shape`: `node_axes`' alone where given; else None
    (channel fastest) and, where the grid spans several of the profile's nodes and the profile
    has a link between nodes, every other choice of axes kept inside a node whose groups fit
    in one (their sizes multiply to a divisor of ranks_per_node), one per distinct rank order."""
    if node_axes is not None:
        return [placed_axes(shape, node_axes)]
    out, seen = [None], {placement_order(shape)}
    if math.prod(shape.values()) <= profile.ranks_per_node or "inter" not in profile.links:
        return out
    split = [a for a in AXES if shape.get(a, 1) > 1]
    for k in range(1, len(split) + 1):
        for axes in itertools.combinations(split, k):
            order = placement_order(shape, axes)
            if profile.ranks_per_node % math.prod(shape[a] for a in axes) == 0 and order not in seen:
                seen.add(order)
                out.append(axes)
    return out


def layer_options(layer, ranks, profile, algorithms=("sample",) + CHANNEL_ALGORITHMS, grid=None,
                  optimizer_buffers=1, spatial=False, node_axes=None, chunks=False):
    """Every (grid, placement, algorithm, p_f) for `layer` on `ranks` ranks (or on the fixed
    `grid` (P_n, P_c), (P_n, P_h, P_w, P_c) or (P_n, P_d, P_h, P_w, P_c)), with its predicted
    cost. Data parallelism needs P_c = 1 (on a grid with P_c > 1 it would only replicate work).
    spatial: also the grids that split the image over height and width, a volume also over
    depth (as far as the layer's output has planes, rows and columns). The placements are
    `placements`' (one unless the grid spans nodes of a two-link profile; `node_axes` given:
    that one). chunks: also x, y and w in each of CHUNKS chunks they run in (chunk_counts), on
    grids with channel ranks to exchange with and where the profile's links progress while
    ranks compute (with none, a pipeline hides nothing and only adds its chunks' latencies:
    one chunk), and each layer on a split image that convolves its own block with its interior
    computed while the halo moves (layer_cost's halo_interior): what --overlap all runs."""
    progress = chunks and any(v > 0 for v in profile.progress.values())
    volume = len(layer.spatial) == 3
    if grid is not None:
        grid = tuple(grid)
        grids = [grid if len(grid) == 5 else (grid[0], 1) + grid[1:] if len(grid) == 4 else (grid[0], 1, 1, 1, grid[1])]
    elif spatial:
        out_size = ((1,) if not volume else ()) + layer.out_size  # (planes, rows, columns)
        grids = [(f[0],) + ((1,) if not volume else ()) + f[1:] for f in factorizations(ranks, 5 if volume else 4)]
        grids = [f for f in grids if all(parts <= size for parts, size in zip(f[1:4], out_size))]
    else:
        grids = [(P_n, 1, 1, 1, P_c) for P_n, P_c in factorizations(ranks)]
    out = []
    for P_n, P_d, P_h, P_w, P_c in grids:
        if P_n > layer.N:  # a sample rank without a sample does nothing useful
            continue
        for algorithm in algorithms:
            if algorithm == "sample" and P_c > 1:
                continue
            if algorithm != "sample" and P_c == 1 and algorithm != "y":
                continue  # with one channel rank x, y and w are the same computation: keep one
            p_fs = [d for d in range(1, P_c + 1) if P_c % d == 0] if algorithm == "w" else [None]
            cls = algorithm_class(algorithm, layer.groups)
            ks = chunk_counts(layer, cls, P_n, P_c, CHUNKS) if progress and P_c > 1 and pipelines(
                cls, layer.first) else [1]
            for p_f, placed, k in itertools.product(p_fs, placements(
                    {"sample": P_n, "depth": P_d, "height": P_h, "width": P_w, "channel": P_c}, profile, node_axes),
                    ks):
                cost = layer_cost(layer, algorithm, P_n, P_c, profile, p_f, optimizer_buffers, P_h, P_w, placed, P_d, k,
                                  halo_interior=chunks)
                out.append(Choice(layer, P_n, P_c, algorithm, cost["p_f"], cost, P_h=P_h, P_w=P_w,
                                  node_axes=placed, P_d=P_d, chunks=k))
    return out


def geometries(layers, ranks, profile, spatial=False, chunks=False):
    """The local convolutions of every option of every layer on `ranks` ranks, for calibration
    to measure (calibration.top_up): (the 2-D geometries, perfmodel.local_geometry: what the
    kernels of any plan of these layers would run; the volumes' own blocks with their stacked
    geometries, [(perfmodel.local_block, geometry)], which it times as volumes). chunks: also
    the options in chunks that plan(..., chunks=True) weighs, with their chunks' own geometries
    (layer_cost's "chunk_geometries"), so that a layer in chunks is priced at measured rates
    beside the same layer whole."""
    options = [o for L in layers for o in layer_options(L, ranks, profile, spatial=spatial, chunks=chunks)]
    pieces = [(o.cost["geometry"], o.cost.get("block")) for o in options]
    pieces += [piece for o in options for piece in o.cost.get("chunk_geometries", ())]
    return [g for g, _ in pieces], [(block, g) for g, block in pieces if block is not None]


def moves(chosen, choice, itemsize):
    """[(source choice, bytes)]: the activations a model redistributes for `choice`'s layer
    after the choices `chosen` (in the layers' order): its input, the output of the last one
    unless LayerShape.reads names another, where that lies on another grid; and, where its
    output is added to another branch's (LayerShape.merges) on another grid, that branch's
    output, brought into its layout (models.build_model's Redistribute modules, one each)."""
    if not chosen:
        return []
    L = choice.layer
    by_name = {c.layer.name: c for c in chosen} if L.reads or L.merges else {}
    source = by_name[L.reads] if L.reads else chosen[-1]
    out = [(source, math.prod(L.x_shape) * itemsize)]  # its input, after any pooling on the way
    if L.merges:
        out.append((by_name[L.merges], L.N * L.F * math.prod(L.out_size) * itemsize))
    return [(c, volume) for c, volume in out if _grid(c) != _grid(choice)]


def _grid(c):
    return c.where


def redistribution_time(chosen, choice, profile, last=False):
    """Seconds of `moves`: each activation forward and its gradient backward, by an all-to-all
    over all ranks whose result on each is its share of the activation (of which (p - 1) / p
    arrives from the others: a split by samples traded for a split by channels). Data
    parallelism runs only where P_c = 1, so one placed grid means one layout. last: `choice`
    is the last layer's, and its output also moves to the loss (`loss_move_time`; chosen[0]
    the first layer's choice)."""
    ranks = math.prod(choice.shape.values())
    intra = ranks <= profile.ranks_per_node
    own = sum(2 * profile.collective_time("alltoall", ranks, volume / ranks, intra)
              for _, volume in moves(chosen, choice, profile.itemsize))
    return own + (loss_move_time(chosen[0] if chosen else choice, choice, profile) if last else 0.0)


def path_redistributions(path, profile):
    """[seconds] of redistribution_time for each choice of `path` (a whole plan, in the layers'
    order), the last one's move to the loss included where the layers end in one."""
    ends = _ends_in_loss([c.layer for c in path])
    return [redistribution_time(path[:k], c, profile, ends and k == len(path) - 1) for k, c in enumerate(path)]


def _ends_in_loss(layers):
    """Whether `layers` are a network's (models.layer_shapes), whose last layer's output, the
    logits, goes to the loss: the layer before it then has the loss among the layers after it
    (the global pool and softmax cross-entropy, or a per-pixel one). A lone layer has none."""
    return len(layers) >= 2 and "loss" in layers[-2].after


def loss_move_time(first, last, profile):
    """Seconds of the network's last redistribution (nn.Network.place's 'loss'): the logits
    forward and their gradient back, from the last layer's output to the loss's layout (split
    by samples over the first layer's grid, whole over its other axes), which they differ from
    unless the last layer ends on the first's grid split by samples alone (P_c = 1, no image
    split). Priced as a redistribution between layers is, each rank's result its share of the
    logits (all of a sample's on a grid without sample ranks)."""
    if _grid(last) == _grid(first) and last.P_c == last.P_d == last.P_h == last.P_w == 1:
        return 0.0
    L = last.layer
    ranks = math.prod(last.shape.values())
    share = L.N * L.F * math.prod(L.out_size) * profile.itemsize / first.P_n
    return 2 * profile.collective_time("alltoall", ranks, share, ranks <= profile.ranks_per_node)


_PASSING = ("temporary", "workspace")  # memory that is not each layer's own: see _memory


def _memory(choices):
    """Bytes per rank of a plan: everything each layer keeps, plus the largest temporary (alive
    inside one layer at a time) and the largest kernel workspace (one block, kept between the
    layers, as large as the largest layer's)."""
    kept = sum(c.cost["bytes"] - sum(c.cost["memory"][k] for k in _PASSING) for c in choices)
    return kept + sum(max((c.cost["memory"][k] for c in choices), default=0) for k in _PASSING)


def _best_path(options, profile, price, count_temporary=False):
    """The choices minimising time + price * bytes, by dynamic programming. The bytes priced
    are what each layer keeps (summed over layers, as in the plan's memory), plus, with
    count_temporary, its temporary and workspace too (upper bounds on the plan's largest).

    The program's state after a layer is the grid of every layer a later one still refers to
    (the one before it, and those a later layer reads or merges with: LayerShape.reads,
    merges): what is left to pay depends on them only through where their outputs lie, so a
    residual block's redistributions are priced exactly and the plan is the best of all."""
    layers = [opts[0].layer for opts in options]
    index = {L.name: i for i, L in enumerate(layers)}
    last_use = list(range(1, len(layers) + 1))  # the last layer referring to each: the next by default
    ends = _ends_in_loss(layers)
    if ends:  # the first layer's grid is the loss's (loss_move_time)
        last_use[0] = len(layers) - 1
    for k, L in enumerate(layers):
        for name in (L.reads, L.merges):
            if name:
                last_use[index[name]] = max(last_use[index[name]], k)

    def own_cost(o):
        priced = o.cost["bytes"] - (0 if count_temporary else sum(o.cost["memory"][k] for k in _PASSING))
        return o.cost["time"] + price * priced

    # {grids of the layers still referred to: (total, option index of every layer so far)}
    best = {}
    for k, o in enumerate(options[0]):
        if (_grid(o),) not in best or own_cost(o) < best[(_grid(o),)][0]:
            best[(_grid(o),)] = (own_cost(o), (k,))
    live = [0]
    for i in range(1, len(options)):
        referred, live = live, [j for j in range(i + 1) if last_use[j] > i]
        step = {}
        for total, path in best.values():
            chosen = [options[j][path[j]] for j in referred]  # in order, the layer before i last
            for k, o in enumerate(options[i]):
                t = total + own_cost(o) + redistribution_time(chosen, o, profile, ends and i == len(options) - 1)
                full = path + (k,)
                key = tuple(_grid(options[j][full[j]]) for j in live)
                if key not in step or t < step[key][0]:
                    step[key] = (t, full)
        best = step
    _, path = min(best.values(), key=lambda tp: tp[0])
    return [options[j][k] for j, k in enumerate(path)]


@dataclasses.dataclass
class Plan:
    choices: list
    ranks: int
    bucket_mb: float = 0  # > 0: the gradient buckets the planner chose (plan(..., buckets=True)); 0: blocking

    def to_json(self):
        """The plan file's content: {"layers": {layer name: {"grid", "algorithm", "filter_groups",
        "node_axes"}}} (plan_entries)."""
        return {"layers": plan_entries(self)}

    @property
    def time(self):
        return sum(c.cost["time"] + c.redistribution for c in self.choices)

    @property
    def memory(self):
        return _memory(self.choices)

    overlapped_time = None  # the step with the chosen buckets (choose_bucket)

    def choose_bucket(self, profile, sizes=BUCKETS_MB):
        """The bucket of `sizes` (MiB) whose overlapped step (overlapped) is the fastest, kept
        where it beats the blocking step (else 0: every gradient sum blocking)."""
        best = min(sizes, key=lambda b: self.overlapped(profile, b)["time"])
        time = self.overlapped(profile, best)["time"]
        self.bucket_mb, self.overlapped_time = (best, time) if time < self.time else (0, None)
        return self.bucket_mb

    def pipelined(self, profile, chunks=CHUNKS, optimizer_buffers=1):
        """This plan with each x, y and w layer on a grid with channel ranks run in the number
        of `chunks` it runs in (chunk_counts: of samples, or of features) whose pipeline is the fastest
        (layer_cost's chunks), and each layer on a split image with its interior computed while
        the halo moves (halo_interior), its grids and algorithms kept: what --overlap all gives
        the plan (simulate.py's overlapped columns; plan(..., chunks=True) chooses grids with
        it in view). A profile whose links do not progress keeps one chunk."""
        flowing = any(v > 0 for v in profile.progress.values())
        choices = []
        for c in self.choices:
            cls = algorithm_class(c.algorithm, c.layer.groups)
            ks = chunk_counts(c.layer, cls, c.P_n, c.P_c, chunks) if flowing and c.P_c > 1 and pipelines(
                cls, c.layer.first) else [1]
            costs = [layer_cost(c.layer, c.algorithm, c.P_n, c.P_c, profile, c.p_f if c.algorithm == "w" else None,
                                optimizer_buffers, c.P_h, c.P_w, c.node_axes, c.P_d, k, halo_interior=True)
                     for k in ks]
            cost = min(costs, key=lambda cost: cost["time"])
            choices.append(dataclasses.replace(c, cost=cost, chunks=cost["chunks"]) if cost["time"] < c.cost["time"]
                           else c)
        return Plan(choices, self.ranks, self.bucket_mb)

    def overlapped(self, profile, bucket_mb):
        """perfmodel.overlapped_step of this plan: its step with the gradient sums started in
        buckets of bucket_mb MiB during backward (the plan itself chosen without overlap)."""
        return overlapped_step([{**c.cost, "redistribution": c.redistribution} for c in self.choices], profile,
                               bucket_mb * 2 ** 20)

    def table(self):
        """The plan as a plain-text table."""
        mib = 1024.0 ** 2
        rows = [("layer", "shape N,C,F,HxW,K[,groups][,dilation]", "grid", "algorithm", "compute ms", "comm ms",
                 "layers ms", "redistribute ms", "memory MiB")]
        for c in self.choices:
            L = c.layer
            extra = (f",g{L.groups}" if L.groups > 1 else "") + (f",d{L.dilation}" if L.dilation > 1 else "") + \
                (",transposed" if "transpose" in L.op else "")
            size = "x".join(map(str, L.spatial))
            rows.append((L.name, f"{L.N},{L.C},{L.F},{size},{L.K}{extra}", c.placed, c.label,
                         f"{sum(c.cost['compute'].values()) * 1e3:.2f}",
                         f"{sum(c.cost['comm'].values()) * 1e3:.2f}",
                         f"{sum(c.cost.get('layers', {}).values()) * 1e3:.2f}", f"{c.redistribution * 1e3:.2f}",
                         f"{c.cost['bytes'] / mib:.2f}"))
        text = (format_table(rows) + f"\npredicted iteration {self.time * 1e3:.2f} ms on {self.ranks} "
                f"ranks, {self.memory / mib:.2f} MiB per rank")
        if self.bucket_mb:
            text += (f"\ngradient sums in buckets of {self.bucket_mb:g} MiB during backward: "
                     f"{self.overlapped_time * 1e3:.2f} ms")
        return text


def plan_entries(the_plan):
    """{layer name: {"grid", "algorithm", "filter_groups", "node_axes"}} of a Plan, as
    models.build_model and plan files take them (filter_groups only for 'w', node_axes only
    for a placement other than channel fastest)."""
    out = {}
    for c in the_plan.choices:
        entry = {"grid": c.grid, "algorithm": c.algorithm}
        if c.algorithm == "w":
            entry["filter_groups"] = c.p_f
        if c.chunks > 1:
            entry["chunks"] = c.chunks
        if c.node_axes:
            entry["node_axes"] = ",".join(c.node_axes)
        out[c.layer.name] = entry
    return out


def price_plan(layers, ranks, profile, entries, optimizer_buffers=1, halo_interior=False):
    """The Plan (predicted times and memory) of running `layers` as `entries` says: {layer
    name: {"grid", "algorithm", "filter_groups", "node_axes"}}, every layer listed (a plan file as plan.py
    writes it, or a single-grid plan), priced as the planner prices its own (halo_interior:
    as --overlap all runs it, what plan(..., chunks=True) prices)."""
    from .grid import parse_grid_spec
    choices = []
    for L in layers:
        if L.name not in entries:
            raise ValueError(f"price_plan: layer {L.name} is not in the plan")
        entry = entries[L.name]
        sizes = parse_grid_spec(entry["grid"])
        P_n, P_c = sizes.get("sample", 1), sizes.get("channel", 1)
        P_d, P_h, P_w = sizes.get("depth", 1), sizes.get("height", 1), sizes.get("width", 1)
        if P_n * P_d * P_h * P_w * P_c != ranks:
            raise ValueError(f"price_plan: layer {L.name}: grid {entry['grid']} is not a grid of {ranks} ranks")
        node_axes = placed_axes(ProcessGrid.shape_of(entry["grid"]), entry.get("node_axes"))
        cost = layer_cost(L, entry["algorithm"], P_n, P_c, profile, entry.get("filter_groups"), optimizer_buffers,
                          P_h, P_w, node_axes, P_d, entry.get("chunks", 1), halo_interior)
        choices.append(Choice(L, P_n, P_c, entry["algorithm"], cost["p_f"], cost, P_h=P_h, P_w=P_w,
                              node_axes=node_axes, P_d=P_d, chunks=cost["chunks"]))
    for choice, seconds in zip(choices, path_redistributions(choices, profile)):
        choice.redistribution = seconds
    return Plan(choices, ranks)


def _time(path, profile):
    return sum(c.cost["time"] for c in path) + sum(path_redistributions(path, profile))


def _within(options, profile, memory_limit, ranks):
    """The fastest plan found under `memory_limit`: the plans minimising time + price * bytes
    for prices of a byte from 1e-18 to 1e6 s (geometric bisection on the smallest price whose
    plan fits), each with the largest temporary and workspace priced both ways (they are not
    additive: counting them in every layer overstates them, leaving them out understates the
    plan's memory, so neither pricing's fit is monotone in the price alone), keeping the
    fastest of every plan tried that fits."""
    fitting = []

    def plans(price):
        """Both pricings' plans at `price`, the fitting ones kept; whether any fits."""
        both = [_best_path(options, profile, price, with_temp) for with_temp in (False, True)]
        fit = [p for p in both if _memory(p) <= memory_limit]
        fitting.extend(fit)
        return both, bool(fit)
    low, high = -18.0, 6.0  # log10 of the price
    dearest, fits = plans(10 ** high)
    if not fits:
        smallest = min(_memory(p) for p in dearest)
        raise ValueError(f"memory limit {memory_limit / 2 ** 20:.2f} MiB per rank is impossible: "
                         f"the smallest plan on {ranks} ranks needs {smallest / 2 ** 20:.2f} MiB")
    for _ in range(30):
        middle = (low + high) / 2
        if plans(10 ** middle)[1]:
            high = middle
        else:
            low = middle
    return min(fitting, key=lambda p: _time(p, profile))


def plan(layers, ranks, profile, memory_limit=None, algorithms=("sample",) + CHANNEL_ALGORITHMS,
         grid=None, optimizer_buffers=1, spatial=False, node_axes=None, chunks=False, buckets=False):
    """The fastest plan for `layers` (perfmodel.LayerShape, in order) on `ranks` ranks whose
    predicted memory per rank is at most `memory_limit` bytes (None: no limit).

    grid: a fixed (P_n, P_c), (P_n, P_h, P_w, P_c) or (P_n, P_d, P_h, P_w, P_c) for every layer
    (what a model built on one grid can run). spatial: also consider grids that split the image
    (a volume's depth too), layer by layer.
    node_axes: every layer's placement (grid.ProcessGrid); None: each layer's chosen with its
    grid where the grid spans the profile's nodes (placements).
    chunks: also the x, y and w layers pipelined in chunks (layer_options). buckets: the plan's
    gradient sums in the buckets (BUCKETS_MB) whose overlapped step is the fastest
    (Plan.choose_bucket; the plan itself is chosen with the sums blocking).
    Raises ValueError when no plan fits the limit, naming the smallest memory possible.
    """
    if not layers:
        raise ValueError("plan: no layers given")
    options = [layer_options(L, ranks, profile, algorithms, grid, optimizer_buffers, spatial, node_axes, chunks)
               for L in layers]
    for L, opts in zip(layers, options):
        if not opts:
            raise ValueError(f"plan: layer {L.name} has no valid option on {ranks} ranks "
                             f"(global batch {L.N}, grid {grid})")
    path = _best_path(options, profile, 0.0)
    if memory_limit is not None and _memory(path) > memory_limit:
        path = _within(options, profile, memory_limit, ranks)
    path = [dataclasses.replace(c) for c in path]
    for choice, seconds in zip(path, path_redistributions(path, profile)):
        choice.redistribution = seconds
    result = Plan(path, ranks)
    if buckets:
        result.choose_bucket(profile)
    return result
