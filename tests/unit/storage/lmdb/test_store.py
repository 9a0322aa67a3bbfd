"""kvcache.storage.lmdb.store: opening errors, map growth, capacity eviction, checksums, access batching.

Real LMDB environments in tmp dirs. The read-only-location and full-disk cases mount a small tmpfs (root only;
skipped where mounting is not allowed).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import lmdb
import msgspec
import numpy as np
import pytest

from kvcache.errors import InvalidInput, LayoutMismatch, NotAStore, StoreFull, StoreReadOnly, StoreUnsupported
from kvcache.storage.api import AccessPolicy, CapacityPolicy, DeleteResult, PageOrigin, page_origins
from kvcache.storage.lmdb import delete as lmdb_delete
from kvcache.storage.lmdb import store as lmdb_store
from kvcache.storage.lmdb.reads import RELEASED_COPY_BYTES
from kvcache.storage.lmdb.store import LMDBStore
from kvcache.storage.registry import open_store
from kvcache.types.keys import pack_tokens
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace

LAYOUT = KVLayout("unit-model@r1", layers=2, kv_heads=2, head_dim=16, dtype="float16", page_size=4)  # 1 KiB pages
PAGE = LAYOUT.bytes_per_page
SALT = "unit-salt-d41d8cd98f"
NS = Namespace("tenant-a", SALT)
NS2 = Namespace("tenant-b", SALT)


def payload(page_hash: bytes, nbytes: int = PAGE) -> np.ndarray:
    return np.frombuffer(hashlib.shake_128(page_hash).digest(nbytes), dtype=np.uint8).copy()


def write(store, tokens, ns=NS, layout=LAYOUT):
    hashes, origins = page_origins(layout, pack_tokens(tokens), ns, store.chain_key)
    result = store.put(hashes, [payload(h, layout.bytes_per_page) for h in hashes], origins)
    return hashes, result


def read(store, hashes, layout=LAYOUT):
    out = np.zeros((len(hashes), layout.bytes_per_page), dtype=np.uint8)
    n = store.get_into(hashes, list(out))
    assert all(np.array_equal(out[i], payload(hashes[i], layout.bytes_per_page)) for i in range(n))
    return n


@pytest.fixture
def path(tmp_path: Path) -> str:
    return str(tmp_path / "store")


@pytest.fixture
def store(path):
    s = LMDBStore.open(path, LAYOUT, create=True)
    yield s
    s.close()


class Tmpfs:
    """A small tmpfs mounted for one test (needs root)."""

    def __init__(self, where: Path, size: str) -> None:
        self.where = where
        where.mkdir()
        rc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                            capture_output=True).returncode
        if rc != 0:
            if os.environ.get("CI"):  # CI runs as root: a mount that fails there is a failure, not a skip
                pytest.fail("cannot mount a tmpfs (CI runs as root, so this should work)")
            pytest.skip("cannot mount a tmpfs here (needs root)")

    def remount_readonly(self) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(self.where)], check=True)

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.where)], capture_output=True)


@pytest.fixture
def tmpfs(tmp_path: Path):
    mounts: list[Tmpfs] = []

    def mount(size: str) -> Tmpfs:
        m = Tmpfs(tmp_path / f"mnt{len(mounts)}", size)
        mounts.append(m)
        return m

    yield mount
    for m in mounts:
        m.unmount()


# -- opening --------------------------------------------------------------------------------------------------


def test_a_regular_file_is_not_a_store(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"hello")
    with pytest.raises(NotAStore) as info:
        LMDBStore.open(str(f), LAYOUT, create=True)
    assert info.value.path == str(f) and "regular file" in str(info.value)


def test_a_foreign_lmdb_is_not_a_store(tmp_path):
    foreign = tmp_path / "foreign"
    env = lmdb.open(str(foreign), max_dbs=2)
    with env.begin(write=True) as txn:
        txn.put(b"some", b"thing")
    env.close()
    for create in (False, True):
        with pytest.raises(NotAStore) as info:
            LMDBStore.open(str(foreign), LAYOUT, create=create)
        assert "foreign LMDB" in str(info.value)


def test_a_non_empty_directory_is_not_turned_into_a_store(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "notes.txt").write_text("mine")
    with pytest.raises(NotAStore):
        LMDBStore.open(str(tmp_path / "dir"), LAYOUT, create=True)
    assert sorted(os.listdir(tmp_path / "dir")) == ["notes.txt"]


def test_garbage_in_data_mdb_is_not_a_store(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "data.mdb").write_bytes(os.urandom(64 << 10))
    with pytest.raises(NotAStore):
        LMDBStore.open(str(tmp_path / "junk"), LAYOUT)


def _rewrite_format(path: str, **changes) -> None:
    env = lmdb.open(path, max_dbs=lmdb_store.MAX_DBS)
    db = env.open_db(b"store")
    with env.begin(write=True, db=db) as txn:
        fmt = msgspec.msgpack.decode(txn.get(b"format"), type=lmdb_store.StoreFormat)
        txn.put(b"format", msgspec.msgpack.encode(msgspec.structs.replace(fmt, **changes)))
    env.close()


def test_a_newer_format_or_unknown_checksum_is_unsupported(path):
    LMDBStore.open(path, LAYOUT, create=True).close()
    _rewrite_format(path, version=lmdb_store.FORMAT_VERSION + 1)
    with pytest.raises(StoreUnsupported, match="newer"):
        LMDBStore.open(path, LAYOUT)
    _rewrite_format(path, version=lmdb_store.FORMAT_VERSION, checksum="sha0")
    with pytest.raises(StoreUnsupported, match="sha0"):
        LMDBStore.open(path, LAYOUT)
    _rewrite_format(path, magic="not-kvc", checksum=lmdb_store.DEFAULT_CHECKSUM)
    with pytest.raises(NotAStore):
        LMDBStore.open(path, LAYOUT)


def test_layout_must_be_held_unless_added(path):
    other = KVLayout("unit-model@r1", layers=2, kv_heads=2, head_dim=16, dtype="bfloat16", page_size=4)
    LMDBStore.open(path, LAYOUT, create=True).close()
    with pytest.raises(LayoutMismatch) as info:
        LMDBStore.open(path, other, create=True)  # create does not register a layout in an existing store
    assert info.value.held == [LAYOUT.describe()] and "bfloat16" in info.value.requested
    with pytest.raises(StoreReadOnly):
        LMDBStore.open(path, other, readonly=True, add_layout=True)
    with LMDBStore.open(path, other, add_layout=True) as s:
        assert s.layouts() == [LAYOUT, other]


def test_two_handles_in_one_process_share_the_environment(path):
    first = LMDBStore.open(path, LAYOUT, create=True)
    second = LMDBStore.open(path, LAYOUT)
    hashes, _ = write(first, range(16))
    assert second.exists_prefix(hashes) == 4
    first.close()
    first.close()  # idempotent
    assert read(second, hashes) == 4
    second.close()


def test_readonly_handle_refuses_writes_and_records_no_access(path):
    with LMDBStore.open(path, LAYOUT, create=True) as s:
        hashes, _ = write(s, range(16))
    with LMDBStore.open(path, LAYOUT, readonly=True) as ro:
        assert ro.readonly
        with pytest.raises(StoreReadOnly):
            write(ro, range(100, 116))
        with pytest.raises(StoreReadOnly):
            ro.delete_namespace(NS.id)
        assert read(ro, hashes) == 4
        assert ro.counters().pending_access == 0
    with LMDBStore.open(path, LAYOUT) as s:
        assert s.page_meta(hashes[0]).hits == 0


def test_readonly_location_opens_for_reading_and_refuses_writes(tmpfs):
    mount = tmpfs("16m")
    where = str(mount.where / "store")
    with LMDBStore.open(where, LAYOUT, create=True) as s:
        hashes, _ = write(s, range(16))
    mount.remount_readonly()
    with pytest.raises(StoreReadOnly):
        LMDBStore.open(str(mount.where / "other"), LAYOUT, create=True)
    with LMDBStore.open(where, LAYOUT) as s:
        assert s.readonly
        assert read(s, hashes) == 4
        with pytest.raises(StoreReadOnly, match="read-only location"):
            write(s, range(100, 116))


def test_full_disk_is_store_full_and_loses_nothing_acknowledged(tmpfs):
    mount = tmpfs("2m")
    where = str(mount.where / "store")
    acked: list[list[bytes]] = []
    with LMDBStore.open(where, LAYOUT, create=True, map_size=64 << 20) as s:
        with pytest.raises(StoreFull) as info:
            for i in range(1000):
                hashes, _ = write(s, range(64 * i, 64 * i + 64))
                acked.append(hashes)
        assert info.value.path == os.path.realpath(where)
        assert acked, "the disk filled before the first batch"
    with LMDBStore.open(where, LAYOUT) as s:
        assert s.verify().ok
        assert all(read(s, hashes) == len(hashes) for hashes in acked)


# -- writing ----------------------------------------------------------------------------------------------


def test_put_rejects_malformed_batches(store, path):
    hashes, origins = page_origins(LAYOUT, pack_tokens(range(8)), NS, store.chain_key)
    good = [payload(h) for h in hashes]
    with pytest.raises(InvalidInput, match="bytes"):
        store.put(hashes, [good[0], good[1][:-1]], origins)
    with pytest.raises(InvalidInput, match="as many"):
        store.put(hashes, good[:1], origins)
    with pytest.raises(InvalidInput, match="hash of its parent"):
        store.put(hashes[::-1], good, origins)
    short = [PageOrigin(o.namespace, o.parent, o.tokens[:-4]) for o in origins]
    with pytest.raises(InvalidInput, match="token bytes"):
        store.put(hashes, good, short)
    # A chain continued under another namespace than its stored parent's.
    store.put(hashes[:1], good[:1], origins[:1])
    foreign, forigins = page_origins(LAYOUT, pack_tokens(range(4, 8)), NS2, store.chain_key, parent=hashes[0])
    with pytest.raises(InvalidInput, match="another namespace"):
        store.put(foreign, [payload(foreign[0])], forigins)
    # ... and under another namespace than its parent's in the same batch (the parent not stored yet).
    fresh, fresh_origins = page_origins(LAYOUT, pack_tokens(range(100, 108)), NS, store.chain_key)
    mixed = [fresh_origins[0], PageOrigin(NS2, fresh_origins[1].parent, fresh_origins[1].tokens)]
    with pytest.raises(InvalidInput, match="another namespace"):
        store.put(fresh, [payload(h) for h in fresh], mixed)
    with LMDBStore.open(path) as no_layout, pytest.raises(InvalidInput, match="layout"):
        no_layout.put(hashes, good, origins)
    assert store.stats().pages == 1 and store.verify().ok


def test_get_into_rejects_unusable_views(store):
    hashes, _ = write(store, range(8))
    with pytest.raises(InvalidInput, match="out view"):
        store.get_into(hashes, [np.zeros(PAGE, np.uint8)])
    with pytest.raises(InvalidInput, match="contiguous"):
        store.get_into(hashes[:1], [np.zeros((PAGE, 2), np.uint8)[:, 0]])
    with pytest.raises(InvalidInput, match="writable"):
        store.get_into(hashes[:1], [bytes(PAGE)])
    with pytest.raises(InvalidInput, match="out views of"):
        store.get_into(hashes[:1], [np.zeros(PAGE // 2, np.uint8)])


def test_map_grows_through_many_batches_without_losing_any(path):
    with LMDBStore.open(path, LAYOUT, create=True, map_size=64 << 10) as s:
        start = s.map_size()
        batches = [write(s, range(32 * i, 32 * i + 32))[0] for i in range(60)]
        assert s.map_size() > start
        assert all(read(s, hashes) == 8 for hashes in batches)
        assert s.stats().pages == 480
        assert s.verify().ok


def test_capacity_evicts_least_recent_leaves_first(path):
    policy = CapacityPolicy(capacity_bytes=10 * PAGE, evict_headroom=0.0)
    with LMDBStore.open(path, LAYOUT, create=True, capacity=policy) as s:
        a, _ = write(s, [1] * 16)  # four pages each
        b, _ = write(s, [2] * 16)
        assert read(s, a) == 4
        s.flush()  # a is now more recent than b
        c, result = write(s, [3] * 16)
        assert (result.written, result.evicted, result.rejected) == (4, 2, 0)
        # b lost its two deepest pages: a parent with a stored child is never taken first.
        assert [s.exists_prefix(x) for x in (a, b, c)] == [4, 2, 4]
        assert s.stats().bytes == 10 * PAGE
        assert s.counters().pages_evicted == 2
        assert s.verify().ok


def test_eviction_frees_headroom_beyond_the_need(path):
    policy = CapacityPolicy(capacity_bytes=20 * PAGE, evict_headroom=0.25)  # 5 pages of headroom
    with LMDBStore.open(path, LAYOUT, create=True, capacity=policy) as s:
        for i in range(5):
            write(s, range(100 * i, 100 * i + 16))
        _, result = write(s, range(1000, 1004))
        assert (result.written, result.evicted) == (1, 6)
        _, result = write(s, range(2000, 2016))  # fits in the headroom: no scan, no eviction
        assert (result.written, result.evicted) == (4, 0)
        assert s.verify().ok


def test_a_batch_larger_than_the_capacity_keeps_its_prefix(path):
    with LMDBStore.open(path, LAYOUT, create=True, capacity=CapacityPolicy(capacity_bytes=3 * PAGE)) as s:
        hashes, result = write(s, range(20))
        assert (result.written, result.rejected) == (3, 2)
        assert s.exists_prefix(hashes) == 3
        assert s.capacity_bytes() == 3 * PAGE
        s.set_capacity(0)
        hashes, result = write(s, range(20))
        assert (result.written, result.existing) == (2, 3)


def test_delete_namespace_uses_bounded_transactions(store, monkeypatch):
    monkeypatch.setattr(lmdb_delete, "DELETE_BATCH_PAGES", 8)
    mine, _ = write(store, range(200))  # 50 pages
    theirs, _ = write(store, range(200), NS2)
    result = store.delete_namespace(NS.id)
    assert (result.pages, result.transactions) == (50, 7 + 1)  # 7 batches of <= 8, then a scan that finds none
    assert store.exists_prefix(mine) == 0 and store.exists_prefix(theirs) == 50
    assert [r.extra_key for r in store.namespaces()] == ["tenant-b"]
    assert store.verify().ok
    assert store.delete_namespace(NS.id) == DeleteResult(0, 0, 1)


# -- checksums and access batching ----------------------------------------------------------------------------


def _flip_payload_byte(path: str, page: np.ndarray) -> None:
    """Flip one bit of every copy of `page` in data.mdb (copy-on-write leaves stale copies on free pages)."""
    data_file = os.path.join(path, "data.mdb")
    raw = bytearray(Path(data_file).read_bytes())
    needle = page.tobytes()
    at = raw.find(needle)
    assert at >= 0
    while at >= 0:
        raw[at + 7] ^= 0x01
        at = raw.find(needle, at + 1)
    Path(data_file).write_bytes(bytes(raw))


@pytest.mark.parametrize("checksum", sorted(lmdb_store.CHECKSUMS))
def test_checksum_failure_is_a_counted_miss_reported_and_dropped(path, checksum):
    with LMDBStore.open(path, LAYOUT, create=True, checksum=checksum) as s:
        hashes, _ = write(s, range(32))
    _flip_payload_byte(path, payload(hashes[5]))
    with LMDBStore.open(path, LAYOUT) as s:
        assert s.stats().checksum == checksum  # the store keeps the algorithm it was created with
        assert [(f.kind, f.page_hash) for f in s.verify().findings] == [("checksum_mismatch", hashes[5].hex())]
        assert read(s, hashes) == 5
        assert read(s, hashes[5:]) == 0
        counters = s.counters()
        assert (counters.checksum_failures, counters.misses) == (1, 2)
        s.flush()  # a page seen corrupt is dropped at the next flush: the next writer can store it again
        assert s.stats().pages == 7
        # The pages below it are unreachable until a writer stores it again: an orphan chain, kept so that
        # rewriting the one page heals the whole chain.
        assert [(f.kind, f.page_hash) for f in s.verify().findings] == [("orphan", hashes[6].hex())]
        assert read(s, hashes) == 5
        write(s, range(32))
        assert read(s, hashes) == 8
        assert s.verify().ok


def test_reads_update_access_in_batches_not_per_read(path):
    policy = AccessPolicy(flush_reads=10_000, flush_interval_s=1e9)
    with LMDBStore.open(path, LAYOUT, create=True, access=policy) as s:
        hashes, _ = write(s, range(16))
        created = s.page_meta(hashes[-1]).last_access
        for _ in range(3):
            read(s, hashes)
        assert s.page_meta(hashes[-1]).hits == 0  # nothing written yet
        assert s.counters().pending_access == 12
        s.flush()
        deepest = s.page_meta(hashes[-1])
        assert deepest.hits == 3 and deepest.last_access > created
        # A read is credited once, to the deepest page it reached; its ancestors' heat is their subtree's.
        assert s.page_meta(hashes[0]).hits == 0
        first = s.children(s.root(NS))[0]
        assert (first.page_hash, first.hits, first.last_access) == (hashes[0], 3, deepest.last_access)
        assert s.counters().pending_access == 0 and s.counters().flushes == 1
        assert s.namespaces()[0].hits == 12  # pages served
        read(s, hashes[:2])
        write(s, range(100, 116))  # a put carries pending reads in its own transaction
        assert s.page_meta(hashes[1]).hits == 1
        assert s.verify().ok


def test_access_flushes_by_itself_past_the_policy_threshold(path):
    with LMDBStore.open(path, LAYOUT, create=True, access=AccessPolicy(flush_reads=3)) as s:
        hashes, _ = write(s, range(16))
        read(s, hashes)
        read(s, hashes)
        assert s.page_meta(hashes[-1]).hits == 0
        read(s, hashes)
        assert s.page_meta(hashes[-1]).hits == 3
        assert s.counters().pending_access == 0


def test_eviction_counts_a_parent_as_recent_as_the_child_it_loses(path):
    policy = CapacityPolicy(capacity_bytes=6 * PAGE, evict_headroom=0.0)
    with LMDBStore.open(path, LAYOUT, create=True, capacity=policy) as s:
        old, _ = write(s, [1] * 8)  # two pages, never read
        hot, _ = write(s, [2] * 16)  # four pages: only the deepest one is credited when read
        read(s, hot)
        s.flush()
        _, result = write(s, [3] * 12)  # needs three pages of room
        assert result.evicted == 3
        # old goes first (both pages), then hot's tail only: its parents inherit the read time.
        assert (s.exists_prefix(old), s.exists_prefix(hot)) == (0, 3)


def test_verify_reports_broken_metadata_and_indexes(path):
    with LMDBStore.open(path, LAYOUT, create=True) as s:
        hashes, _ = write(s, range(16))
    env = lmdb.open(path, max_dbs=lmdb_store.MAX_DBS)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        txn.delete(hashes[3], db=meta)
    env.close()
    with LMDBStore.open(path, LAYOUT) as s:
        kinds = sorted({f.kind for f in s.verify().findings})
        assert kinds == ["counter_mismatch", "dangling_index", "missing_meta"]


def test_stats_report_totals_and_footprint(store):
    write(store, range(40))
    write(store, range(40), NS2)
    stats = store.stats()
    assert (stats.backend, stats.layouts, stats.namespaces, stats.pages, stats.bytes) == ("lmdb", 1, 2, 20, 20 * PAGE)
    assert stats.footprint_bytes >= stats.bytes
    assert stats.format_version == lmdb_store.FORMAT_VERSION


def test_the_salt_is_in_no_byte_of_the_files(path):
    with open_store(path, LAYOUT, create=True) as s:
        hashes, _ = write(s, range(64))
        write(s, range(64), NS2)
        read(s, hashes)
        s.flush()
        s.delete_namespace(NS2.id)
        assert s.verify().ok
    for name in os.listdir(path):
        raw = Path(path, name).read_bytes()
        for encoded in (SALT.encode(), SALT.encode("utf-16-le"), SALT.encode().hex().encode()):
            assert encoded not in raw, name


# -- namespace quotas -----------------------------------------------------------------------------------------


def test_a_namespace_over_its_quota_evicts_its_own_pages_first(path):
    policy = CapacityPolicy(namespace_quota_bytes=4 * PAGE, evict_headroom=0.0)
    with LMDBStore.open(path, LAYOUT, create=True, capacity=policy) as s:
        assert s.namespace_quota_bytes() == 4 * PAGE and s.capacity_bytes() == 0
        theirs, _ = write(s, range(16), NS2)  # the oldest pages in the store, but another namespace's
        first, _ = write(s, range(100, 116))
        second, result = write(s, range(200, 208))
        assert (result.written, result.evicted, result.rejected) == (2, 2, 0)
        assert [s.exists_prefix(x) for x in (theirs, first, second)] == [4, 2, 2]
        records = {r.extra_key: r.bytes for r in s.namespaces()}
        assert records == {"tenant-a": 4 * PAGE, "tenant-b": 4 * PAGE}
        assert s.stats().namespace_quota_bytes == 4 * PAGE
        assert s.verify().ok


def test_quota_rejects_only_the_namespace_over_it(path):
    policy = CapacityPolicy(namespace_quota_bytes=3 * PAGE)
    with LMDBStore.open(path, LAYOUT, create=True, capacity=policy) as s:
        mine, origins = page_origins(LAYOUT, pack_tokens(range(20)), NS, s.chain_key)  # five pages: two over the quota
        theirs, their_origins = page_origins(LAYOUT, pack_tokens(range(8)), NS2, s.chain_key)
        hashes = [mine[0], theirs[0], *mine[1:], theirs[1]]  # interleaved in one batch
        origins = [origins[0], their_origins[0], *origins[1:], their_origins[1]]
        result = s.put(hashes, [payload(h) for h in hashes], origins)
        assert (result.written, result.rejected, result.evicted) == (5, 2, 0)
        assert (s.exists_prefix(mine), s.exists_prefix(theirs)) == (3, 2)
        s.set_capacity(0, namespace_quota_bytes=0)
        assert s.put(hashes, [payload(h) for h in hashes], origins).written == 2
        assert s.verify().ok


def test_a_page_whose_stored_size_is_wrong_is_a_counted_quarantined_miss(path):
    with LMDBStore.open(path, LAYOUT, create=True) as store:
        hashes, _ = write(store, range(12))
    env = lmdb.open(path, max_dbs=lmdb_store.MAX_DBS)
    with env.begin(write=True) as txn:  # the second page's value cut short: its recorded size is now wrong
        pages = env.open_db(b"pages", txn=txn, create=False)
        txn.put(hashes[1], bytes(txn.get(hashes[1], db=pages))[:100], db=pages)
    env.close()
    with LMDBStore.open(path, LAYOUT) as store:
        out = np.zeros((3, PAGE), np.uint8)
        assert store.get_into(hashes, list(out)) == 1  # a miss, not InvalidInput
        assert store.get_into(hashes, list(out)) == 1  # quarantined: still a miss
        assert store.counters().checksum_failures == 1 and store.counters().misses == 2
        assert {f.kind for f in store.verify().findings} >= {"size_mismatch"}
        store.flush()  # the next write transaction drops it (checked again first)
        assert store.page_meta(hashes[1]) is None and store.verify(repair=True).removals
        assert store.verify().ok
    with LMDBStore.open(path, LAYOUT) as store, pytest.raises(InvalidInput, match="out views of"):
        store.get_into(hashes[:1], [np.zeros(PAGE - 1, np.uint8)])  # a caller's wrong buffer is still an error


def test_records_that_do_not_decode_are_findings_and_one_repair_clears_them(path):
    with LMDBStore.open(path, LAYOUT, create=True) as store:
        hashes, _ = write(store, range(16))
        write(store, range(100, 108), ns=NS2)
    env = lmdb.open(path, max_dbs=lmdb_store.MAX_DBS)
    with env.begin(write=True) as txn:
        meta = env.open_db(b"meta", txn=txn, create=False)
        txn.put(hashes[2], b"\xc1 not msgpack", db=meta)  # a damaged page record...
        registry = env.open_db(b"namespaces", txn=txn, create=False)
        txn.put(NS2.id, b"\xc1", db=registry)  # ... and a damaged namespace record
    env.close()
    with LMDBStore.open(path, readonly=True) as store:
        kinds = {f.kind for f in store.verify().findings}
        assert {"missing_meta", "damaged_record"} <= kinds
        with pytest.raises(lmdb_store.StoreError, match="kvc audit --repair"):
            store.namespaces()  # outside verify, a damaged record is one StoreError naming the cure
    with LMDBStore.open(path, LAYOUT) as store:
        report = store.verify(repair=True)
        assert report.repaired == len(report.findings)
        assert store.verify().ok  # one pass
        assert store.stats().pages == 2  # the first two pages of NS; the rest hung below the damaged one or was NS2's


@pytest.mark.parametrize("checksum", sorted(lmdb_store.CHECKSUMS))
def test_pages_in_segments_are_summed_as_copied_with_either_checksum(path, checksum):
    """A page given or read as segments (an engine's host page split by layer) is checksummed part by part: the
    value stored is the contiguous page's, and a flipped byte is caught in whichever segment it lands."""
    def segments(pool, i):
        return [pool[i, part] for part in range(4)]

    src = np.stack([payload(bytes([i]) * 16).reshape(4, PAGE // 4) for i in range(4)])
    with LMDBStore.open(path, LAYOUT, create=True, checksum=checksum) as s:
        hashes, origins = page_origins(LAYOUT, pack_tokens(range(16)), NS, s.chain_key)
        assert s.put(hashes, [segments(src, i) for i in range(4)], origins).written == 4
        flat = np.zeros((4, PAGE), np.uint8)
        assert s.get_into(hashes, list(flat)) == 4 and np.array_equal(flat, src.reshape(4, PAGE))
        assert s.verify().ok
    _flip_payload_byte(path, src[2].reshape(PAGE))
    with LMDBStore.open(path, LAYOUT) as s:
        dst = np.zeros_like(src)
        assert s.get_into(hashes, [segments(dst, i) for i in range(4)]) == 2
        assert np.array_equal(dst[:2], src[:2]) and s.counters().checksum_failures == 1


def test_a_read_rewrites_one_record_per_chain_and_one_per_unchained_engine_page(path):
    """The cost of crediting every page served: a chained run (token pages, a linked engine chain) rewrites its
    deepest page's record only (the pages above carry its time through their subtree); engine pages that hang
    side by side are rewritten each."""
    from kvcache.storage.api import engine_origins

    policy = AccessPolicy(flush_reads=10_000, flush_interval_s=1e9)
    with LMDBStore.open(path, LAYOUT, create=True, access=policy) as s:
        tokens, _ = write(s, range(16))
        keys = [bytes([i]) * 32 for i in range(6)]
        chain, origins = engine_origins(LAYOUT, NS2, s.chain_key, keys[:3])
        s.put(chain, [payload(h) for h in chain], origins)
        loose = []
        for k in keys[3:]:
            h, o = engine_origins(LAYOUT, NS2, s.chain_key, [k])
            s.put(h, [payload(h[0])], o)
            loose += h
        before = {h: s.page_meta(h) for h in tokens + chain + loose}
        for run in (tokens, chain, loose):
            assert read(s, run) == len(run)
        s.flush()
        changed = {h for h, m in before.items() if s.page_meta(h) != m}
        assert changed == {tokens[-1], chain[-1], *loose}


@pytest.mark.parametrize("page_bytes", [RELEASED_COPY_BYTES // 2, RELEASED_COPY_BYTES, 2 * RELEASED_COPY_BYTES])
def test_pages_either_side_of_the_released_copy_size_read_back_and_a_flipped_one_is_a_miss(tmp_path, page_bytes):
    # a page at least RELEASED_COPY_BYTES long is copied by numpy (the GIL released), a smaller one by a memoryview
    layout = KVLayout("big-model@r1", layers=1, kv_heads=1, head_dim=page_bytes // 16, dtype="float16", page_size=4)
    assert layout.bytes_per_page == page_bytes
    s = LMDBStore.open(str(tmp_path / "store"), layout, create=True)
    hashes, result = write(s, list(range(12)), layout=layout)
    assert result.written == 3 and read(s, hashes, layout) == 3
    s.close()
    data = tmp_path / "store" / "data.mdb"
    raw = bytearray(data.read_bytes())
    needle = payload(hashes[1], page_bytes)[page_bytes // 2:page_bytes // 2 + 64].tobytes()
    at = raw.find(needle)
    while at >= 0:
        raw[at + 10] ^= 0xFF
        at = raw.find(needle, at + 1)
    data.write_bytes(bytes(raw))
    s = LMDBStore.open(str(tmp_path / "store"), layout)
    out = np.zeros((3, page_bytes), dtype=np.uint8)
    assert s.get_into(hashes, list(out)) == 1  # the flipped page ends the run: verified on what was copied
    assert np.array_equal(out[0], payload(hashes[0], page_bytes))
    assert s.counters().checksum_failures == 1
    s.close()
