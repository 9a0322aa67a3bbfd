"""kvcache.engine.pressure, and TieredCache under memory pressure: prefetch holds take only what their result needs,
are bounded, and never starve an admission that fits the device pool (DESIGN §4, "Holds under pressure")."""

import pytest

from factories import device_bytes_ok, forward, l3_cache, make_layout, make_store, serve
from kvcache import AdmitStatus, Namespace, Request, WritePolicy
from kvcache.types.config import HostMode, PrefetchPolicy
from kvcache.types.results import DeclineReason

PS = 4
TENANTS = [Namespace(f"t{i}", f"salt-{i}") for i in range(4)]


def prefix(i):
    return [1000 + 10 * i + k for k in range(2 * PS)]  # 2 pages, distinct per tenant


def suffix(i):
    return [5000 + 10 * i + k for k in range(2 * PS)]  # 2 more pages


@pytest.fixture
def store(tmp_path):
    s = make_store(tmp_path / "store", make_layout(PS))
    yield s
    s.close()


def write(cache, rid, tokens, ns):
    req = Request(rid, tokens, ns)
    serve(cache, req)
    return req


def hot_prefixes(cache):
    """Every tenant's 2-page prefix is committed on the device (all 8 pages of the 8-page pools below)."""
    for i, ns in enumerate(TENANTS):
        write(cache, f"p{i}", prefix(i), ns)
    cache.flush()


def seed_l3(store):
    """An earlier process wrote every tenant's whole sequence (prefix + suffix) to L3."""
    w = l3_cache(store, device_tokens=64 * PS, host_tokens=64 * PS)
    for i, ns in enumerate(TENANTS):
        write(w, f"seed{i}", prefix(i) + suffix(i), ns)
    w.flush()
    w.close()


@pytest.mark.parametrize("mode", list(HostMode))
def test_waiting_prefetches_do_not_starve_the_prefetching_requests_own_admit(store, mode):
    """Four in-flight prefetches on an 8-page device pool: the first request's own admit fits, and its fetched
    span is used, not dropped as unattached (on the old main: POOL_FULL, and in buffer mode 'unattached')."""
    seed_l3(store)
    c = l3_cache(store, device_tokens=8 * PS, host_tokens=64 * PS, host_mode=mode)
    hot_prefixes(c)
    reqs = [Request(f"r{i}", prefix(i) + suffix(i), ns) for i, ns in enumerate(TENANTS)]
    for r in reqs:
        c.prefetch(r)
    c.flush()
    adm = c.admit(reqs[0])
    assert adm.status is AdmitStatus.ADMITTED
    assert adm.cached_tokens == 4 * PS and adm.storage_hit_tokens == 2 * PS
    assert device_bytes_ok(c, reqs[0], adm.slots, adm.cached_tokens)
    assert c.stats().prefetch.dropped.get("unattached", 0) == 0
    forward(c, reqs[0], adm)
    c.commit("r0")
    assert c.audit().ok
    for r in reqs[1:]:
        if c.holds(r.rid):
            c.release(r.rid)
    c.flush()
    assert c.audit().ok
    c.close()


def test_cache_mode_prefetch_holds_the_anchors_host_copy_only(store):
    seed_l3(store)
    c = l3_cache(store, device_tokens=8 * PS, host_tokens=64 * PS)
    write(c, "p0", prefix(0), TENANTS[0])
    c.flush()
    assert c.prefetch(Request("r0", prefix(0) + suffix(0), TENANTS[0])).issued
    assert c.tree.device_protected == 0 and c.tree.device_held == 0  # the device copy stays evictable
    assert c.tree.host_held == 2  # the anchor's host copy is held for the fetched pages to attach to
    assert c.evict(device_tokens=8 * PS).device_pages == 2
    c.flush()
    adm = c.admit(Request("r0", prefix(0) + suffix(0), TENANTS[0]))
    assert adm.cached_tokens == 4 * PS and adm.host_hit_tokens == 2 * PS and adm.storage_hit_tokens == 2 * PS
    c.release("r0")
    assert c.audit().ok
    c.close()


def test_buffer_mode_device_holds_are_capped(store):
    seed_l3(store)
    c = l3_cache(store, device_tokens=8 * PS, host_tokens=64 * PS, host_mode=HostMode.BUFFER,
                 prefetch_max_device_tokens=4 * PS)
    hot_prefixes(c)
    out = [c.prefetch(Request(f"r{i}", prefix(i) + suffix(i), ns)) for i, ns in enumerate(TENANTS)]
    assert [o.issued for o in out] == [True, True, False, False]
    assert {o.reason for o in out[2:]} == {DeclineReason.DEVICE_LIMIT}
    assert c.tree.device_held == 4  # two anchors of two pages: the cap
    assert c.headroom().device.evictable == 4
    assert c.audit().ok
    c.close()


def test_admission_reclaims_buffer_mode_holds_youngest_first_as_a_last_resort(store):
    """A request that fits the pool is admitted even when every evictable page is held by waiting requests'
    prefetches: the youngest holds go first, each counted with its reason."""
    seed_l3(store)
    c = l3_cache(store, device_tokens=8 * PS, host_tokens=64 * PS, host_mode=HostMode.BUFFER,
                 prefetch_max_device_tokens=8 * PS)
    hot_prefixes(c)
    for i, ns in enumerate(TENANTS):
        assert c.prefetch(Request(f"r{i}", prefix(i) + suffix(i), ns)).issued
    c.flush()
    big = Request("big", list(range(7000, 7000 + 6 * PS)), Namespace("other"))
    adm = c.admit(big)
    assert adm.status is AdmitStatus.ADMITTED and adm.new_tokens == 6 * PS
    assert c.stats().prefetch.cancelled == {"device_pressure": 3}
    assert not c.holds("r3") and not c.holds("r2") and not c.holds("r1") and c.holds("r0")  # oldest kept
    c.release("big")
    c.release("r0")
    assert c.audit().ok
    c.close()


def test_a_request_larger_than_the_pool_is_too_large_and_nothing_stays_held(store):
    seed_l3(store)
    c = l3_cache(store, device_tokens=8 * PS, host_tokens=64 * PS)
    req = Request("huge", list(range(9 * PS)), TENANTS[0])
    c.prefetch(req)
    adm = c.admit(req)
    assert adm.status is AdmitStatus.TOO_LARGE
    assert not c.holds("huge") and c.host_pool.used_pages == c.tree.host_evictable + c.tree.host_protected
    assert c.stats().counters.too_large == 1
    assert c.audit().ok
    c.close()


def test_pool_full_keeps_the_staged_record_for_the_next_try(store):
    seed_l3(store)
    c = l3_cache(store, device_tokens=8 * PS, host_tokens=64 * PS, host_mode=HostMode.BUFFER)
    other = Request("o", list(range(7000, 7000 + 6 * PS)), Namespace("other"))
    assert c.admit(other).status is AdmitStatus.ADMITTED  # a live request holds 6 of 8 pages
    req = Request("r0", prefix(0) + suffix(0), TENANTS[0])
    c.prefetch(req)
    c.flush()
    assert c.admit(req).status is AdmitStatus.POOL_FULL
    assert c.holds("r0") and c.stats().prefetch.dropped == {}
    c.release("o")
    adm = c.admit(req)
    assert adm.status is AdmitStatus.ADMITTED and adm.storage_hit_tokens == 4 * PS
    assert device_bytes_ok(c, req, adm.slots, adm.cached_tokens)
    c.release("r0")
    assert c.audit().ok
    c.close()


def test_buffer_mode_staged_records_count_against_the_prefetch_host_budget(store):
    seed_l3(store)
    c = l3_cache(store, host_mode=HostMode.BUFFER, prefetch_max_host_tokens=4 * PS)
    a = c.prefetch(Request("r0", prefix(0) + suffix(0), TENANTS[0]))
    c.flush()
    b = c.prefetch(Request("r1", prefix(1) + suffix(1), TENANTS[1]))
    c.flush()
    assert a.issued and not b.issued and b.reason is DeclineReason.HOST_LIMIT
    assert sum(len(s.pages) for s in c.staged_records()) == 4  # never more than the budget (was 8 of 4)
    c.release("r0")
    assert c.prefetch(Request("r1", prefix(1) + suffix(1), TENANTS[1])).issued
    c.close()


def test_buffer_mode_a_device_prefix_without_host_copy_anchors_a_staged_span(store):
    seed_l3(store)
    c = l3_cache(store, host_mode=HostMode.BUFFER, write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE,
                 write_through_threshold=5)
    write(c, "p0", prefix(0), TENANTS[0])  # on the device, never backed up (one hit, threshold 5)
    req = Request("r0", prefix(0) + suffix(0), TENANTS[0])
    out = c.prefetch(req)
    assert out.issued and out.start_tokens == 2 * PS  # was declined as unbacked_prefix
    c.flush()
    adm = c.admit(req)
    assert adm.cached_tokens == 4 * PS and adm.device_hit_tokens == 2 * PS and adm.storage_hit_tokens == 2 * PS
    assert device_bytes_ok(c, req, adm.slots, adm.cached_tokens)
    c.release("r0")
    assert c.audit().ok
    c.close()


def test_buffer_mode_host_tier_is_only_a_bounce_buffer(store):
    c = l3_cache(store, host_mode=HostMode.BUFFER)
    for i, ns in enumerate(TENANTS):
        write(c, f"p{i}", prefix(i) + suffix(i), ns)
    c.flush()
    assert c.stats().backup.storage_pages == 16  # every page reached L3 ...
    assert c.host_pool.used_pages == 0  # ... and its bounce copy was freed at the acknowledgement
    assert c.tree.host_evictable == 0 and c.tree.host_protected == 0
    assert c.audit().ok
    c.close()


def test_buffer_mode_write_back_bounces_at_eviction(store):
    c = l3_cache(store, host_mode=HostMode.BUFFER, write_policy=WritePolicy.WRITE_BACK)
    write(c, "p0", prefix(0) + suffix(0), TENANTS[0])
    assert c.stats().backup.storage_pages == 0
    c.evict(device_tokens=4 * PS)
    c.flush()
    assert c.stats().backup.storage_pages == 4 and c.host_pool.used_pages == 0
    d = l3_cache(store, host_mode=HostMode.BUFFER, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    req = Request("r", prefix(0) + suffix(0), TENANTS[0])
    d.prefetch(req)
    assert d.admit(req).storage_hit_tokens == 4 * PS
    d.release("r")
    assert c.audit().ok and d.audit().ok
    c.close()
    d.close()


def test_headroom_counts_what_admission_could_use(store):
    c = l3_cache(store, device_tokens=8 * PS, host_tokens=16 * PS)
    write(c, "p0", prefix(0), TENANTS[0])
    live = Request("l", list(range(3 * PS)), TENANTS[1])
    c.admit(live)
    room = c.headroom()
    assert (room.device.free, room.device.evictable, room.device.held, room.device.busy) == (3, 2, 0, 3)
    assert room.device.available == 5
    c.release("l")
    c.close()


def test_a_node_unlocked_while_its_l3_write_is_in_flight_stays_evictable_from_the_device(tmp_path):
    """An eviction that meets a locked node drops its LRU entry (it is offered again at unlock). The unlock came
    while an L3 write still read the node's host copy, and `offer` skipped the device tier for that host pin: the
    node stayed counted evictable but no eviction could find it, and an admission that needed its page was refused
    with nothing running (found by the stateful test)."""
    store = make_store(tmp_path / "store1", make_layout(1))
    c = l3_cache(store, page_size=1, device_tokens=10, host_tokens=4)
    a, b = TENANTS[0], TENANTS[1]
    c.admit(Request("a", [1], a))
    c.commit("a")  # node N (1 page); its device -> host backup is in flight
    assert c.admit(Request("b", [1, 2], a)).status is AdmitStatus.ADMITTED  # locks N
    # c needs N's page: the eviction pops N while b locks it, the backup completes meanwhile and N's L3 write is
    # queued (it runs at the next poll); c is refused (b holds the room)
    assert c.admit(Request("c", list(range(100, 109)), b)).status is AdmitStatus.POOL_FULL
    c.release("b")  # unlocks N while its write is in flight
    assert not c.live_requests() and c.storage_writes()
    adm = c.admit(Request("d", list(range(200, 210)), b))  # the whole pool: N's device copy must go
    assert adm.status is AdmitStatus.ADMITTED, c.headroom()
    c.release("d")
    c.flush()
    assert c.audit().ok
    c.close()
    store.close()
