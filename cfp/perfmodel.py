"""The cost model of the convolution algorithms: bytes each rank sends and receives per phase,
and predicted time and memory per rank from a machine profile (docs/design.md section 4).

Bytes are worked out from shapes alone (never from the ledger): every block from the layer's
own layouts (ConvAlgorithm.layouts, through Layout.indices) and every collective from its
algorithm's `messages`, so that the ledger of a real run can be checked against them exactly.
The byte convention is comm.py's: each element counted where it leaves a rank and where it
arrives, never a rank's own block.
"""
import bisect
import dataclasses
import functools
import math
import os
import re

from .algorithms import algorithm_class
from .algorithms.base import (HALO, HALO_ADJOINT, by_features, chunks_fit, feature_chunk_limit, feature_chunk_tensors,
                              message_sent, run_order)
from .comm import PHASES as LEDGER_PHASES
from .grid import AXES, coords_of, parse_grid_spec, process_ranks, rank_of
from .io import load_json
from .halo import halo_plan, window_options, window_spans
from .layout import piece_size
from .kernels.conv import conv_op
from .kernels.conv.geometry import geometry_flops
from .kernels.conv.volume import copied_elements
from .kernels.conv.paths import PASSES, geometry_key, pass_bytes, rate_key  # the kernel path table: its passes and its choice
from .partition import block_sizes, gather_group, scatter_group

PHASES = tuple(p for p in LEDGER_PHASES if p != "other")  # the phases predictions cover


def _allgather(sizes, me, unit):
    """(sent, received) by member `me` of an allgather of blocks `sizes` (in units of `unit` bytes)."""
    own = sizes[me]
    return (len(sizes) - 1) * own * unit, (sum(sizes) - own) * unit


def _reduce_scatter(sizes, me, unit):
    sent, received = _allgather(sizes, me, unit)
    return received, sent


def _allreduce(count, p, me, itemsize):
    own = block_sizes(count, p)[me]
    moved = ((count - own) + (p - 1) * own) * itemsize
    return moved, moved


def predict_bytes(algorithm, x_shape, w_shape, grid, coords, stride=1, padding=0,
                  filter_groups=None, bias=True, input_whole=False, need_dx=True, itemsize=8,
                  dilation=1, groups=1, padding_mode="zeros", op="conv2d", output_padding=0):
    """{phase: (bytes sent, bytes received)} of one forward and backward pass of a convolution:
    the sums over message_bytes, which takes the same arguments.

    x_shape (N, C, H, W) and w_shape (F, C, Kh, Kw) are global; `grid` is a spec or dict of
    axis sizes ('sample=2,channel=2'); `coords` the rank's {'sample': s, 'channel': c}.
    With one algorithm, p_f = 1 is stationary-x's and p_f = P_c stationary-y's data movement:
    forward, allgather x within a row of p_f ranks and reduce-scatter y within a column of q;
    backward-filter, allgather dy within the column; backward-data, reduce-scatter dx within
    the row; gradient-sync, allreduce the dw and db shards over the P_n ranks sharing them.
    input_whole: x holds all C channels (no gather); need_dx=False: no backward-data (both
    so for the network's first layer). w_shape is (F, C/groups, Kh, Kw); a grouped layer under
    channel/filter parallelism moves only its gradient (algorithms/grouped.py). op: the kind
    of convolution (kernels/conv/ops.py; a volume's x_shape is (N, C, D, H, W), a transposed
    convolution's w_shape in the convolution's orientation (F, C/groups, *K)), output_padding
    a transposed one's.
    """
    out = {phase: (0, 0) for phase in PHASES}
    for m, sent, received in message_bytes(algorithm, x_shape, w_shape, grid, coords, stride, padding,
                                           filter_groups, bias, input_whole, need_dx, itemsize,
                                           dilation, groups, padding_mode, op, output_padding):
        out[m.phase] = (out[m.phase][0] + sent, out[m.phase][1] + received)
    return out


def message_bytes(algorithm, x_shape, w_shape, grid, coords, stride=1, padding=0,
                  filter_groups=None, bias=True, input_whole=False, need_dx=True, itemsize=8,
                  dilation=1, groups=1, padding_mode="zeros", op="conv2d", output_padding=0):
    """[(Message, bytes sent, bytes received)]: each collective the rank at `coords` takes
    part in during one forward and backward pass, in the order the layer runs them
    (algorithms.base.run_order: the halo exchange on a spatial grid, the algorithm's
    `messages` that are sent, the halo's adjoint when dx is computed). Arguments as
    predict_bytes."""
    cls = algorithm_class(algorithm, groups)
    sizes = parse_grid_spec(grid)
    shape = {a: sizes.get(a, 1) for a in AXES}
    coords = {a: coords.get(a, 0) for a in AXES}
    P_c = shape["channel"]
    p_f = cls.filter_groups(P_c, filter_groups)
    op = conv_op(op)
    options = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
    options.update(output_padding=output_padding) if op.transposed else options.update(padding_mode=padding_mode)
    y_shape = op.output_shape(x_shape, w_shape, **options)
    # every block as the layer holds it: its layouts' index sets (Layout.indices)
    layouts = cls.layouts({a: shape[a] for a in ("depth", "height", "width")}, p_f, input_whole, groups, op.axes)
    x_ix = layouts["x"].indices(x_shape, shape, coords)
    y_ix = layouts["y"].indices(y_shape, shape, coords)
    halo = None
    if shape["depth"] * shape["height"] * shape["width"] > 1:  # x's block extended by its halo first
        halo = _halo(layouts["x"], x_shape, w_shape, shape, **window_options(options))
        x_ix = halo["wanted"][rank_of(coords, shape)]
    # Per tensor of a message, the elements of one channel block of this rank's samples and
    # (extended) rows and columns: the member at channel coordinate k holds `channels(k)` of them.
    per_channel = {"x": math.prod(len(ix) for i, ix in enumerate(x_ix) if i != 1),
                   "y": math.prod(len(ix) for i, ix in enumerate(y_ix) if i != 1)}
    channels = {"x": lambda k: len(layouts["x"].indices(x_shape, shape, {**coords, "channel": k})[1]),
                "y": lambda k: len(layouts["y"].indices(y_shape, shape, {**coords, "channel": k})[1])}
    members = {"row": gather_group(coords["channel"], P_c, p_f), "column": scatter_group(coords["channel"], P_c, p_f)}
    # the gradient allreduce: this rank's weight and bias shards, over the ranks holding the
    # same ones (the sample and spatial ranks of its channel coordinate), in rank order
    w_count = math.prod(layouts["w"].local_shape(w_shape, shape, coords))
    w_count += math.prod(layouts["b"].local_shape((w_shape[0],), shape, coords)) if bias else 0
    sharing = [r for r in range(math.prod(shape.values())) if coords_of(r, shape)["channel"] == coords["channel"]]
    out = []
    for m in run_order(cls.messages, halo is not None):
        if m == HALO:
            out.append((m,) + _halo_bytes(halo, shape, coords, itemsize))
        elif m == HALO_ADJOINT:
            if need_dx:  # the adjoint sends the same pieces back
                out.append((m,) + _halo_bytes(halo, shape, coords, itemsize)[::-1])
        elif message_sent(m, input_whole, need_dx):
            if m.collective == "allreduce":
                moved = _allreduce(w_count, len(sharing), sharing.index(rank_of(coords, shape)), itemsize)
            else:
                group = members[m.group]
                collective = _allgather if m.collective == "allgather" else _reduce_scatter
                moved = collective([channels[m.tensor](k) for k in group], group.index(coords["channel"]),
                                   per_channel[m.tensor] * itemsize)
            out.append((m,) + tuple(moved))
    return out


def _halo(layout, x_shape, w_shape, shape, **options):
    """The layer's halo exchange of its input laid out by `layout` on a grid of `shape`
    (halo.halo_plan, what the algorithm runs)."""
    return halo_plan(tuple(x_shape), layout, tuple(shape.items()), tuple(w_shape[2:]), tuple(sorted(options.items())))


def _halo_bytes(plan, sizes, coords, itemsize):
    """(sent, received) of the halo exchange (its adjoint moves the same pieces back)."""
    rank = rank_of(coords, sizes)
    sent = sum(piece_size(p) for s, d, p in plan["pieces"] if s == rank and d != rank) * itemsize
    received = sum(piece_size(p) for s, d, p in plan["pieces"] if d == rank and s != rank) * itemsize
    return sent, received


def redistribute_bytes(global_shape, source, target, rank, itemsize=8):
    """(bytes sent, bytes received) by `rank` in the exchange of a tensor of `global_shape`
    from spec `source` to spec `target` ((grid, layout) pairs; a grid or its {axis: size}):
    the pieces of layout.exchange_plan that leave or reach the rank, never its own."""
    from .layout import exchange_plan, piece_size
    (s_grid, s_layout), (t_grid, t_layout) = source, target
    ranks = math.prod(getattr(s_grid, "shape", s_grid).values())
    sent = received = 0
    for s, d, piece in exchange_plan(global_shape, s_layout, s_grid, t_layout, t_grid, ranks):
        if s != d and s == rank:
            sent += piece_size(piece)
        if s != d and d == rank:
            received += piece_size(piece)
    return sent * itemsize, received * itemsize


def ledger_bytes(ledger, layer=None):
    """{phase: (sent, received)} from a CommLedger, in the shape predict_bytes returns."""
    out = {phase: (0, 0) for phase in PHASES}
    for r in ledger.records:
        if (layer is None or r.layer == layer) and r.phase in out:
            sent, received = out[r.phase]
            out[r.phase] = (sent + r.bytes_sent, received + r.bytes_received)
    return out


# ---------------------------------------------------------------------------------------------
# Time and memory: the alpha-beta-gamma model of docs/design.md section 4, with the constants of a
# machine profile (measured by scripts/calibrate.py, or a built-in reference profile).

COLLECTIVES = ("allgather", "reduce_scatter", "allreduce", "alltoall")
PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """One convolution: global batch N, C -> F channels, H x W input (a volume's D x H x W), a
    K x K (x K) kernel, and nn.Conv2d's stride, padding, dilation and groups (each filter sees
    C / groups channels), alike on every axis; `op` its kind (kernels/conv/ops.py), D a
    volume's depth, output_padding a transposed convolution's."""
    name: str
    N: int
    C: int
    F: int
    H: int
    W: int
    K: int
    stride: int = 1
    padding: int = None  # default dilation * (K // 2)
    first: bool = False  # the network's first layer: its input whole over the channel axis, no dx
    normed: bool = False  # followed by batch norm and ReLU, which keep x-hat and a mask of its output
    # the other layers after it, in order, whose time the step adds: "relu", "maxpool", "add"
    # (a residual sum), "upsample" (nearest, by 2), "loss" (the global pool, the classifier and
    # the loss after the last one)
    after: tuple = ()
    dilation: int = 1
    groups: int = 1
    # Where a layer is not fed by the one before it in the list: the name of the layer whose
    # output is its input (a residual block's projection reads the block's input), and the
    # name of the layer whose output its own is added to (a residual sum of two branches that
    # may lie on different grids: the shortcut is redistributed to the body's layout).
    reads: str = None
    merges: str = None
    op: str = "conv2d"  # 'conv2d', 'conv3d', 'conv_transpose2d' or 'conv_transpose3d'
    D: int = None  # a volume's depth (conv3d, conv_transpose3d); None for an image
    output_padding: int = 0  # a transposed convolution's

    def __post_init__(self):
        volume = conv_op(self.op).axes == 3
        if volume != (self.D is not None):
            raise ValueError(f"layer {self.name}: a {self.op} layer " + (
                "needs the depth D of its volume" if volume else f"has no depth (D={self.D})"))

    @property
    def pad(self):
        return self.dilation * (self.K // 2) if self.padding is None else self.padding

    @property
    def spatial(self):
        """The input's size per spatial axis: (H, W), a volume's (D, H, W)."""
        return ((self.D,) if self.D is not None else ()) + (self.H, self.W)

    @property
    def x_shape(self):
        return (self.N, self.C) + self.spatial

    @property
    def w_shape(self):
        """(F, C / groups, K, K[, K]): in the convolution's orientation, transposed ones too."""
        return (self.F, self.C // self.groups) + (self.K,) * len(self.spatial)

    @property
    def options(self):
        """The layer's options as its kind's passes take them (ConvOp.options: checked)."""
        op = conv_op(self.op)
        extra = {"output_padding": self.output_padding} if op.transposed else {}
        return op.options(stride=self.stride, padding=self.pad, dilation=self.dilation, groups=self.groups, **extra)

    @functools.cached_property
    def out_size(self):
        """The output's size per spatial axis (the kind's own output_shape)."""
        return tuple(conv_op(self.op).output_shape(self.x_shape, self.w_shape, **self.options)[2:])

    @property
    def out_hw(self):
        return self.out_size[-2:]

    def flops(self, n=None, c=None, f=None):
        """2 n c f K^axes times the positions each pass visits (the output's; a transposed
        convolution's input's, its adjoint's output): one pass over n samples, f filters that
        each see c channels (default: all samples and filters, C / groups channels)."""
        positions = math.prod(self.spatial if conv_op(self.op).transposed else self.out_size)
        return 2 * (self.N if n is None else n) * (self.C // self.groups if c is None else c) * \
            (self.F if f is None else f) * positions * self.K ** len(self.spatial)


FORMAT = 2  # the profile format read here (cfp/calibration.py writes it)
# The layers between convolutions the model times (calibration.calibrate_layers measures them):
# each [seconds, seconds per element] of one forward and backward.
LAYER_KINDS = ("batchnorm", "relu", "maxpool", "upsample", "add", "loss", "conv", "optimizer", "volume")
_VARIANT = re.compile(r" F\(\dx\d\)")  # a path's variant in its name (paths.KernelPath.variant)
ANY_PATH = "*"  # a profile's rates for whatever path a pass takes (a model of another machine's kernels)


class MachineProfile:
    """The constants of one machine: alpha (s) and beta (s/byte) of each collective on the
    links inside a node and between nodes, the local packing of each collective (s per byte
    of its result: cfp's copies of NCHW blocks; none where the library works in place), the
    kernel rates (flop/s) of each pass and kernel path (kernels/conv/paths.py) measured on
    shapes of given flop and GEMM-row counts (paths.rate_key), the time of the layers between
    convolutions (LAYER_KINDS), and what it was measured on (`machine`, None for a model of a
    machine). Loaded from JSON (cfp/calibration.py writes it; docs/design.md section 4)."""

    def __init__(self, data, where="profile"):
        try:
            version = data.get("format", 1)
            if not isinstance(version, int) or version > FORMAT:
                raise _Refused(f"{where} is format {version!r}, newer than this cfp reads (format {FORMAT}): "
                               f"use the cfp that wrote it, or calibrate again (scripts/calibrate.py)")
            if version < FORMAT:
                raise _Refused(f"{where} is format {version} (kernel rates per kernel size, from before cfp "
                               f"timed each kernel path); calibrate again (scripts/calibrate.py)")
            self.name = str(data["name"])
            self.source = str(data.get("source", ""))
            self.machine = data.get("machine")
            self.itemsize = int(data.get("itemsize", 4))
            self.ranks_per_node = int(data["ranks_per_node"])
            self.workspace_weights = float(data.get("workspace_weights", 3))
            # cfp's own kernels: their Winograd layers' workspace as the kernels ask for it
            self.winograd_workspace = bool(data.get("winograd_workspace", True))
            self.packing = {c: float(v) for c, v in data.get("packing", {}).items()}
            self.links = {}
            for link, table in data["links"].items():
                self.links[link] = {c: (float(table[c][0]), float(table[c][1])) for c in COLLECTIVES}
            if self.links and "intra" not in self.links:
                raise KeyError("links.intra")
            # per link and collective, {p: ((m bytes, ...), (seconds, ...))}: the times calibration
            # measured (less the packing), priced by interpolation where a group of p was measured
            self.collective_times = {}
            for link, table in data.get("collective_times", {}).items():
                if link not in self.links:
                    raise KeyError(f"collective_times.{link} (a link the profile has no constants of)")
                unknown = sorted(set(table) - set(COLLECTIVES))
                if unknown:
                    raise KeyError(f"collective_times.{link}.{unknown[0]} (not one of {', '.join(COLLECTIVES)})")
                self.collective_times[link] = {c: _measured_times(points) for c, points in table.items()}
            self.kernels = {}
            for pass_name in PASSES:
                self.kernels[pass_name] = {
                    str(path): [_kernel_point(point) for point in points]
                    for path, points in data["kernels"][pass_name].items()}
                if not self.kernels[pass_name] or any(not p for p in self.kernels[pass_name].values()):
                    raise KeyError(f"kernels.{pass_name} (no measured points)")
            # per link, the fraction of a started collective's transfer that proceeds while its
            # rank computes (calibration.calibrate_progress); 0 where unmeasured: none hidden
            self.progress = {str(link): min(1.0, max(0.0, float(v))) for link, v in data.get("progress", {}).items()}
            self.layers = {kind: (0.0, 0.0) for kind in LAYER_KINDS}
            for kind, (fixed, per_element) in data.get("layers", {}).items():
                if kind not in self.layers:
                    raise KeyError(f"layers.{kind} (not one of {', '.join(LAYER_KINDS)})")
                self.layers[kind] = (float(fixed), float(per_element))
        except _Refused as e:
            raise ValueError(str(e)) from None
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise ValueError(f"{where} is not a valid machine profile: missing or malformed {e}") from None
        self.data = data

    @classmethod
    def load(cls, path):
        """A profile from a JSON file, or a built-in one by name ('reference-v100', 'cpu-dev')."""
        builtin = os.path.join(PROFILE_DIR, f"{path}.json")
        if not os.path.exists(path) and os.path.exists(builtin):
            path = builtin
        if not os.path.exists(path):
            names = sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))
            raise ValueError(f"machine profile {path!r} does not exist (built-in profiles: {', '.join(names)})")
        return cls(load_json(path, "machine profile"), where=f"machine profile {path!r}")

    def link_name(self, intra):
        """The link a collective inside a node (intra) or between nodes is priced on: "intra" where
        the profile measured no link between nodes."""
        if not self.links:
            raise ValueError(f"machine profile {self.name!r} was calibrated on one rank and has no link "
                             f"constants; calibrate on 2 or more ranks (mpiexec -n 2 ...) to plan for several")
        return "intra" if intra or "inter" not in self.links else "inter"

    def progress_of(self, intra=True):
        """The fraction of a non-blocking collective's transfer that proceeds while its rank
        computes, on the link inside a node (intra) or between nodes: 1 where the transport
        moves data by itself (an RDMA network, a GPU's collectives), near 0 where it moves only
        inside MPI calls (MPICH over TCP or shared memory, calibrate_progress); 0 unmeasured.
        Where one link was measured (one node; or nodes of one rank, whose groups all cross
        nodes) it stands for both, as the links' constants do."""
        own, other = ("intra", "inter") if intra else ("inter", "intra")
        return self.progress.get(own, self.progress.get(other, 0.0))

    def collective_time(self, collective, p, m, intra=True):
        """Seconds of a collective over p ranks whose whole result has m bytes: the cost of the
        messages (none on one rank) plus the local packing of the result. The messages' cost is
        the calibrated time of that collective over p ranks where the profile measured groups
        of p on the link (interpolated between the measured sizes, `_interpolated`), else the
        alpha-beta form."""
        packing = self.packing.get(collective, 0.0) * m
        if p <= 1 or m == 0 and collective != "allreduce":
            return packing
        link = self.link_name(intra)
        measured = self.collective_times.get(link, {}).get(collective, {}).get(p)
        if measured:
            return _interpolated(*measured, m) + packing
        alpha, beta = self.links[link][collective]
        steps, volume = (2 * (p - 1), 2 * (p - 1) / p * m) if collective == "allreduce" else \
            (p - 1, (p - 1) / p * m)
        return steps * alpha + volume * beta + packing

    def layer_time(self, kind, elements, count=1):
        """Seconds of `count` forward and backward passes of a layer of `kind` (LAYER_KINDS)
        over `elements` elements in all: count fixed costs plus the per-element cost."""
        fixed, per_element = self.layers[kind]
        return count * fixed + elements * per_element

    def point_rate(self, pass_name, path, geometry):
        """The flop/s of the point measured on `geometry` (its name) under `path`, or None."""
        return next((rate for _, _, rate, key in self.kernels[pass_name].get(path, ()) if key == geometry), None)

    def kernel_time(self, pass_name, path, flops, rows=None, geometry=None):
        """Seconds of one kernel pass of `flops` by kernel path `path` over `rows` GEMM rows
        (paths.rate_key): the rate measured on `geometry` itself (paths.geometry_key) where
        the profile has it, else that of the measured shapes of that path nearest in log flops
        and log rows (inverse-distance weighted over the 3 nearest).

        The rows are the shape class: at equal flops a pass over few rows and many channels
        streams a large weight matrix for little work and runs slower; for Winograd they are
        its tiles, which samples and image size fill. A variant of a path that the profile has
        no rates of (Winograd's F(2x2), 'winograd F(2x2)': a profile measured before the kernel
        table chose tiles per layer) is priced at its path's rates; a calibration measures it.
        """
        if flops <= 0:
            return 0.0
        table = self.kernels[pass_name]
        points = table.get(path, table.get(_VARIANT.sub("", path), table.get(ANY_PATH)))
        if points is None:
            raise ValueError(f"machine profile {self.name!r} has no rates of kernel path {path!r} ({pass_name}): "
                             f"it was measured before that path; calibrate again (scripts/calibrate.py)")
        exact = [rate for _, _, rate, key in points if geometry is not None and key == geometry]
        if exact:
            return flops / exact[0]
        nearest = []
        for f, px, rate, _ in points:
            d = (math.log(flops) - math.log(f)) ** 2
            if px is not None and rows:
                d += (math.log(rows) - math.log(px)) ** 2
            nearest.append((math.sqrt(d), rate))
        nearest.sort()
        outside = not min(p[0] for p in points) <= flops <= max(p[0] for p in points)
        if nearest[0][0] < 1e-9 or outside:  # beyond the measured range: the nearest rate holds
            return flops / nearest[0][1]
        weights = [(1.0 / d ** 2, math.log(rate)) for d, rate in nearest[:3]]
        log_rate = sum(w * r for w, r in weights) / sum(w for w, _ in weights)
        return flops / math.exp(log_rate)


class _Refused(Exception):
    """A profile refused as a whole (its format), with its own message."""


def _measured_times(points):
    """{p: ((m, ...), (seconds, ...))} from a profile's [[p, m bytes, seconds], ...]: sizes
    ascending, a size measured twice (two groups of p on one link) at its mean, and the times
    made non-decreasing in m (a larger message never costs less: what decreases is noise)."""
    by_size = {}
    for point in points:
        if len(point) != 3 or int(point[0]) < 2 or not float(point[1]) > 0 or not float(point[2]) >= 0:
            raise ValueError(f"collective time {point!r} (expected [p, m bytes, seconds] with p >= 2, m > 0, "
                             f"seconds >= 0)")
        p, m, seconds = point
        by_size.setdefault(int(p), {}).setdefault(float(m), []).append(float(seconds))
    out = {}
    for p, sizes in by_size.items():
        ms = sorted(sizes)
        times, most = [], 0.0
        for m in ms:
            most = max(most, sum(sizes[m]) / len(sizes[m]))
            times.append(most)
        out[p] = (tuple(ms), tuple(times))
    return out


def _interpolated(sizes, times, m):
    """Seconds of a message of m bytes from measured (sizes, times), ascending: linear between
    the two measured sizes around m; below the smallest, the smallest's time (latency bound);
    above the largest, the last two sizes' slope carried on (bandwidth bound)."""
    if m <= sizes[0] or len(sizes) == 1:
        return times[0] if m <= sizes[0] else times[0] * m / sizes[0]
    i = bisect.bisect_left(sizes, m)
    if i == len(sizes):
        i -= 1
    m0, m1, t0, t1 = sizes[i - 1], sizes[i], times[i - 1], times[i]
    return t0 + (t1 - t0) * (m - m0) / (m1 - m0)


def _kernel_point(point):
    """(flops, rows or None, flop/s, geometry or None) from a profile's [flops, rows, rate,
    geometry], [flops, rows, rate] or [flops, rate]."""
    if len(point) == 4:
        return float(point[0]), float(point[1]), float(point[2]), str(point[3])
    if len(point) == 3:
        return float(point[0]), float(point[1]), float(point[2]), None
    return float(point[0]), None, float(point[1]), None


def _shard_sizes(layer, layouts, shape):
    """The busiest rank's blocks, from the layer's layouts (cls.layouts) on a grid of `shape`, at
    coordinate 0 of every axis (the first block of each partition is the largest): n samples,
    x_channels (of x's block), read (the channels the kernel reads), filters (it computes),
    y_filters (of y's block), w_count (weight elements), seen (channels each filter sees), and
    x, y: the blocks' sizes per spatial axis."""
    G = layer.groups
    first = {a: 0 for a in AXES}
    n, x_channels, *x = map(len, layouts["x"].indices(layer.x_shape, shape, first))
    _, y_filters, *y = map(len, layouts["y"].indices((layer.N, layer.F) + layer.out_size, shape, first))
    filters, seen = map(len, layouts["w"].indices(layer.w_shape, shape, first)[:2])
    # The kernel reads the channels of the groups whose filters it holds (filters / (F/G) of
    # them, all G under sample parallelism); ungrouped, the channels its filters see.
    read = seen if G == 1 else seen * (filters // (layer.F // G))
    return {"n": n, "x_channels": x_channels, "read": read, "filters": filters, "y_filters": y_filters,
            "w_count": filters * seen * layer.K ** len(layer.spatial), "seen": seen, "x": tuple(x), "y": tuple(y)}


def _windows(layer, shape):
    """Per spatial axis of `layer` on a grid of `shape`: (the input extent the busiest rank's
    kernel reads, the kernel's padding before and after it, the most input positions any rank
    needs). On an axis the grid splits, from the halo's own spans (halo.window_spans) at
    coordinate 0: a convolution's block is the rows its windows read, halo and border padding
    included, convolved without padding (what the halo gives the kernels); a transposed one's
    the input rows that reach its output block, with that block's signed sides. On the others,
    the whole axis and the layer's padding."""
    op = conv_op(layer.op)
    names = ("depth", "height", "width")[3 - len(layer.spatial):]
    options = tuple(sorted(window_options(layer.options).items()))
    grid = tuple((a, shape.get(a, 1)) for a in names)
    spans = window_spans(layer.x_shape, grid, (layer.K,) * len(names), options)[2] \
        if any(shape.get(a, 1) > 1 for a in names) else {}
    out = []
    for axis, size in zip(names, layer.spatial):
        if shape.get(axis, 1) == 1:
            out.append((size, layer.pad, layer.pad - layer.output_padding if op.transposed else layer.pad, size))
            continue
        _, need, before, after, positions = spans[axis][0]
        most = max(len(span[1]) for span in spans[axis])
        if op.transposed:
            out.append((len(need), before, after, most))
        else:
            out.append((len(positions) if positions is not None else len(need) + before + after, 0, 0, most))
    return out


GROUPS = ("row", "column", "gradient", "halo")  # the groups an algorithm's collectives run over


@functools.lru_cache(maxsize=4096)
def _inside_nodes(shape, node_axes, per_node, p_f):
    """{group: whether each of its groups lies inside one node} on a grid of `shape` ((axis,
    size) pairs) placed by `node_axes` (grid.process_ranks) on nodes of `per_node`
    neighbouring ranks: stationary-w's rows (p_f consecutive channel ranks) and columns (every
    p_f-th), the gradient group (the ranks holding the same channels: all but the channel
    axis) and the halo group (the ranks of one image: depth, height and width)."""
    shape = dict(shape)
    spans = {group: {} for group in GROUPS}
    for g, process in enumerate(process_ranks(shape, node_axes)):
        c = coords_of(g, shape)
        keys = {"row": (c["sample"], c["depth"], c["height"], c["width"], c["channel"] // p_f),
                "column": (c["sample"], c["depth"], c["height"], c["width"], c["channel"] % p_f),
                "gradient": c["channel"], "halo": (c["sample"], c["channel"])}
        for group, key in keys.items():
            spans[group].setdefault(key, set()).add(process // per_node)
    return {group: all(len(nodes) == 1 for nodes in by_key.values()) for group, by_key in spans.items()}


def inside_nodes(shape, profile, p_f=1, node_axes=None):
    """{group (GROUPS): whether each of its groups stays inside a node} for a grid of {axis:
    size} `shape` placed by `node_axes` (grid.ProcessGrid) on the profile's nodes
    (ranks_per_node neighbouring ranks each)."""
    if isinstance(node_axes, str):
        node_axes = tuple(a.strip() for a in node_axes.split(",") if a.strip())
    return _inside_nodes(tuple((a, int(shape.get(a, 1))) for a in AXES), None if node_axes is None else
                         tuple(node_axes), profile.ranks_per_node, p_f)


def layer_cost(layer, algorithm, P_n, P_c, profile, p_f=None, optimizer_buffers=1, P_h=1, P_w=1,
               node_axes=None, P_d=1, chunks=1, halo_interior=False):
    """Predicted seconds (per phase, compute and communication) and bytes per rank of one
    forward and backward pass of `layer` under `algorithm` on a P_n x P_d x P_h x P_w x P_c grid
    (P_d, P_h, P_w > 1: the image, or a volume, split over depth, height and width, with a halo
    exchange; depth a volume's only).

    Each pass is priced at the rate of the 2-D pass that computes it (ConvOp.plane): an image's
    own, a volume's stacked planes, a transposed convolution's adjoint (its forward at the
    adjoint's backward-data rate, its backward-data at the forward's).

    A collective runs over the link inside a node where each of its groups lies inside one
    (inside_nodes: the grid's placement, `node_axes`, on the profile's nodes), else over the
    link between nodes (docs/design.md, "Rank placement").

    chunks > 1: the layer's passes pipelined over that many chunks of its samples (or of its
    features where a rank holds fewer; _pipeline), each chunk's
    collectives in flight while the next computes (ConvAlgorithm.pipelined; stationary-x, -y
    and -w): each pass priced by pipeline_seconds, its comm the part left exposed, "hidden"
    the part the chunks' kernels hide. halo_interior: on a split image, the interior of the
    block computed while the halo moves (ConvAlgorithm.halo_interior, where the algorithm
    convolves its own block, a convolution and not a transposed one): the forward halo hidden,
    at the link's progress, behind the interior's share of the forward kernels (the halo's
    adjoint stays blocking).
    """
    cls = algorithm_class(algorithm, layer.groups)
    op = conv_op(layer.op)
    if P_d > 1 and op.axes == 2:
        raise ValueError(f"layer {layer.name}: a depth axis of {P_d} ranks splits a volume; {layer.op} has none")
    p_f = cls.filter_groups(P_c, p_f)
    q = P_c // p_f
    item = profile.itemsize
    shape = {"sample": P_n, "depth": P_d, "height": P_h, "width": P_w, "channel": P_c}
    layouts = cls.layouts({"depth": P_d, "height": P_h, "width": P_w}, p_f, layer.first, layer.groups, op.axes)
    s = _shard_sizes(layer, layouts, shape)
    n, x_channels, read, filters, w_count = s["n"], s["x_channels"], s["read"], s["filters"], s["w_count"]
    windows = _windows(layer, shape)
    # this rank's block: its outputs, the input its windows read (halo included), and the most
    # input any rank of its image needs
    out, needed = math.prod(s["y"]), math.prod(w[3] for w in windows)
    x_bytes, y_bytes = n * read * needed * item, n * filters * out * item
    inside = inside_nodes(shape, profile, p_f, node_axes)
    block = local_block(layer, n, read, filters, s["seen"], windows)
    local, passes = local_geometry(layer, n, read, filters, s["seen"], windows)
    compute, keys = _pass_seconds(layer, local, passes, profile, block)
    comm = {phase: 0.0 for phase in PHASES}
    spatial = P_d * P_h * P_w
    groups = {"row": (p_f, inside["row"]), "column": (q, inside["column"]),
              "gradient": (P_n * spatial, inside["gradient"])}
    result = {"x": x_bytes, "y": y_bytes, "w": w_count * item}  # bytes of each collective's whole result
    hidden = {phase: 0.0 for phase in PHASES}
    sent = [m for m in cls.messages if message_sent(m, layer.first, not layer.first)]
    for m in sent:
        ranks, intra = groups[m.group]
        comm[m.phase] += profile.collective_time(m.collective, ranks, result[m.tensor], intra)
    chunked = []  # the chunks' own (geometry, block), priced where they run
    if chunks > 1:
        chunked = _pipeline(layer, cls, chunks, n, read, filters, s["seen"], windows, profile, compute, comm, hidden,
                            [m for m in sent if m.group in ("row", "column")], groups, result, P_c)
    if spatial > 1:  # the halo rows and columns arrive in one all-to-all, and go back with dx
        received = n * x_channels * max(0, needed - math.prod(s["x"])) * item
        halo = profile.collective_time("alltoall", spatial, received * spatial / (spatial - 1), inside["halo"])
        exposed = halo
        if halo_interior and not op.transposed and cls.convolves_own(layer.first):
            interior = math.prod(max(0, y - -(-(w[3] - x) // layer.stride)) / y
                                 for y, x, w in zip(s["y"], s["x"], windows) if y)
            exposed = max(0.0, halo - profile.progress_of(inside["halo"]) * interior * compute["forward"])
            hidden["halo"] = halo - exposed
        comm["halo"] = exposed + (0 if layer.first else halo)
    weights = w_count * item
    # The kernels' workspace (cfp/kernels/workspace.py), kept from call to call, as large as the
    # largest call's temporaries. A pass by Winograd asks for what its path counts
    # (paths.pass_bytes: tiles, transformed filters, products: 34.2 MiB for 8x256x256x16x16, 15
    # weights); any other pass is bounded by weight-sized buffers (three for cfp's NumPy im2col:
    # backward-filter's accumulator and its transpose, backward-data's flipped filters) and a
    # block of im2col patches of at most 4 MiB.
    patches = 0 if local is None else local.N * local.Ho * local.Wo * local.C * local.Kh * local.Kw * item
    bound = profile.workspace_weights * weights + min(4 << 20, patches)
    dtype = {4: "float32", 8: "float64"}.get(item)
    counted = {} if not (profile.winograd_workspace and dtype and layer.groups == 1 and local is not None) else {
        p: pass_bytes(passes[p], local, dtype) for p in PASSES}
    kept = ("forward", "backward-filter") if layer.first else PASSES
    y_kept = n * s["y_filters"] * out
    memory = {
        "weights": weights, "gradients": weights, "optimizer": optimizer_buffers * weights,
        # x as the layer keeps it for backward-filter (gathered under y and w, with its halo on
        # a split image) and y
        "activations": (n * (read if algorithm in ("y", "w") else x_channels) * needed + y_kept) * item
        # batch norm's normalised output (item bytes) and ReLU's mask (one byte) per element of y
        + (y_kept * (item + 1) if layer.normed else 0),
        # Alive only inside the layer: the partial y and dx before their reduce-scatters, and a
        # volume's stacked planes (kernels/conv/volume.py: its input Kd times over)
        "temporary": (n * filters * out + (0 if layer.first else x_bytes // item)
                      + (local.N * local.C * local.H * local.W if op.axes == 3 and local is not None else 0)) * item,
        "workspace": max(counted.get(p) or bound for p in kept),
    }
    layers = _layers_time(layer, profile, y_kept, s["y_filters"], w_count, optimizer_buffers,
                          P_n * spatial, inside["gradient"])

    return {"compute": compute, "comm": comm, "layers": layers, "memory": memory, "p_f": p_f,
            "gradient_intra": inside["gradient"],
            # the share of backward-data after the gradient sum starts (sum_start_seconds)
            "data_after_sum": data_after_sum(cls, n, chunks, layer.first),
            "paths": {pass_name: path for pass_name, (path, _) in keys.items()}, "geometry": local, "passes": passes,
            "block": block if priced_as_volume(layer) and local is not None else None,
            "chunks": chunks, "hidden": hidden, "chunk_geometries": chunked,
            "time": sum(compute.values()) + sum(comm.values()) + sum(layers.values()),
            "bytes": sum(memory.values())}


def data_after_sum(cls, n, chunks, first=False):
    """The share of a layer's backward-data computed after its gradient sum starts
    (ConvAlgorithm.sums_before_data; sum_start_seconds): all of it where backward sums first,
    the last chunk's where dw is computed chunk by chunk beside dx (dw_by_chunks: chunks of
    samples, or of dy's filters), none where backward sums last. In feature chunks of dx's
    channels (stationary-w, by_features) dw is whole before the first chunk: all of it."""
    if not cls.sums_before_data:
        return 0.0
    if not cls.dw_by_chunks or (by_features(n, chunks)
                                and feature_chunk_tensors(cls, first, not first)["backward"] == "x"):
        return 1.0
    return 1 / chunks


def chunk_counts(layer, cls, P_n, P_c, counts):
    """Those of `counts` the layer runs in on P_n x P_c ranks (ConvAlgorithm.pipelined): no more
    than the samples a rank holds, or, beyond them, than the smallest block of the features
    its chunks split (feature_chunk_limit)."""
    limit = feature_chunk_limit(cls, layer.C, layer.F, P_c, layer.first, not layer.first)
    return [k for k in counts if chunks_fit(layer.N // P_n, k, limit)]


def pipelines(cls, first=False):
    """Whether `cls`'s layers pipeline their collectives over chunks of samples (or features)
    (ConvAlgorithm.pipelined): those with messages of their own besides the gradient sum,
    stationary-x, -y and -w (train.pipelined_layers)."""
    return any(m.group in ("row", "column") and message_sent(m, first, not first) for m in cls.messages)


def pipeline_seconds(chunks, compute, gather=0.0, scatter=0.0, progress=0.0):
    """Seconds of one pass in `chunks` chunks, each computing for `compute` seconds between its
    gather (an allgather of its input, `gather` seconds blocking) and its reduce-scatter
    (`scatter`), as ConvAlgorithm.pipelined runs them: chunk 0's gather is waited for at once;
    chunk i + 1's is started before chunk i computes and chunk i's reduce-scatter after it, so
    that while a chunk computes the started collectives move, one after another on the link
    (in the order started), at `progress` of their blocking rate (MachineProfile.progress_of);
    a wait moves what is left of them up to the one waited for at the full rate, exposed. The
    last chunk's reduce-scatters are waited for at the end. One chunk: compute + gather +
    scatter."""
    if chunks <= 1:
        return compute + gather + scatter
    t, link = gather, []  # link: [what, seconds left] of the started collectives, in order
    for i in range(chunks):
        if i + 1 < chunks and gather:
            link.append(["gather", gather])
        budget = compute * progress  # what the link moves while this chunk computes
        for item in link:
            moved = min(item[1], budget)
            item[1] -= moved
            budget -= moved
        t += compute
        if i + 1 < chunks and gather:  # the next chunk's input, and all started before it
            last = max(j for j, item in enumerate(link) if item[0] == "gather")
            t += sum(item[1] for item in link[:last + 1])
            link = link[last + 1:]
        if scatter:
            link.append(["scatter", scatter])
    return t + sum(item[1] for item in link)


def _pipeline(layer, cls, chunks, n, read, filters, seen, windows, profile, compute, comm, hidden, sent, groups,
              result, P_c):
    """layer_cost's `compute`, `comm` and `hidden` (dicts by phase, updated) for the layer's
    passes in `chunks` chunks, as ConvAlgorithm.pipelined cuts them: of its n samples, or,
    where a rank holds fewer (by_features), of the features each pass's collective moves
    (feature_chunk_tensors: y's filters, x's channels). Each chunk's kernels are priced at the
    chunk's own geometry (the largest chunk, for all), each chunk's collectives at a chunks-th
    of the bytes. In samples: forward is gather x, compute, reduce-scatter y; backward under
    stationary-x and -w (dy gathered) one pipeline, per chunk both passes, its dx
    reduce-scattered (-w); under -y backward-data alone, its dx reduce-scattered, and
    backward-filter on the whole block. In features, a pass with a reduce-scatter pipelines it
    behind the chunks of the phase that computes its summand, after its allgather (whole,
    blocking) and its other phases (whole: stationary-w's dw); one without pipelines its
    allgather behind the chunks of all its phases. Returns the chunks' (2-D geometry, volume
    block or None) at which it priced them (layer_cost's "chunk_geometries")."""
    if not pipelines(cls, layer.first):
        raise ValueError(f"layer {layer.name}: chunks={chunks}: its algorithm pipelines no collectives "
                         f"(stationary-x, -y and -w do)")
    features = by_features(n, chunks)
    limit = feature_chunk_limit(cls, layer.C, layer.F, P_c, layer.first, not layer.first)
    if not chunks_fit(n, chunks, limit):
        raise ValueError(f"layer {layer.name}: chunks={chunks} is more than the {n} sample(s) a rank holds and "
                         f"the {limit} channel(s) or filter(s) of the smallest block its feature chunks split")
    progress = profile.progress_of(all(groups[m.group][1] for m in sent))

    def part(phases, collective, share=chunks):
        return sum(profile.collective_time(m.collective, groups[m.group][0], result[m.tensor] / share,
                                           groups[m.group][1])
                   for m in sent if m.phase in phases and m.collective == collective)

    measured = []  # the chunks' (geometry, block): what calibration's top-up measures (planner.geometries)

    def chunk_seconds(part_n, part_read, part_filters):  # (a chunk of the channels reads as many of w's)
        part_seen = seen if part_read == read else part_read
        local, passes = local_geometry(layer, part_n, part_read, part_filters, part_seen, windows)
        block = local_block(layer, part_n, part_read, part_filters, part_seen, windows)
        measured.append((local, block if priced_as_volume(layer) and local is not None else None))
        return _pass_seconds(layer, local, passes, profile, block)[0]

    # stages: (the phases computed in chunks, their chunks' seconds, the allgather pipelined,
    # the reduce-scatter pipelined, the allgather's seconds where it runs whole and blocking first)
    stages = []
    if not features:
        chunk = chunk_seconds(-(-n // chunks), read, filters)
        stages.append((("forward",), chunk, part(("forward",), "allgather"), part(("forward",), "reduce_scatter"), 0.0))
        if any(m.phase == "backward-filter" and m.collective == "allgather" for m in sent):  # x, w
            both = ("backward-filter", "backward-data")
            stages.append((both, chunk, part(both, "allgather"), part(both, "reduce_scatter"), 0.0))
        else:  # y: dy is its own; backward-filter is one blocking pass
            stages.append((("backward-data",), chunk, 0.0, part(("backward-data",), "reduce_scatter"), 0.0))
    else:
        tensors = feature_chunk_tensors(cls, layer.first, not layer.first)
        for stage, phases in (("forward", ("forward",)), ("backward", ("backward-filter", "backward-data"))):
            if tensors[stage] is None:
                continue
            chunk = chunk_seconds(n, *((read, -(-filters // chunks)) if tensors[stage] == "y"
                                       else (-(-read // chunks), filters)))
            scattered = [m.phase for m in sent if m.phase in phases and m.collective == "reduce_scatter"]
            if scattered:  # (its other phases computed whole, as they were priced)
                stages.append((tuple(scattered), chunk, 0.0, part(phases, "reduce_scatter"),
                               part(phases, "allgather", share=1)))
            else:
                stages.append((phases, chunk, part(phases, "allgather"), 0.0, 0.0))
    for phases, chunk, gather, scatter, blocking in stages:
        c = sum(chunk[p] for p in phases)
        exposed = pipeline_seconds(chunks, c, gather, scatter, progress) - chunks * c + blocking
        # the exposed and hidden time shared among the stage's phases as their collectives' time
        every = _stage_phases(phases)
        moved = {p: (part((p,), "allgather", share=1) if blocking else chunks * part((p,), "allgather"))
                 + chunks * part((p,), "reduce_scatter") for p in every}
        total = sum(moved.values())
        for p in phases:
            compute[p] = chunks * chunk[p]
        for p in every:
            share = moved[p] / total if total else 1.0 / len(every)
            comm[p] = exposed * share
            hidden[p] = max(0.0, total - exposed) * share
    return measured


def _stage_phases(phases):
    """The phases of the stage (forward, or backward's two) that `phases` belong to."""
    return ("forward",) if "forward" in phases else ("backward-filter", "backward-data")


def _pass_seconds(layer, local, passes, profile, block=None):
    """({pass: seconds} of the layer's local kernels, {pass: (path, GEMM rows)}) on the 2-D
    geometry `local` (local_geometry) whose `passes` compute them: each at its path's measured
    rate (kernel_time), a volume's with the copies of its planes around them where it makes
    them (volume.copied_elements, at the profile's 'volume' rate), or, where the profile has
    its passes measured on its own `block` (local_block; volume_key), at those; none for the
    first layer's backward-data or a block no window reaches."""
    flops = geometry_flops(local) if local is not None else 0
    keys = {p: rate_key(passes[p], local, "float32") if local is not None else (None, None) for p in PASSES}
    if flops and block is not None and priced_as_volume(layer):
        own = {p: profile.point_rate(passes[p], *volume_key(passes[p], block, local)) for p in PASSES}
        if all(own.values()):
            return {p: 0.0 if layer.first and p == "backward-data" else flops / own[p] for p in PASSES}, keys
    named = None if local is None else geometry_key(local)
    copied = copied_elements(local, layer.K, ring=(layer.stride, layer.dilation) == (1, 1)) \
        if flops and len(layer.spatial) == 3 else {}
    copies = {p: profile.layer_time("volume", copied[passes[p]], count=1 / 3) if copied.get(passes[p]) else 0.0
              for p in PASSES}  # the fixed cost, fitted on the three passes' copies together, a third each
    seconds = {p: 0.0 if layer.first and p == "backward-data" or not flops else
               profile.kernel_time(passes[p], path, flops, rows, named) + copies[p] for p, (path, rows) in keys.items()}
    return seconds, keys


def local_block(layer, n, read, filters, seen, windows):
    """(x shape, w shape, options) of the busiest rank's local convolution of `layer`: x (n,
    read, *extents), w (filters, seen, K...) with the padding of `windows` (_windows)."""
    groups = 1 if layer.groups == 1 else max(1, read // max(1, seen))
    options = dict(layer.options, groups=groups, padding=tuple(side for w in windows for side in w[1:3]))
    if conv_op(layer.op).transposed:
        options["output_padding"] = 0
    x_shape = (max(n, 1), max(read, groups)) + tuple(w[0] for w in windows)
    return x_shape, (max(filters, groups), seen) + (layer.K,) * len(windows), options


def local_geometry(layer, n, read, filters, seen, windows):
    """(the 2-D ConvGeometry that computes the busiest rank's local convolution of `layer`,
    {pass: its pass that computes each}; ConvOp.plane) of its local_block; its kernel paths are
    what the kernel table chooses for it (paths.rate_key). None for a transposed block no
    window reaches."""
    x_shape, w_shape, options = local_block(layer, n, read, filters, seen, windows)
    return conv_op(layer.op).plane(x_shape, w_shape, **options)


# A volume's passes (Conv3d) run its own kernels around the stacked 2-D convolution they are
# keyed by: the ring that transforms each plane once, or the stack's copies. Where calibration
# has timed a volume's passes on its very block (calibration.top_up), the profile keeps them
# under VOLUME + the 2-D path's name and volume_key's name of the block, and the volume is priced
# at them; elsewhere at its stacked convolution's rate plus the copies (volume.copied_elements).
VOLUME = "volume "


def volume_key(pass_name, block, plane):
    """(path, geometry name) of a volume's pass measured on its own block (x shape, w shape,
    options; local_block) whose stacked convolution is `plane`."""
    name, _ = rate_key(pass_name, plane, "float32")
    x_shape, w_shape, options = block
    opts = " ".join(f"{k}={options[k]}" for k in sorted(options))
    return VOLUME + name, f"{'x'.join(map(str, x_shape))} {'x'.join(map(str, w_shape))} {opts}"


def priced_as_volume(layer):
    """Whether `layer`'s passes may be priced at its volume's own measured points (Conv3d)."""
    return layer.op == "conv3d"


def _layers_time(layer, profile, elements, channels, w_count, optimizer_buffers, sharing, intra):
    """{kind: seconds} of what the step spends on `layer` beyond its kernels and collectives:
    the layers after it (batch norm and its statistics' allreduces over the `sharing` ranks
    holding the same channels, ReLU, pooling, a residual sum, the head and loss) on the
    busiest rank's `elements` outputs, the convolution module's fixed cost, and the optimizer's
    update of the layer's parameters (a momentum buffer per `optimizer_buffers`)."""
    out = {kind: profile.layer_time(kind, elements) for kind in layer.after}
    out["conv"] = profile.layer_time("conv", 0)
    item = profile.itemsize
    tensors, parameters = 1, w_count
    if layer.normed:
        # forward: the sums, then the squares; backward: the two gradient sums (the count is
        # the shapes')
        out["batchnorm"] = profile.layer_time("batchnorm", elements) + sum(
            profile.collective_time("allreduce", sharing, m * item, intra)
            for m in (channels, channels, 2 * channels))
        tensors, parameters = tensors + 2, parameters + 2 * channels
    out["optimizer"] = profile.layer_time("optimizer", parameters, tensors) * (1 + optimizer_buffers) / 2
    return out


def backward_seconds(cost):
    """Of layer_cost's `cost`, the seconds its backward pass computes and communicates after
    its gradient sum could start (the next layer down's backward runs in them): backward-data
    and backward-filter with their collectives, the halo's adjoint, and half the time of the
    layers after it (batch norm, ReLU, pooling: forward and backward alike, an approximation)."""
    layers = sum(v for kind, v in cost["layers"].items() if kind != "optimizer")
    passes = ("backward-data", "backward-filter")
    halo = cost["comm"].get("halo", 0.0)
    return (sum(cost["compute"].get(p, 0.0) + cost["comm"].get(p, 0.0) for p in passes)
            + (halo / 2 if cost["compute"].get("backward-data", 0.0) else 0.0) + layers / 2)


def sum_start_seconds(cost):
    """Of backward_seconds(cost), the seconds before the layer's gradient sum can start: all of
    them, less what runs after it where the algorithm sums before it computes dx (its cost's
    "data_after_sum", from ConvAlgorithm.sums_before_data and dw_by_chunks): that share of
    backward-data with its collectives (all of it, or the last of k chunks' where dw is
    computed chunk by chunk) and the halo's adjoint."""
    after = cost.get("data_after_sum", 0.0)
    data = cost["compute"].get("backward-data", 0.0)
    if not after:
        return backward_seconds(cost)
    halo = cost["comm"].get("halo", 0.0) / 2 if data else 0.0
    return backward_seconds(cost) - after * (data + cost["comm"].get("backward-data", 0.0)) - halo


def overlapped_step(costs, profile, bucket_bytes):
    """A training step of layers costing `costs` (layer_cost's results, in forward order; each
    may hold its `redistribution` seconds) with the weight gradients' sums started in buckets of
    `bucket_bytes` during backward and waited for before the update (train_step's bucket_mb),
    as a dict: time (the step), blocking (the same step with every sum blocking, the sum of the
    costs), gradient_sync (the sums' seconds), exposed (of them, the time the step waits) and
    hidden (gradient_sync - exposed).

    Backward runs the layers last to first, each taking backward_seconds; a layer's gradient
    joins the open bucket when its sum can start (sum_start_seconds into its backward: at its
    end, or before its dx where the algorithm sums first), and a bucket of bucket_bytes or
    more (or the last, when backward ends) starts its sum, the sums one after another on the link. While
    backward still computes, a started sum moves at profile.progress_of(its link) of its
    blocking rate; what is left when backward ends is moved at the full rate, exposed. So a
    transport that moves data only inside MPI calls (progress 0) hides nothing, and one that
    moves it by itself hides up to the backward time after each bucket starts. bucket_bytes <= 0:
    the blocking step. A bucket's sum costs the sum of its layers' sums: each layer's latency
    counted, where cfp's one allreduce of a bucket pays it once (an upper bound)."""
    blocking = sum(c["time"] + c.get("redistribution", 0.0) for c in costs)
    total = sum(c["comm"]["gradient-sync"] for c in costs)
    if bucket_bytes <= 0 or total == 0:
        return {"time": blocking, "blocking": blocking, "gradient_sync": total, "exposed": total, "hidden": 0.0}
    buckets, t = [], 0.0
    seconds, size, intra = 0.0, 0, True
    for c in reversed(costs):
        ready = t + sum_start_seconds(c)
        t += backward_seconds(c)
        seconds += c["comm"]["gradient-sync"]
        size += c["memory"]["gradients"]
        intra = intra and c.get("gradient_intra", True)
        if size >= bucket_bytes:
            buckets.append((ready, seconds, profile.progress_of(intra)))
            seconds, size, intra = 0.0, 0, True
    if seconds:
        buckets.append((t, seconds, profile.progress_of(intra)))
    end, link, exposed = t, 0.0, 0.0  # backward's end; when the link is free (while backward runs)
    for ready, left, rate in buckets:
        start = max(ready, link)
        if start < end and rate > 0:
            if left <= (end - start) * rate:
                link = start + left / rate
                continue
            left -= (end - start) * rate
            link = end
        exposed += left
    return {"time": blocking - (total - exposed), "blocking": blocking, "gradient_sync": total,
            "exposed": exposed, "hidden": total - exposed}
