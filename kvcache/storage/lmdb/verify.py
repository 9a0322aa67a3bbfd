"""LMDB's side of the shared integrity audit (`kvcache.storage.verify`): how an LMDB store is read for it and how
records are removed from it.

Payloads are checked in chunks of VERIFY_CHUNK_PAGES, each in its own short read transaction, so a verify of a
large store never pins old pages while writers go on; a page's metadata, namespace and index entry are read in
the transaction of its payload. The tree, index and counter checks read one snapshot of the metadata (never
payloads): parents, children and counters only agree on one snapshot. Repair rechecks every page in its write
transaction (at most REPAIR_BATCH_PAGES records each) before it removes it.

Read lock-free (`env`: a user who cannot write lock.mdb, `kvc audit --read-only`), a read that writers overtook
may have seen reused pages, so nothing it read may become a finding before the read is known sound: each chunk
of payloads is copied out whole (LOCK_FREE_CHUNK_PAGES) and checked once its transaction is (`SharedEnv.reading`
runs an overtaken one again), and the snapshot's structure findings are added once its transaction is.

Two checks are LMDB's own: a walk of a sub-database that reaches fewer records than its catalogue counts, and a
lookup that misses a record a walk finds (a damaged branch page misroutes it), are `structure_corrupt` findings:
repairing the records one by one would remove sound pages (`salvage` rebuilds such a store).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import lmdb

from ...types.keys import PAGE_HASH_BYTES, hash_root_of_id
from ...types.layout import KVLayout
from ..api import LayoutRecord, PageMeta
from ..chain import chain_key_of
from ..codec import (
    CHECKSUMS,
    HEADER,
    chains_to,
    decode_layout,
    decode_meta,
    decode_namespace,
    decode_or_none,
    engine_keyed,
    stored_checksum,
)
from ..keyfile import key_if_any
from ..verify import Findings, Guard, PageRow, Removal, RepairOps, ScannedPage, Snapshot, recorded_roots
from .env import SharedEnv
from .registry import NsDelta, adjust_totals, apply_deltas, decode_totals, drop_page, recount

T = TypeVar("T")

VERIFY_CHUNK_PAGES = 256  # pages per read transaction when verifying (short read transactions, see above)
LOCK_FREE_CHUNK_PAGES = 32  # ... when reading lock-free: copied out whole, and the shorter, the less overtaken
REPAIR_BATCH_PAGES = 1024  # records removed per write transaction by verify(repair=True)

Progress = Callable[[str, int, bytes | None], None]  # (sub-database, records walked, last key)


class LMDBIntegrity:
    """An LMDB environment as `verify.IntegritySource`. One per verify: it keeps what the scan saw for the
    snapshot's structure checks."""

    recounts_after_removals = True  # one write transaction recounts exactly

    def __init__(self, shared: SharedEnv, write: Callable[[Callable[[lmdb.Transaction], Any]], Any] | None = None,
                 progress: Progress | None = None) -> None:
        self.shared = shared
        self.checksum = CHECKSUMS[shared.format.checksum]
        # the roots' key from the store's key file (None: this user may not read it; roots come from the records)
        # a key file that does not read is the audit's `key_file` finding, never the death of its walk
        self.chain_key = chain_key_of(shared.format, key_if_any(shared.path))
        self.batch_pages = REPAIR_BATCH_PAGES
        self._write = write or shared.write  # a store passes its own (the handle's checks and counts)
        self._progress = progress
        self._layouts: dict[bytes, KVLayout] = {}
        self._missed_meta: set[bytes] = set()  # pages whose metadata a lookup in the scan did not find

    # -- reading --------------------------------------------------------------------------------------------

    def layout_records(self) -> dict[bytes, LayoutRecord | None]:
        """The layout records, by layout id (None: does not decode)."""
        records = self.shared.reading(lambda txn: {bytes(k): decode_or_none(decode_layout, v)
                                                   for k, v in txn.cursor(db=self.shared.dbs.layouts)})
        self._layouts = {k: r.layout for k, r in records.items() if r is not None}
        return records

    def scan_pages(self, found: Findings) -> Iterator[ScannedPage]:
        """Every page value with its metadata, namespace and index entry read in the same transaction."""
        if self.shared.lock_free:
            yield from self._scan_pages_lock_free(found)
            return
        for txn, h, value in self.shared.scan(self.shared.dbs.pages, VERIFY_CHUNK_PAGES, self._progress, "pages"):
            yield from self._noted(found, h, self._scanned(txn, h, value))

    def _noted(self, found: Findings, h: bytes, page: ScannedPage | None) -> Iterator[ScannedPage]:
        """`page`, once what it says of the store is noted: a pages key that is no page hash is a finding (and no
        page), a page without metadata is kept for the pass that looks for metadata elsewhere."""
        if page is None:
            found.add("dangling_index", h, "a pages key that is not a page hash", remove=True)
            return
        if page.meta is None and not page.damaged:
            self._missed_meta.add(h)
        yield page

    def _scanned(self, txn: lmdb.Transaction, h: bytes, value: Any) -> ScannedPage | None:
        """The page stored under `h`, read in `txn`; None for a key that is no page hash."""
        dbs = self.shared.dbs
        if len(h) != PAGE_HASH_BYTES:
            return None
        raw = txn.get(h, db=dbs.meta)
        if raw is None:
            return ScannedPage(h, value, None)  # scan_pages notes it in _missed_meta
        meta = decode_or_none(decode_meta, raw)
        if meta is None:
            return ScannedPage(h, value, None, damaged=True)
        return ScannedPage(h, value, meta, indexed=txn.cursor(db=dbs.children).set_key_dup(meta.parent, h),
                           registered=txn.get(meta.ns_id, db=dbs.namespaces) is not None)

    def _scan_pages_lock_free(self, found: Findings) -> Iterator[ScannedPage]:
        """scan_pages of a lock-free environment: each chunk copied out in one read transaction, run again when
        writers overtook it, and yielded only then (see the module docstring)."""
        shared, after, walked = self.shared, None, 0

        def chunk(txn: lmdb.Transaction) -> tuple[list[tuple[bytes, ScannedPage | None]], bool]:
            cur = txn.cursor(db=shared.dbs.pages)
            positioned = cur.first() if after is None else cur.set_range(after)
            if positioned and after is not None and bytes(cur.key()) == after:
                positioned = cur.next()
            rows: list[tuple[bytes, ScannedPage | None]] = []
            while positioned and len(rows) < LOCK_FREE_CHUNK_PAGES:
                h = bytes(cur.key())
                rows.append((h, self._scanned(txn, h, bytes(cur.value()))))
                positioned = cur.next()
            return rows, positioned

        while True:
            if self._progress is not None:
                self._progress("pages", walked, after)
            rows, more = shared.reading(chunk, buffers=True)
            for h, page in rows:
                yield from self._noted(found, h, page)
            walked += len(rows)
            if not more or not rows:
                return
            after = rows[-1][0]

    def snapshot(self, found: Findings) -> Snapshot:
        """The metadata, the registry, the children index and the totals in one read transaction; then the
        structure checks (catalogue counts, misrouted lookups)."""
        shared, dbs, progress = self.shared, self.shared.dbs, self._progress

        def take(txn: lmdb.Transaction) -> tuple[Any, ...]:
            # added to `found` only once the transaction is known sound (lock-free: run again when overtaken)
            structural: list[str] = []
            misrouted_meta = 0  # records a lookup missed in the scan and this walk finds
            pages = txn.cursor(db=dbs.pages)  # set_key positions without copying the payload
            tree: dict[bytes, PageRow] = {}
            bodiless: set[bytes] = set()
            damaged: set[bytes] = set()
            if progress is not None:
                progress("meta", 0, None)
            for key, raw in txn.cursor(db=dbs.meta):
                h = bytes(key)
                misrouted_meta += h in self._missed_meta  # the walk finds what a lookup of it missed
                meta = decode_or_none(decode_meta, raw)
                if meta is None:
                    damaged.add(h)
                else:
                    tree[h] = PageRow(meta.parent, meta.ns_id, meta.layout_id, meta.nbytes)
                if not pages.set_key(h):
                    bodiless.add(h)
            headless: set[bytes] = set()
            walked_pages = 0
            for key in txn.cursor(db=dbs.pages).iternext(keys=True, values=False):
                walked_pages += 1
                if bytes(key) not in tree:
                    headless.add(bytes(key))
            # A walk that reaches fewer records than the catalogue counts skipped a damaged part of the tree: the
            # records it missed are not missing, and removing what depends on them would lose sound pages.
            for db, n in (("meta", len(tree) + len(damaged)), ("pages", walked_pages)):
                recorded = txn.stat(getattr(dbs, db))["entries"]
                if n != recorded:
                    structural.append(f"a walk of sub-database '{db}' reaches {n} of the {recorded} records its "
                                      f"catalogue counts")
            if progress is not None:
                progress("namespaces", len(tree), None)
            registry = {bytes(k): decode_or_none(decode_namespace, v) for k, v in txn.cursor(db=dbs.namespaces)}
            if progress is not None:
                progress("children", 0, None)
            links = [(bytes(p), bytes(c)) for p, c in txn.cursor(db=dbs.children)]
            totals = decode_or_none(decode_totals, txn.get(b"totals", db=dbs.store))
            return tree, bodiless, damaged, headless, registry, links, totals, structural, misrouted_meta

        tree, bodiless, damaged, headless, registry, links, totals, structural, misrouted_meta = shared.reading(
            take, buffers=True)
        for detail in structural:
            found.add("structure_corrupt", None, detail)
        misrouted = {"meta": misrouted_meta, "pages": 0}  # records a lookup missed and a walk found, per database
        missed = bodiless - damaged
        if missed:  # rare: walk the page keys again (no payloads) to see whether they are there
            for _, h, _ in shared.scan(dbs.pages, VERIFY_CHUNK_PAGES * 16, progress, "pages"):
                misrouted["pages"] += h in missed
        for db, n in misrouted.items():
            if n:
                found.add("structure_corrupt", None, f"lookups in sub-database '{db}' miss {n} record(s) that a walk "
                                                     f"of it finds: a damaged branch page misroutes them")
        return Snapshot(tree, bodiless, damaged, headless, registry, links,
                        (totals.pages, totals.bytes) if totals is not None else (-1, -1))

    # -- repairing ------------------------------------------------------------------------------------------

    def repair_batch(self, body: Callable[[RepairOps], T]) -> T:
        """`body` in one write transaction, with the counters of what it removed settled at its end."""
        def run(txn: lmdb.Transaction) -> T:
            ops = _RepairOps(txn, self.shared.dbs, self._layouts, self.checksum, self.chain_key)
            result = body(ops)
            ops.settle()
            return result

        return self._write(run)

    def recount(self) -> None:
        """Every registry counter and the totals from the pages stored, in one write transaction."""
        self._write(lambda txn: recount(txn, self.shared.dbs))


class _RepairOps:
    """`verify.RepairOps` inside one LMDB write transaction."""

    def __init__(self, txn: lmdb.Transaction, dbs: Any, layouts: dict[bytes, KVLayout], checksum: Any,
                 chain_key: bytes | None) -> None:
        self.txn, self.dbs, self.layouts, self.checksum = txn, dbs, layouts, checksum
        self.chain_key = chain_key
        self.deltas: dict[bytes, NsDelta] = {}
        self.freed_pages = self.freed_bytes = 0

    def remove(self, items: Sequence[Removal]) -> list[tuple[str, int] | None]:
        """Each item's records, if they are still what verify judged them (rechecked in this transaction)."""
        out: list[tuple[str, int] | None] = []
        for item in items:
            h = item.page
            if item.guard is Guard.FILED_UNDER:
                keep = self.txn.get(h, db=self.dbs.meta) is None and self.txn.get(h, db=self.dbs.pages) is None
            elif item.via is None:
                keep = not self._defect(h)
            else:
                keep = not self._below_removed(h, item.via)
            out.append(None if keep else self._remove_records(h))
        return out

    def children(self, pages: Sequence[bytes]) -> list[list[bytes]]:
        """The children index entries of each page."""
        cur = self.txn.cursor(db=self.dbs.children)
        return [[bytes(c) for c in cur.iternext_dup(keys=False, values=True)] if cur.set_key(h) else []
                for h in pages]

    def unlink(self, links: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        """Remove dangling children entries, unless the page was stored under that parent meanwhile."""
        out = []
        cur = self.txn.cursor(db=self.dbs.children)
        for parent, child in links:
            raw = self.txn.get(child, db=self.dbs.meta)
            if raw is not None and getattr(decode_or_none(decode_meta, raw), "parent", None) == parent:
                out.append(False)  # the page was stored meanwhile: the entry is no longer dangling
            elif cur.set_key_dup(parent, child):
                cur.delete()
                out.append(True)
            else:
                out.append(False)  # gone with a removed page
        return out

    def relink(self, pages: Sequence[tuple[bytes, PageRow]]) -> list[bool]:
        """List each page still stored under the parent its metadata names now."""
        out = []
        for h, _ in pages:
            meta = decode_or_none(decode_meta, self.txn.get(h, db=self.dbs.meta) or b"")
            if meta is not None:
                self.txn.put(meta.parent, h, db=self.dbs.children, dupdata=True)
            out.append(meta is not None)
        return out

    def drop_record(self, name: str, key: bytes) -> bool:
        """Remove a namespace or layout record that still does not decode."""
        db = self.dbs.namespaces if name == "namespaces" else self.dbs.layouts
        raw = self.txn.get(key, db=db)
        decode = decode_namespace if name == "namespaces" else decode_layout
        if raw is None or decode_or_none(decode, raw) is not None:
            return False
        self.txn.delete(key, db=db)
        return True

    def settle(self) -> None:
        """Take the pages removed off the totals and the namespace counters (a damaged totals record is left for
        the recount at the end of the repair)."""
        if self.freed_pages:
            adjust_totals(self.txn, self.dbs, -self.freed_pages, -self.freed_bytes, damaged_ok=True)
            apply_deltas(self.txn, self.dbs, self.deltas, time.time(), None)

    def _defect(self, h: bytes) -> bool:
        """Whether the records under `h` are provably corrupt or unreachable now: the check repair repeats inside
        its write transaction before removing a finding's page."""
        txn, dbs = self.txn, self.dbs
        value = txn.get(h, db=dbs.pages)
        raw = txn.get(h, db=dbs.meta)
        if value is None or raw is None or len(h) != PAGE_HASH_BYTES:
            return value is not None or raw is not None  # half a page, or a key that is no page hash
        meta = decode_or_none(decode_meta, raw)
        if meta is None or len(value) < HEADER:
            return True  # damaged metadata, or bytes too short to hold a checksum
        stored_sum = stored_checksum(value)
        size = len(value) - HEADER
        layout = self.layouts.get(meta.layout_id)
        if (not self.checksum.sound(value, h) or meta.checksum != stored_sum or meta.nbytes != size
                or (layout is not None and layout.bytes_per_page != size) or not self._hash_sound(h, meta)):
            return True
        up = txn.get(meta.parent, db=dbs.meta)
        if up is not None:
            parent = decode_or_none(decode_meta, up)
            if parent is None:
                return False  # the parent's damaged metadata is its own finding; this page goes below it
            return (parent.ns_id, parent.layout_id) != (meta.ns_id, meta.layout_id)
        if self._own_root(meta.parent, meta.layout_id, meta.ns_id):
            return False
        # Not its own root: an orphan, or a child of another namespace's root; a parent with bytes but no
        # metadata is that page's defect, and this page goes as part of its subtree.
        return txn.get(meta.parent, db=dbs.pages) is None

    def _hash_sound(self, h: bytes, meta: PageMeta) -> bool:
        """Whether `h` is the hash its metadata gives: H(parent || tokens), or an engine page's key under its root
        (recomputed with the chain key, else one its namespace's record keeps; no record that decodes: assume
        so, and keep the page)."""
        if not meta.key:
            return chains_to(h, meta)
        if self.chain_key is not None:
            return engine_keyed(h, meta, (hash_root_of_id(meta.layout_id, meta.ns_id, self.chain_key),))
        raw = self.txn.get(meta.ns_id, db=self.dbs.namespaces)
        record = decode_or_none(decode_namespace, raw) if raw is not None else None
        return record is None or engine_keyed(h, meta, recorded_roots(record))

    def _own_root(self, root: bytes, layout_id: bytes, ns_id: bytes) -> bool:
        """Whether `root` is the chain root of namespace `ns_id` under `layout_id`: recomputed with the chain key,
        else as the namespace's record keeps it (a record that does not decode: assume so, and keep the page)."""
        if self.chain_key is not None:
            return root == hash_root_of_id(layout_id, ns_id, self.chain_key)
        raw = self.txn.get(ns_id, db=self.dbs.namespaces)
        record = decode_or_none(decode_namespace, raw) if raw is not None else None
        return record is None or root.hex() in record.roots

    def _below_removed(self, h: bytes, via: bytes) -> bool:
        """Whether `h` is a child of the removed page `via` (so unreachable now), checked in this transaction."""
        txn, dbs = self.txn, self.dbs
        raw = txn.get(h, db=dbs.meta)
        if raw is None or getattr(decode_or_none(decode_meta, raw), "parent", None) != via:
            return False  # not stored, or linked under `via` by a wrong index entry only (dangling_index)
        return txn.get(via, db=dbs.meta) is None and txn.get(via, db=dbs.pages) is None

    def _remove_records(self, h: bytes) -> tuple[str, int]:
        """Delete whatever is stored under `h`: (what, payload bytes); a whole page comes off the counters."""
        txn, dbs = self.txn, self.dbs
        value = txn.get(h, db=dbs.pages)
        raw = txn.get(h, db=dbs.meta)
        if raw is None:
            assert value is not None, "every guard of `remove` keeps a page with no records"
            txn.delete(h, db=dbs.pages)
            return "bytes", max(len(value) - HEADER, 0)
        meta = decode_or_none(decode_meta, raw)
        if meta is None:  # damaged metadata: its children entry is unlinked by repair, its counters recounted
            txn.delete(h, db=dbs.meta)
            if value is not None:
                txn.delete(h, db=dbs.pages)
            return ("page" if value is not None else "meta"), max(len(value or b"") - HEADER, 0)
        if value is None:
            txn.delete(h, db=dbs.meta)
            txn.delete(meta.parent, h, db=dbs.children)
            return "meta", 0
        drop_page(txn, dbs, h, meta, self.deltas)
        self.freed_pages += 1
        self.freed_bytes += meta.nbytes
        return "page", meta.nbytes

