"""What the engine checks (`make engine-check`: tests/engine/test_engine_check*.py) share: the kvc CLI on a store,
one stored page's byte flipped in place (LMDB or Redis), a redis-server of a test's own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from redis_server import RedisServer, require_server

PROCESS_TIMEOUT_S = 600  # a hung engine thread fails the check instead of hanging it


def kvc(store: str, *args: str) -> subprocess.CompletedProcess:
    """The kvc CLI on `store` (in KVC_PYTHON, kvc's own venv, when set)."""
    python = os.environ.get("KVC_PYTHON") or sys.executable
    env = dict(os.environ, KVC_STORE=store)
    return subprocess.run([python, "-m", "kvc", *args], env=env, capture_output=True, text=True,
                          timeout=PROCESS_TIMEOUT_S)


def flip_one_page(store: str, needle: bytes) -> int:
    """Flip one byte inside the stored page holding `needle` (bytes only that page has); the copies flipped."""
    if store.startswith("redis"):
        return _flip_redis(store, needle)
    data = Path(store) / "data.mdb"
    raw = bytearray(data.read_bytes())
    # Every copy: LMDB's copy-on-write can leave stale copies of a page on free pages; one of them is live.
    at, flipped = raw.find(needle), 0
    while at >= 0:
        raw[at + len(needle) // 2] ^= 0x5A
        flipped += 1
        at = raw.find(needle, at + 1)
    data.write_bytes(bytes(raw))
    return flipped


def _flip_redis(store: str, needle: bytes) -> int:
    from urllib.parse import parse_qs, urlsplit

    import redis

    parts = urlsplit(store)
    prefix = parse_qs(parts.query)["prefix"][0]
    flipped = 0
    with redis.Redis(host=parts.hostname, port=parts.port) as client:
        for key in client.scan_iter(match=prefix + "*", count=1000):
            if client.type(key) != b"hash":
                continue
            for field, value in client.hgetall(key).items():
                at = value.find(needle)
                if at >= 0:
                    damaged = bytearray(value)
                    damaged[at + len(needle) // 2] ^= 0x5A
                    client.hset(key, field, bytes(damaged))
                    flipped += 1
    return flipped


@pytest.fixture
def redis_store(tmp_path):
    """A redis-server of the test's own on loopback: its store URL."""
    server = RedisServer(require_server(), tmp_path / "redis").start()
    try:
        yield server.store_url()
    finally:
        server.stop()
