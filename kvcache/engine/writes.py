"""L2 -> L3 writes: the job the I/O worker runs, and its life on the scheduler thread.

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
along (parent first), so a chain is never refused for a
parent that failed once.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from ..storage.api import PageOrigin, PageStore
from ..types.ids import NamespaceId, NodeId, PageHash
from ..types.keys import TOKEN_BYTES
from ..types.owners import OwnerKind, owner_code
from .copies import OpKind

if TYPE_CHECKING:
    from ..ledger.pools import SlotPool
    from ..tree import RadixTree, TreeNode
    from ..types.config import CacheConfig
    from ..types.stats import BackupStats
    from .copies import Copies, TransferOp
    from .event_log import EventFeed
    from .holders import Holders
    from .io_worker import IOWorker

log = logging.getLogger("kvcache")

RETRY_MAX_POLLS = 64  # the longest wait, in polls, before failed writes are tried again while the store fails


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
        self.copies: Copies  # wired by the cache: a bounce write rewritten after an L3 eviction backs up again
        self.events = events  # the KV-event feed: its log, while one is attached
        self.failed: dict[NodeId, TreeNode] = {}  # node id -> the last node of a write that failed, for a retry
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

    def start(self, nodes: list[TreeNode], bounce: TransferOp | None = None) -> StorageWriteJob | None:
        """Queue an L2 -> L3 write of `nodes` (root first). Cache mode: from their host copies, pinned until the
        store acknowledges. Buffer mode: from the completed backup `bounce`, whose pages the write takes over
        (Op(backup) -> Op(storage_write)) and frees at the acknowledgement."""
        if not nodes or self.io is None:
            return None
        if bounce is None:
            nodes = self._unstored_ancestors(nodes[0]) + nodes
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
        rows = host.rows()  # one byte row per page
        job = StorageWriteJob(self.holders.mint(), nodes, hashes, [rows[p] for p in pages.tolist()], origins,
                              self.config.io_batch_pages, check_parent, pages if bounce is not None else None,
                              self._clock)
        if bounce is not None:
            host.transfer(pages, bounce.owner, job.owner)
        else:
            tree.pin_host(nodes)  # the host copy is being read; the device copy may still be evicted
        self.holders.add_pinner(nodes, job)  # follows splits; marks "being written"
        self.holders.writes[job.id] = job
        self.io.submit(job)
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
            done = self.io.done
            while True:
                earlier = next(j for j in done if isinstance(j, StorageWriteJob))
                done.remove(earlier)
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
            self.copies.unpin(node, job)
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
            tree.mark_unstored(tree.path(job.nodes[-1]))
            self._write_path(job.nodes[-1])
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
        """Namespace `ns_id` was dropped: none of its failed writes is tried again (offboarding sticks)."""
        self.failed = {k: n for k, n in self.failed.items() if n.namespace is None or n.namespace.id != ns_id}

    def retry_failed(self) -> int:
        """poll: when the wait since the last failure is over, write again the paths whose writes failed (each
        from its root, parent first) that are still in the tree and not stored. Returns how many paths."""
        if not self.failed:
            return 0
        if self._retry_in > 0:
            self._retry_in -= 1
            return 0
        nodes, self.failed = list(self.failed.values()), {}
        n = 0
        for node in nodes:
            if self.tree.attached(node) and not node.stored:
                self._write_path(node)
                n += 1
        self.backup_stats.storage_retries += n
        return n

    def _write_path(self, node: TreeNode) -> None:
        """Write `node`'s path from its first unstored node: from the host copies (cache mode), or bounced again
        from the device copies (buffer mode); nodes without the copy to write from are backed up first."""
        if self.copies.rules.bounce:
            self.copies.start_backup(self.copies.backup_candidates(node, 0))
        else:
            self.start(self.unstored_path(node, 0))
            missing = self.copies.backup_candidates(node, 0)  # no host copy any more: backed up, then written
            if missing and self.config.backup_rule.on_commit:
                self.copies.start_backup(missing)
