"""The replay driver: a serving scheduler's loop over a `TieredCache`, fed by a trace, with synthetic KV.

Per request (DESIGN §5): it enters a waiting window of `lookahead` requests, where its L3 prefetch is issued
(as an engine does while a request queues); at the head of the window it is admitted in a step of up to `batch`
requests; the forward writes its new tokens' synthetic KV (`kvcache.workload.kvdata`); commit inserts it and backs it up
per the write policy. With `verify`, every cached token an admission hands out is compared, byte for byte, with
what its page hash says it must hold. At the end the driver flushes L3 writes and audits the whole cache.

Under pressure it follows the documented loop: a prefetch declined by a bound (host budget, device holds) or
cancelled by an admission is issued again at the next step, oldest waiting request first, so the request nearest
admission gets the room first; admission itself evicts, waits for copies and cancels the youngest holds last. A
request that finds no room because this step's requests hold it waits for the next step; one larger than the
device pool is `refused`. A `NamespaceMismatch` from a prefetch is counted and the request is served without L3 —
the loop never dies of it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import msgspec

from ..engine.cache import TieredCache
from ..engine.explain import after_admission
from ..errors import InvalidConfig, InvariantViolation, NamespaceMismatch
from ..types.explain import Explanation
from ..types.fingerprint_key import FingerprintKey
from ..types.keys import page_hashes
from ..types.reports import NamespaceReplay, ReplayReport, TierTokens, VerifyMismatch
from ..types.request import Request
from ..types.results import Admission, AdmitStatus, DeclineReason
from .kvdata import SyntheticKV
from .traces import TraceRequest

_TAIL_FILL = 0xAB  # bytes of a partial tail page: never cached, never verified
# Declines that a later step may not meet: the bound that declined the prefetch loosens as requests are admitted.
_RETRY_DECLINES = frozenset({DeclineReason.HOST_LIMIT, DeclineReason.DEVICE_LIMIT})


MAX_MISMATCH_EXAMPLES = 20


class _Tally:
    """Running totals of one replay."""

    def __init__(self, fingerprints: FingerprintKey) -> None:
        """`fingerprints`: the key the rows show their namespaces under (the cache's)."""
        self.fingerprints = fingerprints
        self.requests = self.refused = self.tokens = 0
        self.hits = TierTokens()
        self.by_ns: dict[bytes, NamespaceReplay] = {}
        self.verified = 0
        self.mismatched = 0
        self.examples: list[VerifyMismatch] = []
        self.ns_mismatches = 0
        self.reissued = 0
        self.blocked = 0

    def row(self, request: Request) -> NamespaceReplay:
        """The namespace's row of `request` (made on its first request, with the namespace's info under the cache's
        key: the report's rows carry everything a table needs, so no client keys them again)."""
        ns = request.namespace
        row = self.by_ns.get(ns.id)
        if row is None:
            row = self.by_ns[ns.id] = NamespaceReplay(self.fingerprints.info(ns))
        return row

    def admitted(self, request: Request, adm: Admission) -> None:
        row = self.row(request)
        for hits in (self.hits, row.hit_tokens):
            hits.device += adm.device_hit_tokens
            hits.host += adm.host_hit_tokens
            hits.storage += adm.storage_hit_tokens
        row.requests += 1
        row.tokens += len(request)
        self.requests += 1
        self.tokens += len(request)


_Counts = TypeVar("_Counts", bound=msgspec.Struct)


def _delta(after: _Counts, before: _Counts) -> _Counts:
    """Field-wise `after - before` of two counter structs (nested dicts of counts included)."""

    def sub(a: Any, b: Any) -> Any:  # msgspec.to_builtins's values: counts, or dicts of them
        if isinstance(a, dict):
            return {k: sub(v, b.get(k, 0)) for k, v in a.items() if sub(v, b.get(k, 0))}
        return a - b

    a, b = msgspec.to_builtins(after), msgspec.to_builtins(before)
    return msgspec.convert({k: sub(v, b[k]) for k, v in a.items()}, type(after))


class Replayer:
    """Drives one cache with requests; `run` replays a trace and returns the report."""

    def __init__(self, cache: TieredCache, *, verify: bool = False, batch: int = 4, lookahead: int = 8,
                 on_admit: Callable[[Request, Admission], None] | None = None,
                 on_explained: Callable[[Explanation], None] | None = None) -> None:
        if batch < 1 or lookahead < 0:
            raise ValueError(f"batch={batch} must be >= 1 and lookahead={lookahead} >= 0")
        self.cache = cache
        self.verify = verify
        self.batch = batch  # requests admitted together in one step (concurrent on the device)
        self.lookahead = lookahead  # requests waiting behind the step, whose prefetches are in flight
        self.on_admit = on_admit  # called with every admitted request and its admission (observers, tests)
        # Called with each admitted or refused request's line (`kvc replay --requests-out`): the request explained
        # just before its admission (`TieredCache.explain`), with the tokens the admission took from each tier
        # and how its prefetch ended (`after_admission`).
        self.on_explained = on_explained
        self.kv = SyntheticKV(cache.layout)
        self._prefetching: set[str] = set()  # rids whose prefetch the cache holds (until their admission)
        self._retry: set[str] = set()  # rids whose prefetch a bound declined: issued again at the next step

    def run(self, trace: Iterable[TraceRequest],
            progress: Callable[[int], object] | None = None) -> ReplayReport:
        """Replay every request of `trace` in order; `progress(n)` after each step with the requests done."""
        cache, tally = self.cache, _Tally(self.cache.fingerprints)
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
                tally.row(request).sent += 1
                self._prefetch(request, tally)
                waiting.append(request)

        refill()
        while waiting:
            cache.poll()
            self._reissue(waiting, tally)  # before new arrivals: the oldest waiting requests get the room first
            step = [waiting.popleft() for _ in range(min(self.batch, len(waiting)))]
            refill()
            running: list[Request] = []
            for i, request in enumerate(step):
                before = cache.explain(request) if self.on_explained is not None else None
                adm = cache.admit(request)
                if adm.status is AdmitStatus.POOL_FULL:
                    if running:  # room comes back when this step's requests commit: first in line next step
                        waiting.extendleft(reversed(step[i:]))
                        break
                    if not cache.live_requests():
                        raise InvariantViolation(
                            f"request {request.rid} ({len(request)} tokens) fits the device pool but was not admitted "
                            f"with nothing else running: {cache.headroom()}")
                    tally.blocked += 1  # live mode: the engine's own requests hold the room during this replay
                    self._forget(request.rid)
                    continue
                self._forget(request.rid)
                if before is not None and self.on_explained is not None:
                    self.on_explained(after_admission(cache, request, before, adm))
                if adm.status is AdmitStatus.TOO_LARGE:
                    tally.refused += 1
                    tally.row(request).refused += 1
                    continue
                self._forward(request, adm, tally)
                tally.admitted(request, adm)
                if self.on_admit is not None:
                    self.on_admit(request, adm)
                running.append(request)
            for request in running:
                cache.commit(request.rid)
            if progress is not None:
                progress(tally.requests + tally.refused + tally.blocked)
        cache.flush()
        seconds = time.perf_counter() - start
        audit = cache.audit()
        stats1 = cache.stats()
        prefetch = _delta(stats1.prefetch, stats0.prefetch)
        return ReplayReport(
            tally.requests, tally.refused, tally.tokens, tally.hits,
            sorted(tally.by_ns.values(), key=lambda r: (-r.tokens, r.namespace.extra_key or "")),
            self.verify, tally.verified, tally.mismatched, tally.examples, tally.ns_mismatches,
            sum(prefetch.cancelled.values()), prefetch, _delta(stats1.backup, stats0.backup),
            audit, seconds, tally.requests / seconds if seconds else 0.0,
            tally.tokens / seconds if seconds else 0.0, tally.reissued, tally.blocked)

    def _prefetch(self, request: Request, tally: _Tally) -> None:
        if self.cache.store is None:
            return
        try:
            outcome = self.cache.prefetch(request)
        except NamespaceMismatch:
            tally.ns_mismatches += 1  # counted by the cache too; the request is served without L3
            return
        if outcome.issued:
            self._prefetching.add(request.rid)
        elif outcome.reason in _RETRY_DECLINES:
            self._retry.add(request.rid)

    def _reissue(self, waiting: deque[Request], tally: _Tally) -> None:
        """Prefetch again, oldest first, for waiting requests whose prefetch a bound declined or an admission
        cancelled (the cache no longer holds it)."""
        if not (self._retry or self._prefetching):
            return
        for request in waiting:
            rid = request.rid
            cancelled = rid in self._prefetching and not self.cache.holds(rid)
            if rid in self._retry or cancelled:
                self._forget(rid)
                tally.reissued += 1
                self._prefetch(request, tally)

    def _forget(self, rid: str) -> None:
        self._prefetching.discard(rid)
        self._retry.discard(rid)

    def _forward(self, request: Request, adm: Admission, tally: _Tally) -> None:
        """Check the cached pages (verify), then write the new tokens' KV as the engine's forward would."""
        cache, ps = self.cache, self.cache.page_size
        rows = cache.device_pool.pages
        if rows is None:  # (a replay is kvc standing in for an engine: it never runs over an engine's own KV)
            raise InvalidConfig("a replay writes the KV of kvc's own device pool; this cache's L1 is an engine's")
        # the device pages of the cached prefix, then of the rest (the last possibly partial)
        cached, fresh = adm.cached_pages, adm.fresh_pages
        hashes = page_hashes(cache.layout.layout_id, request.key, ps, cache.chain_key)
        n_cached = len(cached)
        if self.verify and n_cached:
            bad = self.kv.mismatches(rows, cached, hashes[:n_cached])
            tally.verified += adm.cached_tokens
            tally.mismatched += len(bad)
            for p in bad[: MAX_MISMATCH_EXAMPLES - len(tally.examples)].tolist():
                tally.examples.append(VerifyMismatch(request.rid, p, cache.fingerprints.info(request.namespace)))
        n_whole = len(hashes)
        self.kv.write(rows, fresh[:n_whole - n_cached], hashes[n_cached:n_whole])
        if n_whole < n_cached + len(fresh):
            rows[int(fresh[-1])] = _TAIL_FILL


def replay(cache: TieredCache, trace: Iterable[TraceRequest], *, verify: bool = False, batch: int = 4,
           lookahead: int = 8, progress: Callable[[int], object] | None = None,
           on_admit: Callable[[Request, Admission], None] | None = None,
           on_explained: Callable[[Explanation], None] | None = None) -> ReplayReport:
    """Replay `trace` through `cache` (see `Replayer`)."""
    return Replayer(cache, verify=verify, batch=batch, lookahead=lookahead, on_admit=on_admit,
                    on_explained=on_explained).run(trace, progress)

