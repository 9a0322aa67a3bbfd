"""The store's records of what it holds, apart from the pages: the layouts, the namespace registry (identity,
counters, roots) and the namespaces' shares, with the recount that sets the registry's counters from the pages.

Administrative reads and writes: a fault is a StoreError. The counters themselves are kept by the put and removal
scripts as they write (`scripts`); the recount is the audit's repair of a drift, a racy scan run when writers are
quiet.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from kvcache.storage.kit import (
    KVLayout,
    LayoutRecord,
    Namespace,
    NamespaceInfo,
    NamespaceRecord,
    NamespaceShares,
    Shares,
    decode_layout,
    decode_or_none,
    decode_shares_record,
    encoder,
)

from .connection import Connection
from .scan import RecordScan
from .schema import Keys

_dec_info = msgspec.msgpack.Decoder(NamespaceInfo)


class Registry:
    """One store's layout records, namespace records and shares."""

    def __init__(self, conn: Connection, keys: Keys, scan: RecordScan, fingerprint_key: bytes | None) -> None:
        self.conn = conn
        self.keys = keys
        self.scan = scan
        self.fingerprint_key = fingerprint_key  # keys the salt fingerprint a shares record keeps

    def layout_records(self) -> dict[bytes, LayoutRecord]:
        """The layout records, by layout id."""
        raw = self.conn.admin(lambda c: c.hgetall(self.keys.layouts))
        return {bytes.fromhex(k.decode()): decode_layout(v) for k, v in raw.items()}

    def add_layout(self, layout: KVLayout) -> None:
        """Record `layout` (kept as it is when already recorded)."""
        self.conn.admin(lambda c: c.hsetnx(self.keys.layouts, layout.layout_id.hex(),
                                           encoder.encode(LayoutRecord(layout, time.time()))))

    def layouts(self) -> list[KVLayout]:
        """Every layout the store holds, oldest first."""
        return [r.layout for r in sorted(self.layout_records().values(), key=lambda r: r.created)]

    def layout_count(self) -> int:
        """How many layout records the store holds."""
        return int(self.conn.admin(lambda c: c.hlen(self.keys.layouts)))

    def records(self) -> dict[str, NamespaceRecord]:
        """Every registered namespace's record, by namespace id hex."""
        keys = self.keys
        ids = sorted(m.decode() for m in self.conn.admin(lambda c: c.smembers(keys.nsidx)))

        def fetch(c: Any) -> list[dict]:
            pipe = c.pipeline(transaction=False)
            for ns_hex in ids:
                pipe.hgetall(keys.namespace(ns_hex))
            return pipe.execute()

        out = {}
        for ns_hex, rec in zip(ids, self.conn.admin(fetch) if ids else [], strict=True):
            if b"info" not in rec:
                continue  # removed meanwhile (delete_namespace), or a counter stub: not a registered namespace
            info = _dec_info.decode(rec[b"info"])
            roots = sorted(k[2:].decode() for k in rec if k.startswith(b"r:"))
            out[ns_hex] = NamespaceRecord(ns_hex, info.extra_key, info.salt_fingerprint, int(rec.get(b"pages", 0)),
                                          int(rec.get(b"bytes", 0)), float(rec.get(b"created", 0)),
                                          float(rec.get(b"last", 0)), int(rec.get(b"hits", 0)), roots)
        return out

    def namespaces(self) -> list[NamespaceRecord]:
        """The namespace registry, most pages first."""
        return sorted(self.records().values(), key=lambda r: (-r.pages, r.ns_id_hex))

    def set_shares(self, namespace: Namespace, shares: Shares) -> None:
        """Record `namespace`'s shares (`Shares()` clears them); a `store_bytes` share also under its own field,
        which the put script reads."""
        ns_hex = namespace.id_hex
        info = namespace.info(self.fingerprint_key)
        key = self.keys.shares

        def write(c: Any) -> None:
            if shares.empty:
                c.hdel(key, ns_hex, "b:" + ns_hex)
                return
            record = NamespaceShares(ns_hex, info.extra_key, info.salt_fingerprint, shares, time.time())
            c.hset(key, ns_hex, encoder.encode(record))
            if shares.store_bytes:
                c.hset(key, "b:" + ns_hex, shares.store_bytes)
            else:
                c.hdel(key, "b:" + ns_hex)

        self.conn.admin(write)

    def shares(self) -> list[NamespaceShares]:
        """Every namespace's shares."""
        raw = self.conn.admin(lambda c: c.hgetall(self.keys.shares))
        records = (decode_or_none(decode_shares_record, v) for k, v in raw.items() if not k.startswith(b"b:"))
        return sorted((r for r in records if r is not None), key=lambda r: r.ns_id_hex)

    def recount(self) -> None:
        """Set every registry counter from the page records stored now."""
        per_ns: dict[str, list[int]] = {}
        for _, (n, size) in self.scan.page_sizes():
            acc = per_ns.setdefault(n, [0, 0])
            acc[0] += 1
            acc[1] += size
        registry = self.records()
        keys = self.keys

        def write(c: Any) -> None:
            pipe = c.pipeline(transaction=False)
            for ns_hex, record in registry.items():
                n_pages, n_bytes = per_ns.get(ns_hex, [0, 0])
                if (record.pages, record.bytes) != (n_pages, n_bytes):
                    pipe.hset(keys.namespace(ns_hex), mapping={"pages": n_pages, "bytes": n_bytes})
            pipe.execute()

        self.conn.admin(write)
