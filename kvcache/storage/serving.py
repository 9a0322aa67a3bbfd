"""Offboarding that sticks across processes: the live caches of a store follow its drop records.

A namespace dropped from a shared store is gone only when no cache writes it back. A live cache may hold the
namespace's pages in L1/L2 that its store does not have yet (write-back: written on eviction), so a drop made
elsewhere — offline, or through another live cache of the same store — must reach it. The store keeps two
things for that (`L3Store.register_serve` / `record_drop`, each backend in its own records):

- who serves it: a `ServeRecord` per live cache (pid, host, admin socket), removed when the cache stops, so a
  drop can find the caches to go through (`kvcache.live.server.live_serves` skips records whose process is gone
  or whose socket does not answer);
- what was dropped: a `DropRecord` per drop, numbered, written *before* the namespace's pages are deleted.

A cache follows the records with a `DropWatch` on a `FencedStore`, the store handle it is given:

- every `put` first reads the store's drop number (one small read); a namespace dropped under a number this cache
  has not yet applied is refused in that put (counted `rejected`), so no write-back of it lands after the record;
- its owner (the live server) applies the new records between steps — `TieredCache.drop_namespace` of each
  namespace it holds — and only then does the fence let that namespace's new pages through;
- a namespace it drops itself (`delete_namespace` through the fenced handle: an offboarding, a TTL expiry) is
  recorded first, so the others follow it; applying another's record records nothing (no echo).

A put that checked the fence just before a record and lands after the delete leaves a residue; the applying
cache's own drop removes it, since it still holds the namespace.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import InvariantViolation, StoreError
from ..types.ids import NamespaceId, PageHash
from ..types.layout import KVLayout
from ..types.namespace import Namespace
from ..types.removals import PageRemoval, RemovalReason
from ..types.shares import NamespaceShares, Shares
from .api import (
    ChildInfo,
    DeleteResult,
    DropRecord,
    L3Store,
    NamespaceRecord,
    PageMeta,
    PageOrigin,
    PageOutcome,
    PutResult,
    ServeRecord,
    StoreStats,
    VerifyReport,
)

OFFLINE = "offline"  # DropRecord.by of a drop made without a live cache


def new_serve_record(socket_path: str) -> ServeRecord:
    """The record of this process serving on `socket_path` (a fresh token)."""
    return ServeRecord(uuid.uuid4().hex, os.getpid(), socket.gethostname(), socket_path, time.time())


def registry_record(store: L3Store, ns_id: NamespaceId) -> NamespaceRecord | None:
    """The store's registry record of namespace `ns_id`; None when it holds nothing of it."""
    ns_hex = bytes(ns_id).hex()
    return next((r for r in store.namespaces() if r.ns_id_hex == ns_hex), None)


def recorded_drop(store: L3Store, ns_id: NamespaceId, by: str = OFFLINE) -> tuple[DropRecord, DeleteResult]:
    """Drop namespace `ns_id` from `store` so that its live caches follow: the drop record first, then the pages."""
    rec = registry_record(store, ns_id)
    record = store.record_drop(ns_id, rec.extra_key if rec else None, rec.salt_fingerprint if rec else None, by)
    return record, store.delete_namespace(ns_id)


def last_drop(store: L3Store, ns_id_hex: str | None = None, extra_key: str | None = None,
              salt_fingerprint: str | None = None) -> DropRecord | None:
    """The latest drop record kept of a namespace named by its raw id hex, or by its salt fingerprint (and
    extra_key when given): "already offboarded" is told from "never there" by it."""
    for rec in reversed(store.drops()):
        if ns_id_hex is not None and rec.ns_id_hex == ns_id_hex:
            return rec
        if (ns_id_hex is None and salt_fingerprint is not None and rec.salt_fingerprint == salt_fingerprint
                and (extra_key is None or rec.extra_key == extra_key)):
            return rec
    return None


class DropWatch:
    """One cache's view of its store's drop records: those it has not applied yet fence its puts.

    Thread-safe: the fence is read on the I/O thread, records are applied on the owner thread."""

    def __init__(self, store: L3Store, by: str) -> None:
        self.store = store
        self.by = by  # DropRecord.by of the drops this cache records: its admin socket
        self._lock = threading.Lock()
        self._seen = store.drop_seq()  # records up to here are known (earlier ones concern a cache not yet built)
        self._own: set[int] = set()  # numbers of records this cache wrote and has not read back yet
        self._pending: dict[bytes, DropRecord] = {}  # namespace id -> a record this cache has not applied yet
        self._applying = 0  # > 0: deletes are this cache following a record, not new drops to record
        self.applied = 0  # records applied so far (figures)

    def refresh(self) -> None:
        """Read the records written since the last call (one small read when there are none)."""
        with self._lock:
            seq = self.store.drop_seq()
            if seq <= self._seen:
                return
            for rec in self.store.drops(self._seen):
                if rec.seq in self._own:
                    self._own.discard(rec.seq)
                else:
                    self._pending[bytes.fromhex(rec.ns_id_hex)] = rec
                self._seen = max(self._seen, rec.seq)
            self._seen = max(self._seen, seq)

    def fenced(self) -> frozenset[bytes]:
        """Namespace ids whose drop this cache has not applied yet: its puts of them are refused. A store that
        cannot be read now fences what was known (its put fails alike)."""
        with contextlib.suppress(StoreError):
            self.refresh()
        with self._lock:
            return frozenset(self._pending)

    def pending(self) -> list[DropRecord]:
        """Records to apply, oldest first."""
        with self._lock:
            return sorted(self._pending.values(), key=lambda r: r.seq)

    def done(self, record: DropRecord) -> None:
        """`record` is applied: the cache holds nothing of its namespace, whose new pages may be written again."""
        with self._lock:
            key = bytes.fromhex(record.ns_id_hex)
            if self._pending.get(key) is record:
                del self._pending[key]
            self.applied += 1

    @contextlib.contextmanager
    def applying(self) -> Iterator[None]:
        """While following a record: deletes through the fenced store record nothing (no echo)."""
        with self._lock:
            self._applying += 1
        try:
            yield
        finally:
            with self._lock:
                self._applying -= 1

    def announce(self, ns_id: NamespaceId) -> DropRecord | None:
        """Record a drop this cache makes (before its pages go); None while following another's record."""
        with self._lock:
            if self._applying:
                return None
            rec = registry_record(self.store, ns_id)
            record = self.store.record_drop(ns_id, rec.extra_key if rec else None,
                                            rec.salt_fingerprint if rec else None, self.by)
            if record.seq > self._seen:
                self._own.add(record.seq)
            return record


class FencedStore:
    """The store handle a live cache is given: `store` itself, except that puts of namespaces dropped elsewhere
    (and not yet applied here) are refused, and `delete_namespace` records the drop first (see the module
    docstring). Every other attribute is the store's."""

    def __init__(self, store: L3Store, watch: DropWatch) -> None:
        self._store = store
        self.watch = watch
        self.location: str = store.location
        self.layout: KVLayout | None = store.layout
        self.readonly: bool = store.readonly

    @property
    def inner(self) -> L3Store:
        """The store handle behind the fence."""
        return self._store

    def put(self, hashes: Sequence[PageHash], pages: Sequence[Any], origins: Sequence[PageOrigin]) -> PutResult:
        """The store's put, less the pages of fenced namespaces (counted `rejected`)."""
        fenced = self.watch.fenced()
        keep = [i for i, o in enumerate(origins) if o.namespace.id not in fenced] if fenced else None
        if keep is None or len(keep) == len(origins):
            return self._store.put(hashes, pages, origins)
        refused = len(origins) - len(keep)
        outcomes = bytearray([PageOutcome.REJECTED]) * len(origins)  # a fenced page is rejected
        if not keep:
            return PutResult(0, 0, refused, 0, 0, outcomes=bytes(outcomes))
        got = self._store.put([hashes[i] for i in keep], [pages[i] for i in keep], [origins[i] for i in keep])
        if len(got.outcomes) != len(keep):
            raise InvariantViolation(f"the store's put named {len(got.outcomes)} outcomes for {len(keep)} pages "
                                     f"(every backend names one per page: PutResult.outcomes)")
        for i, outcome in zip(keep, got.outcomes, strict=True):
            outcomes[i] = outcome
        return PutResult(got.written, got.existing, got.rejected + refused, got.evicted, got.bytes_written,
                         got.evicted_hashes, got.evicted_keys, bytes(outcomes))

    def delete_namespace(self, ns_id: NamespaceId, reason: RemovalReason = RemovalReason.DROP) -> DeleteResult:
        """Record the drop (unless following another's), then the store's delete (`reason`: DROP or TTL, what
        the store's removal log records)."""
        self.watch.announce(ns_id)
        return self._store.delete_namespace(ns_id, reason)

    # -- the rest of L3Store: the store's own ----------------------------------------------------------------

    def exists_prefix(self, hashes: Sequence[PageHash]) -> int:
        return self._store.exists_prefix(hashes)

    def get_into(self, hashes: Sequence[PageHash], out_views: Sequence[Any]) -> int:
        return self._store.get_into(hashes, out_views)

    def namespaces(self) -> list[NamespaceRecord]:
        return self._store.namespaces()

    def set_shares(self, namespace: Namespace, shares: Shares) -> None:
        self._store.set_shares(namespace, shares)

    def shares(self) -> list[NamespaceShares]:
        return self._store.shares()

    def layouts(self) -> list[KVLayout]:
        return self._store.layouts()

    def root(self, namespace: Namespace, layout: KVLayout | None = None) -> PageHash:
        return self._store.root(namespace, layout)

    def children(self, page_hash: PageHash) -> list[ChildInfo]:
        return self._store.children(page_hash)

    def removals(self, hashes: Sequence[PageHash], namespace: NamespaceId | None = None) -> list[PageRemoval | None]:
        return self._store.removals(hashes, namespace)

    def page_meta(self, page_hash: PageHash) -> PageMeta | None:
        return self._store.page_meta(page_hash)

    def stats(self) -> StoreStats:
        return self._store.stats()

    def verify(self, repair: bool = False) -> VerifyReport:
        return self._store.verify(repair)

    def register_serve(self, record: ServeRecord) -> None:
        self._store.register_serve(record)

    def unregister_serve(self, token: str) -> None:
        self._store.unregister_serve(token)

    def serves(self) -> list[ServeRecord]:
        return self._store.serves()

    def record_drop(self, ns_id: NamespaceId, extra_key: str | None, salt_fingerprint: str | None,
                    by: str) -> DropRecord:
        return self._store.record_drop(ns_id, extra_key, salt_fingerprint, by)

    def drops(self, since: int = 0) -> list[DropRecord]:
        return self._store.drops(since)

    def drop_seq(self) -> int:
        return self._store.drop_seq()

    def flush(self) -> None:
        self._store.flush()

    def close(self) -> None:
        self._store.close()

    def __getattr__(self, name: str) -> Any:
        # what a backend has beyond L3Store (fingerprint_key, counters, path, ...)
        return getattr(self._store, name)

    def __repr__(self) -> str:
        return f"FencedStore({self._store!r})"
