"""Fixtures of the L3 conformance suite: one `StoreFactory` per registered backend.

Every backend registered in the entry-point group `kvcache.storage` runs the whole suite. A new backend adds
one factory to FACTORIES (where its stores live for a test, how to open one, how to damage one page's bytes in
place, how to make one unwritable under an open handle); a registered backend without a factory fails the suite
rather than skip it silently.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from kvcache.storage.api import L3Store
from kvcache.storage.registry import backends, open_store
from kvcache.types.layout import KVLayout
from redis_server import redis_cluster, redis_server  # noqa: F401  (session fixtures of the redis factories)

LAYOUT = KVLayout("conformance-model@r1", layers=2, kv_heads=2, head_dim=16, dtype="float16", page_size=4)
# Same geometry, another model revision: same page size in bytes, so only the layout id keeps them apart.
OTHER_LAYOUT = KVLayout("conformance-model@r2", layers=2, kv_heads=2, head_dim=16, dtype="float16", page_size=4)


class StoreFactory(msgspec.Struct, frozen=True):
    """How the suite makes, opens and damages stores of one backend."""

    backend: str
    location: Callable[[Path], str]  # a fresh, empty store location for one test
    open: Callable[..., L3Store]  # open(location, layout, **options) -> a store, created if missing
    corrupt: Callable[[str, bytes], None]  # corrupt(location, payload): flip a byte of a stored payload in place
    # outage(tmp) -> a context yielding (location, cut): a store location of its own, and what makes it unwritable
    # under a handle already open on it (a server killed; a full disk). Undone when the context ends.
    outage: Callable[[Path], contextlib.AbstractContextManager[tuple[str, Callable[[], None]]]]


def _lmdb_corrupt(location: str, payload: bytes) -> None:
    # Every copy: copy-on-write can leave stale copies of a value on free pages, and only one copy is live.
    data_file = os.path.join(location, "data.mdb")
    with open(data_file, "r+b") as f:
        raw = f.read()
        at = raw.find(payload)
        assert at >= 0, "payload not found in data.mdb"
        while at >= 0:
            f.seek(at + len(payload) // 2)
            f.write(bytes([raw[at + len(payload) // 2] ^ 0x5A]))
            at = raw.find(payload, at + 1)


def _redis_corrupt(location: str, payload: bytes) -> None:
    # The page record's `d` field is an 8-byte checksum + the payload: flip a payload byte in place.
    from urllib.parse import parse_qs, urlsplit

    import redis

    parts = urlsplit(location)
    prefix = parse_qs(parts.query)["prefix"][0]
    hits = 0
    with redis.Redis(host=parts.hostname, port=parts.port) as client:
        for key in client.scan_iter(match=prefix + "p:*", count=1000):
            value = client.hget(key, "d")
            at = value.find(payload) if value is not None else -1
            if at >= 0:
                flipped = bytearray(value)
                flipped[at + len(payload) // 2] ^= 0x5A
                client.hset(key, "d", bytes(flipped))
                hits += 1
    assert hits, "payload not found under the store's prefix"


@contextlib.contextmanager
def _lmdb_outage(tmp: Path) -> Iterator[tuple[str, Callable[[], None]]]:
    """The file system refuses to let the data file grow (RLIMIT_FSIZE at its size: a full disk, for this process
    only): LMDB's commit fails with EFBIG. SIGXFSZ, which would kill the process, is ignored meanwhile."""
    location = str(tmp / "store")
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.getsignal(signal.SIGXFSZ)

    def cut() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(os.path.join(location, "data.mdb")), limits[1]))

    try:
        yield location, cut
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)


def _redis_outage(cluster: bool) -> Callable[[Path], contextlib.AbstractContextManager[tuple[str, Callable[[], None]]]]:
    """A server of the test's own, killed (SIGKILL, as a crash) by `cut`; the handle's timeouts short, so that it
    notices at once."""

    @contextlib.contextmanager
    def outage(tmp: Path) -> Iterator[tuple[str, Callable[[], None]]]:
        from redis_server import RedisServer, require_server

        server = RedisServer(require_server(), tmp / "redis-outage", cluster=cluster).start()
        try:
            yield server.store_url() + "&timeout=0.5&connect_timeout=0.5&backoff_max=0.2", server.kill
        finally:
            server.stop()

    return outage


def _redis_location(cluster: bool) -> Callable[[Path], str]:
    from redis_server import shared_server

    return lambda tmp: shared_server(tmp, cluster=cluster).store_url()


def _open_created(location: str, layout: KVLayout, **kw) -> L3Store:
    return open_store(location, layout, create=True, add_layout=True, **kw)


FACTORIES: dict[str, StoreFactory] = {
    "lmdb": StoreFactory(
        backend="lmdb",
        location=lambda tmp: str(tmp / "store"),
        open=_open_created,
        corrupt=_lmdb_corrupt,
        outage=_lmdb_outage,
    ),
    # A real redis-server on 127.0.0.1 (tests/redis_server.py), one key prefix per test.
    "redis": StoreFactory(backend="redis", location=_redis_location(False), open=_open_created,
                          corrupt=_redis_corrupt, outage=_redis_outage(False)),
    # The cluster code path (one-key scripts, per-slot pipelines) on a one-node Redis Cluster.
    "redis+cluster": StoreFactory(backend="redis+cluster", location=_redis_location(True), open=_open_created,
                                  corrupt=_redis_corrupt, outage=_redis_outage(True)),
}
# Schemes that open the same backend as another one over TLS: the suite runs over the plain scheme.
ALIASES = {"rediss": "redis", "rediss+cluster": "redis+cluster"}
# Backends whose factory needs a server: the fixture (tests/redis_server.py) that provides it.
SERVERS = {"redis": "redis_server", "redis+cluster": "redis_cluster"}


@pytest.fixture(params=sorted({ALIASES.get(name, name) for name in backends()}))
def factory(request: pytest.FixtureRequest) -> StoreFactory:
    """The factory of each registered backend in turn."""
    name = request.param
    if name not in FACTORIES:
        pytest.fail(f"backend {name!r} is registered in kvcache.storage but has no conformance factory")
    if name in SERVERS:
        request.getfixturevalue(SERVERS[name])  # skips locally / fails under CI=true without redis-server
    return FACTORIES[name]


@pytest.fixture
def location(factory: StoreFactory, tmp_path: Path) -> str:
    """A fresh store location of the backend under test."""
    return factory.location(tmp_path)


@pytest.fixture
def layout() -> KVLayout:
    """The layout stores of the suite are opened with."""
    return LAYOUT


@pytest.fixture
def other_layout() -> KVLayout:
    """A second layout with the same page size in bytes and another model revision."""
    return OTHER_LAYOUT


@pytest.fixture
def store(factory: StoreFactory, location: str):
    """A fresh store with LAYOUT, closed after the test."""
    s = factory.open(location, LAYOUT)
    yield s
    s.close()
