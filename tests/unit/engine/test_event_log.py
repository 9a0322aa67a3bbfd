"""The cache's KV-event log: what a feed reports is exactly what the cache holds.

Each test attaches a sink that keeps the batches, drives the cache, and rebuilds from the events alone the set of
(namespace, page hash, tier) — then compares it with what the cache holds, read independently: the tree's copies
with page hashes recomputed from each node's path tokens (`keys.page_hashes`, not the tree's cached chain), and
the store's pages walked from each namespace's root.
"""

from __future__ import annotations

import pytest

from factories import l3_cache, make_cache, make_layout, make_store, store_holdings
from kvcache import InvalidInput, Namespace, RadixKey, Request, WorkloadSpec, generate, replay
from kvcache.types.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, MediumNames, encode_batch
from kvcache.types.keys import page_hashes

SPEC = WorkloadSpec(requests=40, tenants=3, shared_prefix_tokens=16, system_prompt_tokens=48, documents=3,
                    document_tokens=32, user_tokens=12, output_tokens=8, seed=5)


class Feed:
    """A sink that keeps every batch, and the set its events rebuild."""

    def __init__(self) -> None:
        self.batches: list[EventBatch] = []

    def __call__(self, batch: EventBatch) -> None:
        self.batches.append(batch)

    def rebuilt(self) -> set[tuple]:
        held: set[tuple] = set()
        for batch in self.batches:
            for ev in batch.events:
                if isinstance(ev, AllBlocksCleared):
                    held.clear()
                    continue
                keys = {((ev.extra_key, ev.salt_fingerprint), h, ev.medium) for h in ev.block_hashes}
                if isinstance(ev, BlockStored):
                    assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
                    held |= keys
                else:
                    assert keys <= held, "a removal of pages the feed never announced"
                    held -= keys
        return held


def holdings(cache) -> set[tuple]:
    """(namespace, page hash, tier) of everything the cache holds now, read from the tree and the store."""
    tree, ps = cache.tree, cache.page_size
    out = set()
    for node in tree.nodes():
        ns = node.namespace
        name = (ns.extra_key, cache.fingerprints.fingerprint(ns))
        chain = page_hashes(cache.layout.layout_id, RadixKey.of(tree.path_key(node), ns), ps, cache.chain_key)
        mine = chain[len(chain) - len(node.key) // (4 * ps):]
        for tier, present in (("device", node.device is not None), ("host", node.host is not None)):
            if present:
                out |= {(name, h, tier) for h in mine}
    return out | store_holdings(cache.store) if cache.store is not None else out


def _tiers(held: set[tuple]) -> set[str]:
    return {tier for _, _, tier in held}


@pytest.fixture
def store(tmp_path):
    """An LMDB store (a cache on it keys its feed's fingerprints by the store's key: the registry's are the
    feed's)."""
    handle = make_store(tmp_path / "store", make_layout(4))
    yield handle
    handle.close()


@pytest.mark.parametrize("mode", ["cache", "buffer"])
def test_a_replay_under_pressure_is_rebuilt_exactly_from_its_events(store, mode):
    cache = l3_cache(store, page_size=4, device_tokens=192, host_tokens=384, host_mode=mode)
    feed = Feed()
    cache.attach_events(feed)
    report = replay(cache, generate(SPEC))
    assert report.audit.ok
    assert cache.counters.device_pages_evicted > 0  # pressure: evictions happened
    held = holdings(cache)
    assert _tiers(held) == ({"device", "host", "storage"} if mode == "cache" else {"device", "storage"})
    assert feed.rebuilt() == held
    assert len(feed.batches) > 10  # one batch per step, not one per cache
    salts = {SPEC.tenant(i)[1].encode() for i in range(SPEC.tenants)}
    for batch in feed.batches:
        payload = encode_batch(batch)
        assert not any(salt in payload for salt in salts)
    cache.close()
    assert isinstance(feed.batches[-1].events[-1], AllBlocksCleared)
    assert feed.rebuilt() == set()


def test_dropping_a_namespace_reports_its_pages_leaving_every_tier(store):
    cache = l3_cache(store, page_size=4)
    feed = Feed()
    cache.attach_events(feed)
    a, b = Namespace("a", "sa"), Namespace("b")
    for i, ns in enumerate((a, b)):
        req = Request(f"r{i}", list(range(100 * i, 100 * i + 24)), ns)
        cache.admit(req)
        cache.commit(req.rid)
    cache.flush()
    assert feed.rebuilt() == holdings(cache)
    stored = {name for name, _, tier in feed.rebuilt() if tier == "storage"}
    assert stored == {("a", a.fingerprint(store.fingerprint_key)), ("b", None)}
    drop = cache.drop_namespace(a)
    assert drop.store_pages == 6
    cache.poll()
    assert feed.rebuilt() == holdings(cache)
    assert {name for name, _, _ in feed.rebuilt()} == {("b", None)}
    removed = [ev for ev in feed.batches[-1].events if isinstance(ev, BlockRemoved)]
    assert {ev.medium for ev in removed} == {"device", "host", "storage"}


def test_attaching_to_a_warm_cache_clears_then_announces_what_it_holds():
    cache = make_cache(page_size=2, device_tokens=32, host_tokens=64)
    req = Request("r", list(range(10)), Namespace("t"))
    cache.admit(req)
    cache.commit("r")
    cache.flush()
    feed = Feed()
    cache.attach_events(feed)
    assert len(feed.batches) == 1  # handed over before attach_events returns
    first = feed.batches[0].events
    assert isinstance(first[0], AllBlocksCleared)
    assert feed.rebuilt() == holdings(cache) and _tiers(feed.rebuilt()) == {"device", "host"}
    stored = [ev for ev in first if isinstance(ev, BlockStored)]
    assert all(ev.parent_block_hash is None for ev in stored)  # one node: the namespace's first pages
    assert stored[0].token_ids == list(range(10))[:10 // 2 * 2]


def test_a_split_moves_pages_without_an_event_and_parents_chain():
    cache = make_cache(page_size=2, device_tokens=64, host_tokens=0)
    feed = Feed()
    cache.attach_events(feed)
    ns = Namespace("t")
    for rid, tokens in (("a", list(range(12))), ("b", list(range(6)) + [90, 91, 92, 93])):
        cache.admit(Request(rid, tokens, ns))
        cache.commit(rid)
        cache.poll()
    events = [ev for b in feed.batches for ev in b.events if not isinstance(ev, AllBlocksCleared)]
    # a: one node of 6 pages; b: splits it after 3 pages (no event) and adds a 2-page leaf below the head
    assert [(type(ev).__name__, len(ev.block_hashes)) for ev in events] == [("BlockStored", 6), ("BlockStored", 2)]
    head_last = page_hashes(cache.layout.layout_id, RadixKey.of(list(range(6)), ns), 2, cache.chain_key)[-1]
    assert events[1].parent_block_hash == head_last
    assert feed.rebuilt() == holdings(cache)


def test_without_a_feed_the_tree_has_no_listener_and_detach_ends_one():
    cache = make_cache(page_size=2)
    assert cache.tree.on_copy is None
    feed = Feed()
    cache.attach_events(feed, data_parallel_rank=3, medium_names=MediumNames.SGLANG)
    with pytest.raises(InvalidInput, match="already has a KV-event feed"):
        cache.attach_events(Feed())
    cache.admit(Request("r", list(range(8)), Namespace()))
    cache.commit("r")
    cache.poll()  # the backup completes here
    assert {ev.medium for ev in feed.batches[-1].events} == {"GPU", "CPU_PINNED"}
    n = len(feed.batches)
    cache.admit(Request("s", list(range(20, 28)), Namespace()))
    cache.commit("s")
    cache.detach_events()  # hands over what is pending
    assert cache.tree.on_copy is None
    assert len(feed.batches) == n + 1 and feed.batches[-1].data_parallel_rank == 3
    assert [(type(ev).__name__, ev.medium) for ev in feed.batches[-1].events] == [("BlockStored", "GPU")]
    n += 1
    cache.evict(device_tokens=64, host_tokens=64)
    cache.poll()
    assert len(feed.batches) == n


# --- storage, exactly (issue 25, item 8) ------------------------------------------------------------------------

def _storage_stored(feed: Feed) -> list:
    return [ev for b in feed.batches for ev in b.events if isinstance(ev, BlockStored) and ev.medium == "storage"]


def _serve(cache, rid, tokens, ns):
    from factories import forward

    req = Request(rid, tokens, ns)
    adm = cache.admit(req)
    forward(cache, req, adm)
    cache.commit(rid)
    return req


def test_a_node_evicted_while_its_write_is_in_flight_is_announced_with_its_true_parent(store):
    """Buffer mode: a request's pages are bounced to L3, and its node is evicted from the device (to admit the
    next request) before the write runs. On f3c3857 the detached node was announced with parent None: a router
    took its pages for a namespace's first pages, and their hashes did not re-derive from their tokens."""
    ns = Namespace("t", "s")
    cache = l3_cache(store, page_size=4, device_tokens=48, host_tokens=64, host_mode="buffer")
    feed = Feed()
    cache.attach_events(feed)
    prefix = list(range(16))
    _serve(cache, "p", prefix, ns)
    cache.flush()  # the prefix is in L3
    _serve(cache, "a", prefix + list(range(100, 116)), ns)  # a child node of 4 pages, its backup in flight
    _serve(cache, "b", list(range(200, 224)), ns)  # needs the room: completes the backup, evicts the child
    child = page_hashes(cache.layout.layout_id, RadixKey.of(prefix + list(range(100, 116)), ns), 4,
                        cache.chain_key)
    assert cache.match(Request("q", prefix + list(range(100, 116)), ns)).device_tokens == 16  # it was evicted
    cache.flush()
    assert store.exists_prefix(child) == 8  # ... and written all the same
    announced = [ev for ev in _storage_stored(feed) if child[4] in ev.block_hashes]
    assert len(announced) == 1
    ev = announced[0]
    assert ev.block_hashes == child[4:] and ev.parent_block_hash == child[3]
    assert page_hashes(cache.layout.layout_id, RadixKey.of(prefix + ev.token_ids, ns), 4, cache.chain_key)[4:] == ev.block_hashes
    assert feed.rebuilt() == holdings(cache)


def test_a_page_written_again_is_announced_once(store):
    """The same prompt written, evicted from L1 and L2 (L3 keeps it), served and written again: its storage pages
    are announced once (on f3c3857 the second write announced them again)."""
    ns = Namespace("t", "s")
    cache = l3_cache(store, page_size=4)
    feed = Feed()
    cache.attach_events(feed)
    tokens = list(range(32))
    for rid in ("a", "b"):
        _serve(cache, rid, tokens, ns)
        cache.flush()
        cache.evict(device_tokens=1000, host_tokens=1000)  # the node goes; L3 keeps the pages
        cache.poll()
    hashes = [h for ev in _storage_stored(feed) for h in ev.block_hashes]
    assert len(hashes) == len(set(hashes)) == 8
    assert feed.rebuilt() == holdings(cache)


def test_a_drop_removes_only_pages_the_feed_announced(store):
    """Pages of the tenant written by another process (never announced by this feed) go with the drop too; the
    feed removes only those it announced (on f3c3857 it removed every page the store walk found)."""
    ns = Namespace("t", "s")
    other = l3_cache(store, page_size=4)
    _serve(other, "o", list(range(500, 532)), ns)
    other.close()
    cache = l3_cache(store, page_size=4)
    feed = Feed()
    cache.attach_events(feed)
    _serve(cache, "a", list(range(32)), ns)
    cache.flush()
    drop = cache.drop_namespace(ns)
    assert drop.store_pages == 16
    cache.poll()
    removed = [h for b in feed.batches for ev in b.events if isinstance(ev, BlockRemoved) and ev.medium == "storage"
               for h in ev.block_hashes]
    assert sorted(removed) == sorted(page_hashes(cache.layout.layout_id, RadixKey.of(list(range(32)), ns), 4,
                                                       cache.chain_key))
    assert feed.rebuilt() == holdings(cache) == set()


def test_a_store_share_eviction_is_reported_removed(store):
    """The store evicts a tenant's older pages to keep it within its share: the feed reports them removed (on
    f3c3857 it went on saying storage held them: 16 pages announced where the store held 10)."""
    from kvcache.types.shares import Shares

    ns = Namespace("t", "s")
    cache = l3_cache(store, page_size=4)
    feed = Feed()
    cache.attach_events(feed)
    cache.set_shares(ns, Shares(store_bytes=10 * cache.layout.bytes_per_page))
    _serve(cache, "a", list(range(32)), ns)
    cache.flush()
    _serve(cache, "b", list(range(500, 532)), ns)
    cache.flush()
    storage = {h for _, h, tier in feed.rebuilt() if tier == "storage"}
    assert len(storage) <= 10 and storage == {h for _, h, _ in store_holdings(store)}
    assert feed.rebuilt() == holdings(cache)
