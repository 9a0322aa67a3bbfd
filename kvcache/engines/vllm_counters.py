"""What kvc's vLLM tier counts (`TierStats`), how it counts it from the scheduler thread and the I/O threads alike
(`TierCounters`), and the vLLM counters it reports them as (`METRICS`).

vLLM asks for the counters every step, on its scheduler thread: they are read in memory, the store handle's own
counters included, never with store I/O; vLLM's counters are fed increments (`TierCounters.deltas`). A fault is
counted and logged once per new fault (a store gone away fails every job alike), never raised into vLLM.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import msgspec

from ..storage.api import L3Store, StoreCounters

# the logger of the tier's module, the one vLLM loads (what an operator filters the tier's log lines by)
logger = logging.getLogger("kvcache.engines.vllm")


class TierStats(msgspec.Struct, frozen=True):
    """What the tier did since it was built (chunks, not calls), and its store handle's counters."""

    chunks_stored: int = 0  # chunks a cascade wrote new
    chunks_existing: int = 0  # chunks a cascade found stored already (written by anyone before)
    chunks_rejected: int = 0  # chunks the store refused (capacity, quota): their cascade failed
    chunks_loaded: int = 0  # chunks promoted: copied into vLLM's memory and verified
    chunks_missed: int = 0  # chunks a promotion asked for and did not get (absent, corrupt, a fault, a timeout)
    chunks_evicted: int = 0  # chunks of this deployment the store evicted to make room for a cascade
    bytes_written: int = 0  # payload bytes of the chunks stored
    bytes_read: int = 0  # payload bytes of the chunks promoted
    lookups: int = 0  # lookup calls answered
    lookup_hits: int = 0  # ... answered HIT
    store_faults: int = 0  # cascades a store fault ended (failed jobs)
    load_faults: int = 0  # promotions a store fault ended
    load_timeouts: int = 0  # promotions reported failed at their deadline while copying (deferred release)
    lookup_faults: int = 0  # lookups a store fault answered MISS
    cancelled: int = 0  # jobs a drain or shutdown cancelled before they started (reported failed)
    bad_keys: int = 0  # keys that are no engine key (not 1..64 bytes): failed, never stored
    last_fault: str = ""  # the latest fault, one line (never a key or a chunk)
    store: StoreCounters | None = None  # the store handle's own counters (checksum failures, I/O errors, ...)


# TierStats counters (and the store's checksum failures) -> vLLM counter name and help, labelled by vLLM's tier label
METRICS: dict[str, tuple[str, str]] = {
    "chunks_stored": ("vllm:kv_offload_kvc_chunks_stored", "Chunks a cascade wrote new into the kvc store."),
    "chunks_existing": ("vllm:kv_offload_kvc_chunks_existing",
                        "Chunks a cascade found in the kvc store already (left as they were)."),
    "chunks_rejected": ("vllm:kv_offload_kvc_chunks_rejected",
                        "Chunks the kvc store refused (over its capacity or the namespace's share)."),
    "chunks_loaded": ("vllm:kv_offload_kvc_chunks_loaded", "Chunks promoted from the kvc store, checksums verified."),
    "chunks_missed": ("vllm:kv_offload_kvc_chunks_missed",
                      "Chunks a promotion did not get (absent, corrupt, a fault or a timeout)."),
    "checksum_misses": ("vllm:kv_offload_kvc_checksum_misses",
                        "Chunks that failed their checksum when read: never handed to vLLM, quarantined."),
    "chunks_evicted": ("vllm:kv_offload_kvc_chunks_evicted",
                       "Chunks of this deployment the kvc store evicted to make room for a cascade."),
    "bytes_written": ("vllm:kv_offload_kvc_bytes_written", "Payload bytes of the chunks written into the kvc store."),
    "bytes_read": ("vllm:kv_offload_kvc_bytes_read", "Payload bytes of the chunks promoted from the kvc store."),
    "store_faults": ("vllm:kv_offload_kvc_store_faults", "Cascades a kvc store fault failed."),
    "load_faults": ("vllm:kv_offload_kvc_load_faults", "Promotions a kvc store fault failed."),
    "load_timeouts": ("vllm:kv_offload_kvc_load_timeouts",
                      "Promotions reported failed at kvc_load_timeout_s while still copying (release deferred)."),
    "lookup_faults": ("vllm:kv_offload_kvc_lookup_faults", "Lookups a kvc store fault answered as a miss."),
}


class TierCounters:
    """The tier's counters (TierStats' integer fields) and its last fault, under one lock: the scheduler thread and
    the I/O threads count alike. Reads the store handle's own counters beside them (`store`)."""

    __slots__ = ("store", "_lock", "_counts", "_last_fault", "_reported")

    def __init__(self, store: L3Store) -> None:
        self.store = store
        self._lock = threading.Lock()  # guards the counts and `_last_fault`
        self._counts: dict[str, int] = dict.fromkeys(
            (f for f in TierStats.__struct_fields__ if f not in ("last_fault", "store")), 0)
        self._last_fault = ""
        self._reported: dict[str, int] = {}  # the counts at the last `deltas` (vLLM's counters take increments)

    def count(self, **delta: int) -> None:
        """Add `delta` to the counters it names."""
        with self._lock:
            for name, value in delta.items():
                self._counts[name] += value

    def fault(self, counter: str, exc: BaseException) -> None:
        """Count a fault under `counter` and log it: at WARNING when it differs from the last one (a store gone away
        fails every job alike: said once per new fault, not once per job)."""
        fault = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        with self._lock:
            self._counts[counter] += 1
            new, self._last_fault = fault != self._last_fault, fault
        logger.log(logging.WARNING if new else logging.DEBUG, "kvc tier fault (%s): %s", counter, fault)

    def stats(self) -> TierStats:
        """The counters and the store handle's, read in memory (vLLM asks every step: no store I/O)."""
        with self._lock:
            counts, last = dict(self._counts), self._last_fault
        # Every backend's handle keeps its counters in memory (`counters()`); `stats()` would ask the store for
        # its totals, a network round trip on a server, on vLLM's scheduler thread.
        local: Callable[[], StoreCounters] | None = getattr(self.store, "counters", None)
        return TierStats(**counts, last_fault=last, store=local() if local is not None else None)

    def deltas(self, stats: TierStats) -> dict[str, int]:
        """Each counter's increase in `stats` (what `stats()` read) since the last call, the store handle's checksum
        failures as `checksum_misses`; the counters that did not move are left out."""
        now = {f: getattr(stats, f) for f in self._counts}
        now["checksum_misses"] = stats.store.checksum_failures if stats.store is not None else \
            self._reported.get("checksum_misses", 0)
        deltas = {name: value - self._reported.get(name, 0) for name, value in now.items()}
        self._reported = now
        return {name: d for name, d in deltas.items() if d}
