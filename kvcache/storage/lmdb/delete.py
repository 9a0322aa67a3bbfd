"""Deleting a namespace from an LMDB store: a tenant's offboarding, rare next to puts and reads.

No namespace -> pages index is kept (every put would pay for it), so the pages are found by scanning `meta` in
chunks of short read transactions and removed DELETE_BATCH_PAGES per write transaction: a large tenant's
offboarding never holds the writer lock, or pins old pages, for long. Scans repeat until one finds nothing, so
pages a concurrent writer adds meanwhile go too; the namespace's registry record goes with the last batch, and
the removal is recorded there once for the whole namespace (`removals`: DROP or TTL, never a record per page).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lmdb

from ...types.ids import NamespaceId
from ..api import DeleteResult
from ..codec import decode_meta, decode_or_none
from ..removals import RemovalReason
from .bookkeeping import NsDelta, adjust_totals, apply_deltas, drop_stored
from .integrity import VERIFY_CHUNK_PAGES, Progress
from .removals import record as record_removals
from .shared_env import SharedEnv

DELETE_BATCH_PAGES = 1024  # pages per write transaction when deleting a namespace


def delete_namespace(shared: SharedEnv, write: Callable[..., Any], ns_id: NamespaceId, fingerprint_key: bytes | None,
                     progress: Progress | None, reason: RemovalReason = RemovalReason.DROP) -> DeleteResult:
    """Remove every page of namespace `ns_id` and its registry record, each batch through `write` (the handle's),
    the last one recording the namespace removed for `reason` (DROP or TTL); `progress` is called as `meta` is
    scanned."""
    pages = nbytes = txns = 0
    while True:
        found = pages_of(shared, ns_id, progress)
        for start in range(0, max(len(found), 1), DELETE_BATCH_PAGES):
            batch = found[start:start + DELETE_BATCH_PAGES]
            last = start + DELETE_BATCH_PAGES >= len(found)
            # the round that finds nothing is the end: it records the removal, once
            dropped, freed = write(_dropper(shared.dbs, ns_id, batch, last, fingerprint_key,
                                            reason if not found else None))
            txns += 1
            pages += dropped
            nbytes += freed
        if not found:
            break
    return DeleteResult(pages, nbytes, txns)


def pages_of(shared: SharedEnv, ns_id: NamespaceId, progress: Progress | None) -> list[bytes]:
    """Hashes of the stored pages of one namespace: a scan of `meta`, VERIFY_CHUNK_PAGES x 16 per read txn."""
    return [h for _, h, value in shared.scan(shared.dbs.meta, VERIFY_CHUNK_PAGES * 16, progress, "meta")
            if getattr(decode_or_none(decode_meta, value), "ns_id", None) == ns_id]


def _dropper(dbs: Any, ns_id: NamespaceId, batch: list[bytes], last: bool, fingerprint_key: bytes | None,
             reason: RemovalReason | None) -> Callable[[lmdb.Transaction], tuple[int, int]]:
    """The write transaction that drops `batch` (pages gone meanwhile are skipped); (pages, bytes) dropped. The
    `last` batch deletes the namespace's record instead of updating it; with a `reason` it records the removal."""
    def body(txn: lmdb.Transaction) -> tuple[int, int]:
        deltas: dict[NamespaceId, NsDelta] = {}
        dropped = freed = 0
        for h in batch:
            meta = drop_stored(txn, dbs, h, deltas)
            if meta is not None:  # else gone meanwhile
                dropped += 1
                freed += meta.nbytes
        if dropped:
            adjust_totals(txn, dbs, -dropped, -freed)
        if last:
            txn.delete(ns_id, db=dbs.namespaces)
        else:
            apply_deltas(txn, dbs, deltas, time.time(), fingerprint_key)
        if reason is not None:
            record_removals(txn, dbs.removals, [(ns_id, ns_id)], reason, time.time())
        return dropped, freed
    return body
