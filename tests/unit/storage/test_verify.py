"""LMDBStore.verify: the L3 integrity audit and its repair, fault by fault.

Each test builds a real store in a tmp dir, closes it, injects one fault with plain py-lmdb writes (registry
counters recomputed by hand where the fault alone would also skew them, so the report names exactly that fault),
and checks that verify reports exactly that kind, that repair removes exactly the bad or unreachable records,
that everything else still reads back bit-exact, and that a second verify is clean.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvcache.errors import InvalidInput, StoreReadOnly
from kvcache.storage.api import REPAIRS, VERIFY_KINDS, CapacityPolicy, NamespaceRecord, PageMeta, page_origins
from kvcache.storage.lmdb import integrity as lmdb_integrity
from kvcache.storage.lmdb import store as lmdb_store
from kvcache.storage.lmdb.store import LMDBStore, StoreTotals
from kvcache.storage.registry import open_store
from kvcache.types.keys import pack_tokens
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace
from lmdb_surgery import raw
from redis_server import redis_cluster, redis_server  # noqa: F401  (session fixtures of the redis backends)

LAYOUT = KVLayout("verify-model@r1", layers=2, kv_heads=2, head_dim=16, dtype="float16", page_size=4)  # 1 KiB pages
# Same geometry, another revision: pages of the same size, told apart only by the layout id.
OTHER_LAYOUT = KVLayout("verify-model@r2", layers=2, kv_heads=2, head_dim=16, dtype="float16", page_size=4)
PAGE = LAYOUT.bytes_per_page
NS = Namespace("tenant-a", "verify-salt")
NS2 = Namespace("tenant-b", "verify-salt")


def payload(page_hash: bytes) -> np.ndarray:
    return np.frombuffer(hashlib.shake_128(page_hash).digest(PAGE), dtype=np.uint8).copy()


def write(store: LMDBStore, tokens, ns: Namespace = NS, parent: bytes | None = None) -> list[bytes]:
    hashes, origins = page_origins(store.layout, pack_tokens(tokens), ns, store.chain_key, parent)
    result = store.put(hashes, [payload(h) for h in hashes], origins)
    assert result.written + result.existing == len(hashes)
    return hashes


def readable(store: LMDBStore, hashes: list[bytes]) -> int:
    """Pages of the chain read back from its start, each checked bit-exact."""
    out = np.zeros((len(hashes), PAGE), dtype=np.uint8)
    n = store.get_into(hashes, list(out))
    assert all(np.array_equal(out[i], payload(hashes[i])) for i in range(n))
    return n


class Chains(msgspec.Struct):
    """The healthy store every test starts from: 24 pages in two namespaces."""

    a: list[bytes]  # NS, tokens 0..39: 10 pages
    b: list[bytes]  # NS, a branch sharing a's first 3 pages, then 4 of its own
    c: list[bytes]  # NS2, tokens 0..39: 10 pages (other hashes than a)


@pytest.fixture
def path(tmp_path: Path) -> str:
    return str(tmp_path / "store")


@pytest.fixture
def chains(path: str) -> Chains:
    with LMDBStore.open(path, LAYOUT, create=True) as s:
        built = Chains(write(s, range(40)), write(s, [*range(12), *[7] * 16]), write(s, range(40), NS2))
        assert built.b[:3] == built.a[:3] and s.stats().pages == 24 and s.verify().ok
    return built


def kinds(report) -> list[tuple[str, str | None]]:
    return sorted((f.kind, f.page_hash) for f in report.findings)


def removed(report) -> dict[str, tuple[str, str | None]]:
    """page hex -> (what, below) of the removals of pages (index entries apart)."""
    out = {r.page_hash: (r.what, r.below) for r in report.removals if r.what != "index"}
    assert len(out) == len([r for r in report.removals if r.what != "index"])  # each record removed once
    return out


def assert_intact(s: LMDBStore, chains: Chains, pages: int, lost: dict[str, int] | None = None) -> None:
    """After a repair: a second verify is clean, the store holds `pages`, and every chain reads back bit-exact up
    to where it was cut (`lost`: chain name -> pages readable; default all)."""
    assert s.verify().ok
    assert s.stats().pages == pages
    for name in ("a", "b", "c"):
        hashes = getattr(chains, name)
        assert readable(s, hashes) == (lost or {}).get(name, len(hashes)), name
    assert sum(r.pages for r in s.namespaces()) == pages


def test_every_kind_is_described_and_every_repair_names_a_kind():
    assert {"orphan", "namespace_mismatch", "hash_mismatch"} <= set(VERIFY_KINDS)
    assert set(REPAIRS) <= set(VERIFY_KINDS)
    # key_mismatch is never repaired either (a repair refuses to remove anything for it)
    assert set(VERIFY_KINDS) - set(REPAIRS) - {"key_mismatch"} == {"unknown_layout", "unknown_namespace", "key_file"}


def test_a_healthy_store_repairs_nothing(path, chains):
    with LMDBStore.open(path, LAYOUT) as s:
        report = s.verify(repair=True)
        assert (report.ok, report.findings, report.repaired, report.removals) == (True, [], 0, [])
        assert report.pages_checked == 24 and report.bytes_checked == 24 * PAGE
        assert_intact(s, chains, 24)


def test_a_flipped_byte_goes_with_the_subtree_only_it_reached(path, chains):
    with raw(path) as r:
        value = bytearray(r.txn.get(chains.a[3], db=r.db["pages"]))
        value[100] ^= 0x10
        r.txn.put(chains.a[3], bytes(value), db=r.db["pages"])
    with LMDBStore.open(path, LAYOUT) as s:
        assert kinds(s.verify()) == [("checksum_mismatch", chains.a[3].hex())]
        report = s.verify(repair=True)
        assert report.repaired == 1 and report.findings[0].repaired
        head = chains.a[3].hex()
        assert removed(report) == {head: ("page", None), **{h.hex(): ("page", head) for h in chains.a[4:]}}
        assert sum(r.nbytes for r in report.removals) == 7 * PAGE
        assert_intact(s, chains, 17, {"a": 3})  # the sibling branch b and namespace NS2 untouched
        write(s, range(40))  # a later writer stores the chain again
        assert readable(s, chains.a) == 10 and s.verify().ok


def test_a_chain_whose_parent_was_never_stored_is_an_orphan(path, chains):
    with LMDBStore.open(path, LAYOUT) as s:
        # put() refuses a parent it does not hold; a chain whose parent record is lost later is an orphan.
        with pytest.raises(InvalidInput, match="parent"):
            write(s, range(100, 116), parent=os.urandom(16))
        anchor = write(s, range(200, 204))
        lost = write(s, range(100, 116), parent=anchor[0])
    with raw(path) as r:
        r.drop(anchor[0])
    with LMDBStore.open(path, LAYOUT) as s:
        report = s.verify()
        assert kinds(report) == [("orphan", lost[0].hex())]
        assert "3 page(s)" in report.findings[0].detail
        report = s.verify(repair=True)
        assert report.repaired == 1
        assert removed(report) == {lost[0].hex(): ("page", None), **{h.hex(): ("page", lost[0].hex())
                                                                    for h in lost[1:]}}
        assert_intact(s, chains, 24)


def test_a_missing_middle_page_orphans_its_subtree(path, chains):
    with raw(path) as r:
        r.drop(chains.a[5])
    with LMDBStore.open(path, LAYOUT) as s:
        report = s.verify()
        assert kinds(report) == [("orphan", chains.a[6].hex())]
        assert "3 page(s)" in report.findings[0].detail
        repaired = s.verify(repair=True)
        head = chains.a[6].hex()
        assert removed(repaired) == {head: ("page", None), **{h.hex(): ("page", head) for h in chains.a[7:]}}
        assert_intact(s, chains, 19, {"a": 5})


@pytest.mark.parametrize("where", ["leaf", "first page"])
def test_a_page_tagged_with_another_namespace_is_a_mismatch(path, chains, where):
    with LMDBStore.open(path, LAYOUT) as s:
        lone = write(s, range(200, 204))  # one page: its parent is NS's root
    target = chains.a[-1] if where == "leaf" else lone[0]
    with raw(path) as r:
        r.put_meta(target, msgspec.structs.replace(r.meta(target), ns_id=NS2.id))
    with LMDBStore.open(path, LAYOUT) as s:
        report = s.verify()
        assert kinds(report) == [("namespace_mismatch", target.hex())]
        if where == "first page":
            assert "root of namespace" in report.findings[0].detail
        assert removed(s.verify(repair=True)) == {target.hex(): ("page", None)}
        assert_intact(s, chains, 24, {"a": 9} if where == "leaf" else None)
        assert s.exists_prefix(lone) == (0 if where == "first page" else 1)


def test_a_page_tagged_with_another_layout_is_a_mismatch(path, chains):
    LMDBStore.open(path, OTHER_LAYOUT, add_layout=True).close()
    with raw(path) as r:
        r.put_meta(chains.c[-1], msgspec.structs.replace(r.meta(chains.c[-1]), layout_id=OTHER_LAYOUT.layout_id))
    with LMDBStore.open(path, LAYOUT) as s:
        assert kinds(s.verify()) == [("namespace_mismatch", chains.c[-1].hex())]
        assert removed(s.verify(repair=True)) == {chains.c[-1].hex(): ("page", None)}
        assert_intact(s, chains, 23, {"c": 9})


def test_a_page_filed_under_a_wrong_hash_is_a_hash_mismatch(path, chains):
    wrong = os.urandom(16)
    leaf = chains.b[-1]
    with raw(path) as r:
        meta = r.meta(leaf)
        value = r.txn.get(leaf, db=r.db["pages"])
        checksum = lmdb_store.CHECKSUMS[lmdb_store.DEFAULT_CHECKSUM].of(value[8:], wrong)  # consistent bytes
        r.drop(leaf)
        r.txn.put(wrong, checksum.to_bytes(8, "little") + value[8:], db=r.db["pages"])
        r.put_meta(wrong, msgspec.structs.replace(meta, checksum=checksum))
        r.txn.put(meta.parent, wrong, db=r.db["children"])
    with LMDBStore.open(path, LAYOUT) as s:
        assert kinds(s.verify()) == [("hash_mismatch", wrong.hex())]
        assert removed(s.verify(repair=True)) == {wrong.hex(): ("page", None)}
        assert_intact(s, chains, 23, {"b": 6})


def test_metadata_without_bytes_goes_with_its_subtree(path, chains):
    with raw(path) as r:
        r.drop(chains.c[7], meta=False, link=False)
    with LMDBStore.open(path, LAYOUT) as s:
        assert kinds(s.verify()) == [("missing_page", chains.c[7].hex())]
        report = s.verify(repair=True)
        head = chains.c[7].hex()
        assert removed(report) == {head: ("meta", None), chains.c[8].hex(): ("page", head),
                                   chains.c[9].hex(): ("page", head)}
        assert_intact(s, chains, 21, {"c": 7})


def test_bytes_without_metadata_go_with_their_subtree_and_index_entry(path, chains):
    with raw(path) as r:
        r.drop(chains.a[8], page=False, link=False)
    with LMDBStore.open(path, LAYOUT) as s:
        assert kinds(s.verify()) == sorted([("missing_meta", chains.a[8].hex()),
                                            ("dangling_index", chains.a[8].hex())])
        report = s.verify(repair=True)
        assert report.repaired == 2 and all(f.repaired for f in report.findings)
        head = chains.a[8].hex()
        assert removed(report) == {head: ("bytes", None), chains.a[9].hex(): ("page", head)}
        assert [(r.kind, r.page_hash) for r in report.removals if r.what == "index"] == [("dangling_index", head)]
        assert_intact(s, chains, 22, {"a": 8})


def test_dangling_children_entries_are_removed_and_nothing_else(path, chains):
    nowhere = os.urandom(16)
    with raw(path) as r:
        r.txn.put(chains.a[2], nowhere, db=r.db["children"])  # names a page never stored
        r.txn.put(chains.c[0], chains.c[5], db=r.db["children"])  # a stored page under a wrong parent
    with LMDBStore.open(path, LAYOUT) as s:
        assert kinds(s.verify()) == sorted([("dangling_index", nowhere.hex()), ("dangling_index", chains.c[5].hex())])
        report = s.verify(repair=True)
        assert report.repaired == 2
        assert sorted((r.what, r.page_hash) for r in report.removals) == sorted(
            [("index", nowhere.hex()), ("index", chains.c[5].hex())])
        assert_intact(s, chains, 24)
        assert [c.page_hash for c in s.children(chains.c[0])] == [chains.c[1]]


def test_a_missing_children_entry_is_added_back(path, chains):
    with raw(path) as r:
        assert r.txn.delete(chains.b[3], chains.b[4], db=r.db["children"])
    with LMDBStore.open(path, LAYOUT) as s:
        assert kinds(s.verify()) == [("missing_index", chains.b[4].hex())]
        report = s.verify(repair=True)
        assert (report.repaired, report.removals) == (1, [])
        assert_intact(s, chains, 24)
        assert [c.page_hash for c in s.children(chains.b[3])] == [chains.b[4]]


def test_registry_counters_off_are_recounted(path, chains):
    with raw(path, recount=False) as r:
        raw_record = r.txn.get(NS.id, db=r.db["namespaces"])
        record = msgspec.msgpack.decode(raw_record, type=NamespaceRecord)
        r.txn.put(NS.id, msgspec.msgpack.encode(msgspec.structs.replace(record, pages=record.pages + 3)),
                  db=r.db["namespaces"])
        totals = msgspec.msgpack.decode(r.txn.get(b"totals", db=r.db["store"]), type=StoreTotals)
        r.txn.put(b"totals", msgspec.msgpack.encode(StoreTotals(totals.pages, totals.bytes - 5)), db=r.db["store"])
    with LMDBStore.open(path, LAYOUT) as s:
        report = s.verify()
        assert [f.kind for f in report.findings] == ["counter_mismatch", "counter_mismatch"]
        assert "registry says 17 pages" in report.findings[0].detail
        repaired = s.verify(repair=True)
        assert (repaired.repaired, repaired.removals) == (2, [])
        assert_intact(s, chains, 24)
        assert {r.ns_id_hex: r.pages for r in s.namespaces()} == {NS.id_hex: 14, NS2.id_hex: 10}
        assert s.stats().bytes == 24 * PAGE


def test_repair_removes_in_bounded_transactions(path, chains, monkeypatch):
    monkeypatch.setattr(lmdb_integrity, "REPAIR_BATCH_PAGES", 3)
    with raw(path) as r:
        r.drop(chains.c[0])  # the whole of NS2's chain is orphaned
    with LMDBStore.open(path, LAYOUT) as s:
        assert kinds(s.verify()) == [("orphan", chains.c[1].hex())]
        writes = []
        real_write = s._lease.write
        monkeypatch.setattr(s._lease, "write", lambda body, wanted=0: writes.append(body) or real_write(body, wanted))
        report = s.verify(repair=True)
        assert len(removed(report)) == 9
        assert len(writes) == 3 + 1  # 9 pages, 3 per transaction, then the recount
        assert_intact(s, chains, 14, {"c": 0})


def test_repair_needs_a_writable_handle(path, chains):
    with raw(path) as r:
        r.drop(chains.a[5])
    with LMDBStore.open(path, LAYOUT, readonly=True) as s:
        assert not s.verify().ok
        with pytest.raises(StoreReadOnly):
            s.verify(repair=True)


def test_a_healthy_store_under_concurrent_writes_and_eviction_verifies_clean(path, chains):
    """Every check sees one consistent state (payload chunks check their metadata in the same transaction; the
    tree, index and counter checks read one snapshot), and repair rechecks in its own write transactions: a
    writer evicting and adding pages meanwhile yields no finding and no removal."""
    stop, warmed = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            with LMDBStore.open(path, LAYOUT, capacity=CapacityPolicy(capacity_bytes=40 * PAGE)) as w:
                k = 0
                while not stop.is_set():
                    write(w, range(1000 + 12 * k, 1012 + 12 * k), NS if k % 2 else NS2)
                    k += 1
                    if k == 8:  # 24 + 8 x 3 pages: past the capacity, evicting from here on
                        warmed.set()
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            warmed.set()  # never leave the verifying side waiting

    with LMDBStore.open(path, LAYOUT) as s:
        writer = threading.Thread(target=churn)
        writer.start()
        try:
            warmed.wait()
            reports = [s.verify(repair=i % 2 == 1) for i in range(20)]
        finally:
            stop.set()
            writer.join()
        assert errors == []
        assert [(r.findings, r.removals) for r in reports] == [([], [])] * 20
        assert s.verify().ok and s.stats().pages <= 40


# --- every backend, one verifier -------------------------------------------------------------------------------
# The checks and repairs live once in kvcache.storage.verify; each backend only reads and removes records. The same
# fault, injected by hand into LMDB and into Redis (standalone and cluster), must give the same findings and the
# same removals. The conformance suite covers the one fault a backend-neutral API can inject (a flipped byte).


class Surgeon:
    """Damage to one store through its storage directly (the store closed), the registry counters kept at what
    verify counts (whole pages), so the report names exactly the fault injected."""

    def drop(self, h: bytes, *, page: bool = True, meta: bool = True, link: bool = True) -> None:
        raise NotImplementedError

    def link(self, parent: bytes, child: bytes) -> None:
        raise NotImplementedError

    def unlink(self, parent: bytes, child: bytes) -> None:
        raise NotImplementedError


class LMDBSurgeon(Surgeon):
    def __init__(self, location: str) -> None:
        self.path = location

    def drop(self, h: bytes, *, page: bool = True, meta: bool = True, link: bool = True) -> None:
        with raw(self.path) as r:
            r.drop(h, page=page, meta=meta, link=link)

    def link(self, parent: bytes, child: bytes) -> None:
        with raw(self.path) as r:
            r.txn.put(parent, child, db=r.db["children"])

    def unlink(self, parent: bytes, child: bytes) -> None:
        with raw(self.path) as r:
            assert r.txn.delete(parent, child, db=r.db["children"])


class RedisSurgeon(Surgeon):
    def __init__(self, location: str) -> None:
        from urllib.parse import parse_qs, urlsplit

        import redis

        parts = urlsplit(location)
        self.prefix = parse_qs(parts.query)["prefix"][0].encode()
        cls = redis.RedisCluster if parts.scheme.endswith("+cluster") else redis.Redis
        self.client = cls(host=parts.hostname, port=parts.port)

    def _pk(self, h: bytes) -> bytes:
        return self.prefix + b"p:" + h.hex().encode()

    def _ck(self, h: bytes) -> bytes:
        return self.prefix + b"c:" + h.hex().encode()

    def drop(self, h: bytes, *, page: bool = True, meta: bool = True, link: bool = True) -> None:
        meta_rec = msgspec.msgpack.decode(self.client.hget(self._pk(h), "m"), type=PageMeta)
        if link:
            assert self.client.srem(self._ck(meta_rec.parent), h)
        fields = [f for f, gone in (("d", page), ("m", meta)) if gone]
        if len(fields) == 2:
            fields = ["d", "m", "n", "p", "h", "a"]  # the whole record
        assert self.client.hdel(self._pk(h), *fields)
        ns = self.prefix + b"ns:" + meta_rec.ns_id.hex().encode()
        self.client.hincrby(ns, "pages", -1)
        self.client.hincrby(ns, "bytes", -meta_rec.nbytes)

    def link(self, parent: bytes, child: bytes) -> None:
        self.client.sadd(self._ck(parent), child)

    def unlink(self, parent: bytes, child: bytes) -> None:
        assert self.client.srem(self._ck(parent), child)


BACKENDS = ["lmdb", "redis", "redis+cluster"]


@pytest.fixture(params=BACKENDS)
def any_store(request, tmp_path) -> tuple[str, Surgeon, Chains]:
    """(location, surgeon) of a store holding the `Chains` pages, on each backend."""
    if request.param == "lmdb":
        location = str(tmp_path / "store")
        surgeon: type[Surgeon] = LMDBSurgeon
    else:
        server = request.getfixturevalue("redis_cluster" if request.param.endswith("+cluster") else "redis_server")
        location, surgeon = server.store_url(), RedisSurgeon
    with open_store(location, LAYOUT, create=True, add_layout=True) as s:
        built = Chains(write(s, range(40)), write(s, [*range(12), *[7] * 16]), write(s, range(40), NS2))
        assert s.verify().ok
    return location, surgeon(location), built


FAULTS = {
    # name: (damage, findings, page removals {hash: (what, below)}, index removals, chains readable, pages left)
    "a middle page lost": (
        lambda c, op: op.drop(c.a[5]),
        lambda c: [("orphan", c.a[6])],
        lambda c: {c.a[6]: ("page", None), **{h: ("page", c.a[6]) for h in c.a[7:]}}, [], {"a": 5}, 19),
    "metadata without bytes": (
        lambda c, op: op.drop(c.c[7], meta=False, link=False),
        lambda c: [("missing_page", c.c[7])],
        lambda c: {c.c[7]: ("meta", None), c.c[8]: ("page", c.c[7]), c.c[9]: ("page", c.c[7])}, [], {"c": 7}, 21),
    "bytes without metadata": (
        lambda c, op: op.drop(c.a[8], page=False, link=False),
        lambda c: [("dangling_index", c.a[8]), ("missing_meta", c.a[8])],
        lambda c: {c.a[8]: ("bytes", None), c.a[9]: ("page", c.a[8])}, ["a8"], {"a": 8}, 22),
    "a children entry naming no page": (
        lambda c, op: op.link(c.a[2], NOWHERE),
        lambda c: [("dangling_index", NOWHERE)],
        lambda c: {}, ["nowhere"], {}, 24),
    "a children entry lost": (
        lambda c, op: op.unlink(c.b[3], c.b[4]),
        lambda c: [("missing_index", c.b[4])],
        lambda c: {}, [], {}, 24),
}
NOWHERE = bytes(range(16))


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_every_backend_reports_and_repairs_a_fault_the_same_way(any_store, fault):
    location, surgeon, c = any_store
    damage, findings, removals, index_removals, cut, left = FAULTS[fault]
    damage(c, surgeon)
    with open_store(location, LAYOUT) as s:
        report = s.verify()
        assert kinds(report) == sorted((k, h.hex()) for k, h in findings(c))
        repaired = s.verify(repair=True)
        assert repaired.repaired == len(report.findings) and all(f.repaired for f in repaired.findings)
        assert removed(repaired) == {h.hex(): (what, below and below.hex()) for h, (what, below) in removals(c).items()}
        named = {"a8": c.a[8], "nowhere": NOWHERE}
        assert sorted(r.page_hash for r in repaired.removals if r.what == "index") == sorted(
            named[n].hex() for n in index_removals)
        assert s.verify().ok
        for name in ("a", "b", "c"):
            hashes = getattr(c, name)
            assert readable(s, hashes) == cut.get(name, len(hashes)), name
        assert s.stats().pages == sum(r.pages for r in s.namespaces()) == left


# --- engine pages ----------------------------------------------------------------------------------------------

from kvcache.storage.api import engine_origins  # noqa: E402
from kvcache.storage.verify import verify as shared_verify  # noqa: E402
from kvcache.types.keys import engine_page_hash, hash_root  # noqa: E402

ENGINE_KEYS = [hashlib.sha256(bytes([i])).digest() for i in range(6)]


def write_engine(store: LMDBStore, keys: list[bytes], ns: Namespace = NS) -> list[bytes]:
    hashes, origins = engine_origins(store.layout, ns, store.chain_key, keys)
    assert store.put(hashes, [payload(h) for h in hashes], origins).written == len(keys)
    return hashes


def keyless(s: LMDBStore, repair: bool = False):
    """verify as a reader who may not read the key file: roots from the namespace records."""
    source = lmdb_integrity.LMDBIntegrity(s._lease.live(), s._lease.write)
    source.chain_key = None
    return shared_verify(source, repair)


@pytest.mark.parametrize("with_key", [True, False])
def test_an_engine_page_filed_under_a_wrong_hash_is_a_hash_mismatch(path, chains, with_key):
    with LMDBStore.open(path, LAYOUT) as s:
        engine = write_engine(s, ENGINE_KEYS)
        chain_key = s.chain_key
        assert s.verify().ok and keyless(s).ok  # sound engine pages pass, with the key and without
    # the last engine page re-filed under its key's hash in another namespace (consistent bytes and checksum)
    wrong = engine_page_hash(hash_root(LAYOUT.layout_id, NS2, chain_key), ENGINE_KEYS[-1])
    with raw(path) as r:
        meta = r.meta(engine[-1])
        value = r.txn.get(engine[-1], db=r.db["pages"])
        checksum = lmdb_store.CHECKSUMS[lmdb_store.DEFAULT_CHECKSUM].of(value[8:], wrong)
        r.drop(engine[-1])
        r.txn.put(wrong, checksum.to_bytes(8, "little") + value[8:], db=r.db["pages"])
        r.put_meta(wrong, msgspec.structs.replace(meta, checksum=checksum))
        r.txn.put(meta.parent, wrong, db=r.db["children"])
    with LMDBStore.open(path, LAYOUT) as s:
        check = s.verify if with_key else lambda repair=False: keyless(s, repair)
        assert kinds(check()) == [("hash_mismatch", wrong.hex())]
        assert removed(check(repair=True)) == {wrong.hex(): ("page", None)}
        assert check().ok
        assert s.exists_prefix(engine[:-1]) == 5 and s.exists_prefix([wrong]) == 0
        assert_intact(s, chains, 24 + 5)


def test_an_engine_page_whose_parent_is_gone_is_no_orphan_its_key_proves_it(path, chains):
    # Unlike a token page (whose hash chains its parent's), an engine page's parent is a hint: its hash is its key's
    # under its namespace root. A parent gone (a corrupt one the store dropped) leaves the pages below it intact and
    # readable by their keys: no finding, and a repair removes none of them.
    with LMDBStore.open(path, LAYOUT) as s:
        engine = write_engine(s, ENGINE_KEYS)
    with raw(path) as r:
        r.drop(engine[2])
    with LMDBStore.open(path, LAYOUT) as s:
        assert kinds(s.verify()) == []
        assert s.verify(repair=True).removals == []
        assert s.exists_prefix(engine) == 2 and s.exists_prefix(engine[3:]) == len(engine) - 3
        write_engine(s, ENGINE_KEYS[2:3])  # the engine writes the lost page again (it hangs from the root)
        assert s.exists_prefix(engine) == len(engine) and s.verify().ok
        assert_intact(s, chains, 24 + len(engine))
