"""Who holds what, and what moves between whom: one distributed convolution described rank by
rank, for learners (docs/design.md, section 9; scripts/explain.py).

`explain_layer` needs no MPI run. It reads everything from the descriptions the layer itself
runs, never from a second copy:
- the layouts of x, w, b and y (ConvAlgorithm.layouts, through layout.Layout.indices), so each
  rank's global index ranges are the shards the code holds;
- the algorithm's collectives in run order (algorithms.base.run_order, the halo exchange and
  its adjoint on a spatial grid), with each rank's bytes (perfmodel.message_bytes, which
  predict_bytes sums), its group of ranks (partition.gather_group / scatter_group, the
  splits grid.ProcessGrid makes) and the tensor it holds after the step.

`trace_layer` runs the real algorithm on every rank of an MPI job, with a ledger that keeps
what each collective returned, and sets beside each step of the explanation what the code
actually did: the ledger's bytes and group size, the shape of the result and its checksum
next to the checksum of the serial tensors at the explained indices. `plot_layer` draws the
explanation for a slide; `explain_model` tabulates a model's layers under a grid or a plan.
"""
import dataclasses
import math

import numpy as np

from .algorithms import algorithm_class
from .algorithms.base import HALO, HALO_ADJOINT, check_image_fits, halo_plan, run_order
from .checks import int_pair
from .grid import AXES, ProcessGrid, coords_of, rank_of
from .kernels import conv2d_output_shape, conv_options
from .layout import Layout, Shard
from .partition import filter_groups_of, gather_group, scatter_group
from .perfmodel import PHASES, message_bytes
from .report import format_bytes, format_table

# what each dimension of a tensor is called in the tables
DIMS = {"x": "samples, channels, rows, columns", "w": "filters, channels", "b": "filters",
        "y": "samples, filters, rows, columns"}


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
            what = "the halo rows and columns of x" if m.tensor == "x" else "the gradient of the halo back (adjoint)"
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

    def header(self):
        p_f = f" (p_f={self.p_f})" if self.algorithm == "w" else ""
        k = "x".join(map(str, self.kernel))
        return (f"layer: x {self.shapes['x']} -> y {self.shapes['y']}, w {self.shapes['w']}, kernel {k}, "
                f"{self.option_text()}; algorithm {self.algorithm}{p_f} on grid "
                f"{ProcessGrid.describe_shape(self.grid)} ({self.ranks} rank{'s' * (self.ranks > 1)}), "
                f"{self.itemsize * 8}-bit floats")

    def option_text(self):
        o = self.options
        text = f"stride {pair(o['stride'])}, padding {pair(o['padding'])}"
        if o["dilation"] != (1, 1):
            text += f", dilation {pair(o['dilation'])}"
        if o["groups"] > 1:
            text += f", groups {o['groups']}"
        if o["padding_mode"] != "zeros":
            text += f", padding mode {o['padding_mode']}"
        if self.input_whole:
            text += ", input whole (a first layer)"
        if not self.need_dx:
            text += ", no dx"
        return text

    def holds_table(self):
        rows = [["rank", "coords", "x", "w", "y"]]
        for r in range(self.ranks):
            held = self.holds[r]
            rows.append([str(r), coords_text(self.coords[r], self.grid), indices_text("x", held["x"]),
                         indices_text("w", held["w"][:2]), indices_text("y", held["y"])])
        return format_table(rows)

    def steps_text(self):
        lines = []
        if not self.steps:
            lines.append("(no collective: every rank computes alone)")
        for k, step in enumerate(self.steps, 1):
            groups = " ".join("{" + ",".join(map(str, g)) + "}" for g in step.group_sets())
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

    def text(self):
        return "\n".join([
            self.header(), "",
            "Who holds what: global index ranges start:stop (a+b: a union of blocks),",
            f"  x[{DIMS['x']}], w[{DIMS['w']}], y[{DIMS['y']}]; dx, dw, dy as x, w, y",
            self.holds_table(), "",
            "The steps of one forward and backward pass, in the order the layer runs them",
            self.steps_text(), "",
            "Bytes sent / received per rank and phase (perfmodel.predict_bytes), and the memory each rank holds",
            self.bytes_table()])


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
                  padding_mode="zeros"):
    """A LayerExplanation of the convolution of a global x of x_shape (N, C, H, W) into
    out_channels filters under `algorithm` ('sample', 'x', 'y', 'w') on `grid` (a spec such as
    'sample=2,channel=2' or {axis: size}), with nn.Conv2d's options, for every rank. (The
    padding mode moves nothing more unless the grid splits the image: then the halo also
    brings the rows the padded border copies.)"""
    sizes = ProcessGrid.shape_of(grid)
    x_shape = tuple(int(n) for n in x_shape)
    kernel = int_pair(kernel_size, "kernel_size", 1, "a positive integer")
    options = conv_options(stride, padding, dilation, groups, padding_mode)
    cls = algorithm_class(algorithm, options["groups"])
    C, F = x_shape[1], int(out_channels)
    p_f = filter_groups_of(algorithm, sizes["channel"], filter_groups)
    w_shape = (F, C // options["groups"]) + kernel
    spatial_options = {k: v for k, v in options.items() if k != "groups"}
    y_shape = conv2d_output_shape(x_shape, w_shape, **options)
    image = {"height": sizes["height"], "width": sizes["width"]}
    layouts = cls.layouts(image, p_f, input_whole, options["groups"])
    ranks = math.prod(sizes.values())
    coords = [coords_of(r, sizes) for r in range(ranks)]
    holds = []
    for c in coords:
        holds.append({"x": layouts["x"].indices(x_shape, sizes, c), "w": layouts["w"].indices(w_shape, sizes, c),
                      "b": layouts["b"].indices((F,), sizes, c), "y": layouts["y"].indices(y_shape, sizes, c)})
    spatial = image["height"] * image["width"] > 1
    halo = halo_plan(x_shape, layouts["x"], tuple(sizes.items()), kernel,
                     tuple(sorted(spatial_options.items()))) if spatial else None
    if spatial:
        check_image_fits(halo, x_shape, ProcessGrid.describe_shape(sizes), "layer")
    moved = [message_bytes(algorithm, x_shape, w_shape, sizes, c, filter_groups=filter_groups, bias=bias,
                           input_whole=input_whole, need_dx=need_dx, itemsize=itemsize, **options)
             for c in coords]
    order = [m for m, _, _ in moved[0]]
    assert all([m for m, _, _ in mine] == order for mine in moved), "ranks run different collectives"
    assert [m for m in run_order(cls.messages, spatial) if m in order] == order
    e = LayerExplanation(algorithm=algorithm, grid=sizes, ranks=ranks, coords=coords, p_f=p_f, kernel=kernel,
                         options=options, bias=bool(bias), input_whole=input_whole, need_dx=need_dx,
                         itemsize=itemsize, shapes={"x": x_shape, "w": w_shape, "y": tuple(y_shape)},
                         layouts=layouts, holds=holds, halo=halo, steps=[])
    for k, m in enumerate(order):
        e.steps.append(Step(m, [_group(e, m, r) for r in range(ranks)], [moved[r][k][1] for r in range(ranks)],
                            [moved[r][k][2] for r in range(ranks)], [_result(e, m, r) for r in range(ranks)]))
    return e


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
# The trace: the real algorithm under MPI, set beside its explanation


def _take(a, ix):
    """a at the global indices ix (per dimension)."""
    return a[np.ix_(*[list(i) for i in ix])]


def checksum(a):
    """The sum of a tensor's values (float64): what the trace prints for a tensor."""
    return float(np.asarray(a, dtype=np.float64).sum())


class Trace:
    """What every rank of a run held after each step (trace_layer), with the explanation."""

    def __init__(self, explanation, start, steps, mismatches):
        self.explanation = explanation
        self.start = start  # per rank: {tensor: (shape, checksum, serial checksum)}
        self.steps = steps  # per step, per rank: dict of the ledger record and the result
        self.mismatches = mismatches  # what differs from the explanation or the serial tensors

    def text(self):
        e = self.explanation
        lines = [e.header(), "", "What each rank holds at the start: its blocks (shape, checksum = sum of the values;",
                 "the serial tensors' checksum at the explained indices beside it)"]
        rows = [["rank", "x block", "w shard", "dy block"]]
        for r in range(e.ranks):
            rows.append([str(r)] + [_held_text(self.start[r][t]) for t in ("x", "w", "dy")])
        lines.append(format_table(rows))
        lines += ["", "After each step, from the ledger and what the collective returned"]
        for k, (step, done) in enumerate(zip(e.steps, self.steps), 1):
            lines.append(f"{k}. {step.title()} (ledger: {done[0]['collective']} over {done[0]['group_size']} "
                         f"rank{'s' * (done[0]['group_size'] > 1)})")
            rows = [["rank", "sent", "received", "holds", "shape", "checksum", "serial"]]
            for r in range(e.ranks):
                d = done[r]
                rows.append([str(r), format_bytes(d["sent"]), format_bytes(d["received"]),
                             result_text(step.result[r]), "x".join(map(str, d["shape"])), f"{d['checksum']:.6g}",
                             "-" if d["serial"] is None else f"{d['serial']:.6g}"])
            lines.extend("   " + line for line in format_table(rows).splitlines())
        lines.append("")
        if self.mismatches:
            lines.append(f"{len(self.mismatches)} difference(s) from the explanation:")
            lines.extend("  " + m for m in self.mismatches)
        else:
            lines.append("Every step ran as explained: the same collectives, groups, bytes and index ranges, "
                         "and every block equals the serial tensors there.")
        return "\n".join(lines)


def _held_text(item):
    shape, value, serial = item
    return f"{'x'.join(map(str, shape))} sum {value:.6g} (serial {serial:.6g})"


def _close(a, b):
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


def trace_layer(comm, x_shape, out_channels, kernel_size, algorithm, grid, filter_groups=None, stride=1,
                padding=0, dilation=1, groups=1, bias=True, input_whole=False, need_dx=True, seed=0,
                padding_mode="zeros"):
    """Run one float64 forward and backward pass of the layer explain_layer describes on the
    ranks of `comm` (the grid's size), with values drawn from `seed` (uniform in [0, 1), the
    same global tensors on every rank), and return, on rank 0, a Trace: what each rank held
    after each collective (the ledger's record and a copy of its result) beside the
    explanation and the serial tensors; None on the other ranks. Collective over comm."""
    from .algorithms import make_conv
    from .comm import CommLedger, use_ledger
    from .kernels import conv2d_backward_data, conv2d_backward_filter, conv2d_forward
    from .tensor import DistTensor
    e = explain_layer(x_shape, out_channels, kernel_size, algorithm, grid, filter_groups, stride, padding,
                      dilation, groups, bias, input_whole, need_dx, itemsize=8, padding_mode=padding_mode)
    g = ProcessGrid(grid, comm)
    try:
        options = dict(e.options)
        conv = make_conv(algorithm, g, e.shapes["x"][1], out_channels, e.kernel, filter_groups=filter_groups,
                         bias=bias, input_whole=input_whole, need_dx=need_dx, layer="conv", **options)
        rng = np.random.default_rng(seed)
        x, w, b, dy = (rng.random(s) for s in (e.shapes["x"], e.shapes["w"], (out_channels,), e.shapes["y"]))
        serial = {"x": x, "dy": dy, "y0": conv2d_forward(x, w, None, **options),
                  "dx": conv2d_backward_data(dy, w, x.shape, **options),
                  "dw": conv2d_backward_filter(x, dy, w.shape, **options), "db": dy.sum(axis=(0, 2, 3))}
        x_local = DistTensor.from_global(x, conv.input_layout, g).local
        dy_local = DistTensor.from_global(dy, conv.output_layout, g).local
        w_local, b_local = conv.shard_weight(w), conv.shard_bias(b) if bias else None
        ledger = CommLedger(keep_results=True)
        with use_ledger(ledger):
            conv.forward(x_local, w_local, b_local, input_shape=x.shape)
            conv.backward(dy_local)
        held = e.holds[g.rank]
        mine = {"start": {t: (tuple(a.shape), checksum(a), checksum(_take(full, held[k])))
                          for t, a, full, k in (("x", x_local, x, "x"), ("w", w_local, w, "w"),
                                                ("dy", dy_local, dy, "y"))},
                "shards": (list(conv.w_filters), list(conv.w_channels), list(conv.b_filters)),
                "steps": []}
        for record, result, step in zip(ledger.records, ledger.results, e.steps + [None] * len(ledger.records)):
            tensor, ix = (step.result[g.rank][1], step.result[g.rank][2]) if step else (None, None)
            if tensor == "dwdb":
                expected = checksum(_take(serial["dw"], ix[0])) + (checksum(serial["db"][list(ix[1])]) if bias else 0)
            else:
                expected = None if tensor is None else checksum(_take(serial[tensor], ix))
            mine["steps"].append({"phase": record.phase, "collective": record.collective,
                                  "group_size": record.group_size, "sent": record.bytes_sent,
                                  "received": record.bytes_received,
                                  "shape": tuple(result.shape) if result is not None else (),
                                  "checksum": checksum(result) if result is not None else float("nan"),
                                  "serial": expected})
    finally:
        g.free()
    every = comm.gather(mine, root=0)
    if comm.Get_rank() != 0:
        return None
    return Trace(e, [m["start"] for m in every], _by_step(every, e), _mismatches(e, every, bias))


def _by_step(every, e):
    steps = max(len(m["steps"]) for m in every)
    return [[m["steps"][k] if k < len(m["steps"]) else None for m in every] for k in range(steps)]


def _mismatches(e, every, bias):
    """Where the run differs from its explanation: another number of collectives, another
    collective, group size or byte count at a step, a result of another shape or whose values
    are not the serial tensor's at the explained indices, or shards the code holds elsewhere."""
    out = []
    for r, mine in enumerate(every):
        held = e.holds[r]
        filters, channels, bias_filters = mine["shards"]
        if (filters, channels) != (list(held["w"][0]), list(held["w"][1])) or bias_filters != list(held["b"][0]):
            out.append(f"rank {r}: the layer's weight shard is not the explained w{held['w'][:2]}")
        for t, (shape, value, serial) in mine["start"].items():
            explained = tuple(len(i) for i in held[{"dy": "y"}.get(t, t)])
            if shape != explained or not _close(value, serial):
                out.append(f"rank {r}: its {t} block {shape} differs from the explained one {explained}")
        if len(mine["steps"]) != len(e.steps):
            out.append(f"rank {r}: ran {len(mine['steps'])} collectives, the explanation has {len(e.steps)}")
            continue
        for k, (done, step) in enumerate(zip(mine["steps"], e.steps), 1):
            m = step.message
            what, tensor, ix = step.result[r]
            if tensor == "dwdb":  # the flattened dw and db shards
                size = math.prod(len(i) for i in ix[0]) + (len(ix[1][0]) if bias else 0)
            else:
                size = math.prod(len(i) for i in ix)
            checks = [(done["phase"], m.phase, "phase"), (done["collective"], m.collective, "collective"),
                      (done["sent"], step.sent[r], "bytes sent"), (done["received"], step.received[r], "bytes received"),
                      (math.prod(done["shape"]), size, "result size")]
            if m.phase != "halo":  # the halo's all-to-all spans the grid; its group is the ranks it trades with
                checks.append((done["group_size"], len(step.groups[r]), "group size"))
            for got, explained, name in checks:
                if got != explained:
                    out.append(f"rank {r}, step {k} ({step.title()}): {name} {got}, explained {explained}")
            if done["serial"] is not None and not _close(done["checksum"], done["serial"]):
                out.append(f"rank {r}, step {k} ({step.title()}): {what} sums to {done['checksum']:.12g}, the serial "
                           f"tensor at {indices_text('', ix) if tensor != 'dwdb' else 'its shard'} to {done['serial']:.12g}")
    return out


# ---------------------------------------------------------------------------------------------
# Pictures

DIM_NAMES = {"x": ("samples", "channels", "rows", "columns"), "y": ("samples", "filters", "rows", "columns"),
             "w": ("filters", "channels")}
MAX_CELLS = 32  # a longer dimension is drawn in bins of equal length


def _drawn_dims(e, family):
    """The two dimensions of an x- or y-like tensor a picture shows: those the grid splits
    (samples, then channels or filters, then rows and columns), filled up in that order."""
    if family == "w":
        return (0, 1)
    layout = e.layouts[family]
    split = [d for d, s in enumerate(layout.dims) if s is not None and e.grid[s.axis] > 1]
    return tuple(sorted((split + [d for d in (0, 1, 2, 3) if d not in split])[:2]))


def _family(tensor):
    """Which of x, y, w a step's result is drawn like."""
    if tensor == "dwdb":
        return "w"
    return "y" if tensor in ("y0", "dy") else "x"


def _draw(ax, e, family, ixs, title, colours):
    """A tensor as a matrix of cells over two of its dimensions, each cell striped with the
    colours of the ranks holding some of it (ixs[r]: rank r's global indices)."""
    from matplotlib.patches import Rectangle
    shape = e.shapes[family]
    a, b = _drawn_dims(e, family)
    bins = [max(1, math.ceil(shape[d] / MAX_CELLS)) for d in (a, b)]
    rows, cols = math.ceil(shape[a] / bins[0]), math.ceil(shape[b] / bins[1])
    sets = [(set(ix[a]), set(ix[b])) for ix in ixs]
    for i in range(rows):
        for j in range(cols):
            holders = [r for r, (sa, sb) in enumerate(sets)
                       if sa & set(range(i * bins[0], (i + 1) * bins[0])) and sb & set(range(j * bins[1], (j + 1) * bins[1]))]
            for k, r in enumerate(holders):
                ax.add_patch(Rectangle((j + k / len(holders), rows - 1 - i), 1 / len(holders), 1,
                                       facecolor=colours[r], edgecolor="none"))
            ax.add_patch(Rectangle((j, rows - 1 - i), 1, 1, facecolor="none" if holders else "#eeeeee",
                                   edgecolor="white", linewidth=0.8))
    ax.set_xlim(0, cols)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    names = DIM_NAMES[family]
    ax.set_xlabel(f"{names[b]} ({shape[b]})" + (f", bins of {bins[1]}" if bins[1] > 1 else ""), fontsize=8)
    ax.set_ylabel(f"{names[a]} ({shape[a]})" + (f", bins of {bins[0]}" if bins[0] > 1 else ""), fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title, fontsize=9)


def _brackets(ax, step, colours):
    """The step's groups under the matrix: each group's ranks as coloured squares over a bracket,
    with the bytes each rank sends and receives beside."""
    from matplotlib.patches import Rectangle
    x = 0.0
    size = 0.07
    for group in step.group_sets():
        for r in group:
            ax.add_patch(Rectangle((x, -0.30), size, size, transform=ax.transAxes, clip_on=False,
                                   facecolor=colours[r]))
            ax.text(x + size / 2, -0.30 + size / 2, str(r), transform=ax.transAxes, fontsize=7,
                    ha="center", va="center", color="white", weight="bold")
            x += size + 0.01
        ax.plot([x - len(group) * (size + 0.01), x - 0.01], [-0.33, -0.33], transform=ax.transAxes,
                clip_on=False, color="black", linewidth=1.2)
        x += 0.05
    moved = sorted({(step.sent[r], step.received[r]) for r in range(len(step.sent))})
    text = ("each rank sends {} and receives {}".format(*map(format_bytes, moved[0])) if len(moved) == 1 else
            "; ".join(f"r{r}: {format_bytes(step.sent[r])}/{format_bytes(step.received[r])}"
                      for r in range(len(step.sent))))
    ax.text(0, -0.37, text, transform=ax.transAxes, fontsize=7, va="top", wrap=True)


def plot_layer(e, path):
    """A PNG of the explanation: who holds what, then one panel per step with the tensor it
    leaves each rank, its groups and their bytes. Written atomically."""
    import textwrap

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from .io import save_figure
    colours = [plt.get_cmap("tab10")(r % 10) for r in range(e.ranks)]
    panels = [("x", "x", [h["x"] for h in e.holds], "x: who holds what"),
              ("w", "w", [h["w"] for h in e.holds], "w (and b): who holds what"),
              ("y", "y", [h["y"] for h in e.holds], "y: who holds what")]
    for k, step in enumerate(e.steps, 1):
        what, tensor, _ = step.result[0]
        ixs = [s[2][0] if s[1] == "dwdb" else s[2] for s in step.result]
        family = _family(tensor)
        panels.append((family, step, ixs, f"{k}. {step.title()}\nthen: {what}"))
    columns = 3
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 4.4 * rows), squeeze=False)
    for ax, (family, step, ixs, title) in zip(axes.flat, panels):
        _draw(ax, e, family, ixs, "\n".join(textwrap.fill(t, 46) for t in title.split("\n")), colours)
        if isinstance(step, Step):
            _brackets(ax, step, colours)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    legend = [Patch(color=colours[r], label=f"rank {r} ({coords_text(e.coords[r], e.grid)})")
              for r in range(e.ranks)]
    fig.legend(handles=legend, loc="upper right", fontsize=8, ncol=min(4, e.ranks))
    fig.suptitle(textwrap.fill(e.header(), 110), fontsize=10, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.93), h_pad=6.0)
    save_figure(path, fig, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# A whole model


def explain_model(layers, grid=None, algorithm="y", filter_groups=None, plan=None, itemsize=4):
    """[(LayerShape, {"grid", "algorithm", "filter_groups"}, LayerExplanation)] for the
    convolutions of a model (models.layer_shapes), each on `grid` with `algorithm`, or as
    `plan` ({layer name: entry}, as train.py --plan reads it: a layer it does not list keeps
    the choice of the layer before, models.plan_choice). The first layer takes its input whole
    and computes no dx; a 1x1 image (the classifier) is not split over height and width, the
    spatial ranks holding copies, as the model's Linear layer does."""
    from .models import check_plan, plan_choice
    current = {"grid": grid or "sample=1", "algorithm": algorithm, "filter_groups": filter_groups}
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
                          need_dx=not layer.first, itemsize=itemsize)
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
    rows = [["layer", "x -> y", "grid", "algorithm", "x layout", "w layout", "y layout", "moved/rank", "memory/rank"]]
    for layer, choice, e in explained:
        moved, memory = _busiest(e)
        alg = choice["algorithm"] + (f" p_f={e.p_f}" if choice["algorithm"] == "w" else "")
        grid = ProcessGrid.describe_shape(e.grid)
        rows.append([layer.name, f"{'x'.join(map(str, e.shapes['x'][1:]))} -> {'x'.join(map(str, e.shapes['y'][1:]))}",
                     grid, alg, layout_text(e.layouts["x"], e.grid), layout_text(e.layouts["w"], e.grid),
                     layout_text(e.layouts["y"], e.grid), format_bytes(moved), format_bytes(memory)])
    return format_table(rows) + "\n" + MODEL_NOTE


MODEL_NOTE = ("(convolutions only: the redistributions between layers of different grids or layouts, batch "
              "norm's statistics and the loss appear in train.py's summary)")


def layout_text(layout, grid):
    """'(sample, channel, -, -)': each dimension's grid axis on this grid ('-': whole)."""
    on = layout.on(grid)
    return "(" + ", ".join("-" if d is None else str(d) for d in on.dims) + ")"


def plot_model(explained, path):
    """A PNG strip: per layer, the busiest rank's bytes by phase and its memory, labelled with
    the layer's grid and algorithm. Written atomically."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from .io import save_figure
    names = [f"{layer.name}\n{c['algorithm']} on {ProcessGrid.describe_shape(e.grid)}" for layer, c, e in explained]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6, 1.25 * len(names)), 6.5), sharex=True)
    base = np.zeros(len(names))
    for phase in PHASES:
        values = []
        for _, _, e in explained:
            moved = [e.bytes(r)[phase] for r in range(e.ranks)]
            values.append(max(a + b for a, b in moved) / 2 ** 10)
        if any(values):
            top.bar(range(len(names)), values, bottom=base, label=phase)
            base += values
    top.set_ylabel("KiB sent + received\n(busiest rank)")
    top.legend(fontsize=8)
    top.set_title("What each layer moves and holds per rank (one forward and backward pass)")
    bottom.bar(range(len(names)), [_busiest(e)[1] / 2 ** 10 for _, _, e in explained], color="grey")
    bottom.set_ylabel("KiB held\n(busiest rank)")
    bottom.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
    fig.tight_layout()
    save_figure(path, fig, dpi=100)
    plt.close(fig)
