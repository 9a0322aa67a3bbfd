"""Why one request missed, tier by tier: what `kvc explain` prints and `kvc replay --requests-out` writes per request.

For each tier (L1 device, L2 host, L3 storage) an explanation says how many of the request's tokens the tier holds
from its first token on, and for the first whole page it does not hold, why not, from the cache's and the store's
own records (`MissReason`). For a live cache it also says what became of the last prefetch of the request's prefix
(`PrefetchRecord`). The namespace is shown as its extra_key and salt fingerprint, never the salt, and a miss held
under other namespaces says how many, never which.

Values only (no I/O): the cache (`TieredCache.explain`), the store side (`kvcache.storage.misses`), the admin
socket, the replay driver and the CLI share them.
"""

from __future__ import annotations

import enum

import msgspec

from .namespace import NamespaceInfo
from .removals import RemovalReason
from .results import DeclineReason, DropReason


class MissReason(str, enum.Enum):
    """Why a tier does not hold a page. The string values are the `--json` words."""

    NEVER_WRITTEN = "never_written"  # no record of the page anywhere: the tier never held it
    REMOVED = "removed"  # the tier held it and removed it (`FirstMiss.removal`: why and when)
    OTHER_NAMESPACE = "other_namespace"  # not under the request's namespace; held under others of this layout
    OTHER_LAYOUT = "other_layout"  # held only under another layout (model, dtype, page size) of the store
    QUARANTINED = "quarantined"  # stored, but its bytes failed their checksum: a miss until removed
    NO_RECORD = "no_record"  # not held, and the tier's bounded record of removals has since dropped older entries


class PrefetchFate(str, enum.Enum):
    """What became of a prefetch, as the cache recorded it."""

    DECLINED = "declined"  # nothing started (`PrefetchRecord.declined` says why; below its threshold is one)
    NAMESPACE_MISMATCH = "namespace_mismatch"  # refused: the prefetch anchor is in another namespace
    IN_FLIGHT = "in_flight"  # issued, not settled yet
    COMPLETED = "completed"  # settled with every page the store reported present
    TIMED_OUT = "timed_out"  # settled by the timeout policy before every reported page arrived
    PARTIAL = "partial"  # settled (best effort, or pages left the store) with fewer pages than reported present
    CANCELLED = "cancelled"  # given back so that an admission fits (device pressure)
    DROPPED = "dropped"  # given back otherwise (`PrefetchRecord.dropped` says why: aborted, too large, ...)


class PrefetchRecord(msgspec.Struct, frozen=True):
    """The last prefetch of a prefix: how it ended. Tokens count from the request's first token."""

    fate: PrefetchFate
    at: float  # unix seconds of the last change (issue, decline, settle, give-back)
    start_tokens: int  # tokens the tree held when it was asked for: the prefetch starts here
    requested_tokens: int = 0  # tokens of the span asked from L3
    hit_tokens: int = 0  # of those, tokens the store reported present
    fetched_tokens: int = 0  # tokens that arrived in L2
    declined: DeclineReason | None = None  # fate DECLINED: why
    dropped: DropReason | None = None  # fate CANCELLED or DROPPED: why


class Removal(msgspec.Struct, frozen=True):
    """Why and when a tier removed a page (its namespace is the request's: no id is shown)."""

    reason: RemovalReason
    at: float  # unix seconds


class FirstMiss(msgspec.Struct, frozen=True):
    """The first whole page of the request a tier does not hold, and why."""

    page: int  # its index in the request (0: the first page)
    page_hash: str  # hex of its page hash (keyed by the store's secret, as KV events publish it)
    reason: MissReason
    removal: Removal | None = None  # reason REMOVED or QUARANTINED from a record: what removed it, when
    # Other namespaces of this layout that hold the request's tokens through this page in this tier (a count,
    # never which); computed whatever the reason, so a removal of a prefix also held elsewhere shows both.
    other_namespaces: int = 0
    other_layouts: int = 0  # L3: other layouts of the store holding these tokens (any namespace)
    searched: bool = True  # False when there were more namespace roots than are searched (the counts are lower bounds)


class TierExplanation(msgspec.Struct, frozen=True):
    """What one tier holds of the request."""

    matched_tokens: int  # tokens from the request's first token on that the tier holds, in whole pages
    first_miss: FirstMiss | None = None  # None: the tier holds every whole page of the request


class HitTokens(msgspec.Struct, frozen=True):
    """Tokens an admission serves from each tier (they add up): the device prefix, the host extension past it, the
    L3 pages past that. `kvc explain`: what the tiers hold now; a replay's line: what the admission served."""

    device: int = 0
    host: int = 0
    storage: int = 0


class Explanation(msgspec.Struct, frozen=True):
    """One request, tier by tier: `kvc explain --json`, and one line of `kvc replay --requests-out`."""

    namespace: NamespaceInfo  # extra_key and salt fingerprint; never the salt
    tokens: int  # of the request
    page_size: int
    hits: HitTokens
    device: TierExplanation | None  # L1 of a live cache (None offline: no cache is running)
    host: TierExplanation | None  # L2 of a live cache (None offline, without a host tier, or in buffer mode)
    storage: TierExplanation | None  # L3 (None without a store)
    prefetch: PrefetchRecord | None = None  # the last prefetch of the request's prefix (a live cache's record)
    rid: str | None = None  # the request's id (a trace's rid; a replay's request)
