"""Capacity sweep (`kvc sweep`, issue 37): a 9-size sweep against the 9 full replays it stands for.

One synthetic multi-tenant trace (`kvc generate` defaults: 4 salted tenants, `--requests` requests) and the `kvc init`
default layout (page 16, 1 KiB per token). Nine sizes: L1 x L2 = {4,096, 16,384, 65,536} x {16,384, 65,536,
262,144} tokens, L3 unlimited, write-through, wait_complete prefetch, cache mode. Both in this process, one torch
thread (as `kvc` runs), the same run:

- **sweep**: `kvcache.workload.sweep.sweep` over the nine sizes, one lane per core: this process and one worker
  process per other core (what `kvc sweep` runs; the workers' start-up included). L3 unlimited: each size's L3 is
  the sweep's byte-free page set;
- **replays**: nine replays, one per size, one after another, each what `kvc replay --prefetch-policy wait_complete`
  runs (kvc.context.offline_cache: the default CacheConfig, L3 I/O on its thread, synthetic KV written at every
  forward) on a new LMDB store of the default durability: what sizing took before `kvc sweep`. Without the start-up
  of nine `kvc` processes (about 2 s each here), which favours the replays.

The ratio is replays / sweep (higher: the sweep is faster). The hit tokens of each size are printed side by side:
the sweep's are exactly those of a replay with L3 I/O inline (tests/unit/workload/test_sweep.py checks that);
`kvc replay` runs its L3 I/O on a thread and re-arms short prefetches on a timer, so its L3 hits may differ a little
from run to run, and the text says by how much.

Run: ``python benchmarks/bench_sweep.py [--requests N] [--workers N] [--no-write]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time

import torch

from _report import machine, publish, table
from kvcache import CacheConfig, KVLayout, TieredCache, WorkloadSpec, generate, replay
from kvcache.storage.registry import open_store
from kvcache.types.sweep import SweepPoint
from kvcache.workload.sweep import sweep

LAYOUT = KVLayout("synthetic@r1", layers=4, kv_heads=2, head_dim=32, dtype="float16", page_size=16)  # kvc init's
DEVICE = [4096, 16384, 65536]
HOST = [16384, 65536, 262144]
TARGET = 5.0  # the acceptance bound of issue 37: the sweep at least 5x faster than the replays


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and of its children that have ended (the sweep's workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def full_replay(trace, scratch: str, device: int, host: int):
    """One `kvc replay` at a size on a new store; its report."""
    store = open_store(tempfile.mkdtemp(dir=scratch), LAYOUT, create=True)
    try:
        cache = TieredCache(CacheConfig(LAYOUT, device_tokens=device, host_tokens=host,
                                        prefetch_policy="wait_complete"), store)
        try:
            return replay(cache, trace)
        finally:
            cache.close()
    finally:
        store.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000, help="requests in the trace")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="the sweep's lanes, this process included (default: the cores this process may use)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = parser.parse_args()
    torch.set_num_threads(1)
    trace = list(generate(WorkloadSpec(requests=args.requests)))
    sizes = [(d, h) for d in DEVICE for h in HOST]
    workers = args.workers
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    start, cpu0 = time.perf_counter(), cpu_seconds()
    swept = sweep(LAYOUT, trace, [SweepPoint(d, h) for d, h in sizes], workers=workers)
    t_sweep, c_sweep = time.perf_counter() - start, cpu_seconds() - cpu0
    replays = []
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as scratch:
        start, cpu0 = time.perf_counter(), cpu_seconds()
        for d, h in sizes:
            replays.append(full_replay(trace, scratch, d, h))
        t_replays, c_replays = time.perf_counter() - start, cpu_seconds() - cpu0
    ratio = t_replays / t_sweep
    rows, worst = [], 0.0
    for (d, h), point, full in zip(sizes, swept.points, replays, strict=True):
        s, r = point.hit_tokens, full.hit_tokens
        worst = max(worst, abs(s.total - r.total) / r.total if r.total else 0.0)
        rows.append([f"{d:,}", f"{h:,}", f"{s.device:,} / {s.host:,} / {s.storage:,}",
                     f"{r.device:,} / {r.host:,} / {r.storage:,}", f"{point.hit_rate:.3f}",
                     f"{r.total / full.tokens:.3f}" if full.tokens else "-"])
    met = ratio >= TARGET
    body = "\n".join([
        "## Capacity sweep: 9 sizes in one sweep against 9 full replays (bench_sweep.py)",
        "",
        f"Machine: {machine()}. Trace: `kvc generate --requests {args.requests}` ({swept.requests:,} requests, "
        f"{swept.tokens:,} tokens, 4 salted tenants); `kvc init` default layout (page 16, 1 KiB per token); "
        f"L3 unlimited, write-through, wait_complete, cache mode. The sweep ran {swept.workers} lanes (this "
        f"process and {swept.workers - 1} worker process{'es' if swept.workers > 2 else ''}, their start-up "
        f"included); the replays one after another, each on a new store (`kvc replay`'s cache: L3 I/O on "
        f"its thread, synthetic KV written, the store's default durability). Wall time, same run, load before: "
        f"{load}.",
        "",
        table(["run", "wall seconds", "CPU seconds"],
              [["sweep (9 sizes)", f"{t_sweep:.1f}", f"{c_sweep:.1f}"],
               ["9 full replays", f"{t_replays:.1f}", f"{c_replays:.1f}"],
               ["ratio (replays / sweep)", f"**{ratio:.1f}x**", f"{c_replays / c_sweep:.1f}x"]]),
        "",
        table(["L1 tokens", "L2 tokens", "sweep hits L1 / L2 / L3", "replay hits L1 / L2 / L3", "sweep hit rate",
               "replay hit rate"], rows),
        "",
        f"Acceptance (issue 37): the sweep at least {TARGET:.0f}x faster than the replays (wall time) — "
        f"{'**met**' if met else '**not met**'}; load after: {', '.join(f'{x:.2f}' for x in os.getloadavg())} "
        f"(CPU seconds: user + system, the sweep's worker processes included; a machine whose cores others keep "
        f"busy stretches wall time, and the sweep's parallel processes gain only on idle cores). Total hit tokens differ from `kvc replay`'s by at most "
        f"{100 * worst:.2f} % (its threaded L3 I/O and timed prefetch retries; with inline I/O they are equal). "
        f"Ownership audits: {'ok' if swept.ok and all(r.audit.ok for r in replays) else 'FAILED'}.",
    ])
    publish("bench_sweep", body, args.no_write, {"sweep_over_replays": ratio,
                                                 "sweep_over_replays_cpu": c_replays / c_sweep,
                                                 "sweep_seconds": t_sweep, "replays_seconds": t_replays})
    return 0 if swept.ok and all(r.audit.ok for r in replays) else 1


if __name__ == "__main__":
    sys.exit(main())
