import numpy as np
import pytest
import torch

from devices import TEST_DEVICE
from factories import make_cache
from kvcache import AdmitStatus, DoubleFree, Namespace, Request, UnknownRequest, WritePolicy
from kvcache.types.owners import FREE_CODE

T1, T2 = Namespace("t1", "salt-1"), Namespace("t2", "salt-2")


def run(cache, rid, tokens, ns=T1, fill=None):
    """Admit, write KV for the new tokens, commit; returns the admission."""
    req = Request(rid, tokens, ns)
    adm = cache.admit(req)
    assert adm.status is AdmitStatus.ADMITTED
    if fill is not None:
        cache.device_pool.storage[torch.from_numpy(adm.slots[adm.cached_tokens:])] = fill
    cache.commit(rid)
    assert cache.audit().ok, cache.audit()
    return adm


def test_lifecycle_reuses_device_prefix():
    c = make_cache(page_size=2)
    first = run(c, "a", range(9))
    assert first.cached_tokens == 0 and first.new_tokens == 9 and len(first.slots) == 9
    second = c.admit(Request("b", list(range(8)) + [70, 71, 72], T1))
    assert second.cached_tokens == 8 and second.new_tokens == 3
    assert list(second.slots[:8]) == list(first.slots[:8])
    c.commit("b")
    assert c.audit().ok


def test_two_namespaces_with_identical_tokens_share_no_slot():
    c = make_cache()
    a = run(c, "a", range(10), T1)
    b = run(c, "b", range(10), T2)
    assert b.cached_tokens == 0 and not set(a.slots.tolist()) & set(b.slots.tolist())
    ra = c.tree.match_prefix(Request("x", range(10), T1).key)
    rb = c.tree.match_prefix(Request("y", range(10), T2).key)
    assert ra.device_node is not rb.device_node
    assert not set(ra.device_pages.tolist()) & set(rb.device_pages.tolist())


def test_concurrent_insert_frees_exactly_the_duplicates():
    c = make_cache(host_tokens=0)
    r1, r2 = Request("r1", range(12), T1), Request("r2", range(12), T1)
    c.admit(r1)
    a2 = c.admit(r2)  # both miss: each gets its own 12 pages
    used = c.device_pool.used_pages
    assert used == 24
    c.commit("r1")
    res = c.commit("r2")
    assert res.duplicate_pages == 12 and c.device_pool.used_pages == 12
    codes = c.device_pool.owners(a2.slots)
    assert (codes == FREE_CODE).all()  # r2's pages, and only those, went back
    assert c.counters.duplicate_pages_freed == 12 and c.audit().ok


def test_partial_tail_page_is_freed_at_commit():
    c = make_cache(page_size=4, host_tokens=0)
    c.admit(Request("a", range(10), T1))
    assert c.device_pool.used_pages == 3
    out = c.commit("a")
    assert out.inserted_tokens == 8 and out.tail_pages == 1 and c.device_pool.used_pages == 2


def test_release_frees_fresh_pages_and_unlocks():
    c = make_cache(host_tokens=0)
    run(c, "a", range(8))
    c.admit(Request("b", list(range(8)) + [9, 9], T1))
    c.release("b")
    assert c.device_pool.used_pages == 8 and c.tree.device_protected == 0 and c.audit().ok


def test_pool_full_is_a_value_and_holds_nothing():
    c = make_cache(device_tokens=16, host_tokens=0)
    c.admit(Request("a", range(12), T1))
    adm = c.admit(Request("b", range(100, 110), T1))
    assert adm.status is AdmitStatus.POOL_FULL and c.counters.refused == 1
    assert c.device_pool.used_pages == 12 and c.audit().ok


def test_admit_evicts_lru_to_make_room():
    c = make_cache(device_tokens=16, host_tokens=0)
    run(c, "a", range(8))
    run(c, "b", range(100, 108))
    adm = c.admit(Request("c", range(200, 208), T1))
    assert adm.status is AdmitStatus.ADMITTED and c.counters.device_pages_evicted == 8
    assert c.match(Request("q", range(8), T1)).device_tokens == 0  # "a" was the least recently used
    assert c.match(Request("q", range(100, 108), T1)).device_tokens == 8


def test_unknown_and_duplicate_rids():
    c = make_cache()
    with pytest.raises(UnknownRequest):
        c.commit("nope")
    c.admit(Request("a", [1, 2], T1))
    with pytest.raises(UnknownRequest):
        c.admit(Request("a", [3], T1))
    c.release("a")
    with pytest.raises(UnknownRequest):
        c.release("a")


def test_write_through_backs_up_at_commit_after_poll():
    c = make_cache()
    res = c.admit(Request("a", range(6), T1))
    out = c.commit("a")
    assert out.backup_pages == 6 and len(c.inflight_ops()) == 1
    node = c.tree.match_prefix(Request("q", range(6), T1).key).device_node
    assert node.host is None and node.pins == 1  # in flight: owned by the op, node pinned
    assert c.audit().ok
    assert c.poll() == 1 and node.host is not None and node.pins == 0
    assert res.status is AdmitStatus.ADMITTED and c.audit().ok


def test_write_through_selective_waits_for_hits():
    c = make_cache(write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE, write_through_threshold=2)
    run(c, "a", range(6))
    c.flush()
    assert c.host_pool.used_pages == 0
    run(c, "b", range(6))
    run(c, "c", range(6))
    c.flush()
    assert c.host_pool.used_pages == 6 and c.audit().ok


def test_write_back_backs_up_on_eviction_only():
    c = make_cache(write_policy=WritePolicy.WRITE_BACK, device_tokens=16)
    run(c, "a", range(8), fill=5)
    assert c.host_pool.used_pages == 0 and not c.inflight_ops()
    c.evict(device_tokens=8)
    assert c.host_pool.used_pages == 8 and c.device_pool.used_pages == 0
    adm = c.admit(Request("b", range(8), T1))
    assert adm.loaded_back_tokens == 8
    assert (c.device_pool.storage[torch.from_numpy(adm.slots)] == 5).all()
    c.release("b")
    assert c.audit().ok


def test_load_back_restores_exact_bytes():
    c = make_cache(page_size=2, device_tokens=32, host_tokens=64)
    marker = torch.randint(0, 256, (12, c.layout.bytes_per_token), dtype=torch.uint8, device=TEST_DEVICE)
    req = Request("a", range(12), T1)
    adm = c.admit(req)
    c.device_pool.storage[torch.from_numpy(adm.slots)] = marker
    c.commit("a")
    c.flush()
    c.evict(device_tokens=1000)
    assert c.device_pool.used_pages == 0
    # overwrite every device slot so nothing stale can pass for the loaded-back bytes
    c.device_pool.storage.fill_(0xEE)
    adm = c.admit(Request("b", range(12), T1))
    assert adm.cached_tokens == 12 and adm.loaded_back_tokens == 12
    assert torch.equal(c.device_pool.storage[torch.from_numpy(adm.slots)], marker)
    c.commit("b")
    assert c.audit().ok


def test_load_back_is_all_or_nothing_against_budget():
    c = make_cache(load_back_budget_tokens=4)
    run(c, "a", range(8))
    c.flush()
    c.evict(device_tokens=100)
    adm = c.admit(Request("b", range(8), T1))
    assert adm.loaded_back_tokens == 0 and adm.cached_tokens == 0 and adm.new_tokens == 8
    assert c.counters.load_backs_skipped == 1
    c.commit("b")  # the fresh pages become the host-only nodes' device copy
    m = c.match(Request("q", range(8), T1))
    assert m.device_tokens == 8 and c.audit().ok


def test_split_of_a_node_with_backup_in_flight():
    c = make_cache(page_size=2)
    run(c, "a", range(8))
    assert len(c.inflight_ops()) == 1
    run(c, "b", [0, 1, 2, 3, 50, 51])  # splits the node being backed up
    assert c.audit().ok
    c.flush()
    m = c.tree.match_prefix(Request("q", range(8), T1).key)
    assert m.device_node.host is not None and m.device_node.parent.host is not None
    assert c.audit().ok


def test_host_pressure_evicts_host_lru_for_backups():
    c = make_cache(device_tokens=64, host_tokens=8)
    run(c, "a", range(8))
    c.flush()
    c.evict(device_tokens=8)  # "a" is host-only now
    run(c, "b", range(100, 108))
    c.flush()
    assert c.host_pool.used_pages == 8 and c.counters.host_pages_evicted == 8
    assert c.match(Request("q", range(8), T1)).host_tokens == 0 and c.audit().ok


def test_ledger_catches_a_double_free_through_the_cache():
    c = make_cache()
    run(c, "a", range(4))
    node = c.tree.match_prefix(Request("q", range(4), T1).key).device_node
    c.device_pool.free(node.device, node.owner)  # a bug elsewhere frees a node's pages
    with pytest.raises(DoubleFree):
        c.device_pool.free(node.device, node.owner)
    report = c.audit()
    assert not report.ok and {v.kind.value for v in report.violations} == {"free_but_referenced", "double_owner"}


def test_device_slots_and_repr():
    c = make_cache(page_size=4)
    adm = c.admit(Request("a", range(6), T1))
    assert list(c.device_slots("a")) == list(adm.slots)
    assert "1 live" in repr(c)
    assert isinstance(adm.slots, np.ndarray)


def test_namespace_roots_are_reclaimed_when_they_hold_nothing():
    """20,000 salted sub-page requests used to leave 20,000 empty namespace roots in the tree and in every
    snapshot; the tree's size is bounded by what it holds."""
    c = make_cache(page_size=4, device_tokens=64)
    for i in range(2000):
        req = Request(f"r{i}", [1, 2], Namespace("t", f"salt-{i}"))  # shorter than one page: nothing to cache
        assert c.admit(req).status is AdmitStatus.ADMITTED
        c.commit(req.rid)
    assert c.tree.namespace_roots() == [] and len(c.snapshot().state.nodes) == 0
    # a root locked by an admission while its last node is evicted goes when the lock does
    run(c, "a", list(range(8)), T1)
    c.flush()
    c.admit(Request("b", [50, 51, 52, 53, 54], T1))  # no match: locks T1's root only
    c.evict(device_tokens=64, host_tokens=128)
    assert [r.namespace for r in c.tree.namespace_roots()] == [T1]
    c.release("b")
    assert c.tree.namespace_roots() == [] and c.audit().ok


def test_every_call_after_close_raises_cache_closed():
    from kvcache.errors import CacheClosed

    c = make_cache(page_size=4)
    run(c, "a", list(range(8)))
    c.close()
    req = Request("b", list(range(8)))
    for call in (lambda: c.admit(req), lambda: c.commit("a"), lambda: c.release("a"), lambda: c.match(req),
                 lambda: c.prefetch(req), lambda: c.evict(4), lambda: c.evict_namespace(T1), c.poll, c.flush,
                 lambda: c.drop_namespace(T1), lambda: c.settle_prefetch("a"), lambda: c.device_slots("a")):
        with pytest.raises(CacheClosed):
            call()
    # the final state can still be looked at: nothing is held after close
    assert c.audit().ok and c.headroom().device.busy == 0 and c.stats().counters.committed == 1
    c.close()  # closing twice is fine


def test_a_store_handle_of_another_layout_is_a_layout_mismatch(tmp_path):
    """It used to raise TypeError (the error was built with the wrong arguments)."""
    from factories import make_layout, make_store
    from kvcache import CacheConfig, LayoutMismatch, TieredCache

    store = make_store(tmp_path / "store", make_layout(4))
    with pytest.raises(LayoutMismatch, match=r"page_size=1 is not in this store \(it holds: .*page_size=4\)"):
        TieredCache(CacheConfig(make_layout(1), device_tokens=8, device=TEST_DEVICE), store)
    store.close()
