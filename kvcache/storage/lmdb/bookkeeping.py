"""The bookkeeping of an LMDB store: namespace registry counters, store totals, payload limits, shares and LRU
eviction inside its write transactions, and the records as a handle shows them.

Every transaction that adds or removes pages gathers its registry changes per namespace (`NsDelta`) and applies
them at its end (`apply_deltas`), with the store totals, so pages, indexes and counters commit together.

Eviction finds the least recently used leaves by scanning `meta` (no access-order index is kept: each index is
one more B-tree every put dirties, ~3 µs per 16 KiB page), and the caller asks for a little more than it needs
(`CapacityPolicy.evict_headroom`) so that scan is paid once per many puts.
"""

from __future__ import annotations

import heapq
import struct
import time
from typing import Any

import lmdb
import msgspec
import numpy as np

from ...types.ids import NamespaceId
from ...types.namespace import UNKNOWN_FINGERPRINT, Namespace
from ...types.shares import NamespaceShares, decode_shares_record
from ..api import LayoutRecord, NamespaceRecord, PageMeta
from ..codec import decode_layout, decode_meta, decode_namespace, decode_or_none, encoder
from ..keyfile import KeyEvidence
from ..removals import RemovalReason
from .removals import record as record_removals

_U64 = struct.Struct("<Q")  # the payload limits in `store`


class StoreTotals(msgspec.Struct, frozen=True, array_like=True):
    """Store-wide counters, updated in every transaction that adds or removes pages."""

    pages: int
    bytes: int  # payload bytes


decode_totals = msgspec.msgpack.Decoder(StoreTotals).decode


def init_store_records(txn: lmdb.Transaction, store_db: Any) -> None:
    """The bookkeeping records of a new store: empty totals, no capacity."""
    txn.put(b"totals", encoder.encode(StoreTotals(0, 0)), db=store_db)
    txn.put(b"capacity", _U64.pack(0), db=store_db)


def _kept(txn: lmdb.Transaction, key: bytes, db: Any) -> bytes | memoryview:
    """A bookkeeping record every store holds: `init_store_records` writes it with the store, nothing deletes it."""
    raw = txn.get(key, db=db)
    assert raw is not None, f"a store without its {key.decode()!r} record"
    return raw


def read_totals(txn: lmdb.Transaction, dbs: Any) -> StoreTotals:
    """The store totals (a record that does not decode raises msgspec's DecodeError: a damaged store)."""
    return decode_totals(_kept(txn, b"totals", dbs.store))


def layout_records(txn: lmdb.Transaction, dbs: Any) -> dict[bytes, LayoutRecord]:
    """Every layout record, by layout id."""
    return {bytes(k): decode_layout(v) for k, v in txn.cursor(db=dbs.layouts)}


def namespace_records(txn: lmdb.Transaction, dbs: Any) -> list[NamespaceRecord]:
    """Every namespace record, most pages first."""
    records = [decode_namespace(v) for _, v in txn.cursor(db=dbs.namespaces)]
    return sorted(records, key=lambda r: (-r.pages, r.ns_id_hex))


def key_evidence(txn: lmdb.Transaction, dbs: Any, chain_key: bytes, limit: int = 0) -> "KeyEvidence":
    """What the namespace registry says of `chain_key` (`keyfile.KeyEvidence`): the recorded roots of its records
    (the first `limit` with roots; 0: every one) against the roots the key gives under the layouts recorded."""
    evidence = KeyEvidence(chain_key)
    layout_ids = [bytes(k) for k in txn.cursor(db=dbs.layouts).iternext(keys=True, values=False)]
    seen = 0
    for key, raw in txn.cursor(db=dbs.namespaces):
        record = decode_or_none(decode_namespace, raw)
        if record is None or not record.roots:
            continue
        evidence.record(NamespaceId(bytes(key)), record, layout_ids)
        seen += 1
        if seen == limit:
            break
    return evidence


def has_pages_of(txn: lmdb.Transaction, dbs: Any, layout_id: bytes) -> bool:
    """Whether any page's metadata names layout `layout_id` (a walk of `meta` up to the first that does)."""
    for raw in txn.cursor(db=dbs.meta).iternext(keys=False, values=True):
        meta = decode_or_none(decode_meta, raw)
        if meta is not None and meta.layout_id == layout_id:
            return True
    return False


def adjust_totals(txn: lmdb.Transaction, dbs: Any, pages: int, nbytes: int, damaged_ok: bool = False) -> None:
    """Add to the store totals. `damaged_ok`: leave a totals record that does not decode as it is (repair
    recounts it at its end) instead of failing."""
    raw = _kept(txn, b"totals", dbs.store)
    totals = decode_or_none(decode_totals, raw) if damaged_ok else decode_totals(raw)
    if totals is not None:
        txn.put(b"totals", encoder.encode(StoreTotals(totals.pages + pages, totals.bytes + nbytes)), db=dbs.store)


def limits(txn: lmdb.Transaction, dbs: Any) -> tuple[int, int]:
    """(capacity, namespace quota) in payload bytes; 0 = none. Stores written before quotas lack the key."""
    quota = txn.get(b"ns_quota", db=dbs.store)
    capacity = _U64.unpack(_kept(txn, b"capacity", dbs.store))[0]
    return capacity, (_U64.unpack(quota)[0] if quota else 0)


def set_limits(txn: lmdb.Transaction, dbs: Any, capacity_bytes: int, namespace_quota_bytes: int | None) -> None:
    """Record new payload limits (`namespace_quota_bytes` None: keep the current quota)."""
    txn.put(b"capacity", _U64.pack(capacity_bytes), db=dbs.store)
    if namespace_quota_bytes is not None:
        txn.put(b"ns_quota", _U64.pack(namespace_quota_bytes), db=dbs.store)


SHARES_PREFIX = b"shares/"  # `store` keys b"shares/" + namespace id -> NamespaceShares (msgpack)


def read_shares(txn: lmdb.Transaction, dbs: Any) -> list[NamespaceShares]:
    """Every namespace's shares (a record that does not decode is skipped: it limits nothing)."""
    cur = txn.cursor(db=dbs.store)
    out = []
    if cur.set_range(SHARES_PREFIX):
        for key, raw in cur:
            if not bytes(key).startswith(SHARES_PREFIX):
                break
            record = decode_or_none(decode_shares_record, raw)
            if record is not None:
                out.append(record)
    return out


def write_shares(txn: lmdb.Transaction, dbs: Any, ns_id: NamespaceId, record: NamespaceShares | None) -> None:
    """Record one namespace's shares (None: clear them)."""
    if record is None:
        txn.delete(SHARES_PREFIX + ns_id, db=dbs.store)
    else:
        txn.put(SHARES_PREFIX + ns_id, encoder.encode(record), db=dbs.store)


def store_share(txn: lmdb.Transaction, dbs: Any, ns_id: NamespaceId) -> int:
    """Namespace `ns_id`'s store share in payload bytes (0: none; the uniform quota applies)."""
    raw = txn.get(SHARES_PREFIX + ns_id, db=dbs.store)
    record = decode_or_none(decode_shares_record, raw) if raw is not None else None
    return record.shares.store_bytes if record is not None else 0


class NsDelta:
    """Registry changes for one namespace, gathered during a transaction and applied at its end."""

    __slots__ = ("pages", "bytes", "hits", "last_access", "roots", "info")

    def __init__(self) -> None:
        self.pages = 0
        self.bytes = 0
        self.hits = 0
        self.last_access = 0.0
        self.roots: set[str] = set()
        self.info: Namespace | None = None  # set by writers, which know extra_key and salt fingerprint


def delta(deltas: dict[NamespaceId, NsDelta], ns_id: NamespaceId) -> NsDelta:
    """The delta of namespace `ns_id` in `deltas`, made on first use."""
    return deltas.get(ns_id) or deltas.setdefault(ns_id, NsDelta())


def apply_deltas(txn: lmdb.Transaction, dbs: Any, deltas: dict[NamespaceId, NsDelta], now: float,
                 fingerprint_key: bytes | None) -> None:
    """Fold the gathered changes into the namespace records (a namespace new here is registered, with its salt
    fingerprinted by `fingerprint_key`)."""
    db = dbs.namespaces
    for ns_id, d in deltas.items():
        raw = txn.get(ns_id, db=db)
        if raw is None:
            if d.info is None:
                continue  # a namespace deleted meanwhile
            info = d.info.info(fingerprint_key)
            record = NamespaceRecord(ns_id.hex(), info.extra_key, info.salt_fingerprint, 0, 0, now, now, 0)
        else:
            record = decode_namespace(raw)
            if d.info is not None and record.salt_fingerprint == UNKNOWN_FINGERPRINT:
                # registered under an earlier key (a rekey): its writer knows the salt, so record it under this one
                record = msgspec.structs.replace(record,
                                                 salt_fingerprint=d.info.info(fingerprint_key).salt_fingerprint)
        roots = record.roots if not d.roots - set(record.roots) else sorted(set(record.roots) | d.roots)
        record = msgspec.structs.replace(
            record, pages=record.pages + d.pages, bytes=record.bytes + d.bytes, hits=record.hits + d.hits,
            last_access=max(record.last_access, d.last_access), roots=roots)
        txn.put(ns_id, encoder.encode(record), db=db)


def drop_page(txn: lmdb.Transaction, dbs: Any, page_hash: bytes, meta: PageMeta,
              deltas: dict[NamespaceId, NsDelta]) -> None:
    """Remove one page and every index entry of it; its namespace's counters go into `deltas`."""
    txn.delete(page_hash, db=dbs.pages)
    txn.delete(page_hash, db=dbs.meta)
    txn.delete(meta.parent, page_hash, db=dbs.children)
    d = delta(deltas, meta.ns_id)
    d.pages -= 1
    d.bytes -= meta.nbytes


def drop_stored(txn: lmdb.Transaction, dbs: Any, page_hash: bytes,
                deltas: dict[NamespaceId, NsDelta]) -> PageMeta | None:
    """`drop_page` of the page under `page_hash` if it is stored (its metadata, which says what was freed), else
    None."""
    raw = txn.get(page_hash, db=dbs.meta)
    if raw is None:
        return None
    meta = decode_meta(raw)
    drop_page(txn, dbs, page_hash, meta, deltas)
    return meta


def evict(txn: lmdb.Transaction, dbs: Any, need: int, protect: set[bytes], deltas: dict[NamespaceId, NsDelta],
          only_ns: bytes | None = None, gone: list[bytes] | None = None,
          gone_keys: list[bytes] | None = None) -> tuple[int, int]:
    """Evict least recently used leaf pages (of namespace `only_ns`, or of any) until `need` payload bytes are
    free; (pages, bytes) evicted. The hashes of the pages evicted are appended to `gone` when given, and their
    engine keys (b"" for a token page) to `gone_keys`, in the same order.

    Only leaves (no stored children) are taken. Evicting a leaf can make its parent a leaf: the parent then
    competes with the time of the child it lost (it was read whenever the child was), so a chain shrinks from
    its tail and what stays of it is a prefix. LRU is approximate: access times are as of the last flush. Each
    page evicted is recorded in the removal log (`removals`): a share eviction (`only_ns`) as SHARE, else
    CAPACITY.
    """
    items = list(txn.cursor(db=dbs.meta))
    if not items:
        return 0, 0
    metas = [decode_meta(v) for _, v in items]
    keys = [bytes(k) for (k, _), m in zip(items, metas, strict=True) if only_ns is None or m.ns_id == only_ns]
    times = [m.last_access for m in metas if only_ns is None or m.ns_id == only_ns]
    if not keys:
        return 0, 0
    order = np.argsort(np.array(times), kind="stable").tolist()
    children = txn.cursor(db=dbs.children)
    freed = evicted = 0
    removed: list[tuple[bytes, bytes]] = []  # (page hash, namespace id) of the pages evicted: the removal log's
    orphans: list[tuple[float, bytes]] = []  # (effective last access, page hash) of parents become leaves
    i = 0
    while freed < need and (i < len(order) or orphans):
        if orphans and (i >= len(order) or orphans[0][0] <= times[order[i]]):
            when, h = heapq.heappop(orphans)
        else:
            when, h = times[order[i]], keys[order[i]]
            i += 1
        if h in protect or children.set_key(h):
            continue
        meta = drop_stored(txn, dbs, h, deltas)
        if meta is None:
            continue  # taken already
        evicted += 1
        freed += meta.nbytes
        removed.append((h, meta.ns_id))
        if gone is not None:
            gone.append(h)
        if gone_keys is not None:
            gone_keys.append(meta.key)
        parent_raw = txn.get(meta.parent, db=dbs.meta)
        if parent_raw is not None and not children.set_key(meta.parent):
            parent = decode_meta(parent_raw)
            heapq.heappush(orphans, (max(when, parent.last_access), meta.parent))
    record_removals(txn, dbs.removals, removed, RemovalReason.SHARE if only_ns is not None else RemovalReason.CAPACITY,
                    time.time())
    return evicted, freed


def recount(txn: lmdb.Transaction, dbs: Any) -> None:
    """Set every registry counter and the store totals from the pages stored (metadata and bytes both). A
    namespace's hits are raised to its pages' when they count more (a record restored from an older copy, say):
    every read that ends at a page counts in its namespace too."""
    pages = txn.cursor(db=dbs.pages)
    per_ns: dict[bytes, list[int]] = {}
    for key, raw in txn.cursor(db=dbs.meta):
        meta = decode_or_none(decode_meta, raw)
        if meta is not None and pages.set_key(bytes(key)):
            acc = per_ns.setdefault(meta.ns_id, [0, 0, 0])
            acc[0] += 1
            acc[1] += meta.nbytes
            acc[2] += max(meta.hits, 0)
    for key, raw in list(txn.cursor(db=dbs.namespaces)):
        record = decode_or_none(decode_namespace, raw)
        if record is None:
            continue  # a damaged record: verify reports it, repair removes it with its pages
        n_pages, n_bytes, n_hits = per_ns.get(bytes(key), [0, 0, 0])
        if (record.pages, record.bytes) != (n_pages, n_bytes) or record.hits < n_hits:
            txn.put(bytes(key), encoder.encode(msgspec.structs.replace(record, pages=n_pages, bytes=n_bytes,
                                                                       hits=max(record.hits, n_hits))),
                    db=dbs.namespaces)
    txn.put(b"totals", encoder.encode(StoreTotals(sum(p[0] for p in per_ns.values()),
                                                  sum(p[1] for p in per_ns.values()))), db=dbs.store)
