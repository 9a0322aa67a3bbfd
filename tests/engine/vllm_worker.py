"""One vLLM process of the engine check (tests/engine/test_engine_check_vllm.py): vLLM 0.34's own KV-offloading
scheduler side — `OffloadingSpecFactory` → `TieringOffloadingSpec` → `TieringOffloadingManager` over vLLM's
pinned-CPU primary tier (a shared-memory region) — with `kvcache.engines.vllm.KvcTier` as its secondary tier,
loaded by vLLM's factory from the tier config, driven as vLLM's scheduler drives it. vLLM's worker side (GPU↔CPU
copies) needs a GPU; here the bytes a worker would copy out of the GPU are written into the primary region
directly, and the bytes it would copy back in are read out of it.

    python vllm_worker.py write CONFIG.json   # prepare_store + complete_store every prompt's chunks: the cascades
    python vllm_worker.py read CONFIG.json    # look every prompt up: promotions from the store, bytes compared

CONFIG: {"store": location, "prompts": [[hex block hash, ...], ...], "row": chunk bytes, "dtype": ..., "tp": ...,
"namespace": ..., "result": path}. The result (JSON): per prompt the chunks cascaded / promoted, the bytes that
differ from what was written, the tier's counters.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import uuid
from pathlib import Path

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

MODEL = "Qwen/Qwen3-0.6B"
LAYERS = 28
TOKENS_PER_BLOCK = 16
STEP_LIMIT_S = 120.0  # a tier that never reports fails the check instead of hanging it


def chunk_payload(block_hash: bytes, row: int) -> bytes:
    """What a worker would have copied out of the GPU for a chunk: distinct per block, the same in every process."""
    seed = int.from_bytes(hashlib.blake2b(block_hash, digest_size=8).digest(), "big")
    return np.random.default_rng(seed).integers(0, 256, row, dtype=np.uint8).tobytes()


def build(config: dict):
    """vLLM's spec and manager for the config, as vLLM's connector builds them."""
    row, tp = config["row"], config.get("tp", 1)
    tier = {"type": "KvcTier", "module_path": "kvcache.engines.vllm", "kvc_store": config["store"],
            "enable_kv_events": True}
    if config.get("namespace"):
        tier["kvc_namespace"] = config["namespace"]
    tier.update(config.get("tier", {}))
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": row * config.get("chunks", 64),
             "secondary_tiers": [tier]}
    offloading = OffloadingConfig(
        groups=(OffloadingGroupConfig(TOKENS_PER_BLOCK, tuple(f"model.layers.{i}.self_attn.attn"
                                                                  for i in range(LAYERS)), 0),),
        worker_kv_bytes_per_block=row // tp, enable_kv_cache_events=True, extra_config=extra,
        engine_id=f"kvc-check-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(MODEL, config.get("dtype", "bfloat16")),
        cache=OffloadingCacheConfig(TOKENS_PER_BLOCK, 1),
        parallel=OffloadingParallelConfig(rank=0, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=False))
    spec = OffloadingSpecFactory.create_spec(offloading)
    return spec, spec.get_manager()


def step(manager, new_req_ids=()) -> list:
    """The end of a scheduler step (vLLM's connector calls on_schedule_end last); the events it took."""
    with manager.lock:
        manager.on_schedule_end(ScheduleEndContext(list(new_req_ids), []))
        return list(manager.take_events())


def settle(manager) -> list:
    """Step until no job is out (the scheduler keeps stepping while has_pending_work); the events on the way."""
    events, deadline = [], time.monotonic() + STEP_LIMIT_S
    while True:
        with manager.lock:
            pending = manager.has_pending_work()
        if not pending:
            return events
        if time.monotonic() > deadline:
            raise SystemExit("the tier never finished its jobs")
        events += step(manager)
        time.sleep(0.001)


def write(config: dict) -> dict:
    spec, manager = build(config)
    view = manager.primary_tier.get_kv_memoryview().cast("B")
    row, out, events = config["row"], [], []
    try:
        for p, prompt in enumerate(config["prompts"]):
            keys = [make_offload_key(bytes.fromhex(h), 0) for h in prompt]
            req = ReqContext(req_id=f"w{p}")
            with manager.lock:
                manager.on_new_request(req)
                for i, key in enumerate(keys):
                    req.set_offload_key_position(key, (i + 1) * TOKENS_PER_BLOCK)
                stored = manager.prepare_store(keys, req)
            # the worker's GPU -> CPU copy of the new chunks, then the scheduler's completion: the cascade
            for key, chunk in zip(stored.keys_to_store, stored.store_spec.chunk_ids.tolist(), strict=True):
                view[chunk * row:(chunk + 1) * row] = chunk_payload(key[:-4], row)
            with manager.lock:
                manager.complete_store(stored.keys_to_store, req)
                manager.on_request_finished(req)
            events += step(manager, [req.req_id])
            out.append(len(stored.keys_to_store))
        events += settle(manager)
        with manager.lock:
            stats = manager.secondary_tiers[0].kvc_stats()
            metrics = manager.get_stats()  # what vLLM's metrics collector is handed
            info = manager.config_info()
    finally:
        view.release()
        manager.shutdown()
    stored_events = sum(len(e.keys) for e in events if not e.removed and e.ownership == "kvc" and
                        e.medium.name == "STORAGE")
    extra = spec.extra_config
    counters = {name: {"|".join(labels): value for labels, value in series.items()}
                for name, series in metrics.data["data"].items() if name.startswith("vllm:kv_offload_kvc_")}
    return {"cascaded": out, "chunks_stored": stats.chunks_stored, "chunks_existing": stats.chunks_existing,
            "store_faults": stats.store_faults, "storage_stored_events": stored_events, "counters": counters,
            "defined": sorted(n for n in type(spec).build_metric_definitions(extra) if "kvc" in n),
            "info_keys": list(type(spec).config_info_keys(extra)), "info": [dict(i) for i in info]}


def read(config: dict) -> dict:
    spec, manager = build(config)
    view = manager.primary_tier.get_kv_memoryview().cast("B")
    row, results = config["row"], []
    try:
        for p, prompt in enumerate(config["prompts"]):
            keys = [make_offload_key(bytes.fromhex(h), 0) for h in prompt]
            req = ReqContext(req_id=f"r{p}")
            with manager.lock:
                manager.on_new_request(req)
            deadline = time.monotonic() + STEP_LIMIT_S
            while True:  # vLLM's scheduler: scan to the first miss; again next step while any is not yet readable
                with manager.lock:
                    answers = []
                    for key in keys:
                        answers.append(manager.lookup(key, req))
                        if answers[-1] is LookupResult.MISS:
                            break
                hits = [a for a in answers if a is not LookupResult.MISS]
                if all(a is LookupResult.HIT for a in hits):
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"prompt {p}: lookups never settled: {answers}")
                step(manager, [req.req_id])
                time.sleep(0.001)
            served = keys[:len(hits)]
            differing = 0
            with manager.lock:
                spec_load = manager.prepare_load(served, req) if served else None
            if spec_load is not None:  # the worker's CPU -> GPU copy: what it would hand the model
                for key, chunk in zip(served, spec_load.chunk_ids.tolist(), strict=True):
                    got = bytes(view[chunk * row:(chunk + 1) * row])
                    differing += int(np.count_nonzero(np.frombuffer(got, np.uint8) != np.frombuffer(
                        chunk_payload(key[:-4], row), np.uint8)))
                with manager.lock:
                    manager.complete_load(served, req)
            with manager.lock:
                manager.on_request_finished(req)
            results.append({"chunks": len(keys), "promoted": len(served), "bytes_differing": differing})
        settle(manager)
        with manager.lock:
            stats = manager.secondary_tiers[0].kvc_stats()
    finally:
        view.release()
        manager.shutdown()
    return {"requests": results, "chunks_loaded": stats.chunks_loaded, "chunks_missed": stats.chunks_missed,
            "checksum_failures": stats.store.checksum_failures if stats.store else None,
            "load_faults": stats.load_faults}


if __name__ == "__main__":
    mode, path = sys.argv[1], Path(sys.argv[2])
    cfg = json.loads(path.read_text())
    result = {"write": write, "read": read}[mode](cfg)
    Path(cfg["result"]).write_text(json.dumps(result))
