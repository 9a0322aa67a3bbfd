"""`kvc stats`'s figures: a store's, and a live cache's pools, copies in flight, hits per tier and TTL counters.

On a terminal a two-column table that sums them up for eyes (`3,801`, `59.4 MiB`, `L1 … · L2 … · L3 …`). For
scripts the same result as every other command prints it: `-o json` (and --json) the struct, `-o tsv` a
`figure<TAB>value` header and one line per figure of that struct — every number raw (integers, no separators, no
units) — and `-o jsonl` the same figures as `{"figure", "value"}` objects. A figure is named by its path in the
JSON (`pages`, `counters.pages_read`, `device.used_tokens`, `layout_list.0.page_size`), so the three agree.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvcache.live.protocol import LiveStats
from kvcache.storage.api import StoreStats

from .output import Column, Kind, Listing, Output, emit_listing, render
from .text import human_bytes

FigureValue = str | int | float | bool | None


class Figure(msgspec.Struct, frozen=True):
    """One figure of `kvc stats -o tsv|jsonl`: its path in `kvc stats --json` and its raw value."""

    figure: str
    value: FigureValue


def figures_of(result: Any) -> list[Figure]:
    """Every scalar of `result` (a struct, or the dict offline `kvc stats --json` prints) as a figure named by its
    path, in the order of the JSON; list items are named by their index. Empty lists and dicts have none."""
    out: list[Figure] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}.{key}" if path else str(key))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, f"{path}.{i}" if path else str(i))
        else:
            out.append(Figure(path, value))

    walk(msgspec.to_builtins(result), "")
    return out


def _figure_listing(title: str, figures: list[Figure]) -> Listing:
    """Figures as tsv cells: raw integers and floats, `true`/`false`, `-` for none, strings shown safely."""
    rows: list[list[Any]] = []
    for f in figures:
        value = f.value
        if isinstance(value, bool):
            value = "true" if value else "false"
        elif isinstance(value, (int, float)):
            value = str(value)  # Python's shortest exact form: 62285184, 0.25, 1767323045.123
        rows.append([f.figure, value])
    return Listing(title, [Column("figure"), Column("value", Kind.USER)], rows)


def store_rows(figures: StoreStats, location: str) -> list[list[str]]:
    """The table's rows (figure, value) of a store."""
    c = figures.counters
    return [["store", location],
            ["backend", f"{figures.backend} (format {figures.format_version}, checksum {figures.checksum})"],
            ["pages", f"{figures.pages:,}"],
            ["payload", human_bytes(figures.bytes)],
            ["footprint", human_bytes(figures.footprint_bytes)],
            ["capacity", human_bytes(figures.capacity_bytes) if figures.capacity_bytes else "unlimited"],
            ["namespaces", f"{figures.namespaces:,}"],
            ["reads / misses", f"{c.pages_read:,} / {c.misses:,} (checksum failures {c.checksum_failures:,})"]]


def live_rows(figures: LiveStats) -> list[list[str]]:
    """The table's rows (figure, value) of a live cache: its pools and counters, then its store's as offline."""
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
    return rows


def emit_figures(fmt: Output, title: str, result: Any, rows: list[list[str]], no_headers: bool) -> None:
    """Print `kvc stats`'s `result` (what --json prints) in `fmt`: the table of `rows` on a terminal, else the
    result itself (json), or its figures (jsonl, tsv)."""
    figures = figures_of(result)

    def table() -> None:
        if fmt is Output.TABLE:
            render(Listing(title, [Column("figure"), Column("value")], rows, header=False), fmt)
        else:
            render(_figure_listing(title, figures), fmt, no_headers)

    emit_listing(fmt, result, figures, table)
