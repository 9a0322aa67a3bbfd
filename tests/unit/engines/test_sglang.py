"""kvcache.engines.sglang.KvcStorage without SGLang: SGLang's HiCacheStorage calls against stand-ins of its host
pools (tests/unit/engines/fake_sglang.py: real tensors in SGLang's buffer shapes), on real stores (LMDB in a temp
dir, a real redis-server)."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.engines import sglang as adapter_module
from kvcache.engines.sglang import (
    CLEARED_BY,
    MAX_ENGINE_KEY,
    MAX_RAW_KEY,
    STORE_ENV,
    AdapterStats,
    SGLangL3,
    engine_key,
)
from kvcache.engines.sglang_pool import POOL_FORMS, HostPages
from kvcache.errors import EngineUnsupported, InvalidInput, StoreClosed
from kvcache.storage.api import CapacityPolicy, engine_hashes
from kvcache.storage.registry import open_store
from kvcache.types.keys import engine_page_hash, hash_root
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace
from read_only_user import NO_CAPS, read_only_store
from redis_server import own_redis  # noqa: F401  (fixture)
from unit.engines.fake_sglang import FakeMHAHostPool, FakeMLAHostPool, FakeStorageConfig, fill

KvcStorage = adapter_module.KvcStorage
LAYOUT_FOR_KEYS = KVLayout(model="keys", layers=1, kv_heads=1, head_dim=8, dtype="float16", page_size=4)
ROOT = Path(__file__).resolve().parents[3]


def keys(tag: str, n: int) -> list[str]:
    """SGLang-like page keys: 64 hex digits each."""
    return [hashlib.sha256(f"{tag}-{i}".encode()).hexdigest() for i in range(n)]


def slots(pool, pages: list[int]) -> torch.Tensor:
    """SGLang's host_indices for whole pages of `pool` (page_size consecutive slots each)."""
    ps = pool.page_size
    if not pages:
        return torch.empty(0, dtype=torch.int64)
    return torch.cat([torch.arange(p * ps, (p + 1) * ps, dtype=torch.int64) for p in pages])


def page(pool, p: int) -> bytes:
    """The bytes of page `p` of a pool, as SGLang flattens it."""
    return bytes(pool.get_data_page(p * pool.page_size).contiguous().view(torch.uint8).numpy())


def storage(location: str, pool=None, **config) -> SGLangL3:
    extra = {"kvc_store": location, **config.pop("extra", {})}
    backend = KvcStorage(FakeStorageConfig(extra_config=extra, **config), {})
    if pool is not None:
        backend.register_mem_pool_host(pool)
    return backend


def mha(layout: str, page_size: int, **kw) -> FakeMHAHostPool:
    # page size 64 with a small head: 64 KiB-ish pages would slow nothing down, but the tests need no more
    return FakeMHAHostPool(layout, page_size, **kw)


# -- both interfaces, every pool layout, page sizes 1/16/64 ---------------------------------------------------------

@pytest.mark.parametrize("layout", sorted(POOL_FORMS))
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_zero_copy_pages_written_by_one_engine_read_back_byte_identical_by_another(tmp_path, layout, page_size):
    store = str(tmp_path / "l3")
    src, dst = mha(layout, page_size), mha(layout, page_size)
    fill(src, 1)
    writer, reader = storage(store, src), storage(store, dst)
    ks = keys("a", 5)
    assert writer.batch_set_v1(ks, slots(src, [3, 0, 7, 1, 2])) == [True] * 5
    assert reader.batch_exists(ks) == 5
    # read into other slots of another pool: each page lands where SGLang asks
    assert reader.batch_get_v1(ks, slots(dst, [6, 5, 4, 3, 2])) == [True] * 5
    for s, d in zip([3, 0, 7, 1, 2], [6, 5, 4, 3, 2], strict=True):
        assert page(dst, d) == page(src, s)
    assert page(dst, 0) == bytes(len(page(dst, 0)))  # a slot no read named is untouched
    stats = reader.kvc_stats()
    assert (stats.pages_read, stats.pages_missed, stats.read_faults) == (5, 0, 0)
    assert writer.kvc_stats().pages_written == 5


@pytest.mark.parametrize("layout", sorted(POOL_FORMS))
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_the_generic_and_the_zero_copy_interface_store_the_same_bytes(tmp_path, layout, page_size):
    store = str(tmp_path / "l3")
    src = mha(layout, page_size)
    fill(src, 2)
    backend = storage(store, src)
    generic, zero = keys("generic", 3), keys("zero", 3)
    assert backend.batch_set(generic, [src.get_data_page(p * page_size) for p in (1, 2, 3)]) is True
    assert backend.batch_set_v1(zero, slots(src, [4, 5, 6])) == [True] * 3
    # written generic, read zero-copy
    dst = mha(layout, page_size)
    other = storage(store, dst)
    assert other.batch_get_v1(generic, slots(dst, [0, 1, 2])) == [True] * 3
    assert [page(dst, p) for p in (0, 1, 2)] == [page(src, p) for p in (1, 2, 3)]
    # written zero-copy, read generic, as SGLang's generic prefetch does (dummy pages, then set_from_flat)
    got = other.batch_get(zero, [dst.get_dummy_flat_data_page() for _ in zero])
    assert all(t is not None for t in got)
    for t, p in zip(got, (4, 5, 6), strict=True):
        assert bytes(t.view(torch.uint8).numpy()) == page(src, p)
    # single-page calls and a target SGLang leaves out (the pool's dummy page is used)
    assert other.exists(zero[0]) and not other.exists(keys("never", 1)[0])
    assert bytes(other.get(zero[1]).view(torch.uint8).numpy()) == page(src, 5)
    assert other.get(keys("never", 1)[0], dst.get_dummy_flat_data_page()) is None
    assert other.set(keys("one", 1)[0], src.get_data_page(0)) is True
    # a target that is not contiguous is read into a contiguous copy, which is what comes back
    strided = torch.zeros(2 * src.get_dummy_flat_data_page().numel(), dtype=src.dtype)[::2]
    back = other.get(zero[2], strided)
    assert back is not None and bytes(back.contiguous().view(torch.uint8).numpy()) == page(src, 6)


@pytest.mark.parametrize("layout", sorted(POOL_FORMS))
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_mla_pages_round_trip_and_are_shared_by_every_tp_rank(tmp_path, layout, page_size):
    store = str(tmp_path / "l3")
    rank0, rank1 = FakeMLAHostPool(layout, page_size), FakeMLAHostPool(layout, page_size)
    fill(rank0, 3)
    fill(rank1, 4)  # its own bytes: a rank that does not write must not overwrite the writer's
    first = storage(store, rank0, is_mla_model=True, tp_rank=0, tp_size=2)
    second = storage(store, rank1, is_mla_model=True, tp_rank=1, tp_size=2)
    layout0 = first.layout
    assert layout0 is not None and layout0.mla and layout0.shard is None and layout0 == second.layout
    assert layout0.arrangement == POOL_FORMS[layout].arrangement
    ks = keys("mla", 4)
    # SGLang's rule: one MLA writer per shard; the other rank answers True and stores nothing
    assert second.batch_set_v1(ks, slots(rank1, [0, 1, 2, 3])) == [True] * 4
    assert second.kvc_stats().pages_not_writer == 4 and first.batch_exists(ks) == 0
    assert first.batch_set_v1(ks, slots(rank0, [0, 1, 2, 3])) == [True] * 4
    assert second.batch_get_v1(ks, slots(rank1, [4, 5, 6, 7])) == [True] * 4  # into its own pool
    assert [page(rank1, p) for p in (4, 5, 6, 7)] == [page(rank0, p) for p in (0, 1, 2, 3)]


def test_mha_tp_shards_never_read_each_others_pages(tmp_path):
    store = str(tmp_path / "l3")
    rank0, rank1 = mha("page_first", 4), mha("page_first", 4)
    fill(rank0, 5)
    first = storage(store, rank0, tp_rank=0, tp_size=2)
    second = storage(store, rank1, tp_rank=1, tp_size=2)
    assert first.layout != second.layout and first.layout.shard.tp_rank == 0 and second.layout.shard.tp_rank == 1
    ks = keys("tp", 3)
    assert first.batch_set_v1(ks, slots(rank0, [0, 1, 2])) == [True] * 3
    assert second.batch_exists(ks) == 0
    assert second.batch_get_v1(ks, slots(rank1, [0, 1, 2])) == [False] * 3


def test_layouts_name_the_geometry_sglang_hands_over(tmp_path):
    pool = mha("layer_first", 16, layers=3, heads=4, head_dim=8, dtype=torch.float16)
    backend = storage(str(tmp_path / "l3"), pool, model_name="org/model-7b", pp_rank=1, pp_size=2)
    layout = backend.layout
    assert (layout.model, layout.layers, layout.kv_heads, layout.head_dim, layout.dtype, layout.page_size) == \
        ("org/model-7b", 3, 4, 8, "float16", 16)
    assert layout.arrangement == "kv_layer" and not layout.mla and layout.v_head_dim == 0
    assert (layout.shard.pp_rank, layout.shard.pp_size, layout.shard.tp_size) == (1, 2, 1)
    assert layout.bytes_per_page == len(page(pool, 0))
    assert len(HostPages(pool, "m", False, None).segments(0)) == 2 * 3  # K and V of each layer
    assert len(HostPages(mha("page_first", 16), "m", False, None).segments(16)) == 2
    assert len(HostPages(FakeMLAHostPool("layer_first", 16), "m", True, None).segments(0)) == 3
    assert len(HostPages(FakeMLAHostPool("page_first", 16), "m", True, None).segments(0)) == 1


# -- keys, parents, namespaces ----------------------------------------------------------------------------------

def test_a_read_needs_nothing_but_the_keys_and_a_write_records_parents_when_known(tmp_path):
    store = str(tmp_path / "l3")
    pool = mha("page_first", 4)
    fill(pool, 6)
    backend = storage(store, pool)
    chain = keys("chain", 8)
    assert backend.batch_set_v1(chain[:2], slots(pool, [0, 1])) == [True, True]
    anchor = type("ExtraInfo", (), {"prefix_keys": chain[:2]})()
    assert backend.batch_set_v1(chain[2:4], slots(pool, [2, 3]), anchor) == [True, True]
    assert backend.batch_set_v1(chain[4:6], slots(pool, [4, 5])) == [True, True]  # no prefix keys: from the root
    # a parent the store does not hold (written by another rank, evicted) refuses nothing: the page hangs from
    # the root
    unknown = type("ExtraInfo", (), {"prefix_keys": keys("never-stored", 2)})()
    assert backend.batch_set_v1(chain[6:], slots(pool, [6, 7]), unknown) == [True, True]
    kvc = backend.store
    root = hash_root(backend.layout.layout_id, Namespace(extra_key="sglang"), kvc.chain_key)
    hashes = engine_hashes(backend.layout, Namespace(extra_key="sglang"), kvc.chain_key,
                           [bytes.fromhex(k) for k in chain])
    assert hashes[2] == engine_page_hash(root, bytes.fromhex(chain[2]))
    assert kvc.page_meta(hashes[2]).parent == engine_page_hash(root, bytes.fromhex(chain[1]))  # prefix_keys[-1]
    assert kvc.page_meta(hashes[3]).parent == hashes[2]  # the previous key of the batch
    assert kvc.page_meta(hashes[4]).parent == root and kvc.page_meta(hashes[6]).parent == root
    assert kvc.page_meta(hashes[3]).key == bytes.fromhex(chain[3])
    # SGLang's prefetch anchored below the root passes prefix keys that do not chain with the call's keys: unused
    stray = type("ExtraInfo", (), {"prefix_keys": keys("unrelated", 3)})()
    assert backend.batch_exists(chain[2:], stray) == 6
    dst = mha("page_first", 4)
    reader = storage(store, dst)
    assert reader.batch_get_v1(chain[2:], slots(dst, [0, 1, 2, 3, 4, 5]), stray) == [True] * 6
    assert [page(dst, p) for p in range(6)] == [page(pool, p) for p in range(2, 8)]


def test_batch_exists_counts_consecutive_pages_from_the_start(tmp_path):
    pool = mha("layer_first", 4)
    backend = storage(str(tmp_path / "l3"), pool)
    ks = keys("gap", 4)
    assert backend.batch_set_v1([ks[0], ks[1], ks[3]], slots(pool, [0, 1, 3])) == [True] * 3
    assert backend.batch_exists(ks) == 2
    assert backend.batch_get_v1(ks, slots(pool, [4, 5, 6, 7])) == [True, True, False, False]
    assert backend.batch_exists([]) == 0 and backend.batch_get_v1([], slots(pool, [])) == []


def test_pages_live_under_the_configured_namespace_and_no_other_reads_them(tmp_path):
    store = str(tmp_path / "l3")
    pool = mha("page_first", 4)
    fill(pool, 7)
    ks = keys("ns", 2)
    default, tenant = storage(store, pool), storage(store, pool, extra={"kvc_namespace": "tenant-a"})
    assert tenant.batch_set_v1(ks, slots(pool, [0, 1])) == [True, True]
    assert default.batch_exists(ks) == 0 and tenant.batch_exists(ks) == 2
    assert default.batch_set_v1(ks, slots(pool, [0, 1])) == [True, True]
    names = {r.extra_key: r.pages for r in tenant.store.namespaces()}
    assert names == {"sglang": 2, "tenant-a": 2}
    assert tenant.store.drops() == []
    assert tenant.clear() is True
    assert tenant.batch_exists(ks) == 0 and default.batch_exists(ks) == 2
    # the flush is on the store's record, as `kvc ns drop` leaves one: which namespace, by whom
    [dropped] = tenant.store.drops()
    assert (dropped.extra_key, dropped.ns_id_hex, dropped.by) == ("tenant-a", tenant.namespace.id.hex(), CLEARED_BY)


def test_the_store_comes_from_env_kvc_store_when_the_config_names_none(tmp_path, monkeypatch):
    monkeypatch.setenv(STORE_ENV, str(tmp_path / "from-env"))
    pool = mha("page_first", 1)
    backend = KvcStorage(FakeStorageConfig(extra_config={}), {})
    backend.register_mem_pool_host(pool)
    assert backend.batch_set_v1(keys("env", 1), slots(pool, [0])) == [True]
    assert (tmp_path / "from-env" / "data.mdb").exists()


def test_engine_keys_are_the_raw_bytes_of_lowercase_hex_keys_and_a_digest_of_any_other():
    k = keys("k", 1)[0]
    assert engine_key(k) == bytes.fromhex(k)  # SGLang's keys: every page stored so far stays readable
    assert engine_key("7a7a") == b"zz" and engine_key("zz") != b"zz"  # a non-hex key never decodes like a hex one
    assert engine_key("ab" * MAX_RAW_KEY) == bytes.fromhex("ab" * MAX_RAW_KEY)
    assert len(engine_key("page_ab12_L0-3")) == MAX_ENGINE_KEY and engine_key("page_ab12_L0-3") != \
        engine_key("page_ab12_L0-4")


def test_no_two_key_strings_name_one_page():
    # The repros: k and k.upper(); "abcd", "ab cd" and " abcd" (bytes.fromhex skips whitespace); a non-hex
    # key and the hex of its own digest. SGLang's keys are lowercase hex today: latent, but never one page.
    k = keys("k", 1)[0]
    groups = [[k, k.upper(), f" {k}", f"{k}\n", k[:32] + " " + k[32:]], ["abcd", "ab cd", " abcd", "ABCD", "abcd "],
              ["page_ab12_L0-3", engine_key("page_ab12_L0-3").hex()], ["ab" * (MAX_RAW_KEY + 1), "ab" * MAX_RAW_KEY]]
    for group in groups:
        assert len({engine_key(x) for x in group}) == len(group), group
    # and their pages are distinct pages of the store
    hashes = engine_hashes(LAYOUT_FOR_KEYS, Namespace(extra_key="sglang"), bytes(32),
                           [engine_key(x) for x in groups[1]])
    assert len(set(hashes)) == len(groups[1])


@st.composite
def key_and_another(draw):
    """A key string and another that an engine key built by decoding or digesting could confuse with it."""
    raw = draw(st.binary(min_size=1, max_size=MAX_ENGINE_KEY))
    key = draw(st.one_of(st.just(raw.hex()), st.text(max_size=40)))
    at = draw(st.integers(0, len(key)))
    other = draw(st.sampled_from([
        key.upper(), key.swapcase(), key[:at] + draw(st.sampled_from([" ", "\t", "\n", "\r\n"])) + key[at:],
        engine_key(key).hex(), key + "0", key[:-1]]))
    return key, other


@settings(max_examples=400, deadline=None)
@given(key_and_another())
def test_engine_key_is_one_to_one_over_key_strings(pair):
    key, other = pair
    if key != other:
        assert engine_key(key) != engine_key(other), pair
    for text in pair:  # a key the store takes; a lowercase hex one is its raw bytes when they fit
        made = engine_key(text)
        assert 0 < len(made) <= MAX_ENGINE_KEY
        if text and len(text) <= 2 * MAX_RAW_KEY and len(text) % 2 == 0 and set(text) <= set("0123456789abcdef"):
            assert made == bytes.fromhex(text)


# -- outcomes per page ------------------------------------------------------------------------------------------

def test_pages_over_the_store_capacity_are_false_and_the_others_true(tmp_path):
    store = str(tmp_path / "l3")
    pool = mha("page_first", 16)
    fill(pool, 8)
    probe = storage(store, pool)
    layout, page_bytes = probe.layout, probe.layout.bytes_per_page
    probe.close()
    open_store(store, layout, capacity=CapacityPolicy(capacity_bytes=3 * page_bytes, evict_headroom=0.0)).close()
    backend = storage(store, pool)
    ks = keys("cap", 5)
    result = backend.batch_set_v1(ks, slots(pool, [0, 1, 2, 3, 4]))
    assert result[:3] == [True] * 3 and result[3:] == [False, False]
    assert backend.kvc_stats().pages_rejected == 2
    assert backend.batch_exists(ks) == 3


# -- threads ----------------------------------------------------------------------------------------------------

def test_three_sglang_threads_at_once_see_every_page_they_wrote(tmp_path):
    # SGLang's backup thread writes, its prefetch thread asks and reads what was written, the scheduler asks: all
    # at once, on one backend over one host pool
    store = str(tmp_path / "l3")
    pool = mha("page_first", 4, pages=64)
    fill(pool, 9)
    backend = storage(store, pool)
    rounds, per, away = 10, 3, 32  # round r writes pages r*per.. and reads them back into pages away + r*per..
    written = [keys(f"t{r}", per) for r in range(rounds)]
    done = [threading.Event() for _ in range(rounds)]  # set once round r's pages are written
    start = threading.Barrier(3)
    errors: list[BaseException] = []
    sources = [page(pool, p) for p in range(rounds * per)]

    def writer() -> None:
        start.wait()
        for r in range(rounds):
            assert backend.batch_set_v1(written[r], slots(pool, [r * per + i for i in range(per)])) == [True] * per
            done[r].set()

    def prefetcher() -> None:
        start.wait()
        for r in range(rounds):
            done[r].wait()  # then read it while the writer goes on with the next rounds
            assert backend.batch_exists(written[r]) == per
            assert backend.batch_get_v1(written[r], slots(pool, [away + r * per + i for i in range(per)])) == \
                [True] * per

    def scheduler() -> None:
        start.wait()
        for r in range(rounds):
            assert backend.batch_exists(written[r]) in range(per + 1)
            assert backend.get(keys("absent", 1)[0], pool.get_dummy_flat_data_page()) is None

    def guarded(fn):
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # reported below
                errors.append(exc)
                for event in done:  # never leave the prefetcher waiting on a writer that failed
                    event.set()
        return run

    threads = [threading.Thread(target=guarded(f), name=f.__name__) for f in (writer, prefetcher, scheduler)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [page(pool, away + p) for p in range(rounds * per)] == sources
    stats = backend.kvc_stats()
    assert (stats.pages_read, stats.read_faults, stats.write_faults, stats.bad_requests) == (rounds * per, 0, 0, 0)


def _refuses_reads(shared) -> bool:
    """Whether the LMDB environment `shared` refuses new reads (its close began)."""
    try:
        with shared.read():
            return False
    except StoreClosed:
        return True


def test_close_during_a_read_in_flight_waits_for_it_and_every_later_call_is_a_miss_or_false(tmp_path):
    # The repro: SGLang's detach (or a failed attach) closed the store while the prefetch thread was in
    # batch_get_v1, and the last handle's close unmapped LMDB's map under the read: the engine died (SIGSEGV).
    # Here a read transaction of the adapter's own handle is held open on another thread, as batch_get_v1's copy
    # holds one; tests/faults/test_faults_close.py runs the real calls against closes under load.
    pool = mha("page_first", 4)
    fill(pool, 23)
    backend = storage(str(tmp_path / "l3"), pool)
    ks = keys("closing", 2)
    assert backend.batch_set_v1(ks, slots(pool, [0, 1])) == [True, True]
    shared = backend.store._lease.shared
    inside, go, closed, read = threading.Event(), threading.Event(), threading.Event(), []

    def hold(txn):
        inside.set()
        go.wait()
        # the map must still be there: the close waits for this read (where it does not, the view is not touched)
        return None if closed.is_set() else bytes(txn.get(b"format", db=shared.dbs.store))

    prefetch = threading.Thread(target=lambda: read.append(shared.reading(hold, buffers=True)))
    prefetch.start()
    inside.wait()
    detach = threading.Thread(target=lambda: (backend.close(), closed.set()))
    detach.start()
    try:
        deadline = time.monotonic() + 60
        while not (closed.is_set() or _refuses_reads(shared)):  # until the close began on the store
            assert time.monotonic() < deadline, "the close never began"
            time.sleep(0.001)
        assert not closed.is_set(), "the close returned while a read of its store was in flight"
        # meanwhile SGLang's threads go on calling: misses and False, never an exception
        assert backend.batch_get_v1(ks, slots(pool, [2, 3])) == [False, False]
        assert backend.batch_set_v1(keys("late", 1), slots(pool, [4])) == [False]
        assert backend.batch_exists(ks) == 0 and backend.get(ks[0], pool.get_dummy_flat_data_page()) is None
    finally:
        go.set()
        prefetch.join()
        detach.join()
    assert read[0] is not None and closed.is_set() and shared.closed
    stats = backend.kvc_stats()
    assert stats.bad_requests == 4 and stats.last_fault == "a call after close" and stats.pages_missed == 3
    # SGLang attaches again: the store is back, with every page it held
    backend.register_mem_pool_host(pool)
    assert backend.batch_get_v1(ks, slots(pool, [2, 3])) == [True, True]
    assert [page(pool, 2), page(pool, 3)] == [page(pool, 0), page(pool, 1)]


# -- faults: misses and False, counted, never an exception, never a corrupt page ---------------------------------

def _flip_in_file(data_file: Path, payload: bytes) -> int:
    raw = bytearray(data_file.read_bytes())
    flipped, at = 0, raw.find(payload)
    while at >= 0:  # every copy: LMDB's copy-on-write can leave stale ones on free pages
        raw[at + len(payload) // 2] ^= 0x5A
        flipped += 1
        at = raw.find(payload, at + 1)
    data_file.write_bytes(bytes(raw))
    return flipped


def test_a_flipped_byte_on_disk_is_a_counted_miss_and_never_reported_read(tmp_path):
    store = tmp_path / "l3"
    pool = mha("page_first", 16)
    fill(pool, 10)
    backend = storage(str(store), pool)
    ks = keys("flip", 3)
    assert backend.batch_set_v1(ks, slots(pool, [0, 1, 2])) == [True] * 3
    backend.close()
    assert _flip_in_file(store / "data.mdb", page(pool, 1)[:4096]) >= 1
    dst = mha("page_first", 16)
    reader = storage(str(store), dst)
    assert reader.batch_get_v1(ks, slots(dst, [0, 1, 2])) == [True, False, False]
    assert page(dst, 0) == page(pool, 0)
    got = reader.batch_get(ks, [dst.get_dummy_flat_data_page() for _ in ks])
    assert got[0] is not None and got[1] is None and got[2] is None
    stats = reader.kvc_stats()
    assert stats.store.checksum_failures >= 1 and stats.pages_missed == 4 and stats.read_faults == 0
    # the page is quarantined: a miss on every later read, until a write replaces it
    assert reader.batch_exists(ks) == 1
    # SGLang recomputes the page, backs it up to the host and writes it again: that heals it
    dst.set_from_flat_data_page(1 * 16, pool.get_data_page(1 * 16))
    assert reader.batch_set_v1(ks[1:2], slots(dst, [1]), type("E", (), {"prefix_keys": ks[:1]})()) == [True]
    assert reader.batch_get_v1(ks, slots(dst, [3, 4, 5])) == [True] * 3
    assert page(dst, 4) == page(pool, 1)


def test_a_stopped_redis_server_makes_misses_and_false_never_an_exception(tmp_path, own_redis):  # noqa: F811
    pool = mha("page_first", 16)
    fill(pool, 11)
    # a pause after a fault of 1 ms at most: starting the server again outlasts it, so the first call after the
    # restart tries the server (nothing to wait out)
    url = own_redis.store_url() + "&backoff_max=0.001"
    backend = storage(url, pool)
    ks = keys("redis", 3)
    assert backend.batch_set_v1(ks, slots(pool, [0, 1, 2])) == [True] * 3
    dst = mha("page_first", 16)
    reader = storage(url, dst)  # another engine on the same Redis
    assert reader.batch_get_v1(ks, slots(dst, [0, 1, 2])) == [True] * 3
    assert [page(dst, p) for p in (0, 1, 2)] == [page(pool, p) for p in (0, 1, 2)]
    own_redis.stop()
    more = keys("redis-more", 2)
    assert backend.batch_set_v1(more, slots(pool, [3, 4])) == [False, False]
    assert backend.batch_set(more, [pool.get_data_page(0), pool.get_data_page(16)]) is False
    assert reader.batch_exists(ks) == 0
    assert reader.batch_get_v1(ks, slots(dst, [3, 4, 5])) == [False] * 3
    assert reader.get(ks[0], dst.get_dummy_flat_data_page()) is None
    assert [page(dst, p) for p in (3, 4, 5)] == [bytes(len(page(dst, 3)))] * 3  # nothing half-read was reported
    read = reader.kvc_stats()
    assert read.pages_missed == 4 and read.store is None  # the store's own counters need the server: not now
    # every failed call is counted: by the adapter (a fault it caught) or by the store (one it served as a miss
    # or a rejection), whose counters read again once the server is back (with every page: it kept them)
    own_redis.start()
    wrote, read = backend.kvc_stats(), reader.kvc_stats()
    assert wrote.write_faults + wrote.store.write_errors + wrote.store.pages_rejected >= 2
    assert read.read_faults + read.store.read_errors >= 3
    assert reader.batch_get_v1(ks, slots(dst, [3, 4, 5])) == [True] * 3
    assert [page(dst, p) for p in (3, 4, 5)] == [page(pool, p) for p in (0, 1, 2)]


_READ_ONLY_SCRIPT = """
import hashlib, json, sys, torch
from kvcache.engines.sglang import KvcStorage
from unit.engines.fake_sglang import FakeMHAHostPool, FakeStorageConfig, fill
pool = FakeMHAHostPool("page_first", 4)
fill(pool, 12)
backend = KvcStorage(FakeStorageConfig(extra_config={"kvc_store": sys.argv[1]}), {})
backend.register_mem_pool_host(pool)
old, new = json.loads(sys.argv[2]), json.loads(sys.argv[3])
idx = lambda pages: torch.cat([torch.arange(p * 4, p * 4 + 4) for p in pages])
wrote = backend.batch_set_v1(new, idx([0, 1]))
read = backend.batch_get_v1(old, idx([2, 3]))
s = backend.kvc_stats()
digest = [hashlib.sha256(pool.get_data_page(p * 4).contiguous().view(torch.uint8).numpy()).hexdigest()
          for p in (2, 3)]
print(json.dumps({"wrote": wrote, "read": read, "digest": digest, "write_faults": s.write_faults,
                  "last": s.last_fault}))
"""


def test_a_read_only_store_answers_false_to_writes_and_still_serves_reads(tmp_path):
    import json

    store = tmp_path / "l3"
    pool = mha("page_first", 4)
    fill(pool, 12)
    backend = storage(str(store), pool)
    old = keys("ro-old", 2)
    assert backend.batch_set_v1(old, slots(pool, [0, 1])) == [True, True]
    backend.close()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH",
                                                                                                       "")])}
    with read_only_store(store):
        os.chmod(store / "fingerprint.key", 0o444)  # this engine may read the store's key, not write the store
        out = subprocess.run([*NO_CAPS, sys.executable, "-c", _READ_ONLY_SCRIPT, str(store), json.dumps(old),
                              json.dumps(keys("ro-new", 2))], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["wrote"] == [False, False] and result["write_faults"] == 1
    assert "read-only" in result["last"]
    # another process read what this one wrote, byte for byte
    assert result["read"] == [True, True]
    assert result["digest"] == [hashlib.sha256(page(pool, p)).hexdigest() for p in (0, 1)]


def test_calls_naming_no_whole_pages_or_before_registration_are_counted_misses(tmp_path):
    pool = mha("page_first", 4)
    backend = storage(str(tmp_path / "l3"))
    ks = keys("bad", 2)
    assert backend.batch_set_v1(ks, slots(pool, [0, 1])) == [False, False]
    assert backend.batch_exists(ks) == 0
    backend.register_mem_pool_host(pool)
    assert backend.batch_set_v1(ks, torch.arange(0, 7)) == [False, False]  # 7 slots for 2 pages of 4
    assert backend.batch_set_v1(ks, torch.arange(2, 10)) == [False, False]  # not page-aligned
    assert backend.batch_get_v1(ks, torch.arange(64, 72)) == [False, False]  # past the pool's end
    assert backend.batch_set(ks, [pool.get_data_page(0)]) is False  # one value for two keys
    assert backend.kvc_stats().bad_requests == 6


def _host_indices_naming_no_whole_pages(pool) -> dict[str, torch.Tensor]:
    """Host indices for two pages of `pool` (page size 4, 8 pages) whose first page is whole and whose second is
    not: a check of the first page only accepts every one of them."""
    first = list(range(0, 4))
    return {
        "swapped slots": first + [4, 5, 7, 6],  # the page's slots, two tokens crossed
        "a slot of another page": first + [4, 5, 6, 9],
        "a run across two pages": first + [6, 7, 8, 9],  # consecutive, not page-aligned
        "past the pool's end": first + [32, 33, 34, 35],
        "negative slots": first + [-4, -3, -2, -1],
        "a run counting down": first + [7, 6, 5, 4],
    }


def test_host_indices_that_do_not_name_whole_pages_are_refused_counted_and_logged_once(tmp_path, caplog):
    # The repro: only each page's first slot was checked, so a page was read into (or written from) slots
    # the caller did not name, and reported True. Every bad page below is the second of its batch.
    src, dst = mha("layer_first", 4), mha("layer_first", 4)
    fill(src, 21)
    writer, reader = storage(str(tmp_path / "l3"), src), storage(str(tmp_path / "l3"), dst)
    stored, fresh = keys("whole", 2), keys("never", 2)
    assert writer.batch_set_v1(stored, slots(src, [0, 1])) == [True, True]
    bad = _host_indices_naming_no_whole_pages(dst)
    caplog.set_level(logging.DEBUG, logger="kvcache.engines.sglang")
    for why, indices in bad.items():
        assert reader.batch_get_v1(stored, torch.tensor(indices)) == [False, False], why
        assert writer.batch_set_v1(fresh, torch.tensor(indices)) == [False, False], why
    # two pages of one read into the same slots: the first would be overwritten, yet reported read
    assert reader.batch_get_v1(stored, slots(dst, [1, 1])) == [False, False]
    assert bytes(dst.kv_buffer.view(torch.uint8).numpy()) == bytes(dst.kv_buffer.numel() * 2)  # not one byte read
    assert writer.batch_exists(fresh) == 0  # not one page written
    assert reader.kvc_stats().bad_requests == len(bad) + 1 and writer.kvc_stats().bad_requests == len(bad)
    assert reader.kvc_stats().pages_missed == 2 * (len(bad) + 1) and reader.kvc_stats().pages_read == 0
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 2 and all("host indices that do not name whole pages" in w for w in warned), warned
    assert "batch_get_v1" in warned[0] + warned[1] and "batch_set_v1" in warned[0] + warned[1]
    assert "not consecutive" in reader.kvc_stats().last_fault or "same host slots" in reader.kvc_stats().last_fault
    # whole pages still work, in any order of pages
    assert reader.batch_get_v1(stored, slots(dst, [5, 2])) == [True, True]
    assert [page(dst, 5), page(dst, 2)] == [page(src, 0), page(src, 1)]


@pytest.mark.parametrize("indices", [torch.arange(0, 8, dtype=torch.float32), [0, 1, 2, 3, 4, 5, 6, 7.0],
                                     torch.arange(0, 8).reshape(2, 4)])
def test_host_indices_that_are_not_integers_are_refused(tmp_path, indices):
    pool = mha("page_first", 4)
    fill(pool, 22)
    backend = storage(str(tmp_path / "l3"), pool)
    ks = keys("typed", 2)
    assert backend.batch_set_v1(ks, indices) == [False, False]
    assert backend.batch_exists(ks) == 0 and backend.kvc_stats().bad_requests == 1


# -- what kvc does not support: one clear error, at construction or registration ------------------------------

def test_the_kv_pool_registered_through_v2_binds_the_store_as_sglang_0_5_23_attaches_every_model(tmp_path):
    # SGLang 0.5.23's HybridCacheController registers each pool of its group through v2, the plain "kv" pool of
    # an ordinary model included: refusing it would fail every launch.
    store = str(tmp_path / "l3")
    src, dst = mha("page_first", 4), mha("page_first", 4)
    fill(src, 3)
    writer, reader = storage(store), storage(store)
    writer.register_mem_pool_host(src)
    writer.register_mem_host_pool_v2(src, "kv")  # the same pool again: stays bound
    reader.register_mem_host_pool_v2(dst, "kv")  # v2 alone binds too
    ks = keys("v2", 3)
    assert writer.batch_set_v1(ks, slots(src, [0, 1, 2])) == [True] * 3
    assert reader.batch_get_v1(ks, slots(dst, [2, 1, 0])) == [True] * 3
    assert [page(dst, d) for d in (2, 1, 0)] == [page(src, s) for s in (0, 1, 2)]


def test_unsupported_interfaces_and_settings_raise_engine_unsupported(tmp_path):
    store = str(tmp_path / "l3")
    backend = storage(store, mha("page_first", 4))
    with pytest.raises(EngineUnsupported, match="v2 host pool interface"):
        backend.register_mem_host_pool_v2(mha("page_first", 4), "mamba")
    with pytest.raises(EngineUnsupported, match="page_head"):
        storage(store, mha("page_head", 4))
    with pytest.raises(EngineUnsupported, match="dcp_size"):
        storage(store, dcp_size=2, dcp_rank=0, is_mla_model=True, tp_size=2, logical_page_size=4)
    with pytest.raises(EngineUnsupported, match="should_split_heads"):
        storage(store, should_split_heads=True)
    with pytest.raises(EngineUnsupported, match="dtype int32"):
        storage(store, mha("page_first", 4, dtype=torch.int32))
    with pytest.raises(InvalidInput, match="no kvc store"):
        KvcStorage(FakeStorageConfig(extra_config={}), {})
    with pytest.raises(InvalidInput, match="model"):
        storage(store, model_name=None)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here: "
                    "tests/integration/test_engine_sglang.py checks the class built on it")
def test_without_sglang_kvc_storage_is_the_adapter_itself_and_sglang_stays_unimported():
    out = subprocess.run([sys.executable, "-c",
                          "import sys, kvcache.engines.sglang as m; c = m.KvcStorage; "
                          "print(c.__name__, [b.__name__ for b in c.__mro__[1:]], 'sglang' in sys.modules)"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH",
                                                                                                      "")])})
    assert out.returncode == 0, out.stderr
    name, _, rest = out.stdout.strip().partition(" ")
    assert name == "KvcStorage" and "SGLangL3" in rest and rest.endswith("False")
    assert issubclass(KvcStorage, SGLangL3) and isinstance(SGLangL3(FakeStorageConfig(
        extra_config={"kvc_store": "unused"})).kvc_stats(), AdapterStats)


def test_store_options_pass_to_the_backend_and_one_it_does_not_take_is_invalid_input(tmp_path):
    pool = mha("page_first", 4)
    fill(pool, 13)
    backend = storage(str(tmp_path / "l3"), pool, extra={"kvc_store_options": {"durability": "none"}})
    assert backend.batch_set_v1(keys("opt", 1), slots(pool, [0])) == [True]
    with pytest.raises(InvalidInput, match="durability"):
        storage(str(tmp_path / "l3b"), pool, extra={"kvc_store_options": {"durability": "sometimes"}})
    with pytest.raises(InvalidInput, match="kvc_store_options"):
        storage(str(tmp_path / "l3c"), pool, extra={"kvc_store_options": {"no_such_option": 1}})
    with pytest.raises(InvalidInput, match="kvc_store_options"):
        storage(str(tmp_path / "l3d"), pool, extra={"kvc_store_options": ["durability"]})


def test_a_new_host_pool_rebinds_the_store_to_its_layout(tmp_path):
    store = str(tmp_path / "l3")
    small, large = mha("page_first", 4), mha("page_first", 16)
    fill(small, 14)
    fill(large, 15)
    backend = storage(store, small)
    first = backend.store
    assert backend.batch_set_v1(keys("small", 1), slots(small, [0])) == [True]
    backend.register_mem_pool_host(small)  # the same geometry again: the same handle
    assert backend.store is first
    backend.register_mem_pool_host(large)  # SGLang re-attached with another page size: its own layout
    assert backend.store is not first and backend.layout.page_size == 16
    assert backend.batch_exists(keys("small", 1)) == 0  # a page of the other layout is never read as this one
    assert backend.batch_set_v1(keys("large", 1), slots(large, [0])) == [True]
    assert {layout.page_size for layout in backend.store.layouts()} == {4, 16}


# -- how a page is handed to the store ------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", sorted(POOL_FORMS))
@pytest.mark.parametrize("mla", [False, True])
def test_each_page_is_one_view_into_the_pools_own_memory(layout, mla):
    pool = FakeMLAHostPool(layout, 4) if mla else mha(layout, 4)
    fill(pool, 3)
    pages = HostPages(pool, "m", mla, None)
    memory = pool.kv_buffer.view(torch.uint8).numpy()
    for p in (0, 5):
        view = pages.page(p * 4)
        # one array sharing the pool's memory (the store copies it with one np.copyto), not a list of segments
        assert isinstance(view, np.ndarray) and np.shares_memory(view, memory)
        assert view.tobytes() == page(pool, p)
    assert [v.tobytes() for v in pages.pages([8, 0])] == [page(pool, 2), page(pool, 0)]


class SplitKVPool(FakeMHAHostPool):
    """An MHA host pool whose K and V are two buffers of their own, not the halves of `kv_buffer`."""

    def __init__(self, layout: str, page_size: int) -> None:
        super().__init__(layout, page_size)
        self.k, self.v = self.kv_buffer[0].clone(), self.kv_buffer[1].clone()

    @property
    def k_buffer(self) -> torch.Tensor:
        return self.k

    @property
    def v_buffer(self) -> torch.Tensor:
        return self.v


@pytest.mark.parametrize("layout", sorted(POOL_FORMS))
def test_a_pool_whose_k_and_v_are_separate_buffers_is_copied_as_segments_of_each(tmp_path, layout):
    src, dst = SplitKVPool(layout, 4), SplitKVPool(layout, 4)
    gen = torch.Generator().manual_seed(5)
    for t in (src.k, src.v):
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    assert type(HostPages(src, "m", False, None).page(4)) is list  # segments: K's rows, then V's
    writer, reader = storage(str(tmp_path / "l3"), src), storage(str(tmp_path / "l3"), dst)
    ks = keys("split", 3)
    assert writer.batch_set_v1(ks, slots(src, [1, 2, 3])) == [True] * 3
    assert reader.batch_get_v1(ks, slots(dst, [1, 2, 3])) == [True] * 3
    src_pages, dst_pages = HostPages(src, "m", False, None), HostPages(dst, "m", False, None)
    for p in (1, 2, 3):  # each page read back from src's own K and V buffers (kv_buffer stays zero in both)
        assert b"".join(s.tobytes() for s in dst_pages.segments(p * 4)) == \
            b"".join(s.tobytes() for s in src_pages.segments(p * 4)) != bytes(src_pages.layout.bytes_per_page)
