"""`kvc demo`: a multi-tenant workload replayed cold, then warm after a restart, on the embedded L3 store."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import msgspec
import typer

from kvcache.storage.registry import open_store
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import NamespaceInfo
from kvcache.workload.traces import WorkloadSpec, generate

from ..context import fingerprints_of, offline_cache
from ..errors import EXIT_FOUND, UsageError
from ..options import MAX_TOKENS, DebugOpt, JsonOpt
from ..render.output import Column, Kind, Listing, emit_json, output_format, render, say
from ..render.progress import progress
from ..render.replay import hit_listing, trace_counts
from ..render.text import esc, human_bytes
from ..reporting import at_steps, command

if TYPE_CHECKING:
    from kvcache.types.reports import ReplayReport

DEMO_LAYOUT = KVLayout("kvc-demo@r1", layers=2, kv_heads=2, head_dim=16, dtype="float16", page_size=16)


class TenantSavings(msgspec.Struct):
    """One tenant in the demo: what it hit cold and warm, and what L3 served after the restart. Each run's
    rates are over that run's own committed tokens (a request too large for L1 is refused and not counted)."""

    namespace: NamespaceInfo
    requests: int  # requests of the tenant in the workload (the same in both runs)
    cold_refused: int
    cold_tokens: int  # tokens of the tenant's committed requests in the cold run
    cold_hit_tokens: int
    cold_storage_tokens: int  # served from L3 in the cold run: pages L2 had evicted
    warm_refused: int
    warm_tokens: int
    warm_hit_tokens: int
    warm_storage_tokens: int  # served from L3 in the warm run: prefill the restart did not have to redo


class DemoOutput(msgspec.Struct):
    """`kvc demo --json`."""

    store: str
    requests: int  # in the workload; each run's `requests` + `refused` add up to it
    tenants: list[TenantSavings]
    cold: "ReplayReport"
    warm: "ReplayReport"
    store_ok: bool  # the L3 integrity audit after both runs
    store_pages: int
    store_bytes: int
    ok: bool  # both replays verified with 0 mismatches, both audits and the store audit clean


@command
def demo(
    requests: Annotated[int, typer.Option(min=1, max=1_000_000, help="Requests in the generated workload.")]
    = 3000,
    tenants: Annotated[int, typer.Option(min=1, max=10_000,
                                         help="Tenants (namespaces), each with its own salt.")] = 4,
    device_tokens: Annotated[int, typer.Option("--device-tokens", min=1, max=MAX_TOKENS,
                                               help="L1 capacity in tokens.")] = 2048,
    host_tokens: Annotated[int, typer.Option("--host-tokens", min=0, max=MAX_TOKENS,
                                             help="L2 capacity in tokens.")] = 8192,
    store: Annotated[Path | None, typer.Option(
        "--store", help="Keep the demo's store here (a new directory). Default: a temporary one, removed.")]
    = None,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Generate a multi-tenant workload and replay it twice on an embedded LMDB store: cold (empty tiers), then
    warm (a restarted cache: empty L1 and L2, the store from the first run). Both replays verify every reused
    byte and end with an ownership audit; the table shows what L3 saved each tenant. Exit 1 if a check fails."""
    if store is not None and store.exists():
        raise UsageError(f"{store}: already exists; the demo writes a new store (give a new path)")
    if store is not None and not store.parent.is_dir():
        raise UsageError(f"{store}: the parent directory {store.parent} does not exist")
    from kvcache.workload.replay import replay as run_replay

    # a working set (tenants x 48 documents of 256 tokens) several times L2, so L3 serves the cold run too
    spec = WorkloadSpec(requests=requests, tenants=tenants, documents=48, document_tokens=256, seed=7)
    trace = generate(spec)
    root = Path(tempfile.mkdtemp(prefix="kvc-demo-")) if store is None else None
    location = str(root / "store") if root is not None else str(store)
    try:
        with contextlib.closing(open_store(location, DEMO_LAYOUT, create=True, durability="data")) as handle:
            fingerprints = fingerprints_of(handle)  # what it shows: keyed by its store's key, as its caches do
            reports = []
            for run in ("cold", "warm"):
                cache = offline_cache(handle, DEMO_LAYOUT, device_tokens, host_tokens, prefetch_policy="timeout")
                with at_steps(), contextlib.closing(cache):  # a Ctrl-C lands between the cache's steps
                    with progress(f"{run} replay", len(trace), not json) as advance:
                        reports.append(run_replay(cache, trace, verify=True, progress=advance))
            verify = handle.verify()
            stats = handle.stats()
    finally:
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
    cold, warm = reports
    sent = trace_counts(trace, fingerprints)
    runs = [{r.namespace: r for r in report.namespaces} for report in (cold, warm)]
    rows = []
    for info in sorted(sent, key=lambda i: (i.extra_key or "", i.salt_fingerprint or "")):
        c, w = (run.get(info) for run in runs)
        rows.append(TenantSavings(
            info, sent[info],
            sent[info] - (c.requests if c else 0), c.tokens if c else 0, c.hit_tokens.total if c else 0,
            c.hit_tokens.storage if c else 0,
            sent[info] - (w.requests if w else 0), w.tokens if w else 0, w.hit_tokens.total if w else 0,
            w.hit_tokens.storage if w else 0))
    ok = cold.ok and warm.ok and verify.ok
    result = DemoOutput(location if store is not None else "(temporary)", len(trace), rows, cold, warm, verify.ok,
                        stats.pages, stats.bytes, ok)
    if json:
        emit_json(result)
    else:
        _print(result, spec, trace)
    if not ok:
        raise typer.Exit(EXIT_FOUND)


def _pct(part: int, whole: int) -> float | None:
    return 100 * part / whole if whole else None


def _print(result: DemoOutput, spec: WorkloadSpec, trace: list) -> None:
    fmt = output_format(None)
    say(f"kvc demo: {result.requests} requests from {len(result.tenants)} tenants (each its own namespace; "
        f"the first {spec.shared_prefix_tokens} token ids are the same in all of them), layout "
        f"{esc(DEMO_LAYOUT.describe())}")
    render(hit_listing(result.cold, "cold: empty L1, L2 and L3", trace), fmt, titled=True)
    render(hit_listing(result.warm, "warm: a restarted cache (empty L1, L2) on the same L3 store", trace), fmt,
           titled=True)
    columns = [Column("extra_key", Kind.USER), Column("salt fp"), Column("requests", Kind.INT),
               Column("cold hit %", Kind.PERCENT), Column("cold from L3", Kind.INT),
               Column("warm hit %", Kind.PERCENT), Column("warm from L3", Kind.INT),
               Column("warm prefill saved %", Kind.PERCENT)]
    rows = [[t.namespace.extra_key, t.namespace.salt_fingerprint, t.requests,
             _pct(t.cold_hit_tokens, t.cold_tokens), t.cold_storage_tokens, _pct(t.warm_hit_tokens, t.warm_tokens),
             t.warm_storage_tokens, _pct(t.warm_storage_tokens, t.warm_tokens)] for t in result.tenants]
    render(Listing("what L3 saved each tenant (prefill tokens served from the store; each run's % over its own "
                   "tokens)", columns, rows), fmt, titled=True)
    for name, r in (("cold", result.cold), ("warm", result.warm)):
        say(f"{name}: {r.requests} done + {r.refused} refused = {r.requests + r.refused} requests; "
            f"{r.seconds:.2f} s, {r.requests_per_s:,.0f} req/s; verify {r.verified_tokens} cached tokens: "
            f"{r.verify_mismatches} mismatches; audit {'ok' if r.audit.ok else 'FAILED'}; "
            f"{r.prefetch.fetched_pages} pages prefetched from L3")
    say(f"store: {result.store_pages} pages, {human_bytes(result.store_bytes)}; integrity audit "
        f"{'ok' if result.store_ok else 'FAILED'} -> {'all checks passed' if result.ok else 'CHECKS FAILED'}")
