"""One key range of a parallel audit (`verify_parts`), as LMDB reads it: the range's pages in short read
transactions of `chunk` pages each (run again when a lock-free one was overtaken), every page checked with
`check_page`, and the range's side of the structure checks. `integrity.LMDBIntegrity.scan_part` runs one per range,
in a worker process of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lmdb
import msgspec

from ...types.ids import NamespaceId, PageHash
from ..api import PageMeta
from ..codec import HEADER, decode_meta, decode_or_none
from ..verify_checks import EngineHashes, check_page
from ..verify_parts import HeldPage, KeyRange, NsSum, PartContext, PartProgress, PartReport, replays
from ..verify_source import Findings
from .integrity_page import PageReader
from .shared_env import SharedEnv


def _below(key: Any, hi: int) -> bool:
    """Whether `key` sorts below a range that ends at first key byte `hi` (256: none)."""
    return not len(key) or key[0] < hi


class RangeReader:
    """One key range of `LMDBIntegrity.scan_part`: read in short read transactions (run again when a lock-free
    one was overtaken), each chunk's findings recorded in a `Findings` of its own and kept once it is sound."""

    def __init__(self, shared: SharedEnv, pages: PageReader, chain_key: bytes | None, part: KeyRange,
                 ctx: PartContext, chunk: int) -> None:
        self.shared, self.dbs, self.pages, self.part, self.ctx = shared, shared.dbs, pages, part, ctx
        self.chain_key = chain_key  # the roots' key, for the engine pages' hash check (None: by recorded roots)
        self.chunk = chunk  # pages per read transaction
        self.out = PartReport([], [], 0, 0, [])
        self.txnids: set[int] = set()
        self.roots: dict[tuple[bytes, NamespaceId], PageHash] = {}  # EngineHashes.roots, computed once per range

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
        engine = EngineHashes(self.chain_key)
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
                page = self.pages.read(txn, h, value, children, registry)
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
                    page = self.pages.read(txn, h, value)
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
