"""Eviction's loop, for either tier: take a tier's copies from its victims, least recently used first, until enough
pages are free. `RadixTree.evict_device` and `evict_host` are the entry points; the book (`kvcache.tree.books`)
says what a victim of the tier is, and `kvcache.tree.shares` which namespaces give pages first.

Package-internal: it moves copies and deletes nodes through the tree's own `_set_copy` and `_delete`, so the books
stay exact exactly as for any other move.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING

from ..types.namespace import Namespace
from .books import TierBook
from .node import Evicted, TreeNode
from .shares import eviction_order

if TYPE_CHECKING:
    from .radix import RadixTree

# Told of each victim of an eviction before its copy goes (the node still attached, so its page hashes can be
# named): removed(node, by_share), by_share True when it went because its namespace was over its share.
Removed = Callable[[TreeNode, bool], None]


def evict(tree: RadixTree, book: TierBook, n_pages: int, backup: Callable[[TreeNode], None] | None,
          where: Callable[[TreeNode], bool] | None, charge: Namespace | None,
          removed: Removed | None = None) -> list[Evicted]:
    """Detach copies of `book`'s tier of at least `n_pages` pages (when that many are evictable): with shares set
    (and no `where`), first from the namespaces over their share of the tier in `eviction_order`, each from its own
    LRU heap; then plain LRU. What `backup`, `where`, `charge` and `removed` mean: `RadixTree.evict_device`."""
    out: list[Evicted] = []
    freed = 0
    shares = tree._shares
    if shares and where is None:
        own = shares.get(charge.id) if charge is not None else None
        for excess, state in eviction_order(shares.values(), book.index, own, n_pages):
            victims = book.victims(tree._by_id, state)
            freed += _drain(tree, book, victims, min(excess, n_pages - freed), backup, None, out, removed, True)
            if freed >= n_pages:
                break
    if freed < n_pages:
        _drain(tree, book, book.victims(tree._by_id), n_pages - freed, backup, where, out, removed, False)
    return out


def _drain(tree: RadixTree, book: TierBook, victims: Generator[TreeNode, None, None], n_pages: int,
           backup: Callable[[TreeNode], None] | None, where: Callable[[TreeNode], bool] | None,
           out: list[Evicted], removed: Removed | None, by_share: bool) -> int:
    """The loop over one stream of victims: pages freed (appended to `out`). A victim left with no copy in any tier
    is deleted. `removed(node, by_share)` is told of each victim while it is still attached."""
    freed = 0
    try:
        for node in victims:
            if where is not None and not where(node):
                continue
            if backup is not None and book.needs_backup(node):
                backup(node)
                if not book.victim(node):  # the backup's own work may have changed the node
                    continue
            if removed is not None:
                removed(node, by_share)
            pages = tree._set_copy(book, node, None)
            out.append(Evicted(node.owner, pages))  # type: ignore[arg-type]  # a victim has a copy in the tier
            freed += len(pages)  # type: ignore[arg-type]  # a victim has a copy in the tier
            if node.device is None and node.host is None:
                tree._delete(node)
            if freed >= n_pages:
                break
    finally:
        victims.close()  # its `finally` gives back the entries of nodes not taken
    return freed
