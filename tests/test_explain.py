"""cfp.explain and scripts/explain.py: the explanation's index ranges, groups and bytes against
what the layer holds and does (its shards, its communicators, the ledger of a real run,
perfmodel.predict_bytes), for every algorithm on every factorization of 1-4 ranks; tables
worked out by hand; the pictures and the script's errors."""
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

from cfp.explain import explain_layer, explain_model, model_table, plot_layer, range_text, trace_layer
from cfp.grid import AXES, ProcessGrid, factorizations
from cfp.models import layer_shapes
from cfp.partition import check_filter_groups
from cfp.perfmodel import predict_bytes
from conftest import IMAGE_AXES
from run_suite import ROOT, mpiexec, single_thread_env

EXPLAIN = os.path.join(ROOT, "scripts", "explain.py")
LAYER = dict(x_shape=(4, 6, 8, 8), out_channels=8, kernel_size=3, padding=1)


def grids(ranks):
    """Every sample x height x width x channel grid of `ranks` ranks (an image's: no depth)."""
    return [dict(zip(IMAGE_AXES, f)) for f in factorizations(ranks, 4)]


def cases(ranks):
    """(algorithm, grid, p_f, groups) for every algorithm (w with each p_f) on every grid."""
    out = []
    for g in grids(ranks):
        for algorithm in ("sample", "x", "y"):
            out.append((algorithm, g, None, 1))
        for p_f in range(1, g["channel"] + 1):
            if g["channel"] % p_f == 0:
                out.append(("w", g, p_f, 1))
        out.append(("y", g, None, 2))  # a grouped layer: only its gradient moves
    return out


def test_range_text():
    assert range_text(range(0, 4)) == "0:4"
    assert range_text((0, 1, 4, 5)) == "0:2+4:6"
    assert range_text(range(0)) == "-"


def test_tables_worked_out_by_hand():
    """Stationary-w, p_f = 2 on 4 channel ranks: rank c at (row, column) = divmod(c, 2)
    holds channel block c of x and y (C = F = 8: two each), and the filters of its column's
    blocks {j, j + 2} times the channels of its row's blocks {2i, 2i + 1}."""
    e = explain_layer((4, 8, 8, 8), 8, 3, "w", "channel=4", filter_groups=2, padding=1)
    text = e.text()
    for line in ["0     c0      x[0:4, 0:2, 0:8, 0:8]  w[0:2+4:6, 0:4]  y[0:4, 0:2, 0:8, 0:8]",
                 "3     c3      x[0:4, 6:8, 0:8, 0:8]  w[2:4+6:8, 4:8]  y[0:4, 6:8, 0:8, 0:8]",
                 "1. forward: allgather x within each row: groups {0,1} {2,3}",
                 "2. forward: reduce-scatter y within each column: groups {0,2} {1,3}",
                 "3. backward-filter: allgather dy within each column: groups {0,2} {1,3}",
                 "4. gradient-sync: allreduce dw and db within the ranks sharing a shard: groups {0} {1} {2} {3}",
                 "5. backward-data: reduce-scatter dx within each row: groups {0,1} {2,3}",
                 "   1     4.0 KiB  4.0 KiB   dy of the column: dy[0:4, 2:4+6:8, 0:8, 0:8]"]:
        assert line in text, line
    # each block of x is 4 * 2 * 8 * 8 float64 = 4 KiB; in a row of 2 each rank sends its block
    # once and receives the other's
    assert [s.sent[0] for s in e.steps] == [4096, 4096, 4096, 0, 4096]
    # the halo of a 3x3 kernel over 2 row blocks: one row of 4 samples x 8 channels x 8 columns
    # each way, and back with dx
    e = explain_layer((4, 8, 8, 8), 8, 3, "sample", "height=2", padding=1)
    halo = [s for s in e.steps if s.phase == "halo"]
    assert [(s.sent[0], s.received[0]) for s in halo] == [(4 * 8 * 8 * 8, 4 * 8 * 8 * 8)] * 2
    assert e.steps[0].result[1][2] == (range(0, 4), range(0, 8), range(3, 8), range(0, 8))
    # wrapped around, the top block's padded first row is row 7 and the bottom block's last row 0:
    # each halo brings one more row, from the other block
    e = explain_layer((4, 8, 8, 8), 8, 3, "sample", "height=2", padding=1, padding_mode="circular")
    halo = [s for s in e.steps if s.phase == "halo"]
    assert [(s.sent[0], s.received[0]) for s in halo] == [(2 * 4 * 8 * 8 * 8, 2 * 4 * 8 * 8 * 8)] * 2
    assert e.steps[0].result[0][2] == (range(0, 4), range(0, 8), (0, 1, 2, 3, 4, 7), range(0, 8))
    assert e.steps[0].result[1][2] == (range(0, 4), range(0, 8), (0, 3, 4, 5, 6, 7), range(0, 8))
    assert "padding mode circular" in e.text() and "x[0:4, 0:8, 0:5+7:8, 0:8]" in e.text()


def test_a_depth_split_and_a_transposed_halo_worked_out_by_hand():
    """A Conv3d on depth=2 (6 planes, 3x3x3 kernel, padding 1): each rank's halo is the plane
    beside its block (2 samples x 4 channels x 5 x 5, each way); a ConvTranspose2d of stride 2,
    output_padding 1 on height=2 (5 input rows, 10 output rows of 5 each): the top block's rows
    0..4 are reached by input rows 0..2 (it holds them), the bottom's rows 5..9 by rows 2..4
    (row 2 comes from the top); bytes as predict_bytes."""
    e = explain_layer((2, 4, 6, 5, 5), 4, 3, "sample", "depth=2", padding=1, op="conv3d")
    text = e.text()
    assert "x[samples, channels, planes, rows, columns]" in text and "kernel 3x3x3" in text
    halo = [s for s in e.steps if s.phase == "halo"]
    assert [(s.sent[0], s.received[0]) for s in halo] == [(2 * 4 * 25 * 8, 2 * 4 * 25 * 8)] * 2
    assert e.steps[0].result[1][2] == (range(0, 2), range(0, 4), range(2, 6), range(0, 5), range(0, 5))
    e = explain_layer((1, 2, 5, 5), 2, 3, "y", "height=2", stride=2, padding=1, output_padding=1,
                      op="conv_transpose2d")
    assert e.shapes["y"] == (1, 2, 10, 10) and "output_padding 1" in e.text()
    assert e.steps[0].result[0][2] == (range(0, 1), range(0, 2), range(0, 3), range(0, 5))
    assert e.steps[0].result[1][2] == (range(0, 1), range(0, 2), range(2, 5), range(0, 5))
    assert (e.steps[0].sent[0], e.steps[0].received[1]) == (2 * 5 * 8, 2 * 5 * 8)
    for r in range(e.ranks):
        assert e.bytes(r) == predict_bytes("y", (1, 2, 5, 5), e.shapes["w"], "height=2", e.coords[r], stride=2,
                                           padding=1, op="conv_transpose2d", output_padding=1)
    with pytest.raises(ValueError, match=r"conv2d on a grid splitting depth \(depth=2\): depth splits volumes"):
        explain_layer((1, 2, 5, 5), 2, 3, "y", "depth=2")
    with pytest.raises(ValueError, match=r"conv3d takes x of 5 dimensions"):
        explain_layer((1, 2, 5, 5), 2, 3, "y", "sample=1", op="conv3d")


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_bytes_are_predict_bytes(ranks):
    for algorithm, g, p_f, groups in cases(ranks):
        for first in (False, True):
            e = explain_layer(LAYER["x_shape"], 8, 3, algorithm, g, p_f, padding=1, groups=groups,
                              input_whole=first, need_dx=not first)
            for r in range(e.ranks):
                predicted = predict_bytes(algorithm, LAYER["x_shape"], e.shapes["w"], g, e.coords[r], padding=1,
                                          filter_groups=p_f, groups=groups, input_whole=first, need_dx=not first)
                assert e.bytes(r) == predicted, (algorithm, g, p_f, groups, r)


@pytest.mark.mpi(min_size=1)
def test_trace_matches_explanation_ledger_and_serial():
    """A real run of every algorithm on every grid of this many ranks: the ledger's collectives,
    group sizes and bytes are the explanation's step by step (and sum to predict_bytes), the
    results have the explained index ranges' sizes and hold the serial tensors' values there,
    and the layer's weight shards are the explained ones (Trace.mismatches lists any
    difference)."""
    world = MPI.COMM_WORLD
    for algorithm, g, p_f, groups in cases(world.Get_size()):
        for first in (False, True):
            mode = "reflect" if first else "circular"  # the padded rows copy others' rows on split images
            trace = trace_layer(world, LAYER["x_shape"], 8, 3, algorithm, g, p_f, padding=1, groups=groups,
                                input_whole=first, need_dx=not first, seed=3, padding_mode=mode)
            if world.Get_rank() == 0:
                assert trace.mismatches == [], (algorithm, g, p_f, first, trace.mismatches)
                e = trace.explanation
                assert len(trace.steps) == len(e.steps)
                for r in range(e.ranks):
                    ledger = {}
                    for done in (step[r] for step in trace.steps):
                        sent, received = ledger.get(done["phase"], (0, 0))
                        ledger[done["phase"]] = (sent + done["sent"], received + done["received"])
                    predicted = predict_bytes(algorithm, LAYER["x_shape"], e.shapes["w"], g, e.coords[r],
                                              padding=1, filter_groups=p_f, groups=groups, input_whole=first,
                                              need_dx=not first, padding_mode=mode)
                    assert {p: v for p, v in predicted.items() if v != (0, 0)} == \
                        {p: v for p, v in ledger.items() if v != (0, 0)}, (algorithm, g, r)
                    assert all(s[r]["serial"] is None or np.isfinite(s[r]["serial"]) for s in trace.steps)


@pytest.mark.mpi(min_size=1)
def test_explained_groups_are_the_grids_communicators():
    """The ranks the explanation puts in each row, column and gradient group are the members of
    the communicators grid.ProcessGrid splits for them."""
    world = MPI.COMM_WORLD
    for g in grids(world.Get_size()):
        grid = ProcessGrid(g, world)
        try:
            for p_f in range(1, g["channel"] + 1):
                try:
                    check_filter_groups(g["channel"], p_f)
                except ValueError:
                    continue
                e = explain_layer(LAYER["x_shape"], 8, 3, "w", g, p_f, padding=1)
                row, column = grid.row_and_column_comms(p_f)
                members = {"row": row, "column": column, "gradient": grid.complement_comm("channel")}
                for step in e.steps:
                    if step.message.group in members:
                        actual = sorted(members[step.message.group].allgather(grid.rank))
                        assert actual == step.groups[grid.rank], (g, p_f, step.title())
        finally:
            grid.free()


def test_model_table_follows_the_plan():
    layers = layer_shapes("resnet", 16, 1, image=8)
    plan = {"stem.conv": {"grid": "sample=4", "algorithm": "sample"},
            "layer2.conv1": {"grid": "sample=2,channel=2", "algorithm": "w", "filter_groups": 1}}
    explained = explain_model(layers, plan=plan)
    choices = {layer.name: (c["grid"], c["algorithm"], c["filter_groups"]) for layer, c, _ in explained}
    assert choices["layer1.conv2"] == ("sample=4", "sample", None)  # kept from the layer before
    assert choices["layer2.conv2"] == ("sample=2,channel=2", "w", 1)
    assert choices["fc"] == ("sample=2,channel=2", "w", 1)
    table = model_table(explained)
    assert "layer2.conv1  16x8x8 -> 32x4x4" in table and "w p_f=1" in table
    with pytest.raises(ValueError, match="layer 'nope'|'nope'"):
        explain_model(layers, plan={"nope": {"algorithm": "x"}})


def test_which_ranks_share_a_node_worked_out_by_hand():
    """y on a 2 x 2 sample x channel grid on 2 nodes of 2: channel fastest (the default) puts
    each channel pair (grid ranks 0,1 and 2,3) on a node and the gradient allreduce's sample
    pairs (0,2 and 1,3) across; node axes 'sample' puts grid rank 1 on process 2 and the other
    way round. The tables name each rank's process and node and each group's nodes."""
    default = explain_layer((4, 8, 8, 8), 8, 3, "y", "sample=2,channel=2", padding=1, ranks_per_node=2)
    placed = explain_layer((4, 8, 8, 8), 8, 3, "y", "sample=2,channel=2", padding=1, ranks_per_node=2,
                           node_axes="sample")
    assert default.processes == (0, 1, 2, 3) and placed.processes == (0, 2, 1, 3)
    assert [default.node(r) for r in range(4)] == [0, 0, 1, 1] and [placed.node(r) for r in range(4)] == [0, 1, 0, 1]
    assert default.across_nodes() == ["gradient-sync: allreduce"]
    assert placed.across_nodes() == ["forward: allgather", "backward-data: reduce_scatter"]
    text = placed.text()
    assert "(4 ranks, node axes sample, 2 nodes of 2 ranks)" in text
    assert "groups {0,1} (nodes 0,1: across) {2,3} (nodes 0,1: across)" in text
    assert "groups {0,2} (node 0) {1,3} (node 1)" in text
    assert "rank  process  node  coords" in text and "\n1     2        1     s0 c1" in text
    assert "rank  node  coords" in default.text() and "process" not in default.text()
    # the placement without nodes: which process holds each grid rank
    assert "rank  process  coords" in explain_layer((4, 8, 8, 8), 8, 3, "y", "sample=2,channel=2", padding=1,
                                                    node_axes="sample").text()
    table = model_table(explain_model(layer_shapes("resnet", 16, 1, image=8), "sample=2,channel=2", "y",
                                      node_axes="sample", ranks_per_node=2))
    assert "sample=2,channel=2 (node axes: sample)" in table and "across nodes" in table
    assert "forward: allgather, backward-data: reduce_scatter" in table
    for kwargs, message in ((dict(ranks_per_node=3), "ranks per node 3: expected a positive divisor of the grid's 4"),
                            (dict(ranks_per_node=2, node_axes="sample,channel"),
                             "node axes sample=2,channel=2: a group of 4 ranks does not fit inside"),
                            (dict(node_axes="height"), "node axis 'height': grid sample=2,channel=2 does not split")):
        with pytest.raises(ValueError, match=message):
            explain_layer((4, 8, 8, 8), 8, 3, "y", "sample=2,channel=2", padding=1, **kwargs)


@pytest.mark.mpi(min_size=1)
def test_trace_of_a_placed_grid_runs_as_explained():
    """Every grid of this many ranks placed with each split axis kept inside a node: the run's
    collectives, bytes and blocks are the explanation's, by grid rank, and each grid rank is
    held by the process the explanation names (Trace.processes; at 4 ranks, sample=2,channel=2
    with node axes sample puts grid ranks 1 and 2 on processes 2 and 1)."""
    world = MPI.COMM_WORLD
    moved = []
    for g in grids(world.Get_size()):
        for axis in [a for a in IMAGE_AXES if g[a] > 1]:
            for algorithm, p_f in (("y", None), ("w", 1)):
                trace = trace_layer(world, LAYER["x_shape"], 8, 3, algorithm, g, p_f, padding=1, seed=1,
                                    node_axes=axis)
                if world.Get_rank() == 0:
                    assert trace.mismatches == [], (g, axis, algorithm, trace.mismatches)
                    assert trace.processes == list(trace.explanation.processes)
                    if trace.processes != list(range(world.Get_size())):
                        moved.append((ProcessGrid.describe_shape(g), axis, tuple(trace.processes)))
    if world.Get_rank() == 0 and world.Get_size() == 4:
        assert ("sample=2,channel=2", "sample", (0, 2, 1, 3)) in moved, moved


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "w.png"
    plot_layer(explain_layer((4, 8, 8, 8), 8, 3, "w", "sample=1,channel=4", filter_groups=2, padding=1), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20000


def _script(*args, ranks=None, timeout=60):
    cmd = [sys.executable, EXPLAIN, *args]
    if ranks:
        cmd = mpiexec(ranks, sys.executable, "-m", "mpi4py", EXPLAIN, *args)
    return subprocess.run(cmd, env=single_thread_env(MPIEXEC_TIMEOUT=timeout), capture_output=True, text=True,
                          timeout=timeout + 30, cwd=ROOT)


def test_the_script_explains_a_volume_on_a_depth_split_and_a_transposed_layer():
    proc = _script("--planes", "6", "--image", "4", "--grid", "depth=2", "--algorithm", "sample")
    assert proc.returncode == 0, proc.stderr
    assert "x (4, 8, 6, 4, 4)" in proc.stdout and "x with its halo: x[0:4, 0:8, 2:6, 0:4, 0:4]" in proc.stdout
    proc = _script("--transposed", "--stride", "2", "--output-padding", "1", "--image", "5", "--grid", "height=2")
    assert proc.returncode == 0, proc.stderr
    assert "-> y (4, 8, 10, 10)" in proc.stdout and "x with its halo: x[0:4, 0:8, 2:5, 0:5]" in proc.stdout


def test_the_pipelined_schedule_follows_the_algorithms_messages():
    """--chunks k: each pass's allgathers before a chunk computes, its reduce-scatters after,
    as the layer's steps say; a layer without collectives of its own computes whole; a rank
    holding fewer samples than chunks chunks the features, and too few of those is flagged."""
    w = explain_layer((4, 8, 8, 8), 8, 3, "w", "sample=1,channel=4", filter_groups=2, padding=1, chunks=3).text()
    assert "Pipelined over 3 chunks of each rank's samples (--chunks 3): rank 0's 4 in chunks of 2, 1, 1" in w
    assert ("forward: start the allgather of x (row) of chunk 1; then for i = 1..3: wait for chunk i's allgather of "
            "x (row), start chunk i+1's; test the collectives in flight; compute chunk i; start its reduce_scatter "
            "of y (column); then wait for the 3 reduce-scatters") in w
    assert "backward: start the allgather of y (column) of chunk 1" in w
    y = explain_layer((4, 8, 8, 8), 8, 3, "y", "sample=2,channel=2", padding=1, chunks=2).text()
    assert "backward: for i = 1..2: test the collectives in flight; compute chunk i; start its reduce_scatter of x" in y
    # one sample a rank: chunks of the features each pass's collective moves
    y = explain_layer((2, 8, 8, 8), 8, 3, "y", "sample=2,channel=2", padding=1, chunks=2).text()
    assert "Pipelined over 2 chunks of the features (--chunks 2): rank 0 holds 1 sample(s), fewer than 2" in y
    assert ("forward: start the allgather of x (row) of chunk 1's channels; then for j = 1..2: wait for chunk j's, "
            "start chunk j+1's; compute from chunk j's channels a part of y, added up") in y
    assert ("backward: dw whole and its sum; then for j = 1..2: test the collectives in flight; compute the partial "
            "result of chunk j's channels; start its reduce_scatter of x (row)") in y
    assert "refused here" not in y
    w = explain_layer((1, 8, 8, 8), 8, 3, "w", "channel=4", filter_groups=2, padding=1, chunks=2).text()
    assert ("forward: the allgather of x (row) whole; then for j = 1..2: test the collectives in flight; compute the "
            "partial result of chunk j's filters; start its reduce_scatter of y (column)") in w
    x = explain_layer((1, 8, 8, 8), 8, 3, "x", "channel=4", padding=1, chunks=2).text()
    assert "compute from chunk j's filters their rows of dw and a part of dx, added up" in x
    refused = explain_layer((1, 4, 8, 8), 8, 3, "y", "channel=4", padding=1, chunks=2).text()
    assert "refused here: the smallest block of those features holds 1, fewer than 2 chunks" in refused
    sample = explain_layer((4, 8, 8, 8), 8, 3, "sample", "sample=2", padding=1, chunks=2).text()
    assert "forward: no collective of its own to pipeline" in sample
    assert "Pipelined" not in explain_layer((4, 8, 8, 8), 8, 3, "w", "channel=4", padding=1).text()


@pytest.mark.parametrize("args,message", [
    (["--grid", "channel=4", "--algorithm", "w", "--filter-groups", "3"], "p_f=3 does not divide"),
    (["--algorithm", "z"], "unknown algorithm 'z'"),
    (["--batch", "0"], "--batch"),
    (["--plan", "p.json"], "--plan applies to --model only"),
    (["--model", "resnet", "--trace"], "--trace runs one layer"),
    (["--grid", "height=8", "--image", "4"], "layer: an input of 4x4 gives 4 output rows, too few for the 8 ranks"),
    (["--model", "unet", "--grid", "width=5"], "down.conv: an input of 8x8 gives 4 output columns, too few for the 5"),
    (["--plot", "layer.gif"], "--plot 'layer.gif': the file name's extension chooses the picture's format"),
    (["--grid", "channel=4", "--ranks-per-node", "3"], "ranks per node 3: expected a positive divisor of the grid's 4"),
    (["--grid", "channel=4", "--ranks-per-node", "0"], "--ranks-per-node must be a positive integer, got 0"),
    (["--grid", "channel=4", "--node-axes", "sample"], "node axis 'sample': grid channel=4 does not split it"),
    (["--grid", "channel=2", "--trace", "--ranks-per-node", "2"], "--trace runs on the nodes of its job"),
    (["--model", "resnet", "--plan", "p.json", "--node-axes", "sample"], "give --plan or --node-axes, not both"),
    (["--chunks", "0"], "--chunks must be a positive integer, got 0"),
    (["--chunks", "2", "--model", "resnet"], "--chunks 2 shows one layer's pipelined schedule"),
    (["--device", "gpu"], "--device gpu applies to --trace only"),
    (["--output-padding", "1"], "--output-padding 1 applies to --transposed only"),
    (["--planes", "4", "--trace"], "--planes and --transposed explain one layer's text"),
    (["--planes", "0"], "--planes must be a positive integer, got 0"),
])
def test_bad_input_is_one_message(args, message):
    proc = _script(*args)
    assert proc.returncode != 0
    assert message in proc.stderr and proc.stderr.count("error:") == 1, proc.stderr


def test_trace_on_the_wrong_number_of_ranks_is_one_message():
    proc = _script("--grid", "channel=4", "--trace", ranks=2)
    assert proc.returncode != 0
    assert "grid channel=4 needs 4 ranks, the communicator has 2" in proc.stderr
    assert proc.stderr.count("error:") == 1, proc.stderr
