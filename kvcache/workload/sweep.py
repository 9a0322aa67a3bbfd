"""Capacity sweep: the hit rate per tenant and per tier a trace gets at each of several tier sizes.

Each size is a whole replay (`kvcache.workload.replay.Replayer`) through a real `TieredCache`: the same tree,
ledger, eviction, prefetch and backup code as `kvc replay`, so a size's hits are exactly those of a replay at that
size. Its L3 is what that replay's store would hold:

- an L3 of limited size is a real, empty LMDB store with that capacity (its own eviction decides what stays), in a
  scratch directory opened without fsync (`durability="none"`) and removed afterwards;
- an unlimited L3 (size 0) never evicts, so it holds exactly the pages written and not dropped: a `PageSet`
  (`kvcache.storage.page_set`) keeps that set, byte-free, and answers what the LMDB store would, without LMDB's
  transactions, checksums and copies (`benchmarks/bench_sweep.py` times a sweep of unlimited-L3 sizes against the
  replays it stands for).

What a sweep leaves out is what hit accounting never reads: the KV bytes (no synthetic KV is written at the forward
and none is verified: which tokens hit depends on page hashes and slot ownership, never on the bytes a slot holds)
and durability. Measured on a 2,000-request replay with L3 I/O inline: 8.8 s with an fsync per L3 write and KV
written, 0.55 s without either.

The layout stays the store's own and the scratch store takes the store's key when given: page hashes (the L3
store's keys) then are those a replay on that store writes, so even LRU ties between pages stored together break
the same way (by hash order) and L3 is exact too.

Everything that would read the clock is fixed so a size's outcome depends only on the trace: L3 I/O runs inline
between scheduler steps (`io_thread=False`, as reproducible replays run), prefetches are not re-armed on a timer
(`prefetch_retries=0`), and the prefetch policy is `wait_complete` or `best_effort` (`timeout` is refused: what
arrives within a time budget depends on how fast the machine replays). Sizes run in parallel, at most `workers` at
a time: this process and `workers - 1` worker processes.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from multiprocessing import get_context

import msgspec

from ..engine.cache import TieredCache
from ..errors import InvalidConfig, InvalidInput, KVCacheError
from ..storage.api import CapacityPolicy, L3Store, PageStore
from ..storage.keyfile import install_key
from ..storage.page_set import PageSet
from ..storage.registry import open_store
from ..types.config import CacheConfig, PrefetchPolicy
from ..types.fingerprint_key import FingerprintKey
from ..types.keys import derive_chain_key
from ..types.layout import KVLayout
from ..types.namespace import Namespace
from ..types.reports import ReplayReport, TierTokens
from ..types.request import Request
from ..types.results import Admission
from ..types.sweep import MAX_SWEEP_POINTS, PointResult, SweepPoint, SweepPolicies, SweepReport, TenantHits
from .replay import Replayer
from .traces import TraceRequest

DEFAULT_POLICIES = SweepPolicies()
SCRATCH_DURABILITY = "none"  # a sweep's store is thrown away: no fsync (kvcache.storage.lmdb.env.DURABILITY)


def sweep_config(layout: KVLayout, point: SweepPoint, policies: SweepPolicies) -> CacheConfig:
    """The cache one size of a sweep runs: `point`'s tiers, `policies`, and nothing that reads the clock. A replay
    with this config (and a store whose capacity is `point.storage_bytes`) gets exactly the sweep's hits."""
    if policies.prefetch_policy is PrefetchPolicy.TIMEOUT:
        raise InvalidConfig("a sweep's prefetch policy is wait_complete or best_effort: with timeout, what arrives "
                            "depends on how fast the machine replays, not on the tier sizes")
    return CacheConfig(layout, device_tokens=point.device_tokens, host_tokens=point.host_tokens,
                       write_policy=policies.write_policy, prefetch_policy=policies.prefetch_policy,
                       host_mode=policies.host_mode, device="cpu", io_thread=False, prefetch_retries=0,
                       shares_refresh_s=0.0)


class _Counts(msgspec.Struct, array_like=True):
    """One namespace's figures at one size, as a worker sends them back (by the namespace's index in the trace)."""

    requests: int = 0
    tokens: int = 0
    device: int = 0
    host: int = 0
    storage: int = 0


class _PointCounts(msgspec.Struct, array_like=True):
    """What one size's worker sends back: per namespace (trace order) and the L3 and audit outcomes."""

    namespaces: list[_Counts]
    storage_pages: int
    storage_rejected: int
    audit_ok: bool
    seconds: float


def namespaces_of(trace: Sequence[TraceRequest]) -> list[Namespace]:
    """The trace's namespaces, in the order it first names them."""
    return list(dict.fromkeys(_namespace_per_request(trace)))


def _namespace_per_request(trace: Sequence[TraceRequest]) -> list[Namespace]:
    """Each request's namespace, one Namespace made per (extra_key, cache_salt) written (a Namespace digests its
    fields: made once per spelling, not once per request)."""
    made: dict[tuple[str | None, str | None], Namespace] = {}
    out = []
    for item in trace:
        spelled = (item.extra_key, item.cache_salt)
        ns = made.get(spelled)
        if ns is None:
            ns = made[spelled] = item.namespace()
        out.append(ns)
    return out


def _give_key(directory: str, key: bytes) -> None:
    """Replace the key of the new, empty scratch store in `directory` (closed) by `key`, as `kvc init --rekey`
    replaces a store's (nothing is stored yet, so nothing is hashed under the old one): its page hashes then chain
    as the keyed store's do. The file is written 0600 beside it and renamed over it."""
    fd, temp = tempfile.mkstemp(prefix=".fingerprint-", dir=directory)  # mode 0600
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(key.hex() + "\n")
    install_key(directory, temp)


def _scratch_store(path: str, layout: KVLayout, storage_bytes: int, key: bytes | None) -> L3Store:
    """An empty store at `path` (a new directory) under `layout`, without fsync, holding at most `storage_bytes` of
    payload (0: unlimited), keyed by `key` when given."""
    if key is not None:
        open_store(path, layout, create=True, durability=SCRATCH_DURABILITY).close()
        _give_key(path, key)
    return open_store(path, layout, create=True, capacity=CapacityPolicy(capacity_bytes=storage_bytes),
                      durability=SCRATCH_DURABILITY)


def run_point(layout: KVLayout, point: SweepPoint, policies: SweepPolicies, trace: Sequence[TraceRequest],
              store_key: bytes | None = None, scratch_dir: str | None = None,
              between_steps: Callable[[], object] | None = None) -> _PointCounts:
    """Replay `trace` at one size on an empty scratch store (under `scratch_dir`, the system's temporary directory by
    default; removed afterwards), without KV bytes; its figures per namespace in trace order. `between_steps()`
    after each scheduler step: what it raises unwinds the replay with the cache between steps."""
    config = sweep_config(layout, point, policies)
    index = {ns: i for i, ns in enumerate(namespaces_of(trace))}
    counts = [_Counts() for _ in index]

    def on_admit(request: Request, adm: Admission) -> None:
        c = counts[index[request.namespace]]
        c.requests += 1
        c.tokens += len(request)
        c.device += adm.device_hit_tokens
        c.host += adm.host_hit_tokens
        c.storage += adm.storage_hit_tokens

    def replay_on(store: PageStore) -> ReplayReport:
        cache = TieredCache(config, store)
        try:
            return ByteFreeReplayer(cache, batch=policies.batch, lookahead=policies.lookahead,
                                    on_admit=on_admit).run(trace, None if between_steps is None
                                                           else lambda done: between_steps())
        finally:
            cache.close()

    if not point.storage_bytes:  # L3 unlimited: it never evicts, so it holds exactly the pages written
        report = replay_on(PageSet(layout, derive_chain_key(store_key) if store_key is not None else None,
                                   fingerprint_key=store_key))
    else:
        root = tempfile.mkdtemp(prefix="kvc-sweep-", dir=scratch_dir)  # mode 0700: the key file is a secret
        try:
            store = _scratch_store(os.path.join(root, "store"), layout, point.storage_bytes, store_key)
            try:
                report = replay_on(store)
            finally:
                store.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return _PointCounts(counts, report.backup.storage_pages, report.backup.storage_rejected, report.audit.ok,
                        report.seconds)


class ByteFreeReplayer(Replayer):
    """A replay whose forward writes no KV: which tokens a request finds cached never depends on slot bytes."""

    def _forward(self, request: Request, adm: Admission, tally: object) -> None:
        return None


# --- the worker processes --------------------------------------------------------------------------------------

_worker_trace: list[TraceRequest] = []


def _init_worker(encoded: bytes) -> None:
    """A worker's start: one torch thread (a sweep's parallelism is its processes) and the trace, decoded once.
    SIGINT is ignored: a Ctrl-C reaches the whole process group, and the sweep's own process stops the sweep (a
    KeyboardInterrupt raised at any point of a worker's cache could leave a lock taken that its close waits on)."""
    global _worker_trace
    import signal

    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    _worker_trace = msgspec.msgpack.decode(encoded, type=list[TraceRequest])


class _Failed(msgspec.Struct, frozen=True):
    """A size whose worker raised: what crosses back (an exception of ours may not pickle: its fields differ from
    its message)."""

    kind: str  # the exception's class name
    message: str
    ours: bool  # a KVCacheError (an expected failure: a store fault, a full disk), else a bug

    def exception(self, point: SweepPoint) -> Exception:
        """The error the sweep raises for it."""
        text = f"sweep at L1 {point.device_tokens} / L2 {point.host_tokens} / L3 {point.storage_bytes} bytes: "
        return (KVCacheError if self.ours else RuntimeError)(f"{text}{self.kind}: {self.message}")


def _attempt(layout: KVLayout, point: SweepPoint, policies: SweepPolicies, trace: Sequence[TraceRequest],
             store_key: bytes | None, scratch_dir: str | None,
             between_steps: Callable[[], object] | None) -> _PointCounts:
    """`run_point`, its failure raised as the sweep raises it wherever the size ran (`_Failed.exception`); what
    `between_steps` raises (not an Exception: a KeyboardInterrupt) goes through as it is."""
    outcome = _point_or_failure(layout, point, policies, trace, store_key, scratch_dir, between_steps)
    if isinstance(outcome, _Failed):
        raise outcome.exception(point)
    return outcome


def _point_or_failure(layout: KVLayout, point: SweepPoint, policies: SweepPolicies, trace: Sequence[TraceRequest],
                      store_key: bytes | None, scratch_dir: str | None,
                      between_steps: Callable[[], object] | None = None) -> _PointCounts | _Failed:
    try:
        return run_point(layout, point, policies, trace, store_key, scratch_dir, between_steps)
    except Exception as exc:  # noqa: BLE001 - sent back whole, raised by the parent
        return _Failed(type(exc).__name__, str(exc), isinstance(exc, KVCacheError))


def _worker_point(layout: KVLayout, point: SweepPoint, policies: SweepPolicies, store_key: bytes | None,
                  scratch_dir: str | None) -> _PointCounts | _Failed:
    return _point_or_failure(layout, point, policies, _worker_trace, store_key, scratch_dir)


# --- the sweep --------------------------------------------------------------------------------------------------


def check_points(points: Sequence[SweepPoint]) -> None:
    """InvalidInput unless there are 1 to MAX_SWEEP_POINTS sizes, each non-negative with an L1 of at least a page
    (the cache's own checks run on each size's config too)."""
    if not points:
        raise InvalidInput("a sweep needs at least one size")
    if len(points) > MAX_SWEEP_POINTS:
        raise InvalidInput(f"{len(points)} sizes: a sweep runs at most {MAX_SWEEP_POINTS}")
    for p in points:
        if p.device_tokens < 1 or p.host_tokens < 0 or p.storage_bytes < 0:
            raise InvalidInput(f"{p}: L1 must be >= 1 token, L2 and L3 >= 0")


def sweep(layout: KVLayout, trace: Sequence[TraceRequest], points: Sequence[SweepPoint],
          policies: SweepPolicies = DEFAULT_POLICIES, *, workers: int = 1, store_key: bytes | None = None,
          scratch_dir: str | None = None, progress: Callable[[int], object] | None = None,
          between_steps: Callable[[], object] | None = None) -> SweepReport:
    """Replay `trace` once per size in `points` (see the module docstring) and report the hits of each, per
    namespace and per tier. `workers` > 1 runs that many sizes at once (this process and `workers - 1` others).
    `store_key`: the key of the store a replay would run on (its page hashes, so LRU ties break alike); None: a
    new key per size. Namespaces are shown (extra_key, salt fingerprint) under `store_key` (then they match what
    that store shows), else under env KVC_FINGERPRINT_KEY, else under a key drawn for this sweep.
    `progress(n)` after each size, with the sizes done. `between_steps()` after each scheduler step of a size run
    in this process: what it raises (kvc's Ctrl-C) stops the sweep with that cache between steps; the sizes
    running in workers then finish, the rest are cancelled."""
    check_points(points)
    for p in points:
        sweep_config(layout, p, policies)  # every size's config checked before anything runs
    if workers < 1:
        raise InvalidInput(f"workers={workers} must be >= 1")
    start = time.perf_counter()
    workers = min(workers, len(points))
    results: list[_PointCounts | None] = [None] * len(points)
    if workers == 1:
        for i, p in enumerate(points):
            results[i] = _attempt(layout, p, policies, trace, store_key, scratch_dir, between_steps)
            if progress is not None:
                progress(i + 1)
    else:
        _sweep_shared(layout, trace, points, policies, workers, store_key, scratch_dir, progress, between_steps,
                      results)
    per_request = _namespace_per_request(trace)
    index = {ns: i for i, ns in enumerate(dict.fromkeys(per_request))}
    fingerprints = FingerprintKey.of(store_key)
    namespaces = [fingerprints.info(ns) for ns in index]
    sent = [0] * len(namespaces)
    for ns in per_request:
        sent[index[ns]] += 1
    rows = [_point_result(p, r, namespaces, sent) for p, r in zip(points, results, strict=True) if r is not None]
    return SweepReport(len(trace), sum(len(t.tokens) for t in trace), policies, rows, workers,
                       time.perf_counter() - start)


def _sweep_shared(layout: KVLayout, trace: Sequence[TraceRequest], points: Sequence[SweepPoint],
                  policies: SweepPolicies, workers: int, store_key: bytes | None, scratch_dir: str | None,
                  progress: Callable[[int], object] | None, between_steps: Callable[[], object] | None,
                  results: list[_PointCounts | None]) -> None:
    """Run the sizes on `workers` lanes: `workers - 1` processes take them from the front, and this process, which
    has the trace and its imports already (a worker's start-up is seconds of importing torch), takes them from the
    back, each by cancelling a size no process has started. Fills `results`."""
    encoded = msgspec.msgpack.encode(list(trace))
    done_count = 0

    def settle(future: Future[_PointCounts | _Failed], i: int) -> None:
        nonlocal done_count
        outcome = future.result()
        if isinstance(outcome, _Failed):
            raise outcome.exception(points[i])
        results[i] = outcome
        done_count += 1
        if progress is not None:
            progress(done_count)

    # spawn: a worker starts clean (a fork of a process whose torch started OpenMP threads can hang)
    with ProcessPoolExecutor(workers - 1, mp_context=get_context("spawn"), initializer=_init_worker,
                             initargs=(encoded,)) as pool:
        futures = [pool.submit(_worker_point, layout, p, policies, store_key, scratch_dir) for p in points]
        pending = dict(zip(futures, range(len(points)), strict=True))
        try:
            for i in reversed(range(len(points))):
                if futures[i].cancel():  # no process has it: run it here
                    del pending[futures[i]]
                    results[i] = _attempt(layout, points[i], policies, trace, store_key, scratch_dir,
                                          between_steps)
                    done_count += 1
                    if progress is not None:
                        progress(done_count)
                for future in [f for f in pending if f.done()]:
                    settle(future, pending.pop(future))
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    settle(future, pending.pop(future))
        finally:
            for future in pending:
                future.cancel()


def _rate(hits: TierTokens, tokens: int) -> float:
    return hits.total / tokens if tokens else 0.0


def _point_result(point: SweepPoint, counts: _PointCounts, namespaces: list, sent: list[int]) -> PointResult:
    tenants = []
    total = TierTokens()
    requests = tokens = 0
    for info, c, n_sent in zip(namespaces, counts.namespaces, sent, strict=True):
        hits = TierTokens(c.device, c.host, c.storage)
        tenants.append(TenantHits(info, c.requests, n_sent - c.requests, c.tokens, hits, _rate(hits, c.tokens)))
        total.device += c.device
        total.host += c.host
        total.storage += c.storage
        requests += c.requests
        tokens += c.tokens
    return PointResult(point, requests, sum(sent) - requests, tokens, total, _rate(total, tokens), tenants,
                       counts.storage_pages, counts.storage_rejected, counts.audit_ok, counts.seconds)
