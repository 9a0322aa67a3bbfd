"""`kvc stats`'s figures: a store's, and a live cache's pools, copies in flight, hits per tier and TTL counters —
figure/value rows, a two-column table on a terminal and `figure<TAB>value` lines elsewhere."""

from __future__ import annotations

from kvcache.live.protocol import LiveStats
from kvcache.storage.api import StoreStats

from .output import Column, Listing, Output, output_format, render
from .text import human_bytes


def store_rows(figures: StoreStats, location: str) -> list[list[str]]:
    """`kvc stats` rows (figure, value) of a store."""
    c = figures.counters
    return [["store", location],
            ["backend", f"{figures.backend} (format {figures.format_version}, checksum {figures.checksum})"],
            ["pages", f"{figures.pages:,}"],
            ["payload", human_bytes(figures.bytes)],
            ["footprint", human_bytes(figures.footprint_bytes)],
            ["capacity", human_bytes(figures.capacity_bytes) if figures.capacity_bytes else "unlimited"],
            ["namespaces", f"{figures.namespaces:,}"],
            ["reads / misses", f"{c.pages_read:,} / {c.misses:,} (checksum failures {c.checksum_failures:,})"]]


def print_figures(title: str, rows: list[list[str]], output: Output | None, no_headers: bool) -> None:
    """Figure/value rows: a two-column table on a terminal, `figure<TAB>value` lines elsewhere (--json for
    scripts)."""
    render(Listing(title, [Column("figure"), Column("value")], rows, header=False), output_format(output),
           no_headers)


def render_live_stats(figures: LiveStats, socket: str, output: Output | None, no_headers: bool) -> None:
    """`kvc stats` of a live cache: the store's figures as offline, plus the cache's pools and counters."""
    rows = [["layout", figures.layout.describe()]]
    for name, pool in (("L1 device", figures.device), ("L2 host", figures.host)):
        if pool is not None:
            rows.append([name, f"{pool.used_tokens:,} / {pool.tokens:,} tokens ({human_bytes(pool.used_bytes)} "
                               f"of {human_bytes(pool.bytes)})"])
    rows.append(["in flight", f"{figures.live_requests} requests, {figures.inflight_copies} copies, "
                              f"{figures.prefetches} prefetches, {figures.staged} staged, "
                              f"{figures.storage_writes} L3 writes"])
    hits = figures.cache.hits
    rows.append(["hit tokens", f"L1 {sum(h.device for h in hits):,} · L2 {sum(h.host for h in hits):,} · "
                               f"L3 {sum(h.storage for h in hits):,}"])
    ttl = figures.cache.ttl
    if ttl is not None:
        expired = ", ".join(f"{cause} {n:,}" for cause, n in sorted(ttl.expired.items())) or "none"
        rows.append(["namespace TTL", f"{ttl.tracked:,} tracked; expired: {expired}; {ttl.deferred:,} deferred, "
                                      f"{ttl.cancelled:,} cancelled by reuse; freed L1 {ttl.device_pages:,} · "
                                      f"L2 {ttl.host_pages:,} · L3 {ttl.store_pages:,} pages"])
    if figures.store is not None:
        rows += store_rows(figures.store, figures.store.location)
    print_figures(f"kvc stats — live cache at {socket}", rows, output, no_headers)
