"""Stand-ins for what vLLM 0.34 hands a secondary tier, and for the manager that drives it, so kvc's tier
(`kvcache.engines.vllm`) is tested without vLLM.

- `offloading_config` / `Spec`: vLLM's `OffloadingConfig` and the spec a tier gets (`offloading_spec`), with the
  same attribute names (the tier reads them by attribute).
- `Region`: vLLM's pinned-CPU primary region: `(chunks, row bytes)` of real memory, seen as a 2-D memoryview.
- `Request`: vLLM's `ReqContext` (req_id and the end-token positions the scheduler records per key).
- `Manager`: the calls vLLM's `TieringOffloadingManager` makes on one secondary tier, in its order, with its
  checks: a cascade (`submit_store`) pins its primary chunks until reported; a promotion allocates chunks at the
  HIT and submits one batched `submit_load` at the step's end; `get_finished_jobs` must report each job exactly
  once with `successful_keys` a subset of its keys; a failed promotion's chunks go back to the free list at once,
  or when its `deferred_release` is set; `drain` calls `drain_jobs` and then expects every job reported and every
  deferred release set (vLLM's `reset_cache` asserts both).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcache.engines.vllm_vocabulary import Lookup

WAIT_S = 120.0  # how long `Manager.wait` polls for reports before failing the test (a hung tier, not a slow one)


@dataclass(frozen=True)
class Group:
    group_id: int
    tokens_per_block: int
    layer_names: tuple[str, ...]
    sliding_window_size_in_chunks: int | None = None


@dataclass(frozen=True)
class Model:
    name: str
    dtype: str
    max_model_len: int = 0


@dataclass(frozen=True)
class Cache:
    tokens_per_hash: int
    blocks_per_chunk: int


@dataclass(frozen=True)
class Parallel:
    rank: int = 0
    world_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    data_parallel_index: int = 0
    data_parallel_size: int = 1
    data_parallel_rank_local: int | None = None
    is_parallelism_agnostic: bool = False


@dataclass(frozen=True)
class OffloadingConfig:
    groups: tuple[Group, ...]
    worker_kv_bytes_per_block: int
    enable_kv_cache_events: bool
    extra_config: dict
    engine_id: str
    model: Model
    cache: Cache
    parallel: Parallel
    replicated_layout: bool = False
    canonical_layout: bool = False
    kv_cache_layout: str | None = None


def offloading_config(model: str = "Qwen/Qwen3-0.6B", dtype: str = "bfloat16", tp: int = 1, layers: int = 4,
                      tokens_per_block: int = 16, blocks_per_chunk: int = 1, groups: int = 1,
                      events: bool = True, **kw: Any) -> OffloadingConfig:
    """vLLM's OffloadingConfig of a small deployment (the fields a tier reads)."""
    return OffloadingConfig(
        groups=tuple(Group(g, tokens_per_block, tuple(f"model.layers.{g}.{i}.attn" for i in range(layers)))
                     for g in range(groups)),
        worker_kv_bytes_per_block=1024, enable_kv_cache_events=events, extra_config={}, engine_id="e0",
        model=Model(model, dtype), cache=Cache(tokens_per_block, blocks_per_chunk),
        parallel=Parallel(world_size=tp, tp_size=tp), **kw)


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool
    self_describing_kv_events: bool = False


@dataclass
class Spec:
    """The `offloading_spec` a tier gets: its config, the events switch, the tier configs."""

    config: OffloadingConfig
    secondary_tier_configs: list[dict] = field(default_factory=list)

    @property
    def kv_events_config(self) -> KVEventsConfig:
        return KVEventsConfig(self.config.enable_kv_cache_events)


class Region:
    """vLLM's CPU primary region: `chunks` rows of `row_bytes` real bytes, and the 2-D memoryview tiers get."""

    def __init__(self, chunks: int, row_bytes: int) -> None:
        self.array = np.zeros((chunks, row_bytes), dtype=np.int8)  # vLLM's region is int8, (chunks, row stride)
        self.view = memoryview(self.array)
        self.chunks, self.row_bytes = chunks, row_bytes

    def write(self, chunk: int, data: bytes) -> None:
        self.array[chunk] = np.frombuffer(data, dtype=np.int8)

    def read(self, chunk: int) -> bytes:
        return self.array[chunk].tobytes()


@dataclass
class Request:
    """vLLM's ReqContext: a req_id and the end-token positions the scheduler records for its keys."""

    req_id: str
    positions: dict[bytes, int] = field(default_factory=dict)

    def get_offload_key_position(self, key: bytes) -> int | None:
        return self.positions.get(key)


@dataclass
class TransferJob:
    """vLLM's TransferJob."""

    job_id: int
    keys: list[bytes]
    chunk_ids: np.ndarray
    is_promotion: bool
    req_context: Request
    submit_time: float = field(default_factory=time.monotonic)


def _name(result: Any) -> str:
    """A tier's lookup answer as a name (kvc's stand-in Lookup or vLLM's LookupResult)."""
    return result.name if isinstance(result, Lookup) else str(getattr(result, "name", result))


def offload_key(block_hash: bytes, group: int = 0) -> bytes:
    """vLLM's make_offload_key: block hash || group index (4 bytes, big-endian)."""
    return block_hash + group.to_bytes(4, "big")


def chunk_bytes(tag: str, i: int, size: int) -> bytes:
    """Distinct chunk contents, the same in every process."""
    seed = int.from_bytes(hashlib.blake2b(f"{tag}-{i}".encode(), digest_size=8).digest(), "big")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


class ContractBroken(AssertionError):
    """The tier broke vLLM's contract (a job reported twice, unknown keys, a deferred release never set)."""


class Manager:
    """vLLM's TieringOffloadingManager as one secondary tier meets it (see the module docstring)."""

    def __init__(self, tier: Any, region: Region) -> None:
        self.tier, self.region = tier, region
        self.free = list(range(region.chunks))
        self.ready: dict[bytes, int] = {}  # key -> chunk holding it (stored or promoted)
        self.jobs: dict[int, TransferJob] = {}  # submitted, not yet reported
        self.reports: dict[int, Any] = {}  # every report, by job id
        self.pending: dict[str, list[tuple[bytes, int]]] = {}  # req_id -> promotions to submit at the step's end
        self.pending_req: dict[str, Request] = {}
        self.deferred: dict[int, tuple[Any, list[int]]] = {}  # job id -> (event, chunks held until it is set)
        self.events: list[Any] = []
        self._ids = 0

    def _job(self, keys: list[bytes], chunks: list[int], promotion: bool, req: Request) -> TransferJob:
        job = TransferJob(self._ids, keys, np.array(chunks, dtype=np.int32), promotion, req)
        self._ids += 1
        self.jobs[job.job_id] = job
        return job

    def request(self, req_id: str, keys: list[bytes] | None = None, tokens_per_chunk: int = 16) -> Request:
        """A new request (`on_new_request`), its keys' end-token positions recorded in order."""
        req = Request(req_id, {k: (i + 1) * tokens_per_chunk for i, k in enumerate(keys or [])})
        self.tier.on_new_request(req)
        return req

    def cascade(self, keys: list[bytes], data: list[bytes], req: Request) -> int:
        """GPU -> primary done for `keys`: their chunks hold `data`; cascade them to the tier (`submit_store`)."""
        chunks = []
        for key, payload in zip(keys, data, strict=True):
            chunk = self.free.pop()
            self.region.write(chunk, payload)
            self.ready[key] = chunk
            chunks.append(chunk)
        job = self._job(list(keys), chunks, False, req)
        self.tier.submit_store(job)
        return job.job_id

    def lookup(self, key: bytes, req: Request) -> str:
        """vLLM's lookup: "HIT" when the primary tier holds the key, "HIT_PENDING" while a promotion of it is out;
        else the tier is asked, and its HIT starts a promotion ("HIT_PENDING"); "MISS" or "RETRY" otherwise."""
        if key in self.ready:
            return "HIT"
        if any(key == k for items in self.pending.values() for k, _ in items) or any(
                job.is_promotion and key in job.keys for job in self.jobs.values()):
            return "HIT_PENDING"
        result = _name(self.tier.lookup(key, req))
        if result == "HIT":
            chunk = self.free.pop()
            self.pending.setdefault(req.req_id, []).append((key, chunk))
            self.pending_req[req.req_id] = req
            return "HIT_PENDING"
        return result

    def scan(self, keys: list[bytes], req: Request) -> int | None:
        """vLLM's scheduler over a prompt's keys (`_maximal_prefix_lookup`): how many from the start hit, or None
        when a lookup was deferred (RETRY: scan again next step)."""
        hits, deferred = 0, False
        for key in keys:
            result = self.lookup(key, req)
            if result in ("HIT", "HIT_PENDING"):
                hits += 1
            elif result == "RETRY":
                deferred = True
            else:
                break
        return None if deferred else hits

    def step(self) -> list[Any]:
        """The end of a scheduler step: finished jobs collected, pending promotions submitted (one job per request),
        `on_schedule_end`. The reports collected."""
        got = self.collect()
        for req_id, items in self.pending.items():
            job = self._job([k for k, _ in items], [c for _, c in items], True, self.pending_req[req_id])
            self.tier.submit_load(job)
        self.pending.clear()
        self.tier.on_schedule_end(None)
        self.events.extend(self.tier.take_events())
        return got

    def collect(self) -> list[Any]:
        """`get_finished_jobs`, checked as vLLM checks it, applied as vLLM applies it."""
        got = list(self.tier.get_finished_jobs())
        for report in got:
            job = self.jobs.pop(report.job_id, None)
            if job is None:
                raise ContractBroken(f"job {report.job_id} reported twice or never submitted")
            self.reports[report.job_id] = report
            ok_keys = set(job.keys) if report.success else set(report.successful_keys or ())
            if not ok_keys <= set(job.keys):
                raise ContractBroken(f"job {report.job_id}: successful keys that are not its keys")
            if not job.is_promotion:
                if report.deferred_release is not None:
                    raise ContractBroken(f"store job {report.job_id} with a deferred release")
                continue
            failed = [c for k, c in zip(job.keys, job.chunk_ids.tolist(), strict=True) if k not in ok_keys]
            for k, c in zip(job.keys, job.chunk_ids.tolist(), strict=True):
                if k in ok_keys:
                    self.ready[k] = c
            if report.deferred_release is not None:
                self.deferred[report.job_id] = (report.deferred_release, failed)
            else:
                self.free.extend(failed)
        for job_id, (event, chunks) in list(self.deferred.items()):
            if event.is_set():
                self.free.extend(chunks)
                del self.deferred[job_id]
        return got

    def wait(self, job_ids: list[int] | None = None) -> None:
        """Step until every job (or those named) is reported: polls, as vLLM's scheduler steps."""
        deadline = time.monotonic() + WAIT_S
        while any(j in self.jobs for j in (job_ids if job_ids is not None else list(self.jobs))) or self.pending:
            if time.monotonic() > deadline:
                raise ContractBroken(f"jobs {sorted(self.jobs)} never reported")
            self.step()
            time.sleep(0.001)

    def settle(self, keys: list[bytes], req: Request) -> int:
        """Scan a prompt's keys step after step until no lookup is deferred (async probes resolve across steps),
        then wait for the promotions: how many keys from the start hit."""
        deadline = time.monotonic() + WAIT_S
        while (hits := self.scan(keys, req)) is None:
            if time.monotonic() > deadline:
                raise ContractBroken("lookups answered RETRY for ever")
            self.step()
            time.sleep(0.001)
        self.wait()
        return hits

    def finish(self, req: Request) -> None:
        self.tier.on_request_finished(req)

    def drain(self) -> None:
        """vLLM's reset_cache: drain_jobs, then every job must be reported and every deferred release set."""
        self.tier.drain_jobs()
        self.collect()
        if self.jobs:
            raise ContractBroken(f"jobs {sorted(self.jobs)} unreported after drain_jobs")
        if self.deferred:
            raise ContractBroken("deferred releases still unset after drain_jobs")
