"""TieredCache: the request lifecycle over the radix tree, the L1/L2 slot pools and the copies between them.

Mirrors a serving scheduler (DESIGN §5): ``match`` → ``admit`` (load back the host extension, lock the path,
allocate device slots for the rest) → the engine's forward writes KV → ``commit`` (insert, free duplicates,
unlock, back up per the write policy) or ``release`` (abort). Every slot move is a ledger move; `audit()` checks
the whole partition at any moment.

Single-threaded by design: the engine's scheduler thread owns the cache. Backups are in flight between
``commit`` and the ``poll`` that sees their copy complete.
"""

from __future__ import annotations

import enum

import msgspec
import numpy as np
import torch

from .config import CacheConfig
from .errors import UnknownRequest
from .owners import FREE_CODE, OwnerKind, owner_code
from .pools import SlotPool
from .request import Request
from .transfer import OpKind, OpTarget, TransferOp, copy_pages
from .tree import RadixTree, TreeMatch, TreeNode

_EMPTY = np.empty(0, dtype=np.int64)


class AdmitStatus(str, enum.Enum):
    """How an admit ended. Both are expected outcomes."""

    ADMITTED = "admitted"
    POOL_FULL = "pool_full"  # not enough device pages even after eviction; nothing is held for the request


class Admission(msgspec.Struct):
    """The result of `admit`: where the request's KV lives on the device."""

    rid: str
    status: AdmitStatus
    cached_tokens: int = 0  # tokens whose KV was already on the device (after load-back), page-aligned
    loaded_back_tokens: int = 0  # of those, tokens loaded back from the host tier by this admit
    new_tokens: int = 0  # tokens the forward must compute
    slots: np.ndarray = _EMPTY  # device slot index of every token of the request, in order


class CommitResult(msgspec.Struct):
    """The result of `commit`."""

    rid: str
    inserted_tokens: int  # page-aligned tokens now in the tree (new and already present)
    duplicate_pages: int  # request pages freed because the tree already held them
    tail_pages: int  # partial tail page(s) freed (not cacheable)
    backup_pages: int  # host pages of the backup started by this commit


class EvictResult(msgspec.Struct):
    """Pages an `evict` call freed, per tier."""

    device_pages: int
    host_pages: int


class CacheCounters(msgspec.Struct):
    """Running totals since the cache was built."""

    matches: int = 0
    match_tokens: int = 0  # tokens asked for by matches
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    admitted: int = 0
    refused: int = 0  # admits that found the device pool full
    committed: int = 0
    released: int = 0
    loaded_back_tokens: int = 0
    load_backs_skipped: int = 0  # host extensions not loaded (budget or no device room)
    duplicate_pages_freed: int = 0
    backups_started: int = 0
    backups_completed: int = 0
    backup_pages: int = 0
    backups_skipped: int = 0  # nodes not backed up for lack of host room
    device_pages_evicted: int = 0
    host_pages_evicted: int = 0


class LiveRequest:
    """A request between admit and commit/release, and what it holds."""

    __slots__ = ("request", "handle", "owner", "node", "cached_pages", "fresh_pages")

    def __init__(self, request: Request, handle: int, node: TreeNode, cached_pages: np.ndarray,
                 fresh_pages: np.ndarray) -> None:
        self.request = request
        self.handle = handle  # unique per cache, never reused; the ledger owner is Request(handle)
        self.owner = owner_code(OwnerKind.REQUEST, handle)
        self.node = node  # locked: ends the request's cached prefix
        self.cached_pages = cached_pages  # device pages of the cached prefix; owned by tree nodes
        self.fresh_pages = fresh_pages  # device pages allocated for the rest; owned by this request


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class TieredCache:
    """The tiered KV cache of one engine: L1 (device) and L2 (host) pools under one namespaced radix tree."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.layout = config.layout
        self.page_size = config.layout.page_size
        device = config.device or _default_device()
        bpt = config.layout.bytes_per_token
        self.device_pool = SlotPool("device", config.device_pages, self.page_size, bpt, device=device,
                                    ledger=config.ledger)
        self.host_pool: SlotPool | None = None
        if config.host_pages:
            self.host_pool = SlotPool("host", config.host_pages, self.page_size, bpt, device="cpu",
                                      pin_memory=torch.device(device).type == "cuda", ledger=config.ledger)
        self.tree = RadixTree(self.page_size, config.layout.layout_id)
        self.tree.on_split = self._on_split
        self.counters = CacheCounters()
        self._live: dict[str, LiveRequest] = {}
        self._next_handle = 1
        self._ops: dict[int, TransferOp] = {}  # in flight, in issue order (completion is in that order)
        self._node_ops: dict[int, list[TransferOp]] = {}  # node id -> ops that target it (split handling)
        self._next_op = 1

    # --- the request lifecycle -------------------------------------------------------------------------------

    def match(self, request: Request) -> TreeMatch:
        """What the cache holds for `request`: device prefix, host-only extension, anchor. Counts hits."""
        m = self.tree.match_prefix(request.key)
        c = self.counters
        c.matches += 1
        c.match_tokens += len(request)
        c.device_hit_tokens += m.device_tokens
        c.host_hit_tokens += m.host_tokens
        return m

    def admit(self, request: Request) -> Admission:
        """Make room for `request` on the device: load back its host extension (all-or-nothing), lock its cached
        path, allocate device pages for the rest. A full pool is a value (`POOL_FULL`), with nothing held."""
        rid = request.rid
        if rid in self._live:
            raise UnknownRequest(rid, "is already admitted")
        m = self.match(request)
        node = m.device_node
        self.tree.lock(node)
        cached = m.device_pages
        loaded = 0
        if len(m.host_pages):
            loaded_pages = self._load_back(m)
            if loaded_pages is not None:
                self.tree.lock(m.host_node)
                self.tree.unlock(node)
                node = m.host_node
                cached = np.concatenate([cached, loaded_pages])
                loaded = len(loaded_pages) * self.page_size
        handle = self._next_handle
        self._next_handle += 1
        owner = owner_code(OwnerKind.REQUEST, handle)
        cached_tokens = len(cached) * self.page_size
        new_tokens = len(request) - cached_tokens  # >= 0: the match never runs past the request
        fresh = self._alloc(self.device_pool, -(-new_tokens // self.page_size), owner)
        if fresh is None:
            self.tree.unlock(node)
            self.counters.refused += 1
            return Admission(rid, AdmitStatus.POOL_FULL)
        self._live[rid] = LiveRequest(request, handle, node, cached, fresh)
        self.counters.admitted += 1
        self.counters.loaded_back_tokens += loaded
        slots = self.device_pool.slots(np.concatenate([cached, fresh]) if len(cached) else fresh)[: len(request)]
        return Admission(rid, AdmitStatus.ADMITTED, cached_tokens, loaded, new_tokens, slots)

    def commit(self, rid: str) -> CommitResult:
        """The forward wrote the request's KV: insert its whole pages into the tree (the tree's owners free
        duplicates), free the partial tail, unlock, and back up per the write policy."""
        live = self._pop_live(rid, "commit")
        request, ps = live.request, self.page_size
        key = request.key.page_aligned(ps)
        n_pages = len(key) // ps
        n_cached = len(live.cached_pages)
        pages = np.concatenate([live.cached_pages, live.fresh_pages]) if n_cached else live.fresh_pages
        ins = self.tree.insert(key, pages[:n_pages])
        # The request's fresh pages, in order: duplicates of pages the tree already held (a concurrent insert got
        # there first) -> FREE; the adopted nodes' slices -> those nodes; the partial tail page -> FREE.
        n_dup = max(0, ins.prefix_pages - n_cached)
        parts, at = [(n_dup, FREE_CODE)], n_dup
        for node in ins.adopted:
            at += len(node.device)  # type: ignore[arg-type]
            parts.append((at, node.owner))
        n_tail = len(live.fresh_pages) - at
        parts.append((len(live.fresh_pages), FREE_CODE))
        self.device_pool.disperse(live.fresh_pages, live.owner, parts)
        self.tree.unlock(live.node)
        self.counters.committed += 1
        self.counters.duplicate_pages_freed += n_dup
        backed = 0
        rule = self.config.backup_rule
        if rule.on_commit and self.host_pool is not None:
            min_hits = self.config.write_through_threshold if rule.needs_hits else 0
            op = self._start_backup(self._unbacked_path(ins.node, min_hits))
            backed = len(op.pages) if op is not None else 0
        return CommitResult(rid, n_pages * ps, n_dup, n_tail, backed)

    def release(self, rid: str) -> None:
        """Drop a live request without caching it (abort, or finished without commit): unlock its path and free
        its fresh pages."""
        live = self._pop_live(rid, "release")
        self.device_pool.disperse(live.fresh_pages, live.owner, [(len(live.fresh_pages), FREE_CODE)])
        self.tree.unlock(live.node)
        self.counters.released += 1

    # --- tiers -----------------------------------------------------------------------------------------------

    def evict(self, device_tokens: int = 0, host_tokens: int = 0) -> EvictResult:
        """Free at least this many tokens per tier from unlocked, unpinned tree nodes, LRU first (fewer when
        fewer are evictable)."""
        ps = self.page_size
        d = self._evict_device(-(-device_tokens // ps)) if device_tokens > 0 else 0
        h = self._evict_host(-(-host_tokens // ps)) if host_tokens > 0 and self.host_pool is not None else 0
        return EvictResult(d, h)

    def poll(self) -> int:
        """Complete the in-flight copies that have finished, in issue order. Returns how many completed."""
        done = 0
        while self._ops:
            op = next(iter(self._ops.values()))
            if not op.done():
                break
            self._complete(op)
            done += 1
        return done

    def flush(self) -> int:
        """Wait for every in-flight copy and complete it. Returns how many completed."""
        done = 0
        while self._ops:
            op = next(iter(self._ops.values()))
            op.wait()
            self._complete(op)
            done += 1
        return done

    def audit(self):
        """Check the ownership partition and the tree's structure now. Returns an `AuditReport`."""
        from .audit import audit_cache  # audit reads the cache; the cache does not need audit to run

        return audit_cache(self)

    # --- introspection (audit, snapshots, tests) --------------------------------------------------------------

    def live_requests(self) -> list[LiveRequest]:
        """Requests between admit and commit/release."""
        return list(self._live.values())

    def inflight_ops(self) -> list[TransferOp]:
        """Copies issued and not yet completed."""
        return list(self._ops.values())

    def staged_records(self) -> list:
        """Parked buffer-mode prefetches (none without an L3 tier)."""
        return []

    def device_slots(self, rid: str) -> np.ndarray:
        """Device slots of a live request's tokens, in order."""
        live = self._live.get(rid)
        if live is None:
            raise UnknownRequest(rid, "is not live")
        pages = np.concatenate([live.cached_pages, live.fresh_pages])
        return self.device_pool.slots(pages)[: len(live.request)]

    # --- internals: allocation and eviction ------------------------------------------------------------------

    def _alloc(self, pool: SlotPool, n: int, owner: int) -> np.ndarray | None:
        pages = pool.alloc(n, owner)
        if pages is None:
            short = n - pool.free_pages
            if pool is self.device_pool:
                self._evict_device(short)
            else:
                self._evict_host(short)
            pages = pool.alloc(n, owner)
        return pages

    def _evict_device(self, n_pages: int) -> int:
        rule = self.config.backup_rule
        backup = self._backup_now if rule.on_evict and self.host_pool is not None else None
        freed = 0
        for ev in self.tree.evict_device(n_pages, backup):
            self.device_pool.free(ev.pages, ev.owner)
            freed += len(ev.pages)
        self.counters.device_pages_evicted += freed
        return freed

    def _evict_host(self, n_pages: int) -> int:
        assert self.host_pool is not None
        freed = 0
        for ev in self.tree.evict_host(n_pages):
            self.host_pool.free(ev.pages, ev.owner)
            freed += len(ev.pages)
        self.counters.host_pages_evicted += freed
        return freed

    # --- internals: copies -----------------------------------------------------------------------------------

    def _unbacked_path(self, node: TreeNode, min_hits: int) -> list[TreeNode]:
        """Nodes of `node`'s path that lack a host copy and are not being backed up, root first, stopping at the
        first one below `min_hits` (backed nodes must stay a prefix)."""
        out = []
        for n in self.tree.path(node):
            if n.host is not None or n.id in self._node_ops and any(
                    op.kind is OpKind.BACKUP for op in self._node_ops[n.id]):
                continue
            if n.hits < min_hits:
                break
            out.append(n)
        return out

    def _start_backup(self, nodes: list[TreeNode]) -> TransferOp | None:
        """Copy the device copies of `nodes` (a root-first run of one path) to newly allocated host pages. Backs
        up the longest leading run that fits in the host pool; the rest is counted as skipped."""
        host = self.host_pool
        if not nodes or host is None:
            return None
        sizes = [len(n.device) for n in nodes]  # type: ignore[arg-type]
        total = sum(sizes)
        if total > host.free_pages:
            self._evict_host(total - host.free_pages)
        fit, room = 0, host.free_pages
        while fit < len(nodes) and sizes[fit] <= room:
            room -= sizes[fit]
            fit += 1
        self.counters.backups_skipped += len(nodes) - fit
        if not fit:
            return None
        nodes, n_pages = nodes[:fit], sum(sizes[:fit])
        op_id = self._next_op
        self._next_op += 1
        owner = owner_code(OwnerKind.OP_BACKUP, op_id)
        pages = host.alloc(n_pages, owner)
        assert pages is not None  # room was checked above
        targets, at = [], 0
        for node, size in zip(nodes, sizes):
            targets.append(OpTarget(node, pages[at: at + size]))
            at += size
        op = TransferOp(op_id, OpKind.BACKUP, host, pages, targets)
        _pin(nodes, +1)
        self._track(op)
        src = np.concatenate([n.device for n in nodes])  # type: ignore[misc]
        op.event = copy_pages(self.device_pool, src, host, pages)
        self.counters.backups_started += 1
        self.counters.backup_pages += n_pages
        return op

    def _backup_now(self, node: TreeNode) -> None:
        """Write-back: back up `node` (and its unbacked ancestors, to keep backed nodes a prefix) and wait."""
        self.flush()  # earlier copies complete first: completion order keeps the host prefix intact
        op = self._start_backup(self._unbacked_path(node, 0))
        if op is not None:
            op.wait()
            self._complete(op)

    def _load_back(self, m: TreeMatch) -> np.ndarray | None:
        """Copy the host-only extension of `m` to the device, all-or-nothing. Returns its device pages, or None
        when it does not fit the budget or the device pool."""
        budget = self.config.load_back_budget_tokens
        n_pages = len(m.host_pages)
        if budget is not None and n_pages * self.page_size > budget:
            self.counters.load_backs_skipped += 1
            return None
        nodes = self._host_only_path(m)
        _pin(nodes, +1)  # the host copies must survive any eviction the allocation below triggers
        op_id = self._next_op
        self._next_op += 1
        owner = owner_code(OwnerKind.OP_LOAD_BACK, op_id)
        pages = self._alloc(self.device_pool, n_pages, owner)
        if pages is None:
            _pin(nodes, -1)
            self.counters.load_backs_skipped += 1
            return None
        targets, at = [], 0
        for node in nodes:
            size = len(node.host)  # type: ignore[arg-type]
            targets.append(OpTarget(node, pages[at: at + size]))
            at += size
        op = TransferOp(op_id, OpKind.LOAD_BACK, self.device_pool, pages, targets)
        self._track(op)
        op.event = copy_pages(self.host_pool, m.host_pages, self.device_pool, pages)  # type: ignore[arg-type]
        op.wait()  # the request's forward reads these pages: the load-back completes before admit returns
        self._complete(op)
        return pages

    def _host_only_path(self, m: TreeMatch) -> list[TreeNode]:
        """The nodes of `m`'s host-only extension, root first."""
        out = []
        node = m.host_node
        while node is not m.device_node:
            out.append(node)
            node = node.parent  # type: ignore[assignment]
        out.reverse()
        return out

    def _track(self, op: TransferOp) -> None:
        """Register an issued op; its target nodes are already pinned by the caller."""
        self._ops[op.id] = op
        for t in op.targets:
            self._node_ops.setdefault(t.node.id, []).append(op)

    def _complete(self, op: TransferOp) -> None:
        """Hand each target node its pages (Op -> Node) and unpin it."""
        del self._ops[op.id]
        for t in op.targets:
            node = t.node
            op.pool.transfer(t.pages, op.owner, node.owner)
            if op.kind is OpKind.BACKUP:
                self.tree.set_host(node, t.pages)
            else:
                self.tree.set_device(node, t.pages)
            node.pins -= 1
            ops = self._node_ops[node.id]
            ops.remove(op)
            if not ops:
                del self._node_ops[node.id]
        if op.kind is OpKind.BACKUP:
            self.counters.backups_completed += 1

    def _on_split(self, child: TreeNode, new: TreeNode, head_pages: int) -> None:
        """The tree moved child's first pages to `new`: move their ledger owner, and retarget in-flight copies."""
        if new.device is not None:
            self.device_pool.transfer(new.device, child.owner, new.owner)
        if new.host is not None and self.host_pool is not None:
            self.host_pool.transfer(new.host, child.owner, new.owner)
        for op in self._node_ops.get(child.id, ()):
            op.split_target(child, new, head_pages)
            self._node_ops.setdefault(new.id, []).append(op)

    def _pop_live(self, rid: str, what: str) -> LiveRequest:
        live = self._live.pop(rid, None)
        if live is None:
            raise UnknownRequest(rid, f"cannot {what}: not admitted (or already committed/released)")
        return live

    def __repr__(self) -> str:
        return (f"TieredCache({self.layout.describe()}, device {self.device_pool.used_pages}/"
                f"{self.device_pool.num_pages} pages, host "
                f"{self.host_pool.used_pages if self.host_pool else 0}/"
                f"{self.host_pool.num_pages if self.host_pool else 0} pages, {len(self._live)} live)")


def _pin(nodes: list[TreeNode], delta: int) -> None:
    for n in nodes:
        n.pins += delta
