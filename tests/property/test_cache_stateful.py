"""Random interleavings of the request lifecycle, eviction, backup, load-back — and, over a real LMDB L3, prefetch,
termination, staging, consumption by a request of another namespace and storage writes — over four namespaces.

After every step: the ownership audit is clean. On every match: the bytes of each cached page (device and host)
are the ones written for that page's hash — so a page served across namespaces, a slot reused while still owned,
or a wrong load-back shows up as a content mismatch, not only as a ledger finding.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from factories import make_cache, make_layout, make_store
from kvcache import AdmitStatus, CacheConfig, Namespace, NamespaceMismatch, Request, TieredCache, WritePolicy
from kvcache.config import HostMode, PrefetchPolicy
from kvcache.keys import page_hashes

NAMESPACES = [Namespace("t1", "salt-1"), Namespace("t2", "salt-2"), Namespace("t3"), Namespace()]
# Shared prefixes use the same token ids in every namespace: isolation must come from the namespace alone.
PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9, 9, 9], [20, 21, 22, 23, 24, 25]]
# Hypothesis draws some short runs among the long ones; 300 examples of up to 50 steps give well over 200 runs of
# at least 30 steps, which the test checks. KVC_STATEFUL_EXAMPLES scales it (the bar scales with it).
EXAMPLES = int(os.environ.get("KVC_STATEFUL_EXAMPLES", "300"))
STEPS = 50
LONG_RUN = 30


def page_content(digest: bytes, page_bytes: int) -> torch.Tensor:
    """What a page must hold: its page hash, repeated."""
    reps = -(-page_bytes // len(digest))
    return torch.frombuffer(bytearray((digest * reps)[:page_bytes]), dtype=torch.uint8)


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = None
        self.store = None
        self.tmp = None
        self.live: dict[str, Request] = {}
        self.pending: dict[str, Request] = {}  # prefetched, not yet admitted
        self.counter = 0

    @initialize(page_size=st.sampled_from([1, 2, 4]), policy=st.sampled_from(list(WritePolicy)),
                device_pages=st.integers(6, 24), host_pages=st.integers(4, 32), l3=st.booleans(),
                mode=st.sampled_from(list(HostMode)), prefetch_policy=st.sampled_from(list(PrefetchPolicy)))
    def build(self, page_size, policy, device_pages, host_pages, l3, mode, prefetch_policy):
        if l3:
            self.tmp = tempfile.mkdtemp(prefix="kvc-stateful-")
            self.store = make_store(os.path.join(self.tmp, "store"), make_layout(page_size))
            self.cache = TieredCache(CacheConfig(
                make_layout(page_size), device_tokens=device_pages * page_size, host_tokens=host_pages * page_size,
                device="cpu", write_policy=policy, write_through_threshold=2, host_mode=mode,
                prefetch_policy=prefetch_policy, prefetch_timeout_ms=0, prefetch_retry_interval_ms=0,
                io_batch_pages=2, io_thread=False), self.store)
        else:
            self.cache = make_cache(page_size=page_size, device_tokens=device_pages * page_size,
                                    host_tokens=host_pages * page_size, write_policy=policy,
                                    write_through_threshold=2)
        self.ps = page_size
        self.page_bytes = self.cache.device_pool.page_bytes

    def teardown(self):
        RUN_LENGTHS.append(self.steps)
        if self.store is not None:
            self.cache.close()
            self.store.close()
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _expected(self, req: Request) -> list[bytes]:
        return page_hashes(self.cache.layout.layout_id, req.key, self.ps)

    @rule(ns=st.sampled_from(NAMESPACES), prefix=st.sampled_from(PREFIXES),
          suffix=st.lists(st.integers(0, 3), max_size=10))
    def admit(self, ns, prefix, suffix):
        tokens = prefix + suffix
        if not tokens:
            return
        self.counter += 1
        req = Request(f"r{self.counter}", tokens, ns)
        adm = self.cache.admit(req)
        if adm.status is AdmitStatus.POOL_FULL:
            return
        self.live[req.rid] = req
        # cached pages must already hold this request's own KV
        self._verify_pages(req, self.cache.device_pool, adm.slots[: adm.cached_tokens])

    @rule(data=st.data())
    def commit(self, data):
        if not self.live:
            return
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live.pop(rid)
        adm_slots = self.cache.device_slots(rid)
        hashes = self._expected(req)
        storage = self.cache.device_pool.storage
        cached = len(self.cache._live[rid].cached_pages) * self.ps
        # the forward: write every new token's KV (whole pages from their hash, the tail as noise)
        for i in range(cached // self.ps, -(-len(req) // self.ps)):
            slots = torch.from_numpy(adm_slots[i * self.ps:(i + 1) * self.ps])
            if i < len(hashes):
                storage[slots] = page_content(hashes[i], self.page_bytes).view(self.ps, -1)
            else:
                storage[slots] = 0xAB
        self.cache.commit(rid)

    @rule(data=st.data(), scribble=st.booleans())
    def abort(self, data, scribble):
        if not self.live:
            return
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live.pop(rid)
        if scribble:  # an aborted forward may have written garbage: it must never become visible
            live = self.cache._live[rid]
            if len(live.fresh_pages):
                self.cache.device_pool.pages[torch.from_numpy(live.fresh_pages)] = 0xCD
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

    @rule(ns=st.sampled_from(NAMESPACES), prefix=st.sampled_from(PREFIXES),
          suffix=st.lists(st.integers(0, 3), max_size=10))
    def match_and_verify(self, ns, prefix, suffix):
        tokens = prefix + suffix
        if not tokens:
            return
        req = Request("probe", tokens, ns)
        m = self.cache.match(req)
        dev_slots = self.cache.device_pool.slots(m.device_pages)
        self._verify_pages(req, self.cache.device_pool, dev_slots)
        if len(m.host_pages):
            hashes = self._expected(req)[len(m.device_pages):]
            for page, digest in zip(m.host_pages.tolist(), hashes):
                assert torch.equal(self.cache.host_pool.pages[page], page_content(digest, self.page_bytes)), \
                    f"host page {page} holds another page's KV"

    # --- L3 steps (no-ops without a store) ---

    @rule(ns=st.sampled_from(NAMESPACES), prefix=st.sampled_from(PREFIXES),
          suffix=st.lists(st.integers(0, 3), max_size=10))
    def prefetch(self, ns, prefix, suffix):
        tokens = prefix + suffix
        if self.store is None or not tokens:
            return
        self.counter += 1
        req = Request(f"p{self.counter}", tokens, ns)
        out = self.cache.prefetch(req)
        if out.issued:
            self.pending[req.rid] = req

    @rule(steps=st.integers(1, 4))
    def io_steps(self, steps):
        if self.store is not None:
            self.cache._io.run_pending(max_steps=steps)
            self.cache._take_io_jobs()

    @rule(data=st.data(), foreign=st.booleans())
    def admit_prefetched(self, data, foreign):
        """Admit a prefetched request; `foreign`: the same rid arrives in another namespace (a reused id), so
        its staged record must be dropped, never spliced."""
        if not self.pending:
            return
        rid = data.draw(st.sampled_from(sorted(self.pending)))
        req = self.pending.pop(rid)
        if foreign:
            other = [ns for ns in NAMESPACES if ns != req.namespace][0]
            req = Request(rid, req.tokens, other)
        adm = self.cache.admit(req)
        if adm.status is AdmitStatus.POOL_FULL:
            if self.cache._prefetches.get(rid) or self.cache._staged.get(rid):
                self.cache.release(rid)
            return
        self.live[rid] = req
        self._verify_pages(req, self.cache.device_pool, adm.slots[: adm.cached_tokens])

    @rule(data=st.data())
    def abort_prefetched(self, data):
        if not self.pending:
            return
        rid = data.draw(st.sampled_from(sorted(self.pending)))
        self.pending.pop(rid)
        self.cache.release(rid)

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
        for i in range(len(slots) // self.ps):
            page_slots = torch.from_numpy(np.asarray(slots[i * self.ps:(i + 1) * self.ps]))
            got = pool.storage[page_slots].reshape(-1)
            assert torch.equal(got, page_content(hashes[i], self.page_bytes)), \
                f"{pool.name} page {i} of {req.rid} ({req.namespace.label}) holds another page's KV"

    @invariant()
    def audit_clean(self):
        if self.cache is not None:
            self.steps += 1
            report = self.cache.audit()
            assert report.ok, report.violations

    steps = -1  # invariant checks after the first (initialize) one: the number of rule steps run


RUN_LENGTHS: list[int] = []


def test_random_interleavings_keep_the_ledger_and_the_bytes_right():
    RUN_LENGTHS.clear()
    run_state_machine_as_test(CacheMachine, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))
    long_runs = sum(n >= LONG_RUN for n in RUN_LENGTHS)
    assert long_runs >= EXAMPLES * 2 // 3, f"only {long_runs} of {len(RUN_LENGTHS)} runs had >= {LONG_RUN} steps"
