"""Step time of the planner's per-layer plan against every single-grid plan, measured and
predicted side by side in one run.

    mpiexec -n 2 python -m mpi4py scripts/bench_plans.py --model resnet --width 4 --batch 64 \\
        [--image 8] [--steps 10] [--warmup 3] [--profile PROFILE] [--json out.json]

Plans: every grid factorization of the ranks with every algorithm (with P_c > 1: x, y and w for
each p_f; with P_c = 1: sample), all layers alike, on every placement the planner weighs (where
the grid spans nodes of a profile with a link between them: which axes stay inside a node),
and the planner's own plan (each layer's grid, placement and algorithm chosen freely,
redistributions between them; where it is one of the single-grid plans, that plan, measured
once and shown twice). Measured: one training step
(forward, loss, backward, SGD update) of float32 synthetic data, the slowest rank's time,
median of --steps after --warmup, 1 BLAS thread per rank, the plans' steps taken in turn
(benchtools.measure_steps). Predicted: the planner's price of
the same plan (planner.price_plan: perfmodel.layer_cost of every convolution plus the
redistributions) from the machine profile.
"""
import sys

import _requirements  # noqa: F401 (first: says what is missing, outside cfp's environment)
import numpy as np
from mpi4py import MPI

from cfp import backend, cli
from cfp.benchtools import measure_steps, plan_grids, prepare, single_grid_plans, with_planner
from cfp.calibration import machine_profile
from cfp.checks import int_options
from cfp.data import synthetic
from cfp.io import save_json
from cfp.models import MODELS, layer_shapes
from cfp.planner import plan, plan_entries, price_plan


def parse_args(argv):
    p = cli.ArgumentParser(description=cli.script_description(__doc__))
    p.add_argument("--model", default="resnet", choices=list(MODELS), help="the model to train")
    p.add_argument("--width", type=int, default=4, help="resnet: width multiplier; wide: channels per layer")
    p.add_argument("--depth", type=int, default=4, help="wide: number of wide layers")
    p.add_argument("--image", type=int, default=8, help="side of the square input images")
    p.add_argument("--batch", type=int, default=64, help="global mini-batch")
    p.add_argument("--steps", type=int, default=10, help="timed steps per plan, of which the median is reported")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per plan before them")
    p.add_argument("--profile", default=None,
                   help="machine profile: a JSON file from scripts/calibrate.py or a built-in name (default: this "
                        "machine's, calibrated once and cached)")
    p.add_argument("--json", help="write the rows to this JSON file (rank 0)")
    args = p.parse_args(argv)
    int_options(args, positive=("width", "depth", "image", "batch", "steps"), nonnegative=("warmup",))
    return args


def main(argv=None):
    args = parse_args(argv)
    world = MPI.COMM_WORLD
    P = world.Get_size()
    prepare(world, args.json)
    arch = {"width": args.width, "in_channels": 1, "classes": 10, "image": args.image}
    if MODELS[args.model].depth:
        arch["depth"] = args.depth
    shapes = layer_shapes(args.model, args.batch, **arch)
    profile = machine_profile(args.profile, world, 1, shapes)
    names = [s.name for s in shapes]
    plans = single_grid_plans(names, P, profile=profile)
    planned = plan(shapes, P, profile)
    mine = plan_entries(planned)
    timed, reported = with_planner(plans, mine)
    x, y = synthetic(args.batch, 1, args.image, args.image, 10, seed=0, dtype=np.float32)
    measured = measure_steps(world, args.model, timed, arch, args.batch, x, y, args.steps, args.warmup)
    rows = [{"plan": label, "grids": plan_grids(entries), "predicted_s": price_plan(shapes, P, profile, entries).time,
             "measured_s": measured[key]} for label, entries, key in reported]
    same = reported[-1][2] if reported[-1][2] != "planner" else None
    fastest = min(r["measured_s"] for r in rows)
    predicted_best = min(rows, key=lambda r: r["predicted_s"])
    if world.Get_rank() == 0:
        print(f"# {args.model} width {args.width}, {args.image}x{args.image}, batch {args.batch}, {P} ranks, "
              f"float32, 1 BLAS thread per rank (BLAS {backend.blas_description()}), median of {args.steps} "
              f"steps; predicted by {profile.name}")
        print("| plan | grids | predicted ms | measured ms | vs measured fastest |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['plan']} | {' then '.join(r['grids'])} | {r['predicted_s'] * 1e3:.1f} | "
                  f"{r['measured_s'] * 1e3:.1f} | {(r['measured_s'] / fastest - 1) * 100:+.0f}% |")
        mine = rows[-1]
        print(f"\nthe planner's plan measures {mine['measured_s'] * 1e3:.1f} ms, "
              f"{(mine['measured_s'] / fastest - 1) * 100:+.1f}% against the measured fastest "
              f"({min(rows, key=lambda r: r['measured_s'])['plan']}); predicted fastest: {predicted_best['plan']}")
        print("the planner's plan, layer by layer:")
        print(planned.table())
        if args.json:
            save_json(args.json, {"ranks": P, "profile": profile.name, "model": vars(args), "rows": rows,
                                  "planner": mine, "planner_is": same})
            print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
