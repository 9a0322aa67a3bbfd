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
(`tier_class`, here), as a subclass of vLLM's `SecondaryTierManager` (vLLM's factory checks that), answering in
vLLM's types (`Vocabulary`). Without vLLM the same class (`VLLMTier`) answers in kvc's stand-ins (`Lookup`,
`JobReport`, `TierEvent`), which is how kvc's tests drive it without vLLM installed.

The tier's parts, one module each: `vllm_tier` (`VLLMTier`, the scheduler's side), `vllm_config` (the settings),
`vllm_deployment` (the layout), `vllm_chunks` (the copies the I/O threads run), `vllm_io` (the I/O threads),
`vllm_verdicts` (what lookups know), `vllm_counters` (the counters and their vLLM metrics), `vllm_vocabulary` (the
values it answers in). This module binds them to vLLM.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from ..errors import EngineUnsupported
from .vllm_config import STORE_ENV, TIER_TYPE
from .vllm_counters import METRICS
from .vllm_deployment import ENGINE
from .vllm_tier import VLLMTier
from .vllm_vocabulary import Vocabulary

VLLM_SUPPORTED = ((0, 34), (0, 35))  # vLLM releases [from, to) whose secondary-tier API this tier speaks
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
