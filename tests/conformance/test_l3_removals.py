"""The removal log (`L3Store.removals`, kvcache.storage.removals) on every registered backend: each way a page
leaves a store is recorded with its reason, its time and its namespace, and the log keeps the newest
REMOVALS_KEPT records only."""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_l3_conformance import LAYOUT, NS_A, NS_B, page_payload, read, write

import kvcache.storage.removals as removal_rules
from kvcache.storage.api import page_origins
from kvcache.types.keys import pack_tokens
from kvcache.types.namespace import Namespace
from kvcache.types.removals import PageRemoval, RemovalReason
from kvcache.types.shares import Shares

NBYTES = LAYOUT.bytes_per_page


def assert_records(records: list[PageRemoval | None], hashes, reason: RemovalReason, ns: Namespace,
                   window: tuple[float, float]) -> None:
    """Each record names its page, `reason`, a time inside `window` and `ns`."""
    assert len(records) == len(hashes)
    for h, rec in zip(hashes, records, strict=True):
        assert rec is not None, f"no record of page {h.hex()}"
        assert (rec.page_hash, rec.reason, rec.ns_id) == (h, reason, ns.id)
        assert window[0] <= rec.at <= window[1]


def test_pages_never_removed_have_no_record(store):
    hashes, _ = write(store, range(40), NS_A)
    assert store.removals(hashes) == [None] * 10
    assert store.removals(hashes, NS_A.id) == [None] * 10
    assert store.removals([]) == []


def test_a_capacity_eviction_is_recorded_with_the_put(store):
    if not hasattr(store, "set_capacity"):
        pytest.skip(f"{store.backend} keeps no capacity of its own (the server's maxmemory bounds it)")
    store.set_capacity(4 * NBYTES)
    old, _ = write(store, range(16), NS_A)
    before = time.time()
    hashes, origins = page_origins(LAYOUT, pack_tokens(range(100, 108)), NS_B, store.chain_key)
    result = store.put(hashes, [page_payload(h, NBYTES) for h in hashes], origins)
    after = time.time()
    assert result.written == 2 and len(result.evicted_hashes) >= 2
    assert set(result.evicted_hashes) <= set(old)
    assert_records(store.removals(result.evicted_hashes), result.evicted_hashes, RemovalReason.CAPACITY, NS_A,
                   (before, after))
    kept = [h for h in old if h not in result.evicted_hashes]
    assert store.removals(kept) == [None] * len(kept)  # what stayed has no record
    assert store.verify().ok


def test_a_share_eviction_is_recorded_as_share(store):
    store.set_shares(NS_A, Shares(store_bytes=3 * NBYTES))
    old, _ = write(store, range(12), NS_A)
    before = time.time()
    hashes, origins = page_origins(LAYOUT, pack_tokens(range(200, 208)), NS_A, store.chain_key)
    result = store.put(hashes, [page_payload(h, NBYTES) for h in hashes], origins)
    after = time.time()
    if result.evicted == 0:
        # a backend that refuses pages over a share instead of evicting (Redis): nothing left, nothing recorded
        assert result.rejected == 2
        assert store.removals(old + hashes) == [None] * 5
        return
    assert set(result.evicted_hashes) <= set(old)
    assert_records(store.removals(result.evicted_hashes), result.evicted_hashes, RemovalReason.SHARE, NS_A,
                   (before, after))


def test_a_quarantined_page_is_recorded_when_it_is_taken_out(factory, location):
    s = factory.open(location, LAYOUT)
    try:
        hashes, payloads = write(s, range(40), NS_A)
        factory.corrupt(location, payloads[6].tobytes())
        before = time.time()
        n, _ = read(s, hashes)
        assert n == 6
        assert s.stats().counters.checksum_failures == 1
        s.flush()  # the handle's next write takes the failed page out of the store
        after = time.time()
        assert s.page_meta(hashes[6]) is None
        records = s.removals(hashes)
        assert records[:6] == [None] * 6 and records[7:] == [None] * 3  # only the failed page went
        assert_records(records[6:7], hashes[6:7], RemovalReason.QUARANTINE, NS_A, (before, after))
    finally:
        s.close()


def test_a_repair_records_every_page_it_removes(factory, location):
    s = factory.open(location, LAYOUT)
    hashes, payloads = write(s, range(40), NS_A)
    other, _ = write(s, range(40), NS_B)
    s.close()
    factory.corrupt(location, payloads[7].tobytes())
    s = factory.open(location, LAYOUT)  # a fresh handle: nothing read, nothing quarantined
    try:
        before = time.time()
        report = s.verify(repair=True)
        after = time.time()
        gone = {bytes.fromhex(r.page_hash) for r in report.removals}
        assert gone == set(hashes[7:])  # the page that failed and the pages below it
        records = s.removals(hashes)
        assert records[:7] == [None] * 7
        assert_records(records[7:], hashes[7:], RemovalReason.REPAIR, NS_A, (before, after))
        assert s.removals(other, NS_B.id) == [None] * 10
        assert s.verify().ok
    finally:
        s.close()


@pytest.mark.parametrize("reason", [RemovalReason.DROP, RemovalReason.TTL])
def test_a_namespace_removed_whole_is_one_record_for_the_namespace(store, reason):
    ha, _ = write(store, range(40), NS_A)
    hb, _ = write(store, range(40), NS_B)
    before = time.time()
    assert store.delete_namespace(NS_A.id, reason).pages == 10
    after = time.time()
    assert store.removals(ha) == [None] * 10  # no record per page: a drop of millions costs one
    assert_records(store.removals(ha, NS_A.id), ha, reason, NS_A, (before, after))
    assert store.removals(hb, NS_B.id) == [None] * 10  # the other namespace is untouched
    assert store.verify().ok


def test_a_drop_is_a_drop_by_default_and_no_other_reason_removes_a_namespace(store):
    ha, _ = write(store, range(8), NS_A)
    with pytest.raises(Exception, match="drop or a TTL"):
        store.delete_namespace(NS_A.id, RemovalReason.CAPACITY)
    assert store.exists_prefix(ha) == 2  # refused before anything went
    store.delete_namespace(NS_A.id)
    assert [r.reason for r in store.removals(ha, NS_A.id)] == [RemovalReason.DROP] * 2


def test_a_pages_own_newer_record_answers_over_its_namespaces_drop(factory, location):
    s = factory.open(location, LAYOUT)
    try:
        ha, _ = write(s, range(16), NS_A)
        s.delete_namespace(NS_A.id)
        hashes, payloads = write(s, range(16), NS_A)  # written again after the drop
        assert hashes == ha
        factory.corrupt(location, payloads[3].tobytes())
        read(s, hashes)
        s.flush()
        got = s.removals(hashes, NS_A.id)
        assert [r.reason for r in got] == [RemovalReason.DROP] * 3 + [RemovalReason.QUARANTINE]
        assert got[3].at >= got[0].at
    finally:
        s.close()


def test_the_log_keeps_the_newest_records_only(store, monkeypatch):
    monkeypatch.setattr(removal_rules, "REMOVALS_KEPT", 4)
    tenants = [Namespace(f"bound-{i}", "s") for i in range(7)]
    pages = {}
    for ns in tenants:
        pages[ns.id], _ = write(store, range(4), ns)
        store.delete_namespace(ns.id)
    answers = [store.removals(pages[ns.id], ns.id)[0] for ns in tenants]
    assert answers[:3] == [None] * 3  # the oldest went first
    assert [a.ns_id for a in answers[3:]] == [ns.id for ns in tenants[3:]]
    assert [a.reason for a in answers[3:]] == [RemovalReason.DROP] * 4
    assert store.verify().ok


def test_records_carry_no_salt(store):
    hashes, _ = write(store, range(8), NS_A)
    store.delete_namespace(NS_A.id)
    records = store.removals(hashes, NS_A.id)
    assert "conformance-salt" not in repr(records)
    assert all(isinstance(r.at, float) and np.isfinite(r.at) for r in records)
