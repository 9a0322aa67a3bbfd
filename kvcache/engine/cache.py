"""TieredCache: the request lifecycle over the radix tree, the L1/L2 slot pools and the copies between them.

Mirrors a serving scheduler (DESIGN §5): ``match`` → ``admit`` (load back the host extension, lock the path,
allocate device slots for the rest) → the engine's forward writes KV → ``commit`` (insert, free duplicates,
unlock, back up per the write policy) or ``release`` (abort). Every slot move is a ledger move; `audit()` checks
the whole partition at any moment.

This class is the facade over the parts `parts` builds bottom up, each in its own module and each calling only
the parts below it: `admission` (admit, commit, release: the top), `settlement` (a request's prefetch started and
settled), `pressure` (the order an admission makes room in), `holders` (every slot holder, one id mint), the
in-flight operations (`operation`, `transfer`, `write_job`, `prefetch_op`, `staged`), `host_mode` (the rules of
cache and buffer mode), `room` (allocation and eviction per tier), `copies` (backups and load-backs), `landing`
and `backups` (what a backup becomes and when one runs, per host mode), `writes` (L2 -> L3), `prefetch`
(L3 -> L2), `staging` (buffer-mode records), `completion`, `offboard`, `expiry` (namespace TTL), `shares` and
`event_log` (the KV-event feed).

Single-threaded by design: the engine's scheduler thread owns the cache and calls ``poll`` between steps. Backups
are in flight between ``commit`` and the ``poll`` that sees their copy complete; L3 reads and writes run on the
I/O worker, which touches only the store and the bytes of pages its job owns.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import numpy as np
import torch

from ..diagnostics.audit import audit_cache
from ..diagnostics.ownership import HolderState
from ..diagnostics.snapshot import Snapshot, take_snapshot, write_snapshot
from ..errors import (
    CacheClosed,
    InvalidConfig,
    InvalidInput,
    LayoutMismatch,
    StoreAccessDenied,
    UnknownRequest,
)
from ..ledger.kv import KVPages
from ..ledger.pools import SlotPool
from ..storage.api import L3Store, PageStore
from ..tree import RadixTree, TreeMatch
from ..types.config import CacheConfig, PrefetchPolicy
from ..types.events import MediumNames
from ..types.explain import Explanation
from ..types.fingerprint_key import FingerprintKey
from ..types.namespace import Namespace
from ..types.reports import AuditReport
from ..types.request import Request
from ..types.results import (
    Admission,
    CommitResult,
    DropReason,
    EvictResult,
    ExpiryCause,
    Headroom,
    NamespaceDrop,
    NamespaceExpiry,
    NamespaceTTL,
    PrefetchOutcome,
    SettledPrefetch,
)
from ..types.shares import NamespaceShares, Shares
from ..types.stats import BackupStats, CacheCounters, CacheStats, PrefetchStats
from ..types.tier import Tier
from .event_log import EventLog, EventSink
from .explain import explain_request
from .holders import Holders, LiveRequest
from .parts import Parts
from .prefetch_op import PrefetchOp
from .staged import StagedPrefetch
from .transfer import TransferOp
from .ttl import TTLTracker
from .write_job import StorageWriteJob


def _chain_key(store: PageStore | None) -> bytes | None:
    """The chain key a cache wired to `store` chains its page hashes with (None: no store, the tree draws one).
    A store whose secret this user may not read cannot back a cache: its pages could not be named."""
    if store is None:
        return None
    key = store.chain_key
    if key is None:
        raise StoreAccessDenied(store.location, "a cache needs the store's key file to name its pages (the chain "
                                                "roots are keyed by it), and this user cannot read it")
    return key


def _fingerprints(store: PageStore | None) -> FingerprintKey:
    """The key a cache wired to `store` shows its namespaces under: the store's (what its registry records), else
    env KVC_FINGERPRINT_KEY, else a random key of the cache's own."""
    return FingerprintKey.of(getattr(store, "fingerprint_key", None))


class TieredCache:
    """The tiered KV cache of one engine: L1 (device) and L2 (host) pools under one namespaced radix tree."""

    def __init__(self, config: CacheConfig, store: PageStore | None = None, *,
                 clock: Callable[[], float] = time.monotonic, device_kv: KVPages | None = None) -> None:
        """`clock`: what namespace deadlines (`config.ttl`) run on, in seconds; tests inject a fake one.
        `device_kv`: the engine's own KV tensors as L1 (`KVPages.layer_first`; `config.device_tokens` of them, pages
        in the order `config.layout.arrangement` names); None: kvc allocates its own L1 on `config.device`."""
        if device_kv is not None and device_kv.arrangement != config.layout.arrangement:
            raise InvalidConfig(f"the engine's KV holds pages in {device_kv.arrangement!r} order; the layout says "
                                f"{config.layout.arrangement!r} ({config.layout.describe()})")
        if store is not None and store.layout is not None and store.layout.layout_id != config.layout.layout_id:
            raise LayoutMismatch(store.location, config.layout.describe(), [store.layout.describe()])
        chain_key = _chain_key(store)  # before anything is allocated
        self.config, self.store, self.layout = config, store, config.layout
        # The same store with its administration (registry, removal log, stats, the page tree): what explain,
        # warming and the live handlers read. None without a store, or for a page store only (a sweep's).
        self.l3_store: L3Store | None = store if isinstance(store, L3Store) else None
        self.page_size = ps = config.layout.page_size
        device = device_kv.device if device_kv is not None else \
            config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        bpt = config.layout.bytes_per_token
        self.device_pool = SlotPool("device", config.device_pages, ps, bpt, device=device, ledger=config.ledger,
                                    kv=device_kv)
        self.host_pool: SlotPool | None = None
        if config.host_pages:
            self.host_pool = SlotPool("host", config.host_pages, ps, bpt, device="cpu",
                                      pin_memory=torch.device(device).type == "cuda", ledger=config.ledger)
        # the key every output of this cache shows namespaces under: its store's, so they match its registry
        self.fingerprints: FingerprintKey = _fingerprints(store)
        # every slot holder besides the tree's nodes; it follows the tree's splits
        self.holders = Holders(self.device_pool, self.host_pool)
        self.tree = RadixTree(ps, config.layout.layout_id, chain_key, self.fingerprints, self.holders.follow_split)
        self.counters, self.prefetch_stats, self.backup_stats = CacheCounters(), PrefetchStats(), BackupStats()
        self._live = self.holders.live  # rid -> the request between admit and commit/release
        self._closed = False
        p = Parts(config, store, self.device_pool, self.host_pool, self.tree, self.holders, self.counters,
                  self.prefetch_stats, self.backup_stats, clock)
        self.rules, self._io, self._room, self._staging = p.rules, p.io, p.room, p.staging
        self._prefetcher, self._shares, self._settlement = p.prefetcher, p.shares, p.settlement
        self._completion, self._offboard, self._expiry = p.completion, p.offboard, p.expiry
        self.removals, self.prefetches = p.removals, p.prefetches  # what explains a miss (`explain`)
        self._admissions = p.admissions
        self._admit, self._commit = p.admissions.admit, p.admissions.commit  # the hot path: bound once
        if store is not None:
            self._shares.refresh_quietly()
        self._events = p.events  # the KV-event feed: its log, when one is attached (attach_events)

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
        return self._admit(request)

    def commit(self, rid: str) -> CommitResult:
        """The forward wrote the request's KV: insert its whole pages into the tree (the tree's owners free
        duplicates), free the partial tail, unlock, and back up per the write policy."""
        if self._closed:
            raise CacheClosed("commit")
        return self._commit(rid)

    def release(self, rid: str) -> None:
        """Drop everything held for a request without caching it — abort at any stage: its prefetch (in flight or
        done), its staged record, its admission (path unlocked, fresh pages freed). Each slot is freed once."""
        self._check_open("release")
        self._admissions.release(rid)

    def holds(self, rid: str) -> bool:
        """Does the cache hold anything for request id `rid`: a prefetch, a staged record or an admission?"""
        return self.holders.holds(rid)

    def headroom(self) -> Headroom:
        """Where each tier's pages are now: free, evictable, held only by prefetches, busy. A request of n pages
        with a device prefix of d pages is admitted when n - d <= device.free + device.evictable + device.held
        (after `flush` when copies are in flight); `TOO_LARGE` when n exceeds device.pages."""
        return self._room.headroom()

    # --- L3: prefetch and staging ------------------------------------------------------------------------------

    def prefetch(self, request: Request, match: TreeMatch | None = None) -> PrefetchOutcome:
        """Start fetching the request's miss from L3 into L2, before its admission, keyed by the **request's**
        namespace. `match` (default: a fresh one) gives the anchor: one of another namespace raises
        `NamespaceMismatch` before any slot is taken (count it, serve the request without L3); an id that holds
        something for another request raises `RequestIdInUse`. Declining is a value (`issued=False`, `reason`).
        What is fetched, what the operation holds and for how long: `kvcache.engine.prefetch`."""
        self._check_open("prefetch")
        return self._settlement.prefetch(request, match)

    def settle_prefetch(self, rid: str, policy: PrefetchPolicy | None = None,
                        timeout_ms: float | None = None) -> SettledPrefetch:
        """Finish a request's prefetch now, without admitting it, per the prefetch policy: cache mode inserts
        what arrived as host-only nodes under the request's namespace; buffer mode parks it as the request's
        staged record (see `staged_records`), consumed by its admit or dropped by `release`. How operators warm
        L2 before traffic arrives. `policy` / `timeout_ms` replace the configured ones for this call (the admin
        socket's prefetch waits for what an operator asked for, whatever the engine's policy)."""
        self._check_open("settle_prefetch")
        return self._settlement.settle(rid, policy, timeout_ms)

    def prefetch_ops(self) -> list[PrefetchOp]:
        """Prefetches not yet settled by admission or abort."""
        return list(self.holders.prefetches.values())

    def staged_records(self) -> list[StagedPrefetch]:
        """Parked buffer-mode prefetches."""
        return list(self.holders.staged.values())

    def storage_writes(self) -> list[StorageWriteJob]:
        """L2 -> L3 writes not yet acknowledged."""
        return list(self.holders.writes.values())

    # --- tiers -----------------------------------------------------------------------------------------------

    def evict(self, device_tokens: int = 0, host_tokens: int = 0) -> EvictResult:
        """Free at least this many tokens per tier from tree nodes nobody locks, holds or pins, LRU first (fewer
        when fewer are evictable)."""
        self._check_open("evict")
        ps, room = self.page_size, self._room
        d = room.evict(Tier.DEVICE, -(-device_tokens // ps)) if device_tokens > 0 else 0
        h = room.evict(Tier.HOST, -(-host_tokens // ps)) if host_tokens > 0 else 0
        return EvictResult(d, h)

    def evict_namespace(self, namespace: Namespace, device: bool = True, host: bool = True) -> EvictResult:
        """Free every page `namespace` holds in L1 (`device`) and L2 (`host`) that nobody locks, holds or pins,
        as eviction would under pressure: a device copy with no host copy is backed up first under write-back; L3
        keeps its pages. To offboard a tenant use `drop_namespace`, which never writes back."""
        self._check_open("evict_namespace")
        return self._offboard.evict(namespace, device, host)

    def drop_namespace(self, namespace: Namespace) -> NamespaceDrop:
        """Offboard `namespace` from every tier: give back its prefetches and staged records, let the copies and
        L3 writes in flight land, free its L1 and L2 pages without writing any of them back, then delete it from
        L3. The result is the same whichever of this cache and the store was dropped first. Pages that running
        requests of the namespace lock stay until they end (`live_requests` counts them); a commit after the drop
        caches and writes as usual."""
        self._check_open("drop_namespace")
        return self._offboard.drop(namespace)

    # --- shares (kvcache.types.shares) -------------------------------------------------------------------------

    def set_shares(self, namespace: Namespace, shares: Shares) -> None:
        """Set `namespace`'s shares (`Shares()` clears them): written to the store when there is one (other
        processes on it pick them up at their next refresh) and applied to this cache's tiers now."""
        self._check_open("set_shares")
        self._shares.set(namespace, shares)

    def shares(self) -> list[NamespaceShares]:
        """The shares this cache applies, one record per namespace that has any."""
        return list(self._shares.records.values())

    def refresh_shares(self) -> int:
        """Read every namespace's shares from the store and apply what changed (shares cleared there are cleared
        here). Returns how many namespaces changed. Done at open and, with `CacheConfig.shares_refresh_s`, from
        `poll`; a store that cannot answer then keeps the shares applied and is counted (`share_refresh_errors`)."""
        return self._shares.refresh()

    # --- between steps ---------------------------------------------------------------------------------------

    def poll(self) -> int:
        """Complete what has finished — copies, in issue order, and L3 jobs — and re-arm due prefetch retries.
        Call between scheduler steps. Returns how many copies and jobs completed."""
        self._check_open("poll")
        done = self._completion.poll()
        if self._expiry is not None:
            self._expiry.sweep()
        log = self._events.log
        if log is not None:
            log.flush()  # one batch per scheduler step
        return done

    def run_io(self, max_steps: int | None = None) -> int:
        """Run up to `max_steps` steps of the queued L3 jobs on this thread (all with None) and take back what
        finished: how reproducible runs and tests step an inline I/O worker (`CacheConfig.io_thread=False`) between
        scheduler steps. Returns how many jobs completed; 0 without a store."""
        self._check_open("run_io")
        return self._completion.run_io(max_steps)

    def flush(self) -> int:
        """Wait for every in-flight copy and L3 write (and the prefetch batches queued now) and complete them.
        Returns how many completed."""
        self._check_open("flush")
        done = self._completion.flush()
        log = self._events.log
        if log is not None:
            log.flush()
        return done

    def close(self) -> None:
        """Give back the prefetches and staged records still held, flush, stop the I/O worker and flush the store's
        access records (the store stays open: its opener closes it). Close an admin server on this cache first.
        Afterwards every call that acts raises `CacheClosed`; the views (`audit`, `snapshot`, `stats`,
        `headroom`) still answer, and `close` again does nothing."""
        if self._closed:
            return
        for rid in list(self.holders.prefetches) + list(self.holders.staged):  # never live: admission consumes both
            self._prefetcher.drop_holds(rid, DropReason.ABORTED)
        self._completion.flush()
        if self._io is not None and self.store is not None:
            self._io.close()
            self.store.flush()
        log = self._events.log
        if log is not None:
            log.cleared()  # nothing of this cache can be served any more
            log.flush()
        self._closed = True

    # --- namespace time to live (kvcache.engine.ttl) ---------------------------------------------------------

    def expire_namespace(self, namespace: Namespace) -> NamespaceExpiry:
        """Expire `namespace` now, by the TTL rules: dropped from every tier (`drop_namespace`), or, while running
        requests lock its prefix, deferred until the last of them ends (a use before that cancels it). Needs a TTL
        policy (`InvalidInput` without one: `drop_namespace` offboards a namespace at once)."""
        self._check_open("expire_namespace")
        if self._expiry is None:
            raise InvalidInput("this cache has no TTL policy (CacheConfig.ttl), so nothing expires; "
                               "drop_namespace offboards a namespace now")
        return self._expiry.expire(namespace, ExpiryCause.ON_DEMAND)

    @property
    def chain_key(self) -> bytes:
        """The key of this cache's namespace roots (kvcache.types.keys): its store's, else its own random one.
        What `page_hashes` needs to name this cache's pages: `page_hashes(layout_id, key, ps, cache.chain_key)`."""
        return self.tree.chain_key

    @property
    def ttl_tracker(self) -> TTLTracker | None:
        """The deadlines of the namespaces this cache has used (None without a TTL policy). Read it; the cache
        tells it what happens."""
        return self._expiry.tracker if self._expiry is not None else None

    def namespace_ttls(self) -> list[NamespaceTTL]:
        """Every namespace the TTL policy tracks, with its deadline, soonest first ([] without a policy)."""
        ttl = self.ttl_tracker
        return ttl.views(ttl.clock()) if ttl is not None else []

    # --- KV events -------------------------------------------------------------------------------------------

    def attach_events(self, sink: EventSink, data_parallel_rank: int = 0,
                      medium_names: MediumNames = MediumNames.KVC) -> EventLog:
        """Report every change of the pages this cache holds as KV events (`kvcache.types.events`): `sink` gets
        one `EventBatch` per `poll` (and per `flush`) that saw changes — a device or host copy attached or
        detached, pages acknowledged by or deleted from the store, `AllBlocksCleared` at `close`. The first batch,
        handed over before this returns, clears and announces what the cache holds now. One feed at a time
        (`kvcache.live.events.KVEventPublisher` is the ZeroMQ one); `detach_events` ends it."""
        self._check_open("attach_events")
        if self._events.log is not None:
            raise InvalidInput("this cache already has a KV-event feed attached: detach_events() first")
        log = EventLog.start(self.tree, sink, data_parallel_rank, medium_names)
        self._events.attach(log)
        return log

    def detach_events(self) -> None:
        """Hand the events still pending to the feed's sink and end the feed. Does nothing without one."""
        log = self._events.detach()
        if log is not None:
            log.flush()

    # --- views -----------------------------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        """Hits per namespace and tier, prefetch and backup figures, counters (copies: safe to keep)."""
        ttl = self.ttl_tracker.snapshot_stats() if self.ttl_tracker is not None else None
        return msgspec.convert(msgspec.to_builtins(CacheStats(list(self._admissions.hits.values()), self.prefetch_stats,
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

    def explain(self, request: Request) -> Explanation:
        """Why `request` would miss, tier by tier: how many of its tokens each tier (L1, L2, L3) holds from the
        first on, why the first page a tier does not hold is not there (removed — why and when —, held under other
        namespaces or layouts, quarantined, never written), what an admission now would take from each tier, and
        how the last prefetch of its prefix ended. Reads only: nothing is split, counted or touched. What the
        cache remembers for it is bounded (`kvcache.engine.recent`)."""
        return explain_request(self, request)

    def holder_states(self) -> list[HolderState]:
        """Every slot holder that is not a tree node, as the audit reads them (`kvcache.diagnostics`)."""
        host = self.host_pool.name if self.host_pool is not None else "host"
        return list(self.holders.states(self.device_pool.name, host))

    def live_requests(self) -> list[LiveRequest]:
        """Requests between admit and commit/release."""
        return list(self._live.values())

    def inflight_ops(self) -> list[TransferOp]:
        """Copies issued and not yet completed."""
        return list(self.holders.copies.values())

    def device_slots(self, rid: str) -> np.ndarray:
        """Device slots of a live request's tokens, in order."""
        self._check_open("device_slots")
        live = self._live.get(rid)
        if live is None:
            raise UnknownRequest(rid, "is not live")
        return self.device_pool.slots(live.pages)[: len(live.request)]

    # --- internals -------------------------------------------------------------------------------------------

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise CacheClosed(what)

    def __repr__(self) -> str:
        d, h = self.device_pool, self.host_pool
        return (f"TieredCache({self.layout.describe()}, device {d.used_pages}/{d.num_pages} pages, host "
                f"{h.used_pages if h else 0}/{h.num_pages if h else 0} pages, {len(self._live)} live)")
