"""Datasets for training and checking cfp (scikit-learn's digits, synthetic data) and the
loader that gives each rank its block of every global mini-batch.

Every global batch depends only on the data, the batch size, the seed and the epoch, never on
the grid, which is what lets a run on any grid be compared with a run on one rank.
"""
import math

import numpy as np

from .backend import get_array_module
from .checks import int_at_least
from .layout import Layout


def load_digits(upsample=1, test_fraction=0.2, seed=0, dtype=np.float32):
    """scikit-learn's bundled handwritten digits (1797 images of 8 x 8, ten classes).

    Returns (x_train, y_train, x_test, y_test): x of shape (n, 1, 8 * upsample, 8 * upsample),
    y int64 labels 0..9. Pixels are scaled to [0, 1], then standardised with the mean and
    standard deviation of the training set (one of each, the images having one channel).
    The split is stratified by label (sklearn's train_test_split with random_state=seed):
    with the defaults 1437 training and 360 test images, the same on every call. Upsampling
    repeats each pixel upsample x upsample times (nearest neighbour: no new values, exact).
    """
    int_at_least(upsample, "upsample", 1)
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    try:
        from sklearn.datasets import load_digits as sklearn_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise ImportError("cfp.data.load_digits needs scikit-learn (pip install scikit-learn); "
                          "it reads the digits bundled with it, no download") from None
    digits = sklearn_digits()
    images = digits.images.astype(np.float64) / 16.0  # pixel values are 0..16
    labels = digits.target.astype(np.int64)
    train, test = train_test_split(np.arange(len(labels)), test_size=test_fraction,
                                   stratify=labels, random_state=seed)
    if upsample > 1:
        images = images.repeat(upsample, axis=1).repeat(upsample, axis=2)
    x = images[:, None, :, :]  # (n, 1, H, W)
    mean, std = x[train].mean(), x[train].std()
    x = ((x - mean) / std).astype(dtype)
    return x[train], labels[train], x[test], labels[test]


def synthetic(n, channels, height, width, classes, seed=0, dtype=np.float32):
    """Random images x (n, channels, height, width) and int64 labels y (n,) that can be learnt.

    Each class k has a fixed random mean image mu_k = o_k + pattern_k (o_k: (channels, 1, 1),
    one offset per channel, so that even a model that averages over space can tell the classes
    apart; pattern_k: (channels, height, width)); a sample of class y is mu_y + unit Gaussian
    noise. Labels are drawn uniformly. Everything is generated in float64 from `seed`, so the
    data are the same for every dtype up to rounding.
    """
    for value, what in ((n, "n"), (channels, "channels"), (height, "height"), (width, "width"),
                        (classes, "classes")):
        int_at_least(value, f"synthetic: {what}", 1)
    rng = np.random.default_rng(seed)
    offsets = rng.standard_normal((classes, channels, 1, 1))
    patterns = rng.standard_normal((classes, channels, height, width))
    y = rng.integers(0, classes, size=n, dtype=np.int64)
    x = offsets[y] + patterns[y] + rng.standard_normal((n, channels, height, width))
    return x.astype(dtype), y


SAMPLES = Layout(("sample",))  # a batch's samples split over the sample axis


class ShardedLoader:
    """Global mini-batches of (x, y), each rank taking its block of every batch.

    x: (n, ...) and y: (n,). Each epoch visits the samples in a permutation drawn from
    (seed, epoch) (or in order when shuffle=False) and cuts it into batches of batch_size (the
    last one smaller unless drop_last). Iterating yields, per batch, (x_local, y_local, n_global):
    the rank's block of the batch under the layout SAMPLES (split over the grid's sample axis),
    the same for all ranks with the same sample coordinate (replicated over the channel axis).
    grid=None means one rank, whole batches. `grid` needs only `shape`, `coords` and
    axis_size(axis).

    Each `for` loop over the loader is one epoch and advances `epoch` (the epoch the next loop
    will use); set_epoch(e) chooses it, e.g. when resuming.
    """

    def __init__(self, x, y, batch_size, grid=None, shuffle=True, seed=0, drop_last=False):
        if len(x) != len(y):
            raise ValueError(f"x has {len(x)} samples, y has {len(y)}")
        int_at_least(batch_size, "batch size", 1)
        self.x, self.y = x, y
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.grid = grid
        self.sample_parts = grid.axis_size("sample") if grid is not None else 1
        # Checked identically on every rank, so all raise together rather than some ranks
        # waiting in a collective for one holding no sample.
        if batch_size < self.sample_parts:
            raise ValueError(f"batch size {batch_size} is smaller than the sample axis of the "
                             f"grid (P_n={self.sample_parts}): every rank needs a sample")
        last = len(x) % batch_size
        if not drop_last and 0 < last < self.sample_parts:
            raise ValueError(f"the last batch of an epoch has {last} samples ({len(x)} samples "
                             f"in batches of {batch_size}), fewer than the sample axis of the "
                             f"grid (P_n={self.sample_parts}): every rank needs a sample; use "
                             f"drop_last=True or another batch size")

    def __len__(self):
        """Batches per epoch."""
        n = len(self.x)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def set_epoch(self, epoch):
        self.epoch = int(epoch)

    def order(self, epoch):
        """The sample indices of epoch `epoch` in visiting order (the same on every rank)."""
        if not self.shuffle:
            return np.arange(len(self.x))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.x))

    def __iter__(self):
        order = self.order(self.epoch)
        self.epoch += 1
        return self._batches(order)

    def _batches(self, order):
        for b in range(len(self)):
            batch = order[b * self.batch_size:(b + 1) * self.batch_size]
            n_global = len(batch)
            # Only this rank's block is copied out, never the whole batch.
            rows = batch[self.block(n_global)]
            yield _take_rows(self.x, rows), _take_rows(self.y, rows), n_global


    def block(self, n_global):
        """This rank's rows of a batch of n_global samples: the sample layout's block."""
        if self.grid is None:
            return slice(0, n_global)
        (rows,) = SAMPLES.indices((n_global,), self.grid, self.grid.coords)
        return slice(rows.start, rows.stop)


def _take_rows(array, rows):
    """array[rows] for a NumPy or CuPy array, rows a NumPy index array."""
    return array[get_array_module(array).asarray(rows)]
