"""L2 -> L3 writes over a real LMDB store (issue 25, items 4 and 5): stored flags follow every deletion and eviction
in the store, a write stops at a batch the store refused, and a failed write is tried again, parent first, once the
store answers — never refused forever for a parent that failed once.

Faults are injected into a real store (its `put` raises while the test says it is away), as in the stateful test's
FlakyStore: nothing here mocks the store.
"""

from __future__ import annotations

import pytest

import factories
import kvcache.engine.writes as writes
from factories import l3_cache, make_layout, make_store
from kvcache import Namespace, Request
from kvcache.types.keys import page_hashes
from kvcache.types.shares import Shares

T1, T2 = Namespace("t1", "salt-one"), Namespace("t2", "salt-two")
TOKENS = list(range(100, 132))  # 8 pages of 4
OTHER = list(range(500, 532))  # 8 pages of 4, sharing nothing with TOKENS
RETRY_MAX_POLLS = 64  # the longest retry wait in polls (kvcache.engine.writes.RETRY_MAX_POLLS: checked below)


@pytest.fixture
def store(tmp_path):
    s = make_store(tmp_path / "store", make_layout(4))
    yield s
    s.close()


class Outage:
    """Makes a real store's `put` fail (as a dropped connection does) while `down`; counts the puts tried."""

    def __init__(self, store, monkeypatch) -> None:
        self.down = False
        self.tried = 0
        real = store.put

        def put(hashes, pages, origins):
            self.tried += 1
            if self.down:
                raise OSError("injected: the store is away")
            return real(hashes, pages, origins)

        monkeypatch.setattr(store, "put", put)


def serve(cache, rid, tokens, ns=T1):
    req = Request(rid, tokens, ns)
    factories.serve(cache, req)
    return req


def hashes_of(cache, tokens, ns=T1):
    return page_hashes(cache.layout.layout_id, Request("h", tokens, ns).key, cache.page_size, cache.chain_key)


def stored_flags_are_true(cache, store) -> None:
    """Every node marked stored has every page in the store (a stale flag skips a write that is needed)."""
    for node in cache.tree.nodes():
        if node.stored:
            hashes = cache.tree.page_hashes(node)
            assert all(store.exists_prefix([h]) for h in hashes), f"node #{node.id} is marked stored, L3 lost it"
    cache.tree.check()


@pytest.mark.parametrize("mode", ["cache", "buffer"])
def test_a_failed_write_is_tried_again_once_the_store_answers(store, monkeypatch, mode):
    outage = Outage(store, monkeypatch)
    c = l3_cache(store, host_mode=mode)
    outage.down = True
    serve(c, "a", TOKENS)
    c.flush()
    bs = c.stats().backup
    assert bs.storage_failed == 1 and store.exists_prefix(hashes_of(c, TOKENS)) == 0
    # While the store stays away the retries back off (1, 2, 4 ... polls): a few puts, not one per poll.
    tried = outage.tried
    for _ in range(4 * RETRY_MAX_POLLS):
        c.poll()
    retries = getattr(c.stats().backup, "storage_retries", 0)  # (a field new with the retries)
    assert 3 <= retries <= 12 and outage.tried - tried == retries
    assert c.audit().ok
    outage.down = False  # the store answers again: no new request comes, the cache writes what failed
    for _ in range(RETRY_MAX_POLLS + 3):
        c.poll()
    assert store.exists_prefix(hashes_of(c, TOKENS)) == 8
    node = c.match(Request("q", TOKENS, T1)).device_node
    assert node.stored and store.verify().ok and c.audit().ok
    n = c.stats().backup.storage_retries
    for _ in range(2 * RETRY_MAX_POLLS):
        c.poll()
    assert c.stats().backup.storage_retries == n  # nothing left to retry: no more puts
    stored_flags_are_true(c, store)
    assert writes.RETRY_MAX_POLLS == RETRY_MAX_POLLS  # the bound the poll counts above were sized by


def test_a_child_is_never_refused_for_a_parent_whose_write_failed(store, monkeypatch):
    """The parent's write fails; a request extends it once the store is back: the parent is written first, in
    the same chain, and no write is refused or rewritten for it."""
    outage = Outage(store, monkeypatch)
    c = l3_cache(store, host_mode="buffer")
    outage.down = True
    serve(c, "a", TOKENS)
    c.flush()
    outage.down = False
    serve(c, "b", TOKENS + OTHER)
    c.flush()
    bs = c.stats().backup
    assert store.exists_prefix(hashes_of(c, TOKENS + OTHER)) == 16
    assert bs.storage_failed == 1 and bs.storage_rejected == 0 and store.verify().ok
    stored_flags_are_true(c, store)


def test_a_batch_the_store_refuses_ends_the_write_and_what_it_took_is_kept(store):
    """A share of 5 pages: the store takes pages 0-4 of an 8-page chain and refuses page 5. On f3c3857 the write
    went on with the next batch, whose first page's parent (page 5) was not stored: InvalidInput, a failed write,
    a warning."""
    c = l3_cache(store, io_batch_pages=2)
    c.set_shares(T1, Shares(store_bytes=5 * c.layout.bytes_per_page))
    serve(c, "a", TOKENS)
    c.flush()
    bs = c.stats().backup
    assert bs.storage_failed == 0 and bs.storage_rejected == 1 and bs.storage_pages == 5
    assert store.exists_prefix(hashes_of(c, TOKENS)) == 5
    node = c.match(Request("q", TOKENS, T1)).device_node
    assert not node.stored  # not every page of it is in L3
    stored_flags_are_true(c, store)


@pytest.mark.parametrize("mode", ["cache", "buffer"])
def test_a_drop_under_a_lock_unmarks_the_locked_pages_and_the_commit_writes_them_again(store, mode):
    """Item 4: a request holds the tenant's prefix while it is dropped. On f3c3857 the locked nodes kept
    stored=True though L3 lost them, and the commit wrote nothing: L3 stayed at 0 of 8 pages."""
    c = l3_cache(store, host_mode=mode)
    serve(c, "a", TOKENS)
    c.flush()
    assert store.exists_prefix(hashes_of(c, TOKENS)) == 8
    again = Request("b", TOKENS, T1)  # the same prompt: its whole prefix is cached, locked while it runs
    assert c.admit(again).cached_tokens == 32
    drop = c.drop_namespace(T1)
    assert drop.store_pages == 8 and drop.live_requests == 1 and store.exists_prefix(hashes_of(c, TOKENS)) == 0
    node = c.match(Request("q", TOKENS, T1)).device_node
    assert node.lock_ref and not node.stored
    stored_flags_are_true(c, store)
    c.commit("b")
    c.flush()
    assert store.exists_prefix(hashes_of(c, TOKENS)) == 8 and node.stored
    stored_flags_are_true(c, store)


def test_a_drop_forgets_the_namespaces_failed_writes(store, monkeypatch):
    """Offboarding sticks: a write of the tenant that failed is not retried after the tenant is dropped."""
    outage = Outage(store, monkeypatch)
    c = l3_cache(store)
    outage.down = True
    serve(c, "a", TOKENS)
    c.flush()
    outage.down = False
    b = Request("b", TOKENS, T1)
    c.admit(b)  # locks the failed nodes: the drop cannot free them
    c.drop_namespace(T1)
    for _ in range(2 * RETRY_MAX_POLLS):
        c.poll()
    assert getattr(c.stats().backup, "storage_retries", 0) == 0 and store.exists_prefix(hashes_of(c, TOKENS)) == 0
    c.release("b")


def test_a_store_share_eviction_unmarks_the_nodes_whose_pages_went(store):
    """Item 4: the store evicts a namespace's older pages to keep it within its share; the nodes holding them
    are not stored any more (on f3c3857 they stayed stored=True: PutResult.evicted was ignored)."""
    c = l3_cache(store)
    c.set_shares(T1, Shares(store_bytes=10 * c.layout.bytes_per_page))
    serve(c, "a", TOKENS)
    c.flush()
    first = c.match(Request("q", TOKENS, T1)).device_node
    assert first.stored
    serve(c, "b", OTHER)
    c.flush()
    assert store.exists_prefix(hashes_of(c, OTHER)) == 8
    assert store.exists_prefix(hashes_of(c, TOKENS)) < 8  # the store made room from the older chain
    assert not first.stored and c.stats().backup.storage_evicted > 0
    stored_flags_are_true(c, store)
    # The next write of the evicted chain puts it again (the share evicts the other one in turn).
    serve(c, "c", TOKENS)
    c.flush()
    assert store.exists_prefix(hashes_of(c, TOKENS)) == 8 and first.stored
    stored_flags_are_true(c, store)


def test_the_store_names_the_pages_it_evicts_for_a_put(store):
    """What the cache's stored flags and the feed's removals rest on: `PutResult.evicted_hashes` are exactly the
    pages that left the store, as many as `evicted`."""
    from factories import store_holdings
    from kvcache.storage.api import page_origins
    from kvcache.types.keys import pack_tokens

    layout = make_layout(4)
    store.set_shares(T1, Shares(store_bytes=10 * layout.bytes_per_page))
    before = set()
    for start in (0, 1000):
        hashes, origins = page_origins(layout, pack_tokens(range(start, start + 32)), T1, store.chain_key)
        result = store.put(hashes, [bytes(layout.bytes_per_page)] * len(hashes), origins)
        now = {h for _, h, _ in store_holdings(store)}
        assert result.evicted == len(result.evicted_hashes)
        assert set(result.evicted_hashes) == before - now and now - before <= set(hashes)
        before = now
    assert result.evicted > 0
