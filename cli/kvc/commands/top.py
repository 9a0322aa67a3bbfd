"""`kvc top`: a live cache's tiers, hits and copies, sampled every interval and refreshed in place.

Each sample asks the cache (over its admin socket) for its figures and shows what changed since the previous
one: occupancy of L1 and L2 (bars) and of the store, hit tokens per second by tier and per namespace, the share
of the tokens asked for that each tier served, prefetch and backup pages per second, L3 write failures. On a
terminal the view is redrawn in place; elsewhere (a log, a pipe) each sample is one plain line; with --json
each sample is one JSON object per line. What a sample shows, and how, is `kvc.render.top`'s.
"""

from __future__ import annotations

import time
from typing import Annotated

import msgspec
import typer

from kvcache.live.protocol import LiveStats, StatsRequest

from .. import live
from ..errors import UsageError
from ..options import DebugOpt, JsonOpt, SocketOpt
from ..render.output import console
from ..render.top import TIERS, NamespaceSample, TierSample, TopSample, plain_line, view
from ..reporting import command


def sample(prev: LiveStats, cur: LiveStats, seconds: float) -> TopSample:
    """What changed between two figures of one cache, per second."""
    rate = (lambda a, b: (b - a) / seconds) if seconds > 0 else (lambda a, b: 0.0)
    asked = cur.cache.counters.match_tokens - prev.cache.counters.match_tokens
    before = {h.namespace: h for h in prev.cache.hits}
    tiers = []
    for tier, _ in TIERS:
        hit_now = sum(getattr(h, tier) for h in cur.cache.hits)
        hit_then = sum(getattr(h, tier) for h in prev.cache.hits)
        if tier == "storage":
            store = cur.store
            used_tok, cap_tok = 0, 0
            used_b, cap_b = (store.bytes, store.capacity_bytes) if store is not None else (0, 0)
        else:
            pool = cur.device if tier == "device" else cur.host
            used_tok, cap_tok = (pool.used_tokens, pool.tokens) if pool is not None else (0, 0)
            used_b, cap_b = (pool.used_bytes, pool.bytes) if pool is not None else (0, 0)
        tiers.append(TierSample(tier, used_tok, cap_tok, used_b, cap_b, rate(hit_then, hit_now),
                                (hit_now - hit_then) / asked if asked > 0 else None))
    namespaces = []
    for h in cur.cache.hits:
        p = before.get(h.namespace)
        ns = NamespaceSample(h.namespace.extra_key, h.namespace.salt_fingerprint,
                             *(rate(getattr(p, t) if p else 0, getattr(h, t)) for t, _ in TIERS))
        namespaces.append(ns)
    namespaces.sort(key=lambda n: n.device + n.host + n.storage, reverse=True)
    c0, c1 = prev.cache.counters, cur.cache.counters
    b0, b1 = prev.cache.backup, cur.cache.backup
    return TopSample(time.time(), seconds, tiers, namespaces, rate(c0.committed, c1.committed),
                     rate(c0.refused, c1.refused),
                     rate(prev.cache.prefetch.fetched_pages, cur.cache.prefetch.fetched_pages),
                     rate(b0.host_pages, b1.host_pages), rate(b0.storage_pages, b1.storage_pages),
                     rate(b0.storage_failed, b1.storage_failed), cur.inflight_copies, cur.prefetches)


@command
def top(
    socket: SocketOpt = None,
    interval: Annotated[float, typer.Option("--interval", min=0.05, max=3600.0,
                                            help="Seconds between samples.")] = 2.0,
    count: Annotated[int, typer.Option("--count", min=0, max=10_000_000,
                                       help="Stop after this many samples (0: until Ctrl-C).")] = 0,
    width: Annotated[int, typer.Option("--namespaces", min=1, max=1000,
                                       help="Namespaces shown, busiest first.")] = 10,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Watch a live cache: per-tier occupancy, hit tokens per second by tier and per namespace over the last
    interval, prefetch and backup rates; redrawn in place on a terminal, one plain line per sample elsewhere,
    one JSON object per sample with --json. Needs --socket (or KVC_SOCKET). Ctrl-C ends it (exit 0)."""
    sock = live.socket_path(socket)
    if sock is None:
        raise UsageError("kvc top watches a live cache: give --socket PATH (or KVC_SOCKET)")
    prev, then = live.call(sock, StatsRequest(), LiveStats), time.monotonic()
    screen = console().is_terminal and not json
    display = None
    if screen:
        from rich.live import Live

        display = Live(console=console(), auto_refresh=False, transient=False)
        display.start()
    try:
        taken = 0
        while count == 0 or taken < count:
            time.sleep(interval)
            cur, now = live.call(sock, StatsRequest(), LiveStats), time.monotonic()
            s = sample(prev, cur, now - then)
            prev, then, taken = cur, now, taken + 1
            if json:
                print(msgspec.json.encode(s).decode(), flush=True)
            elif display is not None:
                display.update(view(s, sock, width), refresh=True)
            else:
                print(plain_line(s), flush=True)
    except KeyboardInterrupt:
        return  # Ctrl-C is how a watch ends: not an error
    finally:
        if display is not None:
            display.stop()
