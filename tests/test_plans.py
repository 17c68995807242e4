"""Per-layer plans: a model whose layers run on different grids and layouts trains like one rank
(float64, 20 steps: the same losses and final weights), its ledger equals the predicted bytes of
every convolution and every redistribution, and its checkpoints resume under another plan."""
import json
import shutil

import numpy as np
import pytest
from mpi4py import MPI

from cfp import comm as C
from cfp.grid import ProcessGrid
from cfp.models import build_model
from cfp.perfmodel import ledger_bytes
from cfp.train import train, train_model, train_step
from conftest import SIZE, WORLD, assert_all_ranks, assert_close_all_ranks, raises_on_all_ranks
from test_train import BATCH, assert_trains_like, config, serial_run

pytestmark = pytest.mark.mpi

DIVISORS = [d for d in range(1, SIZE + 1) if SIZE % d == 0]
SAMPLE, CHANNEL = f"sample={SIZE}", f"channel={SIZE}"
SQUARE = "sample=2,channel=2" if SIZE == 4 else CHANNEL  # a grid with both axes where there is one
# SQUARE placed with its sample pairs as neighbours at 4 ranks; where it has one split axis that
# axis (the default placement, named), on one rank none
PLACED = {"node_axes": "sample" if SIZE == 4 else "channel"} if SIZE > 1 else {}


def plans():
    """The issue's plans on this world size, by name."""
    return {
        # sample -> channel mid-network; y next to w of p_f = P_c, then w of p_f = 1; a residual
        # block whose projection runs data-parallel while its body is channel-parallel; the
        # classifier on another grid than the last convolution.
        "switches": {
            "stem.conv": {"grid": SAMPLE, "algorithm": "sample"},
            "layer1.conv1": {"grid": CHANNEL, "algorithm": "y"},
            "layer1.conv2": {"algorithm": "w", "filter_groups": DIVISORS[-1]},
            "layer2.conv1": {"algorithm": "w", "filter_groups": 1},
            "layer2.conv2": {"grid": SQUARE, "algorithm": "x"},
            "layer2.proj": {"grid": SAMPLE, "algorithm": "sample"},
            "layer3.conv1": {"grid": CHANNEL, "algorithm": "w", "filter_groups": DIVISORS[len(DIVISORS) // 2]},
            "layer3.proj": {"grid": SQUARE, "algorithm": "y"},
            "fc": {"grid": SAMPLE, "algorithm": "sample"},
        },
        # channel -> sample -> channel, the classifier filter-parallel after a data-parallel block.
        "back_and_forth": {
            "stem.conv": {"grid": CHANNEL, "algorithm": "y"},
            "layer1.conv1": {"grid": SAMPLE, "algorithm": "sample"},
            "layer2.conv1": {"grid": SQUARE, "algorithm": "w"},
            "layer2.proj": {"algorithm": "x"},
            "layer3.conv1": {"grid": SAMPLE, "algorithm": "sample"},
            "fc": {"grid": CHANNEL, "algorithm": "w", "filter_groups": DIVISORS[-1]},
        },
        # grids placed on the processes in other orders (node_axes: at 4 ranks the sample pairs,
        # not the channel pairs, are neighbours), next to the default placement of one shape
        "placed": {
            "stem.conv": {"grid": SQUARE, "algorithm": "x", **PLACED},
            "layer1.conv1": {"grid": SQUARE, "algorithm": "y"},
            "layer2.conv1": {"grid": SQUARE, "algorithm": "w", **PLACED},
            "layer2.proj": {"grid": SAMPLE, "algorithm": "sample"},
            "layer3.conv1": {"grid": SQUARE, "algorithm": "x", **PLACED},
            "fc": {"grid": SQUARE, "algorithm": "y"},
        },
    }


def write_plan(tmp, name, layers):
    path = tmp / f"{name}.json"
    if WORLD.Get_rank() == 0:
        path.write_text(json.dumps({"layers": layers}))
    WORLD.Barrier()
    return str(path)


@pytest.mark.parametrize("name", sorted(plans()))
def test_mixed_plan_trains_like_one_rank(mpi_tmp_path, name):
    one_rank = serial_run("y")
    path = write_plan(mpi_tmp_path, name, plans()[name])
    result, model = train_model(config(plan=path))
    grids = {e["grid"] for e in model.layers.values()}
    if SIZE > 1:
        assert len(grids) > 1 and model.redistributions(), f"{name}: the plan does not change grid"
    assert_trains_like(result, model, one_rank, f"plan {name}")


def test_the_planners_own_plan_trains_like_one_rank():
    """--algorithm auto without --grid: the planner picks grid and algorithm per layer."""
    one_rank = serial_run("y")
    result, model = train_model(config(algorithm="auto", grid=None, profile="cpu-dev"))
    planned = model.plan
    assert [c.layer.name for c in planned.choices] == list(model.layers)
    assert all(ProcessGrid.shape_of(e["grid"]) == ProcessGrid.shape_of(c.grid) and e["algorithm"] == c.algorithm
               for e, c in zip(model.layers.values(), planned.choices))
    assert_trains_like(result, model, one_rank, "the planner's plan")


def test_the_planners_chunks_and_buckets_under_overlap_all(mpi_tmp_path):
    """--algorithm auto --overlap all with a profile whose links progress (cpu-dev's with
    progress 1): the planner chooses each layer's chunks, which the model runs, and the run
    trains like one rank."""
    from cfp.io import load_json, save_json
    from cfp.perfmodel import PROFILE_DIR
    path = mpi_tmp_path / "flowing.json"
    if WORLD.Get_rank() == 0:
        save_json(str(path), dict(load_json(f"{PROFILE_DIR}/cpu-dev.json", "profile"), progress={"intra": 1.0}))
    WORLD.Barrier()
    one_rank = serial_run("y")
    result, model = train_model(config(algorithm="auto", grid=None, profile=str(path), overlap="all"))
    chunked = [c.layer.name for c in model.plan.choices if c.chunks > 1]
    split = [c.layer.name for c in model.plan.choices if c.P_c > 1 and c.algorithm != "sample"]
    assert_all_ranks(chunked == [n for n, e in model.layers.items() if e.get("chunks", 1) > 1],
                     f"the plan's chunked layers {chunked}, the model's {model.layers}")
    # (at 4 ranks this profile's plan runs a channel-split layer in chunks; at 2 it keeps one chunk)
    assert_all_ranks(SIZE != 4 or chunked, f"no layer in chunks among the channel-split {split}")
    assert_trains_like(result, model, one_rank, "the planner's chunks under --overlap all")


@pytest.mark.parametrize("name", sorted(plans()))
def test_ledger_equals_the_predicted_bytes(name):
    """One training step under the plan: for every convolution and every redistribution, the
    bytes each rank's ledger shows per phase are the predicted ones, exactly."""
    base = ProcessGrid(SAMPLE)
    model = build_model("resnet", base, width=1, dtype=np.float64, in_channels=1, classes=10,
                        image=8, plan=plans()[name], batch=BATCH)
    from cfp.nn import SoftmaxCrossEntropy
    from cfp.optim import SGD
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((BATCH, 1, 8, 8)), rng.integers(0, 10, BATCH)
    rows = _rows(model)
    ledger = C.CommLedger()
    with C.use_ledger(ledger):
        train_step(model, SoftmaxCrossEntropy(model.grid), SGD(model.parameters(), 0.1), x[rows], y[rows])
    predicted = model.predicted_bytes(itemsize=8)
    measured = {}
    for (layer, phase), t in ledger.totals(by=("layer", "phase")).items():
        measured[(layer, phase)] = (t["bytes_sent"], t["bytes_received"])
    wrong = {k: (measured.get(k, (0, 0)), v) for k, v in predicted.items() if measured.get(k, (0, 0)) != v}
    unpredicted = [k for k in measured if k[1] == "redistribute" and k not in predicted]
    assert_all_ranks(not wrong and not unpredicted,
                     f"plan {name}: (measured, predicted) {wrong}; redistributions not predicted {unpredicted}")
    assert_all_ranks(SIZE == 1 or any(v != (0, 0) for k, v in predicted.items() if k[1] == "redistribute"),
                     f"plan {name}: no redistribution moved anything")
    assert ledger_bytes(ledger)["redistribute"] == tuple(
        sum(v[i] for k, v in predicted.items() if k[1] == "redistribute") for i in (0, 1))
    model.free()
    base.free()


def _rows(model):
    (rows,) = model.input_spec[1].head(1).indices((BATCH,), model.grid, model.grid.coords)
    return slice(rows.start, rows.stop)


def test_checkpoints_resume_under_another_plan(mpi_tmp_path):
    """Saved under one plan after 13 of 20 steps, resumed under the other plan, under one grid
    and on one rank: the losses go on as the uninterrupted run's."""
    per_epoch, stop = 10, 13
    common = dict(train_samples=per_epoch * BATCH, epochs=2, max_steps=None)
    first_plan = write_plan(mpi_tmp_path, "first", plans()["switches"])
    other_plan = write_plan(mpi_tmp_path, "other", plans()["back_and_forth"])
    full = [h["loss"] for h in train(config(plan=first_plan, **common))["history"]]
    directory = mpi_tmp_path / "ckpt"
    train(config(plan=first_plan, checkpoint_dir=str(directory), **{**common, "max_steps": stop}))
    expected = np.array(full[stop:])
    rank = WORLD.Get_rank()
    if rank == 0:
        for what in ("other", "grid"):
            shutil.copytree(directory, mpi_tmp_path / f"ckpt-{what}")
        for r in range(SIZE):
            shutil.copytree(directory, mpi_tmp_path / f"ckpt-serial-{r}")
    WORLD.Barrier()
    for what, kwargs, world in (
            ("other", {"plan": other_plan}, None),
            ("grid", {"grid": SQUARE, "algorithm": "w"}, None),
            (f"serial-{rank}", {"grid": "sample=1"}, MPI.COMM_SELF)):
        result = train(config(checkpoint_dir=str(mpi_tmp_path / f"ckpt-{what}"), resume=True, **common, **kwargs),
                       world=world)
        losses = np.array([h["loss"] for h in result["history"][stop:]])
        assert_close_all_ranks(losses, expected, 1e-9, f"resumed under {what}", comm=world or WORLD)


def test_bad_plans_are_refused_on_every_rank(mpi_tmp_path):
    cases = [
        ({"layer9.conv1": {"algorithm": "y"}}, "the plan names layer\\(s\\) 'layer9.conv1' that this model does not have"),
        ({"fc": {"grid": f"sample={SIZE + 1}"}}, f"plan entry of layer fc: grid 'sample={SIZE + 1}' needs {SIZE + 1} ranks"),
        ({"fc": {"algorithm": "z"}}, "plan entry of layer fc: unknown algorithm 'z'"),
        ({"fc": {"algorithm": "y", "filter_groups": 2}}, "filter_groups applies to algorithm 'w' only"),
        ({"fc": {"grid": SAMPLE, "colour": "red"}}, "plan entry of layer fc: expected an object with keys among"),
        ({"fc": {"algorithm": "sample", "chunks": 2}}, "plan entry of layer fc: chunks pipeline the collectives of "
                                                       "algorithms x, y and w; give one of them"),
        ({"fc": {"algorithm": "x", "chunks": 0}}, "chunks of layer fc must be a positive integer, got 0"),
    ]
    if SIZE == 4:
        cases.append(({"fc": {"grid": CHANNEL, "algorithm": "w", "filter_groups": 3}},
                      "filter groups p_f=3 does not divide the channel grid size P_c=4"))
    for i, (layers, message) in enumerate(cases):
        path = write_plan(mpi_tmp_path, f"bad{i}", layers)
        raises_on_all_ranks(ValueError, lambda: train(config(plan=path)), match=message)
    raises_on_all_ranks(ValueError, lambda: train(config(plan=path, algorithm="auto")),
                        match="--plan and --algorithm auto both choose")


def test_a_plans_chunks_pipeline_its_layers_under_overlap_all(mpi_tmp_path, monkeypatch):
    """A plan giving layers their own chunks (2 and 3, on channel and sample x channel grids):
    under --overlap all those layers pipeline their collectives in that many chunks (the
    non-blocking calls are counted) and 20 float64 steps equal the same plan's without chunks
    under --overlap off, with the same bytes outside the gradient sum; without --overlap all,
    or with --chunks too, the plan is refused with a message naming its chunks."""
    from test_train import _phase_bytes, weights
    started = []
    real = C.iallgather
    monkeypatch.setattr(C, "iallgather", lambda *a, **k: started.append(1) or real(*a, **k))
    layers = {"stem.conv": {"grid": SAMPLE, "algorithm": "sample"},
              "layer1.conv1": {"grid": CHANNEL, "algorithm": "y", "chunks": 2},
              "layer2.conv1": {"grid": SQUARE, "algorithm": "x", "chunks": 3},
              "layer3.conv1": {"grid": CHANNEL, "algorithm": "w"}, "fc": {"grid": SAMPLE, "algorithm": "sample"}}
    blocking = {name: {k: v for k, v in e.items() if k != "chunks"} for name, e in layers.items()}
    off, model = train_model(config(plan=write_plan(mpi_tmp_path, "blocking", blocking), overlap="off"))
    expected = ([h["loss"] for h in off["history"]], weights(model))
    path = write_plan(mpi_tmp_path, "chunked", layers)
    started.clear()
    result, model = train_model(config(plan=path, overlap="all"))
    assert_all_ranks(SIZE == 1 or len(started) >= 20 * 2, f"{len(started)} chunks' allgathers started")
    assert_trains_like(result, model, expected, "a plan's chunks under --overlap all", tol=1e-12)
    before, after = _phase_bytes(off), _phase_bytes(result)
    assert_all_ranks(all(before.get(p) == after.get(p) for p in set(before) | set(after) if p != "gradient-sync"),
                     f"bytes by phase: {after}, blocking {before}")
    raises_on_all_ranks(ValueError, lambda: train(config(plan=path)),
                        match="the plan pipelines layer1.conv1 in 2 chunks, layer2.conv1 in 3 chunks, which --overlap "
                              "all runs")
    raises_on_all_ranks(ValueError, lambda: train(config(plan=path, overlap="all", chunks=2)),
                        match="--chunks 2 and the plan's \"chunks\" both say")


@pytest.mark.parametrize("name", sorted(plans()))
def test_the_planner_prices_the_redistributions_the_model_makes(name):
    """Every activation the built model redistributes between layers (its Redistribute modules,
    the classifier's logits aside) is one the planner prices, and no other: the inputs of
    layers fed across grids, the projection reading its block's input, and a residual sum
    whose branches lie on different grids (LayerShape.reads, merges). The logits move to the
    loss's layout (the model's 'loss' Redistribute) exactly where the planner prices that move
    (planner.loss_move_time)."""
    from cfp.models import layer_shapes
    from cfp.perfmodel import MachineProfile
    from cfp.planner import loss_move_time, moves, price_plan
    base = ProcessGrid(SAMPLE)
    model = build_model("resnet", base, width=1, dtype=np.float64, in_channels=1, classes=10,
                        image=8, plan=plans()[name], batch=BATCH)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, 1, 8, 8))
    model.forward(x[_rows(model)], BATCH)
    made = sorted(int(np.prod(r.last_shape)) * 8 for r in model.redistributions() if r.name != "loss")
    shapes = layer_shapes("resnet", BATCH, width=1, in_channels=1, classes=10, image=8)
    priced_profile = MachineProfile.load("cpu-dev")
    priced = price_plan(shapes, SIZE, priced_profile, model.layers)
    moved = sorted(volume for k, c in enumerate(priced.choices) for _, volume in moves(priced.choices[:k], c, 8))
    assert_all_ranks(made == moved, f"plan {name}: the model redistributes {made} bytes, the planner prices {moved}")
    to_loss = any(r.name == "loss" for r in model.redistributions())
    priced_loss = loss_move_time(priced.choices[0], priced.choices[-1], priced_profile) > 0
    assert_all_ranks(to_loss == priced_loss, f"plan {name}: the model moves its logits to the loss: {to_loss}, "
                                             f"the planner prices it: {priced_loss}")
    assert_all_ranks(SIZE == 1 or made, f"plan {name}: no redistribution")
    model.free()
    base.free()
