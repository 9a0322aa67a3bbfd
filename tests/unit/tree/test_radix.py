import gc

import numpy as np
import pytest

from factories import page_range as pages
from factories import tree_key
from kvcache import InvalidInput, InvariantViolation, Namespace
from kvcache.tree import RadixTree, Tier
from kvcache.types.keys import page_hashes

A, B = Namespace("tenant-a", "salt-a"), Namespace("tenant-b")
LAYOUT_ID = b"L" * 16


def key(tokens, ns=A):
    return tree_key(tokens, ns)


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
    assert full == page_hashes(LAYOUT_ID, key(range(12)), 2, t.chain_key)
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
    assert t.page_hashes(other) == page_hashes(LAYOUT_ID, key(list(range(4)) + [77, 78]), 2, t.chain_key)[2:]


def test_split_reports_to_listener():
    t = RadixTree(1)
    seen = []
    t.on_split = lambda child, new, head: seen.append((child.id, new.id, head))
    ins = t.insert(key(range(5)), pages(0, 5))
    t.match_prefix(key([0, 1, 9]))
    assert seen == [(ins.node.id, ins.node.parent.id, 2)]


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
    for _ in range(400):
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


def test_check_names_a_node_whose_children_count_is_off():
    t = RadixTree(1)
    t.insert(key([1, 2, 3]), pages(0, 3))
    t.insert(key([1, 2, 4]), pages(3, 3))
    shared = t.match_prefix(key([1, 2])).device_node
    shared.children_on_device += 1
    with pytest.raises(InvariantViolation, match=f"node#{shared.id} records 3 children with a device copy, it has 2"):
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


def test_check_finds_a_tier_class_count_that_drifted():
    t = RadixTree(1)
    leaf = t.insert(key([1, 2, 3]), pages(0, 3)).node
    t.lock(leaf)
    t.check()
    t.book(Tier.DEVICE).protected += 1
    with pytest.raises(InvariantViolation, match="device pages protected/held/evictable 4/0/0, its nodes hold 3/0/0"):
        t.check()


def test_tier_is_one_value_wherever_it_is_imported_from():
    from kvcache.types.tier import Tier as FromTypes
    assert FromTypes is Tier and Tier.DEVICE.value == "device" and Tier.HOST.value == "host"


def test_an_insert_from_page_first_takes_only_the_pages_after_the_prefix_the_tree_holds():
    # What a commit does: its cached prefix is in the tree (its lock kept it), so it offers its fresh pages alone.
    t = RadixTree(2)
    t.insert(key(range(8)), pages(0, 4))
    fresh = pages(10, 3)
    ins = t.insert(key(list(range(8)) + [50, 51, 52, 53, 54, 55]), fresh, first=4)
    assert ins.prefix_pages == 4 and len(ins.adopted) == 1
    assert ins.adopted[0].device is fresh  # the new leaf took the caller's array itself: no slice, no copy
    m = t.match_prefix(key(list(range(8)) + [50, 51, 52, 53, 54, 55]))
    assert m.device_pages.tolist() == [0, 1, 2, 3, 10, 11, 12]
    # pages the tree holds past `first` are duplicates, and the leaf takes the caller's pages after them
    again = pages(20, 5)
    ins = t.insert(key(list(range(8)) + [50, 51, 52, 53, 54, 55, 60, 61]), again, first=3)
    assert ins.prefix_pages == 7 and ins.adopted[0].device.tolist() == [24]
    t.check()


def test_an_insert_from_page_first_whose_prefix_the_tree_lacks_raises_and_takes_nothing():
    t = RadixTree(2)
    t.insert(key(range(4)), pages(0, 2))
    before = sorted(n.id for n in t.nodes())
    with pytest.raises(InvariantViolation, match="no device copy"):
        t.insert(key(range(12)), pages(10, 2), first=4)  # pages 2 and 3 of the key are not in the tree
    assert sorted(n.id for n in t.nodes()) == before and t.device_evictable == 2
    with pytest.raises(InvalidInput):  # pages offered do not cover the key from `first`
        t.insert(key(range(12)), pages(10, 3), first=4)
    t.check()


def test_namespace_pages_counts_each_namespaces_copies_per_tier():
    t = RadixTree(1)
    a = t.insert(key([1, 2], A), pages(0, 2)).node
    t.insert(key([1, 2, 3, 4], A), pages(10, 4))
    t.insert(key([1, 2, 3], B), pages(30, 3))
    t.set_host(a, pages(20, 2))
    held = t.namespace_pages()
    assert (held[A.id].device_pages, held[A.id].host_pages) == (4, 2)
    assert (held[B.id].device_pages, held[B.id].host_pages) == (3, 0)
    assert list(t.namespace_pages(B)) == [B.id] and t.namespace_pages(Namespace("absent")) == {}


def test_held_run_is_the_device_prefix_then_the_host_extension_and_touches_nothing():
    t = RadixTree(1, LAYOUT_ID)
    a = t.insert(key([1, 2]), pages(0, 2)).node
    b = t.insert(key([1, 2, 3, 4]), pages(10, 4)).node
    t.set_host(b, pages(22, 2))
    hashes = page_hashes(LAYOUT_ID, key([1, 2, 3, 4, 5]), 1, t.chain_key)
    assert (t.held_run(hashes).device_pages, t.held_run(hashes).host_pages) == (4, 0)
    t.evict_device(100, where=lambda n: n is b)  # b keeps its host copy only
    clock = (a.last_access, b.last_access, a.hits, b.hits)
    run = t.held_run(hashes)
    assert (run.device_pages, run.host_pages) == (2, 2)
    assert (a.last_access, b.last_access, a.hits, b.hits) == clock  # no hit, no LRU tick
    assert t.held_run(page_hashes(LAYOUT_ID, key([9, 9], B), 1, t.chain_key)).device_pages == 0
