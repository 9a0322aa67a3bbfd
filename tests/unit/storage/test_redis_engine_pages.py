"""Engine-keyed pages on the Redis backend (issue 23), beyond the conformance suite: where they live in Redis
(key layout and record fields), the put script's paths (a parent that is no stored page hangs the page from the
root inside the one atomic script; outcomes byte by byte through existing, written and share-rejected pages), the
access folding (every page a read served gets its time, the deepest its hit) and a fault on an engine-page read
(a counted miss, never an exception). Real redis-servers only (tests/redis_server.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import msgspec
import numpy as np
import pytest
import redis

from factories import make_layout
from kvcache.storage.api import PageMeta, PageOutcome, engine_hashes, engine_origins, page_origins
from kvcache.storage.codec import decode_meta, encoder
from kvcache.storage.registry import open_store
from kvcache.types.keys import engine_page_hash, hash_root, pack_tokens
from kvcache.types.namespace import Namespace
from kvcache.types.shares import Shares
from redis_server import own_redis, redis_cluster, redis_server  # noqa: F401  (fixtures)

LAYOUT = make_layout(4)
NS = Namespace("sglang")
FAST = "&timeout=0.5&connect_timeout=0.5&backoff_max=0.2"


def keys(n: int, start: int = 0) -> list[bytes]:
    """`n` engine keys as SGLang hands them: 32 raw bytes each (its 64-hex keys, decoded)."""
    return [(start + i).to_bytes(4, "big") * 8 for i in range(n)]


def pages(n: int, base: int = 0) -> list[np.ndarray]:
    """`n` distinct page payloads of LAYOUT."""
    return [np.full(LAYOUT.bytes_per_page, (base + i) % 251, np.uint8) for i in range(n)]


@pytest.fixture(params=["standalone", "cluster"])
def store(request: pytest.FixtureRequest):
    """A fresh store on the shared standalone server, then on the shared one-node cluster."""
    server = request.getfixturevalue("redis_server" if request.param == "standalone" else "redis_cluster")
    s = open_store(server.store_url(), LAYOUT, create=True)
    yield s
    s.close()


def raw_client(store) -> redis.Redis:
    """A plain client on the store's server (the cluster has one node: every slot is there)."""
    host, port = store.location.split("//")[1].split("?")[0].split("/")[0].split(":")
    return redis.Redis(host=host, port=int(port))


def test_engine_pages_are_named_by_their_key_alone_in_redis(store):
    """The record of an engine page is P p:<engine_page_hash(root, key)>: its metadata holds the key and no tokens,
    its `p` field and children entry name the previous page of the chain, the first page's its namespace root."""
    root = hash_root(LAYOUT.layout_id, NS, store.chain_key)
    ks = keys(3)
    hashes, origins = engine_origins(LAYOUT, NS, store.chain_key, ks)
    assert hashes == [engine_page_hash(root, k) for k in ks] == engine_hashes(LAYOUT, NS, store.chain_key, ks)
    assert store.put(hashes, pages(3), origins).outcomes == bytes([PageOutcome.WRITTEN]) * 3
    with raw_client(store) as c:
        p = store.prefix.encode()
        for i, (h, k) in enumerate(zip(hashes, ks, strict=True)):
            record = c.hgetall(p + b"p:" + h.hex().encode())
            meta = decode_meta(record[b"m"])
            parent = root if i == 0 else hashes[i - 1]
            assert (meta.key, meta.tokens, meta.parent) == (k, b"", parent)
            assert record[b"p"] == parent.hex().encode() and record[b"n"] == NS.id_hex.encode()
            assert c.smembers(p + b"c:" + parent.hex().encode()) == {h}
        assert c.hexists(p + b"ns:" + NS.id_hex.encode(), "r:" + root.hex())
    assert [child.key for child in store.children(root)] == [ks[0]]
    assert store.page_meta(hashes[2]).key == ks[2]


def test_an_unknown_parent_hangs_the_page_from_the_root_and_the_batch_is_kept(store):
    """SGLang's prefix keys may name pages never stored here (another node's, or its anchor's ancestors): the
    batch is not refused, its first page hangs from the namespace root (record, children set, namespace roots)
    and the rest chain below it. A token page with the same unknown parent is still refused, nothing written."""
    root = hash_root(LAYOUT.layout_id, NS, store.chain_key)
    ks = keys(3, 100)
    hashes, origins = engine_origins(LAYOUT, NS, store.chain_key, ks, parent_key=keys(1, 99)[0])
    assert origins[0].parent != root  # the engine named a parent ...
    result = store.put(hashes, pages(3), origins)  # ... that is not stored
    assert (result.written, result.outcomes) == (3, bytes([PageOutcome.WRITTEN]) * 3)
    assert store.page_meta(hashes[0]).parent == root and store.page_meta(hashes[1]).parent == hashes[0]
    with raw_client(store) as c:
        p = store.prefix.encode()
        assert c.hget(p + b"p:" + hashes[0].hex().encode(), "p") == root.hex().encode()
        assert hashes[0] in c.smembers(p + b"c:" + root.hex().encode())
        assert not c.exists(p + b"c:" + origins[0].parent.hex().encode())
    assert store.exists_prefix(hashes) == 3 and store.verify().ok
    tok_hashes, tok_origins = page_origins(LAYOUT, pack_tokens(range(8)), NS, store.chain_key,
                                           parent=origins[0].parent)
    from kvcache.errors import InvalidInput

    with pytest.raises(InvalidInput, match="parent"):
        store.put(tok_hashes, pages(2), tok_origins)
    assert store.exists_prefix(tok_hashes) == 0


def test_an_engine_parent_of_another_layout_or_namespace_is_unknown_here(store):
    """The put script reads a stored parent's namespace and layout from its metadata's leading bytes: a parent
    stored under another layout (same page size) or in another namespace is no parent of this page, which hangs
    from its own root; a parent of its namespace and layout is kept."""
    other = make_layout(4, model="test-model@r2")
    root = hash_root(LAYOUT.layout_id, NS, store.chain_key)
    elsewhere = open_store(store.location, other, add_layout=True)
    try:
        (foreign,), foreign_origins = engine_origins(other, NS, elsewhere.chain_key, keys(1, 600))
        assert elsewhere.put([foreign], pages(1), foreign_origins).written == 1
    finally:
        elsewhere.close()
    (tenant,), tenant_origins = engine_origins(LAYOUT, Namespace("other"), store.chain_key, keys(1, 601))
    (home,), home_origins = engine_origins(LAYOUT, NS, store.chain_key, keys(1, 602))
    assert store.put([tenant, home], pages(2), [*tenant_origins, *home_origins]).written == 2
    parents = {"layout": foreign, "namespace": tenant, "home": home}
    for i, (why, parent) in enumerate(parents.items()):
        (h,), (origin,) = engine_origins(LAYOUT, NS, store.chain_key, [keys(1, 610 + i)[0]])
        origin = msgspec.structs.replace(origin, parent=parent)
        assert store.put([h], pages(1), [origin]).written == 1, why
        assert store.page_meta(h).parent == (home if why == "home" else root), why
    # the same within one batch: a parent written just before, in another namespace, is no parent either
    (first,), first_origins = engine_origins(LAYOUT, Namespace("other"), store.chain_key, keys(1, 620))
    (h,), (origin,) = engine_origins(LAYOUT, NS, store.chain_key, keys(1, 621))
    result = store.put([first, h], pages(2), [*first_origins, msgspec.structs.replace(origin, parent=first)])
    assert result.written == 2 and store.page_meta(h).parent == root
    assert store.verify().ok


def test_the_put_script_reads_namespace_and_layout_from_these_bytes_of_a_page_meta():
    """What PUT_BATCH relies on (scripts.py): PageMeta's msgpack is an array header, then its namespace id and
    layout id as two bin 8 of 16 bytes; bytes 2..37 (1-based) are those two, with or without an engine key."""
    ns, layout = bytes(range(16)), bytes(range(16, 32))
    for key in (b"", b"k" * 32):
        meta = encoder.encode(PageMeta(ns, layout, b"p" * 16, b"", 64, 2**64 - 1, 1.0, 2.0, 3, key))
        assert meta[1:37] == b"\xc4\x10" + ns + b"\xc4\x10" + layout


def test_outcomes_page_by_page_through_existing_written_and_share_rejected_pages(store):
    """One batch through the put script's three outcomes: pages already stored, new pages within the namespace's
    store share, and new pages past it (rejected, with every later page of the namespace in the batch)."""
    ks = keys(6, 200)
    hashes, origins = engine_origins(LAYOUT, NS, store.chain_key, ks)
    data = pages(6, 7)
    assert store.put(hashes[:2], data[:2], origins[:2]).written == 2
    store.set_shares(NS, Shares(store_bytes=4 * LAYOUT.bytes_per_page))
    result = store.put(hashes, data, origins)
    W, E, R = PageOutcome.WRITTEN, PageOutcome.EXISTING, PageOutcome.REJECTED
    assert result.outcomes == bytes([E, E, W, W, R, R])
    assert (result.written, result.existing, result.rejected) == (2, 2, 2)
    assert store.exists_prefix(hashes) == 4 and store.verify().ok


def test_a_read_gives_its_time_to_every_page_it_served_and_its_hit_to_the_deepest(store):
    """LRU must not evict what was just read: after a flush every served page's last access is the read's time
    (written through the access script: one record a call on a cluster, TOUCH_KEYS a call on a standalone server,
    so a read of more pages than that spans calls); the hit count stays with the deepest page of the run, the
    namespace counts every page served. Pages the read did not reach keep their write time."""
    from kvcache_redis.access import TOUCH_KEYS

    n = TOUCH_KEYS + 20
    hashes, origins = engine_origins(LAYOUT, NS, store.chain_key, keys(n + 2, 300))
    assert store.put(hashes, pages(n + 2), origins).written == n + 2
    before = time.time()
    out = np.zeros((n, LAYOUT.bytes_per_page), np.uint8)
    assert store.get_into(hashes[:n], list(out)) == n
    store.flush()
    metas = [store.page_meta(h) for h in hashes]
    assert all(m.last_access >= before for m in metas[:n])
    assert all(m.last_access == m.created < before for m in metas[n:])
    assert [m.hits for m in metas] == [0] * (n - 1) + [1, 0, 0]
    (record,) = store.namespaces()
    assert record.hits == n and record.last_access >= before


def test_a_fault_on_an_engine_page_read_is_a_counted_miss_then_reads_resume(own_redis):  # noqa: F811
    """The server killed under a reader of engine pages: `exists_prefix` and `get_into` answer 0 and count
    read errors, nothing is raised; once it is back (its AOF kept the pages), the same keys read again."""
    store = open_store(own_redis.store_url() + FAST, LAYOUT, create=True)
    hashes, origins = engine_origins(LAYOUT, NS, store.chain_key, keys(4, 400))
    data = pages(4, 3)
    assert store.put(hashes, data, origins).written == 4
    own_redis.kill()
    out = np.zeros((4, LAYOUT.bytes_per_page), np.uint8)
    assert store.get_into(engine_hashes(LAYOUT, NS, store.chain_key, keys(4, 400)), list(out)) == 0
    assert store.exists_prefix(hashes) == 0
    counters = store.counters()
    assert counters.read_errors >= 2 and counters.misses >= 2 and counters.pages_read == 0
    own_redis.restart()
    for _ in range(200):  # wait for the handle's backoff to pass: polls the event, asserts no time
        if store.exists_prefix(hashes) == 4:
            break
        time.sleep(0.05)
    assert store.get_into(hashes, list(out)) == 4
    assert all(np.array_equal(o, d) for o, d in zip(out, data, strict=True))
    store.close()


def test_a_flipped_byte_in_an_engine_page_is_never_served_and_the_next_flush_drops_it(store):
    """A corrupt engine page is a counted miss, quarantined; the flush removes its record (the bytes are still the
    ones that failed), so the next put of that key writes it again and it reads back sound."""
    hashes, origins = engine_origins(LAYOUT, NS, store.chain_key, keys(2, 500))
    data = pages(2, 11)
    store.put(hashes, data, origins)
    with raw_client(store) as c:
        key = store.prefix.encode() + b"p:" + hashes[1].hex().encode()
        value = bytearray(c.hget(key, "d"))
        value[-1] ^= 0x5A
        c.hset(key, "d", bytes(value))
    out = np.zeros((2, LAYOUT.bytes_per_page), np.uint8)
    assert store.get_into(hashes, list(out)) == 1
    assert store.get_into(hashes, list(out)) == 1  # quarantined: a miss again, not read twice
    assert store.counters().checksum_failures == 1
    store.flush()
    assert store.exists_prefix(hashes) == 1
    assert store.put(hashes, data, origins).outcomes == bytes([PageOutcome.EXISTING, PageOutcome.WRITTEN])
    assert store.get_into(hashes, list(out)) == 2 and np.array_equal(out[1], data[1])
    assert store.verify().ok


def test_a_full_server_refuses_whole_engine_batches_and_the_next_batch_hangs_from_the_root(own_redis):  # noqa: F811
    """Under `maxmemory` (noeviction) the put script is refused whole before it starts: a batch of engine pages is
    stored whole or not at all, every page of a refused one says REJECTED. The engine goes on chaining from its
    last key; a batch whose parent was refused is kept, hanging from the root. What is stored audits clean."""
    store = open_store(own_redis.store_url(), LAYOUT, create=True)
    root = hash_root(LAYOUT.layout_id, NS, store.chain_key)
    with redis.Redis(port=own_redis.port) as admin:
        used = int(admin.info("memory")["used_memory"])
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", used + 512 * 1024)
    stored = refused = 0
    parent_key: bytes | None = None
    parent_stored = True
    for i in range(400):  # well past 512 KiB of records
        ks = keys(16, 10_000 + 16 * i)
        hashes, origins = engine_origins(LAYOUT, NS, store.chain_key, ks, parent_key=parent_key)
        result = store.put(hashes, pages(16, i), origins)
        if result.written:
            assert result.outcomes == bytes([PageOutcome.WRITTEN]) * 16
            stored += 1
            if not parent_stored:
                assert store.page_meta(hashes[0]).parent == root
        else:
            assert result.outcomes == bytes([PageOutcome.REJECTED]) * 16 and store.exists_prefix(hashes) == 0
            refused += 1
        parent_key, parent_stored = ks[-1], bool(result.written)
    assert stored and refused
    assert store.counters().pages_rejected == 16 * refused
    with redis.Redis(port=own_redis.port) as admin:
        admin.config_set("maxmemory", 0)  # room again: the audit's own reads and the engine's next batch fit
    hashes, origins = engine_origins(LAYOUT, NS, store.chain_key, keys(16, 90_000), parent_key=parent_key)
    assert store.put(hashes, pages(16), origins).written == 16
    assert store.page_meta(hashes[0]).parent == (root if not parent_stored else engine_hashes(
        LAYOUT, NS, store.chain_key, [parent_key])[0])
    assert store.verify().ok and store.namespaces()[0].pages == 16 * (stored + 1)
    store.close()


# The layout comes as JSON (LAYOUT's): the writers import the store's modules alone, not the test factories (and
# torch with them), so they start in a fraction of a second, close enough together to race.
ENGINE_WRITER = """
import json, msgspec
import numpy as np
from kvcache.storage.api import PageOutcome, engine_origins
from kvcache.storage.registry import open_store
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace
layout = msgspec.json.decode({layout!r}, type=KVLayout)
store = open_store({url!r}, layout, create=True, add_layout=True)
keys = [(i).to_bytes(4, "big") * 8 for i in range(96)]
written = 0
for b in [({start} + j) % 12 for j in range(12)]:  # each writer starts at another batch of the same chain
    batch = keys[8 * b:8 * b + 8]
    hashes, origins = engine_origins(layout, Namespace("sglang"), store.chain_key, batch,
                                     parent_key=keys[8 * b - 1] if b else None)
    result = store.put(hashes, [np.full(layout.bytes_per_page, b, np.uint8)] * 8, origins)
    assert result.rejected == 0 and len(result.outcomes) == 8, result
    written += result.outcomes.count(PageOutcome.WRITTEN)
store.close()
print(json.dumps(written))
"""


@pytest.mark.parametrize("kind", ["redis_server", "redis_cluster"])
def test_writers_on_several_processes_store_each_engine_page_once(request, kind):
    """Three processes put the same engine chain at once, batch by batch from different starting batches (so a
    batch may come before its parent's): each page is WRITTEN by exactly one of them (a batch is one script on a
    standalone server, a page one script on a cluster), the registry counts each once, and the store audits
    clean whichever parent each page ended up linked under."""
    url = request.getfixturevalue(kind).store_url()
    layout = msgspec.json.encode(LAYOUT).decode()
    procs = [subprocess.Popen([sys.executable, "-c", ENGINE_WRITER.format(layout=layout, url=url, start=4 * w)],
                              stdout=subprocess.PIPE, text=True) for w in range(3)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert sum(json.loads(out) for out in outs) == 96
    with open_store(url, LAYOUT) as store:
        report = store.verify()
        assert report.ok, report.findings
        assert report.pages_checked == 96 and store.namespaces()[0].pages == 96
        assert store.exists_prefix(engine_hashes(LAYOUT, NS, store.chain_key, keys(96))) == 96
