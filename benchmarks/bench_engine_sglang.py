"""kvc as SGLang's HiCache L3 (`kvcache.engines.sglang.KvcStorage` on LMDB) against SGLang's own `file` backend,
on the same pages, through the calls SGLang's cache controller makes.

This script installs nothing and SGLang is never a dependency of kvc. The measurement runs in SGLang's
interpreter (--peer-python, default $KVC_PEER_PYTHON: a venv where `import sglang` works and kvc is installed, as
`make engine-check` leaves .peer-venv), which this script (run with kvc's Python) starts as its worker; without
such an interpreter it prints one line saying so and exits 0. The worker puts tests/engine/stubs (an import-only
torchvision stand-in) on its path.

Both backends are built by SGLang's own storage backend factory (`file` with its directory, `dynamic` with kvc's
extra config) and given a real SGLang host pool (MHATokenToKVPoolHost, layer_first, on CPU). Per round, each
backend gets fresh keys (SGLang-style 64-hex) for --pages pages of random KV, and the three operations run in
SGLang's batches of 128 pages, timed over all batches:
  set     generic: the controller's `_generic_page_set` (host page views, then `batch_set`); v1: `batch_set_v1`
          (host indices; kvc copies straight out of the host pool); v1-nosync: the same
          on a store opened with `kvc_store_options` {"durability": "none"} (commits not synced, as `file` writes)
  exists  `batch_exists` (consecutive pages present from the start)
  get     generic: the controller's `_generic_page_get` (a bounce page per key, `batch_get`, then
          `set_from_flat_data_page` into the host pool); v1: `batch_get_v1` (straight into the host pool)
then, untimed, each backend's `clear` (SGLang's flush), so that what is written stays about one round's pages: the
page cache never fills with dirty pages, and the disk's writeback (the same for both) does not pace the writes.
This is the steady state of a full L3 under eviction: kvc's LMDB reuses the pages it freed (overwriting its file),
`file` deletes files and creates new ones. A store that only grows (a cold L3 filling up) is slower to write for
both: LMDB extends its file (measured: a 512-page set took 33 ms into a new store, 76 ms once it held 2,048 pages),
`file` grows its directory.
Every get is checked byte for byte against what was set. SGLang's `file` backend has only the generic interface
(its controller never uses v1 for it): both kvc interfaces are compared with it. Rounds are interleaved, the
backend going first alternating; figures are medians over rounds, ratios are kvc's throughput over file's
(the ratio of the median times). Both backends write under one scratch directory (one filesystem).

Durability: `file` writes each page to a temp file and renames it, never fsyncing; kvc's default syncs each batch's
commit. The acceptance compares one kvc configuration at equal durability: the `v1-nosync` row (durability "none":
LMDB's commits unsynced, crash-safe against a killed process, not against a power loss; through `batch_*_v1`, the
interface SGLang's controller uses for kvc), with the default durability's set beside it. Durability does not
touch the read path: the `v1` and `v1-nosync` gets run the same code, and differ only by the machine's noise.

Geometry: float16 KV; page sizes 16 and 64 tokens, sized so one page is 64 KiB (the acceptance case: set >= 5x and
get >= 1.5x file's throughput), and 1 MiB pages for reference.

Run: ``KVC_PEER_PYTHON=.peer-venv/bin/python python benchmarks/bench_engine_sglang.py [--rounds 11] [--pages 512]
[--no-write]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STUBS = ROOT / "tests" / "engine" / "stubs"
BATCH = 128  # SGLang's STORAGE_BATCH_SIZE: pages per storage call
# (page tokens, layers, kv heads, head dim): float16 pages of 2 * layers * tokens * heads * dim * 2 bytes
GEOMETRIES = [
    (16, 8, 1, 128),  # 64 KiB
    (64, 2, 1, 128),  # 64 KiB
    (64, 8, 4, 128),  # 1 MiB
]
OPS = ("set", "exists", "get")


def page_bytes(tokens: int, layers: int, heads: int, dim: int) -> int:
    return 2 * layers * tokens * heads * dim * 2


# -- the worker (SGLang's interpreter) ----------------------------------------------------------------------------

def worker(args: argparse.Namespace) -> dict:
    import hashlib
    import types
    import warnings

    import torch

    with warnings.catch_warnings():  # SGLang warns on import that a CPU lacks its GPU quantisation kernels
        warnings.simplefilter("ignore")
        from sglang.srt.managers.cache_controller import HiCacheController
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.storage import StorageBackendFactory
    torch.set_num_threads(1)
    scratch = Path(args.scratch)
    results = []
    for tokens, layers, heads, dim in GEOMETRIES:
        device = MHATokenToKVPool(size=args.pages * tokens, page_size=tokens, dtype=torch.float16, head_num=heads,
                                  head_dim=dim, layer_num=layers, device="cpu", enable_memory_saver=False)
        pool = MHATokenToKVPoolHost(device._mha_buffer_info(), 1.0, 0, tokens, "layer_first", pin_memory=False,
                                    device="cpu", device_capacity_tokens=args.pages * tokens, start_layer=0,
                                    end_layer=layers)
        gen = torch.Generator().manual_seed(tokens * layers)
        # the rows the pages use (the pool may hold more): [2, layers, tokens, heads, dim * 2] bytes
        raw = pool.kv_buffer.view(torch.uint8)[:, :, : args.pages * tokens]
        indices = torch.arange(args.pages * tokens, dtype=torch.int64)
        model = f"bench/{tokens}x{layers}x{heads}x{dim}"

        def config(extra: dict, model: str = model) -> HiCacheStorageConfig:
            return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                        model_name=model, extra_config=extra)

        where = scratch / model.replace("/", "-")
        backends = {
            "file": StorageBackendFactory.create_backend(
                "file", config({"file_storage_path": str(where / "file")}), pool),
            "kvc": StorageBackendFactory.create_backend(
                "dynamic", config({"backend_name": "kvc", "module_path": "kvcache.engines.sglang",
                                   "class_name": "KvcStorage", "kvc_store": str(where / "kvc"),
                                   "interface_v1": 1}), pool),
            # the same with LMDB's commits unsynced (kvc_store_options), as `file` writes: what fsync costs
            "kvc-nosync": StorageBackendFactory.create_backend(
                "dynamic", config({"backend_name": "kvc", "module_path": "kvcache.engines.sglang",
                                   "class_name": "KvcStorage", "kvc_store": str(where / "kvc-nosync"),
                                   "kvc_store_options": {"durability": "none"}, "interface_v1": 1}), pool),
        }
        for backend in backends.values():
            backend.register_mem_pool_host(pool)
        # both write under `where`: one filesystem (an SGLang env variable could move `file` elsewhere)
        assert Path(backends["file"].file_path).is_relative_to(where), backends["file"].file_path
        # the controller's own page IO, bound to a stand-in holding what it reads (pool, page size, backend)
        op = types.SimpleNamespace(request_id="bench", is_terminated=lambda: False)
        sides = [("file", "generic"), ("kvc", "generic"), ("kvc", "v1"), ("kvc-nosync", "v1")]
        times: dict[tuple[str, str], dict[str, list[float]]] = {s: {o: [] for o in OPS} for s in sides}
        for rnd in range(args.rounds):
            order = sides if rnd % 2 == 0 else sides[::-1]
            for name, interface in order:
                backend = backends[name]
                ctl = types.SimpleNamespace(storage_host_pool=pool, page_size=tokens, storage_backend=backend)
                expected = torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8)
                raw.copy_(expected)
                keys = [hashlib.sha256(f"{name}-{interface}-{rnd}-{p}".encode()).hexdigest()
                        for p in range(args.pages)]
                batches = [(keys[i:i + BATCH], indices[i * tokens:(i + BATCH) * tokens])
                           for i in range(0, args.pages, BATCH)]
                t0 = time.perf_counter()
                for ks, idx in batches:
                    if interface == "v1":
                        ok = all(backend.batch_set_v1(ks, idx))
                    else:
                        ok = HiCacheController._generic_page_set(ctl, ks, idx)
                    assert ok, f"{name} {interface}: a set failed"
                t1 = time.perf_counter()
                for ks, _ in batches:
                    assert backend.batch_exists(ks) == len(ks), f"{name}: exists misses pages just set"
                t2 = time.perf_counter()
                raw.zero_()  # gets land in the same host pool (the one registered): it must be refilled
                for ks, idx in batches:
                    if interface == "v1":
                        got = sum(bool(x) for x in backend.batch_get_v1(ks, idx))
                    else:
                        got = HiCacheController._generic_page_get(ctl, op, ks, idx)
                    assert got == len(ks), f"{name} {interface}: {len(ks) - got} pages not read"
                t3 = time.perf_counter()
                assert torch.equal(raw, expected), f"{name} {interface}: bytes read differ from those set"
                # Empty the backend (untimed) before the next side writes: what both backends write then stays
                # about one round's pages, so the page cache never fills with dirty pages and the disk's
                # writeback (the same for both) does not set the pace of later sides and rounds.
                assert backend.clear(), f"{name}: clear failed"
                for o, t in zip(OPS, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                    times[(name, interface)][o].append(t)
        results.append({"tokens": tokens, "layers": layers, "heads": heads, "dim": dim,
                        "page_bytes": page_bytes(tokens, layers, heads, dim),
                        "times": {f"{n}/{i}": t for (n, i), t in times.items()}})
    return {"geometries": results, "pages": args.pages, "rounds": args.rounds}


# -- the driver (kvc's interpreter) -------------------------------------------------------------------------------

def skip_reason(peer: str | None) -> str | None:
    """Why the measurement cannot run (one line), or None."""
    if not peer:
        return "no peer interpreter (set KVC_PEER_PYTHON or give --peer-python: a Python that imports sglang and kvc)"
    probe = ("import importlib.util as u, sys; "
             "sys.exit(0 if u.find_spec('sglang') and u.find_spec('kvcache.engines.sglang') else 3)")
    try:
        rc = subprocess.run([peer, "-c", probe], env=_peer_env(), capture_output=True, timeout=120).returncode
    except OSError as exc:
        return f"the peer interpreter {peer} does not run ({exc})"
    return None if rc == 0 else f"{peer} cannot import sglang and kvcache.engines.sglang (make engine-check installs both)"


def _peer_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)  # `file` writes beside kvc, in the scratch dir
    env["PYTHONPATH"] = os.pathsep.join([str(STUBS), *filter(None, [env.get("PYTHONPATH")])])
    return env


def report(result: dict) -> tuple[str, dict[str, float]]:
    import _report

    rows, ratios = [], {}
    for g in result["geometries"]:
        size = g["page_bytes"]
        label = f"{g['tokens']}tok,{size // 1024}KiB"
        med = {side: {o: statistics.median(ts) for o, ts in ops.items()} for side, ops in g["times"].items()}
        mib = result["pages"] * size / 2**20
        for side, iface in (("kvc/generic", "generic"), ("kvc/v1", "v1"), ("kvc-nosync/v1", "v1-nosync")):
            row = [f"{g['tokens']}", f"{size // 1024} KiB", iface]
            for o in OPS:
                ratio = med["file/generic"][o] / med[side][o]
                ratios[f"{o}_kvc_over_file[{iface},{label}]"] = round(ratio, 2)
                row.append(f"{mib / med[side][o]:.0f} / {mib / med['file/generic'][o]:.0f} MiB/s = "
                           f"**{ratio:.2f}x**" if o != "exists" else
                           f"{result['pages'] / med[side][o]:.0f} / {result['pages'] / med['file/generic'][o]:.0f} "
                           f"pages/s = **{ratio:.2f}x**")
            rows.append(row)
    # the acceptance: kvc at equal durability (v1-nosync: `file` never fsyncs; see the docstring)
    accept = [(k, v) for k, v in ratios.items()
              if "64KiB" in k and "[v1-nosync," in k and k.split("_")[0] in ("set", "get")]
    synced = [(k, v) for k, v in ratios.items() if "64KiB" in k and k.startswith("set_") and "[v1," in k]
    verdict = all(v >= (5.0 if k.startswith("set") else 1.5) for k, v in accept)
    body = [
        "## kvc as SGLang's HiCache L3 against SGLang's `file` backend (bench_engine_sglang.py)",
        "",
        f"SGLang 0.5.23 on CPU; both backends built by SGLang's storage factory on a real host pool (layer_first, "
        f"float16); {result['pages']} pages per round in batches of {BATCH}, {result['rounds']} interleaved rounds, "
        f"medians; kvc on LMDB with its default durability (each batch's commit synced), and `v1-nosync` with "
        f"`kvc_store_options` `{{\"durability\": \"none\"}}`; `file` writes a temp file per page and renames "
        f"it, without fsync; both under one scratch directory, emptied (`clear`, untimed) after each backend's "
        f"round: the steady state of a full L3 under eviction. Each cell: kvc / file throughput = ratio (kvc's "
        f"over file's; file has only the generic interface). The acceptance is judged on `v1-nosync` (kvc at file's "
        f"durability, through the interface SGLang's controller uses for kvc); durability does not touch reads. "
        f"{_report.machine()}; 1-minute load average "
        f"{result['load'][0]} before, {result['load'][1]} after.",
        "",
        _report.table(["page tokens", "page", "kvc interface", "set", "exists", "get"], rows),
        "",
        f"Acceptance (64 KiB pages: set >= 5x at equal durability, get >= 1.5x): {'met' if verdict else 'NOT met'} "
        f"({', '.join(f'{k} {v:.2f}x' for k, v in accept)}); set with kvc's default durability (each batch "
        f"synced): {', '.join(f'{k} {v:.2f}x' for k, v in synced)}.",
    ]
    return "\n".join(body), ratios


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer-python", default=os.environ.get("KVC_PEER_PYTHON"),
                        help="SGLang's interpreter, with kvc installed (default: $KVC_PEER_PYTHON)")
    parser.add_argument("--rounds", type=int, default=11,
                        help="interleaved rounds per geometry (medians over them; 7 swung a ratio by 2x on a loaded machine)")
    parser.add_argument("--pages", type=int, default=512, help="pages per backend per round (batches of 128)")
    parser.add_argument("--no-write", action="store_true", help="print the figures, leave BENCHMARKS.md alone")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: the scratch dir, run in the peer
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    reason = skip_reason(args.peer_python)
    if reason:
        print(f"bench_engine_sglang: skipped: {reason}")
        return 0
    load = os.getloadavg()[0]  # the machine's 1-minute load before and after: the figures' context
    with tempfile.TemporaryDirectory(prefix="kvc-bench-engine-") as scratch:
        proc = subprocess.run([args.peer_python, __file__, "--worker", "1", "--scratch", scratch,
                               "--rounds", str(args.rounds), "--pages", str(args.pages)],
                              env=_peer_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        return proc.returncode
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["load"] = [round(load, 2), round(os.getloadavg()[0], 2)]
    body, ratios = report(result)
    import _report

    _report.publish("bench_engine_sglang", body, args.no_write, ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
