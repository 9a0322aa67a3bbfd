"""An admission short of device pages: the order in which the room is made, or refused (DESIGN §4).

An admission is refused only when the room is not there: it evicts (LRU, namespaces over their share first), waits
for in-flight copies and evicts again, and only when that makes the room cancels buffer-mode prefetch holds on the
device, youngest first, never the admitting request's own. A request larger than the whole pool is `TOO_LARGE`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..types.namespace import Namespace
from ..types.request import Request
from ..types.results import AdmitStatus, CancelReason, DropReason
from ..types.stats import bump
from ..types.tier import Tier
from .transfer import host_only_path

if TYPE_CHECKING:
    from ..tree import RadixTree, TreeMatch
    from ..types.stats import CacheCounters, PrefetchStats
    from .copies import Copies
    from .holders import Holders
    from .operation import AnchorHolder
    from .prefetch import Prefetcher
    from .room import PoolRoom


class Pressure:
    """Makes device room for one cache's admissions, in the documented order."""

    def __init__(self, device_room: PoolRoom, copies: Copies, prefetcher: Prefetcher, tree: RadixTree,
                 holders: Holders, counters: CacheCounters, prefetch_stats: PrefetchStats) -> None:
        self.device_room = device_room
        self.device_pool = device_room.pool
        self.copies = copies  # waited for: their pins keep pages from eviction
        self.prefetcher = prefetcher  # its holds are cancelled as a last resort
        self.tree = tree
        self.holders = holders
        self.counters = counters
        self.prefetch_stats = prefetch_stats

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
        pool, room = self.device_pool, self.device_room
        room.evict(need - pool.free_pages, charge=charge)
        if pool.free_pages < need and self.holders.copies:
            self.copies.complete_all()  # their pins keep pages from eviction
            room.evict(need - pool.free_pages, charge=charge)
        if pool.free_pages >= need:
            return True
        if pool.free_pages + self.tree.device_evictable + self.tree.device_held < need:
            return False
        return self._cancel_youngest_holds(need, keep)

    def _cancel_youngest_holds(self, n_pages: int, keep: str) -> bool:
        """Admission's last resort: cancel buffer-mode prefetch holds on the device, youngest first (never `keep`'s,
        the admitting request's own), evicting after each, until `n_pages` are free. Each is counted."""
        h = self.holders
        every: list[AnchorHolder] = [*h.prefetches.values(), *h.staged.values()]
        holders = [x for x in every if x.hold is Tier.DEVICE and x.anchor is not None and x.rid != keep]
        holders.sort(key=lambda x: x.issued_by, reverse=True)
        pool = self.device_pool
        for holder in holders:
            self.prefetcher.drop_holds(holder.rid, DropReason.CANCELLED)
            bump(self.prefetch_stats.cancelled, CancelReason.DEVICE_PRESSURE.value)
            self.device_room.evict(n_pages - pool.free_pages)
            if pool.free_pages >= n_pages:
                return True
        return pool.free_pages >= n_pages
