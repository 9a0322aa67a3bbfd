"""L2 -> L3 writes: the job the I/O worker runs, and its life on the scheduler thread.

A write covers whole nodes, root first, keyed by their page hashes (the nodes' own namespace chain). Cache mode:
it reads the nodes' host copies, owns no page, and pins those copies until the store has acknowledged every page.
Buffer mode: it owns a *bounce* copy of the nodes' pages in L2 (taken over from the completed backup,
Op(backup) -> Op(storage_write)) and frees it at the acknowledgement.

A node is marked stored when the store acknowledged all its pages. A write whose first page hangs below a stored
page that the store has evicted since is not written (an orphan chain): the path is written again, root first.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from ..storage.api import L3Store, PageOrigin
from ..types.keys import TOKEN_BYTES
from ..types.owners import OwnerKind, owner_code
from .copies import OpKind

if TYPE_CHECKING:
    from ..ledger.pools import SlotPool
    from ..tree import RadixTree, TreeNode
    from ..types.config import CacheConfig
    from ..types.stats import BackupStats
    from .copies import Copies, TransferOp
    from .event_log import EventLog
    from .holders import Holders
    from .io_worker import IOWorker

log = logging.getLogger("kvcache")


class StorageWriteJob:
    """An L2 -> L3 write of whole nodes: batched puts, run by the I/O worker."""

    kind = OpKind.STORAGE_WRITE  # what it does to the nodes it pins, as copies name it

    def __init__(self, ident: int, nodes: list[TreeNode], hashes: list[bytes], views: list,
                 origins: list[PageOrigin], batch: int, check_parent: bool, pages: np.ndarray | None = None) -> None:
        self.id = ident
        self.owner = owner_code(OwnerKind.OP_STORAGE_WRITE, ident)  # names this write in audits and the ledger
        self.nodes = nodes  # whose pages are written; marked stored when `poll` takes the finished job back
        self.pages = pages  # buffer mode: the L2 bounce pages this job owns, one per hash; None: reads the tree
        self.hashes = hashes  # page hashes, root first
        self.views = views  # host page bytes, one per hash
        self.origins = origins  # PageOrigin per hash
        self.batch = batch  # pages per put
        self.at = 0  # pages put so far
        self.rejected = 0  # pages the store refused for lack of capacity
        # The first page's parent is a stored page (not the namespace root) that L3 may have evicted since it was
        # written; writing below a missing parent would leave an unreachable (orphan) chain in the store.
        self.check_parent = check_parent
        self.parent_missing = False
        self.finished = False
        self.error: BaseException | None = None

    def step(self, store: L3Store) -> bool:
        """Put one batch; True when more remain."""
        if self.at == 0 and self.check_parent and store.exists_prefix([self.origins[0].parent]) == 0:
            self.parent_missing = True
            return False
        end = min(self.at + self.batch, len(self.hashes))
        result = store.put(self.hashes[self.at:end], self.views[self.at:end], self.origins[self.at:end])
        self.rejected += result.rejected
        self.at = end
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


class Writes:
    """Issues a cache's L3 writes and takes them back when the store has answered."""

    def __init__(self, config: CacheConfig, host_pool: SlotPool | None, tree: RadixTree, holders: Holders,
                 io: IOWorker | None, backup_stats: BackupStats) -> None:
        self.config = config
        self.host_pool = host_pool
        self.tree = tree
        self.holders = holders
        self.io = io  # None without a store: nothing is written
        self.enabled = io is not None  # the cache has a store to write to
        self.backup_stats = backup_stats
        self.copies: Copies  # wired by the cache: a bounce write rewritten after an L3 eviction backs up again
        self.events: EventLog | None = None  # the KV-event feed, while one is attached

    def wants(self, node: TreeNode, min_hits: int) -> bool:
        """Should `node` be written now: a host copy not in L3, hot enough, and no write of it in flight."""
        return (not node.stored and node.host is not None and node.hits >= min_hits
                and not any(p.kind is OpKind.STORAGE_WRITE for p in self.holders.pinned_by(node)))

    def unstored_path(self, node: TreeNode, min_hits: int) -> list[TreeNode]:
        """Nodes of `node`'s path with a host copy, not in L3 and not being written, root first."""
        if self.io is None:
            return []
        return [n for n in self.tree.path(node) if self.wants(n, min_hits)]

    def start(self, nodes: list[TreeNode], bounce: TransferOp | None = None) -> StorageWriteJob | None:
        """Queue an L2 -> L3 write of `nodes` (root first). Cache mode: from their host copies, pinned until the
        store acknowledges. Buffer mode: from the completed backup `bounce`, whose pages the write takes over
        (Op(backup) -> Op(storage_write)) and frees at the acknowledgement."""
        if not nodes or self.io is None:
            return None
        host = self.host_pool
        assert host is not None  # L3 writes read host pages
        tree, step = self.tree, self.tree.page_size * TOKEN_BYTES
        hashes, origins = [], []
        for node in nodes:
            assert node.namespace is not None  # nodes below a namespace root carry its namespace
            node_hashes = tree.page_hashes(node)
            parents = [tree.chain_parent(node), *node_hashes[:-1]]
            for i in range(len(node_hashes)):
                hashes.append(node_hashes[i])
                origins.append(PageOrigin(node.namespace, parents[i], node.key[i * step:(i + 1) * step]))
        pages = bounce.pages if bounce is not None else np.concatenate([n.host for n in nodes if n.host is not None])
        first_parent = nodes[0].parent
        check_parent = (first_parent is not None and first_parent.parent is not None
                        and not first_parent.is_namespace_root)
        rows = host.pages.numpy()  # one byte row per page
        job = StorageWriteJob(self.holders.mint(), nodes, hashes, [rows[p] for p in pages.tolist()], origins,
                              self.config.io_batch_pages, check_parent, pages if bounce is not None else None)
        if bounce is not None:
            host.transfer(pages, bounce.owner, job.owner)
        else:
            tree.pin_host(nodes)  # the host copy is being read; the device copy may still be evicted
        self.holders.add_pinner(nodes, job)  # follows splits; marks "being written"
        self.holders.writes[job.id] = job
        self.io.submit(job)
        return job

    def store_now(self, node: TreeNode) -> None:
        """Write-back: write `node` (and its ancestors not yet in L3) to the store before its host copy goes.
        Runs the puts on this thread: eviction needs the answer before it frees the pages."""
        self.wait_for(self.start([n for n in self.tree.path(node) if self.wants(n, 0)]))

    def wait_for(self, job: StorageWriteJob | None) -> None:
        """Wait for `job` and take it back now."""
        if job is not None and job.id in self.holders.writes:
            assert self.io is not None
            self.io.wait(job)
            self.io.done.remove(job)
            self.finish(job)

    def finish(self, job: StorageWriteJob) -> None:
        """Take back a write the store has answered: count it, mark what it stored, unpin, free a bounce copy, and
        write again a path whose parent the store evicted meanwhile."""
        del self.holders.writes[job.id]
        bs = self.backup_stats
        ok = job.error is None and job.rejected == 0
        if job.error is not None:
            bs.storage_failed += 1
            log.warning("L3 write %s failed, nodes left %s: %s", job.id,
                        "unstored" if job.bounce else "in L2 only", job.error)
        bs.storage_rejected += job.rejected
        bs.storage_pages += job.at - job.rejected if job.error is None else 0
        assert self.host_pool is not None
        if job.error is None:
            bs.storage_bytes += (job.at - job.rejected) * self.host_pool.page_bytes
        stored = ok and not job.parent_missing
        for node in job.nodes:
            if stored and not node.stored:
                if self.events is not None:
                    self.events.stored(node)
                self.tree.mark_stored(node)
            self.copies.unpin(node, job)
        if job.pages is not None:
            self.host_pool.free(job.pages, job.owner)
        if job.parent_missing:
            # L3 evicted a page above these nodes since it was written: the path is written again from its host
            # copies (backed nodes form a prefix, so every ancestor has one), or bounced again from its device
            # copies (buffer mode: every node has one), root first.
            bs.storage_rewrites += 1
            self.tree.mark_unstored(self.tree.path(job.nodes[0]))
            if job.bounce:
                self.copies.start_backup(self.copies.backup_candidates(job.nodes[-1], 0))
            else:
                self.start(self.unstored_path(job.nodes[-1], 0))
