"""Synthetic KV: page bytes that are a function of the page hash, so every reused page can be checked.

A page hash folds in the layout, the namespace and the whole prefix (`kvcache.keys`). Writing each page's KV as
a function of its hash makes any page served to the wrong namespace, from a stale layout, out of order, or from a
slot reused while still owned differ from what recomputing gives: replays (`kvc replay --verify`) compare every
reused byte.

The function: the 16-byte hash as two little-endian 64-bit words, XOR-ed with a per-row constant (so the token
rows of one page differ from each other), repeated across the row. Checking a page needs only its 16-byte
pattern per row, never a materialised expected page: the compare reads each byte once, against a pattern that
stays in cache, in chunks small enough to stay there too — cheaper than the copy it checks, which reads and
writes every byte (`benchmarks/bench_replay.py` measures the ratio).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .keys import PAGE_HASH_BYTES
from .layout import KVLayout

_ROW_MIX = np.uint64(0x9E3779B97F4A7C15)  # golden-ratio constant: consecutive rows get unrelated patterns
_CHECK_CHUNK_BYTES = 1 << 20  # pages gathered per compare: large enough to amortise, small enough for L2 cache


class SyntheticKV:
    """Deterministic page contents for one layout, and the check that recomputes them."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.page_size = layout.page_size
        self.row_bytes = layout.bytes_per_token  # bytes of one token's KV across layers, K and V
        self.page_bytes = self.page_size * self.row_bytes
        # rows whose size is a multiple of the pattern are checked as 64-bit words; others byte by byte
        self._words = self.row_bytes % PAGE_HASH_BYTES == 0
        mix = (np.arange(1, self.page_size + 1, dtype=np.uint64) * _ROW_MIX)
        self._mix = np.repeat(mix, 2).reshape(self.page_size, 2)  # [row, word]

    def patterns(self, hashes: Sequence[bytes]) -> np.ndarray:
        """[pages, page_size, 2] uint64: the 16-byte pattern of every row of every page."""
        words = np.frombuffer(b"".join(hashes), dtype="<u8").reshape(len(hashes), 1, 2)
        return words ^ self._mix[None]

    def pages(self, hashes: Sequence[bytes]) -> torch.Tensor:
        """[pages, page_bytes] uint8: the contents of these pages."""
        pat = self.patterns(hashes).view(np.uint8).reshape(len(hashes), self.page_size, PAGE_HASH_BYTES)
        reps = -(-self.row_bytes // PAGE_HASH_BYTES)
        rows = np.tile(pat, (1, 1, reps))[:, :, : self.row_bytes]
        return torch.from_numpy(np.ascontiguousarray(rows).reshape(len(hashes), self.page_bytes))

    def write(self, page_rows: torch.Tensor, pages: np.ndarray, hashes: Sequence[bytes]) -> None:
        """Write the contents of `hashes` into rows `pages` of a pool's [pages, page_bytes] view."""
        if len(pages):
            idx = torch.from_numpy(np.asarray(pages, dtype=np.int64))
            page_rows.index_copy_(0, idx.to(page_rows.device), self.pages(hashes).to(page_rows.device))

    def mismatches(self, page_rows: torch.Tensor, pages: np.ndarray, hashes: Sequence[bytes]) -> np.ndarray:
        """Indices (into `pages`) of the pages whose bytes differ from the contents of their hash."""
        n = len(pages)
        if n != len(hashes):
            raise ValueError(f"{n} pages but {len(hashes)} hashes")
        bad: list[np.ndarray] = []
        step = max(1, _CHECK_CHUNK_BYTES // self.page_bytes)
        idx_all = torch.from_numpy(np.asarray(pages, dtype=np.int64)).to(page_rows.device)
        for at in range(0, n, step):
            chunk = page_rows.index_select(0, idx_all[at:at + step])
            hs = hashes[at:at + step]
            if self._words:
                got = chunk.view(torch.int64).view(len(hs), self.page_size, -1, 2)
                want = torch.from_numpy(self.patterns(hs).view(np.int64)).to(chunk.device)
                same = (got == want[:, :, None, :]).flatten(1).all(dim=1)
            else:
                same = (chunk == self.pages(hs).to(chunk.device)).all(dim=1)
            wrong = torch.nonzero(~same).flatten().cpu().numpy()
            if len(wrong):
                bad.append(wrong + at)
        return np.concatenate(bad) if bad else np.empty(0, dtype=np.int64)
