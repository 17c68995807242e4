"""Predicted against measured time of every algorithm and grid on a set of layers, at the
current rank count; marks the planner's choice and the measured fastest.

    mpiexec -n 2 python -m mpi4py scripts/validate_model.py [--profile cpu-dev] [--repeats 3]
        [--json out.json]

Measured: forward + backward of one distributed convolution (scripts/bench_conv.py's timing:
median of the slowest rank, 1 BLAS thread per rank, float32). Predicted: cfp.perfmodel's
layer_cost with the machine profile (scripts/calibrate.py measures one).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from cfp import backend  # noqa: E402
from cfp.benchtools import measure_conv  # noqa: E402
from cfp.grid import ProcessGrid  # noqa: E402
from cfp.io import save_json  # noqa: E402
from cfp.perfmodel import LayerShape, MachineProfile, layer_cost  # noqa: E402
from cfp.planner import layer_options, plan  # noqa: E402

LAYERS = [
    LayerShape("wide 3x3", 8, 512, 512, 16, 16, 3),
    LayerShape("wide 3x3, N=1", 1, 512, 512, 16, 16, 3),
    LayerShape("32x32 3x3", 32, 64, 64, 32, 32, 3),
    LayerShape("1x1 reduce", 32, 256, 64, 16, 16, 1),
    LayerShape("8x8 3x3", 16, 256, 256, 8, 8, 3),
]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", default="cpu-dev")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    world = MPI.COMM_WORLD
    P = world.Get_size()
    backend.set_blas_threads(1)
    profile = MachineProfile.load(args.profile)
    rng = np.random.default_rng(0)
    rows = []
    for layer in LAYERS:
        x = rng.standard_normal((layer.N, layer.C, layer.H, layer.W)).astype(np.float32)
        w = rng.standard_normal((layer.F, layer.C, layer.K, layer.K)).astype(np.float32)
        b = np.zeros(layer.F, dtype=np.float32)
        dy = rng.standard_normal((layer.N, layer.F) + layer.out_hw).astype(np.float32)
        chosen = plan([layer], P, profile).choices[0]
        measured_rows = []
        # Every option the planner weighs, plus data parallelism where P_n > N (it idles ranks).
        for option in layer_options(layer, P, profile):
            grid = ProcessGrid(f"sample={option.P_n},channel={option.P_c}")
            p_f = option.p_f if option.algorithm == "w" else None
            t = measure_conv(world, grid, option.algorithm, p_f, x, w, b, dy, layer.stride, layer.pad,
                             args.repeats, args.warmup)
            grid.free()
            measured = t["forward_s"] + t["backward_s"]
            predicted = layer_cost(layer, option.algorithm, option.P_n, option.P_c, profile, p_f)["time"]
            measured_rows.append({
                "layer": layer.name, "shape": f"{layer.N},{layer.C},{layer.F},{layer.H}x{layer.W},{layer.K}",
                "grid": option.grid, "algorithm": option.label, "measured_s": measured,
                "predicted_s": predicted, "error": predicted / measured - 1,
                "planner_choice": (option.grid, option.label) == (chosen.grid, chosen.label)})
        fastest = min(r["measured_s"] for r in measured_rows)
        for r in measured_rows:
            r["measured_fastest"] = r["measured_s"] == fastest
            r["planner_vs_fastest"] = r["measured_s"] / fastest - 1 if r["planner_choice"] else None
        rows += measured_rows

    if world.Get_rank() == 0:
        print(f"# predicted ({profile.name}) against measured forward+backward, {P} rank(s), 1 BLAS thread "
              f"per rank, float32, median of {args.repeats}; P = planner's choice, F = measured fastest")
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
        if args.json:
            save_json(args.json, {"ranks": P, "profile": profile.name, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
