"""Two serving nodes share one Redis L3 (DESIGN §6, issue 8): each is its own process with its own TieredCache
(own L1 and L2). Node A serves tenant t1 and backs its pages up; node B then serves t1's requests and hits A's
pages through prefetch, every reused byte checked; tenant t2 on node B, with the same tokens, sees none of them.

Each node is forked from a server that imported kvc, torch and the Redis backend once, under PYTHONHASHSEED=0
(`forkrun`): a process of its own, without a Python start and those imports each."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import forkrun
from factories import make_layout
from kvcache import Namespace
from kvcache.storage.registry import open_store
from redis_server import redis_server  # noqa: F401  (session fixture)

NODE = str(Path(__file__).resolve().parents[1] / "redis_node.py")


ENV = {**os.environ, "PYTHONHASHSEED": "0"}


@pytest.fixture(scope="module")
def node_forks():
    """A server that imported what a node imports, started as a node would be (PYTHONHASHSEED=0), to fork the
    nodes from."""
    server = forkrun.Forks((*forkrun.ENGINE_MODULES, "kvcache_redis.*"), env=ENV)
    yield server
    server.close()


def run_node(forks: forkrun.Forks, url: str, *jobs: str) -> dict:
    """Run one node process to completion; its JSON result."""
    proc = forks.run([url, *jobs], script_file=NODE, env=ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_node_b_hits_node_a_pages_per_namespace(redis_server, node_forks):  # noqa: F811
    url = redis_server.store_url()
    a = run_node(node_forks, url, "t1:salt-1:1:6")
    assert a["audit_ok"] and a["store"] == {"read_errors": 0, "write_errors": 0, "checksum_failures": 0}
    (ja,) = a["jobs"]
    assert ja["verify_mismatches"] == 0 and ja["refused"] == 0
    assert ja["hit_tokens"]["storage"] == 0 and ja["storage_pages_written"] > 0

    # Node B: t1 with other questions on the same system prompt and documents, then t2 with t1's exact tokens.
    b = run_node(node_forks, url, "t1:salt-1:2:6", "t2:salt-2:1:6")
    assert b["audit_ok"] and b["store"] == {"read_errors": 0, "write_errors": 0, "checksum_failures": 0}
    t1, t2 = b["jobs"]
    assert t1["verify_mismatches"] == 0 and t2["verify_mismatches"] == 0
    # B's first request finds nothing in its own L1/L2: system prompt + document 0 (128 tokens) come from A's
    # pages in L3; the next two documents (32 tokens each) too, after a system prompt B now holds itself.
    assert t1["hit_tokens"]["storage"] == 128 + 2 * 32
    assert t2["hit_tokens"]["storage"] == 0  # the same tokens in another namespace: nothing of t1 is reachable

    with open_store(url, make_layout(4), readonly=True) as store:
        assert store.verify().ok
        records = {r.extra_key: r for r in store.namespaces()}
        assert set(records) == {"t1", "t2"}
        assert records["t1"].hits == 32 + 2 * 8  # the pages B's prefetches read, in the shared registry
        ns1 = Namespace("t1", "salt-1")
        assert records["t1"].salt_fingerprint == ns1.fingerprint(store.fingerprint_key)  # the store's key
        assert "salt-1" not in repr(records)
