"""CacheConfig and the write policies, as data."""

from __future__ import annotations

import enum

import msgspec

from .errors import InvalidConfig
from .layout import KVLayout


class WritePolicy(str, enum.Enum):
    """When a device copy is backed up to the host tier."""

    WRITE_THROUGH = "write_through"  # at commit, every new page
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # at commit, pages matched at least N times
    WRITE_BACK = "write_back"  # at device eviction


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

    def __post_init__(self) -> None:
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

    @property
    def device_pages(self) -> int:
        """L1 capacity in pages."""
        return self.device_tokens // self.layout.page_size

    @property
    def host_pages(self) -> int:
        """L2 capacity in pages."""
        return self.host_tokens // self.layout.page_size

    @property
    def backup_rule(self) -> BackupRule:
        """What the write policy does."""
        return BACKUP_RULES[self.write_policy]
