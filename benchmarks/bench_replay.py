"""The main job's cost: verifying every reused byte, and the replay driver end to end.

(1) Verify vs copy: N scattered 16 KiB pages (page 16, 1 KiB per token, the `kvc init` default layout) in a
    device-sized pool. `SyntheticKV.mismatches` (hash every byte of each page, compare with the digest its page
    hash prescribes) — for pages seen before (digest remembered: the steady state of a cache) and at first sight
    (digest computed from the regenerated page) — against the copy it checks: `copy_pages` host -> device of the
    same pages (the load-back path), and a plain memcpy of the same bytes. All in the same run; best of R.
(2) Replay: the synthetic multi-tenant generator (`kvc generate` defaults) replayed by `kvcache.workload.replay` on an
    LMDB store (temporary), default `kvc replay` tiers (L1 16,384 / L2 65,536 tokens, timeout prefetch policy,
    write-through): with --verify and without (the ratio is verify's share of the job), and with the ownership
    ledger switched off (the ledger's share). Requests/s and tokens/s. One torch thread, as `kvc` runs.

Run: ``python benchmarks/bench_replay.py [--pages N] [--requests N] [--repeat R] [--no-write]``.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

from _report import machine, publish, table
from kvcache import (
    CacheConfig,
    KVLayout,
    Namespace,
    RadixKey,
    SyntheticKV,
    TieredCache,
    WorkloadSpec,
    generate,
    page_hashes,
    replay,
)
from kvcache.ledger.copy import copy_pages
from kvcache.ledger.pools import SlotPool
from kvcache.storage.registry import open_store
from kvcache.types.keys import new_chain_key

LAYOUT = KVLayout("synthetic@r1", layers=4, kv_heads=2, head_dim=32, dtype="float16", page_size=16)


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def verify_vs_copy(n_pages: int, repeat: int) -> dict[str, float]:
    ps, bpt = LAYOUT.page_size, LAYOUT.bytes_per_token
    host = SlotPool("host", 2 * n_pages, ps, bpt)
    device = SlotPool("device", 2 * n_pages, ps, bpt)
    rng = np.random.default_rng(0)
    src = rng.permutation(2 * n_pages)[:n_pages].astype(np.int64)
    dst = rng.permutation(2 * n_pages)[:n_pages].astype(np.int64)
    hashes = page_hashes(LAYOUT.layout_id, RadixKey.of(range(n_pages * ps), Namespace("t1", "s")), ps,
                         new_chain_key())
    kv = SyntheticKV(LAYOUT)
    kv.write(host.pages, src, hashes)
    copy_pages(host, src, device, dst)
    assert len(kv.mismatches(device.pages, dst, hashes)) == 0
    flat_src = host.pages.numpy()[src].copy()
    flat_dst = np.empty_like(flat_src)
    t_first = best(lambda: SyntheticKV(LAYOUT).mismatches(device.pages, dst, hashes), repeat)  # digests computed
    t_verify = best(lambda: kv.mismatches(device.pages, dst, hashes), repeat)  # digests remembered
    t_copy = best(lambda: copy_pages(host, src, device, dst), repeat)
    t_memcpy = best(lambda: np.copyto(flat_dst, flat_src), repeat)
    nbytes = n_pages * LAYOUT.bytes_per_page
    return {"pages": n_pages, "verify_gbps": nbytes / t_verify / 1e9, "first_gbps": nbytes / t_first / 1e9,
            "first_over_copy": t_first / t_copy, "first_over_memcpy": t_first / t_memcpy,
            "copy_gbps": nbytes / t_copy / 1e9,
            "memcpy_gbps": nbytes / t_memcpy / 1e9, "verify_over_copy": t_verify / t_copy,
            "verify_over_memcpy": t_verify / t_memcpy}


def replay_run(trace, scratch: str, verify: bool, ledger: bool) -> dict[str, float]:
    path = tempfile.mkdtemp(dir=scratch)
    store = open_store(path, LAYOUT, create=True)
    cache = TieredCache(CacheConfig(LAYOUT, device_tokens=16384, host_tokens=65536, prefetch_policy="timeout",
                                    ledger=ledger), store)
    gc.collect()
    report = replay(cache, trace, verify=verify)
    cache.close()
    store.close()
    shutil.rmtree(path, ignore_errors=True)
    assert report.ok, "a benchmark replay must verify and audit clean"
    return {"seconds": report.seconds, "rps": report.requests_per_s, "tps": report.tokens_per_s,
            "verified": report.verified_tokens, "tokens": report.tokens}


VARIANTS = {  # name -> (verify, ledger)
    "verify on, ledger on (kvc replay --verify)": (True, True),
    "verify off, ledger on (kvc replay)": (False, True),
    "verify off, ledger off (baseline)": (False, False),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=4096, help="16 KiB pages verified and copied (default 64 MiB)")
    ap.add_argument("--requests", type=int, default=10000, help="requests in the generated trace")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    args = ap.parse_args()
    torch.set_num_threads(1)
    vc = verify_vs_copy(args.pages, args.repeat)
    trace = generate(WorkloadSpec(requests=args.requests))
    scratch = tempfile.mkdtemp(prefix="kvc-bench-replay-")
    try:
        runs = {name: min((replay_run(trace, scratch, *cfg) for _ in range(max(1, args.repeat - 1))),
                          key=lambda r: r["seconds"]) for name, cfg in VARIANTS.items()}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    base = runs["verify off, ledger off (baseline)"]["seconds"]
    no_verify = runs["verify off, ledger on (kvc replay)"]["seconds"]
    body = "\n".join([
        "## Verified replay (`benchmarks/bench_replay.py`)",
        "",
        f"Best of {args.repeat}. Machine: {machine()}. Layout: {LAYOUT.describe()} "
        f"({LAYOUT.bytes_per_page // 1024} KiB pages). CPU only: the device pool is host memory.",
        "",
        table(["operation", "pages", "GB/s", "ratio to the load-back copy", "ratio to memcpy"],
              [["verify, pages seen before (SyntheticKV.mismatches)", f"{vc['pages']:,}", f"{vc['verify_gbps']:.2f}",
                f"{vc['verify_over_copy']:.2f}x", f"{vc['verify_over_memcpy']:.2f}x"],
               ["verify, first sight of each page (expected digest computed)", f"{vc['pages']:,}",
                f"{vc['first_gbps']:.2f}", f"{vc['first_over_copy']:.2f}x", f"{vc['first_over_memcpy']:.2f}x"],
               ["load-back copy (copy_pages host -> device)", f"{vc['pages']:,}", f"{vc['copy_gbps']:.2f}", "1.00x",
                f"{vc['memcpy_gbps'] / vc['copy_gbps']:.2f}x"],
               ["memcpy (np.copyto, contiguous)", f"{vc['pages']:,}", f"{vc['memcpy_gbps']:.2f}", "", "1.00x"]]),
        "",
        f"Replay of {args.requests:,} generated requests ({runs[next(iter(runs))]['tokens']:,} tokens), "
        "L1 16,384 / L2 65,536 tokens, LMDB L3, timeout prefetch policy, write-through; best of "
        f"{max(1, args.repeat - 1)}.",
        "",
        table(["replay", "seconds", "requests/s", "tokens/s", "verified tokens", "time vs baseline"],
              [[name, f"{r['seconds']:.2f}", f"{r['rps']:,.0f}", f"{r['tps']:,.0f}", f"{r['verified']:,}",
                f"{r['seconds'] / base:.2f}x"] for name, r in runs.items()]),
        "",
        f"Verify's share of the job: {runs[next(iter(runs))]['seconds'] / no_verify:.2f}x the replay without it; "
        f"the ledger's: {no_verify / base:.2f}x the replay without it.",
    ])
    publish("bench_replay", body, args.no_write, {
        "verify_over_copy": vc["verify_over_copy"], "verify_over_memcpy": vc["verify_over_memcpy"],
        "replay_verify_over_no_verify": runs[next(iter(runs))]["seconds"] / no_verify,
        "replay_ledger_over_no_ledger": no_verify / base,
        "replay_requests_per_s": runs[next(iter(runs))]["rps"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
