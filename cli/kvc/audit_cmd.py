"""`kvc audit`: the L3 integrity audit of a store, or the ownership audit of a snapshot."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Annotated, Any

import msgspec
import typer
from rich.table import Table

from kvcache.audit import audit_snapshot, audit_store
from kvcache.snapshot import read_snapshot
from kvcache.storage.base import VerifyRemoval

from . import live
from .common import (DEFAULT_STORE, EXIT_FOUND, EXIT_OK, DebugOpt, JsonOpt, StoreOpt, UsageError, command,
                     emit_json, human_bytes, out, require_store)


class Finding(msgspec.Struct, omit_defaults=True):
    """One violation as `kvc audit --json` prints it: `kind` first, then whatever locates it."""

    kind: str
    detail: str
    page_hash: str | None = None
    pool: str | None = None
    pages: list[int] = []
    count: int = 0
    owners: list[str] = []
    node: int | None = None
    rid: str | None = None


class AuditOutput(msgspec.Struct):
    """`kvc audit --json` (DESIGN §8: `ok`, `violations` with `kind`, `checked`)."""

    source: str  # "store" or "snapshot"
    location: str
    ok: bool  # no violations (with --repair: none left after the repair)
    violations: list[Finding]  # what the audit found (with --repair: what is left after the repair)
    checked: dict[str, int]
    repaired: int = 0  # findings fixed by --repair
    repaired_violations: list[Finding] = []  # with --repair: what was found before the repair
    removals: list[VerifyRemoval] = []  # every record --repair removed, one entry each


@command
def audit(
    store: StoreOpt = DEFAULT_STORE,
    snapshot: Annotated[Path | None, typer.Option(
        "--snapshot", help="Audit the ownership snapshot in this file (written by `kvc snapshot` or "
        "TieredCache.snapshot) instead of the store.")] = None,
    repair: Annotated[bool, typer.Option(
        "--repair", help="Remove what is provably corrupt or unreachable in the store, reporting each removal.")]
    = False,
    socket: live.SocketOpt = None,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Check a store's integrity (checksums, metadata, indexes, registry), or a snapshot's slot ownership, or
    with --socket the live cache's slot ownership and tree structure.

    Exit 0 when clean, 1 when violations were found, 2 on bad usage or input.
    """
    if snapshot is not None:
        result = _snapshot_audit(snapshot)
    elif (sock := live.socket_path(socket)) is not None:
        if repair:
            raise UsageError("--repair works on a store, not on a live cache")
        result = live.audit(sock)
    else:
        result = _store_audit(store, repair)
    if json:
        emit_json(result)
    else:
        _render(result)
    raise typer.Exit(EXIT_OK if result.ok else EXIT_FOUND)


def _snapshot_audit(path: Path) -> AuditOutput:
    report = audit_snapshot(read_snapshot(path))
    findings = [Finding(**{k: v for k, v in msgspec.structs.asdict(v).items()}) for v in report.violations]
    for f in findings:
        f.kind = getattr(f.kind, "value", f.kind)
    return AuditOutput("snapshot", str(path), report.ok, findings, msgspec.structs.asdict(report.checked))


def _store_audit(location: str, repair: bool) -> AuditOutput:
    require_store(location)
    # audit_store survives a damaged store (LMDB: its walks run in child processes; see kvcache.audit)
    report = audit_store(location, repair=repair)
    after = audit_store(location) if repair and not report.ok else report  # exit code and `ok`: what is left
    checked = {"pages": report.pages_checked, "bytes": report.bytes_checked}
    left = [Finding(f.kind, f.detail, page_hash=f.page_hash) for f in after.findings]
    if not repair:
        return AuditOutput("store", location, report.ok, left, checked)
    found = [Finding(f.kind, f.detail, page_hash=f.page_hash) for f in report.findings]
    return AuditOutput("store", location, after.ok, left, checked, report.repaired, found, report.removals)


def _render(result: AuditOutput) -> None:
    summary = Table(title=f"kvc audit — {result.source} {result.location}", show_header=False)
    summary.add_column(style="bold")
    summary.add_column()
    if result.repaired_violations:
        summary.add_row("found", f"[yellow]{len(result.repaired_violations)} violation(s)[/], "
                                 f"{result.repaired} repaired")
    summary.add_row("result", "[green]ok[/]" if result.ok else f"[red]{len(result.violations)} violation(s)[/]")
    for name, value in result.checked.items():
        summary.add_row(f"checked {name}", human_bytes(value) if name == "bytes" else f"{value:,}")
    if result.repaired:
        summary.add_row("repaired", f"{result.repaired:,}")
    out.print(summary)
    _render_groups(result.repaired_violations, "repaired: ")
    _render_groups(result.violations, "")
    if result.removals:
        table = Table(title=f"removed by --repair ({len(result.removals)})", title_justify="left")
        for col in ("page", "what", "finding", "bytes", "below"):
            table.add_column(col)
        for r in result.removals[:100]:
            table.add_row(r.page_hash[:16], r.what, r.kind, human_bytes(r.nbytes), (r.below or "-")[:16])
        if len(result.removals) > 100:
            table.add_row("…", f"{len(result.removals) - 100} more (use --json for all)", "", "", "")
        out.print(table)


def _render_groups(findings: list[Finding], prefix: str) -> None:
    groups: dict[str, list[Finding]] = defaultdict(list)
    for f in findings:
        groups[f.kind].append(f)
    for kind, items in sorted(groups.items()):
        table = Table(title=f"{prefix}{kind} ({len(items)})", title_justify="left")
        table.add_column("where")
        table.add_column("detail")
        for f in items[:50]:
            table.add_row(_where(f), f.detail)
        if len(items) > 50:
            table.add_row("…", f"{len(items) - 50} more (use --json for all)")
        out.print(table)


def _where(f: Finding) -> str:
    parts: list[Any] = []
    if f.page_hash:
        parts.append(f"page {f.page_hash[:16]}")
    if f.pool:
        parts.append(f.pool + (f" pages {f.pages[:8]}" if f.pages else ""))
    if f.node is not None:
        parts.append(f"node#{f.node}")
    if f.rid:
        parts.append(f"request {f.rid}")
    return ", ".join(str(p) for p in parts) or "-"
