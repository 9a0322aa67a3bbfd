"""Counters and statistics of a TieredCache: plain msgspec values, safe to encode and to keep."""

from __future__ import annotations

import msgspec

from .fingerprint_key import FingerprintKey
from .namespace import Namespace, NamespaceInfo


class CacheCounters(msgspec.Struct):
    """Running totals since the cache was built."""

    matches: int = 0
    match_tokens: int = 0  # tokens asked for by matches
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    admitted: int = 0
    refused: int = 0  # admits that found no room now (POOL_FULL: other live requests or copies hold it)
    too_large: int = 0  # admits of requests that need more pages than the device pool has (TOO_LARGE)
    committed: int = 0
    released: int = 0
    loaded_back_tokens: int = 0
    load_backs_skipped: int = 0  # host extensions not loaded (budget or no device room)
    load_backs_refused: int = 0  # host extensions another in-flight load-back was already filling
    duplicate_pages_freed: int = 0
    backups_started: int = 0
    backups_completed: int = 0
    backup_pages: int = 0
    backups_skipped: int = 0  # nodes not backed up for lack of host room
    device_pages_evicted: int = 0
    host_pages_evicted: int = 0
    share_refresh_errors: int = 0  # refreshes of namespace shares from the store that failed (shares kept)


class TierHits(msgspec.Struct):
    """Tokens a namespace's admitted requests found in each tier."""

    namespace: NamespaceInfo
    device: int = 0  # already on the device at admission
    host: int = 0  # loaded back from L2 (host copies that were there before the request's prefetch)
    storage: int = 0  # fetched from L3 by the request's prefetch


def add_hits(book: dict[bytes, TierHits], namespace: Namespace, device: int, host: int, storage: int,
             fingerprints: FingerprintKey) -> None:
    """Add an admission's hit tokens by tier to its namespace's row of `book` (namespace id -> TierHits), a new
    row showing the namespace under `fingerprints` (the cache's key)."""
    hits = book.get(namespace.id)
    if hits is None:
        hits = book[namespace.id] = TierHits(fingerprints.info(namespace))
    hits.device += device
    hits.host += host
    hits.storage += storage


class PrefetchStats(msgspec.Struct):
    """Prefetch outcomes since the cache was built."""

    attempts: int = 0  # prefetch() calls
    issued: int = 0
    declined: dict[str, int] = {}  # DeclineReason value -> count
    namespace_mismatches: int = 0  # prefetch anchors and staged records of another namespace than the request
    hit_pages: int = 0  # pages the store reported present
    fetched_pages: int = 0  # pages that arrived in L2
    fetched_bytes: int = 0
    used_pages: int = 0  # fetched pages a request used (inserted or spliced)
    retried: int = 0  # re-armed attempts
    dropped: dict[str, int] = {}  # DropReason value -> pages given back
    cancelled: dict[str, int] = {}  # CancelReason value -> prefetches and staged records cancelled under pressure
    read_errors: int = 0  # jobs that failed on an L3 fault
    seconds: float = 0.0  # issue-to-settle time, summed over settled prefetches


class BackupStats(msgspec.Struct):
    """Backups since the cache was built."""

    host_pages: int = 0  # device -> host pages completed
    host_bytes: int = 0
    storage_pages: int = 0  # host -> L3 pages acknowledged
    storage_bytes: int = 0
    # writes that failed on an L3 fault: an exception, or pages the store could not write (unreachable, timed out,
    # PageOutcome.FAILED); the nodes are left intact, not marked stored, and written again later
    storage_failed: int = 0
    storage_rejected: int = 0  # pages the store refused: its capacity, a quota or a share (never a fault)
    storage_rewrites: int = 0  # paths written again because L3 had evicted a page above them
    storage_retries: int = 0  # paths written again after a write of them failed or was refused (parent first)
    storage_evicted: int = 0  # pages the store evicted to make room for this cache's writes (marked gone)


class TTLStats(msgspec.Struct):
    """Namespace expiry since the cache was built (`kvcache.engine.ttl`)."""

    tracked: int = 0  # namespaces tracked now (a deadline or a deferred expiry each)
    expired: dict[str, int] = {}  # ExpiryCause value -> namespaces dropped for it
    deferred: int = 0  # expiries put off because running requests of the namespace lock its prefix
    cancelled: int = 0  # deferred expiries a new use of the namespace cancelled (its deadline re-armed)
    device_pages: int = 0  # L1 pages freed by expiries
    host_pages: int = 0  # L2 pages freed by expiries
    store_pages: int = 0  # L3 pages deleted by expiries
    store_bytes: int = 0


class CacheStats(msgspec.Struct):
    """`TieredCache.stats()`: hits per namespace and tier, prefetch and backup figures, running counters, and
    namespace expiry (`ttl`, None without a TTL policy)."""

    hits: list[TierHits]
    prefetch: PrefetchStats
    backup: BackupStats
    counters: CacheCounters
    ttl: TTLStats | None = None


def bump(counts: dict[str, int], key: str, n: int = 1) -> None:
    """Add `n` to counts[key] (a reason -> count table)."""
    if n:
        counts[key] = counts.get(key, 0) + n
