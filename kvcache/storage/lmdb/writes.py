"""The data plane's writes of an LMDB store (`PageWrites`): a batch of pages put, the reads a handle logged
written back, a namespace deleted. A put is one write transaction that folds in the handle's logged reads and
quarantined pages (`access`), a flush one that writes only them, and a deletion flushes them before its own
bounded transactions.

The transactions themselves are built elsewhere: `put` (one batch), `access` (the write-back), `delete` (a
namespace's offboarding); this part runs them through the handle's lease and keeps its counters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ...errors import InvalidInput
from ...types.ids import NamespaceId, PageHash
from ...types.layout import KVLayout
from ..api import CapacityPolicy, DeleteResult, PageOrigin, PutResult
from ..checks import put_views
from ..codec import Checksum
from ..removals import RemovalReason
from .access import AccessRecords
from .delete import delete_namespace
from .lease import EnvLease
from .put import PutBatch


class PageWrites:
    """`put`, `flush` and `delete_namespace` of one handle. Owns the eviction headroom its puts ask for
    (`CapacityPolicy.evict_headroom`); the environment is the handle's lease, the logged reads and quarantined
    pages are its access records, the counters are its counters. The handle's keys are passed in by each call (a
    handle learns them once opened)."""

    def __init__(self, lease: EnvLease, access: AccessRecords, counts: dict[str, int], checksum: Checksum,
                 layout: KVLayout | None) -> None:
        self._lease = lease
        self._access = access
        self._counts = counts
        self._checksum = checksum
        self._layout = layout  # the handle's: what its puts write under
        self.evict_headroom = CapacityPolicy().evict_headroom

    def put(self, hashes: Sequence[PageHash], pages: Sequence[Any], origins: Sequence[PageOrigin],
            chain_key: bytes | None, fingerprint_key: bytes | None) -> PutResult:
        """`LMDBStore.put`: the batch checked (`checks.put_views`) and written in one write transaction with the
        logged reads (`put.PutBatch`), counted."""
        self._lease.check_writable()
        views = put_views(self._layout, hashes, pages, origins, chain_key)
        if not hashes:
            return PutResult(0, 0, 0, 0, 0)
        layout = self._layout
        assert layout is not None  # put_views refuses a handle without one
        assert chain_key is not None  # a writer holds the key file (store_key), or the store is format 1
        batch = PutBatch(self._lease.live().dbs, layout, self._checksum, hashes, views, origins, self.evict_headroom,
                         fingerprint_key, chain_key)
        access = self._access
        taken = access.take()
        result = access.commit(self._lease.write, lambda txn: batch.write(txn, access, taken), taken,
                               wanted=len(hashes) * (layout.bytes_per_page + 512))
        c = self._counts
        c["pages_written"] += result.written
        c["pages_existing"] += result.existing
        c["pages_rejected"] += result.rejected
        c["pages_evicted"] += result.evicted
        if taken[0]:
            c["flushes"] += 1
        return result

    def flush(self, fingerprint_key: bytes | None) -> None:
        """`LMDBStore.flush`: logged reads and quarantined pages in one write transaction, when there are any (and
        the handle writes and is open)."""
        if self._lease.readonly or self._lease.closed:
            return
        taken = self._access.take()
        if not taken[0] and not taken[1]:
            return
        self._access.write_back(self._lease.write, self._lease.live().dbs, taken, fingerprint_key)
        self._counts["flushes"] += 1

    def delete_namespace(self, ns_id: NamespaceId, reason: RemovalReason, fingerprint_key: bytes | None,
                         progress: Callable[[str, int, bytes | None], None] | None) -> DeleteResult:
        """`LMDBStore.delete_namespace`: the arguments checked, the logged reads flushed, then `delete`'s scans and
        bounded write transactions (`progress` called as they walk `meta`)."""
        self._lease.check_writable()
        if not isinstance(ns_id, bytes) or len(ns_id) != 16:
            raise InvalidInput(f"a namespace id is 16 bytes, got {ns_id!r:.60}")
        if reason not in (RemovalReason.DROP, RemovalReason.TTL):
            raise InvalidInput(f"a namespace is removed whole for a drop or a TTL expiry, not for {reason!r}")
        self.flush(fingerprint_key)
        return delete_namespace(self._lease.live(), self._lease.write, ns_id, fingerprint_key, progress,
                                RemovalReason(reason))
