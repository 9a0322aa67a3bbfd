"""Faults of a Redis L3 (issue 8): a server killed during a replay, refused connections, a hung server, OOM
replies. The store answers misses and failed writes, counts them and raises nothing into the scheduler loop;
the cache's ownership audit stays clean; once the server is back, prefetches hit again. Real servers only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import redis

from factories import l3_cache, make_layout
from kvcache.storage.api import page_origins
from kvcache.storage.registry import open_store
from kvcache.types.keys import pack_tokens
from kvcache.types.namespace import Namespace
from redis_node import PAGE_SIZE, requests, serve
from redis_server import own_redis, redis_server  # noqa: F401  (fixtures)

LAYOUT = make_layout(PAGE_SIZE)
NS = Namespace("t1", "salt-1")
FAST = "&timeout=0.5&connect_timeout=0.5&backoff_max=0.2"  # a dead server is noticed, and retried, quickly


def chain(chain_key: bytes, start: int, pages: int, ns: Namespace = NS):
    """Hashes, payloads and origins of one chain of `pages` pages."""
    hashes, origins = page_origins(LAYOUT, pack_tokens(range(start, start + pages * PAGE_SIZE)), ns, chain_key)
    payloads = [np.full(LAYOUT.bytes_per_page, i % 251, dtype=np.uint8) for i in range(len(hashes))]
    return hashes, payloads, origins


def wait_until_back(store, probe: list[bytes], tries: int = 200) -> None:
    """Poll until the store answers again after a restart (its backoff has passed): not a timed assertion."""
    for _ in range(tries):
        if store.exists_prefix(probe) == len(probe):
            return
        time.sleep(0.05)
    raise AssertionError("the store never reconnected")


def test_server_killed_during_a_replay_then_restarted(own_redis):  # noqa: F811
    store = open_store(own_redis.store_url() + FAST, LAYOUT, create=True)
    cache = l3_cache(store, page_size=PAGE_SIZE, device_tokens=1024, host_tokens=2048, io_thread=True,
                     prefetch_policy="wait_complete")
    first = serve(cache, requests("t1", "salt-1", 1, 4))
    assert first["verify_mismatches"] == 0 and first["storage_pages_written"] > 0
    probe = requests("t1", "salt-1", 9, 1)[0]

    # The replay goes on with new documents; the server dies before its third request.
    second = serve(cache, requests("t1", "salt-1", 2, 6, docs_from=3),
                   before=lambda i: own_redis.kill() if i == 2 else None)
    assert second["requests"] == 6 and second["refused"] == 0 and second["verify_mismatches"] == 0
    assert cache.audit().ok  # no slot leaked by the failed writes and prefetches
    counters = store.counters()
    assert counters.write_errors > 0 and counters.read_errors > 0  # L3 errors counted, none raised
    stats = cache.stats()
    assert stats.backup.storage_failed + stats.backup.storage_rejected > 0

    own_redis.restart()  # the AOF brings back every acknowledged write
    from kvcache.types.keys import page_hashes

    wait_until_back(store, page_hashes(LAYOUT.layout_id, probe.key, PAGE_SIZE, store.chain_key)[:24])
    # A fresh node on the same store handle: its first documents come from L3 again, bytes checked.
    fresh = l3_cache(store, page_size=PAGE_SIZE, device_tokens=1024, host_tokens=2048, io_thread=True,
                     prefetch_policy="wait_complete")
    third = serve(fresh, requests("t1", "salt-1", 3, 3))
    assert third["verify_mismatches"] == 0 and third["audit_ok"]
    assert third["hit_tokens"]["storage"] == 128 + 2 * 32
    cache.close()
    fresh.close()
    assert cache.audit().ok and fresh.audit().ok
    assert store.verify().ok  # no half batch left behind by the kill
    store.close()


def test_refused_connections_are_misses_and_failed_writes_then_it_reconnects(own_redis):  # noqa: F811
    store = open_store(own_redis.store_url() + FAST, LAYOUT, create=True)
    hashes, payloads, origins = chain(store.chain_key, 0, 8)
    assert store.put(hashes[:4], payloads[:4], origins[:4]).written == 4
    own_redis.kill()
    out = np.zeros((8, LAYOUT.bytes_per_page), dtype=np.uint8)
    assert store.exists_prefix(hashes) == 0
    assert store.get_into(hashes, list(out)) == 0 and not out.any()
    result = store.put(hashes[4:], payloads[4:], origins[4:])
    assert (result.written, result.existing, result.rejected, result.failed) == (0, 0, 0, 4)
    store.flush()  # a fault keeps the access log, raises nothing
    c = store.counters()
    assert c.read_errors >= 2 and c.write_errors >= 1 and c.pages_rejected == 0  # a failure, not a refusal
    own_redis.restart()
    wait_until_back(store, hashes[:4])
    assert store.put(hashes[4:], payloads[4:], origins[4:]).written == 4
    assert store.get_into(hashes, list(out)) == 8
    assert all(np.array_equal(o, p) for o, p in zip(out, payloads, strict=True))
    assert store.verify().ok
    store.close()


def test_a_hung_server_times_out_into_a_miss(own_redis):  # noqa: F811
    store = open_store(own_redis.store_url() + "&timeout=0.2&backoff_max=0.1", LAYOUT, create=True)
    hashes, payloads, origins = chain(store.chain_key, 0, 4)
    store.put(hashes, payloads, origins)
    os.kill(own_redis.proc.pid, signal.SIGSTOP)
    try:
        out = np.zeros((4, LAYOUT.bytes_per_page), dtype=np.uint8)
        assert store.get_into(hashes, list(out)) == 0
        assert store.put(*chain(store.chain_key, 100, 2)).failed == 2
    finally:
        os.kill(own_redis.proc.pid, signal.SIGCONT)
    assert store.counters().read_errors >= 1 and store.counters().write_errors >= 1
    wait_until_back(store, hashes)
    store.close()


def test_oom_rejects_whole_batches_and_reads_go_on(own_redis):  # noqa: F811
    store = open_store(own_redis.store_url(), LAYOUT, create=True)
    with redis.Redis(port=own_redis.port) as admin:
        used = int(admin.info("memory")["used_memory"])
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", used + 512 * 1024)
    written: list[tuple] = []
    rejected = 0
    for i in range(400):  # 400 batches of 16 pages of 64 bytes + records: well past 512 KiB
        hashes, payloads, origins = chain(store.chain_key, 10_000 * (i + 1), 16)
        result = store.put(hashes, payloads, origins)
        assert result.written in (0, 16)  # a batch is stored whole or not at all
        if result.rejected:
            assert result.rejected == 16
            rejected += 1
        else:
            written.append((hashes, payloads))
    assert written and rejected
    assert store.counters().pages_rejected == 16 * rejected
    hashes, payloads = written[0]
    out = np.zeros((16, LAYOUT.bytes_per_page), dtype=np.uint8)
    assert store.get_into(hashes, list(out)) == 16
    assert store.verify().ok
    record = store.namespaces()[0]
    assert record.pages == 16 * len(written)
    store.close()


def test_key_prefixes_keep_deployments_apart(redis_server):  # noqa: F811
    a = open_store(redis_server.store_url("kvc-a:"), LAYOUT, create=True)
    b = open_store(redis_server.store_url("kvc-b:"), LAYOUT, create=True)
    hashes, payloads, origins = chain(a.chain_key, 0, 4)
    assert a.put(hashes, payloads, origins).written == 4
    assert b.exists_prefix(hashes) == 0 and b.namespaces() == []
    b_hashes, b_payloads, b_origins = chain(b.chain_key, 0, 4)  # each store keys its own chain roots
    assert not set(b_hashes) & set(hashes)
    assert b.put(b_hashes, b_payloads, b_origins).written == 4  # its own copy, counted in its own registry
    assert a.delete_namespace(NS.id).pages == 4
    assert b.exists_prefix(b_hashes) == 4 and a.exists_prefix(hashes) == 0
    assert a.verify().ok and b.verify().ok
    a.close()
    b.close()


WRITER = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
from factories import make_layout
from kvcache.types.keys import pack_tokens
from kvcache.types.namespace import Namespace
from kvcache.storage.api import page_origins
from kvcache.storage.registry import open_store
layout = make_layout(4)
store = open_store({url!r}, layout, create=True, add_layout=True)
for round_ in range(3):
    for k in range(20):
        ns = Namespace("t%d" % (k % 3), "s")
        hashes, origins = page_origins(layout, pack_tokens(range(1000 * k, 1000 * k + 4 * (8 + k))), ns, store.chain_key)
        store.put(hashes, [np.full(layout.bytes_per_page, len(h) + k, dtype=np.uint8) for h in hashes], origins)
c = store.counters()
assert c.write_errors == 0 and c.pages_rejected == 0, c
store.close()
"""


def test_concurrent_writers_on_several_processes_keep_registry_exact(redis_server):  # noqa: F811
    url = redis_server.store_url()
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = WRITER.format(tests=tests, url=url)
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    with open_store(url, LAYOUT) as store:
        report = store.verify()
        assert report.ok, report.findings
        assert report.pages_checked == sum(8 + k for k in range(20))  # every page once, whoever wrote it first
        assert sum(r.pages for r in store.namespaces()) == report.pages_checked
