"""Why a page that was once held is not held now: the record a tier keeps of the pages it removed.

A miss is explained from these: "never written" is the absence of any record, anything else names what removed
the page and when. Every tier keeps a bounded number of them (the newest win), so a record may be gone even
though the page was removed: an explanation then says "not held, no record of it" rather than guessing.

Values only (no I/O): the store, the cache, `kvc explain` and the per-request lines of `kvc replay` share them.
"""

from __future__ import annotations

import enum

import msgspec

from .ids import NamespaceId


class RemovalReason(str, enum.Enum):
    """What removed a page. The string values are the wire and `--json` words."""

    CAPACITY = "capacity"  # evicted to make room under the tier's (or the store's) capacity
    SHARE = "share"  # evicted because its namespace was over its share (quota) of the tier
    TTL = "ttl"  # deleted because it outlived its namespace's time to live
    DROP = "drop"  # deleted with its whole namespace (`kvc ns drop`, offboarding)
    REPAIR = "repair"  # removed by `kvc audit --repair` (a page that failed its checks, or an orphan)
    QUARANTINE = "quarantine"  # its bytes failed their checksum (or size) on a read: taken out of service
    # a cache only: evicted from L1/L2 on request (`kvc ns evict`, `TieredCache.evict_namespace`); L3 keeps it
    EVICT = "evict"


class PageRemoval(msgspec.Struct, frozen=True):
    """One page removed from one tier: what removed it and when."""

    page_hash: bytes  # PAGE_HASH_BYTES: the page's hash (its identity in every tier)
    reason: RemovalReason
    at: float  # unix seconds of the removal
    ns_id: NamespaceId  # the namespace the page was held under (never its salt)


# removal records a tier keeps at most (the oldest go first): ~140 bytes each on an LMDB store's disk, ~240 of a
# Redis server's memory (kvcache.storage.removals, docs/capacity.md)
REMOVALS_KEPT = 65536
