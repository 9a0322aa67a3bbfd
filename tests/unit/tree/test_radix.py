import gc

import numpy as np
import pytest

from kvcache import InvariantViolation, LockUnderflow, Namespace, RadixKey
from kvcache.types.keys import page_hashes
from kvcache.tree import RadixTree, Tier

A, B = Namespace("tenant-a", "salt-a"), Namespace("tenant-b")
LAYOUT_ID = b"L" * 16


def key(tokens, ns=A):
    return RadixKey.of(tokens, ns)


def pages(start, n):
    return np.arange(start, start + n, dtype=np.int64)


def test_match_on_empty_tree_anchors_at_root():
    t = RadixTree(1)
    m = t.match_prefix(key([1, 2, 3]))
    assert m.device_tokens == 0 and m.host_tokens == 0 and m.anchor is t.root and m.anchor.namespace is None


def test_insert_then_match_full_and_partial():
    t = RadixTree(2)
    ins = t.insert(key(range(8)), pages(0, 4))
    assert ins.prefix_pages == 0 and [len(n) for n in ins.adopted] == [8]
    m = t.match_prefix(key(range(8)))
    assert list(m.device_pages) == [0, 1, 2, 3] and m.device_node is ins.node
    # a query ending inside a node splits it at the page boundary
    m = t.match_prefix(key([0, 1, 2, 3, 99]))
    assert list(m.device_pages) == [0, 1] and len(m.device_node) == 4
    assert m.device_node.parent.is_namespace_root and len(list(t.nodes())) == 2


def test_two_namespaces_share_no_node_for_identical_tokens():
    t = RadixTree(1)
    a = t.insert(key(range(6), A), pages(0, 6))
    b = t.insert(key(range(6), B), pages(100, 6))
    assert b.prefix_pages == 0 and a.node is not b.node
    assert t.namespace_root(A) is not t.namespace_root(B)
    for node in t.nodes():
        root = node
        while not root.is_namespace_root:
            assert root.namespace == node.namespace
            root = root.parent
    assert list(t.match_prefix(key(range(6), B)).device_pages) == list(range(100, 106))
    assert t.match_prefix(key(range(6), Namespace("tenant-c"))).device_tokens == 0


def test_insert_of_existing_prefix_reports_exactly_the_duplicates():
    t = RadixTree(1)
    t.insert(key(range(10)), pages(0, 10))
    ins = t.insert(key(list(range(6)) + [50, 51, 52]), pages(20, 9))
    assert ins.prefix_pages == 6  # the caller frees its pages 20..25
    assert [list(n.device) for n in ins.adopted] == [[26, 27, 28]]
    m = t.match_prefix(key(list(range(6)) + [50, 51, 52]))
    assert list(m.device_pages) == [0, 1, 2, 3, 4, 5, 26, 27, 28]


def test_insert_adopts_pages_for_host_only_nodes():
    t = RadixTree(1)
    ins = t.insert(key(range(4)), pages(0, 4))
    t.set_host(ins.node, pages(50, 4))
    [ev] = t.evict_device(4)
    assert list(ev.pages) == [0, 1, 2, 3] and ins.node.device is None and ins.node.host is not None
    again = t.insert(key(range(6)), pages(10, 6))
    assert again.prefix_pages == 0 and [list(n.device) for n in again.adopted] == [[10, 11, 12, 13], [14, 15]]


def test_split_keeps_sizes_and_page_hashes():
    t = RadixTree(2, LAYOUT_ID)
    ins = t.insert(key(range(12)), pages(0, 6))
    t.set_host(ins.node, pages(40, 6))
    full = t.page_hashes(ins.node)
    assert full == page_hashes(LAYOUT_ID, key(range(12)), 2)
    before = (t.device_evictable, t.host_evictable)
    t.insert(key(list(range(4)) + [77, 78]), pages(10, 3))  # splits after 2 pages
    head = ins.node.parent
    assert len(head) == 4 and len(ins.node) == 8
    assert list(head.device) == [0, 1] and list(ins.node.device) == [2, 3, 4, 5]
    assert list(head.host) == [40, 41] and list(ins.node.host) == [42, 43, 44, 45]
    assert head.page_hashes + ins.node.page_hashes == full
    assert (t.device_evictable, t.host_evictable) == (before[0] + 1, before[1])
    # hashes computed after a split agree with a fresh computation
    other = t.match_prefix(key(list(range(4)) + [77, 78])).device_node
    assert t.page_hashes(other) == page_hashes(LAYOUT_ID, key(list(range(4)) + [77, 78]), 2)[2:]


def test_split_reports_to_listener():
    t = RadixTree(1)
    seen = []
    t.on_split = lambda child, new, head: seen.append((child.id, new.id, head))
    ins = t.insert(key(range(5)), pages(0, 5))
    t.match_prefix(key([0, 1, 9]))
    assert seen == [(ins.node.id, ins.node.parent.id, 2)]


def test_lock_protects_path_and_underflow_is_detected():
    t = RadixTree(1)
    ins = t.insert(key(range(4)), pages(0, 4))
    leaf = t.insert(key(range(6)), pages(10, 6)).node
    t.lock(leaf)
    assert t.device_protected == 6 and t.device_evictable == 0
    assert t.evict_device(100) == []
    t.unlock(leaf)
    assert t.device_protected == 0 and t.device_evictable == 6
    with pytest.raises(LockUnderflow):
        t.unlock(leaf)
    assert leaf.lock_ref == 0 and ins.node.lock_ref == 0  # nothing changed by the failed unlock


def test_eviction_never_touches_locked_or_pinned_nodes_and_is_lru():
    t = RadixTree(1)
    t.insert(key([1, 1]), pages(0, 2))
    n2 = t.insert(key([2, 2]), pages(2, 2)).node
    n3 = t.insert(key([3, 3]), pages(4, 2)).node
    n4 = t.insert(key([4, 4]), pages(6, 2)).node
    t.match_prefix(key([1, 1]))  # n1 is now the most recently used
    t.lock(n2)
    t.pin([n3])
    evicted = t.evict_device(2)
    assert [list(e.pages) for e in evicted] == [[6, 7]]  # n4: oldest unlocked, unpinned
    evicted = t.evict_device(100)
    assert [list(e.pages) for e in evicted] == [[0, 1]]
    assert n2.device is not None and n3.device is not None and n4.parent is None


def test_device_eviction_keeps_node_with_host_copy_then_host_eviction_deletes_leaves_first():
    t = RadixTree(1)
    a = t.insert(key([1, 2]), pages(0, 2)).node
    b = t.insert(key([1, 2, 3, 4]), pages(10, 4)).node
    t.set_host(a, pages(20, 2))
    t.set_host(b, pages(22, 2))
    assert len(t.evict_device(100)) == 2
    assert a.device is None and b.device is None and b.parent is a
    first = t.evict_host(1)
    assert [list(e.pages) for e in first] == [[22, 23]]  # the leaf before its parent
    assert t.evict_host(1)[0].owner == a.owner
    assert t.namespace_root(A) is None  # an empty namespace subtree is removed


def test_host_eviction_skips_nodes_with_device_copy():
    t = RadixTree(1)
    a = t.insert(key([1, 2]), pages(0, 2)).node
    t.set_host(a, pages(20, 2))
    assert t.evict_host(10) == []


def test_anchor_is_deepest_host_node():
    t = RadixTree(1)
    a = t.insert(key([1, 2]), pages(0, 2)).node
    b = t.insert(key([1, 2, 3]), pages(10, 3)).node
    t.set_host(a, pages(20, 2))
    m = t.match_prefix(key([1, 2, 3, 9]))
    assert m.anchor is a and m.device_node is b and m.host_tokens == 0
    t.set_host(b, pages(22, 1))
    t.evict_device(1)
    m = t.match_prefix(key([1, 2, 3, 9]))
    assert m.anchor is b and m.device_node is a and m.host_node is b and list(m.host_pages) == [22]


def test_insert_rejects_unaligned_keys():
    t = RadixTree(4)
    with pytest.raises(ValueError):
        t.insert(key(range(6)), pages(0, 1))
    with pytest.raises(ValueError):
        t.insert(key(range(8)), pages(0, 3))


def test_an_insert_of_less_than_a_page_creates_no_namespace_root():
    t = RadixTree(4, LAYOUT_ID)
    ins = t.insert(key([1, 2]).page_aligned(4), pages(0, 0))
    assert ins.prefix_pages == 0 and ins.adopted == [] and t.namespace_roots() == []


def test_children_copy_counts_match_a_recount_after_random_moves():
    rng = np.random.default_rng(7)
    t = RadixTree(2)
    next_page = 0
    for step in range(400):
        ns = A if rng.random() < 0.7 else B
        # a few shared stems, random tails: inserts split nodes, matches split them too
        stem = [int(rng.integers(3))] * 4
        tokens = stem + rng.integers(0, 3, int(rng.integers(0, 5)) * 2).tolist()
        k = key(tokens, ns)
        op = rng.integers(5)
        if op == 0:
            t.insert(k, pages(next_page, len(tokens) // 2))
            next_page += len(tokens) // 2
        elif op == 1:
            t.match_prefix(k)
        elif op == 2:
            t.evict_device(int(rng.integers(1, 4)))
        elif op == 3:
            t.evict_host(int(rng.integers(1, 4)))
        else:  # back up a device node's path to the host tier, root first (host copies stay a prefix)
            nodes = [n for n in t.nodes() if n.device is not None and n.host is None]
            if nodes:
                for n in t.path(nodes[int(rng.integers(len(nodes)))]):
                    if n.host is None:
                        t.set_host(n, pages(next_page, len(n.device)))
                        next_page += len(n.device)
        t.check()
    assert t.node_count > 0


def test_the_lru_heaps_hold_leaves_only_and_eviction_still_finds_every_one():
    t = RadixTree(1)
    a = t.insert(key([1, 2]), pages(0, 2)).node
    b = t.insert(key([1, 2, 3, 4]), pages(10, 4)).node
    t.set_host(a, pages(20, 2))  # write-through: host copies of device-resident nodes are no host victims yet
    t.set_host(b, pages(22, 2))
    # the device heap: b, and a's entry from before b became its child
    assert t.book(Tier.HOST).lru == [] and len(t.book(Tier.DEVICE).lru) == 2
    t.lock(b)
    t.check()
    assert t.evict_device(10) == []  # b is locked and a is not a device leaf
    t.unlock(b)
    t.check()
    assert [e.owner for e in t.evict_device(10)] == [b.owner, a.owner]  # b's unlock offered it again
    t.check()  # both became host leaves as their device copies went: b has its entry, a gets one when b goes
    assert [e.owner for e in t.evict_host(10)] == [b.owner, a.owner] and t.node_count == 0


def test_a_host_pin_never_hides_a_device_copy_from_eviction():
    # Found by the stateful test once check() looked for heap entries: an unlock while an L3 write still read the
    # host copy offered the node to neither heap, so its device copy stayed out of reach until the write landed.
    t = RadixTree(1)
    a = t.insert(key([1, 2]), pages(0, 2)).node
    t.set_host(a, pages(20, 2))
    t.pin_host([a])  # an L3 write reads the host copy
    t.lock(a)
    assert t.evict_device(10) == []  # locked: its entry is dropped, and it is offered again at unlock
    t.unlock(a)
    t.check()
    assert [e.owner for e in t.evict_device(10)] == [a.owner]  # the host pin protects the host copy only
    assert t.evict_host(10) == []  # ... which stays until the write lands
    t.unpin_host(a)  # offers it again
    assert [e.owner for e in t.evict_host(10)] == [a.owner]


def test_check_finds_an_evictable_leaf_the_heap_lost():
    t = RadixTree(1)
    t.insert(key([1, 2]), pages(0, 2))
    t.book(Tier.DEVICE).lru.clear()
    with pytest.raises(InvariantViolation, match="no entry in the device LRU heap"):
        t.check()


def test_check_names_a_node_whose_children_count_is_off():
    t = RadixTree(1)
    t.insert(key([1, 2, 3]), pages(0, 3))
    t.insert(key([1, 2, 4]), pages(3, 3))
    shared = t.match_prefix(key([1, 2])).device_node
    shared.children_on_device += 1
    with pytest.raises(InvariantViolation, match=f"node#{shared.id} records 3 children with a device copy, it has 2"):
        t.check()


# --- shares --------------------------------------------------------------------------------------------------


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


def test_nodes_are_invisible_to_the_cyclic_gc_and_a_dropped_tree_unlinks_them():
    # A full collection would otherwise walk every node of a big cache; the tree breaks its own cycles instead.
    tree = RadixTree(2)
    tree.insert(key([1, 2, 3, 4]), np.arange(2))
    tree.insert(key([1, 2, 5, 6]), np.arange(2, 4))
    leaf = tree.match_prefix(key([1, 2, 5, 6])).device_node
    assert leaf.parent is not None and not any(gc.is_tracked(n) for n in [tree.root, *tree.nodes()])
    del tree
    gc.collect()
    assert leaf.parent is None and leaf.children == {}  # unlinked: freed by reference counting
