"""The engine check for vLLM (`make engine-check`): kvc as a secondary tier of vLLM 0.34's own KV offloading, on CPU,
in separate processes over one store.

Process 1 (tests/engine/vllm_worker.py `write`) builds vLLM's `TieringOffloadingSpec` from a kv-transfer config
naming `KvcTier` (loaded by vLLM's own tier factory), stores every prompt's chunks into vLLM's pinned-CPU primary
tier and lets vLLM's `TieringOffloadingManager` cascade them to the tier. Process 2 (`read`, a new process, an
empty primary tier) looks every prompt up as vLLM's scheduler does: each chunk is promoted from the store and
compared byte for byte with what process 1 wrote. Deployments with another KV dtype or TP size get nothing on the
same keys. Then one byte of one stored chunk is flipped: `kvc audit` reports exactly it, and a new reader is never
handed it. The same runs on LMDB and on a Redis store (a redis-server on loopback).

Needs vLLM (skipped without it: `make test` runs in kvc's own venv, which never has it). vLLM's worker side (its
GPU↔CPU copies) needs a GPU: the worker writes and reads the primary region where vLLM's GPU worker would. The kvc
CLI runs in the interpreter named by env KVC_PYTHON (kvc's own venv: `make engine-check` sets it), else in this one.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.base", reason="vLLM is not installed here: `make engine-check` "
                                                               "runs these in its venv")

from engine_checks import PROCESS_TIMEOUT_S, flip_one_page, kvc, redis_store  # noqa: E402, F401  (a fixture)

HERE = Path(__file__).resolve().parent
WORKER = HERE / "vllm_worker.py"
ROW = 256 * 1024  # bytes of one chunk row: a 16-token block of a small model's KV
PROMPTS = 4
CHUNKS = 12  # chunks per prompt
NAMESPACE = "vllm"  # the tier's default kvc namespace


def prompts() -> list[list[str]]:
    """Each prompt's block hashes (hex), as vLLM's sha256 prefix hashing names them: prompts 0-1 share their first
    half (a common system prompt), the rest is their own."""
    def block(p: int, i: int) -> str:
        owner = "shared" if p < 2 and i < CHUNKS // 2 else f"p{p}"
        return hashlib.sha256(f"{owner}-{i}".encode()).hexdigest()
    return [[block(p, i) for i in range(CHUNKS)] for p in range(PROMPTS)]


def run(mode: str, tmp: Path, **config) -> dict:
    """One vLLM process to its exit; its JSON result."""
    n = len(list(tmp.glob("*.json")))
    config = dict(config, prompts=config.get("prompts", prompts()), row=config.get("row", ROW),
                  result=str(tmp / f"{mode}-{n}.result.json"))
    path = tmp / f"{mode}-{n}.config.json"
    path.write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, str(WORKER), mode, str(path)], capture_output=True, text=True,
                          timeout=PROCESS_TIMEOUT_S)
    assert proc.returncode == 0, f"{mode} process failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads(Path(config["result"]).read_text())


@pytest.mark.parametrize("backend", ["lmdb", "redis"])
def test_vllm_tiering_on_kvc_two_processes(request, tmp_path, backend):
    store = request.getfixturevalue("redis_store") if backend == "redis" else str(tmp_path / "store")
    unique = PROMPTS * CHUNKS - CHUNKS // 2  # prompts 0 and 1 share half their chunks

    written = run("write", tmp_path, store=store)
    assert written["store_faults"] == 0, written
    assert written["chunks_stored"] == unique and written["chunks_existing"] == 0, written
    assert written["storage_stored_events"] == unique, written  # every stored chunk said stored to routers
    # kvc's counters reach vLLM's metrics under vLLM's tier label; its config info names the store and layout
    assert written["counters"]["vllm:kv_offload_kvc_chunks_stored"] == {"1:KvcTier": unique}, written
    assert written["counters"]["vllm:kv_offload_kvc_bytes_written"] == {"1:KvcTier": unique * ROW}, written
    assert set(written["counters"]) <= set(written["defined"]) and len(written["defined"]) == 13, written
    assert {"kvc_store", "kvc_namespace", "kvc_layout", "tier"} <= set(written["info_keys"]), written
    (tier_info,) = [i for i in written["info"] if i.get("tier") == "1:KvcTier"]
    assert tier_info["kvc_namespace"] == NAMESPACE and len(tier_info["kvc_layout"]) == 32, tier_info

    read = run("read", tmp_path, store=store)
    # Every chunk process 1 cascaded is promoted in process 2, byte for byte.
    assert [r["promoted"] for r in read["requests"]] == [CHUNKS] * PROMPTS, read
    assert sum(r["bytes_differing"] for r in read["requests"]) == 0, read
    assert read["chunks_missed"] == 0 and read["load_faults"] == 0, read

    # Deployments that differ in KV dtype or TP size get nothing on the same keys.
    for other in ({"dtype": "float16"}, {"tp": 2}):
        stranger = run("read", tmp_path, store=store, **other)
        assert [r["promoted"] for r in stranger["requests"]] == [0] * PROMPTS, (other, stranger)

    audit = kvc(store, "audit")
    assert audit.returncode == 0, audit.stdout + audit.stderr
    listed = kvc(store, "ns", "ls", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["namespaces"]
    assert [(r["extra_key"], r["pages"]) for r in rows] == [(NAMESPACE, unique)], rows

    # One byte of one chunk (chunk 7 of prompt 3, its own) flipped in the store.
    sys.path.insert(0, str(HERE))
    from vllm_worker import chunk_payload

    victim = bytes.fromhex(prompts()[3][7])
    needle = chunk_payload(victim, ROW)[ROW // 2:ROW // 2 + 64]
    assert flip_one_page(store, needle) >= 1
    found = kvc(store, "audit", "--json")  # the nightly audit, before any engine reads the damage
    assert found.returncode == 1, found.stdout + found.stderr
    report = json.loads(found.stdout)
    assert [v["kind"] for v in report["violations"]] == ["checksum_mismatch"], report  # that chunk, nothing else
    damaged = run("read", tmp_path, store=store)
    assert sum(r["bytes_differing"] for r in damaged["requests"]) == 0, damaged  # the flipped chunk never served
    assert [r["promoted"] for r in damaged["requests"]] == [CHUNKS] * 3 + [7], damaged  # prompt 3 stops at it
    assert damaged["checksum_failures"] == 1 and damaged["chunks_missed"] == 1, damaged
    # The reader's store handle dropped the corrupt chunk on its way out (the store's self-heal); the chunks after
    # it are intact and readable by their keys: the audit is clean again, nothing called an orphan.
    healed = kvc(store, "audit", "--json")
    assert healed.returncode == 0, healed.stdout + healed.stderr
    again = run("read", tmp_path, store=store)
    assert [r["promoted"] for r in again["requests"]] == [CHUNKS] * 3 + [7], again  # the scan still stops there


def test_the_tier_class_is_vllms_and_refuses_a_vllm_outside_the_supported_releases(monkeypatch):
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    from kvcache.engines import vllm as tier_module
    from kvcache.errors import EngineUnsupported

    cls = SecondaryTierFactory.get_tier_class({"type": "KvcTier", "module_path": "kvcache.engines.vllm"})
    assert issubclass(cls, SecondaryTierManager) and issubclass(cls, tier_module.VLLMTier)
    assert cls.medium.name == "STORAGE" and cls.cache_hit_source.name == "DISK"
    monkeypatch.setattr(tier_module, "_tier_class", None)
    monkeypatch.setattr(tier_module, "_vllm_version", lambda: (0, 35))
    with pytest.raises(EngineUnsupported, match="vLLM 0.35"):
        tier_module.tier_class()
