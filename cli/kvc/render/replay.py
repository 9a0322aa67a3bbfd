"""A replay's report for eyes (`kvc replay`, and both runs of `kvc demo`): hit tokens per namespace and tier, then
one line each on prefetch, backup, verification, the ownership audit and the pace. Tables on a terminal, a title
line and tsv rows elsewhere."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from .output import Column, Kind, Listing, output_format, render, say
from .text import esc, human_bytes, ns_label

if TYPE_CHECKING:
    from kvcache.types.fingerprint_key import FingerprintKey
    from kvcache.types.reports import ReplayReport
    from kvcache.workload.traces import TraceRequest


def trace_counts(requests: "list[TraceRequest]", fingerprints: "FingerprintKey") -> Counter:
    """Requests per namespace in a trace, keyed by the namespace's info under `fingerprints` (a store's key: `kvc
    demo`'s, as its caches show them)."""
    return Counter(fingerprints.info(r.namespace()) for r in requests)


def hit_listing(report: "ReplayReport", title: str, requests: "list[TraceRequest]") -> Listing:
    """Per namespace × tier hit tokens, from the report's own rows (sent and refused included): a live replay's
    rows carry the live cache's fingerprints, which this process could not make."""
    rows = []
    for row in sorted(report.namespaces, key=lambda r: (-r.tokens, r.namespace.extra_key or "",
                                                        r.namespace.salt_fingerprint or "")):
        h = row.hit_tokens
        rows.append([row.namespace.extra_key, row.namespace.salt_fingerprint, row.sent, row.requests, row.refused,
                     row.tokens, h.device, h.host, h.storage, 100 * h.total / row.tokens if row.tokens else None])
    h = report.hit_tokens
    rows.append(["total", None, len(requests), report.requests, report.refused, report.tokens, h.device, h.host,
                 h.storage, 100 * h.total / report.tokens if report.tokens else None])
    columns = [Column("extra_key", Kind.USER), Column("salt fp"), Column("sent", Kind.INT),
               Column("done", Kind.INT), Column("refused", Kind.INT), Column("tokens", Kind.INT),
               Column("L1 hit", Kind.INT), Column("L2 hit", Kind.INT), Column("L3 hit", Kind.INT),
               Column("hit %", Kind.PERCENT)]
    return Listing(title, columns, rows, bold=[len(rows) - 1])


def print_report(report: "ReplayReport", title: str, requests: "list[TraceRequest]") -> None:
    """The human form of a replay report."""
    render(hit_listing(report, f"replay {title}", requests), output_format(None), titled=True)
    p = report.prefetch
    declined = ", ".join(f"{k} {v}" for k, v in sorted(p.declined.items())) or "none"
    dropped = ", ".join(f"{k} {v}" for k, v in sorted(p.dropped.items())) or "none"
    cancelled = ", ".join(f"{k} {v}" for k, v in sorted(p.cancelled.items())) or "none"
    say(f"prefetch: {p.issued} issued of {p.attempts} ({report.prefetches_reissued} issued again); declined: "
        f"{declined}; {p.hit_pages} pages hit in L3, {p.fetched_pages} fetched ({human_bytes(p.fetched_bytes)}), "
        f"{p.used_pages} used; dropped: {dropped}; cancelled: {cancelled}; {p.read_errors} read errors; "
        f"{report.namespace_mismatches} namespace mismatches")
    b = report.backup
    say(f"backup: {b.host_pages} pages L1 -> L2, {b.storage_pages} pages L2 -> L3 "
        f"({human_bytes(b.storage_bytes)}), {b.storage_failed} writes failed (store unreachable), "
        f"{b.storage_rejected} pages rejected (capacity, quota, share)")
    if report.verify:
        verdict = "ok" if not report.verify_mismatches else f"{report.verify_mismatches} pages DIFFER"
        say(f"verify: {report.verified_tokens} cached tokens compared byte for byte: {verdict}")
        for m in report.mismatches[:5]:
            say(f"  {esc(m.rid)} page {m.page} ({ns_label(m.namespace)})")
    audit = "ok" if report.audit.ok else f"{len(report.audit.violations)} violations ({report.audit.violations[0]})"
    say(f"audit: {esc(audit)}")
    blocked = f", {report.blocked} blocked by the engine's own requests" if report.blocked else ""
    say(f"{len(requests)} requests sent: {report.requests} done, {report.refused} refused (too large for L1)"
        f"{blocked}; {report.tokens} tokens in {report.seconds:.2f} s: {report.requests_per_s:,.0f} req/s, "
        f"{report.tokens_per_s:,.0f} tokens/s")
