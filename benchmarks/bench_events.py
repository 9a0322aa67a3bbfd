"""KV events: how many a replay publishes per second, and what publishing them costs the replay.

A multi-tenant trace is replayed through L1 + L2 + L3 (LMDB, a fresh store per run) under pressure, three times per
round: without a feed (the baseline); with a `KVEventPublisher` on loopback TCP and a subscriber in its own process
that decodes every batch and counts its events (so the events are really sent, received and decoded; the
subscriber's count must equal what the publisher sent); and with the feed but no subscriber (ZeroMQ drops the
messages at the socket: the engine's own work — building, encoding, sending — without a router's process competing
for this machine's cores). The order is reversed every other round. Reported: the replay's wall time and its process
CPU time (ZeroMQ's I/O thread included) with the feed over without it, median and (min-max) over the rounds, and
events published per second of replay. Target: <= 1.10x.

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
from kvcache.storage.registry import open_store

LAYOUT = KVLayout("bench-events@r1", layers=2, kv_heads=2, head_dim=32, dtype="float16", page_size=16)
DEVICE_TOKENS, HOST_TOKENS = 8192, 16384

# The subscriber, in its own process: a plain SUB socket and kvc's decoder; ends at the closing AllBlocksCleared.
SUBSCRIBER = textwrap.dedent("""
    import json, sys, zmq
    from kvcache.types.events import AllBlocksCleared, decode_batch
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


def one_run(scratch: str, trace, feed: bool, subscriber: bool = True) -> dict[str, float]:
    """Replay `trace` on a fresh cache over a fresh store; with `feed`, publish its events (to a subscriber process
    unless `subscriber` is false: then ZeroMQ drops them at the socket, the engine's side of the work alone)."""
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
        if subscriber:
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
        if sub is not None:
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
    ap.add_argument("--repeat", type=int, default=21, help="interleaved pairs of runs (without, with the feed); "
                    "the pairs of a shared 2-core machine spread by +-20 %%, so the median needs many")
    ap.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    args = ap.parse_args()
    torch.set_num_threads(1)
    trace = generate(WorkloadSpec(requests=args.requests, tenants=4, seed=7))
    scratch = tempfile.mkdtemp(prefix="kvc-bench-events-")
    pairs = []
    try:
        one_run(scratch, trace[: max(1, len(trace) // 10)], True)  # warm-up: imports, sockets, allocator
        for rep in range(args.repeat):
            kinds = [(False, True), (True, True), (True, False)]  # none, feed + subscriber, feed alone
            if rep % 2:  # alternate the order: a drift of the machine's load favours none of them
                kinds.reverse()
            got = {kind: one_run(scratch, trace, *kind) for kind in kinds}
            off, on, alone = got[(False, True)], got[(True, True)], got[(True, False)]
            pairs.append((off, on, alone))
            print(f"run {rep + 1}: without {off['wall']:.3f} s ({off['cpu']:.3f} s CPU), with the feed "
                  f"{on['wall']:.3f} s ({on['cpu']:.3f} s CPU), {on['events']:,} events in {on['batches']:,} "
                  f"batches; feed without a subscriber {alone['wall']:.3f} s ({alone['cpu']:.3f} s CPU)", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    wall_ratio = [on["wall"] / off["wall"] for off, on, _ in pairs]
    cpu_ratio = [on["cpu"] / off["cpu"] for off, on, _ in pairs]
    alone_wall = [alone["wall"] / off["wall"] for off, _, alone in pairs]
    alone_cpu = [alone["cpu"] / off["cpu"] for off, _, alone in pairs]
    per_s = [on["events"] / on["wall"] for _, on, _ in pairs]
    on0 = pairs[0][1]
    body = "\n".join([
        "## KV events: published per second, and their cost to a replay (`benchmarks/bench_events.py`)",
        "",
        f"Machine: {machine()}; load average {os.getloadavg()[0]:.2f} when the script ended (the machine may be "
        f"shared). A {args.requests:,}-request, 4-tenant trace replayed through L1 {DEVICE_TOKENS:,} / L2 "
        f"{HOST_TOKENS:,} tokens (page 16) and L3 (LMDB, a fresh store per run, write-through), under pressure "
        f"({on0['evicted']:,} device pages evicted per run). Each repetition runs without a feed, then with a "
        f"`KVEventPublisher` on loopback TCP and a subscriber process decoding every batch (it received exactly "
        f"what was sent), then once more with the feed and no subscriber (ZeroMQ drops the messages at the socket: "
        f"the engine's own work); median (min-max) over {args.repeat} rounds, the order reversed every other round. "
        f"CPU time is the replaying process's (ZeroMQ's I/O thread included, the subscriber not). On this 2-core "
        f"machine the subscriber process competes with the replay for the cores; a router runs elsewhere.",
        "",
        table(["figure", "value"], [
            ["events published per second of replay", spread(per_s, 0, "")],
            ["events per run (batches)", f"{on0['events']:,} ({on0['batches']:,}), "
                                         f"{on0['bytes'] / max(1, on0['batches']):,.0f} B per batch"],
            ["replay wall time, with the feed over without (target <= 1.10x)", f"**{spread(wall_ratio)}**"],
            ["replay CPU time, with the feed over without", spread(cpu_ratio)],
            ["the same without a subscriber (the engine's work alone): wall", spread(alone_wall)],
            ["the same without a subscriber: CPU", spread(alone_cpu)],
            ["replay wall time without a feed (baseline)",
             spread([off["wall"] for off, _, _ in pairs], 3, " s")],
        ]),
    ])
    ratios = {"replay_time_events_over_no_events": statistics.median(wall_ratio),
              "replay_cpu_events_over_no_events": statistics.median(cpu_ratio),
              "replay_time_feed_alone_over_no_events": statistics.median(alone_wall),
              "kv_events_published_per_s": statistics.median(per_s)}
    publish("bench_events", body, args.no_write, ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
