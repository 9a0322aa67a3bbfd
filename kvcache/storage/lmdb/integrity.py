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

import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import lmdb
import msgspec

from ... import errors
from ...errors import StoreError
from ...types.keys import PAGE_HASH_BYTES, hash_root_of_id
from ...types.layout import KVLayout
from ..api import AuditHistory, AuditRecord, LayoutRecord, PageMeta, VerifyReport
from ..chain import chain_key_of
from ..codec import (
    CHECKSUMS,
    FORMAT_VERSION,
    HEADER,
    chains_to,
    decode_layout,
    decode_meta,
    decode_namespace,
    decode_or_none,
    encoder,
    engine_keyed,
    stored_checksum,
)
from ..isolated import Died
from ..keyfile import KEY_MISMATCH, key_if_any, mismatch_detail
from ..removals import RemovalReason
from ..verify import (
    EngineHashes,
    Findings,
    Guard,
    PageRow,
    Removal,
    RepairOps,
    ScannedPage,
    Snapshot,
    check_page,
    implausible,
    life,
    recorded_roots,
)
from ..verify_parts import Catalogue, HeldPage, KeyRange, NsSum, PartContext, PartProgress, PartReport, replays
from . import pagemap
from . import removals as removal_log
from .bookkeeping import NsDelta, adjust_totals, apply_deltas, decode_totals, drop_page, key_evidence, recount
from .env import DEFAULT_MAP_SIZE, SharedEnv, acquire, release

T = TypeVar("T")

VERIFY_CHUNK_PAGES = 256  # pages per read transaction when verifying (short read transactions, see above)
LOCK_FREE_CHUNK_PAGES = 32  # ... when reading lock-free: copied out whole, and the shorter, the less overtaken
REPAIR_BATCH_PAGES = 1024  # records removed per write transaction by verify(repair=True)
PAGE_MAP_ATTEMPTS = 8  # reads of the page map that writers may overtake before that is the finding

AUDIT_KEY = b"audit"  # the store's AuditHistory, in the `store` sub-database
_decode_history = msgspec.msgpack.Decoder(AuditHistory).decode

Progress = Callable[[str, int, bytes | None], None]  # (sub-database, records walked, last key)


class LMDBIntegrity:
    """An LMDB environment as `verify.IntegritySource`. One per verify: it keeps what the scan saw for the
    snapshot's structure checks."""

    recounts_after_removals = True  # one write transaction recounts exactly

    def __init__(self, shared: SharedEnv, write: Callable[[Callable[[lmdb.Transaction], Any]], Any] | None = None,
                 progress: Progress | None = None, record: bool = False, trust_key: bool = False) -> None:
        self.shared = shared
        # record this audit in the store (`AuditHistory`): only an audit of a store it may write, in the current
        # format (an older one is left as it is until `kvc migrate`)
        self._record = record and shared.writable and not shared.lock_free and \
            shared.format.version == FORMAT_VERSION
        self.checksum = CHECKSUMS[shared.format.checksum]
        # the roots' key from the store's key file (None: this user may not read it; roots come from the records)
        # a key file that does not read is the audit's `key_file` finding, never the death of its walk
        self.chain_key = chain_key_of(shared.format, key_if_any(shared.path))
        # A valid key that is not the one the pages were written under (keyfile.KeyEvidence) is the audit's
        # `key_mismatch` finding; the rest is then checked against the roots the registry recorded, as a reader
        # without the key does, so that no page is called an orphan (and removed) for the key's sake. `trust_key`:
        # the key was replaced on purpose (`--repair --force`): the pages it does not reach are unreachable.
        self.key_mismatch = ""
        self.trust_key = trust_key
        if self.chain_key and shared.format.keyed_roots and not shared.format.chain_key and not trust_key:
            chain_key = self.chain_key
            evidence = shared.reading(lambda txn: key_evidence(txn, shared.dbs, chain_key))
            if evidence.mismatch:
                self.key_mismatch = mismatch_detail(shared.path, evidence)
                self.chain_key = None
        self.batch_pages = REPAIR_BATCH_PAGES
        self._write = write or shared.write  # a store passes its own (the handle's checks and counts)
        self._progress = progress
        self._layouts: dict[bytes, KVLayout] = {}
        self._missed_meta: set[bytes] = set()  # pages whose metadata a lookup in the scan did not find
        self._ns_seen: dict[tuple[int, bytes], tuple[bool, int]] = {}  # (txn id, namespace) -> recorded?, its hits
        self.store_created = shared.format.created  # the start of the store's life (verify.life)

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

    def _scanned(self, txn: lmdb.Transaction, h: bytes, value: Any, children: Any = None,
                 registry: Any = None) -> ScannedPage | None:
        """The page stored under `h`, read in `txn`; None for a key that is no page hash. `children`: a cursor
        on the children index in `txn` to reuse; `registry`: the namespace records as of `txn`'s snapshot, id ->
        record or None (None: look each up in `txn`)."""
        dbs = self.shared.dbs
        if len(h) != PAGE_HASH_BYTES:
            return None
        raw = txn.get(h, db=dbs.meta)
        if raw is None:
            return ScannedPage(h, value, None)  # scan_pages notes it in _missed_meta
        meta = decode_or_none(decode_meta, raw)
        if meta is None:
            return ScannedPage(h, value, None, damaged=True)
        registered, ns_hits = self._namespace_of(txn, meta.ns_id, registry)
        return ScannedPage(h, value, meta, registered=registered,
                           indexed=(children or txn.cursor(db=dbs.children)).set_key_dup(meta.parent, h),
                           ns_hits=ns_hits)

    def _namespace_of(self, txn: lmdb.Transaction, ns_id: bytes, registry: Any) -> tuple[bool, int]:
        """(whether namespace `ns_id` is recorded, the hits its record counts or -1) as of `txn` (from
        `registry` when given: the same snapshot), looked up once per namespace and transaction."""
        if registry is not None:
            record = registry.get(ns_id)
            return ns_id in registry, record.hits if record is not None else -1
        key = (txn.id(), ns_id)
        found = self._ns_seen.get(key)
        if found is None:
            if len(self._ns_seen) > 4096:
                self._ns_seen.clear()
            raw = txn.get(ns_id, db=self.shared.dbs.namespaces)
            record = decode_or_none(decode_namespace, raw) if raw is not None else None
            found = self._ns_seen[key] = (raw is not None, record.hits if record is not None else -1)
        return found

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
                    tree[h] = PageRow(meta.parent, meta.ns_id, meta.layout_id, meta.nbytes, meta.hits,
                                      engine=bool(meta.key))
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

    def own_checks(self, found: Findings) -> None:
        """What a full audit checks of LMDB's own besides the records: a key file that is not the pages' key
        (`key_mismatch`), LMDB's page map (`page_map`), and the removal log (each key of it that is not what it
        writes: a `damaged_record`, which a repair removes; the log is diagnostics, no page depends on it)."""
        if self.key_mismatch:
            found.add(KEY_MISMATCH, None, self.key_mismatch)
        self.page_map(found)
        shared = self.shared
        for key, why in shared.reading(lambda txn: removal_log.damaged(txn, shared.dbs.removals)):
            found.damaged_record(removal_log.DB_NAME, key, why)

    def page_map(self, found: Findings) -> None:
        """LMDB's page map on the snapshot of one read transaction (`pagemap`): what LMDB trusts blindly (each
        live page's header against its position, its flags against its place, the free list against the trees),
        each problem a `structure_corrupt` finding (a repair rebuilds the store). The transaction pins the
        snapshot's pages while the file is walked; when writers moved both meta pages on meanwhile, it is read
        again."""
        data = os.path.join(self.shared.path, "data.mdb")
        for _ in range(PAGE_MAP_ATTEMPTS):
            got = self.shared.reading(lambda txn: pagemap.read_map(data, txn.id()))
            if got is not None:
                for problem in got.problems:
                    found.add("structure_corrupt", None, f"LMDB's page map: {problem}")
                return
        found.add("structure_corrupt", None, f"LMDB's page map could not be read: writers moved its meta pages on "
                                             f"during each of {PAGE_MAP_ATTEMPTS} reads (audit it while they are "
                                             f"idle)")

    # -- reading in key ranges (verify_parts) ---------------------------------------------------------------

    def key_ranges(self, n: int) -> list[KeyRange]:
        """`n` ranges split on the first key byte (page hashes are uniform: the ranges hold alike)."""
        n = max(1, min(n, 256))
        cuts = [bytes([i * 256 // n]) for i in range(1, n)]
        return [KeyRange(lo, hi) for lo, hi in zip([None, *cuts], [*cuts, None], strict=True)]

    def catalogue(self) -> Catalogue:
        """The registry, the totals and the catalogue counts in one read transaction, with its id."""
        dbs = self.shared.dbs

        def take(txn: lmdb.Transaction) -> Catalogue:
            registry = {bytes(k): decode_or_none(decode_namespace, v) for k, v in txn.cursor(db=dbs.namespaces)}
            totals = decode_or_none(decode_totals, txn.get(b"totals", db=dbs.store))
            entries = {db: txn.stat(getattr(dbs, db))["entries"] for db in ("pages", "meta", "children")}
            return Catalogue(txn.id(), registry, (totals.pages, totals.bytes) if totals is not None else (-1, -1),
                             entries)

        return self.shared.reading(take, buffers=True)

    def scan_part(self, part: KeyRange, ctx: PartContext, report: Callable[[PartProgress], None]) -> PartReport:
        """The pages of `part` (see verify_parts), read through a handle of this process: its own, opened here,
        in a forked child."""
        if self.shared.pid == os.getpid():
            reader = _PartReader(self, part, ctx)
            return reader.incremental(report) if ctx.since is not None else reader.full(report)
        # a forked child: this copy of the source reads through the child's own handle from now on
        self.shared = acquire(self.shared.path, False, DEFAULT_MAP_SIZE, "none", lock=not self.shared.lock_free)
        try:
            return self.scan_part(part, ctx, report)
        finally:
            release(self.shared)

    def missed_meta(self, hashes: Sequence[bytes]) -> None:
        """Pages whose metadata a lookup in a child did not find (the snapshot's misrouted-lookup check)."""
        self._missed_meta.update(hashes)

    def parts_progress(self, records: int, last_key: bytes | None) -> None:
        """The children's progress, as the serial scan reports its own."""
        if self._progress is not None:
            self._progress("pages", records, last_key)

    def part_failed(self, part: KeyRange, died: Died) -> None:
        """A child that died reading `part`: the error it raised when that is a store's (a lock-free read
        overtaken: StoreChanged, read again by the caller), else a StoreError naming how it died (the audit's
        caller reports that as damage, `salvage`)."""
        reached: PartProgress | None = died.progress
        if self._progress is not None and reached is not None:
            self._progress("pages", reached.records, reached.last_key or None)
        kind = getattr(errors, died.error_type or "", None)
        if isinstance(kind, type) and issubclass(kind, StoreError) and died.error is not None:
            message = died.error.split(": ", 1)[1] if ": " in died.error else died.error
            prefix = self.shared.path + ": "
            raise kind(self.shared.path, message[len(prefix):] if message.startswith(prefix) else message)
        where = "from the start" if part.lo is None else f"from key {part.lo.hex()}"
        raise StoreError(self.shared.path, f"an audit worker reading the pages {where} {died.describe()}")

    # -- the audit record (AuditHistory) ---------------------------------------------------------------------

    def begin_audit(self) -> float | None:
        """The audit's start, taken in a write transaction (a put takes its pages' `created` in its own, so every
        page committed after this one carries a later stamp); None when this audit is not recorded."""
        if not self._record:
            return None
        return self._write(lambda txn: time.time())

    def last_clean(self) -> float | None:
        """When the store's last clean audit began (None: none recorded)."""
        history = self.shared.reading(lambda txn: read_history(txn, self.shared.dbs))
        return history.last_clean.started if history.last_clean is not None else None

    def record_audit(self, started: float, report: VerifyReport) -> bool:
        """Record the audit begun at `started` as the store's last, and as its last clean one when it is."""
        if not self._record:
            return False
        record = AuditRecord(started, time.time(), report.ok, report.scope, report.since, report.pages_checked)
        dbs = self.shared.dbs

        def put(txn: lmdb.Transaction) -> None:
            old = read_history(txn, dbs)
            history = AuditHistory(record, record if record.ok else old.last_clean)
            txn.put(AUDIT_KEY, encoder.encode(history), db=dbs.store)

        self._write(put)
        return True

    # -- repairing ------------------------------------------------------------------------------------------

    def repair_batch(self, body: Callable[[RepairOps], T]) -> T:
        """`body` in one write transaction, with the counters of what it removed settled at its end."""
        def run(txn: lmdb.Transaction) -> T:
            ops = _RepairOps(txn, self.shared.dbs, self._layouts, self.checksum, self.chain_key,
                             life(self.store_created))
            result = body(ops)
            ops.settle()
            return result

        return self._write(run)

    def recount(self) -> None:
        """Every registry counter and the totals from the pages stored, in one write transaction."""
        self._write(lambda txn: recount(txn, self.shared.dbs))

    def forget_foreign_roots(self) -> int:
        """With a key trusted on purpose (`trust_key`): drop from each namespace record the roots this key does not
        give (the old key's, whose pages a repair under this key removed), so that the registry no longer
        contradicts the key. Records changed."""
        chain_key = self.chain_key
        if not (self.trust_key and chain_key):
            return 0
        dbs = self.shared.dbs

        def body(txn: lmdb.Transaction) -> int:
            layout_ids = [bytes(k) for k in txn.cursor(db=dbs.layouts).iternext(keys=True, values=False)]
            changed = 0
            for key, raw in list(txn.cursor(db=dbs.namespaces)):
                record = decode_or_none(decode_namespace, raw)
                if record is None or not record.roots:
                    continue
                given = {hash_root_of_id(lay, bytes(key), chain_key).hex() for lay in layout_ids}
                kept = [r for r in record.roots if r in given]
                if kept != record.roots:
                    txn.put(bytes(key), encoder.encode(msgspec.structs.replace(record, roots=kept)),
                            db=dbs.namespaces)
                    changed += 1
            return changed

        return self._write(body)


class _RepairOps:
    """`verify.RepairOps` inside one LMDB write transaction."""

    def __init__(self, txn: lmdb.Transaction, dbs: Any, layouts: dict[bytes, KVLayout], checksum: Any,
                 chain_key: bytes | None, times: tuple[float, float] = (0.0, 0.0)) -> None:
        self.txn, self.dbs, self.layouts, self.checksum = txn, dbs, layouts, checksum
        self.chain_key = chain_key
        self.times = times  # the store's life (verify.life): what a page's times may be
        self.deltas: dict[bytes, NsDelta] = {}
        self.freed_pages = self.freed_bytes = 0
        self.removed: list[tuple[bytes, bytes]] = []  # (page, namespace id) of what went: the removal log's

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
        """Remove a namespace or layout record that still does not decode (or a damaged key of the removal log)."""
        if name == removal_log.DB_NAME:
            return removal_log.remove_damaged(self.txn, self.dbs.removals, key)
        db = self.dbs.namespaces if name == "namespaces" else self.dbs.layouts
        raw = self.txn.get(key, db=db)
        decode = decode_namespace if name == "namespaces" else decode_layout
        if raw is None or decode_or_none(decode, raw) is not None:
            return False
        self.txn.delete(key, db=db)
        return True

    def reset_fields(self, pages: Sequence[bytes]) -> list[bool]:
        """Each page's implausible `created`, `last_access` and `hits` set to what can be, as of now and of its
        namespace's record in this transaction (`verify.implausible`): times outside the store's life go to now
        (so an incremental audit checks the page next), `created` past `last_access` comes down to it, hits that
        cannot be go to 0. The page itself is kept."""
        done = []
        for h in pages:
            raw = self.txn.get(h, db=self.dbs.meta)
            meta = decode_or_none(decode_meta, raw) if raw is not None else None
            if meta is None:
                done.append(False)
                continue
            ns_raw = self.txn.get(meta.ns_id, db=self.dbs.namespaces)
            record = decode_or_none(decode_namespace, ns_raw) if ns_raw is not None else None
            ns_hits = record.hits if record is not None else -1
            low, high = self.times
            now = time.time()
            created, last = meta.created, meta.last_access
            if not math.isfinite(created) or not low <= created <= high:
                created = now
            if not math.isfinite(last) or not low <= last <= high:
                last = now
            created = min(created, last)
            hits = meta.hits if 0 <= meta.hits and (ns_hits < 0 or meta.hits <= ns_hits) else 0
            fixed = msgspec.structs.replace(meta, created=created, last_access=last, hits=hits)
            if fixed != meta:
                self.txn.put(h, encoder.encode(fixed), db=self.dbs.meta)
            done.append(not implausible(fixed, self.times, ns_hits))
        return done

    def settle(self) -> None:
        """Take the pages removed off the totals and the namespace counters (a damaged totals record is left for
        the recount at the end of the repair), and record them in the removal log (REPAIR)."""
        removal_log.record(self.txn, self.dbs.removals, self.removed, RemovalReason.REPAIR, time.time())
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
        if meta.key:
            return False  # an engine page under a parent gone: its parent is a hint, its key proves it (above)
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
        self.removed.append((h, meta.ns_id))
        if value is None:
            txn.delete(h, db=dbs.meta)
            txn.delete(meta.parent, h, db=dbs.children)
            return "meta", 0
        drop_page(txn, dbs, h, meta, self.deltas)
        self.freed_pages += 1
        self.freed_bytes += meta.nbytes
        return "page", meta.nbytes


def _below(key: Any, hi: int) -> bool:
    """Whether `key` sorts below a range that ends at first key byte `hi` (256: none)."""
    return not len(key) or key[0] < hi


def read_history(txn: lmdb.Transaction, dbs: Any) -> AuditHistory:
    """The store's audit record (empty when none, or when it does not decode: the next audit writes it anew)."""
    raw = txn.get(AUDIT_KEY, db=dbs.store)
    return (decode_or_none(_decode_history, raw) if raw is not None else None) or AuditHistory()


class _PartReader:
    """One key range of `LMDBIntegrity.scan_part`: read in short read transactions (run again when a lock-free
    one was overtaken), each chunk's findings recorded in a `Findings` of its own and kept once it is sound."""

    def __init__(self, source: LMDBIntegrity, part: KeyRange, ctx: PartContext) -> None:
        self.source, self.shared, self.dbs, self.part, self.ctx = source, source.shared, source.shared.dbs, part, ctx
        self.chunk = LOCK_FREE_CHUNK_PAGES if source.shared.lock_free else VERIFY_CHUNK_PAGES
        self.out = PartReport([], [], 0, 0, [])
        self.txnids: set[int] = set()
        self.roots: dict[tuple[bytes, bytes], bytes] = {}  # EngineHashes.roots, computed once per range

    def _first(self, cur: Any, after: bytes | None) -> bool:
        """Position `cur` on the first key of the range past `after` (None: from the range's start)."""
        if after is None:
            positioned = cur.set_range(self.part.lo) if self.part.lo is not None else cur.first()
        else:
            positioned = cur.set_range(after)
            if positioned and bytes(cur.key()) == after:
                positioned = cur.next()
        return positioned and (self.part.hi is None or bytes(cur.key()) < self.part.hi)

    def _engine(self) -> EngineHashes:
        """The engine-page hash check of one chunk (the roots it computes are kept for the next)."""
        engine = EngineHashes(self.source.chain_key)
        engine.roots = self.roots
        return engine

    def _done(self, found: Findings, missed: list[bytes], txn_id: int, engine: EngineHashes) -> None:
        self.out.findings += replays(found.items, {h.hex(): h for h in found.by_page}, found.remove, found.relink)
        self.out.missed_meta += missed
        self.out.held += [HeldPage(h, meta) for h, meta in engine.held]
        self.txnids.add(txn_id)

    def full(self, report: Callable[[PartProgress], None]) -> PartReport:
        """Every page of the range with `check_page`, and the range's side of the structure checks (see
        verify_parts): its parent, the metadata keys, the sums per namespace."""
        out, ctx, dbs = self.out, self.ctx, self.dbs
        sums: dict[bytes, list[int]] = {}
        after: bytes | None = None
        hi = self.part.hi[0] if self.part.hi is not None else 256  # ranges split on the first key byte

        def chunk(txn: lmdb.Transaction) -> tuple[Any, ...]:
            found = Findings()
            engine = self._engine()
            missed: list[bytes] = []
            unsure = ""
            children = txn.cursor(db=dbs.children)
            # the catalogue's, when the same snapshot
            registry = ctx.records if txn.id() == ctx.txnid else None
            cur = txn.cursor(db=dbs.pages)
            positioned = self._first(cur, after)
            keys: list[bytes] = []
            pages = nbytes = 0
            chunk_sums: dict[bytes, list[int]] = {}
            while positioned and len(keys) < self.chunk:
                h = bytes(cur.key())
                keys.append(h)
                value = cur.value()
                before = len(found.items)
                page = self.source._scanned(txn, h, value, children, registry)
                if page is None:
                    found.add("dangling_index", h, "a pages key that is not a page hash", remove=True)
                else:
                    if page.meta is None and not page.damaged:
                        missed.append(h)
                    pages += 1
                    nbytes += max(len(value) - HEADER, 0)
                    check_page(found, page, ctx.layouts, ctx.checksum, engine, ctx.times)
                    if len(found.items) == before and page.meta is not None:
                        unsure = unsure or self._parent_unsure(txn, page.meta)
                        acc = chunk_sums.setdefault(page.meta.ns_id, [0, 0, 0])
                        acc[0] += 1
                        acc[1] += page.meta.nbytes
                        acc[2] += page.meta.hits
                positioned = cur.next() and _below(cur.key(), hi)
            # the metadata keys from where this chunk began up to its last page (the range's end when it is the
            # last chunk): each must be a page read here
            last = keys[-1] if positioned and keys else None
            metas = txn.cursor(db=dbs.meta)
            seen = set(keys)
            meta_keys = 0
            if self._first(metas, after):
                for key in metas.iternext(keys=True, values=False):
                    if not _below(key, hi):
                        break
                    k = bytes(key)
                    if last is not None and k > last:
                        break
                    meta_keys += 1
                    if k not in seen:
                        unsure = unsure or "metadata without a page"
            return found, engine, missed, keys, pages, nbytes, chunk_sums, unsure, meta_keys, txn.id(), positioned

        while True:
            report(PartProgress(out.pages, after or b""))
            found, engine, missed, keys, pages, nbytes, chunk_sums, unsure, meta_keys, txn_id, more = \
                self.shared.reading(chunk, buffers=True)
            self._done(found, missed, txn_id, engine)
            out.pages += pages
            out.nbytes += nbytes
            out.meta_keys += meta_keys
            out.unsure = out.unsure or unsure
            for ns_id, (n, b, k) in chunk_sums.items():
                acc = sums.setdefault(ns_id, [0, 0, 0])
                acc[0] += n
                acc[1] += b
                acc[2] += k
            if not more or not keys:
                break
            after = keys[-1]
        out.sums = [NsSum(ns_id, n, b, k) for ns_id, (n, b, k) in sums.items()]
        out.txnids = sorted(self.txnids)
        return out

    def _parent_unsure(self, txn: lmdb.Transaction, meta: PageMeta) -> str:
        """Why the page of `meta` may be an orphan or a mismatch by `check_snapshot`'s rules ("": it is not)."""
        ctx = self.ctx
        raw = txn.get(meta.parent, db=self.dbs.meta)
        if raw is not None:
            up = decode_or_none(decode_meta, raw)
            if up is None:
                return "a parent whose metadata does not decode"
            return "" if (up.ns_id, up.layout_id) == (meta.ns_id, meta.layout_id) else "a namespace mismatch"
        if ctx.roots.owner(meta.parent) is not None:
            return "" if ctx.roots.belongs(meta.parent, meta.layout_id, meta.ns_id) else "a namespace mismatch"
        if not ctx.roots.keyed and meta.ns_id not in ctx.registry:
            return ""
        if meta.key:
            return ""  # an engine page under a parent gone: reachable by its key (its hash is checked apart)
        return "an orphan"

    def incremental(self, report: Callable[[PartProgress], None]) -> PartReport:
        """The pages of the range whose metadata was written or read back since `ctx.since`, with `check_page`
        (a changed page without bytes: `missing_page`)."""
        out, ctx, dbs, since = self.out, self.ctx, self.dbs, self.ctx.since
        assert since is not None
        resume: bytes | None = self.part.lo  # the first key of the next chunk (None: the first of the database)
        hi = self.part.hi[0] if self.part.hi is not None else 256  # ranges split on the first key byte
        limit = self.chunk * 64  # metadata records per read transaction: no payload is read unless changed
        walked = 0

        def chunk(txn: lmdb.Transaction) -> tuple[Any, ...]:
            found = Findings()
            engine = self._engine()
            missed: list[bytes] = []
            cur = txn.cursor(db=dbs.meta)
            changed = pages = nbytes = n = 0
            stop: bytes | None = None  # the first key left for the next chunk
            if cur.set_range(resume) if resume is not None else cur.first():
                # the hot loop: one decode per record, the key copied only for a changed page
                for key, raw in cur.iternext():
                    if len(key) and key[0] >= hi:
                        break
                    if n == limit:
                        stop = bytes(key)
                        break
                    n += 1
                    try:
                        meta: PageMeta | None = decode_meta(raw)
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        meta = None
                    if meta is not None and meta.created < since and meta.last_access < since:
                        continue
                    h = bytes(key)
                    changed += 1
                    value = txn.get(h, db=dbs.pages)
                    if value is None:
                        found.add("missing_page", h, "metadata that does not decode, without a page" if meta is None
                                  else "metadata without a page", remove=True)
                        continue
                    page = self.source._scanned(txn, h, value)
                    if page is None:
                        found.add("dangling_index", h, "a pages key that is not a page hash", remove=True)
                        continue
                    if page.meta is None and not page.damaged:
                        missed.append(h)
                    pages += 1
                    nbytes += max(len(value) - HEADER, 0)
                    check_page(found, page, ctx.layouts, ctx.checksum, engine, ctx.times)
            return found, engine, missed, n, stop, changed, pages, nbytes, txn.id()

        while True:
            report(PartProgress(walked, resume or b""))
            found, engine, missed, n, stop, changed, pages, nbytes, txn_id = self.shared.reading(chunk, buffers=True)
            self._done(found, missed, txn_id, engine)
            walked += n
            out.changed += changed
            out.pages += pages
            out.nbytes += nbytes
            if stop is None:
                break
            resume = stop
        out.txnids = sorted(self.txnids)
        return out
