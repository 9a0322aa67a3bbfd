"""L2 -> L3 writes: their life on the scheduler thread, from issue to the store's answer (the job the I/O worker
runs is `kvcache.engine.write_job`).

A write covers whole nodes, root first, keyed by their page hashes (the nodes' own namespace chain). Cache mode:
it reads the nodes' host copies, owns no page, and pins those copies until the store has acknowledged every page.
Buffer mode: it owns a *bounce* copy of the nodes' pages in L2 (taken over from the completed backup,
Op(backup) -> Op(storage_write)) and frees it at the acknowledgement.

A write's nodes need not be consecutive (nodes of the path already stored are left out): a batch never spans such a
gap, and the parent a batch hangs below is checked to be in the store before it is put. A node is marked stored when
the store acknowledged all its pages; the pages acknowledged are announced (KV
events) from the write's own record of them (hash, parent, tokens), so a node evicted while its write was in flight
is announced with its true parent. Pages the store evicted to make room for a write are marked gone from their
nodes and announced removed. A write whose first page (or the first page after a gap) hangs below a stored page
that the store has evicted since is not written (an orphan chain): the path is written again, root first.

A write never puts a page below one the store did not take: at the first batch the store rejects (a refusal:
capacity, a quota, a share) or fails (a fault: the store unreachable, or answering FAILED), it stops; the two are
counted apart (`BackupStats.storage_rejected` pages, `storage_failed` writes). Its unstored nodes are kept for a
retry (their path, parent first), after 1, 2, 4 ... up to `RETRY_MAX_POLLS` polls while the store keeps failing,
at once after a write succeeds; a write of a node whose parent is unstored and not being written takes the parent
along (parent first), so a chain is never refused for a parent that failed once.

Writes move bytes and marks only: which path is written again, and from which copy (the host copies, or bounced
again from the device), is the host mode's (`kvcache.engine.backups`), which takes `rewrites` and `due_retries`.
"""

from __future__ import annotations

import collections
import itertools
import logging
from typing import TYPE_CHECKING

import numpy as np

from ..storage.api import PageOrigin
from ..types.ids import NamespaceId, NodeId, PageHash
from ..types.keys import TOKEN_BYTES
from .io_worker import take_back
from .operation import OpKind
from .write_job import StorageWriteJob

if TYPE_CHECKING:
    from ..ledger.pools import SlotPool
    from ..tree import RadixTree, TreeNode
    from ..types.config import CacheConfig
    from ..types.stats import BackupStats
    from .event_log import EventFeed
    from .holders import Holders
    from .io_worker import IOWorker
    from .transfer import TransferOp

log = logging.getLogger("kvcache")

RETRY_MAX_POLLS = 64  # the longest wait, in polls, before failed writes are tried again while the store fails


class Writes:
    """Issues a cache's L3 writes and takes them back when the store has answered."""

    def __init__(self, config: CacheConfig, host_pool: SlotPool | None, tree: RadixTree, holders: Holders,
                 io: IOWorker | None, backup_stats: BackupStats, events: EventFeed) -> None:
        self.config = config
        self.host_pool = host_pool
        self.tree = tree
        self.holders = holders
        self.io = io  # None without a store: nothing is written
        self.enabled = io is not None  # the cache has a store to write to
        self.backup_stats = backup_stats
        self.events = events  # the KV-event feed: its log, while one is attached
        self.done: collections.deque[StorageWriteJob] = collections.deque()  # answered, in the order they finished
        self.failed: dict[NodeId, TreeNode] = {}  # node id -> the last node of a write that failed, for a retry
        # node id -> the last node of a write whose parent the store evicted meanwhile: its path is written again,
        # root first, as soon as the write is taken back (`take_rewrites`)
        self.rewrites: dict[NodeId, TreeNode] = {}
        # The order of the store's changes (StorageWriteJob.clock), and per page hash the number of the last put
        # taken back that stored it, and of the last eviction taken back that removed it (bounded by `_prune`).
        self._clock = itertools.count()
        self._put_at: dict[PageHash, int] = {}
        self._evicted_at: dict[PageHash, int] = {}
        self._finished = 0
        self._retry_wait = 0  # polls to wait before the next retry (doubles while writes keep failing)
        self._retry_in = 0  # polls left of that wait

    def wants(self, node: TreeNode, min_hits: int) -> bool:
        """Should `node` be written now: a host copy not in L3, hot enough, and no write of it in flight."""
        return (not node.stored and node.host is not None and node.hits >= min_hits
                and not any(p.kind is OpKind.STORAGE_WRITE for p in self.holders.pinned_by(node)))

    def unstored_path(self, node: TreeNode, min_hits: int) -> list[TreeNode]:
        """Nodes of `node`'s path with a host copy, not in L3 and not being written, root first."""
        if self.io is None:
            return []
        return [n for n in self.tree.path(node) if self.wants(n, min_hits)]

    def start(self, nodes: list[TreeNode]) -> StorageWriteJob | None:
        """Queue an L2 -> L3 write of `nodes` (root first) from their host copies (cache mode), with the unstored
        ancestors a write must take along; the host copies are pinned until the store acknowledges."""
        if not nodes or self.io is None:
            return None
        nodes = self._unstored_ancestors(nodes[0]) + nodes
        pages = np.concatenate([n.host for n in nodes if n.host is not None])
        job = self._job(nodes, pages, None)
        self.tree.pin_host(nodes)  # the host copy is being read; the device copy may still be evicted
        return self._submit(job)

    def start_bounce(self, bounce: TransferOp) -> StorageWriteJob | None:
        """Queue an L2 -> L3 write of the nodes a completed backup copied (buffer mode): the write takes over its
        pages, a bounce copy (Op(backup) -> Op(storage_write)), and frees them at the acknowledgement."""
        nodes = [t.node for t in bounce.targets]
        if not nodes or self.io is None:
            return None
        job = self._job(nodes, bounce.pages, bounce.pages)
        bounce.pool.transfer(bounce.pages, bounce.owner, job.owner)
        return self._submit(job)

    def _job(self, nodes: list[TreeNode], pages: np.ndarray, owned: np.ndarray | None) -> StorageWriteJob:
        """The write of `nodes` from the host pages `pages` (one per page of theirs, in order); `owned`: the pages
        the job owns (a bounce copy), None when it reads the nodes' host copies."""
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
        first_parent = nodes[0].parent
        check_parent = (first_parent is not None and first_parent.parent is not None
                        and not first_parent.is_namespace_root)
        rows = host.rows()  # one byte row per page
        return StorageWriteJob(self.holders.mint(), nodes, hashes, [rows[p] for p in pages.tolist()], origins,
                               self.config.io_batch_pages, check_parent, owned, self._clock)

    def _submit(self, job: StorageWriteJob) -> StorageWriteJob:
        """Register `job` (its nodes listed as being written; it follows their splits) and queue it."""
        assert self.io is not None
        self.holders.add_pinner(job.nodes, job)
        self.holders.writes[job.id] = job
        self.io.submit(job, self.done)
        return job

    def _unstored_ancestors(self, node: TreeNode) -> list[TreeNode]:
        """The ancestors of `node` a write of it must take along, root first: those a write `wants` (not stored,
        a host copy, none in flight) up to the first that is stored or being written. A write below a parent
        whose own write failed then writes the parent first instead of being refused for it."""
        out = []
        walk = node.parent
        while walk is not None and walk.parent is not None and not walk.is_namespace_root and self.wants(walk, 0):
            out.append(walk)
            walk = walk.parent
        out.reverse()
        return out

    def store_now(self, node: TreeNode) -> None:
        """Write-back: write `node` (and its ancestors not yet in L3) to the store before its host copy goes.
        Runs the puts on this thread: eviction needs the answer before it frees the pages."""
        self.wait_for(self.start([n for n in self.tree.path(node) if self.wants(n, 0)]))

    def wait_for(self, job: StorageWriteJob | None) -> None:
        """Wait for `job` and take it back now, with the writes finished before it, in their order (a later write
        may put again a page an earlier one's put evicted: taken back out of order, the page would be marked
        gone while the store holds it)."""
        if job is not None and job.id in self.holders.writes:
            assert self.io is not None
            self.io.wait(job)
            while True:
                earlier = self.done.popleft()
                self.finish(earlier)
                if earlier is job:
                    return

    def finish(self, job: StorageWriteJob) -> None:
        """Take back a write the store has answered: count it, mark and announce what it stored, unpin, free a
        bounce copy, mark what the store evicted for it as gone, write again a path whose parent the store evicted
        meanwhile, and keep what failed for a retry."""
        del self.holders.writes[job.id]
        bs = self.backup_stats
        acked = self._still_held(job)
        failed = job.error is not None or job.rejected > 0 or job.failed > 0 or job.cut or acked < job.acked
        if job.error is not None or job.failed:  # (pages the store answered FAILED are a value: counted, not logged)
            bs.storage_failed += 1
        if job.error is not None:
            log.warning("L3 write %s failed, nodes left %s: %s", job.id,
                        "unstored" if job.bounce else "in L2 only", job.error)
        bs.storage_rejected += job.rejected
        bs.storage_pages += job.acked
        assert self.host_pool is not None
        bs.storage_bytes += job.acked * self.host_pool.page_bytes
        feed = self.events.log
        if acked and feed is not None:
            feed.stored_pages(job.hashes[:acked], job.origins[:acked])
        for end, seq in job.puts:  # what a later eviction must come after to count
            for h in job.hashes[:min(end, acked)]:
                self._put_at[h] = seq
        at, ps, tree = 0, self.tree.page_size * TOKEN_BYTES, self.tree
        for node in job.nodes:
            at += len(node.key) // ps  # (after a split in flight the head and the rest are both listed)
            if at <= acked and not node.stored and tree.attached(node):
                tree.mark_stored(node)
            self.holders.unpin(tree, node, job)
        if job.pages is not None:
            self.host_pool.free(job.pages, job.owner)
        for seq, hashes in job.evictions:
            self.store_evicted(hashes, seq)
        self._finished += 1
        if not self.holders.writes or not self._finished % 1024:
            self._prune()
        if job.parent_missing:
            # L3 evicted a page above these nodes since it was written: the path is written again from its host
            # copies (backed nodes form a prefix, so every ancestor has one), or bounced again from its device
            # copies (buffer mode: every node has one), root first.
            bs.storage_rewrites += 1
            last = job.nodes[-1]
            tree.mark_unstored(tree.path(last))
            self.rewrites[last.id] = last
        elif failed:
            last = job.nodes[-1]
            if tree.attached(last) and not last.stored:
                self.failed[last.id] = last
            self._retry_wait = min(max(1, 2 * self._retry_wait), RETRY_MAX_POLLS)
            self._retry_in = self._retry_wait
        else:
            self._retry_wait = 0
            self._retry_in = 0  # the store answers: what failed before is tried again at the next poll

    def store_evicted(self, hashes: list[PageHash], seq: int) -> None:
        """The store evicted these pages to make room for the put numbered `seq`: the nodes holding them (and
        below) are not stored any more, and the feed reports removed those it announced. A page put again by a
        later put already taken back is back in the store, and stays."""
        put_at, evicted_at = self._put_at, self._evicted_at
        gone = [h for h in hashes if put_at.get(h, -1) < seq]
        for h in hashes:
            if evicted_at.get(h, -1) < seq:
                evicted_at[h] = seq
        self.backup_stats.storage_evicted += len(gone)
        self.tree.unstore_pages(gone)
        feed = self.events.log
        if feed is not None:
            feed.removed_from_store(gone)

    def _still_held(self, job: StorageWriteJob) -> int:
        """How many leading pages of `job` the store still holds as far as this cache knows: those it
        acknowledged, up to the first that a put taken back earlier evicted after this job put it (the writes run
        interleaved, batch by batch, and are taken back in the order they finish)."""
        evicted_at, at = self._evicted_at, 0
        for end, seq in job.puts:
            for i in range(at, min(end, job.acked)):
                if evicted_at.get(job.hashes[i], -1) > seq:
                    return i
            at = end
        return job.acked

    def _prune(self) -> None:
        """Forget the puts and evictions no write in flight can be ordered against (all of them when none is in
        flight): what `_still_held` and `store_evicted` compare with stays bounded."""
        floor = min((j.puts[0][1] for j in self.holders.writes.values() if j.puts), default=None)
        if floor is None and not self.holders.writes:
            self._put_at.clear()
            self._evicted_at.clear()
            return
        floor = floor if floor is not None else next(self._clock)
        for book in (self._put_at, self._evicted_at):
            for h in [h for h, seq in book.items() if seq < floor]:
                del book[h]

    def forget(self, ns_id: NamespaceId) -> None:
        """Namespace `ns_id` was dropped: none of its failed or orphaned writes is tried again (offboarding sticks)."""
        def other(node: TreeNode) -> bool:
            return node.namespace is None or node.namespace.id != ns_id
        self.failed = {k: n for k, n in self.failed.items() if other(n)}
        self.rewrites = {k: n for k, n in self.rewrites.items() if other(n)}

    def take_back(self) -> int:
        """Take back the writes the store has answered, in the order they finished. Returns how many."""
        return take_back(self.done, self.finish)

    def take_rewrites(self) -> list[TreeNode]:
        """The last nodes of the paths to write again because the store evicted a parent meanwhile (each once)."""
        nodes, self.rewrites = list(self.rewrites.values()), {}
        return nodes

    def due_retries(self) -> list[TreeNode]:
        """poll: when the wait since the last failure is over, the last nodes of the paths whose writes failed that
        are still in the tree and not stored (each written again from its root, parent first, by the caller),
        counted as retries."""
        if not self.failed:
            return []
        if self._retry_in > 0:
            self._retry_in -= 1
            return []
        nodes, self.failed = list(self.failed.values()), {}
        due = [node for node in nodes if self.tree.attached(node) and not node.stored]
        self.backup_stats.storage_retries += len(due)
        return due
