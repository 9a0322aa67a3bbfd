"""The engine check (`make engine-check`): kvc as the L3 of SGLang 0.5.23's own HiCache, on CPU, in two processes.

Process 1 (tests/engine/sglang_worker.py `write`) serves a multi-tenant workload through SGLang's UnifiedRadixCache
and its cache controller with `--hicache-storage-backend dynamic` loading `kvcache.engines.sglang.KvcStorage`, and
waits until every page is written through to the store. Process 2 (`read`, a new process on the same store)
prefetches every prompt as SGLang's scheduler does and compares every byte that reached its device pool. Then one
byte of one stored page is flipped: a third process must never be served that page, and `kvc audit` must report
it. The same runs on LMDB and on a Redis store (a redis-server on loopback, started and stopped here).

Needs SGLang (skipped without it: `make test` runs in kvc's own venv, which never has it). The kvc CLI runs in
the interpreter named by env KVC_PYTHON (kvc's own venv: `make engine-check` sets it), else in this one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed here: `make engine-check` runs these in its venv")

import torch  # noqa: E402  (after the skip: the peer venv's torch)

from engine_checks import PROCESS_TIMEOUT_S, flip_one_page, kvc, redis_store  # noqa: E402, F401  (a fixture)

HERE = Path(__file__).resolve().parent
WORKER = HERE / "sglang_worker.py"
STUBS = HERE / "stubs"
NAMESPACE = "sglang"  # the adapter's default kvc namespace
TENANTS = [  # two salts over the same tokens, a salt-less tenant with an extra_key, and the default namespace
    {"extra_key": "acme", "cache_salt": "salt-one"},
    {"extra_key": "acme", "cache_salt": "salt-two"},
    {"extra_key": "globex", "cache_salt": None},
    {"extra_key": None, "cache_salt": None},
]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(STUBS), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_worker(mode: str, config: dict, tmp: Path) -> dict:
    """Run one engine process to its exit; its JSON result."""
    config = dict(config, result=str(tmp / f"{mode}-{len(list(tmp.glob('*.result.json')))}.result.json"))
    path = tmp / "config.json"
    path.write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, str(WORKER), mode, str(path)], env=_env(), capture_output=True,
                          text=True, timeout=PROCESS_TIMEOUT_S)
    assert proc.returncode == 0, f"{mode} process failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads(Path(config["result"]).read_text())


CASES = [  # (store backend, SGLang's zero-copy interface_v1, host layout)
    pytest.param("lmdb", False, "layer_first", id="lmdb-generic-layer_first"),
    pytest.param("lmdb", True, "page_first_direct", id="lmdb-v1-page_first_direct"),
    pytest.param("redis", True, "layer_first", id="redis-v1-layer_first"),
]


@pytest.mark.parametrize(("backend", "interface_v1", "layout"), CASES)
def test_sglang_hicache_on_kvc_two_processes(request, tmp_path, backend, interface_v1, layout):
    store = request.getfixturevalue("redis_store") if backend == "redis" else str(tmp_path / "store")
    config = {"backend": "kvc", "store": store, "expected": str(tmp_path / "expected.pt"), "page_size": 16,
              "prompt_tokens": 512, "tenants": TENANTS, "stranger": {"extra_key": "never-wrote", "cache_salt": None},
              "interface_v1": interface_v1, "layout": layout}

    written = run_worker("write", config, tmp_path)
    stats = written["kvc_stats"]
    assert stats["pages_written"] == written["pages_written"] and stats["write_faults"] == 0, stats
    read = run_worker("read", config, tmp_path)
    assert read["kvc_stats"]["read_faults"] == 0, read["kvc_stats"]
    # Every token process 1 wrote is an L3 hit in process 2, byte for byte; another namespace gets nothing.
    assert read["l3_tokens"] == written["tokens_written"], read["requests"]
    assert read["bytes_differing"] == 0, read["requests"]
    assert all(r["device_tokens"] == config["prompt_tokens"] for r in read["requests"].values()), read["requests"]
    assert set(read["stranger_l3_tokens"].values()) == {0}, read["stranger_l3_tokens"]

    audit = kvc(store, "audit")
    assert audit.returncode == 0, audit.stdout + audit.stderr
    listed = kvc(store, "ns", "ls", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["namespaces"]
    assert [(r["extra_key"], r["pages"]) for r in rows] == [(NAMESPACE, written["pages_written"])], rows

    # One byte of one page (page 20 of the tenant-0-only prompt: in its second half) flipped in the store.
    expected = torch.load(config["expected"])
    page = 20
    needle = expected["t0-own"][0, 0, page * 16].contiguous().view(torch.uint8).numpy().tobytes()
    assert flip_one_page(store, needle) >= 1
    damaged = run_worker("read", config, tmp_path)
    assert damaged["bytes_differing"] == 0, damaged["requests"]  # the flipped page was never served
    own = damaged["requests"]["t0-own"]
    assert own["device_tokens"] <= page * 16, own  # nothing at or past the flipped page reached the device
    others = {rid: r for rid, r in damaged["requests"].items() if rid != "t0-own"}
    assert all(r["l3_tokens"] == config["prompt_tokens"] for r in others.values()), others
    found = kvc(store, "audit", "--json")
    assert found.returncode == 1, found.stdout + found.stderr
    report = json.loads(found.stdout)
    assert not report["ok"], report
    assert [v["kind"] for v in report["violations"]] == ["checksum_mismatch"], report  # that one page, nothing else
