"""Timing helpers shared by the benchmark and validation scripts."""
import statistics
import time

import numpy as np
from mpi4py import MPI

from . import backend, comm
from .algorithms import make_conv
from .tensor import DistTensor, check_blocks


def prepare(world, json_path):
    """What every benchmark does before its work: refuse a --json path that cannot be written
    (on every rank alike, so nothing is measured in vain) and run one BLAS thread per rank."""
    from .checks import alike_on_all_ranks
    from .io import check_writable
    if json_path:
        alike_on_all_ranks(world, lambda: check_writable(json_path, "--json"))
    backend.set_blas_threads(1)


def slowest_median(world, step, repeats, warmup):
    """Median over `repeats` (after `warmup`) of the slowest rank's time for each part.

    step() runs one iteration on every rank of `world` and returns {part: seconds}.
    """
    samples = []
    for i in range(warmup + repeats):
        world.Barrier()
        parts = step()
        names = sorted(parts)  # the same parts on every rank, in one buffer
        most = np.empty(len(names))
        world.Allreduce(np.array([parts[k] for k in names], dtype=np.float64), most, op=MPI.MAX)
        slowest = dict(zip(names, (float(v) for v in most)))
        if i >= warmup:
            samples.append(slowest)
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def timed(func):
    """{'total': seconds} of one call of func(): a step for slowest_median."""
    start = time.perf_counter()
    func()
    return {"total": time.perf_counter() - start}


def quiet_barrier(world):
    """A barrier that sleeps instead of spinning while it waits, leaving the cores to the
    ranks still working."""
    request = world.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


def on_rank0(world, work):
    """work() on rank 0 alone, its result broadcast to every rank; the others wait in a
    quiet_barrier, so rank 0 has the machine's cores to itself (a one-rank baseline measured
    inside a P-rank job). Where work() raises, rank 0 raises it and every other rank a
    RuntimeError with its message, after the same barrier: all ranks stop together, none is
    left waiting for a rank that has gone."""
    result, failure, problem = None, None, None
    if world.Get_rank() == 0:
        try:
            result = work()
        except Exception as e:  # any failure: the others must not wait in the barrier for ever
            failure, problem = e, f"{type(e).__name__}: {e}"
    quiet_barrier(world)
    result, problem = world.bcast((result, problem), root=0)
    if failure is not None:
        raise failure
    if problem is not None:
        raise RuntimeError(f"rank 0 failed: {problem}")
    return result


KERNELS = ("local_forward", "local_backward_data", "local_backward_filter")


def count_kernel_seconds(conv):
    """Make the local kernels of `conv` (its KERNELS methods) add the seconds they take to the
    one-element list returned (on a device, each call synchronised: its kernels' time, not
    their launch's)."""
    spent = [0.0]
    for name in KERNELS:
        def timed_kernel(*args, kernel=getattr(conv, name), **kwargs):
            start = time.perf_counter()
            try:
                return kernel(*args, **kwargs)
            finally:
                backend.synchronize(args[0])  # (its input: an array of the device it ran on)
                spent[0] += time.perf_counter() - start
        setattr(conv, name, timed_kernel)
    return spent


BREAKDOWN = ("step", "kernels", "packing", "mpi", "wait", "rest")


def measure_conv(world, grid, algorithm, p_f, x, w, b, dy, stride, padding, repeats, warmup, xp=np,
                 halo_interior=False, op="conv2d", output_padding=0, chunks=1):
    """Time one distributed convolution, forward and backward, on the global tensors x, w, b, dy.

    Returns forward_s and backward_s (median of the slowest rank), and the most any rank sent
    per iteration (bytes_sent_per_rank; of them in the halo exchange, halo_bytes_per_rank),
    holds as weights (weight_bytes_per_rank) and keeps from forward to backward
    (kept_activation_bytes_per_rank); and `breakdown`, each rank's median seconds (BREAKDOWN)
    of a step: in its local kernels, in the collectives' local copies (the ledger's
    pack_seconds), in MPI calls (seconds), waiting for the group (wait_seconds), and the rest
    (the layer's own code around them). xp: the array module the layer runs on (the tensors
    moved there once; each pass synchronised before its clock stops). halo_interior: the
    layer's (ConvAlgorithm.halo_interior). op: the kind of convolution (kernels/conv/ops.py;
    'conv3d' for a volume's x (N, C, D, H, W)), output_padding a transposed one's. chunks:
    the layer's (ConvAlgorithm.chunks: its collectives pipelined over that many chunks of
    samples)."""
    conv = make_conv(algorithm, grid, x.shape[1], w.shape[0], w.shape[2:], filter_groups=p_f,
                     stride=stride, padding=padding, layer="conv", halo_interior=halo_interior, op=op, chunks=chunks,
                     **({"output_padding": output_padding} if output_padding else {}))
    x_local = DistTensor.from_global(x, conv.input_layout, grid).local
    dy_local = DistTensor.from_global(dy, conv.output_layout, grid).local
    w_shard, b_shard = conv.shard_weight(w), conv.shard_bias(b)
    x_local, dy_local, w_shard, b_shard = (backend.from_host(a, xp) for a in (x_local, dy_local, w_shard, b_shard))
    ledger = comm.CommLedger()
    check_blocks(x_local, conv.input_layout, grid, "x")  # once; the timed calls then skip the check
    kernel_seconds = count_kernel_seconds(conv)
    parts = []  # this rank's BREAKDOWN of every iteration

    def step():
        ledger.reset()
        kernel_seconds[0] = 0.0
        with comm.use_ledger(ledger), comm.inputs_checked():
            t0 = time.perf_counter()
            conv.forward(x_local, w_shard, b_shard, input_shape=x.shape)
            backend.synchronize(x_local)
            t1 = time.perf_counter()
            conv.backward(dy_local)
            backend.synchronize(x_local)
            t2 = time.perf_counter()
        records = ledger.records
        spent = {"step": t2 - t0, "kernels": kernel_seconds[0], "packing": sum(r.pack_seconds for r in records),
                 "mpi": sum(r.seconds for r in records), "wait": sum(r.wait_seconds for r in records)}
        spent["rest"] = spent["step"] - sum(v for k, v in spent.items() if k != "step")
        parts.append(spent)
        return {"forward": t1 - t0, "backward": t2 - t1}

    times = slowest_median(world, step, repeats, warmup)
    mine = {k: statistics.median(p[k] for p in parts[warmup:]) for k in BREAKDOWN}
    kept = conv.kept_bytes
    sent = sum(r.bytes_sent for r in ledger.records)
    halo = sum(r.bytes_sent for r in ledger.records if r.phase == "halo")
    most = np.empty(4)
    world.Allreduce(np.array([sent, w_shard.nbytes + b_shard.nbytes, kept, halo], dtype=np.float64), most,
                    op=MPI.MAX)
    return {"forward_s": times["forward"], "backward_s": times["backward"],
            "bytes_sent_per_rank": int(most[0]), "weight_bytes_per_rank": int(most[1]),
            "kept_activation_bytes_per_rank": int(most[2]), "halo_bytes_per_rank": int(most[3]),
            "breakdown": world.allgather(mine)}


def measure_steps(world, model_name, plans, arch, batch, x, y, steps, warmup, bucket_mb=0):
    """{label: the slowest rank's median seconds of one training step} (forward, loss, backward,
    SGD with momentum) of model `model_name` (models.MODELS, with `arch`) built on the ranks of
    `world` under each plan of `plans` ({label: {layer: {"grid", "algorithm", "filter_groups",
    "node_axes"}}}),
    on the global batch x, y (float32); bucket_mb: train_step's (the gradient sums started in
    buckets during backward).

    Every plan's model is built first and the steps go round the plans, one step of each in
    turn: a machine whose speed drifts or stalls for a while (a shared host) then slows every
    plan alike instead of the one that happened to be running."""
    from .grid import ProcessGrid
    from .models import build_model
    from .nn import SoftmaxCrossEntropy
    from .optim import SGD
    from .train import train_step
    base = ProcessGrid(f"sample={world.Get_size()}", comm=world)
    runs = {}
    for label, entries in plans.items():
        model = build_model(model_name, base, plan=entries, batch=batch, dtype=np.float32, **arch)
        (rows,) = model.input_spec[1].head(1).indices((len(x),), model.grid, model.grid.coords)
        runs[label] = (model, SoftmaxCrossEntropy(model.grid), SGD(model.parameters(), 0.01, momentum=0.9),
                       x[rows.start:rows.stop], y[rows.start:rows.stop])

    def one_round():  # one step of every plan, each timed alone
        out = {}
        for label, (model, loss_fn, optimizer, xs, ys) in runs.items():
            # the sleeping barrier's ranks wake up to 2 ms apart, and the first to wake would
            # wait for the other inside the step: a tight barrier then starts them together
            quiet_barrier(world)
            world.Barrier()
            out[label] = timed(lambda: train_step(model, loss_fn, optimizer, xs, ys, bucket_mb))["total"]
        return out
    seconds = slowest_median(world, one_round, steps, warmup)
    for model, *_ in runs.values():
        model.free()
    base.free()
    return {label: seconds[label] for label in plans}


def plan_grids(entries):
    """The grids of plan entries in the order the layers first use them, each with its
    placement where that is not channel fastest: ['sample=2,channel=2 (node axes: sample)']."""
    return list(dict.fromkeys(e["grid"] + (f" (node axes: {e['node_axes']})" if e.get("node_axes") else "")
                              for e in entries.values()))


def same_plan(a, b):
    """Whether plan entries `a` and `b` run every layer alike: the same layers, each on the
    same grid (its axes of one rank ignored: 'sample=2,channel=1' is 'sample=2'), algorithm,
    filter groups, placement and chunks."""
    from .grid import parse_grid_spec

    def canonical(entry):
        grid = {axis: n for axis, n in parse_grid_spec(entry["grid"]).items() if n > 1}
        return (sorted(grid.items()), entry["algorithm"], entry.get("filter_groups"), entry.get("node_axes") or None,
                entry.get("chunks", 1))
    return a.keys() == b.keys() and all(canonical(a[name]) == canonical(b[name]) for name in a)


def with_planner(plans, mine):
    """(the plans to measure, [(label, entries, the measured plan's label)] to report) of the
    single-grid `plans` and the planner's plan entries `mine`, last: where `mine` is one of the
    single-grid plans (same_plan) it is that plan, measured once and reported as 'planner (=
    that plan)'; timing it twice would set the same plan against itself, which measures only
    the steps' spread. What bench_plans and validate_model time."""
    same = next((label for label, entries in plans.items() if same_plan(entries, mine)), None)
    measured = dict(plans) if same else {**plans, "planner": mine}
    rows = [(label, entries, label) for label, entries in plans.items()]
    rows.append(("planner", mine, "planner") if same is None else (f"planner (= {same})", mine, same))
    return measured, rows


def single_grid_plans(names, ranks, algorithms=None, profile=None):
    """{label: plan entries} of every grid of `ranks` ranks (sample x channel) with every
    algorithm (sample where P_c = 1; x, y and w for each p_f otherwise; or those of
    `algorithms`), all layers `names` alike; with a `profile`, on every placement the planner
    weighs for the grid on its nodes (planner.placements), else channel fastest."""
    from .grid import ProcessGrid, factorizations
    from .planner import placements
    out = {}
    for P_n, P_c in factorizations(ranks):
        shape = {"sample": P_n, "channel": P_c}
        grid = ProcessGrid.describe_shape(shape)
        if P_c == 1:
            options = [("sample", None)]
        else:
            options = [("x", None), ("y", None)] + [("w", d) for d in range(1, P_c + 1) if P_c % d == 0]
        for node_axes in [None] if profile is None else placements(shape, profile):
            placed = {"node_axes": ",".join(node_axes)} if node_axes else {}
            for algorithm, p_f in options:
                if algorithms is not None and algorithm not in algorithms:
                    continue
                entry = {"grid": grid, "algorithm": algorithm, **({"filter_groups": p_f} if p_f else {}), **placed}
                label = f"{grid} {algorithm}" + (f" p_f={p_f}" if p_f else "") + \
                    (f" [node axes: {placed['node_axes']}]" if placed else "")
                out[label] = {name: dict(entry) for name in names}
    return out
