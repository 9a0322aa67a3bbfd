"""What an in-flight operation is to the rest of the engine, whatever its class.

Besides tree nodes and FREE, slots are held by live requests and by operations in flight (DESIGN §4): a copy
between L1 and L2 (`transfer.TransferOp`), an L2 -> L3 write (`write_job.StorageWriteJob`), a prefetch
(`prefetch_op.PrefetchOp`) and the staged record a buffer-mode prefetch becomes (`staged.StagedPrefetch`). Each is
its own ledger owner and implements the small protocols here, which the holders' registry, completion, the audit
and snapshots use without knowing its class:

- every holder shows itself to the audit as a `HolderState` (`Holder`);
- a copy or an L3 write *pins* the nodes it reads or fills, follows them through tree splits, and gives its pin
  back when it completes (`Pinner`);
- a prefetch or a staged record *holds* its anchor's path on one tier until it is spliced, settled or dropped, and
  releases that hold once (`AnchorHolder`, `release_anchor`).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Protocol

from ..types.owners import OwnerKind

if TYPE_CHECKING:
    from ..diagnostics.ownership import HolderState
    from ..tree import RadixTree, TreeNode
    from ..types.ids import NodeId, OwnerCode
    from ..types.tier import Tier


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


class Holder(Protocol):
    """Anything that holds slots besides a tree node: it names its ledger owner and shows what it holds."""

    @property
    def owner(self) -> OwnerCode:
        """The ledger code its pages carry."""

    def holder_state(self, device_pool: str, host_pool: str) -> HolderState:
        """What it holds, as the audit and snapshots read it (`device_pool` / `host_pool`: the pools' names)."""


class Pinner(Holder, Protocol):
    """An operation that pins the tree nodes it reads or fills until it completes (a copy, an L3 write)."""

    @property
    def id(self) -> int:
        """Unique per cache, never reused."""

    @property
    def kind(self) -> OpKind:
        """What it moves: tells "being backed up", "being loaded back" and "being written" apart."""

    def split_target(self, child: TreeNode, new_parent: TreeNode, head_pages: int) -> None:
        """Follow a tree split: `child` lost its first `head_pages` pages to `new_parent`, now pinned too."""

    def unpin(self, tree: RadixTree, node: TreeNode) -> None:
        """Give back the pin this operation took on `node` (the tree's pin counts; the registry's list is the
        caller's)."""


class AnchorHolder(Holder, Protocol):
    """A prefetch or staged record: holds its anchor's path on one tier while it lives."""

    rid: str  # the request it was made for
    anchor: TreeNode | None  # ends the prefix its span hangs below; None once released, or when there is none
    hold: Tier | None  # the tier the anchor's path is held on (None: no hold)

    @property
    def issued_by(self) -> int:
        """The prefetch that took the hold: holds are cancelled youngest first."""


def release_anchor(tree: RadixTree, holder: AnchorHolder) -> None:
    """Release the hold a prefetch or staged record keeps on its anchor's path, once."""
    if holder.anchor is not None and holder.hold is not None:
        tree.release(holder.anchor, holder.hold)
        holder.anchor = None


def anchor_holds(holder: AnchorHolder, tier: Tier) -> list[NodeId]:
    """The node ids whose path `holder` holds on `tier` (its anchor, or none): the audit's hold fields."""
    anchor = holder.anchor
    return [anchor.id] if anchor is not None and holder.hold is tier else []
