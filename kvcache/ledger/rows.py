"""Copies of page rows on the CPU (numpy): ``dst[dst_rows] = src[src_rows]`` over 1-D arrays of opaque rows
(`pools.page_rows`), with as few passes over the bytes, and as few calls, as the pages allow.

- `copy_rows`: one copy of whole pages (kvc's own pools, whose rows are pages). Long rows go run by run (stretches
  where both sides are consecutive), one memcpy each; short rows by numpy's fancy indexing, whose per-call cost is
  lower than one copy per run.
- `SpanRows`: one copy of the same pages over many spans (an engine's tensors: 64 for 32 layers), planned once and
  applied to every span. When the source pages, sorted, fall into few stretches of consecutive pages (a
  permutation of a pool's pages is one), each stretch is one numpy scatter from a plain slice of the source: one
  pass, no temporary. Moving 64 spans a page is a transpose, though: one side moves in pieces of a span's width
  (2 KiB at 128 KiB pages) wherever the pages lie, and on the CPU that side, not the calls, sets the pace.
"""

from __future__ import annotations

import numpy as np

_RUN_COPY_MIN_BYTES = 4096  # rows at least this long are copied run by run; shorter ones by fancy indexing
_FEW_STRETCHES = 8  # a copy goes by source stretches when they average at least this many pages


def copy_rows(dst: np.ndarray, dst_rows: np.ndarray, src: np.ndarray, src_rows: np.ndarray) -> None:
    """dst[dst_rows] = src[src_rows] for 1-D arrays of page rows (`pools.page_rows`), without the temporary a
    fancy-indexed copy makes where rows are long.

    Long rows go run by run (stretches where both sides are consecutive), one memcpy each: pages allocated
    together are mostly consecutive, and this halves the bytes moved. Short rows keep numpy's fancy indexing,
    whose per-call cost is lower than one copy per run.
    """
    if dst.itemsize < _RUN_COPY_MIN_BYTES:
        dst[dst_rows] = src[src_rows]
        return
    n = len(src_rows)
    cuts = (np.flatnonzero((np.diff(src_rows) != 1) | (np.diff(dst_rows) != 1)) + 1).tolist()
    for a, b in zip([0, *cuts], [*cuts, n], strict=True):
        s0, d0 = int(src_rows[a]), int(dst_rows[a])
        np.copyto(dst[d0:d0 + b - a], src[s0:s0 + b - a])


class SpanRows:
    """How one copy moves the rows of its pages in every span: worked out once, applied span by span."""

    def __init__(self, dst_pages: np.ndarray, src_pages: np.ndarray) -> None:
        self.dst_pages = dst_pages
        self.src_pages = src_pages
        order = np.argsort(src_pages, kind="stable")
        by_source = src_pages[order]
        cuts = (np.flatnonzero(np.diff(by_source) != 1) + 1).tolist()
        # (first source page, the destination pages of the stretch from there), or None: too many stretches, and
        # each span goes as `copy_rows` does
        self.stretches: list[tuple[int, np.ndarray]] | None = None
        if (len(cuts) + 1) * _FEW_STRETCHES <= len(src_pages):
            to = dst_pages[order]
            self.stretches = [(int(by_source[a]), to[a:b]) for a, b in zip([0, *cuts], [*cuts, len(order)],
                                                                            strict=True)]

    def apply(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Copy the planned pages of one span: ``dst[dst_pages] = src[src_pages]`` over its page rows."""
        if self.stretches is None:
            copy_rows(dst, self.dst_pages, src, self.src_pages)
            return
        for first, to in self.stretches:
            dst[to] = src[first:first + len(to)]
