"""An L2 -> L3 write in flight (`StorageWriteJob`): batched puts of whole nodes, run by the I/O worker.

The job reads the nodes' host copies (cache mode: it owns no page and pins those copies) or owns a bounce copy of
their pages (buffer mode). Each `step` puts one batch and stops at the first batch the store did not take whole;
what the store acknowledged, refused, failed and evicted for it is recorded on the job for `kvcache.engine.writes`
to take back on the scheduler thread.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from ..diagnostics.ownership import HolderState, encode_pages
from ..types.ids import PageHash
from ..types.owners import OwnerKind, owner_code
from .operation import OpKind

if TYPE_CHECKING:
    from ..storage.api import PageOrigin, PageStore
    from ..tree import RadixTree, TreeNode


class StorageWriteJob:
    """An L2 -> L3 write of whole nodes: batched puts, run by the I/O worker."""

    kind = OpKind.STORAGE_WRITE  # what it does to the nodes it pins, as copies name it

    def __init__(self, ident: int, nodes: list[TreeNode], hashes: list[PageHash], views: list[np.ndarray],
                 origins: list[PageOrigin], batch: int, check_parent: bool, pages: np.ndarray | None = None,
                 clock: Iterator[int] | None = None) -> None:
        self.id = ident
        self.owner = owner_code(OwnerKind.OP_STORAGE_WRITE, ident)  # names this write in audits and the ledger
        self.nodes = nodes  # whose pages are written; marked stored when `poll` takes the finished job back
        self.pages = pages  # buffer mode: the L2 bounce pages this job owns, one per hash; None: reads the tree
        self.hashes = hashes  # page hashes, root first
        self.views = views  # host page bytes, one per hash
        self.origins = origins  # PageOrigin per hash
        self.batch = batch  # pages per put
        self.at = 0  # pages put so far
        self.acked = 0  # leading pages the store is known to hold (acknowledged)
        self.rejected = 0  # pages the store refused (capacity, a quota, a share)
        self.failed = 0  # pages the store could not write (PageOutcome.FAILED: unreachable, a fault it answered)
        self.evicted: list[PageHash] = []  # pages the store evicted to make room for this write's puts
        # The order of store changes across writes: each put takes the next number of `clock` (shared by a cache's
        # writes, run one at a time by the worker). (end, number) per batch put; (number, hashes) per eviction.
        self.clock = clock if clock is not None else itertools.count()
        self.puts: list[tuple[int, int]] = []
        self.evictions: list[tuple[int, list[PageHash]]] = []
        # The first page's parent is a stored page (not the namespace root) that L3 may have evicted since it was
        # written; writing below a missing parent would leave an unreachable (orphan) chain in the store.
        self.check_parent = check_parent
        self.parent_missing = False
        self.cut = False  # stopped because an earlier page of its own was evicted by another write meanwhile
        self.finished = False
        self.error: BaseException | None = None

    def step(self, store: PageStore) -> bool:
        """Put one batch; True when more remain. Stops at a batch the store did not take whole: nothing is put
        below a page it refused (that page's children would be refused, or orphaned)."""
        at, origins, hashes = self.at, self.origins, self.hashes
        if (at or self.check_parent) and store.exists_prefix([origins[at].parent]) == 0:
            if at and origins[at].parent == hashes[at - 1]:
                # Another write's put evicted the page this batch hangs below since this job put it: the chain is
                # cut here (written again later, parent first), never continued below a page the store let go.
                self.cut = True
            else:
                self.parent_missing = True
            return False
        end = min(at + self.batch, len(hashes))
        for i in range(at + 1, end):
            if origins[i].parent != hashes[i - 1]:  # a node of the path left out (stored): its parent is checked
                end = i  # first, at the start of the next batch
                break
        result = store.put(self.hashes[self.at:end], self.views[self.at:end], self.origins[self.at:end])
        seq = next(self.clock)
        self.puts.append((end, seq))
        if result.evicted_hashes:
            self.evicted += result.evicted_hashes
            self.evictions.append((seq, list(result.evicted_hashes)))
        if result.rejected or result.failed:
            self.rejected += result.rejected
            self.failed += result.failed
            # What the store holds of the batch is a prefix of it (it rejects a chain's tail): ask how long, so
            # that what it took is marked and announced. A store that cannot answer now: nothing of it counts.
            try:
                self.acked = self.at + store.exists_prefix(self.hashes[self.at:end])
            except Exception:  # noqa: BLE001 - an L3 fault here only leaves the batch unacknowledged
                self.acked = self.at
            self.at = end
            return False
        self.acked = self.at = end
        return end < len(self.hashes)

    @property
    def bounce(self) -> bool:
        """True when the job writes its own bounce copy (buffer mode) instead of reading the nodes' host copies."""
        return self.pages is not None

    def split_target(self, child: TreeNode, new_parent: TreeNode, head_pages: int) -> None:
        """Follow a tree split: `new_parent` now holds part of a node being written (and is pinned too, when the
        job reads host copies)."""
        if child in self.nodes:
            self.nodes.insert(self.nodes.index(child), new_parent)

    def unpin(self, tree: RadixTree, node: TreeNode) -> None:
        """A write from host copies pins each node's host copy; a bounce write pins no node (it is listed only to
        mark "being written")."""
        if self.pages is None:
            tree.unpin_host(node)

    def holder_state(self, device_pool: str, host_pool: str) -> HolderState:
        """Buffer mode: the bounce copy it owns (it reads no node). Cache mode: no page, the host copies it reads."""
        if self.pages is not None:
            return HolderState("op:storage_write", self.id, self.owner, host_pool, encode_pages(self.pages))
        return HolderState("op:storage_write", self.id, self.owner, host_pool, b"",
                           host_pins=[n.id for n in self.nodes])
