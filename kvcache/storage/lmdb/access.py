"""What an LMDB store handle has seen and not yet written to the store, and how a write transaction folds it in.

Bookkeeping must cost a small fraction of the read it records: a read is logged in memory as one entry, the pages
it served (`AccessLog`), and folded into `meta` by the handle's next `flush` or `put` (`apply_access`: one record
rewritten per chained run, one per page of an unchained one); no access-order index is kept. A page that fails
verification on read is quarantined: a miss in this handle from then on, until that next `flush` or `put` checks
it again and drops it (or finds it rewritten sound meanwhile), or `verify(repair=True)` removes it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import lmdb
import msgspec

from ...errors import StoreError
from ...types.ids import NamespaceId, PageHash
from ..api import AccessPolicy, PageMeta
from ..codec import HEADER, Checksum, decode_meta, decode_or_none, encoder
from ..handle import AccessLog
from ..removals import RemovalReason
from .bookkeeping import NsDelta, adjust_totals, apply_deltas, delta, drop_page
from .removals import record as record_removals

Reads = list[tuple[float, Sequence[bytes], int]]  # logged reads: (unix seconds, the pages served in order, how many)
Taken = tuple[Reads, set[bytes]]  # what one write transaction folds in: the reads and the quarantined pages


class AccessRecords:
    """A handle's logged reads and quarantined pages. A write transaction `take`s both and `fold`s them in; when
    it commits, `unquarantine` releases the pages it handled, and when it fails `restore` gives everything back
    for a later one. Thread-safe."""

    def __init__(self, policy: AccessPolicy, checksum: Checksum, counts: dict[str, int]) -> None:
        self.log = AccessLog(policy)
        # Pages that failed verification here, misses until dropped. The read paths test membership without the
        # lock (a set lookup is atomic under the GIL), and only when the set is not empty.
        self.corrupt: set[bytes] = set()
        self._lock = threading.Lock()  # guards `corrupt`; the log has its own
        self._checksum = checksum
        self._counts = counts  # the handle's counters (kvcache.storage.handle)

    def quarantine(self, page_hash: PageHash) -> None:
        """A page failed verification on read: a miss from now on in this handle, dropped by its next write
        transaction (which checks it again first) or by `verify(repair=True)`."""
        with self._lock:
            self.corrupt.add(page_hash)
        self._counts["checksum_failures"] += 1

    def unquarantine(self, pages: set[bytes]) -> None:
        """`pages` are misses no more: dropped, found sound, or removed by repair (a writer may store them again)."""
        with self._lock:
            self.corrupt -= pages

    def record(self, served: Sequence[bytes], flush: Callable[[], None]) -> None:
        """Log one read that served the pages `served` (in order, the deepest last; one entry per read, see
        `apply_access`), and run `flush` (the handle's) when the policy says one is due."""
        if self.log.record(time.time(), served, len(served)):
            try:
                flush()
            except StoreError:
                # A read must not fail because its bookkeeping could not be written; the log is kept and written
                # by a later flush.
                self._counts["flush_errors"] += 1

    def take(self) -> Taken:
        """Every logged read (the log is emptied) and a copy of the quarantined pages, for one write transaction."""
        reads = self.log.take()
        with self._lock:
            return reads, set(self.corrupt)

    def restore(self, taken: Taken) -> None:
        """Give back what `take` returned: its transaction did not commit."""
        self.log.restore(taken[0])
        with self._lock:
            self.corrupt |= taken[1]

    def reset(self) -> None:
        """Forget every read and quarantined page: in a forked child they are the parent's."""
        with self._lock:
            self.log.clear()
            self.corrupt = set()

    def fold(self, txn: lmdb.Transaction, dbs: Any, taken: Taken, deltas: dict[NamespaceId, NsDelta]) -> tuple[int, int]:
        """Into write transaction `txn`: drop the quarantined pages that still fail, then fold the reads into page
        metadata, registry changes into `deltas`. (pages, bytes) dropped: the caller adjusts the store totals."""
        dropped = drop_corrupt(txn, dbs, self._checksum, taken[1], deltas)
        apply_access(txn, dbs, taken[0], deltas)
        return dropped

    def commit(self, write: Callable[..., Any], body: Callable[[lmdb.Transaction], Any], taken: Taken,
               wanted: int = 0) -> Any:
        """Run `body`, a write transaction that folds `taken` in, through `write` (the handle's); its result.
        `taken` is given back if it does not commit, so the reads are written by a later one."""
        try:
            result = write(body, wanted)
        except BaseException:
            self.restore(taken)
            raise
        self.unquarantine(taken[1])
        return result

    def write_back(self, write: Callable[..., Any], dbs: Any, taken: Taken, fingerprint_key: bytes | None) -> None:
        """`flush`: one write transaction that folds `taken` in and nothing else."""
        def body(txn: lmdb.Transaction) -> None:
            deltas: dict[NamespaceId, NsDelta] = {}
            dropped = self.fold(txn, dbs, taken, deltas)
            apply_deltas(txn, dbs, deltas, time.time(), fingerprint_key)
            if dropped[0]:
                adjust_totals(txn, dbs, -dropped[0], -dropped[1])

        self.commit(write, body, taken)


def apply_access(txn: lmdb.Transaction, dbs: Any, reads: Reads, deltas: dict[NamespaceId, NsDelta]) -> int:
    """Fold logged reads into page metadata and namespace counters; pages updated.

    Every page a read served is credited with the read's time, so LRU never takes a page that was just read: the
    deepest page of the run in its own `last_access`, and each page before it through the page after it when
    that one is its child (a chain: eviction takes leaves only and a parent inherits the time of the child it
    loses, and `children()` reports a page's subtree heat), else in its own `last_access`. A run that ends at a
    token page is a chain (its hashes chain its tokens: `page_origins`), so it rewrites one record, as it always
    did; a run that ends at an engine page is checked link by link (an engine's pages may hang from their root
    side by side), and each page it did not reach through its child is rewritten too. A read counts one hit, at
    the deepest page of its run. Each record is rewritten once per fold however many reads credited it.
    """
    if not reads:
        return 0
    hits: Counter[bytes] = Counter()
    pages: Counter[bytes] = Counter()
    last: dict[bytes, float] = {}
    for when, served, n in reads:  # oldest first: a later read's time replaces an earlier one's
        deepest = served[-1]
        hits[deepest] += 1
        pages[deepest] += n
        last[deepest] = when
    cur = txn.cursor(db=dbs.meta)
    metas = {bytes(k): decode_meta(raw) for k, raw in cur.getmulti(list(last))}  # the pages still stored
    alone = _credited_alone(txn, dbs, reads, metas)
    if alone:
        metas.update((bytes(k), decode_meta(raw)) for k, raw in cur.getmulti([h for h in alone if h not in metas]))
        for h, when in alone.items():
            last[h] = max(last.get(h, when), when)
    updated = []
    for h, meta in metas.items():
        when = max(meta.last_access, last[h])
        n_hits = hits.get(h, 0)
        if n_hits:
            d = delta(deltas, meta.ns_id)
            d.hits += pages[h]
            d.last_access = max(d.last_access, when)
        elif when == meta.last_access:
            continue
        updated.append((h, encoder.encode(msgspec.structs.replace(meta, hits=meta.hits + n_hits, last_access=when))))
    cur.putmulti(updated)
    return len(updated)


def _credited_alone(txn: lmdb.Transaction, dbs: Any, reads: Reads, metas: dict[bytes, PageMeta]) -> dict[bytes, float]:
    """The pages of runs ending at an engine page that the run did not reach through their child (the children
    index does not list the next page of the run under them): page -> the latest read's time."""
    alone: dict[bytes, float] = {}
    links = None
    chained: dict[tuple[bytes, bytes], bool] = {}  # (parent, child) -> linked, looked up once per fold
    for when, served, n in reads:
        deepest = metas.get(served[-1])
        if n < 2 or deepest is None or not deepest.key:
            continue
        links = links or txn.cursor(db=dbs.children)
        child = served[-1]
        for h in served[-2::-1]:
            linked = chained.get((h, child))
            if linked is None:
                linked = chained[(h, child)] = links.set_key_dup(h, child)
            if not linked:
                alone[h] = when
            child = h
    return alone


def drop_corrupt(txn: lmdb.Transaction, dbs: Any, checksum: Checksum, corrupt: set[bytes],
                 deltas: dict[NamespaceId, NsDelta]) -> tuple[int, int]:
    """Drop pages that failed their checksum (rechecked here), each recorded in the removal log as QUARANTINE;
    (pages, bytes) dropped."""
    dropped = freed = 0
    removed: list[tuple[bytes, bytes]] = []
    for h in corrupt:
        value = txn.get(h, db=dbs.pages)
        raw = txn.get(h, db=dbs.meta)
        if value is None or raw is None:
            continue
        meta = decode_or_none(decode_meta, raw)
        if meta is None:
            continue  # metadata that does not decode: verify reports it, repair removes the page
        if len(value) - HEADER == meta.nbytes and checksum.sound(value, h):
            continue  # rewritten since
        drop_page(txn, dbs, h, meta, deltas)
        removed.append((h, meta.ns_id))
        dropped += 1
        freed += meta.nbytes
    record_removals(txn, dbs.removals, removed, RemovalReason.QUARANTINE, time.time())
    return dropped, freed
