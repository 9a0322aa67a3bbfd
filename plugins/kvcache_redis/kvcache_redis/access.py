"""Reads logged in memory and pages quarantined on read, written back by `flush`.

A read is one entry of the access log (never a write per read, kvcache.storage.api): its hit goes to the deepest
page it reached, its time to every page it served (LRU must never evict what was just read). `flush` folds the
log into the page records and namespace counters with TOUCH scripts that only touch records that still exist (a
deleted page never comes back as a stub), and drops the pages that failed their checksum on read (if their bytes
are still the ones that failed). A fault keeps the log for the next flush; a server away (or full) for long does
not grow it without bound: the oldest reads are forgotten past MAX_PENDING_FACTOR x `flush_reads`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

from kvcache.storage.kit import AccessLog, AccessPolicy, RemovalReason, StoreError

from .connection import FAULTS, Connection
from .removing import Removals
from .schema import Keys

TOUCH_KEYS = 512  # records one access-folding script updates on a standalone server (a script blocks the server)
MAX_PENDING_FACTOR = 16  # logged reads kept while flushes fail: this many times AccessPolicy.flush_reads
# One logged read: (unix seconds, the pages it served in order (the last is the deepest), their namespace id hex,
# how many): what `flush` folds into the page records and the namespace counters.
Read = tuple[float, tuple[bytes, ...], str, int]


class AccessRecords:
    """One handle's access log and its quarantine of pages seen corrupt (`corrupt`: misses until dropped)."""

    def __init__(self, conn: Connection, keys: Keys, policy: AccessPolicy, readonly: bool,
                 removals: Removals) -> None:
        self.conn = conn
        self.keys = keys
        self.readonly = readonly
        self.removals = removals
        # `Read` entries. A server away (or full) for long must not grow the log without bound: access figures
        # are approximate, the oldest reads are the ones to forget.
        self.log = AccessLog(policy, keep=MAX_PENDING_FACTOR * policy.flush_reads)
        self.corrupt: dict[bytes, str] = {}  # page -> SHA-1 hex of the bytes that failed their checksum

    def record(self, served: tuple[bytes, ...], ns_hex: str) -> None:
        """Log one read that served `served` (in order) of namespace `ns_hex`; flush when the log is due."""
        # One entry per read: its hit goes to the deepest page it reached, its time to every page it served
        # (kvcache.storage.api: LRU must never evict what was just read, chained or not).
        if self.log.record(time.time(), served, ns_hex, len(served)):
            self.flush()

    def forget(self, pages: Iterable[bytes]) -> None:
        """Drop `pages` from the quarantine: they are gone, and a writer may store them again."""
        with self.conn.lock:
            for h in pages:
                self.corrupt.pop(h, None)

    def forget_all(self) -> None:
        """Empty the quarantine (its pages' namespace was deleted whole)."""
        with self.conn.lock:
            self.corrupt.clear()

    def _take_pending(self) -> tuple[list[Read], dict[bytes, str]]:
        pending = self.log.take()
        with self.conn.lock:
            return pending, dict(self.corrupt)

    def flush(self) -> None:
        """Write logged reads (hit counts, access times) and drop pages seen corrupt (if still the same bytes).
        A fault keeps the log for the next flush and is counted (`flush_errors`); nothing is raised."""
        conn = self.conn
        if self.readonly or conn.closed:
            return
        pending, corrupt = self._take_pending()
        if not pending and not corrupt:
            return
        if not conn.available():
            self.log.restore(pending)
            with conn.lock:
                conn.counts["flush_errors"] += 1
            return
        try:
            self._write_access(conn.client, pending)
            if corrupt:
                self.removals.remove([(h, None, None, "sha", sha) for h, sha in corrupt.items()],
                                     RemovalReason.QUARANTINE)
            conn.ok()
        except (*FAULTS, StoreError) as exc:
            self.log.restore(pending)
            conn.fault("flush_errors", exc)
            return
        with conn.lock:
            for h in corrupt:
                self.corrupt.pop(h, None)
            conn.counts["flushes"] += 1

    def flush_quietly(self) -> None:
        """Flush when there is anything to write (logged reads ride with writes, as in the LMDB backend)."""
        if self.log or self.corrupt:
            self.flush()

    def _write_access(self, client: Any, pending: list[Read]) -> None:
        """Fold logged reads into page records and namespace counters (TOUCH: only records that still exist).
        Each read adds a hit to its deepest page and raises the last access of every page it served."""
        hits: Counter[bytes] = Counter()
        last: dict[bytes, float] = {}
        ns_pages: Counter[str] = Counter()
        ns_last: dict[str, float] = {}
        for when, served, ns_hex, n in pending:
            hits[served[-1]] += 1
            for h in served:
                if last.get(h, 0.0) < when:
                    last[h] = when
            ns_pages[ns_hex] += n
            ns_last[ns_hex] = max(ns_last.get(ns_hex, 0.0), when)
        keys = self.keys
        pipe = client.pipeline(transaction=False)
        self._touch(pipe, [(keys.page(h), hits[h], t) for h, t in last.items()], "h", "a")
        self._touch(pipe, [(keys.namespace(ns_hex), n, ns_last[ns_hex]) for ns_hex, n in ns_pages.items()], "hits",
                    "last")
        pipe.execute()

    def _touch(self, pipe: Any, records: list[tuple[bytes, int, float]], count: str, when: str) -> None:
        """Queue TOUCH calls on `pipe` for (key, increment, time) records: TOUCH_KEYS records a call on a
        standalone server, one on a cluster (a call's keys must share a slot)."""
        conn = self.conn
        step = 1 if conn.cluster else TOUCH_KEYS
        for start in range(0, len(records), step):
            chunk = records[start:start + step]
            args: list[Any] = [count, when]
            for _, inc, t in chunk:
                args += [inc, repr(t)]
            conn.call(conn.touch, [k for k, _, _ in chunk], args, pipe)
