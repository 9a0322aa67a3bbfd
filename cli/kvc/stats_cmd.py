"""`kvc stats`: a store's size, pages, namespaces, layouts and counters; `--prom` for Prometheus."""

from __future__ import annotations

from typing import Annotated

import msgspec
import typer
from rich.table import Table

from kvcache.storage.base import StoreStats

from . import live
from .common import DEFAULT_STORE, DebugOpt, JsonOpt, StoreOpt, command, emit_json, human_bytes, open_inspect, out

# Prometheus metric name -> (help, type, how to read it from StoreStats): the exposition is this table, printed.
PROM_METRICS: dict[str, tuple[str, str, str]] = {
    "kvc_store_pages": ("Pages stored.", "gauge", "pages"),
    "kvc_store_bytes": ("Payload bytes stored.", "gauge", "bytes"),
    "kvc_store_footprint_bytes": ("Bytes the store occupies in its medium.", "gauge", "footprint_bytes"),
    "kvc_store_capacity_bytes": ("Payload limit in bytes; 0 = unlimited.", "gauge", "capacity_bytes"),
    "kvc_store_namespaces": ("Namespaces in the registry.", "gauge", "namespaces"),
    "kvc_store_layouts": ("KV layouts the store holds.", "gauge", "layouts"),
    "kvc_store_pages_read_total": ("Pages read by this handle.", "counter", "counters.pages_read"),
    "kvc_store_misses_total": ("Reads that stopped short.", "counter", "counters.misses"),
    "kvc_store_checksum_failures_total": ("Pages that failed their checksum.", "counter",
                                          "counters.checksum_failures"),
}


def _read(stats: StoreStats, path: str) -> float:
    value = stats
    for part in path.split("."):
        value = getattr(value, part)
    return float(value)  # type: ignore[arg-type]


def prometheus(stats: StoreStats) -> str:
    """The Prometheus text exposition of a store's stats."""
    labels = f'{{backend="{stats.backend}",store="{stats.location}"}}'
    lines = []
    for name, (help_text, kind, path) in PROM_METRICS.items():
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{labels} {_read(stats, path):g}"]
    return "\n".join(lines) + "\n"


@command
def stats(
    store: StoreOpt = DEFAULT_STORE,
    prom: Annotated[bool, typer.Option("--prom", help="Print Prometheus text format instead.")] = False,
    socket: live.SocketOpt = None,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Store size, pages, namespaces, layouts and hit/miss counters; with --socket, also the live cache's
    pools, what is in flight and its hit tokens per tier."""
    if (sock := live.socket_path(socket)) is not None:
        return live.stats(sock, prom, json)
    st = open_inspect(store)
    try:
        figures = st.stats()
        layouts = st.layouts()
    finally:
        st.close()
    if prom:
        typer.echo(prometheus(figures), nl=False)
        return
    if json:
        emit_json({**msgspec.structs.asdict(figures), "layout_list": layouts})
        return
    table = Table(title=f"kvc stats — {store}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("backend", f"{figures.backend} (format {figures.format_version}, checksum {figures.checksum})")
    table.add_row("pages", f"{figures.pages:,}")
    table.add_row("payload", human_bytes(figures.bytes))
    table.add_row("on disk", human_bytes(figures.footprint_bytes))
    table.add_row("capacity", human_bytes(figures.capacity_bytes) if figures.capacity_bytes else "unlimited")
    table.add_row("namespaces", f"{figures.namespaces:,}")
    for layout in layouts:
        table.add_row("layout", layout.describe())
    c = figures.counters
    table.add_row("reads / misses", f"{c.pages_read:,} / {c.misses:,} (checksum failures {c.checksum_failures:,})")
    out.print(table)
