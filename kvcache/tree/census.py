"""Read-only questions about the whole tree, asked by ops and the live handlers: what each namespace holds per tier
(`namespace_pages`), and how far a chain of page hashes is held (`held_run`). They walk the nodes and change
nothing: no hit, no LRU clock, no split."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..types.ids import PageHash
from .node import HeldRun, NamespacePages, TreeNode

if TYPE_CHECKING:
    from ..types.namespace import Namespace
    from .radix import RadixTree


def namespace_pages(tree: RadixTree, namespace: Namespace | None = None) -> dict[bytes, NamespacePages]:
    """Namespace id -> the pages its nodes hold in each tier (only `namespace`'s when given). A namespace
    root's subtree is all of its namespace's nodes. Reads only."""
    out: dict[bytes, NamespacePages] = {}
    stack: list[tuple[TreeNode, NamespacePages]] = []
    for r in tree.root.children.values():
        assert r.namespace is not None, "only the tree's root has no namespace"
        if namespace is None or r.namespace == namespace:
            use = out[r.namespace.id] = NamespacePages(r.namespace)
            stack += [(c, use) for c in r.children.values()]
    while stack:
        node, use = stack.pop()
        use.device_pages += len(node.device) if node.device is not None else 0
        use.host_pages += len(node.host) if node.host is not None else 0
        stack.extend((c, use) for c in node.children.values())
    return out

def held_run(tree: RadixTree, hashes: list[PageHash]) -> HeldRun:
    """How much of the chain `hashes` the tree holds from its first page on: the device prefix, then the
    host-only extension after it, as a match would find them. Walked by page hash (a hash names its namespace
    and its whole prefix), touching nothing: no hit, no LRU clock, no split."""
    kids: list[TreeNode] = [c for root in tree.root.children.values() for c in root.children.values()]
    at = device = host = 0
    while at < len(hashes) and kids:
        node = next((c for c in kids if tree.page_hashes(c)[:1] == [hashes[at]]), None)
        if node is None or (node.device is None and node.host is None):
            break
        own = tree.page_hashes(node)
        n = 1
        while n < len(own) and at + n < len(hashes) and own[n] == hashes[at + n]:
            n += 1
        if node.device is not None and not host:  # device copies form a prefix of a path
            device += n
        elif node.host is not None:
            host += n
        else:
            break
        at += n
        if n < len(own):
            break
        kids = list(node.children.values())
    return HeldRun(device, host)
