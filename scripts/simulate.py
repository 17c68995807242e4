"""Predicted strong scaling of data parallelism and of the planner's hybrid plans, from 4 to 1024
GPUs, on a machine profile (no mpiexec, no GPU: the cost model of cfp.perfmodel only).

    python scripts/simulate.py [--profile reference-v100] [--batch 512] [--resnet-width 4]
        [--cnn-width 4096] [--cnn-depth 4] [--cnn-image 32] [--max-gpus 1024]
        [--bucket-mb 25] [--json scaling.json] [--plot scaling.png]

Two models, each at a fixed global batch (strong scaling): a wide ResNet-50 (every channel count
of ResNet-50 times --resnet-width) on 224x224 images, and the wide plain CNN of
cfp.models.wide_cnn. At each power of two P, two plans are compared:

- data parallel: every layer on the grid sample=P (the planner restricted to 'sample');
- hybrid: the planner's choice per layer of grid, algorithm and p_f, within the profile's memory
  per rank ("memory_per_rank" in the profile JSON).

Data parallelism cannot give a rank less than one sample, so where P exceeds the batch it runs
on `batch` ranks and the rest idle; the tables mark those rows.

What the numbers are: predictions of the alpha-beta-gamma model (docs/design.md section 4), not
measurements. The convolutions (and the classifier as a 1x1 convolution) are modelled, and
the layers between them and the update where the profile times them (reference-v100 does not:
there batch norm, ReLU, pooling, the loss and the optimizer step cost nothing). Each plan's step is
given twice: every collective blocking, and with the gradient allreduces started in buckets of
--bucket-mb MiB during backward (perfmodel.overlapped_step, at the profile's measured progress of
a started collective) and each x, y and w layer pipelined over the chunks (of samples or features) that pay
(planner.Plan.pipelined, perfmodel.pipeline_seconds); the plans are chosen without overlap.
"""
import collections
import importlib.util
import sys
import time

import _requirements  # noqa: F401 (first: says what is missing, outside cfp's environment)
from cfp import cli, planner
from cfp.checks import finite_number, int_options
from cfp.io import check_figure_path, check_writable, save_figure, save_json
from cfp.models import wide_cnn_layers, wide_resnet50_layers
from cfp.perfmodel import MachineProfile

GB = 1e9


def allreduce_bytes(choice):
    """Bytes one rank sends in the ring allreduce of its weight-gradient shard: 2 (p-1)/p m over
    the P_n ranks that hold the same shard of m bytes."""
    p, m = choice.P_n, choice.cost["memory"]["weights"]
    return 2 * (p - 1) / p * m


def describe(plan):
    """'sample=64,channel=16: 40 layers; ...' and 'y 30, w 12, sample 12': the grids and
    algorithms of a plan, most used first."""
    grids = collections.Counter(c.placed for c in plan.choices)
    algorithms = collections.Counter(c.label for c in plan.choices)
    return ("; ".join(f"{g}: {n}" for g, n in grids.most_common()),
            ", ".join(f"{a} {n}" for a, n in algorithms.most_common()))


def summarize(plan, memory_limit, profile, bucket_mb):
    """The numbers of a plan that the tables, the plot and the JSON show; overlapped_time_s
    and hidden_s with the gradient sums in buckets of bucket_mb MiB (Plan.overlapped) and each
    x, y and w layer pipelined in the chunks that pay (Plan.pipelined), pipelined_layers of
    them."""
    grids, algorithms = describe(plan)
    pipelined = plan.pipelined(profile)
    overlapped = pipelined.overlapped(profile, bucket_mb)
    return {
        "ranks_used": plan.ranks,
        "time_s": plan.time,
        "overlapped_time_s": overlapped["time"],
        "hidden_s": overlapped["hidden"],
        "pipelined_layers": sum(c.chunks > 1 for c in pipelined.choices),
        "compute_s": sum(sum(c.cost["compute"].values()) for c in plan.choices),
        "allreduce_bytes_per_rank": sum(allreduce_bytes(c) for c in plan.choices),
        "allreduce_s": sum(c.cost["comm"]["gradient-sync"] for c in plan.choices),
        "memory_bytes_per_rank": plan.memory,
        "fits_memory": memory_limit is None or plan.memory <= memory_limit,
        "grids": grids,
        "algorithms": algorithms,
        "layers": [{"name": c.layer.name, "grid": c.grid, "node_axes": c.node_axes and ",".join(c.node_axes),
                    "algorithm": c.algorithm, "p_f": c.p_f,
                    "time_s": c.cost["time"], "redistribution_s": c.redistribution}
                   for c in plan.choices],
    }


def simulate_scale(layers, gpus, profile, memory_limit, bucket_mb=25):
    """{'gpus', 'data_parallel', 'hybrid'}: the two plans' summaries at `gpus` GPUs (the hybrid's
    is {'error': why} when no plan fits the memory limit)."""
    batch = layers[0].N
    # Data parallelism on more ranks than samples would leave ranks without work: it runs on
    # `batch` ranks and the others idle. It gets no memory limit: a plan that does not fit is
    # still predicted, and flagged.
    data_parallel = planner.plan(layers, min(gpus, batch), profile, algorithms=("sample",))
    try:
        hybrid = summarize(planner.plan(layers, gpus, profile, memory_limit=memory_limit), memory_limit, profile,
                           bucket_mb)
    except ValueError as e:  # no plan fits the memory limit: say so instead of failing the run
        hybrid = {"error": str(e)}
    return {"gpus": gpus, "data_parallel": summarize(data_parallel, memory_limit, profile, bucket_mb),
            "hybrid": hybrid}


def _ratio(a, b):
    """a / b as '12.3x'; 'none left' when only b is zero, '-' when both are."""
    return f"{a / b:.1f}x" if b > 0 else ("-" if a == 0 else "none left")


COLUMNS = ("GPUs", "data parallel ms", "hybrid ms", "speedup", "DP ms, overlapped", "hybrid", "speedup",
           "allreduce MB/rank DP", "hybrid", "smaller",
           "allreduce ms DP", "hybrid", "smaller", "memory GB/rank DP", "hybrid", "hybrid grids (layers)",
           "hybrid algorithms (layers)")


def table_row(row):
    """The cells of one scale: '-' for the hybrid's where no plan fits the memory limit."""
    dp, hy = row["data_parallel"], row["hybrid"]
    gpus = str(row["gpus"]) + (f" (DP on {dp['ranks_used']})" if dp["ranks_used"] < row["gpus"] else "")
    dp_memory = f"{dp['memory_bytes_per_rank'] / GB:.1f}" + ("" if dp["fits_memory"] else " (over)")
    if "error" in hy:
        return [gpus, f"{dp['time_s'] * 1e3:.1f}", "no plan fits", "-", f"{dp['overlapped_time_s'] * 1e3:.1f}", "-",
                "-", f"{dp['allreduce_bytes_per_rank'] / 1e6:.0f}", "-", "-",
                f"{dp['allreduce_s'] * 1e3:.1f}", "-", "-", dp_memory, "-", "-", "-"]
    return [gpus, f"{dp['time_s'] * 1e3:.1f}", f"{hy['time_s'] * 1e3:.1f}", f"{dp['time_s'] / hy['time_s']:.2f}x",
            f"{dp['overlapped_time_s'] * 1e3:.1f}", f"{hy['overlapped_time_s'] * 1e3:.1f}",
            f"{dp['overlapped_time_s'] / hy['overlapped_time_s']:.2f}x",
            f"{dp['allreduce_bytes_per_rank'] / 1e6:.0f}", f"{hy['allreduce_bytes_per_rank'] / 1e6:.0f}",
            _ratio(dp["allreduce_bytes_per_rank"], hy["allreduce_bytes_per_rank"]),
            f"{dp['allreduce_s'] * 1e3:.1f}", f"{hy['allreduce_s'] * 1e3:.1f}",
            _ratio(dp["allreduce_s"], hy["allreduce_s"]),
            dp_memory, f"{hy['memory_bytes_per_rank'] / GB:.1f}", hy["grids"], hy["algorithms"]]


def markdown_table(rows):
    """One row per scale: times, allreduce volume and time, memory, and the hybrid plan; then
    why no hybrid plan exists where none fits."""
    body = [COLUMNS, ["---"] * len(COLUMNS)] + [table_row(r) for r in rows]
    lines = ["| " + " | ".join(cells) + " |" for cells in body]
    notes = [f"- {r['gpus']} GPUs, hybrid: {r['hybrid']['error']}" for r in rows if "error" in r["hybrid"]]
    return "\n".join(lines + ([""] + notes if notes else []))


def plot(results, path):
    """Predicted iteration time against GPUs (log-log), one panel per model: data parallel,
    hybrid, and ideal linear scaling from the first hybrid point (parse_args has checked that
    matplotlib is installed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, (title, rows) in zip(axes[0], results.items()):
        gpus = [r["gpus"] for r in rows]
        ax.plot(gpus, [r["data_parallel"]["time_s"] * 1e3 for r in rows], "o-", label="data parallel")
        over = [(r["gpus"], r["data_parallel"]["time_s"] * 1e3) for r in rows
                if not r["data_parallel"]["fits_memory"]]
        if over:
            ax.plot(*zip(*over), "rx", markersize=10, label="data parallel over the memory limit")
        fitted = [(r["gpus"], r["hybrid"]["time_s"] * 1e3) for r in rows if "error" not in r["hybrid"]]
        if fitted:
            ax.plot(*zip(*fitted), "s-", label="hybrid (planner)")
            p0, t0 = fitted[0]
            ideal = [p for p in gpus if p >= p0]
            ax.plot(ideal, [t0 * p0 / p for p in ideal], "k--", linewidth=1,
                    label=f"ideal linear from {p0} GPUs")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(gpus)
        ax.set_xticklabels([str(p) for p in gpus])
        ax.set_xlabel("GPUs (fixed global batch)")
        ax.set_ylabel("predicted iteration time (ms)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    save_figure(path, fig, dpi=80)
    plt.close(fig)


def parse_args(argv):
    p = cli.ArgumentParser(description=cli.script_description(__doc__))
    p.add_argument("--profile", default="reference-v100",
                   help="machine profile: a JSON file or a built-in name")
    p.add_argument("--batch", type=int, default=512, help="global batch, fixed at every scale")
    p.add_argument("--resnet-width", type=int, default=4, help="ResNet-50 channel multiplier")
    p.add_argument("--cnn-width", type=int, default=4096, help="channels per layer of the wide CNN")
    p.add_argument("--cnn-depth", type=int, default=4, help="number of wide layers of the wide CNN")
    p.add_argument("--cnn-image", type=int, default=32, help="side of the wide CNN's square input images")
    p.add_argument("--max-gpus", type=int, default=1024, help="largest scale (powers of two from 4)")
    p.add_argument("--bucket-mb", type=float, default=25,
                   help="gradient buckets of the overlapped columns, MiB (train.py --bucket-mb; default PyTorch DDP's)")
    p.add_argument("--json", help="write every number to this JSON file")
    p.add_argument("--plot", help="write the scaling plot to this file, .png, .pdf or .svg (needs matplotlib)")
    args = p.parse_args(argv)
    int_options(args, positive=("batch", "resnet_width", "cnn_width", "cnn_depth", "cnn_image"))
    finite_number(args.bucket_mb, "--bucket-mb", above=0)
    if args.max_gpus < 4:
        raise ValueError(f"--max-gpus must be at least 4, got {args.max_gpus}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError(f"--plot {args.plot}: needs matplotlib, which is not installed "
                         "(pip install matplotlib, or the extra cfp[plot])")
    return args


def run_simulation(args):
    """Plan both models at every scale, print the tables and write --json and --plot; returns
    {model title: [simulate_scale rows]}."""
    if args.json:
        check_writable(args.json, "--json")
    if args.plot:
        check_figure_path(args.plot, "--plot")
    profile = MachineProfile.load(args.profile)
    memory_limit = profile.data.get("memory_per_rank")
    scales = [2 ** k for k in range(2, args.max_gpus.bit_length())]  # 4, 8, ... up to --max-gpus
    models = {
        f"wide ResNet-50 (width x{args.resnet_width}, 224x224)":
            wide_resnet50_layers(args.resnet_width, args.batch),
        f"wide CNN (width {args.cnn_width}, depth {args.cnn_depth}, {args.cnn_image}x{args.cnn_image})":
            wide_cnn_layers(args.cnn_width, args.cnn_depth, args.batch, args.cnn_image),
    }
    limit_text = f"{memory_limit / GB:g} GB" if memory_limit else "none (the profile gives no memory_per_rank)"
    print(f"Profile: {profile.name}. {profile.source}\n")
    print(f"Global batch {args.batch} at every scale (strong scaling); memory limit per rank for the "
          f"hybrid plans: {limit_text}. Times are predictions of cfp's cost model, not measurements. "
          + ("Only convolutions and the classifier are modelled (this profile times no batch norm, ReLU, "
             "pooling, loss or optimizer). " if not any(f or r for f, r in profile.layers.values()) else
             "Convolutions, the layers between them and the update are modelled (the profile's layer times). ")
          + "'overlapped': the same plans with the gradient allreduces started in "
          f"buckets of {args.bucket_mb:g} MiB during backward and each x, y and w layer pipelined in the "
          "chunks (of samples or features) that pay, a started collective moving at "
          f"{profile.progress_of(True):.0%} (inside a node) and {profile.progress_of(False):.0%} (between "
          "nodes) of its rate while its rank computes (the profile's progress). Data parallelism "
          f"cannot use more ranks than samples: above {args.batch} GPUs it runs on {args.batch} and the "
          "rest idle. Allreduce MB: bytes each rank sends in the ring allreduces of its weight-gradient "
          "shards. '(over)': the plan needs more memory than the limit. What was checked: the model's form "
          "between nodes (each collective's alpha and beta on the link between nodes, for groups that span "
          "nodes) on an emulated cluster of 2 nodes of one rank over 1 Gbit/s, layers and steps within 15% "
          "(BENCHMARKS.md); on 2 nodes of 2 ranks, which of a grid's groups cross nodes under each placement "
          "(the planner's placement measured fastest, its order of the placements right) but not the "
          "magnitudes there (the oversubscribed steps measured 1.5-1.9x the predictions); not checked: "
          "this profile's constants, which are public specifications, not measurements.\n")
    results = {}
    started = time.time()
    for title, layers in models.items():
        results[title] = [simulate_scale(layers, p, profile, memory_limit, args.bucket_mb) for p in scales]
        print(f"### {title}: {len(layers)} layers\n")
        print(markdown_table(results[title]) + "\n")
    print(f"(planned in {time.time() - started:.1f} s)")
    if args.json:
        save_json(args.json, {"profile": profile.name, "source": profile.source, "batch": args.batch,
                              "memory_limit": memory_limit, "bucket_mb": args.bucket_mb,
                              "resnet_width": args.resnet_width,
                              "cnn_width": args.cnn_width, "cnn_depth": args.cnn_depth,
                              "cnn_image": args.cnn_image, "scales": scales, "models": results})
    if args.json:
        print(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    return results


def main(argv=None):
    run_simulation(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
