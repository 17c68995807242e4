"""Datasets, the sample-sharded loader and its augmentation, checked serially with stand-in grids.

The loader only asks a grid for axis_size and coord, so a tiny stand-in plays every rank of a
2 x 1, 3 x 1 or 2 x 2 grid in one process.
"""
import numpy as np
import pytest

from cfp.data import ShardedLoader, augment_batch, load_digits, synthetic
from cfp.partition import block_sizes


class StandInGrid:
    """The rank at {axis: coord} of a grid of {axis: size}; axes not given have size 1."""

    def __init__(self, shape, coords):
        self.shape, self.coords = shape, coords

    def axis_size(self, axis):
        return self.shape.get(axis, 1)

    def coord(self, axis):
        return self.coords.get(axis, 0)


def every_rank(sample, channel):
    shape = {"sample": sample, "channel": channel}
    return [StandInGrid(shape, {"sample": s, "channel": c})
            for s in range(sample) for c in range(channel)]


def sklearn_digits(**kwargs):
    pytest.importorskip("sklearn")  # the digits ship with scikit-learn
    return load_digits(**kwargs)


@pytest.fixture(scope="module")
def digits():
    return sklearn_digits(dtype=np.float64)


# ------------------------------------------------------------------ digits


def test_digits_shapes_and_split(digits):
    x_train, y_train, x_test, y_test = digits
    assert x_train.shape == (1437, 1, 8, 8) and x_test.shape == (360, 1, 8, 8)
    assert y_train.shape == (1437,) and y_test.shape == (360,)
    assert y_train.dtype == np.int64 and set(np.unique(y_train)) == set(range(10))
    # Stratified: every class has its share of the test set (about 36 of each).
    assert np.all(np.abs(np.bincount(y_test) - 360 * np.bincount(np.r_[y_train, y_test]) / 1797) <= 1)


def test_digits_standardised_with_training_statistics(digits):
    x_train, _, x_test, _ = digits
    assert abs(x_train.mean()) < 1e-12 and abs(x_train.std() - 1) < 1e-12
    assert abs(x_test.mean()) < 0.1  # the same transformation, not the test set's own


def test_digits_deterministic_by_seed(digits):
    again = sklearn_digits(dtype=np.float64)
    for a, b in zip(digits, again):
        np.testing.assert_array_equal(a, b)
    other = sklearn_digits(seed=1, dtype=np.float64)
    assert not np.array_equal(other[1], digits[1])


def test_digits_dtype_fraction_and_upsampling():
    x_train, y_train, x_test, _ = sklearn_digits(upsample=2, test_fraction=0.5)
    assert x_train.dtype == np.float32
    assert x_train.shape == (898, 1, 16, 16) and x_test.shape == (899, 1, 16, 16)
    x8, y8, _, _ = sklearn_digits(test_fraction=0.5)
    np.testing.assert_array_equal(y_train, y8)
    # Nearest neighbour: each pixel becomes a 2 x 2 block (standardisation is unchanged by it).
    np.testing.assert_allclose(x_train, x8.repeat(2, axis=2).repeat(2, axis=3), atol=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    (dict(upsample=0), "upsample must be an integer >= 1, got 0"),
    (dict(upsample=1.5), "got 1.5"),
    (dict(test_fraction=1.0), r"test_fraction must be in \(0, 1\), got 1.0"),
])
def test_digits_bad_arguments(kwargs, message):
    # Checked before scikit-learn is imported, so this holds without it.
    with pytest.raises(ValueError, match=message):
        load_digits(**kwargs)


# ------------------------------------------------------------------ synthetic


def test_synthetic_shapes_and_determinism():
    x, y = synthetic(64, 3, 5, 7, classes=4, seed=3)
    assert x.shape == (64, 3, 5, 7) and x.dtype == np.float32
    assert y.shape == (64,) and y.dtype == np.int64 and set(np.unique(y)) <= set(range(4))
    x2, y2 = synthetic(64, 3, 5, 7, classes=4, seed=3)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    x64, y64 = synthetic(64, 3, 5, 7, classes=4, seed=3, dtype=np.float64)
    np.testing.assert_allclose(x, x64, rtol=1e-6)
    assert not np.array_equal(synthetic(64, 3, 5, 7, classes=4, seed=4)[0], x)
    with pytest.raises(ValueError, match="classes must be an integer >= 1, got 0"):
        synthetic(4, 1, 2, 2, classes=0)


def test_synthetic_is_learnable():
    # Nearest class mean, fitted on one half and scored on the other: far above chance (10 %).
    x, y = synthetic(2000, 2, 6, 6, classes=10, seed=0, dtype=np.float64)
    flat = x.reshape(len(x), -1)
    fit, score = slice(0, 1000), slice(1000, None)
    means = np.stack([flat[fit][y[fit] == k].mean(axis=0) for k in range(10)])
    distances = ((flat[score, None, :] - means[None]) ** 2).sum(axis=2)
    assert np.mean(distances.argmin(axis=1) == y[score]) > 0.9
    # Also through the per-channel spatial means alone, what a pooled model sees.
    pooled = x.mean(axis=(2, 3))
    means = np.stack([pooled[fit][y[fit] == k].mean(axis=0) for k in range(10)])
    distances = ((pooled[score, None, :] - means[None]) ** 2).sum(axis=2)
    assert np.mean(distances.argmin(axis=1) == y[score]) > 0.7


# ------------------------------------------------------------------ sharded loader


def make_data(n=53):
    x = np.arange(n * 2 * 3, dtype=np.float64).reshape(n, 2, 3, 1)
    return x, np.arange(n, dtype=np.int64)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("sample, channel", [(2, 1), (3, 1), (2, 2)])
def test_local_blocks_make_the_global_batch(sample, channel, drop_last):
    x, y = make_data()
    reference = ShardedLoader(x, y, batch_size=8, seed=5, drop_last=drop_last)
    ranks = [ShardedLoader(x, y, batch_size=8, grid=g, seed=5, drop_last=drop_last)
             for g in every_rank(sample, channel)]
    assert len(reference) == (6 if drop_last else 7)
    assert all(len(r) == len(reference) for r in ranks)
    for _ in range(2):  # two epochs: each `for` over a loader advances its epoch
        for whole, *local in zip(reference, *ranks):
            x_global, y_global, n_global = whole
            assert n_global == len(y_global)
            assert all(n == n_global for _, _, n in local)
            blocks = [local[s * channel] for s in range(sample)]
            assert [len(b[1]) for b in blocks] == block_sizes(n_global, sample)
            np.testing.assert_array_equal(np.concatenate([b[0] for b in blocks]), x_global)
            np.testing.assert_array_equal(np.concatenate([b[1] for b in blocks]), y_global)
            for s in range(sample):  # replicated over the channel axis
                for c in range(1, channel):
                    np.testing.assert_array_equal(local[s * channel + c][0], blocks[s][0])
    assert reference.epoch == 2


def test_epochs_are_seeded_permutations():
    x, y = make_data()
    loader = ShardedLoader(x, y, batch_size=8, seed=1)
    epoch0 = np.concatenate([yb for _, yb, _ in loader])
    epoch1 = np.concatenate([yb for _, yb, _ in loader])
    np.testing.assert_array_equal(np.sort(epoch0), y)  # every sample once
    assert not np.array_equal(epoch0, epoch1)
    again = ShardedLoader(x, y, batch_size=8, seed=1)
    again.set_epoch(1)
    np.testing.assert_array_equal(np.concatenate([yb for _, yb, _ in again]), epoch1)
    other_seed = ShardedLoader(x, y, batch_size=8, seed=2)
    assert not np.array_equal(np.concatenate([yb for _, yb, _ in other_seed]), epoch0)
    in_order = ShardedLoader(x, y, batch_size=8, shuffle=False)
    np.testing.assert_array_equal(np.concatenate([yb for _, yb, _ in in_order]), y)


def test_drop_last_drops_the_partial_batch():
    x, y = make_data()
    sizes = [n for _, _, n in ShardedLoader(x, y, batch_size=8, drop_last=True)]
    assert sizes == [8] * 6
    sizes = [n for _, _, n in ShardedLoader(x, y, batch_size=8)]
    assert sizes == [8] * 6 + [5]


def test_batch_smaller_than_sample_axis():
    x, y = make_data()
    grid = StandInGrid({"sample": 2}, {"sample": 0})
    with pytest.raises(ValueError, match=r"batch size 1 is smaller than the sample axis of the "
                                         r"grid \(P_n=2\)"):
        ShardedLoader(x, y, batch_size=1, grid=grid)
    # 53 = 6 * 8 + 5: a last batch of 5 cannot give each of 6 sample ranks a sample.
    grid = StandInGrid({"sample": 6}, {"sample": 0})
    with pytest.raises(ValueError, match=r"last batch .* has 5 samples .* \(P_n=6\)"):
        ShardedLoader(x, y, batch_size=8, grid=grid)
    assert len(ShardedLoader(x, y, batch_size=8, grid=grid, drop_last=True)) == 6
    with pytest.raises(ValueError, match="x has 53 samples, y has 52"):
        ShardedLoader(x, y[:-1], batch_size=8)


# ------------------------------------------------------------------ augmentation


def test_augment_batch_by_hand():
    x = np.arange(1, 10, dtype=np.float32).reshape(1, 1, 3, 3)  # [[1 2 3] [4 5 6] [7 8 9]]
    same = augment_batch(x, [[4, 4]], [False])  # the window where the image lies: itself
    assert same.dtype == np.float32 and same.shape == x.shape
    np.testing.assert_array_equal(same, x)
    np.testing.assert_array_equal(augment_batch(x, [[4, 4]], [True])[0, 0],
                                  [[3, 2, 1], [6, 5, 4], [9, 8, 7]])
    # Offset (3, 5): padded rows 3..5 are image rows -1..1, columns 5..7 image columns 1..3;
    # cropped [[0 0 0] [2 3 0] [5 6 0]], then flipped.
    np.testing.assert_array_equal(augment_batch(x, [[3, 5]], [True])[0, 0], [[0, 0, 0], [0, 3, 2], [0, 6, 5]])
    # Offsets 0 and 8 on a 3 x 3 image padded by 4: the window lies in the zero border.
    np.testing.assert_array_equal(augment_batch(x, [[0, 8]], [False]), np.zeros_like(x))
    np.testing.assert_array_equal(augment_batch(x, [[8, 0]], [True]), np.zeros_like(x))
    # Padding 1: offset 0 takes the top (left) zero border, 2 the bottom (right) one.
    np.testing.assert_array_equal(augment_batch(x, [[0, 2]], [False], padding=1)[0, 0],
                                  [[0, 0, 0], [2, 3, 0], [5, 6, 0]])
    np.testing.assert_array_equal(augment_batch(x, [[2, 0]], [True], padding=1)[0, 0],
                                  [[5, 4, 0], [8, 7, 0], [0, 0, 0]])


def test_augment_batch_is_a_crop_then_a_flip_of_each_sample():
    """A batch of several samples and channels, float64 and float32, against np.pad and slicing
    sample by sample."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 3, 7, 5))
    offsets = rng.integers(0, 9, (6, 2))
    flips = np.array([True, False, True, True, False, False])
    for dtype in (np.float64, np.float32):
        out = augment_batch(x.astype(dtype), offsets, flips)
        assert out.shape == x.shape and out.dtype == dtype
        for i, ((r, c), flip) in enumerate(zip(offsets, flips)):
            window = np.pad(x[i], ((0, 0), (4, 4), (4, 4)))[:, r:r + 7, c:c + 5]
            np.testing.assert_array_equal(out[i], (window[..., ::-1] if flip else window).astype(dtype))


@pytest.mark.parametrize("x, offsets, flips, message", [
    (np.zeros((2, 3, 3)), [[0, 0], [0, 0]], [False, False], r"x has shape \(2, 3, 3\); expected a batch"),
    (np.zeros((2, 1, 3, 3)), [[0, 0]], [False, False], r"offsets \(1, 2\) and flips \(2,\) for 2 samples"),
    (np.zeros((1, 1, 3, 3)), [[0, 9]], [False], r"offsets must be in 0..8 \(padding 4\), got 0..9"),
])
def test_augment_batch_bad_arguments(x, offsets, flips, message):
    with pytest.raises(ValueError, match=message):
        augment_batch(x, offsets, flips)


def make_images(n=53):
    x = np.random.default_rng(2).standard_normal((n, 2, 5, 4))
    return x, np.arange(n, dtype=np.int64)


@pytest.mark.parametrize("sample, channel", [(2, 1), (3, 1), (2, 2)])
def test_augmented_blocks_make_the_augmented_global_batch(sample, channel):
    """Each rank augments only its rows, yet the blocks of the sample ranks make the batch that
    one rank augments whole; replicas along the channel axis agree; each sample's transform is
    that of its position in the global batch."""
    x, y = make_images()
    reference = ShardedLoader(x, y, batch_size=8, seed=5, augment=True)
    plain = ShardedLoader(x, y, batch_size=8, seed=5)
    ranks = [ShardedLoader(x, y, batch_size=8, grid=g, seed=5, augment=True) for g in every_rank(sample, channel)]
    for epoch in range(2):
        for b, (whole, unaugmented, *local) in enumerate(zip(reference, plain, *ranks)):
            x_global, y_global, n_global = whole
            np.testing.assert_array_equal(y_global, unaugmented[1])
            offsets, flips = reference.augmentation(epoch, b, n_global)
            np.testing.assert_array_equal(x_global, augment_batch(unaugmented[0], offsets, flips))
            blocks = [local[s * channel] for s in range(sample)]
            np.testing.assert_array_equal(np.concatenate([blk[0] for blk in blocks]), x_global)
            np.testing.assert_array_equal(np.concatenate([blk[1] for blk in blocks]), y_global)
            for s in range(sample):
                for c in range(1, channel):
                    np.testing.assert_array_equal(local[s * channel + c][0], blocks[s][0])


def test_augmentation_is_seeded_by_epoch_and_batch():
    x, y = make_images()
    loader = ShardedLoader(x, y, batch_size=8, seed=1, augment=True)
    epoch0 = [xb for xb, _, _ in loader]
    epoch1 = [xb for xb, _, _ in loader]
    assert epoch0[0].dtype == x.dtype and all(a.shape == b.shape for a, b in zip(epoch0, epoch1))
    # A loader made anew and set to epoch 1 (a resumed run) gives epoch 1's batches again.
    again = ShardedLoader(x, y, batch_size=8, seed=1, augment=True)
    again.set_epoch(1)
    for a, b in zip(epoch1, (xb for xb, _, _ in again)):
        np.testing.assert_array_equal(a, b)
    # Two epochs draw other transforms, not only another order: epoch 1's batches are not
    # epoch 0's samples transformed as in epoch 0.
    offsets0, flips0 = loader.augmentation(0, 0, 8)
    offsets1, flips1 = loader.augmentation(1, 0, 8)
    assert not (np.array_equal(offsets0, offsets1) and np.array_equal(flips0, flips1))
    assert not np.array_equal(loader.augmentation(0, 1, 8)[0], offsets0)  # nor two batches
    assert not np.array_equal(ShardedLoader(x, y, batch_size=8, seed=2).augmentation(0, 0, 8)[0], offsets0)
    # The draws cover the whole range: offsets 0..8 and both flips.
    offsets, flips = loader.augmentation(0, 0, 500)
    assert set(np.unique(offsets)) == set(range(9)) and 0.4 < flips.mean() < 0.6
    # augment=False leaves the batches as they were.
    unaugmented = ShardedLoader(x, y, batch_size=8, seed=1)
    order = unaugmented.order(0)
    for b, (xb, yb, _) in enumerate(unaugmented):
        np.testing.assert_array_equal(xb, x[order[b * 8:(b + 1) * 8]])
        assert not np.array_equal(xb, epoch0[b])


def test_augmentation_needs_images():
    x, y = make_data()
    with pytest.raises(ValueError, match=r"augmentation crops and flips images: x has shape \(53, 2, 3\); expected \(N, C, H, W\)"):
        ShardedLoader(x[:, :, :, 0], y, batch_size=8, augment=True)
