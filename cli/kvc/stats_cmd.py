"""`kvc stats`: a store's size, pages, namespaces, layouts; with --socket a live cache's too; `--prom` for
Prometheus (kvcache.live.metrics)."""

from __future__ import annotations

from typing import Annotated

import msgspec
import typer

from kvcache.storage.base import StoreStats

from . import live
from .common import DEFAULT_STORE, DebugOpt, StoreOpt, command, open_inspect
from .output import (Column, JsonOpt, Listing, NoHeadersOpt, Output, OutputOpt, emit_json, human_bytes, output_format,
                     render)

PromOpt = Annotated[bool, typer.Option("--prom", help="Print the Prometheus text exposition instead (for a "
                                       "node_exporter textfile or a scrape; `kvc serve --metrics-port` serves it).")]


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


@command
def stats(
    store: StoreOpt = DEFAULT_STORE,
    prom: PromOpt = False,
    socket: live.SocketOpt = None,
    output: OutputOpt = None,
    no_headers: NoHeadersOpt = False,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Store size, pages, namespaces and layouts; with --socket, also the live cache's pools, what is in flight,
    its hit tokens per tier and its counters."""
    if (sock := live.socket_path(socket)) is not None:
        return live.stats(sock, prom, json, output, no_headers)
    st = open_inspect(store)
    try:
        figures = msgspec.structs.replace(st.stats(), location=str(store))
        layouts = st.layouts()
        namespaces = st.namespaces() if prom else []
    finally:
        st.close()
    if prom:
        from kvcache.live.metrics import exposition, store_families

        typer.echo(exposition(store_families(figures, str(store), namespaces)), nl=False)
        return
    if json:
        emit_json({**msgspec.structs.asdict(figures), "layout_list": layouts})
        return
    rows = store_rows(figures, str(store))
    rows += [["layout", layout.describe()] for layout in layouts]
    print_figures(f"kvc stats — {store}", rows, output, no_headers)
