"""The cost model of the convolution algorithms: bytes each rank sends and receives per phase.

Worked out from shapes and the partition arithmetic alone (never from the ledger), so that the
ledger of a real run can be checked against it exactly. The byte convention is comm.py's: each
element counted where it leaves a rank and where it arrives, never a rank's own block.
"""
from .grid import parse_grid_spec
from .kernels import conv2d_output_shape
from .partition import (block_size, block_sizes, check_filter_groups, default_filter_groups,
                        gather_group, scatter_group, union_of_blocks)

PHASES = ("forward", "backward-filter", "backward-data", "gradient-sync")
ALGORITHM_NAMES = ("sample", "x", "y", "w")


def _allgather(sizes, me, unit):
    """(sent, received) by member `me` of an allgather of blocks `sizes` (in units of `unit` bytes)."""
    own = sizes[me]
    return (len(sizes) - 1) * own * unit, (sum(sizes) - own) * unit


def _reduce_scatter(sizes, me, unit):
    sent, received = _allgather(sizes, me, unit)
    return received, sent


def _allreduce(count, p, me, itemsize):
    own = block_sizes(count, p)[me]
    moved = ((count - own) + (p - 1) * own) * itemsize
    return moved, moved


def predict_bytes(algorithm, x_shape, w_shape, grid, coords, stride=1, padding=0,
                  filter_groups=None, bias=True, input_replicated=False, itemsize=8):
    """{phase: (bytes sent, bytes received)} of one forward and backward pass of a convolution.

    x_shape (N, C, H, W) and w_shape (F, C, Kh, Kw) are global; `grid` is a spec or dict of
    axis sizes ('sample=2,channel=2'); `coords` the rank's {'sample': s, 'channel': c}.
    With one algorithm, p_f = 1 is stationary-x's and p_f = P_c stationary-y's data movement:
    forward, allgather x within a row of p_f ranks and reduce-scatter y within a column of q;
    backward-filter, allgather dy within the column; backward-data, reduce-scatter dx within
    the row; gradient-sync, allreduce the dw and db shards over the P_n ranks sharing them.
    """
    if algorithm not in ALGORITHM_NAMES:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHM_NAMES)}")
    sizes = parse_grid_spec(grid)
    P_n, P_c = sizes.get("sample", 1), sizes.get("channel", 1)
    s, c = coords.get("sample", 0), coords.get("channel", 0)
    N, C, H, W = x_shape
    F, _, Kh, Kw = w_shape
    _, _, Ho, Wo = conv2d_output_shape(x_shape, w_shape, stride, padding)
    n = block_size(N, P_n, s)
    x_unit = n * H * W * itemsize  # bytes of one input channel of the local samples
    y_unit = n * Ho * Wo * itemsize
    out = {phase: (0, 0) for phase in PHASES}

    if algorithm == "sample":
        w_count = F * C * Kh * Kw + (F if bias else 0)
    else:
        p_f = {"x": 1, "y": P_c}.get(algorithm)
        if p_f is None:
            p_f = default_filter_groups(P_c) if filter_groups is None else filter_groups
        check_filter_groups(P_c, p_f)
        row, column = gather_group(c, P_c, p_f), scatter_group(c, P_c, p_f)
        row_sizes = [block_size(C, P_c, k) for k in row]
        column_sizes = [block_size(F, P_c, k) for k in column]
        me_in_row, me_in_column = row.index(c), column.index(c)
        x_gather = (0, 0) if input_replicated else _allgather(row_sizes, me_in_row, x_unit)
        y_scatter = _reduce_scatter(column_sizes, me_in_column, y_unit)
        out["forward"] = (x_gather[0] + y_scatter[0], x_gather[1] + y_scatter[1])
        out["backward-filter"] = _allgather(column_sizes, me_in_column, y_unit)
        out["backward-data"] = (0, 0) if input_replicated else _reduce_scatter(row_sizes, me_in_row, x_unit)
        w_count = (len(union_of_blocks(F, P_c, column)) * len(union_of_blocks(C, P_c, row)) * Kh * Kw
                   + (block_size(F, P_c, c) if bias else 0))
    out["gradient-sync"] = _allreduce(w_count, P_n, s, itemsize)
    return out


def ledger_bytes(ledger, layer=None):
    """{phase: (sent, received)} from a CommLedger, in the shape predict_bytes returns."""
    out = {phase: (0, 0) for phase in PHASES}
    for r in ledger.records:
        if (layer is None or r.layer == layer) and r.phase in out:
            sent, received = out[r.phase]
            out[r.phase] = (sent + r.bytes_sent, received + r.bytes_received)
    return out
