"""CacheConfig, the write policies and the namespace TTL policy, as data."""

from __future__ import annotations

import enum
import math

import msgspec

from ..errors import InvalidConfig
from .layout import KVLayout


class WritePolicy(str, enum.Enum):
    """When a device copy is backed up to the host tier."""

    WRITE_THROUGH = "write_through"  # at commit, every new page
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # at commit, pages matched at least N times
    WRITE_BACK = "write_back"  # at device eviction


class HostMode(str, enum.Enum):
    """What the host tier is for."""

    CACHE = "cache"  # a cache tier: prefetched pages become host-only tree nodes
    BUFFER = "buffer"  # a bounce buffer: a prefetch is parked as a staged record and spliced at admission


class PrefetchPolicy(str, enum.Enum):
    """What admission does with a prefetch still in flight."""

    BEST_EFFORT = "best_effort"  # terminate it and take the pages that have arrived
    WAIT_COMPLETE = "wait_complete"  # wait until every hit page has arrived
    TIMEOUT = "timeout"  # wait up to base + per-page budget, then take what arrived


class TTLMode(str, enum.Enum):
    """From when a namespace's time to live runs (`TTLPolicy`)."""

    SLIDING = "sliding"  # from its last use: every admit or prefetch of the namespace pushes the deadline out
    ABSOLUTE = "absolute"  # from its first use: later uses leave the deadline where it is


class TTLPolicy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """When namespaces expire (DESIGN §7b; the rules are `kvcache.engine.ttl`'s). A namespace is tracked from its
    first use (admit or prefetch); at its deadline it is dropped from L1, L2 and L3 (`TieredCache.drop_namespace`)."""

    mode: TTLMode = TTLMode.SLIDING
    default_ttl_s: float = 3600.0  # a namespace's time to live when its requests ask for none, > 0
    max_ttl_s: float = 86400.0  # a request's `ttl_s` is clamped to this, >= default_ttl_s
    max_namespaces: int = 100_000  # namespaces tracked at once; a new one beyond this expires those closest to
    # their deadline first
    sweep_interval_s: float = 1.0  # `poll` looks for expired namespaces at most this often (0: at every poll)

    def __post_init__(self) -> None:
        try:
            msgspec.structs.force_setattr(self, "mode", TTLMode(self.mode))
        except ValueError:
            raise InvalidConfig(f"ttl mode={self.mode!r} is not one of "
                                f"{', '.join(m.value for m in TTLMode)}") from None
        for name in ("default_ttl_s", "max_ttl_s", "sweep_interval_s"):  # seconds as floats, whatever was given
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidConfig(f"ttl {name}={value!r} is not a number of seconds")
            msgspec.structs.force_setattr(self, name, float(value))
        if not 0 < self.default_ttl_s < math.inf:
            raise InvalidConfig(f"ttl default_ttl_s={self.default_ttl_s} must be > 0 and finite")
        if not self.default_ttl_s <= self.max_ttl_s < math.inf:
            raise InvalidConfig(f"ttl max_ttl_s={self.max_ttl_s} must be finite and >= default_ttl_s="
                                f"{self.default_ttl_s}")
        if self.max_namespaces < 1:
            raise InvalidConfig(f"ttl max_namespaces={self.max_namespaces} must be >= 1")
        if not 0 <= self.sweep_interval_s < math.inf:
            raise InvalidConfig(f"ttl sweep_interval_s={self.sweep_interval_s} must be >= 0 and finite")

    def clamp(self, ttl_s: float | None) -> float:
        """The time to live a request asking for `ttl_s` (None: the default) gets."""
        return self.default_ttl_s if ttl_s is None else min(float(ttl_s), self.max_ttl_s)


class BackupRule(msgspec.Struct, frozen=True):
    """What a write policy does at commit and at device eviction."""

    on_commit: bool  # back up the committed path at commit
    needs_hits: bool  # ... only nodes with hits >= CacheConfig.write_through_threshold
    on_evict: bool  # back up a device-only node before its device copy is evicted


BACKUP_RULES: dict[WritePolicy, BackupRule] = {
    WritePolicy.WRITE_THROUGH: BackupRule(on_commit=True, needs_hits=False, on_evict=False),
    WritePolicy.WRITE_THROUGH_SELECTIVE: BackupRule(on_commit=True, needs_hits=True, on_evict=False),
    WritePolicy.WRITE_BACK: BackupRule(on_commit=False, needs_hits=False, on_evict=True),
}


class CacheConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Sizes and policies of one TieredCache."""

    layout: KVLayout
    device_tokens: int  # L1 capacity in tokens (rounded down to whole pages), >= one page
    host_tokens: int = 0  # L2 capacity in tokens; 0 = no host tier
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    write_through_threshold: int = 2  # hits before write_through_selective backs a node up, >= 1
    load_back_budget_tokens: int | None = None  # most tokens one admit may load back host -> device; None = any
    device: str | None = None  # torch device of L1; None = "cuda" when available, else "cpu"
    ledger: bool = True  # ownership checks on every move; False only to measure what they cost
    # --- L3 (used when the cache is given a store) ---
    host_mode: HostMode = HostMode.CACHE
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.BEST_EFFORT
    prefetch_threshold_tokens: int = 0  # a miss past the tree shorter than this starts no prefetch
    prefetch_max_host_tokens: int | None = None  # host slots all prefetches and staged records may hold at once;
    # None = the host tier
    prefetch_max_device_tokens: int | None = None  # buffer mode: device tokens that prefetch holds may keep from
    # eviction at once (the prefixes their splices extend); None = half the device tier. Admission releases holds,
    # youngest first, when a request that fits the device pool would otherwise not fit
    prefetch_timeout_ms: float = 20.0  # TIMEOUT policy: base budget ...
    prefetch_timeout_per_page_ms: float = 0.5  # ... plus this much per page asked for
    prefetch_retries: int = 2  # re-arms of a prefetch that found fewer pages than wanted
    prefetch_retry_interval_ms: float = 50.0  # pacing between attempts
    io_batch_pages: int = 64  # pages per L3 read or write batch; a prefetch can be terminated between batches
    io_thread: bool = True  # run L3 I/O on a background thread; False: run it in poll() (tests, replays)
    shares_refresh_s: float = 10.0  # re-read namespace shares from the store this often (poll); 0 = only at open
    ttl: TTLPolicy | None = None  # namespace expiry; None: namespaces never expire (only pressure evicts)

    def __post_init__(self) -> None:
        # Policies may be given by value ("write_back"); stored as the enum so every comparison is by identity.
        for name, enum_type in (("write_policy", WritePolicy), ("host_mode", HostMode),
                                ("prefetch_policy", PrefetchPolicy)):
            value = getattr(self, name)
            try:
                msgspec.structs.force_setattr(self, name, enum_type(value))
            except ValueError:
                choices = ", ".join(e.value for e in enum_type)
                raise InvalidConfig(f"{name}={value!r} is not one of {choices}") from None
        ps = self.layout.page_size
        if self.device_tokens < ps:
            raise InvalidConfig(f"device_tokens={self.device_tokens} is less than one page ({ps} tokens)")
        if self.host_tokens < 0:
            raise InvalidConfig(f"host_tokens={self.host_tokens} must be >= 0")
        if 0 < self.host_tokens < ps:
            raise InvalidConfig(f"host_tokens={self.host_tokens} is less than one page ({ps} tokens)")
        if self.write_through_threshold < 1:
            raise InvalidConfig(f"write_through_threshold={self.write_through_threshold} must be >= 1")
        if self.load_back_budget_tokens is not None and self.load_back_budget_tokens < 0:
            raise InvalidConfig(f"load_back_budget_tokens={self.load_back_budget_tokens} must be >= 0")
        if self.write_policy is WritePolicy.WRITE_BACK and self.host_tokens == 0:
            raise InvalidConfig("write_back needs a host tier (host_tokens > 0)")
        for name in ("prefetch_threshold_tokens", "prefetch_retries", "prefetch_timeout_ms",
                     "prefetch_timeout_per_page_ms", "prefetch_retry_interval_ms", "shares_refresh_s"):
            if not 0 <= getattr(self, name) < math.inf:  # nan and inf too: a wait needs a finite budget
                raise InvalidConfig(f"{name}={getattr(self, name)} must be >= 0 and finite")
        for name in ("prefetch_max_host_tokens", "prefetch_max_device_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise InvalidConfig(f"{name}={getattr(self, name)} must be >= 0")
        if self.io_batch_pages < 1:
            raise InvalidConfig(f"io_batch_pages={self.io_batch_pages} must be >= 1")
        if self.ttl is not None and not isinstance(self.ttl, TTLPolicy):
            raise InvalidConfig(f"ttl must be a TTLPolicy or None, got {type(self.ttl).__name__}")

    @property
    def device_pages(self) -> int:
        """L1 capacity in pages."""
        return self.device_tokens // self.layout.page_size

    @property
    def host_pages(self) -> int:
        """L2 capacity in pages."""
        return self.host_tokens // self.layout.page_size

    @property
    def prefetch_max_host_pages(self) -> int:
        """Host pages all prefetches may hold at once."""
        if self.prefetch_max_host_tokens is None:
            return self.host_pages
        return min(self.host_pages, self.prefetch_max_host_tokens // self.layout.page_size)

    @property
    def prefetch_max_device_pages(self) -> int:
        """Buffer mode: device pages prefetch holds may keep from eviction at once."""
        if self.prefetch_max_device_tokens is None:
            return self.device_pages // 2
        return min(self.device_pages, self.prefetch_max_device_tokens // self.layout.page_size)

    @property
    def backup_rule(self) -> BackupRule:
        """What the write policy does."""
        return BACKUP_RULES[self.write_policy]
