"""Prefetch from a real LMDB L3: keyed by the request's namespace, policies, retries, aborts, declines."""

import pytest

from factories import device_bytes_ok, forward, l3_cache, make_layout, make_store
from kvcache import AdmitStatus, Namespace, NamespaceMismatch, Request, WritePolicy
from kvcache.engine.prefetch_op import PrefetchState
from kvcache.types.config import HostMode, PrefetchPolicy
from kvcache.types.results import DeclineReason

T1, T2 = Namespace("t1", "salt-one"), Namespace("t2", "salt-two")
TOKENS = list(range(100, 164))  # 16 pages of 4


@pytest.fixture
def store(tmp_path):
    s = make_store(tmp_path / "store", make_layout(4))
    yield s
    s.close()


def warm(store, ns=T1, tokens=TOKENS, **kw):
    """Another cache writes `tokens` of `ns` to L3."""
    w = l3_cache(store, **kw)
    req = Request("w", tokens, ns)
    adm = w.admit(req)
    forward(w, req, adm)
    w.commit("w")
    w.flush()
    w.close()
    return w


def serve(cache, req):
    adm = cache.admit(req)
    assert adm.status is AdmitStatus.ADMITTED
    ok = device_bytes_ok(cache, req, adm.slots, adm.cached_tokens)
    forward(cache, req, adm)
    cache.commit(req.rid)
    return adm, ok


def test_prefetch_hits_its_own_namespace_only(store):
    warm(store, T1)
    c = l3_cache(store)
    for ns, expect in ((T1, 64), (T2, 0), (Namespace("t1", "other-salt"), 0), (Namespace("t1"), 0)):
        req = Request(f"r-{c.fingerprints.label(ns)}", TOKENS, ns)
        assert c.prefetch(req).issued
        c.flush()
        adm, ok = serve(c, req)
        assert adm.cached_tokens == expect and ok
    assert c.audit().ok


def test_empty_string_and_none_are_one_namespace_in_every_tier(store):
    warm(store, Namespace("", ""))
    c = l3_cache(store)
    req = Request("r", TOKENS, Namespace(None, None))
    c.prefetch(req)
    c.flush()
    adm, ok = serve(c, req)
    assert adm.cached_tokens == 64 and ok
    assert c.match(Request("q", TOKENS, Namespace(""))).device_tokens == 64


def test_anchor_of_another_namespace_is_refused_and_serving_goes_on(store):
    c = l3_cache(store)
    serve(c, Request("t1", TOKENS[:16], T1))
    c.flush()
    foreign = c.tree.match_prefix(Request("m", TOKENS, T1).key)  # a match taken for another request
    held = (c.host_pool.used_pages, c.device_pool.used_pages)
    with pytest.raises(NamespaceMismatch) as err:
        c.prefetch(Request("t2", TOKENS, T2), foreign)
    assert err.value.rid == "t2" and "salt-two" not in str(err.value) and c.fingerprints.label(T2) in str(err.value)
    assert (c.host_pool.used_pages, c.device_pool.used_pages) == held  # no slot taken
    assert c.stats().prefetch.namespace_mismatches == 1
    adm, _ = serve(c, Request("t2", TOKENS, T2))  # the request goes on without L3
    assert adm.cached_tokens == 0 and c.audit().ok


def test_declines_are_values(store):
    c = l3_cache(store, prefetch_threshold_tokens=32, prefetch_max_host_tokens=8)
    assert c.prefetch(Request("a", TOKENS[:16], T1)).reason is DeclineReason.BELOW_THRESHOLD
    assert c.prefetch(Request("b", TOKENS, T1)).issued
    assert c.prefetch(Request("b", TOKENS, T1)).reason is DeclineReason.IN_FLIGHT
    c.flush()
    assert c.prefetch(Request("c", TOKENS, T2)).reason in (DeclineReason.HOST_LIMIT, None)
    nostore = l3_cache(None)
    assert nostore.prefetch(Request("d", TOKENS, T1)).reason is DeclineReason.NO_STORE
    assert c.stats().prefetch.declined["below_threshold"] == 1 and c.audit().ok


def test_unbacked_prefix_is_declined(store):
    c = l3_cache(store, write_policy=WritePolicy.WRITE_BACK)
    serve(c, Request("a", TOKENS[:16], T1))  # device only: write_back has not backed it up
    out = c.prefetch(Request("b", TOKENS, T1))
    assert not out.issued and out.reason is DeclineReason.UNBACKED_PREFIX


def test_prefetch_extends_a_partial_tree_match(store):
    warm(store, T1)
    c = l3_cache(store)
    serve(c, Request("a", TOKENS[:24], T1))
    c.flush()
    req = Request("b", TOKENS, T1)
    out = c.prefetch(req)
    assert out.start_tokens == 24 and out.requested_tokens == 40
    c.flush()
    adm, ok = serve(c, req)
    assert adm.cached_tokens == 64 and ok and c.audit().ok
    hits = {h.namespace.extra_key: (h.device, h.host, h.storage) for h in c.stats().hits}
    assert hits["t1"] == (0 + 24, 0, 40)  # request a: 0 of anything; b: 24 on device, 40 from L3


def test_retry_after_miss_hits_once_the_pages_appear(store):
    c = l3_cache(store, prefetch_retries=3, prefetch_retry_interval_ms=0)
    req = Request("r", TOKENS, T1)
    assert c.prefetch(req).issued
    c.poll()  # first attempt: nothing in L3; re-armed at once (interval 0)
    op = c.prefetch_ops()[0]
    assert op.attempts == 1 and op.fetched == 0 and op.state is PrefetchState.CHECKING
    warm(store, T1)  # another request's backup writes the pages
    for _ in range(4):
        c.poll()
    adm, ok = serve(c, req)
    assert adm.cached_tokens == 64 and ok
    assert c.stats().prefetch.retried >= 1 and c.audit().ok


@pytest.mark.parametrize("policy, expect", [(PrefetchPolicy.BEST_EFFORT, 8), (PrefetchPolicy.WAIT_COMPLETE, 64),
                                            (PrefetchPolicy.TIMEOUT, 64)])
def test_policies_at_admission(store, policy, expect):
    warm(store, T1)
    c = l3_cache(store, prefetch_policy=policy, io_batch_pages=2, prefetch_timeout_ms=10_000)
    req = Request("r", TOKENS, T1)
    c.prefetch(req)
    c.run_io(max_steps=2)  # the check and one batch of two pages have run
    c._io.run_pending(max_steps=1)
    adm, ok = serve(c, req)
    assert adm.cached_tokens == expect and ok and c.audit().ok


def test_timeout_zero_takes_what_arrived(store):
    warm(store, T1)
    c = l3_cache(store, prefetch_policy=PrefetchPolicy.TIMEOUT, prefetch_timeout_ms=0,
                 prefetch_timeout_per_page_ms=0, io_batch_pages=4)
    req = Request("r", TOKENS, T1)
    c.prefetch(req)
    adm, ok = serve(c, req)
    assert adm.cached_tokens < 64 and ok and c.audit().ok


@pytest.mark.parametrize("mode", list(HostMode))
@pytest.mark.parametrize("stage", ["checking", "fetching", "done", "admitted"])
def test_abort_at_every_stage_frees_each_slot_once(store, mode, stage):
    warm(store, T1)
    c = l3_cache(store, host_mode=mode, io_batch_pages=2)
    req = Request("r", TOKENS, T1)
    c.prefetch(req)
    if stage == "fetching":
        c.run_io(max_steps=1)
        c._io.run_pending(max_steps=1)
        assert c.prefetch_ops()[0].state is PrefetchState.FETCHING
    elif stage in ("done", "admitted"):
        c.flush()
        assert bool(c.staged_records()) == (mode is HostMode.BUFFER)
    if stage == "admitted":
        c.admit(req)
    c.release("r")
    c.flush()
    assert c.audit().ok
    if stage == "admitted":  # the fetched pages became tree pages at admission: cached, unlocked, evictable
        assert c.device_pool.used_pages == c.tree.device_evictable == 16
    else:
        assert c.host_pool.used_pages == 0 and c.device_pool.used_pages == 0
    assert not c.prefetch_ops() and not c.staged_records() and not c.live_requests()
    assert c.tree.device_protected == 0 and c.tree.host_protected == 0


def test_second_load_back_on_a_pinned_node_is_refused(store):
    c = l3_cache(store)
    serve(c, Request("a", TOKENS, T1))
    c.flush()
    c.evict(device_tokens=1000)
    m = c.match(Request("x", TOKENS, T1))
    assert m.host_tokens == 64
    assert c._admissions.load_back(m, wait=False) is not None  # held open: in flight
    adm = c.admit(Request("b", TOKENS, T1))
    assert adm.loaded_back_tokens == 0 and adm.new_tokens == 64  # recomputes instead
    assert c.counters.load_backs_refused == 1
    c.release("b")
    c.flush()
    assert c.audit().ok


def test_write_back_writes_l3_when_host_copies_are_evicted(store):
    c = l3_cache(store, write_policy=WritePolicy.WRITE_BACK, host_tokens=64)
    serve(c, Request("a", TOKENS, T1))
    assert c.stats().backup.storage_pages == 0
    c.evict(device_tokens=1000)
    c.evict(host_tokens=1000)
    assert c.stats().backup.storage_pages == 16 and c.host_pool.used_pages == 0
    d = l3_cache(store)
    req = Request("b", TOKENS, T1)
    d.prefetch(req)
    d.flush()
    adm, ok = serve(d, req)
    assert adm.cached_tokens == 64 and ok


def test_failed_l3_write_is_counted_and_leaves_the_node(tmp_path):
    layout = make_layout(4)
    make_store(tmp_path / "s", layout).close()
    from kvcache.storage.registry import open_store

    ro = open_store(str(tmp_path / "s"), layout, readonly=True)
    c = l3_cache(ro)
    serve(c, Request("a", TOKENS, T1))
    c.flush()
    bs = c.stats().backup
    assert bs.storage_failed == 1 and bs.host_pages == 16
    m = c.match(Request("q", TOKENS, T1))
    assert m.device_tokens == 64 and not m.device_node.stored and c.audit().ok
    ro.close()


def test_l3_write_below_an_evicted_parent_rewrites_the_path(store):
    c = l3_cache(store)
    serve(c, Request("a", TOKENS[:32], T1))
    c.flush()
    assert store.delete_namespace(T1.id).pages == 8  # L3 loses the parent pages; the tree still says "stored"
    serve(c, Request("b", TOKENS, T1))
    c.flush()
    assert c.stats().backup.storage_rewrites == 1
    assert store.verify().ok  # no orphan chain below the missing parent: the whole path was written again
    d = l3_cache(store)
    req = Request("r", TOKENS, T1)
    d.prefetch(req)
    d.flush()
    adm, ok = serve(d, req)
    assert adm.cached_tokens == 64 and ok


def test_a_match_taken_before_an_eviction_is_declined_as_stale(store):
    warm(store)
    c = l3_cache(store)
    serve(c, Request("a", TOKENS[:32], T1))
    c.flush()
    req = Request("r", TOKENS, T1)
    m = c.match(req)
    assert m.device_tokens == 32
    c.evict(device_tokens=10**6, host_tokens=10**6)  # the matched nodes leave the tree
    out = c.prefetch(req, m)  # was AttributeError
    assert not out.issued and out.reason is DeclineReason.STALE_MATCH
    assert c.prefetch(req).issued  # a fresh match works
    c.release("r")
    assert c.audit().ok
    c.close()


def test_a_match_of_another_requests_tokens_is_declined_as_stale(store):
    warm(store)
    c = l3_cache(store)
    serve(c, Request("a", TOKENS[:32], T1))
    c.flush()
    m = c.match(Request("x", TOKENS[:32], T1))
    out = c.prefetch(Request("r", list(range(500, 564)), T1), m)
    assert not out.issued and out.reason is DeclineReason.STALE_MATCH
    assert c.audit().ok
    c.close()


def test_a_wait_complete_admit_after_close_raises_instead_of_blocking(store):
    import threading

    from kvcache.errors import CacheClosed

    warm(store)
    c = l3_cache(store, io_thread=True, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    c.close()
    req = Request("r", TOKENS, T1)
    raised = []

    def call():
        try:
            c.prefetch(req)
            c.admit(req)
        except CacheClosed as exc:
            raised.append(exc)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive() and len(raised) == 1  # was: blocked forever in admit


@pytest.mark.parametrize("store_first", [True, False])
def test_a_namespace_drop_never_writes_back(store, store_first):
    """Under write_back, dropping a namespace (offboarding) frees its L1/L2 pages without writing them to L3,
    whichever order the cache and the store are dropped in (evict_namespace after store.delete_namespace wrote
    the deleted tenant back)."""
    from kvcache.types.keys import page_hashes

    c = l3_cache(store, write_policy=WritePolicy.WRITE_BACK, device_tokens=128, host_tokens=256)
    serve(c, Request("a", TOKENS[:32], T1))
    c.evict(device_tokens=32)  # write-back: the device copy went to L2, not yet to L3
    serve(c, Request("b", TOKENS[32:], T1))  # on the device only
    serve(c, Request("c", TOKENS, T2))  # another tenant stays
    c.flush()
    a_hashes = page_hashes(c.layout.layout_id, Request("p", TOKENS[:32], T1).key, 4, c.chain_key)
    b_hashes = page_hashes(c.layout.layout_id, Request("p", TOKENS[32:], T1).key, 4, c.chain_key)
    if store_first:
        store.delete_namespace(T1.id)
    dropped = c.drop_namespace(T1)
    assert dropped.device_pages == 8 and dropped.host_pages == 8
    c.flush()
    assert store.exists_prefix(a_hashes) == 0 and store.exists_prefix(b_hashes) == 0
    assert T1.id_hex not in {r.ns_id_hex for r in store.namespaces()}
    assert c.match(Request("p", TOKENS, T1)).device_tokens == 0
    assert c.match(Request("q", TOKENS, T2)).device_tokens == 64
    assert c.audit().ok
    c.close()


def test_a_settle_with_an_infinite_or_huge_timeout_holds_nothing_afterwards(store):
    """timeout_ms=inf used to raise OverflowError inside the wait, after the op had left the table: its host
    pages leaked to op:prefetch for the life of the cache."""
    from kvcache import InvalidInput

    warm(store)
    c = l3_cache(store, io_thread=True)
    req = Request("r", TOKENS, T1)
    assert c.prefetch(req).issued
    for bad in (float("inf"), float("nan"), -5.0):
        with pytest.raises(InvalidInput):
            c.settle_prefetch("r", PrefetchPolicy.TIMEOUT, bad)
    assert c.holds("r")  # refused before anything moved
    settled = c.settle_prefetch("r", PrefetchPolicy.TIMEOUT, 1e13)  # finite, past a condition wait's range
    assert settled.fetched_pages == 16 and c.audit().ok
    c.close()
    from kvcache import CacheConfig, InvalidConfig

    with pytest.raises(InvalidConfig, match="finite"):
        CacheConfig(make_layout(4), device_tokens=64, prefetch_timeout_ms=float("inf"))
