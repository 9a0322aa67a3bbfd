"""Redis losing its data under a running writer (issue 14, item 4): a server restarted without persistence in the
middle of a workload. The writer must find the format record gone, stop writing (nothing lands under a prefix
that is no store), count it and say so in one line; after `kvc init`, writes resume, and `kvc audit --repair`
converges in one pass even with orphaned tails written by a writer that still believed its parents stored."""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import pytest

import faultkit
from factories import l3_cache, make_layout
from kvcache.errors import InvalidInput
from kvcache.storage.api import page_origins
from kvcache.storage.registry import open_store
from kvcache.types.keys import pack_tokens
from kvcache.types.namespace import Namespace
from redis_node import PAGE_SIZE, requests, serve
from redis_server import RedisServer, require_server

LAYOUT = make_layout(PAGE_SIZE)
FAST = "&timeout=0.5&connect_timeout=0.5&backoff_max=0.2"


def _keys(server: RedisServer, prefix: str) -> int:
    import redis

    with redis.Redis(host="127.0.0.1", port=server.port) as c:
        return sum(1 for _ in c.scan_iter(match=prefix + "*", count=1000))


def _tails(store, ns: Namespace, first: int, pages: int, skip: int):
    """Put only the pages of a chain past `skip`: what a writer does that believes the first ones stored."""
    hashes, origins = page_origins(LAYOUT, pack_tokens(range(first, first + pages * PAGE_SIZE)), ns, store.chain_key)
    payloads = [np.full(LAYOUT.bytes_per_page, 7, np.uint8)] * len(hashes)
    return store.put(hashes[skip:], payloads[skip:], origins[skip:])


def test_a_writer_stops_when_redis_loses_its_data_and_repair_converges_in_one_pass(tmp_path, caplog):
    trials = faultkit.trials(1)
    survived = lost_keys = 0
    for trial in range(trials):
        server = RedisServer(require_server(), tmp_path / f"redis{trial}").start()  # no persistence
        prefix = f"kvcf{trial}:"
        url = server.store_url(prefix) + FAST
        try:
            store = open_store(url, LAYOUT, create=True)
            cache = l3_cache(store, page_size=PAGE_SIZE, device_tokens=1024, host_tokens=2048, io_thread=True,
                             prefetch_policy="wait_complete")
            first = serve(cache, requests("t1", "salt-1", 1, 4))
            assert first["storage_pages_written"] > 0

            def lose(i: int, server: RedisServer = server) -> None:
                if i == 2:
                    server.restart()  # empty: the format record, the registry and every page are gone
                    time.sleep(0.3)

            with caplog.at_level(logging.WARNING, logger="kvcache_redis"):
                after_loss = serve(cache, requests("t1", "salt-1", 2, 12, docs_from=3), before=lose)
                for k in range(3):
                    _tails(store, Namespace("t1", "salt-1"), 90_000 + 1000 * k, 8, 4)
            assert after_loss["verify_mismatches"] == 0 and cache.audit().ok
            written_after_loss = _keys(server, prefix)
            lines = [r for r in caplog.records if "format record" in r.getMessage()]
            counted = store.counters().format_lost
            # `kvc init` makes the store again; writers resume, and a tail of a chain the loss took is refused
            # (put takes no page whose parent is not stored): no orphan enters the new store
            init = faultkit.kvc("init", "--store", server.store_url(prefix), "--model", LAYOUT.model,
                                "--page-size", PAGE_SIZE, "--layers", LAYOUT.layers, "--kv-heads", LAYOUT.kv_heads,
                                "--head-dim", LAYOUT.head_dim, "--dtype", LAYOUT.dtype)
            assert init.returncode == 0, init.stderr
            for k in range(3):
                with pytest.raises(InvalidInput, match="parent"):
                    _tails(store, Namespace("t1", "salt-1"), 90_000 + 1000 * k, 8, 4)
            serve(cache, requests("t1", "salt-1", 20, 4, docs_from=6))  # writers go on after the init
            cache.close()
            store.close()
            repair = faultkit.kvc("audit", "--store", server.store_url(prefix), "--repair", "--json")
            doc = json.loads(repair.stdout)
            ok = (written_after_loss == 0 and counted > 0 and len(lines) == 1 and repair.returncode in (0, 1)
                  and doc["remaining"] == [])
            survived += ok
            lost_keys += written_after_loss
            assert ok, (written_after_loss, counted, [r.getMessage() for r in lines], repair.returncode,
                        repair.stderr, doc.get("violations"))
            assert faultkit.kvc("audit", "--store", server.store_url(prefix)).returncode == 0
        finally:
            server.stop()
        caplog.clear()
    faultkit.record("Redis restarted empty under a running writer", trials, survived, lost_keys,
                    "keys written under the prefix while the store was gone; one `--repair` pass converged")
