"""Who serves an LMDB store and what was dropped from it, kept in its `store` sub-database (see
`kvcache.storage.serving`)::

    b"serve/" + token          -> ServeRecord (msgpack): one live cache and its admin socket
    b"drop_seq"                -> u64: the number of the last drop recorded
    b"drop/" + u64 big-endian  -> DropRecord (msgpack), in sequence order (big-endian keys sort by number)

An older kvc ignores these keys, and a record that does not decode is skipped (it names nobody to reach).
"""

from __future__ import annotations

import struct
import time
from typing import Any

import lmdb
import msgspec

from ...types.ids import NamespaceId
from ..api import DROPS_KEPT, DropRecord, ServeRecord
from ..codec import decode_or_none, encoder

SERVE_PREFIX = b"serve/"
DROP_PREFIX = b"drop/"
DROP_SEQ = b"drop_seq"
_SEQ = struct.Struct(">Q")  # drop keys: big-endian, so a cursor walks them in sequence order
_U64 = struct.Struct("<Q")

decode_serve = msgspec.msgpack.Decoder(ServeRecord).decode
decode_drop = msgspec.msgpack.Decoder(DropRecord).decode


def _prefixed(txn: lmdb.Transaction, db: Any, prefix: bytes, start: bytes | None = None):
    """(key, value) of the records under `prefix`, from `start` (default: the first)."""
    cur = txn.cursor(db=db)
    if cur.set_range(start or prefix):
        for key, raw in cur:
            if not bytes(key).startswith(prefix):
                break
            yield bytes(key), raw


def put_serve(txn: lmdb.Transaction, dbs: Any, record: ServeRecord) -> None:
    """Record one serving process."""
    txn.put(SERVE_PREFIX + record.token.encode(), encoder.encode(record), db=dbs.store)


def delete_serve(txn: lmdb.Transaction, dbs: Any, token: str) -> None:
    """Remove one serving record (absent: nothing to do)."""
    txn.delete(SERVE_PREFIX + token.encode(), db=dbs.store)


def read_serves(txn: lmdb.Transaction, dbs: Any) -> list[ServeRecord]:
    """Every serving record that decodes."""
    found = (decode_or_none(decode_serve, raw) for _, raw in _prefixed(txn, dbs.store, SERVE_PREFIX))
    return [r for r in found if r is not None]


def read_drop_seq(txn: lmdb.Transaction, dbs: Any) -> int:
    """The number of the last drop recorded (0: none)."""
    raw = txn.get(DROP_SEQ, db=dbs.store)
    return _U64.unpack(raw)[0] if raw is not None and len(raw) == _U64.size else 0


def add_drop(txn: lmdb.Transaction, dbs: Any, ns_id: NamespaceId, extra_key: str | None,
             salt_fingerprint: str | None, by: str) -> DropRecord:
    """Record a drop as the next of the sequence and forget those beyond DROPS_KEPT."""
    seq = read_drop_seq(txn, dbs) + 1
    record = DropRecord(seq, bytes(ns_id).hex(), extra_key, salt_fingerprint, time.time(), by)
    txn.put(DROP_SEQ, _U64.pack(seq), db=dbs.store)
    txn.put(DROP_PREFIX + _SEQ.pack(seq), encoder.encode(record), db=dbs.store)
    if seq > DROPS_KEPT:  # one in, one out: the records kept stay DROPS_KEPT
        txn.delete(DROP_PREFIX + _SEQ.pack(seq - DROPS_KEPT), db=dbs.store)
    return record


def read_drops(txn: lmdb.Transaction, dbs: Any, since: int) -> list[DropRecord]:
    """The drop records numbered above `since`, oldest first (those that do not decode skipped)."""
    found = (decode_or_none(decode_drop, raw)
             for _, raw in _prefixed(txn, dbs.store, DROP_PREFIX, DROP_PREFIX + _SEQ.pack(max(0, since) + 1)))
    return [r for r in found if r is not None]
