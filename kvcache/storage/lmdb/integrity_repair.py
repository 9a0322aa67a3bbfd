"""A repair's removals inside one LMDB write transaction: `verify.RepairOps` for an LMDB store.

The audit (`kvcache.storage.verify`) judged what is wrong from reads that writers may have overtaken since, so
every removal is rechecked here, in the write transaction that makes it: a page is removed only when its records
are still provably corrupt or unreachable. What goes comes off the counters and into the removal log in the same
transaction (`settle`). `integrity.LMDBIntegrity.repair_batch` builds one per write transaction.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import lmdb
import msgspec

from ...types.ids import NamespaceId
from ...types.keys import PAGE_HASH_BYTES, hash_root_of_id
from ...types.layout import KVLayout
from ..api import PageMeta
from ..codec import (
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
from ..removals import RemovalReason
from ..verify_checks import implausible, recorded_roots
from ..verify_source import Guard, PageRow, Removal
from . import removals as removal_log
from .bookkeeping import NsDelta, adjust_totals, apply_deltas, drop_page


class LMDBRepairOps:
    """`verify.RepairOps` inside one LMDB write transaction."""

    def __init__(self, txn: lmdb.Transaction, dbs: Any, layouts: dict[bytes, KVLayout], checksum: Any,
                 chain_key: bytes | None, times: tuple[float, float] = (0.0, 0.0)) -> None:
        self.txn, self.dbs, self.layouts, self.checksum = txn, dbs, layouts, checksum
        self.chain_key = chain_key
        self.times = times  # the store's life (verify.life): what a page's times may be
        self.deltas: dict[NamespaceId, NsDelta] = {}
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

    def _own_root(self, root: bytes, layout_id: bytes, ns_id: NamespaceId) -> bool:
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

