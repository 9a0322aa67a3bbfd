"""When backups run, per host mode: after a commit, before a victim's device copy goes (write-back), and when a
path's L3 write must be done again (DESIGN §5).

One class per `BackupTarget`, picked once from `BACKUPS`:

- `HostCopyBackups` (cache mode): a commit backs its path up to L2 and writes L2's unstored copies to L3;
  write-back copies a victim to L2 and waits; a path written again goes from its host copies, the nodes without one
  backed up first.
- `BounceBackups` (buffer mode with a store): a commit bounces its path through L2 to L3; write-back bounces a
  victim and waits for the store's acknowledgement; a path written again is bounced again from the device.
- `NoBackups`: nothing is backed up (no host tier, or a bounce buffer with nothing to write to).

A backup takes its host pages from L2's room (evicting L2 when short, whose write-back writes to L3) and hands them
to the copies; where a finished backup's pages go is the landing's (`kvcache.engine.landing`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..types.owners import OwnerKind, owner_code
from .host_mode import BackupTarget

if TYPE_CHECKING:
    from ..tree import TreeNode
    from ..types.config import CacheConfig
    from ..types.stats import CacheCounters
    from .copies import Copies
    from .holders import Holders
    from .room import PoolRoom, WriteBack
    from .transfer import TransferOp
    from .writes import Writes


class Backups:
    """A cache's backups, for its host mode (the subclasses); the base backs nothing up."""

    def __init__(self, config: CacheConfig, copies: Copies, writes: Writes, host_room: PoolRoom | None,
                 holders: Holders, counters: CacheCounters) -> None:
        self.copies = copies
        self.writes = writes
        self.host_room = host_room  # a backup's host pages (None without a host tier: nothing is backed up)
        self.holders = holders
        self.counters = counters
        rule = config.backup_rule
        self.min_hits = config.write_through_threshold if rule.needs_hits else 0  # a commit backs up this hot
        self.back_up_missing = rule.on_commit  # a path written again backs up its nodes without a host copy

    @property
    def write_back(self) -> WriteBack | None:
        """What writes a device victim back before its copy goes (None: nothing to write it to)."""
        return None

    def start(self, nodes: list[TreeNode]) -> TransferOp | None:
        """Back up `nodes` (a root-first run of one path) to newly allocated host pages: the longest leading run
        that fits in the host pool, evicting L2 for it; the rest is counted as skipped."""
        room = self.host_room
        if not nodes or room is None:
            return None
        host = room.pool
        sizes = [len(n.device) if n.device is not None else 0 for n in nodes]
        total = sum(sizes)
        if total > host.free_pages:
            room.evict(total - host.free_pages, charge=nodes[0].namespace)
        fit, left = 0, host.free_pages
        while fit < len(nodes) and sizes[fit] <= left:
            left -= sizes[fit]
            fit += 1
        self.counters.backups_skipped += len(nodes) - fit
        if not fit:
            return None
        op_id = self.holders.mint()
        pages = host.alloc(sum(sizes[:fit]), owner_code(OwnerKind.OP_BACKUP, op_id))
        assert pages is not None  # room was checked above
        return self.copies.start_backup(op_id, nodes[:fit], sizes[:fit], pages)

    def after_commit(self, node: TreeNode) -> int:
        """Back up the path a commit ended at `node`, per the write policy. Returns the host pages it took."""
        return 0

    def write_path(self, node: TreeNode) -> None:
        """Write `node`'s path to L3 again, from its first unstored node."""

    def rewrite_orphans(self) -> int:
        """Write again the paths whose L3 writes were orphaned (the store evicted a parent meanwhile), as their
        writes are taken back. Returns how many paths."""
        return self._write_paths(self.writes.take_rewrites())

    def retry_failed(self) -> int:
        """poll: write again the paths whose failed writes are due for a retry. Returns how many paths."""
        return self._write_paths(self.writes.due_retries())

    def _write_paths(self, nodes: list[TreeNode]) -> int:
        for node in nodes:
            self.write_path(node)
        return len(nodes)


class HostCopyBackups(Backups):
    """Cache mode: L2 is a cache tier of its own, and L3 writes read its copies."""

    @property
    def write_back(self) -> WriteBack | None:
        """Copy the victim (and its unbacked ancestors) to L2 first."""
        return self.back_up_now

    def after_commit(self, node: TreeNode) -> int:
        """Back up the path's nodes without a host copy (hot enough), and write its unstored host copies to L3."""
        copies = self.copies
        op = self.start(copies.backup_candidates(node, self.min_hits))
        self.writes.start(self.writes.unstored_path(node, self.min_hits))
        return len(op.pages) if op is not None else 0

    def back_up_now(self, node: TreeNode) -> None:
        """Write-back: back up `node` (and its unbacked ancestors, to keep backed nodes a prefix) and wait."""
        copies = self.copies
        copies.complete_all()  # earlier copies complete first: completion order keeps the host prefix intact
        op = self.start(copies.backup_candidates(node, 0))
        if op is not None:
            op.wait()
            copies.complete(op)

    def write_path(self, node: TreeNode) -> None:
        """From the host copies; nodes without one any more are backed up first, then written when they land."""
        self.writes.start(self.writes.unstored_path(node, 0))
        missing = self.copies.backup_candidates(node, 0)
        if missing and self.back_up_missing:
            self.start(missing)


class BounceBackups(Backups):
    """Buffer mode: L2 is only a bounce buffer on the way to L3."""

    @property
    def write_back(self) -> WriteBack | None:
        """Bounce the victim to L3 first, and wait for the store."""
        return self.bounce_now

    def after_commit(self, node: TreeNode) -> int:
        """Bounce the path's nodes not yet in L3 (hot enough)."""
        op = self.start(self.copies.backup_candidates(node, self.min_hits))
        return len(op.pages) if op is not None else 0

    def bounce_now(self, node: TreeNode) -> None:
        """Write-back: bounce `node` (and its ancestors not yet in L3) through L2 to L3 and wait for the
        acknowledgement before its device copy goes."""
        if node.stored:
            return
        copies = self.copies
        copies.complete_all()
        op = self.start(copies.backup_candidates(node, 0))
        if op is None:
            return
        op.wait()
        copies.complete(op)
        for job in [j for j in self.holders.writes.values() if j.bounce and node in j.nodes]:
            self.writes.wait_for(job)

    def write_path(self, node: TreeNode) -> None:
        """Bounced again from the device copies (in buffer mode every node has one)."""
        self.start(self.copies.backup_candidates(node, 0))


class NoBackups(Backups):
    """Nothing is backed up: the base's answers."""


BACKUPS: dict[BackupTarget, type[Backups]] = {
    BackupTarget.TREE: HostCopyBackups,
    BackupTarget.BOUNCE: BounceBackups,
    BackupTarget.NONE: NoBackups,
}
