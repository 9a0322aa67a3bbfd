"""Room in the pools: one tier's allocation that evicts when short, and its eviction with write-back (DESIGN §4).

A `PoolRoom` frees a tier's pages LRU first (namespaces over their share first) from nodes nobody locks, holds or
pins. Under write-back a victim without a copy in the next tier is written there before it goes: L2's victims to
L3 (`Writes.store_now`), L1's through the host mode's backups (`kvcache.engine.backups`, above the copies). Each
room is built with its write-back, so the rooms sit where their write-back puts them: L2's below the copies (a
backup takes host pages through it), L1's above the backups. What an admission does when even eviction is not
enough (wait for copies, cancel prefetch holds) is `kvcache.engine.pressure`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ..types.ids import OwnerCode
from ..types.namespace import Namespace
from ..types.removals import RemovalReason
from ..types.results import Headroom, TierRoom
from ..types.tier import Tier

if TYPE_CHECKING:
    from ..ledger.pools import SlotPool
    from ..tree import Evicted, RadixTree, TreeNode
    from ..types.config import CacheConfig
    from ..types.stats import CacheCounters
    from .recent import RecentRemovals

NodeFilter = Callable[["TreeNode"], bool]
WriteBack = Callable[["TreeNode"], None]  # writes a victim to the next tier before its copy goes


def _count_device(counters: CacheCounters, pages: int) -> None:
    counters.device_pages_evicted += pages


def _count_host(counters: CacheCounters, pages: int) -> None:
    counters.host_pages_evicted += pages


# per tier, the counter its evictions add to
_COUNT_EVICTED: dict[Tier, Callable[[CacheCounters, int], None]] = {Tier.DEVICE: _count_device,
                                                                     Tier.HOST: _count_host}


class PoolRoom:
    """Makes room in one tier's pool."""

    def __init__(self, tier: Tier, pool: SlotPool, config: CacheConfig, tree: RadixTree, counters: CacheCounters,
                 removals: RecentRemovals, write_back: WriteBack | None) -> None:
        self.tier = tier
        self.pool = pool
        self.tree = tree
        self.counters = counters
        self.removals = removals  # what each tier removed, and why (`TieredCache.explain` reads it)
        # what writes a victim to the next tier before it goes, when the write policy writes back on eviction
        self.write_back = write_back if config.backup_rule.on_evict else None
        self._evict_from = tree.evict_device if tier is Tier.DEVICE else tree.evict_host
        self._count_evicted = _COUNT_EVICTED[tier]

    def alloc(self, n: int, owner: OwnerCode, charge: Namespace | None = None) -> np.ndarray | None:
        """`n` pages for `owner`, evicting when short; the room is made for namespace `charge` (its pages over its
        share go first). None when the room is not there."""
        pool = self.pool
        pages = pool.alloc(n, owner)
        if pages is None:
            self.evict(n - pool.free_pages, charge=charge)
            pages = pool.alloc(n, owner)
        return pages

    def evict(self, n_pages: int, where: NodeFilter | None = None, write_back: bool = True,
              charge: Namespace | None = None, reason: RemovalReason = RemovalReason.CAPACITY) -> int:
        """Free at least `n_pages` pages (fewer when fewer are evictable), LRU first, from tree nodes nobody
        locks, holds or pins and that `where` accepts. Under write-back a victim is first written to the next tier
        (`write_back=False`: never, as offboarding wants). Each victim's pages are recorded removed for `reason`
        (SHARE instead for those taken because their namespace was over its share)."""
        if n_pages <= 0:
            return 0
        backup = self.write_back if write_back else None
        pool, freed, tier = self.pool, 0, self.tier
        removals, now = self.removals, time.time()

        def removed(node: TreeNode, by_share: bool) -> None:
            # The hashes the node already has (its L3 writes, its KV events computed them): hashing a page here would
            # cost a cache without a store ~1 us a page on its eviction path (a serve loop with L1/L2 churn ran 22 %
            # slower). A victim never hashed is not recorded, and the tier's record says it is not complete, so an
            # explanation says "no record", never "never written".
            hashes = node.page_hashes
            if hashes is None:
                removals.unrecorded(tier)
            else:
                removals.removed(tier, hashes, RemovalReason.SHARE if by_share else reason, now)

        victims: list[Evicted] = self._evict_from(n_pages, backup, where, charge, removed)
        for ev in victims:
            pool.free(ev.pages, ev.owner)
            freed += len(ev.pages)
        self._count_evicted(self.counters, freed)
        return freed


class Room:
    """Both tiers' rooms: eviction by tier, and where each tier's pages are."""

    def __init__(self, device: PoolRoom, host: PoolRoom | None, tree: RadixTree) -> None:
        self.device = device
        self.host = host  # None without a host tier
        self.tree = tree
        self.tiers = {Tier.DEVICE: device, **({Tier.HOST: host} if host is not None else {})}

    def evict(self, tier: Tier, n_pages: int, where: NodeFilter | None = None, write_back: bool = True,
              reason: RemovalReason = RemovalReason.CAPACITY) -> int:
        """`PoolRoom.evict` on `tier` (0 for a tier the cache does not have)."""
        room = self.tiers.get(tier)
        return room.evict(n_pages, where, write_back, reason=reason) if room is not None else 0

    def headroom(self) -> Headroom:
        """Where each tier's pages are now: free, evictable, held only by prefetches, busy."""
        t, host = self.tree, self.host
        return Headroom(_room(self.device.pool, t.device_evictable, t.device_held),
                        _room(host.pool, t.host_evictable, t.host_held) if host is not None else None)


def _room(pool: SlotPool, evictable: int, held: int) -> TierRoom:
    free = pool.free_pages
    return TierRoom(pool.num_pages, free, evictable, held, pool.num_pages - free - evictable - held)


def of_namespace(namespace: Namespace) -> NodeFilter:
    """A tree-node filter: the nodes of `namespace`."""
    ns_id = namespace.id
    return lambda node: node.namespace is not None and node.namespace.id == ns_id
