"""kvcache.ledger.rows: page rows copied on the CPU, byte for byte as numpy's fancy indexing copies them, over
page patterns generated from their parts (which pages, in which order, on each side) and rows short and long."""

import itertools

import numpy as np
import pytest

from kvcache.ledger.pools import page_rows
from kvcache.ledger.rows import SpanRows, copy_rows

POOL = 48


def pattern(kind, rng, n):
    """(destination rows, source rows) of `n` pages out of POOL on each side."""
    picks = {
        "run": lambda: np.arange((POOL - n) // 2, (POOL - n) // 2 + n),
        "permutation": lambda: rng.permutation(POOL)[:n] if n < POOL else rng.permutation(POOL),
        "sparse": lambda: rng.choice(POOL, n, replace=False),
        "runs_that_break": lambda: np.roll(np.arange(POOL), POOL // 3)[:n],  # 32 .. 47, then 0 ..
    }
    return picks[kind](), picks[kind]()


KINDS = ("run", "permutation", "sparse", "runs_that_break")
CASES = list(itertools.product(KINDS, KINDS, (1, 17, POOL), (64, 8192)))


def rows(width, seed):
    return np.random.default_rng(seed).integers(0, 256, (POOL, width), dtype=np.uint8)


@pytest.mark.parametrize("dst_kind, src_kind, n, width", CASES)
def test_both_copies_move_what_fancy_indexing_moves(dst_kind, src_kind, n, width):
    rng = np.random.default_rng(n * width)
    dst_rows, _ = pattern(dst_kind, rng, n)
    _, src_rows = pattern(src_kind, rng, n)
    src = rows(width, 1)
    want = rows(width, 2)
    before = want.copy()
    want[dst_rows] = src[src_rows]
    got = before.copy()
    copy_rows(page_rows(got), dst_rows, page_rows(src), src_rows)
    assert np.array_equal(got, want)
    got = before.copy()
    SpanRows(dst_rows, src_rows).apply(page_rows(got), page_rows(src))
    assert np.array_equal(got, want)


def test_one_plan_serves_every_span_and_a_strided_side():
    """An engine's spans: the same pages of each, into a host page's columns (rows strided by a page)."""
    rng = np.random.default_rng(7)
    spans = [rows(32, i) for i in range(4)]
    host = np.zeros((POOL, 4 * 32), dtype=np.uint8)
    src_pages, dst_pages = rng.permutation(POOL)[:40], rng.permutation(POOL)[:40]
    plan = SpanRows(dst_pages, src_pages)
    for j, span in enumerate(spans):
        plan.apply(page_rows(host[:, j * 32:(j + 1) * 32]), page_rows(span))
    assert np.array_equal(host[dst_pages], np.concatenate([s[src_pages] for s in spans], axis=1))


def test_a_permutation_is_one_stretch_and_scattered_pages_keep_the_row_copy():
    rng = np.random.default_rng(3)
    assert SpanRows(rng.permutation(POOL), rng.permutation(POOL)).stretches is not None
    assert len(SpanRows(rng.permutation(POOL), rng.permutation(POOL)).stretches) == 1
    assert SpanRows(np.arange(8), np.arange(0, 32, 4)).stretches is None  # 8 stretches of one page each
