"""Fixtures of the L3 conformance suite: one `StoreFactory` per registered backend.

Every backend registered in the entry-point group `kvcache.storage` runs the whole suite. A new backend adds
one factory to FACTORIES (where its stores live for a test, how to open one, how to damage one page's bytes in
place); a registered backend without a factory fails the suite rather than skip it silently.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from kvcache.layout import KVLayout
from kvcache.storage.base import L3Store, backends, open_store

LAYOUT = KVLayout("conformance-model@r1", layers=2, kv_heads=2, head_dim=16, dtype="float16", page_size=4)
# Same geometry, another model revision: same page size in bytes, so only the layout id keeps them apart.
OTHER_LAYOUT = KVLayout("conformance-model@r2", layers=2, kv_heads=2, head_dim=16, dtype="float16", page_size=4)


class StoreFactory(msgspec.Struct, frozen=True):
    """How the suite makes, opens and damages stores of one backend."""

    backend: str
    location: Callable[[Path], str]  # a fresh, empty store location for one test
    open: Callable[..., L3Store]  # open(location, layout, **options) -> a store, created if missing
    corrupt: Callable[[str, bytes], None]  # corrupt(location, payload): flip a byte of a stored payload in place


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


FACTORIES: dict[str, StoreFactory] = {
    "lmdb": StoreFactory(
        backend="lmdb",
        location=lambda tmp: str(tmp / "store"),
        open=lambda location, layout, **kw: open_store(location, layout, create=True, add_layout=True, **kw),
        corrupt=_lmdb_corrupt,
    ),
}


@pytest.fixture(params=sorted(backends()))
def factory(request: pytest.FixtureRequest) -> StoreFactory:
    """The factory of each registered backend in turn."""
    name = request.param
    if name not in FACTORIES:
        pytest.fail(f"backend {name!r} is registered in kvcache.storage but has no conformance factory")
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
