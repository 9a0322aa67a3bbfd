"""`kvc top`: a live cache's tiers, hits and copies, sampled every interval and refreshed in place.

Each sample asks the cache (over its admin socket) for its figures and shows what changed since the previous
one: occupancy of L1 and L2 (bars) and of the store, hit tokens per second by tier and per namespace, the share
of the tokens asked for that each tier served, prefetch and backup pages per second, L3 write failures. On a
terminal the view is redrawn in place; elsewhere (a log, a pipe) each sample is one plain line; with --json
each sample is one JSON object per line.
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
from ..render.text import esc, human_bytes, shown
from ..reporting import command

TIERS = (("device", "L1"), ("host", "L2"), ("storage", "L3"))


class TierSample(msgspec.Struct):
    """One tier over the last interval."""

    tier: str  # "device", "host" or "storage"
    used_tokens: int  # L1/L2: tokens held; L3: 0 (see used_bytes)
    tokens: int  # capacity (0: none, or an unlimited store)
    used_bytes: int
    capacity_bytes: int  # 0: unlimited (a store without a capacity)
    hit_tokens_per_s: float  # tokens admitted requests found in this tier, per second
    hit_share: float | None  # of the tokens asked for (matched) in the interval, the part this tier served


class NamespaceSample(msgspec.Struct):
    """One namespace's hit tokens per second over the last interval, by tier."""

    extra_key: str | None
    salt_fingerprint: str | None
    device: float
    host: float
    storage: float


class TopSample(msgspec.Struct):
    """`kvc top --json`: one line per interval."""

    at: float  # unix seconds
    interval_s: float
    tiers: list[TierSample]
    namespaces: list[NamespaceSample]  # busiest first
    requests_per_s: float  # committed
    refused_per_s: float
    prefetch_pages_per_s: float  # fetched L3 -> L2
    backup_host_pages_per_s: float  # L1 -> L2
    backup_storage_pages_per_s: float  # L2 -> L3
    storage_write_failures_per_s: float
    inflight_copies: int
    prefetches: int


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


def _pct(part: float | None) -> str:
    return "-" if part is None else f"{100 * part:.0f}%"


def plain_line(s: TopSample) -> str:
    """A sample as one line (for logs and pipes)."""
    parts = [time.strftime("%H:%M:%S", time.localtime(s.at))]
    for t, (_, name) in zip(s.tiers, TIERS):
        held = (f"{t.used_tokens}/{t.tokens} tok" if t.tier != "storage"
                else f"{t.used_bytes}/{t.capacity_bytes or '-'} B")
        parts.append(f"{name} {held} hit {t.hit_tokens_per_s:.0f} tok/s ({_pct(t.hit_share)})")
    parts.append(f"req {s.requests_per_s:.1f}/s refused {s.refused_per_s:.1f}/s")
    parts.append(f"prefetch {s.prefetch_pages_per_s:.0f} pg/s backup L2 {s.backup_host_pages_per_s:.0f} pg/s "
                 f"L3 {s.backup_storage_pages_per_s:.0f} pg/s failed {s.storage_write_failures_per_s:.0f}/s")
    busiest = [f"{shown(n.extra_key)}/{n.salt_fingerprint or '-'} {n.device + n.host + n.storage:.0f}"
               for n in s.namespaces[:3] if n.device + n.host + n.storage > 0]
    if busiest:
        parts.append("top ns tok/s " + ", ".join(busiest))
    return " | ".join(parts)


def view(s: TopSample, socket: str, width: int = 10):
    """A sample as a rich renderable: tier bars and rates, then the busiest namespaces."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    tiers = Table(title=f"kvc top — live cache at {esc(socket)} (every {s.interval_s:.1f} s)", title_justify="left")
    for col in ("tier", "occupancy", "held", "hit tok/s", "of asked"):
        tiers.add_column(col, justify="left" if col in ("tier", "occupancy", "held") else "right")
    for t, (_, name) in zip(s.tiers, TIERS):
        used, cap = (t.used_tokens, t.tokens) if t.tier != "storage" else (t.used_bytes, t.capacity_bytes)
        bar = ProgressBar(total=cap or 1, completed=used if cap else 0, width=30)
        held = (f"{t.used_tokens:,} / {t.tokens:,} tokens" if t.tier != "storage"
                else f"{human_bytes(t.used_bytes)} / {human_bytes(t.capacity_bytes) if t.capacity_bytes else '∞'}")
        tiers.add_row(name, bar, held, f"{t.hit_tokens_per_s:,.0f}", _pct(t.hit_share))
    rates = (f"requests {s.requests_per_s:,.1f}/s (refused {s.refused_per_s:,.1f}/s) · in flight: "
             f"{s.inflight_copies} copies, {s.prefetches} prefetches\nprefetch {s.prefetch_pages_per_s:,.0f} pages/s"
             f" · backup L1→L2 {s.backup_host_pages_per_s:,.0f}, L2→L3 {s.backup_storage_pages_per_s:,.0f} pages/s"
             f" · L3 write failures {s.storage_write_failures_per_s:,.0f}/s")
    ns = Table(title="busiest namespaces (hit tokens/s)", title_justify="left")
    for col in ("extra_key", "salt fp", "L1", "L2", "L3"):
        ns.add_column(col, justify="left" if col in ("extra_key", "salt fp") else "right")
    from rich.text import Text

    for n in s.namespaces[:width]:
        ns.add_row(Text(shown(n.extra_key)), n.salt_fingerprint or "-", f"{n.device:,.0f}", f"{n.host:,.0f}",
                   f"{n.storage:,.0f}")
    return Group(tiers, Text(rates), ns)


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
