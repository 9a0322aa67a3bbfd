"""Every holder of slots in one cache, in one registry, and the one mint of their ids.

A slot is owned by a tree node, by FREE, or by one of the holders kept here (DESIGN §4): a live request (its fresh
device pages), an in-flight copy (`TransferOp`), an L3 write (`StorageWriteJob`), a prefetch (`PrefetchOp`) or a
staged record (`StagedPrefetch`). Each engine module adds and removes its own kind; the audit and snapshots read
them all from here (`states`), in one order, through the `Holder` protocol (`kvcache.engine.operation`), so a new
kind of holder is one table here and that protocol on its class.

Nodes an in-flight copy or L3 write reads or fills are *pinned* by it (`pinners`): the pinners follow the node
through splits (with the ledger owner of the pages the split moved), and tell "being backed up", "being loaded
back" and "being written" apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from ..diagnostics.ownership import HolderState, encode_pages
from ..types.ids import NamespaceId, NodeId, OwnerCode
from ..types.keys import RadixKey
from ..types.request import Request

if TYPE_CHECKING:
    from ..ledger.pools import SlotPool
    from ..tree import RadixTree, TreeNode
    from .operation import Holder, Pinner
    from .prefetch_op import PrefetchOp
    from .staged import StagedPrefetch
    from .transfer import TransferOp
    from .write_job import StorageWriteJob


class LiveRequest(msgspec.Struct, eq=False):
    """A request between admit and commit/release, and what it holds. (A struct: built in C on every admission;
    `eq=False`: compared by identity.)"""

    request: Request
    handle: int  # unique per cache, never reused
    owner: OwnerCode  # the ledger code of Request(handle)
    node: TreeNode  # locked: ends the request's cached prefix
    cached_pages: np.ndarray  # device pages of the cached prefix; owned by tree nodes
    fresh_pages: np.ndarray  # device pages allocated for the rest; owned by this request

    @property
    def pages(self) -> np.ndarray:
        """The request's device pages in order: cached_pages then fresh_pages (built on each call: admission and
        commit never need them as one array)."""
        return np.concatenate([self.cached_pages, self.fresh_pages])

    @property
    def id(self) -> int:
        """Its handle: what the audit names it by."""
        return self.handle

    def holder_state(self, device_pool: str, host_pool: str) -> HolderState:
        """Its fresh device pages, and the node it keeps locked."""
        return HolderState("request", self.handle, self.owner, device_pool, encode_pages(self.fresh_pages),
                           locks=[self.node.id], rid=self.request.rid)


class Holders:
    """The registry of one cache's slot holders, by kind, and the mint of operation and request ids."""

    def __init__(self, device_pool: SlotPool, host_pool: SlotPool | None) -> None:
        self.device_pool = device_pool  # where a split moves the ledger owner of a node's head pages
        self.host_pool = host_pool
        self.live: dict[str, LiveRequest] = {}  # rid -> admitted request, until commit or release
        self.copies: dict[int, TransferOp] = {}  # op id -> copy in flight, in issue order (completion order)
        self.writes: dict[int, StorageWriteJob] = {}  # job id -> L3 write not yet taken back by poll
        self.prefetches: dict[str, PrefetchOp] = {}  # rid -> its prefetch, until admission or abort
        self.staged: dict[str, StagedPrefetch] = {}  # rid -> its parked fetch (buffer mode)
        # node id -> the copies and L3 writes pinning it, in the order they pinned it
        self.pinners: dict[NodeId, list[Pinner]] = {}
        # Host pages held by prefetches and staged records: what `prefetch_max_host_pages` bounds (>= 0).
        self.prefetch_host_pages = 0
        self._next_id = 1  # operations, staged records and L3 writes share one sequence
        self._next_handle = 1  # requests have their own

    def mint(self) -> int:
        """A new id for an operation, staged record or L3 write: unique in this cache, never reused."""
        ident = self._next_id
        self._next_id += 1
        return ident

    def mint_handle(self) -> int:
        """A new request handle: unique in this cache, never reused."""
        handle = self._next_handle
        self._next_handle += 1
        return handle

    def count_prefetch_pages(self, delta: int) -> None:
        """The host pages prefetches and staged records hold grew by `delta` (shrank, when negative)."""
        self.prefetch_host_pages += delta

    def holds(self, rid: str) -> bool:
        """Is anything held for request id `rid`: an admission, a prefetch or a staged record?"""
        return rid in self.live or rid in self.prefetches or rid in self.staged

    def held_key(self, rid: str) -> RadixKey | None:
        """The key of what is held for `rid` (its admission, prefetch or staged record), if anything is."""
        live = self.live.get(rid)
        if live is not None:
            return live.request.key
        op = self.prefetches.get(rid)
        if op is not None:
            return op.key
        staged = self.staged.get(rid)
        return staged.key if staged is not None else None

    def running(self, namespace_id: NamespaceId) -> int:
        """Live requests of the namespace with this id."""
        return sum(1 for r in self.live.values() if r.request.key.namespace.id == namespace_id)

    # --- pins --------------------------------------------------------------------------------------------------

    def add_pinner(self, nodes: list[TreeNode], pinner: Pinner) -> None:
        """Record that `pinner` reads or fills `nodes` (the tree's pin counts are the caller's to take)."""
        pinners = self.pinners
        for node in nodes:
            pinners.setdefault(node.id, []).append(pinner)

    def unpin(self, tree: RadixTree, node: TreeNode, pinner: Pinner) -> None:
        """`pinner` is done with `node`: its pin is given back, and it is no longer listed."""
        pinner.unpin(tree, node)
        pinners = self.pinners[node.id]
        pinners.remove(pinner)
        if not pinners:
            del self.pinners[node.id]

    def pinned_by(self, node: TreeNode) -> list[Pinner]:
        """What pins `node` now (empty when nothing does)."""
        return self.pinners.get(node.id, [])

    def follow_split(self, child: TreeNode, new: TreeNode, head_pages: int) -> None:
        """The tree moved `child`'s first pages to `new` (the tree's `on_split`): their ledger owner moves with
        them, and every pinner of `child` now pins `new` too."""
        if new.device is not None:
            self.device_pool.transfer(new.device, child.owner, new.owner)
        if new.host is not None and self.host_pool is not None:
            self.host_pool.transfer(new.host, child.owner, new.owner)
        for pinner in self.pinners.get(child.id, ()):
            pinner.split_target(child, new, head_pages)
            self.pinners.setdefault(new.id, []).append(pinner)

    # --- what the audit and snapshots read -----------------------------------------------------------------

    def states(self, device_pool: str, host_pool: str) -> Iterator[HolderState]:
        """Every holder as plain data, by kind in a fixed order (requests, copies, prefetches, staged records,
        L3 writes): what `kvcache.diagnostics` checks and serialises."""
        kinds: tuple[Iterable[Holder], ...] = (self.live.values(), self.copies.values(), self.prefetches.values(),
                                               self.staged.values(), self.writes.values())
        for holders in kinds:
            for holder in holders:
                yield holder.holder_state(device_pool, host_pool)
