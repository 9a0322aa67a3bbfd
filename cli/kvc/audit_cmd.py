"""`kvc audit`: the L3 integrity audit of a store, the ownership audit of a snapshot, or the ownership and
structure audit of a live cache — and the output says which ran.

Exit 0 when nothing was found; 1 whenever violations were found, whether --repair then fixed them or not (a
cron job must hear about a store that needed repairing); 2 when the audit could not run.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Annotated, Any

import msgspec
import typer

from kvcache.storage.base import REPAIRS, VERIFY_KINDS, VerifyRemoval

from . import live
from .common import DEFAULT_STORE, DebugOpt, StoreOpt, command, require_store
from .errors import EXIT_FOUND, EXIT_OK, UsageError
from .output import (Column, JsonOpt, Kind, Listing, NoHeadersOpt, Output, OutputOpt, emit_json, emit_rows, human_bytes,
                     output_format, render)

# the audits one `kvc audit` can run, as `audits` names them
AUDITS = {
    "l3_integrity": "L3 integrity of the store: checksums, metadata, indexes, registry",
    "ownership": "slot ownership: every page of every pool has exactly one owner",
    "structure": "tree structure: locks, parents, namespaces of the live cache",
}


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


class PlannedRepair(msgspec.Struct, frozen=True):
    """What `--repair` would do about one finding (`--repair --dry-run`)."""

    kind: str
    page_hash: str | None
    action: str  # REPAIRS[kind], or "reported only"


class AuditOutput(msgspec.Struct):
    """`kvc audit --json` (DESIGN §8: `ok`, `violations` with `kind`, `checked`)."""

    source: str  # "store", "snapshot" or "live"
    location: str  # credentials redacted
    audits: list[str]  # which audits ran: keys of AUDITS
    ok: bool  # nothing found: exit 0. False: violations were found (exit 1), repaired or not
    violations: list[Finding]  # what the audit found (before any repair)
    checked: dict[str, int]
    repair: str = "none"  # "none", "dry_run" (see `planned`), "done" (see `repaired`, `remaining`, `removals`)
    repaired: int = 0  # findings fixed by --repair
    remaining: list[Finding] = []  # with --repair: what a second scan still finds
    removals: list[VerifyRemoval] = []  # every record --repair removed, one entry each
    planned: list[PlannedRepair] = []  # with --repair --dry-run: what --repair would do, per finding


@command
def audit(
    store: StoreOpt = DEFAULT_STORE,
    snapshot: Annotated[Path | None, typer.Option(
        "--snapshot", help="Audit the ownership snapshot in this file (written by `kvc snapshot` or "
        "TieredCache.snapshot) instead of the store.")] = None,
    repair: Annotated[bool, typer.Option(
        "--repair", help="Remove what is provably corrupt or unreachable in the store, reporting each removal.")]
    = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="With --repair: change nothing, print what --repair would do about each finding.")]
    = False,
    socket: live.SocketOpt = None,
    output: OutputOpt = None,
    no_headers: NoHeadersOpt = False,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Check a store's integrity (checksums, metadata, indexes, registry), or a snapshot's slot ownership, or
    with --socket the live cache's slot ownership and tree structure. The output names the audits that ran.

    Exit 0 when nothing was found, 1 when violations were found (repaired or not), 2 on bad usage or input.
    """
    if dry_run and not repair:
        raise UsageError("--dry-run goes with --repair")
    sock = live.socket_path(socket)
    if repair and (snapshot is not None or sock is not None):
        raise UsageError("--repair works on a store, not on a snapshot or a live cache")
    if snapshot is not None:
        result = _snapshot_audit(snapshot)
    elif sock is not None:
        result = live.audit(sock)
    else:
        result = _store_audit(store, repair, dry_run)
    fmt = output_format(output, json)
    if fmt is Output.JSON:
        emit_json(result)
    elif fmt is Output.JSONL:
        emit_rows(result.violations)
    else:
        _render(result, fmt, output is Output.TSV, no_headers)
    raise typer.Exit(EXIT_OK if result.ok else EXIT_FOUND)


def findings_of(violations: list[Any]) -> list[Finding]:
    """Ownership violations (kvcache.diagnostics.audit.Violation) as findings."""
    findings = [Finding(**msgspec.structs.asdict(v)) for v in violations]
    for f in findings:
        f.kind = getattr(f.kind, "value", f.kind)
    return findings


def _snapshot_audit(path: Path) -> AuditOutput:
    from kvcache.diagnostics.audit import audit_snapshot
    from kvcache.diagnostics.snapshot import read_snapshot

    report = audit_snapshot(read_snapshot(path))
    return AuditOutput("snapshot", str(path), ["ownership"], report.ok, findings_of(report.violations),
                       msgspec.structs.asdict(report.checked))


def _store_audit(location, repair: bool, dry_run: bool) -> AuditOutput:
    from kvcache.diagnostics.audit import audit_store

    require_store(location)
    # audit_store survives a damaged store (LMDB: its walks run in child processes; see kvcache.diagnostics.audit)
    fix = repair and not dry_run
    report = audit_store(location.url, repair=fix)
    after = audit_store(location.url) if fix and not report.ok else None
    checked = {"pages": report.pages_checked, "bytes": report.bytes_checked}
    found = [Finding(f.kind, f.detail, page_hash=f.page_hash) for f in report.findings]
    result = AuditOutput("store", str(location), ["l3_integrity"], report.ok, found, checked)
    if dry_run:
        result.repair = "dry_run"
        result.planned = [PlannedRepair(f.kind, f.page_hash, REPAIRS.get(f.kind, "reported only")) for f in found]
    elif repair:
        result.repair = "done"
        result.repaired = report.repaired
        result.removals = report.removals
        result.remaining = [Finding(f.kind, f.detail, page_hash=f.page_hash)
                            for f in (after.findings if after is not None else [])]
    return result


def _render(result: AuditOutput, fmt: Output, findings_only: bool, no_headers: bool) -> None:
    """Tables on a terminal; elsewhere the same sections as plain lines, or with -o tsv only the findings (kind,
    where, detail: one line each, for awk)."""
    if findings_only:
        rows = [[f.kind, _where(f), f.detail] for f in result.violations]
        render(Listing("", [Column("kind"), Column("where"), Column("detail", Kind.USER)], rows), fmt, no_headers)
        return
    summary = [["audits", "; ".join(AUDITS[a] for a in result.audits)],
               ["result", "ok" if result.ok else f"{len(result.violations)} violation(s) found"]]
    summary += [[f"checked {name}", human_bytes(value) if name == "bytes" else f"{value:,}"]
                for name, value in result.checked.items()]
    if result.repair == "done":
        summary.append(["repair", f"{result.repaired} repaired, {len(result.removals)} records removed, "
                                  f"{len(result.remaining)} violation(s) left"])
    elif result.repair == "dry_run":
        summary.append(["repair", f"dry run: nothing changed; {len(result.planned)} finding(s) planned below"])
    sections = [Listing(f"kvc audit — {result.source} {result.location}", [Column("figure"), Column("value")],
                        summary, header=False)]
    sections += _groups(result.violations, "")
    if result.planned:
        sections.append(Listing("--repair would", [Column("finding"), Column("page"), Column("action")],
                                [[p.kind, (p.page_hash or "-")[:16], p.action] for p in result.planned[:100]]))
    sections += _groups(result.remaining, "left after repair: ")
    if result.removals:
        rows = [[r.page_hash[:16], r.what, r.kind, r.nbytes, (r.below or "-")[:16]] for r in result.removals[:100]]
        if len(result.removals) > 100:
            rows.append(["…", f"{len(result.removals) - 100} more (use --json for all)", "", None, ""])
        sections.append(Listing(f"removed by --repair ({len(result.removals)})",
                                [Column("page"), Column("what"), Column("finding"), Column("bytes", Kind.BYTES),
                                 Column("below")], rows))
    for section in sections:
        render(section, fmt, titled=True)


def _groups(findings: list[Finding], prefix: str) -> list[Listing]:
    groups: dict[str, list[Finding]] = defaultdict(list)
    for f in findings:
        groups[f.kind].append(f)
    listings = []
    for kind, items in sorted(groups.items()):
        rows = [[_where(f), f.detail] for f in items[:50]]
        if len(items) > 50:
            rows.append(["…", f"{len(items) - 50} more (use --json for all)"])
        title = f"{prefix}{kind} ({len(items)})" + (f": {VERIFY_KINDS[kind]}" if kind in VERIFY_KINDS else "")
        listings.append(Listing(title, [Column("where"), Column("detail", Kind.USER)], rows))
    return listings


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
