"""What proves a record of a damaged store sound without LMDB's trees: a rebuild keeps only records that prove
themselves (a walk of a damaged leaf can return garbage, and a freed page still holds records deleted since).

A page proves itself by its checksum seeded by its key; its metadata by decoding and chaining to its key (a token
page's H(parent || tokens), an engine page's key under its namespace/layout root); a namespace or layout record
by naming its own id (`recover`).
"""

from __future__ import annotations

from typing import Any

import lmdb

from ...types.ids import PageHash
from ...types.keys import PAGE_HASH_BYTES, UNKEYED_CHAIN, derive_chain_key, hash_root_of_id
from ..codec import (
    CHECKSUMS,
    Checksum,
    StoreFormat,
    chains_to,
    decode_format,
    decode_meta,
    decode_namespace,
    decode_or_none,
    engine_keyed,
)
from ..keyfile import key_if_any
from ..verify_checks import recorded_roots
from . import recover
from .salvage_child import env_of


def algorithms(store_records: dict[bytes, bytes]) -> list[Checksum]:
    """The checksum the store's format record names, or every one when that record is lost."""
    fmt = decode_or_none(decode_format, store_records.get(b"format", b""))
    if isinstance(fmt, StoreFormat) and fmt.checksum in CHECKSUMS:
        return [CHECKSUMS[fmt.checksum]]
    return list(CHECKSUMS.values())


def page_proves(key: bytes, value: Any, algos: list[Checksum]) -> bool:
    """A page record whose checksum, seeded by its key, matches its payload."""
    return len(key) == PAGE_HASH_BYTES and any(a.sound(value, key) for a in algos)


def meta_proves(key: bytes, value: Any, chain_keys: list[bytes],
                recorded: dict[bytes, list[PageHash]] | None = None) -> bool:
    """A metadata record that decodes and chains to its key: a token page's H(parent || tokens), an engine page's
    key under its namespace/layout root keyed by one of `chain_keys` (`possible_chain_keys`), or under a root its
    namespace's record keeps (`recorded`: what proves it when this user may not read the key, or it is lost)."""
    meta = decode_or_none(decode_meta, value)
    if meta is None:
        return False
    if not meta.key:
        return chains_to(key, meta)
    roots = [hash_root_of_id(meta.layout_id, meta.ns_id, k) for k in chain_keys]
    return engine_keyed(key, meta, roots + (recorded or {}).get(meta.ns_id, []))


def recorded_roots_in(txn: lmdb.Transaction, dbs: Any) -> dict[bytes, list[PageHash]]:
    """Namespace id -> the roots its record keeps, for the namespace records in `txn` that prove themselves."""
    out = {}
    for key, raw in txn.cursor(db=dbs.namespaces):
        record = decode_or_none(decode_namespace, raw)
        if record is not None and record.ns_id_hex == bytes(key).hex():
            out[bytes(key)] = recorded_roots(record)
    return out


def possible_chain_keys(directory: str) -> list[bytes]:
    """The chain keys a store's roots may be keyed by, for the engine pages' proof: the one derived from the key
    file in `directory` (the fresh store holds a copy) and a format-1 store's (none), since the format record
    that says which may be lost."""
    secret = key_if_any(directory)
    return ([derive_chain_key(secret)] if secret is not None else []) + [UNKEYED_CHAIN]


def drop_unsound(new: str, store_records: dict[bytes, bytes]) -> dict[str, list[bytes]]:
    """In a child, on the fresh store: remove copied page and metadata records that do not prove themselves (a
    walk of a damaged leaf can return garbage); returns the keys of those that do, per sub-database."""
    algos = algorithms(store_records)
    chain_keys = possible_chain_keys(new)
    kept: dict[str, list[bytes]] = {"pages": [], "meta": []}

    def body(txn: lmdb.Transaction) -> None:
        recorded = recorded_roots_in(txn, dbs)
        for db, proves in (("pages", lambda k, v: page_proves(k, v, algos)),
                           ("meta", lambda k, v: meta_proves(k, v, chain_keys, recorded)),
                           ("namespaces", recover.namespace_proves), ("layouts", recover.layout_proves)):
            target = getattr(dbs, db)
            for key, value in list(txn.cursor(db=target)):
                if proves(bytes(key), value):
                    kept.setdefault(db, []).append(bytes(key))
                else:
                    txn.delete(bytes(key), db=target)

    with env_of(new) as store:
        dbs = store.dbs
        store.write(body)
    return kept
