"""The scripts as a user runs them, under mpiexec: run_conv.py on random .npy files against a
serial computation made here, train.py end to end; bad input ends every rank with one clear
error and a non-zero exit, within seconds."""
import json
import os
import re
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest

from cfp.kernels import conv2d_backward_bias, conv2d_backward_data, conv2d_backward_filter, conv2d_forward
from run_suite import ROOT, mpiexec, single_thread_env

RUN_CONV = os.path.join(ROOT, "scripts", "run_conv.py")
TRAIN = os.path.join(ROOT, "scripts", "train.py")


def run(nprocs, args, timeout=120, script=RUN_CONV):
    cmd = mpiexec(nprocs, sys.executable, "-m", "mpi4py", script, *args)
    start = time.time()
    proc = subprocess.run(cmd, env=single_thread_env(MPIEXEC_TIMEOUT=timeout), capture_output=True,
                          text=True, timeout=timeout + 30)
    return proc, time.time() - start


def write_problem(folder, N=3, C=5, F=7, H=6, W=5, K=3, stride=1, padding=1, dtype=np.float64, bias=True):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((N, C, H, W)).astype(dtype)
    w = rng.standard_normal((F, C, K, K)).astype(dtype)
    b = rng.standard_normal(F).astype(dtype)
    y = conv2d_forward(x, w, b, stride, padding)
    dy = rng.standard_normal(y.shape).astype(dtype)
    paths = {name: str(folder / f"{name}.npy") for name in ("x", "w", "b", "dy")}
    for name, a in zip(("x", "w", "b", "dy"), (x, w, b, dy)):
        np.save(paths[name], a)
    args = ["--input", paths["x"], "--weight", paths["w"], "--grad-output", paths["dy"],
            "--stride", str(stride), "--padding", str(padding)]
    if bias:
        args += ["--bias", paths["b"]]
    expected = {"y": y if bias else conv2d_forward(x, w, None, stride, padding),
                "dx": conv2d_backward_data(dy, w, x.shape, stride, padding),
                "dw": conv2d_backward_filter(x, dy, w.shape, stride, padding),
                "db": conv2d_backward_bias(dy)}
    return args, expected


@pytest.mark.parametrize("nprocs,algorithm,grid,extra", [
    (1, "sample", "sample=1", []),
    (2, "y", "channel=2", []),
    (3, "x", "sample=3", []),
    (4, "w", "sample=1,channel=4", ["--filter-groups", "2"]),
    (4, "sample", "sample=2,channel=2", []),
    (2, "y", "height=2", []),
    (3, "x", "width=3", []),
    (4, "w", "height=2,channel=2", ["--filter-groups", "2"]),
])
def test_result_matches_serial(tmp_path, nprocs, algorithm, grid, extra):
    args, expected = write_problem(tmp_path, stride=2 if algorithm == "x" else 1)
    out = tmp_path / "result.npz"
    proc, _ = run(nprocs, args + ["--algorithm", algorithm, "--grid", grid, "--out", str(out), *extra])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "allreduce" in proc.stdout or nprocs == 1  # the ledger table is printed
    with np.load(out, allow_pickle=False) as result:
        assert sorted(result.files) == ["db", "dw", "dx", "y"]
        for name, want in expected.items():
            got = result[name]
            err = np.max(np.abs(got - want)) / np.max(np.abs(want))
            assert err < 1e-10, (name, err)


@pytest.mark.parametrize("nprocs,algorithm,grid,options,groups", [
    (3, "w", "channel=3", ["--stride", "1", "--padding", "same", "--dilation", "2,1", "--padding-mode", "reflect"], 1),
    (2, "x", "channel=2", ["--stride", "2,1", "--padding", "1,0", "--groups", "3", "--padding-mode", "circular"], 3),
    (3, "y", "sample=1,channel=3", ["--padding", "valid", "--groups", "6"], 6),
])
def test_conv2d_options_from_the_command_line(tmp_path, nprocs, algorithm, grid, options, groups):
    """--stride, --padding, --dilation, --groups, --padding-mode as PyTorch's nn.Conv2d takes
    them, against the serial kernels."""
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((2, 6, 7, 6)), rng.standard_normal((12, 6 // groups, 3, 3))
    b = rng.standard_normal(12)
    values = dict(zip(options[::2], options[1::2]))

    def parsed(text):
        if text in ("same", "valid") or "," not in text:
            return text if text in ("same", "valid") else int(text)
        return tuple(int(v) for v in text.split(","))
    kwargs = {"stride": parsed(values.get("--stride", "1")), "padding": parsed(values.get("--padding", "0")),
              "dilation": parsed(values.get("--dilation", "1")), "groups": groups,
              "padding_mode": values.get("--padding-mode", "zeros")}
    y = conv2d_forward(x, w, b, **kwargs)
    dy = rng.standard_normal(y.shape)
    expected = {"y": y, "dx": conv2d_backward_data(dy, w, x.shape, **kwargs),
                "dw": conv2d_backward_filter(x, dy, w.shape, **kwargs), "db": conv2d_backward_bias(dy)}
    run_against(tmp_path, nprocs, (x, w, b, dy), options + ["--algorithm", algorithm, "--grid", grid], expected)


def run_against(tmp_path, nprocs, arrays, options, expected):
    """run_conv.py on `nprocs` ranks with the global (x, w, b, dy) saved as .npy and `options`:
    its y, dx, dw and db have the shapes of `expected` and equal it to 1e-10 (relative)."""
    for name, a in zip(("x", "w", "b", "dy"), arrays):
        np.save(tmp_path / f"{name}.npy", a)
    out = tmp_path / "result.npz"
    proc, _ = run(nprocs, ["--input", str(tmp_path / "x.npy"), "--weight", str(tmp_path / "w.npy"),
                           "--grad-output", str(tmp_path / "dy.npy"), "--bias", str(tmp_path / "b.npy"), *options,
                           "--out", str(out)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with np.load(out, allow_pickle=False) as result:
        for name, want in expected.items():
            assert result[name].shape == want.shape, name
            assert np.max(np.abs(result[name] - want)) / np.max(np.abs(want)) < 1e-10, name


@pytest.mark.parametrize("nprocs,algorithm,grid,x_shape,w_shape,options", [
    (2, "y", "channel=2", (2, 4, 5, 6, 7), (6, 4, 3, 3, 3), ["--stride", "2,1,2", "--padding", "1"]),
    (3, "x", "sample=1,channel=3", (2, 6, 4, 5), (6, 2, 3, 3),
     ["--transposed", "--stride", "2", "--padding", "1", "--output-padding", "1", "--groups", "3"]),
    (4, "w", "sample=2,channel=2", (3, 4, 3, 4, 3), (4, 5, 2, 3, 3),
     ["--transposed", "--stride", "2,2,1", "--padding", "0,1,1", "--output-padding", "1,0,0"]),
])
def test_volumes_and_transposed_from_the_command_line(tmp_path, nprocs, algorithm, grid, x_shape, w_shape, options):
    """A 5-D input is a volume (nn.Conv3d); --transposed takes PyTorch's transposed weight
    (C, F / groups, ...) and writes dw in it; against the serial kernels."""
    from cfp.kernels.conv import (conv3d_backward_data, conv3d_backward_filter, conv3d_forward,
                                  conv_transpose_backward_data, conv_transpose_backward_filter, conv_transpose_forward)
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
    values = dict(zip(options[1::2], options[2::2]) if options[0] == "--transposed" else zip(options[::2], options[1::2]))
    parsed = {k.lstrip("-").replace("-", "_"): tuple(int(v) for v in t.split(",")) if "," in t else int(t)
              for k, t in values.items()}
    if "--transposed" in options:
        passes = (conv_transpose_forward, conv_transpose_backward_data, conv_transpose_backward_filter)
        F = w_shape[1] * parsed.get("groups", 1)
    else:
        passes = (conv3d_forward, conv3d_backward_data, conv3d_backward_filter)
        F = w_shape[0]
    b = rng.standard_normal(F)
    y = passes[0](x, w, b, **parsed)
    dy = rng.standard_normal(y.shape)
    expected = {"y": y, "dx": passes[1](dy, w, x.shape, **parsed), "dw": passes[2](x, dy, w.shape, **parsed),
                "db": dy.sum(axis=tuple(i for i in range(dy.ndim) if i != 1))}
    run_against(tmp_path, nprocs, (x, w, b, dy), options + ["--algorithm", algorithm, "--grid", grid], expected)


def test_float32_stays_float32_and_bias_is_optional(tmp_path):
    args, expected = write_problem(tmp_path, dtype=np.float32, bias=False)
    out = tmp_path / "result.npz"
    proc, _ = run(2, args + ["--algorithm", "w", "--grid", "channel=2", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr
    with np.load(out, allow_pickle=False) as result:
        assert sorted(result.files) == ["dw", "dx", "y"]
        assert result["y"].dtype == np.float32
        err = np.max(np.abs(result["y"] - expected["y"])) / np.max(np.abs(expected["y"]))
        assert err < 1e-5


def bad_cases(tmp_path):
    args, _ = write_problem(tmp_path)
    garbage = tmp_path / "garbage.npy"
    garbage.write_bytes(b"this is not an npy file")
    wrong_dy = tmp_path / "wrong_dy.npy"
    np.save(wrong_dy, np.zeros((3, 7, 2, 2)))
    base = ["--algorithm", "w", "--grid", "channel=3", "--out", str(tmp_path / "r.npz")]

    def swap(flag, value):
        changed = list(args)
        changed[changed.index(flag) + 1] = value
        return changed

    return [
        (args + ["--algorithm", "w", "--grid", "channel=3", "--filter-groups", "2", "--out", "r.npz"],
         "filter groups p_f=2 does not divide the channel grid size P_c=3"),
        (args + ["--algorithm", "x", "--grid", "sample=2,channel=2", "--out", "r.npz"],
         "grid sample=2,channel=2 needs 4 ranks, the communicator has 3"),
        (args + ["--algorithm", "q", "--grid", "channel=3", "--out", "r.npz"], "unknown algorithm 'q'"),
        (swap("--input", str(tmp_path / "missing.npy")) + base, "input file .*missing.npy' does not exist"),
        (swap("--weight", str(garbage)) + base, "weight file .*garbage.npy' is not a readable .npy file"),
        (swap("--grad-output", str(wrong_dy)) + base,
         r"grad-output has shape \(3, 7, 2, 2\); the convolution's output has shape \(3, 7, 6, 5\)"),
        (args + ["--output-padding", "1"] + base, "--output-padding 1 applies to --transposed only"),
        (args + ["--transposed", "--padding-mode", "reflect"] + base,
         "--padding-mode reflect: a transposed convolution pads with zeros only"),
    ]


def test_bad_input_stops_every_rank_with_a_clear_error(tmp_path):
    for args, message in bad_cases(tmp_path):
        proc, seconds = run(3, args, timeout=60)
        assert proc.returncode != 0, (args, proc.stdout)
        assert re.search(message, proc.stderr), (message, proc.stderr)
        assert proc.stderr.count("run_conv.py: error:") == 1  # said once, by rank 0
        assert seconds < 30, f"{message}: took {seconds:.0f} s"


def test_train_script_end_to_end(tmp_path):
    log, curves = tmp_path / "run.json", tmp_path / "curves.png"
    proc, _ = run(2, ["--model", "resnet", "--grid", "channel=2", "--algorithm", "w", "--epochs", "1",
                      "--train-samples", "256", "--batch-size", "64", "--log", str(log), "--no-progress",
                      "--plot", str(curves)],
                  script=TRAIN)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    # what it read first; the summary ends with what it wrote, the run and, last, the result
    assert lines[0] == ("dataset digits: 256 training and 360 test images of 1x8x8 (C x H x W), 10 classes; test "
                        "set: a stratified 20% test split (seed 0); the first 256 training samples (--train-samples)")
    assert re.fullmatch(r"test accuracy 0\.\d{4}", lines[-1]), lines[-1]
    assert re.fullmatch(r"4 steps in .* s, \d+ images/s on 2 rank\(s\), grid channel=2, algorithm w, .*", lines[-2])
    assert lines[-3] == f"wrote log {log}, plot {curves}", lines[-3]
    # the communication table: the 10 rows of most transfer time, the rest in one row, the total
    table = proc.stdout.split("communication of rank 0 by layer, phase and collective (10 rows of most transfer "
                              "time; --comm-table full for all)")[1].split("memory per rank")[0].strip().splitlines()
    assert table[1].endswith("transfer s  wait s  pack s"), table[1]
    assert len(table) == 1 + 1 + 10 + 2 and table[-2].startswith("(") and table[-1].startswith("total"), table
    rows = [float(r.split()[-3]) for r in table[2:12]]
    assert rows == sorted(rows, reverse=True)  # by transfer time
    with open(log) as f:
        record = json.load(f)
    assert len(record["steps"]) == 4 and record["summary"]["ranks"] == 2
    communication = record["summary"]["communication"]
    assert all(c["wait_seconds"] >= 0 and c["seconds"] >= 0 for c in communication)
    total_calls = sum(c["calls"] for c in communication)
    assert table[-1].split()[1] == str(total_calls)
    assert curves.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_conv_breaks_each_ranks_step_down(tmp_path):
    """bench_conv --breakdown --rounds 3 on 2 ranks: a row per rank of every distributed row, whose
    parts (kernels, packing, MPI, waiting, the rest) add up to its step, and the JSON keeps them;
    each row's speedup the median of its three rounds' own, the serial row's 1."""
    out = tmp_path / "bench.json"
    proc, _ = run(2, ["--shape", "2,4,6,5,5,3", "--repeats", "1", "--warmup", "0", "--algorithms", "x,sample",
                      "--breakdown", "--rounds", "3", "--json", str(out)],
                  script=os.path.join(ROOT, "scripts", "bench_conv.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = proc.stdout.split("| grid | algorithm | rank | step ms | kernels | packing | MPI | wait | rest |")[1]
    rows = [line.split("|")[1:-1] for line in table.strip().splitlines()[1:] if line.startswith("|")]
    assert len(rows) == 4 * 2, rows  # channel=2 and sample=2, each with x and sample, on 2 ranks
    with open(out) as f:
        record = json.load(f)
    distributed = [r for r in record["rows"] if "breakdown" in r]
    assert [len(r["breakdown"]) for r in distributed] == [2] * len(distributed)
    for r in distributed:
        for parts in r["breakdown"]:
            assert parts["kernels"] > 0 and parts["packing"] >= 0 and parts["mpi"] >= 0 and parts["wait"] >= 0
            total = parts["kernels"] + parts["packing"] + parts["mpi"] + parts["wait"] + parts["rest"]
            assert total == pytest.approx(parts["step"], rel=1e-9, abs=1e-12), parts
    for r in record["rows"]:
        assert len(r["speedups"]) == 3 and r["speedup"] == statistics.median(r["speedups"]), r
    assert record["rows"][0]["speedups"] == [1.0] * 3
    assert "3 rounds in turns" in proc.stdout.splitlines()[0]


def test_bench_conv_times_the_interior_beside_the_blocking_halo(tmp_path):
    """bench_conv --spatial --halo-interior on 2 ranks: on each grid that splits the image, the
    sample and x rows a second time with the interior computed while the halo moves, and the
    same bytes as the blocking rows."""
    out = tmp_path / "bench.json"
    proc, _ = run(2, ["--shape", "2,4,6,8,8,3", "--repeats", "1", "--warmup", "0", "--algorithms", "sample,x",
                      "--spatial", "--halo-interior", "--json", str(out)],
                  script=os.path.join(ROOT, "scripts", "bench_conv.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        rows = json.load(f)["rows"]
    interior = [r for r in rows if r["algorithm"].endswith("(interior while the halo moves)")]
    assert sorted((r["grid"], r["algorithm"].split()[0]) for r in interior) == sorted(
        (g, a) for g in ("height=2", "width=2")
        for a in ("sample", "x")), [r["grid"] for r in interior]
    for r in interior:
        blocking = next(b for b in rows if b["grid"] == r["grid"] and b["algorithm"] == r["algorithm"].split()[0])
        assert r["bytes_sent_per_rank"] == blocking["bytes_sent_per_rank"] > 0
        assert r["halo_bytes_per_rank"] == blocking["halo_bytes_per_rank"] > 0


def test_bench_conv_times_each_layer_in_chunks_beside_the_blocking_one(tmp_path):
    """bench_conv --chunks 1,2 on 2 ranks: on channel=2 each of x, y and w a second time with its
    collectives pipelined over 2 chunks, moving the same bytes; none on sample=2, whose ranks
    hold one sample each; with one sample, in 2 chunks of the features; a count above the samples
    and the features refused."""
    out = tmp_path / "chunks.json"
    proc, _ = run(2, ["--shape", "2,4,6,5,5,3", "--repeats", "1", "--warmup", "0", "--algorithms", "x,y,w,sample",
                      "--chunks", "1,2", "--json", str(out)], script=os.path.join(ROOT, "scripts", "bench_conv.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        rows = json.load(f)["rows"]
    chunked = [r for r in rows if r.get("chunks") == 2]
    assert sorted(r["algorithm"] for r in chunked) == ["w (p_f=1) (2 chunks)", "w (p_f=2) (2 chunks)", "x (2 chunks)",
                                                       "y (2 chunks)"], chunked
    assert all(r["grid"] == "channel=2" for r in chunked), chunked
    blocking = {r["algorithm"]: r for r in rows if r["grid"] == "channel=2" and r.get("chunks") == 1}
    assert all(r["bytes_sent_per_rank"] == blocking[r["algorithm"].replace(" (2 chunks)", "")]["bytes_sent_per_rank"]
               for r in chunked)
    # one sample: the chunks split the features (2 of C=4 and 3 of F=6 a rank), the same bytes again
    # (and --mpi-progress calls,thread: each of those rows a second time under the progress thread)
    proc, _ = run(2, ["--shape", "1,4,6,5,5,3", "--repeats", "1", "--warmup", "0", "--algorithms", "x,y,w",
                      "--grid", "channel=2", "--chunks", "1,2", "--mpi-progress", "calls,thread", "--json", str(out)],
                  script=os.path.join(ROOT, "scripts", "bench_conv.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        rows = json.load(f)["rows"]
    chunked = [r for r in rows if r.get("chunks") == 2]
    labels = ["w (p_f=1) (2 feature chunks)", "w (p_f=2) (2 feature chunks)", "x (2 feature chunks)",
              "y (2 feature chunks)"]
    assert sorted(r["algorithm"] for r in chunked) == sorted(labels + [a + " (progress thread)" for a in labels]), chunked
    assert sorted(r["mpi_progress"] for r in chunked) == ["calls"] * 4 + ["thread"] * 4, chunked
    blocking = {r["algorithm"]: r for r in rows if r.get("chunks") == 1}
    assert all(r["bytes_sent_per_rank"] == blocking[r["algorithm"].split(" (2 feature chunks)")[0]]
               ["bytes_sent_per_rank"] for r in chunked)
    proc, _ = run(1, ["--shape", "2,4,6,5,5,3", "--mpi-progress", "calls,often"],
                  script=os.path.join(ROOT, "scripts", "bench_conv.py"))
    assert proc.returncode != 0 and ("--mpi-progress 'calls,often': expected a comma-separated list of calls, "
                                     "thread") in proc.stderr, proc.stderr
    proc, _ = run(1, ["--shape", "2,4,6,5,5,3", "--chunks", "5"], script=os.path.join(ROOT, "scripts", "bench_conv.py"))
    assert proc.returncode != 0 and ("--chunks 5: 5 chunks is more than the 2 sample(s) and the 4 channels or "
                                     "filters") in proc.stderr, proc.stderr


def test_same_plan_compares_what_each_layer_runs():
    """benchtools.same_plan: a grid's axes of one rank do not count; the algorithm, filter
    groups, placement and chunks of any layer do."""
    from cfp.benchtools import same_plan
    a = {"c1": {"grid": "sample=2", "algorithm": "sample"}, "c2": {"grid": "channel=2", "algorithm": "x"}}
    b = {"c1": {"grid": "sample=2,channel=1", "algorithm": "sample"},
         "c2": {"grid": "sample=1,channel=2", "algorithm": "x"}}
    assert same_plan(a, b) and same_plan(b, a)
    for change in ({"algorithm": "y"}, {"filter_groups": 2}, {"node_axes": "channel"}, {"chunks": 2},
                   {"grid": "sample=2"}):
        assert not same_plan(a, {**b, "c2": {**b["c2"], **change}}), change
    assert not same_plan(a, {"c1": b["c1"]})


def test_with_planner_measures_a_planners_single_grid_plan_once():
    """benchtools.with_planner: the planner's plan is timed as a plan of its own unless it is one
    of the single-grid plans, whose measurement it then reports under 'planner (= that plan)'."""
    from cfp.benchtools import with_planner
    single = {"sample=2 sample": {"c": {"grid": "sample=2", "algorithm": "sample"}},
              "channel=2 x": {"c": {"grid": "channel=2", "algorithm": "x"}}}
    mine = {"c": {"grid": "sample=2,channel=1", "algorithm": "sample"}}
    timed, rows = with_planner(single, mine)
    assert timed == single and rows[-1] == ("planner (= sample=2 sample)", mine, "sample=2 sample")
    other = {"c": {"grid": "channel=2", "algorithm": "y"}}
    timed, rows = with_planner(single, other)
    assert timed == {**single, "planner": other} and rows[-1] == ("planner", other, "planner")
    assert [r[0] for r in rows[:-1]] == list(single)


def test_bench_plans_measures_a_planners_single_grid_plan_once(tmp_path):
    """bench_plans on 2 ranks: every single-grid plan and the planner's, the planner's last; where
    the planner's plan is one of the single-grid plans its row names it and carries that plan's
    measurement (the same plan is not timed against itself)."""
    out = tmp_path / "plans.json"
    proc, _ = run(2, ["--model", "resnet", "--width", "1", "--batch", "8", "--steps", "1", "--warmup", "0",
                      "--profile", "cpu-dev", "--json", str(out)], script=os.path.join(ROOT, "scripts", "bench_plans.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        result = json.load(f)
    rows = {r["plan"]: r for r in result["rows"]}
    assert {"channel=2 x", "channel=2 y", "channel=2 w p_f=1", "channel=2 w p_f=2", "sample=2 sample"} <= set(rows)
    last = result["rows"][-1]
    if result["planner_is"] is None:
        assert last["plan"] == "planner", last
    else:
        assert last["plan"] == f"planner (= {result['planner_is']})", last
        assert last["measured_s"] == rows[result["planner_is"]]["measured_s"]
        assert last["predicted_s"] == pytest.approx(rows[result["planner_is"]]["predicted_s"], rel=1e-12)


def test_bench_conv_splits_a_volume_by_depth(tmp_path):
    """bench_conv --shape N,C,F,D,H,W,K --spatial on 2 ranks: a volume's rows on every grid of
    sample, depth, height, width and channel, the depth split's halo bytes those predict_bytes
    gives."""
    out = tmp_path / "bench.json"
    proc, _ = run(2, ["--shape", "1,4,6,6,5,5,3", "--repeats", "1", "--warmup", "0", "--algorithms", "sample",
                      "--spatial", "--json", str(out)], script=os.path.join(ROOT, "scripts", "bench_conv.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        rows = {r["grid"]: r for r in json.load(f)["rows"]}
    assert {"sample=2", "depth=2", "height=2", "width=2", "channel=2"} <= set(rows), sorted(rows)
    from cfp.perfmodel import predict_bytes
    halo = [predict_bytes("sample", (1, 4, 6, 5, 5), (6, 4, 3, 3, 3), "depth=2", {"depth": d}, padding=1,
                          itemsize=4, op="conv3d")["halo"][0] for d in (0, 1)]
    assert rows["depth=2"]["halo_bytes_per_rank"] == max(halo) > 0


def test_bench_conv_times_only_the_grids_asked_for(tmp_path):
    """bench_conv --grid on 2 ranks: the serial kernels and the grids named, in their order (a spec
    as train.py's, 'sample=1,depth=2' and 'depth=2' alike), no other; a grid the run does not time refused,
    naming those it does."""
    out = tmp_path / "bench.json"
    script = os.path.join(ROOT, "scripts", "bench_conv.py")
    proc, _ = run(2, ["--shape", "1,4,6,6,5,5,3", "--repeats", "1", "--warmup", "0", "--algorithms", "sample,x",
                      "--spatial", "--grid", "sample=1,depth=2", "--grid", "height=2", "--grid", "depth=2",
                      "--json", str(out)], script=script)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        rows = [(r["grid"], r["algorithm"]) for r in json.load(f)["rows"]]
    assert rows == [("1 rank (serial kernels)", "-"), ("depth=2", "sample"), ("depth=2", "x"),
                    ("height=2", "sample"), ("height=2", "x")], rows  # in the order asked, each once
    proc, _ = run(2, ["--shape", "1,4,6,5,5,3", "--grid", "height=2"], script=script)
    assert proc.returncode != 0 and ("--grid height=2: not a grid this run times on 2 rank(s); expected one of "
                                     "channel=2, sample=2 (--spatial adds the image's axes)") in proc.stderr, proc.stderr


def test_bench_progress_times_each_way_of_progressing_a_started_allreduce(tmp_path):
    """bench_progress on 2 ranks: every row timed (the GEMMs, the allreduce, blocking, started
    with no call and with a test() after each GEMM, started under the progress thread at each
    interval with the pace of its rounds, the GEMMs beside it), in the table and the JSON
    alike; a bad --gemm refused."""
    out = tmp_path / "progress.json"
    proc, _ = run(2, ["--mib", "0.25", "--gemms", "2", "--gemm", "64,32,16", "--repeats", "1", "--intervals", "1,0.5",
                      "--json", str(out)], script=os.path.join(ROOT, "scripts", "bench_progress.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        record = json.load(f)
    rows = record["rows_ms"]
    assert len(rows) == 5 + 2 * 2 and all(ms > 0 for ms in rows.values()), rows
    assert sum("thread every 0.5 ms" in name for name in rows) == 2, rows
    assert record["gemm"] == [64, 32, 16] and len(record["thread_round_ms"]) == 2, record
    assert all(ms > 0 for ms in record["thread_round_ms"].values()), record
    assert all(f"| {name} |" in proc.stdout for name in rows), proc.stdout
    proc, _ = run(1, ["--gemm", "64,32"], script=os.path.join(ROOT, "scripts", "bench_progress.py"))
    assert proc.returncode != 0 and "--gemm (M,K,N) '64,32': expected 3 positive integers separated by commas" in proc.stderr


def test_the_progress_bar_shows_the_epoch(tmp_path):
    proc, _ = run(1, ["--epochs", "2", "--train-samples", "128", "--batch-size", "64"], script=TRAIN)
    assert proc.returncode == 0, proc.stderr
    assert "epoch 1/2" in proc.stderr and "epoch 2/2" in proc.stderr, proc.stderr


def test_plan_script_writes_a_plan_that_train_runs(tmp_path):
    """scripts/plan.py --out, then scripts/train.py --plan on the same model and ranks: the
    run follows the plan layer by layer and shows its redistributions."""
    plan_file, log = tmp_path / "plan.json", tmp_path / "run.json"
    model = ["--model", "resnet", "--width", "4"]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plan.py"), *model, "--batch", "64",
                           "--ranks", "2", "--out", str(plan_file)], env=single_thread_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    with open(plan_file) as f:
        written = json.load(f)["layers"]
    proc, _ = run(2, [*model, "--plan", str(plan_file), "--epochs", "1", "--train-samples", "128",
                      "--batch-size", "64", "--log", str(log), "--no-progress"], script=TRAIN)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(log) as f:
        built = json.load(f)["summary"]["layers"]
    assert list(written)[0] == "stem.conv" and list(written)[-1] == "fc"  # model order
    assert set(built) == set(written)
    for name, entry in written.items():
        assert built[name]["algorithm"] == entry["algorithm"]
        assert built[name].get("filter_groups") == entry.get("filter_groups")
    grids = {e["grid"] for e in written.values()}
    assert ("redistribute for" in proc.stdout) == (len(grids) > 1), proc.stdout


@pytest.mark.parametrize("args,message", [
    (["--model", "vgg"], "unknown model 'vgg'"),
    (["--optimizer", "rmsprop"], "unknown optimizer 'rmsprop'"),
    (["--grid", "sample=2", "--batch-size", "1"], "batch size 1 is smaller than the sample axis of the grid"),
    (["--grid", "channel=2", "--model", "wide", "--width", "1"], "width=1 gives 1 channels in the narrowest layer"),
    (["--grid", "sample=3"], "grid sample=3 needs 3 ranks, the communicator has 2"),
    (["--resume"], "--resume needs --checkpoint-dir"),
])
def test_train_script_bad_input(args, message):
    proc, seconds = run(2, args + ["--epochs", "1", "--no-progress"], timeout=60, script=TRAIN)
    assert proc.returncode != 0, proc.stdout
    assert message in proc.stderr, proc.stderr
    assert proc.stderr.count("train.py: error:") == 1
    assert seconds < 30


SCRIPT_FILES = sorted(f for f in os.listdir(os.path.join(ROOT, "scripts")) if f.endswith(".py") and not f.startswith("_"))


@pytest.mark.parametrize("name", SCRIPT_FILES)
def test_help_describes_every_option_in_whole_sentences(name):
    """--help as a newcomer meets it: printed once, a description that ends its sentence, and
    a help text for every option (argparse adds the defaults)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", name), "--help"], capture_output=True,
                          text=True, env=single_thread_env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    description = text.split("\n\n")[1].strip()
    assert description.endswith((".", ")")), f"{name}: the description stops mid-sentence: {description!r}"
    options = text.split("options:")[1]
    entries = re.split(r"\n  (?=-)", "\n" + options.strip("\n"))[1:]
    for entry in entries:
        flag_part = entry.split("  ")[0]
        words = entry[len(flag_part):].split()
        assert words, f"{name}: option {flag_part.strip()} has no help text"


def test_a_script_outside_cfps_environment_says_what_is_missing_in_one_line():
    """scripts/_requirements.py, imported first by every script: a module cfp needs that cannot
    be imported (a script run by a Python without cfp's environment) is one line naming it and
    how to activate the environment, not an import traceback."""
    code = ("import importlib.util, runpy, sys; real = importlib.util.find_spec; "
            "importlib.util.find_spec = lambda name, *a: None if name in ('tqdm', 'cfp') else real(name, *a); "
            "sys.argv = ['scripts/train.py']; sys.path.insert(0, 'scripts'); "
            "runpy.run_path('scripts/train.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=single_thread_env())
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == (f"train.py: error: tqdm, cfp are not installed for {sys.executable}; activate "
                                   f"cfp's environment first (`. .venv/bin/activate` in the checkout, after `make "
                                   f"install`) or run the script with .venv/bin/python"), proc.stderr
