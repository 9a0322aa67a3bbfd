"""The cache's changes as KV events (`kvcache.types.events`), collected between scheduler steps.

`EventLog` turns what happens to the tree and the store into events: a node's device or host copy attached or
detached (the tree calls `copy_changed` from the two functions that set a copy — one `if` when no log is
attached), a node's pages acknowledged by the store, a namespace's pages deleted from the store, everything gone.
Splits move pages between nodes without changing which (namespace, page hash, tier) exist: no event. Page hashes
are the tree's lazily computed chain, computed here only while a log is attached.

The events wait in `pending` until `flush` hands them to the sink as one `EventBatch` — `TieredCache.poll` flushes
at the end of every call, so a feed carries one batch per scheduler step, not one message per page.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ..tree import RadixTree, Tier, TreeNode
from ..types.events import (
    MEDIUMS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    Medium,
    MediumNames,
)
from ..types.namespace import Namespace

if TYPE_CHECKING:
    from ..storage.api import L3Store

EventSink = Callable[[EventBatch], None]


class EventLog:
    """The events of one cache since the last `flush`, handed to `sink` as one batch per flush."""

    def __init__(self, tree: RadixTree, sink: EventSink, data_parallel_rank: int = 0,
                 medium_names: MediumNames = MediumNames.KVC) -> None:
        self.tree = tree
        self.sink = sink
        self.data_parallel_rank = data_parallel_rank
        self.medium: Medium = MEDIUMS[MediumNames(medium_names)]
        self._tier_medium = {Tier.DEVICE: self.medium.device, Tier.HOST: self.medium.host}
        self.pending: list[KVEvent] = []
        self.events = 0  # handed to the sink so far
        self.batches = 0
        self._names: dict[bytes, tuple[str | None, str | None]] = {}  # namespace id -> (extra_key, fingerprint)

    @classmethod
    def start(cls, tree: RadixTree, sink: EventSink, data_parallel_rank: int = 0,
              medium_names: MediumNames = MediumNames.KVC) -> EventLog:
        """A feed that has handed `sink` its first batch: cleared, then what `tree` holds now announced."""
        log = cls(tree, sink, data_parallel_rank, medium_names)
        log.announce()
        log.flush()
        return log

    # --- what the cache reports ------------------------------------------------------------------------------

    def copy_changed(self, node: TreeNode, tier: Tier, had: object, pages: object) -> None:
        """The tree set `node`'s copy in `tier` (None: no copy), having `had` before; an event when a copy came or
        went (the node is still attached either way: a node leaves the tree only after its copies)."""
        if (had is None) == (pages is None):
            return
        medium = self._tier_medium[tier]
        self.pending.append(self._stored(node, medium) if pages is not None else self._removed(node, medium))

    def stored(self, node: TreeNode) -> None:
        """The store acknowledged every page of `node` (its hashes were computed for the write)."""
        self.pending.append(self._stored(node, self.medium.storage))

    def dropped_from_store(self, namespace: Namespace, hashes: list[bytes]) -> None:
        """The cache deleted these pages of `namespace` from the store."""
        if hashes:
            extra_key, fingerprint = self._name(namespace)
            self.pending.append(BlockRemoved(hashes, self.medium.storage, extra_key, fingerprint))

    def cleared(self) -> None:
        """Everything this cache held is gone (it closed)."""
        self.pending.append(AllBlocksCleared())

    def announce(self) -> None:
        """Start a feed: clear, then every copy the tree holds now, parents first (device, host, and the pages
        the store acknowledged). Pages of the store this cache never wrote are not announced."""
        self.pending.append(AllBlocksCleared())
        for node in self.tree.nodes():
            if node.device is not None:
                self.pending.append(self._stored(node, self.medium.device))
            if node.host is not None:
                self.pending.append(self._stored(node, self.medium.host))
            if node.stored:
                self.pending.append(self._stored(node, self.medium.storage))

    def flush(self) -> int:
        """Hand the pending events to the sink as one batch (nothing when there are none). Returns how many."""
        events = self.pending
        if not events:
            return 0
        self.pending = []
        self.events += len(events)
        self.batches += 1
        self.sink(EventBatch(time.time(), events, self.data_parallel_rank))
        return len(events)

    # --- building events -------------------------------------------------------------------------------------

    def _name(self, namespace: Namespace) -> tuple[str | None, str | None]:
        name = self._names.get(namespace.id)
        if name is None:
            name = self._names[namespace.id] = (namespace.extra_key, namespace.salt_fingerprint)
        return name

    def _stored(self, node: TreeNode, medium: str) -> BlockStored:
        tree = self.tree
        parent = node.parent
        assert node.namespace is not None  # events are of nodes below a namespace root
        # (a node evicted while its L3 write was in flight is detached: no parent to name)
        chained = parent is not None and parent.parent is not None and not parent.is_namespace_root
        extra_key, fingerprint = self._name(node.namespace)
        parent_hash = tree.page_hashes(parent)[-1] if chained and parent is not None else None
        return BlockStored(list(tree.page_hashes(node)), parent_hash, np.frombuffer(node.key, dtype="<u4").tolist(),
                           tree.page_size, None, medium, None, extra_key, fingerprint)

    def _removed(self, node: TreeNode, medium: str) -> BlockRemoved:
        assert node.namespace is not None  # events are of nodes below a namespace root
        extra_key, fingerprint = self._name(node.namespace)
        return BlockRemoved(list(self.tree.page_hashes(node)), medium, extra_key, fingerprint)


def store_pages(store: "L3Store", namespace: Namespace) -> list[bytes]:
    """The hashes of every page of `namespace` in `store` under its handle's layout, walked from the namespace's
    root (before a delete: which pages it removes)."""
    out: list[bytes] = []
    stack = [store.root(namespace)]
    while stack:
        for child in store.children(stack.pop()):
            out.append(child.page_hash)
            stack.append(child.page_hash)
    return out

