"""The kvc commands' socket client (DESIGN §7): which socket a command talks to, and the requests whose answers
need more than one call or a file written here (audit, snapshot, replay). Rendering is `kvc.render`'s;
the --socket option is declared in `kvc.options`.

`--socket PATH` is accepted after a command (`kvc prefetch --socket S`) and before it (`kvc --socket S prefetch`,
or env KVC_SOCKET, read by the app's callback); the one after the command wins. A command given a socket sends
its request to that cache's admin socket and prints the same fields as offline, plus what only a live cache has
(what each namespace holds in L1 and L2). Admin errors (no server, another protocol version, no answer in time,
a failure on the server) are `kvcache.errors.AdminError`: one line on stderr, exit 2.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from kvcache.diagnostics.snapshot import decode_snapshot
from kvcache.live.client import AdminClient
from kvcache.live.protocol import AuditRequest, ReplayOutcome, SnapshotData, SnapshotRequest, SnapshotResult
from kvcache.types.explain import Explanation
from kvcache.types.reports import AuditReport
from kvcache.workload.traces import parse_trace, trace_lines

from .errors import UsageError
from .outputs import OutputTarget, write_file
from .render.audit import AuditOutput, findings_of

if TYPE_CHECKING:
    from kvcache.types.reports import ReplayReport

DEFAULT_TIMEOUT = 30.0

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


def timeout() -> float:
    """The --timeout given before the command: how long to wait for a live cache (or its event feed) to answer."""
    if not 0 < _GLOBAL.timeout <= MAX_TIMEOUT_S:  # also refuses nan and inf
        raise UsageError(f"--timeout {_GLOBAL.timeout:g}: must be > 0 and at most {MAX_TIMEOUT_S:g} seconds")
    return _GLOBAL.timeout


def client(socket: str) -> AdminClient:
    """A client of the live cache at `socket`, with the --timeout given before the command, trusting a server
    run by this user, by root, or by the uids in env KVC_SERVER_UID (comma-separated)."""
    return AdminClient(socket, timeout(), trusted_uids={os.geteuid(), 0, *_server_uids()})


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


# --- audit, stats, snapshot, replay --------------------------------------------------------------------------


def audit(socket: str) -> AuditOutput:
    """`kvc audit` on the live cache: the ownership and structure audit, as `AuditOutput` (source "live")."""
    report = call(socket, AuditRequest(), AuditReport)
    return AuditOutput("live", socket, ["ownership", "structure"], report.ok, findings_of(report.violations),
                       msgspec.structs.asdict(report.checked))


def snapshot_to(socket: str, target: OutputTarget) -> SnapshotResult:
    """Fetch the live cache's ownership snapshot and write it to `target` (by this process, as `kvc.outputs`
    writes: the server writes no file a client names)."""
    snap = call(socket, SnapshotRequest(), SnapshotData)
    return _write_snapshot(snap, target)


def _write_snapshot(snap: SnapshotData, target: OutputTarget) -> SnapshotResult:
    decode_snapshot(snap.data, f"the snapshot for {target.given}")  # never write what is not a snapshot
    written = write_file(target, snap.data)
    return SnapshotResult(str(written.resolve()), len(snap.data), snap.created, snap.nodes, snap.holders)


def replay(socket: str, trace: Path, verify: bool, batch: int, snapshot_out: OutputTarget | None,
           explain: bool = False) -> tuple[ReplayReport, list[Explanation]]:
    """Have the live cache replay `trace` (validated here first, so a bad line names this file; streamed in
    chunks, never read whole) and return its report, and with `explain` each request's line (`kvc replay
    --requests-out`); write the snapshot taken right after it to `snapshot_out`."""
    with open(trace, "rb") as f:
        for _ in parse_trace(trace_lines(f), str(trace)):
            pass
    with client(socket) as c:
        outcome = c.replay(Path(trace), ReplayOutcome, verify=verify, batch=batch,
                           snapshot=snapshot_out is not None, explain=explain)
    if snapshot_out is not None and outcome.snapshot is not None:
        _write_snapshot(outcome.snapshot, snapshot_out)
    return outcome.replay_report(), outcome.requests
