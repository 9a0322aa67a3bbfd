"""`kvc stats`: a store's size, pages, namespaces, layouts; with --socket a live cache's too; `--prom` for
Prometheus (kvcache.live.metrics)."""

from __future__ import annotations

from typing import Annotated

import msgspec
import typer

from kvcache.live.protocol import LiveStats, NamespaceList, NamespacesRequest, StatsRequest

from .. import live
from ..context import open_inspect
from ..options import DEFAULT_STORE, DebugOpt, JsonOpt, NoHeadersOpt, OutputOpt, ReadOnlyOpt, SocketOpt, StoreOpt
from ..render.figures import print_figures, render_live_stats, store_rows
from ..render.output import emit_json
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
    its hit tokens per tier and its counters."""
    if (sock := live.socket_path(socket)) is not None:
        figures = live.call(sock, StatsRequest(), LiveStats)
        if prom:
            from kvcache.live.metrics import cache_families

            print_prometheus(cache_families(figures, live.call(sock, NamespacesRequest(), NamespaceList)))
        elif json:
            emit_json(figures)
        else:
            render_live_stats(figures, sock, output, no_headers)
        return
    st = open_inspect(store, read_only=read_only)
    try:
        figures = msgspec.structs.replace(st.stats(), location=str(store))
        layouts = st.layouts()
        namespaces = st.namespaces() if prom else []
    finally:
        st.close()
    if prom:
        from kvcache.live.metrics import store_families

        print_prometheus(store_families(figures, str(store), namespaces))
        return
    if json:
        emit_json({**msgspec.structs.asdict(figures), "layout_list": layouts})
        return
    rows = store_rows(figures, str(store))
    rows += [["layout", layout.describe()] for layout in layouts]
    print_figures(f"kvc stats — {store}", rows, output, no_headers)
