"""The KV-event feed under hostile replay clients: `kvc serve --events` with a live replay running, quiet and then
under 64 replay flooders.

`kvc serve` runs on a fresh LMDB store with a KV-event feed and its replay socket (on loopback). A live replay drives
it (`kvc --socket S replay TRACE`, the same trace again and again, as the CLI sends it). Three phases of `--seconds`
each: quiet, flooded, quiet again. In the flooded phase a process of its own runs 64 flooders: each one, every
second, opens a new replay connection that never reads (the smallest receive queue and buffer ZeroMQ allows), asks
for the whole buffer on it, and keeps its two newest such connections open — 64 new requests a second, 128
connections piling up what the publisher would queue for them. At the end of the flood a well-behaved client
fetches the whole buffer (`KVEventSubscriber.fetch(0)`), flooders still there.

Reported: the server's RSS (VmRSS from /proc) at the end of the first quiet phase and its peak (VmHWM) over the
flood — growth must be <= 64 MiB (the replay buffer, `--events-buffer` batches, is full before the flood begins, so
the feed's own growth is not counted); the live replay's throughput (requests per second of the server's replay
time, over the replays that completed in a phase) flooded over quiet (the mean of both quiet phases), target
>= 0.8x; the well-behaved client's fetch (batches, gaps, time); and the busy answers the flooders found on their
last connections (the cap on answers running at once, seen from outside).

Run: ``python benchmarks/bench_feed_flood.py [--seconds S] [--requests N] [--no-write]`` (acceptance: --seconds 60).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from _report import machine, publish, table
from kvcache.live.feed import REPLAY_BUSY
from kvcache.live.subscriber import KVEventSubscriber

MiB = 1 << 20
HERE = Path(__file__).resolve().parent
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE.parent / "cli"),
                                                   os.environ.get("PYTHONPATH", "")]))
FLOODERS = 64
DEVICE_TOKENS, HOST_TOKENS = 4096, 8192  # smaller than the trace's working set: every replay evicts, and publishes
EVENTS_BUFFER = 1000  # batches: filled before the flood, so that the flood's growth is the flood's alone

# The flooders, in a process of their own: a new non-reading replay connection per flooder per second, asking for
# everything; the two newest of each kept open. Ends when its stdin closes; prints what it did.
FLOODER = textwrap.dedent("""
    import json, select, sys, time, zmq
    endpoint, flooders, busy_frame = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3])
    ctx = zmq.Context()
    open_ = [[] for _ in range(flooders)]
    asked = 0
    def hostile():
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0); s.setsockopt(zmq.RCVHWM, 1); s.setsockopt(zmq.RCVBUF, 4096)
        s.connect(endpoint)
        s.send_multipart([b"", (0).to_bytes(8, "big")])
        return s
    print("ready", flush=True)
    while not select.select([sys.stdin], [], [], 0)[0]:
        t0 = time.monotonic()
        for mine in open_:
            mine.append(hostile()); asked += 1
            if len(mine) > 2:
                mine.pop(0).close(0)
        time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
    busy = 0
    for mine in open_:  # what came back before each closes: a busy answer is one message (it is read: counted)
        for s in mine:
            while s.poll(0):
                frames = s.recv_multipart()
                busy += len(frames) == 3 and frames[1] == busy_frame
            s.close(0)
    print(json.dumps({"requests": asked, "busy_seen": busy}), flush=True)
""")


def kvc(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvc", *args], capture_output=True, text=True, env=ENV,
                          check=True, **kw)


def memory(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (its peak) and RssAnon (the part that is not mapped files: LMDB's map is one) of a process,
    in bytes."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM", "RssAnon")}


def reset_peak(pid: int) -> bool:
    """Reset the kernel's VmHWM of `pid` to its RSS now (Linux >= 4.0: write 5 to clear_refs). False if refused."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def fetch_all(ready: dict) -> tuple[list, float]:
    """What the feed's replay buffer holds, fetched as `kvc events` does, and how long it took."""
    t0 = time.monotonic()
    with KVEventSubscriber(ready["events"], replay_endpoint=ready["events_replay"], replay_timeout=60) as sub:
        got = sub.fetch(0)
    return got, time.monotonic() - t0


def phase(sock: str, trace: str, seconds: float, pid: int) -> dict:
    """Replay `trace` on the live cache again and again for `seconds`; throughput over the replays completed, and
    the server's RSS sampled between them."""
    requests, replay_s, runs, rss = 0, 0.0, 0, []
    end = time.monotonic() + seconds
    while time.monotonic() < end or runs == 0:
        report = json.loads(kvc("--socket", sock, "replay", trace, "--json").stdout)
        assert report["audit"]["ok"] and report["refused"] == 0, report["audit"]
        requests += report["requests"]
        replay_s += report["seconds"]
        runs += 1
        rss.append(memory(pid)["VmRSS"])
    return {"requests_per_s": requests / replay_s, "runs": runs, "rss_max": max(rss)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each phase (acceptance: 60)")
    ap.add_argument("--requests", type=int, default=300, help="requests in the replayed trace")
    ap.add_argument("--events-buffer", type=int, default=EVENTS_BUFFER,
                    help="batches the feed's replay buffer holds, filled before the flood (a toy run: fewer)")
    ap.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    args = ap.parse_args()
    scratch = tempfile.mkdtemp(prefix="kvc-bench-feed-flood-")
    store, sock, trace = f"{scratch}/store", f"{scratch}/s.sock", f"{scratch}/trace.jsonl"
    kvc("init", "--store", store, "--page-size", "16")
    kvc("generate", trace, "--requests", str(args.requests), "--seed", "7")
    server = subprocess.Popen([sys.executable, "-m", "kvc", "serve", "--store", store, "--socket", sock, "--json",
                               "--device-tokens", str(DEVICE_TOKENS), "--host-tokens", str(HOST_TOKENS), "--events", "*",
                               "--events-replay", "*", "--events-buffer", str(args.events_buffer)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV)
    flooder = None
    try:
        ready = json.loads(server.stdout.readline())
        pid = server.pid
        buffered, still = 0, 0
        while buffered < args.events_buffer and still < 3:  # warm-up: pools faulted in, store written, buffer filled
            phase(sock, trace, 0, pid)
            was, buffered = buffered, len(fetch_all(ready)[0])
            still = still + 1 if buffered == was else 0  # a trace that fits the tiers stops making events
        quiet1 = phase(sock, trace, args.seconds, pid)
        base = memory(pid)
        peak_reset = reset_peak(pid)
        flooder = subprocess.Popen([sys.executable, "-c", FLOODER, ready["events_replay"], str(FLOODERS),
                                    REPLAY_BUSY.hex()], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                   env=ENV)
        assert flooder.stdout.readline().strip() == "ready"
        flooded = phase(sock, trace, args.seconds, pid)
        fetched, fetch_s = fetch_all(ready)  # a well-behaved client, the flooders still at it
        during = memory(pid)
        flooder.stdin.close()
        flood = json.loads(flooder.stdout.readline())
        flooder.wait(timeout=60)
        quiet2 = phase(sock, trace, args.seconds, pid)
        after = memory(pid)
    finally:
        if flooder is not None and flooder.poll() is None:
            flooder.kill()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
        server.stdout.close()
        subprocess.run(["rm", "-rf", scratch], check=False)
    peak = during["VmHWM"] if peak_reset else max(flooded["rss_max"], during["VmRSS"])
    growth = (peak - base["VmRSS"]) / MiB
    quiet = statistics.mean([quiet1["requests_per_s"], quiet2["requests_per_s"]])
    ratio = flooded["requests_per_s"] / quiet
    gap_free = [b.seq for b in fetched] == list(range(fetched[0].seq, fetched[0].seq + len(fetched))) \
        if fetched else False
    body = "\n".join([
        "## KV-event feed under 64 replay flooders (`benchmarks/bench_feed_flood.py`)",
        "",
        f"Machine: {machine()}; load average {os.getloadavg()[0]:.2f} when the script ended (the machine may be "
        f"shared). `kvc serve --events '*' --events-replay '*' --events-buffer {args.events_buffer}` (loopback) on a "
        f"fresh LMDB store, L1 {DEVICE_TOKENS:,} / L2 {HOST_TOKENS:,} tokens, driven by `kvc --socket S replay` of a "
        f"{args.requests}-request, 4-tenant trace again and again: {args.seconds:g} s quiet, {args.seconds:g} s "
        f"under {FLOODERS} flooders, {args.seconds:g} s quiet again. Each flooder opens a new replay connection "
        f"every second that never reads (receive queue 1 message, 4 KiB buffer), asks for the whole buffer on it, "
        f"and keeps its two newest open ({flood['requests']:,} requests in all). The replay buffer held "
        f"{buffered:,} of {args.events_buffer:,} batches before the flood (full: the growth is the flood's). RSS from /proc: the server's "
        f"VmRSS at the end of the first quiet phase, and its peak over the flood "
        f"({'VmHWM, reset at the start of the flood' if peak_reset else 'VmRSS sampled between replays'}). "
        f"Throughput: requests per second of the server's replay time over the replays completed in a phase.",
        "",
        table(["figure", "value"], [
            ["server RSS before the flood", f"{base['VmRSS'] / MiB:,.0f} MiB"],
            ["server RSS growth over the flood, peak (bound <= 64 MiB)", f"**{growth:+,.1f} MiB**"],
            ["of which anonymous memory (not the store's mapped file), at the end of the flood",
             f"{(during['RssAnon'] - base['RssAnon']) / MiB:+,.1f} MiB"],
            ["server RSS after the flood and a quiet phase", f"{after['VmRSS'] / MiB:,.0f} MiB"],
            ["live replay, quiet (before, after)",
             f"{quiet1['requests_per_s']:,.0f}, {quiet2['requests_per_s']:,.0f} requests/s "
             f"({quiet1['runs']}, {quiet2['runs']} replays)"],
            ["live replay, flooded", f"{flooded['requests_per_s']:,.0f} requests/s ({flooded['runs']} replays)"],
            ["live replay throughput, flooded over quiet (target >= 0.8x)", f"**{ratio:.2f}x**"],
            ["a well-behaved client's fetch of the whole buffer during the flood",
             f"{len(fetched):,} of {args.events_buffer:,} batches (seq {fetched[0].seq if fetched else '-'} on), "
             f"{'no gap' if gap_free else 'GAPS'}, {fetch_s:.2f} s"],
            ["busy answers found on the flooders' last two connections each (the cap on answers at once)",
             f"{flood['busy_seen']:,} of {2 * FLOODERS}"],
        ]),
    ])
    publish("bench_feed_flood", body, args.no_write, {
        "replay_ratio_with_feed_flooders": ratio,
        "feed_flood_rss_growth_mib": growth,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
