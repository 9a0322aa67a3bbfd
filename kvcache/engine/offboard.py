"""Offboarding a namespace: every tier let go of its pages, without writing any of them back (DESIGN §5).

A drop gives back the namespace's prefetches and staged records, lets the copies and L3 writes in flight land,
frees its L1 and L2 pages with no write-back, then deletes it from L3. The result is the same whichever of the
cache and the store was dropped first. Pages that running requests of the namespace lock stay until they end; they
are no longer marked stored (the next write of their path puts them again), and the KV-event feed reports removed
from storage exactly the namespace's pages it had announced there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..types.namespace import Namespace
from ..types.removals import RemovalReason
from ..types.results import DropReason, EvictResult, NamespaceDrop
from .room import of_namespace

if TYPE_CHECKING:
    from ..storage.api import PageStore
    from ..tree import RadixTree
    from .completion import Completion
    from .event_log import EventFeed
    from .holders import Holders
    from .prefetch import Prefetcher
    from .room import Room
    from .writes import Writes


class Offboard:
    """Evicts or drops one namespace from a cache's tiers."""

    def __init__(self, room: Room, prefetcher: Prefetcher, completion: Completion, holders: Holders,
                 store: PageStore | None, writes: Writes, tree: RadixTree, events: EventFeed) -> None:
        self.room = room
        self.writes = writes
        self.tree = tree
        self.prefetcher = prefetcher
        self.completion = completion
        self.holders = holders
        self.store = store
        self.events = events  # the KV-event feed: its log, while one is attached

    def evict(self, namespace: Namespace, device: bool, host: bool, write_back: bool = True,
              reason: RemovalReason = RemovalReason.EVICT) -> EvictResult:
        """Free what `namespace` holds in L1 and L2 that nobody locks, holds or pins (written back first under
        write-back unless `write_back` is False), recorded removed for `reason`."""
        mine, room = of_namespace(namespace), self.room
        d = room.device.evict(room.device.pool.num_pages, mine, write_back, reason=reason) if device else 0
        host_room = room.host
        h = (host_room.evict(host_room.pool.num_pages, mine, write_back, reason=reason)
             if host and host_room is not None else 0)
        return EvictResult(d, h)

    def drop(self, namespace: Namespace, reason: RemovalReason = RemovalReason.DROP) -> NamespaceDrop:
        """Offboard `namespace` from every tier (see the module docstring); its pages are recorded removed for
        `reason` (DROP, or TTL for an expiry)."""
        ns_id, holders = namespace.id, self.holders
        held = [rid for rid, op in holders.prefetches.items() if op.namespace.id == ns_id]
        held += [rid for rid, staged in holders.staged.items() if staged.key.namespace.id == ns_id]
        for rid in held:
            self.prefetcher.drop_holds(rid, DropReason.ABORTED)
        self.completion.flush()  # a write still in flight would land after the delete below
        events = self.events.log
        if events is not None:
            events.flush()
        freed = self.evict(namespace, True, True, write_back=False, reason=reason)
        store = self.store
        deleted = store.delete_namespace(ns_id, reason) if store is not None else None
        if store is not None:
            # What running requests lock stays in the tree, no longer in L3: its next write puts it again, and
            # nothing of the namespace is retried on its own.
            self.writes.forget(ns_id)
            self.tree.unstore_namespace(ns_id)
            if events is not None:
                events.dropped_from_store(namespace)  # the pages it announced, and only those
        fp = self.tree.fingerprints
        return NamespaceDrop(fp.info(namespace), fp.display_id(ns_id), freed.device_pages, freed.host_pages,
                             deleted.pages if deleted else 0, deleted.bytes if deleted else 0,
                             holders.running(ns_id))
