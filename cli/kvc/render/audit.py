"""`kvc audit`'s findings: the struct it prints with --json (DESIGN §8: `ok`, `violations` with `kind`,
`checked`) and its tables — a summary, then the findings grouped by kind; with -o tsv one line per finding.

An offline audit (`kvc.commands.audit`) and a live one (`kvc.live`) both build an `AuditOutput`, so they print
alike.
"""

from __future__ import annotations

import datetime
from collections import defaultdict
from typing import Any

import msgspec

from kvcache.storage.api import VERIFY_KINDS, SalvageReport, VerifyRemoval
from kvcache.storage.verify_parts import NOT_CHECKED

from .output import Column, Kind, Listing, Output, render
from .text import human_bytes

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
    original_kept: str | None = None  # with --repair: the data file as it was, kept beside the store
    salvage: SalvageReport | None = None  # with --repair of a damaged structure: pages kept, lost, unreadable bytes
    # a store's audit only (None for a snapshot's or a live cache's):
    scope: str | None = None  # "full" (every page, every check) or "incremental" (see `since`)
    since: float | None = None  # incremental: unix seconds; the pages written or read back since then were checked
    not_checked: list[str] = []  # incremental: the checks it left out (keys of verify_parts.NOT_CHECKED)
    workers: int | None = None  # processes that read the store's pages
    recorded: bool | None = None  # this audit was recorded in the store (what `--since last` reads)


def findings_of(violations: list[Any]) -> list[Finding]:
    """Ownership violations (kvcache.diagnostics.audit.Violation) as findings."""
    findings = [Finding(**msgspec.structs.asdict(v)) for v in violations]
    for f in findings:
        f.kind = getattr(f.kind, "value", f.kind)
    return findings


def render_audit(result: AuditOutput, fmt: Output, findings_only: bool, no_headers: bool) -> None:
    """`kvc audit`'s tables on a terminal; elsewhere the same sections as plain lines, or with -o tsv only the
    findings (kind, where, detail: one line each, for awk)."""
    if findings_only:
        rows = [[f.kind, _where(f), f.detail] for f in result.violations]
        render(Listing("", [Column("kind"), Column("where"), Column("detail", Kind.USER)], rows), fmt, no_headers)
        return
    summary = [["audits", "; ".join(AUDITS[a] for a in result.audits)],
               ["result", "ok" if result.ok else f"{len(result.violations)} violation(s) found"]]
    summary += [[f"checked {name}", human_bytes(value) if name == "bytes" else f"{value:,}"]
                for name, value in result.checked.items()]
    if result.source == "store":
        summary.append(["scope", _scope(result)])
        summary += [["not checked", NOT_CHECKED[key]] for key in result.not_checked]
    if result.repair == "done":
        summary.append(["repair", f"{result.repaired} repaired, {len(result.removals)} records removed, "
                                  f"{len(result.remaining)} violation(s) left"])
    if result.salvage is not None:
        s = result.salvage
        lost = f"{s.lost:,}" if s.lost_exact else f"at least {s.lost:,}" if s.lost > 0 else "an unknown number"
        before = f"{s.pages_before:,}" if s.pages_before >= 0 else "unknown"
        summary.append(["rebuilt", f"{s.kept:,} page(s) kept, {lost} lost of {before} recorded; "
                                   f"{human_bytes(s.unreadable_bytes)} of the file unreadable"])
    if result.original_kept is not None:
        summary.append(["original kept", result.original_kept])
    if result.repair == "dry_run":
        summary.append(["repair", f"dry run: nothing changed; {len(result.planned)} finding(s) planned below"])
    sections = [Listing(f"kvc audit — {result.source} {result.location}", [Column("figure"), Column("value")],
                        summary, header=False)]
    sections += _groups(result.violations, "")
    if result.planned:
        sections.append(Listing("--repair would", [Column("finding"), Column("page"), Column("action")],
                                [[p.kind, (p.page_hash or "-")[:16], p.action] for p in result.planned[:100]]))
    sections += _groups(result.remaining, "left after repair: ")
    if result.removals:
        removed: list[list[Any]] = [[r.page_hash[:16], r.what, r.kind, r.nbytes, (r.below or "-")[:16]]
                                    for r in result.removals[:100]]
        if len(result.removals) > 100:
            removed.append(["…", f"{len(result.removals) - 100} more (use --json for all)", "", None, ""])
        sections.append(Listing(f"removed by --repair ({len(result.removals)})",
                                [Column("page"), Column("what"), Column("finding"), Column("bytes", Kind.BYTES),
                                 Column("below")], removed))
    for section in sections:
        render(section, fmt, titled=True)


def _scope(result: AuditOutput) -> str:
    """How much of the store the audit read, with how many processes, and whether the store recorded it."""
    if result.scope == "incremental" and result.since is not None:
        when = datetime.datetime.fromtimestamp(result.since, datetime.timezone.utc).isoformat(timespec="seconds")
        what = f"incremental: the pages written or read back since {when}"
    else:
        what = "full: every page"
    return (f"{what}; {result.workers} worker process(es); "
            + ("recorded in the store" if result.recorded else "not recorded in the store"))


def _groups(findings: list[Finding], prefix: str) -> list[Listing]:
    groups: dict[str, list[Finding]] = defaultdict(list)
    for f in findings:
        groups[f.kind].append(f)
    listings = []
    for kind, items in sorted(groups.items()):
        rows = [[_where(f), f.detail] for f in items[:50]]
        if len(items) > 50:
            rows.append(["…", f"{len(items) - 50} more (use --json for all)"])
        described = VERIFY_KINDS.get(kind)
        title = f"{prefix}{kind} ({len(items)})" + (f": {described}" if described else "")
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
