"""One page as LMDB's side of the audit reads it: its payload with its metadata, its namespace's record and its
children index entry, all read in one transaction (`verify.ScannedPage`). Both the serial scan
(`integrity.LMDBIntegrity`) and the readers of key ranges (`integrity_ranges`) read pages through it.
"""

from __future__ import annotations

from typing import Any

import lmdb

from ...types.keys import PAGE_HASH_BYTES
from ..codec import decode_meta, decode_namespace, decode_or_none
from ..verify_source import ScannedPage
from .shared_env import SharedEnv


class PageReader:
    """Reads pages of one LMDB environment for the audit; it remembers each namespace's record per transaction
    (pages of one namespace come in runs)."""

    def __init__(self, shared: SharedEnv) -> None:
        self.shared = shared
        self._ns_seen: dict[tuple[int, bytes], tuple[bool, int]] = {}  # (txn id, namespace) -> recorded?, its hits

    def read(self, txn: lmdb.Transaction, h: bytes, value: Any, children: Any = None,
             registry: Any = None) -> ScannedPage | None:
        """The page stored under `h`, read in `txn`; None for a key that is no page hash. `children`: a cursor
        on the children index in `txn` to reuse; `registry`: the namespace records as of `txn`'s snapshot, id ->
        record or None (None: look each up in `txn`)."""
        dbs = self.shared.dbs
        if len(h) != PAGE_HASH_BYTES:
            return None
        raw = txn.get(h, db=dbs.meta)
        if raw is None:
            return ScannedPage(h, value, None)  # the caller notes the lookup that missed (misrouted lookups)
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

