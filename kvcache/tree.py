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
"""

from __future__ import annotations


import heapq
import weakref
from collections.abc import Callable, Iterator

import msgspec
import numpy as np

from .errors import InvalidInput, InvariantViolation, LockUnderflow
from .types.keys import TOKEN_BYTES, RadixKey, extend_chain, hash_root
from .types.namespace import Namespace
from .types.owners import OwnerKind, owner_code
from .types.tier import Tier

_EMPTY = np.empty(0, dtype=np.int64)
_ID_BITS = 48  # node ids stay below 2**48 (they are ledger owner ids too)
_ID_MASK = (1 << _ID_BITS) - 1
_NODE = OwnerKind.NODE  # looked up once: an Enum member lookup costs ~0.1 us on Python 3.11


class TreeNode(msgspec.Struct, gc=False, eq=False):
    """One node: a run of whole pages of one namespace's tokens and where their KV is.

    Invisible to Python's cyclic garbage collector (`gc=False`): a tree of a million nodes would otherwise be
    walked by every full collection, a pause that grows with the cache. Nodes form cycles (parent <-> children),
    so the tree unlinks them itself when it is dropped (`RadixTree.__init__`, `_unlink`).
    """

    id: int  # unique in the tree, never reused; the ledger owner is Node(id)
    owner: int  # ledger code of this node (hot paths)
    key: bytes  # packed tokens, whole pages; b"" for the root and namespace roots
    namespace: Namespace | None  # None only for the root
    parent: TreeNode | None
    # The share state of the node's namespace (RadixTree.set_share), None when it has none: the one test the copy
    # moves pay for shares.
    share: ShareState | None = None
    children: dict[bytes, TreeNode] = {}  # first page of the child's key (root: namespace id) -> child; own dict
    device: np.ndarray | None = None  # L1 page indices, one per page of key; None = no device copy
    host: np.ndarray | None = None  # L2 page indices, one per page of key; None = no host copy
    page_hashes: list[bytes] | None = None  # chain hashes of key's pages, computed on demand
    stored: bool = False  # every page of key is acknowledged by the L3 store
    lock_ref: int = 0  # running requests using this node (>= 0); a locked node is never evicted
    device_holds: int = 0  # prefetch holds on this path's device copies (>= 0); they are not evicted
    host_holds: int = 0  # prefetch holds on this path's host copies (>= 0); they are not evicted
    pins: int = 0  # in-flight copies reading or writing this node (>= 0); a pinned node is never evicted
    host_pins: int = 0  # in-flight L3 writes reading the host copy (>= 0); it is not evicted from L2 meanwhile
    last_access: int = 0  # logical clock of the last match/insert through this node (LRU order)
    hits: int = 0  # matches that went through this node (write_through_selective)
    # Children holding a device / host copy, kept by every move (RadixTree._set_device, _set_host, _split,
    # _delete): whether a node is an eviction candidate of a tier is then O(1), never a scan of its children.
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

    owner: int  # ledger code of the node that held the pages
    pages: np.ndarray


class ShareState:
    """One namespace's shares in the tree (`RadixTree.set_share`), in pages, and its use of each tier, kept exact
    by every copy move (`_set_device` / `_set_host`). Each tier with a share has its own lazy LRU heap of the
    namespace's eviction candidates (entries as in the tree's heaps), so taking a namespace's pages over its share
    pops from those and never scans the tree's heap."""

    __slots__ = ("ns_id", "label", "device_limit", "host_limit", "device_used", "host_used", "device_lru",
                 "host_lru")

    def __init__(self, ns_id: bytes, label: str, device_limit: int | None, host_limit: int | None) -> None:
        self.ns_id = ns_id  # Namespace.id (a share may come from a store, which knows no salt)
        self.label = label  # for messages: extra_key/salt fingerprint
        self.device_limit = device_limit  # pages; None = no share on L1
        self.host_limit = host_limit  # pages; None = no share on L2
        self.device_used = 0  # pages of device copies the namespace's nodes hold
        self.host_used = 0  # pages of host copies likewise
        self.device_lru: list[int] = []
        self.host_lru: list[int] = []

    def over(self, device: bool, incoming: int = 0) -> int:
        """Pages the namespace holds over its share of a tier, counting `incoming` pages about to be its own
        (0 without a share there)."""
        limit = self.device_limit if device else self.host_limit
        if limit is None:
            return 0
        return max(0, (self.device_used if device else self.host_used) + incoming - limit)


SplitListener = Callable[[TreeNode, TreeNode, int], None]
# Called as on_copy(node, tier, had, pages) each time a node's copy in a tier is set (None: taken away), `had`
# being the copy before: the KV-event log (kvcache.engine.event_log) reports a copy that came or went.
CopyListener = Callable[[TreeNode, "Tier", "np.ndarray | None", "np.ndarray | None"], None]


class RadixTree:
    """Radix tree of page-aligned token keys, one subtree per namespace."""

    def __init__(self, page_size: int, layout_id: bytes = b"") -> None:
        if page_size < 1:
            raise InvalidInput(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.layout_id = layout_id  # seeds the page hash chains of every namespace root
        self._page_bytes = page_size * TOKEN_BYTES
        self.root = TreeNode(0, owner_code(_NODE, 0), b"", None, None)
        self.root.device = self.root.host = _EMPTY
        # Nodes are invisible to the cyclic GC; when the tree goes, its parent <-> children cycles are unlinked here.
        weakref.finalize(self, _unlink, self.root).atexit = False
        self._next_id = 1
        self._clock = 0
        # Pages per tier in three classes, kept exact on every change: locked by a running request (protected),
        # held by a prefetch and not locked (held), neither (evictable, once in-flight copies no longer pin them).
        self.device_evictable = 0
        self.device_held = 0
        self.device_protected = 0
        self.host_evictable = 0
        self.host_held = 0
        self.host_protected = 0
        # Called as on_split(child, new_parent, head_pages) after a split moved child's first pages to new_parent.
        self.on_split: SplitListener | None = None
        self.on_copy: CopyListener | None = None  # see CopyListener; None (no event feed) costs one test per change
        # Lazy LRU heaps of eviction candidates per tier (see _victims); nodes are offered when they may have
        # become leaves of that tier. Entries are plain ints, last_access << _ID_BITS | id: a heap of ints compares
        # in C without a tuple per entry (several times faster at a million entries, and nothing for the GC).
        self._device_lru: list[int] = []
        self._host_lru: list[int] = []
        self._by_id: dict[int, TreeNode] = {}  # nodes below the namespace roots, by id (what heap entries name)
        self.node_count = 0  # nodes below the namespace roots
        self._shares: dict[bytes, ShareState] = {}  # namespace id -> its share state (namespaces with a share)

    # --- lookup ----------------------------------------------------------------------------------------------

    def namespace_root(self, namespace: Namespace, create: bool = False) -> TreeNode | None:
        """The subtree root of `namespace` (created when asked)."""
        node = self.root.children.get(namespace.id)
        if node is None and create:
            node = self._new_node(b"", namespace, self.root)
            node.device = node.host = _EMPTY
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
            return TreeMatch(_EMPTY, _EMPTY, self.root, self.root, self.root, self.page_size)
        end = len(key.data) - len(key.data) % self._page_bytes
        path = list(self._descend(ns_root, key.data, end))
        if touch:
            self._clock += 1
            clock = self._clock
            for node in path:
                node.last_access = clock
                node.hits += 1
            ns_root.last_access = clock
        return self._match_of(ns_root, path)

    def _match_of(self, ns_root: TreeNode, path: list[TreeNode]) -> TreeMatch:
        # Device copies form a prefix of the path; the rest of the path is host-only.
        if not path or path[-1].device is not None:  # all on the device: no search for the split
            device_nodes, host_nodes = path, path[:0]
        else:
            split = next(i for i, node in enumerate(path) if node.device is None)
            device_nodes, host_nodes = path[:split], path[split:]
        device_node = device_nodes[-1] if device_nodes else ns_root
        host_node = host_nodes[-1] if host_nodes else device_node
        anchor = self.root
        for node in reversed(path):
            if node.host is not None:
                anchor = node
                break
        return TreeMatch(_concat([n.device for n in device_nodes]), _concat([n.host for n in host_nodes]),
                         device_node, host_node, anchor, self.page_size)

    # --- insert ----------------------------------------------------------------------------------------------

    def insert(self, key: RadixKey, device_pages: np.ndarray) -> TreeInsert:
        """Insert a page-aligned key whose KV is in `device_pages` (one L1 page per key page).

        Existing nodes with a device copy keep it (the caller's pages there are duplicates); existing host-only
        nodes and new nodes take the caller's pages as their device copy.
        """
        data, pb = key.data, self._page_bytes
        if len(data) % pb:
            raise InvalidInput(f"insert needs a page-aligned key, got {len(key)} tokens at page size "
                               f"{self.page_size}")
        if len(device_pages) * pb != len(data):
            raise InvalidInput(f"insert of {len(data) // pb} pages with {len(device_pages)} device pages")
        if not data:  # nothing to cache: no namespace root is created for it
            return TreeInsert(0, self.root.children.get(key.namespace.id, self.root), [])
        self._clock += 1
        clock = self._clock
        node = self.namespace_root(key.namespace, create=True)
        node.last_access = clock
        page, prefix_pages, adopted = 0, 0, []
        for node in self._descend(node, data, len(data)):
            node.last_access = clock
            n = len(node.key) // pb
            if node.device is None:  # host-only: the caller's pages become its device copy
                self._set_device(node, device_pages[page:page + n])
                adopted.append(node)
            elif not adopted:
                prefix_pages += n
            page += n
        if page * pb < len(data):
            leaf = self._new_node(data[page * pb:], key.namespace, node)
            node.children[data[page * pb:(page + 1) * pb]] = leaf
            leaf.last_access = clock
            self._set_device(leaf, device_pages[page:])
            adopted.append(leaf)
            node = leaf
        return TreeInsert(prefix_pages, node, adopted)

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
        node = self.namespace_root(key.namespace, create=start_page == 0)
        if node is None:
            return HostInsert(None, 0, 0)
        pos = 0
        for node in self._descend(node, data, end):
            node.last_access = self._clock
            pos += len(node.key)
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
        leaf.last_access = self._clock
        self._set_host(leaf, host_pages[duplicates:])
        return HostInsert(leaf, duplicates, len(host_pages) - duplicates)

    # --- locks -----------------------------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """Lock `node` and its path for a running request: none of it is evicted until `unlock`."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._protect(node, True)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`. Raises `LockUnderflow` (changing nothing) when the path is not locked."""
        walk = node
        while walk is not self.root:
            if walk.lock_ref <= 0:
                raise LockUnderflow(walk.id, walk.namespace.label if walk.namespace else "root")
            walk = walk.parent  # type: ignore[assignment]
        root = self.root
        while node is not root:
            parent = node.parent
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protect(node, False)
                if parent is not root:
                    self.offer(node)
                elif not node.children:  # a namespace root that holds nothing now
                    self._reclaim_namespace_root(node)
            node = parent  # type: ignore[assignment]

    def hold(self, node: TreeNode, tier: Tier) -> None:
        """Hold `node`'s path on one tier for a prefetch: its copies in that tier are not evicted until `release`.
        The other tier's copies stay evictable."""
        device = tier is Tier.DEVICE
        while node is not self.root:
            if device:
                if node.device_holds == 0 and not node.lock_ref and node.device is not None:
                    self.device_evictable -= len(node.device)
                    self.device_held += len(node.device)
                node.device_holds += 1
            else:
                if node.host_holds == 0 and not node.lock_ref and node.host is not None:
                    self.host_evictable -= len(node.host)
                    self.host_held += len(node.host)
                node.host_holds += 1
            node = node.parent  # type: ignore[assignment]

    def release(self, node: TreeNode, tier: Tier) -> None:
        """Undo one `hold(node, tier)`. Raises `LockUnderflow` (changing nothing) when the path is not held."""
        attr = "device_holds" if tier is Tier.DEVICE else "host_holds"
        walk = node
        while walk is not self.root:
            if getattr(walk, attr) <= 0:
                raise LockUnderflow(walk.id, walk.namespace.label if walk.namespace else "root", f"{tier.value} hold")
            walk = walk.parent  # type: ignore[assignment]
        device = tier is Tier.DEVICE
        while node is not self.root:
            parent = node.parent
            if device:
                node.device_holds -= 1
                freed = node.device_holds == 0
                if freed and not node.lock_ref and node.device is not None:
                    self.device_held -= len(node.device)
                    self.device_evictable += len(node.device)
            else:
                node.host_holds -= 1
                freed = node.host_holds == 0
                if freed and not node.lock_ref and node.host is not None:
                    self.host_held -= len(node.host)
                    self.host_evictable += len(node.host)
            if freed:
                if parent is self.root:  # a namespace root
                    self._reclaim_namespace_root(node)
                else:
                    self.offer(node)
            node = parent  # type: ignore[assignment]

    def unheld_device_pages(self, node: TreeNode) -> int:
        """Device pages of `node`'s path that a new device hold would add to `device_held` (neither locked nor
        held yet; those nodes are a suffix of the path, since locks and holds take whole paths)."""
        n = 0
        while node is not self.root and not node.lock_ref and not node.device_holds:
            n += len(node.device) if node.device is not None else 0
            node = node.parent  # type: ignore[assignment]
        return n

    # --- copies ----------------------------------------------------------------------------------------------

    def set_host(self, node: TreeNode, pages: np.ndarray | None) -> None:
        """Give `node` a host copy (a backup completed) or take it away (pages=None)."""
        self._set_host(node, pages)

    def set_device(self, node: TreeNode, pages: np.ndarray | None) -> None:
        """Give `node` a device copy (a load-back completed) or take it away (pages=None)."""
        self._set_device(node, pages)

    def page_hashes(self, node: TreeNode) -> list[bytes]:
        """The page hash chain of `node`'s pages (computed once, from its namespace root down)."""
        missing = []
        walk = node
        while walk.page_hashes is None and not walk.is_namespace_root and walk is not self.root:
            missing.append(walk)
            walk = walk.parent  # type: ignore[assignment]
        if walk is self.root:
            return []
        last = (hash_root(self.layout_id, walk.namespace) if walk.is_namespace_root  # type: ignore[arg-type]
                else walk.page_hashes[-1])  # type: ignore[index]
        for n in reversed(missing):
            n.page_hashes = extend_chain(last, n.key, self.page_size)
            last = n.page_hashes[-1]
        return node.page_hashes or []

    def chain_parent(self, node: TreeNode) -> bytes:
        """The hash the chain of `node`'s first page extends: its parent's last page hash, or the namespace root."""
        parent = node.parent
        if parent is None or parent.is_namespace_root or parent is self.root:
            return hash_root(self.layout_id, node.namespace)  # type: ignore[arg-type]
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

    # --- pins and stored flags (temporary: the tree package replaces these) ---------------------------------

    def pin(self, nodes: list[TreeNode]) -> None:
        """An in-flight copy reads or fills `nodes`: none of them is evicted until `unpin`."""
        for n in nodes:
            n.pins += 1

    def unpin(self, node: TreeNode) -> None:
        """Undo one `pin` of `node`."""
        node.pins -= 1
        self.offer(node)

    def pin_host(self, nodes: list[TreeNode]) -> None:
        """An L3 write reads the host copies of `nodes`: they are not evicted from L2 until `unpin_host`."""
        for n in nodes:
            n.host_pins += 1

    def unpin_host(self, node: TreeNode) -> None:
        """Undo one `pin_host` of `node`."""
        node.host_pins -= 1
        self.offer(node)

    def mark_stored(self, node: TreeNode) -> None:
        """The store acknowledged every page of `node`."""
        node.stored = True

    def mark_unstored(self, nodes: list[TreeNode]) -> None:
        """The store may no longer hold these nodes' pages."""
        for n in nodes:
            n.stored = False

    # --- eviction --------------------------------------------------------------------------------------------

    def evict_device(self, n_pages: int, backup: Callable[[TreeNode], None] | None = None,
                     where: Callable[[TreeNode], bool] | None = None,
                     charge: Namespace | None = None) -> list[Evicted]:
        """Detach device copies of at least `n_pages` pages (when that many are evictable), least recently used
        leaves first. Never touches locked or pinned nodes.

        `backup(node)` is called on a victim without a host copy before its device copy goes (write-back); a node
        that has a host copy afterwards is kept host-only, any other victim is deleted. `where(node)` false keeps
        a node (evicting one namespace).

        With shares set (and no `where`), namespaces over their device share give their own LRU pages first:
        `charge`, the namespace the room is made for, while it holds or with `n_pages` more would hold more than
        its share, then the others, most over first; plain LRU takes the rest.
        """
        out: list[Evicted] = []
        freed = self._evict_over_shares(True, n_pages, backup, charge, out) if self._shares and where is None else 0
        if freed < n_pages:
            self._drain_device(self._victims(self._device_lru, _device_leaf, _device_busy), n_pages - freed, backup,
                               where, out)
        return out

    def _drain_device(self, victims: Iterator[TreeNode], n_pages: int, backup: Callable[[TreeNode], None] | None,
                      where: Callable[[TreeNode], bool] | None, out: list[Evicted]) -> int:
        """`evict_device`'s loop over one stream of victims: pages freed (appended to `out`)."""
        freed = 0
        try:
            for node in victims:
                if where is not None and not where(node):
                    continue
                if node.host is None and backup is not None:
                    backup(node)
                    if not self._device_victim(node):  # the backup's own work may have changed the node
                        continue
                pages = node.device
                self._set_device(node, None)
                out.append(Evicted(node.owner, pages))  # type: ignore[arg-type]
                freed += len(pages)  # type: ignore[arg-type]
                if node.host is None:
                    self._delete(node)
                if freed >= n_pages:
                    break
        finally:
            victims.close()
        return freed

    def evict_host(self, n_pages: int, backup: Callable[[TreeNode], None] | None = None,
                   where: Callable[[TreeNode], bool] | None = None,
                   charge: Namespace | None = None) -> list[Evicted]:
        """Detach host copies of at least `n_pages` pages (when that many are evictable) from unlocked, unpinned
        host-only leaves, least recently used first; the nodes are deleted (their KV remains only in L3).

        `backup(node)` is called on a victim not yet in L3 before its host copy goes (write-back). `where(node)`
        false keeps a node. Shares and `charge` as in `evict_device`, on the host shares."""
        out: list[Evicted] = []
        freed = self._evict_over_shares(False, n_pages, backup, charge, out) if self._shares and where is None else 0
        if freed < n_pages:
            self._drain_host(self._victims(self._host_lru, _host_leaf, _host_busy), n_pages - freed, backup, where,
                             out)
        return out

    def _drain_host(self, victims: Iterator[TreeNode], n_pages: int, backup: Callable[[TreeNode], None] | None,
                    where: Callable[[TreeNode], bool] | None, out: list[Evicted]) -> int:
        """`evict_host`'s loop over one stream of victims: pages freed (appended to `out`)."""
        freed = 0
        try:
            for node in victims:
                if where is not None and not where(node):
                    continue
                if not node.stored and backup is not None:
                    backup(node)
                    if not self._host_victim(node):
                        continue
                pages = node.host
                self._set_host(node, None)
                out.append(Evicted(node.owner, pages))  # type: ignore[arg-type]
                freed += len(pages)  # type: ignore[arg-type]
                self._delete(node)
                if freed >= n_pages:
                    break
        finally:
            victims.close()
        return freed

    def _victims(self, heap: list, is_leaf: Callable[[TreeNode], bool],
                 is_busy: Callable[[TreeNode], bool]) -> Iterator[TreeNode]:
        """Evictable nodes of one tier, least recently used first, from its lazy LRU heap.

        Entries are (last_access at push, id, node) and are never updated in place: an entry whose node was used
        since is pushed again with the new time; one whose node is no longer a leaf of that tier is dropped (the
        node is offered again when it becomes one), and so is a locked or pinned one (offered again when free).
        """
        if len(heap) > 4 * self.node_count + 1024:  # stale entries pile up under churn: rebuild from the tree
            heap[:] = [n.last_access << _ID_BITS | n.id for n in self._by_id.values() if is_leaf(n)]
            heapq.heapify(heap)
        kept = []
        by_id, pop = self._by_id, heapq.heappop
        try:
            while heap:
                entry = pop(heap)
                node = by_id.get(entry & _ID_MASK)
                if node is None or not is_leaf(node):
                    continue  # deleted, or not a leaf of this tier now: offered again when it becomes one
                if entry >> _ID_BITS != node.last_access:
                    heapq.heappush(heap, node.last_access << _ID_BITS | node.id)
                    continue
                if is_busy(node):
                    continue  # offered again when its last lock or pin goes (unlock, TieredCache._unpin)
                yield node
                if node.parent is not None and is_leaf(node):
                    kept.append(node.last_access << _ID_BITS | node.id)  # still there: not evicted after all
        finally:
            for entry in kept:
                heapq.heappush(heap, entry)

    def offer(self, node: TreeNode) -> None:
        """`node` lost a lock, hold or pin: it may be evictable again in either tier. Each tier has its own test: a
        host pin (an L3 write reading the host copy) keeps the device copy evictable, so it must not keep the node
        out of the device heap until the write lands."""
        self._offer(node, not _device_busy(node), not _host_busy(node))

    def _offer(self, node: TreeNode | None, device: bool, host: bool) -> None:
        """`node` may have become an eviction candidate of a tier: give it an entry in that tier's LRU heap."""
        # Only a node that is a leaf of the tier now gets an entry: one that is not becomes one later only through a
        # change that offers it again (a copy set, a child's copy lost, the last lock or pin gone), so skipping it
        # loses nothing, and the heaps stay near the number of leaves instead of filling with entries that a pop
        # would drop (a write-through node is offered to the host heap while it still has its device copy).
        if node is None:
            return
        device = device and _device_leaf(node)
        host = host and _host_leaf(node)
        if not (device or host):
            return
        entry = node.last_access << _ID_BITS | node.id
        if device:
            heapq.heappush(self._device_lru, entry)
        if host:
            heapq.heappush(self._host_lru, entry)
        if node.share is not None:
            self._offer_share(node.share, entry, device, host)

    def _device_victim(self, node: TreeNode) -> bool:
        return _device_leaf(node) and not _device_busy(node)

    def _host_victim(self, node: TreeNode) -> bool:
        return _host_leaf(node) and not _host_busy(node)

    # --- shares ----------------------------------------------------------------------------------------------

    def set_share(self, ns_id: bytes, device_pages: int | None, host_pages: int | None, label: str = "") -> None:
        """Give namespace `ns_id` a share of each tier in pages (None: no share there; both None clears it). Its
        nodes are counted now (one walk of its subtree); from then on every copy move keeps the count."""
        self._shares.pop(ns_id, None)
        state = None
        if device_pages is not None or host_pages is not None:
            state = self._shares[ns_id] = ShareState(ns_id, label or ns_id.hex()[:12], device_pages, host_pages)
        ns_root = self.root.children.get(ns_id)
        if ns_root is None:
            return
        ns_root.share = state
        for node in self._subtree(ns_root):
            node.share = state
            if state is not None:
                state.device_used += len(node.device) if node.device is not None else 0
                state.host_used += len(node.host) if node.host is not None else 0
        if state is not None:
            self._rebuild_share_heaps(state)

    def share_of(self, ns_id: bytes) -> ShareState | None:
        """The share state of namespace `ns_id` (its shares in pages, its use of each tier); None without one."""
        return self._shares.get(ns_id)

    def shares(self) -> list[ShareState]:
        """The share state of every namespace with a share."""
        return list(self._shares.values())

    def _evict_over_shares(self, device: bool, n_pages: int, backup: Callable[[TreeNode], None] | None,
                           charge: Namespace | None, out: list[Evicted]) -> int:
        """The first part of an eviction with shares set: pages of namespaces over their share of the tier, from
        their own LRU heaps — `charge`'s first (counting the `n_pages` the room is for), then the others, most
        over first. Pages freed (appended to `out`)."""
        own = self._shares.get(charge.id) if charge is not None else None
        over = sorted(((st.over(device), st) for st in self._shares.values() if st is not own and st.over(device)),
                      key=lambda x: -x[0])
        if own is not None and own.over(device, n_pages):
            over.insert(0, (min(own.over(device, n_pages), n_pages), own))
        freed = 0
        for excess, st in over:
            if device:
                victims = self._victims(st.device_lru, lambda n, st=st: n.share is st and _device_leaf(n),
                                        _device_busy)
                freed += self._drain_device(victims, min(excess, n_pages - freed), backup, None, out)
            else:
                victims = self._victims(st.host_lru, lambda n, st=st: n.share is st and _host_leaf(n), _host_busy)
                freed += self._drain_host(victims, min(excess, n_pages - freed), backup, None, out)
            if freed >= n_pages:
                break
        return freed

    def _offer_share(self, state: ShareState, entry: int, device: bool, host: bool) -> None:
        """`_offer` for a node of a namespace with a share: its entry goes to the share's heaps too. Heaps that
        nothing pops (a namespace within its share) are rebuilt from the namespace's subtree when stale entries
        outgrow its pages, so they stay bounded by what it caches."""
        if device and state.device_limit is not None:
            heapq.heappush(state.device_lru, entry)
        if host and state.host_limit is not None:
            heapq.heappush(state.host_lru, entry)
        if len(state.device_lru) + len(state.host_lru) > 4 * (state.device_used + state.host_used) + 1024:
            self._rebuild_share_heaps(state)

    def _rebuild_share_heaps(self, state: ShareState) -> None:
        """The share's heaps, fresh: one entry per eviction candidate of each tier with a share."""
        ns_root = self.root.children.get(state.ns_id)
        nodes = list(self._subtree(ns_root)) if ns_root is not None else []
        for limit, heap, is_leaf in ((state.device_limit, state.device_lru, _device_leaf),
                                     (state.host_limit, state.host_lru, _host_leaf)):
            heap[:] = ([n.last_access << _ID_BITS | n.id for n in nodes if is_leaf(n)] if limit is not None
                       else [])
            heapq.heapify(heap)

    @staticmethod
    def _subtree(top: TreeNode) -> Iterator[TreeNode]:
        """The nodes below `top` (not `top` itself)."""
        stack = list(top.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # --- walking ---------------------------------------------------------------------------------------------

    def nodes(self) -> Iterator[TreeNode]:
        """Every node below the namespace roots, parents before children."""
        return (node for node in self._subtree(self.root) if not node.is_namespace_root)

    def namespace_roots(self) -> list[TreeNode]:
        """The per-namespace subtree roots."""
        return list(self.root.children.values())

    def check(self) -> None:
        """Recount what the tree keeps incrementally — each node's children holding a device / host copy, the
        node count, an LRU entry for every evictable leaf, each share's use of each tier — and raise
        `InvariantViolation` naming the first node or namespace whose record differs."""
        count, stack = 0, [self.root]
        used = {ns_id: [0, 0] for ns_id in self._shares}
        while stack:
            node = stack.pop()
            kids = node.children.values()
            for tier, recorded, actual in (
                    ("device", node.children_on_device, sum(c.device is not None for c in kids)),
                    ("host", node.children_on_host, sum(c.host is not None for c in kids))):
                if recorded != actual:
                    raise InvariantViolation(f"tree node#{node.id} records {recorded} children with a {tier} copy, "
                                             f"it has {actual}")
            if node.parent is not None:
                if node.share is not self._shares.get(node.namespace.id):  # type: ignore[union-attr]
                    raise InvariantViolation(f"tree node#{node.id} does not carry its namespace's share state")
                if not node.is_namespace_root:
                    count += 1
                    if node.share is not None:
                        row = used[node.namespace.id]  # type: ignore[union-attr]
                        row[0] += len(node.device) if node.device is not None else 0
                        row[1] += len(node.host) if node.host is not None else 0
            stack.extend(kids)
        for ns_id, (device, host) in used.items():
            st = self._shares[ns_id]
            if (st.device_used, st.host_used) != (device, host):
                raise InvariantViolation(f"namespace {st.label} records {st.device_used}/{st.host_used} "
                                         f"device/host pages against its share, it holds {device}/{host}")
        if not count == self.node_count == len(self._by_id):
            raise InvariantViolation(f"tree records {self.node_count} nodes below its namespace roots (indexed: "
                                     f"{len(self._by_id)}), it has {count}")
        # Eviction finds a tier's victims only through its heap: every leaf nobody locks, holds or pins needs an entry.
        for tier, heap, is_leaf, is_busy in (("device", self._device_lru, _device_leaf, _device_busy),
                                             ("host", self._host_lru, _host_leaf, _host_busy)):
            offered = {entry & _ID_MASK for entry in heap}
            for node in self._by_id.values():
                if is_leaf(node) and not is_busy(node) and node.id not in offered:
                    raise InvariantViolation(f"tree node#{node.id} is an evictable {tier} leaf with no entry in the "
                                             f"{tier} LRU heap: eviction would never find it")

    # --- internals -------------------------------------------------------------------------------------------

    def _new_node(self, key: bytes, namespace: Namespace, parent: TreeNode) -> TreeNode:
        node = TreeNode(self._next_id, owner_code(_NODE, self._next_id), key, namespace, parent, parent.share)
        self._next_id += 1
        if parent is not self.root:
            self.node_count += 1
            self._by_id[node.id] = node
        return node

    def _descend(self, node: TreeNode, data: bytes, end: int) -> Iterator[TreeNode]:
        """Walk down from `node` along data[:end] (whole pages), yielding each node matched in full; the last may
        be the head of a node split where data diverges from it or ends inside it."""
        pb = self._page_bytes
        pos = 0
        while pos < end:
            child = node.children.get(data[pos:pos + pb])
            if child is None:
                return
            klen = len(child.key)
            if not data.startswith(child.key, pos):  # compared in place: no copy of the slice
                head = self._common_pages(child.key, data, pos, end)
                child = self._split(child, head)
                klen = head * pb
            yield child
            node = child
            pos += klen

    def _common_pages(self, node_key: bytes, data: bytes, pos: int, end: int) -> int:
        """Whole pages shared by `node_key` and data[pos:end] (>= 1: the first page matched by the child lookup)."""
        n = min(len(node_key), end - pos) // TOKEN_BYTES
        a = np.frombuffer(node_key, dtype="<u4", count=n)
        b = np.frombuffer(data, dtype="<u4", count=n, offset=pos)
        diff = np.flatnonzero(a != b)
        return (int(diff[0]) if len(diff) else n) // self.page_size

    def _split(self, child: TreeNode, head_pages: int) -> TreeNode:
        """Split `child` after `head_pages` pages; the new node takes the head and becomes child's parent."""
        cut = head_pages * self._page_bytes
        parent = child.parent
        assert parent is not None and 0 < cut < len(child.key)
        new = self._new_node(child.key[:cut], child.namespace, parent)  # type: ignore[arg-type]
        new.lock_ref, new.pins, new.host_pins = child.lock_ref, child.pins, child.host_pins
        new.device_holds, new.host_holds = child.device_holds, child.host_holds
        new.last_access, new.hits, new.stored = child.last_access, child.hits, child.stored
        if child.device is not None:
            new.device, child.device = _exact(child.device[:head_pages]), _exact(child.device[head_pages:])
        if child.host is not None:
            new.host, child.host = _exact(child.host[:head_pages]), _exact(child.host[head_pages:])
        if child.page_hashes is not None:
            new.page_hashes, child.page_hashes = child.page_hashes[:head_pages], child.page_hashes[head_pages:]
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
        # Callers take both copies away first (each offered the parent if it left it a leaf); a copy still here
        # leaves with the node.
        if node.device is not None:
            self._lost_child_copy(parent, True)
        if node.host is not None:
            self._lost_child_copy(parent, False)
        if parent.is_namespace_root:
            self._reclaim_namespace_root(parent)

    def _reclaim_namespace_root(self, ns_root: TreeNode) -> None:
        """Detach a namespace root that holds nothing and that nobody locks or holds: the tree's size stays
        bounded by what it caches, not by how many namespaces it has seen."""
        if (ns_root.parent is self.root and not ns_root.children and not ns_root.lock_ref
                and not ns_root.device_holds and not ns_root.host_holds):
            del self.root.children[ns_root.namespace.id]  # type: ignore[union-attr]
            ns_root.parent = None
            self.root.children_on_device -= 1
            self.root.children_on_host -= 1

    def _lost_child_copy(self, parent: TreeNode, device: bool) -> None:
        """A child of `parent` no longer holds a copy in one tier; `parent` is offered when it became a leaf."""
        if device:
            parent.children_on_device -= 1
            if not parent.children_on_device:
                self._offer(parent, True, False)
        else:
            parent.children_on_host -= 1
            if not parent.children_on_host:
                self._offer(parent, False, True)

    def _set_device(self, node: TreeNode, pages: np.ndarray | None) -> None:
        had = node.device
        delta = (0 if pages is None else len(pages)) - (0 if had is None else len(had))
        node.device = pages = _exact(pages)
        if node.share is not None:
            node.share.device_used += delta
        if pages is None:
            if had is not None:
                if node.parent is not None:
                    self._lost_child_copy(node.parent, True)  # the parent may be a device leaf now
                self._offer(node, False, True)  # and this node a host leaf
        else:
            if had is None and node.parent is not None:
                node.parent.children_on_device += 1
            self._offer(node, True, False)
        if node.lock_ref:
            self.device_protected += delta
        elif node.device_holds:
            self.device_held += delta
        else:
            self.device_evictable += delta
        if self.on_copy is not None:
            self.on_copy(node, Tier.DEVICE, had, pages)

    def _set_host(self, node: TreeNode, pages: np.ndarray | None) -> None:
        had = node.host
        delta = (0 if pages is None else len(pages)) - (0 if had is None else len(had))
        node.host = pages = _exact(pages)
        if node.share is not None:
            node.share.host_used += delta
        if pages is None:
            if had is not None and node.parent is not None:
                self._lost_child_copy(node.parent, False)
        else:
            if had is None and node.parent is not None:
                node.parent.children_on_host += 1
            self._offer(node, False, True)
        if node.lock_ref:
            self.host_protected += delta
        elif node.host_holds:
            self.host_held += delta
        else:
            self.host_evictable += delta
        if self.on_copy is not None:
            self.on_copy(node, Tier.HOST, had, pages)

    def _protect(self, node: TreeNode, locked: bool) -> None:
        """Move `node`'s pages between the locked class and the one it has without the lock."""
        sign = 1 if locked else -1
        if node.device is not None:
            d = sign * len(node.device)
            self.device_protected += d
            if node.device_holds:
                self.device_held -= d
            else:
                self.device_evictable -= d
        if node.host is not None:
            h = sign * len(node.host)
            self.host_protected += h
            if node.host_holds:
                self.host_held -= h
            else:
                self.host_evictable -= h


def _unlink(root: TreeNode) -> None:
    """Break the parent <-> children links below `root`: the nodes of a dropped tree are then freed by reference
    counting (the cyclic GC does not see them)."""
    stack = [root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        node.children = {}
        node.parent = None


def _exact(pages: np.ndarray | None) -> np.ndarray | None:
    """`pages` as an array that holds only its own entries: a slice of a larger array is copied, so a node never
    keeps the rest of a request's or an operation's pages alive (a few bytes per cached token at page size 1)."""
    if pages is None:
        return None
    base = pages.base
    if base is None or (isinstance(base, np.ndarray) and base.nbytes == pages.nbytes):
        return pages
    return pages.copy()


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    if not arrays:
        return _EMPTY
    if len(arrays) == 1:
        return arrays[0]
    return np.concatenate(arrays)


def _device_leaf(node: TreeNode) -> bool:
    """Has a device copy and no child has one (device copies form a prefix: only leaves can go)."""
    return (node.device is not None and not node.children_on_device and node.parent is not None
            and node.parent.parent is not None)


def _host_leaf(node: TreeNode) -> bool:
    """Has only a host copy and no child has one."""
    return (node.host is not None and node.device is None and not node.children_on_host and node.parent is not None
            and node.parent.parent is not None)


def _device_busy(node: TreeNode) -> bool:
    return bool(node.lock_ref or node.device_holds or node.pins)


def _host_busy(node: TreeNode) -> bool:
    return bool(node.lock_ref or node.host_holds or node.pins or node.host_pins)
