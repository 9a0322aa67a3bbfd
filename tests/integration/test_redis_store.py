"""The Redis backend's own rules, beyond the conformance suite: URLs and options, opening, read-only handles."""

from __future__ import annotations

import numpy as np
import pytest

from factories import make_layout
from kvcache.errors import InvalidInput, NotAStore, StoreError, StoreReadOnly, StoreUnsupported
from kvcache.storage.api import CapacityPolicy, L3Store, page_origins
from kvcache.storage.registry import open_store
from kvcache.types.keys import pack_tokens
from kvcache.types.namespace import Namespace
from kvcache_redis.store import RedisStore
from kvcache_redis.url import parse_url
from redis_server import free_port, redis_cluster, redis_server  # noqa: F401  (fixtures)

LAYOUT = make_layout(4)
NS = Namespace("t1", "s1")


def test_url_forms_options_and_password_redaction():
    u = parse_url("redis://:s3cret@db.example:6380/2?prefix=prod:&timeout=0.5&health_check_interval=10", {})
    assert (u.cluster, u.options.prefix, u.options.timeout) == (False, "prod:", 0.5)
    assert u.client_url == "redis://:s3cret@db.example:6380/2?health_check_interval=10"  # kvc's options removed
    assert "s3cret" not in u.shown and ":***@" in u.shown
    c = parse_url("rediss+cluster://node1:7000?prefix=x:", {"prefix": "y:"})
    assert (c.cluster, c.options.prefix, c.client_url) == (True, "y:", "rediss://node1:7000")
    for bad in ("redis+cluster://h:1/3", "memcached://h:1", "redis://h:1?timeout=-1", "redis://h:1?prefix="):
        with pytest.raises(InvalidInput):
            parse_url(bad, {})


def test_opening_rules(redis_server):  # noqa: F811
    url = redis_server.store_url()
    with pytest.raises(NotAStore):
        open_store(url, LAYOUT)  # nothing under this prefix and no create
    with pytest.raises(StoreUnsupported):
        open_store(url, LAYOUT, create=True, capacity=CapacityPolicy(capacity_bytes=1 << 20))
    store = open_store(url, LAYOUT, create=True)
    assert isinstance(store, RedisStore) and isinstance(store, L3Store)
    hashes, origins = page_origins(LAYOUT, pack_tokens(range(8)), NS, store.chain_key)
    store.put(hashes, [np.ones(LAYOUT.bytes_per_page, np.uint8)] * 2, origins)
    store.close()
    ro = open_store(url, readonly=True)
    assert ro.exists_prefix(hashes) == 2 and ro.layouts() == [LAYOUT]
    with pytest.raises(StoreReadOnly):
        ro.delete_namespace(NS.id)
    ro.close()
    with pytest.raises(StoreError):
        open_store(f"redis://127.0.0.1:{free_port()}/0?connect_timeout=0.2", LAYOUT, create=True)


def test_cluster_store_reads_what_a_standalone_writer_would_and_verifies(redis_cluster):  # noqa: F811
    store = open_store(redis_cluster.store_url(), LAYOUT, create=True)
    assert store.cluster
    hashes, origins = page_origins(LAYOUT, pack_tokens(range(64)), NS, store.chain_key)
    pages = [np.full(LAYOUT.bytes_per_page, i, np.uint8) for i in range(len(hashes))]
    assert store.put(hashes, pages, origins).written == 16
    out = np.zeros((16, LAYOUT.bytes_per_page), np.uint8)
    assert store.get_into(hashes, list(out)) == 16
    assert all(np.array_equal(o, p) for o, p in zip(out, pages, strict=True))
    assert store.delete_namespace(NS.id).pages == 16
    assert store.verify().ok and store.namespaces() == []
    store.close()


def test_the_chain_key_lives_in_the_format_record_and_a_format_1_store_is_refused(redis_server):  # noqa: F811
    """A Redis store keeps its chain key, a random secret, in its format record (issue 26); a store of format 1
    (unkeyed chain roots, written before) is refused in one line: kvc migrate rewrites LMDB stores only."""
    import msgspec
    import redis

    from kvcache.storage.codec import FORMAT_VERSION, decode_format, encoder

    client = redis.Redis(host="127.0.0.1", port=redis_server.port, db=0)
    url = redis_server.store_url()
    store = open_store(url, LAYOUT, create=True)
    prefix = store.prefix
    store.close()
    raw = client.get(prefix.encode() + b"format")
    fmt = decode_format(raw)
    assert fmt.version == FORMAT_VERSION and len(bytes.fromhex(fmt.chain_key)) == 32
    assert bytes.fromhex(fmt.chain_key) != bytes.fromhex(fmt.fingerprint_key)
    with open_store(url, LAYOUT) as again:
        assert again.chain_key == bytes.fromhex(fmt.chain_key)
    old = msgspec.structs.replace(fmt, version=1, chain_key="")
    client.set(prefix.encode() + b"format", encoder.encode(old))
    with pytest.raises(StoreUnsupported) as info:
        open_store(url, LAYOUT)
    message = str(info.value)
    assert "\n" not in message and "format 1" in message and "kvc migrate" in message and prefix in message
    client.close()
