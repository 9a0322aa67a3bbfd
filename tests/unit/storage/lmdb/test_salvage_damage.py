"""Repairs that know what they lose (issue 36, item 2), on real stores damaged with plain file writes.

On ebaf189: one zeroed leaf of `namespaces` or `store` made the repair rebuild from an older catalogue (the last
put's pages gone, "0 lost, exact"); a zeroed `layouts` leaf made it refuse ("would keep nothing") though every page
was whole; a page header naming another page, and a flipped `hits`, `created` or `last_access`, passed the audit
clean; a key file replaced by another valid key read as orphans everywhere, and the repair deleted every page.
Each test below failed there."""

from __future__ import annotations

import os
import struct
import time

import msgspec
import numpy as np
import pytest

import lmdbpages
from kvcache.errors import KeyMismatch, RepairRefused, StoreDamaged
from kvcache.storage.api import page_origins
from kvcache.storage.lmdb import pagefile
from kvcache.storage.lmdb.salvage import audit_location
from kvcache.storage.registry import open_store
from kvcache.types.keys import pack_tokens
from kvcache.types.namespace import Namespace
from kvcache.workload.kvdata import SyntheticKV
from lmdb_surgery import raw

from .test_salvage import LAYOUT, TENANTS, build, stored

PAGE = 4096


@pytest.fixture(autouse=True)
def fixed_key(monkeypatch):
    # one key every run: the page hashes, so where each record lies in the file, are the same every time
    monkeypatch.setenv("KVC_FINGERPRINT_KEY", "c3" * 32)


def put_more(path: str, ns: Namespace, first: int, docs: int = 3) -> dict[bytes, bytes]:
    """The "last put": `docs` more chains of 10 pages under `ns`; their bytes by hash."""
    kv = SyntheticKV(LAYOUT)
    written = {}
    with open_store(path, LAYOUT) as store:
        for doc in range(first, first + docs):
            tokens = [7000 + doc] * 4 + list(range(doc * 100, doc * 100 + 36))
            hashes, origins = page_origins(LAYOUT, pack_tokens(tokens), ns, store.chain_key)
            pages = list(kv.pages(hashes).numpy())
            assert store.put(hashes, pages, origins).written == len(hashes)
            written.update((h, bytes(p)) for h, p in zip(hashes, pages, strict=True))
    return written


def zero_pages(path: str, pgnos) -> None:
    with open(os.path.join(path, "data.mdb"), "r+b") as f:
        for pg in pgnos:
            f.seek(pg * PAGE)
            f.write(b"\0" * PAGE)


def leaf_of(path: str, db: str) -> int:
    (leaf,) = [p.pgno for p in lmdbpages.live_pages(path) if p.db == db and p.kind == "leaf"]
    return leaf


@pytest.mark.parametrize("db", ["namespaces", "store"])
def test_a_zeroed_registry_or_store_leaf_keeps_every_page_the_last_put_included(tmp_path, db):
    path = str(tmp_path / "s")
    written = build(path, docs=4)
    written |= put_more(path, TENANTS[0], first=50)  # an existing namespace: its record has an older copy
    zero_pages(path, [leaf_of(path, db)])
    report = audit_location(path, repair=True)
    s = report.salvage
    assert s is not None and s.source == "tree"  # the current catalogue, never an older one
    assert (s.pages_before, s.kept, s.lost, s.lost_exact) == (len(written), len(written), 0, True)
    assert stored(path) == written
    assert audit_location(path).ok  # the records came back from the copies the file still holds
    with open_store(path, readonly=True) as store:
        assert {r.extra_key for r in store.namespaces()} == {"tenant-a", "tenant-b"}
        assert store.stats().pages == len(written)


def test_a_new_namespace_whose_only_record_is_lost_keeps_its_pages_and_says_so(tmp_path):
    path = str(tmp_path / "s")
    written = build(path, docs=2)
    new = Namespace("tenant-new", "salt-new")
    written |= put_more(path, new, first=60, docs=1)  # one transaction: the leaf it wrote holds its only record
    zero_pages(path, [leaf_of(path, "namespaces")])
    report = audit_location(path, repair=True)
    assert report.salvage is not None and report.salvage.kept == len(written) and report.salvage.lost == 0
    summary = report.findings[-1].detail
    assert "10 page(s) kept whose namespace record is lost everywhere in the file" in summary
    assert stored(path) == written
    after = audit_location(path)
    assert {f.kind for f in after.findings} == {"unknown_namespace"} and len(after.findings) == 10


def test_a_zeroed_layouts_leaf_keeps_every_page_and_the_layout_registers_again(tmp_path):
    path = str(tmp_path / "s")
    written = build(path, docs=3)
    zero_pages(path, [leaf_of(path, "layouts")])
    report = audit_location(path, repair=True)  # ebaf189: RepairRefused ("would keep nothing")
    assert report.salvage is not None and (report.salvage.kept, report.salvage.lost) == (len(written), 0)
    assert "layout record is lost everywhere" in report.findings[-1].detail
    assert stored(path) == written
    assert {f.kind for f in audit_location(path).findings} == {"unknown_layout"}
    with open_store(path, LAYOUT) as store:  # what `kvc init` with the layout does: its pages name its id
        assert store.layouts() == [LAYOUT]
    assert audit_location(path).ok


def test_the_plain_audit_of_a_cut_file_is_a_finding_and_an_open_is_refused_in_one_line(tmp_path):
    path = str(tmp_path / "s")
    build(path, docs=3)
    data = os.path.join(path, "data.mdb")
    os.truncate(data, os.path.getsize(data) // 2)
    (finding,) = audit_location(path).findings
    assert finding.kind == "structure_corrupt" and "data.mdb is cut short" in finding.detail
    with pytest.raises(StoreDamaged, match="cut short.*`kvc audit --repair`"):
        open_store(path, readonly=True)


def test_an_empty_data_file_is_a_finding_refused_by_repair_and_replaced_by_force(tmp_path):
    path = str(tmp_path / "s")
    build(path, docs=1)
    os.truncate(os.path.join(path, "data.mdb"), 0)
    (finding,) = audit_location(path).findings  # ebaf189: NotAStore, no finding
    assert finding.kind == "structure_corrupt" and "data.mdb is empty" in finding.detail
    assert os.path.getsize(os.path.join(path, "data.mdb")) == 0  # the audit wrote nothing into it
    with pytest.raises(RepairRefused, match="data.mdb is empty"):
        audit_location(path, repair=True)
    forced = audit_location(path, repair=True, force=True)
    assert forced.salvage is not None and forced.salvage.kept == 0 and forced.salvage.lost == -1
    assert os.path.getsize(forced.original_kept) == 0
    assert audit_location(path).ok


def test_a_page_header_naming_another_page_is_found_and_the_rebuild_keeps_every_page(tmp_path):
    path = str(tmp_path / "s")
    written = build(path, docs=6)
    leaf = next(p for p in lmdbpages.live_pages(path) if p.db == "meta" and p.kind == "leaf")
    with open(os.path.join(path, "data.mdb"), "r+b") as f:
        f.seek(leaf.pgno * PAGE)
        f.write(struct.pack("<Q", 3))  # a page LMDB would free on the next write that copies this one
    report = audit_location(path)  # ebaf189: clean
    assert [f.kind for f in report.findings] == ["structure_corrupt"]
    assert f"page {leaf.pgno}" in report.findings[0].detail and "records page number 3" in report.findings[0].detail
    assert not report.recorded  # nothing is written into a store whose page map is broken
    fixed = audit_location(path, repair=True)
    assert fixed.salvage is not None and (fixed.salvage.kept, fixed.salvage.lost) == (len(written), 0)
    assert stored(path) == written and audit_location(path).ok


def test_the_page_map_finds_a_page_flagged_against_its_place_and_a_page_both_live_and_free(tmp_path):
    from kvcache.storage.lmdb import pagemap

    path = str(tmp_path / "s")
    build(path, docs=8)
    data = os.path.join(path, "data.mdb")
    assert pagemap.read_map(data).problems == []
    branch = next(p for p in lmdbpages.live_pages(path) if p.kind == "branch")
    with open(data, "r+b") as f:
        f.seek(branch.pgno * PAGE + 10)
        f.write(struct.pack("<H", 0x02))  # a branch flagged a leaf
    (problem,) = pagemap.read_map(data).problems
    assert f"page {branch.pgno}" in problem and "flagged leaf" in problem and "makes it a branch" in problem
    with open(data, "r+b") as f:
        f.seek(branch.pgno * PAGE + 10)
        f.write(struct.pack("<H", 0x01))
    free_leaf = next(p.pgno for p in lmdbpages.free_list_pages(path) if p.kind == "leaf")
    live = next(p.pgno for p in lmdbpages.live_pages(path) if p.kind == "leaf")
    with pagefile.mapped(data) as mapped:
        _, _, _, at = next(pagefile.nodes(mapped, free_leaf, PAGE))  # a record: count u64, then page numbers
    with open(data, "r+b") as f:
        f.seek(at + 8)
        f.write(struct.pack("<Q", live))  # the first page it lists is now a live leaf
    problems = pagemap.read_map(data).problems
    assert any(f"page {live} is on the free list" in p and "overwrites live records" in p for p in problems)


def _meta_of(path: str, h: bytes):
    with raw(path, recount=False) as r:
        return r.meta(h)


@pytest.mark.parametrize("field", ["hits", "created", "last_access", "created_after_last_access"])
def test_a_flipped_field_of_a_page_metadata_is_found_and_repaired_keeping_the_page(tmp_path, field):
    path = str(tmp_path / "s")
    written = build(path, docs=2)
    h = sorted(written)[7]
    with open_store(path, readonly=True) as store:
        hits = sum(r.hits for r in store.namespaces())
    meta = _meta_of(path, h)
    flipped = {
        "hits": {"hits": meta.hits ^ (1 << 40)},  # a high bit: more than its namespace ever counted
        "created": {"created": struct.unpack("<d", struct.pack("<Q", struct.unpack("<Q", struct.pack(
            "<d", meta.created))[0] ^ (1 << 61)))[0]},  # an exponent bit
        "last_access": {"last_access": meta.last_access + 10 * 365 * 86400},  # years ahead of the clock
        "created_after_last_access": {"created": meta.last_access + 100},
    }[field]
    with raw(path, recount=False) as r:
        r.put_meta(h, msgspec.structs.replace(meta, **flipped))
    report = audit_location(path)  # ebaf189: clean
    also = [("counter_mismatch", None)] if field == "hits" else []  # more hits than the namespace counted
    assert [(f.kind, f.page_hash) for f in report.findings] == [("implausible_meta", h.hex()), *also]
    fixed = audit_location(path, repair=True)
    assert fixed.repaired == 1 + len(also) and fixed.removals == []  # kept: its bytes and hash prove themselves
    assert audit_location(path).ok and stored(path) == written
    after = _meta_of(path, h)
    assert after.created <= after.last_access <= time.time() and 0 <= after.hits
    with open_store(path, readonly=True) as store:
        assert sum(r.hits for r in store.namespaces()) == hits


def test_pages_counting_more_hits_than_their_namespace_is_a_counter_finding_recounted(tmp_path):
    path = str(tmp_path / "s")
    written = build(path, docs=1)
    with raw(path, recount=False) as r:
        read = [h for h in sorted(written) if r.meta(h).ns_id == TENANTS[0].id][:4]
    buf = np.zeros(LAYOUT.bytes_per_page, np.uint8)
    with open_store(path, LAYOUT) as store:  # four reads of one page each: the namespace counts 4 hits
        for h in read:
            assert store.get_into([h], [buf]) == 1
    with raw(path, recount=False) as r:
        for h in read:  # 3 each: plausible alone, 12 together where the namespace counted 4
            r.put_meta(h, msgspec.structs.replace(r.meta(h), hits=3))
    (finding,) = audit_location(path).findings
    assert finding.kind == "counter_mismatch" and "count 12 hits, the registry 4" in finding.detail
    assert audit_location(path, repair=True).repaired == 1 and audit_location(path).ok


def test_another_valid_key_is_named_as_such_and_the_repair_removes_nothing_for_it(tmp_path):
    path = str(tmp_path / "s")
    written = build(path, docs=2)
    key_file = os.path.join(path, "fingerprint.key")
    with open(key_file) as f:
        right = f.read()
    with open(key_file, "w") as f:
        f.write("5e" * 32 + "\n")  # a wrong backup, a tool that wrote a fresh key
    report = audit_location(path)  # ebaf189: every namespace's first page an orphan, no word of the key
    assert [f.kind for f in report.findings] == ["key_mismatch"]
    assert "this store's key file is not the key its pages were written under" in report.findings[0].detail
    with pytest.raises(RepairRefused, match="not the key its pages were written under"):
        audit_location(path, repair=True)  # ebaf189: removed every page
    with pytest.raises(KeyMismatch):
        open_store(path, LAYOUT)
    with open(key_file, "w") as f:
        f.write(right)
    assert audit_location(path).ok and stored(path) == written  # the right key back: everything is there


def test_a_rebuild_under_another_key_is_refused_and_keeps_the_store_as_it_was(tmp_path):
    path = str(tmp_path / "s")
    build(path, docs=3)
    zero_pages(path, [leaf_of(path, "namespaces")])  # the registry lost too: the chain heads say which key
    with open(os.path.join(path, "fingerprint.key"), "w") as f:
        f.write("5e" * 32 + "\n")
    with open(os.path.join(path, "data.mdb"), "rb") as f:
        before = f.read()
    with pytest.raises(RepairRefused, match="not the key its pages were written under"):
        audit_location(path, repair=True)
    with open(os.path.join(path, "data.mdb"), "rb") as f:
        assert f.read() == before


def test_a_loss_that_hides_whole_pages_is_counted_from_the_store_s_own_count(tmp_path):
    # A planted bug that counted `lost` over the pages the rebuild saw only ("0 lost, exact" when damage hid
    # whole pages) passed every test on ebaf189. Here both records of some pages are gone from every leaf of the
    # file: no walk, lookup or scan sees them, and only the catalogue's count can say they were there.
    path = str(tmp_path / "s")
    written = build(path, docs=12)  # the `pages` tree holds several leaves: some are untouched
    records: dict[str, dict[bytes, set[int]]] = {}
    live = lmdbpages.live_pages(path, records)
    leaf = sorted({pg for h in written for pg in records["meta"][h]})[2]
    hidden = {h for h in written if leaf in records["meta"][h]}
    pages_leaves = {p.pgno for p in live if p.db == "pages" and p.kind == "leaf"}
    naming = {pg for h in hidden for pg in records["pages"][h] & pages_leaves}  # the `pages` leaves naming them
    zero_pages(path, {leaf} | naming | stale_leaves_holding(path, hidden))
    report = audit_location(path, repair=True)
    s = report.salvage
    assert s is not None and s.lost_exact
    kept = stored(path)
    assert s.kept == len(kept) and s.lost == len(written) - len(kept) >= len(hidden)
    assert not hidden & set(kept)


def stale_leaves_holding(path: str, keys: set[bytes]) -> set[int]:
    """Every other leaf page of the file (freed ones: older copies) with a node keyed by one of `keys`."""
    from kvcache.storage.lmdb import pagefile

    out = set()
    with pagefile.mapped(os.path.join(path, "data.mdb")) as data:
        for pgno in range(2, len(data) // PAGE):
            if struct.unpack_from("<Q", data, pgno * PAGE)[0] != pgno:
                continue
            flags = struct.unpack_from("<H", data, pgno * PAGE + 10)[0]
            if flags & pagefile.P_LEAF and any(key in keys for _, key, _, _ in pagefile.nodes(data, pgno, PAGE)):
                out.add(pgno)
    return out


def test_a_repair_of_an_old_copy_of_a_page_is_never_served(tmp_path):
    """After any of these rebuilds every page read back is byte-exact: what `stored` compares."""
    path = str(tmp_path / "s")
    written = build(path, docs=2)
    zero_pages(path, [leaf_of(path, "store")])
    audit_location(path, repair=True)
    buf = np.zeros(LAYOUT.bytes_per_page, np.uint8)
    with open_store(path, readonly=True) as store:
        for h, payload in written.items():
            assert store.get_into([h], [buf]) == 1 and bytes(buf) == payload
