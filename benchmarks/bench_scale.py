"""Cost per request over a long replay: does it stay flat as the tree grows?

Workload (streamed, never held in memory): 4 namespaces x 5 shared prefixes of 64 tokens = 20 shared-prefix nodes;
each request either opens a conversation (a shared prefix, then 24-72 new tokens) or continues one of its
namespace's 64 open conversations (the conversation so far, 8 output tokens, 24-72 new tokens; at most 4 turns).
KV is 32 B per token (1 layer, 1 KV head, head_dim 8, float16) so the copies stay CPU-cheap and the tree's own
bookkeeping is what is measured. Page size 16. L1 holds about 1/8 and L2 about 1/2 of the run's tokens: devices
evict all along (write-through keeps host copies), the host tier starts evicting half way; the tree grows to
hundreds of thousands of nodes, the shared-prefix nodes to tens of thousands of children.

The public replay driver (`kvcache.replay`) runs it: prefetch-less serve loop, admit, synthetic KV write, commit,
backup. Cost per request is the process's CPU time (`time.process_time`: on a shared machine other processes
inflate it far less than wall clock) per window of requests, the generator's own time subtracted, the cyclic GC's
share shown beside it; the headline is the last window's cost over the second window's (the first includes
warm-up): flat is 1.0. Each window is also cut into ten slices and the median slice's cost reported beside the
mean: a burst of load from another process, or one full collection, moves a window's mean but not its median, so
the median ratio is the steadier figure on a shared machine (both are published). A slower machine moves every
window, slices and all: the workload generator's own time per request is the control (the same Python work for
every request, timed in the same windows), and the ratio is published against it too.

Run: ``python benchmarks/bench_scale.py [--requests N] [--window N] [--no-write]``; the acceptance run is
``--requests 1000000 --window 100000``. The default (20,000) is the `make bench` size.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import numpy as np
import torch

from _report import machine, publish, table
from kvcache import CacheConfig, KVLayout, TieredCache, TraceRequest, replay

LAYOUT = KVLayout("scale@r1", layers=1, kv_heads=1, head_dim=8, dtype="float16", page_size=16)
TENANTS, PREFIXES, PREFIX_TOKENS = 4, 5, 64
OPEN, MAX_TURNS, OUTPUT_TOKENS = 64, 4, 8
NEW_LO, NEW_HI = 24, 72
MEAN_TOKENS_PER_REQUEST = 48 + 0.5 * OUTPUT_TOKENS  # new tokens a request adds, on average
SLICES = 10  # slices per window, for the median slice cost


class Workload:
    """The streamed trace; `gen_seconds` is the time spent generating requests (subtracted from the windows)."""

    def __init__(self, requests: int, seed: int = 0) -> None:
        self.requests = requests
        self.rng = np.random.default_rng(seed)
        self.gen_seconds = 0.0

    def __iter__(self):
        rng, clock = self.rng, time.process_time
        t0 = clock()
        prefixes = [[rng.integers(0, 32000, PREFIX_TOKENS).tolist() for _ in range(PREFIXES)]
                    for _ in range(TENANTS)]
        conversations: list[list[list]] = [[] for _ in range(TENANTS)]  # per tenant: [tokens, turns]
        self.gen_seconds += clock() - t0
        for r in range(self.requests):
            t0 = clock()
            t = int(rng.integers(TENANTS))
            new = rng.integers(0, 32000, int(rng.integers(NEW_LO, NEW_HI + 1))).tolist()
            open_ = conversations[t]
            if open_ and rng.random() < 0.5:
                conv = open_[int(rng.integers(len(open_)))]
                conv[0] = conv[0] + rng.integers(0, 32000, OUTPUT_TOKENS).tolist() + new
                conv[1] += 1
                if conv[1] >= MAX_TURNS:
                    open_.remove(conv)
            else:
                conv = [prefixes[t][int(rng.integers(PREFIXES))] + new, 1]
                open_.append(conv)
                if len(open_) > OPEN:
                    open_.pop(0)
            item = TraceRequest(f"r{r}", conv[0], f"tenant-{t}", None, OUTPUT_TOKENS)
            self.gen_seconds += clock() - t0
            yield item


def run(requests: int, window: int) -> dict:
    total_tokens = int(requests * MEAN_TOKENS_PER_REQUEST)
    cache = TieredCache(CacheConfig(LAYOUT, device_tokens=max(total_tokens // 8, 1 << 14),
                                    host_tokens=max(total_tokens // 2, 1 << 16), device="cpu"))
    work = Workload(requests)
    slice_ = max(window // SLICES, 1)
    # (requests, clock, generator s, GC s, device pages evicted, host pages evicted) at slice ends
    marks: list[tuple[int, float, float, float, int, int]] = []
    next_mark = slice_
    gc_seconds, gc_start = 0.0, 0.0

    def on_gc(phase: str, info: dict) -> None:
        nonlocal gc_seconds, gc_start
        if phase == "start":
            gc_start = time.process_time()
        else:
            gc_seconds += time.process_time() - gc_start

    def progress(done: int) -> None:
        nonlocal next_mark
        if done >= next_mark:
            c = cache.counters
            marks.append((done, time.process_time(), work.gen_seconds, gc_seconds, c.device_pages_evicted,
                          c.host_pages_evicted))
            next_mark += slice_

    gc.collect()
    gc.callbacks.append(on_gc)
    start = time.process_time()
    try:
        report = replay(cache, work, progress=progress)
    finally:
        gc.callbacks.remove(on_gc)
    assert report.audit.ok and report.requests == requests, report.audit
    slices, prev = [], (0, start, 0.0, 0.0, 0, 0)
    for mark in marks:  # per request in each slice: CPU s less the generator's, GC s, generator s, pages evicted
        n = mark[0] - prev[0]
        slices.append((mark[0], (mark[1] - prev[1] - (mark[2] - prev[2])) / n, (mark[3] - prev[3]) / n,
                       (mark[2] - prev[2]) / n, (mark[4] - prev[4]) / n, (mark[5] - prev[5]) / n))
        prev = mark
    windows = []  # (end, mean cost, median slice cost, GC, generator, device and host pages evicted) per window
    for w in range(requests // window):
        mine = [s for s in slices if w * window < s[0] <= (w + 1) * window]
        if mine:
            n = mine[-1][0] - w * window
            sizes = [s[0] - (mine[i - 1][0] if i else w * window) for i, s in enumerate(mine)]

            def mean_of(k: int, mine=mine, sizes=sizes, n=n) -> float:
                return sum(s[k] * size for s, size in zip(mine, sizes, strict=True)) / n

            windows.append((mine[-1][0], mean_of(1), statistics.median(s[1] for s in mine), mean_of(2), mean_of(3),
                            mean_of(4), mean_of(5)))
    return {"windows": windows, "seconds": report.seconds, "nodes": cache.tree.node_count,
            "evicted": (cache.counters.device_pages_evicted, cache.counters.host_pages_evicted)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20000, help="requests replayed (the acceptance run: 1000000)")
    ap.add_argument("--window", type=int, default=None, help="requests per window (default: a tenth of the run)")
    ap.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    args = ap.parse_args()
    window = args.window or max(args.requests // 10, 1)
    if args.requests < 2 * window:
        ap.error("--requests must cover at least two windows")
    torch.set_num_threads(1)
    result = run(args.requests, window)
    windows = result["windows"]
    ratio = windows[-1][1] / windows[1][1]
    ratio_median = windows[-1][2] / windows[1][2]
    control = windows[-1][4] / windows[1][4]  # the generator's own last / second window: the machine's drift
    rows = [[f"{end - window:,}-{end:,}", f"{cost * 1e6:.1f}", f"{cost / windows[1][1]:.2f}", f"{med * 1e6:.1f}",
             f"{med / windows[1][2]:.2f}", f"{gcs * 1e6:.1f}", f"{gen * 1e6:.1f} ({gen / windows[1][4]:.2f})",
             f"{dev:.1f} / {host:.1f}"] for end, cost, med, gcs, gen, dev, host in windows]
    body = "\n".join([
        "## Cost per request over a long replay (`benchmarks/bench_scale.py`)",
        "",
        f"{args.requests:,} requests (4 namespaces, 20 shared prefixes, conversations of up to 4 turns), 32 B/token, "
        f"page 16, L1 1/8 and L2 1/2 of the run's tokens, write-through; windows of {window:,} requests; cost = "
        f"the process's CPU time per request; one torch thread; GC on. Machine: {machine()}.",
        "",
        table(["requests", "us/request (mean)", "x second window", f"median of {SLICES} slices us/request",
               "x second window", "of which GC us/request", "generator us/request (x second window)",
               "pages evicted per request: device / host"], rows),
        "",
        "The generator column is a control: the workload's own Python, the same work for every request and not "
        "part of the cost, timed in the same windows; where it rises too, the machine (or the process's memory "
        "footprint) slowed, not kvc. The eviction columns show the work per request: the device tier evicts from "
        "the second window on, the host tier from half way (where L2 fills), so the windows after that do more per "
        "request than the second.",
        "",
        f"- last window / second window: **{ratio:.2f}x** on the means, **{ratio_median:.2f}x** on the slice "
        f"medians (flat = 1.0); against the control (the generator's own last / second window, "
        f"{control:.2f}x): **{ratio / control:.2f}x**; {result['nodes']:,} tree nodes at the end; "
        f"pages evicted: device {result['evicted'][0]:,}, host {result['evicted'][1]:,}; "
        f"{args.requests / result['seconds']:,.0f} requests/s over the run (wall clock)",
    ])
    publish("bench_scale", body, args.no_write, {"scale_cost_ratio": ratio, "scale_median_cost_ratio": ratio_median,
                                                  "scale_controlled_cost_ratio": ratio / control,
                                                  "replay_requests_per_s": args.requests / result["seconds"],
                                                  # CPU per request, less the generator's, over every window
                                                  "request_cost_seconds": statistics.mean(w[1] for w in windows)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
