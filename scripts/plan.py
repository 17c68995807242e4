"""Print the planner's per-layer plan for a model: grid, algorithm, predicted compute,
communication and memory per rank.

    python scripts/plan.py --model wide --width 1024 --depth 4 --image 16 --batch 32 --ranks 16 \\
        [--profile cpu-dev|reference-v100|profile.json] [--memory-limit MiB] [--grid sample=4,channel=4]
        [--data-parallel] [--out plan.json]

No MPI run is needed: the plan is a prediction from the machine profile (see scripts/calibrate.py).
Layers are planned as a chain in model order (a residual block's projection counts as the layer
after the block's convolutions). --out writes the plan as a plan file that
`scripts/train.py --plan` runs: {"layers": {layer name: {"grid", "algorithm", "filter_groups"}}}.
"""
import math
import sys

import _requirements  # noqa: F401 (first: says what is missing, outside cfp's environment)
from cfp import cli
from cfp.checks import finite_number, int_options
from cfp.grid import parse_grid_spec
from cfp.io import check_writable, save_json
from cfp.models import MODELS, layer_shapes
from cfp.perfmodel import MachineProfile
from cfp.planner import plan
from cfp.train import OVERLAPS


def parse_args(argv):
    p = cli.ArgumentParser(description=cli.script_description(__doc__))
    p.add_argument("--model", default="wide", metavar=cli.one_of(MODELS), help="the model to plan")
    p.add_argument("--width", type=int, default=256,
                   help="resnet: width multiplier; wide: channels per layer")
    p.add_argument("--depth", type=int, default=4, help="wide: number of wide layers")
    p.add_argument("--image", type=int, default=8, help="input height and width")
    p.add_argument("--in-channels", type=int, default=1, help="channels of the input images")
    p.add_argument("--batch", type=int, default=64, help="global mini-batch")
    p.add_argument("--ranks", type=int, required=True, help="number of ranks to plan for")
    p.add_argument("--profile", default="cpu-dev",
                   help="machine profile: a JSON file from scripts/calibrate.py or a built-in name")
    p.add_argument("--memory-limit", type=float, help="MiB per rank the plan must fit")
    p.add_argument("--grid", help="plan on this grid only (as a model built on one grid runs)")
    p.add_argument("--data-parallel", action="store_true", help="data parallelism only, for comparison")
    p.add_argument("--spatial", action="store_true",
                   help="also consider grids that split the image over height and width (a volume also "
                        "over depth), layer by layer")
    p.add_argument("--overlap", default="off", metavar=cli.one_of(OVERLAPS),
                   help="what the plan may overlap: off (every collective blocking), grads (also choose the "
                        "gradient buckets) or all (also each x, y and w layer's chunks, which the plan file "
                        "records for train.py --overlap all)")
    p.add_argument("--out", help="write the plan here as a plan file for scripts/train.py --plan")
    args = p.parse_args(argv)
    int_options(args, positive=("width", "depth", "image", "in_channels", "batch", "ranks"))
    if args.overlap not in OVERLAPS:
        raise ValueError(f"unknown --overlap {args.overlap!r}; expected one of {', '.join(OVERLAPS)}")
    if args.memory_limit is not None:
        finite_number(args.memory_limit, "--memory-limit", above=0)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.out:
        check_writable(args.out, "--out")
    profile = MachineProfile.load(args.profile)
    layers = layer_shapes(args.model, args.batch, args.width, args.depth, args.in_channels, image=args.image)
    grid = None
    if args.grid:
        sizes = parse_grid_spec(args.grid)
        grid = tuple(sizes.get(a, 1) for a in ("sample", "depth", "height", "width", "channel"))
        if math.prod(grid) != args.ranks:
            raise ValueError(f"grid {args.grid} has {math.prod(grid)} ranks, --ranks says {args.ranks}")
    limit = None if args.memory_limit is None else args.memory_limit * 2 ** 20
    kwargs = {"algorithms": ("sample",)} if args.data_parallel else {}
    result = plan(layers, args.ranks, profile, memory_limit=limit, grid=grid, spatial=args.spatial,
                  chunks=args.overlap == "all", buckets=args.overlap != "off", **kwargs)
    inputs = f"{args.image}^3 volumes" if MODELS[args.model].volumes else f"{args.image}x{args.image} images"
    print(f"# {args.model} width {args.width}, {inputs}, global batch {args.batch}, "
          f"{args.ranks} ranks, profile {profile.name}")
    print(result.table())
    if args.out:
        save_json(args.out, {"about": f"scripts/plan.py: {args.model} width {args.width}, batch {args.batch}, "
                                      f"{args.ranks} ranks, profile {profile.name}", **result.to_json()},
                  sort_keys=False)
        print(f"plan written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
