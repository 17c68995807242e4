"""The explanation as tables: who holds which global indices and what each collective moves,
rank by rank, read from the layer's own layouts and messages (explain_layer, explain_model).

`explain_layer` needs no MPI run. It reads everything from the descriptions the layer itself
runs, never from a second copy:
- the layouts of x, w, b and y (ConvAlgorithm.layouts, through layout.Layout.indices), so each
  rank's global index ranges are the shards the code holds;
- the algorithm's collectives in run order (algorithms.base.run_order, the halo exchange and
  its adjoint on a spatial grid), with each rank's bytes (perfmodel.message_bytes, which
  predict_bytes sums), its group of ranks (partition.gather_group / scatter_group, the
  splits grid.ProcessGrid makes) and the tensor it holds after the step.
`explain_model` tabulates a model's layers under a grid or a plan (model_table).
"""
import dataclasses
import math

from ..algorithms import algorithm_class
from ..algorithms.base import HALO, HALO_ADJOINT, by_features, feature_chunk_limit, feature_chunk_tensors, run_order
from ..checks import int_tuple, positive_int
from ..grid import AXES, ProcessGrid, check_node_fit, coords_of, placed_axes, placement_order, process_ranks, rank_of
from ..halo import check_image_fits, halo_plan, window_options
from ..kernels.conv import conv_op
from ..layout import Layout, Shard
from ..partition import block_sizes, gather_group, scatter_group
from ..perfmodel import PHASES, message_bytes
from ..report import format_bytes, format_table


# what each dimension of a tensor is called in the tables
DIMS = {"x": "samples, channels, rows, columns", "w": "filters, channels", "b": "filters",
        "y": "samples, filters, rows, columns"}
VOLUME_DIMS = {**DIMS, "x": "samples, channels, planes, rows, columns", "y": "samples, filters, planes, rows, columns"}


@dataclasses.dataclass
class Step:
    """One collective of the pass. `message`: its algorithms.base.Message; per rank r:
    groups[r] (the ranks it runs with, r included), sent[r] and received[r] (bytes),
    result[r] = (what the rank holds after it, the tensor it is a part of: 'x', 'dx', 'dy',
    'y0' (y before the bias), 'dwdb' (dw and db, flattened) or None where no serial tensor
    has those values, and its global indices)."""
    message: object
    groups: list
    sent: list
    received: list
    result: list

    @property
    def phase(self):
        return self.message.phase

    def title(self):
        m = self.message
        if m.phase == "halo":
            volume = any(r is not None and len(r[2]) == 5 for r in self.result)  # (a volume's halo has planes too)
            what = f"the halo {'planes, ' if volume else ''}rows and columns of x" if m.tensor == "x" else \
                "the gradient of the halo back (adjoint)"
            return f"halo: alltoall {what}"
        verb = {"allgather": "allgather", "reduce_scatter": "reduce-scatter", "allreduce": "allreduce"}[m.collective]
        tensor = {("x", "forward"): "x", ("x", "backward-data"): "dx", ("y", "forward"): "y",
                  ("y", "backward-filter"): "dy"}.get((m.tensor, m.phase), "dw and db")
        within = {"row": "each row", "column": "each column", "gradient": "the ranks sharing a shard"}[m.group]
        return f"{m.phase}: {verb} {tensor} within {within}"

    def group_sets(self):
        """The distinct groups of ranks, in order of their first rank."""
        return sorted({tuple(g) for g in self.groups})


class LayerExplanation:
    """What explain_layer found; see the module's docstring."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    # -- bytes and memory ----------------------------------------------------------------------

    def bytes(self, rank):
        """{phase: (bytes sent, bytes received)} of `rank`: what perfmodel.predict_bytes says."""
        out = {phase: (0, 0) for phase in PHASES}
        for step in self.steps:
            sent, received = out[step.phase]
            out[step.phase] = (sent + step.sent[rank], received + step.received[rank])
        return out

    def memory(self, rank):
        """Bytes `rank` holds: its blocks of x, w and b, y, the gradients dw and db, and the
        largest tensor a step leaves it (a gathered x or dy; the extended x of a halo)."""
        size = lambda ix: math.prod(len(i) for i in ix) * self.itemsize  # noqa: E731
        held = self.holds[rank]
        out = {"x": size(held["x"]), "w": size(held["w"]) + (size(held["b"]) if self.bias else 0),
               "y": size(held["y"])}
        out["dw"] = out["w"]
        out["largest step result"] = max([size(s.result[rank][2]) for s in self.steps
                                          if s.message.collective != "allreduce"] or [0])
        return out

    # -- text ---------------------------------------------------------------------------------------

    # -- nodes -------------------------------------------------------------------------------------

    def node(self, rank):
        """The node of grid rank `rank` (its process's rank // ranks_per_node), or None when
        the explanation was not given the nodes."""
        return None if self.ranks_per_node is None else self.processes[rank] // self.ranks_per_node

    def group_text(self, group):
        """'{0,1}', with the nodes its ranks are on where those are known: '{0,1} (node 0)',
        '{0,2} (nodes 0,1: across)'."""
        text = "{" + ",".join(map(str, group)) + "}"
        if self.ranks_per_node is None or len(group) < 2:
            return text
        nodes = sorted({self.node(r) for r in group})
        return text + (f" (node {nodes[0]})" if len(nodes) == 1 else f" (nodes {','.join(map(str, nodes))}: across)")

    def across_nodes(self):
        """The steps ([phase: collective]) some of whose groups span nodes (none where the
        nodes are not known)."""
        if self.ranks_per_node is None:
            return []
        return [f"{s.phase}: {s.message.collective}" for s in self.steps
                if any(len({self.node(r) for r in g}) > 1 for g in s.group_sets())]

    def placement_text(self):
        """', node axes sample, 2 nodes of 2 ranks' (what the header adds: the placement where
        not the default, the nodes where known)."""
        text = f", node axes {','.join(self.node_axes)}" if self.node_axes else ""
        if self.ranks_per_node is not None:
            nodes = self.ranks // self.ranks_per_node
            text += f", {nodes} node{'s' * (nodes > 1)} of {self.ranks_per_node} rank{'s' * (self.ranks_per_node > 1)}"
        return text

    # -- text ---------------------------------------------------------------------------------------

    def header(self):
        p_f = f" (p_f={self.p_f})" if self.algorithm == "w" else ""
        k = "x".join(map(str, self.kernel))
        return (f"layer: x {self.shapes['x']} -> y {self.shapes['y']}, w {self.shapes['w']}, kernel {k}, "
                f"{self.option_text()}; algorithm {self.algorithm}{p_f} on grid "
                f"{ProcessGrid.describe_shape(self.grid)} ({self.ranks} rank{'s' * (self.ranks > 1)}"
                f"{self.placement_text()}), {self.itemsize * 8}-bit floats")

    def option_text(self):
        o = self.options
        text = f"stride {pair(o['stride'])}, padding {pair(o['padding'])}"
        if set(o["dilation"]) != {1}:
            text += f", dilation {pair(o['dilation'])}"
        if o["groups"] > 1:
            text += f", groups {o['groups']}"
        if o.get("padding_mode", "zeros") != "zeros":
            text += f", padding mode {o['padding_mode']}"
        if any(o.get("output_padding", ())):
            text += f", output_padding {pair(o['output_padding'])}"
        if self.input_whole:
            text += ", input whole (a first layer)"
        if not self.need_dx:
            text += ", no dx"
        return text

    def rank_columns(self, rank=None):
        """The first cells of a table row of grid rank `rank` (None: the header): the rank;
        with a placement, the process (the rank in the job) holding it; with the nodes, its node."""
        placed, nodes = self.node_axes is not None, self.ranks_per_node is not None
        if rank is None:
            return ["rank"] + ["process"] * placed + ["node"] * nodes
        return [str(rank)] + [str(self.processes[rank])] * placed + [str(self.node(rank))] * nodes

    def holds_table(self):
        rows = [self.rank_columns() + ["coords", "x", "w", "y"]]
        for r in range(self.ranks):
            held = self.holds[r]
            rows.append(self.rank_columns(r) + [coords_text(self.coords[r], self.grid), indices_text("x", held["x"]),
                                                indices_text("w", held["w"][:2]), indices_text("y", held["y"])])
        return format_table(rows)

    def steps_text(self):
        lines = []
        if not self.steps:
            lines.append("(no collective: every rank computes alone)")
        for k, step in enumerate(self.steps, 1):
            groups = " ".join(self.group_text(g) for g in step.group_sets())
            lines.append(f"{k}. {step.title()}: groups {groups}")
            rows = [["rank", "sends", "receives", "then holds"]]
            for r in range(self.ranks):
                rows.append([str(r), format_bytes(step.sent[r]), format_bytes(step.received[r]),
                             result_text(step.result[r])])
            lines.extend("   " + line for line in format_table(rows).splitlines())
        return "\n".join(lines)

    def bytes_table(self):
        phases = [p for p in PHASES if any(s.phase == p for s in self.steps)]
        rows = [["rank"] + phases + ["memory"]]
        for r in range(self.ranks):
            moved = self.bytes(r)
            rows.append([str(r)] + [f"{format_bytes(moved[p][0])} / {format_bytes(moved[p][1])}" for p in phases]
                        + [format_bytes(sum(self.memory(r).values()))])
        return format_table(rows)

    def pipeline_text(self):
        """The schedule of a pass pipelined over self.chunks chunks (ConvAlgorithm.pipelined),
        read from the steps: of each rank's samples, a pass's allgathers gather each chunk
        before it computes, its reduce-scatters scatter each chunk's result after; of the
        features where a rank holds fewer samples than chunks (by_features), the axis each
        pass's collective moves (feature_chunk_tensors). The halo and the gradient sum run
        whole, before and after."""
        k = self.chunks
        held = [len(self.holds[r]["x"][0]) for r in range(self.ranks)]
        cls = algorithm_class(self.algorithm, self.options.get("groups", 1))
        if by_features(held[0], k):
            return self._feature_pipeline_text(cls, held[0])
        lines = [f"Pipelined over {k} chunks of each rank's samples (--chunks {k}): rank 0's "
                 f"{held[0]} in chunks of {', '.join(map(str, block_sizes(held[0], k)))}; each collective "
                 f"below moves a chunk's share, the same bytes per phase in all"]
        if k > min(held):
            lines.append(f"  ranks holding fewer than {k} samples ({min(held)}) chunk their features instead")
        for name, phases in (("forward", ("forward",)), ("backward", ("backward-filter", "backward-data"))):
            gather, scatter = self._collectives(phases)
            if not gather and not scatter:
                lines.append(f"  {name}: no collective of its own to pipeline: each rank computes its block whole")
                continue
            parts = [f"start the {gather} of chunk 1"] if gather else []
            each = ([f"wait for chunk i's {gather}, start chunk i+1's"] if gather else []) + \
                ["test the collectives in flight", "compute chunk i"] + ([f"start its {scatter}"] if scatter else [])
            parts.append(f"for i = 1..{k}: " + "; ".join(each))
            if scatter:
                parts.append(f"wait for the {k} reduce-scatters")
            lines.append(f"  {name}: " + "; then ".join(parts))
        return "\n".join(lines)

    def _collectives(self, phases):
        """(the allgathers, the reduce-scatters) of the steps in `phases`, as text ('' for none)."""
        steps = [s for s in self.steps if s.phase in phases]
        return tuple(" and ".join(f"{s.message.collective} of {s.message.tensor} ({s.message.group})"
                                  for s in steps if s.message.collective == c)
                     for c in ("allgather", "reduce_scatter"))

    def _feature_pipeline_text(self, cls, held):
        """pipeline_text for a rank holding fewer samples than chunks: chunks of the filters
        (y's channel axis) or channels (x's) each pass's collective moves."""
        k, C, F = self.chunks, self.shapes["x"][1], self.shapes["w"][0]
        P_c = self.grid.get("channel", 1)
        limit = feature_chunk_limit(cls, C, F, P_c, self.input_whole, self.need_dx)
        lines = [f"Pipelined over {k} chunks of the features (--chunks {k}): rank 0 holds {held} sample(s), fewer "
                 f"than {k}, so each pass is cut along the channel axis its collective moves, every rank's block "
                 f"of it in {k} pieces (chunk j: the j-th piece of each); each collective below moves a chunk's "
                 f"share, the same bytes per phase in all"]
        if limit and k > limit:
            lines.append(f"  refused here: the smallest block of those features holds {limit}, fewer than {k} chunks")
        axis = {"y": "filters", "x": "channels"}
        tensors = feature_chunk_tensors(cls, self.input_whole, self.need_dx)
        for name, phases in (("forward", ("forward",)), ("backward", ("backward-filter", "backward-data"))):
            gather, scatter = self._collectives(phases)
            if tensors[name] is None:
                lines.append(f"  {name}: no collective of its own to pipeline: each rank computes its block whole")
                continue
            what = f"chunk j's {axis[tensors[name]]}"
            if scatter:
                parts = ([f"the {gather} whole"] if gather else []) + (
                    ["dw whole and its sum"] if name == "backward" else [])
                parts.append(f"for j = 1..{k}: test the collectives in flight; compute the partial result of {what}; "
                             f"start its {scatter}")
                parts.append(f"wait for the {k} reduce-scatters, this rank's pieces side by side")
            else:
                parts = [f"start the {gather} of chunk 1's {axis[tensors[name]]}",
                         f"for j = 1..{k}: wait for chunk j's, start chunk j+1's; compute from {what} "
                         + ("their rows of dw and a part of dx, added up" if name == "backward"
                            else "a part of y, added up")]
            lines.append(f"  {name}: " + "; then ".join(parts))
        return "\n".join(lines)

    def text(self):
        return "\n".join([
            self.header(), "",
            "Who holds what: global index ranges start:stop (a+b: a union of blocks),"
            + (" by grid rank (the process of the job holding it: the placement)," if self.node_axes else ""),
            "  x[{x}], w[{w}], y[{y}]; dx, dw, dy as x, w, y".format(**(VOLUME_DIMS if len(self.shapes["x"]) == 5
                                                                        else DIMS)),
            self.holds_table(), "",
            "The steps of one forward and backward pass, in the order the layer runs them",
            self.steps_text(), "",
            "Bytes sent / received per rank and phase (perfmodel.predict_bytes), and the memory each rank holds",
            self.bytes_table()] + (["", self.pipeline_text()] if self.chunks > 1 else []))


def pair(v):
    if isinstance(v, str):
        return repr(v)
    v = tuple(v)
    return str(v[0]) if len(set(v)) == 1 else "x".join(map(str, v))


def result_text(result):
    """'x of the row: x[0:4, 0:4, 0:8, 0:8]': what a step leaves a rank, and its indices."""
    what, tensor, ix = result
    if tensor == "dwdb":
        return f"{what}: {indices_text('dw', ix[0][:2])} {indices_text('db', ix[1])}"
    return f"{what}: {indices_text({'y0': 'y', None: 'dx'}.get(tensor, tensor), ix)}"


def coords_text(coords, grid):
    named = [f"{a[0]}{coords[a]}" for a in AXES if grid[a] > 1]
    return " ".join(named) if named else "-"


def range_text(ix):
    """'0:4' for a range, '0:2+4:6' for a union of runs, '-' when empty."""
    ix = list(ix)
    if not ix:
        return "-"
    runs, start = [], ix[0]
    for a, b in zip(ix, ix[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}:{a + 1}")
            start = b
    return "+".join(runs)


def indices_text(name, ix):
    return f"{name}[{', '.join(range_text(i) for i in ix)}]"


def explain_layer(x_shape, out_channels, kernel_size, algorithm, grid, filter_groups=None, stride=1,
                  padding=0, dilation=1, groups=1, bias=True, input_whole=False, need_dx=True, itemsize=8,
                  padding_mode="zeros", node_axes=None, ranks_per_node=None, chunks=1, op="conv2d",
                  output_padding=0, name="layer"):
    """A LayerExplanation of the convolution of a global x of x_shape (N, C, H, W) into
    out_channels filters under `algorithm` ('sample', 'x', 'y', 'w') on `grid` (a spec such as
    'sample=2,channel=2' or {axis: size}), with nn.Conv2d's options, for every rank. (The
    padding mode moves nothing more unless the grid splits the image: then the halo also
    brings the rows the padded border copies.) `node_axes`: the grid's placement
    (grid.ProcessGrid), which process holds each grid rank; `ranks_per_node`: the job's nodes
    (neighbouring processes, as many each), to show which ranks share one. `chunks` > 1: the
    text also shows the pipelined schedule of that many chunks (ConvAlgorithm.pipelined).
    op: the kind of convolution (kernels/conv/ops.py): 'conv3d' and 'conv_transpose3d' take a
    volume's x_shape (N, C, D, H, W) and may split depth; a transposed one takes
    output_padding, and its halo brings the input rows that reach each rank's output block.
    name: the layer's name in the message refusing an image too small for the grid."""
    sizes = ProcessGrid.shape_of(grid)
    processes, node_axes = _placement(sizes, node_axes, ranks_per_node)
    x_shape = tuple(int(n) for n in x_shape)
    op = conv_op(op)
    if len(x_shape) != 2 + op.axes:
        raise ValueError(f"{op.name} takes x of {2 + op.axes} dimensions (N, C, {'D, ' * (op.axes == 3)}H, W), "
                         f"got {x_shape}")
    if op.axes == 2 and sizes["depth"] > 1:
        raise ValueError(f"{op.name} on a grid splitting depth ({ProcessGrid.describe_shape(sizes)}): depth splits "
                         f"volumes; expected a grid without a depth axis for an image's layer")
    kernel = int_tuple(kernel_size, op.axes, "kernel_size", 1, "a positive integer")
    options = op.options(stride, padding, dilation, groups, padding_mode,
                         **({"output_padding": output_padding} if op.transposed else {}))
    if not op.transposed and output_padding:
        raise ValueError(f"output_padding={output_padding!r} applies to transposed convolutions only")
    cls = algorithm_class(algorithm, options["groups"])
    C, F = x_shape[1], int(out_channels)
    p_f = cls.filter_groups(sizes["channel"], filter_groups)
    w_shape = (F, C // options["groups"]) + kernel
    spatial_options = window_options(options)
    y_shape = op.output_shape(x_shape, w_shape, **options)
    image = {a: sizes[a] for a in ("depth", "height", "width")}
    layouts = cls.layouts(image, p_f, input_whole, options["groups"], op.axes)
    ranks = math.prod(sizes.values())
    coords = [coords_of(r, sizes) for r in range(ranks)]
    holds = []
    for c in coords:
        holds.append({"x": layouts["x"].indices(x_shape, sizes, c), "w": layouts["w"].indices(w_shape, sizes, c),
                      "b": layouts["b"].indices((F,), sizes, c), "y": layouts["y"].indices(y_shape, sizes, c)})
    spatial = math.prod(image.values()) > 1
    halo = halo_plan(x_shape, layouts["x"], tuple(sizes.items()), kernel,
                     tuple(sorted(spatial_options.items()))) if spatial else None
    if spatial:
        check_image_fits(halo, x_shape, ProcessGrid.describe_shape(sizes), name)
    moved = [message_bytes(algorithm, x_shape, w_shape, sizes, c, filter_groups=filter_groups, bias=bias,
                           input_whole=input_whole, need_dx=need_dx, itemsize=itemsize, op=op.name, **options)
             for c in coords]
    order = [m for m, _, _ in moved[0]]
    assert all([m for m, _, _ in mine] == order for mine in moved), "ranks run different collectives"
    assert [m for m in run_order(cls.messages, spatial) if m in order] == order
    e = LayerExplanation(algorithm=algorithm, grid=sizes, ranks=ranks, coords=coords, p_f=p_f, kernel=kernel,
                         options=options, bias=bool(bias), input_whole=input_whole, need_dx=need_dx,
                         itemsize=itemsize, shapes={"x": x_shape, "w": w_shape, "y": tuple(y_shape)},
                         layouts=layouts, holds=holds, halo=halo, steps=[], node_axes=node_axes,
                         processes=processes, ranks_per_node=ranks_per_node,
                         chunks=positive_int(chunks, "chunks"))
    for k, m in enumerate(order):
        e.steps.append(Step(m, [_group(e, m, r) for r in range(ranks)], [moved[r][k][1] for r in range(ranks)],
                            [moved[r][k][2] for r in range(ranks)], [_result(e, m, r) for r in range(ranks)]))
    return e


def _placement(sizes, node_axes, ranks_per_node):
    """(the process of each grid rank, the node axes as the grid orders them or None), after
    checking them as a run would be: ValueError naming the value otherwise."""
    ranks = math.prod(sizes.values())
    placement_order(sizes, node_axes)  # names each bad axis
    if ranks_per_node is not None:
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1 \
                or ranks % ranks_per_node:
            raise ValueError(f"ranks per node {ranks_per_node!r}: expected a positive divisor of the grid's "
                             f"{ranks} ranks")
        check_node_fit(sizes, node_axes, ranks_per_node, ranks // ranks_per_node)
    placed = placed_axes(sizes, node_axes)
    return process_ranks(sizes, node_axes), placed


def _group(e, m, r):
    """The ranks rank r runs message m with (r included), in rank order."""
    c, P_c = e.coords[r], e.grid["channel"]
    if m.group in ("row", "column"):
        members = (gather_group if m.group == "row" else scatter_group)(c["channel"], P_c, e.p_f)
        return sorted(rank_of({**c, "channel": k}, e.grid) for k in members)
    if m.group == "gradient":  # the sample and spatial ranks of one channel coordinate
        return [q for q in range(e.ranks) if e.coords[q]["channel"] == c["channel"]]
    # the halo: the ranks r exchanges pieces with
    pieces = e.halo["pieces"]
    return sorted({r} | {d for s, d, _ in pieces if s == r} | {s for s, d, _ in pieces if d == r})


def _result(e, m, r):
    """(name, serial tensor, global indices) of what rank r holds after message m."""
    held, c = e.holds[r], e.coords[r]
    rows_cols = tuple(e.halo["wanted"][r][2:]) if e.halo else held["x"][2:]  # the rows its windows read
    if m == HALO:
        return "x with its halo", "x", tuple(e.halo["wanted"][r])
    if m == HALO_ADJOINT:
        return "dx", "dx", held["x"]
    if m.collective == "allreduce":
        return "dw (and db) summed", "dwdb", (held["w"], held["b"])
    if m.tensor == "x":
        if m.collective == "allgather":  # the row's channel blocks
            (row,) = Layout((Shard("channel", "row", e.p_f),)).indices((e.shapes["x"][1],), e.grid, c)
            return "x of the row", "x", (held["x"][0], row) + rows_cols
        # dx: on a spatial grid still the extended block, which the halo's adjoint completes
        return ("dx of the extended block", None, (held["x"][0], held["x"][1]) + rows_cols) if e.halo else \
            ("dx", "dx", held["x"])
    if m.collective == "allgather":  # dy of the column's filter blocks
        (column,) = Layout((Shard("channel", "column", e.p_f),)).indices((e.shapes["y"][1],), e.grid, c)
        return "dy of the column", "dy", (held["y"][0], column) + held["y"][2:]
    return "y (summed, before the bias)", "y0", held["y"]


# ---------------------------------------------------------------------------------------------
# A whole model


def explain_model(layers, grid=None, algorithm="y", filter_groups=None, plan=None, itemsize=4, node_axes=None,
                  ranks_per_node=None):
    """[(LayerShape, {"grid", "algorithm", "filter_groups", "node_axes"}, LayerExplanation)] for
    the convolutions of a model (models.layer_shapes), each on `grid` (placed by `node_axes`)
    with `algorithm`, or as `plan` ({layer name: entry}, as train.py --plan reads it: a layer
    it does not list keeps the choice of the layer before, models.plan_choice), on nodes of
    `ranks_per_node` ranks where given. The first layer takes its input whole and computes no
    dx; a 1x1 image (the classifier) is not split over height and width, the spatial ranks
    holding copies, as the model's Linear layer does."""
    from ..models import check_plan, plan_choice
    current = {"grid": grid or "sample=1", "algorithm": algorithm, "filter_groups": filter_groups,
               "node_axes": node_axes}
    if plan is not None:
        ranks = math.prod(ProcessGrid.shape_of(current["grid"]).values()) if grid else None
        first = plan.get(layers[0].name, {}).get("grid")
        ranks = ranks or math.prod(ProcessGrid.shape_of(first or "sample=1").values())
        check_plan(plan, [l.name for l in layers], ranks)
    out = []
    for layer in layers:
        current = plan_choice(current, None if plan is None else plan.get(layer.name))
        spec = ProcessGrid.shape_of(current["grid"])
        if layer.H * layer.W == 1:
            spec.update(height=1, width=1)
        e = explain_layer((layer.N, layer.C, layer.H, layer.W), layer.F, layer.K, current["algorithm"], spec,
                          current["filter_groups"] if current["algorithm"] == "w" else None, stride=layer.stride,
                          padding=layer.pad, dilation=layer.dilation, groups=layer.groups, input_whole=layer.first,
                          need_dx=not layer.first, itemsize=itemsize, node_axes=current["node_axes"],
                          ranks_per_node=ranks_per_node, name=layer.name)
        out.append((layer, dict(current), e))
    return out


def _busiest(e):
    """(bytes sent + received over the pass, memory) of the rank that moves the most."""
    moved = [sum(a + b for a, b in e.bytes(r).values()) for r in range(e.ranks)]
    memory = [sum(e.memory(r).values()) for r in range(e.ranks)]
    return max(moved), max(memory)


def model_table(explained):
    """One line per layer: its shapes, grid and algorithm, the layouts of x, w and y, and the
    busiest rank's bytes moved and memory."""
    nodes = any(e.ranks_per_node is not None for _, _, e in explained)
    rows = [["layer", "x -> y", "grid", "algorithm", "x layout", "w layout", "y layout", "moved/rank", "memory/rank"]
            + ["across nodes"] * nodes]
    for layer, choice, e in explained:
        moved, memory = _busiest(e)
        alg = choice["algorithm"] + (f" p_f={e.p_f}" if choice["algorithm"] == "w" else "")
        grid = ProcessGrid.describe_shape(e.grid) + (f" (node axes: {','.join(e.node_axes)})" if e.node_axes else "")
        rows.append([layer.name, f"{'x'.join(map(str, e.shapes['x'][1:]))} -> {'x'.join(map(str, e.shapes['y'][1:]))}",
                     grid, alg, layout_text(e.layouts["x"], e.grid), layout_text(e.layouts["w"], e.grid),
                     layout_text(e.layouts["y"], e.grid), format_bytes(moved), format_bytes(memory)]
                    + [", ".join(e.across_nodes()) or "-"] * nodes)
    note = ("\n(across nodes: the collectives some of whose groups span nodes, over the link between them)"
            if nodes else "")
    return format_table(rows) + "\n" + MODEL_NOTE + note


MODEL_NOTE = ("(convolutions only: the redistributions between layers of different grids or layouts, batch "
              "norm's statistics and the loss appear in train.py's summary)")


def layout_text(layout, grid):
    """'(sample, channel, -, -)': each dimension's grid axis on this grid ('-': whole)."""
    on = layout.on(grid)
    return "(" + ", ".join("-" if d is None else str(d) for d in on.dims) + ")"
