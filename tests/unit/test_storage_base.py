"""kvcache.storage.base: the registry, open_store dispatch, page_origins and the value types."""

from __future__ import annotations

import msgspec
import pytest

from kvcache.errors import InvalidInput, NotAStore, StoreError, UnknownBackend
from kvcache.types.keys import RadixKey, hash_root, page_hashes
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace
from kvcache.storage import base
from kvcache.storage.base import (VERIFY_KINDS, L3Store, NamespaceRecord, PageMeta, VerifyFinding, VerifyReport,
                                  backend_class, backends, check_page_hashes, open_store, page_origins, scheme_of)
from kvcache.storage.lmdb.store import LMDBStore

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
    assert backends()["lmdb"].group == base.ENTRY_POINT_GROUP
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
        hashes, origins = page_origins(LAYOUT, b"\x01\x00\x00\x00" * 4, Namespace("t"))
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


def test_page_origins_match_the_key_chain():
    ns = Namespace("tenant", "salt")
    key = RadixKey.of(list(range(18)), ns)  # 4 whole pages and a partial tail
    hashes, origins = page_origins(LAYOUT, key.data, ns)
    assert hashes == page_hashes(LAYOUT.layout_id, key, LAYOUT.page_size)
    assert len(origins) == 4
    assert origins[0].parent == hash_root(LAYOUT.layout_id, ns)
    assert [o.parent for o in origins[1:]] == hashes[:-1]
    assert b"".join(o.tokens for o in origins) == key.page_aligned(4).data
    assert all(o.namespace == ns for o in origins)


def test_page_origins_continue_a_chain_from_a_parent():
    ns = Namespace("tenant")
    key = RadixKey.of(list(range(16)), ns)
    hashes, _ = page_origins(LAYOUT, key.data, ns)
    tail, origins = page_origins(LAYOUT, key.data[32:], ns, parent=hashes[1])
    assert tail == hashes[2:]
    assert origins[0].parent == hashes[1]


def test_check_page_hashes_rejects_anything_but_16_bytes():
    check_page_hashes([bytes(16), b"x" * 16])
    for bad in (b"short", bytes(17), "0" * 16, None):
        with pytest.raises(InvalidInput):
            check_page_hashes([bytes(16), bad])


def test_value_types_round_trip_through_msgpack_and_json():
    meta = PageMeta(bytes(16), bytes(16), bytes(16), b"\x00" * 16, 1024, 2**64 - 1, 1.5, 2.5, 3)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(meta), type=PageMeta) == meta
    record = NamespaceRecord("ab" * 16, "tenant", "f00dfeed0001", 3, 3072, 1.0, 2.0, 7, ["cd" * 16])
    assert msgspec.json.decode(msgspec.json.encode(record), type=NamespaceRecord) == record
    report = VerifyReport(False, 1, 1024, [VerifyFinding("checksum_mismatch", "ab" * 16, "bad")])
    as_json = msgspec.json.decode(msgspec.json.encode(report))
    assert as_json["findings"][0]["kind"] == "checksum_mismatch"


def test_verify_kinds_are_documented():
    assert all(isinstance(k, str) and v for k, v in VERIFY_KINDS.items())
    assert {"checksum_mismatch", "missing_meta", "counter_mismatch"} <= set(VERIFY_KINDS)
