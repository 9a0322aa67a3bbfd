"""The I/O threads' side of kvc's vLLM tier (`ChunkIO`): the jobs `vllm_io` runs, each copying between vLLM's
primary region and the store, or asking the store what it holds.

vLLM's primary tier is a region of chunk rows (`block_size_bytes` each, alignment padding included); the tier sees
it as a `memoryview` and copies whole rows:

- a cascade (STORE) writes the job's rows as pages keyed by their `OffloadKey`s, each chunk linked to its
  predecessor in the same KV cache group when vLLM recorded both positions (`ReqContext`), so the store keeps each
  prefix as a chain; a key that is no engine key is never stored; the chunks of this deployment the store evicted
  to make room are handed back to be reported removed;
- a promotion (LOAD) copies pages into the job's rows, verified there (the store's checksum); a row that did not
  load is zeroed before the job is reported, so no byte of a failed copy stays in vLLM's memory;
- a probe (LOOKUP, async lookups) asks the store which keys it holds.

A store fault ends the job as a fault (counted, logged once per new fault: `vllm_counters`), never an exception into
vLLM's threads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from ..errors import InvalidInput, StoreError
from ..storage.api import L3Store, PageOrigin, PageOutcome, engine_hashes, stored
from ..storage.location import StoreLocation
from ..types.ids import PageHash
from ..types.keys import ENGINE_KEY_MAX, engine_page_hash
from ..types.layout import KVLayout
from ..types.namespace import Namespace
from .vllm_counters import TierCounters
from .vllm_io import Done, Job, JobKind

_NO_HASH = PageHash(b"")  # stands for a page whose key is no engine key (never asked of the store)


class ChunkIO:
    """The copies and probes of one tier between vLLM's primary `region` and `store` (see the module docstring):
    `run(job)` is what the I/O threads call. Owns the region's flat byte view (`release` when the tier shuts down);
    counts into the tier's `counters`."""

    def __init__(self, store: L3Store, layout: KVLayout, namespace: Namespace, root: PageHash, region: memoryview,
                 block_size_bytes: int, chunk_tokens: dict[int, int], counters: TierCounters, location: str) -> None:
        self.store = store
        self.layout = layout
        self.namespace = namespace
        self._root = root  # the namespace/layout root every page of this deployment hangs from
        self._rows = region.cast("B")  # the region as flat bytes: chunk c is [c*B, (c+1)*B)
        self._chunks = len(region)
        self._block_size_bytes = block_size_bytes
        self._chunk_tokens = chunk_tokens  # KV cache group -> tokens of one chunk
        self._location = location  # the store's location, as the tier config gives it (named in faults)
        self._count = counters.count
        self._fault = counters.fault
        self._runs: dict[JobKind, Callable[[Job], Done]] = {JobKind.LOOKUP: self._probe, JobKind.LOAD: self._load,
                                                             JobKind.STORE: self._store}

    def run(self, job: Job) -> Done:
        """Do `job` (on an I/O thread): its outcome, a store fault included."""
        return self._runs[job.kind](job)

    def release(self) -> None:
        """Release the view of vLLM's region (after the last job ran)."""
        self._rows.release()

    def hashes(self, keys: Sequence[bytes]) -> list[PageHash]:
        """The page hashes of engine keys `keys` under this deployment's layout and namespace."""
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
            for h in self.hashes(job.keys):
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
            self._fault("store_faults", StoreError(str(StoreLocation(self._location)),
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
            hashes = [engine_page_hash(self._root, k) if g else _NO_HASH for k, g in zip(job.keys, good, strict=True)]
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
