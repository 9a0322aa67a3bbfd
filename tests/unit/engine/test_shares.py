"""kvcache.types.shares and what the cache does with shares: the value's rules, admission charged to its namespace,
shares read from and written through to a real LMDB store, refreshed by poll, and the store share in LMDB."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest

from factories import l3_cache, make_cache, make_layout, make_store
from kvcache import AdmitStatus, InvalidInput, Namespace, Request
from kvcache.storage.api import CapacityPolicy, page_origins
from kvcache.types.keys import pack_tokens
from kvcache.types.shares import NamespaceShares, Shares, decode_shares_record

A, B = Namespace("tenant-a", "salt-a"), Namespace("tenant-b", "salt-b")


def serve(cache, rid, tokens, ns):
    adm = cache.admit(Request(rid, tokens, ns))
    assert adm.status is AdmitStatus.ADMITTED
    cache.commit(rid)
    return adm


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8", 1 << 63])
def test_a_share_is_a_non_negative_integer(bad):
    with pytest.raises(InvalidInput, match="device_tokens"):
        Shares(device_tokens=bad)


def test_empty_shares_clear_and_pages_round_down():
    assert Shares().empty and not Shares(store_bytes=1).empty
    assert Shares(device_tokens=70, host_tokens=0).pages(16) == (4, None)
    good = msgspec.to_builtins(NamespaceShares("00" * 16, "t", None, Shares(device_tokens=5), 0.0))
    assert decode_shares_record(msgspec.msgpack.encode(good)).shares == Shares(device_tokens=5)
    raw = msgspec.msgpack.encode({**good, "shares": {"device_tokens": -5}})
    with pytest.raises(msgspec.ValidationError):  # a stored record is checked like a constructed one
        decode_shares_record(raw)


def test_an_admission_over_its_device_share_evicts_its_own_pages_first_and_succeeds():
    def cache_with(shares):
        c = make_cache(device_tokens=16, host_tokens=0)
        serve(c, "b", range(100, 104), B)  # B's 4 pages: the oldest in the pool
        for i in range(3):
            serve(c, f"a{i}", range(i * 4, i * 4 + 4), A)  # A fills the rest
        if shares:
            c.set_shares(A, Shares(device_tokens=12))
        return c

    for shares, b_kept in ((False, 0), (True, 4)):
        c = cache_with(shares)
        adm = c.admit(Request("a-new", range(50, 54), A))  # A is at its share: 4 more pages take it over
        assert adm.status is AdmitStatus.ADMITTED
        c.commit("a-new")
        assert c.tree.match_prefix(Request("x", range(100, 104), B).key, touch=False).device_tokens == b_kept
        assert c.audit().ok
        c.tree.check()


def test_shares_are_written_through_to_the_store_and_read_by_another_cache(tmp_path):
    layout = make_layout(4)
    store = make_store(tmp_path / "s", layout)
    first = l3_cache(store)
    first.set_shares(A, Shares(device_tokens=64, host_tokens=32, store_bytes=1 << 20))
    assert first.tree.share_of(A.id).device_limit == 16 and first.tree.share_of(A.id).host_limit == 8
    second = l3_cache(store, shares_refresh_s=0.01)  # another engine on the store: reads them at open
    assert [(r.ns_id_hex, r.extra_key, r.shares) for r in second.shares()] == [
        (A.id_hex, "tenant-a", Shares(64, 32, 1 << 20))]
    first.set_shares(A, Shares())
    first.set_shares(B, Shares(device_tokens=8))
    time.sleep(0.02)
    second.poll()  # refreshed: A's cleared, B's new
    assert [(r.ns_id_hex, r.shares) for r in second.shares()] == [(B.id_hex, Shares(device_tokens=8))]
    assert second.tree.share_of(A.id) is None and second.tree.share_of(B.id).device_limit == 2
    second.close()
    first.close()
    store.close()


def test_a_refresh_the_store_cannot_answer_keeps_the_shares_and_is_counted(tmp_path):
    store = make_store(tmp_path / "s", make_layout(4))
    cache = l3_cache(store, shares_refresh_s=0.01)
    cache.set_shares(A, Shares(device_tokens=16))
    store.close()
    time.sleep(0.02)
    cache.poll()
    assert cache.counters.share_refresh_errors == 1
    assert [r.shares for r in cache.shares()] == [Shares(device_tokens=16)]


def test_lmdb_keeps_a_store_share_by_evicting_the_namespaces_own_oldest_pages(tmp_path):
    layout = make_layout(4)
    nbytes = layout.bytes_per_page
    store = make_store(tmp_path / "s", layout, capacity=CapacityPolicy(namespace_quota_bytes=2 * nbytes))
    store.set_shares(A, Shares(store_bytes=6 * nbytes))  # A's own limit replaces the uniform quota for A

    def put(tokens, ns):
        hashes, origins = page_origins(layout, pack_tokens(tokens), ns, store.chain_key)
        return store.put(hashes, [np.full(nbytes, 7, np.uint8)] * len(hashes), origins)

    assert put(range(0, 24), A).written == 6  # 6 pages: within A's share
    result = put(range(100, 116), A)  # 4 more: A's own oldest leaves make room, nothing is rejected
    assert result.written == 4 and result.evicted >= 4 and result.rejected == 0
    assert put(range(0, 24), B).written == 2  # B has no share: the uniform quota
    records = {r.extra_key: r for r in store.namespaces()}
    assert records["tenant-a"].bytes <= 6 * nbytes and records["tenant-b"].pages == 2
    assert store.verify().ok
    store.close()


def test_a_salvage_rebuild_carries_the_share_records_into_the_fresh_store(tmp_path):
    from kvcache.storage.lmdb.bookkeeping import SHARES_PREFIX
    from kvcache.storage.lmdb.salvage_rebuild import prepare

    record = msgspec.msgpack.encode(NamespaceShares(A.id_hex, "tenant-a", None, Shares(store_bytes=64), 0.0))
    fresh = make_store(tmp_path / "fresh", make_layout(4))
    fresh.close()
    prepare(str(tmp_path / "fresh"), {SHARES_PREFIX + A.id: record, SHARES_PREFIX + B.id: b"\xc1damaged"})
    fresh = make_store(tmp_path / "fresh", make_layout(4))
    assert [(r.ns_id_hex, r.shares) for r in fresh.shares()] == [(A.id_hex, Shares(store_bytes=64))]
    fresh.close()
