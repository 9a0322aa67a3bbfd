"""KV events: how many a replay publishes per second, and what publishing them costs the replay.

A multi-tenant trace is replayed through L1 + L2 + L3 (LMDB, a fresh store per run) under pressure, twice per
repetition and interleaved: without a feed (the baseline), then with a `KVEventPublisher` on loopback TCP and a
subscriber in its own process that decodes every batch and counts its events (so the events are really sent,
received and decoded; the subscriber's work does not share the replay's interpreter lock). The two runs of a pair
alternate in order. Reported per pair as the replay's wall time and its process CPU time (the replaying process,
ZeroMQ's I/O thread included; the subscriber, a router's work, is not) with the feed over without it, median and
(min-max) over the pairs, and events published per second of replay. The subscriber's count must equal what the
publisher sent. Target: <= 1.10x. On a shared machine the CPU-time ratio is the steadier of the two.

Run: ``python benchmarks/bench_events.py [--requests N] [--repeat R] [--no-write]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch
from _report import machine, publish, spread, table

from kvcache import CacheConfig, KVEventPublisher, KVLayout, Replayer, TieredCache, WorkloadSpec, generate
from kvcache.storage.base import open_store

LAYOUT = KVLayout("bench-events@r1", layers=2, kv_heads=2, head_dim=32, dtype="float16", page_size=16)
DEVICE_TOKENS, HOST_TOKENS = 8192, 16384

# The subscriber, in its own process: a plain SUB socket and kvc's decoder; ends at the closing AllBlocksCleared.
SUBSCRIBER = textwrap.dedent("""
    import json, sys, zmq
    from kvcache.events import AllBlocksCleared, decode_batch
    ctx = zmq.Context(); sub = ctx.socket(zmq.SUB); sub.setsockopt(zmq.RCVHWM, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b""); sub.connect(sys.argv[1])
    print("ready", flush=True)
    batches = events = 0
    while sub.poll(60000):
        topic, seq, payload = sub.recv_multipart()
        batch = decode_batch(payload)
        batches += 1; events += len(batch.events)
        if int.from_bytes(seq, "big") > 0 and isinstance(batch.events[-1], AllBlocksCleared):
            break
    print(json.dumps({"batches": batches, "events": events}))
""")


def _subscriber(endpoint: str) -> subprocess.Popen:
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, endpoint], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def one_run(scratch: str, trace, feed: bool) -> dict[str, float]:
    """Replay `trace` on a fresh cache over a fresh store; with `feed`, publish its events to a subscriber."""
    path = f"{scratch}/store"
    shutil.rmtree(path, ignore_errors=True)
    store = open_store(path, LAYOUT, create=True, durability="none")
    cache = TieredCache(CacheConfig(LAYOUT, device_tokens=DEVICE_TOKENS, host_tokens=HOST_TOKENS, device="cpu"),
                        store)
    cache.device_pool.storage.fill_(0)
    cache.host_pool.storage.fill_(0)  # fault the pools in outside the timing
    publisher = sub = None
    if feed:
        publisher = KVEventPublisher(cache, "tcp://127.0.0.1:*")
        sub = _subscriber(publisher.endpoint)
        time.sleep(0.2)  # the subscription reaches the publisher
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    report = Replayer(cache).run(trace)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert report.audit.ok and report.refused == 0, report.audit
    out = {"wall": wall, "cpu": cpu, "evicted": cache.counters.device_pages_evicted}
    cache.close()
    if publisher is not None:
        st = publisher.stats()
        publisher.close()
        got = json.loads(sub.communicate(timeout=120)[0])
        # all but the first batch (the cache's announcement, one AllBlocksCleared: it left before the subscriber
        # could connect)
        assert got["events"] == st.events - 1 and got["batches"] == st.batches - 1, (got, st)
        out.update(events=st.events - 1, batches=st.batches, bytes=st.bytes)  # less the closing AllBlocksCleared
    store.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=800, help="requests in the replayed trace")
    ap.add_argument("--repeat", type=int, default=5, help="interleaved pairs of runs (without, with the feed)")
    ap.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    args = ap.parse_args()
    torch.set_num_threads(1)
    trace = generate(WorkloadSpec(requests=args.requests, tenants=4, seed=7))
    scratch = tempfile.mkdtemp(prefix="kvc-bench-events-")
    pairs = []
    try:
        one_run(scratch, trace[: max(1, len(trace) // 10)], True)  # warm-up: imports, sockets, allocator
        for rep in range(args.repeat):
            if rep % 2 == 0:  # alternate which goes first: a drift of the machine's load favours neither
                off = one_run(scratch, trace, False)
                on = one_run(scratch, trace, True)
            else:
                on = one_run(scratch, trace, True)
                off = one_run(scratch, trace, False)
            pairs.append((off, on))
            print(f"run {rep + 1}: without {off['wall']:.3f} s ({off['cpu']:.3f} s CPU), with the feed "
                  f"{on['wall']:.3f} s ({on['cpu']:.3f} s CPU), {on['events']:,} events in {on['batches']:,} "
                  f"batches", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    wall_ratio = [on["wall"] / off["wall"] for off, on in pairs]
    cpu_ratio = [on["cpu"] / off["cpu"] for off, on in pairs]
    per_s = [on["events"] / on["wall"] for _, on in pairs]
    per_event = [1e6 * (on["cpu"] - off["cpu"]) / on["events"] for off, on in pairs]
    on0 = pairs[0][1]
    body = "\n".join([
        "## KV events: published per second, and their cost to a replay (`benchmarks/bench_events.py`)",
        "",
        f"Machine: {machine()}; load average {os.getloadavg()[0]:.2f} when the script ended (the machine may be "
        f"shared). A {args.requests:,}-request, 4-tenant trace replayed through L1 {DEVICE_TOKENS:,} / L2 "
        f"{HOST_TOKENS:,} tokens (page 16) and L3 (LMDB, a fresh store per run, write-through), under pressure "
        f"({on0['evicted']:,} device pages evicted per run). Each repetition runs without a feed, then with a "
        f"`KVEventPublisher` on loopback TCP and a subscriber process decoding every batch (it received exactly "
        f"what was sent); median (min-max) of {args.repeat} interleaved pairs, alternating which run goes first. The "
        f"CPU time is the replaying process's (ZeroMQ's I/O thread included, the subscriber not): on a shared "
        f"machine it is the steadier figure.",
        "",
        table(["figure", "value"], [
            ["events published per second of replay", spread(per_s, 0, "")],
            ["events per run (batches)", f"{on0['events']:,} ({on0['batches']:,}), "
                                         f"{on0['bytes'] / max(1, on0['batches']):,.0f} B per batch"],
            ["replay wall time, with the feed over without (target <= 1.10x)", f"**{spread(wall_ratio)}**"],
            ["replay CPU time, with the feed over without", spread(cpu_ratio)],
            ["extra CPU per event published (hashes, encoding, send)", spread(per_event, 1, " us")],
            ["replay wall time without a feed (baseline)",
             spread([off["wall"] for off, _ in pairs], 3, " s")],
        ]),
    ])
    ratios = {"replay_time_events_over_no_events": statistics.median(wall_ratio),
              "replay_cpu_events_over_no_events": statistics.median(cpu_ratio),
              "kv_events_published_per_s": statistics.median(per_s)}
    publish("bench_events", body, args.no_write, ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
