"""Namespace shares in the tree: use per tier, share heaps, and the order eviction takes namespaces over their share
(kvcache.tree.shares)."""

import numpy as np
import pytest

from kvcache import InvariantViolation, Namespace, RadixKey
from kvcache.tree import RadixTree, ShareState, Tier
from kvcache.tree.shares import eviction_order

A, B = Namespace("tenant-a", "salt-a"), Namespace("tenant-b")


def key(tokens, ns=A):
    return RadixKey.of(tokens, ns)


def pages(start, n):
    return np.arange(start, start + n, dtype=np.int64)


def _fill(t, ns, n, start, base_token):
    """n one-page sequences of namespace ns, distinct tokens, device pages start..start+n-1, oldest first."""
    for i in range(n):
        t.insert(key([base_token + i], ns), pages(start + i, 1))


def test_share_counts_follow_every_copy_move_and_check_recounts_them():
    t = RadixTree(1)
    t.insert(key(range(6), A), pages(0, 6))
    t.set_share(A.id, 4, None)  # set after the fact: the subtree is counted now
    st = t.share_of(A.id)
    assert (st.device_used, st.host_used) == (6, 0)
    ins = t.insert(key(list(range(6)) + [7, 8]), pages(0, 8))
    assert ins.prefix_pages == 6 and st.device_used == 8  # the caller frees its duplicate pages, not the tree
    t.match_prefix(key([0, 1, 2, 9]))  # a split moves pages between nodes, the count stays
    node = t.match_prefix(key([0, 1, 2])).device_node
    t.set_host(node, pages(50, len(node)))
    assert (st.device_used, st.host_used) == (8, 3)
    t.check()
    st.tier(Tier.DEVICE).used += 1  # a count that drifted is found
    with pytest.raises(InvariantViolation, match="share"):
        t.check()
    st.tier(Tier.DEVICE).used -= 1
    t.set_share(A.id, None, None)
    assert t.share_of(A.id) is None and all(n.share is None for n in t.nodes())
    t.check()


def test_eviction_takes_namespaces_over_their_share_first():
    t = RadixTree(1)
    _fill(t, B, 3, 100, 1000)  # B's pages are the least recently used of all
    _fill(t, A, 10, 0, 0)
    t.set_share(A.id, 4, None)
    t.set_share(B.id, 4, None)
    out = t.evict_device(5)
    assert sum(len(e.pages) for e in out) == 5
    assert t.share_of(B.id).device_used == 3 and t.share_of(A.id).device_used == 5  # A gave them, oldest first
    assert sorted(int(p) for e in out for p in e.pages) == [0, 1, 2, 3, 4]
    out = t.evict_device(3)  # A is over by one: that one, then plain LRU (B's oldest)
    assert sorted(int(p) for e in out for p in e.pages) == [5, 100, 101]
    t.check()


def test_without_shares_the_same_eviction_is_plain_lru():
    t = RadixTree(1)
    _fill(t, B, 3, 100, 1000)
    _fill(t, A, 10, 0, 0)
    out = t.evict_device(5)
    assert sorted(int(p) for e in out for p in e.pages) == [0, 1, 100, 101, 102]


def test_an_eviction_charged_to_a_namespace_takes_its_own_pages_while_it_would_exceed_its_share():
    t = RadixTree(1)
    _fill(t, A, 4, 0, 0)
    _fill(t, B, 4, 100, 1000)  # B is newer, A is exactly at its share
    t.set_share(A.id, 4, None)
    out = t.evict_device(2, charge=A)  # A's admission of 2 more pages would take it over: its own pages go
    assert sorted(int(p) for e in out for p in e.pages) == [0, 1]
    out = t.evict_device(2, charge=B)  # B has no share: plain LRU, which here is A's again
    assert sorted(int(p) for e in out for p in e.pages) == [2, 3]
    t.check()


def test_host_shares_evict_host_only_leaves_of_the_namespace_over_its_share():
    t = RadixTree(1)
    for ns, base, hp in ((B, 1000, 100), (A, 0, 0)):
        for i in range(3):
            ins = t.insert(key([base + i], ns), pages(hp + i, 1))
            t.set_host(ins.node, pages(hp + 500 + i, 1))
            t.set_device(ins.node, None)
    t.set_share(A.id, None, 1)
    out = t.evict_host(2)
    assert sorted(int(p) for e in out for p in e.pages) == [500, 501]
    assert t.share_of(A.id).host_used == 1
    t.check()


def test_share_heaps_stay_bounded_when_nothing_pops_them():
    t = RadixTree(1)
    t.set_share(A.id, 1000, None)  # never over its share: its heap is only pushed to
    t.insert(key([1, 2]), pages(0, 2))
    node = t.match_prefix(key([1, 2])).device_node
    for _ in range(5000):
        t.lock(node)
        t.unlock(node)  # offers the path each time
    assert len(t.share_of(A.id).tier(Tier.DEVICE).lru) <= 4 * 2 + 1024 + 2


def test_a_namespace_root_made_after_the_share_carries_it():
    t = RadixTree(1)
    t.set_share(B.id, 2, None)
    t.insert(key([1, 2, 3], B), pages(0, 3))
    assert t.share_of(B.id).device_used == 3
    t.evict_device(3)
    assert t.share_of(B.id).device_used == 0 and t.namespace_root(B) is None  # reclaimed, the share stays
    t.insert(key([4], B), pages(0, 1))
    assert t.share_of(B.id).device_used == 1
    t.check()




def _state(name, device_limit, used):
    st = ShareState(name.encode(), name, device_limit, None)
    st.tier(Tier.DEVICE).used = used
    return st


def test_the_eviction_order_is_the_charged_namespace_then_the_most_over_first():
    a, b, c, d = _state("a", 10, 12), _state("b", 10, 15), _state("c", None, 50), _state("d", 10, 9)
    assert eviction_order([a, b, c, d], 0, None, 4) == [(5, b), (2, a)]  # c has no share, d is within its own
    # d admits 4 pages: with them it would be 3 over, so it gives those first, then the others as before
    assert eviction_order([a, b, c, d], 0, d, 4) == [(3, d), (5, b), (2, a)]
    assert eviction_order([a, b, c, d], 0, b, 2) == [(2, b), (2, a)]  # at most what the eviction asks of it
    assert eviction_order([a, b], 1, None, 4) == []  # no host shares
    assert (a.over(Tier.DEVICE), a.over(Tier.DEVICE, 3), a.over(Tier.HOST, 100)) == (2, 5, 0)
