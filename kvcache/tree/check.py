"""`RadixTree.check`: recount from the nodes what the tree keeps incrementally and name the first record that
differs. Slow (a walk of the whole tree); tests and the stateful property test call it after every step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import InvariantViolation
from .books import ID_MASK

if TYPE_CHECKING:
    from .radix import RadixTree


def check_tree(tree: RadixTree) -> None:
    """Recount each node's children holding a copy per tier, the node count, each tier's pages per class, each
    share's use of each tier, the stored-page index, and look for an LRU entry for every evictable leaf; raise `InvariantViolation` naming
    the first node, tier or namespace whose record differs."""
    books, shares, by_id = tree._books, tree._shares, tree._by_id
    count, stack = 0, [tree.root]
    used = {ns_id: [0] * len(books) for ns_id in shares}
    classes = [[0, 0, 0] for _ in books]  # per tier: protected, held, evictable
    while stack:
        node = stack.pop()
        kids = node.children.values()
        for book in books:
            kept, actual = book.children(node), sum(book.copy(c) is not None for c in kids)
            if kept != actual:
                raise InvariantViolation(f"tree node#{node.id} records {kept} children with a {book.tier.value} "
                                         f"copy, it has {actual}")
        if node.parent is not None:
            ns = node.namespace
            assert ns is not None  # below the root every node carries its namespace
            if node.share is not shares.get(ns.id):
                raise InvariantViolation(f"tree node#{node.id} does not carry its namespace's share state")
            if not node.is_namespace_root:
                count += 1
                for book in books:
                    pages = book.copy(node)
                    if pages is None:
                        continue
                    if node.share is not None:
                        used[ns.id][book.index] += len(pages)
                    row = classes[book.index]
                    row[0 if node.lock_ref else 1 if book.holds(node) else 2] += len(pages)
        stack.extend(kids)
    for ns_id, row in used.items():
        st = shares[ns_id]
        recorded = [t.used for t in st.tiers]
        if recorded != row:
            raise InvariantViolation(f"namespace {st.label} records {'/'.join(map(str, recorded))} device/host pages "
                                     f"against its share, it holds {'/'.join(map(str, row))}")
    if not count == tree.node_count == len(by_id):
        raise InvariantViolation(f"tree records {tree.node_count} nodes below its namespace roots (indexed: "
                                 f"{len(by_id)}), it has {count}")
    for book in books:
        recorded = [book.protected, book.held, book.evictable]
        if recorded != classes[book.index]:
            raise InvariantViolation(f"tree records {book.tier.value} pages protected/held/evictable "
                                     f"{'/'.join(map(str, recorded))}, its nodes hold "
                                     f"{'/'.join(map(str, classes[book.index]))}")
    # A page the store drops finds its node only through the stored index: exactly the pages of stored nodes.
    indexed = tree._stored_pages
    n_stored = 0
    for node in by_id.values():
        if node.stored:
            for h in node.page_hashes or ():
                n_stored += 1
                if indexed.get(h) is not node:
                    raise InvariantViolation(f"tree node#{node.id} is marked stored but its page {h.hex()} is not "
                                             f"indexed to it: a store eviction of that page would leave it stale")
    if n_stored != len(indexed):
        raise InvariantViolation(f"the tree's stored-page index holds {len(indexed)} pages, its stored nodes "
                                 f"{n_stored}")
    # Eviction finds a tier's victims only through its heap: every leaf nobody locks, holds or pins needs an entry.
    for book in books:
        offered = {entry & ID_MASK for entry in book.lru}
        for node in by_id.values():
            if book.victim(node) and node.id not in offered:
                raise InvariantViolation(f"tree node#{node.id} is an evictable {book.tier.value} leaf with no entry "
                                         f"in the {book.tier.value} LRU heap: eviction would never find it")
