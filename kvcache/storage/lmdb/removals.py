"""An LMDB store's removal log (`kvcache.storage.removals`): one sub-database, `removals`, written inside the write
transaction that removes the pages it records::

    b"h" + page hash     -> record: u64 seq (big-endian), f64 unix seconds, u8 reason code, 16-byte namespace id
    b"n" + namespace id  -> record of a namespace removed whole (a drop, a TTL expiry)
    b"q" + u64 seq (BE)  -> the key above it records (the log, oldest first: big-endian keys sort by number)

A removal writes its record under its subject and its sequence entry, and drops the sequence entries more than
REMOVALS_KEPT behind the newest (with their record, unless a newer removal of the same subject replaced it): a
get and a few puts and deletes per removal. Sequence keys sort after every record key, so the newest is the
database's last key. A record is 33 bytes under a 17-byte key and its sequence entry 17 bytes under a 9-byte key:
with LMDB's node headers and leaves filled ~2/3 by keys in hash order, ~140 bytes a record on disk (measured).

Stores written before the log have no `removals` sub-database: a writer creates it when it opens the store (an
older kvc leaves it alone), a reader that cannot write reads "no record" (`env.Dbs.removals` None).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any

import lmdb

from ...types.ids import NamespaceId, PageHash
from ...types.keys import PAGE_HASH_BYTES
from ..removals import (
    NAMESPACE_WIDE,
    REASON_CODES,
    REASONS_BY_CODE,
    PageRemoval,
    RemovalReason,
    newest_removal,
    removals_kept,
)

DB_NAME = "removals"
PAGE, NAMESPACE, SEQ = b"h", b"n", b"q"
_VALUE = struct.Struct(">QdB16s")  # seq, unix seconds, reason code, namespace id
_SEQ = struct.Struct(">Q")
SUBJECT_BYTES = 1 + PAGE_HASH_BYTES  # b"h" + page hash, b"n" + namespace id (both 16 bytes)


def last_seq(txn: lmdb.Transaction, db: Any) -> int:
    """The newest sequence number recorded (0: none): the last sequence key (a stray key sorting after them, which
    the audit reports, does not hide it)."""
    cur = txn.cursor(db=db)
    if not (cur.prev() if cur.set_range(bytes([SEQ[0] + 1])) else cur.last()):
        return 0
    key = bytes(cur.key())
    return _SEQ.unpack_from(key, 1)[0] if key[:1] == SEQ and len(key) == 1 + _SEQ.size else 0


def record(txn: lmdb.Transaction, db: Any | None, removed: Iterable[tuple[bytes, bytes]], reason: RemovalReason,
           now: float) -> int:
    """Record `removed` ((page hash, namespace id) each; for a namespace-wide reason, (namespace id, namespace id))
    as removed for `reason` at `now`, and drop what falls past the bound; records written. `db` None: a store
    without the log (opened by a reader that could not create it): nothing is recorded."""
    if db is None:
        return 0
    tag = NAMESPACE if reason in NAMESPACE_WIDE else PAGE
    code = REASON_CODES[reason]
    seq = last_seq(txn, db)
    n = 0
    for subject, ns_id in removed:
        seq += 1
        key = tag + bytes(subject)
        txn.put(key, _VALUE.pack(seq, now, code, bytes(ns_id)), db=db)
        txn.put(SEQ + _SEQ.pack(seq), key, db=db)
        n += 1
    if n:
        trim(txn, db, seq)
    return n


def trim(txn: lmdb.Transaction, db: Any, newest: int) -> int:
    """Drop the sequence entries more than the bound behind `newest`, with the records they name unless a newer
    removal of the same subject replaced them; entries dropped."""
    floor = newest - removals_kept()
    cur = txn.cursor(db=db)
    dropped = 0
    positioned = cur.set_range(SEQ)
    while positioned:
        key = bytes(cur.key())
        if key[:1] != SEQ or len(key) != 1 + _SEQ.size or _SEQ.unpack_from(key, 1)[0] > floor:
            break
        subject = bytes(cur.value())
        value = txn.get(subject, db=db)
        if value is not None and bytes(value[:_SEQ.size]) == key[1:]:
            txn.delete(subject, db=db)
        positioned = cur.delete()  # moves to the next entry
        dropped += 1
    return dropped


def decode(subject: bytes, value: Any) -> tuple[int, PageRemoval] | None:
    """(seq, record) of one record value, or None when it does not decode (a damaged record, an unknown code)."""
    if len(value) != _VALUE.size:
        return None
    seq, at, code, ns_id = _VALUE.unpack(bytes(value))
    reason = REASONS_BY_CODE.get(code)
    if reason is None:
        return None
    return seq, PageRemoval(bytes(subject[1:]), reason, at, NamespaceId(ns_id))


def lookup(txn: lmdb.Transaction, db: Any | None, hashes: Sequence[PageHash],
           namespace: NamespaceId | None) -> list[PageRemoval | None]:
    """The record answered for each of `hashes` (`removals.newest_removal`); all None without the log."""
    if db is None:
        return [None] * len(hashes)
    whole = None
    if namespace is not None:
        raw = txn.get(NAMESPACE + bytes(namespace), db=db)
        whole = decode(NAMESPACE + bytes(namespace), raw) if raw is not None else None
    out: list[PageRemoval | None] = []
    for h in hashes:
        raw = txn.get(PAGE + bytes(h), db=db)
        out.append(newest_removal(bytes(h), decode(PAGE + bytes(h), raw) if raw is not None else None, whole))
    return out


def damaged(txn: lmdb.Transaction, db: Any | None) -> list[tuple[bytes, str]]:
    """The log's keys that are not what it writes, each with why: a record that does not decode, a sequence entry
    that names no record, a key of no kind. What the audit reports (`damaged_record`) and a repair removes."""
    if db is None:
        return []
    found = ((bytes(key), _why(txn, db, bytes(key), value)) for key, value in txn.cursor(db=db))
    return [(key, why) for key, why in found if why]


def remove_damaged(txn: lmdb.Transaction, db: Any | None, key: bytes) -> bool:
    """Remove one key `damaged` named, if it is still damaged in `txn` (the repair's recheck)."""
    value = txn.get(key, db=db) if db is not None else None
    if value is None or not _why(txn, db, key, value):
        return False
    txn.delete(key, db=db)
    return True


def _why(txn: lmdb.Transaction, db: Any, key: bytes, value: Any) -> str:
    """Why the log's entry `key` is damaged ("": it is sound). A sequence entry whose record a newer removal of
    the same subject replaced is sound: the trim drops it in its turn."""
    if key[:1] in (PAGE, NAMESPACE) and len(key) == SUBJECT_BYTES:
        return "" if decode(key, value) is not None else "a removal record that does not decode"
    if key[:1] == SEQ and len(key) == 1 + _SEQ.size:
        named = bytes(value)
        raw = txn.get(named, db=db) if len(named) == SUBJECT_BYTES else None
        return "" if raw is not None and decode(named, raw) is not None else "a removal log entry that names no record"
    return "a key of the removal log that is none of its kinds"
