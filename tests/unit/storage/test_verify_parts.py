"""The integrity audit over key ranges (kvcache.storage.verify_parts): worker processes find what a serial audit
finds, in its order, whatever the damage; an incremental audit checks the pages changed since the store's last
clean audit, which each audit of a store it may write records.

Stores are real LMDB stores in a tmp dir, damaged through plain py-lmdb (tests/lmdb_surgery.py) while closed.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvcache.errors import InvalidInput, StoreError
from kvcache.storage.api import NamespaceRecord, PageMeta, engine_origins, page_origins
from kvcache.storage.lmdb import salvage
from kvcache.storage.lmdb import store as lmdb_store
from kvcache.storage.lmdb.env import DEFAULT_MAP_SIZE, acquire, release
from kvcache.storage.lmdb.integrity import LMDBIntegrity, read_history
from kvcache.storage.lmdb.store import LMDBStore
from kvcache.storage.verify import verify
from kvcache.storage.verify_parts import NOT_CHECKED, AuditScope, KeyRange
from kvcache.types.keys import engine_page_hash, hash_root, pack_tokens
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace
from lmdb_surgery import Raw, raw

LAYOUT = KVLayout("parts-model@r1", layers=1, kv_heads=1, head_dim=8, dtype="float16", page_size=2)
OTHER_LAYOUT = KVLayout("parts-model@r2", layers=1, kv_heads=1, head_dim=8, dtype="float16", page_size=2)
NS = Namespace("tenant-a", "parts-salt")
NS2 = Namespace("tenant-b", "parts-salt")


def payload(h: bytes) -> np.ndarray:
    return np.frombuffer(hashlib.shake_128(h).digest(LAYOUT.bytes_per_page), dtype=np.uint8).copy()


def write(store: LMDBStore, tokens, ns: Namespace = NS) -> list[bytes]:
    hashes, origins = page_origins(store.layout, pack_tokens(list(tokens)), ns, store.chain_key)
    store.put(hashes, [payload(h) for h in hashes], origins)
    return hashes


class Built(msgspec.Struct):
    chains: list[list[bytes]]  # NS chains, then NS2 chains


@pytest.fixture
def path(tmp_path: Path) -> str:
    return str(tmp_path / "store")


@pytest.fixture
def built(path: str) -> Built:
    """600 pages (more than two read chunks a worker), 20 chains of 30 pages in two namespaces."""
    chains = []
    with LMDBStore.open(path, LAYOUT, create=True) as s:
        for i in range(20):
            chains.append(write(s, range(i * 1000, i * 1000 + 60), NS if i < 10 else NS2))
        assert s.verify().ok
    return Built(chains)


def audit(path: str, scope: AuditScope | None = None, record: bool = False, parts: int | None = None,
          progress: Callable[..., None] | None = None):
    """verify() of the store at `path` through a handle of this process; `parts`: that many key ranges."""
    shared = acquire(path, False, DEFAULT_MAP_SIZE, "none")
    try:
        source = LMDBIntegrity(shared, progress=progress, record=record)
        if parts is not None:
            ranges = source.key_ranges(parts)
            source.key_ranges = lambda n: ranges  # type: ignore[method-assign]
        return verify(source, scope=scope)
    finally:
        release(shared)


def flip(r: Raw, h: bytes, at: int = -1) -> None:
    value = bytearray(r.txn.get(h, db=r.db["pages"]))
    value[at] ^= 0xFF
    r.txn.put(h, bytes(value), db=r.db["pages"])


def plant_everything(path: str, b: Built) -> set[str]:
    """Damage of every kind a record can carry, at once (the LMDB structure itself apart); the kinds planted."""
    c = b.chains
    with raw(path, recount=False) as r:
        flip(r, c[0][3])  # checksum_mismatch, and its subtree goes with it on repair
        value = r.txn.get(c[1][29], db=r.db["pages"])
        r.txn.put(c[1][29], value[:-4], db=r.db["pages"])  # size_mismatch
        r.drop(c[2][10])  # orphan (c[2][11:] hang from a page no longer stored)
        r.put_meta(c[3][5], msgspec.structs.replace(r.meta(c[3][5]), ns_id=NS2.id))  # namespace_mismatch
        r.put_meta(c[4][7], msgspec.structs.replace(r.meta(c[4][7]), tokens=b"\0" * 8))  # hash_mismatch
        r.drop(c[5][20], meta=False, link=False)  # missing_page
        r.drop(c[6][12], page=False, link=False)  # missing_meta (and its children entry now dangles)
        r.txn.put(c[7][2], bytes(range(16)), db=r.db["children"])  # dangling_index
        assert r.txn.delete(r.meta(c[8][4]).parent, c[8][4], db=r.db["children"])  # missing_index
        r.put_meta(c[9][29], msgspec.structs.replace(r.meta(c[9][29]), layout_id=OTHER_LAYOUT.layout_id))
        r.txn.put(b"\x01short", b"x" * 40, db=r.db["pages"])  # a pages key that is no page hash
        r.recount()
        r.txn.put(c[10][8], b"\x93\x01", db=r.db["meta"])  # metadata that does not decode
        r.txn.put(bytes(16), b"\xc1", db=r.db["namespaces"])  # damaged_record
        record = msgspec.msgpack.decode(r.txn.get(NS2.id, db=r.db["namespaces"]), type=NamespaceRecord)
        r.txn.put(NS2.id, msgspec.msgpack.encode(msgspec.structs.replace(record, pages=record.pages + 1)),
                  db=r.db["namespaces"])  # counter_mismatch
    return {"checksum_mismatch", "size_mismatch", "orphan", "namespace_mismatch", "hash_mismatch", "missing_page",
            "missing_meta", "dangling_index", "missing_index", "unknown_layout", "damaged_record", "counter_mismatch"}


def test_workers_find_what_a_serial_audit_finds_in_its_order_on_every_kind_of_damage(path, built):
    planted = plant_everything(path, built)
    serial = audit(path)
    assert planted <= {f.kind for f in serial.findings}
    for parts in (2, 3, 7):
        parallel = audit(path, AuditScope(workers=parts), parts=parts)
        assert parallel.findings == serial.findings
        assert (parallel.pages_checked, parallel.bytes_checked, parallel.ok) == (
            serial.pages_checked, serial.bytes_checked, False)
        assert parallel.workers == parts and parallel.scope == "full"


@pytest.mark.parametrize("fault", ["counters", "orphan", "namespace", "meta without bytes", "dangling entry"])
def test_damage_no_page_check_sees_is_still_found_by_the_structure_checks(path, built, fault):
    """Damage that leaves every page's own checks clean: the workers' side of the structure checks must not call
    the store clean."""
    c = built.chains
    with raw(path, recount=fault != "counters") as r:
        if fault == "counters":
            r.recount()
            totals = r.txn.get(b"totals", db=r.db["store"])
            r.txn.put(b"totals", totals[:-1] + bytes([totals[-1] ^ 2]), db=r.db["store"])
        elif fault == "orphan":
            r.drop(c[12][0])
        elif fault == "namespace":
            meta = r.meta(c[13][0])
            r.put_meta(c[13][0], msgspec.structs.replace(meta, parent=r.meta(c[2][0]).parent))
        elif fault == "meta without bytes":
            r.drop(c[14][29], meta=False, link=False)
        else:
            r.txn.put(c[15][1], c[16][1], db=r.db["children"])
    serial = audit(path)
    parallel = audit(path, AuditScope(workers=2))
    assert not serial.ok and parallel.findings == serial.findings


def test_a_clean_store_audits_clean_with_workers_and_each_reads_its_own_range(path, built):
    reached: list[tuple[str, int]] = []
    report = audit(path, AuditScope(workers=2), progress=lambda db, n, key: reached.append((db, n)))
    assert report.ok and report.pages_checked == 600 and report.workers == 2
    assert reached and {db for db, _ in reached} == {"pages"} and max(n for _, n in reached) <= 600
    with LMDBStore.open(path) as s:
        assert s.verify(scope=AuditScope(workers=2)).ok


def test_key_ranges_cover_every_key_once_in_order(path, built):
    shared = acquire(path, False, DEFAULT_MAP_SIZE, "none")
    try:
        ranges = LMDBIntegrity(shared).key_ranges(3)
    finally:
        release(shared)
    assert ranges[0].lo is None and ranges[-1].hi is None
    assert [r.hi for r in ranges[:-1]] == [r.lo for r in ranges[1:]] == [bytes([85]), bytes([170])]
    assert all(isinstance(r, KeyRange) for r in ranges)


def test_a_worker_that_dies_fails_the_audit_naming_its_range(path, built, monkeypatch):
    def die(self, part, ctx, report):
        if part.lo is not None:
            import os
            import signal
            os.kill(os.getpid(), signal.SIGSEGV)
        return real(self, part, ctx, report)

    real = LMDBIntegrity.scan_part
    monkeypatch.setattr(LMDBIntegrity, "scan_part", die)
    with pytest.raises(StoreError, match=r"an audit worker reading the pages from key 80 died of SIGSEGV"):
        audit(path, AuditScope(workers=2))


# --- incremental ----------------------------------------------------------------------------------------------


def history(path: str):
    shared = acquire(path, False, DEFAULT_MAP_SIZE, "none")
    try:
        return shared.reading(lambda txn: read_history(txn, shared.dbs))
    finally:
        release(shared)


def test_an_audit_is_recorded_and_the_clean_record_moves_only_on_a_clean_audit(path, built):
    assert history(path).last is None
    first = salvage.audit_location(path)
    assert first.ok and first.recorded
    clean = history(path).last_clean
    assert clean is not None and clean.ok and clean.scope == "full" and clean.pages_checked == 600
    with raw(path) as r:
        flip(r, built.chains[3][3])
    found = salvage.audit_location(path, scope=AuditScope(workers=2))
    assert not found.ok and found.recorded
    after = history(path)
    assert after.last is not None and not after.last.ok and after.last.started > clean.started
    assert after.last_clean == clean  # the damage did not move it
    again = salvage.audit_location(path, scope=AuditScope(since_last=True))
    assert again.scope == "incremental" and again.since == clean.started and again.ok  # the page is older
    assert history(path).last_clean.started > clean.started  # a clean incremental audit moves it


def test_since_last_finds_a_page_damaged_after_the_last_clean_audit(path, built):
    assert salvage.audit_location(path).ok
    with LMDBStore.open(path, LAYOUT) as s:
        fresh = write(s, range(90_000, 90_010))
    with raw(path) as r:
        flip(r, fresh[4])
    for workers in (1, 2):
        report = salvage.audit_location(path, scope=AuditScope(workers=workers, since_last=True))
        assert report.scope == "incremental" and report.not_checked == list(NOT_CHECKED)
        assert [(f.kind, f.page_hash) for f in report.findings] == [("checksum_mismatch", fresh[4].hex())]
        assert report.pages_checked == len(fresh) and not report.ok
    full = salvage.audit_location(path)
    assert [(f.kind, f.page_hash) for f in full.findings] == [("checksum_mismatch", fresh[4].hex())]


def test_since_last_finds_a_page_written_while_the_last_clean_audit_ran_and_damaged_before_it_ended(path, built):
    """The record keeps when the audit began (in a write transaction): a page a writer stored during it, behind
    the scan, and damaged before it ended, is checked by the next incremental audit though the damage is older
    than the record."""
    store = LMDBStore.open(path, LAYOUT)
    behind: list[bytes] = []

    def write_behind(db: str, walked: int, after: bytes | None) -> None:
        if db != "pages" or after is None or behind:
            return
        for i in range(2000):  # a new page whose hash the scan has passed
            hashes, origins = page_origins(LAYOUT, pack_tokens([i, 7]), NS, store.chain_key)
            if hashes[0] < after:
                store.put(hashes, [payload(hashes[0])], origins)
                damage(store, hashes[0])
                behind.append(hashes[0])
                return
        raise AssertionError("no hash below the scan's position")

    try:
        source = LMDBIntegrity(store._lease.live(), store._lease.write, write_behind, record=True)
        report = verify(source)
        assert behind and report.ok and report.recorded  # the scan had passed it: this audit is clean
        assert history_of(store).last_clean.started <= time.time()
        again = verify(LMDBIntegrity(store._lease.live(), store._lease.write, record=True),
                       scope=AuditScope(since_last=True))
    finally:
        store.close()
    assert [(f.kind, f.page_hash) for f in again.findings] == [("checksum_mismatch", behind[0].hex())]


def damage(store: LMDBStore, h: bytes) -> None:
    """Flip the last payload byte of page `h` through the open store's own environment (a writer's fault)."""
    shared = store._lease.live()
    value = bytearray(shared.reading(lambda txn: bytes(txn.get(h, db=shared.dbs.pages))))
    value[-1] ^= 0xFF
    shared.write(lambda txn: txn.put(h, bytes(value), db=shared.dbs.pages))


def history_of(store: LMDBStore):
    shared = store._lease.live()
    return shared.reading(lambda txn: read_history(txn, shared.dbs))


def test_since_last_without_a_clean_audit_is_a_full_one_and_since_checks_changed_metadata(path, built):
    report = salvage.audit_location(path, scope=AuditScope(since_last=True))
    assert report.scope == "full" and report.pages_checked == 600 and report.ok
    c = built.chains
    with raw(path) as r:  # metadata read back after the time: checked; the page's bytes are damaged
        meta: PageMeta = r.meta(c[1][1])
        r.put_meta(c[1][1], msgspec.structs.replace(meta, last_access=time.time() + 3600))
        flip(r, c[1][1])
        r.drop(c[2][29], page=True, meta=False, link=False)  # changed metadata whose page is gone
        r.put_meta(c[2][29], msgspec.structs.replace(r.meta(c[2][29]), created=time.time() + 3600))
    later = salvage.audit_location(path, scope=AuditScope(since=time.time() + 1800, workers=2))
    assert [(f.kind, f.page_hash) for f in later.findings] == [
        ("checksum_mismatch", c[1][1].hex()), ("missing_page", c[2][29].hex())][::1 if c[1][1] < c[2][29] else -1]
    assert later.pages_checked == 1


def test_a_lock_free_audit_records_nothing_and_a_repair_cannot_be_incremental(path, built):
    report = salvage.audit_location(path, lock=False, scope=AuditScope(workers=2))
    assert report.ok and not report.recorded and history(path).last is None
    with pytest.raises(InvalidInput):
        salvage.audit_location(path, repair=True, scope=AuditScope(since_last=True))
    shared = acquire(path, False, DEFAULT_MAP_SIZE, "none")
    try:
        with pytest.raises(InvalidInput):
            verify(LMDBIntegrity(shared), repair=True, scope=AuditScope(since=0.0))
    finally:
        release(shared)


def test_a_clean_store_is_proven_clean_by_the_workers_without_the_serial_structure_pass(path, built, monkeypatch):
    def no_snapshot(self, found):
        raise AssertionError("the serial structure pass ran")

    monkeypatch.setattr(LMDBIntegrity, "snapshot", no_snapshot)
    report = audit(path, AuditScope(workers=2))
    assert report.ok and report.pages_checked == 600
    with raw(path) as r:  # one page without its children entry: the serial pass must run (and finds it)
        assert r.txn.delete(r.meta(built.chains[0][1]).parent, built.chains[0][1], db=r.db["children"])
    with pytest.raises(AssertionError, match="the serial structure pass ran"):
        audit(path, AuditScope(workers=2))


ENGINE_KEYS = [hashlib.sha256(bytes([i])).digest() for i in range(40)]


@pytest.mark.parametrize("with_key", [True, False])
def test_engine_pages_are_judged_by_workers_as_by_a_serial_audit_with_the_chain_key_or_without(path, built, with_key):
    """Without the chain key an engine page's hash is judged with the registry (held by the worker, settled by the
    parent): a page re-filed under another namespace's key hash is found all the same, in the serial order."""
    with LMDBStore.open(path, LAYOUT) as s:
        hashes, origins = engine_origins(s.layout, NS, s.chain_key, ENGINE_KEYS)
        s.put(hashes, [payload(h) for h in hashes], origins)
        chain_key = s.chain_key

    def keyless_audit(scope=None):
        shared = acquire(path, False, DEFAULT_MAP_SIZE, "none")
        try:
            source = LMDBIntegrity(shared)
            if not with_key:
                source.chain_key = None
            return verify(source, scope=scope)
        finally:
            release(shared)

    assert keyless_audit().ok and keyless_audit(AuditScope(workers=2)).ok
    wrong = engine_page_hash(hash_root(LAYOUT.layout_id, NS2, chain_key), ENGINE_KEYS[-1])
    with raw(path) as r:
        meta = r.meta(hashes[-1])
        value = r.txn.get(hashes[-1], db=r.db["pages"])
        checksum = lmdb_store.CHECKSUMS[lmdb_store.DEFAULT_CHECKSUM].of(value[8:], wrong)
        r.drop(hashes[-1])
        r.txn.put(wrong, checksum.to_bytes(8, "little") + value[8:], db=r.db["pages"])
        later = time.time() + 3600  # written "later": the incremental audit below picks it
        r.put_meta(wrong, msgspec.structs.replace(meta, checksum=checksum, created=later, last_access=later))
        r.txn.put(meta.parent, wrong, db=r.db["children"])
    serial = keyless_audit()
    assert [(f.kind, f.page_hash) for f in serial.findings] == [("hash_mismatch", wrong.hex())]
    assert keyless_audit(AuditScope(workers=2)).findings == serial.findings
    assert keyless_audit(AuditScope(workers=2, since=time.time() + 1800)).findings == serial.findings


def test_ranges_read_in_many_short_transactions_find_the_same(path, built, monkeypatch):
    """Chunks of 3 pages (and 192 metadata records, incremental): every chunk boundary inside a range is crossed
    without a key read twice or skipped."""
    from kvcache.storage.lmdb import integrity as lmdb_integrity

    plant_everything(path, built)
    serial = audit(path)
    monkeypatch.setattr(lmdb_integrity, "VERIFY_CHUNK_PAGES", 3)
    assert audit(path, AuditScope(workers=3), parts=3).findings == serial.findings
    everything = audit(path, AuditScope(workers=2, since=0.0))
    headless = built.chains[6][12].hex()  # bytes without metadata: no metadata walk finds it (headless_pages)
    assert everything.pages_checked == serial.pages_checked - 1
    page_kinds = {"checksum_mismatch", "size_mismatch", "hash_mismatch", "missing_meta", "unknown_layout",
                  "missing_index", "missing_page"}
    assert [f for f in everything.findings if f.kind in page_kinds] == sorted(
        (f for f in serial.findings if f.kind in page_kinds and f.page_hash != headless),
        key=lambda f: f.page_hash or "")
