"""kvcache.ledger.copy: whole pages copied between pools, byte for byte."""

import numpy as np
import pytest
import torch

from kvcache.ledger.copy import copy_pages, copy_rows
from kvcache.ledger.pools import SlotPool, page_rows


def test_copy_pages_moves_exact_bytes():
    src = SlotPool("device", 8, 2, 16)
    dst = SlotPool("host", 8, 2, 16)
    src.storage.copy_(torch.randint(0, 256, src.storage.shape, dtype=torch.uint8))
    dst.storage.zero_()
    assert copy_pages(src, np.array([5, 1, 3]), dst, np.array([0, 7, 2])) is None
    for s, d in ((5, 0), (1, 7), (3, 2)):
        assert torch.equal(src.pages[s], dst.pages[d])
    assert int(dst.pages[[1, 3, 4, 5, 6]].sum()) == 0


def test_copy_pages_length_mismatch():
    p = SlotPool("device", 4, 1, 8)
    with pytest.raises(ValueError):
        copy_pages(p, np.array([0, 1]), p, np.array([2]))


@pytest.mark.parametrize("row_bytes", [64, 8192])
def test_copy_rows_matches_fancy_indexing(row_bytes):
    rng = np.random.default_rng(row_bytes)
    src = rng.integers(0, 256, (40, row_bytes), dtype=np.uint8)
    for src_rows, dst_rows in ((np.arange(10, 30), np.arange(0, 20)),  # one run
                               (np.array([3, 4, 5, 9, 1, 2]), np.array([7, 8, 9, 10, 0, 1])),  # runs break
                               (rng.permutation(40)[:17], rng.permutation(40)[:17])):  # no runs
        want = np.zeros((40, row_bytes), dtype=np.uint8)
        want[dst_rows] = src[src_rows]
        got = np.zeros_like(want)
        copy_rows(page_rows(got), dst_rows, page_rows(src), src_rows)
        assert np.array_equal(got, want)
