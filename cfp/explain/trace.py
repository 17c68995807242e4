"""The trace: the real layer run on every rank of an MPI job, each of its collectives set
beside the step of the explanation and the serial tensors (trace_layer, Trace).

`trace_layer` runs the real algorithm on every rank, with a ledger that keeps what each
collective returned, and sets beside each step of the explanation what the code actually did:
the ledger's bytes and group size, the shape of the result and its checksum next to the
checksum of the serial tensors at the explained indices.
"""
import math

import numpy as np

from ..grid import ProcessGrid
from ..report import format_bytes, format_table
from .tables import explain_layer, indices_text, result_text


def _take(a, ix):
    """a at the global indices ix (per dimension)."""
    return a[np.ix_(*[list(i) for i in ix])]


def checksum(a):
    """The sum of a tensor's values (float64): what the trace prints for a tensor."""
    return float(np.asarray(a, dtype=np.float64).sum())


class Trace:
    """What every rank of a run held after each step (trace_layer), with the explanation."""

    def __init__(self, explanation, start, steps, mismatches, processes):
        self.explanation = explanation
        self.processes = processes  # per grid rank: the process (rank of the job) that ran it
        self.start = start  # per rank: {tensor: (shape, checksum, serial checksum)}
        self.steps = steps  # per step, per rank: dict of the ledger record and the result
        self.mismatches = mismatches  # what differs from the explanation or the serial tensors

    def text(self):
        e = self.explanation
        lines = [e.header(), "", "What each rank holds at the start: its blocks (shape, checksum = sum of the values;",
                 "the serial tensors' checksum at the explained indices beside it)"]
        rows = [e.rank_columns() + ["x block", "w shard", "dy block"]]
        for r in range(e.ranks):
            rows.append(e.rank_columns(r) + [_held_text(self.start[r][t]) for t in ("x", "w", "dy")])
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
                padding_mode="zeros", node_axes=None, xp=np):
    """Run one float64 forward and backward pass of the layer explain_layer describes on the
    ranks of `comm` (the grid's size, placed by `node_axes`, its nodes shown where the job has
    several), with values drawn from `seed` (uniform in [0, 1), the same global tensors on
    every rank), and return, on rank 0, a Trace: what each rank held after each collective (the
    ledger's record and a copy of its result) beside the explanation and the serial tensors;
    None on the other ranks. xp: the array module the layer runs on (numpy, or cupy from
    backend.use_device: the tensors are moved there and what the ledger keeps is copied back).
    Collective over comm."""
    from ..algorithms import make_conv
    from ..comm import CommLedger, use_ledger
    from ..kernels import conv2d_backward_data, conv2d_backward_filter, conv2d_forward
    from ..grid import node_layout
    from ..tensor import DistTensor
    per_node, nodes = node_layout(comm)
    e = explain_layer(x_shape, out_channels, kernel_size, algorithm, grid, filter_groups, stride, padding,
                      dilation, groups, bias, input_whole, need_dx, itemsize=8, padding_mode=padding_mode,
                      node_axes=node_axes, ranks_per_node=per_node if nodes > 1 else None)  # one node: no news
    g = ProcessGrid(grid, comm, node_axes=node_axes)
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
        from .. import backend
        with use_ledger(ledger):
            conv.forward(backend.from_host(x_local, xp), backend.from_host(w_local, xp),
                         None if b_local is None else backend.from_host(b_local, xp), input_shape=x.shape)
            conv.backward(backend.from_host(dy_local, xp))
        held = e.holds[g.rank]
        mine = {"start": {t: (tuple(a.shape), checksum(a), checksum(_take(full, held[k])))
                          for t, a, full, k in (("x", x_local, x, "x"), ("w", w_local, w, "w"),
                                                ("dy", dy_local, dy, "y"))},
                "shards": (list(conv.w_filters), list(conv.w_channels), list(conv.b_filters)),
                "process": comm.Get_rank(),
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
        # by grid rank, as the explanation counts them (grid rank 0, at coordinates 0, is process 0)
        every = g.comm.gather(mine, root=0)
    finally:
        g.free()
    if comm.Get_rank() != 0:
        return None
    return Trace(e, [m["start"] for m in every], _by_step(every, e), _mismatches(e, every, bias),
                 [m["process"] for m in every])


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
        if mine["process"] != e.processes[r]:
            out.append(f"rank {r}: held by process {mine['process']}, explained on process {e.processes[r]}")
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
