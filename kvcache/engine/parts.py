"""The state machines of one cache, each built once and wired to the ones it hands work to.

Who hands what to whom: admission asks `room` for pages, `copies` for load-backs, `staging` for splices and
`prefetch` to settle; `room` writes victims back through `copies` (L1 -> L2) and `writes` (L2 -> L3) and cancels
prefetch holds as a last resort; a completed backup feeds `writes`; a rewritten bounce write backs up again through
`copies`; `completion` takes finished copies and L3 jobs back; `offboard` and `expiry` drop namespaces.
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
from .completion import Completion
from .copies import Copies
from .event_log import EventFeed
from .expiry import Expiry
from .host_mode import rules_for
from .io_worker import IOWorker
from .offboard import Offboard
from .prefetch import Prefetcher
from .recent import RecentPrefetches, RecentRemovals
from .room import Room
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
    """One cache's state machines, wired."""

    def __init__(self, config: CacheConfig, store: PageStore | None, device_pool: SlotPool, host_pool: SlotPool | None,
                 tree: RadixTree, holders: Holders, counters: CacheCounters, prefetch_stats: PrefetchStats,
                 backup_stats: BackupStats, clock: Callable[[], float] = time.monotonic) -> None:
        self.io = io = IOWorker(store, config.io_thread) if store is not None else None
        self.rules = rules = rules_for(config.host_mode, host_pool is not None, store is not None)
        pools = {Tier.DEVICE: device_pool, **({Tier.HOST: host_pool} if host_pool is not None else {})}
        # what explains a miss later (`TieredCache.explain`): the pages each tier removed, the prefetches' ends
        self.removals, self.prefetches = RecentRemovals(), RecentPrefetches()
        self.room = room = Room(config, rules, pools, tree, holders, counters, prefetch_stats, self.removals)
        # the bytes under every L1 <-> L2 move, on a stream of its own on a GPU
        self.copier = copier = Copier(device_pool, host_pool)
        self.copies = copies = Copies(config, rules, copier, tree, holders, counters, backup_stats)
        # the KV-event log, attached in this one place (TieredCache.attach_events) and read by the parts that report
        self.events = events = EventFeed(tree)
        self.writes = writes = Writes(config, host_pool, tree, holders, io, backup_stats, events)
        self.staging = staging = Staging(copier, tree, holders, prefetch_stats)
        self.prefetcher = prefetcher = Prefetcher(config, rules, tree, host_pool, holders, io, prefetch_stats,
                                                  self.prefetches)
        self.shares = shares = AppliedShares(config, store, tree, counters)
        self.completion = completion = Completion(holders, copies, writes, prefetcher, io, shares)
        self.offboard = offboard = Offboard(room, prefetcher, completion, holders, store, writes, tree, events)
        # an expiry drops its namespace as offboarding does, its pages recorded removed for their time to live
        expire = functools.partial(offboard.drop, reason=RemovalReason.TTL)
        tracker = TTLTracker(config.ttl, clock, fingerprints=tree.fingerprints) if config.ttl is not None else None
        self.expiry = Expiry(tracker, holders, expire) if tracker is not None else None
        # the request lifecycle on top: it calls down into the machines above, none of which calls it
        self.admissions = Admissions(config, tree, device_pool, holders, counters, room, copies, staging, prefetcher,
                                     self.expiry, rules.backs_up)
        room.wire(copies, writes, prefetcher)
        copies.room, copies.writes, copies.flush = room, writes, completion.flush
        writes.copies = copies
        staging.room = room
        prefetcher.room, prefetcher.staging, prefetcher.expiry = room, staging, self.expiry
        prefetcher.take_io_jobs = completion.take_io_jobs
        tree.on_split = copies.on_split
