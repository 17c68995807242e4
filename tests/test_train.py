"""Training end to end: the same losses and weights on every grid as on one rank (float64),
checkpoints that resume on another grid, refusal of damaged checkpoints, and bad options."""
import glob
import os
import shutil

import numpy as np
import pytest
from mpi4py import MPI

from cfp import backend
from cfp.checkpoint import latest_checkpoint, load_checkpoint, resume_point
from cfp.train import TrainConfig, train, train_model
from conftest import (SIZE, WORLD, assert_all_ranks, assert_close_all_ranks, at_most_four, grid_specs,
                      raises_on_all_ranks, split_grid)

pytestmark = pytest.mark.mpi

STEPS, BATCH = 20, 32


def config(**overrides):
    base = dict(model="resnet", width=1, epochs=1, batch_size=BATCH, lr=0.05, dtype="float64",
                train_samples=STEPS * BATCH, max_steps=STEPS, progress=False, seed=3)
    base.update(overrides)
    return TrainConfig(**base)


def weights(model):
    """{parameter name: global array} of a trained model (from train_model), whose
    communicators it then frees."""
    out = {}
    for p in model.parameters():
        out[p.name] = backend.to_host(p.tensor().gather())
    model.free()
    return out


_serial = {}


def serial_run(algorithm):
    """The same training on one rank (every rank runs it alone on COMM_SELF), cached."""
    if algorithm not in _serial:
        result, model = train_model(config(algorithm=algorithm, grid="sample=1"), world=MPI.COMM_SELF)
        _serial[algorithm] = ([h["loss"] for h in result["history"]], weights(model))
    return _serial[algorithm]


def assert_trains_like(result, model, one_rank, what, tol=1e-9, weights_tol=None):
    """A run's losses (train_model's result) and final weights (of its model, then freed) equal
    one rank's (serial_run's, or another run's losses and weights), to `tol` (the weights to
    weights_tol where given), on every rank."""
    losses0, weights0 = one_rank
    losses = np.array([h["loss"] for h in result["history"]])
    assert_close_all_ranks(losses, np.array(losses0), tol, f"{what}: losses")
    final = weights(model)
    assert_all_ranks(final.keys() == weights0.keys(), f"{what}: other parameters")
    for key in final:
        assert_close_all_ranks(final[key], weights0[key], weights_tol or tol, f"{what}: {key}")


CASES = [(spec, alg) for spec in grid_specs() for alg in ("sample", "x", "y", "w")]


@pytest.mark.parametrize("spec,algorithm", CASES)
def test_training_matches_one_rank(spec, algorithm):
    losses0, weights0 = serial_run(algorithm)
    result, model = train_model(config(algorithm=algorithm, grid=spec))
    losses = [h["loss"] for h in result["history"]]
    assert len(losses) == STEPS
    assert_close_all_ranks(np.array(losses), np.array(losses0), 1e-9, f"{spec} {algorithm} losses")
    final = weights(model)
    assert final.keys() == weights0.keys()
    for name in final:
        assert_close_all_ranks(final[name], weights0[name], 1e-9, f"{spec} {algorithm} {name}")


_serial_mobile = {}


@pytest.mark.parametrize("spec,algorithm", CASES)
def test_mobile_model_matches_one_rank(spec, algorithm):
    """The depthwise, dilated and grouped stack (cfp.models.mobile_cnn) trains as on one rank:
    whole groups per channel rank, with redistributions where a layer's groups do not fall on
    the previous layer's channel blocks."""
    steps = 8
    if "serial" not in _serial_mobile:
        result, model = train_model(config(model="mobile", max_steps=steps, grid="sample=1"), world=MPI.COMM_SELF)
        _serial_mobile["serial"] = ([h["loss"] for h in result["history"]], weights(model))
    losses0, weights0 = _serial_mobile["serial"]
    result, model = train_model(config(model="mobile", max_steps=steps, grid=spec, algorithm=algorithm))
    assert_close_all_ranks(np.array([h["loss"] for h in result["history"]]), np.array(losses0), 1e-9,
                           f"mobile {spec} {algorithm} losses")
    final = weights(model)
    for name in final:
        assert_close_all_ranks(final[name], weights0[name], 1e-9, f"mobile {spec} {algorithm} {name}")


def test_auto_plan_trains_like_one_rank():
    """--algorithm auto picks the algorithm per layer on one grid (with two or more channel
    ranks the cpu-dev plan mixes them: y for the first convolution, x after it); the losses
    still equal one rank's."""
    losses0, _ = serial_run("y")
    spec = grid_specs()[len(grid_specs()) // 2]
    result, model = train_model(config(algorithm="auto", grid=spec, profile="cpu-dev"))
    chosen = {e["algorithm"] for e in model.layers.values()}
    mixed = len(chosen) > 1 or model.grid.axis_size("channel") == 1
    channels = model.grid.axis_size("channel")
    weights(model)
    assert_all_ranks(mixed, f"{spec}: the plan uses {sorted(chosen)} only on {channels} channel ranks")
    assert_close_all_ranks(np.array([h["loss"] for h in result["history"]]), np.array(losses0), 1e-9,
                           f"{spec} auto losses")


def test_float32_training_stays_float32():
    _, model = train_model(config(dtype="float32", grid=grid_specs()[-1], max_steps=2))
    assert all(p.data.dtype == np.float32 and p.grad.dtype == np.float32 for p in model.parameters())
    weights(model)


def test_checkpoint_resumes_on_other_grids(mpi_tmp_path):
    """A run interrupted 3 steps into its second epoch on the world's squarest grid resumes on
    one rank and (at 4 ranks) on a 1 x 2 grid: the losses after the interruption equal those
    of an uninterrupted run."""
    spec = grid_specs()[len(grid_specs()) // 2]  # sample=2,channel=2 at 4 ranks
    per_epoch, stop = 10, 13
    common = dict(train_samples=per_epoch * BATCH, algorithm="w", epochs=2)
    full = [h["loss"] for h in train(config(grid=spec, max_steps=None, **common))["history"]]
    directory = str(mpi_tmp_path / "ckpt")
    first = train(config(grid=spec, checkpoint_dir=directory, max_steps=stop, **common))
    assert_close_all_ranks(np.array([h["loss"] for h in first["history"]]), np.array(full[:stop]), 1e-12,
                           "before the interruption")
    expected = np.array(full[stop:])

    def resumed_losses(grid, world, directory):
        result = train(config(grid=grid, checkpoint_dir=directory, resume=True, max_steps=None, **common),
                       world=world)
        history = result["history"]
        assert [h["step"] for h in history] == list(range(1, 2 * per_epoch + 1))
        assert (result["steps"], result["steps_this_session"]) == (2 * per_epoch, 2 * per_epoch - stop)
        return np.array([h["loss"] for h in history[stop:]])

    if WORLD.Get_rank() == 0:  # each resumed run saves anew: give each its own copy
        for r in range(SIZE):
            shutil.copytree(directory, f"{directory}-serial-{r}")
            shutil.copytree(directory, f"{directory}-pair-{r // 2}", dirs_exist_ok=True)
    WORLD.Barrier()
    losses = resumed_losses("sample=1", MPI.COMM_SELF, f"{directory}-serial-{WORLD.Get_rank()}")
    assert_close_all_ranks(losses, expected, 1e-9, "resumed on one rank")
    if SIZE == 4:
        pair = WORLD.Split(WORLD.Get_rank() // 2, WORLD.Get_rank())
        losses = resumed_losses("channel=2", pair, f"{directory}-pair-{WORLD.Get_rank() // 2}")
        assert_close_all_ranks(losses, expected, 1e-9, "resumed on 1 x 2")
        pair.Free()


def test_damaged_checkpoint_is_refused_and_the_previous_one_still_loads(mpi_tmp_path):
    directory = str(mpi_tmp_path / "ckpt")
    spec = grid_specs()[-1]
    cfg = config(epochs=2, grid=spec, checkpoint_dir=directory, train_samples=4 * BATCH, max_steps=None)
    train(cfg)
    latest = latest_checkpoint(directory)
    steps = sorted(glob.glob(os.path.join(directory, "step-*")))
    assert len(steps) == 2 and steps[-1] == latest
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        shard = sorted(glob.glob(os.path.join(latest, "rank-*.npz")))[0]
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
    WORLD.Barrier()
    # --resume refuses it and goes back to the previous one (tests/test_checkpoint_safety.py).
    path, skipped = resume_point(directory)
    assert path == steps[0] and [bad for bad, _ in skipped] == [latest], (path, skipped)
    assert "is corrupt: its SHA-256 does not match" in skipped[0][1]
    # The previous checkpoint is intact and loads into the same model.
    _, model = train_model(config(epochs=1, grid=spec, train_samples=4 * BATCH, max_steps=1))
    from cfp.optim import SGD
    meta = load_checkpoint(steps[0], model, SGD(model.parameters(), 0.1, momentum=0.9))
    assert meta["step"] == 4
    weights(model)


def test_eval_only_gives_the_checkpoints_test_numbers_on_any_grid(mpi_tmp_path):
    """--eval-only --resume: the test loss and accuracy the training run measured at its last
    epoch, on another grid and on one rank, without a training step."""
    directory = str(mpi_tmp_path / "ckpt")
    spec = grid_specs()[len(grid_specs()) // 2]
    trained = train(config(epochs=1, grid=spec, algorithm="w", checkpoint_dir=directory, train_samples=4 * BATCH,
                           max_steps=None))
    for grid, world in ((grid_specs()[0], None), ("sample=1", MPI.COMM_SELF)):
        result = train(config(epochs=1, grid=grid, algorithm="y", checkpoint_dir=directory, resume=True,
                              eval_only=True, train_samples=4 * BATCH, max_steps=None), world=world)
        assert result["steps"] == trained["steps"] == 4
        assert_close_all_ranks(np.array([result["test_loss"]]), np.array([_last_test(directory)["test_loss"]]),
                               1e-9, f"eval-only on {grid}", comm=world or WORLD)
        assert result["test_accuracy"] == trained["test_accuracy"]
    raises_on_all_ranks(ValueError, lambda: train(config(eval_only=True)), match="--eval-only evaluates a checkpoint")


def _last_test(directory):
    """The last epoch's test numbers that the checkpoint's meta.json keeps."""
    import json
    path = latest_checkpoint(directory)
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)["epochs"][-1]


def test_checkpoint_of_another_model_is_refused(mpi_tmp_path):
    directory = str(mpi_tmp_path / "ckpt")
    spec = grid_specs()[0]
    train(config(epochs=1, grid=spec, checkpoint_dir=directory, train_samples=2 * BATCH, max_steps=None))
    raises_on_all_ranks(ValueError, lambda: train(config(width=2, grid=spec, checkpoint_dir=directory, resume=True)),
                        match=r"checkpoint '.*' was trained with other options: --width 1 in the checkpoint, 2 in "
                              r"this run; resume with the options it was trained with, or train afresh in another "
                              r"--checkpoint-dir")
    raises_on_all_ranks(ValueError, lambda: train(config(optimizer="adam", width=2, grid=spec, checkpoint_dir=directory,
                                                         resume=True)),
                        match=r"--width 1 in the checkpoint, 2 in this run; --optimizer sgd in the checkpoint, adam "
                              r"in this run; resume")


@pytest.mark.parametrize("overrides,match", [
    (dict(model="vgg"), "unknown model 'vgg'; expected one of resnet, wide"),
    (dict(algorithm="z"), "unknown algorithm 'z'"),
    (dict(optimizer="lbfgs"), "unknown optimizer 'lbfgs'; expected one of sgd, adam, adamw"),
    (dict(width=0), "width must be a positive integer, got 0"),
])
def test_bad_options(overrides, match):
    raises_on_all_ranks(ValueError, lambda: train(config(grid=grid_specs()[0], **overrides)), match=match)


def test_batch_smaller_than_sample_axis():
    spec = f"sample={SIZE}"
    if SIZE == 1:
        pytest.skip("one rank always has a sample")
    raises_on_all_ranks(ValueError, lambda: train(config(grid=spec, batch_size=SIZE - 1)),
                        match=f"batch size {SIZE - 1} is smaller than the sample axis of the grid")


@pytest.mark.parametrize("algorithm", ["x", "y", "w"])
def test_a_classifier_with_fewer_classes_than_channel_ranks_matches_one_rank(mpi_tmp_path, algorithm):
    """Two classes over 3 or 4 channel ranks (10 digits over 12 or 16 at make test-scale): the
    ranks without a class hold empty blocks of the classifier, and the losses are one rank's."""
    if SIZE < 3:
        pytest.skip("needs more channel ranks than the 2 classes")
    path = str(mpi_tmp_path / "two-classes.npz")
    if WORLD.Get_rank() == 0:
        rng = np.random.default_rng(5)
        np.savez(path, x=rng.standard_normal((80, 1, 8, 8)).astype(np.float32), y=np.arange(80) % 2)
    WORLD.Barrier()
    common = dict(dataset=f"npz:{path}", train_samples=None)
    serial = train(config(grid="sample=1", **common), world=MPI.COMM_SELF)
    result = train(config(grid=f"channel={SIZE}", algorithm=algorithm, **common))
    assert_close_all_ranks(np.array([h["loss"] for h in result["history"]]),
                           np.array([h["loss"] for h in serial["history"]]), 1e-9,
                           f"2 classes on channel={SIZE} {algorithm}")


def test_width_that_cannot_be_split():
    if SIZE < 2:
        pytest.skip("one channel rank splits any width")
    raises_on_all_ranks(ValueError,
                        lambda: train(config(model="wide", width=SIZE - 1, grid=f"channel={SIZE}", algorithm="y")),
                        match=f"width={SIZE - 1} gives {SIZE - 1} channels in the narrowest layer, fewer than "
                              f"the {SIZE} channel ranks")


def test_flags_and_ctrl_c_are_agreed_by_every_rank():
    """cli's flags, as the training loop reads them: the largest value over the ranks, a flag
    true only where every rank's is, and Ctrl-C seen by the last rank alone stopping every rank
    at the same check."""
    from cfp import cli
    rank = WORLD.Get_rank()
    assert_all_ranks(cli.max_over_ranks(WORLD, rank) == SIZE - 1, "max_over_ranks is not the last rank")
    assert_all_ranks(cli.on_every_rank(WORLD, True) and not cli.on_every_rank(WORLD, rank != SIZE - 1),
                     "on_every_rank is not the AND of the ranks' flags")
    ctrl_c = cli.CtrlC()
    ctrl_c.check(WORLD)  # nobody asked: every rank goes on
    ctrl_c.requested = rank == SIZE - 1
    raises_on_all_ranks(KeyboardInterrupt, lambda: ctrl_c.check(WORLD))


@pytest.mark.parametrize("bucket_mb", [1000])  # (buckets of a layer or two: test_overlap_all_trains_as_overlap_off)
def test_gradients_summed_in_buckets_during_backward_train_like_one_rank(bucket_mb):
    """--bucket-mb: the weight gradients' allreduces started during backward, in buckets of a
    layer or two (1e-4 MiB) or of the whole model (1000 MiB), waited for before the update:
    the same losses and weights as one rank, on the channel and the sample axis."""
    for grid, algorithm in ((f"sample={SIZE}", "sample"), (f"channel={SIZE}", "w")):
        result, model = train_model(config(grid=grid, algorithm=algorithm, bucket_mb=bucket_mb))
        assert_trains_like(result, model, serial_run(algorithm), f"bucket {bucket_mb} MiB on {grid}")


def test_chunks_more_than_a_rank_holds_refused():
    """--chunks above the samples a rank of a pipelined layer holds: one message on every rank."""
    raises_on_all_ranks(ValueError, lambda: train_model(config(grid=f"channel={SIZE}", algorithm="y",
                                                               chunks=BATCH + 1)),
                        f"--chunks {BATCH + 1} is more than the {BATCH} sample")


def _phase_bytes(result):
    """{phase: bytes sent} of a run's summary (every layer and collective added up)."""
    out = {}
    for row in result["communication"]:
        out[row["phase"]] = out.get(row["phase"], 0) + row["bytes_sent"]
    return out


def _overlap_cases():
    """(grid, algorithm, overrides): sample, x, y and w (p_f = 2 where the channel axis has 2
    ranks), a spatial grid and the planner's mixed plan."""
    cases = [(f"sample={SIZE}", "sample", {}), (f"channel={SIZE}", "x", {}), (f"channel={SIZE}", "y", {})]
    cases.append(("sample=2,channel=2", "w", {"filter_groups": 2}) if SIZE == 4 else (f"channel={SIZE}", "w", {}))
    if at_most_four() > 1:  # (none at 5 or 7 ranks, which split height no other way than 5 or 7 rows)
        cases.append((split_grid("height"), "y", {"upsample": 2}))  # the ResNet's 4x4 layers: at most 4 rows
    cases.append((None, "auto", {"profile": "cpu-dev"}))
    return cases


def test_overlap_all_trains_as_overlap_off(monkeypatch):
    """--overlap all (chunks 2 and 3 in turns, buckets of a layer or two) against --overlap
    off: 20 float64 steps with the same losses and weights (1e-12) and the same bytes in every
    phase but the gradient sum, whose buckets concatenate the layers' arrays (the same bytes to
    the rounding of each message's balanced split). The chunks' non-blocking collectives are
    counted, so a run that silently stayed blocking fails; so are the halos started with the
    interior computed while they move (the first layer on the split image). Every other case
    runs with the progress thread (--mpi-progress thread), which must change nothing either."""
    from cfp import comm
    from cfp.halo import Halo
    started, halos = [], []
    for name in ("iallgather", "ireduce_scatter"):
        real = getattr(comm, name)
        monkeypatch.setattr(comm, name, lambda *a, real=real, **k: started.append(1) or real(*a, **k))
    monkeypatch.setattr(Halo, "start", lambda *a, real=Halo.start, **k: halos.append(1) or real(*a, **k))
    for case, (grid, algorithm, extra) in enumerate(_overlap_cases()):
        chunks = 2 + case % 2
        off, model = train_model(config(grid=grid, algorithm=algorithm, overlap="off", **extra))
        expected = ([h["loss"] for h in off["history"]], weights(model))
        started.clear()
        halos.clear()
        progress = ("thread", "calls")[case % 2]  # the progress thread testing what is in flight, in turns
        result, model = train_model(config(grid=grid, algorithm=algorithm, overlap="all", chunks=chunks,
                                           bucket_mb=1e-4, mpi_progress=progress, **extra))
        what = f"--overlap all, chunks {chunks}, --mpi-progress {progress}, on {grid} {algorithm}"
        if algorithm in ("x", "y", "w") and SIZE > 1:
            assert_all_ranks(len(started) >= STEPS * chunks, f"{what}: {len(started)} chunk calls")
        if "height" in (grid or ""):
            assert_all_ranks(len(halos) >= STEPS, f"{what}: {len(halos)} halos started with the interior")
        assert_trains_like(result, model, expected, what, tol=1e-12)
        before, after = _phase_bytes(off), _phase_bytes(result)
        for phase in set(before) | set(after):
            if phase != "gradient-sync":
                assert_all_ranks(before.get(phase) == after.get(phase),
                                 f"{what}: {phase} moved {after.get(phase)} bytes, {before.get(phase)} blocking")
        hidden = result["overlap"]
        assert_all_ranks(all(0.0 <= t["hidden"] <= 1.0 for t in hidden.values()), f"{what}: hidden {hidden}")


def _feature_chunk_cases():
    """(grid, algorithm, overrides, chunks) with one sample a rank: x, y, w (p_f = 2 where the
    channel axis has 4 ranks) and, at 4 ranks, a split image under x, whose first layer
    computes its interior while the halo moves; 3 chunks where the classifier's 10 filters
    give every channel rank 3 (up to 3 ranks), else 2."""
    # at most 4 channel ranks: more give some of the classifier's 10 filters one each, too few to chunk
    P_c, grid = at_most_four(), split_grid("channel")
    cases = [(grid, "x", {}, 3 if P_c < 4 else 2), (grid, "y", {}, 2),
             (grid, "w", {"filter_groups": 2} if P_c == 4 else {}, 2)]
    if SIZE == 4:
        cases.append(("height=2,channel=2", "x", {}, 3))
    return cases


def test_one_sample_a_rank_trains_in_feature_chunks_as_overlap_off():
    """A batch of one sample a rank: --overlap all runs the x, y and w layers' passes in chunks
    of their features (ConvAlgorithm.pipelined) and 20 float64 steps equal --overlap off
    (losses 1e-12, weights 1e-10), with the same bytes in every phase but the gradient sum; the chunks' collectives
    are counted, so a run that silently stayed blocking fails."""
    from cfp import comm
    started = []
    real = comm.ireduce_scatter
    try:
        comm.ireduce_scatter = lambda *a, **k: started.append(1) or real(*a, **k)
        for grid, algorithm, extra, chunks in _feature_chunk_cases():
            batch = SIZE // at_most_four()  # one sample a rank of the sample axis
            common = dict(grid=grid, algorithm=algorithm, batch_size=batch, train_samples=STEPS * batch, **extra)
            off, model = train_model(config(overlap="off", **common))
            expected = ([h["loss"] for h in off["history"]], weights(model))
            started.clear()
            result, model = train_model(config(overlap="all", chunks=chunks, bucket_mb=1e-4, **common))
            what = f"--overlap all, {chunks} feature chunks, on {grid} {algorithm}, batch 1"
            if SIZE > 1:
                assert_all_ranks(len(started) >= STEPS * chunks, f"{what}: {len(started)} chunks' reduce-scatters")
            # (a chunk of the channels or filters splits a sum over them in parts, as a channel
            # split does: the weights, after 20 steps, to the 1e-10 of two grids)
            assert_trains_like(result, model, expected, what, tol=1e-12, weights_tol=1e-10)
            before, after = _phase_bytes(off), _phase_bytes(result)
            for phase in set(before) | set(after):
                if phase != "gradient-sync":
                    assert_all_ranks(before.get(phase) == after.get(phase),
                                     f"{what}: {phase} moved {after.get(phase)} bytes, {before.get(phase)} blocking")
    finally:
        comm.ireduce_scatter = real


@pytest.mark.parametrize("case", [0, 1])
def test_overlap_all_in_float32_trains_as_overlap_off_to_rounding(case):
    """float32, 5 steps: --overlap all (2 chunks, small buckets; on a split image the interior
    while the halo moves) gives --overlap off's losses and weights to float32 rounding, and
    moves the same bytes outside the gradient sum. Rounding grows in 5 steps: the blocking runs
    on height=3 and on channel=3 differ by 1.07e-4 in their losses and by 1.4e-2 in their
    weights (a batch norm's bias, whose gradient is a sum that cancels); hence 1e-3 and 5e-2.
    The float64 test above holds the same runs to 1e-12."""
    grid, algorithm, extra = [(f"channel={SIZE}", "x", {}), (split_grid("height"), "y", {"upsample": 2})][case]
    common = dict(grid=grid, algorithm=algorithm, dtype="float32", max_steps=5, train_samples=5 * BATCH, **extra)
    off, model = train_model(config(overlap="off", **common))
    expected = ([h["loss"] for h in off["history"]], weights(model))
    result, model = train_model(config(overlap="all", chunks=2, bucket_mb=1e-4, **common))
    assert_trains_like(result, model, expected, f"float32 --overlap all on {grid} {algorithm}", tol=1e-3,
                       weights_tol=5e-2)
    before, after = _phase_bytes(off), _phase_bytes(result)
    assert_all_ranks(all(before.get(k) == after.get(k) for k in set(before) | set(after) if k != "gradient-sync"),
                     f"float32 bytes {after} against {before}")


def test_overlap_settings_and_their_contradictions():
    """--overlap grads and all fill in --bucket-mb and --chunks where they are left at their
    defaults; off with either, or grads with chunks, is refused with a message."""
    from cfp.train import OVERLAP_BUCKET_MB, OVERLAP_CHUNKS
    assert TrainConfig(overlap="grads").overlap_settings() == (OVERLAP_BUCKET_MB, 1, False)
    assert TrainConfig(overlap="all").overlap_settings() == (OVERLAP_BUCKET_MB, OVERLAP_CHUNKS, True)
    assert TrainConfig(overlap="all", chunks=3, bucket_mb=2).overlap_settings() == (2, 3, True)
    assert TrainConfig(bucket_mb=4).overlap_settings() == (4, 1, False)
    for fine in ({"overlap": "grads"}, {"bucket_mb": 1}, {"chunks": 2}):
        config(mpi_progress="thread", **fine).validate()  # something is in flight for the thread to test
    for overrides, message in (({"overlap": "off", "bucket_mb": 4}, "--overlap off runs every collective blocking"),
                               ({"overlap": "grads", "chunks": 2}, "use --overlap all"),
                               ({"overlap": "sometimes"}, "unknown overlap 'sometimes'; expected one of off, grads, all"),
                               ({"mpi_progress": "thread"}, "--mpi-progress thread progresses the collectives started "
                                                            "during a step; with every collective blocking none is"),
                               ({"mpi_progress": "often"}, "unknown mpi_progress 'often'; expected one of calls, thread")):
        with pytest.raises(ValueError, match=message):
            config(**overrides).validate()
