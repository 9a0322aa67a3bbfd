"""TieredCache: the request lifecycle over the radix tree, the L1/L2 slot pools and the copies between them.

Mirrors a serving scheduler (DESIGN §5): ``match`` → ``admit`` (load back the host extension, lock the path,
allocate device slots for the rest) → the engine's forward writes KV → ``commit`` (insert, free duplicates,
unlock, back up per the write policy) or ``release`` (abort). Every slot move is a ledger move; `audit()` checks
the whole partition at any moment.

With an L3 store: ``prefetch`` (before admission) fetches the request's miss from L3 into L2, keyed by the
request's own namespace; admission settles it per the prefetch policy, inserting the pages as host-only nodes
(cache mode) or splicing a staged record (buffer mode); committed pages are written to L3 per the write policy.
In buffer mode L2 is only a bounce buffer: it holds staged records and the bounce copies of L3 writes, each freed
when its splice or its L3 acknowledgement is done.

Under pressure (DESIGN §4): a prefetch holds only the tier its result attaches to, within bounds; every hold is
bound to its request's namespace and tokens. Admission makes room in a fixed order — evict, wait for in-flight
copies and evict again, then cancel prefetch holds youngest first, and only when that makes the room — so a request
that fits the device pool is refused only while other live requests hold the room (`POOL_FULL`); one larger than
the pool is `TOO_LARGE`.

Namespaces may expire (`CacheConfig.ttl`, rules in `kvcache.engine.ttl`): an admit or prefetch is a use of its namespace,
``poll`` sweeps for the namespaces past their deadline and drops them from every tier, deferring those whose
running requests lock their prefix until the last of them ends. Without a policy this costs one attribute test in
admit, prefetch, commit, release and poll.

Single-threaded by design: the engine's scheduler thread owns the cache and calls ``poll`` between steps. Backups
are in flight between ``commit`` and the ``poll`` that sees their copy complete; L3 reads and writes run on the
I/O worker, which touches only the store and the bytes of pages its job owns.
"""

from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Callable

import msgspec
import numpy as np
import torch

from ..types.config import CacheConfig, HostMode, PrefetchPolicy
from ..diagnostics.audit import audit_cache
from ..types.reports import AuditReport
from ..diagnostics.snapshot import Snapshot, take_snapshot, write_snapshot
from .event_log import EventLog, EventSink, store_pages
from ..types.events import MediumNames
from ..errors import (CacheClosed, InvalidInput, InvariantViolation, LayoutMismatch, NamespaceMismatch, RequestIdInUse,
                     StoreError, UnknownRequest)
from .io_worker import IOWorker
from ..types.keys import TOKEN_BYTES, RadixKey, page_hashes
from ..types.namespace import Namespace, NamespaceInfo
from ..types.owners import FREE_CODE, OwnerKind, owner_code
from ..ledger.pools import SlotPool
from .prefetch import CheckJob, FetchJob, PrefetchOp, PrefetchState
from ..types.results import CancelReason, DeclineReason, DropReason, PrefetchOutcome, SettledPrefetch
from ..types.request import Request
from ..types.shares import NamespaceShares, Shares
from .staging import StagedPrefetch
from ..types.stats import BackupStats, CacheCounters, CacheStats, PrefetchStats, TierHits, bump
from ..storage.api import L3Store, PageOrigin
from .transfer import OpKind, OpTarget, StorageWriteJob, TransferOp, copy_pages
from ..tree import HostInsert, RadixTree, Tier, TreeMatch, TreeNode
from .ttl import TTLTracker
from ..types.results import ExpiryCause, NamespaceExpiry, NamespaceTTL
from ..types.results import Admission, AdmitStatus, CommitResult, EvictResult, Headroom, NamespaceDrop, TierRoom

log = logging.getLogger("kvcache")

_EMPTY = np.empty(0, dtype=np.int64)


# Enum members looked up once: on Python 3.11 each `Enum.MEMBER` lookup in a hot path goes through the enum type's
# __getattr__ hook (~0.1 us).
_ADMITTED = AdmitStatus.ADMITTED
_REQUEST = OwnerKind.REQUEST


class BackupTarget(enum.Enum):
    """What a completed device -> host backup becomes, by host mode (DESIGN §5)."""

    TREE = "tree"  # cache mode: the node's host copy, a cache tier of its own
    BOUNCE = "bounce"  # buffer mode with a store: a bounce copy written to L3 and freed at the acknowledgement
    NONE = "none"  # no host tier, or buffer mode without a store: nothing is backed up


class LiveRequest:
    """A request between admit and commit/release, and what it holds."""

    __slots__ = ("request", "handle", "owner", "node", "cached_pages", "fresh_pages", "pages")

    def __init__(self, request: Request, handle: int, owner: int, node: TreeNode, cached_pages: np.ndarray,
                 fresh_pages: np.ndarray, pages: np.ndarray) -> None:
        self.request = request
        self.handle = handle  # unique per cache, never reused
        self.owner = owner  # the ledger code of Request(handle)
        self.node = node  # locked: ends the request's cached prefix
        self.cached_pages = cached_pages  # device pages of the cached prefix; owned by tree nodes
        self.fresh_pages = fresh_pages  # device pages allocated for the rest; owned by this request
        self.pages = pages  # cached_pages then fresh_pages: the request's device pages in order


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class TieredCache:
    """The tiered KV cache of one engine: L1 (device) and L2 (host) pools under one namespaced radix tree."""

    def __init__(self, config: CacheConfig, store: L3Store | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`clock`: what namespace deadlines (`config.ttl`) run on, in seconds; tests inject a fake one."""
        if store is not None and store.layout is not None and store.layout.layout_id != config.layout.layout_id:
            raise LayoutMismatch(store.location, config.layout.describe(), [store.layout.describe()])
        self.config = config
        self.store = store
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
        # node id -> what pins it (copies and storage writes): they follow the node through splits
        self._pinners: dict[int, list[TransferOp | StorageWriteJob]] = {}
        self._next_op = 1
        self._io = IOWorker(store, config.io_thread) if store is not None else None
        self._writes: dict[int, StorageWriteJob] = {}  # storage writes not yet taken back by poll
        self._prefetches: dict[str, PrefetchOp] = {}  # rid -> its prefetch, until admission or abort
        self._staged: dict[str, StagedPrefetch] = {}  # rid -> its parked fetch (buffer mode)
        self._prefetch_pages = 0  # host pages held by prefetch operations and staged records (their budget)
        self._hits: dict[bytes, TierHits] = {}  # namespace id -> tier hits
        self.prefetch_stats = PrefetchStats()
        self.backup_stats = BackupStats()
        self._closed = False
        self._shares: dict[bytes, NamespaceShares] = {}  # namespace id -> its shares, as applied to the tree
        self._shares_due = math.inf  # time.monotonic() of the next refresh from the store
        if store is not None:
            self._refresh_shares_quietly()
        self._ttl = TTLTracker(config.ttl, clock) if config.ttl is not None else None
        self._events: EventLog | None = None  # the KV-event feed, when one is attached (attach_events)
        if self.host_pool is None:
            self._backup_target = BackupTarget.NONE
        elif config.host_mode is HostMode.CACHE:
            self._backup_target = BackupTarget.TREE
        else:
            self._backup_target = BackupTarget.BOUNCE if store is not None else BackupTarget.NONE
        self._backup_on_commit = config.backup_rule.on_commit and self._backup_target is not BackupTarget.NONE

    # --- the request lifecycle -------------------------------------------------------------------------------

    def match(self, request: Request) -> TreeMatch:
        """What the cache holds for `request`: device prefix, host-only extension, anchor. Counts hits."""
        if self._closed:
            raise CacheClosed("match")
        m = self.tree.match_prefix(request.key)
        c, ps = self.counters, self.page_size
        c.matches += 1
        c.match_tokens += len(request.key.data) >> 2  # len(request), without two __len__ calls (hot path)
        c.device_hit_tokens += len(m.device_pages) * ps
        c.host_hit_tokens += len(m.host_pages) * ps
        return m

    def admit(self, request: Request) -> Admission:
        """Make room for `request` on the device: settle its prefetch, load back its host extension
        (all-or-nothing), splice its staged record (buffer mode), lock its cached path, allocate device pages for
        the rest. No room is a value: `POOL_FULL` (other live requests hold it; nothing new is held) or
        `TOO_LARGE` (it could never fit). A request id that is already admitted is `RequestIdInUse`."""
        if self._closed:
            raise CacheClosed("admit")
        rid, ps, n_tokens = request.rid, self.page_size, len(request.key.data) >> 2
        if rid in self._live:
            raise RequestIdInUse(rid, "is already admitted")
        if self._ttl is not None:
            self._ttl_use(request)
        if self._prefetches or self._staged:
            self._drop_foreign_holds(request)  # what was fetched for another request never serves this one
        m = self.match(request)
        node = m.device_node
        self.tree.lock(node)
        total_pages = -(-n_tokens // ps)
        if total_pages - len(m.device_pages) > self.device_pool.free_pages:  # room to make, or never
            if total_pages > self.device_pool.num_pages:
                self.tree.unlock(node)
                self._drop_holds(rid, DropReason.TOO_LARGE)
                self.counters.too_large += 1
                return Admission(rid, AdmitStatus.TOO_LARGE)
            if not self._room_for(m, total_pages, rid, request.key.namespace):
                self.tree.unlock(node)
                self.counters.refused += 1
                return Admission(rid, AdmitStatus.POOL_FULL)
        from_storage = 0
        op = self._prefetches.pop(rid, None)
        if op is not None:
            from_storage = self._settle_prefetch(op)
        staged = self._staged.pop(rid, None)
        if op is not None:  # the tree may hold more of the request now (host-only nodes of its prefetch)
            m = self.tree.match_prefix(request.key, touch=False)
        cached = m.device_pages
        loaded = 0
        if len(m.host_pages):
            loaded_pages = self._load_back(m)
            if loaded_pages is not None:
                self.tree.lock(m.host_node)
                self.tree.unlock(node)
                node = m.host_node
                cached = np.concatenate([cached, loaded_pages])
                loaded = len(loaded_pages) * ps
        if staged is not None:
            node, cached, spliced = self._consume_staged(staged, request, node, cached)
            from_storage += spliced
        cached_tokens = len(cached) * ps
        if cached_tokens > n_tokens:
            self.tree.unlock(node)
            raise InvariantViolation(f"admit of request {rid}: {cached_tokens} cached tokens run past the end of its "
                                     f"{n_tokens} tokens; nothing was allocated for it")
        handle = self._next_handle
        self._next_handle += 1
        owner = owner_code(_REQUEST, handle)
        new_tokens = n_tokens - cached_tokens
        fresh = self._alloc(self.device_pool, -(-new_tokens // ps), owner, request.key.namespace)
        if fresh is None:  # the room was made above; only a copy still pinning its pages can take it back
            self.tree.unlock(node)
            self.counters.refused += 1
            return Admission(rid, AdmitStatus.POOL_FULL)
        pages = np.concatenate([cached, fresh]) if len(cached) else fresh
        self._live[rid] = LiveRequest(request, handle, owner, node, cached, fresh, pages)
        self.counters.admitted += 1
        self.counters.loaded_back_tokens += loaded
        device_tokens = len(m.device_pages) * ps
        storage_tokens = min(from_storage * ps, cached_tokens - device_tokens)
        host_tokens = cached_tokens - device_tokens - storage_tokens
        hits = self._tier_hits(request.key.namespace)
        hits.device += device_tokens
        hits.host += host_tokens
        hits.storage += storage_tokens
        slots = self.device_pool.slots(pages)
        if len(slots) != n_tokens:  # the partial tail page's unused slots
            slots = slots[:n_tokens]
        return Admission(rid, _ADMITTED, cached_tokens, loaded, new_tokens, slots, device_tokens,
                         host_tokens, storage_tokens)

    def commit(self, rid: str) -> CommitResult:
        """The forward wrote the request's KV: insert its whole pages into the tree (the tree's owners free
        duplicates), free the partial tail, unlock, and back up per the write policy."""
        if self._closed:
            raise CacheClosed("commit")
        live = self._pop_live(rid, "commit")
        request, ps = live.request, self.page_size
        key = request.key.page_aligned(ps)
        n_pages = (len(key.data) >> 2) // ps
        n_cached = len(live.cached_pages)
        ins = self.tree.insert(key, live.pages if len(live.pages) == n_pages else live.pages[:n_pages])
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
        if self._backup_on_commit:
            min_hits = self.config.write_through_threshold if self.config.backup_rule.needs_hits else 0
            op = self._start_backup(self._backup_candidates(ins.node, min_hits))
            backed = len(op.pages) if op is not None else 0
            if self._backup_target is BackupTarget.TREE:
                self._start_storage_write(self._unstored_path(ins.node, min_hits))
        if self._ttl is not None and self._ttl.deferred:
            self._ttl_ended(request.namespace)
        return CommitResult(rid, n_pages * ps, n_dup, n_tail, backed)

    def release(self, rid: str) -> None:
        """Drop everything held for a request without caching it — abort at any stage: its prefetch (in flight or
        done), its staged record, its admission (path unlocked, fresh pages freed). Each slot is freed once."""
        self._check_open("release")
        found = self._drop_holds(rid, DropReason.ABORTED)
        live = self._live.pop(rid, None)
        if live is not None:
            self.device_pool.disperse(live.fresh_pages, live.owner, [(len(live.fresh_pages), FREE_CODE)])
            self.tree.unlock(live.node)
            self.counters.released += 1
            found = True
            if self._ttl is not None and self._ttl.deferred:
                self._ttl_ended(live.request.namespace)
        if not found:
            raise UnknownRequest(rid, "cannot release: no prefetch, staged record or admission is held for it")

    def holds(self, rid: str) -> bool:
        """Does the cache hold anything for request id `rid`: a prefetch, a staged record or an admission?"""
        return rid in self._live or rid in self._prefetches or rid in self._staged

    def headroom(self) -> Headroom:
        """Where each tier's pages are now: free, evictable, held only by prefetches, busy. A request of n pages
        with a device prefix of d pages is admitted when n - d <= device.free + device.evictable + device.held
        (after `flush` when copies are in flight); `TOO_LARGE` when n exceeds device.pages."""
        t = self.tree
        return Headroom(_room(self.device_pool, t.device_evictable, t.device_held),
                        _room(self.host_pool, t.host_evictable, t.host_held) if self.host_pool is not None else None)

    # --- tiers -----------------------------------------------------------------------------------------------

    def evict(self, device_tokens: int = 0, host_tokens: int = 0) -> EvictResult:
        """Free at least this many tokens per tier from tree nodes nobody locks, holds or pins, LRU first (fewer
        when fewer are evictable)."""
        self._check_open("evict")
        ps = self.page_size
        d = self._evict_device(-(-device_tokens // ps)) if device_tokens > 0 else 0
        h = self._evict_host(-(-host_tokens // ps)) if host_tokens > 0 and self.host_pool is not None else 0
        return EvictResult(d, h)

    def evict_namespace(self, namespace: Namespace, device: bool = True, host: bool = True) -> EvictResult:
        """Free every page `namespace` holds in L1 (`device`) and L2 (`host`) that nobody locks, holds or pins,
        as eviction would under pressure: a device copy with no host copy is backed up first under write-back; L3
        keeps its pages. To offboard a tenant use `drop_namespace`, which never writes back."""
        self._check_open("evict_namespace")
        mine = _of_namespace(namespace)
        d = self._evict_device(self.device_pool.num_pages, mine) if device else 0
        h = (self._evict_host(self.host_pool.num_pages, mine) if host and self.host_pool is not None else 0)
        return EvictResult(d, h)

    def drop_namespace(self, namespace: Namespace) -> NamespaceDrop:
        """Offboard `namespace` from every tier: give back its prefetches and staged records, let the copies and
        L3 writes in flight land, free its L1 and L2 pages without writing any of them back, then delete it from
        L3. The result is the same whichever of this cache and the store was dropped first. Pages that running
        requests of the namespace lock stay until they end (`live_requests` counts them); a commit after the drop
        caches and writes as usual."""
        self._check_open("drop_namespace")
        ns_id = namespace.id
        held = [rid for rid, op in self._prefetches.items() if op.namespace.id == ns_id]
        held += [rid for rid, staged in self._staged.items() if staged.key.namespace.id == ns_id]
        for rid in held:
            self._drop_holds(rid, DropReason.ABORTED)
        self.flush()  # a write still in flight would land after the delete below
        mine = _of_namespace(namespace)
        d = self._evict_device(self.device_pool.num_pages, mine, write_back=False)
        h = (self._evict_host(self.host_pool.num_pages, mine, write_back=False)
             if self.host_pool is not None else 0)
        gone = store_pages(self.store, namespace) if self._events is not None and self.store is not None else None
        deleted = self.store.delete_namespace(ns_id) if self.store is not None else None
        if gone:
            self._events.dropped_from_store(namespace, gone)  # type: ignore[union-attr]
        live = sum(1 for r in self._live.values() if r.request.namespace.id == ns_id)
        return NamespaceDrop(namespace.info(), namespace.id_hex, d, h, deleted.pages if deleted else 0,
                             deleted.bytes if deleted else 0, live)

    # --- shares (kvcache.types.shares) -----------------------------------------------------------------------------

    def set_shares(self, namespace: Namespace, shares: Shares) -> None:
        """Set `namespace`'s shares (`Shares()` clears them): written to the store when there is one (other
        processes on it pick them up at their next refresh) and applied to this cache's tiers now."""
        self._check_open("set_shares")
        if self.store is not None:
            self.store.set_shares(namespace, shares)
        info = namespace.info(getattr(self.store, "fingerprint_key", None))  # as the store's registry shows it
        self._apply_shares(NamespaceShares(namespace.id_hex, info.extra_key, info.salt_fingerprint, shares,
                                           time.time()))

    def shares(self) -> list[NamespaceShares]:
        """The shares this cache applies, one record per namespace that has any."""
        return list(self._shares.values())

    def refresh_shares(self) -> int:
        """Read every namespace's shares from the store and apply what changed (shares cleared there are cleared
        here). Returns how many namespaces changed. Done at open and, with `CacheConfig.shares_refresh_s`, from
        `poll`; a store that cannot answer then keeps the shares applied and is counted (`share_refresh_errors`)."""
        if self.store is None:
            return 0
        self._shares_due = (time.monotonic() + self.config.shares_refresh_s if self.config.shares_refresh_s > 0
                            else math.inf)
        stored = {r.ns_id_hex: r for r in self.store.shares()}
        changed = 0
        for ns_id, rec in list(self._shares.items()):
            if ns_id.hex() not in stored:
                self._apply_shares(msgspec.structs.replace(rec, shares=Shares()))
                changed += 1
        for rec in stored.values():
            now = self._shares.get(bytes.fromhex(rec.ns_id_hex))
            if now is None or now.shares != rec.shares:
                self._apply_shares(rec)
                changed += 1
        return changed

    def _refresh_shares_quietly(self) -> None:
        try:
            self.refresh_shares()
        except StoreError as exc:  # a store away now: the shares applied stay, the next refresh tries again
            self.counters.share_refresh_errors += 1
            log.warning("refreshing namespace shares from the store failed: %s", exc)

    def _apply_shares(self, record: NamespaceShares) -> None:
        ns_id = bytes.fromhex(record.ns_id_hex)
        if record.shares.empty:
            self._shares.pop(ns_id, None)
            self.tree.set_share(ns_id, None, None)
        else:
            self._shares[ns_id] = record
            label = f"{record.extra_key or '-'}/{record.salt_fingerprint or '-'}"
            self.tree.set_share(ns_id, *record.shares.pages(self.page_size), label)

    def poll(self) -> int:
        """Complete what has finished — copies, in issue order, and L3 jobs — and re-arm due prefetch retries.
        Call between scheduler steps. Returns how many copies and jobs completed."""
        self._check_open("poll")
        done = 0
        while self._ops:
            op = next(iter(self._ops.values()))
            if not op.done():
                break
            self._complete(op)
            done += 1
        if self._io is not None:
            if not self._io.threaded:
                self._io.run_pending()
            done += self._take_io_jobs()
            self._rearm_prefetches()
            if time.monotonic() >= self._shares_due:
                self._refresh_shares_quietly()
        if self._ttl is not None:
            self._ttl_sweep()
        if self._events is not None:
            self._events.flush()  # one batch per scheduler step
        return done

    # --- namespace TTL (kvcache.engine.ttl) ------------------------------------------------------------------------------

    def expire_namespace(self, namespace: Namespace) -> NamespaceExpiry:
        """Expire `namespace` now, by the TTL rules: dropped from every tier (`drop_namespace`), or, while running
        requests lock its prefix, deferred until the last of them ends (a use before that cancels it). Needs a TTL
        policy (`InvalidInput` without one: `drop_namespace` offboards a namespace at once)."""
        self._check_open("expire_namespace")
        if self._ttl is None:
            raise InvalidInput("this cache has no TTL policy (CacheConfig.ttl), so nothing expires; "
                               "drop_namespace offboards a namespace now")
        return self._expire(namespace, ExpiryCause.ON_DEMAND)

    @property
    def ttl_tracker(self) -> TTLTracker | None:
        """The deadlines of the namespaces this cache has used (None without a TTL policy). Read it; the cache
        tells it what happens."""
        return self._ttl

    def namespace_ttls(self) -> list[NamespaceTTL]:
        """Every namespace the TTL policy tracks, with its deadline, soonest first ([] without a policy)."""
        return self._ttl.views(self._ttl.clock()) if self._ttl is not None else []

    def _ttl_use(self, request: Request) -> None:
        """An admit or prefetch of `request` uses its namespace: one past its deadline that no sweep has seen yet
        expires first (the use then starts from nothing); then its deadline moves, and a namespace newly tracked
        beyond the policy's bound expires the others closest to their deadline."""
        ttl, ns = self._ttl, request.key.namespace
        assert ttl is not None
        now = ttl.clock()
        if ttl.overdue(ns, now):
            self._expire(ns, ExpiryCause.DEADLINE)
        if ttl.use(ns, request.ttl_s, now):
            for entry in ttl.overflow(ns):
                self._expire(entry.namespace, ExpiryCause.OVERFLOW)

    def _ttl_ended(self, ns: Namespace) -> None:
        """A running request of `ns` ended: when `ns`'s expiry was deferred and it was the last, the next poll
        expires it."""
        ttl = self._ttl
        assert ttl is not None
        if ns.id in ttl.deferred and not self._running(ns):
            ttl.ended(ns)

    def _ttl_sweep(self) -> None:
        """poll: expire the deferred namespaces whose running requests ended, and, at most every sweep interval,
        those past their deadline."""
        ttl = self._ttl
        assert ttl is not None
        if ttl.ready:
            for entry in ttl.take_ready():
                self._expire(entry.namespace, entry.deferred or ExpiryCause.DEADLINE)
        now = ttl.clock()
        if ttl.sweep_due(now):
            for entry in ttl.due(now):
                self._expire(entry.namespace, ExpiryCause.DEADLINE)

    def _running(self, ns: Namespace) -> int:
        """Running requests (admitted, not committed or released) of `ns`."""
        ns_id = ns.id
        return sum(1 for r in self._live.values() if r.request.key.namespace.id == ns_id)

    def _expire(self, ns: Namespace, cause: ExpiryCause) -> NamespaceExpiry:
        """Drop `ns` from every tier, or defer that while its running requests lock its prefix."""
        ttl = self._ttl
        assert ttl is not None
        running = self._running(ns)
        if running:
            ttl.defer(ns, cause)
            return NamespaceExpiry(ns.info(), ns.display_id, cause, False, True, running)
        drop = self.drop_namespace(ns)
        ttl.expired(ns, cause, drop.device_pages, drop.host_pages, drop.store_pages,
                    drop.store_bytes)
        return NamespaceExpiry(ns.info(), ns.display_id, cause, True, False, 0, drop.device_pages, drop.host_pages,
                               drop.store_pages, drop.store_bytes)

    def flush(self) -> int:
        """Wait for every in-flight copy and L3 write (and the prefetch batches queued now) and complete them.
        Returns how many completed."""
        self._check_open("flush")
        done = self._flush()
        if self._events is not None:
            self._events.flush()
        return done

    def close(self) -> None:
        """Flush, stop the I/O worker and flush the store's access records. The store itself stays open (the
        caller opened it). Prefetches and staged records still held are given back. Close an admin server
        on this cache first (its requests would meet a closed cache). Afterwards every call that acts (admit, prefetch, evict, poll, ...) raises `CacheClosed`; the views
        of the final state (`audit`, `snapshot`, `stats`, `headroom`) still answer, and `close` again does nothing."""
        if self._closed:
            return
        for rid in list(self._prefetches) + list(self._staged):  # never live: admission consumes both
            self._drop_holds(rid, DropReason.ABORTED)
        self._flush()
        if self._io is not None:
            self._io.close()
            self.store.flush()  # type: ignore[union-attr]
        if self._events is not None:
            self._events.cleared()  # nothing of this cache can be served any more
            self._events.flush()
        self._closed = True

    def attach_events(self, sink: EventSink, data_parallel_rank: int = 0,
                      medium_names: MediumNames = MediumNames.KVC) -> EventLog:
        """Report every change of the pages this cache holds as KV events (`kvcache.types.events`): `sink` gets one
        `EventBatch` per `poll` (and per `flush`) that saw changes — a device or host copy attached or detached,
        pages acknowledged by or deleted from the store, `AllBlocksCleared` at `close`. The first batch, handed
        over before this returns, clears and announces what the cache holds now. One feed at a time
        (`kvcache.live.events.KVEventPublisher` is the ZeroMQ one); `detach_events` ends it."""
        self._check_open("attach_events")
        if self._events is not None:
            raise InvalidInput("this cache already has a KV-event feed attached: detach_events() first")
        log = EventLog(self.tree, sink, data_parallel_rank, medium_names)
        log.announce()
        log.flush()
        self._events = log
        self.tree.on_copy = log.copy_changed
        return log

    def detach_events(self) -> None:
        """Hand the events still pending to the feed's sink and end the feed. Does nothing without one."""
        log, self._events = self._events, None
        self.tree.on_copy = None
        if log is not None:
            log.flush()

    def stats(self) -> CacheStats:
        """Hits per namespace and tier, prefetch and backup figures, counters (copies: safe to keep)."""
        ttl = self._ttl.snapshot_stats() if self._ttl is not None else None
        return msgspec.convert(msgspec.to_builtins(CacheStats(list(self._hits.values()), self.prefetch_stats,
                                                              self.backup_stats, self.counters, ttl)), CacheStats)

    def audit(self) -> AuditReport:
        """Check the ownership partition and the tree's structure now."""
        return audit_cache(self)

    def snapshot(self, path: str | None = None) -> Snapshot:
        """The ownership snapshot of the cache now; written atomically to `path` when given. Audit it offline
        with `kvcache.diagnostics.audit.audit_snapshot`."""
        snap = take_snapshot(self)
        if path is not None:
            write_snapshot(snap, path)
        return snap

    def live_requests(self) -> list[LiveRequest]:
        """Requests between admit and commit/release."""
        return list(self._live.values())

    def inflight_ops(self) -> list[TransferOp]:
        """Copies issued and not yet completed."""
        return list(self._ops.values())

    def device_slots(self, rid: str) -> np.ndarray:
        """Device slots of a live request's tokens, in order."""
        self._check_open("device_slots")
        live = self._live.get(rid)
        if live is None:
            raise UnknownRequest(rid, "is not live")
        return self.device_pool.slots(live.pages)[: len(live.request)]

    # --- L3: prefetch, staging, storage writes -------------------------------------------------------------

    def prefetch(self, request: Request, match: TreeMatch | None = None) -> PrefetchOutcome:
        """Start fetching the request's miss from L3 into L2, before its admission.

        The span is the request's whole pages past what the tree holds (past its device prefix in buffer mode),
        hashed from the **request's** namespace. `match` (default: a fresh one) gives the anchor, which must be
        the tree's root or of the request's namespace: otherwise `NamespaceMismatch` is raised before any slot is
        taken, and the caller should count it and serve the request without L3. A match that no longer describes
        the tree or the request declines as `STALE_MATCH`. A request id that already holds something for another
        request (other tokens or namespace) raises `RequestIdInUse`; the same request again declines `IN_FLIGHT`.
        Declining is a value (`issued=False`, `reason`).

        The operation holds its anchor's path on one tier until admission: the host copy (cache mode: the fetched
        pages attach below it) or the device prefix (buffer mode: the splice extends it), within
        `prefetch_max_device_tokens`; nothing when the span starts at the first page.
        """
        self._check_open("prefetch")
        st = self.prefetch_stats
        st.attempts += 1
        rid, ns = request.rid, request.namespace
        held = self._held_key(rid)
        if held is not None and not request.key.starts_with(held):
            raise RequestIdInUse(rid, f"already holds a prefetch, staged record or admission for another request "
                                      f"(namespace {held.namespace.label}, {len(held)} tokens); reuse an id only "
                                      f"once nothing is held for it")
        if match is not None:
            for node, where in ((match.anchor, "prefetch anchor"), (match.host_node, "prefetch attach node")):
                if node.namespace is not None and node.namespace != ns:
                    st.namespace_mismatches += 1
                    log.error("request %s: %s is in namespace %s, the request is in %s: not prefetching", rid,
                              where, node.namespace.label, ns.label)
                    raise NamespaceMismatch(rid, ns.label, node.namespace.label, where)
        if self._ttl is not None:  # after the refusals above: a refused prefetch moves nothing, expires nothing
            self._ttl_use(request)
            held = self._held_key(rid)  # an expiry of the request's own namespace gave back what it held
        stale = False
        if match is None:
            match = self.tree.match_prefix(request.key)
        else:  # checked after the TTL use: an expiry it caused may have left the caller's match behind
            stale = not self._describes(match, request.key)
        buffer = self.config.host_mode is HostMode.BUFFER
        end_node = match.device_node if buffer else match.host_node
        start_page = len(match.device_pages) + (0 if buffer else len(match.host_pages))
        span = len(request) // self.page_size - start_page
        room = self.config.prefetch_max_host_pages - self._prefetch_pages
        hold = None if start_page == 0 else Tier.DEVICE if buffer else Tier.HOST
        reason = None
        if self.store is None:
            reason = DeclineReason.NO_STORE
        elif self.host_pool is None:
            reason = DeclineReason.NO_HOST_TIER
        elif held is not None:
            reason = DeclineReason.IN_FLIGHT
        elif stale:
            reason = DeclineReason.STALE_MATCH
        elif span <= 0:
            reason = DeclineReason.NOTHING_TO_FETCH
        elif span * self.page_size < self.config.prefetch_threshold_tokens:
            reason = DeclineReason.BELOW_THRESHOLD
        elif room <= 0:
            reason = DeclineReason.HOST_LIMIT
        elif hold is Tier.HOST and end_node.host is None:
            reason = DeclineReason.UNBACKED_PREFIX
        elif hold is Tier.DEVICE and (self.tree.device_held + self.tree.unheld_device_pages(end_node)
                                      > self.config.prefetch_max_device_pages):
            reason = DeclineReason.DEVICE_LIMIT
        if reason is not None:
            bump(st.declined, reason.value)
            return PrefetchOutcome(rid, False, reason, namespace=ns.info())
        span = min(span, room)
        end = start_page + span
        key = RadixKey(request.key.data[: end * self.page_size * TOKEN_BYTES], ns)
        hashes = page_hashes(self.layout.layout_id, key, self.page_size)[start_page:]  # the request's own chain
        anchor = end_node if hold is not None else None
        if anchor is not None:
            self.tree.hold(anchor, hold)  # type: ignore[arg-type]
        op = PrefetchOp(self._next_op, rid, key, start_page, hashes, anchor, hold)
        self._next_op += 1
        self._prefetches[rid] = op
        self._submit_check(op)
        st.issued += 1
        return PrefetchOutcome(rid, True, None, op.id, start_page * self.page_size, span * self.page_size,
                               ns.info())

    def settle_prefetch(self, rid: str, policy: PrefetchPolicy | None = None,
                        timeout_ms: float | None = None) -> SettledPrefetch:
        """Finish a request's prefetch now, without admitting it, per the prefetch policy: cache mode inserts
        what arrived as host-only nodes under the request's namespace; buffer mode parks it as the request's
        staged record (see `staged_records`), consumed by its admit or dropped by `release`. How operators warm
        L2 before traffic arrives. `policy` / `timeout_ms` replace the configured ones for this call (the admin
        socket's prefetch waits for what an operator asked for, whatever the engine's policy)."""
        self._check_open("settle_prefetch")
        if timeout_ms is not None and not 0 <= timeout_ms < math.inf:
            raise InvalidInput(f"timeout_ms={timeout_ms} must be >= 0 and finite")
        op = self._prefetches.pop(rid, None)
        if op is None:
            raise UnknownRequest(rid, "has no prefetch to settle")
        try:
            inserted = self._settle_prefetch(op, policy, timeout_ms)
        except BaseException:  # the op is out of the table: give back what it holds, or nobody ever will
            if op.state is not PrefetchState.FINISHED:
                op.terminate()
                self._give_back(op, DropReason.ABORTED)
            raise
        return SettledPrefetch(rid, op.id, op.hit, op.fetched, inserted, rid in self._staged,
                               time.monotonic() - op.created, op.namespace.info())

    def prefetch_ops(self) -> list[PrefetchOp]:
        """Prefetches not yet settled by admission or abort."""
        return list(self._prefetches.values())

    def staged_records(self) -> list[StagedPrefetch]:
        """Parked buffer-mode prefetches."""
        return list(self._staged.values())

    def storage_writes(self) -> list[StorageWriteJob]:
        """L2 -> L3 writes not yet acknowledged."""
        return list(self._writes.values())

    def _held_key(self, rid: str) -> RadixKey | None:
        """The key of what is held for `rid` (its admission, prefetch or staged record), if anything is."""
        live = self._live.get(rid)
        if live is not None:
            return live.request.key
        op = self._prefetches.get(rid)
        if op is not None:
            return op.key
        staged = self._staged.get(rid)
        return staged.key if staged is not None else None

    def _describes(self, m: TreeMatch, key: RadixKey) -> bool:
        """Does `m` still describe the tree for `key`: its nodes in the tree, ending where it says, on the key's
        own tokens, with the device prefix still on the device?"""
        tree, pb = self.tree, self.page_size * TOKEN_BYTES
        end, dev = m.host_node, m.device_node
        if not (tree.attached(end) and tree.attached(dev)):
            return False
        path = tree.path_key(end)
        if len(path) != (len(m.device_pages) + len(m.host_pages)) * pb or not key.data.startswith(path):
            return False
        if len(tree.path_key(dev)) != len(m.device_pages) * pb:
            return False
        return not tree.path(dev) or dev.device is not None

    def _drop_foreign_holds(self, request: Request) -> None:
        """Give back the prefetch or staged record held for `request`'s id when it was fetched for another request
        (a reused id): counted, logged, never used."""
        rid = request.rid
        op = self._prefetches.get(rid)
        if op is not None:
            reason = self._foreign(op.key, f"prefetch {op.id}", request)
            if reason is not None:
                del self._prefetches[rid]
                op.terminate()
                self._give_back(op, reason)
        staged = self._staged.get(rid)
        if staged is not None:
            reason = self._foreign(staged.key, f"staged record {staged.id}", request)
            if reason is not None:
                del self._staged[rid]
                self._drop_staged(staged, reason)

    def _foreign(self, key: RadixKey, what: str, request: Request) -> DropReason | None:
        """Why a prefetch or staged record held for `request`'s id, fetched for `key`, must not serve it: another
        namespace, or tokens that do not start with its key (a reused request id). None when it serves it.
        A mismatch is counted and logged with both namespaces' fingerprints."""
        if key.namespace != request.namespace:
            self.prefetch_stats.namespace_mismatches += 1
            log.error("request %s: %s is in namespace %s, the request is in %s: dropped, not used", request.rid,
                      what, key.namespace.label, request.namespace.label)
            return DropReason.NAMESPACE_MISMATCH
        if not request.key.data.startswith(key.data):
            log.error("request %s: %s was fetched for other tokens (the request id was reused): dropped, not used",
                      request.rid, what)
            return DropReason.KEY_MISMATCH
        return None

    def _submit_check(self, op: PrefetchOp) -> None:
        op.state = PrefetchState.CHECKING
        op.job = CheckJob(op)
        self._io.submit(op.job)  # type: ignore[union-attr]

    def _take_io_jobs(self) -> int:
        """Take finished L3 jobs back on the scheduler thread."""
        io, n = self._io, 0
        while io is not None and io.done:
            job = io.done.popleft()
            n += 1
            if isinstance(job, StorageWriteJob):
                self._finish_storage_write(job)
            elif job.op.state is not PrefetchState.FINISHED and job is job.op.job:
                self._advance_prefetch(job)
        return n

    def _advance_prefetch(self, job: CheckJob | FetchJob) -> None:
        """A prefetch job finished: after a check, allocate host pages for the hit and fetch them; after a fetch,
        end the attempt."""
        op, st = job.op, self.prefetch_stats
        op.job = None
        if job.error is not None:
            st.read_errors += 1
            log.warning("prefetch %s of request %s: L3 read failed: %s", op.id, op.rid, job.error)
        if isinstance(job, CheckJob) and job.hit and not op.terminated:
            st.hit_pages += job.hit
            op.hit = max(op.hit, op.fetched + job.hit)
            room = self.config.prefetch_max_host_pages - self._prefetch_pages
            n = min(job.hit, room)
            pages = (self._alloc(self.host_pool, n, op.owner, op.namespace)  # type: ignore[arg-type]
                     if n > 0 else None)
            if pages is not None:
                op.pages = np.concatenate([op.pages, pages])
                self._prefetch_pages += n
                rows = self.host_pool.pages.numpy()  # type: ignore[union-attr]
                op.state = PrefetchState.FETCHING
                op.job = FetchJob(op, [rows[p] for p in pages.tolist()], self.config.io_batch_pages)
                self._io.submit(op.job)  # type: ignore[union-attr]
                return
        self._end_attempt(op)

    def _end_attempt(self, op: PrefetchOp) -> None:
        """Free what this attempt allocated and did not fill; re-arm a short attempt or mark the op done."""
        extra = op.pages[op.fetched:]
        if len(extra):
            self.host_pool.free(extra, op.owner)  # type: ignore[union-attr]
            self._prefetch_pages -= len(extra)
            op.pages = op.pages[: op.fetched]
        op.attempts += 1
        if op.fetched < op.wanted and op.attempts <= self.config.prefetch_retries and not op.terminated:
            op.state = PrefetchState.WAITING
            op.next_attempt = time.monotonic() + self.config.prefetch_retry_interval_ms / 1000
            return
        op.state = PrefetchState.DONE
        if self.config.host_mode is HostMode.BUFFER and op.fetched:
            # an empty result stays an op (holding nothing but its anchor's hold) until admission or abort
            self._prefetches.pop(op.rid, None)
            self._park(op)

    def _rearm_prefetches(self) -> None:
        now = time.monotonic()
        for op in self._prefetches.values():
            if op.state is PrefetchState.WAITING and op.next_attempt <= now:
                self.prefetch_stats.retried += 1
                self._submit_check(op)

    def _settle_prefetch(self, op: PrefetchOp, policy: PrefetchPolicy | None = None,
                         timeout_ms: float | None = None) -> int:
        """Admission: finish `op` per the prefetch policy and hand what arrived to the tree (cache mode) or to a
        staged record (buffer mode). Returns the pages inserted into the tree."""
        policy = self.config.prefetch_policy if policy is None else PrefetchPolicy(policy)
        if policy is not PrefetchPolicy.BEST_EFFORT and self._io is not None:
            budget = None
            if policy is PrefetchPolicy.TIMEOUT:
                budget = (self.config.prefetch_timeout_ms if timeout_ms is None else timeout_ms) \
                    + self.config.prefetch_timeout_per_page_ms * op.wanted
                budget = max(0.0, op.created + budget / 1000 - time.monotonic())
            deadline = None if budget is None else time.monotonic() + budget
            while op.job is not None:
                # one wait at most an hour (a condition wait overflows past ~9e9 s); the loop goes on to the end
                left = None if deadline is None else min(3600.0, max(0.0, deadline - time.monotonic()))
                if not self._io.wait(op.job, left):
                    break
                self._take_io_jobs()
        op.terminate()
        op.job = None  # a job still queued sees `terminated` and ends without touching the pages
        if op.state not in (PrefetchState.DONE, PrefetchState.FINISHED):
            # stop here: free what was allocated and not filled, never re-arm
            op.attempts = self.config.prefetch_retries + 1
            self._end_attempt(op)
        if op.state is PrefetchState.FINISHED:
            return 0  # buffer mode: parked as a staged record, spliced after the load-back
        return self._insert_prefetched(op)

    def _insert_prefetched(self, op: PrefetchOp) -> int:
        """Cache mode: what arrived becomes a host-only leaf under the request's namespace; pages the tree already
        holds are freed by the operation, never re-owned."""
        st, host = self.prefetch_stats, self.host_pool
        st.seconds += time.monotonic() - op.created
        fetched = op.pages[: op.fetched]
        st.fetched_pages += len(fetched)
        st.fetched_bytes += len(fetched) * host.page_bytes  # type: ignore[union-attr]
        ins = (self.tree.insert_host(op.key, op.start_page, fetched) if len(fetched)
               else HostInsert(None, 0, 0))
        used = ins.duplicates + ins.adopted
        parts = [(ins.duplicates, FREE_CODE)]
        if ins.node is not None:
            parts.append((used, ins.node.owner))
        parts.append((len(fetched), FREE_CODE))
        host.disperse(fetched, op.owner, parts)  # type: ignore[union-attr]
        bump(st.dropped, DropReason.DUPLICATE.value, ins.duplicates)
        bump(st.dropped, DropReason.UNATTACHED.value, len(fetched) - used)
        st.used_pages += ins.adopted
        self._prefetch_pages -= len(op.pages)
        op.pages = op.pages[:0]
        self._release_anchor(op)
        op.state = PrefetchState.FINISHED
        return ins.adopted

    def _give_back(self, op: PrefetchOp, reason: DropReason) -> None:
        """Abort: return every page the op holds to FREE and release its anchor's hold."""
        if len(op.pages):
            self.host_pool.free(op.pages, op.owner)  # type: ignore[union-attr]
            bump(self.prefetch_stats.dropped, reason.value, int(op.fetched))
        self._prefetch_pages -= len(op.pages)
        op.pages = op.pages[:0]
        self._release_anchor(op)
        op.state = PrefetchState.FINISHED

    def _park(self, op: PrefetchOp) -> None:
        """Buffer mode: a finished fetch becomes a staged record (Op(prefetch) -> Staged), keeping the anchor's hold
        and its place in the prefetch host budget."""
        st = self.prefetch_stats
        fetched = op.pages[: op.fetched]
        st.fetched_pages += len(fetched)
        st.fetched_bytes += len(fetched) * self.host_pool.page_bytes  # type: ignore[union-attr]
        st.seconds += time.monotonic() - op.created
        op.state = PrefetchState.FINISHED
        staged = StagedPrefetch(self._next_op, op.rid, op.key, self.page_size, op.start_page, fetched,
                                op.hashes[: len(fetched)], op.id, op.anchor, op.hold)
        self._next_op += 1
        self.host_pool.transfer(fetched, op.owner, staged.owner)  # type: ignore[union-attr]
        op.pages = op.pages[:0]
        op.anchor = None  # the record holds it now
        self._staged[op.rid] = staged

    def _drop_staged(self, staged: StagedPrefetch, reason: DropReason) -> None:
        """Free a staged record's host pages (Staged -> FREE) and release its anchor's hold; never splice it."""
        self.host_pool.free(staged.pages, staged.owner)  # type: ignore[union-attr]
        self._prefetch_pages -= len(staged.pages)
        self._release_anchor(staged)
        bump(self.prefetch_stats.dropped, reason.value, len(staged.pages))

    def _release_anchor(self, holder: PrefetchOp | StagedPrefetch) -> None:
        if holder.anchor is not None:
            self.tree.release(holder.anchor, holder.hold)  # type: ignore[arg-type]
            holder.anchor = None

    def _drop_holds(self, rid: str, reason: DropReason) -> bool:
        """Give back `rid`'s prefetch and staged record, if any. True if there was one."""
        op = self._prefetches.pop(rid, None)
        if op is not None:
            op.terminate()
            self._give_back(op, reason)
        staged = self._staged.pop(rid, None)
        if staged is not None:
            self._drop_staged(staged, reason)
        return op is not None or staged is not None

    def _cancel_youngest_holds(self, n_pages: int, keep: str) -> bool:
        """Admission's last resort: cancel buffer-mode prefetch holds on the device, youngest first (never `keep`'s,
        the admitting request's own), evicting after each, until `n_pages` are free. Each is counted."""
        holders: list[PrefetchOp | StagedPrefetch] = [
            h for h in (*self._prefetches.values(), *self._staged.values())
            if h.hold is Tier.DEVICE and h.anchor is not None and h.rid != keep]
        holders.sort(key=lambda h: h.id if isinstance(h, PrefetchOp) else h.op_id, reverse=True)
        pool = self.device_pool
        for holder in holders:
            self._drop_holds(holder.rid, DropReason.CANCELLED)
            bump(self.prefetch_stats.cancelled, CancelReason.DEVICE_PRESSURE.value)
            self._evict_device(n_pages - pool.free_pages)
            if pool.free_pages >= n_pages:
                return True
        return pool.free_pages >= n_pages

    def _consume_staged(self, staged: StagedPrefetch, request: Request, node: TreeNode,
                        cached: np.ndarray) -> tuple[TreeNode, np.ndarray, int]:
        """Buffer mode, at admission: splice `staged` (checked to serve `request`) after the request's cached device
        pages. Returns the new locked end node, the cached pages, and how many pages were spliced."""
        skip = len(cached) - staged.start_page  # staged pages the device already holds
        if skip < 0:
            self._drop_staged(staged, DropReason.PREFIX_GAP)
            return node, cached, 0
        use = staged.pages[skip:]
        op_id = self._next_op
        self._next_op += 1
        owner = owner_code(OwnerKind.OP_LOAD_BACK, op_id)
        dev = self._alloc(self.device_pool, len(use), owner, staged.key.namespace) if len(use) else None
        if dev is None:
            self._drop_staged(staged, DropReason.DUPLICATE if not len(use) else DropReason.UNATTACHED)
            return node, cached, 0
        copy_pages(self.host_pool, use, self.device_pool, dev)  # type: ignore[arg-type]
        if self.device_pool.device_type == "cuda":
            torch.cuda.current_stream().synchronize()
        # The splice key is rebuilt from the record's own namespace (checked equal to the request's above).
        end = staged.start_page + len(staged.pages)
        key = RadixKey(staged.key.data[: end * self.page_size * TOKEN_BYTES], staged.key.namespace)
        ins = self.tree.insert(key, np.concatenate([cached, dev]))
        n_dup = max(0, ins.prefix_pages - len(cached))
        parts, at = [(n_dup, FREE_CODE)], n_dup
        for adopted in ins.adopted:
            at += len(adopted.device)  # type: ignore[arg-type]
            parts.append((at, adopted.owner))
        parts.append((len(dev), FREE_CODE))
        self.device_pool.disperse(dev, owner, parts)
        self.host_pool.free(staged.pages, staged.owner)  # type: ignore[union-attr]
        self._prefetch_pages -= len(staged.pages)
        # After the splice the tree must own exactly the spliced device slots, in the request's namespace.
        again = self.tree.match_prefix(key)
        held = again.device_pages
        if (len(held) != end or not np.array_equal(held[: len(cached)], cached)
                or not np.array_equal(held[len(cached) + n_dup:], dev[n_dup:])):
            raise InvariantViolation(f"request {request.rid}: after splicing staged record {staged.id} the tree "
                                     f"does not own exactly the spliced device pages")
        self.tree.lock(again.device_node)
        self.tree.unlock(node)
        self._release_anchor(staged)
        self.prefetch_stats.used_pages += len(dev) - n_dup
        bump(self.prefetch_stats.dropped, DropReason.DUPLICATE.value, skip + n_dup)
        return again.device_node, again.device_pages, len(dev) - n_dup

    def _wants_store(self, node: TreeNode, min_hits: int) -> bool:
        return (not node.stored and node.host is not None and node.hits >= min_hits
                and not any(isinstance(p, StorageWriteJob) for p in self._pinners.get(node.id, ())))

    def _unstored_path(self, node: TreeNode, min_hits: int) -> list[TreeNode]:
        """Nodes of `node`'s path with a host copy, not in L3 and not being written, root first."""
        if self.store is None:
            return []
        return [n for n in self.tree.path(node) if self._wants_store(n, min_hits)]

    def _start_storage_write(self, nodes: list[TreeNode], bounce: TransferOp | None = None) -> StorageWriteJob | None:
        """Queue an L2 -> L3 write of `nodes` (root first). Cache mode: from their host copies, pinned until the
        store acknowledges. Buffer mode: from the completed backup `bounce`, whose pages the write takes over
        (Op(backup) -> Op(storage_write)) and frees at the acknowledgement."""
        if not nodes or self._io is None:
            return None
        rows = self.host_pool.pages.numpy()  # type: ignore[union-attr]
        hashes, origins = [], []
        step = self.page_size * TOKEN_BYTES
        for node in nodes:
            node_hashes = self.tree.page_hashes(node)
            parents = [self.tree.chain_parent(node), *node_hashes[:-1]]
            for i in range(len(node_hashes)):
                hashes.append(node_hashes[i])
                origins.append(PageOrigin(node.namespace, parents[i], node.key[i * step:(i + 1) * step]))
        pages = bounce.pages if bounce is not None else np.concatenate([n.host for n in nodes])  # type: ignore
        first_parent = nodes[0].parent
        check_parent = first_parent is not None and first_parent.parent is not None \
            and not first_parent.is_namespace_root
        job = StorageWriteJob(self._next_op, nodes, hashes, [rows[p] for p in pages.tolist()], origins,
                              self.config.io_batch_pages, check_parent, pages if bounce is not None else None)
        self._next_op += 1
        if bounce is not None:
            self.host_pool.transfer(pages, bounce.owner, job.owner)  # type: ignore[union-attr]
        else:
            for n in nodes:
                n.host_pins += 1  # the host copy is being read; the device copy may still be evicted
        for n in nodes:
            self._pinners.setdefault(n.id, []).append(job)  # follows splits; marks "being written"
        self._writes[job.id] = job
        self._io.submit(job)
        return job

    def _store_now(self, node: TreeNode) -> None:
        """Write-back: write `node` (and its ancestors not yet in L3) to the store before its host copy goes.
        Runs the puts on this thread: eviction needs the answer before it frees the pages."""
        self._wait_for(self._start_storage_write([n for n in self.tree.path(node) if self._wants_store(n, 0)]))

    def _wait_for(self, job: StorageWriteJob | None) -> None:
        if job is not None and job.id in self._writes:
            self._io.wait(job)  # type: ignore[union-attr]
            self._io.done.remove(job)  # type: ignore[union-attr]
            self._finish_storage_write(job)

    def _finish_storage_write(self, job: StorageWriteJob) -> None:
        del self._writes[job.id]
        bs = self.backup_stats
        ok = job.error is None and job.rejected == 0
        if job.error is not None:
            bs.storage_failed += 1
            log.warning("L3 write %s failed, nodes left %s: %s", job.id,
                        "unstored" if job.bounce else "in L2 only", job.error)
        bs.storage_rejected += job.rejected
        bs.storage_pages += job.at - job.rejected if job.error is None else 0
        if job.error is None:
            bs.storage_bytes += (job.at - job.rejected) * self.host_pool.page_bytes  # type: ignore[union-attr]
        for node in job.nodes:
            if self._events is not None and ok and not job.parent_missing and not node.stored:
                self._events.stored(node)
            node.stored = node.stored or (ok and not job.parent_missing)
            self._unpin(node, job)
        if job.bounce:
            self.host_pool.free(job.pages, job.owner)  # type: ignore[union-attr, arg-type]
        if job.parent_missing:
            # L3 evicted a page above these nodes since it was written: the path is written again from its host
            # copies (backed nodes form a prefix, so every ancestor has one), or bounced again from its device
            # copies (buffer mode: every node has one), root first.
            bs.storage_rewrites += 1
            for node in self.tree.path(job.nodes[0]):
                node.stored = False
            if job.bounce:
                self._start_backup(self._backup_candidates(job.nodes[-1], 0))
            else:
                self._start_storage_write(self._unstored_path(job.nodes[-1], 0))

    def _tier_hits(self, ns: Namespace) -> TierHits:
        hits = self._hits.get(ns.id)
        if hits is None:
            hits = self._hits[ns.id] = TierHits(ns.info())
        return hits

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise CacheClosed(what)

    # --- internals: room, allocation and eviction ------------------------------------------------------------

    def _room_for(self, m: TreeMatch, total_pages: int, keep: str, charge: Namespace | None = None) -> bool:
        """Make room for an admission of `total_pages` pages whose device prefix is `m`'s (locked by the caller),
        in the documented order: evict; wait for in-flight copies and evict again; then, only when that makes the
        room, cancel prefetch holds youngest first. False, with nothing cancelled, when the room is not there."""
        host_nodes = self._host_only_path(m)
        _pin(host_nodes, +1)  # the request's host extension survives write-back's host evictions
        try:
            return self._make_device_room(total_pages - len(m.device_pages), keep, charge)
        finally:
            _pin(host_nodes, -1)
            for n in host_nodes:
                self.tree.offer(n)

    def _make_device_room(self, need: int, keep: str, charge: Namespace | None = None) -> bool:
        pool = self.device_pool
        self._evict_device(need - pool.free_pages, charge=charge)
        if pool.free_pages < need and self._ops:
            self._complete_copies()  # their pins keep pages from eviction
            self._evict_device(need - pool.free_pages, charge=charge)
        if pool.free_pages >= need:
            return True
        if pool.free_pages + self.tree.device_evictable + self.tree.device_held < need:
            return False
        return self._cancel_youngest_holds(need, keep)

    def _alloc(self, pool: SlotPool, n: int, owner: int, charge: Namespace | None = None) -> np.ndarray | None:
        """`n` pages of `pool` for `owner`, evicting when short; the room is made for namespace `charge` (its
        pages over its share go first)."""
        pages = pool.alloc(n, owner)
        if pages is None:
            short = n - pool.free_pages
            if pool is self.device_pool:
                self._evict_device(short, charge=charge)
            else:
                self._evict_host(short, charge=charge)
            pages = pool.alloc(n, owner)
        return pages

    def _evict_device(self, n_pages: int, where=None, write_back: bool = True, charge: Namespace | None = None) -> int:
        if n_pages <= 0:
            return 0
        backup = None
        if write_back and self.config.backup_rule.on_evict:
            backup = {BackupTarget.TREE: self._backup_now, BackupTarget.BOUNCE: self._bounce_now}.get(
                self._backup_target)
        freed = 0
        for ev in self.tree.evict_device(n_pages, backup, where, charge):
            self.device_pool.free(ev.pages, ev.owner)
            freed += len(ev.pages)
        self.counters.device_pages_evicted += freed
        return freed

    def _evict_host(self, n_pages: int, where=None, write_back: bool = True, charge: Namespace | None = None) -> int:
        assert self.host_pool is not None
        if n_pages <= 0:
            return 0
        rule = self.config.backup_rule
        backup = self._store_now if write_back and rule.on_evict and self.store is not None else None
        freed = 0
        for ev in self.tree.evict_host(n_pages, backup, where, charge):
            self.host_pool.free(ev.pages, ev.owner)
            freed += len(ev.pages)
        self.counters.host_pages_evicted += freed
        return freed

    # --- internals: copies -----------------------------------------------------------------------------------

    def _backup_candidates(self, node: TreeNode, min_hits: int) -> list[TreeNode]:
        """Nodes of `node`'s path a backup should copy, root first, stopping at the first one below `min_hits`:
        those without a host copy (cache mode: host copies stay a prefix) or not yet in L3 (buffer mode: what is
        in L3 stays a prefix of each chain), and not already being backed up or written."""
        bounce = self._backup_target is BackupTarget.BOUNCE
        pinners = self._pinners
        out = []
        for n in self.tree.path(node):
            if (n.stored if bounce else n.host is not None) or (n.id in pinners and any(
                    getattr(p, "kind", None) is OpKind.BACKUP or (bounce and isinstance(p, StorageWriteJob))
                    for p in pinners[n.id])):
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
            self._evict_host(total - host.free_pages, charge=nodes[0].namespace)
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
        self._flush()  # earlier copies complete first: completion order keeps the host prefix intact
        op = self._start_backup(self._backup_candidates(node, 0))
        if op is not None:
            op.wait()
            self._complete(op)

    def _bounce_now(self, node: TreeNode) -> None:
        """Write-back in buffer mode: bounce `node` (and its ancestors not yet in L3) through L2 to L3 and wait for
        the acknowledgement before its device copy goes."""
        if node.stored:
            return
        self._complete_copies()
        op = self._start_backup(self._backup_candidates(node, 0))
        if op is None:
            return
        op.wait()
        self._complete(op)
        for job in [j for j in self._writes.values() if j.bounce and node in j.nodes]:
            self._wait_for(job)

    def _load_back(self, m: TreeMatch, wait: bool = True) -> np.ndarray | None:
        """Copy the host-only extension of `m` to the device, all-or-nothing. Returns its device pages, or None
        when it does not fit the budget or the device pool, or another load-back is filling those nodes.
        `wait=False` leaves the copy in flight (completed by poll): tests use it to hold a load-back open."""
        budget = self.config.load_back_budget_tokens
        n_pages = len(m.host_pages)
        if budget is not None and n_pages * self.page_size > budget:
            self.counters.load_backs_skipped += 1
            return None
        nodes = self._host_only_path(m)
        if any(getattr(p, "kind", None) is OpKind.LOAD_BACK for n in nodes for p in self._pinners.get(n.id, ())):
            # another load-back is filling these nodes: never claim them twice; the request recomputes instead
            self.counters.load_backs_refused += 1
            return None
        _pin(nodes, +1)  # the host copies must survive any eviction the allocation below triggers
        op_id = self._next_op
        self._next_op += 1
        owner = owner_code(OwnerKind.OP_LOAD_BACK, op_id)
        pages = self._alloc(self.device_pool, n_pages, owner, nodes[0].namespace)
        if pages is None:
            _pin(nodes, -1)
            for n in nodes:
                self.tree.offer(n)
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
        if not wait:
            return pages
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
            self._pinners.setdefault(t.node.id, []).append(op)

    def _unpin(self, node: TreeNode, pinner: TransferOp | StorageWriteJob) -> None:
        if isinstance(pinner, StorageWriteJob):
            if not pinner.bounce:
                node.host_pins -= 1
        else:
            node.pins -= 1
        self.tree.offer(node)
        pinners = self._pinners[node.id]
        pinners.remove(pinner)
        if not pinners:
            del self._pinners[node.id]

    def _complete(self, op: TransferOp) -> None:
        """Hand each target node its pages (Op -> Node) and unpin it. In buffer mode a backup's pages are a bounce
        copy: they go to an L3 write instead (Op(backup) -> Op(storage_write))."""
        del self._ops[op.id]
        bounce = self._backup_target is BackupTarget.BOUNCE and op.kind is OpKind.BACKUP
        if bounce:
            self._start_storage_write([t.node for t in op.targets], bounce=op)
        for t in op.targets:
            node = t.node
            if not bounce:
                op.pool.transfer(t.pages, op.owner, node.owner)
                if op.kind is OpKind.BACKUP:
                    self.tree.set_host(node, t.pages)
                else:
                    self.tree.set_device(node, t.pages)
            self._unpin(node, op)
        if op.kind is OpKind.BACKUP:
            self.counters.backups_completed += 1
            self.backup_stats.host_pages += len(op.pages)
            self.backup_stats.host_bytes += len(op.pages) * op.pool.page_bytes
            rule = self.config.backup_rule
            if not bounce and self.store is not None and rule.on_commit:
                min_hits = self.config.write_through_threshold if rule.needs_hits else 0
                self._start_storage_write([t.node for t in op.targets if self._wants_store(t.node, min_hits)])

    def _complete_copies(self) -> int:
        """Wait for every in-flight copy and complete them, in issue order."""
        done = 0
        while self._ops:
            op = next(iter(self._ops.values()))
            op.wait()
            self._complete(op)
            done += 1
        return done

    def _flush(self) -> int:
        done = 0
        while self._ops or (self._io is not None and (self._writes or self._io.done or not self._io.idle)):
            done += self._complete_copies()
            if self._io is not None:
                self._io.drain()
                done += self._take_io_jobs()
        return done

    def _on_split(self, child: TreeNode, new: TreeNode, head_pages: int) -> None:
        """The tree moved child's first pages to `new`: move their ledger owner, and retarget in-flight copies."""
        if new.device is not None:
            self.device_pool.transfer(new.device, child.owner, new.owner)
        if new.host is not None and self.host_pool is not None:
            self.host_pool.transfer(new.host, child.owner, new.owner)
        for pinner in self._pinners.get(child.id, ()):
            pinner.split_target(child, new, head_pages)
            self._pinners.setdefault(new.id, []).append(pinner)

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


def _room(pool: SlotPool, evictable: int, held: int) -> TierRoom:
    free = pool.free_pages
    return TierRoom(pool.num_pages, free, evictable, held, pool.num_pages - free - evictable - held)


def _of_namespace(namespace: Namespace):
    """A tree-node filter: the nodes of `namespace`."""
    ns_id = namespace.id
    return lambda node: node.namespace is not None and node.namespace.id == ns_id
