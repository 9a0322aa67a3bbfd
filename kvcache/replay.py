"""The replay driver: a serving scheduler's loop over a `TieredCache`, fed by a trace, with synthetic KV.

Per request (DESIGN §5): it enters a waiting window of `lookahead` requests, where its L3 prefetch is issued
(as an engine does while a request queues); at the head of the window it is admitted in a step of up to `batch`
requests; the forward writes its new tokens' synthetic KV (`kvcache.kvdata`); commit inserts it and backs it up
per the write policy. With `verify`, every cached token an admission hands out is compared, byte for byte, with
what its page hash says it must hold. At the end the driver flushes L3 writes and audits the whole cache.

A `NamespaceMismatch` from a prefetch is counted and the request is served without L3 — the loop never dies of it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

import msgspec

from .audit import AuditReport
from .cache import AdmitStatus, TieredCache
from .errors import NamespaceMismatch
from .keys import page_hashes
from .kvdata import SyntheticKV
from .namespace import NamespaceInfo
from .request import Request
from .stats import BackupStats, PrefetchStats
from .workload import TraceRequest

_TAIL_FILL = 0xAB  # bytes of a partial tail page: never cached, never verified


class TierTokens(msgspec.Struct):
    """Tokens found in each tier at admission."""

    device: int = 0
    host: int = 0
    storage: int = 0

    @property
    def total(self) -> int:
        """Tokens found in any tier."""
        return self.device + self.host + self.storage


class NamespaceReplay(msgspec.Struct):
    """One namespace's share of a replay."""

    namespace: NamespaceInfo
    requests: int = 0
    tokens: int = 0
    hit_tokens: TierTokens = msgspec.field(default_factory=TierTokens)


class VerifyMismatch(msgspec.Struct, frozen=True):
    """A cached page whose bytes are not those of its page hash."""

    rid: str
    page: int  # index of the page in the request
    namespace: NamespaceInfo


class ReplayReport(msgspec.Struct):
    """What a replay did. `requests`, `tokens`, `hit_tokens`, `verify_mismatches` and `audit` are pinned
    (DESIGN §8)."""

    requests: int  # admitted and committed
    refused: int  # requests that did not fit the device pool even alone (skipped)
    tokens: int  # tokens of the committed requests
    hit_tokens: TierTokens  # of those, found cached, by tier
    namespaces: list[NamespaceReplay]
    verify: bool
    verified_tokens: int  # cached tokens compared byte for byte (0 without verify)
    verify_mismatches: int  # pages whose bytes differed from their page hash's
    mismatches: list[VerifyMismatch]  # the first few
    namespace_mismatches: int  # prefetches refused for an anchor of another namespace
    prefetches_cancelled: int  # waiting requests' prefetches cancelled to make device room for the head request
    prefetch: PrefetchStats  # during this replay
    backup: BackupStats  # during this replay
    audit: AuditReport  # of the whole cache after the final flush
    seconds: float  # the loop and the final flush
    requests_per_s: float
    tokens_per_s: float

    @property
    def ok(self) -> bool:
        """No verify mismatch and a clean audit."""
        return self.verify_mismatches == 0 and self.audit.ok


MAX_MISMATCH_EXAMPLES = 20


class _Tally:
    """Running totals of one replay."""

    def __init__(self) -> None:
        self.requests = self.refused = self.tokens = 0
        self.hits = TierTokens()
        self.by_ns: dict[bytes, NamespaceReplay] = {}
        self.verified = 0
        self.mismatched = 0
        self.examples: list[VerifyMismatch] = []
        self.ns_mismatches = 0
        self.cancelled = 0

    def admitted(self, request: Request, adm) -> None:
        ns = request.namespace
        row = self.by_ns.get(ns.id)
        if row is None:
            row = self.by_ns[ns.id] = NamespaceReplay(ns.info())
        for hits in (self.hits, row.hit_tokens):
            hits.device += adm.device_hit_tokens
            hits.host += adm.host_hit_tokens
            hits.storage += adm.storage_hit_tokens
        row.requests += 1
        row.tokens += len(request)
        self.requests += 1
        self.tokens += len(request)


def _delta(after: msgspec.Struct, before: msgspec.Struct) -> msgspec.Struct:
    """Field-wise `after - before` of two counter structs (nested dicts of counts included)."""

    def sub(a, b):
        if isinstance(a, dict):
            return {k: sub(v, b.get(k, 0)) for k, v in a.items() if sub(v, b.get(k, 0))}
        return a - b

    a, b = msgspec.to_builtins(after), msgspec.to_builtins(before)
    return msgspec.convert({k: sub(v, b[k]) for k, v in a.items()}, type(after))


class Replayer:
    """Drives one cache with requests; `run` replays a trace and returns the report."""

    def __init__(self, cache: TieredCache, *, verify: bool = False, batch: int = 4, lookahead: int = 8) -> None:
        if batch < 1 or lookahead < 0:
            raise ValueError(f"batch={batch} must be >= 1 and lookahead={lookahead} >= 0")
        self.cache = cache
        self.verify = verify
        self.batch = batch  # requests admitted together in one step (concurrent on the device)
        self.lookahead = lookahead  # requests waiting behind the step, whose prefetches are in flight
        self.kv = SyntheticKV(cache.layout)
        self._prefetching: set[str] = set()  # rids whose prefetch is held by the cache (until admission)
        self._cancelled: set[str] = set()  # rids whose prefetch was cancelled under pressure, to re-issue

    def run(self, trace: Iterable[TraceRequest],
            progress: Callable[[int], None] | None = None) -> ReplayReport:
        """Replay every request of `trace` in order; `progress(n)` after each step with the requests done."""
        cache, tally = self.cache, _Tally()
        stats0 = cache.stats()
        start = time.perf_counter()
        source = iter(trace)
        waiting: deque[Request] = deque()

        def refill() -> None:
            while len(waiting) < self.batch + self.lookahead:
                item = next(source, None)
                if item is None:
                    return
                request = item.request()
                self._prefetch(request, tally)
                waiting.append(request)

        refill()
        while waiting:
            step = [waiting.popleft() for _ in range(min(self.batch, len(waiting)))]
            refill()
            self._reissue(waiting, tally)
            cache.poll()
            running: list[Request] = []
            for i, request in enumerate(step):
                self._prefetching.discard(request.rid)  # admission settles it
                self._cancelled.discard(request.rid)
                adm = cache.admit(request)
                if adm.status is AdmitStatus.POOL_FULL and not running and self._relieve(waiting, tally):
                    adm = cache.admit(request)  # the waiting requests' prefetches no longer pin device pages
                if adm.status is AdmitStatus.POOL_FULL:
                    if running:  # room comes back when this step's requests commit: retry first next step
                        waiting.extendleft(reversed(step[i:]))
                        break
                    tally.refused += 1
                    continue
                self._forward(request, adm, tally)
                tally.admitted(request, adm)
                running.append(request)
            for request in running:
                cache.commit(request.rid)
            cache.poll()
            if progress is not None:
                progress(tally.requests + tally.refused)
        cache.flush()
        seconds = time.perf_counter() - start
        audit = cache.audit()
        stats1 = cache.stats()
        return ReplayReport(
            tally.requests, tally.refused, tally.tokens, tally.hits,
            sorted(tally.by_ns.values(), key=lambda r: (-r.tokens, r.namespace.extra_key or "")),
            self.verify, tally.verified, tally.mismatched, tally.examples, tally.ns_mismatches, tally.cancelled,
            _delta(stats1.prefetch, stats0.prefetch), _delta(stats1.backup, stats0.backup),  # type: ignore[arg-type]
            audit, seconds, tally.requests / seconds if seconds else 0.0,
            tally.tokens / seconds if seconds else 0.0)

    def _prefetch(self, request: Request, tally: _Tally) -> None:
        if self.cache.store is None:
            return
        try:
            if self.cache.prefetch(request).issued:
                self._prefetching.add(request.rid)
        except NamespaceMismatch:
            tally.ns_mismatches += 1  # counted by the cache too; the request is served without L3

    def _relieve(self, waiting: deque[Request], tally: _Tally) -> bool:
        """The head request does not fit alone: cancel the waiting requests' prefetches, whose anchors lock
        device pages (as a scheduler under memory pressure drops speculative work). True if any was."""
        cancelled = [r for r in waiting if r.rid in self._prefetching]
        for request in cancelled:
            self.cache.release(request.rid)
            self._prefetching.discard(request.rid)
            self._cancelled.add(request.rid)
        tally.cancelled += len(cancelled)
        return bool(cancelled)

    def _reissue(self, waiting: deque[Request], tally: _Tally) -> None:
        """Prefetch again for waiting requests whose prefetch `_relieve` cancelled."""
        if self._cancelled:
            for request in waiting:
                if request.rid in self._cancelled:
                    self._cancelled.discard(request.rid)
                    self._prefetch(request, tally)

    def _forward(self, request: Request, adm, tally: _Tally) -> None:
        """Check the cached pages (verify), then write the new tokens' KV as the engine's forward would."""
        cache, ps = self.cache, self.cache.page_size
        rows = cache.device_pool.pages
        pages = adm.slots[::ps] // ps  # device page of every (possibly partial) page of the request
        hashes = page_hashes(cache.layout.layout_id, request.key, ps)
        n_cached = adm.cached_tokens // ps
        if self.verify and n_cached:
            bad = self.kv.mismatches(rows, pages[:n_cached], hashes[:n_cached])
            tally.verified += adm.cached_tokens
            tally.mismatched += len(bad)
            for p in bad[: MAX_MISMATCH_EXAMPLES - len(tally.examples)].tolist():
                tally.examples.append(VerifyMismatch(request.rid, p, request.namespace.info()))
        n_whole = len(hashes)
        self.kv.write(rows, pages[n_cached:n_whole], hashes[n_cached:n_whole])
        if n_whole < len(pages):
            rows[int(pages[n_whole])] = _TAIL_FILL


def replay(cache: TieredCache, trace: Iterable[TraceRequest], *, verify: bool = False, batch: int = 4,
           lookahead: int = 8, progress: Callable[[int], None] | None = None) -> ReplayReport:
    """Replay `trace` through `cache` (see `Replayer`)."""
    return Replayer(cache, verify=verify, batch=batch, lookahead=lookahead).run(trace, progress)

