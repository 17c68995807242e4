"""Measuring the cost model's constants on this machine, and the profile cache that keeps them.

A machine profile (cfp/perfmodel.py, docs/design.md section 4) holds what `calibrate` measures:
the alpha, beta and packing of each collective, the rate of every kernel path of the kernel
table for each pass (kernels/conv/paths.py, keyed as `paths.rate_key` keys them), and the time
of the layers between convolutions (batch norm, ReLU, pooling, residual adds, the head and
loss, the optimizer update, each module's fixed overhead). It also records what it was
measured on (`machine`): a profile describes one machine, one BLAS, one count of threads and
ranks and one version of cfp's kernels, and says so.

`profile_for(world, threads)` is what the planner's users call when no profile is named: the
cached profile of this machine (a JSON file in `cache_dir()`, keyed by the machine record) or,
where none matches, a quick calibration, cached for the next run, as FFTW keeps its wisdom.
"""
import datetime
import glob
import hashlib
import math
import os
import platform
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

from . import backend, comm
from .benchtools import count_kernel_seconds, on_rank0, quiet_barrier, slowest_median, timed
from .grid import ProcessGrid, node_layout  # noqa: F401 (calibration.node_layout: the nodes it measures)
from .io import load_json, save_json
from .kernels import conv_geometry
from .kernels import settings as kernel_settings
from .kernels.conv import paths
from .kernels.conv.geometry import geometry_flops
from .kernels.conv.ops import OPS
from .kernels.conv.volume import copy_passes, stacked_copies, volume_geometry
from .nn import (BatchNorm2d, Conv2d, GlobalAvgPool2d, MaxPool2d, ReLU, Residual, Sequential, SoftmaxCrossEntropy,
                 Upsample)
from .nn.module import Parameter
from .optim import SGD
from .partition import block_sizes
from .perfmodel import MachineProfile, volume_key
from .tensor import DistTensor, Layout

FORMAT = 2  # the profile format this cfp writes and reads (perfmodel.MachineProfile)

# What a profile must share with this machine to describe it (the machine record's keys).
MACHINE_KEYS = ("cpu", "cores", "blas", "numpy", "mpi", "kernels", "threads_per_rank", "ranks", "ranks_per_node")


# -- what a profile was measured on -----------------------------------------------------------

def kernels_version():
    """A hash of cfp's kernel sources (cfp/kernels, every .py file), of the layers and the
    optimizers (cfp/nn, cfp/optim.py: the times between convolutions), of this module (how they
    are measured), of cfp/comm.py (the collectives' local copies, whose cost a profile holds)
    and of the kernel settings that choose their paths: it changes when a kernel, the path
    table, a layer, the collectives or the calibration changes, and with it the times a
    profile holds."""
    here = os.path.dirname(os.path.abspath(__file__))
    sources = [os.path.abspath(__file__), os.path.join(here, "comm.py"), os.path.join(here, "optim.py")]
    for root in (os.path.join(here, "kernels"), os.path.join(here, "nn")):
        for folder, dirs, files in sorted(os.walk(root)):
            dirs.sort()
            sources += [os.path.join(folder, name) for name in sorted(f for f in files if f.endswith(".py"))]
    digest = hashlib.sha256()
    for path in sources:
        digest.update(os.path.relpath(path, here).encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(f.read())
    s = kernel_settings.current()
    digest.update(repr((s.winograd, s.winograd_tile, s.plane_stacking)).encode())
    return digest.hexdigest()[:16]


def _blas():
    """The BLAS NumPy uses, as name, version and the kernels it runs ('scipy-openblas
    0.3.31.188.0 (SkylakeX)'): one library runs at different rates with different kernels
    (OpenBLAS's Haswell and SkylakeX ones, backend.blas_description), so a profile names them:
    those of NumPy's own library (backend.numpy_blas_info), whatever else a process loaded
    before (SciPy's OpenBLAS), so that one machine's record is the same in every run."""
    loaded = backend.numpy_blas_info()
    kernels = ", ".join(arch for _, _, _, arch in loaded if arch)
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        name = f"{blas.get('name', '?')} {blas.get('version', '?')}"
    except Exception:  # an older NumPy: what threadpoolctl sees loaded
        name = ", ".join(f"{lib} {version}" for lib, version, _, _ in loaded) or "unknown"
    return f"{name} ({kernels})" if kernels else name


def machine_record(ranks, threads, ranks_per_node=None):
    """What a profile measured on `ranks` ranks of `threads` BLAS threads each, `ranks_per_node`
    of them a node (default: all on one), would record here (MACHINE_KEYS), plus the host's
    name for people to read."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": backend.cpu_name(), "cores": int(cores), "blas": _blas(), "numpy": np.__version__,
            "mpi": MPI.Get_library_version().splitlines()[0].strip(), "kernels": kernels_version(),
            "threads_per_rank": int(threads), "ranks": int(ranks),
            "ranks_per_node": int(ranks if ranks_per_node is None else ranks_per_node), "host": platform.node()}


def differences(recorded, here):
    """['key: recorded there, here' ...] for each MACHINE_KEYS value that differs ([] when the
    profile describes this machine; a profile without a record, a model such as
    reference-v100, has nothing to compare)."""
    if not isinstance(recorded, dict):
        return []
    return [f"{key} {recorded.get(key)!r} (here {here[key]!r})" for key in MACHINE_KEYS
            if recorded.get(key) != here[key]]


# -- caches as a step leaves them --------------------------------------------------------------

def _l2_bytes():
    """The size of a core's L2 cache as Linux reports it (sysfs), else 0."""
    for folder in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
        try:
            with open(os.path.join(folder, "level")) as f:
                level = f.read().strip()
            with open(os.path.join(folder, "size")) as f:
                size = f.read().strip()
        except OSError:
            continue
        if level == "2" and size[:-1].isdigit():
            return int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20}.get(size[-1], 0)
    return 0


def _evict_bytes():
    """Bytes to write to push a call's data out of a core's caches: four times its L2 (where
    the system says) and at least 8 MiB. Not the last-level cache: a step's other layers do
    not empty that, and calibrating as if they did over-predicted 2-rank steps by 18-80% on the
    AMD EPYC guest (BENCHMARKS.md)."""
    return max(4 * _l2_bytes(), 8 << 20)


class _Cold:
    """Timed calls as a training step makes them: between two passes of one layer the step runs
    the other layers, whose data pushes this layer's out of the core's caches. Before each
    timed call a buffer larger than the caches is written (untimed), so calibration measures
    kernels and layers on cold caches, not on what the previous repetition left there (on the
    2-core Intel Xeon guest, the ResNet width 4 step's 1x1 and first-layer kernels run 25-70%
    slower in the step than hot, 3x3 ones 3-10%, and a small collective's Python around the
    MPI call up to twice as slow; their evicted times are within a few per cent of the
    step's). The collectives are timed so too."""

    def __init__(self, compute_seconds=0.0):
        self._buffer = None
        self.compute_seconds = compute_seconds
        self._gemms = None

    def _compute(self):
        """About compute_seconds of float32 GEMMs, as a layer's kernels run before its collectives."""
        a = np.ones((256, 256), np.float32)
        if self._gemms is None:
            start = time.perf_counter()
            for _ in range(4):
                a @ a
            self._gemms = max(1, round(self.compute_seconds / max((time.perf_counter() - start) / 4, 1e-6)))
        for _ in range(self._gemms):
            a @ a

    def prepare(self, group=None):
        """Leave the core as a step's other layers do: compute_seconds of GEMMs where set, then
        the caches evicted. group: the ranks of a collective about to be timed, which wait for
        each other after the eviction, so that no rank's time holds another's eviction (on the
        AMD EPYC guest that wait was most of a small message's time: alpha fitted at 34-180 us
        where a 256-byte allreduce takes 20-40)."""
        if self._buffer is None:
            self._buffer = np.zeros(_evict_bytes() // 4, np.float32)
        if self.compute_seconds:
            self._compute()
        self._buffer += 1.0
        if group is not None:
            group.Barrier()

    def __call__(self, func, group=None):
        """{'total': seconds} of one call of func() after `prepare(group)` (benchtools.timed)."""
        self.prepare(group)
        return timed(func)


# -- the collectives ---------------------------------------------------------------------------

# A collective in a step follows its layer's kernels, and on the AMD EPYC guest a collective
# right after a few milliseconds of GEMMs on both cores runs 1.5-5x slower than one timed alone
# (a 512 KiB allgather: 75 us after 1 ms of GEMMs, 150-240 us after 2 ms; BENCHMARKS.md): the
# collectives are timed after this long of GEMMs, a layer pass's time in the models cfp plans.
STEP_COMPUTE_SECONDS = 2e-3

# Whole results of 256 bytes (a batch norm's statistics) to 16 MiB: MPI changes protocol over them
# (eager, rendezvous, caches), so the model prices a collective by its measured times in between
MESSAGE_BYTES = [256, 4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]
COLLECTIVE_NAMES = ("allgather", "reduce_scatter", "allreduce", "alltoall")


def collective_call(name, group, m_bytes, grid=None):
    """A zero-argument function running collective `name` with a whole result of ~m bytes.

    Allgather, reduce-scatter and all-to-all move activation-like tensors (8 samples, blocks
    along the channel axis, as a layer's NCHW blocks lie); allreduce moves a flat gradient. The
    sums are donated and the gathers may alias their block, as the layers' are and may (a group
    of one rank then copies nothing). The all-to-all is what a model's all-to-alls are: a
    DistTensor redistributed from a split by samples to a split by channels (tensor.move, the
    redistribution between layers and the halo exchange, with the packing of its pieces) on
    `grid`, a ProcessGrid over `group`; there m is each rank's result, (p - 1) / p of which
    arrives from the others.
    """
    p, r = group.Get_size(), group.Get_rank()
    samples = 8
    channels = max(p, m_bytes // (4 * samples))
    sizes = block_sizes(channels, p)
    full = np.ones((samples, channels), dtype=np.float32)
    mine = np.ones((samples, sizes[r]), dtype=np.float32)
    if name == "allgather":
        return lambda: comm.allgather(group, mine, 1, sizes, may_alias=True)
    if name == "reduce_scatter":
        return lambda: comm.reduce_scatter(group, full, 1, sizes, donate=True)
    if name == "allreduce":  # a weight gradient and its bias, as one message (sync_gradients)
        flat = full.reshape(-1)
        return lambda: comm.allreduce(group, [flat[:-samples], flat[-samples:]], donate=True)
    # each rank's result of m bytes, as the model prices an all-to-all (perfmodel.collective_time)
    by_sample, by_channel = Layout(("sample", None)), Layout((None, "sample"))
    x = DistTensor.from_global(np.ones((samples, channels * p), dtype=np.float32), by_sample, grid)
    return lambda: x.redistribute(by_channel)


def _nnls(a, b):
    """The non-negative least-squares solution x of a x = b (scipy.optimize.nnls). Imported
    here, when a calibration fits: scipy.optimize takes a third of a second to import, which
    every script that imports cfp.train (all of them) would otherwise pay at its start."""
    import scipy.optimize
    return scipy.optimize.nnls(a, b)[0]


def fit_alpha_beta(samples):
    """Non-negative least-squares (alpha, beta) from [(steps, volume bytes, seconds, measured seconds)]
    where `seconds` is what alpha and beta must explain (the measurement less the packing),
    minimising errors relative to the whole measurement (small and large messages alike). The
    weights come from the measurement, not the remainder: a remainder near zero (the packing
    is most of the time) must not outweigh every other sample."""
    a = np.array([[s, v] for s, v, _, _ in samples], dtype=np.float64)
    t = np.array([sec for _, _, sec, _ in samples])
    weights = 1.0 / np.maximum(np.array([total for *_, total in samples]), 1e-9)
    alpha, beta = _nnls(a * weights[:, None], t * weights)
    return float(alpha), float(beta)


def fit_packing(samples):
    """Seconds per byte of the whole result, through the origin, from [(bytes, seconds)]."""
    m = np.array([b for b, _ in samples], dtype=np.float64)
    t = np.array([sec for _, sec in samples])
    return max(float(np.dot(m, t) / np.dot(m, m)), 0.0)


def calibrate_collectives(world, repeats, layout=None):
    """({link: {collective: [alpha, beta]}}, {collective: packing s/byte}, {link: {collective:
    [[p, m bytes, seconds], ...]}}); no links or times on one rank.

    cfp's collectives pack and unpack NCHW blocks with local copies, which cost time even on
    one rank: that packing is measured on a group of one rank (rank 0 alone), and alpha and
    beta are fitted to what remains of the times over groups of neighbouring ranks: those of
    2..R ranks inside a node give the link inside a node ("intra"), those that span nodes
    (2..P neighbours beyond R, and one rank of each of 2..K nodes) the link between nodes
    ("inter", measured only where the ranks span several nodes; with one rank a node, the
    "intra" link is the same numbers: no group of the model's ever uses it). layout: the
    (ranks per node, nodes) of node_layout, where the caller has it. The times are each
    group's, less the packing: the model prices a collective over p ranks by them where it has
    them (perfmodel.MachineProfile.collective_time), alpha and beta elsewhere. Every size of
    MESSAGE_BYTES is timed, quick calibration or not (a second in all on 2 ranks).
    """
    P, rank = world.Get_size(), world.Get_rank()
    per_node, nodes = layout or node_layout(world)
    groups = [(list(range(p)), "intra" if p <= per_node else "inter") for p in range(2, P + 1)]
    if nodes > 1 and per_node > 1:
        groups += [([k * per_node for k in range(p)], "inter") for p in range(2, nodes + 1)]
    samples = {link: {name: [] for name in COLLECTIVE_NAMES} for _, link in groups}
    times = {link: {name: [] for name in COLLECTIVE_NAMES} for _, link in groups}
    # Calibration traffic stays out of any ledger; the collectives run as a training step runs
    # them (train_step checks its batch once, then trusts it: no agreement check per call),
    # after a layer's worth of kernels on every rank (STEP_COMPUTE_SECONDS)
    cold = _Cold(STEP_COMPUTE_SECONDS)
    with comm.use_ledger(comm.CommLedger()), comm.inputs_checked():
        def packing_samples():
            alone = ProcessGrid("sample=1", comm=MPI.COMM_SELF)
            out = {name: [(m, slowest_median(MPI.COMM_SELF, lambda: cold(collective_call(name, MPI.COMM_SELF, m, alone)),
                                            repeats, 1)["total"]) for m in MESSAGE_BYTES] for name in COLLECTIVE_NAMES}
            alone.free()
            return out
        packing = {name: fit_packing(s) for name, s in on_rank0(world, packing_samples).items()}
        for members, link in groups:
            p = len(members)
            group = world.Split(0 if rank in members else MPI.UNDEFINED, rank)
            if rank in members:
                grid = ProcessGrid(f"sample={p}", comm=group)
                for name in COLLECTIVE_NAMES:
                    for m in MESSAGE_BYTES[::-1]:  # largest first: a small one timed after a large one ran slow
                        call = collective_call(name, group, m, grid)
                        seconds = slowest_median(group, lambda: cold(call, group), repeats, 2)["total"]
                        steps, volume = (2 * (p - 1), 2 * (p - 1) / p * m) if name == "allreduce" \
                            else (p - 1, (p - 1) / p * m)
                        remainder = max(seconds - packing[name] * m, 0.0)
                        samples[link][name].append((steps, volume, remainder, seconds))
                        times[link][name].append([p, m, remainder])
                grid.free()
                group.Free()
            quiet_barrier(world)
    if P < 2:
        return {}, packing, {}
    links = {}
    for link in ("intra", "inter"):
        if link in samples:
            fitted = np.array([fit_alpha_beta(samples[link][name]) if samples[link][name] else (0.0, 0.0)
                               for name in COLLECTIVE_NAMES])
            world.Bcast(fitted, root=0)  # rank 0's fit, to every rank (rank 0 is in every group)
            links[link] = {name: [float(a), float(b)] for name, (a, b) in zip(COLLECTIVE_NAMES, fitted)}
    links.setdefault("intra", links.get("inter"))
    times = world.bcast(times, root=0)
    times.setdefault("intra", times.get("inter"))
    return links, packing, times


PROGRESS_BYTES = 8 << 20  # the allreduce whose progress behind computation is measured: a bucket's size
PROGRESS_TESTS = 4  # the test() calls while it is in flight: as many as layers end during a bucket's sum


def calibrate_progress(world, repeats, link):
    """{link: fraction}: how much of a started allreduce over all of `world` moves while its
    ranks compute, as a gradient bucket's does during backward (train_step's bucket_mb): the
    blocking allreduce of PROGRESS_BYTES takes t; started, then GEMMs for t with PROGRESS_TESTS
    test() calls spread over it (what cfp does as each layer of backward ends), its wait()
    takes w; the fraction is 1 - w / t, clipped to [0, 1] (the slowest rank's medians; 0: the
    transport moves data only inside MPI calls). {} on one rank (no link)."""
    if world.Get_size() < 2:
        return {}
    data = np.ones(PROGRESS_BYTES // 4, dtype=np.float32)
    a = np.ones((192, 192), dtype=np.float32)
    with comm.use_ledger(comm.CommLedger()), comm.inputs_checked():
        blocking = slowest_median(world, lambda: timed(lambda: comm.allreduce(world, data.copy(), donate=True)),
                                  repeats, 1)["total"]

        def overlapped():
            pending = comm.iallreduce(world, data.copy(), donate=True)
            begin = time.perf_counter()
            for k in range(1, PROGRESS_TESTS + 1):  # a bucket's time spans a few layers, a test() after each
                while time.perf_counter() < begin + blocking * k / PROGRESS_TESTS:
                    a @ a
                pending.test()
            start = time.perf_counter()
            pending.wait()
            return {"total": time.perf_counter() - start}
        waited = slowest_median(world, overlapped, repeats, 1)["total"]
    fraction = float(world.bcast(min(1.0, max(0.0, 1.0 - waited / blocking)) if blocking > 0 else 0.0, root=0))
    return {link: fraction}


def check_fits(links, packing):
    """ValueError when a fit is physically impossible: a collective whose large messages would
    cost zero seconds per byte (beta and the packing both zero), which is what a noisy machine
    produces. beta = 0 alone is possible: on two ranks the per-byte cost of the link and of
    the packing cannot be told apart, and the packing may carry all of it."""
    bad = [name for name, (alpha, beta) in links.items() if not beta + packing.get(name, 0.0) > 0]
    if bad:
        raise ValueError(f"the fit of {', '.join(bad)} gives zero seconds per byte, which no link has: "
                         f"the timings were too noisy; rerun on a quiet machine (or with more --repeats)")


# -- the kernels -------------------------------------------------------------------------------

MAX_FLOPS = 3e9  # the largest shapes are left out: their rate is the last measured one's

# Families of layers, (K, stride, dilation, depthwise, channels, sides, filters): every path of
# the kernel table is reached by some family (tests/test_calibration.py checks it), each over
# the channel counts and image sides that move its rate. Filters: as many as channels, or 64 on
# a first layer's few channels, unless the family names them. Samples: 1, 8 and 32 (quick: 1
# and 32).
FAMILIES = (
    (3, 1, 1, False, (16, 64, 256, 512), (2, 4, 8, 16, 32), None),  # Winograd where it pays, else im2col / plane
    (3, 2, 1, False, (16, 64, 256), (4, 8, 16, 32), None),  # im2col, col2im
    (1, 1, 1, False, (16, 64, 256, 512), (2, 4, 8, 16), None),  # pointwise (below 64 channels the same)
    (1, 2, 1, False, (16, 64, 256), (4, 8, 16), None),  # im2col at a stride
    (5, 1, 1, False, (16, 64, 256), (4, 8, 16), None),  # im2col, plane columns
    (3, 1, 1, False, (1, 3), (8, 16, 32), None),  # a network's first layer: per-sample columns
    (3, 1, 1, False, (16, 64, 256), (8, 16, 32), 4),  # a rank's few filters: backward-data by per-sample columns
    (3, 1, 2, False, (16, 64, 256), (8, 16, 32), None),  # dilated: Winograd on the sub-grids
    (3, 1, 1, True, (16, 64, 256), (4, 8, 16, 32), None),  # depthwise bands
    (3, 2, 1, True, (16, 64, 256), (4, 8, 16, 32), None),  # depthwise, banded backward-data
)
SAMPLES = (1, 8, 32)


def kernel_shapes(quick):
    """[(N, C, F, H, K, stride, dilation, groups)] of the layers calibration measures (H = W,
    padding dilation * (K // 2)), within MAX_FLOPS."""
    out = []
    for K, stride, dilation, depthwise, channels, sides, filters in FAMILIES:
        for C in channels[::2] if quick else channels:
            F = filters or (64 if C < 16 else C)
            for H in sides[::2] if quick else sides:
                for N in SAMPLES[::2] if quick else SAMPLES:
                    groups = C if depthwise else 1
                    shape = (N, C, F, H, K, stride, dilation, groups)
                    if _flops(_geometry(shape)) <= MAX_FLOPS:
                        out.append(shape)
    return out


def _geometry(shape):
    """The ConvGeometry of a kernel_shapes entry (square, "same" padding)."""
    N, C, F, H, K, stride, dilation, groups = shape
    return conv_geometry((N, C, H, H), (F, C // groups, K, K), stride, dilation * (K // 2), dilation, groups)


def _shapes_and_args(g):
    """(x shape, w shape, the kernels' keyword arguments) of geometry g (zero padding)."""
    args = dict(stride=(g.sh, g.sw), padding=(g.pt, g.pb, g.pl, g.pr), dilation=(g.dh, g.dw), groups=g.G)
    return (g.N, g.C, g.H, g.W), (g.F, g.C // g.G, g.Kh, g.Kw), args


def _flops(g):
    return float(geometry_flops(g))


KERNEL_ROUND_BYTES = 256 << 20  # the arrays of the geometries calibrate_kernels times round by round


def _rounds(geometries):
    """geometries in consecutive groups whose arrays (x, w and y, float32) fit in
    KERNEL_ROUND_BYTES together (a larger one alone)."""
    group, size = [], 0
    for g in geometries:
        x_shape, w_shape, _ = _shapes_and_args(g)
        need = 4 * (math.prod(x_shape) + math.prod(w_shape) + g.N * g.F * g.Ho * g.Wo)
        if group and size + need > KERNEL_ROUND_BYTES:
            yield group
            group, size = [], 0
        group.append(g)
        size += need
    if group:
        yield group


def calibrate_kernels(world, geometries, repeats, progress=None, table=None):
    """{pass: {path: [[flops, rows, flop/s, geometry], ...]}}: each pass of each ConvGeometry
    timed on every rank of `world` at once, the three passes in turn on cold caches (as a
    training step runs them; the slowest rank's median of `repeats`), and filed under the path
    the kernel table takes for it, its rows (paths.rate_key) and the geometry's name
    (paths.geometry_key), float32. `table`: add to this one.

    The repetitions go round the geometries (those whose arrays fit in KERNEL_ROUND_BYTES at
    a time: _rounds), each once a round after a warm-up round, as validate_model and bench_plans
    go round their plans: a slow spell of a shared host (on the AMD EPYC guest, 15-30% for a
    second or more) then costs one sample of many geometries instead of every sample of one,
    which had left a layer's predictions 20-28% apart between two calibrations."""
    rng = np.random.default_rng(0)
    cold = _Cold()
    table = {name: {} for name in paths.PASSES} if table is None else table
    done = 0
    for group in _rounds(geometries):
        samples = _in_rounds(world, [_kernel_step(g, rng, cold) for g in group], repeats)
        for g, kept in zip(group, samples):
            flops = _flops(g)
            for name in paths.PASSES:
                seconds = statistics.median(s[name] for s in kept)
                path, rows = paths.rate_key(name, g, np.dtype(np.float32))
                table[name].setdefault(path, []).append([flops, float(rows), flops / seconds, paths.geometry_key(g)])
            done += 1
            if progress:
                progress(done, len(geometries))
    return table


def _in_rounds(world, steps, repeats):
    """[[{pass: seconds}, ...] of each step]: every step (slowest_median's) once a round, a
    warm-up round and `repeats` timed ones, the slowest rank's time of each."""
    samples = [[] for _ in steps]
    for round_ in range(1 + repeats):
        for step, kept in zip(steps, samples):
            seconds = slowest_median(world, step, 1, 0)
            if round_:
                kept.append(seconds)
    return samples


def _passes_step(op, x_shape, w_shape, options, rng, cold):
    """A step for slowest_median: the three passes of convolution kind `op` (kernels/conv/ops.py)
    on x and w of these shapes in turn, each on cold caches, as a layer's training step runs
    them ({pass: seconds})."""
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    y = op.forward(x, w, None, **options)
    calls = {"forward": lambda: op.forward(x, w, None, **options),
             "backward-data": lambda: op.backward_data(y, w, x.shape, **options),
             "backward-filter": lambda: op.backward_filter(x, y, w.shape, **options)}
    return lambda: {name: cold(call)["total"] for name, call in calls.items()}


def _kernel_step(g, rng, cold):
    """_passes_step of geometry g (zero padding)."""
    return _passes_step(OPS["conv2d"], *_shapes_and_args(g), rng, cold)


def _has_points(profile_data, keys):
    """Whether the profile's kernel rates have a point of each (pass, path, geometry name)."""
    return all(any(len(p) > 3 and p[3] == key for p in profile_data["kernels"][name].get(path, []))
               for name, path, key in keys)


def measured(profile_data, g):
    """Whether every pass of geometry g has a point of its own in the profile's kernel rates
    (the same path, measured on g: paths.geometry_key)."""
    key = paths.geometry_key(g)
    return _has_points(profile_data, [(name, paths.rate_key(name, g, np.dtype(np.float32))[0], key)
                                      for name in paths.PASSES])


def top_up(world, profile_data, geometries, repeats=5, volumes=()):
    """Measure the kernels of those `geometries` (ConvGeometry, zero padding) the profile has
    no points of (`measured`), adding them to profile_data's rates in place, as FFTW adds to its
    wisdom: the planner's own layers are then priced at measured rates, not interpolated ones
    (the median of 5 by default: these points price the plan itself, where the quick
    calibration's 3 left a layer's prediction 15% apart between two runs). `volumes`: [(block,
    its stacked geometry)] of Conv3d layers (perfmodel.local_block), timed as volumes where the
    profile has no points of them (calibrate_volumes). Returns how many were measured (the
    same on every rank)."""
    missing = [g for g in dict.fromkeys(geometries) if g.N * g.C * g.F > 0 and not measured(profile_data, g)]
    calibrate_kernels(world, missing, repeats, table=profile_data["kernels"])
    unmeasured = {}
    for block, plane in volumes:
        if plane is not None and plane.N * plane.C * plane.F > 0 and not volume_measured(profile_data, block, plane):
            unmeasured.setdefault(volume_key("forward", block, plane)[1], (block, plane))
    calibrate_volumes(world, list(unmeasured.values()), repeats, profile_data["kernels"])
    return len(missing) + len(unmeasured)


def volume_measured(profile_data, block, plane):
    """Whether every pass of a volume's block (perfmodel.local_block; `plane` its stacked
    geometry) has a point of its own in the profile's kernel rates (perfmodel.volume_key)."""
    return _has_points(profile_data, [(name, *volume_key(name, block, plane)) for name in paths.PASSES])


def calibrate_volumes(world, volumes, repeats, table):
    """Time the three Conv3d passes of each volume block (x shape, w shape, options) with its
    stacked geometry `plane` [(block, plane)] on every rank of `world` at once, on cold caches,
    the blocks in rounds as calibrate_kernels goes, and file each pass under
    perfmodel.volume_key at the stacked geometry's flops and rows (float32), in `table`."""
    rng = np.random.default_rng(0)
    cold = _Cold()
    samples = _in_rounds(world, [_passes_step(OPS["conv3d"], *block, rng, cold) for block, _ in volumes], repeats)
    for (block, plane), kept in zip(volumes, samples):
        flops = _flops(plane)
        for name in paths.PASSES:
            seconds = statistics.median(s[name] for s in kept)
            path, key = volume_key(name, block, plane)
            _, rows = paths.rate_key(name, plane, np.dtype(np.float32))
            table[name].setdefault(path, []).append([flops, float(rows), flops / seconds, key])


# -- the layers between convolutions -----------------------------------------------------------

# (n, c, side) of the element-wise layers' inputs: 1 to 2^20 elements, large images with few
# channels and small ones with many (a network's last stages).
LAYER_SIZES = ((1, 1, 2), (8, 16, 8), (32, 256, 2), (32, 128, 4), (8, 64, 16), (32, 64, 16), (64, 64, 16))
VOLUME_SIZES = ((1, 4, 8), (2, 16, 16), (1, 32, 32))  # (samples, channels, side) of the volumes timed
PARAMETER_SIZES = (1, 4096, 1 << 16, 1 << 20)


def _fit_line(points):
    """[seconds, seconds per unit] fitted through [(units, seconds)], both non-negative,
    minimising relative errors (the smallest sizes give the fixed cost, the largest the rate)."""
    a = np.array([[1.0, u] for u, _ in points])
    t = np.array([s for _, s in points])
    weights = 1.0 / np.maximum(t, 1e-9)
    fixed, rate = _nnls(a * weights[:, None], t * weights)
    return [float(fixed), float(rate)]


def calibrate_layers(world, repeats):
    """{kind: [seconds, seconds per element]} of one forward and backward of each layer kind
    the cost model adds to the convolutions (perfmodel.LAYER_KINDS), on every rank of `world`
    at once, each on a grid of its own (the slowest rank's median):
    batchnorm, relu, maxpool (2x2, per input element), upsample (nearest by 2, per input
    element), add (a residual block's sum of its two branches and of their gradients), loss
    (the global pool, the classifier's flatten and the softmax cross-entropy, per logit), conv
    (a convolution module's own time beyond its kernels: its fixed cost), volume (a volume's
    copies of its planes around its 2-D passes, per element copied: kernels/conv/volume.py's
    copy_passes and copied_elements), and optimizer (SGD with momentum, per parameter tensor
    and element); each module inside the containers a model runs it in (`through`)."""
    grid = ProcessGrid("sample=1", comm=MPI.COMM_SELF)
    rng = np.random.default_rng(0)
    cold = _Cold()

    def median(call):
        return slowest_median(world, lambda: cold(call), repeats, 1)["total"]

    def through(module, x):
        """A forward and backward of `module` on x as a model runs it: inside a Sequential, on a
        DistTensor (the containers' bookkeeping around each module is part of its cost: 15 us
        a module here, hot, against 2 us for a bare ReLU's passes)."""
        model = Sequential(module)
        spec = module.input_spec or (grid, Layout(("sample", "channel", None, None)))
        t = DistTensor(x, x.shape, spec[1], grid)
        return lambda: model.backward(model.forward(t))

    points = {kind: [] for kind in ("batchnorm", "relu", "maxpool", "upsample", "add", "loss")}
    with comm.use_ledger(comm.CommLedger()), comm.inputs_checked():
        for n, c, side in LAYER_SIZES:
            x = rng.standard_normal((n, c, side, side)).astype(np.float32)
            elements = x.size
            bn = BatchNorm2d(grid, c)
            points["batchnorm"].append((elements, median(through(bn, x))))
            points["relu"].append((elements, median(through(ReLU(), x))))
            points["maxpool"].append((elements, median(through(MaxPool2d(2), x))))
            points["upsample"].append((elements, median(through(Upsample(2), x))))
            points["add"].append((elements, median(through(Residual(Sequential()), x))))
            pool, loss = GlobalAvgPool2d(), SoftmaxCrossEntropy(grid)
            labels = rng.integers(0, c, n)

            def head():
                logits = pool.forward(x)
                loss.forward(logits, labels)
                pool.backward(loss.backward())
            points["loss"].append((elements, median(head)))
        out = {kind: _fit_line(p) for kind, p in points.items()}
        stacking = []
        for n, c, side in VOLUME_SIZES:  # a volume's copies of its planes (kernels/conv/volume.py)
            x = rng.standard_normal((n, c, side, side, side)).astype(np.float32)
            w_shape = (c, c, 3, 3, 3)
            plane = volume_geometry(x.shape, w_shape, padding=1).plane
            stacking.append((sum(stacked_copies(plane).values()), median(lambda: copy_passes(x, w_shape, padding=1))))
        out["volume"] = _fit_line(stacking)
        # the module's own time: its passes less its kernels' calls, whose per-call cost the
        # kernel rates hold already (about 100 of a 1x1 convolution's 160-290 us on the AMD EPYC guest)
        conv = Conv2d(grid, 1, 1, 1, algorithm="sample", bias=False, name="calibration")
        tiny = np.ones((1, 1, 1, 1), np.float32)
        conv.input_shape = tiny.shape
        passes, kernels = through(conv, tiny), count_kernel_seconds(conv.conv)

        def beyond_kernels():
            cold.prepare()
            kernels[0] = 0.0
            return {"total": timed(passes)["total"] - kernels[0]}
        out["conv"] = [slowest_median(world, beyond_kernels, repeats, 1)["total"], 0.0]
        updates = []
        for size in PARAMETER_SIZES:
            p = Parameter("p", np.zeros(size, np.float32), (size,))
            p.grad = np.ones(size, np.float32)
            sgd = SGD([p], 0.01, momentum=0.9)
            updates.append((size, median(sgd.step)))
        out["optimizer"] = _fit_line(updates)
    grid.free()
    return out


# -- a whole profile ---------------------------------------------------------------------------

def calibrate(world, quick=False, repeats=5, threads=1, name=None, progress=None):
    """The machine profile (a dict, format FORMAT) measured on the ranks of `world` at `threads`
    BLAS threads per rank: collectives over groups of 2..P ranks (none on one rank), kernels and
    layers on every rank at once, as a step runs them (so that ranks sharing a node's memory
    and caches slow each other as they will). Every rank returns the same profile (rank 0's).
    progress(done, total) as the kernel shapes finish."""
    start = time.time()
    backend.set_blas_threads(threads)
    per_node, nodes = node_layout(world)
    links, packing, times = calibrate_collectives(world, repeats, (per_node, nodes))
    for table in links.values():
        check_fits(table, packing)  # rank 0's fit on every rank: every rank judges alike

    # over every rank: the link between nodes where they span several
    moving = calibrate_progress(world, 3 if quick else repeats, "inter" if nodes > 1 else "intra")
    kernels = calibrate_kernels(world, [_geometry(s) for s in kernel_shapes(quick)], 3 if quick else repeats,
                                progress)
    kernels, layers = world.bcast((kernels, calibrate_layers(world, 3 if quick else repeats)), root=0)
    P = world.Get_size()
    record = machine_record(P, threads, per_node)
    host = record["host"] or "this machine"
    where = f"{nodes} nodes of {per_node} rank(s)" if nodes > 1 else f"{P} rank(s)"
    return {
        "format": FORMAT, "name": name or (f"{host} ({P} rank{'s' if P > 1 else ''})" if nodes == 1 else
                                           f"{host} and {nodes - 1} more nodes ({per_node} ranks each)"),
        "itemsize": 4, "ranks_per_node": per_node, "machine": record,
        "source": (f"calibrated by cfp on {host} ({record['cpu']}), {where} of {threads} BLAS thread(s), "
                   f"{datetime.date.today().isoformat()}, {'quick' if quick else 'full'} run, "
                   f"{time.time() - start:.0f} s"),
        "links": links,
        "collective_times": times,
        "packing": packing,
        "progress": moving,
        "kernels": kernels,
        "layers": layers,
    }


# -- the cache ---------------------------------------------------------------------------------

def cache_dir():
    """Where calibrated profiles are kept: $CFP_CACHE_DIR, else $XDG_CACHE_HOME/cfp, else
    ~/.cache/cfp."""
    if os.environ.get("CFP_CACHE_DIR"):
        return os.environ["CFP_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cfp")


def cache_path(record, directory=None):
    """The cache file of the profile of machine record `record` (its MACHINE_KEYS hashed)."""
    key = hashlib.sha256(repr([(k, record[k]) for k in MACHINE_KEYS]).encode()).hexdigest()[:16]
    return os.path.join(directory or cache_dir(), f"profile-v{FORMAT}-{key}.json")


def _cached(path, record, warn):
    """The profile dict in the cache file `path` if it is a readable profile of this format
    that describes machine `record`; None (with one line of warning where a file is there
    but unusable) otherwise."""
    if not os.path.exists(path):
        return None
    try:
        data = load_json(path, "cached machine profile")
        MachineProfile(data, where=f"cached machine profile {path!r}")
        different = differences(data.get("machine"), record)
        if different:
            raise ValueError(f"it describes another machine or kernels: {'; '.join(different)}")
        return data
    except (ValueError, OSError) as e:
        warn(f"cfp: ignoring the cached machine profile {path}: {e}; calibrating again")
        return None


def _cache(path, data):
    """Write profile `data` to cache file `path` (atomically); says where it went, or why not."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_json(path, data)
        return f"cached in {path}"
    except (OSError, ValueError) as e:
        return f"not cached ({e})"


def profile_for(world, threads, layers=None, directory=None, out=None, chunks=False):
    """This machine's profile (a perfmodel.MachineProfile) for a run on the ranks of `world` at
    `threads` BLAS threads per rank: the cached one (cache_dir()) where it matches this
    machine, its ranks and threads and cfp's kernels; else a quick calibration, announced by a
    progress line, cached for the next run (written atomically; a cache that cannot be
    written is said and skipped). `layers` (perfmodel.LayerShape): the local convolutions of
    every option the planner weighs for them are measured where the profile has no points of
    them (top_up), and kept in the cache too; chunks: also those of their options in chunks
    (planner.geometries). The same on every rank."""
    out = out or sys.stdout
    rank0 = world.Get_rank() == 0
    record = machine_record(world.Get_size(), threads, node_layout(world)[0])
    path = cache_path(record, directory)

    def say(line):
        print(line, file=out, flush=True)
    data = _cached(path, record, say) if rank0 else None
    fresh = world.bcast(data is None, root=0)
    if fresh:
        if rank0:
            say(f"cfp: no machine profile for this machine, {world.Get_size()} rank(s) and cfp's kernels in "
                f"{os.path.dirname(path)}; calibrating (quick, a few seconds)...")
        start = time.time()
        data = calibrate(world, quick=True, threads=threads)
        if rank0:
            say(f"cfp: calibrated in {time.time() - start:.1f} s, {_cache(path, data)}")
    data = world.bcast(data, root=0)
    if layers:
        from .planner import geometries
        start = time.time()
        planes, volumes = geometries(layers, world.Get_size(), MachineProfile(data), chunks=chunks)
        added = top_up(world, data, planes, volumes=volumes)
        if added and rank0:  # (every rank measured the same slowest-rank rates)
            say(f"cfp: measured the kernels of {added} more layer shape(s) the planner weighs in "
                f"{time.time() - start:.1f} s, {_cache(path, data)}")
    return MachineProfile(data, where=f"machine profile {path!r}")


def warn_if_foreign(profile, world, threads, out=None):
    """One line of warning on rank 0 when `profile` records a machine other than this one
    (differences names what differs); nothing for a profile without a record."""
    per_node = node_layout(world, strict=False)[0]  # (collective: every rank)
    if world.Get_rank() != 0:
        return
    different = differences(profile.machine, machine_record(world.Get_size(), threads, per_node))
    if different:
        print(f"cfp: warning: machine profile {profile.name!r} was measured elsewhere ({'; '.join(different)}): "
              f"its predictions may not hold here; run without --profile to calibrate this machine",
              file=out or sys.stdout, flush=True)


def machine_profile(name, world, threads, layers=None, chunks=False):
    """The profile a run on `world` at `threads` BLAS threads per rank plans `layers` with: the
    one named (a JSON file or a built-in name, used as it is, with one line of warning when it
    records another machine), or, with `name` None, this machine's own (profile_for: cached or
    calibrated, and topped up with the layers' own shapes, and with chunks those of their
    options in chunks, for a planner asked to choose them)."""
    if name is None:
        return profile_for(world, threads, layers, chunks=chunks)
    profile = MachineProfile.load(name)
    warn_if_foreign(profile, world, threads)
    return profile
