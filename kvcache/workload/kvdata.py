"""Synthetic KV: page bytes that are a function of the page hash, so every reused page can be checked.

A page hash folds in the layout, the namespace and the whole prefix (`kvcache.types.keys`). Writing each page's KV as
a function of its hash makes any page served to the wrong namespace, from a stale layout, out of order, or from a
slot reused while still owned differ from what recomputing gives: replays (`kvc replay --verify`) compare every
reused byte.

The function: the 16-byte hash as two little-endian 64-bit words, XOR-ed with a per-row constant (so the token
rows of one page differ from each other), repeated across the row.

The check reads every byte of every page once, in place: on the CPU it hashes the page (XXH3-128, tens of GB/s
per core) and compares the digest with that of the page its hash prescribes — computed once per page hash and
remembered, since a cache serves the same pages again and again. That costs well under the copy it checks,
which reads and writes every byte (`benchmarks/bench_replay.py` measures the ratio). A pool on another device
is compared element by element there, against the 16-byte row patterns.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from ..types.ids import PageHash
from ..types.keys import PAGE_HASH_BYTES
from ..types.layout import KVLayout

_ROW_MIX = np.uint64(0x9E3779B97F4A7C15)  # golden-ratio constant: consecutive rows get unrelated patterns
_CHECK_CHUNK_BYTES = 1 << 20  # pages gathered per compare on a device: large enough to amortise the launches
_LEARN_BATCH_BYTES = 512 << 10  # pages generated at once to learn digests: stays in cache
_DIGEST_CACHE = 1 << 18  # page hashes whose expected digest is remembered (~40 MiB at most), then start over


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
        self._digests: dict[PageHash, int] = {}  # page hash -> XXH3-128 of the page it prescribes
        self._scratch: np.ndarray | None = None  # pages generated to learn their digests

    def patterns(self, hashes: Sequence[PageHash]) -> np.ndarray:
        """[pages, page_size, 2] uint64: the 16-byte pattern of every row of every page."""
        words = np.frombuffer(b"".join(hashes), dtype="<u8").reshape(len(hashes), 1, 2)
        return words ^ self._mix[None]

    def pages(self, hashes: Sequence[PageHash]) -> torch.Tensor:
        """[pages, page_bytes] uint8: the contents of these pages."""
        out = np.empty((len(hashes), self.page_bytes), dtype=np.uint8)
        self._fill(hashes, out)
        return torch.from_numpy(out)

    def _fill(self, hashes: Sequence[PageHash], out: np.ndarray) -> None:
        """Write the contents of `hashes` into `out` ([len(hashes), page_bytes] uint8, C-contiguous): each row's
        pattern, then the row doubled onto itself (a few long copies rather than many 16-byte ones)."""
        rows = out.reshape(len(hashes) * self.page_size, self.row_bytes)
        first = min(PAGE_HASH_BYTES, self.row_bytes)
        rows[:, :first] = self.patterns(hashes).view(np.uint8).reshape(len(rows), PAGE_HASH_BYTES)[:, :first]
        filled = first
        while filled < self.row_bytes:
            k = min(filled, self.row_bytes - filled)
            rows[:, filled:filled + k] = rows[:, :k]
            filled += k

    def write(self, page_rows: torch.Tensor, pages: np.ndarray, hashes: Sequence[PageHash]) -> None:
        """Write the contents of `hashes` into rows `pages` of a pool's [pages, page_bytes] view."""
        if len(pages):
            idx = torch.from_numpy(np.asarray(pages, dtype=np.int64))
            page_rows.index_copy_(0, idx.to(page_rows.device), self.pages(hashes).to(page_rows.device))

    def digest(self, page_hash: PageHash) -> int:
        """XXH3-128 of the contents of `page_hash` (remembered)."""
        d = self._digests.get(page_hash)
        if d is None:
            if len(self._digests) >= _DIGEST_CACHE:
                self._digests.clear()
            d = self._digests[page_hash] = xxhash.xxh3_128_intdigest(self.pages([page_hash]).numpy().data)
        return d

    def _learn(self, hashes: list[PageHash]) -> None:
        """Compute the expected digests of `hashes` in one batch (pages generated together, hashed row by row)."""
        if not hashes:
            return
        if len(self._digests) + len(hashes) > _DIGEST_CACHE:
            self._digests.clear()
        h128 = xxhash.xxh3_128_intdigest
        if self._scratch is None:  # reused: a fresh large buffer per call costs page faults, not copies
            self._scratch = np.empty((max(1, _LEARN_BATCH_BYTES // self.page_bytes), self.page_bytes), np.uint8)
        step = len(self._scratch)
        for at in range(0, len(hashes), step):
            chunk = hashes[at:at + step]
            rows = self._scratch[: len(chunk)]
            self._fill(chunk, rows)
            for h, row in zip(chunk, rows, strict=True):
                self._digests[h] = h128(row)

    def mismatches(self, page_rows: torch.Tensor, pages: np.ndarray, hashes: Sequence[PageHash]) -> np.ndarray:
        """Indices (into `pages`) of the pages whose bytes differ from the contents of their hash."""
        if len(pages) != len(hashes):
            raise ValueError(f"{len(pages)} pages but {len(hashes)} hashes")
        if page_rows.device.type != "cpu":
            return self._mismatches_on_device(page_rows, pages, hashes)
        rows = page_rows.numpy()
        self._learn([h for h in hashes if h not in self._digests])
        digest, h128 = self.digest, xxhash.xxh3_128_intdigest
        bad = [i for i, (p, h) in enumerate(zip(np.asarray(pages).tolist(), hashes, strict=True))
               if h128(rows[p]) != digest(h)]
        return np.asarray(bad, dtype=np.int64)

    def _mismatches_on_device(self, page_rows: torch.Tensor, pages: np.ndarray,
                              hashes: Sequence[PageHash]) -> np.ndarray:
        n = len(pages)
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
