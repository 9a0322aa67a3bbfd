"""kvc as a secondary tier of vLLM's KV offloading (`kvcache.engines.vllm.KvcTier` on LMDB) against vLLM's own `fs`
tier (`FileSystemTierManager`), on the same chunks, through vLLM's own `TieringOffloadingManager`.

This script installs nothing and vLLM is never a dependency of kvc. The measurement runs in vLLM's interpreter
(--vllm-python, default $KVC_VLLM_PYTHON: a venv where `import vllm` works and kvc is installed, as `make
engine-check-vllm` leaves .vllm-venv), which this script (run with kvc's Python) starts as its worker; without such
an interpreter it prints one line saying so and exits 0.

Each configuration is built as vLLM builds it from a kv-transfer config: `OffloadingSpecFactory` ->
`TieringOffloadingSpec` -> `TieringOffloadingManager` over vLLM's CPU primary tier (a shared-memory region that holds
a round's chunks), with ONE secondary tier loaded by vLLM's tier factory: `fs` (its `root_dir` under the scratch
directory; its defaults: 16 read and 16 write threads, O_DIRECT where the filesystem takes it) or `KvcTier` (its
LMDB store under the same scratch directory; its defaults: 2 I/O threads, sync lookups on a local store). The
manager is driven as vLLM's scheduler drives it (as tests/engine/vllm_worker.py does): vLLM's worker side (the
GPU<->CPU copies) needs a GPU, so the bytes it would copy out of the GPU are written into the primary region where
it would write them, and the bytes it would copy back in are read out of it. Geometry: 16-token blocks, one block
per chunk, chunk rows of 256 KiB and 2 MiB (`worker_kv_bytes_per_block`); per round --prompts requests sharing
--mib MiB of random KV, under fresh sha256 block hashes. Timed on the scheduler side:

  store      per request `prepare_store` and the chunks' bytes written into their primary chunks (untimed: the GPU
             worker's copy); then from the first `complete_store` (each submits its request's cascade to the tier
             as one job) until the manager has no pending work (a step, `on_schedule_end`, every 1 ms while
             `has_pending_work()`): the time until the last cascade is reported
  promotion  a FRESH manager (new spec, primary region and tier objects: an empty primary) on the same store or
             root_dir, from the first lookup until every chunk is HIT in the primary: each step looks every request
             up as vLLM's scheduler does (to the first MISS; again next step while a key is RETRY or HIT_PENDING);
             a HIT in the tier starts a promotion, submitted at the step's end as one job per request (`fs` answers
             a first lookup RETRY and probes at the step's end: one step more, as in vLLM)
  promotion, page cache dropped
             the same, on chunks stored (untimed) in a location of the tier's own whose files were then synced and
             dropped from the page cache (POSIX_FADV_DONTNEED, untimed): both tiers read the disk

Untimed, after each promotion: `prepare_load`, every chunk's bytes compared with what was written (the GPU worker's
copy-in), `complete_load`; then the tier is emptied (`fs`: its chunk files removed; kvc: its namespace deleted), so
what is stored stays about one round's chunks and the page cache never fills with dirty pages; kvc's LMDB then
reuses the pages it freed (the steady state of a full store under eviction). `fs`'s directories (<hhh>/<hh>_g0, two
levels per chunk) are made for a round's keys before its store (untimed): a long-running `fs` tier has its 4096 x
256 directories already, so making them is not counted against it.

Page cache: `fs` reads and writes with O_DIRECT where the filesystem takes it (its default: it bypasses the page
cache by design), so its promotions read the disk in both columns; kvc's "promotion" reads what was just written
from the page cache (a store that fits in memory), its "page cache dropped" column from the disk. `fs-buffered`
(reference, --no-fs-buffered leaves it out) is vLLM's `fs` tier with its O_DIRECT off (the bench sets the tier's
`_use_o_direct` False after vLLM built it: what vLLM itself falls back to where the filesystem refuses O_DIRECT),
to show what the page cache alone is worth to `fs`.

Durability: `fs` never fsyncs; kvc's LMDB syncs each commit by default. kvc is measured at its default (`kvc`) and at
`fs`'s durability (`kvc-nosync`: `kvc_store_options` {"durability": "none"}, commits not synced: crash-safe against a
killed process, not against a power loss); the acceptance (2 MiB chunks: store >= 2x and promotion >= 1.2x `fs`'s
throughput, and no corrupt chunk handed to vLLM where `fs` hands one) is judged on `kvc-nosync` and the "promotion"
column, with the page-cache-dropped promotion and the default durability beside it. Durability does not touch the
read path. --threads adds rows of `kvc-nosync` with more I/O threads (`kvc_io_threads`).

Integrity, after the timed rounds of each chunk size: one request is stored on each tier, one byte in the middle of
one of its chunks is flipped in place (`fs`: the chunk's file, named by vLLM's FileMapper; kvc: every copy of a
64-byte needle of the chunk's payload in `data.mdb`, as tests/engine/engine_checks.py does), and a fresh manager
promotes the request: the chunks handed to vLLM (HIT in the primary, `prepare_load`) whose bytes differ from what
was written are counted.

Rounds are interleaved (the tier going first alternates); figures are medians over rounds, ratios are kvc's
throughput over fs's (the ratio of the median times). All tiers write under one scratch directory (one filesystem).

Run: ``KVC_VLLM_PYTHON=.vllm-venv/bin/python python benchmarks/bench_engine_vllm.py [--rounds 7] [--mib 128]
[--sizes 256,2048] [--threads 4] [--no-write]`` (about 2 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "bench/vllm-tier"
LAYERS = 4  # layer names of the one KV cache group (the identity only: the row size is set directly)
TOKENS_PER_BLOCK = 16
STEP_S = 0.001  # pause between scheduler steps while the manager has pending work
STEP_LIMIT_S = 300.0  # a tier that never reports fails the bench instead of hanging it
NEEDLE = 64  # bytes of a chunk's payload that identify it in data.mdb
OPS = ("store", "promotion", "promotion-cold")
BUFFERED = "bench:buffered"  # a tier config key of this bench's own (never passed to vLLM): fs without O_DIRECT
REFERENCE = ("fs-buffered",)  # configurations measured for reference only (no integrity check, no published ratio)


# -- the worker (vLLM's interpreter) -------------------------------------------------------------------------------

def tier_configs(scratch: Path, threads: list[int], fs_buffered: bool = False) -> dict[str, dict]:
    """The secondary tier of each configuration, by its name in the report."""
    kvc = {"type": "KvcTier", "module_path": "kvcache.engines.vllm"}
    sides = {
        "fs": {"type": "fs", "root_dir": str(scratch / "fs")},
        "kvc": dict(kvc, kvc_store=str(scratch / "kvc")),
        "kvc-nosync": dict(kvc, kvc_store=str(scratch / "kvc-nosync"), kvc_store_options={"durability": "none"}),
    }
    for n in threads:
        sides[f"kvc-nosync-{n}io"] = dict(kvc, kvc_store=str(scratch / f"kvc-nosync-{n}io"),
                                          kvc_store_options={"durability": "none"}, kvc_io_threads=n)
    if fs_buffered:
        sides["fs-buffered"] = {"type": "fs", "root_dir": str(scratch / "fs-buffered"), BUFFERED: True}
    return sides


def elsewhere(tier: dict, suffix: str) -> dict:
    """The same tier configuration on another location (root_dir or store) beside its own."""
    where = "root_dir" if tier["type"] == "fs" else "kvc_store"
    return dict(tier, **{where: tier[where] + suffix})


def build(tier: dict, row: int, chunks: int):
    """vLLM's manager with `tier` as its one secondary tier, its primary tier `chunks` rows of `row` bytes, as vLLM's
    connector builds it; (manager, the primary region as bytes, the region as a numpy (chunks, row) view)."""
    import uuid

    import numpy as np
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    tier = dict(tier)
    buffered = tier.pop(BUFFERED, False)
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": row * chunks, "secondary_tiers": [tier]}
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(TOKENS_PER_BLOCK, tuple(f"model.layers.{i}.self_attn.attn"
                                                                  for i in range(LAYERS)), 0),),
        worker_kv_bytes_per_block=row, enable_kv_cache_events=False, extra_config=extra,
        engine_id=f"kvc-bench-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(MODEL, "bfloat16"),
        cache=OffloadingCacheConfig(TOKENS_PER_BLOCK, 1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=False))
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    if buffered:  # fs as it runs where the filesystem refuses O_DIRECT (its own fallback): through the page cache
        manager.secondary_tiers[0]._use_o_direct = False
    view = manager.primary_tier.get_kv_memoryview().cast("B")
    assert len(view) >= row * chunks, "the primary tier cannot hold a round's chunks"
    return manager, view, np.frombuffer(view, dtype=np.uint8).reshape(-1, row)


def close(manager, view: memoryview) -> None:
    """The manager shut down (its tiers, then the primary region), once the caller dropped its numpy view of the
    region (a buffer still exported keeps the region from closing)."""
    view.release()
    manager.shutdown()


def step(manager, new_req_ids=()) -> None:
    """The end of a scheduler step (vLLM's connector calls on_schedule_end last)."""
    from vllm.v1.kv_offload.base import ScheduleEndContext

    with manager.lock:
        manager.on_schedule_end(ScheduleEndContext(list(new_req_ids), []))


def settle(manager) -> None:
    """Step until the manager has no pending work (the scheduler keeps stepping while it has)."""
    deadline = time.monotonic() + STEP_LIMIT_S
    while True:
        with manager.lock:
            if not manager.has_pending_work():
                return
        if time.monotonic() > deadline:
            raise SystemExit("a tier never finished its jobs")
        step(manager)
        time.sleep(STEP_S)


def store(tier: dict, prompts: list[list[bytes]], payload, row: int) -> float:
    """Cascade every prompt's chunks (`payload` rows, in prompt order) to the tier through a new manager: seconds
    from the first complete_store to the last cascade reported."""
    import numpy as np
    from vllm.v1.kv_offload.base import ReqContext

    manager, view, rows = build(tier, row, len(payload))
    try:
        if tier["type"] == "fs":  # a populated fs tier has its directories: their making is not counted against it
            mapper = manager.secondary_tiers[0].file_mapper
            for keys in prompts:
                for key in keys:
                    os.makedirs(os.path.dirname(mapper.get_file_name(key)), exist_ok=True)
        reqs, at = [], 0
        for p, keys in enumerate(prompts):
            req = ReqContext(req_id=f"store-{p}")
            with manager.lock:
                manager.on_new_request(req)
                for i, key in enumerate(keys):
                    req.set_offload_key_position(key, (i + 1) * TOKENS_PER_BLOCK)
                out = manager.prepare_store(keys, req)
            assert out is not None and list(out.keys_to_store) == keys, "the primary tier refused a store"
            # the GPU worker's copy of the request's chunks into the primary tier
            rows[np.asarray(out.store_spec.chunk_ids)] = payload[at:at + len(keys)]
            at += len(keys)
            reqs.append((req, keys))
        t0 = time.perf_counter()
        with manager.lock:
            for req, keys in reqs:
                manager.complete_store(keys, req)  # the cascade of the request's chunks: one job
                manager.on_request_finished(req)
        step(manager, [req.req_id for req, _ in reqs])
        settle(manager)
        return time.perf_counter() - t0
    finally:
        rows = None
        close(manager, view)


def promote(tier: dict, prompts: list[list[bytes]], payload, row: int, empty_after: bool = False
            ) -> tuple[float, dict]:
    """Promote every prompt's chunks into a new manager's (empty) primary tier: seconds from the first lookup until
    every request's chunks up to its first miss are HIT; then (untimed) what vLLM is handed, compared with
    `payload`; with `empty_after`, the tier emptied."""
    import numpy as np
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

    hit, miss = LookupResult.HIT, LookupResult.MISS
    manager, view, rows = build(tier, row, len(payload))
    try:
        reqs = []
        with manager.lock:
            for p in range(len(prompts)):
                reqs.append(ReqContext(req_id=f"load-{p}"))
                manager.on_new_request(reqs[-1])
        ready: dict[int, int] = {}  # prompt -> chunks served (HIT up to its first MISS)
        new = [r.req_id for r in reqs]
        t0 = time.perf_counter()
        deadline = time.monotonic() + STEP_LIMIT_S
        while True:
            with manager.lock:
                for p, keys in enumerate(prompts):
                    if p in ready:
                        continue
                    answers = []
                    for key in keys:  # vLLM's scheduler: scan to the first miss
                        answers.append(manager.lookup(key, reqs[p]))
                        if answers[-1] is miss:
                            break
                    hits = [a for a in answers if a is not miss]
                    if all(a is hit for a in hits):
                        ready[p] = len(hits)
                manager.on_schedule_end(ScheduleEndContext(new, []))
            new = []
            if len(ready) == len(prompts):
                break
            if time.monotonic() > deadline:
                raise SystemExit("lookups never settled")
            time.sleep(STEP_S)
        seconds = time.perf_counter() - t0
        # Untimed: the GPU worker's copy-in of what vLLM is handed, compared with what was written.
        handed = differing = at = 0
        with manager.lock:
            for p, keys in enumerate(prompts):
                served = keys[:ready[p]]
                if served:
                    spec = manager.prepare_load(served, reqs[p])
                    got = rows[np.asarray(spec.chunk_ids)]
                    differing += int(np.any(got != payload[at:at + len(served)], axis=1).sum())
                    handed += len(served)
                    manager.complete_load(served, reqs[p])
                manager.on_request_finished(reqs[p])
                at += len(keys)
        settle(manager)
        outcome = {"chunks": sum(map(len, prompts)), "handed": handed, "corrupt_handed": differing}
        t = manager.secondary_tiers[0]
        if tier["type"] != "fs":
            stats = t.kvc_stats()
            outcome["checksum_failures"] = stats.store.checksum_failures if stats.store else None
        if empty_after:  # what the round stored goes (fs: its chunk files; kvc: its namespace)
            if tier["type"] == "fs":
                shutil.rmtree(f"{t.file_mapper.base_path}_r{t.file_mapper.rank}", ignore_errors=True)
            else:
                t.store.delete_namespace(t.namespace.id)
        return seconds, outcome
    finally:
        rows = None
        close(manager, view)


def flip(tier: dict, key: bytes, chunk: bytes, row: int) -> int:
    """One byte in the middle of a stored chunk flipped in place (no process has the store open); the copies
    flipped."""
    import mmap

    if tier["type"] == "fs":
        manager, view, rows = build(tier, row, 1)
        path = manager.secondary_tiers[0].file_mapper.get_file_name(key)
        del rows
        close(manager, view)
        with open(path, "r+b") as f:
            f.seek(row // 2)
            b = f.read(1)
            f.seek(row // 2)
            f.write(bytes([b[0] ^ 0x5A]))
        return 1
    needle = chunk[row // 2 - NEEDLE // 2: row // 2 + NEEDLE // 2]
    flipped = 0
    with open(Path(tier["kvc_store"]) / "data.mdb", "r+b") as f, \
            mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_WRITE) as m:
        at = m.find(needle)
        while at >= 0:  # every copy: LMDB's copy-on-write can leave stale copies on free pages
            m[at + NEEDLE // 2] ^= 0x5A
            flipped += 1
            at = m.find(needle, at + 1)
        m.flush()
    return flipped


def drop_cached(tier: dict) -> None:
    """The tier's stored bytes out of the page cache (no process has them open or mapped): each file synced (its
    dirty pages written), then dropped (POSIX_FADV_DONTNEED). Untimed."""
    if tier["type"] == "fs":
        files = [Path(d) / f for d, _, fs in os.walk(tier["root_dir"]) for f in fs]
    else:
        files = [Path(tier["kvc_store"]) / "data.mdb"]
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def keys_for(*parts: object, n: int) -> list[bytes]:
    """`n` fresh OffloadKeys: sha256 block hashes (as vLLM's sha256 prefix hashing makes them), group 0."""
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(hashlib.sha256("-".join(map(str, (*parts, i))).encode()).digest(), 0) for i in range(n)]


def worker(args: argparse.Namespace) -> dict:
    import logging

    import numpy as np
    import vllm
    from vllm.v1.kv_offload.tiering.fs.io import probe_o_direct

    logging.getLogger("vllm").setLevel(logging.WARNING)
    scratch = Path(args.scratch)
    sides = tier_configs(scratch, args.threads, args.fs_buffered)
    rng = np.random.default_rng(20240607)
    results = []
    for kib in args.sizes:
        row = kib * 1024
        per = max(1, args.mib * 2**20 // row // args.prompts)  # chunks per request
        chunks = per * args.prompts
        times: dict[str, dict[str, list[float]]] = {s: {o: [] for o in OPS} for s in sides}
        names = list(sides)
        for rnd in range(args.rounds):
            payload = np.frombuffer(rng.bytes(chunks * row), dtype=np.uint8).reshape(chunks, row)
            for name in (names if rnd % 2 == 0 else names[::-1]):
                tier = sides[name]
                prompts = [keys_for(name, kib, rnd, p, n=per) for p in range(args.prompts)]
                times[name]["store"].append(store(tier, prompts, payload, row))
                seconds, outcome = promote(tier, prompts, payload, row, empty_after=True)
                assert outcome["handed"] == chunks and outcome["corrupt_handed"] == 0, (name, outcome)
                times[name]["promotion"].append(seconds)
                # From the disk: the same chunks stored (untimed) in a location of their own, whose files are then
                # synced and dropped from the page cache (so the location above keeps its pages cached, as a store
                # that fits in memory does, and its writes stay comparable between rounds).
                cold = elsewhere(tier, "-cold")
                prompts = [keys_for("cold", name, kib, rnd, p, n=per) for p in range(args.prompts)]
                store(cold, prompts, payload, row)
                drop_cached(cold)
                seconds, outcome = promote(cold, prompts, payload, row, empty_after=True)
                assert outcome["handed"] == chunks and outcome["corrupt_handed"] == 0, (name, "cold", outcome)
                times[name]["promotion-cold"].append(seconds)
        # Integrity: one request per tier, one byte of its middle chunk flipped, promoted by a fresh manager.
        integrity = {}
        n = min(per, 8)
        payload = np.frombuffer(rng.bytes(n * row), dtype=np.uint8).reshape(n, row)
        for name, tier in sides.items():
            if name in REFERENCE:
                continue
            keys = keys_for("integrity", name, kib, n=n)
            store(tier, [keys], payload, row)
            copies = flip(tier, keys[n // 2], payload[n // 2].tobytes(), row)
            _, outcome = promote(tier, [keys], payload, row, empty_after=True)
            integrity[name] = dict(outcome, flipped_copies=copies)
        results.append({"row": row, "chunks": chunks, "per_prompt": per, "times": times, "integrity": integrity})
    probe = scratch / "o-direct-probe"
    probe.mkdir(exist_ok=True)
    return {"sizes": results, "rounds": args.rounds, "prompts": args.prompts, "mib": args.mib, "sides": list(sides),
            "o_direct": probe_o_direct(str(probe)), "vllm": vllm.__version__}


# -- the driver (kvc's interpreter) -------------------------------------------------------------------------------

def skip_reason(python: str | None) -> str | None:
    """Why the measurement cannot run (one line), or None."""
    if not python:
        return ("no vLLM interpreter (set KVC_VLLM_PYTHON or give --vllm-python: a Python that imports vllm and "
                "kvc)")
    probe = ("import importlib.util as u, sys; "
             "sys.exit(0 if u.find_spec('vllm') and u.find_spec('kvcache.engines.vllm') else 3)")
    try:
        rc = subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode
    except OSError as exc:
        return f"the vLLM interpreter {python} does not run ({exc})"
    return None if rc == 0 else (f"{python} cannot import vllm and kvcache.engines.vllm (make engine-check-vllm "
                                 f"installs both)")


def report(result: dict) -> tuple[str, dict[str, float]]:
    import _report

    rows, ratios, integrity_rows = [], {}, []
    for s in result["sizes"]:
        row = s["row"]
        size = f"{row // 1024} KiB" if row < 2**20 else f"{row // 2**20} MiB"
        label = size.replace(" ", "")
        med = {side: {o: statistics.median(ts) for o, ts in ops.items()} for side, ops in s["times"].items()}
        mib = s["chunks"] * row / 2**20
        rows.append([size, "fs", *(f"{mib / med['fs'][o]:.0f} MiB/s" for o in OPS)])
        for side in result["sides"]:
            if side == "fs":
                continue
            cells = [size, f"{side} (reference)" if side in REFERENCE else side]
            for o in OPS:
                ratio = med["fs"][o] / med[side][o]
                if side not in REFERENCE:
                    ratios[f"{o.replace('-', '_')}_kvc_over_fs[{side},{label}]"] = round(ratio, 2)
                cells.append(f"{mib / med[side][o]:.0f} / {mib / med['fs'][o]:.0f} MiB/s = **{ratio:.2f}x**")
            rows.append(cells)
        for side, got in s["integrity"].items():
            integrity_rows.append([size, side, str(got["chunks"]), str(got["handed"]), f"**{got['corrupt_handed']}**",
                                   "-" if got.get("checksum_failures") is None else str(got["checksum_failures"])])
    accept = [(k, v) for k, v in ratios.items() if "2MiB" in k and "[kvc-nosync," in k and "cold" not in k]
    cold = [(k, v) for k, v in ratios.items() if "2MiB" in k and "[kvc-nosync," in k and "cold" in k]
    synced = [(k, v) for k, v in ratios.items() if "2MiB" in k and "[kvc," in k and k.startswith("store")]
    corrupt = {side: sum(s["integrity"][side]["corrupt_handed"] for s in result["sizes"])
               for side in result["sides"] if side not in REFERENCE}
    integrity_met = corrupt.get("fs", 0) > 0 and all(v == 0 for side, v in corrupt.items() if side != "fs")
    verdict = bool(accept) and integrity_met and all(v >= (2.0 if k.startswith("store") else 1.2) for k, v in accept)
    first = result["sizes"][0]
    more = [side.split("-")[-1][:-2] for side in result["sides"] if side.endswith("io")]
    threads = f"; `kvc-nosync-Nio`: the same with `kvc_io_threads` N ({', '.join(more)})" if more else ""
    direct = ("with O_DIRECT (the page cache bypassed: its promotions read the disk)" if result["o_direct"] else
              "buffered (this filesystem refuses O_DIRECT)")
    body = [
        "## kvc as a vLLM offloading tier against vLLM's `fs` tier (bench_engine_vllm.py)",
        "",
        f"vLLM {result['vllm']} on CPU (its scheduler side; the bytes vLLM's GPU worker would copy are written and "
        f"read in the primary region where it would); each configuration built by vLLM's `OffloadingSpecFactory` "
        f"(`TieringOffloadingSpec`) with one secondary tier loaded by vLLM's tier factory, driven through vLLM's "
        f"`TieringOffloadingManager` as its scheduler drives it. {result['prompts']} requests per round, "
        f"{result['mib']} MiB of fresh chunks per tier (16-token blocks, one per chunk; {first['per_prompt']} chunks "
        f"per request at {first['row'] // 1024} KiB), {result['rounds']} interleaved rounds, medians. store: from "
        f"the first `complete_store` (one cascade job per request) until the last cascade is reported; promotion: a "
        f"fresh manager (empty primary) from the first lookup until every chunk is HIT in the primary (every chunk "
        f"compared, untimed), once with what was just written in the page cache and once on the same chunks stored "
        f"(untimed) in a location of their own whose files were then synced and dropped from the page cache. `fs`: vLLM's defaults (16 + 16 threads), writing and reading "
        f"{direct}, its directories made beforehand (untimed); `fs-buffered` (reference): the same tier with its "
        f"O_DIRECT off, as vLLM runs it where the filesystem refuses O_DIRECT. kvc: `KvcTier` on LMDB, its defaults "
        f"(2 I/O threads), at its default durability (`kvc`: each commit synced) and at `fs`'s (`kvc-nosync`: "
        f"`kvc_store_options` `{{\"durability\": \"none\"}}`; `fs` never fsyncs){threads}. All under one scratch "
        f"directory, emptied after each tier's round (untimed). Each cell: throughput / fs's = ratio. The "
        f"acceptance is judged on `kvc-nosync` (equal durability) with the page cache as the bench leaves it: kvc's "
        f"promotions then read memory while `fs`'s read the disk; the page-cache-dropped column compares both "
        f"reading the disk (this VM's virtual disk). {_report.machine()}; 1-minute load average "
        f"{result['load'][0]} before, {result['load'][1]} after.",
        "",
        _report.table(["chunk", "tier", "store", "promotion", "promotion, page cache dropped"], rows),
        "",
        "Integrity: one request stored per tier, one byte flipped in the middle of one of its chunks in place "
        "(`fs`: the chunk's file; kvc: the chunk's bytes in `data.mdb`), then promoted by a fresh manager; "
        "\"corrupt handed\" counts the chunks handed to vLLM (HIT in the primary, `prepare_load`) whose bytes differ "
        "from what was written. kvc's chunk fails its checksum and is not promoted (the request's scan stops at it).",
        "",
        _report.table(["chunk", "tier", "chunks stored", "chunks handed to vLLM", "corrupt handed",
                       "checksum failures"], integrity_rows),
        "",
        f"Acceptance (2 MiB chunks, kvc at equal durability: store >= 2x, promotion >= 1.2x; no corrupt chunk handed "
        f"where fs hands one): {'met' if verdict else 'NOT met'} ({', '.join(f'{k} {v:.2f}x' for k, v in accept)}; "
        f"corrupt chunks handed, all chunk sizes: {', '.join(f'{k} {v}' for k, v in corrupt.items())}). Page cache dropped: "
        f"{', '.join(f'{k} {v:.2f}x' for k, v in cold)}. With kvc's default durability (each commit synced): "
        f"{', '.join(f'{k} {v:.2f}x' for k, v in synced)}.",
    ]
    return "\n".join(body), ratios


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", default=os.environ.get("KVC_VLLM_PYTHON"),
                        help="vLLM's interpreter, with kvc installed (default: $KVC_VLLM_PYTHON)")
    parser.add_argument("--rounds", type=int, default=7,
                        help="interleaved rounds per chunk size (medians over them; this VM's disk swings a round by 2x)")
    parser.add_argument("--mib", type=int, default=128, help="MiB of chunks per tier per round")
    parser.add_argument("--prompts", type=int, default=8, help="requests per round (one cascade / promotion job each)")
    parser.add_argument("--sizes", default="256,2048", help="chunk row sizes in KiB, comma-separated")
    parser.add_argument("--threads", default="4",
                        help="also measure kvc-nosync with these kvc_io_threads (comma-separated; \"\": none)")
    parser.add_argument("--fs-buffered", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure fs with its O_DIRECT off (through the page cache), for reference")
    parser.add_argument("--no-write", action="store_true", help="print the figures, leave BENCHMARKS.md alone")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run in vLLM's interpreter
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.sizes = [int(x) for x in str(args.sizes).split(",") if x]
    args.threads = [int(x) for x in str(args.threads).split(",") if x]
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    reason = skip_reason(args.vllm_python)
    if reason:
        print(f"bench_engine_vllm: skipped: {reason}")
        return 0
    load = os.getloadavg()[0]  # the machine's 1-minute load before and after: the figures' context
    with tempfile.TemporaryDirectory(prefix="kvc-bench-vllm-") as scratch:
        proc = subprocess.run([args.vllm_python, __file__, "--worker", "1", "--scratch", scratch,
                               "--rounds", str(args.rounds), "--mib", str(args.mib), "--prompts", str(args.prompts),
                               "--sizes", ",".join(map(str, args.sizes)),
                               "--threads", ",".join(map(str, args.threads)),
                               "--fs-buffered" if args.fs_buffered else "--no-fs-buffered"],
                              capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        return proc.returncode
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["load"] = [round(load, 2), round(os.getloadavg()[0], 2)]
    body, ratios = report(result)
    import _report

    _report.publish("bench_engine_vllm", body, args.no_write, ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
