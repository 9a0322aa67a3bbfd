"""The tree's bookkeeping: everything that writes a node's counters and the per-tier books that sum them.

`RadixTree` (kvcache.tree.radix) is keys and structure on top of this class: lookup, insert, split, delete,
eviction's entry points. `BookKeeper` is the rest — the one place where

- a node's copy in a tier is set or taken away (`_set_copy`, one code path for both tiers, parameterised by the
  tier's `TierBook`), keeping the parent's children count, the tier's page classes, the namespace's share use and
  the LRU heaps in step;
- locks (running requests), holds (prefetches, per tier), pins (in-flight copies) and host pins (L3 writes) are
  taken and given back, moving pages between the classes and re-offering a node to the heaps when the last one
  goes;
- the L3 acknowledgement of a node is recorded (`mark_stored` / `mark_unstored`);
- namespace shares are set and their use counted.

Callers outside the package never write a node's field (kvcache.tree.node): a pin taken by hand and given back
without an offer would leave the node out of every heap, never evicted. Not used on its own: the split into two
classes keeps each of them readable.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

import numpy as np

from ..errors import LockUnderflow
from ..types.ids import NamespaceId, PageHash
from ..types.tier import Tier
from .books import ID_BITS, TierBook, new_books
from .node import TreeNode, exact, namespace_label, subtree
from .shares import ShareState

# Called as on_copy(node, tier, had, pages) each time a node's copy in a tier is set (None: taken away), `had`
# being the copy before: the KV-event log (kvcache.engine.event_log) reports a copy that came or went.
CopyListener = Callable[[TreeNode, Tier, "np.ndarray | None", "np.ndarray | None"], None]


class BookKeeper:
    """The bookkeeping half of `RadixTree` (module docstring): counters, books, shares."""

    root: TreeNode  # the tree's root (RadixTree.__init__)

    # Each tier's pages in three classes (kvcache.tree.books), read by headroom and the audit; the books keep them.
    @property
    def device_protected(self) -> int:
        """Device pages of locked nodes."""
        return self._device.protected

    @property
    def device_held(self) -> int:
        """Device pages held by a prefetch, not locked."""
        return self._device.held

    @property
    def device_evictable(self) -> int:
        """Device pages neither locked nor held."""
        return self._device.evictable

    @property
    def host_protected(self) -> int:
        """Host pages of locked nodes."""
        return self._host.protected

    @property
    def host_held(self) -> int:
        """Host pages held by a prefetch, not locked."""
        return self._host.held

    @property
    def host_evictable(self) -> int:
        """Host pages neither locked nor held."""
        return self._host.evictable

    def __init__(self) -> None:
        # One book per tier, kept exact on every change: its pages per class and its lazy LRU heap of candidates.
        self._device: TierBook
        self._host: TierBook
        self._device, self._host = self._books = new_books()
        self._book_of: dict[Tier, TierBook] = {book.tier: book for book in self._books}
        self.on_copy: CopyListener | None = None  # see CopyListener; None (no event feed) costs one test per change
        self._shares: dict[NamespaceId, ShareState] = {}  # namespace id -> its share state (namespaces with a share)
        # page hash -> the attached node marked stored that holds it (mark_stored / mark_unstored, splits, deletes)
        self._stored_pages: dict[PageHash, TreeNode] = {}

    def page_hashes(self, node: TreeNode) -> list[PageHash]:
        """The page hash chain of `node`'s pages (RadixTree's: it knows the layout that seeds the chains)."""
        raise NotImplementedError

    def book(self, tier: Tier) -> TierBook:
        """The books of `tier`: its page counts per class and its LRU heap (read them; the tree writes them)."""
        return self._book_of[tier]

    # --- locks and holds -------------------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """Lock `node` and its path for a running request: none of it is evicted until `unlock`."""
        root = self.root
        while node is not root:
            parent = node.parent
            # A namespace root (the root's child) holds no pages, so none move between classes: no call for it
            # (every admission's path ends there).
            if node.lock_ref == 0 and parent is not root:
                self._protect(node, True)
            node.lock_ref += 1
            node = parent  # type: ignore[assignment]  # below the root every node has a parent

    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`. Raises `LockUnderflow` (changing nothing) when the path is not locked."""
        walk = node
        while walk is not self.root:
            if walk.lock_ref <= 0:
                raise LockUnderflow(walk.id, namespace_label(walk))
            walk = walk.parent  # type: ignore[assignment]  # below the root every node has a parent
        root = self.root
        while node is not root:
            parent = node.parent
            node.lock_ref -= 1
            if node.lock_ref == 0:
                if parent is not root:
                    self._protect(node, False)
                    self._reoffer(node)
                elif not node.children:  # a namespace root (no pages to move: see lock) that holds nothing now
                    self._reclaim_namespace_root(node)
            node = parent  # type: ignore[assignment]  # below the root every node has a parent

    def hold(self, node: TreeNode, tier: Tier) -> None:
        """Hold `node`'s path on one tier for a prefetch: its copies in that tier are not evicted until `release`.
        The other tier's copies stay evictable."""
        book = self._book_of[tier]
        add_holds, copy, root = book.add_holds, book.copy, self.root
        while node is not root:
            if add_holds(node, 1) == 1 and not node.lock_ref:
                pages = copy(node)
                if pages is not None:
                    book.evictable -= len(pages)
                    book.held += len(pages)
            node = node.parent  # type: ignore[assignment]  # below the root every node has a parent

    def release(self, node: TreeNode, tier: Tier) -> None:
        """Undo one `hold(node, tier)`. Raises `LockUnderflow` (changing nothing) when the path is not held."""
        book = self._book_of[tier]
        holds, add_holds, copy, root = book.holds, book.add_holds, book.copy, self.root
        walk = node
        while walk is not root:
            if holds(walk) <= 0:
                raise LockUnderflow(walk.id, namespace_label(walk), f"{book.tier.value} hold")
            walk = walk.parent  # type: ignore[assignment]  # below the root every node has a parent
        while node is not root:
            parent = node.parent
            if add_holds(node, -1) == 0:
                pages = copy(node)
                if pages is not None and not node.lock_ref:
                    book.held -= len(pages)
                    book.evictable += len(pages)
                if parent is root:  # a namespace root
                    self._reclaim_namespace_root(node)
                else:
                    self._reoffer(node)
            node = parent  # type: ignore[assignment]  # below the root every node has a parent

    def unheld_device_pages(self, node: TreeNode) -> int:
        """Device pages of `node`'s path that a new device hold would add to `device_held` (neither locked nor
        held yet; those nodes are a suffix of the path, since locks and holds take whole paths)."""
        n = 0
        while node is not self.root and not node.lock_ref and not node.device_holds:
            n += len(node.device) if node.device is not None else 0
            node = node.parent  # type: ignore[assignment]  # below the root every node has a parent
        return n

    # --- pins: what in-flight work does to a node -------------------------------------------------------------

    def pin(self, nodes: Iterable[TreeNode]) -> None:
        """An in-flight copy reads or fills `nodes` (a backup, a load-back, a request's host extension while room is
        made): none of their copies is evicted until each is `unpin`ned. Pins are not locks: the pages stay in
        their class (a pinned page is still counted evictable, since it will be once the copy lands)."""
        for node in nodes:
            node.pins += 1

    def unpin(self, node: TreeNode) -> None:
        """Undo one `pin` of `node` and offer it to the LRU heaps again (a node that became a leaf while pinned
        would otherwise never be found by eviction). Raises `LockUnderflow` (changing nothing) when not pinned."""
        if node.pins <= 0:
            raise LockUnderflow(node.id, namespace_label(node), "pin")
        node.pins -= 1
        self._reoffer(node)

    def pin_host(self, nodes: Iterable[TreeNode]) -> None:
        """An L3 write reads the host copies of `nodes`: those copies are not evicted until each is `unpin_host`ed.
        Their device copies stay evictable."""
        for node in nodes:
            node.host_pins += 1

    def unpin_host(self, node: TreeNode) -> None:
        """Undo one `pin_host` of `node` and offer it to the LRU heaps again. Raises `LockUnderflow` (changing
        nothing) when its host copy is not pinned."""
        if node.host_pins <= 0:
            raise LockUnderflow(node.id, namespace_label(node), "host pin")
        node.host_pins -= 1
        self._reoffer(node)

    def mark_stored(self, node: TreeNode) -> None:
        """The L3 store acknowledged every page of `node` (whose page hashes the write computed): its host copy can
        go without a write-back first. Its pages are indexed, so a later eviction or deletion of any of them in
        the store finds the node (`unstore_pages`)."""
        node.stored = True
        index = self._stored_pages
        for h in self.page_hashes(node):
            index[h] = node

    def mark_unstored(self, nodes: Iterable[TreeNode]) -> None:
        """The L3 store no longer holds all of `nodes`' pages (it evicted or deleted one, or a page above them): a
        host eviction writes them back again first, and the next write of their path includes them."""
        index = self._stored_pages
        for node in nodes:
            if node.stored:
                node.stored = False
                for h in node.page_hashes or ():
                    if index.get(h) is node:
                        del index[h]

    def unstore_pages(self, hashes: Iterable[PageHash]) -> int:
        """The store no longer holds these pages (evicted to make room, deleted): every node holding one of them,
        and every node below it (a chain hangs from its parent), is marked not stored. Returns how many nodes."""
        index, n = self._stored_pages, 0
        for h in hashes:
            node = index.get(h)
            if node is not None:
                stale = [node, *subtree(node)]
                n += sum(x.stored for x in stale)
                self.mark_unstored(stale)
        return n

    def unstore_namespace(self, ns_id: NamespaceId) -> int:
        """Every page of namespace `ns_id` left the store (dropped): none of its nodes is stored any more (those
        running requests lock stay in the tree and are written again by the next write of their path). Returns
        how many nodes were marked."""
        ns_root = self.root.children.get(ns_id)
        if ns_root is None:
            return 0
        stale = [node for node in subtree(ns_root) if node.stored]
        self.mark_unstored(stale)
        return len(stale)

    def stored_node(self, page_hash: PageHash) -> TreeNode | None:
        """The node marked stored that holds page `page_hash`, if any (read it; the tree keeps the index)."""
        return self._stored_pages.get(page_hash)

    # --- copies and offers ----------------------------------------------------------------------------------

    def set_host(self, node: TreeNode, pages: np.ndarray | None) -> None:
        """Give `node` a host copy (a backup completed) or take it away (pages=None)."""
        self._set_copy(self._host, node, pages)

    def set_device(self, node: TreeNode, pages: np.ndarray | None) -> None:
        """Give `node` a device copy (a load-back completed) or take it away (pages=None)."""
        self._set_copy(self._device, node, pages)

    def _reoffer(self, node: TreeNode) -> None:
        """`node` lost a lock, hold or pin: it may be evictable again in either tier. Each tier has its own test: a
        host pin (an L3 write reading the host copy) keeps the device copy evictable, so it must not keep the node
        out of the device heap until the write lands."""
        # A node is a candidate of one tier at most: of the device tier while it has a device copy, of the host tier
        # after (a host leaf has none: TierBook.unblocks). So one test and one offer, not one per book: every
        # admission's unlock offers its whole path.
        book = self._device if node.device is not None else self._host
        # The leaf test first: most nodes an unlock walks are inner ones, and it spares them the busy test's call.
        if book.is_leaf(node) and not book.is_busy(node):
            self._offer(book, node)

    def _offer(self, book: TierBook, node: TreeNode) -> None:
        """`node` may have become an eviction candidate of `book`'s tier: give it an entry in that tier's heap."""
        # Only a node that is a leaf of the tier now gets an entry: one that is not becomes one later only through a
        # change that offers it again (a copy set, a child's copy lost, the last lock or pin gone), so skipping it
        # loses nothing, and the heaps stay near the number of leaves instead of filling with entries that a pop
        # would drop (a write-through node is offered to the host heap while it still has its device copy).
        if book.is_leaf(node):
            entry = node.last_access << ID_BITS | node.id
            heapq.heappush(book.lru, entry)
            share = node.share
            if share is not None and share.push(book.index, entry):
                self._rebuild_share_heaps(share)

    # --- shares ----------------------------------------------------------------------------------------------

    def set_share(self, ns_id: NamespaceId, device_pages: int | None, host_pages: int | None, label: str = "") -> None:
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
        for node in subtree(ns_root):
            node.share = state
            if state is not None:
                for book in self._books:
                    pages = book.copy(node)
                    state.tiers[book.index].used += len(pages) if pages is not None else 0
        if state is not None:
            self._rebuild_share_heaps(state)

    def share_of(self, ns_id: NamespaceId) -> ShareState | None:
        """The share state of namespace `ns_id` (its shares in pages, its use of each tier); None without one."""
        return self._shares.get(ns_id)

    def shares(self) -> list[ShareState]:
        """The share state of every namespace with a share."""
        return list(self._shares.values())

    def _rebuild_share_heaps(self, state: ShareState) -> None:
        """The share's heaps, fresh: one entry per eviction candidate of each tier with a share."""
        ns_root = self.root.children.get(state.ns_id)
        state.rebuild(list(subtree(ns_root)) if ns_root is not None else [], self._books)

    # --- internals -------------------------------------------------------------------------------------------

    def _reclaim_namespace_root(self, ns_root: TreeNode) -> None:
        """Detach a namespace root that holds nothing and that nobody locks or holds: the tree's size stays
        bounded by what it caches, not by how many namespaces it has seen."""
        if (ns_root.parent is self.root and not ns_root.children and not ns_root.lock_ref
                and not ns_root.device_holds and not ns_root.host_holds):
            del self.root.children[ns_root.namespace.id]  # type: ignore[union-attr]  # a namespace root's own
            ns_root.parent = None
            self.root.children_on_device -= 1
            self.root.children_on_host -= 1

    def _lost_child_copy(self, book: TierBook, parent: TreeNode) -> None:
        """A child of `parent` no longer holds a copy in `book`'s tier; `parent` is offered when it became a leaf."""
        if not book.add_children(parent, -1):
            self._offer(book, parent)

    def _set_copy(self, book: TierBook, node: TreeNode, pages: np.ndarray | None) -> np.ndarray | None:
        """Give `node` a copy in `book`'s tier or take it away (None), and return the copy it had: the one code path
        of either tier's copy moves (an insert's new leaf takes `_new_device_leaf`, its specialised twin; a split
        divides copies between two nodes and changes no count). Keeps the parent's children count, the tier's class
        counts, the namespace's share use and the heaps, and tells `on_copy`."""
        # The tier's fields through the book's typed accessors: a method call each, ~25 ns an access over a plain
        # attribute (what reading them by name cost too), ~70 ns a move: within noise of an eviction. The moves on
        # every request's path are specialised: `_new_device_leaf`, `_protect`.
        if pages is not None:  # (a removal, eviction's move, skips the call)
            pages = exact(pages)
        had = book.swap_copy(node, pages)
        delta = (0 if pages is None else len(pages)) - (0 if had is None else len(had))
        share = node.share
        if share is not None:
            share.tiers[book.index].used += delta
        parent = node.parent
        if (had is None) is not (pages is None) and parent is not None:  # a copy came or went: the parent's count
            if not book.add_children(parent, 1 if had is None else -1):
                self._offer(book, parent)  # its last child's copy went: the parent may be a leaf of the tier now
        if pages is not None:
            self._offer(book, node)
        elif had is not None and book.unblocks is not None:
            self._offer(book.unblocks, node)  # this node may be a leaf of the tier its copy kept it out of now
        if node.lock_ref:  # the class the node's pages are in now (kvcache.tree.books)
            book.protected += delta
        elif book.holds(node):
            book.held += delta
        else:
            book.evictable += delta
        if self.on_copy is not None:
            self.on_copy(node, book.tier, had, pages)
        return had

    def _new_device_leaf(self, leaf: TreeNode, pages: np.ndarray) -> None:
        """`_set_copy(self._device, leaf, pages)` for a leaf an insert has just created, written out for the one
        case it is: the copy move every insert makes. The generic path reads and writes the tier's fields through the
        book's accessors (a method call each, ~70 ns a move, a few % of a whole insert at page size 1:
        benchmarks/bench_tree.py); here they are plain attribute accesses. What it may assume: the leaf is new (no
        copy, no lock, hold or pin: its pages are evictable), below a namespace root and childless (a device leaf).
        `check()` recounts everything it keeps."""
        pages = exact(pages)  # type: ignore[assignment]  # a copy being set, never None here
        leaf.device = pages
        n = len(pages)
        book = self._device
        book.evictable += n
        leaf.parent.children_on_device += 1  # type: ignore[union-attr]  # a new leaf hangs below its parent
        entry = leaf.last_access << ID_BITS | leaf.id
        heapq.heappush(book.lru, entry)
        share = leaf.share
        if share is not None:
            share.tiers[book.index].used += n
            if share.push(book.index, entry):
                self._rebuild_share_heaps(share)
        if self.on_copy is not None:
            self.on_copy(leaf, Tier.DEVICE, None, pages)

    def _protect(self, node: TreeNode, locked: bool) -> None:
        """Move `node`'s pages in every tier between the locked class and the one they have without the lock.

        Written out per tier, not looped over the books: it runs for every node of every admission's path twice
        (lock, unlock), and a loop over the books, reading each tier's fields through its accessors, costs a call
        per field per node (reads by name measured +50% on a lock/unlock pair, ~1 us a request, 3-5% of an
        admission in benchmarks/bench_tree.py)."""
        sign = 1 if locked else -1
        pages = node.device
        if pages is not None:
            d, book = sign * len(pages), self._device
            book.protected += d
            if node.device_holds:
                book.held -= d
            else:
                book.evictable -= d
        pages = node.host
        if pages is not None:
            d, book = sign * len(pages), self._host
            book.protected += d
            if node.host_holds:
                book.held -= d
            else:
                book.evictable -= d
