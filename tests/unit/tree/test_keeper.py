"""Locks, holds, pins and the L3 flag (kvcache.tree.keeper): the tree writes a node's counters, callers say what
their work does to it."""

import pytest

from factories import page_range as pages
from factories import tree_key
from kvcache import LockUnderflow, Namespace
from kvcache.tree import RadixTree, Tier

A = Namespace("tenant-a", "salt-a")


def key(tokens, ns=A):
    return tree_key(tokens, ns)


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


def test_a_hold_moves_one_tiers_pages_to_held_and_release_gives_them_back():
    t = RadixTree(1)
    a = t.insert(key([1, 2]), pages(0, 2)).node
    t.set_host(a, pages(20, 2))
    t.hold(a, Tier.HOST)
    assert (t.host_held, t.host_evictable, t.device_held, t.device_evictable) == (2, 0, 0, 2)
    assert [e.owner for e in t.evict_device(10)] == [a.owner]  # the device copy stays evictable
    assert t.evict_host(10) == []
    t.check()
    t.release(a, Tier.HOST)
    assert (t.host_held, t.host_evictable) == (0, 2)
    t.check()  # the release offered the node again: eviction finds it
    assert [e.owner for e in t.evict_host(10)] == [a.owner]
    b = t.insert(key([3]), pages(5, 1)).node
    with pytest.raises(LockUnderflow, match="host hold underflow"):
        t.release(b, Tier.HOST)
    assert b.host_holds == 0 and b.parent.host_holds == 0


def test_unpin_offers_a_node_again_so_eviction_finds_it():
    t = RadixTree(1)
    a = t.insert(key([1, 2]), pages(0, 2)).node
    t.pin([a])
    assert a.pins == 1 and t.evict_device(10) == []  # pinned: eviction drops its heap entry
    t.check()  # a pinned leaf needs no entry
    t.unpin(a)
    t.check()  # ... and an unpinned one does: unpin gave it one
    assert a.pins == 0 and [e.owner for e in t.evict_device(10)] == [a.owner]


def test_an_unbalanced_unpin_raises_and_changes_nothing():
    t = RadixTree(1)
    a = t.insert(key([1, 2]), pages(0, 2)).node
    t.pin([a])
    t.unpin(a)
    with pytest.raises(LockUnderflow, match=f"pin underflow at node {a.id}"):
        t.unpin(a)
    with pytest.raises(LockUnderflow, match=f"host pin underflow at node {a.id}"):
        t.unpin_host(a)
    assert (a.pins, a.host_pins) == (0, 0)
    t.check()


def test_pins_follow_a_split_and_each_half_is_unpinned_on_its_own():
    # A split copies the pins to the new head (TieredCache retargets the in-flight copy to both halves).
    t = RadixTree(1)
    leaf = t.insert(key([1, 2, 3, 4]), pages(0, 4)).node
    t.pin([leaf])
    t.pin_host([leaf])
    head = t.match_prefix(key([1, 2, 9])).device_node  # splits leaf after 2 pages
    assert head is leaf.parent and (head.pins, head.host_pins) == (1, 1)
    for node in (leaf, head):
        t.unpin(node)
        t.unpin_host(node)
    t.check()
    assert sum(len(e.pages) for e in t.evict_device(10)) == 4


def test_pin_host_keeps_only_the_host_copy_and_unpin_host_offers_it_again():
    t = RadixTree(1)
    a = t.insert(key([1, 2]), pages(0, 2)).node
    t.set_host(a, pages(20, 2))
    t.pin_host([a])
    assert [e.owner for e in t.evict_device(10)] == [a.owner]  # the host pin leaves the device copy evictable
    assert t.evict_host(10) == [] and a.host_pins == 1
    t.check()
    t.unpin_host(a)
    t.check()
    assert [e.owner for e in t.evict_host(10)] == [a.owner] and t.node_count == 0


def test_mark_stored_spares_a_host_victim_its_write_back_and_mark_unstored_takes_that_back():
    t = RadixTree(1)
    nodes = []
    for i in range(3):
        node = t.insert(key([10 + i]), pages(i, 1)).node
        t.set_host(node, pages(20 + i, 1))
        nodes.append(node)
    t.evict_device(10)  # all three host-only now
    for node in nodes:
        t.mark_stored(node)
    assert all(n.stored for n in nodes)
    t.mark_unstored(nodes[1:2])  # L3 lost it
    written = []
    out = t.evict_host(10, backup=written.append)
    assert written == [nodes[1]] and len(out) == 3


def test_the_stored_index_follows_splits_deletes_and_the_store_letting_pages_go():
    """A page the store evicts or deletes finds the node marked stored that holds it (issue 25, item 4): through
    splits (the head's pages move to the new node), and not after the node leaves the tree."""
    t = RadixTree(2, b"layout")
    B = Namespace("tenant-b")
    head = t.insert(key(range(12)), pages(0, 6)).node
    t.mark_stored(head)
    hashes = t.page_hashes(head)
    assert all(t.stored_node(h) is head for h in hashes)
    leaf = t.insert(key(list(range(6)) + [90, 91]), pages(10, 4)).node  # splits head after 3 pages
    top = leaf.parent
    assert top is not head and top.stored and head.stored
    assert [t.stored_node(h) for h in hashes] == [top] * 3 + [head] * 3
    t.mark_stored(leaf)
    other = t.insert(key(range(4), B), pages(20, 2)).node
    t.mark_stored(other)
    t.check()
    # the store evicts the head's second page: the head's node and every node below it are not stored any more
    assert t.unstore_pages([hashes[1]]) == 3
    assert not top.stored and not head.stored and not leaf.stored and other.stored
    assert t.stored_node(hashes[4]) is None
    t.check()
    # a dropped namespace: every node of it
    assert t.unstore_namespace(B.id) == 1 and not other.stored
    # a stored node that leaves the tree takes its pages out of the index (the store keeps them)
    t.mark_stored(top)
    t.mark_stored(head)
    t.evict_device(100)
    assert t.node_count == 0 and t.stored_node(hashes[0]) is None
    t.check()
