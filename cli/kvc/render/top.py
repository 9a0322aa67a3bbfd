"""What `kvc top` shows of each sample: the struct it prints with --json (one per line), one plain line for a log
or a pipe, and the rich view redrawn in place on a terminal — tier bars and rates, then the busiest namespaces.
`kvc.commands.top` takes the samples."""

from __future__ import annotations

import time

import msgspec

from .text import esc, human_bytes, shown

TIERS = (("device", "L1"), ("host", "L2"), ("storage", "L3"))  # (field of the hit counters, the label shown)


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


def _pct(part: float | None) -> str:
    return "-" if part is None else f"{100 * part:.0f}%"


def plain_line(s: TopSample) -> str:
    """A sample as one line (for logs and pipes)."""
    parts = [time.strftime("%H:%M:%S", time.localtime(s.at))]
    for t, (_, name) in zip(s.tiers, TIERS, strict=True):
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
    for t, (_, name) in zip(s.tiers, TIERS, strict=True):
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
