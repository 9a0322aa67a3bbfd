"""Format 2 (keyed chain roots) and `kvc migrate` (issue 26, item 1): a format-1 store reads and writes as before,
says that `kvc migrate` upgrades it, and the migration rewrites every page under its keyed hash, keeping what
every page holds. Real stores in a tmp dir."""

from __future__ import annotations

import os

import lmdb
import msgspec
import numpy as np
import pytest

from kvcache.errors import KeyFileError, StoreError
from kvcache.storage.api import page_origins
from kvcache.storage.codec import FORMAT_VERSION, decode_format, decode_meta, decode_namespace, encoder
from kvcache.storage.lmdb.migrate import MIGRATE_PREFIX, migrate_location
from kvcache.storage.registry import open_store
from kvcache.types.keys import UNKEYED_CHAIN, derive_chain_key, hash_root_of_id, pack_tokens
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace
from kvcache.workload.kvdata import SyntheticKV

LAYOUT = KVLayout("migrate@r1", layers=1, kv_heads=2, head_dim=64, dtype="float16", page_size=4)  # 1 KiB pages
TENANTS = (Namespace("tenant-a", "abc"), Namespace("tenant-b", "xyz"))


def set_format_version(path: str, version: int) -> None:
    """Rewrite the store's format record to `version` (what a store made by an older kvc records)."""
    env = lmdb.open(path, max_dbs=16)
    try:
        with env.begin(write=True) as txn:
            db = env.open_db(b"store", txn=txn, create=False)
            fmt = decode_format(txn.get(b"format", db=db))
            txn.put(b"format", encoder.encode(msgspec.structs.replace(fmt, version=version)), db=db)
    finally:
        env.close()


def build_format_1(path: str, docs: int = 6) -> None:
    """A format-1 store as the kvc before keyed roots wrote it: unkeyed chain roots, two tenants, chains that
    share a first page and branch (so a page's new parent is another page's new hash)."""
    open_store(path, LAYOUT, create=True, durability="none").close()
    set_format_version(path, 1)
    kv = SyntheticKV(LAYOUT)
    with open_store(path, LAYOUT, durability="none") as store:
        assert store.format_version == 1 and store.chain_key == UNKEYED_CHAIN
        for t, ns in enumerate(TENANTS):
            for doc in range(docs):
                tokens = [t + 1] * 4 + [doc] * 4 + list(range(doc * 100, doc * 100 + 12))
                hashes, origins = page_origins(LAYOUT, pack_tokens(tokens), ns, store.chain_key)
                store.put(hashes, list(kv.pages(hashes).numpy()), origins)


def contents(path: str) -> dict[tuple[bytes, bytes], bytes]:
    """What the store holds, by what names a page apart from its hash: (namespace id, the tokens of its whole
    prefix) -> its payload."""
    env = lmdb.open(path, readonly=True, lock=False, max_dbs=16)
    try:
        with env.begin() as txn:
            metas = {bytes(k): decode_meta(v) for k, v in txn.cursor(db=env.open_db(b"meta", txn=txn, create=False))}
            pages = {bytes(k): bytes(v)[8:]
                     for k, v in txn.cursor(db=env.open_db(b"pages", txn=txn, create=False))}
    finally:
        env.close()
    out = {}
    for h, meta in metas.items():
        prefix, up = meta.tokens, meta.parent
        while up in metas:
            prefix, up = metas[up].tokens + prefix, metas[up].parent
        out[(meta.ns_id, bytes(prefix))] = pages[h]
    return out


def test_a_format_1_store_reads_and_writes_as_before(tmp_path):
    path = str(tmp_path / "s")
    build_format_1(path)
    with open_store(path, LAYOUT, durability="none") as store:
        assert store.format_version == 1 and store.chain_key == UNKEYED_CHAIN
        assert store.stats().format_version == 1
        tokens = [1] * 4 + [0] * 4 + list(range(0, 12))
        hashes, _ = page_origins(LAYOUT, pack_tokens(tokens), TENANTS[0], UNKEYED_CHAIN)
        assert store.exists_prefix(hashes) == len(hashes) == 5
        assert store.verify().ok
    # a keyed store names the same pages otherwise
    fresh = str(tmp_path / "fresh")
    with open_store(fresh, LAYOUT, create=True, durability="none") as store:
        assert store.format_version == FORMAT_VERSION and store.chain_key not in (None, UNKEYED_CHAIN)
        assert store.root(TENANTS[0]) != hash_root_of_id(LAYOUT.layout_id, TENANTS[0].id, UNKEYED_CHAIN)


def test_migrate_rewrites_every_page_under_its_keyed_hash_and_keeps_what_it_holds(tmp_path):
    path = str(tmp_path / "s")
    build_format_1(path)
    before, hashes_before = contents(path), set(_hashes(path))
    report = migrate_location(path)
    assert report.migrated and (report.from_version, report.to_version) == (1, FORMAT_VERSION)
    assert report.pages == len(before) == len(hashes_before) and report.namespaces == 2
    assert contents(path) == before  # every page, its prefix and its bytes
    assert not set(_hashes(path)) & hashes_before  # every page hash changed
    with open(os.path.join(path, "fingerprint.key"), encoding="ascii") as f:
        chain_key = derive_chain_key(bytes.fromhex(f.read().strip()))
    with open_store(path, LAYOUT, durability="none") as store:
        assert store.format_version == FORMAT_VERSION and store.chain_key == chain_key
        assert store.verify().ok and store.stats().pages == len(before)
        for ns in TENANTS:
            tokens = [TENANTS.index(ns) + 1] * 4 + [2] * 4 + list(range(200, 212))
            hashes, origins = page_origins(LAYOUT, pack_tokens(tokens), ns, store.chain_key)
            assert store.exists_prefix(hashes) == 5  # found under the keyed chain
            got = np.zeros((5, LAYOUT.bytes_per_page), np.uint8)
            assert store.get_into(hashes, list(got)) == 5
            # the namespace record keeps the keyed root its pages hang from (what a keyless audit reads)
            [record] = [r for r in store.namespaces() if r.ns_id_hex == ns.id_hex]
            assert origins[0].parent.hex() in record.roots
        assert {r.ns_id_hex: r.pages for r in store.namespaces()} == {ns.id_hex: 1 + 4 * 6 for ns in TENANTS}
    assert [n for n in os.listdir(path) if n.startswith(".")] == []


def test_a_migrated_store_verifies_without_its_key(tmp_path):
    """A reader without the key file (a monitoring user) checks the chains against the recorded roots."""
    path = str(tmp_path / "s")
    build_format_1(path)
    migrate_location(path)
    assert _keyless_verify(path).ok
    # it still finds a chain whose head hangs from no recorded root
    env = lmdb.open(path, max_dbs=16)
    with env.begin(write=True) as txn:
        db = env.open_db(b"namespaces", txn=txn, create=False)
        rec = decode_namespace(txn.get(TENANTS[0].id, db=db))
        txn.put(TENANTS[0].id, encoder.encode(msgspec.structs.replace(rec, roots=[])), db=db)
    env.close()
    assert {f.kind for f in _keyless_verify(path).findings} == {"orphan"}


def _keyless_verify(path: str):
    from kvcache.storage.lmdb.env import acquire, release
    from kvcache.storage.lmdb.integrity import LMDBIntegrity
    from kvcache.storage.verify import verify

    shared = acquire(path, False, 1 << 20, "none", lock=False)
    try:
        source = LMDBIntegrity(shared)
        source.chain_key = None  # what read_key gives a user who may not read the key file
        return verify(source)
    finally:
        release(shared)


def test_migrating_a_current_store_changes_nothing(tmp_path):
    path = str(tmp_path / "s")
    build_format_1(path)
    migrate_location(path)
    data = _data(path)
    again = migrate_location(path)
    assert not again.migrated and again.from_version == again.to_version == FORMAT_VERSION
    assert _data(path) == data


def test_migrate_refuses_a_store_open_here_or_one_that_does_not_audit_clean(tmp_path):
    path = str(tmp_path / "s")
    build_format_1(path)
    data = _data(path)
    with open_store(path, LAYOUT, durability="none"):
        with pytest.raises(StoreError, match="this process has the store open"):
            migrate_location(path)
    env = lmdb.open(path, max_dbs=16)
    with env.begin(write=True) as txn:  # a page without its metadata: a finding
        meta = env.open_db(b"meta", txn=txn, create=False)
        key = next(iter(txn.cursor(db=meta).iternext(keys=True, values=False)))
        txn.delete(key, db=meta)
    env.close()
    data = _data(path)
    with pytest.raises(StoreError, match="kvc audit --repair"):
        migrate_location(path)
    assert _data(path) == data and not [n for n in os.listdir(path) if n.startswith(MIGRATE_PREFIX)]


def _hashes(path: str) -> list[bytes]:
    env = lmdb.open(path, readonly=True, lock=False, max_dbs=16)
    try:
        with env.begin() as txn:
            db = env.open_db(b"pages", txn=txn, create=False)
            return [bytes(k) for k in txn.cursor(db=db).iternext(keys=True, values=False)]
    finally:
        env.close()


def _data(path: str) -> bytes:
    with open(os.path.join(path, "data.mdb"), "rb") as f:
        return f.read()


def test_a_writer_never_makes_a_new_key_for_a_keyed_store_that_holds_pages(tmp_path):
    """Under a new key file no stored page could be found again (the chain roots are keyed by the old one)."""
    path = str(tmp_path / "s")
    build_format_1(path)
    migrate_location(path)
    os.rename(os.path.join(path, "fingerprint.key"), os.path.join(tmp_path, "kept.key"))
    with pytest.raises(StoreError, match="fingerprint key file is missing"):
        open_store(path, LAYOUT)
    assert not os.path.exists(os.path.join(path, "fingerprint.key"))
    # the key file is part of the store: a reader is refused too (i26-keyfile); a reader who may not read an
    # existing key file (monitoring) goes on keyless, its audit reading recorded roots (test_cli_keyfile.py)
    with pytest.raises(KeyFileError, match="fingerprint key file is missing"):
        open_store(path, readonly=True)
    os.rename(os.path.join(tmp_path, "kept.key"), os.path.join(path, "fingerprint.key"))
    with open_store(path, LAYOUT) as store:
        assert store.verify().ok and store.stats().pages == 2 * (1 + 4 * 6)


def test_migrate_files_engine_pages_under_their_keys_hash_under_the_new_root(tmp_path):
    """A format-1 store an engine wrote into (its chain key then the unkeyed one): each engine page goes under its
    key's hash under its namespace's keyed root, its chain links kept, and reads back by key alone."""
    import hashlib

    from kvcache.storage.api import engine_hashes, engine_origins

    path = str(tmp_path / "s")
    build_format_1(path, docs=2)
    ns, keys = Namespace("sglang"), [hashlib.sha256(bytes([i])).digest() for i in range(5)]
    kv = SyntheticKV(LAYOUT)
    with open_store(path, LAYOUT, durability="none") as store:
        old, origins = engine_origins(LAYOUT, ns, store.chain_key, keys)
        payloads = list(kv.pages(old).numpy())
        store.put(old, payloads, origins)
    migrate_location(path)
    assert not set(old) & set(_hashes(path))
    with open_store(path, LAYOUT, durability="none") as store:
        new = engine_hashes(LAYOUT, ns, store.chain_key, keys)
        got = np.zeros((5, LAYOUT.bytes_per_page), np.uint8)
        assert store.get_into(new, list(got)) == 5
        assert all(np.array_equal(g, p) for g, p in zip(got, payloads, strict=True))
        assert store.page_meta(new[3]).parent == new[2] and store.page_meta(new[3]).key == keys[3]
        assert store.verify().ok
    assert _keyless_verify(path).ok
