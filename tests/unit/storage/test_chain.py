"""kvcache.storage.chain: which key a store's chain roots are under, and the roots an audit checks against."""

from __future__ import annotations

from kvcache.storage.api import NamespaceRecord
from kvcache.storage.chain import ChainRoots, chain_key_of
from kvcache.storage.codec import FORMAT_VERSION, StoreFormat
from kvcache.types.keys import UNKEYED_CHAIN, derive_chain_key, hash_root_of_id

SECRET = bytes(range(32))
LAY, NS = b"l" * 16, b"n" * 16


def test_the_chain_key_of_each_kind_of_store():
    assert chain_key_of(StoreFormat("kvc-store", 1, "crc32", 0.0), SECRET) == UNKEYED_CHAIN  # format 1: no key
    lmdb = StoreFormat("kvc-store", FORMAT_VERSION, "crc32", 0.0)
    assert chain_key_of(lmdb, SECRET) == derive_chain_key(SECRET) != SECRET  # derived from the key file
    assert chain_key_of(lmdb, None) is None  # a reader who may not read the key file
    shared = StoreFormat("kvc-store", FORMAT_VERSION, "crc32", 0.0, SECRET.hex(), ("ab" * 32))
    assert chain_key_of(shared, SECRET) == bytes.fromhex("ab" * 32)  # the format record's own


def test_roots_with_the_key_are_recomputed_and_without_it_read_from_the_records():
    key = derive_chain_key(SECRET)
    root = hash_root_of_id(LAY, NS, key)
    keyed = ChainRoots(key, {(LAY, NS)}, {})
    assert keyed.owner(root) == (LAY, NS) and keyed.belongs(root, LAY, NS)
    assert not keyed.belongs(root, b"m" * 16, NS)  # another layout's root
    record = NamespaceRecord(NS.hex(), "t", None, 1, 1, 0.0, 0.0, 0, [root.hex(), "not hex"])
    keyless = ChainRoots(None, {(LAY, NS)}, {NS: record})
    assert keyless.owner(root) == (None, NS) and keyless.belongs(root, LAY, NS)
    assert not keyless.belongs(root, LAY, b"o" * 16)  # another namespace's root
    assert keyless.owner(hash_root_of_id(LAY, NS, UNKEYED_CHAIN)) is None  # a guess without the key names none
