"""Who serves the store and what was dropped from it (kvcache.storage.serving): the serving records of the live
caches on it, and the drop log they follow (a drop numbered by INCR, so writers on many machines get distinct
numbers; the last DROPS_KEPT are kept).

Administrative calls (a fault is a StoreError), but for `drop_seq`, which a live cache reads before every put: a
data call, refused at once during the backoff pause after a fault.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from kvcache.storage.kit import DROPS_KEPT, DropRecord, InvalidInput, ServeRecord, StoreError, decode_or_none, encoder

from .connection import FAULTS, Connection, said
from .schema import Keys

_dec_serve = msgspec.msgpack.Decoder(ServeRecord).decode
_dec_drop = msgspec.msgpack.Decoder(DropRecord).decode


class ServeRecords:
    """One store's serving records and drop log."""

    def __init__(self, conn: Connection, keys: Keys) -> None:
        self.conn = conn
        self.keys = keys

    def register(self, record: ServeRecord) -> None:
        """Record a live cache serving this store."""
        self.conn.admin(lambda c: c.hset(self.keys.serves, record.token, encoder.encode(record)))

    def unregister(self, token: str) -> None:
        """Remove a serving record (no error when it is gone)."""
        self.conn.admin(lambda c: c.hdel(self.keys.serves, token))

    def serves(self) -> list[ServeRecord]:
        """Every serving record, stale ones included (one that does not decode is skipped)."""
        raw = self.conn.admin(lambda c: c.hgetall(self.keys.serves))
        found = (decode_or_none(_dec_serve, v) for v in raw.values())
        return sorted((r for r in found if r is not None), key=lambda r: (r.started, r.token))

    def record_drop(self, ns_id: bytes, extra_key: str | None, salt_fingerprint: str | None,
                    by: str) -> DropRecord:
        """Record a drop as the next of the store's drop sequence, and forget those beyond DROPS_KEPT."""
        if not isinstance(ns_id, bytes) or len(ns_id) != 16:
            raise InvalidInput(f"a namespace id is 16 bytes, got {ns_id!r:.60}")
        keys = self.keys

        def write(c: Any) -> DropRecord:
            seq = int(c.incr(keys.dropseq))
            record = DropRecord(seq, ns_id.hex(), extra_key, salt_fingerprint, time.time(), by)
            c.zadd(keys.drops, {encoder.encode(record): seq})
            c.zremrangebyscore(keys.drops, "-inf", seq - DROPS_KEPT)
            return record

        return self.conn.admin(write)

    def drops(self, since: int = 0) -> list[DropRecord]:
        """The drop records numbered above `since`, oldest first."""
        raw = self.conn.admin(lambda c: c.zrangebyscore(self.keys.drops, f"({max(0, since)}", "+inf"))
        found = (decode_or_none(_dec_drop, v) for v in raw)
        return [r for r in found if r is not None]

    def drop_seq(self) -> int:
        """The number of the last drop recorded (0: none); a fault is a StoreError, at once during the backoff
        pause, counted in `read_errors`."""
        conn = self.conn
        client = conn.live()
        if not conn.available():
            raise StoreError(conn.location, "redis: the server is not answering (backing off)")
        try:
            raw = client.get(self.keys.dropseq)
        except FAULTS as exc:
            conn.fault("read_errors", exc)
            raise StoreError(conn.location, f"redis: {said(exc)}") from None
        conn.ok()
        return int(raw) if raw is not None else 0
