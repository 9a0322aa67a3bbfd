"""Admission: the request lifecycle at the top of the engine — admit, commit, release (DESIGN §5).

An admission settles the request's prefetch, loads back its host extension (all-or-nothing), splices its staged
record (buffer mode), locks its cached path and allocates device pages for the rest, making room in the order
`pressure` keeps (evict, wait for copies, cancel prefetch holds). A commit inserts the request's whole pages into
the tree, frees duplicates and the partial tail, unlocks, and backs up per the write policy; a release drops
everything held for the request. It calls down into pressure, room, copies, backups, staging, the prefetch's
settlement and expiry; nothing calls back up into it.
Admission and commit are the hot path: written out, with the enum members and the owner base looked up once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import InvariantViolation, RequestIdInUse, UnknownRequest
from ..types.ids import OwnerCode
from ..types.owners import FREE_CODE, OwnerKind, owner_code
from ..types.request import Request
from ..types.results import Admission, AdmitStatus, CommitResult, DropReason
from ..types.stats import TierHits, add_hits
from .holders import LiveRequest
from .transfer import host_only_path

if TYPE_CHECKING:
    from ..tree import RadixTree, TreeMatch
    from ..types.config import CacheConfig
    from ..types.stats import CacheCounters
    from .backups import Backups
    from .copies import Copies
    from .expiry import Expiry
    from .holders import Holders
    from .prefetch import Prefetcher
    from .pressure import Pressure
    from .room import PoolRoom
    from .settlement import Settlement
    from .staging import Staging

# Enum members looked up once: on Python 3.11 each `Enum.MEMBER` lookup in a hot path goes through the enum type's
# __getattr__ hook (~0.1 us).
_ADMITTED = AdmitStatus.ADMITTED
_REQUEST_BASE = owner_code(OwnerKind.REQUEST, 0)  # a request's ledger code is this | its handle (owner_code)


class Admissions:
    """Admits, commits and releases one cache's requests."""

    def __init__(self, config: CacheConfig, tree: RadixTree, device_room: PoolRoom, holders: Holders,
                 counters: CacheCounters, pressure: Pressure, copies: Copies, backups: Backups, staging: Staging,
                 prefetcher: Prefetcher, settlement: Settlement, expiry: Expiry | None, backs_up: bool) -> None:
        self.page_size = config.layout.page_size
        self.tree = tree
        self.device_pool = device_room.pool
        self.load_back_budget = config.load_back_budget_tokens  # None: a load-back of any length
        self.holders = holders
        self._live = holders.live  # rid -> the request between admit and commit/release (the hot path's reference)
        self.counters = counters
        self.hits: dict[bytes, TierHits] = {}  # namespace id -> the tokens each tier served it
        self._device_room = device_room
        self._pressure = pressure
        self._copies = copies
        self._backups = backups
        self._staging = staging
        self._prefetcher = prefetcher
        self._settlement = settlement
        self._expiry = expiry  # None without a TTL policy
        # a commit starts a backup (write-through, selective) when the host mode backs up at all
        self.backs_up_on_commit = config.backup_rule.on_commit and backs_up

    def admit(self, request: Request) -> Admission:
        """Make room for `request` on the device: settle its prefetch, load back its host extension
        (all-or-nothing), splice its staged record (buffer mode), lock its cached path, allocate device pages for
        the rest. No room is a value: `POOL_FULL` (other live requests hold it; nothing new is held) or
        `TOO_LARGE` (it could never fit). A request id that is already admitted is `RequestIdInUse`."""
        rid, ps, n_tokens, holders = request.rid, self.page_size, len(request.key.data) >> 2, self.holders
        if rid in self._live:
            raise RequestIdInUse(rid, "is already admitted")
        if self._expiry is not None:
            self._expiry.use(request)
        if holders.prefetches or holders.staged:
            self._prefetcher.drop_foreign_holds(request)  # what was fetched for another request never serves it
        # self.match(request), written out (one call less on every admission)
        m = self.tree.match_prefix(request.key)
        c = self.counters
        c.matches += 1
        c.match_tokens += n_tokens
        device_tokens = len(m.device_pages) * ps
        c.device_hit_tokens += device_tokens
        c.host_hit_tokens += len(m.host_pages) * ps
        node = m.device_node
        self.tree.lock(node)
        total_pages = -(-n_tokens // ps)
        if total_pages - len(m.device_pages) > self.device_pool.free_pages:  # room to make, or never
            refused = self._pressure.refuse(request, m, total_pages)
            if refused is not None:
                return Admission(rid, refused)
        from_storage = 0
        op = holders.prefetches.pop(rid, None) if holders.prefetches else None
        if op is not None:
            from_storage = self._settlement.settle_op(op)
            m = self.tree.match_prefix(request.key, touch=False)  # the tree may hold host-only nodes of it now
            device_tokens = len(m.device_pages) * ps
        staged = holders.staged.pop(rid, None) if holders.staged else None
        cached, loaded = m.device_pages, 0
        if len(m.host_pages):
            loaded_pages = self.load_back(m)
            if loaded_pages is not None:
                self.tree.lock(m.host_node)
                self.tree.unlock(node)
                node = m.host_node
                cached = np.concatenate([cached, loaded_pages])
                loaded = len(loaded_pages) * ps
        if staged is not None:
            node, cached, spliced = self._staging.consume(staged, request, node, cached)
            from_storage += spliced
        cached_tokens = len(cached) * ps
        if cached_tokens > n_tokens:
            self.tree.unlock(node)
            raise InvariantViolation(f"admit of request {rid}: {cached_tokens} cached tokens run past the end of its "
                                     f"{n_tokens} tokens; nothing was allocated for it")
        handle = holders.mint_handle()
        owner: OwnerCode = _REQUEST_BASE | handle  # type: ignore[assignment]  # owner_code(REQUEST, handle), without the call
        new_tokens = n_tokens - cached_tokens
        n_fresh = -(-new_tokens // ps)
        # The pool first: room was made above when it was short, so eviction (room.alloc) is the rare path.
        fresh = self.device_pool.alloc(n_fresh, owner)
        if fresh is None:
            fresh = self._device_room.alloc(n_fresh, owner, request.key.namespace)
        if fresh is None:  # the room was made above; only a copy still pinning its pages can take it back
            self.tree.unlock(node)
            self.counters.refused += 1
            return Admission(rid, AdmitStatus.POOL_FULL)
        self._live[rid] = LiveRequest(request, handle, owner, node, cached, fresh)
        c.admitted += 1
        c.loaded_back_tokens += loaded
        storage_tokens = min(from_storage * ps, cached_tokens - device_tokens)
        host_tokens = cached_tokens - device_tokens - storage_tokens
        add_hits(self.hits, request.key.namespace, device_tokens, host_tokens, storage_tokens, self.tree.fingerprints)
        # Pages only, as the two runs the cache holds: the request's pages as one array and its per-token slots are
        # built if and when the caller reads `Admission.pages` / `Admission.slots`.
        return Admission(rid, _ADMITTED, cached_tokens, loaded, new_tokens, cached, fresh, device_tokens,
                         host_tokens, storage_tokens, ps)

    def load_back(self, m: TreeMatch, wait: bool = True) -> np.ndarray | None:
        """Copy the host-only extension of `m` to the device, all-or-nothing. Returns its device pages, or None
        when it does not fit the budget or the device pool, or another load-back is filling those nodes.
        `wait=False` leaves the copy in flight (completed by poll): tests use it to hold a load-back open."""
        n_pages = len(m.host_pages)
        if self.load_back_budget is not None and n_pages * self.page_size > self.load_back_budget:
            self.counters.load_backs_skipped += 1
            return None
        nodes = host_only_path(m)
        copies, tree = self._copies, self.tree
        if copies.loading_back(nodes):
            # another load-back is filling these nodes: never claim them twice; the request recomputes instead
            self.counters.load_backs_refused += 1
            return None
        tree.pin(nodes)  # the host copies must survive any eviction the allocation below triggers
        op_id = self.holders.mint()
        pages = self._device_room.alloc(n_pages, owner_code(OwnerKind.OP_LOAD_BACK, op_id), nodes[0].namespace)
        if pages is None:
            for n in nodes:
                tree.unpin(n)
            self.counters.load_backs_skipped += 1
            return None
        op = copies.start_load_back(op_id, nodes, m.host_pages, pages)
        if not wait:
            return pages
        # The request's forward reads these pages: it runs on the caller's stream, which waits for the copy (on
        # the GPU: the host goes on). Every later copy of these pages runs on the copier's stream, after this one.
        copies.hand_on(op)
        return pages

    def commit(self, rid: str) -> CommitResult:
        """The forward wrote the request's KV: insert its whole pages into the tree (the tree's owners free
        duplicates), free the partial tail, unlock, and back up per the write policy."""
        live = self._live.pop(rid, None)
        if live is None:
            raise UnknownRequest(rid, "cannot commit: not admitted (or already committed/released)")
        request, ps = live.request, self.page_size
        key = request.key
        n_pages = (len(key.data) >> 2) // ps
        if n_pages * ps != len(key.data) >> 2:  # the partial tail page is not cached
            key = key.page_aligned(ps)
        n_cached, fresh = len(live.cached_pages), live.fresh_pages
        # The cached prefix is in the tree already (the request's lock kept it there): only the fresh pages are
        # offered, so the request's pages are never joined into one array.
        ins = self.tree.insert(key, fresh if len(fresh) == n_pages - n_cached else fresh[:n_pages - n_cached],
                               n_cached)
        # The request's fresh pages, in order: duplicates of pages the tree already held (a concurrent insert got
        # there first) -> FREE; the adopted nodes' slices -> those nodes; the partial tail page -> FREE.
        n_dup = max(0, ins.prefix_pages - n_cached)
        adopted = ins.adopted
        if len(adopted) == 1 and adopted[0].device is fresh:  # the hot case: one new leaf took them all
            n_tail = 0
            self.device_pool.transfer(fresh, live.owner, adopted[0].owner)
        else:
            parts, at = [(n_dup, FREE_CODE)], n_dup
            for node in adopted:
                at += len(node.device)  # type: ignore[arg-type]  # an adopted node took the caller's device pages
                parts.append((at, node.owner))
            n_tail = len(fresh) - at
            parts.append((len(fresh), FREE_CODE))
            self.device_pool.disperse(fresh, live.owner, parts)
        self.tree.unlock(live.node)
        c = self.counters
        c.committed += 1
        c.duplicate_pages_freed += n_dup
        backed = self._backups.after_commit(ins.node) if self.backs_up_on_commit else 0
        if self._expiry is not None and self._expiry.tracker.deferred:
            self._expiry.ended(request.namespace)
        return CommitResult(rid, n_pages * ps, n_dup, n_tail, backed)

    def release(self, rid: str) -> None:
        """Drop everything held for a request without caching it — abort at any stage: its prefetch (in flight or
        done), its staged record, its admission (path unlocked, fresh pages freed). Each slot is freed once."""
        found = self._prefetcher.drop_holds(rid, DropReason.ABORTED)
        live = self._live.pop(rid, None)
        if live is not None:
            self.device_pool.disperse(live.fresh_pages, live.owner, [(len(live.fresh_pages), FREE_CODE)])
            self.tree.unlock(live.node)
            self.counters.released += 1
            found = True
            if self._expiry is not None and self._expiry.tracker.deferred:
                self._expiry.ended(live.request.namespace)
        if not found:
            raise UnknownRequest(rid, "cannot release: no prefetch, staged record or admission is held for it")
