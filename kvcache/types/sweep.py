"""The values of a capacity sweep (`kvcache.workload.sweep`): the tier sizes tried, the policies every size shares,
and the hits each size gave, per tenant and per tier."""

from __future__ import annotations

import msgspec

from .config import HostMode, PrefetchPolicy, WritePolicy
from .namespace import NamespaceInfo
from .reports import TierTokens

# The most sizes one sweep runs: each is a whole replay of the trace (a sweep of 8 x 8 sizes fits).
MAX_SWEEP_POINTS = 64


class SweepPoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One combination of tier sizes."""

    device_tokens: int  # L1 capacity in tokens (CacheConfig.device_tokens)
    host_tokens: int  # L2 capacity in tokens; 0 = no L2
    storage_bytes: int = 0  # L3 payload capacity in bytes (the store's CapacityPolicy.capacity_bytes); 0 = unlimited


class SweepPolicies(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What every size of a sweep shares: the cache's policies and the replay driver's pace. The prefetch policy is
    one that does not read the clock (a timeout would make hits depend on how fast the replay runs)."""

    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.WAIT_COMPLETE
    host_mode: HostMode = HostMode.CACHE
    batch: int = 4  # requests admitted together per scheduler step (Replayer.batch)
    lookahead: int = 8  # requests waiting behind a step, their prefetches in flight (Replayer.lookahead)


class TenantHits(msgspec.Struct):
    """One namespace's hits at one size."""

    namespace: NamespaceInfo  # extra_key and salt fingerprint: never the salt
    requests: int  # admitted (the trace's requests of this namespace less the refused)
    refused: int  # too large for L1 at this size
    tokens: int  # tokens of the admitted requests
    hit_tokens: TierTokens  # found cached at admission, per tier
    hit_rate: float  # hit_tokens.total / tokens; 0.0 without tokens


class PointResult(msgspec.Struct):
    """What one size gave: totals, then one row per namespace (in the order the trace first names them)."""

    point: SweepPoint
    requests: int
    refused: int
    tokens: int
    hit_tokens: TierTokens
    hit_rate: float
    tenants: list[TenantHits]
    storage_pages: int  # pages written to L3
    storage_rejected: int  # pages L3 refused (its capacity)
    audit_ok: bool  # the ownership audit at the end of this size's replay
    seconds: float


class SweepReport(msgspec.Struct):
    """`kvcache.workload.sweep.sweep`'s result, and `kvc sweep --json`."""

    requests: int  # in the trace
    tokens: int
    policies: SweepPolicies
    points: list[PointResult]  # in the order the sizes were given
    workers: int  # processes the sizes ran in
    seconds: float  # wall time of the whole sweep

    @property
    def ok(self) -> bool:
        """Every size's ownership audit passed."""
        return all(p.audit_ok for p in self.points)
