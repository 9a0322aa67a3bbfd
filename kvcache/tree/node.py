"""The tree's node and the values its operations hand back.

A `TreeNode` is read by everyone (the cache, the audit, the KV-event log, the CLI's views) and written by the tree
package alone: its structure (`key`, `parent`, `children`), its copies (`device`, `host`) and its counters
(`lock_ref`, `device_holds`, `host_holds`, `pins`, `host_pins`, `stored`, `hits`, `last_access`,
`children_on_device`, `children_on_host`) change only through `RadixTree` methods, which keep the per-tier books
(`kvcache.tree.books`) and the LRU heaps in step with them. A counter written from outside would leave the books
wrong or a node out of every heap (silently never evicted); `RadixTree.pin`, `unpin`, `pin_host`, `unpin_host`,
`mark_stored` and `mark_unstored` are how a caller says what its in-flight work does to a node.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import numpy as np

from ..types.ids import NodeId, OwnerCode, PageHash
from ..types.keys import TOKEN_BYTES
from ..types.namespace import Namespace
from .shares import ShareState

EMPTY = np.empty(0, dtype=np.int64)  # the pages of a copy with none (the root's and the namespace roots' copies)

class TreeNode(msgspec.Struct, gc=False, eq=False):
    """One node: a run of whole pages of one namespace's tokens and where their KV is.

    Invisible to Python's cyclic garbage collector (`gc=False`): a tree of a million nodes would otherwise be
    walked by every full collection, a pause that grows with the cache. Nodes form cycles (parent <-> children),
    so the tree unlinks them itself when it is dropped (`RadixTree.__init__`, `unlink`). `eq=False`: nodes compare
    by identity, and hashing or comparing them costs no field walk.

    Every field is written by the tree package only (module docstring); callers read them.
    """

    id: NodeId  # unique in the tree, never reused; the ledger owner is Node(id)
    owner: OwnerCode  # ledger code of this node (hot paths)
    key: bytes  # packed tokens, whole pages; b"" for the root and namespace roots
    namespace: Namespace | None  # None only for the root
    parent: TreeNode | None
    # The share state of the node's namespace (RadixTree.set_share), None when it has none: the one test the copy
    # moves pay for shares.
    share: ShareState | None = None
    children: dict[bytes, TreeNode] = {}  # first page of the child's key (root: namespace id) -> child; own dict
    device: np.ndarray | None = None  # L1 page indices, one per page of key; None = no device copy
    host: np.ndarray | None = None  # L2 page indices, one per page of key; None = no host copy
    page_hashes: list[PageHash] | None = None  # chain hashes of key's pages (one each), computed on demand
    stored: bool = False  # every page of key is acknowledged by the L3 store (RadixTree.mark_stored)
    lock_ref: int = 0  # running requests using this node (>= 0); a locked node is never evicted
    device_holds: int = 0  # prefetch holds on this path's device copies (>= 0); they are not evicted
    host_holds: int = 0  # prefetch holds on this path's host copies (>= 0); they are not evicted
    pins: int = 0  # in-flight copies reading or writing this node (>= 0, RadixTree.pin); never evicted meanwhile
    host_pins: int = 0  # in-flight L3 writes reading the host copy (>= 0, RadixTree.pin_host); kept in L2 meanwhile
    last_access: int = 0  # logical clock (RadixTree._clock, one tick per match/insert) of the last use: LRU order
    hits: int = 0  # matches that went through this node (write_through_selective)
    # Children holding a device / host copy (each >= 0 and <= len(children)), kept by every move (RadixTree
    # _set_copy, _split, _delete): whether a node is an eviction candidate of a tier is then O(1), never a scan of
    # its children.
    children_on_device: int = 0
    children_on_host: int = 0

    @property
    def is_namespace_root(self) -> bool:
        """True for the per-namespace root nodes (no pages, never evicted while they have children)."""
        return self.parent is not None and self.parent.parent is None

    def __len__(self) -> int:
        """Tokens in this node's key."""
        return len(self.key) // TOKEN_BYTES

    def __repr__(self) -> str:
        ns = self.namespace.label if self.namespace is not None else "root"
        return (f"TreeNode(#{self.id} {ns} tokens={len(self)} device={self.device is not None} "
                f"host={self.host is not None} lock={self.lock_ref} holds={self.device_holds}/{self.host_holds} "
                f"pins={self.pins}/{self.host_pins})")


class NamespacePages(msgspec.Struct):
    """What one namespace holds in the tree (`RadixTree.namespace_pages`)."""

    namespace: Namespace
    device_pages: int = 0  # L1 pages of its nodes (>= 0)
    host_pages: int = 0  # L2 pages of its nodes (>= 0)


class HeldRun(msgspec.Struct, frozen=True):
    """How much of a chain of page hashes the tree holds from its first page (`RadixTree.held_run`), as a match
    would find it: a device prefix, then a host-only extension."""

    device_pages: int  # leading pages with an L1 copy
    host_pages: int  # pages after those with an L2 copy only


class TreeMatch(msgspec.Struct, gc=False):
    """What the tree holds for a key: a device prefix, then a host-only extension.

    `device_node` ends the device prefix (the namespace root when there is none); `host_node` ends the host-only
    extension (== `device_node` when there is none). `anchor` is the deepest matched node with a host copy, or
    the tree's root (namespace None) when no matched node has one: where an L3 prefetch would attach.
    """

    device_pages: np.ndarray  # L1 pages of the device prefix, in order
    host_pages: np.ndarray  # L2 pages of the host-only extension, in order
    device_node: TreeNode
    host_node: TreeNode
    anchor: TreeNode
    page_size: int

    @property
    def device_tokens(self) -> int:
        """Tokens of the device prefix."""
        return len(self.device_pages) * self.page_size

    @property
    def host_tokens(self) -> int:
        """Tokens of the host-only extension."""
        return len(self.host_pages) * self.page_size


class TreeInsert(msgspec.Struct, gc=False):
    """The outcome of an insert. The caller's pages in [0, prefix_pages) duplicate device copies the tree already
    held (free those that are the caller's own); `adopted` nodes took the caller's pages as their device copy."""

    prefix_pages: int  # leading pages of the key whose device copy was already in the tree
    node: TreeNode  # the node that ends the key
    adopted: list[TreeNode]  # nodes whose device copy now is a slice of the caller's pages, in path order


class HostInsert(msgspec.Struct, gc=False):
    """The outcome of `insert_host`: of the caller's host pages, the first `duplicates` cover pages the tree
    already held, the next `adopted` became the host copy of `node`; the rest could not attach."""

    node: TreeNode | None  # the new host-only leaf, None when nothing was attached
    duplicates: int
    adopted: int


class Evicted(msgspec.Struct, gc=False):
    """Pages an eviction detached from a node; the caller frees them from the node's owner."""

    owner: OwnerCode  # ledger code of the node that held the pages
    pages: np.ndarray


def unlink(root: TreeNode) -> None:
    """Break the parent <-> children links below `root`: the nodes of a dropped tree are then freed by reference
    counting (the cyclic GC does not see them)."""
    stack = [root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        node.children = {}
        node.parent = None


def subtree(top: TreeNode) -> Iterator[TreeNode]:
    """The nodes below `top` (not `top` itself), parents before their children."""
    stack = list(top.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def namespace_label(node: TreeNode) -> str:
    """How messages name `node`'s namespace."""
    return node.namespace.label if node.namespace is not None else "root"


def exact(pages: np.ndarray | None) -> np.ndarray | None:
    """`pages` as an array that holds only its own entries: a slice of a larger array is copied, so a node never
    keeps the rest of a request's or an operation's pages alive (a few bytes per cached token at page size 1)."""
    if pages is None:
        return None
    base = pages.base
    if base is None or (isinstance(base, np.ndarray) and base.nbytes == pages.nbytes):
        return pages
    return pages.copy()
