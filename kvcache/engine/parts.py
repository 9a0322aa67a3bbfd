"""The parts of one cache, each built once, in its constructor, from the parts below it: a tree of calls that
never points back up.

From the bottom: the registry of holders, the I/O worker and the KV-event feed; the movers — L2 -> L3 `writes`,
the L1 <-> L2 `copies` (a finished backup lands where the host mode's `landing` says) — which take the pages they
are handed; L2's room (its write-back is an L3 write); the host mode's `backups` (after a commit, on write-back,
writing a path again: host pages from L2's room, the bytes through the copies); L1's room (its write-back is a
backup); `staging` and the `prefetcher` (their pages come from the rooms); `completion` (what
finished goes back to the part that issued it); `offboard` and `expiry` (a namespace dropped from every tier); and
on top `pressure`, the prefetch's `settlement` and `admissions`, the request lifecycle.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..ledger.copy import Copier
from ..types.removals import RemovalReason
from ..types.tier import Tier
from .admission import Admissions
from .backups import BACKUPS
from .completion import Completion
from .copies import Copies
from .event_log import EventFeed
from .expiry import Expiry
from .host_mode import rules_for
from .io_worker import IOWorker
from .landing import landing_for
from .offboard import Offboard
from .prefetch import Prefetcher
from .pressure import Pressure
from .recent import RecentPrefetches, RecentRemovals
from .room import PoolRoom, Room
from .settlement import Settlement
from .shares import AppliedShares
from .staging import Staging
from .ttl import TTLTracker
from .writes import Writes

if TYPE_CHECKING:
    from ..ledger.pools import SlotPool
    from ..storage.api import PageStore
    from ..tree import RadixTree
    from ..types.config import CacheConfig
    from ..types.stats import BackupStats, CacheCounters, PrefetchStats
    from .holders import Holders


class Parts:
    """One cache's parts, built bottom up."""

    def __init__(self, config: CacheConfig, store: PageStore | None, device_pool: SlotPool, host_pool: SlotPool | None,
                 tree: RadixTree, holders: Holders, counters: CacheCounters, prefetch_stats: PrefetchStats,
                 backup_stats: BackupStats, clock: Callable[[], float] = time.monotonic) -> None:
        self.io = io = IOWorker(store, config.io_thread) if store is not None else None
        self.rules = rules = rules_for(config.host_mode, host_pool is not None, store is not None)
        # what explains a miss later (`TieredCache.explain`): the pages each tier removed, the prefetches' ends
        self.removals = removals = RecentRemovals()
        self.prefetches = RecentPrefetches()
        # the KV-event log, attached in this one place (TieredCache.attach_events) and read by the parts that report
        self.events = events = EventFeed(tree)
        self.writes = writes = Writes(config, host_pool, tree, holders, io, backup_stats, events)
        # the bytes under every L1 <-> L2 move, on a stream of its own on a GPU
        self.copier = copier = Copier(device_pool, host_pool)
        landing = landing_for(rules.backup, tree, writes, config)
        self.copies = copies = Copies(config, landing, copier, tree, holders, counters, backup_stats)
        host_room = None
        if host_pool is not None:
            host_room = PoolRoom(Tier.HOST, host_pool, config, tree, counters, removals,
                                 writes.store_now if writes.enabled else None)
        self.backups = backups = BACKUPS[rules.backup](config, copies, writes, host_room, holders, counters)
        device_room = PoolRoom(Tier.DEVICE, device_pool, config, tree, counters, removals, backups.write_back)
        self.room = Room(device_room, host_room, tree)
        self.staging = staging = Staging(copies, tree, holders, prefetch_stats, device_room)
        self.prefetcher = prefetcher = Prefetcher(config, rules, tree, host_pool, holders, io, prefetch_stats,
                                                  self.prefetches, host_room, staging)
        self.shares = shares = AppliedShares(config, store, tree, counters)
        self.completion = completion = Completion(holders, copies, writes, backups, prefetcher, io, shares)
        self.offboard = offboard = Offboard(self.room, prefetcher, completion, holders, store, writes, tree, events)
        # an expiry drops its namespace as offboarding does, its pages recorded removed for their time to live
        expire = functools.partial(offboard.drop, reason=RemovalReason.TTL)
        tracker = TTLTracker(config.ttl, clock, fingerprints=tree.fingerprints) if config.ttl is not None else None
        self.expiry = Expiry(tracker, holders, expire) if tracker is not None else None
        # the request lifecycle on top: it calls down into the parts above, none of which calls it
        self.settlement = settlement = Settlement(prefetcher, completion, holders, tree, self.expiry)
        pressure = Pressure(device_room, copies, prefetcher, tree, holders, counters, prefetch_stats)
        self.admissions = Admissions(config, tree, device_room, holders, counters, pressure, copies, backups, staging,
                                     prefetcher, settlement, self.expiry, rules.backs_up)
