"""Live mode for the kvc commands (DESIGN §7): which socket a command talks to, and each command's request to
the live cache behind it.

`--socket PATH` is accepted after a command (`kvc prefetch --socket S`) and before it (`kvc --socket S prefetch`,
or env KVC_SOCKET, read by the app's callback); the one after the command wins. A command given a socket sends
its request to that cache's admin socket and prints the same fields as offline, plus what only a live cache has
(what each namespace holds in L1 and L2). Admin errors (no server, another protocol version, no answer in time,
a failure on the server) are `kvcache.errors.AdminError`: one line on stderr, exit 2.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import msgspec
import typer
from rich.table import Table

from kvcache.admin import AdminClient
from kvcache.admin_protocol import (AuditRequest, EvictOutcome, EvictRequest, LiveStats, NamespaceList,
                                    NamespacesRequest, ReplayOutcome, SnapshotData, SnapshotRequest,
                                    SnapshotResult, StatsRequest)
from kvcache.audit import AuditReport
from kvcache.replay import ReplayReport
from kvcache.snapshot import decode_snapshot, write_snapshot
from kvcache.workload import parse_trace, trace_lines

from .common import (DebugOpt, JsonOpt, SaltOpt, UsageError, command, emit_json, human_bytes,
                     namespace_arg, out, when)

DEFAULT_TIMEOUT = 30.0

SocketOpt = Annotated[str | None, typer.Option(
    "--socket", help="Act on the live cache serving this admin socket (`kvc serve`, or an engine's "
    "serve_admin) instead of opening the store. Also accepted before the command; env: KVC_SOCKET. Nothing is "
    "sent to a server running as another user than you or root unless env KVC_SERVER_UID names its uid.",
    show_default=False)]
MAX_TIMEOUT_S = 86400.0  # --timeout: a day at most


class _Global(msgspec.Struct):
    socket: str | None = None
    timeout: float = DEFAULT_TIMEOUT


_GLOBAL = _Global()


def set_global(socket: str | None, timeout: float) -> None:
    """The options given before the command (`kvc --socket S --timeout T ...`); set by the app's callback on
    every invocation."""
    _GLOBAL.socket = socket or None
    _GLOBAL.timeout = timeout


def socket_path(socket: str | None) -> str | None:
    """The socket a command acts on: its own --socket, else the one given before it (or KVC_SOCKET); None for
    offline mode."""
    return socket or _GLOBAL.socket


def client(socket: str) -> AdminClient:
    """A client of the live cache at `socket`, with the --timeout given before the command, trusting a server
    run by this user, by root, or by the uids in env KVC_SERVER_UID (comma-separated)."""
    if not 0 < _GLOBAL.timeout <= MAX_TIMEOUT_S:  # also refuses nan and inf
        raise UsageError(f"--timeout {_GLOBAL.timeout:g}: must be > 0 and at most {MAX_TIMEOUT_S:g} seconds")
    return AdminClient(socket, _GLOBAL.timeout, trusted_uids={os.geteuid(), 0, *_server_uids()})


def _server_uids() -> list[int]:
    text = os.environ.get("KVC_SERVER_UID", "").strip()
    words = [w for w in text.replace(",", " ").split() if w]
    if not all(w.isdigit() for w in words):
        raise UsageError(f"KVC_SERVER_UID={text!r}: not a list of numeric uids such as 1001,1002")
    return [int(w) for w in words]


def call(socket: str, request, result_type):
    """Send one admin request to the live cache at `socket` and decode its answer as `result_type`."""
    with client(socket) as c:
        return c.call(request, result_type)


# --- prefetch, stage, load-back ------------------------------------------------------------------------------


# --- ns ls, ns evict -----------------------------------------------------------------------------------------


def ns_ls(socket: str, sort: str, json: bool) -> None:
    """`kvc ns ls` on the live cache: the store's rows plus what each namespace holds in L1, L2 and L3."""
    listing = call(socket, NamespacesRequest(), NamespaceList)
    if sort == "extra_key":
        listing.namespaces.sort(key=lambda r: (r.extra_key or "", r.salt_fingerprint or ""))
    else:
        listing.namespaces.sort(key=lambda r: getattr(r, sort), reverse=True)
    if json:
        emit_json(listing)
        return
    table = Table(title=f"namespaces of the live cache at {socket} (store {listing.store or '-'})")
    cols = ("extra_key", "salt fingerprint", "L1 tokens", "L2 tokens", "L3 tokens", "L3 bytes", "hits",
            "last access")
    for col in cols:
        table.add_column(col, justify="left" if col in ("extra_key", "salt fingerprint", "last access")
                         else "right")
    for r in listing.namespaces:
        table.add_row(r.extra_key if r.extra_key is not None else "-", r.salt_fingerprint or "-",
                      f"{r.device.tokens:,}", f"{r.host.tokens:,}", f"{r.storage.tokens:,}",
                      human_bytes(r.storage.bytes), f"{r.hits:,}", when(r.last_access))
    out.print(table)


@command
def ns_evict(
    extra_key: Annotated[str, typer.Argument(help="The namespace's extra_key (\"\" for requests without one).",
                                             metavar="EXTRA_KEY")],
    salt: SaltOpt = None,
    socket: SocketOpt = None,
    device: Annotated[bool, typer.Option("--device/--no-device", help="Evict from L1.")] = True,
    host: Annotated[bool, typer.Option("--host/--no-host", help="Evict from L2.")] = True,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Live cache only: evict a namespace's pages from L1 and/or L2 (what requests and copies use stays; its L3
    pages stay). Under write-back, device pages are backed up before they go."""
    path = socket_path(socket)
    if path is None:
        raise UsageError("kvc ns evict acts on a live cache: give --socket PATH (or KVC_SOCKET)")
    ns = namespace_arg(extra_key, salt)
    outcome = call(path, EvictRequest(extra_key, salt, device, host), EvictOutcome)
    if json:
        emit_json(outcome)
        return
    t = outcome.tiers
    out.print(f"evicted namespace {ns.label}: {outcome.device_pages:,} L1 pages, {outcome.host_pages:,} L2 pages; "
              f"it now holds {t.device.tokens:,} tokens in L1, {t.host.tokens:,} in L2, {t.storage.tokens:,} in L3")


# --- audit, stats, snapshot, replay --------------------------------------------------------------------------


def audit(socket: str):
    """`kvc audit` on the live cache: the ownership and structure audit, as `AuditOutput` (source "live")."""
    from .audit_cmd import AuditOutput, Finding

    report = call(socket, AuditRequest(), AuditReport)
    findings = [Finding(**msgspec.structs.asdict(v)) for v in report.violations]
    for f in findings:
        f.kind = getattr(f.kind, "value", f.kind)
    return AuditOutput("live", socket, report.ok, findings, msgspec.structs.asdict(report.checked))


def stats(socket: str, prom: bool, json: bool) -> None:
    """`kvc stats` on the live cache: the store's figures as offline, plus the cache's pools and counters."""
    figures = call(socket, StatsRequest(), LiveStats)
    if prom:
        typer.echo(_prometheus(figures), nl=False)
        return
    if json:
        emit_json(figures)
        return
    table = Table(title=f"kvc stats — live cache at {socket}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("layout", figures.layout.describe())
    for name, pool in (("L1 device", figures.device), ("L2 host", figures.host)):
        if pool is not None:
            table.add_row(name, f"{pool.used_tokens:,} / {pool.tokens:,} tokens ({human_bytes(pool.used_bytes)} "
                                f"of {human_bytes(pool.bytes)})")
    table.add_row("in flight", f"{figures.live_requests} requests, {figures.inflight_copies} copies, "
                               f"{figures.prefetches} prefetches, {figures.staged} staged, "
                               f"{figures.storage_writes} L3 writes")
    hits = figures.cache.hits
    table.add_row("hit tokens", f"L1 {sum(h.device for h in hits):,} · L2 {sum(h.host for h in hits):,} · "
                                f"L3 {sum(h.storage for h in hits):,}")
    if figures.store is not None:
        s = figures.store
        table.add_row("store", f"{s.location} ({s.backend}): {s.pages:,} pages, {human_bytes(s.bytes)}, "
                               f"{s.namespaces:,} namespaces")
    out.print(table)


def _prometheus(figures: LiveStats) -> str:
    """The offline store exposition plus the live cache's pool and hit figures."""
    from .stats_cmd import prometheus

    text = prometheus(figures.store) if figures.store is not None else ""
    lines = []
    gauges = [("kvc_cache_tokens", "Pool capacity in tokens.", "tokens"),
              ("kvc_cache_used_tokens", "Tokens held in the pool.", "used_tokens")]
    for name, help_text, field in gauges:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
        for tier, pool in (("device", figures.device), ("host", figures.host)):
            if pool is not None:
                lines.append(f'{name}{{tier="{tier}"}} {getattr(pool, field)}')
    lines += ["# HELP kvc_cache_hit_tokens_total Tokens admitted requests found cached, by tier.",
              "# TYPE kvc_cache_hit_tokens_total counter"]
    for tier in ("device", "host", "storage"):
        lines.append(f'kvc_cache_hit_tokens_total{{tier="{tier}"}} '
                     f'{sum(getattr(h, tier) for h in figures.cache.hits)}')
    return text + "\n".join(lines) + "\n"


def snapshot_to(socket: str, path: Path) -> SnapshotResult:
    """Fetch the live cache's ownership snapshot and write it to `path` (atomically, by this process: the server
    writes no file a client names)."""
    snap = call(socket, SnapshotRequest(), SnapshotData)
    return _write_snapshot(snap, path)


def _write_snapshot(snap: SnapshotData, path: Path) -> SnapshotResult:
    decode_snapshot(snap.data, f"the snapshot from {path}")  # never write what is not a snapshot
    target = write_snapshot(snap.data, Path(path).resolve())
    return SnapshotResult(str(target), len(snap.data), snap.created, snap.nodes, snap.holders)


def replay(socket: str, trace: Path, verify: bool, batch: int, snapshot_out: Path | None) -> ReplayReport:
    """Have the live cache replay `trace` (validated here first, so a bad line names this file; streamed in
    chunks, never read whole) and return its report; write the snapshot taken right after it to `snapshot_out`."""
    with open(trace, "rb") as f:
        for _ in parse_trace(trace_lines(f), str(trace)):
            pass
    with client(socket) as c:
        outcome = c.replay(Path(trace), ReplayOutcome, verify=verify, batch=batch,
                           snapshot=snapshot_out is not None)
    if snapshot_out is not None and outcome.snapshot is not None:
        _write_snapshot(outcome.snapshot, snapshot_out)
    return outcome.report
