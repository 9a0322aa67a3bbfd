"""kvcache.ops.dump: a store's pages as KV events, on a real LMDB store and a real redis-server on loopback. Replayed
into a consumer (`kvcache.live.holdings`) they rebuild what the store's registry and children index say it holds,
each page once, parents first, chains that recompute to their hashes; a walk in chunks (a live dump) gives the same
events, and one that pages leave meanwhile gives none twice."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from factories import make_layout, make_store, store_holdings
from kvcache.live.holdings import Holdings, read_batches
from kvcache.ops.dump import DumpCursor, StoreWalk, batches, store_events
from kvcache.storage.api import page_origins
from kvcache.storage.registry import open_store
from kvcache.types.events import BlockStored, encode_batch
from kvcache.types.keys import extend_chain
from kvcache.types.namespace import Namespace
from redis_server import redis_server  # noqa: F401  (session fixture)

LAYOUT = make_layout(4)
SALT = "dump-salt-asdfgh"
T1, T2, DEFAULT = Namespace("t1", SALT), Namespace("t2"), Namespace(None)
PROMPT = list(range(100, 124))  # 6 pages of 4


def _put(store, ns: Namespace, tokens: list[int]) -> None:
    packed = np.asarray(tokens, dtype="<u4").tobytes()
    hashes, origins = page_origins(LAYOUT, packed, ns, store.chain_key)
    result = store.put(hashes, [np.zeros(LAYOUT.bytes_per_page, dtype=np.uint8)] * len(hashes), origins)
    assert result.written + result.existing == len(hashes)


@pytest.fixture(params=["lmdb", "redis"])
def store(request, tmp_path):
    if request.param == "lmdb":
        s = make_store(tmp_path / "store", LAYOUT)
    else:
        server = request.getfixturevalue("redis_server")
        s = open_store(server.store_url(), LAYOUT, create=True)
    for i in range(3):  # t1: a shared prefix and three branches of it; longer chains than one run
        _put(s, T1, PROMPT + [i] * 8 + [7] * 4 * i)
    _put(s, T2, PROMPT)  # another namespace, the same tokens: other pages
    _put(s, DEFAULT, [5] * 12)
    yield s
    s.close()


def _events(store, **kw) -> list[BlockStored]:
    return list(store_events(StoreWalk(store, **kw), "storage"))


def test_a_store_dump_replayed_into_a_consumer_rebuilds_what_the_store_holds(store):
    dump = b"".join(encode_batch(b) for b in batches(_events(store), per_batch=2))  # what --out writes
    held = Holdings()
    seen: list[bytes] = []
    t1_fingerprint = T1.fingerprint(store.fingerprint_key)  # under the store's key, as its registry shows it
    by_fingerprint = {None: DEFAULT, t1_fingerprint: T1}
    for batch in read_batches(dump):
        held.apply_batch(batch)
        for ev in batch.events:
            if not isinstance(ev, BlockStored):
                continue
            assert ev.parent_block_hash is None or ev.parent_block_hash in seen  # parents before children
            ns = T2 if ev.extra_key == "t2" else by_fingerprint[ev.salt_fingerprint]
            start = ev.parent_block_hash or store.root(ns)
            assert extend_chain(start, np.asarray(ev.token_ids, "<u4").tobytes(), 4) == ev.block_hashes
            seen += ev.block_hashes
    assert len(seen) == len(set(seen))  # each page once
    registry = {(r.extra_key, r.salt_fingerprint): r.pages for r in store.namespaces()}
    assert {(r.extra_key, r.salt_fingerprint): r.pages for r in held.namespaces()} == registry
    assert all(r.medium == "storage" for r in held.namespaces())
    assert {(ns, h) for ns, h, _ in store_holdings(store)} == {
        ((ev.extra_key, ev.salt_fingerprint), h) for ev in _events(store) for h in ev.block_hashes}
    assert registry[("t1", t1_fingerprint)] == 6 + 3 * 2 + 1 + 2  # the salt never rides, its fingerprint does
    assert SALT.encode() not in dump


def test_runs_follow_single_child_chains_and_stop_at_branches_and_at_the_run_limit(store):
    events = _events(store, run_max_pages=3)
    assert max(len(ev.block_hashes) for ev in events) == 3
    t2 = [ev for ev in events if ev.extra_key == "t2"]
    assert [len(ev.block_hashes) for ev in t2] == [3, 3]  # 6 pages, one chain, cut at the run limit
    assert t2[1].parent_block_hash == t2[0].block_hashes[-1]


def test_a_walk_in_chunks_gives_the_same_events_as_one_walk(store):
    whole = _events(store)
    chunked: list[BlockStored] = []
    cursor = None
    # bounded: a walk that never moves on fails here, it does not hang (`calls` is read after the loop)
    for calls in range(1, 100):  # noqa: B007
        walk = StoreWalk(store, cursor)
        chunked += store_events(walk, "storage", max_pages=2)
        raw = msgspec.msgpack.encode(walk.cursor())  # the cursor travels to the client and back
        cursor = msgspec.msgpack.decode(raw, type=DumpCursor | None)
        if cursor is None:
            break
    assert cursor is None and calls > 4
    assert [ev.block_hashes for ev in chunked] == [ev.block_hashes for ev in whole]


def test_pages_that_leave_between_chunks_are_never_given_twice_and_the_rest_all_once(store):
    walk = StoreWalk(store)
    first = list(store_events(walk, "storage", max_pages=1))
    cursor = walk.cursor()
    assert cursor is not None
    gone = next(r for r in store.namespaces() if r.ns_id_hex != cursor.ns_id)
    store.delete_namespace(bytes.fromhex(gone.ns_id_hex))
    rest = _events(store, cursor=cursor)
    given = [h for ev in first + rest for h in ev.block_hashes]
    assert len(given) == len(set(given))
    assert set(given) == {h for _, h, _ in store_holdings(store)} | set(first[0].block_hashes)


class _ChildrenOnly:
    """The store with only the protocol's `children` to list a page's children (a backend without `child_pages`):
    every call goes to the real store."""

    def __init__(self, store) -> None:
        self._store = store

    def __getattr__(self, name):
        if name == "child_pages":
            raise AttributeError(name)
        return getattr(self._store, name)


def test_child_pages_lists_what_children_lists_and_a_store_without_it_walks_the_same(store):
    for rec in store.namespaces():
        stack = [bytes.fromhex(r) for r in rec.roots]
        while stack:
            parent = stack.pop()
            kids = store.children(parent)
            assert sorted((c.page_hash, c.tokens, c.key) for c in store.child_pages(parent)) == sorted(
                (c.page_hash, c.tokens, c.key) for c in kids)
            stack += [c.page_hash for c in kids]
    assert _events(_ChildrenOnly(store)) == _events(store)
