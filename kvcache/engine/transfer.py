"""Copies between tiers, and the in-flight operations that own the destination pages while a copy runs.

An operation (`TransferOp`) takes its destination pages from FREE under its own ledger owner (`Op(id, kind)`),
pins the tree nodes it reads or fills, and on completion hands each node its slice of the pages (Op -> Node). A
cancelled or failed operation returns its pages to FREE through the ledger.

Copies are real tensor copies. Host-side gathers and scatters run through numpy (fancy indexing over the pool's
page rows, one opaque element per page), several times faster than `torch` indexing with few threads. A copy into a CUDA pool
is queued on the current stream and completes when its event does; a copy out of one waits for itself.
"""

from __future__ import annotations

import enum

import numpy as np
import torch

from ..types.owners import OwnerKind, owner_code
from ..ledger.pools import SlotPool, page_rows
from ..tree import TreeNode


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
        self.node = node  # pinned until the operation completes or is cancelled
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
        return self.event is None or self.event.query()

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

    def __repr__(self) -> str:
        return f"TransferOp(#{self.id} {self.kind.value} {len(self.pages)} pages in {self.pool.name})"


_RUN_COPY_MIN_BYTES = 4096  # rows at least this long are copied run by run; shorter ones by fancy indexing


def copy_rows(dst: np.ndarray, dst_rows: np.ndarray, src: np.ndarray, src_rows: np.ndarray) -> None:
    """dst[dst_rows] = src[src_rows] for 1-D arrays of page rows (`pools.page_rows`), without the temporary a
    fancy-indexed copy makes.

    Long rows go run by run (stretches where both sides are consecutive), one memcpy each: pages allocated
    together are mostly consecutive, and this halves the bytes moved. Short rows keep numpy's fancy indexing,
    whose per-call cost is lower than one copy per run.
    """
    if dst.itemsize < _RUN_COPY_MIN_BYTES:
        dst[dst_rows] = src[src_rows]
        return
    n = len(src_rows)
    cuts = (np.flatnonzero((np.diff(src_rows) != 1) | (np.diff(dst_rows) != 1)) + 1).tolist()
    for a, b in zip([0, *cuts], [*cuts, n]):
        s0, d0 = int(src_rows[a]), int(dst_rows[a])
        np.copyto(dst[d0:d0 + b - a], src[s0:s0 + b - a])


def copy_pages(src: SlotPool, src_pages: np.ndarray, dst: SlotPool, dst_pages: np.ndarray) -> torch.cuda.Event | None:
    """Copy whole pages `src_pages` of `src` into `dst_pages` of `dst`. Returns an event to wait on when the copy
    was queued on a CUDA stream, None when it has completed."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"copy of {len(src_pages)} pages into {len(dst_pages)}")
    if not len(src_pages):
        return None
    if dst.page_rows is not None:
        if src.page_rows is not None:
            copy_rows(dst.page_rows, dst_pages, src.page_rows, src_pages)
            return None
        # Device -> host: the gathered rows must have landed before the CPU scatters them, so this direction
        # waits for its own copy (a non-blocking D2H followed by a CPU read would race).
        rows = src.pages.index_select(0, torch.from_numpy(np.ascontiguousarray(src_pages)).to(src.device)).cpu()
        copy_rows(dst.page_rows, dst_pages, page_rows(rows.numpy()), np.arange(len(dst_pages)))
        return None
    # Host (or device) -> device: gather on the source, copy, scatter on the destination stream; the host rows are
    # staged by the H2D copy itself, so nothing on the host side is read after this call returns.
    if src.page_rows is not None:
        rows = torch.from_numpy(src.page_rows[src_pages].view(np.uint8).reshape(len(src_pages), src.page_bytes))
    else:
        rows = src.pages.index_select(0, torch.from_numpy(np.ascontiguousarray(src_pages)).to(src.device))
    dst_idx = torch.from_numpy(np.ascontiguousarray(dst_pages)).to(dst.device, non_blocking=True)
    dst.pages.index_copy_(0, dst_idx, rows.to(dst.device, non_blocking=True))
    event = torch.cuda.Event()
    event.record()
    return event


class StorageWriteJob:
    """An L2 -> L3 write of whole nodes: batched puts, run by the I/O worker.

    Cache mode: it reads the nodes' host copies, owns no page, and pins those copies (`host_pins`) until the
    store has acknowledged every page. Buffer mode: it owns a *bounce* copy of the nodes' pages in L2 (`pages`,
    ledger owner Op(storage_write)), pins nothing, and its pages are freed at the acknowledgement."""

    def __init__(self, ident: int, nodes: list[TreeNode], hashes: list[bytes], views: list,
                 origins: list, batch: int, check_parent: bool, pages: np.ndarray | None = None) -> None:
        self.id = ident
        self.owner = owner_code(OwnerKind.OP_STORAGE_WRITE, ident)  # names this write in audits and the ledger
        self.nodes = nodes  # whose pages are written; marked stored when `poll` takes the finished job back
        self.pages = pages  # buffer mode: the L2 bounce pages this job owns, one per hash; None: reads the tree
        self.hashes = hashes  # page hashes, root first
        self.views = views  # host page bytes, one per hash
        self.origins = origins  # PageOrigin per hash
        self.batch = batch
        self.at = 0  # pages put so far
        self.rejected = 0  # pages the store refused for lack of capacity
        # The first page's parent is a stored page (not the namespace root) that L3 may have evicted since it was
        # written; writing below a missing parent would leave an unreachable (orphan) chain in the store.
        self.check_parent = check_parent
        self.parent_missing = False
        self.finished = False
        self.error: BaseException | None = None

    def step(self, store) -> bool:
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
