"""Datasets for training and checking cfp (scikit-learn's digits, synthetic data, .npz files
and CIFAR-10's binary batches), the loader that gives each rank its block of every global
mini-batch, and the loader's optional augmentation (random crop and horizontal flip).

Every global batch, augmented or not, depends only on the data, the batch size, the seed and
the epoch, never on the grid, which is what lets a run on any grid be compared with a run on
one rank.
"""
import math
import os

import numpy as np

from .backend import get_array_module
from .checks import int_at_least
from .io import load_array
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


def _standardised(x_train, x_test, dtype):
    """Both sets standardised with the training set's per-channel mean and deviation."""
    mean = x_train.mean(axis=(0, 2, 3), keepdims=True)
    std = x_train.std(axis=(0, 2, 3), keepdims=True)
    std[std == 0] = 1.0  # a constant channel stays constant (zero) rather than dividing by 0
    return ((x_train - mean) / std).astype(dtype), ((x_test - mean) / std).astype(dtype)


def _images(x, where):
    """x as float64 (N, C, H, W): from (N, C, H, W), (N, H, W, C) (a last axis of 1, 3 or 4
    channels that the second axis does not look like) or (N, H, W); uint8 scaled to [0, 1]."""
    if x.dtype == object or x.dtype.kind not in "uif":
        raise ValueError(f"{where}: has dtype {x.dtype}; expected uint8 or floating-point pixels")
    if x.dtype.kind in "ui" and x.dtype != np.uint8:
        raise ValueError(f"{where}: has dtype {x.dtype}; expected uint8 (0..255) or floating-point pixels")
    if x.ndim == 3:
        x = x[:, None]
    if x.ndim != 4:
        raise ValueError(f"{where}: has shape {x.shape}; expected (N, C, H, W), (N, H, W, C) or (N, H, W)")
    if x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):
        x = x.transpose(0, 3, 1, 2)  # channel-last
    out = x.astype(np.float64) / (255.0 if x.dtype == np.uint8 else 1.0)
    if not np.isfinite(out).all():
        raise ValueError(f"{where}: holds {int(out.size - np.isfinite(out).sum())} NaN or infinite value(s)")
    return out


def _labels(y, n, where, positions=None):
    """y as int64 labels 0, 1, ... of n samples: one a sample, (n,), or, where `positions` (a
    sample's spatial shape) is given, one a position, (n, *positions)."""
    per_position = positions is not None and y.ndim > 1
    if y.dtype == object or y.dtype.kind not in "ui" or (y.ndim != 1 and not per_position):
        raise ValueError(f"{where}: has dtype {y.dtype} and shape {y.shape}; expected a 1-D array of integer labels"
                         + ("" if positions is None else f" or one a position, (N, {', '.join(map(str, positions))})"))
    if len(y) != n:
        raise ValueError(f"{where}: has {len(y)} labels for {n} images")
    if per_position and y.shape[1:] != tuple(positions):
        raise ValueError(f"{where}: has labels of {y.shape[1:]} a sample; expected one a position, {tuple(positions)}")
    if y.size and y.min() < 0:
        raise ValueError(f"{where}: holds a negative label ({int(y.min())}); expected labels 0, 1, 2, ...")
    return y.astype(np.int64)


def _available_memory():
    """Bytes of memory the system can give now (Linux's MemAvailable; else free pages), or None."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _declared_bytes(npz):
    """{array: bytes its header declares} of an open NpzFile, read from the headers alone (no
    data), so that a damaged or crafted file declaring an array larger than memory is refused
    before it is read."""
    out = {}
    for member_name in npz.zip.namelist():
        if not member_name.endswith(".npy"):
            continue
        with npz.zip.open(member_name) as member:
            version = np.lib.format.read_magic(member)
            read = {(1, 0): np.lib.format.read_array_header_1_0,
                    (2, 0): np.lib.format.read_array_header_2_0}.get(version)
            if read is None:
                continue  # a newer header format: numpy's own reading checks it
            shape, _, dtype = read(member)
        out[member_name[:-4]] = math.prod(shape) * dtype.itemsize
    return out


def _too_large(declared, where):
    """The refusal of arrays that declare more bytes than the memory available, or None."""
    available = _available_memory()
    total = sum(declared.values())
    if available is None or total <= available:
        return None
    from .report import format_bytes
    arrays = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(declared.items()))
    return (f"{where}: its arrays declare {format_bytes(total)} ({arrays}), more than the "
            f"{format_bytes(available)} of memory available; a damaged file, or one too large for this machine")


def _named(labels):
    """'1, 3, 4' (the first ten, then '...') for a message naming labels."""
    return ", ".join(str(int(c)) for c in labels[:10]) + (", ..." if len(labels) > 10 else "")


def check_classes(y_train, y_test, where):
    """K, the number of classes: max training label + 1. Refused (ValueError naming them): a
    class in 0..K-1 with no training sample (labels 1..10 leave class 0 empty; sparse label ids
    leave gaps), and a test label that is not a training class."""
    classes = int(y_train.max(initial=-1)) + 1
    seen = np.bincount(y_train, minlength=classes) if classes else np.zeros(0, np.int64)
    empty = np.flatnonzero(seen == 0)
    if len(empty):
        named = _named(empty)
        raise ValueError(f"{where}: the training labels run to {classes - 1}, so there are {classes} classes "
                         f"0..{classes - 1}, but {len(empty)} of them {'has' if len(empty) == 1 else 'have'} no "
                         f"training sample ({named}); "
                         f"expected labels 0..K-1 with every class present (relabel, e.g. y - 1 for "
                         f"labels 1..K)")
    unseen = np.setdiff1d(np.unique(y_test), np.arange(classes))
    if len(unseen):
        named = _named(unseen)
        raise ValueError(f"{where}: test {'label' if len(unseen) == 1 else 'labels'} {named} "
                         f"{'is' if len(unseen) == 1 else 'are'} not among the {classes} training classes "
                         f"0..{classes - 1}")
    return classes


def _stratified_split(y, test_fraction, seed, where):
    """(train, test) indices of a stratified split; a label with a single sample, which cannot
    be on both sides, is refused naming it and the fix."""
    from sklearn.model_selection import train_test_split
    counts = np.bincount(y)
    single = np.flatnonzero(counts == 1)
    if len(single):
        named = _named(single)
        raise ValueError(f"{where}: {'label' if len(single) == 1 else 'labels'} {named} "
                         f"{'has' if len(single) == 1 else 'have'} a single sample, too few to split off a "
                         f"stratified test set (each label needs one training and one test sample); give "
                         f"x_test and y_test, or at least 2 samples of every label")
    try:
        return train_test_split(np.arange(len(y)), test_size=test_fraction, stratify=y, random_state=seed)
    except ValueError as e:
        raise ValueError(f"{where}: cannot split off a stratified test set of {test_fraction:g} of the "
                         f"{len(y)} samples ({e}); give x_test and y_test") from None


def load_npz(path, test_fraction=0.2, seed=0, dtype=np.float32):
    """A dataset of one's own from an .npz file: `x` (N, C, H, W), (N, H, W, C) or (N, H, W),
    uint8 (scaled to [0, 1]) or floating-point, and `y` integer labels 0..K-1; optionally
    `x_test` and `y_test`, else a stratified split of `test_fraction` (sklearn's
    train_test_split with random_state=seed). Standardised per channel with the training set's
    statistics. Returns (x_train, y_train, x_test, y_test, classes). Every problem is a
    ValueError naming the file and the array: among them labels that leave a class without a
    training sample, and arrays whose headers declare more bytes than the memory available
    (checked before reading). Read with allow_pickle=False."""
    where = f"dataset {path!r}"
    try:
        with np.load(path, allow_pickle=False) as f:
            too_large = _too_large(_declared_bytes(f), where)
            arrays = {} if too_large else {k: f[k] for k in f.files}
    except FileNotFoundError:
        raise ValueError(f"{where} does not exist") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{where} is not an .npz file of plain arrays: {e}") from None
    if too_large:
        raise ValueError(too_large)
    missing = [k for k in ("x", "y") if k not in arrays]
    if missing:
        raise ValueError(f"{where} lacks the array(s) {', '.join(missing)}; it has {', '.join(sorted(arrays)) or 'none'}")
    if ("x_test" in arrays) != ("y_test" in arrays):
        raise ValueError(f"{where} has only one of x_test and y_test; give both or neither")
    x = _images(arrays["x"], f"{where} array x")
    y = _labels(arrays["y"], len(x), f"{where} array y")
    if "x_test" in arrays:
        x_test = _images(arrays["x_test"], f"{where} array x_test")
        y_test = _labels(arrays["y_test"], len(x_test), f"{where} array y_test")
        if x_test.shape[1:] != x.shape[1:]:
            raise ValueError(f"{where}: x_test's images are {x_test.shape[1:]}, x's {x.shape[1:]}")
        x_train, y_train = x, y
    else:
        check_classes(y, y[:0], where)  # the classes before the split, whose sides hold them all
        train, test = _stratified_split(y, test_fraction, seed, where)
        x_train, y_train, x_test, y_test = x[train], y[train], x[test], y[test]
    classes = check_classes(y_train, y_test, where)
    x_train, x_test = _standardised(x_train, x_test, dtype)
    return x_train, y_train, x_test, y_test, classes


CIFAR_RECORD = 1 + 3 * 32 * 32  # a label byte, then 1024 red, 1024 green and 1024 blue pixels


def load_cifar10(directory, dtype=np.float32):
    """CIFAR-10's binary version from `directory` (data_batch_1.bin ... data_batch_5.bin and
    test_batch.bin, 3073-byte records), read as bytes (no pickle), standardised per channel
    with the training set's statistics. Returns (x_train, y_train, x_test, y_test, 10)."""
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.exists(directory) else "does not exist"
        raise ValueError(f"CIFAR-10 directory {directory!r} {what}; expected the directory of CIFAR-10's binary "
                         f"version (cifar-10-batches-bin, holding data_batch_1.bin ... test_batch.bin)")
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    missing = [n for n in names if not os.path.isfile(os.path.join(directory, n))]
    if missing:
        raise ValueError(f"CIFAR-10 directory {directory!r} lacks {', '.join(missing)}")
    parts = []
    for name in names:
        path = os.path.join(directory, name)
        raw = np.fromfile(path, dtype=np.uint8)
        if raw.size == 0 or raw.size % CIFAR_RECORD:
            raise ValueError(f"CIFAR-10 file {path!r} has {raw.size} bytes, not a whole number of "
                             f"{CIFAR_RECORD}-byte records")
        records = raw.reshape(-1, CIFAR_RECORD)
        labels = records[:, 0].astype(np.int64)
        if labels.max() > 9:
            raise ValueError(f"CIFAR-10 file {path!r} holds label {int(labels.max())}; expected 0..9")
        parts.append((records[:, 1:].reshape(-1, 3, 32, 32).astype(np.float64) / 255.0, labels))
    x_train = np.concatenate([p[0] for p in parts[:5]])
    y_train = np.concatenate([p[1] for p in parts[:5]])
    x_train, x_test = _standardised(x_train, parts[5][0], dtype)
    return x_train, y_train, x_test, parts[5][1], 10


def synthetic(n, channels, height, width, classes, seed=0, dtype=np.float32, depth=None):
    """Random images x (n, channels, height, width) (with depth, volumes (n, channels, depth,
    height, width)) and int64 labels y (n,) that can be learnt.

    Each class k has a fixed random mean image mu_k = o_k + pattern_k (o_k: (channels, 1, 1),
    one offset per channel, so that even a model that averages over space can tell the classes
    apart; pattern_k: (channels, height, width)); a sample of class y is mu_y + unit Gaussian
    noise. Labels are drawn uniformly. Everything is generated in float64 from `seed`, so the
    data are the same for every dtype up to rounding.
    """
    sizes = ((n, "n"), (channels, "channels")) + (((depth, "depth"),) if depth is not None else ()) + (
        (height, "height"), (width, "width"), (classes, "classes"))
    for value, what in sizes:
        int_at_least(value, f"synthetic: {what}", 1)
    space = ((depth,) if depth is not None else ()) + (height, width)
    rng = np.random.default_rng(seed)
    offsets = rng.standard_normal((classes, channels) + (1,) * len(space))
    patterns = rng.standard_normal((classes, channels) + space)
    y = rng.integers(0, classes, size=n, dtype=np.int64)
    x = offsets[y] + patterns[y] + rng.standard_normal((n, channels) + space)
    return x.astype(dtype), y


def synthetic_segmentation(n, channels, side, classes, seed=0, dtype=np.float32, cell=4):
    """Random images x (n, channels, side, side) and int64 labels y (n, side, side), one class
    a pixel, that can be learnt: each image's label map is a random map of cell x cell squares
    (a (side / cell)^2 map of classes drawn uniformly, nearest-upsampled), and a pixel of class
    k is mu_k (a fixed random offset per class and channel) plus unit Gaussian noise, so a
    pixel's class shows in its neighbourhood. Generated in float64 from `seed`."""
    for value, what in ((n, "n"), (channels, "channels"), (side, "side"), (classes, "classes"), (cell, "cell")):
        int_at_least(value, f"synthetic_segmentation: {what}", 1)
    if side % cell:
        raise ValueError(f"synthetic_segmentation: side {side} must be a multiple of the cell {cell}")
    rng = np.random.default_rng(seed)
    means = 1.5 * rng.standard_normal((classes, channels))
    coarse = rng.integers(0, classes, size=(n, side // cell, side // cell), dtype=np.int64)
    y = np.repeat(np.repeat(coarse, cell, axis=1), cell, axis=2)
    x = np.moveaxis(means[y], -1, 1) + rng.standard_normal((n, channels, side, side))
    return x.astype(dtype), y


SAMPLES = Layout(("sample",))  # a batch's samples split over the sample axis
AUGMENT_PADDING = 4  # random crop: zero-pad by 4 pixels per side, take an H x W window
AUGMENT_STREAM = 0x617567  # the augmentation's rng stream, apart from the shuffling's (seed, epoch)


def augment_batch(x, offsets, flips, padding=AUGMENT_PADDING):
    """Random crop and horizontal flip of a batch x (n, C, H, W), NumPy or CuPy, keeping its
    dtype: sample i is zero-padded by `padding` pixels on every side, the H x W window whose
    top-left corner is offsets[i] = (row, column), each in 0..2 * padding, is taken, and its
    columns are reversed where flips[i] is true. offsets: (n, 2) integers, flips: (n,) booleans
    (host arrays). Offsets (padding, padding) and no flip give the sample back unchanged."""
    xp = get_array_module(x)
    if x.ndim != 4:
        raise ValueError(f"augment_batch: x has shape {x.shape}; expected a batch (N, C, H, W)")
    offsets, flips = np.asarray(offsets), np.asarray(flips, dtype=bool)
    n, _, height, width = x.shape
    if offsets.shape != (n, 2) or flips.shape != (n,):
        raise ValueError(f"augment_batch: offsets {offsets.shape} and flips {flips.shape} for {n} samples; "
                         f"expected ({n}, 2) and ({n},)")
    if offsets.size and (offsets.min() < 0 or offsets.max() > 2 * padding):
        raise ValueError(f"augment_batch: offsets must be in 0..{2 * padding} (padding {padding}), "
                         f"got {int(offsets.min())}..{int(offsets.max())}")
    padded = xp.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    rows = offsets[:, :1] + np.arange(height)  # (n, H): the padded rows of each window
    columns = offsets[:, 1:] + np.arange(width)  # (n, W)
    columns = np.where(flips[:, None], columns[:, ::-1], columns)
    samples = xp.arange(n)[:, None, None, None]
    channels = xp.arange(x.shape[1])[None, :, None, None]
    return padded[samples, channels, xp.asarray(rows)[:, None, :, None], xp.asarray(columns)[:, None, None, :]]


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

    layout: a Layout of x's batches over the grid (its first dimension split by 'sample') that
    splits more than the samples, the first layer's input layout on a grid that splits depth,
    height, width or channels (ConvAlgorithm.input_layout): each rank then reads of each of its
    samples only its block, by slices of x, so that x may be a memory-mapped .npy
    (open_npy) of samples larger than a rank: no rank ever holds a whole sample. None: whole
    samples, the rank's block of the batch's samples.

    augment=True (training only; x must be (n, C, H, W)): every batch goes through
    augment_batch, with a crop offset and a flip per sample drawn for the whole global batch
    from (seed, epoch, batch number) on every rank alike, of which each rank applies its rows'.
    So the augmented global batch is the same on every grid, and a loader that starts at batch
    b of an epoch (a resumed run) gives the batches an uninterrupted one gave.
    """

    def __init__(self, x, y, batch_size, grid=None, shuffle=True, seed=0, drop_last=False, augment=False,
                 layout=None):
        if len(x) != len(y):
            raise ValueError(f"x has {len(x)} samples, y has {len(y)}")
        int_at_least(batch_size, "batch size", 1)
        if augment and x.ndim != 4:
            raise ValueError(f"augmentation crops and flips images: x has shape {x.shape}; "
                             f"expected (N, C, H, W)")
        if layout is not None:
            if grid is None or layout.ndim != x.ndim or layout.dims[0] is None or layout.dims[0].axis != "sample":
                raise ValueError(f"layout {layout}: a loader's blocks need a grid and a layout of x's {x.ndim} "
                                 f"dimensions whose first is split by 'sample'")
            if augment:
                raise ValueError("augmentation crops and flips whole images; a loader with a layout reads blocks "
                                 "of samples: expected augment=False with layout")
        self.layout = layout
        self.x, self.y = x, y
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.augment = augment
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

    def augmentation(self, epoch, batch, n_global):
        """(offsets (n_global, 2), flips (n_global,)) of batch number `batch` of epoch `epoch`,
        for the whole global batch: the same on every rank and grid."""
        rng = np.random.default_rng([self.seed, epoch, batch, AUGMENT_STREAM])
        offsets = rng.integers(0, 2 * AUGMENT_PADDING + 1, size=(n_global, 2))
        flips = rng.random(n_global) < 0.5
        return offsets, flips

    def __iter__(self):
        order = self.order(self.epoch)
        self.epoch += 1
        return self._batches(order, self.epoch - 1)

    def _batches(self, order, epoch):
        for b in range(len(self)):
            # (made by a call, so that this frame keeps no reference to a batch once the next
            # is asked for: one batch's blocks in memory at a time, not two)
            yield self._batch(order, epoch, b)

    def _batch(self, order, epoch, b):
        batch = order[b * self.batch_size:(b + 1) * self.batch_size]
        n_global = len(batch)
        # Only this rank's block is copied out, never the whole batch.
        block = self.block(n_global)
        rows = batch[block]
        x_local = _take_rows(self.x, rows) if self.layout is None else read_blocks(self.x, rows, n_global, self.layout,
                                                                                  self.grid)
        if self.augment:  # drawn for the whole batch, applied to this rank's block of it
            offsets, flips = self.augmentation(epoch, b, n_global)
            x_local = augment_batch(x_local, offsets[block], flips[block])
        return x_local, _take_rows(self.y, rows), n_global

    def block(self, n_global):
        """This rank's rows of a batch of n_global samples: the sample layout's block."""
        if self.grid is None:
            return slice(0, n_global)
        (rows,) = SAMPLES.indices((n_global,), self.grid, self.grid.coords)
        return slice(rows.start, rows.stop)


def load_arrays(source, dtype=np.float64):
    """A dataset of samples too large to read whole: from the directory `source` ('npy:DIR':
    x_train.npy and x_test.npy memory-mapped read-only, y_train.npy and y_test.npy read) or an
    HDF5 file ('h5:FILE': its arrays x_train, y_train, x_test, y_test; the x arrays opened
    unread, open_hdf5). x: (N, C, H, W) images or (N, C, D, H, W) volumes of `dtype`, used as
    they are (nothing is read until a loader slices them); y: integer labels 0..K-1, one a
    sample, (N,), or one a pixel or voxel, (N, *S), for segmentation. Returns (x_train,
    y_train, x_test, y_test, classes); ValueError naming the file and the array for any
    problem."""
    kind, path = source.split(":", 1)
    if kind == "npy" and not os.path.isdir(path):
        raise ValueError(f"dataset {source}: {path!r} is not a directory (of x_train.npy, y_train.npy, x_test.npy, "
                         f"y_test.npy)")
    arrays = {}
    for name in ("x_train", "y_train", "x_test", "y_test"):
        where = f"dataset {source} array {name}"
        if kind == "npy":
            array = load_array(os.path.join(path, f"{name}.npy"), where, mmap_mode="r" if name[0] == "x" else None)
        else:
            array = open_hdf5(path, name, f"dataset {source}")
            array = array if name[0] == "x" else np.asarray(array[()])
        if name[0] == "x" and (array.ndim not in (4, 5) or array.dtype != np.dtype(dtype)):
            raise ValueError(f"{where} has shape {array.shape} and dtype {array.dtype}; expected (N, C, H, W) or "
                             f"(N, C, D, H, W) of {np.dtype(dtype)} (the run's --dtype: it is read as it is)")
        if name[0] == "y":
            x = arrays[f"x{name[1:]}"]
            array = _labels(array, len(x), where, x.shape[2:])
        arrays[name] = array
    if arrays["x_test"].shape[1:] != arrays["x_train"].shape[1:] or \
            arrays["y_test"].ndim != arrays["y_train"].ndim:
        raise ValueError(f"dataset {source}: the test samples {arrays['x_test'].shape[1:]} and labels "
                         f"{arrays['y_test'].shape[1:]} differ from the training ones {arrays['x_train'].shape[1:]}, "
                         f"{arrays['y_train'].shape[1:]}")
    classes = int(max(arrays["y_train"].max(initial=0), arrays["y_test"].max(initial=0))) + 1
    return arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"], classes


def read_blocks(x, rows, n_global, layout, grid):
    """(len(rows), ...) this rank's block, under `layout` on `grid`, of each sample of x in
    `rows` (the layout's index sets past the sample dimension, for a batch of n_global
    samples), each read into one fresh array by one slice of x per sample (a memory map reads
    only those pages, an HDF5 dataset only those chunks), an index set that is not a range
    then taken from what the slice read."""
    ix = layout.indices((n_global,) + tuple(x.shape[1:]), grid, grid.coords)[1:]
    ranges = tuple(isinstance(i, range) and i.step == 1 for i in ix)
    window = tuple(slice(i.start, i.stop) if whole else slice(min(i, default=0), max(i, default=-1) + 1)
                   for i, whole in zip(ix, ranges))
    blocks = np.empty((len(rows),) + tuple(len(i) for i in ix), x.dtype)
    for k, r in enumerate(rows):
        sample = x[(int(r),) + window]
        for axis, (i, whole, w) in enumerate(zip(ix, ranges, window)):
            if not whole:  # the index set's positions within the window read
                sample = sample[(slice(None),) * axis + (np.asarray(i) - w.start,)]
        blocks[k] = sample
    return blocks


def open_hdf5(path, name, what="dataset"):
    """The array `name` of the HDF5 file `path` as an h5py Dataset, opened read-only: nothing
    is read until sliced, so a ShardedLoader with a layout reads each rank's blocks only.
    Needs h5py (the `hdf5` extra); ValueError naming the file and the array otherwise."""
    try:
        import h5py
    except ImportError:
        raise ValueError(f"{what} {path!r} is an HDF5 file: reading it needs h5py (pip install h5py, or cfp's "
                         f"hdf5 extra)") from None
    if not os.path.isfile(path):
        raise ValueError(f"{what} {path!r} does not exist")
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise ValueError(f"{what} {path!r} is not a readable HDF5 file: {e}") from None
    if name not in f or not isinstance(f[name], h5py.Dataset):
        found = ", ".join(k for k in f if isinstance(f[k], h5py.Dataset)) or "none"
        f.close()
        raise ValueError(f"{what} {path!r} has no array {name!r}; its arrays: {found}")
    return f[name]  # (the file stays open while the dataset is referenced)


def open_npy(path, what="input"):
    """The array of the .npy file `path` memory-mapped read-only, for a ShardedLoader with a
    layout (io.load_array's checks and messages)."""
    return load_array(path, what, mmap_mode="r")


def _take_rows(array, rows):
    """array[rows] for a NumPy or CuPy array, rows a NumPy index array."""
    return array[get_array_module(array).asarray(rows)]
