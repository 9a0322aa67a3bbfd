"""Room in the pools: allocation that evicts when short, eviction per tier, and the order in which an admission
makes room (DESIGN §4).

An admission is refused only when the room is not there: it evicts (LRU, namespaces over their share first), waits
for in-flight copies and evicts again, and only when that makes the room cancels prefetch holds, youngest first.
Under write-back a victim without a copy in the next tier is written there before it goes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ..types.ids import OwnerCode
from ..types.namespace import Namespace
from ..types.removals import RemovalReason
from ..types.request import Request
from ..types.results import AdmitStatus, CancelReason, DropReason, Headroom, TierRoom
from ..types.stats import bump
from ..types.tier import Tier
from .copies import host_only_path
from .host_mode import BackupTarget

if TYPE_CHECKING:
    from ..ledger.pools import SlotPool
    from ..tree import Evicted, RadixTree, TreeMatch, TreeNode
    from ..types.config import CacheConfig
    from ..types.stats import CacheCounters, PrefetchStats
    from .copies import Copies
    from .holders import Holders
    from .host_mode import HostModeRules
    from .prefetch import Prefetcher, PrefetchOp
    from .recent import RecentRemovals
    from .staging import StagedPrefetch
    from .writes import Writes

NodeFilter = Callable[["TreeNode"], bool]
# the counter each tier's evictions add to
_EVICTED: dict[Tier, str] = {Tier.DEVICE: "device_pages_evicted", Tier.HOST: "host_pages_evicted"}


class Room:
    """Makes room in a cache's device and host pools."""

    def __init__(self, config: CacheConfig, rules: HostModeRules, pools: dict[Tier, SlotPool], tree: RadixTree,
                 holders: Holders, counters: CacheCounters, prefetch_stats: PrefetchStats,
                 removals: RecentRemovals) -> None:
        self.config = config
        self.removals = removals  # what each tier removed, and why (`TieredCache.explain` reads it)
        self.rules = rules
        self.pools = pools  # the pools the cache has (no HOST entry without a host tier)
        self.device_pool = pools[Tier.DEVICE]
        self.tree = tree
        self.holders = holders
        self.counters = counters
        self.prefetch_stats = prefetch_stats
        self._evict_from: dict[Tier, Callable[..., list[Evicted]]] = {
            Tier.DEVICE: tree.evict_device, Tier.HOST: tree.evict_host}
        self.copies: Copies  # (wire) waiting for copies under pressure
        self.prefetcher: Prefetcher  # (wire) cancelling prefetch holds
        # (wire) per tier, what writes a victim to the next tier before it goes under write-back (None: nothing to)
        self._write_back: dict[Tier, Callable[[TreeNode], None] | None] = {}

    def wire(self, copies: Copies, writes: Writes, prefetcher: Prefetcher) -> None:
        """Hand the room the machines it calls on (built after it): write-back goes through `copies` (L1 -> L2,
        or a bounce to L3 in buffer mode) and `writes` (L2 -> L3)."""
        self.copies, self.prefetcher = copies, prefetcher
        device = {BackupTarget.TREE: copies.backup_now, BackupTarget.BOUNCE: copies.bounce_now}.get(self.rules.backup)
        self._write_back = {Tier.DEVICE: device, Tier.HOST: writes.store_now if writes.enabled else None}

    def alloc(self, tier: Tier, n: int, owner: OwnerCode, charge: Namespace | None = None) -> np.ndarray | None:
        """`n` pages of the tier's pool for `owner`, evicting when short; the room is made for namespace `charge`
        (its pages over its share go first). None when the room is not there."""
        pool = self.pools[tier]
        pages = pool.alloc(n, owner)
        if pages is None:
            self.evict(tier, n - pool.free_pages, charge=charge)
            pages = pool.alloc(n, owner)
        return pages

    def evict(self, tier: Tier, n_pages: int, where: NodeFilter | None = None, write_back: bool = True,
              charge: Namespace | None = None, reason: RemovalReason = RemovalReason.CAPACITY) -> int:
        """Free at least `n_pages` pages of the tier (fewer when fewer are evictable), LRU first, from tree nodes
        nobody locks, holds or pins and that `where` accepts. Under write-back a victim is first written to the
        next tier (`write_back=False`: never, as offboarding wants). Each victim's pages are recorded removed for
        `reason` (SHARE instead for those taken because their namespace was over its share)."""
        if n_pages <= 0:
            return 0
        backup = self._write_back[tier] if write_back and self.config.backup_rule.on_evict else None
        pool, freed = self.pools[tier], 0
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

        for ev in self._evict_from[tier](n_pages, backup, where, charge, removed):
            pool.free(ev.pages, ev.owner)
            freed += len(ev.pages)
        name = _EVICTED[tier]
        setattr(self.counters, name, getattr(self.counters, name) + freed)
        return freed

    def refuse(self, request: Request, m: TreeMatch, total_pages: int) -> AdmitStatus | None:
        """An admission short of free device pages: make the room (`for_admission`), or unlock the match's device
        node (locked by the admission) and say why not: `TOO_LARGE` (its holds are given back) or `POOL_FULL`."""
        rid = request.rid
        if total_pages > self.device_pool.num_pages:
            self.tree.unlock(m.device_node)
            self.prefetcher.drop_holds(rid, DropReason.TOO_LARGE)
            self.counters.too_large += 1
            return AdmitStatus.TOO_LARGE
        if not self.for_admission(m, total_pages, rid, request.key.namespace):
            self.tree.unlock(m.device_node)
            self.counters.refused += 1
            return AdmitStatus.POOL_FULL
        return None

    def for_admission(self, m: TreeMatch, total_pages: int, keep: str, charge: Namespace | None = None) -> bool:
        """Make room for an admission of `total_pages` pages whose device prefix is `m`'s (locked by the caller),
        in the documented order: evict; wait for in-flight copies and evict again; then, only when that makes the
        room, cancel prefetch holds youngest first. False, with nothing cancelled, when the room is not there."""
        host_nodes = host_only_path(m)
        self.tree.pin(host_nodes)  # the request's host extension survives write-back's host evictions
        try:
            return self._make_device_room(total_pages - len(m.device_pages), keep, charge)
        finally:
            for n in host_nodes:
                self.tree.unpin(n)

    def _make_device_room(self, need: int, keep: str, charge: Namespace | None = None) -> bool:
        pool = self.device_pool
        self.evict(Tier.DEVICE, need - pool.free_pages, charge=charge)
        if pool.free_pages < need and self.holders.copies:
            self.copies.complete_all()  # their pins keep pages from eviction
            self.evict(Tier.DEVICE, need - pool.free_pages, charge=charge)
        if pool.free_pages >= need:
            return True
        if pool.free_pages + self.tree.device_evictable + self.tree.device_held < need:
            return False
        return self._cancel_youngest_holds(need, keep)

    def _cancel_youngest_holds(self, n_pages: int, keep: str) -> bool:
        """Admission's last resort: cancel buffer-mode prefetch holds on the device, youngest first (never `keep`'s,
        the admitting request's own), evicting after each, until `n_pages` are free. Each is counted."""
        h = self.holders
        every: list[PrefetchOp | StagedPrefetch] = [*h.prefetches.values(), *h.staged.values()]
        holders = [x for x in every if x.hold is Tier.DEVICE and x.anchor is not None and x.rid != keep]
        holders.sort(key=lambda x: x.issued_by, reverse=True)
        pool = self.device_pool
        for holder in holders:
            self.prefetcher.drop_holds(holder.rid, DropReason.CANCELLED)
            bump(self.prefetch_stats.cancelled, CancelReason.DEVICE_PRESSURE.value)
            self.evict(Tier.DEVICE, n_pages - pool.free_pages)
            if pool.free_pages >= n_pages:
                return True
        return pool.free_pages >= n_pages

    def headroom(self) -> Headroom:
        """Where each tier's pages are now: free, evictable, held only by prefetches, busy."""
        t, host = self.tree, self.pools.get(Tier.HOST)
        return Headroom(_room(self.device_pool, t.device_evictable, t.device_held),
                        _room(host, t.host_evictable, t.host_held) if host is not None else None)


def _room(pool: SlotPool, evictable: int, held: int) -> TierRoom:
    free = pool.free_pages
    return TierRoom(pool.num_pages, free, evictable, held, pool.num_pages - free - evictable - held)


def of_namespace(namespace: Namespace) -> NodeFilter:
    """A tree-node filter: the nodes of `namespace`."""
    ns_id = namespace.id
    return lambda node: node.namespace is not None and node.namespace.id == ns_id
