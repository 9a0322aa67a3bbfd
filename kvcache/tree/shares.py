"""Namespace shares inside the tree: each namespace's use of each tier against its share, and the order in which
eviction takes namespaces over their share (DESIGN §5, `kvcache.types.shares` for the policy).

A `ShareState` has one `ShareTier` per tier, in the order of the tree's books (`TierBook.index`: device 0, host 1),
so the tree's one copy move updates `state.tiers[book.index]` whichever tier it moves.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..types.ids import NamespaceId
from ..types.tier import Tier
from .books import ID_BITS, TierBook

if TYPE_CHECKING:
    from .node import TreeNode

_INDEX = {Tier.DEVICE: 0, Tier.HOST: 1}  # a tier's row in ShareState.tiers (== its TierBook.index)


class ShareTier:
    """One namespace's share of one tier and its use of it, in pages, with its own lazy LRU heap of the namespace's
    eviction candidates in that tier (entries as in the tree's heaps, `kvcache.tree.books`): taking a namespace's
    pages over its share pops from this heap and never scans the tree's."""

    __slots__ = ("limit", "used", "lru")

    def __init__(self, limit: int | None) -> None:
        self.limit = limit  # pages; None = no share on this tier (the heap then stays empty)
        self.used = 0  # pages of this tier's copies the namespace's nodes hold (>= 0), kept by every copy move
        self.lru: list[int] = []

    def over(self, incoming: int = 0) -> int:
        """Pages the namespace holds over its share, counting `incoming` pages about to be its own (0 without a
        share)."""
        if self.limit is None:
            return 0
        return max(0, self.used + incoming - self.limit)


class ShareState:
    """One namespace's shares in the tree (`RadixTree.set_share`): a `ShareTier` per tier, kept exact by every copy
    move."""

    __slots__ = ("ns_id", "label", "tiers")

    def __init__(self, ns_id: NamespaceId, label: str, device_limit: int | None, host_limit: int | None) -> None:
        self.ns_id = ns_id  # Namespace.id (a share may come from a store, which knows no salt)
        self.label = label  # for messages: extra_key/salt fingerprint
        self.tiers = (ShareTier(device_limit), ShareTier(host_limit))  # indexed by TierBook.index

    def tier(self, tier: Tier) -> ShareTier:
        """The namespace's share of `tier` and its use of it."""
        return self.tiers[_INDEX[tier]]

    def over(self, tier: Tier, incoming: int = 0) -> int:
        """Pages the namespace holds over its share of `tier`, counting `incoming` pages about to be its own (0
        without a share there)."""
        return self.tiers[_INDEX[tier]].over(incoming)

    @property
    def device_limit(self) -> int | None:
        """The share of L1 in pages (None: no share there)."""
        return self.tiers[0].limit

    @property
    def host_limit(self) -> int | None:
        """The share of L2 in pages (None: no share there)."""
        return self.tiers[1].limit

    @property
    def device_used(self) -> int:
        """Pages of device copies the namespace's nodes hold."""
        return self.tiers[0].used

    @property
    def host_used(self) -> int:
        """Pages of host copies the namespace's nodes hold."""
        return self.tiers[1].used

    def push(self, index: int, entry: int) -> bool:
        """Give a node of the namespace an entry in the heap of tier `index` (when it has a share there). True when
        the heaps outgrew what the namespace caches: heaps nothing pops (a namespace within its share) are then
        rebuilt by the caller (`rebuild`), so they stay bounded."""
        tier = self.tiers[index]
        if tier.limit is not None:
            heapq.heappush(tier.lru, entry)
        device, host = self.tiers
        return len(device.lru) + len(host.lru) > 4 * (device.used + host.used) + 1024

    def rebuild(self, nodes: list[TreeNode], books: Iterable[TierBook]) -> None:
        """The heaps, fresh from the namespace's `nodes`: one entry per eviction candidate of each tier with a
        share."""
        for book in books:
            tier, is_leaf = self.tiers[book.index], book.is_leaf
            tier.lru[:] = ([n.last_access << ID_BITS | n.id for n in nodes if is_leaf(n)]
                           if tier.limit is not None else [])
            heapq.heapify(tier.lru)


def eviction_order(shares: Iterable[ShareState], index: int, charge: ShareState | None,
                   n_pages: int) -> list[tuple[int, ShareState]]:
    """Which namespaces an eviction of `n_pages` pages from tier `index` takes pages from before plain LRU, and how
    many from each, in order: `charge` (the namespace the room is made for) first while it holds, or with the
    `n_pages` would hold, more than its share; then every other namespace over its share, most over first."""
    over = sorted(((st.tiers[index].over(), st) for st in shares if st is not charge and st.tiers[index].over()),
                  key=lambda x: -x[0])
    if charge is not None:
        own = charge.tiers[index].over(n_pages)
        if own:
            over.insert(0, (min(own, n_pages), charge))
    return over
