"""The tree's books, one per tier: the tier's pages in three exact classes and its lazy LRU heap of eviction
candidates.

Classes. Every page of a tier held by a tree node is in exactly one: *protected* (its node is locked by a running
request), *held* (not locked, held on this tier by a prefetch or a staged record), *evictable* (neither; an in-flight
copy may still pin it for a while). The cache reads them for headroom (`TieredCache.headroom`) and the audit
recomputes them; the tree moves pages between them on every copy, lock and hold change.

Heap. Eviction finds a tier's victims only through its heap, least recently used first. Entries are plain ints,
``last_access << ID_BITS | id``: a heap of ints compares in C without a tuple per entry (several times faster at a
million entries, and nothing for the GC). Entries are never updated in place (hence "lazy"): a node is *offered*
(given an entry) when it may have become a candidate — a copy set, a child's copy gone, its last lock, hold or pin
gone — and `TierBook.victims` drops or refreshes the entries that no longer say the truth.

One book describes its tier completely — which of a node's fields hold its copy, holds and children count, and the
predicates that say whether a node is a leaf of the tier, busy in it, or in need of a backup before its copy goes —
so the tree moves copies and holds of either tier through one code path (`RadixTree._set_copy`, `hold`,
`release`, `evict`), parameterised by the book. `TierBook` is abstract; `DeviceBook` and `HostBook` read and write
their tier's node fields (`node.device`, `node.device_holds`, `node.children_on_device` and the host twins) as
plain attribute accesses in typed methods, so a type checker follows every access and no field is named by a
string. The predicates are plain functions stored on the book, not methods: calling one costs what calling a
module function costs, no bound-method object per call.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING

from ..types.ids import NodeId
from ..types.tier import Tier

if TYPE_CHECKING:
    import numpy as np

    from .node import TreeNode
    from .shares import ShareState

ID_BITS = 48  # node ids stay below 2**48 (they are ledger owner ids too): the low bits of a heap entry
ID_MASK = (1 << ID_BITS) - 1

NodeTest = Callable[["TreeNode"], bool]


def lru_entry(node: TreeNode) -> int:
    """`node`'s LRU heap entry as of now (hot paths inline the expression)."""
    return node.last_access << ID_BITS | node.id


def device_leaf(node: TreeNode) -> bool:
    """Has a device copy and no child has one (device copies form a prefix: only leaves can go)."""
    return (node.device is not None and not node.children_on_device and node.parent is not None
            and node.parent.parent is not None)


def host_leaf(node: TreeNode) -> bool:
    """Has only a host copy and no child has one (a host copy goes only once the device copy has gone)."""
    return (node.host is not None and node.device is None and not node.children_on_host and node.parent is not None
            and node.parent.parent is not None)


def device_busy(node: TreeNode) -> bool:
    """The device copy may not go now: locked, held on the device, or pinned by an in-flight copy."""
    return bool(node.lock_ref or node.device_holds or node.pins)


def host_busy(node: TreeNode) -> bool:
    """The host copy may not go now: locked, held on the host, pinned, or read by an in-flight L3 write."""
    return bool(node.lock_ref or node.host_holds or node.pins or node.host_pins)


def device_unbacked(node: TreeNode) -> bool:
    """Losing the device copy would lose the KV: there is no host copy (write-back backs it up first)."""
    return node.host is None


def host_unstored(node: TreeNode) -> bool:
    """Losing the host copy would lose the KV: L3 has not acknowledged it (write-back stores it first)."""
    return not node.stored


class TierBook(ABC):
    """One tier's books: its page counts per class, its LRU heap, and what a node's fields mean for the tier. The
    node field accessors are the concrete books' (`DeviceBook`, `HostBook`): one per tier, picked by `new_books`."""

    __slots__ = ("tier", "index", "is_leaf", "is_busy", "needs_backup", "unblocks", "protected", "held", "evictable",
                 "lru")

    def __init__(self, tier: Tier, index: int, is_leaf: NodeTest, is_busy: NodeTest, needs_backup: NodeTest) -> None:
        self.tier = tier
        self.index = index  # the tier's row in ShareState.tiers (device 0, host 1)
        self.is_leaf = is_leaf  # a candidate of this tier when not busy
        self.is_busy = is_busy  # locked, held or pinned for this tier
        self.needs_backup = needs_backup  # evicting the copy would lose the KV without a backup first
        # The book whose leaves this tier's copy keeps out: a node is a host leaf only without a device copy, so the
        # device book's copy going offers the node to the host heap. None for the host book.
        self.unblocks: TierBook | None = None
        self.protected = 0  # pages of locked nodes (>= 0)
        self.held = 0  # pages of nodes held on this tier and not locked (>= 0)
        self.evictable = 0  # pages of nodes neither locked nor held on this tier (>= 0; pins aside)
        self.lru: list[int] = []  # lazy LRU heap of entries ``last_access << ID_BITS | id`` (module docstring)

    # --- the tier's node fields (written by the tree package only: kvcache.tree.node) ---------------------------

    @abstractmethod
    def copy(self, node: TreeNode) -> np.ndarray | None:
        """`node`'s copy in this tier: its page indices, None without one."""

    @abstractmethod
    def swap_copy(self, node: TreeNode, pages: np.ndarray | None) -> np.ndarray | None:
        """Make `pages` `node`'s copy in this tier (None: take it away) and return the copy it had. The field alone:
        the counts and heaps that follow are `RadixTree._set_copy`'s."""

    @abstractmethod
    def holds(self, node: TreeNode) -> int:
        """The holds on `node`'s path in this tier (`RadixTree.hold`)."""

    @abstractmethod
    def add_holds(self, node: TreeNode, delta: int) -> int:
        """Add `delta` to `node`'s holds in this tier and return the new count."""

    @abstractmethod
    def children(self, node: TreeNode) -> int:
        """How many of `node`'s children have a copy in this tier."""

    @abstractmethod
    def add_children(self, node: TreeNode, delta: int) -> int:
        """Add `delta` to `node`'s count of children with a copy in this tier and return the new count."""

    def victim(self, node: TreeNode) -> bool:
        """Could `node`'s copy in this tier go now (a leaf of the tier, not busy)?"""
        return self.is_leaf(node) and not self.is_busy(node)

    def victims(self, by_id: dict[NodeId, TreeNode], share: ShareState | None = None) -> Generator[TreeNode, None, None]:
        """This tier's evictable nodes, least recently used first, from its lazy LRU heap (`share`: from that
        namespace's heap of the tier, its nodes only). `by_id` is the tree's index of its nodes below the namespace
        roots, which heap entries name.

        An entry whose node was used since it was pushed is pushed again with the new time; one whose node is gone
        or no longer a leaf of the tier is dropped (the node is offered again when it becomes one), and so is a busy
        one (offered again when its last lock, hold or pin goes). A node the consumer did not take after all (it is
        still a leaf when the consumer asks for the next) gets its entry back when the stream is closed.
        """
        if share is None:
            heap, is_leaf = self.lru, self.is_leaf
        else:
            heap, leaf = share.tiers[self.index].lru, self.is_leaf
            def is_leaf(n: TreeNode) -> bool:  # the share's own nodes only
                return n.share is share and leaf(n)
        is_busy = self.is_busy
        if len(heap) > 4 * len(by_id) + 1024:  # stale entries pile up under churn: rebuild from the tree
            heap[:] = [n.last_access << ID_BITS | n.id for n in by_id.values() if is_leaf(n)]
            heapq.heapify(heap)
        kept = []
        pop, push = heapq.heappop, heapq.heappush
        try:
            while heap:
                entry = pop(heap)
                node = by_id.get(entry & ID_MASK)  # type: ignore[call-overload]  # the low bits: a NodeId
                if node is None or not is_leaf(node):
                    continue  # deleted, or not a leaf of this tier now: offered again when it becomes one
                if entry >> ID_BITS != node.last_access:
                    push(heap, node.last_access << ID_BITS | node.id)
                    continue
                if is_busy(node):
                    continue  # offered again when its last lock, hold or pin goes (unlock, release, unpin)
                yield node
                if node.parent is not None and is_leaf(node):
                    kept.append(node.last_access << ID_BITS | node.id)  # still there: not evicted after all
        finally:
            for entry in kept:
                push(heap, entry)

    def __repr__(self) -> str:
        return (f"TierBook({self.tier.value}: protected={self.protected} held={self.held} "
                f"evictable={self.evictable} heap={len(self.lru)})")


class DeviceBook(TierBook):
    """The device tier's (L1) books: a node's `device`, `device_holds` and `children_on_device`."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(Tier.DEVICE, 0, device_leaf, device_busy, device_unbacked)

    def copy(self, node: TreeNode) -> np.ndarray | None:
        """`node.device`."""
        return node.device

    def swap_copy(self, node: TreeNode, pages: np.ndarray | None) -> np.ndarray | None:
        """Set `node.device`, returning the copy it had."""
        had, node.device = node.device, pages
        return had

    def holds(self, node: TreeNode) -> int:
        """`node.device_holds`."""
        return node.device_holds

    def add_holds(self, node: TreeNode, delta: int) -> int:
        """Add to `node.device_holds`, returning the new count."""
        node.device_holds = n = node.device_holds + delta
        return n

    def children(self, node: TreeNode) -> int:
        """`node.children_on_device`."""
        return node.children_on_device

    def add_children(self, node: TreeNode, delta: int) -> int:
        """Add to `node.children_on_device`, returning the new count."""
        node.children_on_device = n = node.children_on_device + delta
        return n


class HostBook(TierBook):
    """The host tier's (L2) books: a node's `host`, `host_holds` and `children_on_host`."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(Tier.HOST, 1, host_leaf, host_busy, host_unstored)

    def copy(self, node: TreeNode) -> np.ndarray | None:
        """`node.host`."""
        return node.host

    def swap_copy(self, node: TreeNode, pages: np.ndarray | None) -> np.ndarray | None:
        """Set `node.host`, returning the copy it had."""
        had, node.host = node.host, pages
        return had

    def holds(self, node: TreeNode) -> int:
        """`node.host_holds`."""
        return node.host_holds

    def add_holds(self, node: TreeNode, delta: int) -> int:
        """Add to `node.host_holds`, returning the new count."""
        node.host_holds = n = node.host_holds + delta
        return n

    def children(self, node: TreeNode) -> int:
        """`node.children_on_host`."""
        return node.children_on_host

    def add_children(self, node: TreeNode, delta: int) -> int:
        """Add to `node.children_on_host`, returning the new count."""
        node.children_on_host = n = node.children_on_host + delta
        return n


def new_books() -> tuple[DeviceBook, HostBook]:
    """A tree's two books, device then host (their `index` order), linked as the tiers' leaves depend."""
    device, host = DeviceBook(), HostBook()
    device.unblocks = host
    return device, host
