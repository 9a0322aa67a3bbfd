"""The cache's changes as KV events (`kvcache.types.events`), collected between scheduler steps.

`EventLog` turns what happens to the tree and the store into events: a node's device or host copy attached or
detached (the tree calls `copy_changed` from the two functions that set a copy — one `if` when no log is
attached), pages acknowledged by the store, pages the store evicted for a write of this cache, a namespace's pages
deleted from the store, everything gone. Splits move pages between nodes without changing which (namespace, page
hash, tier) exist: no event. Page hashes are the tree's lazily computed chain, computed here only while a log is
attached.

Storage is reported per page, not per node: a write hands over the pages the store acknowledged with the parent
and tokens it put them with (a node evicted while its write was in flight keeps its true parent), and the log keeps
the set of pages it announced in storage. A page is announced there once however often it is written again, and
a removal (an eviction by the store, a dropped namespace) names only pages it announced.

The events wait in `pending` until `flush` hands them to the sink as one `EventBatch` — `TieredCache.poll` flushes
at the end of every call, so a feed carries one batch per scheduler step, not one message per page.

`EventFeed` is where a cache attaches its log, once (`TieredCache.attach_events`): the one slot the cache, its L3
writes and offboarding read, which also sets the tree's copy hook.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from ..storage.api import PageOrigin
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
from ..types.ids import NamespaceId, PageHash
from ..types.keys import TOKEN_BYTES, hash_root
from ..types.namespace import Namespace

EventSink = Callable[[EventBatch], None]


class EventFeed:
    """Where one cache's KV-event log is attached: set here alone (`attach`, `detach`), read by every part that
    reports a change (the cache's steps, L3 writes, offboarding) as `log`, None while no feed is attached. The
    tree's copy hook goes with it: the tree, below the engine, calls a plain function on every copy change (one
    test when no feed is attached), so `attach` sets that hook and `detach` clears it."""

    __slots__ = ("log", "_tree")

    def __init__(self, tree: RadixTree) -> None:
        self.log: EventLog | None = None
        self._tree = tree

    def attach(self, log: EventLog) -> None:
        """Make `log` the feed every part reports to."""
        self.log = log
        self._tree.on_copy = log.copy_changed

    def detach(self) -> EventLog | None:
        """End the feed; returns the log that was attached (None: none was)."""
        log, self.log = self.log, None
        self._tree.on_copy = None
        return log


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
        self._names: dict[NamespaceId, tuple[str | None, str | None]] = {}  # namespace id -> (extra_key, fingerprint)
        self._roots: dict[NamespaceId, PageHash] = {}  # namespace id -> the hash its chains start from (a first page's parent)
        # What the feed has announced in storage and not removed since: namespace id -> its pages (insertion
        # ordered), and page hash -> namespace id. What a removal may name, and what is never announced twice.
        self._storage: dict[NamespaceId, dict[PageHash, None]] = {}
        self._storage_ns: dict[PageHash, NamespaceId] = {}

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

    def stored_pages(self, hashes: list[PageHash], origins: list[PageOrigin]) -> None:
        """The store acknowledged these pages (a write's leading pages, in chain order, with the origins the write
        put them with: parent and tokens, so a node evicted meanwhile loses nothing). Pages this feed announced in
        storage already are not announced again; each run of the others is one `BlockStored` with its true
        parent."""
        run_h: list[PageHash] = []
        run_o: list[PageOrigin] = []
        for h, origin in zip(hashes, origins, strict=True):
            if h in self._storage_ns or (run_h and origin.parent != run_h[-1]):
                self._announce_run(run_h, run_o)
                run_h, run_o = [], []
            if h not in self._storage_ns:
                run_h.append(h)
                run_o.append(origin)
        self._announce_run(run_h, run_o)

    def removed_from_store(self, hashes: list[PageHash]) -> None:
        """These pages left the store (evicted to make room by a write of this cache): those this feed announced
        are reported removed, one `BlockRemoved` per namespace."""
        by_ns: dict[NamespaceId, list[PageHash]] = {}
        for h in hashes:
            ns_id = self._storage_ns.pop(h, None)
            if ns_id is not None:
                mine = self._storage[ns_id]
                del mine[h]
                if not mine:
                    del self._storage[ns_id]
                by_ns.setdefault(ns_id, []).append(h)
        for ns_id, gone in by_ns.items():
            self._removed_storage(ns_id, gone)

    def dropped_from_store(self, namespace: Namespace) -> None:
        """The cache deleted every page of `namespace` from the store: the pages of it this feed announced are
        reported removed (never one it did not announce)."""
        pages = self._storage.pop(namespace.id, None)
        if pages:
            for h in pages:
                del self._storage_ns[h]
            self._removed_storage(namespace.id, list(pages))

    def cleared(self) -> None:
        """Everything this cache held is gone (it closed)."""
        self.pending.append(AllBlocksCleared())
        self._forget_storage()

    def announce(self) -> None:
        """Start a feed: clear, then every copy the tree holds now, parents first (device, host, and the pages
        the store acknowledged). Pages of the store this cache never wrote are not announced."""
        self.pending.append(AllBlocksCleared())
        self._forget_storage()
        tree, step = self.tree, self.tree.page_size * TOKEN_BYTES
        for node in tree.nodes():
            if node.device is not None:
                self.pending.append(self._stored(node, self.medium.device))
            if node.host is not None:
                self.pending.append(self._stored(node, self.medium.host))
            if node.stored:
                assert node.namespace is not None  # events are of nodes below a namespace root
                hashes = tree.page_hashes(node)
                parents = [tree.chain_parent(node), *hashes[:-1]]
                self.stored_pages(hashes, [PageOrigin(node.namespace, parents[i], node.key[i * step:(i + 1) * step])
                                           for i in range(len(hashes))])

    @property
    def storage_pages(self) -> int:
        """Pages this feed has announced in storage and not removed since."""
        return len(self._storage_ns)

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
            name = self._names[namespace.id] = (namespace.extra_key, self.tree.fingerprints.fingerprint(namespace))
        return name

    def _stored(self, node: TreeNode, medium: str) -> BlockStored:
        """A device or host copy of `node` (attached: the tree reports a copy before it detaches a node)."""
        tree = self.tree
        assert node.namespace is not None  # events are of nodes below a namespace root
        parent = node.parent
        chained = parent is not None and parent.parent is not None and not parent.is_namespace_root
        extra_key, fingerprint = self._name(node.namespace)
        parent_hash = tree.page_hashes(parent)[-1] if chained and parent is not None else None
        return BlockStored(list(tree.page_hashes(node)), parent_hash, np.frombuffer(node.key, dtype="<u4").tolist(),
                           tree.page_size, None, medium, None, extra_key, fingerprint)

    def _announce_run(self, hashes: list[PageHash], origins: list[PageOrigin]) -> None:
        """One `BlockStored` in storage for a run of consecutive pages of one chain, recorded as announced."""
        if not hashes:
            return
        namespace = origins[0].namespace
        ns_id = namespace.id
        root = self._roots.get(ns_id)
        if root is None:
            root = self._roots[ns_id] = hash_root(self.tree.layout_id, namespace, self.tree.chain_key)
        parent = origins[0].parent
        extra_key, fingerprint = self._name(namespace)
        tokens = np.frombuffer(b"".join(o.tokens for o in origins), dtype="<u4").tolist()
        self.pending.append(BlockStored(list(hashes), None if parent == root else parent, tokens,
                                        self.tree.page_size, None, self.medium.storage, None, extra_key, fingerprint))
        mine = self._storage.setdefault(ns_id, {})
        for h in hashes:
            mine[h] = None
            self._storage_ns[h] = ns_id

    def _removed_storage(self, ns_id: NamespaceId, hashes: list[PageHash]) -> None:
        extra_key, fingerprint = self._names[ns_id]
        self.pending.append(BlockRemoved(hashes, self.medium.storage, extra_key, fingerprint))

    def _forget_storage(self) -> None:
        self._storage.clear()
        self._storage_ns.clear()

    def _removed(self, node: TreeNode, medium: str) -> BlockRemoved:
        assert node.namespace is not None  # events are of nodes below a namespace root
        extra_key, fingerprint = self._name(node.namespace)
        return BlockRemoved(list(self.tree.page_hashes(node)), medium, extra_key, fingerprint)
