"""Copies of whole pages between two slot pools: real tensor copies, the bytes under every ledger move.

Host-side gathers and scatters run through numpy (fancy indexing over the pool's page rows, one opaque element per
page), several times faster than `torch` indexing with few threads. A copy into a CUDA pool is queued on the current
stream and completes when its event does; a copy out of one waits for itself.
"""

from __future__ import annotations

import numpy as np
import torch

from .pools import SlotPool, page_rows

_RUN_COPY_MIN_BYTES = 4096  # rows at least this long are copied run by run; shorter ones by fancy indexing


def copy_rows(dst: np.ndarray, dst_rows: np.ndarray, src: np.ndarray, src_rows: np.ndarray) -> None:
    """dst[dst_rows] = src[src_rows] for 1-D arrays of page rows (`pools.page_rows`), without the temporary a
    fancy-indexed copy makes.

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


def copy_pages(src: SlotPool, src_pages: np.ndarray, dst: SlotPool, dst_pages: np.ndarray) -> torch.cuda.Event | None:
    """Copy whole pages `src_pages` of `src` into `dst_pages` of `dst`. Returns an event to wait on when the copy
    was queued on a CUDA stream, None when it has completed."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"copy of {len(src_pages)} pages into {len(dst_pages)}")
    if not len(src_pages):
        return None
    if dst.page_rows is not None:
        if src.page_rows is not None:
            copy_rows(dst.page_rows, dst_pages, src.page_rows, src_pages)
            return None
        # Device -> host: the gathered rows must have landed before the CPU scatters them, so this direction
        # waits for its own copy (a non-blocking D2H followed by a CPU read would race).
        rows = src.pages.index_select(0, torch.from_numpy(np.ascontiguousarray(src_pages)).to(src.device)).cpu()
        copy_rows(dst.page_rows, dst_pages, page_rows(rows.numpy()), np.arange(len(dst_pages)))
        return None
    # Host (or device) -> device: gather on the source, copy, scatter on the destination stream; the host rows are
    # staged by the H2D copy itself, so nothing on the host side is read after this call returns.
    if src.page_rows is not None:
        rows = torch.from_numpy(src.page_rows[src_pages].view(np.uint8).reshape(len(src_pages), src.page_bytes))
    else:
        rows = src.pages.index_select(0, torch.from_numpy(np.ascontiguousarray(src_pages)).to(src.device))
    dst_idx = torch.from_numpy(np.ascontiguousarray(dst_pages)).to(dst.device, non_blocking=True)
    dst.pages.index_copy_(0, dst_idx, rows.to(dst.device, non_blocking=True))
    event = torch.cuda.Event()
    event.record()
    return event
