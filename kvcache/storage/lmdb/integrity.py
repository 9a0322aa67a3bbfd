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

`LMDBIntegrity` reads each page through `integrity_page.PageReader`, a key range of a parallel audit through
`integrity_ranges.RangeReader`, and removes records through `integrity_repair.LMDBRepairOps`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import lmdb
import msgspec

from ... import errors
from ...errors import StoreError
from ...types.ids import NamespaceId
from ...types.keys import hash_root_of_id
from ...types.layout import KVLayout
from ..api import AuditHistory, AuditRecord, LayoutRecord, VerifyReport
from ..chain import chain_key_of
from ..codec import (
    CHECKSUMS,
    FORMAT_VERSION,
    decode_layout,
    decode_meta,
    decode_namespace,
    decode_or_none,
    encoder,
)
from ..isolated import Died
from ..keyfile import KEY_MISMATCH, key_if_any, mismatch_detail
from ..verify_checks import life
from ..verify_parts import Catalogue, KeyRange, PartContext, PartProgress, PartReport
from ..verify_source import Findings, PageRow, RepairOps, ScannedPage, Snapshot
from . import pagemap
from . import removals as removal_log
from .bookkeeping import decode_totals, key_evidence, recount
from .env import DEFAULT_MAP_SIZE, acquire, release
from .integrity_page import PageReader
from .integrity_ranges import RangeReader
from .integrity_repair import LMDBRepairOps
from .shared_env import SharedEnv

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
        self._pages = PageReader(shared)
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
            yield from self._noted(found, h, self._pages.read(txn, h, value))

    def _noted(self, found: Findings, h: bytes, page: ScannedPage | None) -> Iterator[ScannedPage]:
        """`page`, once what it says of the store is noted: a pages key that is no page hash is a finding (and no
        page), a page without metadata is kept for the pass that looks for metadata elsewhere."""
        if page is None:
            found.add("dangling_index", h, "a pages key that is not a page hash", remove=True)
            return
        if page.meta is None and not page.damaged:
            self._missed_meta.add(h)
        yield page

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
                rows.append((h, self._pages.read(txn, h, bytes(cur.value()))))
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
            chunk = LOCK_FREE_CHUNK_PAGES if self.shared.lock_free else VERIFY_CHUNK_PAGES
            reader = RangeReader(self.shared, self._pages, self.chain_key, part, ctx, chunk)
            return reader.incremental(report) if ctx.since is not None else reader.full(report)
        # a forked child: this copy of the source reads through the child's own handle from now on
        self.shared = acquire(self.shared.path, False, DEFAULT_MAP_SIZE, "none", lock=not self.shared.lock_free)
        self._pages = PageReader(self.shared)
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
            ops = LMDBRepairOps(txn, self.shared.dbs, self._layouts, self.checksum, self.chain_key,
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
                ns_id = NamespaceId(bytes(key))
                given = {hash_root_of_id(lay, ns_id, chain_key).hex() for lay in layout_ids}
                kept = [r for r in record.roots if r in given]
                if kept != record.roots:
                    txn.put(bytes(key), encoder.encode(msgspec.structs.replace(record, roots=kept)),
                            db=dbs.namespaces)
                    changed += 1
            return changed

        return self._write(body)
def read_history(txn: lmdb.Transaction, dbs: Any) -> AuditHistory:
    """The store's audit record (empty when none, or when it does not decode: the next audit writes it anew)."""
    raw = txn.get(AUDIT_KEY, db=dbs.store)
    return (decode_or_none(_decode_history, raw) if raw is not None else None) or AuditHistory()

