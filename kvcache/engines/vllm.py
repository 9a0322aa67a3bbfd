"""`KvcTier`: kvc's store as a secondary tier of vLLM's KV offloading (vLLM 0.34, `TieringOffloadingSpec`).

Loaded by vLLM itself, out of tree, with no change to vLLM::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 10737418240,
        "secondary_tiers": [{"type": "KvcTier", "module_path": "kvcache.engines.vllm", "kvc_store": "/var/lib/kvc"}]}}'

vLLM keeps its pinned-CPU primary tier and moves the KV between the GPU and it; the tier sees that region as a
`memoryview` of chunk rows and is told which rows to copy to (`submit_store`, a cascade) and from (`submit_load`, a
promotion) the store. The tier's settings (the tier config's other keys):

- `kvc_store`: a kvc store location (a path: LMDB; `redis://...`: the Redis plugin, so several vLLM nodes share one
  L3), default env KVC_STORE. `kvc_store_options`: the backend's own open options, passed as they are (e.g.
  `{"durability": "none"}` for LMDB commits without fsync, as vLLM's `fs` tier writes).
- `kvc_namespace` (default "vllm"): the kvc namespace every chunk of this deployment lives under
  (`Namespace(extra_key=kvc_namespace)`): `kvc ns ls/show/drop`, shares and TTL act on it. The layout names the
  deployment itself (`vllm_deployment`): two deployments that differ in model, KV dtype, parallel sizes, cache
  groups or chunk size never read each other's chunks, whatever namespace they share.
- `kvc_io_threads` (default 2): the threads the tier's I/O runs on (`vllm_io`). `kvc_lookup`: "sync" answers a
  lookup from the store at once (a local LMDB: a B-tree lookup in mapped memory); "async" answers RETRY and
  probes the store on an I/O thread, as vLLM's `fs` tier does (a store across a network: no round trip on
  vLLM's scheduler thread); "auto" (default) is sync for a path and async for a URL. `kvc_load_timeout_s`
  (default 10; 0: none): a promotion still copying after this long is reported failed, its primary chunks held
  by vLLM until the copy ends (`deferred_release`). `enable_kv_events` and `locality` as for vLLM's own tiers.

How vLLM's calls map to the store:

- Keys: an `OffloadKey` (block hash || group index, 4 bytes big-endian) is the page's engine key as it is (36
  bytes with vLLM's sha256, 20 with xxhash); kvc derives the page hash from the key and the namespace/layout root
  alone (`engine_hashes`), so a read needs nothing but the keys. A store job's chunks are linked to their
  predecessor in the same group when vLLM recorded both positions (`ReqContext`), so the store keeps each prefix
  as a chain (`kvc ns show`, leaf-first eviction); otherwise a chunk hangs from the namespace root.
- Never blocking: `lookup` answers from what the tier knows (a verdict per key, kept while a request that asked
  lives), from a local store, or RETRY; `submit_*` queue a job; `get_finished_jobs` collects what the I/O threads
  finished. Every job is reported exactly once. `drain_jobs` cancels queued jobs (reported failed) and waits for
  running ones, so no copy is ever left half-written in vLLM's memory or the store.
- Integrity: a promoted chunk is copied into vLLM's chunk and verified there (the store's checksum); one that
  fails is not among the job's `successful_keys`, its chunk is zeroed before the job is reported (no byte of it
  stays in vLLM's memory), the store quarantines it, and the key is answered MISS from then on (vLLM would promote
  it again every step otherwise). A store fault is a failed job, counted and logged once per new fault; never an
  exception into vLLM's scheduler.
- Capacity: the store's own capacity, quotas, shares and LRU eviction apply. Chunks of this deployment the store
  evicted for a cascade are reported removed through `take_events` (with `enable_kv_events`), so vLLM's KV-event
  consumers stay exact; a stored cascade is reported stored.
- Metrics: kvc's counters (`TierStats`) as vLLM counters under vLLM's tier label; `config_info` names the store
  (credentials redacted), the namespace and the layout.
- Unsupported configurations (a KV dtype kvc cannot name, a region without chunks, unknown settings, a vLLM
  outside VLLM_SUPPORTED) raise one error at construction, never from an I/O call.

vLLM is imported lazily and never by kvc at large: `KvcTier` is built on first access of the module attribute
(`tier_class`), as a subclass of vLLM's `SecondaryTierManager` (vLLM's factory checks that), answering in vLLM's
types (`Vocabulary`). Without vLLM the same class (`VLLMTier`) answers in kvc's stand-ins (`Lookup`, `JobReport`,
`TierEvent`), which is how kvc's tests drive it without vLLM installed.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import msgspec
import numpy as np

from ..errors import EngineUnsupported, InvalidInput, StoreError
from ..storage.api import L3Store, PageOrigin, PageOutcome, StoreCounters, engine_hashes, stored
from ..storage.location import StoreLocation
from ..types.ids import PageHash
from ..types.keys import ENGINE_KEY_MAX, engine_page_hash, hash_root
from ..types.layout import KVLayout
from ..types.namespace import Namespace
from .engine_store import open_engine_store
from .vllm_deployment import ENGINE, Deployment, deployment
from .vllm_io import Done, IOPool, Job, JobKind

logger = logging.getLogger(__name__)

STORE_ENV = "KVC_STORE"  # the store location when the tier config names none
DEFAULT_NAMESPACE = "vllm"  # the kvc namespace (extra_key) of a deployment's chunks when the config names none
VLLM_SUPPORTED = ((0, 34), (0, 35))  # vLLM releases [from, to) whose secondary-tier API this tier speaks
TIER_TYPE = "KvcTier"  # the tier config's "type" (the class name vLLM's factory looks up in this module)
OWNERSHIP = "kvc"  # the events' `ownership`: which offloading tier says a chunk is stored or removed (vLLM's routers
#                    count a block's residency per medium and owner)


class LookupMode(str, enum.Enum):
    """How `lookup` finds out whether the store holds a key it has no verdict for."""

    AUTO = "auto"  # SYNC for a store at a path (LMDB), ASYNC for a URL (a server)
    SYNC = "sync"  # ask the store on the calling thread (a lookup in mapped memory)
    ASYNC = "async"  # answer RETRY and probe on an I/O thread (no network round trip on vLLM's scheduler thread)


class TierConfig(msgspec.Struct, frozen=True):
    """The tier's settings, from the tier config's keys (see the module docstring)."""

    store: str  # kvc store location (path or URL)
    namespace: str  # extra_key of the kvc namespace the chunks live under
    store_options: dict[str, Any]  # the backend's own open options, passed as they are
    io_threads: int  # I/O threads, >= 1
    lookup: LookupMode  # SYNC or ASYNC (AUTO resolved)
    load_timeout_s: float  # seconds a promotion may copy before it is reported failed; inf: no limit
    kv_events: bool  # report stored and evicted chunks through take_events
    locality: str | None  # vLLM's Locality value ("LOCAL"/"REMOTE") for the events, or None


SETTINGS = ("kvc_store", "kvc_namespace", "kvc_store_options", "kvc_io_threads", "kvc_lookup", "kvc_load_timeout_s",
            "enable_kv_events", "locality")


def tier_config(settings: dict[str, Any]) -> TierConfig:
    """Validate the tier config's keys (everything vLLM's factory passes besides its own): InvalidInput naming
    the first that is wrong, before anything is opened."""
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise InvalidInput(f"{TIER_TYPE}: unknown settings {unknown} (it takes {', '.join(SETTINGS)})")
    store = str(settings.get("kvc_store") or os.environ.get(STORE_ENV, "")).strip()
    if not store:
        raise InvalidInput(f"{TIER_TYPE}: no kvc store: set \"kvc_store\" in the tier config or env {STORE_ENV}")
    namespace = settings.get("kvc_namespace", DEFAULT_NAMESPACE)
    if not isinstance(namespace, str) or not namespace.strip():
        raise InvalidInput(f"{TIER_TYPE}: \"kvc_namespace\" must be a non-empty string, got {namespace!r}")
    options = settings.get("kvc_store_options") or {}
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise InvalidInput(f"{TIER_TYPE}: \"kvc_store_options\" must be an object of the store backend's open "
                           f"options, got {options!r}")
    threads = settings.get("kvc_io_threads", 2)
    if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= 64:
        raise InvalidInput(f"{TIER_TYPE}: \"kvc_io_threads\" must be an integer from 1 to 64, got {threads!r}")
    try:
        mode = LookupMode(settings.get("kvc_lookup", LookupMode.AUTO.value))
    except ValueError:
        raise InvalidInput(f"{TIER_TYPE}: \"kvc_lookup\" must be one of {[m.value for m in LookupMode]}, got "
                           f"{settings.get('kvc_lookup')!r}") from None
    if mode is LookupMode.AUTO:
        mode = LookupMode.ASYNC if StoreLocation(store).is_url else LookupMode.SYNC
    timeout = settings.get("kvc_load_timeout_s", 10.0)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 <= timeout < math.inf:
        raise InvalidInput(f"{TIER_TYPE}: \"kvc_load_timeout_s\" must be a finite number of seconds >= 0 (0: no "
                           f"limit), got {timeout!r}")
    locality = settings.get("locality")
    if locality is not None and locality not in ("LOCAL", "REMOTE"):
        raise InvalidInput(f"{TIER_TYPE}: \"locality\" must be LOCAL or REMOTE, got {locality!r}")
    return TierConfig(store=store, namespace=namespace, store_options=options, io_threads=threads, lookup=mode,
                      load_timeout_s=float(timeout) or math.inf, kv_events=bool(settings.get("enable_kv_events")),
                      locality=locality)


# -- what the tier answers in: vLLM's types when it is built on vLLM, kvc's stand-ins when it is not ------------------

class Lookup(enum.Enum):
    """kvc's stand-in for vLLM's `LookupResult` (the values a tier returns)."""

    MISS = "miss"
    HIT = "hit"
    RETRY = "retry"


class JobReport(msgspec.Struct, frozen=True):
    """kvc's stand-in for vLLM's `JobResult`: the same fields, in the same order."""

    job_id: int
    success: bool  # every key succeeded
    successful_keys: tuple[bytes, ...] | None = None  # a failed promotion's keys that did load; None: none did
    transfer_time: float | None = None  # seconds of I/O
    transfer_bytes: int | None = None  # payload bytes moved
    deferred_release: threading.Event | None = None  # set when the I/O of a failed promotion can no longer write


class TierEvent(msgspec.Struct, frozen=True):
    """kvc's stand-in for vLLM's `OffloadingEvent` as a tier makes it."""

    keys: list[bytes]
    medium: str  # "STORAGE"
    removed: bool  # True: the store no longer holds the keys; False: it stored them
    locality: str | None = None
    ownership: str | None = None  # OWNERSHIP
    req_context: Any = None


class RequestPolicy(msgspec.Struct, frozen=True):
    """kvc's stand-in for vLLM's `RequestOffloadingContext`: chunk-level offloading (the default)."""

    policy: str = "chunk_level"


class Vocabulary(msgspec.Struct, frozen=True):
    """The values and types a tier answers vLLM in."""

    hit: Any
    miss: Any
    retry: Any
    job_result: Callable[..., Any]  # JobResult(job_id, success, successful_keys, transfer_time, transfer_bytes,
    #                                 deferred_release)
    event: Callable[..., Any]  # OffloadingEvent(keys=, medium=, removed=, locality=, ownership=, req_context=)
    request_context: Callable[[], Any]  # RequestOffloadingContext()
    medium: Any  # Medium.STORAGE
    locality: Callable[[str], Any]  # "LOCAL"/"REMOTE" -> Locality


STAND_INS = Vocabulary(Lookup.HIT, Lookup.MISS, Lookup.RETRY, JobReport, TierEvent, RequestPolicy, "STORAGE", str)


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


class _Verdicts:
    """What the tier knows of keys a live request asked about: present (True), absent (False) or being probed
    (None). A verdict lives while a request that asked lives (`release`), so it is never stale for long; a stored
    cascade makes its keys present, a failed promotion absent. Scheduler thread only (vLLM's lock)."""

    __slots__ = ("known", "asked", "refs")

    def __init__(self) -> None:
        self.known: dict[bytes, bool | None] = {}
        self.asked: dict[str, set[bytes]] = {}  # req_id -> keys it asked about
        self.refs: dict[bytes, int] = {}  # key -> live requests that asked about it (a finish costs its own keys)

    def note(self, key: bytes, req_id: str, verdict: bool | None) -> None:
        self.known[key] = verdict
        keys = self.asked.setdefault(req_id, set())
        if key not in keys:
            keys.add(key)
            self.refs[key] = self.refs.get(key, 0) + 1

    def settle(self, keys: Iterable[bytes], verdict: bool, only_pending: bool = False) -> None:
        """Set the verdict of `keys` that have one (a probe's answer sets only those still pending)."""
        known = self.known
        for key in keys:
            if key in known and (not only_pending or known[key] is None):
                known[key] = verdict

    def forget_pending(self, keys: Iterable[bytes]) -> None:
        """A probe that never answered: the keys are asked again."""
        for key in keys:
            if key in self.known and self.known[key] is None:
                del self.known[key]

    def release(self, req_id: str) -> None:
        """A request finished: drop the verdicts no other live request asked for."""
        for key in self.asked.pop(req_id, ()):
            left = self.refs[key] - 1
            if left:
                self.refs[key] = left
            else:
                del self.refs[key]
                self.known.pop(key, None)


class VLLMTier:
    """vLLM's SecondaryTierManager interface on a kvc store (see the module docstring). Constructed as vLLM's
    `SecondaryTierFactory` does: `KvcTier(offloading_spec=, primary_kv_view=, tier_type=,
    backpressure_detector=, **tier settings)`."""

    vocabulary: ClassVar[Vocabulary] = STAND_INS
    medium: ClassVar[Any] = "STORAGE"

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, **settings: Any) -> None:
        self.config = tier_config(settings)
        # What vLLM's SecondaryTierManager.__init__ sets, under the same names (its properties read them).
        self._offloading_spec = offloading_spec
        self._primary_kv_view = primary_kv_view
        self._bp_detector = backpressure_detector
        self.tier_type = tier_type
        shape, strides = primary_kv_view.shape, primary_kv_view.strides
        if shape is None or strides is None or len(shape) != 2:
            raise EngineUnsupported(ENGINE, "a primary KV view that is not (chunks, row bytes)")
        self._block_size_bytes: int = strides[0]
        self.locality = None if self.config.locality is None else self.vocabulary.locality(self.config.locality)

        self.deployment: Deployment = deployment(offloading_spec.config, self._block_size_bytes)
        self.layout: KVLayout = self.deployment.layout()
        self.namespace = Namespace(extra_key=self.config.namespace)
        self._rows = primary_kv_view.cast("B")  # the region as flat bytes: chunk c is [c*B, (c+1)*B)
        self._chunks = shape[0]
        self._chunk_tokens = {g.group_id: g.tokens_per_block * self.deployment.blocks_per_chunk
                              for g in self.deployment.groups}
        events_on = bool(getattr(getattr(offloading_spec, "kv_events_config", None), "enable_kv_cache_events",
                                 False))
        if self.config.kv_events and not events_on:
            logger.warning("%s: enable_kv_events is set but vLLM's KV cache events are off: no events", tier_type)
        self._events: list[Any] | None = [] if self.config.kv_events and events_on else None

        store, chain_key = open_engine_store(self.config.store, self.layout, self.config.store_options, TIER_TYPE,
                                             "vLLM")
        self.store: L3Store = store
        self._root = hash_root(self.layout.layout_id, self.namespace, chain_key)
        self._lock = threading.Lock()  # guards the counters and `_last_fault` (the I/O threads count too)
        self._counts: dict[str, int] = dict.fromkeys(
            (f for f in TierStats.__struct_fields__ if f not in ("last_fault", "store")), 0)
        self._last_fault = ""
        self._reported: dict[str, int] = {}  # the counts at the last get_stats (vLLM's counters take deltas)
        self._verdicts = _Verdicts()
        self._probe_batch: list[bytes] = []  # keys to probe, submitted at the step's end (async lookups)
        self._probe_ids = 0
        self._runs: dict[JobKind, Callable[[Job], Done]] = {JobKind.LOOKUP: self._probe, JobKind.LOAD: self._load,
                                                             JobKind.STORE: self._store}
        self._pool = IOPool(self.config.io_threads, lambda job: self._runs[job.kind](job), "kvc-vllm-io")
        self._closed = False
        logger.info("kvc tier on %s: namespace %s, layout %s (%s lookups)", StoreLocation(self.config.store),
                    self.config.namespace, self.layout.describe(), self.config.lookup.value)

    @property
    def block_size_bytes(self) -> int:
        """Bytes of one chunk row (vLLM's primary region's row stride)."""
        return self._block_size_bytes

    @property
    def bp_detector(self) -> Any:
        """vLLM's backpressure detector for this tier, when configured."""
        return self._bp_detector

    # -- the scheduler side: never blocks --------------------------------------------------------------------

    def lookup(self, key: bytes, req_context: Any) -> Any:
        """HIT when the store holds `key`, MISS when it does not (or a promotion of it failed), RETRY while an
        async probe is out."""
        words, known = self.vocabulary, self._verdicts.known
        if key in known:
            verdict = known[key]
            self._verdicts.note(key, req_context.req_id, verdict)  # kept while this request lives too
        else:
            verdict = self._first_look(key, req_context.req_id)
        self._count(lookups=1, lookup_hits=verdict is True)
        return words.hit if verdict is True else words.retry if verdict is None else words.miss

    def _first_look(self, key: bytes, req_id: str) -> bool | None:
        if self.config.lookup is LookupMode.ASYNC:
            self._verdicts.note(key, req_id, None)
            self._probe_batch.append(key)
            return None
        try:
            present = self.store.exists_prefix(self._hashes([key])) == 1
        except Exception as exc:  # a store fault is a miss, counted, never an exception into vLLM
            self._fault("lookup_faults", exc)
            return False  # not noted: asked again next time
        self._verdicts.note(key, req_id, present)
        return present

    def submit_store(self, job_metadata: Any) -> None:
        """Queue a cascade: the job's primary chunks into the store (pages stored already are left as they are)."""
        self._pool.submit(Job(int(job_metadata.job_id), JobKind.STORE, list(job_metadata.keys),
                              [int(c) for c in job_metadata.chunk_ids], job_metadata.req_context))

    def submit_load(self, job_metadata: Any) -> None:
        """Queue a promotion: the store's pages into the job's primary chunks."""
        self._pool.submit(Job(int(job_metadata.job_id), JobKind.LOAD, list(job_metadata.keys),
                              [int(c) for c in job_metadata.chunk_ids], job_metadata.req_context,
                              deadline=time.monotonic() + self.config.load_timeout_s))

    def get_finished_jobs(self) -> list[Any]:
        """Every store and load job finished since the last call, each exactly once; a promotion past its deadline
        reported failed with its deferred release."""
        words, out = self.vocabulary, []
        for job in self._pool.expire(time.monotonic()):
            self._verdicts.settle(job.keys, False)
            self._count(chunks_missed=len(job.keys))
            self._fault("load_timeouts", TimeoutError(f"a promotion of {len(job.keys)} chunks copied for more "
                                                      f"than {self.config.load_timeout_s:g} s"))
            out.append(words.job_result(job.job_id, False, None, time.monotonic() - job.started, None,
                                        job.released))
        for done in self._pool.finished():
            report = self._finish(done)
            if report is not None:
                out.append(report)
        return out

    def _finish(self, done: Done) -> Any:
        job, words = done.job, self.vocabulary
        if job.kind is JobKind.LOOKUP:
            if done.fault:
                self._verdicts.forget_pending(job.keys)
            else:
                for key, present in zip(job.keys, done.ok, strict=True):
                    self._verdicts.settle((key,), present, only_pending=True)
            return None
        if not done.seconds and done.fault:
            self._count(cancelled=1)
        if job.kind is JobKind.STORE:
            stored = [k for k, ok in zip(job.keys, done.ok, strict=True) if ok]
            self._verdicts.settle(stored, True)
            if self._events is not None:
                if stored:
                    self._events.append(words.event(keys=stored, medium=words.medium, removed=False,
                                                    locality=self.locality, ownership=OWNERSHIP, req_context=job.req))
                if done.evicted_keys:
                    self._events.append(words.event(keys=list(done.evicted_keys), medium=words.medium,
                                                    removed=True, locality=self.locality, ownership=OWNERSHIP))
            return words.job_result(job.job_id, all(done.ok), None, done.seconds, done.nbytes, None)
        loaded = tuple(k for k, ok in zip(job.keys, done.ok, strict=True) if ok)
        self._verdicts.settle((k for k, ok in zip(job.keys, done.ok, strict=True) if not ok), False)
        success = len(loaded) == len(job.keys)
        return words.job_result(job.job_id, success, None if success or not loaded else loaded, done.seconds,
                                done.nbytes, None)

    def has_pending_work(self) -> bool:
        """Whether a probe awaits the step's end or any I/O is queued, running or uncollected."""
        return bool(self._probe_batch) or self._pool.busy()

    def take_events(self) -> Iterable[Any]:
        """Chunks stored and evicted since the last call (with `enable_kv_events` and vLLM's KV events on)."""
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events

    def on_new_request(self, req_context: Any) -> Any:
        """Chunk-level offloading: cascade what vLLM stores, as vLLM's own tiers do."""
        return self.vocabulary.request_context()

    def on_request_finished(self, req_context: Any) -> None:
        """Forget the request's verdicts (those no other live request asked for)."""
        self._verdicts.release(req_context.req_id)

    def on_schedule_end(self, context: Any) -> None:
        """Send the step's probes (async lookups) to the I/O threads as one job."""
        if self._probe_batch:
            batch, self._probe_batch = self._probe_batch, []
            self._probe_ids += 1
            self._pool.submit(Job(self._probe_ids, JobKind.LOOKUP, batch, []))

    def serve_external_requests(self, parent: Any) -> None:
        """Nothing to serve: kvc's store is shared through the store itself, not through peers."""

    def drain_jobs(self) -> None:
        """Cancel what has not started (reported failed at the next get_finished_jobs), wait for what runs: then no
        tier I/O touches vLLM's memory and every deferred release is set."""
        self._pool.drain()

    def shutdown(self) -> None:
        """Stop the I/O threads (after a drain), close the store handle, release the views of vLLM's region.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.close()
        try:
            self.store.close()
        finally:
            self._rows.release()

    # -- counters --------------------------------------------------------------------------------------------

    def kvc_stats(self) -> TierStats:
        """The tier's counters and its store handle's, read in memory (vLLM asks every step: no store I/O)."""
        with self._lock:
            counts, last = dict(self._counts), self._last_fault
        # Every backend's handle keeps its counters in memory (`counters()`); `stats()` would ask the store for
        # its totals, a network round trip on a server, on vLLM's scheduler thread.
        local: Callable[[], StoreCounters] | None = getattr(self.store, "counters", None)
        return TierStats(**counts, last_fault=last, store=local() if local is not None else None)

    def stat_deltas(self) -> dict[str, int]:
        """Each counter's increase since the last call (vLLM's counters are fed increments), the store handle's
        checksum failures as `checksum_misses`."""
        stats = self.kvc_stats()
        now = {f: getattr(stats, f) for f in self._counts}
        now["checksum_misses"] = stats.store.checksum_failures if stats.store is not None else \
            self._reported.get("checksum_misses", 0)
        deltas = {name: value - self._reported.get(name, 0) for name, value in now.items()}
        self._reported = now
        return {name: d for name, d in deltas.items() if d}

    def get_stats(self) -> Any:
        """The counters (`kvc_stats`). The class built on vLLM returns vLLM's OffloadingConnectorStats instead:
        the increments since the last call under the tier's label."""
        return self.kvc_stats()

    def config_info(self) -> dict[str, str]:
        """The tier's info-metric labels: the store (credentials redacted), the namespace, the layout id."""
        return {"kvc_store": str(StoreLocation(self.config.store)), "kvc_namespace": self.config.namespace,
                "kvc_layout": self.layout.layout_id.hex()}

    # -- the I/O threads' side -------------------------------------------------------------------------------

    def _hashes(self, keys: Sequence[bytes]) -> list[PageHash]:
        return engine_hashes(self.layout, self.namespace, self.store.chain_key or b"", keys)

    def _chunk(self, chunk_id: int) -> memoryview:
        if not 0 <= chunk_id < self._chunks:
            raise InvalidInput(f"chunk {chunk_id} is outside vLLM's region of {self._chunks} chunks")
        size = self._block_size_bytes
        return self._rows[chunk_id * size:(chunk_id + 1) * size]

    def _probe(self, job: Job) -> Done:
        began = time.monotonic()
        present = []
        try:
            for h in self._hashes(job.keys):
                present.append(self.store.exists_prefix([h]) == 1)
        except Exception as exc:
            self._fault("lookup_faults", exc)
            return Done(job, (False,) * len(job.keys), time.monotonic() - began, fault=str(exc) or "fault")
        return Done(job, tuple(present), time.monotonic() - began)

    def _store(self, job: Job) -> Done:
        began = time.monotonic()
        good = [i for i, k in enumerate(job.keys) if type(k) is bytes and 0 < len(k) <= ENGINE_KEY_MAX]
        if len(good) < len(job.keys):
            self._count(bad_keys=len(job.keys) - len(good))
        ok = [False] * len(job.keys)
        if not good:
            return Done(job, tuple(ok), 0.0)
        order = self._chain_order(job, good)
        keys = [job.keys[i] for i in order]
        hashes = [engine_page_hash(self._root, k) for k in keys]
        origins = [PageOrigin(self.namespace, parent, b"", k) for k, parent in zip(keys, self._parents(job, order),
                                                                                   strict=True)]
        try:
            result = self.store.put(hashes, [self._chunk(job.chunk_ids[i]) for i in order], origins)
        except Exception as exc:
            self._fault("store_faults", exc)
            return Done(job, tuple(ok), time.monotonic() - began, fault=str(exc) or "fault")
        outcomes = result.outcomes or bytes([PageOutcome.REJECTED if result.rejected else PageOutcome.WRITTEN]
                                            * len(keys))
        for i, outcome in zip(order, outcomes, strict=True):
            ok[i] = stored(outcome)
        if result.failed:  # the store could not be written (a server gone): a fault, not a refusal
            self._fault("store_faults", StoreError(str(StoreLocation(self.config.store)),
                                                   f"{result.failed} chunks not written: the store failed"))
        mine = tuple(k for h, k in zip(result.evicted_hashes, result.evicted_keys, strict=False)
                     if k and engine_page_hash(self._root, k) == h)  # only this deployment's chunks are vLLM's
        self._count(chunks_stored=result.written, chunks_existing=result.existing, chunks_rejected=result.rejected,
                    chunks_evicted=len(mine), bytes_written=result.bytes_written)
        return Done(job, tuple(ok), time.monotonic() - began, result.bytes_written, mine)

    def _chain_order(self, job: Job, good: list[int]) -> list[int]:
        """The job's usable keys with each chunk after its predecessor (by vLLM's recorded end-token positions),
        so the store can link it; keys without a position keep their place, after the others."""
        where = getattr(job.req, "get_offload_key_position", None)
        if where is None:
            return good
        pos = {i: where(job.keys[i]) for i in good}
        return sorted(good, key=lambda i: (pos[i] is None, int.from_bytes(job.keys[i][-4:], "big"),
                                           pos[i] if pos[i] is not None else 0))

    def _parents(self, job: Job, order: list[int]) -> list[PageHash]:
        """The parent page hash of each chunk of `order`: its predecessor's (the chunk of the same group that ends
        one chunk earlier) when it is in this job, else the namespace root (the store never needs one)."""
        where = getattr(job.req, "get_offload_key_position", None)
        if where is None:
            return [self._root] * len(order)
        ends: dict[tuple[bytes, int], bytes] = {}
        out: list[PageHash] = []
        for i in order:
            key = job.keys[i]
            group, end = key[-4:], where(key)
            tokens = self._chunk_tokens.get(int.from_bytes(group, "big"))
            prev = ends.get((group, end - tokens)) if end is not None and tokens else None
            out.append(engine_page_hash(self._root, prev) if prev is not None else self._root)
            if end is not None:
                ends[(group, end)] = key
        return out

    def _load(self, job: Job) -> Done:
        began = time.monotonic()
        n = len(job.keys)
        ok = [False] * n
        views: list[memoryview] = []
        fault = ""
        try:
            good = [type(k) is bytes and 0 < len(k) <= ENGINE_KEY_MAX for k in job.keys]
            if not all(good):
                self._count(bad_keys=good.count(False))
            views = [self._chunk(c) for c in job.chunk_ids]
            hashes = [engine_page_hash(self._root, k) if g else b"" for k, g in zip(job.keys, good, strict=True)]
            i = 0
            while i < n:  # get_into stops at the first page it cannot serve: go on past it
                if not good[i]:
                    i += 1
                    continue
                run_end = good.index(False, i) if False in good[i:] else n
                got = self.store.get_into(hashes[i:run_end], views[i:run_end])
                ok[i:i + got] = [True] * got
                i += got + 1
        except Exception as exc:
            self._fault("load_faults", exc)
            fault = str(exc) or "fault"
        finally:
            for view, loaded in zip(views, ok, strict=False):
                if not loaded:  # whatever a failed copy left there is not vLLM's to see: zero it
                    np.frombuffer(view, dtype=np.uint8)[:] = 0
            views = []
        loaded_n = ok.count(True)
        self._count(chunks_loaded=loaded_n, chunks_missed=n - loaded_n,
                    bytes_read=loaded_n * self._block_size_bytes)
        return Done(job, tuple(ok), time.monotonic() - began, loaded_n * self._block_size_bytes, fault=fault)

    def _fault(self, counter: str, exc: BaseException) -> None:
        """Count a fault under `counter` and log it: at WARNING when it differs from the last one (a store gone away
        fails every job alike: said once per new fault, not once per job)."""
        fault = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        with self._lock:
            self._counts[counter] += 1
            new, self._last_fault = fault != self._last_fault, fault
        logger.log(logging.WARNING if new else logging.DEBUG, "kvc tier fault (%s): %s", counter, fault)

    def _count(self, **delta: int) -> None:
        with self._lock:
            for name, value in delta.items():
                self._counts[name] += value


# -- KvcTier: built on first access, on vLLM's SecondaryTierManager when vLLM is installed ---------------------------

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
INFO_LABELS = ("kvc_store", "kvc_namespace", "kvc_layout")  # config_info's label names

_class_lock = threading.Lock()
_tier_class: type[VLLMTier] | None = None


def _vllm_version() -> tuple[int, int] | None:
    """The installed vLLM's (major, minor), None when its version cannot be read."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        parts = version("vllm").split(".")
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (PackageNotFoundError, ValueError, IndexError):
        return None


def _tier_label(tier: VLLMTier) -> tuple[str]:
    """vLLM's tier label of this tier ("<index + 1>:<type>", as vLLM's tiering metrics name it): the position of
    the first secondary tier config of its type on its store."""
    configs = getattr(tier._offloading_spec, "secondary_tier_configs", None) or []
    for i, config in enumerate(configs):
        if isinstance(config, dict) and config.get("type") == tier.tier_type and \
                (config.get("kvc_store") or os.environ.get(STORE_ENV, "")).strip() == tier.config.store:
            return (f"{i + 1}:{tier.tier_type}",)
    return (tier.tier_type,)


def _vllm_get_stats(self: VLLMTier) -> Any:
    """vLLM's OffloadingConnectorStats: the increments of kvc's counters since the last call, under the tier's
    label; None when nothing changed."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

    deltas = self.stat_deltas()
    if not deltas:
        return None
    stats, label = OffloadingConnectorStats(), _tier_label(self)
    for field, delta in deltas.items():
        if field in METRICS:
            stats.increase_counter(METRICS[field][0], delta, label)
    return stats


def _vllm_metric_definitions(cls: type, extra_config: dict[str, Any]) -> dict[str, Any]:
    """The Prometheus counters the tier emits (METRICS), each labelled by vLLM's tier label."""
    from vllm.v1.kv_offload.base import OffloadingCounterMetadata
    from vllm.v1.kv_offload.tiering.base import TIER_LABEL

    return {name: OffloadingCounterMetadata(documentation=doc, labelnames=(TIER_LABEL,))
            for name, doc in METRICS.values()}


def _vllm_config_info_keys(cls: type, tier_config: dict[str, Any]) -> tuple[str, ...]:
    """config_info's label names."""
    return INFO_LABELS


def tier_class() -> type[VLLMTier]:
    """The class vLLM loads as `kvcache.engines.vllm.KvcTier`: a subclass of vLLM's `SecondaryTierManager` (and of
    `VLLMTier`) answering in vLLM's types when vLLM is installed, `VLLMTier` in kvc's stand-ins when it is not.
    Built once, on first use. EngineUnsupported for a vLLM outside VLLM_SUPPORTED (its tier API is experimental and
    moved between 0.32 and 0.34)."""
    global _tier_class
    with _class_lock:
        if _tier_class is None:
            body: dict[str, Any] = {"__doc__": VLLMTier.__doc__, "__module__": __name__, "__qualname__": TIER_TYPE}
            try:
                from vllm.v1.kv_offload.base import (
                    Locality,
                    LookupResult,
                    Medium,
                    OffloadingEvent,
                    RequestOffloadingContext,
                )
                from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager
            except ModuleNotFoundError as exc:
                if not (exc.name or "").startswith("vllm"):
                    raise  # vLLM is there but broken: say so, do not run without it
                bases: tuple[type, ...] = (VLLMTier,)
            else:
                found = _vllm_version()
                low, high = VLLM_SUPPORTED
                if found is None or not low <= found < high:
                    shown = "an unknown version" if found is None else f"{found[0]}.{found[1]}"
                    raise EngineUnsupported(ENGINE, f"vLLM {shown} (kvc's tier speaks vLLM {low[0]}.{low[1]}.x: the "
                                                    f"secondary-tier API is experimental and changes between releases)")
                bases = (VLLMTier, SecondaryTierManager)
                body.update(
                    medium=Medium.STORAGE,
                    vocabulary=Vocabulary(LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY, JobResult,
                                          OffloadingEvent, RequestOffloadingContext, Medium.STORAGE, Locality),
                    get_stats=_vllm_get_stats,
                    build_metric_definitions=classmethod(_vllm_metric_definitions),
                    config_info_keys=classmethod(_vllm_config_info_keys))
            _tier_class = type(TIER_TYPE, bases, body)
        return _tier_class


def __getattr__(name: str) -> type[VLLMTier]:
    if name == TIER_TYPE:
        return tier_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
