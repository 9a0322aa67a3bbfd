"""What a finished device -> host backup becomes, one class per host mode (`BackupTarget`, DESIGN §5).

- `HostCopy` (cache mode): the node's host copy, a cache tier of its own; copies written to L3 when the write
  policy says so.
- `BounceCopy` (buffer mode with a store): a bounce copy, handed to an L3 write that frees it at the
  acknowledgement (Op(backup) -> Op(storage_write)).
- `NoBackup` (no host tier, or a bounce buffer with nothing to write to): nothing is ever backed up.

A landing also says which nodes a backup need not copy (`covered`) and which in-flight operation already takes a
node there (`busy`). `kvcache.engine.copies` asks it; no other module re-decides the mode for a finished copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ..errors import InvariantViolation
from .host_mode import BackupTarget
from .operation import OpKind

if TYPE_CHECKING:
    from ..tree import RadixTree, TreeNode
    from ..types.config import CacheConfig
    from .operation import Pinner
    from .transfer import TransferOp
    from .writes import Writes


class Landing(Protocol):
    """Where the pages of a finished backup go, for one host mode."""

    def covered(self, node: TreeNode) -> bool:
        """`node` needs no backup: it already has what one would give it."""

    def busy(self, pinner: Pinner) -> bool:
        """`pinner`, pinning a node, already takes it where a backup would."""

    def land(self, op: TransferOp) -> None:
        """Hand the finished backup's pages over (its targets are still pinned by it)."""

    def landed(self, op: TransferOp) -> None:
        """After the backup gave its pins back: start what follows it."""


class HostCopy:
    """Cache mode: a backup becomes its nodes' host copies; with write-through or selective writes, those go on to
    L3 as they land."""

    def __init__(self, tree: RadixTree, writes: Writes, config: CacheConfig) -> None:
        self.tree = tree
        self.writes = writes
        rule = config.backup_rule
        self._write_on_land = writes.enabled and rule.on_commit  # a landed copy is written to L3 now
        self._min_hits = config.write_through_threshold if rule.needs_hits else 0  # ... when matched this often

    def covered(self, node: TreeNode) -> bool:
        """A node with a host copy is backed up (host copies stay a prefix of each path)."""
        return node.host is not None

    def busy(self, pinner: Pinner) -> bool:
        """Another backup is copying it."""
        return pinner.kind is OpKind.BACKUP

    def land(self, op: TransferOp) -> None:
        """Each node takes its slice of the pages as its host copy (Op -> Node)."""
        tree = self.tree
        for t in op.targets:
            node = t.node
            op.pool.transfer(t.pages, op.owner, node.owner)
            tree.set_host(node, t.pages)

    def landed(self, op: TransferOp) -> None:
        """Write the new host copies to L3 when the write policy asks for it now."""
        if self._write_on_land:
            writes, min_hits = self.writes, self._min_hits
            writes.start([t.node for t in op.targets if writes.wants(t.node, min_hits)])


class BounceCopy:
    """Buffer mode: a backup is a bounce copy for L3, never a host copy of the tree."""

    def __init__(self, tree: RadixTree, writes: Writes, config: CacheConfig) -> None:
        self.writes = writes

    def covered(self, node: TreeNode) -> bool:
        """What L3 holds needs no bounce (what is stored stays a prefix of each chain)."""
        return node.stored

    def busy(self, pinner: Pinner) -> bool:
        """Being bounced already, or being written."""
        return pinner.kind is OpKind.BACKUP or pinner.kind is OpKind.STORAGE_WRITE

    def land(self, op: TransferOp) -> None:
        """An L3 write takes the pages over (Op(backup) -> Op(storage_write)) and frees them at the
        acknowledgement."""
        self.writes.start_bounce(op)

    def landed(self, op: TransferOp) -> None:
        """Nothing follows: the write was started as the pages landed."""


class NoBackup:
    """No host tier, or a bounce buffer with no store: no backup is ever started, so none lands."""

    def __init__(self, tree: RadixTree, writes: Writes, config: CacheConfig) -> None:
        """Nothing to keep: it hands nothing on."""

    def covered(self, node: TreeNode) -> bool:
        """Nothing is backed up, so nothing needs to be."""
        return True

    def busy(self, pinner: Pinner) -> bool:
        """No backup runs."""
        return False

    def land(self, op: TransferOp) -> None:
        """A backup that landed here was started against the host mode's rules."""
        raise InvariantViolation(f"{op!r} finished in a cache whose host mode backs nothing up")

    def landed(self, op: TransferOp) -> None:
        """Never reached (`land` raised)."""


LANDINGS: dict[BackupTarget, type[HostCopy | BounceCopy | NoBackup]] = {
    BackupTarget.TREE: HostCopy,
    BackupTarget.BOUNCE: BounceCopy,
    BackupTarget.NONE: NoBackup,
}


def landing_for(target: BackupTarget, tree: RadixTree, writes: Writes, config: CacheConfig) -> Landing:
    """The landing of the host mode whose backups become `target`."""
    return LANDINGS[target](tree, writes, config)
