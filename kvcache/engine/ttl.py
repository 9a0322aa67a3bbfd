"""Namespace time to live: which namespaces are due to expire, and when (DESIGN §7b).

The policy is data (`config.TTLPolicy`); this tracker applies it, and `TieredCache` acts on what it says. The rules:

- **Tracked from first use.** A namespace is tracked from its first *use*: an `admit` or a `prefetch` of one of
  its requests (a `match` is a look, not a use). Its TTL is the request's `ttl_s` clamped to `max_ttl_s`, or
  `default_ttl_s`; a later request that asks for a `ttl_s` replaces it, one that asks for none keeps it.
- **Sliding or absolute.** SLIDING: deadline = last use + TTL, every use pushes it out. ABSOLUTE: deadline = first
  use + TTL, later uses leave it where it is.
- **Expiry** is `TieredCache.drop_namespace`: the namespace's L1 and L2 pages are freed without being written back,
  its prefetches and staged records are given back, its L3 pages are deleted (synchronously: nothing is marked and
  left for later, so a store shared with other processes stops serving it at once). It runs from `poll`, which
  sweeps at most every `sweep_interval_s`; a use of a namespace whose deadline has passed before the sweep saw it
  expires it first, so the use starts from nothing, exactly as if the sweep had run: expiry is exact at uses and
  at most `sweep_interval_s` late otherwise.
- **Deferred on lock.** A namespace with running requests (admitted, not yet committed or released: they lock its
  prefix) is not dropped: its expiry is deferred until the last of them ends, and the first `poll` after that
  drops it (whatever the sweep interval).
- **Cancelled by reuse.** A use of a namespace whose expiry is deferred cancels the deferral and re-arms the
  deadline from now — in ABSOLUTE mode too: the namespace starts a new life, as if first used now.
- **Overflow.** Tracking a namespace beyond `max_namespaces` expires the others closest to their deadline first
  (never the one being used). One with running requests is deferred instead and stays tracked, so while deferred
  expiries wait the count may stay above the bound.
- **On demand.** `TieredCache.expire_namespace` (`kvc ns expire`) expires one namespace now, by the same rules.

Deadlines run on the tracker's clock (`time.monotonic` unless one is injected: tests use a fake clock) and live in
this process only: they are not persisted, so a namespace that only L3 holds (written before a restart, or by
another process) is tracked from its next use here.

The deadlines are kept in a lazy min-heap: an entry's heap item never has a later deadline than the entry, so a
sliding use (a later deadline) costs no heap push; a popped item earlier than its entry is pushed again at the
entry's deadline. Stale items are skipped by sequence number and the heap is rebuilt when they outnumber the live
ones.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable

from ..types.config import TTLMode, TTLPolicy
from ..types.fingerprint_key import FingerprintKey
from ..types.ids import NamespaceId
from ..types.namespace import Namespace
from ..types.results import ExpiryCause, NamespaceTTL
from ..types.stats import TTLStats, bump


class TTLEntry:
    """One tracked namespace (mutable: the tracker's own record)."""

    __slots__ = ("namespace", "ttl_s", "first_use", "last_use", "deadline", "heap_deadline", "seq", "deferred")

    def __init__(self, namespace: Namespace, ttl_s: float, now: float) -> None:
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.first_use = self.last_use = now
        self.deadline = now + ttl_s
        self.heap_deadline = math.inf  # deadline of its current heap item (none yet)
        self.seq = -1  # sequence number of its current heap item
        self.deferred: ExpiryCause | None = None


class TTLTracker:
    """Deadlines of the namespaces a cache has used, per a `TTLPolicy`. Says what is due; the cache drops it."""

    def __init__(self, policy: TTLPolicy, clock: Callable[[], float] = time.monotonic, *,
                 fingerprints: FingerprintKey) -> None:
        """`fingerprints`: the key the views show namespaces under (the cache's)."""
        self.policy = policy
        self.fingerprints = fingerprints
        self.clock = clock
        self.stats = TTLStats()
        self.deferred: dict[NamespaceId, TTLEntry] = {}  # ns id -> entry whose expiry waits for its running requests
        self.ready: dict[NamespaceId, TTLEntry] = {}  # of those, the ones whose last running request ended
        self.next_sweep = -math.inf
        self._entries: dict[NamespaceId, TTLEntry] = {}
        self._heap: list[tuple[float, int, NamespaceId]] = []  # (deadline, seq, ns id); lazy, see the module docstring
        self._seq = 0
        self._sliding = policy.mode is TTLMode.SLIDING

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, namespace: Namespace) -> bool:
        return namespace.id in self._entries

    # --- what the cache tells it -------------------------------------------------------------------------------

    def overdue(self, namespace: Namespace, now: float) -> bool:
        """Is `namespace` tracked, past its deadline and not yet expired or deferred (the sweep has not run)?"""
        entry = self._entries.get(namespace.id)
        return entry is not None and entry.deferred is None and entry.deadline <= now

    def use(self, namespace: Namespace, ttl_s: float | None, now: float) -> bool:
        """A request of `namespace` asking for `ttl_s` (None: keep the namespace's) was admitted or prefetched at
        `now`. Starts tracking it, or moves its deadline per the mode; cancels a deferred expiry (re-armed from
        now). True when more namespaces than the policy's bound are tracked now (see `overflow`)."""
        entry = self._entries.get(namespace.id)
        if entry is None:
            entry = self._entries[namespace.id] = TTLEntry(namespace, self.policy.clamp(ttl_s), now)
            self._push(entry)
            return len(self._entries) > self.policy.max_namespaces
        if ttl_s is not None:
            entry.ttl_s = self.policy.clamp(ttl_s)
        entry.last_use = now
        if entry.deferred is not None:
            del self.deferred[namespace.id]
            self.ready.pop(namespace.id, None)
            entry.deferred = None
            entry.first_use = now  # a new life: in ABSOLUTE mode the deadline runs from this use
            self.stats.cancelled += 1
            entry.heap_deadline = math.inf  # its heap items were dropped when it was deferred
        entry.deadline = (now if self._sliding else entry.first_use) + entry.ttl_s
        if entry.deadline < entry.heap_deadline:
            self._push(entry)
            if len(self._heap) > 2 * len(self._entries) + 64:
                self._rebuild()
        return False

    def defer(self, namespace: Namespace, cause: ExpiryCause) -> TTLEntry:
        """`namespace` is due but running requests lock its prefix: it waits for `ended` (tracked from now when it
        was not tracked: an on-demand expiry of a namespace used before the policy saw it)."""
        entry = self._entries.get(namespace.id)
        if entry is None:
            now = self.clock()
            entry = self._entries[namespace.id] = TTLEntry(namespace, self.policy.default_ttl_s, now)
        if entry.deferred is None:
            self.stats.deferred += 1
        entry.deferred = cause
        self.deferred[namespace.id] = entry
        return entry

    def ended(self, namespace: Namespace) -> None:
        """The last running request of deferred `namespace` ended: the next `poll` expires it."""
        entry = self.deferred.get(namespace.id)
        if entry is not None:
            self.ready[namespace.id] = entry

    def expired(self, namespace: Namespace, cause: ExpiryCause, device_pages: int, host_pages: int,
                store_pages: int, store_bytes: int) -> None:
        """`namespace` was dropped from every tier: stop tracking it and count what it freed."""
        ns_id = namespace.id
        self._entries.pop(ns_id, None)
        self.deferred.pop(ns_id, None)
        self.ready.pop(ns_id, None)
        st = self.stats
        bump(st.expired, cause.value)
        st.device_pages += device_pages
        st.host_pages += host_pages
        st.store_pages += store_pages
        st.store_bytes += store_bytes
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._rebuild()

    # --- what it tells the cache -------------------------------------------------------------------------------

    def sweep_due(self, now: float) -> bool:
        """Is a sweep for expired namespaces due at `now`? Starts the next interval when it is."""
        if now < self.next_sweep:
            return False
        self.next_sweep = now + self.policy.sweep_interval_s
        return True

    def due(self, now: float) -> list[TTLEntry]:
        """The namespaces whose deadline is at or before `now` and that wait for nothing, earliest first. Their
        heap items are consumed: the cache expires or defers each of them."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            entry = self._pop_accurate()
            if entry is not None:
                out.append(entry)
        return out

    def overflow(self, keep: Namespace) -> list[TTLEntry]:
        """The namespaces to expire so that no more than `max_namespaces` are tracked: closest to their deadline
        first, never `keep` (the one being used) nor one already deferred."""
        excess = len(self._entries) - self.policy.max_namespaces
        out: list[TTLEntry] = []
        kept = None
        while len(out) < excess and self._heap:
            entry = self._pop_accurate()
            if entry is None:
                continue
            if entry.namespace.id == keep.id:
                kept = entry
            else:
                out.append(entry)
        if kept is not None:
            self._push(kept)
        return out

    def take_ready(self) -> list[TTLEntry]:
        """Deferred namespaces whose running requests have all ended (the cache expires them now)."""
        out = list(self.ready.values())
        self.ready.clear()
        return out

    def views(self, now: float) -> list[NamespaceTTL]:
        """Every tracked namespace's TTL, soonest deadline first."""
        entries = sorted(self._entries.values(), key=lambda e: e.deadline)
        fp = self.fingerprints
        return [NamespaceTTL(fp.info(e.namespace), fp.display_id(e.namespace.id), e.ttl_s, e.first_use, e.last_use,
                             e.deadline, e.deadline - now, e.deferred) for e in entries]

    def snapshot_stats(self) -> TTLStats:
        """The counters, with `tracked` as of now."""
        self.stats.tracked = len(self._entries)
        return self.stats

    # --- the heap ----------------------------------------------------------------------------------------------

    def _push(self, entry: TTLEntry) -> None:
        self._seq += 1
        entry.seq, entry.heap_deadline = self._seq, entry.deadline
        heapq.heappush(self._heap, (entry.deadline, self._seq, entry.namespace.id))

    def _pop_accurate(self) -> TTLEntry | None:
        """Pop the heap's first item: its entry when the item is current and accurate; None when it was stale, or
        early (then the entry is pushed again at its real deadline)."""
        deadline, seq, ns_id = heapq.heappop(self._heap)
        entry = self._entries.get(ns_id)
        if entry is None or entry.seq != seq or entry.deferred is not None:
            return None
        entry.heap_deadline = math.inf
        if entry.deadline > deadline:  # a sliding use moved it out since this item was pushed
            self._push(entry)
            return None
        return entry

    def _rebuild(self) -> None:
        self._heap = []
        for entry in self._entries.values():
            entry.heap_deadline = math.inf
            if entry.deferred is None:
                self._push(entry)
