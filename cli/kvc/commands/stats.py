"""`kvc stats`: a store's size, pages, namespaces, layouts; with --socket a live cache's too; `--prom` for
Prometheus (kvcache.live.metrics)."""

from __future__ import annotations

from typing import Annotated

import msgspec
import typer

from kvcache.live.protocol import LiveStats, NamespaceList, NamespacesRequest, StatsRequest

from .. import live
from ..context import open_inspect
from ..options import (
    DEFAULT_STORE,
    DebugOpt,
    JsonOpt,
    NoHeadersOpt,
    OutputOpt,
    ReadOnlyOpt,
    SocketOpt,
    StoreOpt,
)
from ..render.figures import emit_figures, live_rows, store_rows
from ..render.output import output_format
from ..render.prometheus import print_prometheus
from ..reporting import command

PromOpt = Annotated[bool, typer.Option("--prom", help="Print the Prometheus text exposition instead (for a "
                                       "node_exporter textfile or a scrape; `kvc serve --metrics-port` serves it).")]


@command
def stats(
    store: StoreOpt = DEFAULT_STORE,
    prom: PromOpt = False,
    socket: SocketOpt = None,
    read_only: ReadOnlyOpt = False,
    output: OutputOpt = None,
    no_headers: NoHeadersOpt = False,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Store size, pages, namespaces and layouts; with --socket, also the live cache's pools, what is in flight,
    its hit tokens per tier and its counters. A terminal gets a summary table; -o tsv (the default elsewhere)
    prints one `figure<TAB>value` line per figure of --json, named by its path there, with raw numbers; -o jsonl
    the same figures as objects."""
    fmt = output_format(output, json)
    if (sock := live.socket_path(socket)) is not None:
        figures = live.call(sock, StatsRequest(), LiveStats)
        if prom:
            from kvcache.live.metrics import cache_families

            print_prometheus(cache_families(figures, live.call(sock, NamespacesRequest(), NamespaceList)))
            return
        emit_figures(fmt, f"kvc stats — live cache at {sock}", figures, live_rows(figures), no_headers)
        return
    st = open_inspect(store, read_only=read_only)
    try:
        totals = msgspec.structs.replace(st.stats(), location=str(store))
        layouts = st.layouts()
        namespaces = st.namespaces() if prom else []
    finally:
        st.close()
    if prom:
        from kvcache.live.metrics import store_families

        print_prometheus(store_families(totals, str(store), namespaces))
        return
    rows = store_rows(totals, str(store)) + [["layout", layout.describe()] for layout in layouts]
    emit_figures(fmt, f"kvc stats — {store}", {**msgspec.structs.asdict(totals), "layout_list": layouts}, rows,
                 no_headers)
