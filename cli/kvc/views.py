"""How the kvc commands show what they got (DESIGN §8): the tables of audit findings, of figures and of
namespaces, and the Prometheus text. The command modules (offline) and the socket client (`live`, with
--socket) both render through here, so a live answer and an offline one print alike; `--json` prints the structs
themselves. Imports only the output primitives (`output`): no command and no socket.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import msgspec
import typer

from kvcache.live.protocol import LiveStats, NamespaceList
from kvcache.types.shares import Shares
from kvcache.storage.base import VERIFY_KINDS, StoreStats, VerifyRemoval

from .output import Column, Kind, Listing, Output, human_bytes, output_format, render

# --- audit findings ------------------------------------------------------------------------------------------

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


def findings_of(violations: list[Any]) -> list[Finding]:
    """Ownership violations (kvcache.diagnostics.audit.Violation) as findings."""
    findings = [Finding(**msgspec.structs.asdict(v)) for v in violations]
    for f in findings:
        f.kind = getattr(f.kind, "value", f.kind)
    return findings


def render_audit(result: AuditOutput, fmt: Output, findings_only: bool, no_headers: bool) -> None:
    """`kvc audit`'s tables on a terminal; elsewhere the same sections as plain lines, or with -o tsv only the findings (kind,
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


# --- figures -------------------------------------------------------------------------------------------------


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


def render_live_stats(figures: LiveStats, socket: str, output: Output | None, no_headers: bool) -> None:
    """`kvc stats` of a live cache: the store's figures as offline, plus the cache's pools and counters."""
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
    ttl = figures.cache.ttl
    if ttl is not None:
        expired = ", ".join(f"{cause} {n:,}" for cause, n in sorted(ttl.expired.items())) or "none"
        rows.append(["namespace TTL", f"{ttl.tracked:,} tracked; expired: {expired}; {ttl.deferred:,} deferred, "
                                      f"{ttl.cancelled:,} cancelled by reuse; freed L1 {ttl.device_pages:,} · "
                                      f"L2 {ttl.host_pages:,} · L3 {ttl.store_pages:,} pages"])
    if figures.store is not None:
        rows += store_rows(figures.store, figures.store.location)
    print_figures(f"kvc stats — live cache at {socket}", rows, output, no_headers)


# --- namespaces ----------------------------------------------------------------------------------------------


def sort_namespaces(rows: list, sort: str) -> None:
    """Order `ns ls` rows (offline or live) by one of SORT_KEYS."""
    if sort == "extra_key":
        rows.sort(key=lambda r: (r.extra_key or "", r.salt_fingerprint or ""))
    else:
        rows.sort(key=lambda r: getattr(r, sort), reverse=True)


def render_live_namespaces(listing: NamespaceList, socket: str, fmt: Output, no_headers: bool) -> None:
    """`kvc ns ls` of a live cache as a table: the store's rows plus what each namespace holds in L1, L2 and L3,
    and when it expires under the cache's TTL policy."""
    columns = [Column("id"), Column("extra_key", Kind.USER), Column("salt fingerprint"),
               Column("L1 tokens", Kind.INT), Column("L2 tokens", Kind.INT), Column("L3 tokens", Kind.INT),
               Column("L3 bytes", Kind.BYTES), Column("hits", Kind.INT), Column("last access", Kind.TIME),
               Column("expires", Kind.TIME), Column("expiry")]
    rows = [[r.id, r.extra_key, r.salt_fingerprint, r.device.tokens, r.host.tokens, r.storage.tokens,
             r.storage.bytes, r.hits, r.last_access, r.deadline, _expiry(r)] for r in listing.namespaces]
    title = f"namespaces of the live cache at {socket} (store {listing.store or '-'})"
    render(with_shares(Listing(title, columns, rows), [r.shares for r in listing.namespaces], fmt), fmt, no_headers)



def share_summary(shares: Shares, human: bool = True) -> str:
    """A namespace's shares in one cell: L1 tokens / L2 tokens / L3 bytes, `-` for no share on a tier; plain
    integers joined by `/` when not `human` (tsv)."""
    if not human:
        return "/".join(str(v or "-") for v in (shares.device_tokens, shares.host_tokens, shares.store_bytes))
    return " / ".join([f"{shares.device_tokens:,}" if shares.device_tokens else "-",
                       f"{shares.host_tokens:,}" if shares.host_tokens else "-",
                       human_bytes(shares.store_bytes) if shares.store_bytes else "-"])


def with_shares(listing: Listing, shares: list[Shares | None], fmt: Output) -> Listing:
    """An `ns ls` listing with a `shares L1 / L2 / L3` column added when any namespace has shares (`shares`: one
    per row); unchanged otherwise, so tables without shares stay as narrow as before."""
    if all(s is None for s in shares):
        return listing
    human = fmt is Output.TABLE
    rows = [row + [share_summary(s, human) if s is not None else None] for row, s in zip(listing.rows, shares)]
    return Listing(listing.title, [*listing.columns, Column("shares L1 / L2 / L3")], rows)


def render_shares(result: Any, socket: str | None, fmt: Output, no_headers: bool) -> None:
    """`kvc ns quota show` (a `kvc.commands.ns.ShareList`): each namespace's share of a tier beside its use of it."""
    columns = [Column("id"), Column("extra_key", Kind.USER), Column("salt fingerprint"),
               Column("L1 share", Kind.INT), Column("L1 used", Kind.INT), Column("L2 share", Kind.INT),
               Column("L2 used", Kind.INT), Column("L3 share", Kind.BYTES), Column("L3 used", Kind.BYTES)]
    rows = [[r.id, r.extra_key, r.salt_fingerprint, r.shares.device_tokens or None, r.used_device_tokens,
             r.shares.host_tokens or None, r.used_host_tokens, r.shares.store_bytes or None, r.used_store_bytes]
            for r in result.namespaces]
    where = f"the live cache at {socket}" if socket is not None else (result.store or "-")
    render(Listing(f"namespace shares in {where}", columns, rows), fmt, no_headers)


def _expiry(row) -> str:
    """A live namespace's TTL state: not tracked ("-": no policy, or unused since the cache started), waiting for
    its deadline, or past it and deferred until its running requests end."""
    if row.deadline is None:
        return "-"
    return "deferred: requests running" if row.expiry_deferred else "scheduled"


# --- Prometheus ----------------------------------------------------------------------------------------------


def print_prometheus(families: list) -> None:
    """The Prometheus text exposition of metric families (`kvcache.live.metrics`) on stdout."""
    from kvcache.live.metrics import exposition  # prometheus_client: only when asked for

    typer.echo(exposition(families), nl=False)
