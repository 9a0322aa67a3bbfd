"""Admin socket throughput, and what an admin client hammering a live cache costs the replay running in it.

(1) Round trips: a cache on an LMDB store (a filled multi-tenant workload: a tree of a few thousand nodes, a few
    namespaces) serves its admin socket with a helper owner thread; a client in another process sends one request
    at a time on one connection for a fixed count: `ping` (the protocol alone), `stats`, `ns ls` (walks the tree and
    the store's registry), `audit` (the whole ownership partition). Reported as round trips/s, against a raw Unix
    socket echo of a ping-sized frame between the same two processes, measured in the same run.
(2) Replay impact: the same trace replayed by the cache's owner thread (`kvcache.workload.replay.Replayer`, calling
    `server.poll()` between its steps, as an engine loop would), each run on a fresh cache over the filled store,
    alternating: no client, then 1 and 4 client processes looping `stats` as fast as answers come back. Reported as
    requests/s and the ratio to the run without clients, and how many admin requests were answered meanwhile.

Run: ``python benchmarks/bench_admin.py [--requests N] [--round-trips N] [--repeat R] [--no-write]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import torch

from _report import machine, publish, table
from kvcache import AdminServer, CacheConfig, KVLayout, Replayer, TieredCache, WorkloadSpec, generate
from kvcache.storage.registry import open_store

LAYOUT = KVLayout("bench-admin@r1", layers=2, kv_heads=2, head_dim=32, dtype="float16", page_size=16)
DEVICE_TOKENS, HOST_TOKENS = 32768, 65536

# The client side, run in its own process so that its work does not share the server's interpreter lock.
CLIENT = textwrap.dedent("""
    import json, socket, struct, sys, time, os
    from kvcache.live.client import AdminClient
    from kvcache.live.protocol import (AuditRequest, LiveStats, NamespaceList, NamespacesRequest, PingRequest,
                                        ServerInfo, StatsRequest)
    from kvcache.diagnostics.audit import AuditReport
    mode, path, arg = sys.argv[1], sys.argv[2], sys.argv[3]
    KINDS = {"ping": (PingRequest(), ServerInfo), "stats": (StatsRequest(), LiveStats),
             "ns_ls": (NamespacesRequest(), NamespaceList), "audit": (AuditRequest(), AuditReport)}
    if mode == "echo":  # raw frames to an echo server: the transport alone
        frame = struct.pack(">I", 27) + b"x" * 27
        s = socket.socket(socket.AF_UNIX); s.connect(path)
        n = int(arg); t0 = time.perf_counter()
        for _ in range(n):
            s.sendall(frame); got = 0
            while got < len(frame):
                got += len(s.recv(len(frame) - got))
        print(json.dumps({"n": n, "seconds": time.perf_counter() - t0}))
    elif mode == "count":  # a fixed number of round trips of each kind
        with AdminClient(path, timeout=120) as c:
            out = {}
            for kind in sys.argv[4].split(","):
                req, typ = KINDS[kind]
                c.call(req, typ)
                n = max(5, int(arg) // (20 if kind == "audit" else 1)); t0 = time.perf_counter()
                for _ in range(n):
                    c.call(req, typ)
                out[kind] = {"n": n, "seconds": time.perf_counter() - t0}
        print(json.dumps(out))
    else:  # hammer: stats as fast as answers come, until the stop file appears
        with AdminClient(path, timeout=120) as c:
            print("ready", flush=True)  # imported and about to connect: the replay may start
            n = 0; t0 = time.perf_counter()
            while not os.path.exists(arg):
                c.call(StatsRequest(), LiveStats); n += 1
        print(json.dumps({"n": n, "seconds": time.perf_counter() - t0}))
""")


def _client(*args: str, **kw) -> subprocess.Popen:
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parent), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-c", CLIENT, *args], stdout=subprocess.PIPE, text=True, env=env,
                            **kw)


def _cache(store) -> TieredCache:
    cache = TieredCache(CacheConfig(LAYOUT, device_tokens=DEVICE_TOKENS, host_tokens=HOST_TOKENS, device="cpu",
                                    prefetch_policy="wait_complete"), store)
    cache.device_pool.storage.fill_(0)
    cache.host_pool.storage.fill_(0)  # fault the pools in outside the timing
    return cache


def echo_round_trips(scratch: str, n: int) -> float:
    """Round trips/s of a ping-sized frame echoed by a thread of this process to a client process."""
    path = f"{scratch}/echo.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    out = json.loads(_client("echo", path, str(n)).communicate()[0])
    t.join()
    server.close()
    return out["n"] / out["seconds"]


def round_trips(store, scratch: str, n: int) -> dict[str, float]:
    cache = _cache(store)
    Replayer(cache).run(generate(WorkloadSpec(requests=500, tenants=4, seed=3)))  # a populated tree to inspect
    path = f"{scratch}/rt.sock"
    server = AdminServer(cache, path).start_owner_thread()
    try:
        out = json.loads(_client("count", path, str(n), "ping,stats,ns_ls,audit").communicate()[0])
        nodes = cache.tree.node_count
    finally:
        server.close()
        cache.close()
    rates = {kind: r["n"] / r["seconds"] for kind, r in out.items()}
    rates["nodes"] = nodes
    return rates


def replay_impact(store, scratch: str, n_requests: int, repeat: int) -> dict[int, dict[str, float]]:
    trace = generate(WorkloadSpec(requests=n_requests, tenants=4, seed=11))
    warm = _cache(store)
    Replayer(warm).run(trace)  # the store holds the trace's pages: every measured run starts from the same L3
    warm.close()
    runs: dict[int, list[tuple[float, int, float]]] = {0: [], 1: [], 4: []}
    for rep in range(repeat):
        for clients in runs:
            cache = _cache(store)
            path = f"{scratch}/replay-{rep}-{clients}.sock"
            stop = Path(f"{scratch}/stop-{rep}-{clients}")
            server = AdminServer(cache, path)
            procs = [_client("hammer", path, str(stop)) for _ in range(clients)]
            for p in procs:  # each client has started (imports done) before the replay starts
                assert p.stdout.readline().strip() == "ready"
            gc.collect()
            report = Replayer(cache).run(trace, progress=lambda _, server=server: server.poll())
            stop.touch()
            answered = 0
            while any(p.poll() is None for p in procs):
                server.poll(0.01)
            for p in procs:
                answered += json.loads(p.stdout.read())["n"]
            assert report.audit.ok and report.requests == n_requests, report.audit
            runs[clients].append((report.requests_per_s, answered, report.seconds))
            server.close()
            cache.close()
    base = statistics.median(r[0] for r in runs[0])
    return {clients: {"rps": statistics.median(r[0] for r in rs),
                      "ratio": statistics.median(r[0] for r in rs) / base,
                      "answered": statistics.median(r[1] for r in rs),
                      "admin_per_s": statistics.median(r[1] / r[2] for r in rs)} for clients, rs in runs.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1500, help="requests in the replayed trace")
    ap.add_argument("--round-trips", type=int, default=2000, help="round trips per request kind (audit: 1/20)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    args = ap.parse_args()
    torch.set_num_threads(1)
    scratch = tempfile.mkdtemp(prefix="kvc-bench-admin-")
    try:
        store = open_store(f"{scratch}/store", LAYOUT, create=True, durability="none")
        echo = echo_round_trips(scratch, args.round_trips)
        rt = round_trips(store, scratch, args.round_trips)
        impact = replay_impact(store, scratch, args.requests, args.repeat)
        store.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    names = {"ping": "ping (protocol only)", "stats": "stats", "ns_ls": "ns ls (tree + store registry)",
             "audit": "audit (whole ownership partition)"}
    body = "\n".join([
        "## Admin socket: round trips, and their cost to a replay in the same process (`benchmarks/bench_admin.py`)",
        "",
        f"Machine: {machine()}. One client process, one request at a time on one connection, the cache's owner "
        f"loop on a helper thread (`AdminServer(cache, path).start_owner_thread()`); a tree of {int(rt['nodes']):,} nodes in "
        f"4 namespaces over an LMDB store. Baseline: a raw Unix-socket echo of a ping-sized frame between the same "
        f"two processes, same run.",
        "",
        table(["request", "round trips/s", "ratio to raw echo"],
              [["raw echo (baseline)", f"{echo:,.0f}", "1.00x"]]
              + [[names[k], f"{rt[k]:,.0f}", f"{rt[k] / echo:.2f}x"] for k in names]),
        "",
        f"Replay impact: a {args.requests:,}-request, 4-tenant trace replayed by the owner thread, `server.poll()` "
        f"between steps (batch 4), L1 {DEVICE_TOKENS:,} / L2 {HOST_TOKENS:,} tokens, L3 already holding the "
        f"trace; median of {args.repeat}. Clients loop `stats` in their own processes; a request waits for the "
        f"next step boundary, so each client gets about one answer per step.",
        "",
        table(["clients hammering", "replay requests/s", "ratio to no client", "admin answers during replay",
               "admin answers/s"],
              [[str(c), f"{r['rps']:,.0f}", f"{r['ratio']:.2f}x", f"{r['answered']:,.0f}",
                f"{r['admin_per_s']:,.0f}"] for c, r in impact.items()]),
    ])
    ratios = {"admin_ping_over_raw_echo": rt["ping"] / echo, "admin_stats_round_trips_per_s": rt["stats"],
              "replay_ratio_with_1_client": impact[1]["ratio"], "replay_ratio_with_4_clients": impact[4]["ratio"]}
    publish("bench_admin", body, args.no_write, ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
