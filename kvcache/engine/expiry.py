"""Namespace expiry in a running cache: the TTL rules of `kvcache.engine.ttl` applied to its tiers.

An admit or prefetch is a use of its namespace; `poll` sweeps for the namespaces past their deadline and drops
them from every tier, deferring those whose running requests lock their prefix until the last of them ends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..types.namespace import Namespace
from ..types.request import Request
from ..types.results import ExpiryCause, NamespaceDrop, NamespaceExpiry
from .ttl import TTLTracker

if TYPE_CHECKING:
    from .holders import Holders


class Expiry:
    """Applies a cache's TTL policy: tells the tracker what happens and drops what it says is due."""

    def __init__(self, tracker: TTLTracker, holders: Holders, drop: Callable[[Namespace], NamespaceDrop]) -> None:
        self.tracker = tracker
        self.holders = holders
        self.drop = drop  # TieredCache.drop_namespace

    def use(self, request: Request) -> None:
        """An admit or prefetch of `request` uses its namespace: one past its deadline that no sweep has seen yet
        expires first (the use then starts from nothing); then its deadline moves, and a namespace newly tracked
        beyond the policy's bound expires the others closest to their deadline."""
        ttl, ns = self.tracker, request.key.namespace
        now = ttl.clock()
        if ttl.overdue(ns, now):
            self.expire(ns, ExpiryCause.DEADLINE)
        if ttl.use(ns, request.ttl_s, now):
            for entry in ttl.overflow(ns):
                self.expire(entry.namespace, ExpiryCause.OVERFLOW)

    def ended(self, ns: Namespace) -> None:
        """A running request of `ns` ended: when `ns`'s expiry was deferred and it was the last, the next poll
        expires it."""
        if ns.id in self.tracker.deferred and not self.holders.running(ns.id):
            self.tracker.ended(ns)

    def sweep(self) -> None:
        """poll: expire the deferred namespaces whose running requests ended, and, at most every sweep interval,
        those past their deadline."""
        ttl = self.tracker
        if ttl.ready:
            for entry in ttl.take_ready():
                self.expire(entry.namespace, entry.deferred or ExpiryCause.DEADLINE)
        now = ttl.clock()
        if ttl.sweep_due(now):
            for entry in ttl.due(now):
                self.expire(entry.namespace, ExpiryCause.DEADLINE)

    def expire(self, ns: Namespace, cause: ExpiryCause) -> NamespaceExpiry:
        """Drop `ns` from every tier, or defer that while its running requests lock their prefix."""
        running = self.holders.running(ns.id)
        fp = self.tracker.fingerprints
        if running:
            self.tracker.defer(ns, cause)
            return NamespaceExpiry(fp.info(ns), fp.display_id(ns.id), cause, False, True, running)
        drop = self.drop(ns)
        self.tracker.expired(ns, cause, drop.device_pages, drop.host_pages, drop.store_pages, drop.store_bytes)
        return NamespaceExpiry(fp.info(ns), fp.display_id(ns.id), cause, True, False, 0, drop.device_pages,
                               drop.host_pages, drop.store_pages, drop.store_bytes)
