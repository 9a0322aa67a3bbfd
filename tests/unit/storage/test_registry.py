"""kvcache.storage.registry: backends found by entry point, scheme_of, open_store dispatch."""

from __future__ import annotations

import pytest

from kvcache.errors import NotAStore, StoreError, UnknownBackend
from kvcache.storage import registry
from kvcache.storage.api import L3Store, page_origins
from kvcache.storage.lmdb.store import LMDBStore
from kvcache.storage.registry import backend_class, backends, open_store, scheme_of
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace

LAYOUT = KVLayout("unit-model@r1", layers=1, kv_heads=1, head_dim=8, dtype="float16", page_size=4)


@pytest.mark.parametrize("location, scheme", [
    ("./kvc-store", "lmdb"),
    ("/var/lib/kvc", "lmdb"),
    ("relative/dir", "lmdb"),
    ("lmdb:///var/lib/kvc", "lmdb"),
    ("redis://localhost:6379/0", "redis"),
    ("Valkey+TLS://h:1", "valkey+tls"),
])
def test_scheme_of(location, scheme):
    assert scheme_of(location) == scheme


def test_lmdb_is_registered_through_the_entry_point_group():
    assert "lmdb" in backends()
    assert backends()["lmdb"].group == registry.ENTRY_POINT_GROUP
    assert backend_class("lmdb") is LMDBStore


def test_unknown_scheme_names_the_registered_ones():
    with pytest.raises(UnknownBackend) as info:
        open_store("nosuch://host/0")
    assert isinstance(info.value, StoreError)
    assert "nosuch" in str(info.value) and "lmdb" in str(info.value)


def test_plain_path_and_lmdb_url_open_the_same_store(tmp_path):
    path = tmp_path / "s"
    with open_store(str(path), LAYOUT, create=True) as first:
        assert isinstance(first, LMDBStore) and isinstance(first, L3Store)
        hashes, origins = page_origins(LAYOUT, b"\x01\x00\x00\x00" * 4, Namespace("t"), first.chain_key)
        first.put(hashes, [bytes(LAYOUT.bytes_per_page)], origins)
    with open_store(f"lmdb://{path}") as second:
        assert second.layout is None
        assert second.exists_prefix(hashes) == 1
        assert second.layouts() == [LAYOUT]


def test_open_store_passes_backend_options_through(tmp_path):
    with open_store(str(tmp_path / "s"), LAYOUT, create=True, map_size=1 << 20) as s:
        assert s.map_size() >= 1 << 20


def test_open_store_without_create_on_a_missing_path(tmp_path):
    with pytest.raises(NotAStore) as info:
        open_store(str(tmp_path / "missing"))
    assert info.value.path.endswith("missing")


def test_maintenance_is_found_through_the_backend_registry(tmp_path):
    from kvcache.storage.lmdb.maintenance import LMDBMaintenance
    from kvcache.storage.registry import maintenance_of

    assert isinstance(maintenance_of(str(tmp_path / "s")), LMDBMaintenance)  # a plain path is LMDB
    assert isinstance(maintenance_of(f"lmdb://{tmp_path}/s"), LMDBMaintenance)
    assert maintenance_of("redis://127.0.0.1:1/0") is None  # keeps its format and key in its format record
    with pytest.raises(UnknownBackend):
        maintenance_of("nosuch://x")


def test_the_cli_reaches_a_backend_only_through_the_registry():
    """`kvc` imports no backend module: what only LMDB can do (migrate, rekey, a page's disk) it asks of the
    backend's maintenance (`maintenance_of`), so a new backend needs no CLI change."""
    import ast
    import pathlib

    cli = pathlib.Path(__file__).resolve().parents[3] / "cli" / "kvc"
    reached = []
    for path in cli.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            reached += [f"{path.name}: {n}" for n in names if n.startswith("kvcache.storage.lmdb")]
    assert reached == []
