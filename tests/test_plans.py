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
    ]
    if SIZE == 4:
        cases.append(({"fc": {"grid": CHANNEL, "algorithm": "w", "filter_groups": 3}},
                      "filter groups p_f=3 does not divide the channel grid size P_c=4"))
    for i, (layers, message) in enumerate(cases):
        path = write_plan(mpi_tmp_path, f"bad{i}", layers)
        raises_on_all_ranks(ValueError, lambda: train(config(plan=path)), match=message)
    raises_on_all_ranks(ValueError, lambda: train(config(plan=path, algorithm="auto")),
                        match="--plan and --algorithm auto both choose")


@pytest.mark.parametrize("name", sorted(plans()))
def test_the_planner_prices_the_redistributions_the_model_makes(name):
    """Every activation the built model redistributes between layers (its Redistribute modules,
    the classifier's logits aside) is one the planner prices, and no other: the inputs of
    layers fed across grids, the projection reading its block's input, and a residual sum
    whose branches lie on different grids (LayerShape.reads, merges)."""
    from cfp.models import layer_shapes
    from cfp.perfmodel import MachineProfile
    from cfp.planner import moves, price_plan
    base = ProcessGrid(SAMPLE)
    model = build_model("resnet", base, width=1, dtype=np.float64, in_channels=1, classes=10,
                        image=8, plan=plans()[name], batch=BATCH)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, 1, 8, 8))
    model.forward(x[_rows(model)], BATCH)
    made = sorted(int(np.prod(r.last_shape)) * 8 for r in model.redistributions() if r.name != "loss")
    shapes = layer_shapes("resnet", BATCH, width=1, in_channels=1, classes=10, image=8)
    priced = price_plan(shapes, SIZE, MachineProfile.load("cpu-dev"), model.layers)
    moved = sorted(volume for k, c in enumerate(priced.choices) for _, volume in moves(priced.choices[:k], c, 8))
    assert_all_ranks(made == moved, f"plan {name}: the model redistributes {made} bytes, the planner prices {moved}")
    assert_all_ranks(SIZE == 1 or made, f"plan {name}: no redistribution")
    model.free()
    base.free()
