"""What each admin request does to a cache (DESIGN §7), the same code for an offline `kvc` command (a cache built
for it) and for live mode (the running cache). In live mode it runs on the cache's owner thread only, between
scheduler steps (`AdminServer.poll`): every handler sees the cache at rest and may use it like the engine.

The requests (`kvcache.ops.requests`) mirror the offline CLI's commands:
prefetch a request or a whole namespace into L2, stage (buffer mode), load back L3 -> L2 -> L1, list namespaces
with what each holds in L1, L2 and L3 (and its TTL deadline), audit, snapshot, stats, evict a namespace from L1/L2,
drop or expire one, replay a trace; and the router's views: a tier as KV events (`kvcache.ops.dump`), what each
tier would serve of a prompt or a chain of page hashes.
Requests the handlers make for themselves carry ids `kvc-admin:<n>`, and a replay's requests `kvc-admin:<n>:<rid>`
(an operator's trace never meets the engine's own request ids); what they leave behind is what an operator
asked for (pages warmed into L2, a prefix loaded onto the device), never a live request or a parked record.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import msgspec
import numpy as np

from ..diagnostics.snapshot import encode_snapshot
from ..errors import InvalidInput, UnknownRequest
from ..ledger.pools import SlotPool
from ..tree import NamespacePages
from ..types.config import HostMode
from ..types.events import BlockStored
from ..types.explain import Explanation
from ..types.ids import DisplayId, NamespaceId, PageHash
from ..types.keys import page_hashes
from ..types.namespace import Namespace, NamespaceInfo
from ..types.reports import AuditReport
from ..types.request import Request
from ..types.results import ExpiryCause, NamespaceExpiry
from ..workload.replay import Replayer
from .dump import DumpTier, StoreWalk, medium_of, store_events, tree_events
from .requests import (
    PROTOCOL_VERSION,
    AuditRequest,
    DropRequest,
    DumpChunk,
    DumpRequest,
    EvictOutcome,
    EvictRequest,
    ExpireRequest,
    ExplainRequest,
    LiveNamespace,
    LiveStats,
    LoadBackRequest,
    NamespaceList,
    NamespacesRequest,
    NamespaceTiers,
    PingRequest,
    PoolUse,
    PrefetchRequest,
    ProbeRequest,
    ReplayJob,
    ReplayOutcome,
    RequestResult,
    ServerInfo,
    SharesOutcome,
    SharesRequest,
    SnapshotData,
    SnapshotRequest,
    StageRequest,
    StatsRequest,
    TierProbe,
    TierServe,
    TierUse,
)
from .warm import warm_namespace

if TYPE_CHECKING:
    from ..engine.cache import TieredCache
    from ..storage.api import NamespaceRecord
    from ..types.results import NamespaceDrop, PrefetchOutcome

_RIDS = itertools.count(1)


def _rid() -> str:
    return f"kvc-admin:{next(_RIDS)}"


def execute(cache: "TieredCache", request: object, between_steps: Callable[[], object] = lambda: 0) -> msgspec.Struct:
    """Run one admin request (or a `ReplayJob`) on `cache` and return its result struct (errors are raised,
    typed). A replay calls `between_steps` after each of its steps (live mode: the server's poll, so other requests
    are answered meanwhile)."""
    if isinstance(request, ReplayJob):
        return _replay(cache, request, between_steps)
    handler = _HANDLERS.get(type(request))
    if handler is None:  # the requests module and this table are kept together; this is a bug, not input
        raise InvalidInput(f"no handler for {type(request).__name__}")
    return handler(cache, request)


# --- occupancy -------------------------------------------------------------------------------------------------


def _use(cache: "TieredCache", pages: int) -> TierUse:
    return TierUse(pages, pages * cache.page_size, pages * cache.layout.bytes_per_page)


def _stored(cache: "TieredCache") -> dict[str, NamespaceRecord]:
    """namespace id (hex) -> the store's registry record."""
    return {r.ns_id_hex: r for r in cache.l3_store.namespaces()} if cache.l3_store is not None else {}


def namespace_tiers(cache: "TieredCache", namespace: Namespace) -> NamespaceTiers:
    """What `namespace` holds in L1, L2 (the tree) and L3 (the store's registry) now."""
    use = cache.tree.namespace_pages(namespace).get(namespace.id, NamespacePages(namespace))
    rec = _stored(cache).get(namespace.id_hex)
    stored = TierUse(rec.pages, rec.pages * cache.page_size, rec.bytes) if rec is not None else TierUse()
    return NamespaceTiers(_use(cache, use.device_pages), _use(cache, use.host_pages), stored)


def _namespaces(cache: "TieredCache", _: NamespacesRequest) -> NamespaceList:
    rows: dict[str, LiveNamespace] = {}
    tree = {ns_id.hex(): row for ns_id, row in cache.tree.namespace_pages().items()}
    stored = _stored(cache)
    shares = {r.ns_id_hex: r for r in cache.shares()}
    ps = cache.page_size
    ttls = {view.id: view for view in cache.namespace_ttls()}  # by display_id
    for ns_hex in sorted(set(tree) | set(stored) | set(shares)):
        rec = stored.get(ns_hex)
        use = tree.get(ns_hex)
        share = shares.get(ns_hex)
        if rec is not None:
            extra_key, fingerprint = rec.extra_key, rec.salt_fingerprint
        else:
            info = cache.fingerprints.info(use.namespace) if use is not None else share
            assert info is not None, "a namespace not in the store is in the tree or has shares"
            extra_key, fingerprint = info.extra_key, info.salt_fingerprint
        l3 = TierUse(rec.pages, rec.pages * ps, rec.bytes) if rec is not None else TierUse()
        # never the raw id: with the extra_key it is a salt oracle
        shown_id = cache.fingerprints.display_id(NamespaceId(bytes.fromhex(ns_hex)))
        rows[ns_hex] = LiveNamespace(extra_key, fingerprint, shown_id, l3.pages, l3.tokens, l3.bytes,
                                     rec.hits if rec is not None else 0,
                                     rec.created if rec is not None else 0.0,
                                     rec.last_access if rec is not None else 0.0,
                                     _use(cache, use.device_pages if use is not None else 0),
                                     _use(cache, use.host_pages if use is not None else 0), l3,
                                     share.shares if share is not None else None)
    out = list(rows.values())
    # tracked by the TTL policy and holding nothing now (say, a prefetch that found nothing): listed for its deadline
    shown = {row.id for row in out}
    empty = TierUse()
    out += [LiveNamespace(v.namespace.extra_key, v.namespace.salt_fingerprint, v.id, 0, 0, 0, 0, 0.0, 0.0, empty,
                          empty, empty) for v in ttls.values() if v.id not in shown]
    wall = time.time()  # deadlines run on the cache's monotonic clock; shown in epoch seconds, like last_access
    for row in out:
        view = ttls.get(row.id)
        if view is not None:
            row.deadline = wall + view.seconds_left
            row.expiry_deferred = view.deferred is not None
    location = cache.store.location if cache.store is not None else ""
    return NamespaceList(location, out)


# --- the L3 path: prefetch, stage, load-back ---------------------------------------------------------------------


# the requests that name a namespace by extra_key and salt, and those of them that carry a prompt's tokens
_Named: TypeAlias = (PrefetchRequest | StageRequest | LoadBackRequest | ExplainRequest | ProbeRequest | EvictRequest
                     | DropRequest | SharesRequest | ExpireRequest)
_Prompted: TypeAlias = PrefetchRequest | StageRequest | LoadBackRequest | ExplainRequest | ProbeRequest


def _namespace(req: _Named) -> Namespace:
    return Namespace(req.extra_key, req.cache_salt)


def _request(req: _Prompted) -> Request:
    if not req.tokens:
        raise InvalidInput("the request has no tokens")
    return Request(_rid(), np.asarray(req.tokens, dtype=np.uint32), _namespace(req))


def _needs_mode(cache: "TieredCache", mode: HostMode, what: str) -> None:
    if cache.host_pool is None:
        raise InvalidInput(f"{what} needs a host tier (L2); this cache has none")
    if cache.config.host_mode is not mode:
        hint = ("use `stage` (the cache's L2 is a bounce buffer)" if mode is HostMode.CACHE
                else "use `prefetch` (the cache's L2 is a cache tier)")
        raise InvalidInput(f"{what} needs a host tier in {mode.value} mode; this cache runs "
                           f"{cache.config.host_mode.value} mode: {hint}")


def _prefetch(cache: "TieredCache", req: PrefetchRequest) -> RequestResult:
    _needs_mode(cache, HostMode.CACHE, "prefetch into L2")
    ns = _namespace(req)
    if req.tokens is None:
        warm = warm_namespace(cache, ns, req.max_pages, req.max_bytes, req.policy, req.timeout_ms)
        declined = ", ".join(f"{k}={v}" for k, v in sorted(warm.declined.items())) or None
        return RequestResult("prefetch", warm.namespace, warm.requested_tokens, warm.hit_tokens, warm.pages,
                             warm.bytes, warm.seconds, declined, warm.prefixes, tiers=namespace_tiers(cache, ns))
    result = _prefetch_one(cache, _request(req), req, "prefetch")
    result.tiers = namespace_tiers(cache, ns)
    return result


def _prefetch_one(cache: "TieredCache", request: Request, req: PrefetchRequest | StageRequest,
                  command: str) -> RequestResult:
    start = time.perf_counter()
    outcome = cache.prefetch(request)
    pages = 0
    if outcome.issued:
        try:
            pages = cache.settle_prefetch(request.rid, req.policy, req.timeout_ms).fetched_pages
        except BaseException:
            _release_quietly(cache, request.rid)  # a failed settle must not leave the prefetch holding L2 pages
            raise
    return RequestResult(command, cache.fingerprints.info(request.namespace), len(request), pages * cache.page_size,
                         pages,
                         pages * cache.layout.bytes_per_page, time.perf_counter() - start, _declined(outcome))


def _declined(outcome: PrefetchOutcome) -> str | None:
    """Why a prefetch was declined; None when it was issued (a prefetch has a reason exactly when it is not)."""
    return outcome.reason.value if outcome.reason is not None else None


def _stage(cache: "TieredCache", req: StageRequest) -> RequestResult:
    _needs_mode(cache, HostMode.BUFFER, "stage")
    request = _request(req)
    try:
        result = _prefetch_one(cache, request, req, "stage")
        staged = [s for s in cache.staged_records() if s.rid == request.rid]
        result.staged = staged[0].view(cache.fingerprints) if staged else None
    finally:
        _release_quietly(cache, request.rid)  # shown, not kept: nobody will admit this admin request id
    result.tiers = namespace_tiers(cache, request.namespace)
    return result


def _load_back(cache: "TieredCache", req: LoadBackRequest) -> RequestResult:
    request = _request(req)
    ps = cache.page_size
    start = time.perf_counter()
    try:
        outcome = cache.prefetch(request)
        if outcome.issued:
            cache.settle_prefetch(request.rid, req.policy, req.timeout_ms)
        adm = cache.admit(request)
        if adm.status.value != "admitted":
            raise InvalidInput(f"the device pool has no room for {len(request)} tokens now ({adm.status.value})")
        n_pages = adm.cached_tokens // ps
        check = _compare_with_store(cache, request, adm.cached_pages[:n_pages])
    finally:
        _release_quietly(cache, request.rid)  # the loaded pages stay in the tree; the request's own pages go
    buffer = cache.config.host_mode is HostMode.BUFFER
    return RequestResult("load-back", cache.fingerprints.info(request.namespace), len(request), adm.cached_tokens,
                         n_pages, n_pages * cache.layout.bytes_per_page, time.perf_counter() - start,
                         _declined(outcome),
                         loaded_back_tokens=adm.loaded_back_tokens + (adm.storage_hit_tokens if buffer else 0),
                         verified_tokens=check.compared * ps, verify_mismatches=check.differ,
                         verify_absent=check.absent, tiers=namespace_tiers(cache, request.namespace))


def _release_quietly(cache: "TieredCache", rid: str) -> None:
    try:
        cache.release(rid)
    except UnknownRequest:
        pass  # nothing was held for it


class _StoreCheck(msgspec.Struct, frozen=True):
    """The device pages of a load-back checked against the store: compared (read back and compared byte for
    byte), and of those `differ`; `absent`: pages the store does not hold, so nothing to compare them with."""

    compared: int = 0
    differ: int = 0
    absent: int = 0


def _compare_with_store(cache: "TieredCache", request: Request, pages: np.ndarray) -> _StoreCheck:
    """Check the request's first device `pages` (of its cached prefix) against the store's copies, read again by the
    request's own page hashes. A page the store does not hold is `absent`, not a difference: a live cache holds
    pages not written yet (write-back, a write in flight) or dropped from L3 since. A page the store holds but
    cannot read back (a checksum failure) differs: its stored bytes are not the device's."""
    n_pages = len(pages)
    if not n_pages or cache.l3_store is None:
        return _StoreCheck()
    store, ps = cache.l3_store, cache.page_size
    hashes = page_hashes(cache.layout.layout_id, request.key, ps, cache.chain_key)[:n_pages]
    want = np.empty((n_pages, cache.layout.bytes_per_page), dtype=np.uint8)
    device = cache.device_pool.kv.read(pages)
    rows = list(want)
    readable = np.zeros(n_pages, dtype=bool)
    absent = unreadable = 0
    i = 0
    while i < n_pages:
        got = store.get_into(hashes[i:], rows[i:])  # a run of consecutive pages, up to the first it cannot read
        readable[i:i + got] = True
        i += got
        if i < n_pages:  # page i did not read: not stored, or stored and unreadable
            if store.page_meta(hashes[i]) is None:
                absent += 1
            elif store.get_into(hashes[i:i + 1], rows[i:i + 1]) == 1:  # written meanwhile (a write in flight)
                readable[i] = True
            else:
                unreadable += 1
            i += 1
    compared = int(readable.sum())
    same = (device[readable] == want[readable]).all(axis=1)
    return _StoreCheck(compared + unreadable, int((~same).sum()) + unreadable, absent)


# --- diagnostics ---------------------------------------------------------------------------------------------


def _explain(cache: "TieredCache", req: ExplainRequest) -> Explanation:
    """Why the request would miss, tier by tier (reads only). A replay's request ids are prefixed (`_replay`), so
    the rid shown is the one asked about, never a request of the cache's own."""
    request = _request(req)
    return msgspec.structs.replace(cache.explain(request), rid=req.rid)



def _audit(cache: "TieredCache", _: AuditRequest) -> AuditReport:
    return cache.audit()


def _snapshot(cache: "TieredCache", _: SnapshotRequest | None = None) -> SnapshotData:
    """The snapshot as bytes: the client writes the file (the server writes no path a client names)."""
    snap = cache.snapshot()
    return SnapshotData(snap.created, len(snap.state.nodes), len(snap.state.holders), encode_snapshot(snap))


def _pool_use(pool: SlotPool) -> PoolUse:
    ps, pb = pool.page_size, pool.page_bytes
    return PoolUse(pool.num_pages, pool.used_pages, pool.num_pages * ps, pool.used_pages * ps,
                   pool.num_pages * pb, pool.used_pages * pb)


def _stats(cache: "TieredCache", _: StatsRequest) -> LiveStats:
    store = cache.l3_store
    return LiveStats(cache.layout, _pool_use(cache.device_pool),
                     _pool_use(cache.host_pool) if cache.host_pool is not None else None,
                     len(cache.live_requests()), len(cache.inflight_ops()), len(cache.prefetch_ops()),
                     len(cache.staged_records()), len(cache.storage_writes()), cache.stats(),
                     store.stats() if store is not None else None, store.layouts() if store is not None else [])


def _evict(cache: "TieredCache", req: EvictRequest) -> EvictOutcome:
    ns = _namespace(req)
    freed = cache.evict_namespace(ns, device=req.device, host=req.host)
    return EvictOutcome(cache.fingerprints.info(ns), freed.device_pages, freed.host_pages, namespace_tiers(cache, ns))


def held_namespaces(cache: "TieredCache") -> dict[NamespaceId, Namespace]:
    """namespace id -> the Namespace of everything the cache holds: tree pages, prefetches, staged records,
    running requests (what a drop must reach; the salt is known only here, in memory)."""
    held: dict[NamespaceId, Namespace] = {}
    for root in cache.tree.namespace_roots():
        if root.namespace is not None:
            held[root.namespace.id] = root.namespace
    for op in cache.prefetch_ops():
        held[op.namespace.id] = op.namespace
    for staged in cache.staged_records():
        held[staged.key.namespace.id] = staged.key.namespace
    for live in cache.live_requests():
        held[live.request.namespace.id] = live.request.namespace
    return held


def _drop(cache: "TieredCache", req: DropRequest) -> "NamespaceDrop":
    from ..types.results import NamespaceDrop

    fp = cache.fingerprints
    if req.id is None and req.fingerprint is None:
        ns = _namespace(req)
        if not req.dry_run:
            return cache.drop_namespace(ns)
        tiers = namespace_tiers(cache, ns)
        return NamespaceDrop(fp.info(ns), fp.display_id(ns.id), tiers.device.pages, tiers.host.pages,
                             tiers.storage.pages, tiers.storage.bytes, _running(cache, ns.id))
    # named without its salt: what the cache holds (Namespace objects) and what its store records
    key = req.extra_key or None

    def named(shown: str, info: NamespaceInfo) -> bool:
        if req.id is not None:
            return shown == req.id
        return info.salt_fingerprint == req.fingerprint and (req.extra_key is None or info.extra_key == key)

    held = held_namespaces(cache)
    found = {ns_id: fp.info(ns) for ns_id, ns in held.items() if named(fp.display_id(ns.id), fp.info(ns))}
    stored = _stored(cache)
    for rec in stored.values():
        info = NamespaceInfo(rec.extra_key, rec.salt_fingerprint)
        rec_id = NamespaceId(bytes.fromhex(rec.ns_id_hex))
        if named(fp.display_id(rec_id), info):
            found.setdefault(rec_id, info)
    if len(found) > 1:
        raise InvalidInput(f"{len(found)} namespaces match: name one by its id (see `kvc ns ls`)")
    if not found:
        return NamespaceDrop(NamespaceInfo(key, req.fingerprint), DisplayId(req.id or ""), 0, 0, 0, 0, 0)
    ns_id, info = next(iter(found.items()))
    shown_id = fp.display_id(ns_id)
    holder = held.get(ns_id)
    if req.dry_run:
        use = namespace_tiers(cache, holder) if holder is not None else None
        record = stored.get(ns_id.hex())
        return NamespaceDrop(info, shown_id, use.device.pages if use else 0, use.host.pages if use else 0,
                             record.pages if record else 0, record.bytes if record else 0, _running(cache, ns_id))
    if holder is not None:
        return cache.drop_namespace(holder)
    assert cache.store is not None  # found in the store's registry
    deleted = cache.store.delete_namespace(ns_id)
    return NamespaceDrop(info, shown_id, 0, 0, deleted.pages, deleted.bytes, 0)


def _running(cache: "TieredCache", ns_id: NamespaceId) -> int:
    """Running requests of namespace `ns_id`."""
    return sum(1 for live in cache.live_requests() if live.request.namespace.id == ns_id)


def _set_shares(cache: "TieredCache", req: SharesRequest) -> SharesOutcome:
    ns = _namespace(req)
    previous = next((r.shares for r in cache.shares() if r.ns_id_hex == ns.id_hex), None)
    if previous is not None or not req.shares.empty:  # clearing shares a namespace does not have changes nothing
        cache.set_shares(ns, req.shares)
    return SharesOutcome(cache.fingerprints.info(ns), cache.fingerprints.display_id(ns.id), req.shares,
                         namespace_tiers(cache, ns), previous)


def _expire(cache: "TieredCache", req: ExpireRequest) -> NamespaceExpiry:
    """Expire a namespace now; one the cache does not know (nothing in any tier, no deadline) is not expired: the
    answer says `expired` False, and nothing is counted or dropped."""
    ns = _namespace(req)
    if cache.ttl_tracker is not None and not _known(cache, ns):  # without a policy: expire_namespace's own error
        fp = cache.fingerprints
        return NamespaceExpiry(fp.info(ns), fp.display_id(ns.id), ExpiryCause.ON_DEMAND, expired=False,
                               deferred=False, live_requests=0)
    return cache.expire_namespace(ns)


def _known(cache: "TieredCache", ns: Namespace) -> bool:
    """Whether `ns` holds anything in L1, L2 or L3, or has a deadline under the cache's TTL policy."""
    use = cache.tree.namespace_pages(ns).get(ns.id)
    if (use is not None and (use.device_pages or use.host_pages)) or ns.id_hex in _stored(cache):
        return True
    shown = cache.fingerprints.display_id(ns.id)
    return any(view.id == shown for view in cache.namespace_ttls())


def _ping(cache: "TieredCache", _: PingRequest) -> ServerInfo:
    c = cache.config
    return ServerInfo(PROTOCOL_VERSION, os.getpid(), cache.layout,
                      cache.store.location if cache.store is not None else "", c.device_pages * cache.page_size,
                      c.host_pages * cache.page_size, c.host_mode.value, c.prefetch_policy.value,
                      c.write_policy.value)


# --- router views: dump, probe by page hash ----------------------------------------------------------------------


def _dump(cache: "TieredCache", req: DumpRequest) -> DumpChunk:
    """A tier of the cache as KV events: the device or host tier whole, the store a chunk from the cursor on."""
    if req.tier is not DumpTier.STORAGE:
        events = [ev for ev in tree_events(cache, req.tier, req.medium_names) if isinstance(ev, BlockStored)]
        return DumpChunk(events, sum(len(ev.block_hashes) for ev in events))
    if cache.l3_store is None:
        return DumpChunk([], 0)
    walk = StoreWalk(cache.l3_store, req.cursor)
    events = list(store_events(walk, medium_of(DumpTier.STORAGE, req.medium_names), req.max_pages))
    return DumpChunk(events, walk.pages, walk.cursor())


def _probe(cache: "TieredCache", req: ProbeRequest) -> TierProbe:
    """What each tier would serve of a prompt or a hash chain, in admission order; reads only."""
    ps = cache.page_size
    info = None
    hashes: list[PageHash]
    if req.tokens is not None:
        request = _request(req)
        hashes = list(page_hashes(cache.layout.layout_id, request.key, ps, cache.chain_key))
        info = cache.fingerprints.info(request.namespace)  # the cache's key: its store's, as the store shows it
    elif req.page_hashes:
        hashes = cast("list[PageHash]", [bytes(h) for h in req.page_hashes])  # the request's, as they came
    else:
        raise InvalidInput("a probe needs tokens or page hashes")
    run = cache.tree.held_run(hashes)
    device, host = run.device_pages, run.host_pages
    rest = hashes[device + host:]
    storage = cache.store.exists_prefix(rest) if cache.store is not None and rest else 0
    return TierProbe(ps, len(hashes), TierServe(device, device * ps), TierServe(host, host * ps),
                     TierServe(storage, storage * ps), info)


# --- replay --------------------------------------------------------------------------------------------------


def _replay(cache: "TieredCache", job: ReplayJob, between_steps: Callable[[], object]) -> ReplayOutcome:
    """Run the trace through the live cache. Between its steps the replay serves the other admin requests
    queued (an audit during a replay sees the state between two steps); a second replay waits for this one. A
    server that stops meanwhile ends it at its next step (`AdminShuttingDown` from `between_steps`). The trace's
    request ids get the replay's own prefix, so they never meet the engine's."""
    tag = _rid()
    trace = (msgspec.structs.replace(item, rid=f"{tag}:{item.rid}") for item in job.trace)  # still streamed
    before = _holders(cache)
    try:
        lines: list[Explanation] = []

        def explained(line: Explanation) -> None:  # the trace's own rid, as an offline replay writes it
            rid = line.rid[len(tag) + 1:] if line.rid is not None else None
            lines.append(msgspec.structs.replace(line, rid=rid))

        report = Replayer(cache, verify=job.verify, batch=job.batch, lookahead=job.lookahead,
                          on_explained=explained if job.explain else None).run(
            trace, progress=lambda _: between_steps())
    except BaseException:
        # a failed or stopped replay must not leave its requests holding slots in a cache that keeps running
        for rid in _holders(cache) - before:
            _release_quietly(cache, rid)
        raise
    return ReplayOutcome(report, _snapshot(cache) if job.snapshot else None, lines)


def _holders(cache: "TieredCache") -> set[str]:
    """Request ids the cache holds anything for now: live admissions, prefetches, staged records."""
    return ({r.request.rid for r in cache.live_requests()} | {p.rid for p in cache.prefetch_ops()}
            | {s.rid for s in cache.staged_records()})


# request type -> its handler, which takes a request of that type (dispatch by type: `Any` is each handler's own)
_HANDLERS: dict[type, Callable[["TieredCache", Any], msgspec.Struct]] = {
    PingRequest: _ping,
    PrefetchRequest: _prefetch,
    StageRequest: _stage,
    LoadBackRequest: _load_back,
    NamespacesRequest: _namespaces,
    AuditRequest: _audit,
    SnapshotRequest: _snapshot,
    StatsRequest: _stats,
    EvictRequest: _evict,
    DropRequest: _drop,
    SharesRequest: _set_shares,
    ExpireRequest: _expire,
    DumpRequest: _dump,
    ProbeRequest: _probe,
    ExplainRequest: _explain,
}
