"""What the cache's calls return: outcomes, reasons and views. Values only (no torch, no I/O), so the CLI, the
admin protocol and scripts can name them without loading the cache.

Expected outcomes are values here — a full pool, a declined prefetch, a dropped staged record — never exceptions
(broken invariants raise `kvcache.errors`)."""

from __future__ import annotations

import enum
import functools

import msgspec
import numpy as np

from .ids import DisplayId
from .namespace import NamespaceInfo

_EMPTY = np.empty(0, dtype=np.int64)


class AdmitStatus(str, enum.Enum):
    """How an admit ended. All are expected outcomes."""

    ADMITTED = "admitted"
    # No room now: other live requests (or copies still in flight) hold it. Nothing new is held for the request;
    # its prefetch or staged record stays for the next try.
    POOL_FULL = "pool_full"
    # The request needs more pages than the device pool has: it can never be admitted. What was held for it (its
    # prefetch, its staged record) is given back.
    TOO_LARGE = "too_large"


class Admission(msgspec.Struct, dict=True):
    """The result of `admit`: where the request's KV lives on the device.

    Page-level: admission hands back the cache's own two runs of device pages, the cached prefix and the fresh
    pages, and builds nothing per token. `pages` (both runs as one array) and the per-token `slots` (page_size
    entries a page) are built the first time a caller reads them, then kept: an engine that addresses its KV by
    page, or only needs the fresh pages, never pays for them. (`dict=True` gives the instance the room to keep
    them; nothing else is stored there.)"""

    rid: str
    status: AdmitStatus
    cached_tokens: int = 0  # tokens whose KV was already on the device (after load-back), page-aligned
    loaded_back_tokens: int = 0  # of those, tokens loaded back from the host tier by this admit
    new_tokens: int = 0  # tokens the forward must compute
    # Device pages of the cached prefix (cached_tokens / page_size of them, owned by tree nodes), then the pages
    # allocated for the rest (the last may be partly used, owned by the request until commit). The cache's own
    # arrays (the tree's and the ledger's record of those pages): read them, never write them.
    cached_pages: np.ndarray = _EMPTY
    fresh_pages: np.ndarray = _EMPTY
    # cached_tokens by the tier they came from (sum = cached_tokens); the same split as CacheStats.hits
    device_hit_tokens: int = 0  # on the device before this admit
    host_hit_tokens: int = 0  # loaded back from host copies that predate the request's prefetch
    storage_hit_tokens: int = 0  # fetched from L3 by the request's prefetch (then loaded back or spliced)
    page_size: int = 1  # tokens per page of the device pool (`pages` to `slots`)

    @functools.cached_property
    def pages(self) -> np.ndarray:
        """Device page of every page of the request, in order: `cached_pages` then `fresh_pages` (never write it:
        without a cached prefix it is `fresh_pages` itself)."""
        if not len(self.cached_pages):
            return self.fresh_pages
        return np.concatenate([self.cached_pages, self.fresh_pages])

    @functools.cached_property
    def slots(self) -> np.ndarray:
        """Device slot index of every token of the request, in order (page p holds slots p * page_size ..
        p * page_size + page_size - 1): built from `pages` on the first read, the same array after. At page size 1
        the slots are `pages` (never write them)."""
        n, ps, pages = self.cached_tokens + self.new_tokens, self.page_size, self.pages
        if ps == 1:
            return pages if len(pages) == n else pages[:n]
        return (pages[:, None] * ps + np.arange(ps, dtype=np.int64)).reshape(-1)[:n]


class CommitResult(msgspec.Struct):
    """The result of `commit`."""

    rid: str
    inserted_tokens: int  # page-aligned tokens now in the tree (new and already present)
    duplicate_pages: int  # request pages freed because the tree already held them
    tail_pages: int  # partial tail page(s) freed (not cacheable)
    backup_pages: int  # host pages of the backup started by this commit


class EvictResult(msgspec.Struct):
    """Pages an `evict` call freed, per tier."""

    device_pages: int
    host_pages: int


class TierRoom(msgspec.Struct):
    """One tier's pages as an admission sees them. `free + evictable + held + busy = pages`."""

    pages: int  # the pool's size
    free: int  # on the free list
    evictable: int  # tree copies nobody locks or holds: eviction frees them (pinned ones once their copy is done)
    held: int  # tree copies only prefetch holds keep: admission cancels those holds as a last resort
    busy: int  # the rest: pages locked by or allocated to live requests, in-flight copies, prefetched/staged pages

    @property
    def available(self) -> int:
        """Pages an admission can have without cancelling anything."""
        return self.free + self.evictable


class Headroom(msgspec.Struct):
    """`TieredCache.headroom()`: where each tier's pages are, so a scheduler can tell what an admission could get."""

    device: TierRoom
    host: TierRoom | None  # None without a host tier


class NamespaceDrop(msgspec.Struct):
    """What `TieredCache.drop_namespace` freed, per tier."""

    namespace: NamespaceInfo
    namespace_id: DisplayId  # keyed by the fingerprint key (a raw id would let a short salt be brute-forced)
    device_pages: int
    host_pages: int
    store_pages: int  # L3 pages deleted (0 without a store)
    store_bytes: int
    live_requests: int  # running requests of the namespace: the pages they lock stay until they commit or release


class DeclineReason(str, enum.Enum):
    """Why `prefetch` started nothing. All are expected outcomes."""

    NO_STORE = "no_store"  # the cache has no L3 store
    NO_HOST_TIER = "no_host_tier"  # prefetched pages land in L2, and there is none
    IN_FLIGHT = "in_flight"  # the request already has a prefetch, a staged record or an admission
    NOTHING_TO_FETCH = "nothing_to_fetch"  # the tree already holds every whole page of the request
    BELOW_THRESHOLD = "below_threshold"  # the miss is shorter than prefetch_threshold_tokens
    HOST_LIMIT = "host_limit"  # prefetches and staged records already hold prefetch_max_host_tokens of L2
    DEVICE_LIMIT = "device_limit"  # buffer mode: holding this prefix would pass prefetch_max_device_tokens
    UNBACKED_PREFIX = "unbacked_prefix"  # cache mode: the match ends in a node without a host copy to attach to
    STALE_MATCH = "stale_match"  # the match handed in no longer describes the tree (evicted since) or the request


class DropReason(str, enum.Enum):
    """Why fetched pages were given back instead of used."""

    ABORTED = "aborted"  # the request was released before it used them
    DUPLICATE = "duplicate"  # the tree already held those pages when they arrived
    UNATTACHED = "unattached"  # their prefix had left the tree, or ends in a node without host copy
    NAMESPACE_MISMATCH = "namespace_mismatch"  # a prefetch or staged record met by a request of another namespace
    KEY_MISMATCH = "key_mismatch"  # ... by a request whose tokens do not start with its key (a reused request id)
    PREFIX_GAP = "prefix_gap"  # a staged record whose prefix the request no longer has on the device
    CANCELLED = "cancelled"  # released so that an admission fits (see CancelReason)
    TOO_LARGE = "too_large"  # the request can never fit the device pool


class CancelReason(str, enum.Enum):
    """Why a prefetch (or a staged record) was cancelled before its request's admission."""

    DEVICE_PRESSURE = "device_pressure"  # its device hold kept a request that fits the pool from being admitted


class PrefetchOutcome(msgspec.Struct):
    """What `TieredCache.prefetch` did."""

    rid: str
    issued: bool
    reason: DeclineReason | None = None  # set when not issued
    op_id: int = 0
    start_tokens: int = 0  # tokens the tree already held (the span starts here)
    requested_tokens: int = 0  # tokens of the span asked from L3
    namespace: NamespaceInfo | None = None  # the request's namespace, as printable fields


class SettledPrefetch(msgspec.Struct):
    """What `TieredCache.settle_prefetch` did with a request's prefetch, before any admission."""

    rid: str
    op_id: int
    hit_pages: int  # pages of the span the store reported present
    fetched_pages: int  # pages that arrived in L2
    inserted_pages: int  # cache mode: pages now in the tree as host-only nodes (fetched minus duplicates)
    staged: bool  # buffer mode: the pages are parked as the request's staged record
    seconds: float  # issue to settle
    namespace: NamespaceInfo  # the request's


class StagedView(msgspec.Struct):
    """The printable face of a staged record (CLI, snapshots)."""

    id: int
    rid: str
    namespace: NamespaceInfo
    namespace_id: DisplayId  # keyed: a raw id would let a short salt be brute-forced
    key_tokens: int
    start_tokens: int  # tokens the tree held when the fetch started; the staged pages follow them
    staged_tokens: int
    op_id: int
    page_hashes: list[str]  # hex


class ExpiryCause(str, enum.Enum):
    """Why a namespace expired (or is waiting to)."""

    DEADLINE = "deadline"  # its time to live ran out
    OVERFLOW = "overflow"  # more namespaces than max_namespaces were tracked: it was closest to its deadline
    ON_DEMAND = "on_demand"  # `TieredCache.expire_namespace` (`kvc ns expire`)


class NamespaceTTL(msgspec.Struct, frozen=True):
    """One tracked namespace's time to live, as `TieredCache.namespace_ttls` shows it. Times are in the tracker's
    clock (monotonic seconds); `seconds_left` is what scripts compare."""

    namespace: NamespaceInfo
    id: DisplayId  # as `kvc ns ls` prints it
    ttl_s: float
    first_use: float
    last_use: float
    deadline: float
    seconds_left: float  # deadline - now; <= 0 once due (a deferred expiry waits for running requests)
    deferred: ExpiryCause | None  # why it is waiting to expire, while it waits for its running requests


class NamespaceExpiry(msgspec.Struct, frozen=True):
    """What expiring a namespace did: dropped it from every tier (`expired`), or deferred it until its running
    requests end (`deferred`)."""

    namespace: NamespaceInfo
    id: DisplayId
    cause: ExpiryCause
    expired: bool
    deferred: bool
    live_requests: int  # running requests of the namespace (a deferral waits for them)
    device_pages: int = 0  # L1 pages freed
    host_pages: int = 0  # L2 pages freed
    store_pages: int = 0  # L3 pages deleted
    store_bytes: int = 0
