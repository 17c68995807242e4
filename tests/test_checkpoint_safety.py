"""Checkpoints against what ends runs badly: names in latest.json or meta.json that leave the
checkpoint directory are refused, the next save removes what an interrupted save left, --resume
goes back past a damaged checkpoint, files follow the umask, a killed rank ends its whole job,
and a save killed half-way costs only the steps since the previous checkpoint (float64: the
resumed run repeats the uninterrupted one's losses).

The MPI tests damage checkpoints on rank 0 and read them on every rank (`on_rank0`); the
serial test launches mpiexec itself.
"""
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

import cfp.checkpoint as checkpoint
from cfp.io import save_json
from cfp.train import TrainConfig, train
from conftest import SIZE, WORLD, assert_all_ranks, assert_close_all_ranks, raises_on_all_ranks
from run_suite import ROOT, mpiexec, single_thread_env

RANK = WORLD.Get_rank()
BATCH, PER_EPOCH, EPOCHS = 32, 2, 2  # checkpoints step-2 and step-4
STEP2, STEP4 = "step-00000002", "step-00000004"
SHARD = "rank-00000.npz"
TRAIN = os.path.join(ROOT, "scripts", "train.py")


def config(directory, **overrides):
    """A float64 run of EPOCHS x PER_EPOCH steps on a grid where every rank writes a shard."""
    base = dict(model="resnet", width=1, epochs=EPOCHS, batch_size=BATCH, lr=0.05, dtype="float64",
                train_samples=PER_EPOCH * BATCH, progress=False, seed=3, algorithm="y",
                grid=f"sample=1,channel={SIZE}", checkpoint_dir=directory)
    base.update(overrides)
    return TrainConfig(**base)


def losses(result):
    return np.array([h["loss"] for h in result["history"]])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """(directory, losses) of one uninterrupted run that saved step-2 and step-4."""
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("pristine")) if RANK == 0 else None)
    directory = os.path.join(folder, "ckpt")
    return directory, losses(train(config(directory)))


@pytest.fixture
def ckpt(pristine, mpi_tmp_path):
    """A fresh copy of the pristine checkpoint directory, for one test to damage."""
    directory = str(mpi_tmp_path / "ckpt")
    on_rank0(lambda: shutil.copytree(pristine[0], directory, symlinks=True))
    return directory


def on_rank0(edit):
    """Run `edit` on rank 0 alone, then let every rank see the result (or its error)."""
    error = None
    if RANK == 0:
        try:
            edit()
        except Exception as e:  # noqa: BLE001 - raised below, on every rank
            error = f"{type(e).__name__}: {e}"
    error = WORLD.bcast(error)
    if error:
        raise AssertionError(f"editing the checkpoint on rank 0 failed: {error}")


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)


def edit_json(path, change):
    with open(path) as f:
        obj = json.load(f)
    change(obj)
    write_json(path, obj)


# 1. Names that leave the directory; meta.json without what loading reads.

@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["dotdot", "parent", "absolute", "separator", "symlink"])
def test_latest_json_naming_a_path_outside_the_directory_is_refused(ckpt, kind):
    """Each name leads to a good checkpoint (a copy of step-4), so only the name is wrong."""
    outside = ckpt + "-elsewhere"
    name = {"dotdot": "..", "parent": os.path.join("..", os.path.basename(outside)), "absolute": outside,
            "separator": os.path.join("sub", STEP4), "symlink": "step-00000009"}[kind]
    pointer = os.path.join(ckpt, "latest.json")

    def edit():
        shutil.copytree(os.path.join(ckpt, STEP4), outside)
        if kind == "separator":
            shutil.copytree(os.path.join(ckpt, STEP4), os.path.join(ckpt, name))
        if kind == "symlink":
            os.symlink(outside, os.path.join(ckpt, name))
        write_json(pointer, {"checkpoint": name})
    on_rank0(edit)
    raises_on_all_ranks(ValueError, lambda: checkpoint.latest_checkpoint(ckpt),
                        match=re.escape(f"{pointer!r} names {name!r}"))
    # --resume says so and takes the newest step-* inside the directory instead.
    path, skipped = checkpoint.resume_point(ckpt)
    refused = [pointer] + ([os.path.join(ckpt, name)] if kind == "symlink" else [])
    assert_all_ranks(path == os.path.join(ckpt, STEP4) and [p for p, _ in skipped] == refused,
                     f"resume_point gave {path}, {skipped}")


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["dotdot", "parent", "absolute", "separator", "symlink"])
def test_shard_names_outside_the_checkpoint_are_refused(ckpt, kind):
    """Each name leads to a byte-for-byte copy of the shard it replaces (its checksum matches)."""
    path = os.path.join(ckpt, STEP4)
    outside = ckpt + "-elsewhere"
    name = {"dotdot": "..", "parent": os.path.join("..", "..", os.path.basename(outside), SHARD),
            "absolute": os.path.join(outside, SHARD), "separator": os.path.join("sub", SHARD),
            "symlink": SHARD}[kind]

    def edit():
        os.makedirs(outside)
        shutil.copy(os.path.join(path, SHARD), os.path.join(outside, SHARD))
        if kind == "separator":
            os.makedirs(os.path.join(path, "sub"))
            shutil.copy(os.path.join(path, SHARD), os.path.join(path, name))
        if kind == "symlink":
            os.unlink(os.path.join(path, SHARD))
            os.symlink(os.path.join(outside, SHARD), os.path.join(path, SHARD))

        def rename(meta):
            meta["files"][name] = meta["files"].pop(SHARD)
        edit_json(os.path.join(path, "meta.json"), rename)
    on_rank0(edit)
    raises_on_all_ranks(ValueError, lambda: checkpoint.read_meta(path),
                        match=re.escape(f"{os.path.join(path, 'meta.json')!r} names {name!r}"))


@pytest.mark.mpi
@pytest.mark.parametrize("field,value", [("files", None), ("files", [SHARD]), ("shapes", None),
                                         ("optimizer", None), ("optimizer", "sgd")])
def test_meta_json_without_what_loading_reads_is_refused(ckpt, field, value):
    """None: the field is left out; otherwise it has the wrong type."""
    path = os.path.join(ckpt, STEP4)
    meta_path = os.path.join(path, "meta.json")

    def change(meta):
        if value is None:
            del meta[field]
        else:
            meta[field] = value
    on_rank0(lambda: edit_json(meta_path, change))
    expected = f"has no '{field}' entry" if value is None else f"'{field}' is a {type(value).__name__}"
    raises_on_all_ranks(ValueError, lambda: checkpoint.read_meta(path),
                        match=re.escape(f"{meta_path!r}") + ".*" + re.escape(expected))
    path, skipped = checkpoint.resume_point(ckpt)
    assert_all_ranks(path == os.path.join(ckpt, STEP2) and expected in skipped[0][1],
                     f"resume_point gave {path}, {skipped}")


# 2. What interrupted saves leave is removed at the next save.

@pytest.mark.mpi
def test_the_next_save_removes_what_interrupted_saves_left(ckpt):
    def litter():
        for folder, name in [(ckpt, ".tmp-0123456789ab-latest.json"),
                             (os.path.join(ckpt, STEP4), ".tmp-0123456789ab-meta.json"),
                             (os.path.join(ckpt, "step-00000003"), SHARD),  # no meta.json
                             (os.path.join(ckpt, "step-00000005"), "meta.json"),  # garbled
                             (os.path.join(ckpt, "step-00000007"), ".tmp-0123456789ab-rank-00000.npz"),
                             # the one the save writes, holding a shard of a rank this run lacks
                             (os.path.join(ckpt, "step-00000006"), "rank-00099.npz"),
                             (ckpt, "notes.txt"), (os.path.join(ckpt, "step-notes"), "keep.txt")]:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, name), "wb") as f:
                f.write(b'{"format": "cfp-chec')
    on_rank0(litter)
    train(config(ckpt, resume=True, epochs=EPOCHS + 1))  # resumes from step-4, saves step-6
    left = sorted(os.listdir(ckpt))
    temporaries = [os.path.join(d, f) for d, _, files in os.walk(ckpt) for f in files if f.startswith(".tmp-")]
    assert_all_ranks(left == ["latest.json", "notes.txt", STEP4, "step-00000006", "step-notes"]
                     and not temporaries, f"left {left}, temporaries {temporaries}")
    meta = checkpoint.read_meta(os.path.join(ckpt, "step-00000006"))
    assert_all_ranks(sorted(meta["files"]) == [f"rank-{r:05d}.npz" for r in range(SIZE)], meta["files"])


# 3. --resume past corrupt checkpoints.

CORRUPTIONS = {  # name: (damage done to a step directory, what resume_point says)
    "no meta.json": (lambda p: os.unlink(os.path.join(p, "meta.json")), "has no meta.json"),
    "garbled meta.json": (lambda p: open(os.path.join(p, "meta.json"), "w").close(), "is not valid JSON"),
    "checksum mismatch": (lambda p: os.truncate(os.path.join(p, SHARD), 100), "SHA-256 does not match"),
    "missing shard": (lambda p: os.unlink(os.path.join(p, SHARD)), f"{SHARD}' is missing"),
}


@pytest.mark.mpi
@pytest.mark.parametrize("damage", sorted(CORRUPTIONS))
def test_resume_goes_back_past_a_corrupt_checkpoint(ckpt, pristine, damage, capsys):
    spoil, reason = CORRUPTIONS[damage]
    step2, step4 = os.path.join(ckpt, STEP2), os.path.join(ckpt, STEP4)
    on_rank0(lambda: spoil(step4))
    path, skipped = checkpoint.resume_point(ckpt)
    assert_all_ranks(path == step2 and [p for p, _ in skipped] == [step4] and reason in skipped[0][1],
                     f"resume_point gave {path}, {skipped}")
    result = train(config(ckpt, resume=True))
    assert_close_all_ranks(losses(result), pristine[1], 1e-12, "losses after going back to step-2")
    out = capsys.readouterr().out
    said = re.search(rf"checkpoint {re.escape(step4)} is corrupt \(.*{re.escape(reason)}.*\); "
                     rf"resuming from {re.escape(step2)} instead", out)
    assert_all_ranks(RANK != 0 or said, f"rank 0 printed {out!r}")


@pytest.mark.mpi
def test_resume_without_a_valid_checkpoint_says_why_each_was_refused(ckpt, mpi_tmp_path):
    def spoil():
        os.unlink(os.path.join(ckpt, STEP4, "meta.json"))
        os.truncate(os.path.join(ckpt, STEP2, SHARD), 100)
    on_rank0(spoil)
    raises_on_all_ranks(ValueError, lambda: train(config(ckpt, resume=True)),
                        match=rf"no valid checkpoint in .*{STEP4} refused: .*has no meta\.json.*; "
                              rf".*{STEP2} refused: .*SHA-256 does not match")
    empty = str(mpi_tmp_path / "empty")
    raises_on_all_ranks(ValueError, lambda: checkpoint.resume_point(empty),
                        match=r"no checkpoint in .*empty' \(no latest\.json, no step-\* directory\)")


@pytest.mark.mpi
def test_resume_after_a_save_killed_before_latest_json_takes_its_step(ckpt):
    """A kill between meta.json and latest.json leaves a complete step-* nobody points to."""
    on_rank0(lambda: os.unlink(os.path.join(ckpt, "latest.json")))
    path, skipped = checkpoint.resume_point(ckpt)
    assert_all_ranks((path, skipped) == (os.path.join(ckpt, STEP4), []), f"resume_point gave {path}, {skipped}")


# 4. Modes follow the umask.

@pytest.mark.mpi
@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600)], ids=["umask-022", "umask-077"])
def test_files_follow_the_umask(mpi_tmp_path, umask, mode):
    directory = str(mpi_tmp_path / "ckpt")
    plain = str(mpi_tmp_path / f"plain-{RANK}.json")
    previous = os.umask(umask)
    try:
        train(config(directory, epochs=1))
        save_json(plain, {"rank": RANK})
    finally:
        os.umask(previous)
    step = os.path.join(directory, STEP2)
    files = [os.path.join(directory, "latest.json"), os.path.join(step, "meta.json"),
             os.path.join(step, SHARD), plain]
    modes = {f: oct(stat.S_IMODE(os.stat(f).st_mode)) for f in files}
    assert_all_ranks(set(modes.values()) == {oct(mode)}, f"umask {oct(umask)}: expected {oct(mode)}, got {modes}")


# 5. Faults: a killed rank, a killed save.

def _parent(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])  # the command may hold ')' and spaces


def _descendants_running(root, script):
    """Pids of the processes under `root` whose command line names `script` (the ranks)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = _parent(entry)
            except (OSError, IndexError, ValueError):  # gone meanwhile
                pass
    found = []
    for pid in sorted(parents):
        ancestor = parents[pid]
        while ancestor not in (0, 1, root) and ancestor in parents:
            ancestor = parents[ancestor]
        if ancestor == root and pid != root:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().decode(errors="replace").split("\0")
            except OSError:
                continue
            if script in argv:
                found.append(pid)
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the ranks through /proc")
def test_a_rank_killed_mid_training_ends_the_whole_job(tmp_path):
    directory = tmp_path / "ckpt"
    cmd = mpiexec(2, sys.executable, "-m", "mpi4py", TRAIN, "--model", "resnet",
                  "--grid", "channel=2", "--algorithm", "y", "--train-samples", "256", "--batch-size", "32",
                  "--epochs", "50", "--no-progress", "--checkpoint-dir", str(directory),
                  "--log", str(tmp_path / "run.json"))
    with open(tmp_path / "out.txt", "w") as out:
        proc = subprocess.Popen(cmd, env=single_thread_env(MPIEXEC_TIMEOUT=120), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        ranks = []
        while time.monotonic() < deadline and proc.poll() is None:
            ranks = _descendants_running(proc.pid, TRAIN)
            if len(ranks) == 2 and (directory / "latest.json").exists():
                break
            time.sleep(0.1)
        assert proc.poll() is None and len(ranks) == 2, \
            f"no checkpoint from 2 running ranks ({ranks}): {(tmp_path / 'out.txt').read_text()}"
        os.kill(ranks[-1], signal.SIGKILL)
        killed = time.monotonic()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        seconds = time.monotonic() - killed
    finally:
        if proc.poll() is None:  # the job did not end: stop what this test started
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = (tmp_path / "out.txt").read_text()
    assert seconds < 10, f"the job ran on {seconds:.1f} s after a rank was killed: {output}"
    assert proc.returncode != 0, output
    assert not (tmp_path / "run.json").exists()  # it did not finish
    # The checkpoint latest.json names is whole, wherever the kill fell.
    path, skipped = checkpoint.resume_point(str(directory))
    assert skipped == [] and checkpoint.read_meta(path)["step"] > 0


class SimulatedKill(Exception):
    """Stands for SIGKILL arriving while the shards of a checkpoint are written."""


@pytest.mark.mpi
def test_a_save_killed_half_way_costs_only_the_steps_since_the_previous_checkpoint(
        pristine, mpi_tmp_path, monkeypatch):
    directory = str(mpi_tmp_path / "ckpt")
    write_shard = checkpoint.save_npz

    def dying_save_npz(path, **arrays):
        """At step 4 rank 0's shard is written, every other rank's is half written."""
        if STEP4 not in path:
            return write_shard(path, **arrays)
        if RANK == 0:
            write_shard(path, **arrays)
        with open(os.path.join(os.path.dirname(path), f".tmp-{RANK:012x}-{os.path.basename(path)}"), "wb") as f:
            f.write(b"PK\x03\x04 half a shard")
        raise SimulatedKill(path)

    monkeypatch.setattr(checkpoint, "save_npz", dying_save_npz)
    raises_on_all_ranks(SimulatedKill, lambda: train(config(directory)))
    monkeypatch.undo()
    on_rank0(lambda: open(os.path.join(directory, ".tmp-0123456789ab-latest.json"), "w").close())
    partial = sorted(os.listdir(os.path.join(directory, STEP4)))
    assert_all_ranks(SHARD in partial and "meta.json" not in partial, f"{STEP4} holds {partial}")

    path, skipped = checkpoint.resume_point(directory)
    assert_all_ranks((path, skipped) == (os.path.join(directory, STEP2), []), f"resume_point gave {path}, {skipped}")
    result = train(config(directory, resume=True))
    assert_close_all_ranks(losses(result), pristine[1], 1e-12, "losses of the resumed run")
    temporaries = [f for _, _, files in os.walk(directory) for f in files if f.startswith(".tmp-")]
    meta = checkpoint.read_meta(os.path.join(directory, STEP4))
    assert_all_ranks(not temporaries and sorted(meta["files"]) == [f"rank-{r:05d}.npz" for r in range(SIZE)],
                     f"temporaries {temporaries}, files {sorted(meta['files'])}")


@pytest.mark.mpi
def test_a_rank_that_cannot_write_its_shard_stops_every_rank_alike(mpi_tmp_path, monkeypatch):
    """A full disk on one writing rank: every rank raises the same ValueError (nobody is left
    waiting at a barrier) and latest.json still names the previous checkpoint."""
    directory = str(mpi_tmp_path / "ckpt")
    write_shard = checkpoint.save_npz
    last_writer = SIZE - 1  # config() runs on sample=1: every rank writes a shard

    def full_disk(path, **arrays):
        if STEP4 in path and RANK == last_writer:
            raise OSError(28, "No space left on device", path)
        return write_shard(path, **arrays)

    monkeypatch.setattr(checkpoint, "save_npz", full_disk)
    raises_on_all_ranks(ValueError, lambda: train(config(directory)),
                        match=r"saving the checkpoint failed: .*No space left on device")
    monkeypatch.undo()
    path, skipped = checkpoint.resume_point(directory)
    assert_all_ranks(path == os.path.join(directory, STEP2), f"resume_point gave {path}, {skipped}")
