"""A copy between L1 and L2 in flight (`TransferOp`): the operation that owns the destination pages while the
bytes move.

It takes its destination pages from FREE under its own ledger owner (`Op(id, kind)`), pins the tree nodes it reads
or fills, and on completion hands each node its slice of the pages (Op -> Node), or, for a bounce copy in buffer
mode, hands them to an L3 write (Op(backup) -> Op(storage_write)). `kvcache.engine.copies` issues and completes it.

On a GPU a load-back's pages are handed on before its copy lands, since admission returns them and the caller's
stream waits for the copy: the op is then *handed on* and holds only what the copy still reads — the nodes whose
host copies it reads (its pins), or a splice's host pages — until its event completes. Nothing frees or reuses
those host pages meanwhile: an L3 fetch writes host pages from the CPU, which no stream orders.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..diagnostics.ownership import HolderState, encode_pages
from ..types.owners import owner_code
from .operation import OP_OWNER_KIND, OpKind

if TYPE_CHECKING:
    from ..ledger.pools import SlotPool
    from ..tree import RadixTree, TreeMatch, TreeNode


class OpTarget:
    """One node an operation fills, and its slice of the operation's pages."""

    __slots__ = ("node", "pages")

    def __init__(self, node: TreeNode, pages: np.ndarray) -> None:
        self.node = node  # pinned until the operation completes
        self.pages = pages  # destination pages for node's key pages, in order


class TransferOp:
    """A copy in flight: owns `pages` in `pool` until it completes."""

    __slots__ = ("id", "kind", "owner", "pool", "pages", "targets", "event", "handed_on")

    def __init__(self, ident: int, kind: OpKind, pool: SlotPool, pages: np.ndarray,
                 targets: list[OpTarget]) -> None:
        self.id = ident  # unique per cache, never reused
        self.kind = kind
        self.owner = owner_code(OP_OWNER_KIND[kind], ident)  # ledger code of this operation
        self.pool = pool  # the destination pool, where `pages` are owned by this op
        self.pages = pages  # destination pages, owned by this op until completion
        self.targets = targets  # nodes to fill, in root-to-leaf order
        self.event: torch.cuda.Event | None = None  # set when the copy runs asynchronously on a CUDA stream
        # True once the destination pages went to their nodes ahead of the event (a load-back), or for a splice's
        # source: `pool`/`pages` are then what the copy still reads (host pages it frees on completion), if any
        self.handed_on = False

    def done(self) -> bool:
        """True once the copy has finished."""
        return self.event is None or bool(self.event.query())  # type: ignore[no-untyped-call]

    def wait(self) -> None:
        """Block until the copy has finished."""
        if self.event is not None:
            self.event.synchronize()

    def split_target(self, child: TreeNode, new_parent: TreeNode, head_pages: int) -> None:
        """Follow a tree split: the target `child` lost its first `head_pages` pages to `new_parent`."""
        for i, target in enumerate(self.targets):
            if target.node is child:
                head = OpTarget(new_parent, target.pages[:head_pages])
                target.pages = target.pages[head_pages:]
                self.targets.insert(i, head)
                return

    def unpin(self, tree: RadixTree, node: TreeNode) -> None:
        """A copy pins the whole node it reads or fills."""
        tree.unpin(node)

    def holder_state(self, device_pool: str, host_pool: str) -> HolderState:
        """The destination pages it owns, and the nodes it pins."""
        return HolderState(f"op:{self.kind.value}", self.id, self.owner, self.pool.name, encode_pages(self.pages),
                           pins=[t.node.id for t in self.targets])

    def __repr__(self) -> str:
        return f"TransferOp(#{self.id} {self.kind.value} {len(self.pages)} pages in {self.pool.name})"


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


def targets(nodes: list[TreeNode], sizes: list[int], pages: np.ndarray) -> list[OpTarget]:
    """Each node's slice of an operation's pages, in path order."""
    out, at = [], 0
    for node, size in zip(nodes, sizes, strict=True):
        out.append(OpTarget(node, pages[at: at + size]))
        at += size
    return out
