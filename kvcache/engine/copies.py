"""Copies between L1 and L2: backups (device -> host) and load-backs (host -> device), and the in-flight operation
that owns the destination pages while a copy runs.

An operation (`TransferOp`) takes its destination pages from FREE under its own ledger owner (`Op(id, kind)`),
pins the tree nodes it reads or fills, and on completion hands each node its slice of the pages (Op -> Node).
Copies complete in issue order, on `poll` or when a caller must wait (admission's load-back, write-back). In
buffer mode a completed backup is a bounce copy: its pages go to an L3 write instead of the node
(Op(backup) -> Op(storage_write)).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..types.owners import OwnerKind, owner_code
from ..types.tier import Tier
from .host_mode import BackupTarget

if TYPE_CHECKING:
    from ..ledger.copy import Copier
    from ..ledger.pools import SlotPool
    from ..tree import RadixTree, TreeMatch, TreeNode
    from ..types.config import CacheConfig
    from ..types.stats import BackupStats, CacheCounters
    from .holders import Holders
    from .host_mode import HostModeRules
    from .room import Room
    from .writes import StorageWriteJob, Writes


class OpKind(str, enum.Enum):
    """What an operation moves; each kind is its own ledger owner kind."""

    BACKUP = "backup"  # device -> host
    STORAGE_WRITE = "storage_write"  # host -> L3
    PREFETCH = "prefetch"  # L3 -> host
    LOAD_BACK = "load_back"  # host -> device


OP_OWNER_KIND: dict[OpKind, OwnerKind] = {
    OpKind.BACKUP: OwnerKind.OP_BACKUP,
    OpKind.STORAGE_WRITE: OwnerKind.OP_STORAGE_WRITE,
    OpKind.PREFETCH: OwnerKind.OP_PREFETCH,
    OpKind.LOAD_BACK: OwnerKind.OP_LOAD_BACK,
}


class OpTarget:
    """One node an operation fills, and its slice of the operation's pages."""

    __slots__ = ("node", "pages")

    def __init__(self, node: TreeNode, pages: np.ndarray) -> None:
        self.node = node  # pinned until the operation completes
        self.pages = pages  # destination pages for node's key pages, in order


class TransferOp:
    """A copy in flight: owns `pages` in `pool` until it completes."""

    __slots__ = ("id", "kind", "owner", "pool", "pages", "targets", "event")

    def __init__(self, ident: int, kind: OpKind, pool: SlotPool, pages: np.ndarray,
                 targets: list[OpTarget]) -> None:
        self.id = ident  # unique per cache, never reused
        self.kind = kind
        self.owner = owner_code(OP_OWNER_KIND[kind], ident)  # ledger code of this operation
        self.pool = pool  # the destination pool, where `pages` are owned by this op
        self.pages = pages  # destination pages, owned by this op until completion
        self.targets = targets  # nodes to fill, in root-to-leaf order
        self.event: torch.cuda.Event | None = None  # set when the copy runs asynchronously on a CUDA stream

    def done(self) -> bool:
        """True once the copy has finished."""
        return self.event is None or bool(self.event.query())  # type: ignore[no-untyped-call]

    def wait(self) -> None:
        """Block until the copy has finished."""
        if self.event is not None:
            self.event.synchronize()

    def order_current_stream(self) -> None:
        """Make the caller's current stream wait for the copy (the GPU waits, the calling thread does not): what it
        queues from now on sees the copied pages."""
        if self.event is not None:
            torch.cuda.current_stream(self.pool.device).wait_event(self.event)

    def split_target(self, child: TreeNode, new_parent: TreeNode, head_pages: int) -> None:
        """Follow a tree split: the target `child` lost its first `head_pages` pages to `new_parent`."""
        for i, target in enumerate(self.targets):
            if target.node is child:
                head = OpTarget(new_parent, target.pages[:head_pages])
                target.pages = target.pages[head_pages:]
                self.targets.insert(i, head)
                return

    def __repr__(self) -> str:
        return f"TransferOp(#{self.id} {self.kind.value} {len(self.pages)} pages in {self.pool.name})"


class Copies:
    """Issues, tracks and completes the copies between a cache's device and host pools."""

    def __init__(self, config: CacheConfig, rules: HostModeRules, copier: Copier, tree: RadixTree, holders: Holders,
                 counters: CacheCounters, backup_stats: BackupStats) -> None:
        self.config = config
        self.rules = rules
        self._bounce = rules.bounce  # read on every backup and completion: an attribute, not the rules' property
        self.copier = copier  # moves the bytes (a stream of its own on a GPU)
        self.device_pool = copier.device_pool
        self.host_pool = copier.host_pool
        self.tree = tree
        self.holders = holders
        self.counters = counters
        self.backup_stats = backup_stats
        self.room: Room  # wired by the cache: allocations evict through it
        self.writes: Writes  # wired by the cache: completed backups feed L3 writes
        self.flush: Callable[[], int]  # wired by the cache: completes every copy and L3 job in flight

    # --- backups: device -> host ---------------------------------------------------------------------------

    def backup_candidates(self, node: TreeNode, min_hits: int) -> list[TreeNode]:
        """Nodes of `node`'s path a backup should copy, root first, stopping at the first one below `min_hits`:
        those without a host copy (cache mode: host copies stay a prefix) or not yet in L3 (buffer mode: what is
        in L3 stays a prefix of each chain), and not already being backed up or written."""
        bounce = self._bounce
        pinners = self.holders.pinners
        out = []
        for n in self.tree.path(node):
            if (n.stored if bounce else n.host is not None) or (n.id in pinners and any(
                    p.kind is OpKind.BACKUP or (bounce and p.kind is OpKind.STORAGE_WRITE) for p in pinners[n.id])):
                continue
            if n.hits < min_hits:
                break
            out.append(n)
        return out

    def start_backup(self, nodes: list[TreeNode]) -> TransferOp | None:
        """Copy the device copies of `nodes` (a root-first run of one path) to newly allocated host pages. Backs
        up the longest leading run that fits in the host pool; the rest is counted as skipped."""
        host = self.host_pool
        if not nodes or host is None:
            return None
        sizes = [len(n.device) if n.device is not None else 0 for n in nodes]
        total = sum(sizes)
        if total > host.free_pages:
            self.room.evict(Tier.HOST, total - host.free_pages, charge=nodes[0].namespace)
        fit, room = 0, host.free_pages
        while fit < len(nodes) and sizes[fit] <= room:
            room -= sizes[fit]
            fit += 1
        self.counters.backups_skipped += len(nodes) - fit
        if not fit:
            return None
        nodes, sizes = nodes[:fit], sizes[:fit]
        n_pages = sum(sizes)
        op_id = self.holders.mint()
        pages = host.alloc(n_pages, owner_code(OwnerKind.OP_BACKUP, op_id))
        assert pages is not None  # room was checked above
        op = TransferOp(op_id, OpKind.BACKUP, host, pages, _targets(nodes, sizes, pages))
        self.tree.pin(nodes)
        self._track(op)
        src = np.concatenate([n.device for n in nodes if n.device is not None])
        op.event = self.copier.copy(self.device_pool, src, host, pages)
        self.counters.backups_started += 1
        self.counters.backup_pages += n_pages
        return op

    def after_commit(self, node: TreeNode) -> int:
        """Back up the path a commit ended at `node` per the write policy (write-through: now; selective: the
        pages matched often enough), and, in cache mode, write its unstored host copies to L3. Returns the host
        pages of the backup started."""
        rule = self.config.backup_rule
        min_hits = self.config.write_through_threshold if rule.needs_hits else 0
        op = self.start_backup(self.backup_candidates(node, min_hits))
        if self.rules.backup is BackupTarget.TREE:
            self.writes.start(self.writes.unstored_path(node, min_hits))
        return len(op.pages) if op is not None else 0

    def backup_now(self, node: TreeNode) -> None:
        """Write-back: back up `node` (and its unbacked ancestors, to keep backed nodes a prefix) and wait."""
        self.flush()  # earlier copies complete first: completion order keeps the host prefix intact
        op = self.start_backup(self.backup_candidates(node, 0))
        if op is not None:
            op.wait()
            self.complete(op)

    def bounce_now(self, node: TreeNode) -> None:
        """Write-back in buffer mode: bounce `node` (and its ancestors not yet in L3) through L2 to L3 and wait for
        the acknowledgement before its device copy goes."""
        if node.stored:
            return
        self.complete_all()
        op = self.start_backup(self.backup_candidates(node, 0))
        if op is None:
            return
        op.wait()
        self.complete(op)
        for job in [j for j in self.holders.writes.values() if j.bounce and node in j.nodes]:
            self.writes.wait_for(job)

    # --- load-back: host -> device ---------------------------------------------------------------------------

    def load_back(self, m: TreeMatch, wait: bool = True) -> np.ndarray | None:
        """Copy the host-only extension of `m` to the device, all-or-nothing. Returns its device pages, or None
        when it does not fit the budget or the device pool, or another load-back is filling those nodes.
        `wait=False` leaves the copy in flight (completed by poll): tests use it to hold a load-back open."""
        budget = self.config.load_back_budget_tokens
        n_pages = len(m.host_pages)
        if budget is not None and n_pages * self.tree.page_size > budget:
            self.counters.load_backs_skipped += 1
            return None
        nodes = host_only_path(m)
        if any(p.kind is OpKind.LOAD_BACK for n in nodes for p in self.holders.pinned_by(n)):
            # another load-back is filling these nodes: never claim them twice; the request recomputes instead
            self.counters.load_backs_refused += 1
            return None
        self.tree.pin(nodes)  # the host copies must survive any eviction the allocation below triggers
        op_id = self.holders.mint()
        owner = owner_code(OwnerKind.OP_LOAD_BACK, op_id)
        pages = self.room.alloc(Tier.DEVICE, n_pages, owner, nodes[0].namespace)
        if pages is None:
            for n in nodes:
                self.tree.unpin(n)
            self.counters.load_backs_skipped += 1
            return None
        op = TransferOp(op_id, OpKind.LOAD_BACK, self.device_pool, pages,
                        _targets(nodes, [len(n.host) if n.host is not None else 0 for n in nodes], pages))
        self._track(op)
        assert self.host_pool is not None  # a host-only extension lives in the host pool
        op.event = self.copier.copy(self.host_pool, m.host_pages, self.device_pool, pages)
        if not wait:
            return pages
        # The request's forward reads these pages: it runs on the caller's stream, which waits for the copy (on
        # the GPU: the host goes on). Every later copy of these pages runs on the copier's stream, after this one.
        op.order_current_stream()
        self.complete(op)
        return pages

    # --- completion ------------------------------------------------------------------------------------------

    def complete(self, op: TransferOp) -> None:
        """Hand each target node its pages (Op -> Node) and unpin it. In buffer mode a backup's pages are a bounce
        copy: they go to an L3 write instead (Op(backup) -> Op(storage_write))."""
        del self.holders.copies[op.id]
        backup = op.kind is OpKind.BACKUP
        bounce = backup and self._bounce
        if bounce:
            self.writes.start([t.node for t in op.targets], bounce=op)
        tree = self.tree
        for t in op.targets:
            node = t.node
            if not bounce:
                op.pool.transfer(t.pages, op.owner, node.owner)
                if backup:
                    tree.set_host(node, t.pages)
                else:
                    tree.set_device(node, t.pages)
            self.unpin(node, op)
        if backup:
            self.counters.backups_completed += 1
            self.backup_stats.host_pages += len(op.pages)
            self.backup_stats.host_bytes += len(op.pages) * op.pool.page_bytes
            rule = self.config.backup_rule
            if not bounce and self.writes.enabled and rule.on_commit:
                min_hits = self.config.write_through_threshold if rule.needs_hits else 0
                self.writes.start([t.node for t in op.targets if self.writes.wants(t.node, min_hits)])

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

    def unpin(self, node: TreeNode, pinner: TransferOp | StorageWriteJob) -> None:
        """`pinner` is done with `node`: its pin is taken back (a cache-mode L3 write pins the host copy only)."""
        if isinstance(pinner, TransferOp):
            self.tree.unpin(node)
        elif pinner.pages is None:
            self.tree.unpin_host(node)
        # (a bounce write pins no node: it is listed only to mark "being written")
        self.holders.remove_pinner(node, pinner)

    def on_split(self, child: TreeNode, new: TreeNode, head_pages: int) -> None:
        """The tree moved child's first pages to `new`: move their ledger owner, and retarget in-flight copies."""
        if new.device is not None:
            self.device_pool.transfer(new.device, child.owner, new.owner)
        if new.host is not None and self.host_pool is not None:
            self.host_pool.transfer(new.host, child.owner, new.owner)
        self.holders.follow_split(child, new, head_pages)

    def _track(self, op: TransferOp) -> None:
        """Register an issued op; its target nodes are already pinned by the caller."""
        self.holders.copies[op.id] = op
        self.holders.add_pinner([t.node for t in op.targets], op)


def host_only_path(m: TreeMatch) -> list[TreeNode]:
    """The nodes of `m`'s host-only extension, root first."""
    out = []
    node = m.host_node
    while node is not m.device_node:
        out.append(node)
        assert node.parent is not None  # the extension hangs below the device node
        node = node.parent
    out.reverse()
    return out


def _targets(nodes: list[TreeNode], sizes: list[int], pages: np.ndarray) -> list[OpTarget]:
    """Each node's slice of an operation's pages, in path order."""
    targets, at = [], 0
    for node, size in zip(nodes, sizes, strict=True):
        targets.append(OpTarget(node, pages[at: at + size]))
        at += size
    return targets
