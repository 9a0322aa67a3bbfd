"""kvcache.storage.lmdb.removals: the removal log's sub-database, its bound, stores written before it, its audit
and repair. Real LMDB environments in tmp dirs (the backend-neutral rules are tests/conformance)."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import lmdb
import numpy as np
import pytest

import kvcache.storage.removals as removal_rules
from kvcache.storage.api import CapacityPolicy, page_origins
from kvcache.storage.lmdb import removals as log
from kvcache.storage.lmdb import store as lmdb_store
from kvcache.storage.lmdb.store import LMDBStore
from kvcache.types.keys import pack_tokens
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace
from kvcache.types.removals import RemovalReason

LAYOUT = KVLayout("unit-model@r1", layers=1, kv_heads=1, head_dim=16, dtype="float16", page_size=4)
PAGE = LAYOUT.bytes_per_page
NS = Namespace("tenant-a", "unit-salt-0b1c")


def write(store, tokens, ns=NS):
    hashes, origins = page_origins(LAYOUT, pack_tokens(tokens), ns, store.chain_key)
    pages = [np.frombuffer(hashlib.shake_128(h).digest(PAGE), np.uint8).copy() for h in hashes]
    return hashes, store.put(hashes, pages, origins)


def raw_log(path: str) -> dict[bytes, bytes]:
    """Every key and value of the store's `removals` sub-database (the store closed)."""
    env = lmdb.open(path, max_dbs=lmdb_store.MAX_DBS, readonly=True, lock=False)
    try:
        db = env.open_db(b"removals", create=False)
        with env.begin() as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor(db=db)}
    finally:
        env.close()


def drop_log(path: str) -> None:
    """Make the store at `path` one written before the log: its `removals` sub-database deleted (the store closed)."""
    env = lmdb.open(path, max_dbs=lmdb_store.MAX_DBS)
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(b"removals", txn=txn, create=False), delete=True)
    env.close()


@pytest.fixture
def path(tmp_path: Path) -> str:
    return str(tmp_path / "store")


def test_the_log_is_bounded_and_its_order_is_the_removals(path, monkeypatch):
    monkeypatch.setattr(removal_rules, "REMOVALS_KEPT", 5)
    with LMDBStore.open(path, LAYOUT, create=True, capacity=CapacityPolicy(2 * PAGE, evict_headroom=0)) as store:
        evicted: list[bytes] = []
        for i in range(6):  # one page a put, two kept: every put from the third on evicts the oldest page
            hashes, result = write(store, range(100 * i, 100 * i + 4))
            evicted += result.evicted_hashes
        assert len(evicted) == 4
        store.delete_namespace(Namespace("other", "x").id)  # a namespace-wide record takes a place in the log too
        records = store.removals(evicted)
    assert [r.reason for r in records] == [RemovalReason.CAPACITY] * 4
    got = raw_log(path)
    seqs = sorted(struct.unpack(">Q", k[1:])[0] for k in got if k[:1] == log.SEQ)
    assert seqs == [1, 2, 3, 4, 5]  # five removals, all within the bound: every one kept, in order
    assert len(got) == 10  # each a sequence entry and a record
    with LMDBStore.open(path, LAYOUT, capacity=CapacityPolicy(2 * PAGE, evict_headroom=0)) as store:
        assert write(store, range(1000, 1004))[1].evicted == 1  # the next eviction pushes the oldest record out
        assert store.removals(evicted[:1]) == [None]
        assert [r.reason for r in store.removals(evicted[1:])] == [RemovalReason.CAPACITY] * 3
    got = raw_log(path)
    assert sorted(struct.unpack(">Q", k[1:])[0] for k in got if k[:1] == log.SEQ) == [2, 3, 4, 5, 6]
    assert len(got) == 10


def test_a_page_removed_again_keeps_its_newest_record_past_the_older_ones_trim(path, monkeypatch):
    monkeypatch.setattr(removal_rules, "REMOVALS_KEPT", 3)
    with LMDBStore.open(path, LAYOUT, create=True) as store:
        hashes, _ = write(store, range(4))
        env = store._lease.live()
        for reason in (RemovalReason.REPAIR, RemovalReason.QUARANTINE):  # the same page twice: seq 1, then 2
            env.write(lambda txn, r=reason: log.record(txn, env.dbs.removals, [(hashes[0], NS.id)], r, 1.0))
        for k in range(3):  # three more removals of other subjects: seq 3..5 push seq 1 and 2 out...
            env.write(lambda txn, k=k: log.record(txn, env.dbs.removals, [(bytes([k]) * 16, NS.id)],
                                                  RemovalReason.REPAIR, 2.0))
        assert store.removals(hashes[:1]) == [None]  # ... so the page's newest record went with seq 2
        env.write(lambda txn: log.record(txn, env.dbs.removals, [(hashes[0], NS.id)], RemovalReason.REPAIR, 3.0))
        env.write(lambda txn: log.record(txn, env.dbs.removals, [(b"\x09" * 16, NS.id)], RemovalReason.REPAIR, 4.0))
        # seq 6 is the page's; seq 7's trim drops seq 4's entry, and the stale entries never take a newer record
        (record,) = store.removals(hashes[:1])
        assert (record.reason, record.at) == (RemovalReason.REPAIR, 3.0)
        assert store.verify().ok


def test_a_store_written_before_the_log_reads_no_record_and_its_next_writer_adds_the_log(path):
    with LMDBStore.open(path, LAYOUT, create=True) as store:
        hashes, _ = write(store, range(8))
    drop_log(path)
    with LMDBStore.open(path, readonly=True, lock=False) as reader:  # lock-free: cannot create the sub-database
        assert reader._lease.live().dbs.removals is None
        assert reader.removals(hashes, NS.id) == [None, None]
        assert reader.verify().ok
    with LMDBStore.open(path, LAYOUT) as store:  # a writer's open creates it, empty
        assert store.removals(hashes) == [None, None]
        store.delete_namespace(NS.id)
        assert [r.reason for r in store.removals(hashes, NS.id)] == [RemovalReason.DROP] * 2
        assert store.verify().ok
    with LMDBStore.open(path, readonly=True) as reader:  # a read-only handle reads the log
        assert [r.ns_id for r in reader.removals(hashes, NS.id)] == [NS.id] * 2


def test_a_damaged_log_entry_is_an_audit_finding_and_a_repair_removes_it_alone(path):
    with LMDBStore.open(path, LAYOUT, create=True) as store:
        hashes, _ = write(store, range(16))
        store.delete_namespace(Namespace("gone", "x").id)
    env = lmdb.open(path, max_dbs=lmdb_store.MAX_DBS)
    with env.begin(write=True) as txn:
        db = env.open_db(b"removals", txn=txn, create=False)
        txn.put(log.PAGE + hashes[0], b"\x00 not a record", db=db)
        txn.put(log.SEQ + struct.pack(">Q", 99), log.PAGE + b"\x07" * 16, db=db)  # names no record
        txn.put(b"zz", b"", db=db)  # a key of no kind
    env.close()
    with LMDBStore.open(path, LAYOUT) as store:  # the stray key sorts after the log's: its order still goes on
        store.delete_namespace(Namespace("later", "x").id)
    assert raw_log(path)[log.SEQ + struct.pack(">Q", 100)] == log.NAMESPACE + Namespace("later", "x").id
    with LMDBStore.open(path, readonly=True) as reader:
        report = reader.verify()
        assert [f.kind for f in report.findings] == ["damaged_record"] * 3
        assert all("removals key" in f.detail for f in report.findings)
        assert reader.removals(hashes[:1]) == [None]  # a record that does not decode answers nothing
    with LMDBStore.open(path, LAYOUT) as store:
        report = store.verify(repair=True)
        assert report.repaired == 3 and {r.what for r in report.removals} == {"record"}
        assert store.verify().ok
        assert store.exists_prefix(hashes) == 4  # no page depends on the log: all kept
        assert store.removals([], Namespace("gone", "x").id) == []
    got = raw_log(path)
    assert len(got) == 4  # the two drops' records and their sequence entries are sound, and kept


def test_the_rules_are_one_sequence_per_store_across_handles(path):
    a = LMDBStore.open(path, LAYOUT, create=True)
    b = LMDBStore.open(path, LAYOUT)
    try:
        a.delete_namespace(Namespace("one", "x").id)
        b.delete_namespace(Namespace("two", "x").id, RemovalReason.TTL)
    finally:
        a.close()
        b.close()
    got = raw_log(path)
    assert sorted(k for k in got if k[:1] == log.SEQ) == [log.SEQ + struct.pack(">Q", n) for n in (1, 2)]
    reasons = {k[1:]: log.decode(k, v)[1].reason for k, v in got.items() if k[:1] == log.NAMESPACE}
    assert reasons == {Namespace("one", "x").id: RemovalReason.DROP, Namespace("two", "x").id: RemovalReason.TTL}
