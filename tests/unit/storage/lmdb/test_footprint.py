"""kvcache.storage.lmdb.footprint against real stores: what a page costs on disk, and what a payload capacity
means for the data file.

Each store is written as engines write (pages in chains, ~4 MiB batches) in a tmp dir; its data file, and LMDB's
own count of the pages of each sub-database, are compared with the estimate.
"""

from __future__ import annotations

import os

import lmdb
import numpy as np
import pytest

from kvcache.storage.api import CapacityPolicy, page_origins
from kvcache.storage.lmdb.footprint import overflow_pages, page_disk
from kvcache.storage.registry import open_store
from kvcache.types.keys import pack_tokens
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace

NS = Namespace("footprint-tenant", "s")


def layout_of(page_bytes: int, page_size: int = 4) -> KVLayout:
    """A layout of `page_bytes` per page of `page_size` tokens (float16, one head of `page_bytes / 4 / page_size`
    elements for K and V)."""
    head_dim = page_bytes // (4 * page_size)
    assert head_dim * 4 * page_size == page_bytes
    return KVLayout(f"footprint-{page_bytes}@r1", layers=1, kv_heads=1, head_dim=head_dim, dtype="float16",
                    page_size=page_size)


def fill(path, layout: KVLayout, pages: int, capacity: CapacityPolicy | None = None) -> tuple[int, int, dict]:
    """Write `pages` distinct pages (chains of 64, batches of ~4 MiB); (data file bytes, payload bytes stored,
    LMDB's pages per sub-database)."""
    size = layout.bytes_per_page
    rng = np.random.default_rng(size)
    block = np.frombuffer(rng.bytes(64 * size), np.uint8).reshape(64, size)
    store = open_store(str(path), layout, create=True, durability="none", capacity=capacity)
    hashes, origins = [], []
    for c in range(0, pages, 64):
        k = min(64, pages - c)
        tokens = pack_tokens(np.arange(c * 1000, c * 1000 + k * layout.page_size, dtype=np.uint32))
        h, o = page_origins(layout, tokens, NS, store.chain_key)
        hashes += h
        origins += o
    batch = max(1, (4 << 20) // size)
    for s in range(0, pages, batch):
        e = min(pages, s + batch)
        store.put(hashes[s:e], [block[i % 64] for i in range(s, e)], origins[s:e])
    stats = store.stats()
    store.close()
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=16)
    try:
        with env.begin() as txn:
            by_db = {name: txn.stat(env.open_db(name.encode(), txn=txn, create=False))
                     for name in ("pages", "meta", "children")}
    finally:
        env.close()
    assert stats.footprint_bytes == os.path.getsize(path / "data.mdb")
    return stats.footprint_bytes, stats.bytes, by_db


def test_overflow_values_take_whole_pages_behind_a_16_byte_header():
    # LMDB's rule: a value fits n pages when it is at most n * 4096 - 16 bytes.
    assert [overflow_pages(n) for n in (4080, 4081, 8176, 8177, 16368, 16392)] == [1, 2, 2, 3, 4, 5]


@pytest.mark.parametrize("page_bytes, pages", [(16384, 256), (4096, 1024), (65536, 64)])
def test_a_page_value_takes_the_overflow_pages_the_estimate_names(tmp_path, page_bytes, pages):
    # The checksum's 8 bytes tip a 4 KiB page into 2 overflow pages and a 16 KiB one into 5 (16,384 alone would
    # take 5 too: 16,384 + 16 > 4 x 4,096); LMDB's own page counts say so, exactly.
    layout = layout_of(page_bytes)
    _, payload, by_db = fill(tmp_path / "s", layout, pages)
    assert payload == pages * page_bytes
    disk = page_disk(layout)
    assert disk.value_pages == {4096: 2, 16384: 5, 65536: 17}[page_bytes]
    assert by_db["pages"]["overflow_pages"] == pages * disk.value_pages


@pytest.mark.parametrize("page_bytes, page_size, pages", [
    (512, 4, 32768), (4096, 4, 4096), (16384, 4, 512), (16384, 64, 512), (65536, 4, 128), (262144, 1024, 32)])
def test_the_data_file_is_what_the_estimate_says_within_a_tenth(tmp_path, page_bytes, page_size, pages):
    # From 512-byte pages (records and leaves dominate: ~4x) to 256 KiB pages whose 1,024 token ids push the
    # metadata into overflow pages of its own, the estimate per page times the pages stored is the data file
    # within 10% (B-tree fill and copy-on-write spares are measured figures, not exact ones).
    layout = layout_of(page_bytes, page_size)
    footprint, payload, _ = fill(tmp_path / "s", layout, pages)
    estimate = page_disk(layout)
    assert 0.9 <= footprint / (pages * estimate.total) <= 1.1, (footprint / payload, estimate.ratio)
    assert footprint / payload > 1.0


def test_a_payload_capacity_bounds_the_data_file_at_the_ratio_init_prints_plus_two_batches(tmp_path):
    # Capacities count payload: a store capped at 16 MiB of 16 KiB pages holds at most that however many are
    # written. Its data file holds the ratio `kvc init` prints times the capacity, plus two write batches: a
    # batch's new pages are written before the pages it evicts are free, and LMDB reuses a page freed by one
    # transaction two transactions later (what docs/capacity.md tells an operator to provision).
    layout = layout_of(16384)
    cap, batch = 16 << 20, 4 << 20  # fill() writes batches of ~4 MiB
    footprint, payload, _ = fill(tmp_path / "s", layout, 3072, CapacityPolicy(capacity_bytes=cap))
    assert cap * 0.95 <= payload <= cap
    assert cap * page_disk(layout).ratio < footprint <= (cap + 2 * batch) * page_disk(layout).ratio * 1.1
