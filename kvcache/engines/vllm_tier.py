"""`VLLMTier`: vLLM's secondary-tier interface (`SecondaryTierManager`) on a kvc store, the scheduler's side of it.

vLLM calls a secondary tier from its scheduler thread and the tier never blocks there (the module vLLM loads,
`kvcache.engines.vllm`, says what each call means for the store): `lookup` answers from what the tier knows
(`Verdicts`), from a local store, or RETRY; `submit_store` and `submit_load` queue a job for the I/O threads
(`vllm_io`), which run it (`vllm_chunks.ChunkIO`); `get_finished_jobs` reports what they finished, each job exactly
once, a promotion past its deadline failed with its deferred release; `take_events` hands over the chunks stored and
evicted; `kvc_stats` and `stat_deltas` read the counters (`vllm_counters`). The tier builds its parts in its
constructor: settings (`vllm_config`), deployment layout (`vllm_deployment`), store, counters, chunk I/O, verdicts,
I/O threads.

This class answers in kvc's stand-ins for vLLM's types (`vllm_vocabulary`); `kvcache.engines.vllm.tier_class` builds
`KvcTier` on it and on vLLM's own base class, answering in vLLM's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any, ClassVar

from ..errors import EngineUnsupported
from ..storage.api import L3Store
from ..storage.location import StoreLocation
from ..types.keys import hash_root
from ..types.layout import KVLayout
from ..types.namespace import Namespace
from .engine_store import open_engine_store
from .vllm_chunks import ChunkIO
from .vllm_config import TIER_TYPE, LookupMode, tier_config
from .vllm_counters import TierCounters, TierStats
from .vllm_deployment import ENGINE, Deployment, deployment
from .vllm_io import Done, IOPool, Job, JobKind
from .vllm_verdicts import Verdicts
from .vllm_vocabulary import OWNERSHIP, STAND_INS, Vocabulary

# the logger of the tier's module, the one vLLM loads (what an operator filters the tier's log lines by)
logger = logging.getLogger("kvcache.engines.vllm")


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
        chunk_tokens = {g.group_id: g.tokens_per_block * self.deployment.blocks_per_chunk
                        for g in self.deployment.groups}
        events_on = bool(getattr(getattr(offloading_spec, "kv_events_config", None), "enable_kv_cache_events",
                                 False))
        if self.config.kv_events and not events_on:
            logger.warning("%s: enable_kv_events is set but vLLM's KV cache events are off: no events", tier_type)
        self._events: list[Any] | None = [] if self.config.kv_events and events_on else None

        store, chain_key = open_engine_store(self.config.store, self.layout, self.config.store_options, TIER_TYPE,
                                             "vLLM")
        self.store: L3Store = store
        self._counters = TierCounters(store)  # counted by this thread and the I/O threads alike
        self._count, self._fault = self._counters.count, self._counters.fault
        root = hash_root(self.layout.layout_id, self.namespace, chain_key)  # every chunk's page hangs from it
        self._io = ChunkIO(store, self.layout, self.namespace, root, primary_kv_view, self._block_size_bytes,
                           chunk_tokens, self._counters, self.config.store)
        self._verdicts = Verdicts()
        self._probe_batch: list[bytes] = []  # keys to probe, submitted at the step's end (async lookups)
        self._probe_ids = 0
        self._pool = IOPool(self.config.io_threads, self._io.run, "kvc-vllm-io")
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
            present = self.store.exists_prefix(self._io.hashes([key])) == 1
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
            self._io.release()

    # -- counters --------------------------------------------------------------------------------------------

    def kvc_stats(self) -> TierStats:
        """The tier's counters and its store handle's, read in memory (vLLM asks every step: no store I/O)."""
        return self._counters.stats()

    def stat_deltas(self) -> dict[str, int]:
        """Each counter's increase since the last call (vLLM's counters are fed increments), the store handle's
        checksum failures as `checksum_misses`."""
        return self._counters.deltas(self.kvc_stats())

    def get_stats(self) -> Any:
        """The counters (`kvc_stats`). The class built on vLLM returns vLLM's OffloadingConnectorStats instead:
        the increments since the last call under the tier's label."""
        return self.kvc_stats()

    def config_info(self) -> dict[str, str]:
        """The tier's info-metric labels: the store (credentials redacted), the namespace, the layout id."""
        return {"kvc_store": str(StoreLocation(self.config.store)), "kvc_namespace": self.config.namespace,
                "kvc_layout": self.layout.layout_id.hex()}
