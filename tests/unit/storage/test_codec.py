"""kvcache.storage.codec: the stored page value, checksums, the format record, the chain check."""

from __future__ import annotations

import msgspec
import pytest

from kvcache.storage.api import PageMeta, page_origins
from kvcache.storage.codec import (
    CHECKSUMS,
    HEADER,
    StoreFormat,
    chains_to,
    decode_format,
    decode_or_none,
    stored_checksum,
)
from kvcache.types.keys import pack_tokens
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace

LAYOUT = KVLayout("codec-model", layers=1, kv_heads=1, head_dim=8, dtype="float16", page_size=4)
HASHES, ORIGINS = page_origins(LAYOUT, pack_tokens(range(8)), Namespace("t", "s"), b"c" * 32)


def value_of(algo, page_hash: bytes, payload: bytes) -> bytes:
    return algo.of(payload, page_hash).to_bytes(HEADER, "little") + payload


@pytest.mark.parametrize("name", sorted(CHECKSUMS))
def test_a_page_value_is_sound_only_with_its_bytes_under_its_hash(name):
    algo, payload = CHECKSUMS[name], bytes(range(64))
    value = value_of(algo, HASHES[0], payload)
    assert algo.sound(value, HASHES[0]) and stored_checksum(value) == algo.of(payload, HASHES[0])
    flipped = bytearray(value)
    flipped[HEADER + 10] ^= 1
    assert not algo.sound(bytes(flipped), HASHES[0])
    assert not algo.sound(value, HASHES[1])  # the same bytes filed under another page hash
    assert not algo.sound(value[:HEADER - 1], HASHES[0])  # not even a checksum


def test_the_seeds_of_a_batch_are_the_ones_of_each_hash():
    for algo in CHECKSUMS.values():
        assert algo.seeds(HASHES) == [int.from_bytes(h[:algo.seed_bytes], "little") for h in HASHES]


def test_a_format_record_without_a_fingerprint_key_encodes_as_before_it_existed():
    # LMDB stores keep their key in a file: their record must stay the four fields older kvc versions wrote.
    fmt = StoreFormat("kvc-store", 1, "crc32", 12.5)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(fmt)) == {"magic": "kvc-store", "version": 1,
                                                                   "checksum": "crc32", "created": 12.5}
    keyed = msgspec.structs.replace(fmt, fingerprint_key="ab" * 16)
    assert decode_format(msgspec.msgpack.encode(keyed)) == keyed


def test_a_damaged_record_decodes_to_none():
    assert decode_or_none(decode_format, b"\xc1 not msgpack") is None
    assert decode_or_none(decode_format, msgspec.msgpack.encode({"magic": 3})) is None


def test_a_page_hash_chains_from_its_parent_and_tokens_only():
    o = ORIGINS[1]
    meta = PageMeta(o.namespace.id, LAYOUT.layout_id, o.parent, o.tokens, LAYOUT.bytes_per_page, 0, 0.0, 0.0, 0)
    assert chains_to(HASHES[1], meta)
    assert not chains_to(HASHES[0], meta)
    assert not chains_to(HASHES[1], msgspec.structs.replace(meta, tokens=o.tokens[:-4]))
    assert not chains_to(HASHES[1], msgspec.structs.replace(meta, tokens=b""))


# --- segments, engine pages ------------------------------------------------------------------------------------

from kvcache.storage.codec import engine_keyed  # noqa: E402
from kvcache.types.keys import engine_page_hash, hash_root  # noqa: E402


@pytest.mark.parametrize("name", sorted(CHECKSUMS))
def test_the_checksum_of_parts_is_the_checksum_of_their_concatenation(name):
    algo, payload = CHECKSUMS[name], bytes(range(256)) * 4
    whole = algo.of(payload, HASHES[0])
    cuts = [payload[:1], payload[1:300], b"", memoryview(payload)[300:1000], bytearray(payload[1000:])]
    assert algo.of_parts(cuts, HASHES[0]) == whole
    assert algo.of_parts([payload], HASHES[0]) == whole
    assert algo.of_parts(cuts[::-1], HASHES[0]) != whole  # the order is part of it
    assert algo.of_parts(cuts, HASHES[1]) != whole  # so is the page hash


ROOT = hash_root(LAYOUT.layout_id, Namespace("sglang"), b"c" * 32)
ENGINE_KEY = bytes(range(32))
ENGINE_HASH = engine_page_hash(ROOT, ENGINE_KEY)
ENGINE_META = PageMeta(Namespace("sglang").id, LAYOUT.layout_id, ROOT, b"", LAYOUT.bytes_per_page, 0, 0.0, 0.0, 0,
                       ENGINE_KEY)


def test_an_engine_page_is_keyed_to_its_root_and_never_chains():
    assert engine_keyed(ENGINE_HASH, ENGINE_META, [ROOT])
    assert engine_keyed(ENGINE_HASH, ENGINE_META, [bytes(16), ROOT])  # one of its namespace's recorded roots
    assert not engine_keyed(ENGINE_HASH, ENGINE_META, [bytes(16)])
    assert not engine_keyed(ENGINE_HASH, ENGINE_META, [])
    assert not engine_keyed(HASHES[0], ENGINE_META, [ROOT])
    assert not chains_to(ENGINE_HASH, ENGINE_META)  # no tokens: its hash is no chain step
    for damaged in (dict(key=b""), dict(key=bytes(65)), dict(tokens=pack_tokens(range(4)))):
        assert not engine_keyed(ENGINE_HASH, msgspec.structs.replace(ENGINE_META, **damaged), [ROOT])


def test_page_metadata_written_before_engine_keys_decodes_unchanged():
    o = ORIGINS[0]
    fields = [o.namespace.id, LAYOUT.layout_id, o.parent, o.tokens, LAYOUT.bytes_per_page, 7, 1.0, 2.0, 3]
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(fields), type=PageMeta)  # the record of an older kvc
    assert old.key == b"" and old.tokens == o.tokens and chains_to(HASHES[0], old)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(ENGINE_META), type=PageMeta) == ENGINE_META
    # ... and an older kvc, whose PageMeta ends at `hits`, reads an engine page's record (the key is extra)

    class OldMeta(msgspec.Struct, array_like=True):
        ns_id: bytes
        layout_id: bytes
        parent: bytes
        tokens: bytes
        nbytes: int
        checksum: int
        created: float
        last_access: float
        hits: int

    assert msgspec.msgpack.decode(msgspec.msgpack.encode(ENGINE_META), type=OldMeta).nbytes == LAYOUT.bytes_per_page
