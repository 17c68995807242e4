"""Training on one's own data: --dataset npz:PATH and cifar10:DIR, the data checks (one clear
message naming the file and array), and training on them at 1 and 4 ranks from the script;
--augment, the same augmented batches on every grid and after a resume."""
import json
import os

import numpy as np
import pytest
from mpi4py import MPI

from cfp.data import CIFAR_RECORD, load_cifar10, load_digits, load_npz
from cfp.train import TrainConfig, train
from test_scripts import TRAIN, run


def digits_npz(path, channel_last=False, uint8=False):
    x_train, y_train, x_test, y_test = load_digits()
    x = np.concatenate([x_train, x_test])
    y = np.concatenate([y_train, y_test])
    if uint8:
        x = np.clip((x - x.min()) / (x.max() - x.min()) * 255, 0, 255).astype(np.uint8)
    if channel_last:
        x = x.transpose(0, 2, 3, 1)
    np.savez(path, x=x, y=y)
    return x, y


def test_npz_of_digits_loads_split_and_standardised(tmp_path):
    path = tmp_path / "digits.npz"
    x, y = digits_npz(path)
    x_train, y_train, x_test, y_test, classes = load_npz(str(path))
    assert classes == 10 and x_train.shape[1:] == (1, 8, 8) and len(x_train) + len(x_test) == len(x)
    assert abs(float(x_train.mean())) < 1e-5 and abs(float(x_train.std()) - 1) < 1e-4
    # channel-last uint8 and an explicit test set
    path2 = tmp_path / "cl.npz"
    x8 = np.random.default_rng(0).integers(0, 256, (40, 6, 5, 3)).astype(np.uint8)
    np.savez(path2, x=x8, y=np.arange(40) % 4, x_test=x8[:8], y_test=np.arange(8) % 4)
    x_train, y_train, x_test, y_test, classes = load_npz(str(path2))
    assert x_train.shape == (40, 3, 6, 5) and x_test.shape == (8, 3, 6, 5) and classes == 4
    np.testing.assert_allclose(x_train.mean(axis=(0, 2, 3)), 0, atol=1e-5)


@pytest.mark.parametrize("arrays,message", [
    ({"y": np.zeros(4, int)}, "lacks the array\\(s\\) x"),
    ({"x": np.zeros((4, 1, 2, 2)), "y": np.zeros(3, int)}, "array y: has 3 labels for 4 images"),
    ({"x": np.zeros((4, 1, 2, 2)), "y": np.array([0, 1, -1, 0])}, "array y: holds a negative label \\(-1\\)"),
    ({"x": np.zeros((4, 1, 2, 2)), "y": np.zeros(4)}, "array y: has dtype float64.*integer labels"),
    ({"x": np.full((4, 1, 2, 2), np.nan), "y": np.zeros(4, int)}, "array x: holds 16 NaN or infinite"),
    ({"x": np.zeros((4, 2)), "y": np.zeros(4, int)}, "array x: has shape \\(4, 2\\); expected \\(N, C, H, W\\)"),
    ({"x": np.zeros((4, 1, 2, 2), dtype=np.int32), "y": np.zeros(4, int)}, "array x: has dtype int32; expected uint8"),
    ({"x": np.zeros((4, 1, 2, 2)), "y": np.zeros(4, int), "x_test": np.zeros((1, 1, 2, 2))},
     "only one of x_test and y_test"),
])
def test_bad_npz_is_named(tmp_path, arrays, message):
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=message):
        load_npz(str(path))


def test_object_arrays_and_missing_files_are_refused(tmp_path):
    path = tmp_path / "objects.npz"
    np.savez(path, x=np.array([np.zeros(2), np.zeros(3)], dtype=object), y=np.zeros(2, int))
    with pytest.raises(ValueError, match="is not an .npz file of plain arrays"):
        load_npz(str(path))
    with pytest.raises(ValueError, match="does not exist"):
        load_npz(str(tmp_path / "nowhere.npz"))


@pytest.mark.parametrize("arrays,message", [
    # labels 1..10: no class 0
    ({"x": np.zeros((20, 1, 2, 2)), "y": np.arange(20) % 10 + 1},
     r"the training labels run to 10, so there are 11 classes 0..10, but 1 of them has no training sample "
     r"\(0\); expected labels 0..K-1 with every class present \(relabel, e.g. y - 1 for labels 1..K\)"),
    # sparse label ids
    ({"x": np.zeros((12, 1, 2, 2)), "y": np.array([0, 2, 5] * 4)}, r"6 classes 0..5, but 3 of them have no "
     r"training sample \(1, 3, 4\)"),
    # a test label never seen in training
    ({"x": np.zeros((8, 1, 2, 2)), "y": np.arange(8) % 4, "x_test": np.zeros((3, 1, 2, 2)), "y_test": np.array([0, 3, 7])},
     r"test label 7 is not among the 4 training classes 0..3"),
    # a training set of given test data that lacks a class the test set has
    ({"x": np.zeros((4, 1, 2, 2)), "y": np.array([0, 2, 0, 2]), "x_test": np.zeros((2, 1, 2, 2)), "y_test": np.array([1, 1])},
     r"3 classes 0..2, but 1 of them has no training sample \(1\)"),
    # a label with one sample, which a stratified split cannot put on both sides
    ({"x": np.zeros((9, 1, 2, 2)), "y": np.array([0, 0, 0, 0, 1, 1, 1, 1, 2])},
     r"label 2 has a single sample, too few to split off a stratified test set .*give x_test and y_test, "
     r"or at least 2 samples of every label"),
])
def test_labels_that_leave_a_class_empty_are_refused(tmp_path, arrays, message):
    path = tmp_path / "labels.npz"
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=message):
        load_npz(str(path))


def _crafted_npz(path, shape):
    """An .npz whose x declares `shape` (uint8) in its header but holds 16 bytes of data."""
    import io
    import zipfile
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("x.npy", header.getvalue() + bytes(16))
        y = io.BytesIO()
        np.save(y, np.zeros(4, np.int64))
        z.writestr("y.npy", y.getvalue())


def test_an_array_declared_larger_than_memory_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "crafted.npz"
    _crafted_npz(path, (1 << 20, 1 << 20, 64))  # 64 TiB of uint8
    with pytest.raises(ValueError, match=r"crafted.npz': its arrays declare 65536.0 GiB \(x 65536.0 GiB, y 32 B\), "
                                         r"more than the .* GiB of memory available; a damaged file"):
        load_npz(str(path))
    _crafted_npz(path, (4, 1, 2, 2))  # declares 16 bytes: read, and loads
    assert load_npz(str(path), test_fraction=0.5)[4] == 1


def write_cifar(directory, per_file=12, seed=0):
    """Files in CIFAR-10's binary format: 3073-byte records, a label then 3 x 32 x 32 pixels."""
    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        records = rng.integers(0, 256, (per_file, CIFAR_RECORD)).astype(np.uint8)
        records[:, 0] = np.arange(per_file) % 10
        records.tofile(os.path.join(directory, name))


def test_cifar10_binary_files(tmp_path):
    write_cifar(tmp_path / "cifar")
    x_train, y_train, x_test, y_test, classes = load_cifar10(str(tmp_path / "cifar"))
    assert x_train.shape == (60, 3, 32, 32) and x_test.shape == (12, 3, 32, 32) and classes == 10
    assert list(y_test) == [i % 10 for i in range(12)]
    (tmp_path / "cifar" / "test_batch.bin").write_bytes(b"\x00" * 100)
    with pytest.raises(ValueError, match="has 100 bytes, not a whole number of 3073-byte records"):
        load_cifar10(str(tmp_path / "cifar"))
    os.remove(tmp_path / "cifar" / "data_batch_3.bin")
    with pytest.raises(ValueError, match="lacks data_batch_3.bin"):
        load_cifar10(str(tmp_path / "cifar"))
    with pytest.raises(ValueError, match=r"CIFAR-10 directory '.*nowhere' does not exist; expected the directory of "
                                         r"CIFAR-10's binary version \(cifar-10-batches-bin"):
        load_cifar10(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"CIFAR-10 directory '.*test_batch.bin' is not a directory"):
        load_cifar10(str(tmp_path / "cifar" / "test_batch.bin"))


def test_train_script_on_an_npz_and_on_cifar_files(tmp_path):
    """train.py on an .npz of the digits (written channel-last, uint8) and on CIFAR-format files,
    float64: the same losses on 4 ranks (sample=2,channel=2) as on one."""
    digits_npz(tmp_path / "digits.npz", channel_last=True, uint8=True)
    write_cifar(tmp_path / "cifar", per_file=16)
    for name, dataset in (("npz", f"npz:{tmp_path / 'digits.npz'}"), ("cifar", f"cifar10:{tmp_path / 'cifar'}")):
        losses = {}
        for nprocs, grid in ((1, "sample=1"), (4, "sample=2,channel=2")):
            log = tmp_path / f"{name}-{nprocs}.json"
            proc, _ = run(nprocs, ["--model", "resnet", "--width", "1", "--grid", grid, "--algorithm", "y",
                                   "--dataset", dataset, "--epochs", "1", "--batch-size", "16", "--max-steps", "3",
                                   "--dtype", "float64", "--no-progress", "--log", str(log)], script=TRAIN)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            with open(log) as f:
                losses[nprocs] = [step["loss"] for step in json.load(f)["steps"]]
        assert len(losses[1]) == 3
        np.testing.assert_allclose(losses[4], losses[1], rtol=1e-9, err_msg=name)


def test_augmented_training_gives_the_same_losses_on_every_grid(tmp_path):
    """train.py --augment, float64, 6 steps over two epochs: the same losses on 4 ranks
    (sample=2,channel=2, stationary-y) and on 3 (sample=3: blocks of 6, 5 and 5 samples) as
    one rank's (in this process), and other losses than without augmentation."""
    common = dict(model="resnet", width=1, train_samples=64, batch_size=16, epochs=2, max_steps=6,
                  dtype="float64", progress=False, threads=1)
    serial = {augment: np.array([h["loss"] for h in train(TrainConfig(augment=augment, **common),
                                                              world=MPI.COMM_SELF)["history"]])
              for augment in (True, False)}
    assert len(serial[True]) == 6
    assert np.abs(serial[False] - serial[True]).max() > 1e-3, "augmentation changed nothing"
    options = ["--model", "resnet", "--width", "1", "--train-samples", "64", "--batch-size", "16", "--epochs", "2",
               "--max-steps", "6", "--dtype", "float64", "--no-progress", "--augment"]
    for nprocs, grid, algorithm in ((4, "sample=2,channel=2", "y"), (3, "sample=3", "sample")):
        log = tmp_path / f"{grid}.json"
        proc, _ = run(nprocs, options + ["--grid", grid, "--algorithm", algorithm, "--log", str(log)], script=TRAIN)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        with open(log) as f:
            logged = json.load(f)
        assert logged["config"]["augment"] is True
        np.testing.assert_allclose([step["loss"] for step in logged["steps"]], serial[True], rtol=1e-9, err_msg=grid)


def test_augmented_training_resumed_mid_epoch_continues_the_same_batches(tmp_path):
    """A run with augmentation stopped 2 batches into its second epoch and resumed: the steps
    after the stop have the losses of an uninterrupted run, so the resumed loader draws the
    same crops and flips for the same (epoch, batch)."""
    common = dict(model="resnet", width=1, train_samples=64, batch_size=16, epochs=2, dtype="float64",
                  augment=True, progress=False, seed=1, threads=1)
    full = [h["loss"] for h in train(TrainConfig(**common), world=MPI.COMM_SELF)["history"]]
    assert len(full) == 8
    directory = str(tmp_path / "ckpt")
    train(TrainConfig(max_steps=6, checkpoint_dir=directory, **common), world=MPI.COMM_SELF)
    resumed = train(TrainConfig(checkpoint_dir=directory, resume=True, **common), world=MPI.COMM_SELF)
    assert resumed["steps_this_session"] == 2
    np.testing.assert_allclose([h["loss"] for h in resumed["history"]], full, rtol=1e-12)
