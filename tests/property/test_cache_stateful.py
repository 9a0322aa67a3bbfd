"""Random interleavings of the request lifecycle, eviction, backup, load-back — and, over a real LMDB L3 behind a
wrapper that fails and reads short, prefetch, termination, staging, namespace drops, namespace expiry (a TTL
policy, sliding or absolute, on a fake clock: deadlines, overflow, deferral, reuse) and storage writes — over four
namespaces, with several requests in flight, request ids reused with other tokens or a shorter prompt, releases at
any point, and device pools from a few pages up (down to less than one request) — kvc's own token-major pool or an
engine's own per-layer K and V tensors (`device_kv`), on the tests' device (KVC_TEST_DEVICE: on a GPU the engine's
writes run on the compute stream and the copies on the copier's, so a page read before its copy's event or freed
while a copy still reads it shows up in the bytes). On the CPU, a run may also lag like a GPU (`gpu_lag`): each
copy's bytes land at once but it reports itself running until a step lets the GPU catch up, and while it runs, no
host page it reads or writes may be free or in the hands of an L3 fetch (the CPU writes those, unordered by any
stream).

After every step: the ownership audit is clean, and every page the tree holds (device and host) holds the bytes
written for its page hash. On every admit: each cached page holds the request's own KV, and the request is never
handed more than it asked for. So a page served across namespaces or across requests that reuse an id, a slot
reused while still owned, or a wrong load-back shows up as a content mismatch, not only as a ledger finding.
"""

from __future__ import annotations

import collections
import os
import random
import shutil
import tempfile
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from devices import TEST_DEVICE
from factories import PendingCopies, engine_kv, forward, make_layout, make_store, write_kv
from kvcache import (
    AdmitStatus,
    CacheConfig,
    Namespace,
    NamespaceMismatch,
    Request,
    TieredCache,
    TTLMode,
    TTLPolicy,
    WritePolicy,
)
from kvcache.errors import RequestIdInUse
from kvcache.types.config import HostMode, PrefetchPolicy
from kvcache.types.keys import page_hashes
from kvcache.types.owners import OwnerKind

NAMESPACES = [Namespace("t1", "salt-1"), Namespace("t2", "salt-2"), Namespace("t3"), Namespace()]
# Shared prefixes use the same token ids in every namespace: isolation must come from the namespace alone.
PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9, 9, 9], [20, 21, 22, 23, 24, 25]]
# Hypothesis draws some short runs among the long ones; 300 examples of up to 50 steps give 200 or more runs of
# at least 30 steps (seen: 213 to 267); the test checks for at least 150. KVC_STATEFUL_EXAMPLES scales it (the
# bar scales with it).
EXAMPLES = int(os.environ.get("KVC_STATEFUL_EXAMPLES", "300"))
STEPS = 50
LONG_RUN = 30

tokens_st = st.tuples(st.sampled_from(PREFIXES), st.lists(st.integers(0, 3), max_size=10))
MAX_TOKENS = max(map(len, PREFIXES)) + 10


def page_content(digest: bytes, page_bytes: int) -> torch.Tensor:
    """What a page must hold: its page hash, repeated."""
    reps = -(-page_bytes // len(digest))
    return torch.frombuffer(bytearray((digest * reps)[:page_bytes]), dtype=torch.uint8)


class FlakyStore:
    """A real LMDB store behind faults: each call may raise (as a dropped connection would) and reads may stop
    short (as a page evicted or found corrupt meanwhile would). Everything else goes to the store."""

    def __init__(self, store, rng: random.Random, fault_rate: float) -> None:
        self._store, self._rng, self._rate = store, rng, fault_rate
        self.faults = 0

    def _fault(self) -> bool:
        hit = self._rng.random() < self._rate
        self.faults += hit
        return hit

    def exists_prefix(self, hashes):
        if self._fault():
            raise OSError("injected: exists_prefix failed")
        n = self._store.exists_prefix(hashes)
        return self._rng.randint(0, n) if n and self._fault() else n

    def get_into(self, hashes, out_views):
        if self._fault():
            raise OSError("injected: get_into failed")
        if hashes and self._fault():  # a short read: only the first k pages arrive
            k = self._rng.randint(0, len(hashes) - 1)
            return self._store.get_into(hashes[:k], out_views[:k])
        return self._store.get_into(hashes, out_views)

    def put(self, hashes, pages, origins):
        if self._fault():
            raise OSError("injected: put failed")
        return self._store.put(hashes, pages, origins)

    def __getattr__(self, name):
        return getattr(self._store, name)


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.gpu: PendingCopies | None = None
        self.cache = None
        self.store = None
        self.tmp = None
        self.live: dict[str, Request] = {}
        self.cached_tokens: dict[str, int] = {}  # rid -> tokens its admission found cached
        self.pending: dict[str, Request] = {}  # prefetched, not yet admitted
        self.committed: list[Request] = []  # what may be in L3 by now: prefetched again after restarts, evictions
        self.counter = 0
        self.now = 0.0  # the fake clock namespace deadlines run on (advanced by `advance_clock`)

    @initialize(page_size=st.sampled_from([1, 2, 4]), policy=st.sampled_from(list(WritePolicy)),
                device_requests=st.sampled_from([0.5, 1, 1, 1.5, 2, 4]), host_pages=st.integers(4, 32),
                l3=st.sampled_from([True, True, False]), mode=st.sampled_from(list(HostMode)),
                prefetch_policy=st.sampled_from(list(PrefetchPolicy)), seed=st.integers(0, 2**32 - 1),
                fault_rate=st.sampled_from([0.0, 0.0, 0.05, 0.2]),
                ttl=st.sampled_from([None, None, TTLMode.SLIDING, TTLMode.ABSOLUTE]), engine=st.booleans(),
                gpu_lag=st.booleans())
    def build(self, page_size, policy, device_requests, host_pages, l3, mode, prefetch_policy, seed, fault_rate,
              ttl, engine, gpu_lag):
        # the device pool in requests of the longest kind (20 tokens): half of one (it is refused) up to four
        device_pages = max(1, int(device_requests * -(-MAX_TOKENS // page_size)))
        # `engine`: L1 is an engine's own tensors, two layers of K and V (pages in kv_layer order), not kvc's pool
        self.layout = make_layout(page_size, layers=2, arrangement="kv_layer") if engine else make_layout(page_size)
        self.engine = engine
        device_kv = engine_kv(self.layout, device_pages * page_size) if engine else None
        if l3:
            self.tmp = tempfile.mkdtemp(prefix="kvc-stateful-")
            self.store = make_store(os.path.join(self.tmp, "store"), self.layout)
            self.flaky = FlakyStore(self.store, random.Random(seed), fault_rate)
            self.config = CacheConfig(
                self.layout, device_tokens=device_pages * page_size, host_tokens=host_pages * page_size,
                device=TEST_DEVICE, write_policy=policy, write_through_threshold=2, host_mode=mode,
                prefetch_policy=prefetch_policy, prefetch_timeout_ms=0, prefetch_timeout_per_page_ms=0,
                prefetch_retry_interval_ms=0,
                io_batch_pages=2, io_thread=False,
                ttl=TTLPolicy(ttl, 5.0, 8.0, 3, 1.0) if ttl is not None else None)  # 3 of the 4 namespaces
            self._seed_store(page_size)
            self.cache = TieredCache(self.config, self.flaky, clock=self.clock, device_kv=device_kv)
        else:
            self.cache = TieredCache(CacheConfig(self.layout, device_tokens=device_pages * page_size,
                                                 host_tokens=host_pages * page_size, device=TEST_DEVICE,
                                                 write_policy=policy, write_through_threshold=2), device_kv=device_kv)
        self.ps = page_size
        self.page_bytes = self.cache.device_pool.page_bytes
        self.gpu_lag = gpu_lag and not TEST_DEVICE.startswith("cuda")  # a GPU lags by itself
        self._lag()

    def _lag(self) -> None:
        """With `gpu_lag`, the cache's copies report themselves running until `gpu_catches_up`."""
        self.gpu = PendingCopies(self.cache, setattr) if self.gpu_lag else None

    def _seed_store(self, page_size: int) -> None:
        """An earlier process wrote some sequences of two namespaces to L3 (with the bytes of their page hashes)."""
        config = CacheConfig(self.layout, device_tokens=64 * page_size, host_tokens=64 * page_size,
                             device=TEST_DEVICE)
        writer = TieredCache(config, self.store,
                             device_kv=engine_kv(self.layout, 64 * page_size) if self.engine else None)
        for i, ns in enumerate(NAMESPACES[:2]):
            for j, prefix in enumerate(PREFIXES[1:]):
                req = Request(f"seed{i}.{j}", prefix + [j, i, 0, 1], ns)
                forward(writer, req, writer.admit(req))
                writer.commit(req.rid)
                self.committed.append(req)
        writer.close()

    def clock(self) -> float:
        return self.now

    @staticmethod
    def _expected_for(cache, req: Request) -> list[bytes]:
        return page_hashes(cache.layout.layout_id, req.key, cache.page_size, cache.chain_key)

    def teardown(self):
        RUN_LENGTHS.append(self.steps)
        SEEN["runs with L3" if self.store is not None else "runs without L3"] += 1
        SEEN["runs over an engine's tensors" if self.engine else "runs over kvc's own pool"] += 1
        if self.gpu is not None:
            SEEN["runs lagging like a GPU"] += 1
            SEEN["copies issued while lagging"] += len(self.gpu.copies)
        if self.cache is not None:
            _tally(self.cache)
        if self.store is not None:
            for rid in list(self.live):
                self.cache.release(rid)
            self.cache.close()  # gives back every prefetch and staged record: nothing stays held
            assert self.cache.audit().ok and self.cache.headroom().device.busy == 0
            self.store.close()
            shutil.rmtree(self.tmp, ignore_errors=True)

    @property
    def has_live(self) -> bool:
        return bool(self.live)

    @property
    def has_store(self) -> bool:
        return self.store is not None

    @property
    def has_pending(self) -> bool:
        # An admission may have cancelled a pending request's prefetch (its device hold, youngest first).
        # So may an expiry of its namespace (it gives back the namespace's prefetches).
        for rid in [r for r in self.pending if not self.cache.holds(r)]:
            st_ = self.cache.stats()
            assert st_.prefetch.cancelled or (st_.ttl is not None and st_.ttl.expired), \
                f"{rid}'s prefetch is gone and none was cancelled or expired"
            del self.pending[rid]
        return bool(self.pending)

    @property
    def has_committed(self) -> bool:
        return self.store is not None and bool(self.committed)

    def _expected(self, req: Request) -> list[bytes]:
        return page_hashes(self.cache.layout.layout_id, req.key, self.ps, self.cache.chain_key)

    def _rid(self, kind: str) -> str:
        self.counter += 1
        return f"{kind}{self.counter}"

    def _admit(self, req: Request) -> bool:
        """Admit `req`; on success it is live and its cached pages were checked to be its own KV."""
        adm = self.cache.admit(req)
        if adm.status is AdmitStatus.TOO_LARGE:
            assert -(-len(req) // self.ps) > self.cache.device_pool.num_pages
            assert not self.cache.holds(req.rid)
            return False
        if adm.status is AdmitStatus.POOL_FULL:
            assert self.live, "refused with nothing else running"
            return False
        assert 0 <= adm.cached_tokens <= len(req) and adm.cached_tokens + adm.new_tokens == len(req)
        assert len(adm.slots) == len(req)
        self.live[req.rid] = req
        self.cached_tokens[req.rid] = adm.cached_tokens
        self._verify_pages(req, self.cache.device_pool, adm.slots[: adm.cached_tokens])
        return True

    @rule(ns=st.sampled_from(NAMESPACES), tokens=tokens_st)
    def admit(self, ns, tokens):
        tokens = tokens[0] + tokens[1]
        if tokens:
            self._admit(Request(self._rid("r"), tokens, ns))

    @precondition(lambda self: self.has_live)
    @rule(data=st.data())
    def commit(self, data):
        if not self.live:
            return
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live.pop(rid)
        cached = self.cached_tokens.pop(rid)
        # the forward: write every new token's KV (whole pages from their hash, the tail as noise)
        write_kv(self.cache, req, self.cache.device_slots(rid), cached)
        self.cache.commit(rid)
        self.committed.append(req)

    @precondition(lambda self: self.has_live)
    @rule(data=st.data(), scribble=st.booleans())
    def abort(self, data, scribble):
        if not self.live:
            return
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live.pop(rid)
        cached = self.cached_tokens.pop(rid)
        if scribble:  # an aborted forward may have written garbage: it must never become visible
            fresh_pages = self.cache.device_slots(rid)[cached::self.ps] // self.ps
            if len(fresh_pages):
                self.cache.device_pool.kv.write(fresh_pages, np.full((len(fresh_pages), self.page_bytes), 0xCD,
                                                                     dtype=np.uint8))
        self.cache.release(req.rid)

    @rule(device=st.integers(0, 12), host=st.integers(0, 12))
    def evict(self, device, host):
        self.cache.evict(device_tokens=device * self.ps, host_tokens=host * self.ps)

    @rule()
    def poll(self):
        self.cache.poll()

    @rule()
    def flush(self):
        self.cache.flush()

    @rule(ns=st.sampled_from(NAMESPACES), tokens=tokens_st)
    def match_and_verify(self, ns, tokens):
        tokens = tokens[0] + tokens[1]
        if not tokens:
            return
        req = Request("probe", tokens, ns)
        m = self.cache.match(req)
        dev_slots = self.cache.device_pool.slots(m.device_pages)
        self._verify_pages(req, self.cache.device_pool, dev_slots)
        if len(m.host_pages):
            hashes = self._expected(req)[len(m.device_pages):]
            for page, digest in zip(m.host_pages.tolist(), hashes, strict=False):  # the host hit: a prefix of the rest
                assert torch.equal(self.cache.host_pool.pages[page], page_content(digest, self.page_bytes)), \
                    f"host page {page} holds another page's KV"

    # --- L3 steps (no-ops without a store) ---

    @precondition(lambda self: self.has_store)
    @rule(ns=st.sampled_from(NAMESPACES), tokens=tokens_st)
    def prefetch(self, ns, tokens):
        tokens = tokens[0] + tokens[1]
        if self.store is None or not tokens:
            return
        req = Request(self._rid("p"), tokens, ns)
        out = self.cache.prefetch(req)
        if out.issued:
            self.pending[req.rid] = req

    @precondition(lambda self: self.has_committed)
    @rule(data=st.data(), extend=st.lists(st.integers(0, 3), max_size=6))
    def prefetch_stored(self, data, extend):
        """Prefetch a sequence committed earlier (perhaps extended): after evictions and restarts it is in L3."""
        if self.store is None or not self.committed:
            return
        done = data.draw(st.sampled_from(self.committed))
        req = Request(self._rid("p"), done.tokens + extend, done.namespace)
        if self.cache.prefetch(req).issued:
            self.pending[req.rid] = req

    @precondition(lambda self: self.has_store)
    @rule(steps=st.integers(1, 4))
    def io_steps(self, steps):
        if self.store is not None:
            self.cache.run_io(max_steps=steps)

    @precondition(lambda self: self.has_pending)
    @rule(data=st.data(), arrived=st.booleans())
    def admit_prefetched(self, data, arrived):
        """Admit a prefetched request, after its fetch has arrived (`arrived`) or whenever."""
        if not self.pending:
            return
        if arrived:
            self.cache.flush()
        rid = data.draw(st.sampled_from(sorted(self.pending)))
        if self._admit(self.pending[rid]) or not self.cache.holds(rid):
            del self.pending[rid]  # admitted, or too large (its holds were given back)

    @precondition(lambda self: self.has_pending)
    @rule(data=st.data(), how=st.sampled_from(["namespace", "tokens", "shorter", "longer"]))
    def reuse_rid(self, data, how):
        """A held request id arrives again for another request: in another namespace, with other tokens, with a
        shorter or a longer prompt. A prefetch for it is refused before anything moves; its admit never hands
        out what was fetched for the other request."""
        if not self.pending:
            return
        rid = data.draw(st.sampled_from(sorted(self.pending)))
        held = self.pending[rid]
        tokens = held.tokens
        if how == "namespace":
            other = Request(rid, tokens, [ns for ns in NAMESPACES if ns != held.namespace][0])
        elif how == "tokens":
            other = Request(rid, [t + 100 for t in tokens], held.namespace)
        elif how == "shorter":  # shorter than what is held for it (a prefetch may hold less than the request)
            held_tokens = len(next(h.key for h in (*self.cache.prefetch_ops(), *self.cache.staged_records())
                                   if h.rid == rid))
            if held_tokens < 2:
                return
            other = Request(rid, tokens[: data.draw(st.integers(1, held_tokens - 1))], held.namespace)
        else:
            other = Request(rid, tokens + [7, 7, 7], held.namespace)  # the same request, grown: not a conflict
        used = (self.cache.host_pool.used_pages, self.cache.device_pool.used_pages)
        if how != "longer":
            with pytest.raises(RequestIdInUse):
                self.cache.prefetch(other)
            assert (self.cache.host_pool.used_pages, self.cache.device_pool.used_pages) == used
        del self.pending[rid]
        if not self._admit(other) and self.cache.holds(rid):
            self.cache.release(rid)

    @precondition(lambda self: self.has_pending)
    @rule(data=st.data())
    def abort_prefetched(self, data):
        if not self.pending:
            return
        rid = data.draw(st.sampled_from(sorted(self.pending)))
        self.pending.pop(rid)
        self.cache.release(rid)

    @precondition(lambda self: self.has_store)
    @rule()
    def restart(self):
        """The engine restarts over the same store: L1 and L2 start empty, L3 keeps what was written."""
        if self.store is None:
            return
        for rid in list(self.live):
            self.cache.release(rid)
        self.cache.close()
        assert self.cache.audit().ok and self.cache.headroom().device.busy == 0
        self.live.clear()
        self.pending.clear()
        _tally(self.cache)
        self.cache = TieredCache(self.config, self.flaky, clock=self.clock)
        self._lag()

    @precondition(lambda self: self.gpu is not None)
    @rule(copies=st.integers(1, 3))
    def gpu_catches_up(self, copies):
        """The GPU gets through the oldest running copies (one stream: in the order they were queued)."""
        assert self.gpu is not None
        self.gpu.finish(copies)

    @rule(ns=st.sampled_from(NAMESPACES), device=st.integers(0, 12), host=st.integers(0, 12))
    def set_shares(self, ns, device, host):
        """Shares (0 pages: none on that tier) only reorder eviction: every invariant holds with any of them."""
        from kvcache.types.shares import Shares

        self.cache.set_shares(ns, Shares(device_tokens=device * self.ps, host_tokens=host * self.ps))
        self.cache.tree.check()

    @precondition(lambda self: self.has_store)
    @rule(ns=st.sampled_from(NAMESPACES))
    def drop_namespace(self, ns):
        if self.store is None:
            return
        self.cache.drop_namespace(ns)
        for rid in [r for r, req in self.pending.items() if req.namespace == ns]:
            assert not self.cache.holds(rid)
            del self.pending[rid]
        if not any(req.namespace == ns for req in self.live.values()):
            probe = Request("probe", PREFIXES[1], ns)
            m = self.cache.match(probe)
            assert m.device_tokens == m.host_tokens == 0

    @precondition(lambda self: self.has_store)
    @rule(seconds=st.sampled_from([0.5, 2.0, 4.0, 6.0]))
    def advance_clock(self, seconds):
        """Time passes and the engine polls: namespaces past their deadline expire (or wait for their requests)."""
        self.now += seconds
        self.cache.poll()
        tracker = self.cache.ttl_tracker
        if tracker is None:
            return
        for ns in NAMESPACES:
            if ns not in tracker:  # expired (or never used): nothing of it is cached
                assert self.cache.tree.namespace_root(ns) is None, f"{ns.label} expired but is still cached"
            if not any(req.namespace == ns for req in self.live.values()):
                assert ns.id not in tracker.deferred or ns.id in tracker.ready, f"{ns.label} waits for nothing"

    @precondition(lambda self: self.has_store)
    @rule(data=st.data())
    def foreign_anchor(self, data):
        """A prefetch handed a match taken for another namespace's request must be refused, holding nothing."""
        if self.store is None:
            return
        ns_a, ns_b = data.draw(st.sampled_from([(NAMESPACES[0], NAMESPACES[1]), (NAMESPACES[2], NAMESPACES[3])]))
        m = self.cache.tree.match_prefix(Request("m", PREFIXES[1], ns_a).key)
        if m.anchor is self.cache.tree.root and m.host_node is self.cache.tree.root:
            return
        before = (self.cache.host_pool.used_pages, self.cache.device_pool.used_pages)
        try:
            self.cache.prefetch(Request("foreign", PREFIXES[1] + [3], ns_b), m)
        except NamespaceMismatch:
            pass
        else:
            raise AssertionError("a foreign anchor was accepted")
        assert (self.cache.host_pool.used_pages, self.cache.device_pool.used_pages) == before

    def _verify_pages(self, req, pool, slots):
        hashes = self._expected(req)
        n = len(slots) // self.ps
        pages = pool.kv.read(np.asarray(slots[: n * self.ps: self.ps]) // self.ps)
        for i in range(n):
            assert np.array_equal(pages[i], page_content(hashes[i], self.page_bytes).numpy()), \
                f"{pool.name} page {i} of {req.rid} ({req.namespace.label}) holds another page's KV"

    @invariant()
    def audit_clean(self):
        if self.cache is not None:
            self.steps += 1
            report = self.cache.audit()
            assert report.ok, report.violations

    @invariant()
    def no_host_page_under_a_running_copy_is_free_or_fetched_into(self):
        if self.cache is None or self.gpu is None:
            return
        host = self.cache.host_pool
        for _, src, src_pages, _, dst_pages in self.gpu.running():
            pages = src_pages if src is host else dst_pages
            kinds = {int(code) >> 48 for code in host.owners(pages).tolist()}
            assert not kinds & {OwnerKind.FREE, OwnerKind.OP_PREFETCH}, \
                f"host pages {pages.tolist()} of a running copy are owned by {sorted(kinds)}"

    @invariant()
    def tree_counts_match_a_recount(self):
        if self.cache is not None:
            self.cache.tree.check()  # children with a device / host copy per node, the node count, share use

    @invariant()
    def every_cached_page_holds_its_hash(self):
        if self.cache is None:
            return
        tree = self.cache.tree
        for node in tree.nodes():
            for pool, pages in ((self.cache.device_pool, node.device), (self.cache.host_pool, node.host)):
                if pages is None:
                    continue
                held = pool.kv.read(pages)
                for row, page, digest in zip(held, pages.tolist(), tree.page_hashes(node), strict=True):
                    assert np.array_equal(row, page_content(digest, self.page_bytes).numpy()), \
                        f"{pool.name} page {page} of node #{node.id} holds another page's KV"

    steps = -1  # invariant checks after the first (initialize) one: the number of rule steps run


RUN_LENGTHS: list[int] = []
SEEN: collections.Counter[str] = collections.Counter()  # what the runs exercised, printed with the timing


def _tally(cache) -> None:
    """Add what one cache did to SEEN."""
    st_ = cache.stats()
    SEEN["prefetches issued"] += st_.prefetch.issued
    SEEN["pages found in L3"] += st_.prefetch.hit_pages
    SEEN["pages used from L3"] += st_.prefetch.used_pages
    SEEN["pages written to L3"] += st_.backup.storage_pages
    SEEN["read errors"] += st_.prefetch.read_errors
    SEEN["write failures"] += st_.backup.storage_failed
    SEEN["holds cancelled"] += sum(st_.prefetch.cancelled.values())
    for reason, n in st_.prefetch.dropped.items():
        SEEN[f"pages dropped: {reason}"] += n
    SEEN["admitted"] += st_.counters.admitted
    SEEN["pool_full"] += st_.counters.refused
    SEEN["too_large"] += st_.counters.too_large
    if st_.ttl is not None:
        for cause, n in st_.ttl.expired.items():
            SEEN[f"namespaces expired: {cause}"] += n
        SEEN["expiries deferred"] += st_.ttl.deferred
        SEEN["deferrals cancelled"] += st_.ttl.cancelled


def test_random_interleavings_keep_the_ledger_and_the_bytes_right():
    RUN_LENGTHS.clear()
    SEEN.clear()
    start = time.perf_counter()
    run_state_machine_as_test(CacheMachine, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))
    long_runs = sum(n >= LONG_RUN for n in RUN_LENGTHS)
    print(f"stateful: {len(RUN_LENGTHS)} runs, {sum(RUN_LENGTHS)} steps, {long_runs} of >= {LONG_RUN} steps, "
          f"{time.perf_counter() - start:.1f} s; " + ", ".join(f"{k} {v}" for k, v in sorted(SEEN.items())))
    assert long_runs >= EXAMPLES // 2, f"only {long_runs} of {len(RUN_LENGTHS)} runs had >= {LONG_RUN} steps"
