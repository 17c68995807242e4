"""Block partition arithmetic: how an extent is split over k parts.

The split is balanced: the first `extent % parts` blocks hold one element more than the others,
and blocks are empty when extent < parts (7 over 3 gives 3, 2, 2; 2 over 4 gives 1, 1, 0, 0).
Every index computation of cfp goes through here, so the whole code base agrees on it.
"""


import operator


def _as_int(value, what, minimum):
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}") from None
    if number < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return number


def _check(extent, parts):
    return _as_int(extent, "extent", 0), _as_int(parts, "number of parts", 1)


def block_sizes(extent, parts):
    """Sizes of the `parts` blocks of `extent`, largest first: [3, 2, 2] for (7, 3)."""
    extent, parts = _check(extent, parts)
    base, extra = divmod(extent, parts)
    return [base + 1 if k < extra else base for k in range(parts)]


def block_offsets(extent, parts):
    """Start index of each block: [0, 3, 5] for (7, 3)."""
    offsets, start = [], 0
    for size in block_sizes(extent, parts):
        offsets.append(start)
        start += size
    return offsets


def block_range(extent, parts, k):
    """(start, stop) of block k."""
    extent, parts = _check(extent, parts)
    if not 0 <= k < parts:
        raise ValueError(f"block index {k!r} outside 0..{parts - 1}")
    base, extra = divmod(extent, parts)
    start = k * base + min(k, extra)
    return start, start + base + (1 if k < extra else 0)


def block_size(extent, parts, k):
    start, stop = block_range(extent, parts, k)
    return stop - start


def block_owner(extent, parts, index):
    """The block that holds `index` (0 <= index < extent)."""
    extent, parts = _check(extent, parts)
    if not 0 <= index < extent:
        raise ValueError(f"index {index!r} outside 0..{extent - 1}")
    base, extra = divmod(extent, parts)
    big = extra * (base + 1)  # indices held by the larger blocks
    if index < big:
        return index // (base + 1)
    return extra + (index - big) // base
