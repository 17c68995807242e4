"""Block partition arithmetic: how an extent is split over k parts.

The split is balanced: the first `extent % parts` blocks hold one element more than the others,
and blocks are empty when extent < parts (7 over 3 gives 3, 2, 2; 2 over 4 gives 1, 1, 0, 0).
Every index computation of cfp goes through here, so the whole code base agrees on it.
"""


from .checks import int_at_least


def _check(extent, parts):
    return int_at_least(extent, "extent", 0), int_at_least(parts, "number of parts", 1)


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


# ---------------------------------------------------------------------------------------------
# Channel groups of the stationary-w algorithm: P_c = q * p_f channel ranks, rank c at
# (i, j) = divmod(c, p_f). Rank c gathers x within its row {i * p_f + j' : j'} (p_f ranks) and
# reduce-scatters y within its column {i' * p_f + j : i'} (q ranks). Stationary-x is the case
# p_f = 1 (rows of one rank), stationary-y the case p_f = P_c (columns of one rank).


def check_filter_groups(channel_parts, filter_groups):
    """p_f must be a positive integer dividing P_c; returns q = P_c // p_f."""
    channel_parts = int_at_least(channel_parts, "channel grid size", 1)
    p_f = int_at_least(filter_groups, "filter groups p_f", 1)
    if channel_parts % p_f:
        divisors = [d for d in range(1, channel_parts + 1) if channel_parts % d == 0]
        raise ValueError(f"filter groups p_f={p_f} does not divide the channel grid size "
                         f"P_c={channel_parts}; expected one of {divisors}")
    return channel_parts // p_f


def default_filter_groups(channel_parts):
    """The p_f stationary-w uses when none is given: the divisor of P_c nearest sqrt(P_c)
    from below (a 2 x 2 split of P_c = 4)."""
    channel_parts = int_at_least(channel_parts, "channel grid size", 1)
    return max(d for d in range(1, channel_parts + 1)
               if channel_parts % d == 0 and d * d <= channel_parts)


def row_and_column(c, filter_groups):
    """(row, column) of channel rank c: divmod(c, p_f)."""
    return divmod(c, filter_groups)


def gather_group(c, channel_parts, filter_groups):
    """The channel coordinates whose x blocks rank c gathers (its row), in group rank order."""
    check_filter_groups(channel_parts, filter_groups)
    i, _ = row_and_column(c, filter_groups)
    return [i * filter_groups + j for j in range(filter_groups)]


def scatter_group(c, channel_parts, filter_groups):
    """The channel coordinates among which rank c reduce-scatters y (its column), in order."""
    q = check_filter_groups(channel_parts, filter_groups)
    _, j = row_and_column(c, filter_groups)
    return [i * filter_groups + j for i in range(q)]


def union_of_blocks(extent, parts, members):
    """The indices of blocks `members` of `extent` over `parts`, concatenated in that order.

    The channel indices held by a gather group, or the filter indices a scatter group reduces:
    a contiguous range for a row of consecutive ranks, strided blocks for a column.
    """
    indices = []
    for k in members:
        start, stop = block_range(extent, parts, k)
        indices.extend(range(start, stop))
    return indices
