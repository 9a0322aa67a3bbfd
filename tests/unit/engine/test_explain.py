"""`TieredCache.explain`: each reason a tier can give for a request's first missing page, each driven for real — a
cache on a real LMDB store brought into that state by the calls that cause it — and read back from explain."""

from __future__ import annotations

import time

import numpy as np
import pytest

import factories
from devices import TEST_DEVICE
from factories import l3_cache, make_layout, make_store
from kvcache import CacheConfig, Namespace, Request, TieredCache
from kvcache.types.config import HostMode, PrefetchPolicy, TTLPolicy
from kvcache.types.explain import MissReason, PrefetchFate
from kvcache.types.keys import page_hashes
from kvcache.types.removals import RemovalReason
from kvcache.types.results import AdmitStatus, DeclineReason, DropReason
from kvcache.types.shares import Shares
from lmdb_surgery import raw

PS = 4
A = Namespace("tenant-a", "salt-a")
B = Namespace("tenant-b", "salt-b")


def req(rid: str, first: int, pages: int = 4, ns: Namespace = A) -> Request:
    return Request(rid, np.arange(first, first + pages * PS, dtype=np.uint32), ns)


def serve(cache, request: Request) -> None:
    """Admit, forward (synthetic KV), commit and flush: the request's pages reach L1, L2 and (write-through) L3."""
    factories.serve(cache, request)
    cache.flush()


@pytest.fixture
def store(tmp_path):
    s = make_store(tmp_path / "s", make_layout(PS))
    yield s
    s.close()


def test_nothing_anywhere_is_never_written_in_every_tier(store):
    cache = l3_cache(store, PS)
    e = cache.explain(req("r", 100))
    for tier in (e.device, e.host, e.storage):
        assert tier is not None and tier.matched_tokens == 0
        assert tier.first_miss is not None and tier.first_miss.page == 0
        assert tier.first_miss.reason is MissReason.NEVER_WRITTEN
    assert e.hits.device == e.hits.host == e.hits.storage == 0
    assert e.prefetch is None


def test_a_served_request_matches_every_tier(store):
    cache = l3_cache(store, PS)
    r = req("r", 100)
    serve(cache, r)
    e = cache.explain(r)
    assert [t.matched_tokens for t in (e.device, e.host, e.storage)] == [16, 16, 16]
    assert all(t.first_miss is None for t in (e.device, e.host, e.storage))
    assert (e.hits.device, e.hits.host, e.hits.storage) == (16, 0, 0)
    assert e.namespace.extra_key == "tenant-a" and "salt-a" not in repr(e)


def test_capacity_eviction_from_l1_then_l2_says_when(store):
    cache = l3_cache(store, PS, device_tokens=16, host_tokens=32)
    t0 = time.time()
    first = req("a", 100)
    serve(cache, first)
    serve(cache, req("b", 200))  # L1 holds 4 pages: `a` leaves it, keeps its host copy
    e = cache.explain(first)
    assert e.device.matched_tokens == 0
    miss = e.device.first_miss
    assert miss.reason is MissReason.REMOVED and miss.removal.reason is RemovalReason.CAPACITY
    assert t0 <= miss.removal.at <= time.time()
    assert e.host.first_miss is None and e.hits.host == 16
    serve(cache, req("c", 300))  # L2 holds 8 pages: `a` (least recently used) leaves it too
    e = cache.explain(first)
    assert e.host.first_miss.reason is MissReason.REMOVED
    assert e.host.first_miss.removal.reason is RemovalReason.CAPACITY
    assert e.storage.first_miss is None and e.hits.storage == 16  # L3 still has it: an admission fetches it


def test_share_eviction_is_named_share(store):
    cache = l3_cache(store, PS, device_tokens=32, host_tokens=64)
    cache.set_shares(A, Shares(device_tokens=16))
    a1, a2 = req("a1", 100), req("a2", 200)
    serve(cache, a1)
    serve(cache, a2)  # A holds 8 device pages, twice its share
    serve(cache, req("b1", 300, ns=B))  # room for B: A's pages over its share go first
    miss = cache.explain(a1).device.first_miss
    assert miss.reason is MissReason.REMOVED and miss.removal.reason is RemovalReason.SHARE


def test_requested_eviction_is_named_evict(store):
    cache = l3_cache(store, PS)
    r = req("a", 100)
    serve(cache, r)
    cache.evict_namespace(A, device=True, host=False)
    miss = cache.explain(r).device.first_miss
    assert miss.reason is MissReason.REMOVED and miss.removal.reason is RemovalReason.EVICT


def test_drop_is_named_in_every_tier(store):
    cache = l3_cache(store, PS)
    r = req("a", 100)
    serve(cache, r)
    cache.drop_namespace(A)
    e = cache.explain(r)
    for tier in (e.device, e.host, e.storage):
        assert tier.matched_tokens == 0
        assert tier.first_miss.reason is MissReason.REMOVED
        assert tier.first_miss.removal.reason is RemovalReason.DROP


def test_ttl_expiry_is_named_ttl_in_every_tier(store):
    now = [1000.0]
    config = CacheConfig(make_layout(PS), device_tokens=64, host_tokens=64, device=TEST_DEVICE, io_thread=False,
                         ttl=TTLPolicy(default_ttl_s=10.0, sweep_interval_s=0.0))
    cache = TieredCache(config, store, clock=lambda: now[0])
    r = req("a", 100)
    serve(cache, r)
    now[0] += 11.0
    cache.poll()  # the sweep drops A from every tier
    e = cache.explain(r)
    for tier in (e.device, e.host, e.storage):
        assert tier.first_miss.reason is MissReason.REMOVED
        assert tier.first_miss.removal.reason is RemovalReason.TTL


def test_store_capacity_eviction_is_named_capacity(tmp_path):
    from kvcache.storage.api import CapacityPolicy

    layout = make_layout(PS)
    page = layout.bytes_per_page
    store = make_store(tmp_path / "s", layout, capacity=CapacityPolicy(capacity_bytes=6 * page, evict_headroom=0.0))
    try:
        cache = l3_cache(store, PS)
        first = req("a", 100)
        serve(cache, first)
        serve(cache, req("b", 200))  # 8 pages into room for 6: the store evicts `a`'s least recently used pages
        miss = cache.explain(first).storage.first_miss
        assert miss.reason is MissReason.REMOVED and miss.removal.reason is RemovalReason.CAPACITY
    finally:
        store.close()


def _damage(path: str, page_hash: bytes) -> None:
    """Flip one payload byte of a stored page (the store closed): its checksum no longer holds."""
    with raw(path, recount=False) as r:
        value = bytearray(r.txn.get(page_hash, db=r.db["pages"]))
        value[-1] ^= 0xFF
        r.txn.put(page_hash, bytes(value), db=r.db["pages"])


def _written(tmp_path, request: Request) -> tuple[str, list[bytes]]:
    """A store holding `request`'s pages, closed; its path and the request's page hashes."""
    path = str(tmp_path / "s")
    store = make_store(path, make_layout(PS))
    cache = l3_cache(store, PS)
    serve(cache, request)
    hashes = page_hashes(cache.layout.layout_id, request.key, PS, cache.chain_key)
    cache.close()
    store.close()
    return path, hashes


def test_a_page_failing_its_checksum_is_quarantined_then_recorded(tmp_path):
    r = req("a", 100)
    path, hashes = _written(tmp_path, r)
    _damage(path, hashes[1])
    store = make_store(path, make_layout(PS))
    try:
        cache = l3_cache(store, PS)
        cache.prefetch(r)
        settled = cache.settle_prefetch(r.rid, PrefetchPolicy.WAIT_COMPLETE)  # reads page 1: checksum fails
        assert settled.fetched_pages == 1
        e = cache.explain(r)
        assert e.storage.matched_tokens == 4
        assert e.storage.first_miss.page == 1 and e.storage.first_miss.reason is MissReason.QUARANTINED
        store.flush()  # the handle's next write takes the bad page out of the store, and records why
        miss = cache.explain(r).storage.first_miss
        assert miss.reason is MissReason.QUARANTINED and miss.removal.reason is RemovalReason.QUARANTINE
    finally:
        store.close()


def test_a_page_removed_by_repair_is_named_repair(tmp_path):
    r = req("a", 100)
    path, hashes = _written(tmp_path, r)
    _damage(path, hashes[2])
    store = make_store(path, make_layout(PS))
    try:
        assert store.verify(repair=True).repaired >= 1
        miss = l3_cache(store, PS).explain(r).storage.first_miss
        assert miss.page == 2 and miss.reason is MissReason.REMOVED and miss.removal.reason is RemovalReason.REPAIR
    finally:
        store.close()


def test_seed_scenario_pages_filed_under_the_default_namespace(store):
    """Tenant B's prompt written and prefetched under the root anchor's (default) namespace: B never hits, and
    explain says its prefix is held under one other namespace of this layout, not that it was never written."""
    default = Namespace()
    tokens = np.arange(500, 516, dtype=np.uint32)
    serve(l3_cache(store, PS), Request("w", tokens, default))  # filed under the default namespace
    cache = l3_cache(store, PS)  # a fresh cache on the store: its tree holds nothing yet
    anchored = Request("p", tokens, default)  # the prefetch keyed by the anchor's namespace
    cache.prefetch(anchored)
    cache.settle_prefetch("p", PrefetchPolicy.WAIT_COMPLETE)  # host-only nodes under the default namespace
    e = cache.explain(Request("b", tokens, B))
    assert e.storage.first_miss.reason is MissReason.OTHER_NAMESPACE and e.storage.first_miss.other_namespaces == 1
    assert e.host.first_miss.reason is MissReason.OTHER_NAMESPACE and e.host.first_miss.other_namespaces == 1
    assert e.device.first_miss.reason is MissReason.NEVER_WRITTEN  # nothing of it on the device anywhere
    assert e.hits.storage == 0


def test_pages_under_another_layout_are_named_other_layout(tmp_path):
    from kvcache.storage.registry import open_store

    def cache_on(store, layout):
        return TieredCache(CacheConfig(layout, device_tokens=64, host_tokens=64, device=TEST_DEVICE, io_thread=False),
                           store)

    path, x, y = str(tmp_path / "s"), make_layout(PS, model="model-x@r1"), make_layout(PS, model="model-y@r1")
    tokens = np.arange(700, 716, dtype=np.uint32)
    first = make_store(path, x)
    serve(cache_on(first, x), Request("x", tokens, A))  # written under model x's layout
    first.close()
    second = open_store(path, y, add_layout=True, durability="none")
    try:
        miss = cache_on(second, y).explain(Request("y", tokens, A)).storage.first_miss
        assert miss.reason is MissReason.OTHER_LAYOUT and miss.other_layouts == 1 and miss.other_namespaces == 0
    finally:
        second.close()


def test_prefetch_fates_are_recorded(store):
    r = req("a", 100)
    serve(l3_cache(store, PS), r)
    cache = l3_cache(store, PS, prefetch_threshold_tokens=64)
    cache.prefetch(r)  # 16 tokens to fetch, under the threshold
    p = cache.explain(r).prefetch
    assert p.fate is PrefetchFate.DECLINED and p.declined is DeclineReason.BELOW_THRESHOLD
    assert (p.start_tokens, p.requested_tokens) == (0, 16)

    cache = l3_cache(store, PS)
    cache.prefetch(r)
    assert cache.explain(r).prefetch.fate is PrefetchFate.IN_FLIGHT
    cache.settle_prefetch(r.rid, PrefetchPolicy.WAIT_COMPLETE)
    p = cache.explain(r).prefetch
    assert p.fate is PrefetchFate.COMPLETED and p.hit_tokens == p.fetched_tokens == 16

    cache = l3_cache(store, PS)
    cache.prefetch(r)
    cache.release(r.rid)
    p = cache.explain(r).prefetch
    assert p.fate is PrefetchFate.DROPPED and p.dropped is DropReason.ABORTED

    # a zero budget: the settle gives up before the inline I/O has run its check
    cache = l3_cache(store, PS, prefetch_policy=PrefetchPolicy.TIMEOUT, prefetch_timeout_ms=0.0,
                     prefetch_timeout_per_page_ms=0.0)
    cache.prefetch(r)
    cache.settle_prefetch(r.rid)
    p = cache.explain(r).prefetch
    assert p.fate is PrefetchFate.TIMED_OUT and p.fetched_tokens == 0


def test_a_full_removal_record_says_no_record_rather_than_never_written(store):
    from kvcache.engine.recent import RecentRemovals
    from kvcache.types.tier import Tier

    log = RecentRemovals(kept=2)
    log.removed(Tier.DEVICE, [b"a" * 16, b"b" * 16], RemovalReason.CAPACITY)
    assert log.complete(Tier.DEVICE)
    log.removed(Tier.DEVICE, [b"c" * 16], RemovalReason.SHARE)
    assert not log.complete(Tier.DEVICE) and log.complete(Tier.HOST)
    assert log.get(Tier.DEVICE, b"a" * 16) is None and log.get(Tier.DEVICE, b"c" * 16).reason is RemovalReason.SHARE
    cache = l3_cache(store, PS)
    cache.removals.kept = 2
    serve(cache, req("a", 100))
    serve(cache, req("b", 200))
    cache.evict_namespace(A, device=True, host=False)  # two nodes: the first one's records are let go of
    assert cache.explain(req("z", 900)).device.first_miss.reason is MissReason.NO_RECORD
    assert cache.explain(req("z", 900)).host.first_miss.reason is MissReason.NEVER_WRITTEN  # L2 removed nothing


def test_a_victim_never_hashed_is_not_hashed_by_its_eviction_and_says_no_record():
    # A cache without a store computes no page hash on its own; its eviction path must not start to (it is the hot
    # path of an L1/L2 serve loop), so such a victim goes unrecorded, and the tier then answers "no record".
    from factories import make_cache

    cache = make_cache(PS, device_tokens=16, host_tokens=0)
    a = req("a", 100)
    adm = cache.admit(a)
    cache.commit(a.rid)
    (node,) = [n for n in cache.tree.nodes() if n.key]  # a's one node
    assert node.page_hashes is None  # nothing hashed it
    b = req("b", 200)
    assert cache.admit(b).status is AdmitStatus.ADMITTED  # `a` is evicted to make room
    cache.commit(b.rid)
    assert node.page_hashes is None and adm.status is AdmitStatus.ADMITTED
    e = cache.explain(a)
    assert e.device.matched_tokens == 0 and e.device.first_miss.reason is MissReason.NO_RECORD
    fresh = make_cache(PS, device_tokens=16, host_tokens=0)
    assert fresh.explain(a).device.first_miss.reason is MissReason.NEVER_WRITTEN  # nothing removed: complete


def test_a_prefetch_cancelled_for_an_admission_is_named_cancelled(store):
    """Buffer mode: four finished prefetches hold every device page; an admission that fits the pool cancels the
    youngest holds (their staged records given back), and explain says so for each; the oldest stays completed."""
    tenants = [Namespace(f"t{i}", f"salt-{i}") for i in range(4)]
    prefixes = [list(range(1000 + 100 * i, 1000 + 100 * i + 2 * PS)) for i in range(4)]
    whole = [p + list(range(5000 + 100 * i, 5000 + 100 * i + 2 * PS)) for i, p in enumerate(prefixes)]
    seed = l3_cache(store, PS, device_tokens=64 * PS, host_tokens=64 * PS)
    for i, ns in enumerate(tenants):
        serve(seed, Request(f"seed{i}", whole[i], ns))
    seed.close()
    cache = l3_cache(store, PS, device_tokens=8 * PS, host_tokens=64 * PS, host_mode=HostMode.BUFFER,
                     prefetch_max_device_tokens=8 * PS)
    for i, ns in enumerate(tenants):
        serve(cache, Request(f"p{i}", prefixes[i], ns))  # every tenant's 2-page prefix on the device
    waiting = [Request(f"r{i}", whole[i], ns) for i, ns in enumerate(tenants)]
    for r in waiting:
        assert cache.prefetch(r).issued
    cache.flush()  # each fetch finished and parked as a staged record, holding its prefix on the device
    assert cache.explain(waiting[3]).prefetch.fate is PrefetchFate.COMPLETED
    assert cache.admit(Request("big", list(range(7000, 7000 + 6 * PS)), Namespace("other"))).status \
        is AdmitStatus.ADMITTED
    for r in waiting[1:]:
        p = cache.explain(r).prefetch
        assert p.fate is PrefetchFate.CANCELLED and p.dropped is DropReason.CANCELLED, r.rid
        assert p.fetched_tokens == 2 * PS
    assert cache.explain(waiting[0]).prefetch.fate is PrefetchFate.COMPLETED  # the oldest hold is kept


def test_explain_changes_nothing(store):
    """A request diverging inside a node would split it on a match: explain walks without splitting, counting a
    hit or touching the LRU clock, and the store's records stay as they were."""
    cache = l3_cache(store, PS)
    served = req("a", 100, pages=6)
    serve(cache, served)
    before = (cache.snapshot().state, cache.tree.node_count, [n.last_access for n in cache.tree.nodes()],
              cache.stats().counters, store.namespaces())
    tokens = np.concatenate([served.tokens[:10], np.arange(900, 914, dtype=np.uint32)])  # diverges in page 2
    e = cache.explain(Request("x", tokens, A))
    assert e.device.matched_tokens == 8 and e.device.first_miss.page == 2
    after = (cache.snapshot().state, cache.tree.node_count, [n.last_access for n in cache.tree.nodes()],
             cache.stats().counters, store.namespaces())
    assert after == before


def test_over_a_page_store_without_administration_the_store_part_is_absent_but_its_hits_count():
    # A cache over a bare PageStore (a sweep's page set) has no removal log or registry to explain a miss from:
    # `l3_store` is None and the L3 part of the explanation is left out, while the tokens L3 would serve still count.
    from kvcache.storage.page_set import PageSet

    cache = l3_cache(PageSet(make_layout(PS)), PS, device_tokens=16, host_tokens=16)
    assert cache.l3_store is None
    first = req("a", 100)
    serve(cache, first)
    serve(cache, req("b", 200))  # L1 and L2 hold 4 pages each: `a` is only in L3 now
    e = cache.explain(first)
    assert e.storage is None and (e.hits.device, e.hits.storage) == (0, 16)


def test_over_an_lmdb_store_l3_store_is_the_store(store):
    assert l3_cache(store, PS).l3_store is store
