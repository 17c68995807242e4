"""Show who holds which block of x, w and y in a distributed convolution, and what each
collective moves between whom: a table, a picture, or a trace of a real run.

    python scripts/explain.py --batch 4 --channels 8 --filters 8 --image 8 --kernel 3 --padding 1 \\
        --grid channel=4 --algorithm w --filter-groups 2 [--plot layer.png]
    mpiexec -n 4 python -m mpi4py scripts/explain.py ... --trace     # run it and show what happened
    python scripts/explain.py --model resnet --width 2 --batch 64 --grid sample=2,channel=2 --algorithm y
    python scripts/explain.py --model resnet --width 2 --batch 64 --plan plan.json [--plot model.png]
    python scripts/explain.py ... --grid sample=2,channel=2 --node-axes sample --ranks-per-node 2

Without --trace no MPI run is needed: the index ranges are the layouts the layer holds, the
steps are its collectives in the order it runs them, and the bytes are perfmodel.predict_bytes.
--trace runs the layer (float64, values from --seed) on the ranks of the MPI job and prints,
after each step, what every rank holds (shape, and the sum of its values beside the serial
tensors' sum at the explained indices), from the ledger and the collectives' results; it exits
with status 1 when anything differs from the explanation. --ranks-per-node (--trace: the job's
own nodes) shows which ranks share a node and which collectives' groups span nodes; --node-axes
places the grid's ranks on the job's processes as train.py --node-axes does.
"""
import sys

import _requirements  # noqa: F401 (first: says what is missing, outside cfp's environment)
from mpi4py import MPI

from cfp import backend, cli
from cfp.algorithms import ALGORITHMS
from cfp.checks import int_options
from cfp.explain import explain_layer, explain_model, model_table, plot_layer, plot_model, trace_layer
from cfp.io import check_figure_path
from cfp.kernels.conv import PADDING_MODES
from cfp.models import MODELS, layer_shapes, read_plan


def parse_args(argv):
    p = cli.ArgumentParser(description=cli.script_description(__doc__))
    p.add_argument("--batch", type=int, default=4, help="N, the global mini-batch")
    p.add_argument("--channels", type=int, default=8, help="C, the input channels")
    p.add_argument("--filters", type=int, default=8, help="F, the output channels")
    p.add_argument("--image", type=int, default=8, help="H = W, the input's height and width")
    p.add_argument("--kernel", type=int, default=3, help="K, the kernel's height and width")
    p.add_argument("--stride", type=int, default=1, help="the stride of the kernel's windows")
    p.add_argument("--padding", type=int, default=None, help="padding on each side (default: K // 2)")
    p.add_argument("--dilation", type=int, default=1, help="the spacing of the kernel's taps")
    p.add_argument("--groups", type=int, default=1, help="grouped convolution (G = C: depthwise)")
    p.add_argument("--padding-mode", default="zeros", metavar=cli.one_of(PADDING_MODES), help="zeros, reflect, replicate or circular (on a grid "
                   "splitting the image the halo also brings the rows the padded border copies)")
    p.add_argument("--first", action="store_true",
                   help="a network's first layer: its input whole on every channel rank, no dx")
    p.add_argument("--planes", type=int, help="D: a volume of D x image x image (Conv3d, a K^3 kernel; grids may "
                   "split depth)")
    p.add_argument("--transposed", action="store_true", help="a transposed convolution (ConvTranspose2d/3d)")
    p.add_argument("--output-padding", type=int, default=0, help="--transposed: positions added at the end")
    p.add_argument("--grid", help="process grid, e.g. sample=2,channel=2 (default: sample=1)")
    p.add_argument("--node-axes", help="the grid axes kept inside a node, e.g. sample (default: channel fastest; "
                   "grid.ProcessGrid's placement)")
    p.add_argument("--ranks-per-node", type=int,
                   help="show which ranks share a node of this many ranks (--trace: the job's own nodes, where "
                        "it has several)")
    p.add_argument("--algorithm", default="y", metavar=cli.one_of(ALGORITHMS), help="the algorithm")
    p.add_argument("--filter-groups", type=int, help="p_f of algorithm w (dividing the channel axis)")
    p.add_argument("--dtype", default="float64", metavar=cli.one_of(("float32", "float64")), help="the bytes' element size")
    p.add_argument("--model", metavar=cli.one_of(MODELS), help="explain every convolution of a model instead")
    p.add_argument("--width", type=int, default=1, help="--model: width multiplier (resnet, mobile) or channels (wide)")
    p.add_argument("--depth", type=int, default=4, help="--model wide: number of wide layers")
    p.add_argument("--in-channels", type=int, default=1, help="--model: channels of the input images")
    p.add_argument("--plan", help="--model: a plan file (scripts/plan.py --out) instead of --grid and --algorithm")
    p.add_argument("--plot", help="write the picture here, .png, .pdf or .svg (needs matplotlib)")
    p.add_argument("--trace", action="store_true",
                   help="run the layer on the ranks of this MPI job and show what each rank held after each step")
    p.add_argument("--seed", type=int, default=0, help="--trace: seeds the tensors' values")
    p.add_argument("--chunks", type=int, default=1,
                   help="also show the schedule of each pass pipelined over this many chunks of a rank's samples "
                        "(train.py --chunks)")
    p.add_argument("--device", default="cpu", metavar=cli.one_of(backend.DEVICES),
                   help="--trace: run the layer on NumPy (cpu) or on each rank's GPU (CuPy)")
    args = p.parse_args(argv)
    int_options(args, positive=("batch", "channels", "filters", "image", "kernel", "stride", "dilation", "groups",
                                "filter_groups", "width", "depth", "in_channels", "ranks_per_node", "chunks", "planes"),
                nonnegative=("padding", "seed", "output_padding"))
    if args.output_padding and not args.transposed:
        raise ValueError(f"--output-padding {args.output_padding} applies to --transposed only")
    if (args.planes is not None or args.transposed) and (args.trace or args.plot or args.model is not None):
        raise ValueError("--planes and --transposed explain one layer's text; --trace, --plot and --model are "
                         "built for 2-D convolutions")
    if args.dtype not in ("float32", "float64"):
        raise ValueError(f"--dtype {args.dtype!r}: expected float32 or float64")
    if args.model is not None:
        if args.trace:
            raise ValueError("--trace runs one layer; it does not combine with --model")
        if args.plan and (args.grid or args.filter_groups):
            raise ValueError("--plan gives every layer its grid and algorithm; give --plan or --grid, not both")
    elif args.plan:
        raise ValueError("--plan applies to --model only")
    if args.trace and args.ranks_per_node is not None:
        raise ValueError("--trace runs on the nodes of its job and shows them; --ranks-per-node is for an "
                         "explanation without a run")
    if args.plan and args.node_axes:
        raise ValueError("--plan places each layer's grid by its entries' node_axes; give --plan or --node-axes, "
                         "not both")
    if args.device != "cpu" and not args.trace:
        raise ValueError(f"--device {args.device} applies to --trace only (an explanation without a run computes "
                         f"nothing)")
    if args.chunks > 1 and (args.trace or args.model is not None):
        raise ValueError(f"--chunks {args.chunks} shows one layer's pipelined schedule; it does not combine with "
                         f"--trace or --model")
    if args.trace and args.dtype != "float64":
        raise ValueError("--trace runs in float64 (its checksums are compared with the serial tensors')")
    return args


def main(argv=None):
    args = parse_args(argv)
    world = MPI.COMM_WORLD
    if args.plot:
        check_figure_path(args.plot, "--plot")
    itemsize = 8 if args.dtype == "float64" else 4
    if args.model is not None:
        layers = layer_shapes(args.model, args.batch, args.width, args.depth, args.in_channels, image=args.image)
        plan = read_plan(args.plan) if args.plan else None
        explained = explain_model(layers, args.grid, args.algorithm, args.filter_groups, plan, itemsize=itemsize,
                                  node_axes=args.node_axes, ranks_per_node=args.ranks_per_node)
        if world.Get_rank() == 0:
            print(f"# {args.model} width {args.width}, {args.image}x{args.image} images, global batch {args.batch}, "
                  f"{args.dtype}; each layer's busiest rank (one forward and backward pass)")
            print(model_table(explained))
            if args.plot:
                plot_model(explained, args.plot)
                print(f"picture written to {args.plot}")
        return 0
    layer = dict(x_shape=(args.batch, args.channels, args.image, args.image), out_channels=args.filters,
                 kernel_size=args.kernel, algorithm=args.algorithm, grid=args.grid or "sample=1",
                 filter_groups=args.filter_groups, stride=args.stride,
                 padding=args.kernel // 2 * args.dilation if args.padding is None else args.padding,
                 dilation=args.dilation, groups=args.groups, input_whole=args.first, need_dx=not args.first,
                 padding_mode=args.padding_mode, node_axes=args.node_axes)
    if args.planes is not None or args.transposed:  # a volume's or a transposed convolution's layer
        kind = "conv_transpose" if args.transposed else "conv"
        layer.update(op=f"{kind}{3 if args.planes is not None else 2}d", output_padding=args.output_padding)
        if args.planes is not None:
            layer["x_shape"] = (args.batch, args.channels, args.planes, args.image, args.image)
    if args.trace:
        xp, _ = backend.use_device(args.device, world)
        trace = trace_layer(world, seed=args.seed, xp=xp, **layer)
        if world.Get_rank() == 0:
            print(trace.text())
        failed = world.bcast(bool(trace.mismatches) if trace is not None else None, root=0)
        status = 1 if failed else 0
    else:
        e = explain_layer(itemsize=itemsize, ranks_per_node=args.ranks_per_node, chunks=args.chunks, **layer)
        trace, status = None, 0
        if world.Get_rank() == 0:
            print(e.text())
    if args.plot and world.Get_rank() == 0:
        plot_layer(trace.explanation if trace is not None else e, args.plot)
        print(f"picture written to {args.plot}")
    return status


if __name__ == "__main__":
    sys.exit(cli.run(main))
