"""A capacity sweep for eyes (`kvc sweep`): a table of hits per size, tenant and tier, and the plot of hit rate
against capacity (matplotlib, the optional `kvc[plot]` extra: imported only when a plot is asked for)."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from .output import Column, Kind, Listing, output_format, render, say
from .text import escape_controls, human_bytes

if TYPE_CHECKING:
    from kvcache.types.namespace import NamespaceInfo
    from kvcache.types.sweep import SweepPoint, SweepReport

PLOT_FORMATS = ("png", "svg")  # what --plot writes, by the file's extension
PLOT_EXTRA = "pip install 'kvc[plot]'"  # how to get the plotting library
# Size of the drawing in inches at PLOT_DPI (PNG pixels: 1000 x 600).
PLOT_INCHES = (10.0, 6.0)
PLOT_DPI = 100


def sweep_listing(report: "SweepReport", title: str) -> Listing:
    """One row per size and namespace, then the size's total (bold)."""
    rows: list[list[object]] = []
    bold: list[int] = []
    for result in report.points:
        p = result.point
        size = [p.device_tokens, p.host_tokens, p.storage_bytes or None]
        for t in result.tenants:
            h = t.hit_tokens
            rows.append([*size, t.namespace.extra_key, t.namespace.salt_fingerprint, t.requests, t.refused, t.tokens,
                         h.device, h.host, h.storage, 100 * t.hit_rate])
        h = result.hit_tokens
        bold.append(len(rows))
        rows.append([*size, "total", None, result.requests, result.refused, result.tokens, h.device, h.host,
                     h.storage, 100 * result.hit_rate])
    columns = [Column("L1 tokens", Kind.INT), Column("L2 tokens", Kind.INT), Column("L3 bytes", Kind.BYTES),
               Column("extra_key", Kind.USER), Column("salt fp"), Column("done", Kind.INT),
               Column("refused", Kind.INT), Column("tokens", Kind.INT), Column("L1 hit", Kind.INT),
               Column("L2 hit", Kind.INT), Column("L3 hit", Kind.INT), Column("hit %", Kind.PERCENT)]
    return Listing(title, columns, rows, bold=bold)


def print_sweep(report: "SweepReport", title: str) -> None:
    """The human form of a sweep: the table (an L3 of "-" is unlimited), then one line on how it ran."""
    render(sweep_listing(report, f"sweep {title}"), output_format(None), titled=True)
    pol = report.policies
    audits = "ok" if report.ok else "FAILED at " + ", ".join(
        size_label(r.point) for r in report.points if not r.audit_ok)
    say(f"{len(report.points)} sizes (L3 -: unlimited) x {report.requests:,} requests ({report.tokens:,} tokens) in "
        f"{report.seconds:.2f} s on {report.workers} processes; {pol.write_policy.value}, "
        f"{pol.prefetch_policy.value}, {pol.host_mode.value} mode, batch {pol.batch}; ownership audits: {audits}")


def size_label(point: "SweepPoint") -> str:
    """`L1/L2/L3` of a size, short: 16384/65536/1.0 GiB (L3 "inf" when unlimited)."""
    l3 = human_bytes(point.storage_bytes) if point.storage_bytes else "inf"
    return f"{point.device_tokens}/{point.host_tokens}/{l3}"


def tenant_label(info: "NamespaceInfo", twins: bool) -> str:
    """A legend entry: the extra_key ("default" for none), with the salt fingerprint where two namespaces share
    an extra_key. Made safe for matplotlib: control characters escaped, `$` (mathtext) escaped, and a leading `_`
    (which hides an entry from the legend) kept visible."""
    label = escape_controls(info.extra_key) if info.extra_key is not None else "default"
    if twins:
        label += f" ({info.salt_fingerprint or 'no salt'})"
    label = label.replace("$", r"\$")
    return " " + label if label.startswith("_") else label


def _axis(report: "SweepReport") -> tuple[list[float], str, list[str] | None]:
    """The x values, the axis label and tick labels: the one tier whose size varies (its capacity), else the sizes
    in order, each ticked with its L1/L2/L3."""
    points = [r.point for r in report.points]
    tiers = [("device_tokens", "L1 (device) capacity, tokens"), ("host_tokens", "L2 (host) capacity, tokens"),
             ("storage_bytes", "L3 (store) capacity, payload bytes")]
    varying = [(f, label) for f, label in tiers if len({getattr(p, f) for p in points}) > 1]
    if len(varying) == 1 and not (varying[0][0] == "storage_bytes" and any(p.storage_bytes == 0 for p in points)):
        field, label = varying[0]
        return [float(getattr(p, field)) for p in points], label, None
    if not varying:
        return [float(p.device_tokens) for p in points], tiers[0][1], None
    return [float(i) for i in range(len(points))], "capacity: L1 tokens / L2 tokens / L3 bytes", [
        size_label(p) for p in points]


def plot_sweep(report: "SweepReport", title: str, fmt: str) -> bytes:
    """The plot as PNG or SVG bytes: hit rate (% of tokens) against capacity, one line per namespace. ImportError
    when matplotlib is not installed."""
    import matplotlib
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend

    xs, xlabel, ticks = _axis(report)
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    fig = Figure(figsize=PLOT_INCHES, dpi=PLOT_DPI, layout="constrained")
    ax = fig.add_subplot()
    tenants = report.points[0].tenants if report.points else []
    keys = [t.namespace.extra_key for t in tenants]
    for i, t in enumerate(tenants):
        ys = [100 * report.points[j].tenants[i].hit_rate for j in order]
        ax.plot([xs[j] for j in order], ys, marker="o", label=tenant_label(t.namespace, keys.count(keys[i]) > 1),
                gid=f"tenant-line-{i}")  # the SVG group of the line: what a reader of the file counts
    ax.set_title(f"kvc sweep: hit rate against capacity ({escape_controls(title).replace('$', chr(92) + '$')})")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("hit rate (% of tokens)")
    ax.set_ylim(0, 100)
    if ticks is None and min(xs) > 0 and max(xs) >= 8 * min(xs):
        ax.set_xscale("log", base=2)  # sizes spanning octaves (the usual doubling steps) spread evenly
        ax.minorticks_off()
        ax.set_xticks(sorted(set(xs)), [f"{int(x):,}" for x in sorted(set(xs))])
    if ticks is not None:
        ax.set_xticks(xs, [ticks[j] for j in range(len(xs))], rotation=30, ha="right")
    ax.grid(True, alpha=0.3)
    if tenants:
        ax.legend(title="tenant", loc="best")
    out = io.BytesIO()
    # SVG text as <text> elements (selectable, searchable), not glyph outlines; no date and a fixed salt for the
    # element ids (random otherwise): the same sweep, the same file
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "kvc sweep"}):
        fig.savefig(out, format=fmt, metadata={"Date": None} if fmt == "svg" else None)
    return out.getvalue()


def plot_note(path: str) -> str:
    """The one line that says a plot was not drawn, and how to get the library."""
    return f"kvc: note: --plot {escape_controls(path)}: not drawn: plotting needs matplotlib ({PLOT_EXTRA})\n"

