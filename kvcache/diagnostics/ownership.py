"""The ownership state of a cache as plain data: every pool's ledger and free list and every reference holder
(tree nodes, live requests, in-flight operations, prefetches, staged records, L3 writes).

`collect_state(cache)` reads it off a live cache; the audit checks it (`audit.check_state`) and a snapshot
serialises it (`snapshot`), so an offline audit of a dump runs exactly the checks of a live audit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import msgspec
import numpy as np

from ..types.ids import NodeId, OwnerCode

if TYPE_CHECKING:
    from ..ledger.pools import SlotPool
    from ..tree import RadixTree

STATE_VERSION = 1
_TREE_ROOT = NodeId(0)  # the parent a namespace root names: the tree's root
_DETACHED = NodeId(-1)  # the parent a node without one names: no node

# --- the state an audit reads --------------------------------------------------------------------------------


class PoolState(msgspec.Struct):
    """One pool's ledger and free list."""

    name: str
    num_pages: int
    page_size: int
    ledger_enabled: bool
    owners: bytes  # int64 little-endian owner code per page
    free_list: bytes  # int64 little-endian pages on the free stack


class NodeState(msgspec.Struct):
    """One tree node (namespace roots included; the tree's root is implicit, id 0)."""

    id: NodeId
    parent: NodeId  # 0 for namespace roots
    namespace: str  # namespace id, hex
    namespace_root: bool
    tokens: int
    device: bytes | None  # int64 little-endian L1 pages, None without a device copy
    host: bytes | None  # int64 little-endian L2 pages, None without a host copy
    lock_ref: int
    pins: int
    host_pins: int = 0
    device_holds: int = 0
    host_holds: int = 0


class HolderState(msgspec.Struct):
    """A reference holder that is not a tree node: a live request, an in-flight op, a staged record."""

    kind: str  # "request", "op:<kind>", "staged"
    id: int
    owner: OwnerCode  # ledger code the holder's pages must carry
    pool: str
    pages: bytes  # int64 little-endian
    locks: list[NodeId] = []  # node ids this holder keeps locked (a request: the end of its cached prefix)
    pins: list[NodeId] = []  # node ids this holder keeps pinned (a copy: its targets)
    host_pins: list[NodeId] = []  # node ids whose host copy this holder reads (an L3 write)
    rid: str | None = None
    device_holds: list[NodeId] = []  # node ids whose path's device copies this holder holds (buffer-mode prefetch)
    host_holds: list[NodeId] = []  # node ids whose path's host copies this holder holds (cache-mode prefetch)


class TreeSizes(msgspec.Struct):
    """The tree's own running totals, to compare with recomputed ones."""

    device_evictable: int
    device_protected: int
    host_evictable: int
    host_protected: int
    device_held: int = 0
    host_held: int = 0


class OwnershipState(msgspec.Struct):
    """Everything the audit checks, as plain data (what a snapshot serialises)."""

    version: int
    page_size: int
    pools: list[PoolState]
    nodes: list[NodeState]
    holders: list[HolderState]
    sizes: TreeSizes


def _b(pages: np.ndarray | None) -> bytes | None:
    return None if pages is None else np.asarray(pages, dtype="<i8").tobytes()


def encode_pages(pages: np.ndarray | None) -> bytes:
    """Pages as a state field stores them (int64 little-endian bytes; b"" for none)."""
    return _b(pages) or b""


def pages_of(data: bytes | None) -> np.ndarray:
    """The pages stored in a state field (int64 little-endian bytes), as an array."""
    return np.frombuffer(data or b"", dtype="<i8")


class OwnershipSource(Protocol):
    """What the audit reads of a cache: its pools, its tree and its other slot holders (`TieredCache` is one)."""

    page_size: int
    device_pool: SlotPool
    host_pool: SlotPool | None
    tree: RadixTree

    def holder_states(self) -> Iterable[HolderState]:
        """Every slot holder that is not a tree node, as plain data."""
        ...


def collect_state(cache: OwnershipSource) -> OwnershipState:
    """Read `cache`'s ledgers, free lists and reference holders."""
    pools = [p for p in (cache.device_pool, cache.host_pool) if p is not None]
    pool_states = [PoolState(p.name, p.num_pages, p.page_size, p.ledger, encode_pages(p.ledger_codes()),
                             encode_pages(p.free_list())) for p in pools]
    tree = cache.tree
    nodes = []
    for ns_root in tree.namespace_roots():
        assert ns_root.namespace is not None  # below the root every node carries its namespace
        nodes.append(NodeState(ns_root.id, _TREE_ROOT, ns_root.namespace.id_hex, True, 0, None, None,
                               ns_root.lock_ref, ns_root.pins, ns_root.host_pins, ns_root.device_holds,
                               ns_root.host_holds))
    for n in tree.nodes():
        assert n.namespace is not None
        nodes.append(NodeState(n.id, n.parent.id if n.parent is not None else _DETACHED,
                               n.namespace.id_hex, False, len(n), _b(n.device), _b(n.host),
                               n.lock_ref, n.pins, n.host_pins, n.device_holds, n.host_holds))
    sizes = TreeSizes(tree.device_evictable, tree.device_protected, tree.host_evictable, tree.host_protected,
                      tree.device_held, tree.host_held)
    return OwnershipState(STATE_VERSION, cache.page_size, pool_states, nodes, list(cache.holder_states()), sizes)
