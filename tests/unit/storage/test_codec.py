"""kvcache.storage.codec: the stored page value, checksums, the format record, the chain check."""

from __future__ import annotations

import msgspec
import pytest

from kvcache.types.keys import pack_tokens
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace
from kvcache.storage.api import PageMeta, page_origins
from kvcache.storage.codec import (CHECKSUMS, HEADER, StoreFormat, chains_to, decode_format, decode_or_none,
                                   stored_checksum)

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
