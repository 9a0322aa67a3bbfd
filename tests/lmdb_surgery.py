"""Surgery on an LMDB store's records through plain py-lmdb (the store closed): the damage that the store's own API
never causes — lost pages, lost metadata, broken links — for the tests of verify and repair."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import lmdb
import msgspec

from kvcache.storage.api import NamespaceRecord, PageMeta
from kvcache.storage.lmdb import store as lmdb_store
from kvcache.storage.lmdb.store import StoreTotals


class Raw(msgspec.Struct):
    """One write transaction on the store's environment through plain py-lmdb (the store closed)."""

    txn: lmdb.Transaction
    db: dict[str, object]

    def meta(self, h: bytes) -> PageMeta:
        return msgspec.msgpack.decode(self.txn.get(h, db=self.db["meta"]), type=PageMeta)

    def put_meta(self, h: bytes, meta: PageMeta) -> None:
        self.txn.put(h, msgspec.msgpack.encode(meta), db=self.db["meta"])

    def drop(self, h: bytes, *, page: bool = True, meta: bool = True, link: bool = True) -> None:
        if link:
            assert self.txn.delete(self.meta(h).parent, h, db=self.db["children"])
        if page:
            assert self.txn.delete(h, db=self.db["pages"])
        if meta:
            assert self.txn.delete(h, db=self.db["meta"])

    def recount(self) -> None:
        """Registry counters and totals from the pages that have bytes and metadata (what verify counts)."""
        per_ns: dict[bytes, list[int]] = {}
        for key, raw in self.txn.cursor(db=self.db["meta"]):
            if self.txn.get(bytes(key), db=self.db["pages"]) is not None:
                m = msgspec.msgpack.decode(raw, type=PageMeta)
                acc = per_ns.setdefault(m.ns_id, [0, 0])
                acc[0] += 1
                acc[1] += m.nbytes
        for key, raw in list(self.txn.cursor(db=self.db["namespaces"])):
            record = msgspec.msgpack.decode(raw, type=NamespaceRecord)
            pages, nbytes = per_ns.get(bytes(key), [0, 0])
            self.txn.put(bytes(key), msgspec.msgpack.encode(msgspec.structs.replace(record, pages=pages,
                                                                                    bytes=nbytes)),
                         db=self.db["namespaces"])
        totals = StoreTotals(sum(p for p, _ in per_ns.values()), sum(b for _, b in per_ns.values()))
        self.txn.put(b"totals", msgspec.msgpack.encode(totals), db=self.db["store"])


@contextmanager
def raw(path: str, recount: bool = True) -> Iterator[Raw]:
    env = lmdb.open(path, max_dbs=lmdb_store.MAX_DBS)
    try:
        db = {n: env.open_db(n.encode(), dupsort=n == "children", dupfixed=n == "children")
              for n in ("pages", "meta", "children", "namespaces", "layouts", "store")}
        with env.begin(write=True) as txn:
            r = Raw(txn, db)
            yield r
            if recount:
                r.recount()
    finally:
        env.close()
