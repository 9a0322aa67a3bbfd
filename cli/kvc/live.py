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
from typing import TYPE_CHECKING, Annotated

import msgspec
import typer

from kvcache.diagnostics.audit import AuditReport
from kvcache.diagnostics.snapshot import decode_snapshot, write_snapshot
from kvcache.live.client import AdminClient
from kvcache.live.protocol import (AuditRequest, DropRequest, EvictOutcome, EvictRequest, LiveStats, NamespaceList,
                                   NamespacesRequest, ReplayOutcome, SnapshotData, SnapshotRequest, SnapshotResult,
                                   StatsRequest)
from kvcache.namespace import Namespace
from kvcache.workload.traces import parse_trace, trace_lines

from .common import DebugOpt, command
from .errors import UsageError
from .output import Column, JsonOpt, Kind, Listing, Output, emit_json, emit_rows, human_bytes, ns_label, render, say
from .secrets import SaltFileOpt, SaltOpt, salt_from

if TYPE_CHECKING:
    from kvcache.workload.replay import ReplayReport  # imports torch: only where a replay runs

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


def ns_ls(socket: str, sort: str, fmt: Output, no_headers: bool) -> None:
    """`kvc ns ls` on the live cache: the store's rows plus what each namespace holds in L1, L2 and L3."""
    from .ns_cmd import sort_rows

    listing = call(socket, NamespacesRequest(), NamespaceList)
    sort_rows(listing.namespaces, sort)
    if fmt is Output.JSON:
        emit_json(listing)
        return
    if fmt is Output.JSONL:
        emit_rows(listing.namespaces)
        return
    columns = [Column("id"), Column("extra_key", Kind.USER), Column("salt fingerprint"),
               Column("L1 tokens", Kind.INT), Column("L2 tokens", Kind.INT), Column("L3 tokens", Kind.INT),
               Column("L3 bytes", Kind.BYTES), Column("hits", Kind.INT), Column("last access", Kind.TIME)]
    rows = [[r.id, r.extra_key, r.salt_fingerprint, r.device.tokens, r.host.tokens, r.storage.tokens,
             r.storage.bytes, r.hits, r.last_access] for r in listing.namespaces]
    render(Listing(f"namespaces of the live cache at {socket} (store {listing.store or '-'})", columns, rows),
           fmt, no_headers)


@command
def ns_evict(
    extra_key: Annotated[str, typer.Argument(help="The namespace's extra_key (\"\" for requests without one).",
                                             metavar="EXTRA_KEY")],
    salt: SaltOpt = None,
    salt_file: SaltFileOpt = None,
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
    salt_value = salt_from(salt, salt_file)
    Namespace(extra_key, salt_value)  # checked here, before the request goes out
    outcome = call(path, EvictRequest(extra_key, salt_value, device, host), EvictOutcome)
    if json:
        emit_json(outcome)
        return
    t = outcome.tiers
    say(f"evicted namespace {ns_label(outcome.namespace)}: {outcome.device_pages:,} L1 pages, "
        f"{outcome.host_pages:,} L2 pages; it now holds {t.device.tokens:,} tokens in L1, {t.host.tokens:,} in L2, "
        f"{t.storage.tokens:,} in L3")


def ns_drop(path: str, extra_key: str, salt: str | None, missing_ok: bool, json: bool) -> None:
    """`kvc --socket S ns drop EXTRA_KEY`: offboard a namespace from the live cache's L1 and L2 (nothing written
    back) and from its store, in one request (`TieredCache.drop_namespace`)."""
    from kvcache.cache import NamespaceDrop  # the result type only; the server runs the cache

    Namespace(extra_key, salt)  # checked here, before the request goes out
    outcome = call(path, DropRequest(extra_key, salt), NamespaceDrop)
    held = outcome.device_pages + outcome.host_pages + outcome.store_pages
    if not held and not outcome.live_requests and not missing_ok:
        raise UsageError(f"namespace {ns_label(outcome.namespace)} holds nothing in the live cache or its store "
                         f"(--missing-ok makes that a success)")
    if json:
        emit_json(outcome)
        return
    running = (f"; {outcome.live_requests} running request(s) keep their pages until they end"
               if outcome.live_requests else "")
    say(f"dropped namespace {ns_label(outcome.namespace)} from the live cache: {outcome.device_pages:,} L1 pages, "
        f"{outcome.host_pages:,} L2 pages, {outcome.store_pages:,} L3 pages ({human_bytes(outcome.store_bytes)})"
        f"{running}")


# --- audit, stats, snapshot, replay --------------------------------------------------------------------------


def audit(socket: str):
    """`kvc audit` on the live cache: the ownership and structure audit, as `AuditOutput` (source "live")."""
    from .audit_cmd import AuditOutput, findings_of

    report = call(socket, AuditRequest(), AuditReport)
    return AuditOutput("live", socket, ["ownership", "structure"], report.ok, findings_of(report.violations),
                       msgspec.structs.asdict(report.checked))


def stats(socket: str, prom: bool, json: bool, output: Output | None = None, no_headers: bool = False) -> None:
    """`kvc stats` on the live cache: the store's figures as offline, plus the cache's pools and counters."""
    figures = call(socket, StatsRequest(), LiveStats)
    if prom:
        from kvcache.live.metrics import cache_families, exposition

        typer.echo(exposition(cache_families(figures, call(socket, NamespacesRequest(), NamespaceList))), nl=False)
        return
    if json:
        emit_json(figures)
        return
    from .stats_cmd import print_figures, store_rows

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
    if figures.store is not None:
        rows += store_rows(figures.store, figures.store.location)
    print_figures(f"kvc stats — live cache at {socket}", rows, output, no_headers)


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
    return outcome.replay_report()
