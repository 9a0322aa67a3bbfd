"""The radix tree over cached token pages, rooted per namespace.

Shape::

    root (no namespace, no pages)
    ├── namespace root  (key b"", namespace A)   children keyed by the first page of their key
    │   └── node ... (key: whole pages of tokens, device and/or host page indices)
    └── namespace root  (namespace B)            no node below it holds another namespace's tokens

Every node below a namespace root holds whole pages: `key` is page-aligned and `device` / `host` (page indices in
the L1 / L2 pool) have one entry per page. Invariants (checked by `audit`):

- a node with a device copy has a parent with a device copy (device copies form a prefix from the namespace root);
  likewise for host copies ("backed nodes form a prefix");
- a node holds at least one copy;
- a parent's `lock_ref`, `device_holds` and `host_holds` are at least each child's (locks and holds take a path).

Locks and holds both keep a path in the tree, for different holders and tiers. A *lock* is a running request's:
nothing of the path is evicted. A *hold* is a prefetch's or a staged record's, on the one tier its result attaches
to (DESIGN §4): a cache-mode prefetch holds the anchor path's host copies (the device copies stay evictable), a
buffer-mode prefetch the device copies its splice will extend. The tree keeps each tier's pages in three exact
classes — locked (`*_protected`), held only (`*_held`), neither (`*_evictable`) — so a caller can tell at once how
much eviction could free and how much releasing holds would add.

The tree records structure and page indices only. Ledger moves are the caller's (`TieredCache`): the tree hands
back what it detached or adopted, and reports splits through `on_split` so the caller can move the head pages to
the new node's owner.

`RadixTree` here is keys and structure: lookup, insert, split, delete, walking, page hashes, eviction's entry
points. Its base `BookKeeper` (kvcache.tree.keeper) is the bookkeeping: locks, holds, pins, copies, shares, and
the per-tier books (kvcache.tree.books) they keep exact.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator

import numpy as np

from ..errors import InvalidInput, InvariantViolation
from ..types.fingerprint_key import FingerprintKey
from ..types.ids import NodeId, PageHash
from ..types.keys import TOKEN_BYTES, RadixKey, extend_chain, hash_root, new_chain_key
from ..types.namespace import Namespace
from ..types.owners import OwnerKind, owner_code
from .census import held_run, namespace_pages
from .check import check_tree
from .evict import Removed, evict
from .keeper import BookKeeper
from .node import (
    EMPTY,
    Evicted,
    HeldRun,
    HostInsert,
    NamespacePages,
    TreeInsert,
    TreeMatch,
    TreeNode,
    exact,
    subtree,
    unlink,
)

_NODE = OwnerKind.NODE  # looked up once: an Enum member lookup costs ~0.1 us on Python 3.11
_NODE_BASE = owner_code(_NODE, 0)  # a node's ledger code is this | its id (owner_code, without the call)

# Called as on_split(child, new_parent, head_pages) after a split moved child's first pages to new_parent.
SplitListener = Callable[[TreeNode, TreeNode, int], None]
Backup = Callable[[TreeNode], None]  # eviction's write-back of a victim before its copy goes


class RadixTree(BookKeeper):
    """Radix tree of page-aligned token keys, one subtree per namespace (module docstring); locks, holds, pins,
    copies and shares are `BookKeeper`'s."""

    def __init__(self, page_size: int, layout_id: bytes = b"", chain_key: bytes | None = None,
                 fingerprints: FingerprintKey | None = None, on_split: SplitListener | None = None) -> None:
        """`chain_key`: the key of the namespace roots' page hashes (kvcache.types.keys), the L3 store's
        `chain_key` when the cache has one; None draws a random one (a cache without a store shares its page
        hashes with nobody, and nobody can test a guessed salt against them). `fingerprints`: the key the
        namespaces held here are shown under, the store's when the cache has one; None: env KVC_FINGERPRINT_KEY,
        else a random one of this tree's own. `on_split`: told of every split (the cache moves the head pages'
        ledger owner and the in-flight operations' targets with it)."""
        if page_size < 1:
            raise InvalidInput(f"page_size must be >= 1, got {page_size}")
        super().__init__()
        self.page_size = page_size
        self.layout_id = layout_id  # seeds the page hash chains of every namespace root
        self.chain_key = new_chain_key() if chain_key is None else chain_key  # ... and keys them
        # what every part of the cache that shows a namespace keys its fingerprints and display ids by
        self.fingerprints = FingerprintKey.of(None) if fingerprints is None else fingerprints
        self._page_bytes = page_size * TOKEN_BYTES
        self.root = TreeNode(NodeId(0), owner_code(_NODE, 0), b"", None, None)
        self.root.device = self.root.host = EMPTY
        # Nodes are invisible to the cyclic GC; when the tree goes, its parent <-> children cycles are unlinked here.
        weakref.finalize(self, unlink, self.root).atexit = False
        self._next_id = 1
        self._clock = 0
        # Called as on_split(child, new_parent, head_pages) after a split moved child's first pages to new_parent.
        self.on_split = on_split
        self._by_id: dict[NodeId, TreeNode] = {}  # nodes below the namespace roots, by id (what heap entries name)
        self.node_count = 0  # nodes below the namespace roots

    # --- lookup ----------------------------------------------------------------------------------------------

    def namespace_root(self, namespace: Namespace, create: bool = False) -> TreeNode | None:
        """The subtree root of `namespace` (created when asked)."""
        node = self.root.children.get(namespace.id)
        if node is None and create:
            node = self._new_node(b"", namespace, self.root)
            node.device = node.host = EMPTY
            node.share = self._shares.get(namespace.id)
            self.root.children[namespace.id] = node
            self.root.children_on_device += 1
            self.root.children_on_host += 1
        return node

    def match_prefix(self, key: RadixKey, touch: bool = True) -> TreeMatch:
        """The longest page-aligned prefix of `key` in the tree, within the key's own namespace.

        Splits the last matched node when the match ends inside it, so the returned nodes end exactly at the match.
        Counts a hit and refreshes the LRU clock on every matched node (`touch=False`: neither, for a second look
        within one admission).
        """
        ns_root = self.root.children.get(key.namespace.id)
        if ns_root is None:
            return TreeMatch(EMPTY, EMPTY, self.root, self.root, self.root, self.page_size)
        end = len(key.data) - len(key.data) % self._page_bytes
        path = self._descend(ns_root, key.data, end)
        if touch:
            self._clock += 1
            clock = self._clock
            for node in path:
                node.last_access = clock
                node.hits += 1
            ns_root.last_access = clock
        return self._match_of(ns_root, path)

    def _match_of(self, ns_root: TreeNode, path: list[TreeNode]) -> TreeMatch:
        anchor = self.root
        for node in reversed(path):
            if node.host is not None:
                anchor = node
                break
        if not path:
            return TreeMatch(EMPTY, EMPTY, ns_root, ns_root, anchor, self.page_size)
        last = path[-1]
        # Device copies form a prefix of the path; the rest of the path is host-only.
        if last.device is not None:  # all on the device (the hot case): no search for the split, no host pages
            device_pages = last.device if len(path) == 1 else np.concatenate([n.device for n in path])
            return TreeMatch(device_pages, EMPTY, last, last, anchor, self.page_size)
        split = next(i for i, node in enumerate(path) if node.device is None)
        device_nodes, host_nodes = path[:split], path[split:]
        device_node = device_nodes[-1] if device_nodes else ns_root
        device_pages = _concat([n.device for n in device_nodes])  # type: ignore[misc]  # all have one
        return TreeMatch(device_pages, _concat([n.host for n in host_nodes]),  # type: ignore[misc]  # likewise
                         device_node, host_nodes[-1], anchor, self.page_size)

    # --- insert ----------------------------------------------------------------------------------------------

    def insert(self, key: RadixKey, device_pages: np.ndarray, first: int = 0) -> TreeInsert:
        """Insert a page-aligned key whose KV is in `device_pages` (one L1 page per key page from page `first`).

        Existing nodes with a device copy keep it (the caller's pages there are duplicates); existing host-only
        nodes and new nodes take the caller's pages as their device copy. `first` > 0: the key's first `first`
        pages are in the tree with a device copy already (a committing request's cached prefix, kept there by its
        lock), so the caller offers only the pages after them; a key whose first pages are not there is an
        `InvariantViolation`, raised before anything takes a page.
        """
        data, pb = key.data, self._page_bytes
        if len(data) % pb:
            raise InvalidInput(f"insert needs a page-aligned key, got {len(key)} tokens at page size "
                               f"{self.page_size}")
        if (len(device_pages) + first) * pb != len(data) or first < 0:
            raise InvalidInput(f"insert of {len(data) // pb} pages with {len(device_pages)} device pages from page "
                               f"{first}")
        if not data:  # nothing to cache: no namespace root is created for it
            return TreeInsert(0, self.root.children.get(key.namespace.id, self.root), [])
        self._clock += 1
        clock = self._clock
        ns_root = self.root.children.get(key.namespace.id)  # (not `or`: a namespace root has len() 0)
        if ns_root is None:
            ns_root = self.namespace_root(key.namespace, create=True)
            assert ns_root is not None  # made
        node = ns_root
        node.last_access = clock
        page, prefix_pages, adopted = 0, 0, []
        device = self._device
        for hit in self._descend(ns_root, data, len(data)):
            hit.last_access = clock
            n = len(hit.key) // pb
            if hit.device is None:  # host-only: the caller's pages become its device copy
                if page < first:
                    raise self._missing_prefix(key, first, page)
                self._set_copy(device, hit, device_pages[page - first:page - first + n])
                adopted.append(hit)
            elif not adopted:
                prefix_pages += n
            page += n
            node = hit  # the deepest node of the key so far
        if page * pb < len(data):
            if page < first:
                raise self._missing_prefix(key, first, page)
            leaf = self._new_node(data[page * pb:], key.namespace, node)
            node.children[data[page * pb:(page + 1) * pb]] = leaf
            leaf.last_access = clock
            # _set_copy, specialised: every insert makes it. The caller's array itself when the leaf takes all of
            # it (a committing request's fresh pages): no slice, no copy.
            self._new_device_leaf(leaf, device_pages if page == first else device_pages[page - first:])
            adopted.append(leaf)
            node = leaf
        return TreeInsert(prefix_pages, node, adopted)

    def _missing_prefix(self, key: RadixKey, first: int, page: int) -> InvariantViolation:
        return InvariantViolation(f"insert of {len(key.data) // self._page_bytes} pages offered from page {first}: "
                                  f"page {page} of the key has no device copy in the tree")

    def insert_host(self, key: RadixKey, start_page: int, host_pages: np.ndarray) -> HostInsert:
        """Attach prefetched pages [start_page, start_page + len(host_pages)) of `key` as one host-only leaf.

        The pages before `start_page` must still be in the tree (the prefetch keeps them locked). Pages of the span
        that the tree already holds are duplicates; the rest attaches below the last existing node when that node
        has a host copy (backed nodes stay a prefix) and is otherwise not attached.
        """
        pb = self._page_bytes
        end = (start_page + len(host_pages)) * pb
        data = key.data[:end]
        self._clock += 1
        clock = self._clock
        ns_root = self.namespace_root(key.namespace, create=start_page == 0)
        if ns_root is None:
            return HostInsert(None, 0, 0)
        node = ns_root
        pos = 0
        for hit in self._descend(ns_root, data, end):
            hit.last_access = clock
            pos += len(hit.key)
            node = hit  # the deepest node of the span so far
        matched = pos // pb
        if matched < start_page:
            return HostInsert(None, 0, 0)
        duplicates = matched - start_page
        if pos >= end or (node.host is None and not node.is_namespace_root):
            if node.is_namespace_root:
                self._reclaim_namespace_root(node)
            return HostInsert(None, duplicates, 0)
        leaf = self._new_node(data[pos:], key.namespace, node)
        node.children[data[pos:pos + pb]] = leaf
        leaf.last_access = clock
        self._set_copy(self._host, leaf, host_pages[duplicates:])
        return HostInsert(leaf, duplicates, len(host_pages) - duplicates)

    # --- copies ----------------------------------------------------------------------------------------------

    def page_hashes(self, node: TreeNode) -> list[PageHash]:
        """The page hash chain of `node`'s pages (computed once, from its namespace root down)."""
        missing = []
        walk = node
        while walk.page_hashes is None and not walk.is_namespace_root and walk is not self.root:
            missing.append(walk)
            walk = walk.parent  # type: ignore[assignment]  # below the root every node has a parent
        if walk is self.root:
            return []
        if walk.is_namespace_root:
            assert walk.namespace is not None  # a namespace root carries its namespace
            last: PageHash = hash_root(self.layout_id, walk.namespace, self.chain_key)
        else:
            assert walk.page_hashes is not None  # the walk stopped at a node with its hashes
            last = walk.page_hashes[-1]
        for n in reversed(missing):
            n.page_hashes = chain = extend_chain(last, n.key, self.page_size)
            last = chain[-1]
        return node.page_hashes or []

    def chain_parent(self, node: TreeNode) -> PageHash:
        """The hash the chain of `node`'s first page extends: its parent's last page hash, or the namespace root."""
        parent = node.parent
        if parent is None or parent.is_namespace_root or parent is self.root:
            assert node.namespace is not None  # below the root every node carries its namespace
            return hash_root(self.layout_id, node.namespace, self.chain_key)
        return self.page_hashes(parent)[-1]

    def attached(self, node: TreeNode) -> bool:
        """Is `node` in the tree? (Eviction and namespace-root reclaim detach nodes; only leaves are detached, so a
        node with a parent is attached.)"""
        return node is self.root or node.parent is not None

    def path_key(self, node: TreeNode) -> bytes:
        """The packed tokens from `node`'s namespace root down to and including `node`."""
        return b"".join(n.key for n in self.path(node))

    def path(self, node: TreeNode) -> list[TreeNode]:
        """Nodes from the namespace root's first child down to `node`."""
        out = []
        while node.parent is not None and not node.is_namespace_root:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    # --- eviction (the loop: kvcache.tree.evict) -------------------------------------------------------------

    def evict_device(self, n_pages: int, backup: Backup | None = None, where: Callable[[TreeNode], bool] | None = None,
                     charge: Namespace | None = None, removed: Removed | None = None) -> list[Evicted]:
        """Detach device copies of at least `n_pages` pages (when that many are evictable), least recently used
        leaves first. Never touches locked or pinned nodes.

        `backup(node)` is called on a victim without a host copy before its device copy goes (write-back); a node
        that has a host copy afterwards is kept host-only, any other victim is deleted. `where(node)` false keeps
        a node (evicting one namespace).

        With shares set (and no `where`), namespaces over their device share give their own LRU pages first:
        `charge`, the namespace the room is made for, while it holds or with `n_pages` more would hold more than
        its share, then the others, most over first; plain LRU takes the rest.

        `removed(node, by_share)` is told of each victim before its copy goes, while it is still attached (the
        cache's record of what it removed, and why: `by_share` when its namespace was over its share).
        """
        return evict(self, self._device, n_pages, backup, where, charge, removed)

    def evict_host(self, n_pages: int, backup: Backup | None = None, where: Callable[[TreeNode], bool] | None = None,
                   charge: Namespace | None = None, removed: Removed | None = None) -> list[Evicted]:
        """Detach host copies of at least `n_pages` pages (when that many are evictable) from unlocked, unpinned
        host-only leaves, least recently used first; the nodes are deleted (their KV remains only in L3).

        `backup(node)` is called on a victim not yet in L3 before its host copy goes (write-back). `where(node)`
        false keeps a node. Shares, `charge` and `removed` as in `evict_device`, on the host shares."""
        return evict(self, self._host, n_pages, backup, where, charge, removed)

    # --- walking ---------------------------------------------------------------------------------------------

    def nodes(self) -> Iterator[TreeNode]:
        """Every node below the namespace roots, parents before children."""
        return (node for node in subtree(self.root) if not node.is_namespace_root)

    def namespace_roots(self) -> list[TreeNode]:
        """The per-namespace subtree roots."""
        return list(self.root.children.values())

    def namespace_pages(self, namespace: Namespace | None = None) -> dict[bytes, NamespacePages]:
        """Namespace id -> the pages its nodes hold in each tier (only `namespace`'s when given). Reads only."""
        return namespace_pages(self, namespace)

    def held_run(self, hashes: list[PageHash]) -> HeldRun:
        """How much of the chain `hashes` the tree holds from its first page on (the device prefix, then the
        host-only extension), touching nothing."""
        return held_run(self, hashes)

    def check(self) -> None:
        """Recount what the tree keeps incrementally — each node's children holding a copy per tier, the node count,
        each tier's pages per class, an LRU entry for every evictable leaf, each share's use of each tier — and
        raise `InvariantViolation` naming the first node, tier or namespace whose record differs."""
        check_tree(self)

    # --- internals: structure --------------------------------------------------------------------------------

    def _new_node(self, key: bytes, namespace: Namespace, parent: TreeNode) -> TreeNode:
        # a NodeId and its OwnerCode, ints as they are (no NewType call per new node)
        node = TreeNode(self._next_id, _NODE_BASE | self._next_id, key, namespace, parent,  # type: ignore[arg-type]
                        parent.share)
        self._next_id += 1
        if parent is not self.root:
            self.node_count += 1
            self._by_id[node.id] = node
        return node

    def _descend(self, node: TreeNode, data: bytes, end: int) -> list[TreeNode]:
        """Walk down from `node` along data[:end] (whole pages): the nodes matched in full, in path order; the last
        may be the head of a node split where data diverges from it or ends inside it. A list, not a generator:
        every caller walks the whole path, and resuming a generator per node costs more than the list."""
        pb = self._page_bytes
        pos = 0
        path: list[TreeNode] = []
        while pos < end:
            child = node.children.get(data[pos:pos + pb])
            if child is None:
                break
            klen = len(child.key)
            if not data.startswith(child.key, pos):  # compared in place: no copy of the slice
                head = self._common_pages(child.key, data, pos, end)
                child = self._split(child, head)
                klen = head * pb
            path.append(child)
            node = child
            pos += klen
        return path

    def _common_pages(self, node_key: bytes, data: bytes, pos: int, end: int) -> int:
        """Whole pages shared by `node_key` and data[pos:end] (>= 1: the first page matched by the child lookup)."""
        n = min(len(node_key), end - pos) // TOKEN_BYTES
        a = np.frombuffer(node_key, dtype="<u4", count=n)
        b = np.frombuffer(data, dtype="<u4", count=n, offset=pos)
        diff = np.flatnonzero(a != b)
        return (int(diff[0]) if len(diff) else n) // self.page_size

    def _split(self, child: TreeNode, head_pages: int) -> TreeNode:
        """Split `child` after `head_pages` pages; the new node takes the head and becomes child's parent. The head
        inherits child's counters (locks, holds and pins take whole paths) and its pages keep their classes."""
        cut = head_pages * self._page_bytes
        parent = child.parent
        assert parent is not None and 0 < cut < len(child.key)
        new = self._new_node(child.key[:cut], child.namespace, parent)  # type: ignore[arg-type]  # below the root
        new.lock_ref, new.pins, new.host_pins = child.lock_ref, child.pins, child.host_pins
        new.device_holds, new.host_holds = child.device_holds, child.host_holds
        new.last_access, new.hits, new.stored = child.last_access, child.hits, child.stored
        if child.device is not None:
            new.device, child.device = exact(child.device[:head_pages]), exact(child.device[head_pages:])
        if child.host is not None:
            new.host, child.host = exact(child.host[:head_pages]), exact(child.host[head_pages:])
        if child.page_hashes is not None:
            new.page_hashes, child.page_hashes = child.page_hashes[:head_pages], child.page_hashes[head_pages:]
            if child.stored:  # the head's pages are the new node's now
                for h in new.page_hashes:
                    self._stored_pages[h] = new
        parent.children[child.key[:self._page_bytes]] = new  # in child's place: parent's counts stay
        child.key = child.key[cut:]
        child.parent = new
        new.children[child.key[:self._page_bytes]] = child
        new.children_on_device = int(child.device is not None)
        new.children_on_host = int(child.host is not None)
        if self.on_split is not None:
            self.on_split(child, new, head_pages)
        return new

    def _delete(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0 and node.pins == node.host_pins == 0
        del parent.children[node.key[:self._page_bytes]]
        node.parent = None
        self.node_count -= 1
        del self._by_id[node.id]
        if node.stored:  # its pages stay in the store; only the index of attached nodes lets go of them
            index = self._stored_pages
            for h in node.page_hashes or ():
                if index.get(h) is node:
                    del index[h]
        # Callers take both copies away first (each offered the parent if it left it a leaf); a copy still here
        # leaves with the node.
        if node.device is not None or node.host is not None:  # (eviction's deletes skip the loop's calls)
            for book in self._books:
                if book.copy(node) is not None:
                    self._lost_child_copy(book, parent)
        if parent.is_namespace_root:
            self._reclaim_namespace_root(parent)

def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    if not arrays:
        return EMPTY
    if len(arrays) == 1:
        return arrays[0]
    return np.concatenate(arrays)
