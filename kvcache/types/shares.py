"""Shares: what one namespace (a tenant) may keep in each tier under pressure (DESIGN §5, §7b).

A `Shares` value names three limits, each 0 for "no share on that tier":

- `device_tokens` (L1) and `host_tokens` (L2), rounded down to whole pages. These are *shares*, not caps on free
  room: a namespace may hold more while its tier has free pages (nothing is evicted to enforce a share on an
  idle pool). When a tier must make room, the pages of namespaces over their share go first, each namespace's own
  least recently used first; only then does eviction fall back to plain LRU over every namespace. An eviction made
  for a namespace's own allocation (its admission, its backup) takes that namespace's own pages first while it
  holds, or with the allocation would hold, more than its share — so one busy tenant's traffic evicts its own
  cache before another tenant's system prompt, and its admission still succeeds.
- `store_bytes` (L3): a hard limit on the namespace's payload in the store, enforced by the store like the uniform
  `CapacityPolicy.namespace_quota_bytes` (which stays the limit of namespaces without a store share): a put over it
  evicts the namespace's own least recently used pages (LMDB) or is rejected (backends without eviction, such as
  Redis).

Shares are kept with the store's namespace registry (`L3Store.set_shares` / `L3Store.shares`), so every process on
the store sees them; a `TieredCache` reads them at open and again every `CacheConfig.shares_refresh_s`. A share
is policy, not data: it outlives the namespace's pages (dropping a namespace or its expiry keeps its share) until
it is cleared (`Shares()`, all zero).
"""

from __future__ import annotations

import msgspec

from ..errors import InvalidInput

MAX_SHARE = 1 << 62  # the largest limit a share may name (tokens or bytes): any real pool or store is smaller


class Shares(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=False):
    """One namespace's limits per tier; 0 = no share on that tier (see the module docstring)."""

    device_tokens: int = 0  # L1 tokens the namespace keeps under pressure (whole pages)
    host_tokens: int = 0  # L2 tokens likewise
    store_bytes: int = 0  # L3 payload bytes: a hard limit, enforced by the store

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value <= MAX_SHARE:
                raise InvalidInput(f"share {name} must be an integer in 0..{MAX_SHARE}, got {value!r}")

    @property
    def empty(self) -> bool:
        """No share on any tier: setting it clears the namespace's shares."""
        return not (self.device_tokens or self.host_tokens or self.store_bytes)

    def pages(self, page_size: int) -> tuple[int | None, int | None]:
        """(device, host) shares in whole pages; None where there is no share on that tier."""
        return (self.device_tokens // page_size if self.device_tokens else None,
                self.host_tokens // page_size if self.host_tokens else None)


class NamespaceShares(msgspec.Struct, frozen=True):
    """One namespace's shares as a store records them: its identity (never the salt) and the shares."""

    ns_id_hex: str  # Namespace.id_hex
    extra_key: str | None
    salt_fingerprint: str | None  # keyed by the store's fingerprint key, like its registry record
    shares: Shares
    updated: float  # unix seconds of the last set


decode_shares_record = msgspec.msgpack.Decoder(NamespaceShares).decode
