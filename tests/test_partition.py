"""Block partition arithmetic: balanced, empty blocks allowed, every index owned once."""
import numpy as np
import pytest

from cfp.partition import block_offsets, block_owner, block_range, block_size, block_sizes


@pytest.mark.parametrize("extent,parts,expected", [
    (7, 3, [3, 2, 2]), (2, 4, [1, 1, 0, 0]), (8, 4, [2, 2, 2, 2]), (0, 3, [0, 0, 0]),
    (10, 4, [3, 3, 2, 2]), (5, 1, [5]),
])
def test_block_sizes(extent, parts, expected):
    assert block_sizes(extent, parts) == expected
    assert block_offsets(extent, parts) == list(np.cumsum([0] + expected[:-1]))


@pytest.mark.parametrize("extent", range(0, 13))
@pytest.mark.parametrize("parts", range(1, 6))
def test_blocks_tile_the_extent(extent, parts):
    covered = []
    for k in range(parts):
        start, stop = block_range(extent, parts, k)
        assert stop - start == block_size(extent, parts, k) == block_sizes(extent, parts)[k]
        covered.extend(range(start, stop))
        for i in range(start, stop):
            assert block_owner(extent, parts, i) == k
    assert covered == list(range(extent))
    sizes = block_sizes(extent, parts)
    assert max(sizes) - min(sizes) <= 1


def test_numpy_integers_are_accepted():
    assert block_sizes(np.int64(7), np.int32(3)) == [3, 2, 2]


@pytest.mark.parametrize("call,match", [
    (lambda: block_sizes(7, 0), "number of parts must be an integer >= 1, got 0"),
    (lambda: block_sizes(-1, 2), "extent must be an integer >= 0, got -1"),
    (lambda: block_sizes(7.5, 2), "extent must be an integer >= 0, got 7.5"),
    (lambda: block_sizes(7, 2.0), "number of parts must be an integer >= 1, got 2.0"),
    (lambda: block_range(7, 3, 3), "block index 3 outside 0..2"),
    (lambda: block_owner(7, 3, 7), "index 7 outside 0..6"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()
