"""kvcache.storage.api: page_origins and the store's values and records."""

from __future__ import annotations

import msgspec

from kvcache.storage.api import VERIFY_KINDS, NamespaceRecord, PageMeta, VerifyFinding, VerifyReport, page_origins
from kvcache.types.keys import RadixKey, hash_root, page_hashes
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace

LAYOUT = KVLayout("unit-model@r1", layers=1, kv_heads=1, head_dim=8, dtype="float16", page_size=4)
KEY = b"c" * 32  # a chain key


def test_page_origins_match_the_key_chain():
    ns = Namespace("tenant", "salt")
    key = RadixKey.of(list(range(18)), ns)  # 4 whole pages and a partial tail
    hashes, origins = page_origins(LAYOUT, key.data, ns, KEY)
    assert hashes == page_hashes(LAYOUT.layout_id, key, LAYOUT.page_size, KEY)
    assert len(origins) == 4
    assert origins[0].parent == hash_root(LAYOUT.layout_id, ns, KEY)
    assert [o.parent for o in origins[1:]] == hashes[:-1]
    assert b"".join(o.tokens for o in origins) == key.page_aligned(4).data
    assert all(o.namespace == ns for o in origins)


def test_page_origins_continue_a_chain_from_a_parent():
    ns = Namespace("tenant")
    key = RadixKey.of(list(range(16)), ns)
    hashes, _ = page_origins(LAYOUT, key.data, ns, KEY)
    tail, origins = page_origins(LAYOUT, key.data[32:], ns, KEY, parent=hashes[1])
    assert tail == hashes[2:]
    assert origins[0].parent == hashes[1]


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


# --- engine-keyed pages ----------------------------------------------------------------------------------------

from kvcache.storage.api import ChildInfo, PageOutcome, PutResult, engine_hashes, engine_origins  # noqa: E402
from kvcache.types.keys import engine_page_hash  # noqa: E402


def test_engine_origins_chain_the_keys_and_hash_each_under_the_root():
    ns = Namespace("sglang")
    keys = [bytes([i]) * 32 for i in range(4)]
    root = hash_root(LAYOUT.layout_id, ns, KEY)
    hashes, origins = engine_origins(LAYOUT, ns, KEY, keys)
    assert hashes == [engine_page_hash(root, k) for k in keys] == engine_hashes(LAYOUT, ns, KEY, keys)
    assert [o.parent for o in origins] == [root, *hashes[:-1]]
    assert [o.key for o in origins] == keys and all(o.tokens == b"" and o.namespace == ns for o in origins)
    tail, tail_origins = engine_origins(LAYOUT, ns, KEY, keys[2:], parent_key=keys[1])
    assert tail == hashes[2:] and tail_origins[0].parent == hashes[1]
    assert engine_origins(LAYOUT, ns, KEY, []) == ([], [])


def test_a_put_result_names_each_pages_outcome_in_one_byte():
    assert [int(o) for o in PageOutcome] == [0, 1, 2, 3]  # WRITTEN, EXISTING, REJECTED, FAILED: one byte each
    assert PutResult(0, 0, 0, 0, 0).outcomes == b""
    outcomes = bytes([PageOutcome.WRITTEN, PageOutcome.REJECTED, PageOutcome.EXISTING])
    result = PutResult(1, 1, 1, 0, 1024, outcomes=outcomes)
    assert [o != PageOutcome.REJECTED for o in result.outcomes] == [True, False, True]  # SGLang's bool per page
    assert msgspec.json.decode(msgspec.json.encode(result), type=PutResult) == result
    assert ChildInfo(bytes(16), b"", 1024, 0, 0.0).key == b""
