"""Copies between L1 and L2: backups (device -> host) and load-backs (host -> device), issued and completed.

A copy is a `TransferOp` (`kvcache.engine.transfer`): it takes its destination pages from FREE under its own ledger
owner, pins the nodes it reads or fills, and on completion hands its pages on — a load-back to its nodes' device
copies, a backup where the host mode's landing (`kvcache.engine.landing`) says — and gives its pins back. Copies
complete in issue order, on `poll` or when a caller must wait (admission's load-back, write-back).

A load-back whose pages admission returns at once is *handed on* (`hand_on`, `hold_source`): its nodes take the
pages before the copy lands, and the op holds what the copy reads until its event completes.

A copy's destination pages are its caller's to take, from the room above (a backup's from L2's room, whose
write-back writes to L3; a load-back's from L1's, whose write-back backs up through here), and are handed to
`start_backup` / `start_load_back` with the op's id.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..types.ids import OwnerCode
from .operation import OpKind
from .transfer import TransferOp, targets

if TYPE_CHECKING:
    from ..ledger.copy import Copier
    from ..tree import RadixTree, TreeNode
    from ..types.config import CacheConfig
    from ..types.stats import BackupStats, CacheCounters
    from .holders import Holders
    from .landing import Landing


class Copies:
    """Issues, tracks and completes the copies between a cache's device and host pools."""

    def __init__(self, config: CacheConfig, landing: Landing, copier: Copier, tree: RadixTree, holders: Holders,
                 counters: CacheCounters, backup_stats: BackupStats) -> None:
        self.config = config
        self.landing = landing  # where a finished backup's pages go (the host mode's)
        self.copier = copier  # moves the bytes (a stream of its own on a GPU)
        self.device_pool = copier.device_pool
        self.host_pool = copier.host_pool
        self.tree = tree
        self.holders = holders
        self.counters = counters
        self.backup_stats = backup_stats

    # --- backups: device -> host ---------------------------------------------------------------------------

    def backup_candidates(self, node: TreeNode, min_hits: int) -> list[TreeNode]:
        """Nodes of `node`'s path a backup should copy, root first, stopping at the first one below `min_hits`:
        those the landing does not find covered (cache mode: without a host copy, so host copies stay a prefix;
        buffer mode: not yet in L3, so what is in L3 stays a prefix of each chain), and that no operation already
        takes there."""
        covered, busy, pinners = self.landing.covered, self.landing.busy, self.holders.pinners
        out = []
        for n in self.tree.path(node):
            if covered(n) or (n.id in pinners and any(busy(p) for p in pinners[n.id])):
                continue
            if n.hits < min_hits:
                break
            out.append(n)
        return out

    def start_backup(self, op_id: int, nodes: list[TreeNode], sizes: list[int], pages: np.ndarray) -> TransferOp:
        """Copy the device copies of `nodes` (a root-first run of one path, `sizes` pages each) to the host pages
        `pages`, which the caller took for this op (owner `Op(op_id, backup)`)."""
        host = self.host_pool
        assert host is not None  # a backup's pages are host pages
        op = TransferOp(op_id, OpKind.BACKUP, host, pages, targets(nodes, sizes, pages))
        self.tree.pin(nodes)
        self._track(op)
        src = np.concatenate([n.device for n in nodes if n.device is not None])
        op.event = self.copier.copy(self.device_pool, src, host, pages)
        self.counters.backups_started += 1
        self.counters.backup_pages += len(pages)
        return op

    # --- load-back: host -> device ---------------------------------------------------------------------------

    def loading_back(self, nodes: list[TreeNode]) -> bool:
        """Is a load-back filling any of `nodes` now? (A node is never claimed by two.)"""
        return any(p.kind is OpKind.LOAD_BACK for n in nodes for p in self.holders.pinned_by(n))

    def start_load_back(self, op_id: int, nodes: list[TreeNode], host_pages: np.ndarray,
                        pages: np.ndarray) -> TransferOp:
        """Copy the host copies of `nodes` (pinned by the caller; `host_pages`, in path order) to the device pages
        `pages`, which the caller took for this op (owner `Op(op_id, load_back)`)."""
        assert self.host_pool is not None  # a host-only extension lives in the host pool
        op = TransferOp(op_id, OpKind.LOAD_BACK, self.device_pool, pages,
                        targets(nodes, [len(n.host) if n.host is not None else 0 for n in nodes], pages))
        self._track(op)
        op.event = self.copier.copy(self.host_pool, host_pages, self.device_pool, pages)
        return op

    def hand_on(self, op: TransferOp) -> None:
        """A load-back whose pages its caller uses now: the caller's current stream waits for the copy (the GPU
        waits, not the calling thread), and its nodes take their device pages at once (Op -> Node). While the copy
        still runs, the op keeps its pins — the host copies it reads stay put — until `complete_done` sees its
        event; a finished copy completes here."""
        self.copier.order_current_stream(op.event)
        if op.done():
            self.complete(op)
            return
        self._fill(op)
        op.pages = op.pages[:0]
        op.handed_on = True

    def hold_source(self, pages: np.ndarray, owner: OwnerCode, event: torch.cuda.Event) -> None:
        """Host `pages` (owned by `owner`) that a queued host -> device copy still reads, whose holder is done with
        them (a spliced staged record): a handed-on load-back op takes them (owner -> Op(load_back)) and frees them
        when its event completes, so no L3 fetch writes them before the GPU has read them."""
        host = self.host_pool
        assert host is not None  # a splice reads host pages
        op = TransferOp(self.holders.mint(), OpKind.LOAD_BACK, host, pages, [])
        host.transfer(pages, owner, op.owner)
        op.event = event
        op.handed_on = True
        self._track(op)

    # --- completion ------------------------------------------------------------------------------------------

    def complete(self, op: TransferOp) -> None:
        """Hand the op's pages on — a load-back's to its nodes' device copies (Op -> Node), a backup's where the
        landing says; a handed-on load-back frees what it still holds — and give its pins back."""
        del self.holders.copies[op.id]
        backup = op.kind is OpKind.BACKUP
        tree = self.tree
        if backup:
            self.landing.land(op)
        elif op.handed_on:
            if len(op.pages):
                op.pool.free(op.pages, op.owner)
        else:
            self._fill(op)
        unpin = self.holders.unpin
        for t in op.targets:
            unpin(tree, t.node, op)
        if backup:
            self.counters.backups_completed += 1
            self.backup_stats.host_pages += len(op.pages)
            self.backup_stats.host_bytes += len(op.pages) * op.pool.page_bytes
            self.landing.landed(op)

    def complete_done(self) -> int:
        """Complete the copies that have finished, in issue order, stopping at the first still running."""
        done, copies = 0, self.holders.copies
        while copies:
            op = next(iter(copies.values()))
            if not op.done():
                break
            self.complete(op)
            done += 1
        return done

    def complete_all(self) -> int:
        """Wait for every in-flight copy and complete them, in issue order."""
        done, copies = 0, self.holders.copies
        while copies:
            op = next(iter(copies.values()))
            op.wait()
            self.complete(op)
            done += 1
        return done

    def _fill(self, op: TransferOp) -> None:
        """A load-back's pages to its nodes' device copies (Op -> Node)."""
        for t in op.targets:
            op.pool.transfer(t.pages, op.owner, t.node.owner)
            self.tree.set_device(t.node, t.pages)

    def _track(self, op: TransferOp) -> None:
        """Register an issued op; its target nodes are already pinned by the caller."""
        self.holders.copies[op.id] = op
        self.holders.add_pinner([t.node for t in op.targets], op)
