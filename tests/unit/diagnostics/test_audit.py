"""Each violation kind is found when the state is broken that way, and a healthy cache audits clean."""

import numpy as np
import pytest

from factories import make_cache
from kvcache import Namespace, Request
from kvcache.diagnostics.audit import check_state
from kvcache.diagnostics.ownership import OwnershipState, collect_state
from kvcache.types.owners import OwnerKind, owner_code

T1 = Namespace("t1")


def cache_with_data():
    c = make_cache(page_size=2, device_tokens=32, host_tokens=32)
    for rid, toks in (("a", range(8)), ("b", list(range(4)) + [9, 9, 9, 9])):
        c.admit(Request(rid, toks, T1))
        c.commit(rid)
    c.flush()
    c.admit(Request("live", list(range(8)) + [5, 5, 5], T1))
    return c


def kinds(cache):
    return {v.kind.value for v in cache.audit().violations}


def some_node(c):
    return next(n for n in c.tree.nodes() if n.device is not None and not n.children)


def test_healthy_cache_is_clean_and_counts_what_it_checked():
    c = cache_with_data()
    r = c.audit()
    assert r.ok and r.violations == []
    assert r.checked.pages == 32 and r.checked.requests == 1 and r.checked.nodes == 4


def test_leak():
    c = cache_with_data()
    c.device_pool.alloc(2, owner_code(OwnerKind.REQUEST, 999))  # taken, held by nobody
    r = c.audit()
    [v] = r.violations
    assert v.kind.value == "leak" and v.count == 2 and v.owners == ["request#999"]


def test_double_owner():
    c = cache_with_data()
    a = some_node(c)
    other = next(n for n in c.tree.nodes() if n is not a and n.device is not None)
    assert len(other.device) == len(a.device)
    a.device = other.device.copy()  # two nodes now reference the same pages; a's pages are held by nobody
    assert {"double_owner", "dangling_ref", "leak"} <= kinds(c)


def test_free_but_referenced_and_dangling_ref():
    c = cache_with_data()
    node = some_node(c)
    c.device_pool.transfer(node.device, node.owner, owner_code(OwnerKind.NODE, 4242))
    assert "dangling_ref" in kinds(c)
    c2 = cache_with_data()
    node = some_node(c2)
    c2.device_pool._owner[node.device] = 0  # ledger says FREE, node still holds it
    assert "free_but_referenced" in kinds(c2)


def test_free_list_mismatch():
    c = cache_with_data()
    free_page = c.device_pool.free_list()[0]
    c.device_pool._owner[free_page] = owner_code(OwnerKind.NODE, 1)
    assert "free_list_mismatch" in kinds(c)


def test_lock_underflow_and_mismatch():
    c = cache_with_data()
    node = some_node(c)
    node.lock_ref = -1
    assert {"lock_underflow", "lock_mismatch"} <= kinds(c)
    c2 = cache_with_data()
    some_node(c2).lock_ref += 1  # a lock no live request accounts for (a leaked lock)
    assert "lock_mismatch" in kinds(c2)


def test_pin_mismatch():
    c = cache_with_data()
    some_node(c).pins = 2
    assert "pin_mismatch" in kinds(c)


def test_prefix_and_shape_checks():
    c = cache_with_data()
    leaf = some_node(c)
    parent = leaf.parent
    assert not parent.is_namespace_root
    parent.device = None
    assert "device_not_prefix" in kinds(c)
    c2 = cache_with_data()
    leaf = some_node(c2)
    leaf.parent.host = None
    assert "host_not_prefix" in kinds(c2)
    c3 = cache_with_data()
    some_node(c3).device = np.array([0], dtype=np.int64)
    assert "page_count_mismatch" in kinds(c3)


def test_empty_node_and_size_mismatch():
    c = cache_with_data()
    leaf = some_node(c)
    leaf.device, leaf.host = None, None
    found = kinds(c)
    assert "empty_node" in found and "size_mismatch" in found


def test_namespace_mix():
    c = cache_with_data()
    some_node(c).namespace = Namespace("intruder")
    assert "namespace_mix" in kinds(c)


def test_detached_ref():
    c = cache_with_data()
    live = c.live_requests()[0]
    live.node.parent.children.clear()  # the request's node falls out of the tree
    assert "detached_ref" in kinds(c) or "leak" in kinds(c)


def test_state_round_trips_through_msgpack_and_audits_the_same():
    import msgspec

    c = cache_with_data()
    some_node(c).pins = 3
    state = collect_state(c)
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(state), type=OwnershipState)
    assert check_state(again) == check_state(state) and not check_state(again).ok


@pytest.mark.parametrize("ledger", [True, False])
def test_partition_checked_with_or_without_ledger(ledger):
    c = make_cache(ledger=ledger)
    c.admit(Request("a", range(5), T1))
    assert c.audit().ok
    c.device_pool.free_pages -= 1  # one free page drops off the free list
    assert "leak" in kinds(c)


@pytest.mark.parametrize("tier, field", [("device", "held"), ("host", "evictable"), ("device", "protected")])
def test_a_tier_count_that_drifted_is_named_with_both_figures(tier, field):
    from kvcache.types.tier import Tier

    c = cache_with_data()
    book = c.tree.book(Tier(tier))
    recomputed = getattr(book, field)
    setattr(book, field, recomputed + 3)  # the tree's running total drifts from its nodes
    found = [v for v in c.audit().violations if v.kind.value == "size_mismatch"]
    assert [(v.detail, v.pool, v.count) for v in found] == [
        (f"tree {tier}_{field} is {recomputed + 3} pages, recomputed {recomputed}", tier, 3)]
