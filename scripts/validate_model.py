"""Predicted against measured time of every algorithm and grid on a set of layers, and of
whole training steps, at the current rank count; marks the planner's choice and the measured
fastest.

    mpiexec -n 2 python -m mpi4py scripts/validate_model.py [--profile PROFILE] [--repeats 3]
        [--steps 5] [--json out.json]

Layers, measured: forward + backward of one distributed convolution (scripts/bench_conv.py's
timing: median of the slowest rank over --repeats rounds, each round one repetition of every
option of every layer, 1 BLAS thread per rank, float32); predicted: cfp.perfmodel's
kernel and communication time of the layer (layer_cost's compute and comm). Steps, measured: a
training step (forward, loss, backward, SGD update) of the ResNet and the wide CNN on every
grid under sample, x and y, and under the planner's own plan (measured once where it is one of
them); predicted: planner.price_plan's step (every layer's kernels, collectives, the layers after it and its update, and the
redistributions). The profile is this machine's (calibrated once and cached) unless --profile
names one. At 2 or more ranks it ends with a memory check: a model too large for a limit on
one rank, planned under the limit. A speed probe (one layer's kernels, measured over
predicted) before the layers, before the steps and at the end says how fast the machine ran
then against when it was calibrated: on a shared host that drift moves every error.
"""
import statistics
import sys
import tracemalloc

import _requirements  # noqa: F401 (first: says what is missing, outside cfp's environment)
import numpy as np
from mpi4py import MPI

from cfp import backend, cli
from cfp.benchtools import measure_conv, measure_steps, plan_grids, prepare, single_grid_plans, with_planner
from cfp.calibration import machine_profile
from cfp.checks import finite_number, int_options
from cfp.data import synthetic
from cfp.grid import ProcessGrid
from cfp.io import save_json
from cfp.models import MODELS, build_model, layer_shapes
from cfp.nn import SoftmaxCrossEntropy
from cfp.optim import SGD
from cfp.perfmodel import LayerShape, layer_cost
from cfp.planner import layer_options, plan, plan_entries, price_plan
from cfp.train import train_step

LAYERS = [
    LayerShape("wide 3x3", 8, 512, 512, 16, 16, 3),
    LayerShape("wide 3x3, N=1", 1, 512, 512, 16, 16, 3),
    LayerShape("32x32 3x3", 32, 64, 64, 32, 32, 3),
    LayerShape("1x1 reduce", 32, 256, 64, 16, 16, 1),
    LayerShape("8x8 3x3", 16, 256, 256, 8, 8, 3),
    # a volume's Conv3d, priced as its stacked planes, and a ConvTranspose2d, as its adjoint
    LayerShape("16^3 3x3x3 volume", 2, 32, 32, 16, 16, 3, op="conv3d", D=16),
    LayerShape("transposed 3x3/2", 8, 128, 64, 16, 16, 3, stride=2, padding=1, output_padding=1,
               op="conv_transpose2d"),
]


def memory_check(world, profile, args):
    """A model whose predicted memory on one rank exceeds a limit, planned under that limit on
    this many ranks with a grid chosen per layer (so the plan may change grids between
    layers), then built and trained for two steps: the measured peak per rank (all NumPy
    allocations alive during the steps, by tracemalloc: the model's shards, gradients,
    optimizer state, activations, redistributions and temporaries, and the batch)."""
    P = world.Get_size()
    arch = dict(width=args.memory_width, in_channels=1, classes=10, image=8)
    if MODELS[args.memory_model].depth:
        arch["depth"] = 2
    shapes = layer_shapes(args.memory_model, args.memory_batch, **arch)
    one_rank = plan(shapes, 1, profile).memory
    limit = one_rank * args.memory_fraction
    base = ProcessGrid(f"sample={P}")
    tracemalloc.start()
    model = build_model(args.memory_model, base, batch=args.memory_batch, profile=profile, memory_limit=limit,
                        algorithm="auto", choose_grids=True, dtype=np.float32, **arch)
    optimizer = SGD(model.parameters(), 0.01, momentum=0.9)
    loss_fn = SoftmaxCrossEntropy(model.grid)
    x, y = synthetic(args.memory_batch, 1, 8, 8, 10, dtype=np.float32)
    (rows,) = model.input_spec[1].head(1).indices((len(x),), model.grid, model.grid.coords)
    x, y = x[rows.start:rows.stop], y[rows.start:rows.stop]
    tracemalloc.reset_peak()  # what building left (the shards) stays counted; its transients do not
    for _ in range(2):
        train_step(model, loss_fn, optimizer, x, y)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    peaks = np.empty(world.Get_size(), dtype=np.int64)
    world.Allgather(np.array([peak], dtype=np.int64), peaks)
    peaks = [int(p) for p in peaks]
    grids = list(dict.fromkeys(e["grid"] for e in model.layers.values()))
    model.free()
    base.free()
    return {"model": f"{args.memory_model} width {args.memory_width}, 8x8, batch {args.memory_batch}",
            "one_rank_predicted": one_rank, "limit": limit, "planned": model.plan.memory, "grids": grids,
            "measured_peaks": peaks, "plan": model.plan.table()}


PROBE = next(L for L in LAYERS if L.name == "8x8 3x3")  # memory-bound kernels, which the host's load moves most


def speed_probe(world, profile, repeats):
    """Measured over predicted seconds of PROBE's kernels on sample=P (the busiest rank's local
    kernels, measure_conv's breakdown, against layer_cost's compute): how fast the machine runs
    now against when the profile was calibrated (1.0: as then). On a shared host the kernels'
    speed drifts by 15-30% within minutes (BENCHMARKS.md), and every prediction with it, so the
    script probes before the layers, before the steps and after them."""
    P = world.Get_size()
    rng = np.random.default_rng(1)
    x = rng.standard_normal(PROBE.x_shape).astype(np.float32)
    w = rng.standard_normal(PROBE.w_shape).astype(np.float32)
    dy = rng.standard_normal((PROBE.N, PROBE.F) + PROBE.out_size).astype(np.float32)
    grid = ProcessGrid(f"sample={P}")
    t = measure_conv(world, grid, "sample", None, x, w, np.zeros(PROBE.F, np.float32), dy, PROBE.stride, PROBE.pad,
                     repeats, 1)
    grid.free()
    measured = max(part["kernels"] for part in t["breakdown"])
    return measured / sum(layer_cost(PROBE, "sample", P, 1, profile)["compute"].values())


# The whole-step check's models: (model, arch, global batch).
STEP_MODELS = (("resnet", {"width": 4}, 64), ("wide", {"width": 64, "depth": 4}, 32))


def step_check(world, profile, args):
    """[row]: each STEP_MODELS model's training step under every single-grid plan of sample, x
    and y, and the planner's plan, measured and predicted (planner.price_plan)."""
    P = world.Get_size()
    rows = []
    for name, arch, batch in STEP_MODELS:
        arch = dict(arch, in_channels=1, classes=10, image=8)
        shapes = layer_shapes(name, batch, **arch)
        plans = single_grid_plans([s.name for s in shapes], P, algorithms=("sample", "x", "y"), profile=profile)
        planned = plan(shapes, P, profile)
        timed, reported = with_planner(plans, plan_entries(planned))  # (one of them: measured once)
        x, y = synthetic(batch, 1, 8, 8, 10, seed=0, dtype=np.float32)
        measured_s = measure_steps(world, name, timed, arch, batch, x, y, args.steps, args.warmup + 1, args.bucket_mb)
        for label, entries, key in reported:
            priced = price_plan(shapes, P, profile, entries)
            predicted = priced.overlapped(profile, args.bucket_mb)["time"] if args.bucket_mb else priced.time
            measured = measured_s[key]
            parts = {"kernels": sum(sum(c.cost["compute"].values()) for c in priced.choices),
                     "comm": sum(sum(c.cost["comm"].values()) for c in priced.choices),
                     "layers": sum(sum(c.cost["layers"].values()) for c in priced.choices),
                     "redistribute": sum(c.redistribution for c in priced.choices)}
            rows.append({"model": f"{name} {', '.join(f'{k} {v}' for k, v in arch.items() if k in ('width', 'depth'))}"
                                  f", batch {batch}",
                         "plan": label, "grids": plan_grids(entries),
                         "measured_s": measured, "predicted_s": predicted, "parts_s": parts,
                         "error": predicted / measured - 1})
    return rows


def parse_args(argv):
    p = cli.ArgumentParser(description=cli.script_description(__doc__))
    p.add_argument("--profile", default=None,
                   help="machine profile: a JSON file from scripts/calibrate.py or a built-in name (default: this "
                        "machine's, calibrated once and cached)")
    p.add_argument("--steps", type=int, default=5, help="timed training steps per plan in the step check")
    p.add_argument("--no-steps", action="store_true", help="skip the whole-step check")
    p.add_argument("--bucket-mb", type=float, default=0,
                   help="the step check's steps with the gradient sums started in buckets of this many MiB during "
                        "backward (train.py --bucket-mb), predicted by perfmodel.overlapped_step; 0: blocking")
    p.add_argument("--repeats", type=int, default=3, help="rounds of timed repetitions of the layers (one of each a round)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions before them")
    p.add_argument("--json", help="write every measured and predicted number to this JSON file")
    p.add_argument("--memory-only", action="store_true", help="run only the memory check")
    p.add_argument("--memory-model", default="resnet", choices=list(MODELS),
                   help="the memory check's model")
    p.add_argument("--memory-width", type=int, default=8, help="width of the memory check's model")
    p.add_argument("--memory-batch", type=int, default=32, help="global batch of the memory check's model")
    # (0.55 until the one-rank plan's Winograd workspace shrank with its filters in blocks: 91 MiB
    # of it, where no 2-rank plan fits in 55%)
    p.add_argument("--memory-fraction", type=float, default=0.6,
                   help="the memory check's limit, as a fraction of the one-rank prediction")
    args = p.parse_args(argv)
    int_options(args, positive=("repeats", "steps", "memory_width", "memory_batch"), nonnegative=("warmup",))
    finite_number(args.memory_fraction, "--memory-fraction", above=0)
    finite_number(args.bucket_mb, "--bucket-mb", minimum=0)
    return args


def main(argv=None):
    args = parse_args(argv)
    world = MPI.COMM_WORLD
    P = world.Get_size()
    prepare(world, args.json)
    wanted = LAYERS + [s for name, arch, batch in STEP_MODELS
                       for s in layer_shapes(name, batch, **arch, in_channels=1, classes=10, image=8)]
    profile = machine_profile(args.profile, world, 1, wanted)
    probes = {"before the layers": speed_probe(world, profile, args.repeats)}
    rng = np.random.default_rng(0)
    # Every option the planner weighs, plus data parallelism where P_n > N (it idles ranks),
    # timed in rounds: one repetition of every option of every layer a round, the median over
    # the rounds, so that a slow spell of the host costs one sample of many rows, not a row.
    cases = []
    for layer in [] if args.memory_only else LAYERS:
        tensors = (rng.standard_normal(layer.x_shape).astype(np.float32),
                   rng.standard_normal(layer.w_shape).astype(np.float32), np.zeros(layer.F, dtype=np.float32),
                   rng.standard_normal((layer.N, layer.F) + layer.out_size).astype(np.float32))
        cases += [(layer, tensors, option, option.p_f if option.algorithm == "w" else None)
                  for option in layer_options(layer, P, profile)]
    seconds = [[] for _ in cases]
    for _ in range(args.repeats):
        for (layer, (x, w, b, dy), option, p_f), kept in zip(cases, seconds):
            grid = ProcessGrid(f"sample={option.P_n},channel={option.P_c}", node_axes=option.node_axes)
            t = measure_conv(world, grid, option.algorithm, p_f, x, w, b, dy, layer.stride, layer.pad, 1,
                             args.warmup, op=layer.op,
                             output_padding=layer.output_padding)
            grid.free()
            kept.append(t["forward_s"] + t["backward_s"])
    rows = []
    for layer in [] if args.memory_only else LAYERS:
        chosen = plan([layer], P, profile).choices[0]
        measured_rows = []
        for (of, _, option, p_f), kept in zip(cases, seconds):
            if of is not layer:
                continue
            measured = statistics.median(kept)
            cost = layer_cost(layer, option.algorithm, option.P_n, option.P_c, profile, p_f,
                              node_axes=option.node_axes)
            predicted = sum(cost["compute"].values()) + sum(cost["comm"].values())  # the convolution alone
            measured_rows.append({
                "layer": layer.name, "shape": f"{layer.N},{layer.C},{layer.F},{'x'.join(map(str, layer.spatial))},"
                                              f"{layer.K}",
                "grid": option.placed, "algorithm": option.label, "measured_s": measured,
                "predicted_s": predicted, "error": predicted / measured - 1,
                "planner_choice": (option.placed, option.label) == (chosen.placed, chosen.label)})
        fastest = min(r["measured_s"] for r in measured_rows)
        for r in measured_rows:
            r["measured_fastest"] = r["measured_s"] == fastest
            r["planner_vs_fastest"] = r["measured_s"] / fastest - 1 if r["planner_choice"] else None
        rows += measured_rows

    if world.Get_rank() == 0 and rows:
        print(f"# predicted ({profile.name}) against measured forward+backward, {P} rank(s), 1 BLAS thread "
              f"per rank (BLAS {backend.blas_description()}), float32, median of {args.repeats} rounds; "
              f"P = planner's choice, F = measured fastest")
        print("| layer (N,C,F,HxW,K) | grid | algorithm | measured ms | predicted ms | error | |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            marks = ("P" if r["planner_choice"] else "") + ("F" if r["measured_fastest"] else "")
            print(f"| {r['layer']} ({r['shape']}) | {r['grid']} | {r['algorithm']} | {r['measured_s'] * 1e3:.2f} | "
                  f"{r['predicted_s'] * 1e3:.2f} | {r['error'] * 100:+.0f}% | {marks} |")
        worst = max(abs(r["error"]) for r in rows)
        picks = [r for r in rows if r["planner_choice"]]
        print(f"\nworst prediction error {worst * 100:.0f}%; the planner's choice is within "
              f"{max(r['planner_vs_fastest'] for r in picks) * 100:.0f}% of the measured fastest on every layer")
    if not (args.memory_only or args.no_steps):
        probes["before the steps"] = speed_probe(world, profile, args.repeats)
    steps = [] if args.memory_only or args.no_steps else step_check(world, profile, args)
    probes["at the end"] = speed_probe(world, profile, args.repeats)
    if world.Get_rank() == 0 and steps:
        print(f"\n# whole training steps predicted ({profile.name}) against measured, {P} rank(s), float32, "
              f"median of {args.steps}; predicted = kernels + comm + layers (batch norm, ReLU, pooling, "
              f"sums, loss, update, fixed costs) + redistribute"
              + (f"; gradient sums in buckets of {args.bucket_mb:g} MiB during backward, less what "
                 f"overlapped_step hides at the profile's progress ({profile.progress_of(True):.0%} inside a node, "
                 f"{profile.progress_of(False):.0%} between)" if args.bucket_mb else ""))
        print("| model | plan | grids | measured ms | predicted ms | error | kernels, comm, layers, redistribute ms |")
        print("|---|---|---|---|---|---|---|")
        for r in steps:
            parts = ", ".join(f"{v * 1e3:.1f}" for v in r["parts_s"].values())
            print(f"| {r['model']} | {r['plan']} | {' then '.join(r['grids'])} | {r['measured_s'] * 1e3:.1f} | "
                  f"{r['predicted_s'] * 1e3:.1f} | {r['error'] * 100:+.0f}% | {parts} |")
        print(f"\nworst step error {max(abs(r['error']) for r in steps) * 100:.0f}%")
    memory = memory_check(world, profile, args) if P > 1 else None
    if world.Get_rank() == 0:
        print(f"\nspeed probe (kernels of {PROBE.name} ({PROBE.N},{PROBE.C},{PROBE.F},{PROBE.H}x{PROBE.W},{PROBE.K}) "
              f"on sample={P}, measured / predicted; 1.00: as fast as at calibration): "
              + ", ".join(f"{v:.2f} {when}" for when, v in probes.items()))
        if memory is not None:
            mib = 2.0 ** 20
            print(f"\nmemory check: {memory['model']}: predicted {memory['one_rank_predicted'] / mib:.2f} MiB on one "
                  f"rank; limit {memory['limit'] / mib:.2f} MiB; plan on {P} ranks predicts "
                  f"{memory['planned'] / mib:.2f} MiB per rank on grids {' then '.join(memory['grids'])}; "
                  f"measured peak per rank (tracemalloc, whole model "
                  f"and training step): {', '.join(f'{p / mib:.2f}' for p in memory['measured_peaks'])} MiB")
            print(memory["plan"])
        if args.json:
            save_json(args.json, {"ranks": P, "profile": profile.name, "rows": rows, "steps": steps,
                                  "memory_check": memory, "speed_probe": probes})
            print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
