"""`kvc demo`: a multi-tenant workload replayed cold, then warm after a restart, on the embedded L3 store."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Annotated

import msgspec
import typer
from rich.table import Table

from kvcache import KVLayout, NamespaceInfo
from kvcache.replay import ReplayReport, replay as run_replay
from kvcache.storage.base import open_store
from kvcache.workload import WorkloadSpec, generate

from .common import (EXIT_FOUND, DebugOpt, JsonOpt, UsageError, command, emit_json, human_bytes, offline_cache, out,
                     progress)
from .replay_cmd import hit_table

DEMO_LAYOUT = KVLayout("kvc-demo@r1", layers=2, kv_heads=2, head_dim=16, dtype="float16", page_size=16)


class TenantSavings(msgspec.Struct):
    """One tenant in the demo: what it hit cold and warm, and what L3 served after the restart."""

    namespace: NamespaceInfo
    tokens: int  # tokens of its requests (the same in both runs)
    cold_hit_tokens: int
    cold_storage_tokens: int  # served from L3 in the cold run: pages L2 had evicted
    warm_hit_tokens: int
    warm_storage_tokens: int  # served from L3 in the warm run: prefill the restart did not have to redo


class DemoOutput(msgspec.Struct):
    """`kvc demo --json`."""

    store: str
    requests: int
    tenants: list[TenantSavings]
    cold: ReplayReport
    warm: ReplayReport
    store_ok: bool  # the L3 integrity audit after both runs
    store_pages: int
    store_bytes: int
    ok: bool  # both replays verified with 0 mismatches, both audits and the store audit clean


@command
def demo(
    requests: Annotated[int, typer.Option(help="Requests in the generated workload.")] = 3000,
    tenants: Annotated[int, typer.Option(help="Tenants (namespaces), each with its own salt.")] = 4,
    device_tokens: Annotated[int, typer.Option("--device-tokens", help="L1 capacity in tokens.")] = 2048,
    host_tokens: Annotated[int, typer.Option("--host-tokens", help="L2 capacity in tokens.")] = 8192,
    store: Annotated[Path | None, typer.Option(
        "--store", help="Keep the demo's store here (a new directory). Default: a temporary one, removed.")]
    = None,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Generate a multi-tenant workload and replay it twice on an embedded LMDB store: cold (empty tiers), then
    warm (a restarted cache: empty L1 and L2, the store from the first run). Both replays verify every reused
    byte and end with an ownership audit; the table shows what L3 saved each tenant. Exit 1 if a check fails."""
    if requests < 1 or tenants < 1:
        raise UsageError("--requests and --tenants must be >= 1")
    if store is not None and store.exists():
        raise UsageError(f"{store}: already exists; the demo writes a new store (give a new path)")
    # a working set (tenants x 48 documents of 256 tokens) several times L2, so L3 serves the cold run too
    spec = WorkloadSpec(requests=requests, tenants=tenants, documents=48, document_tokens=256, seed=7)
    trace = generate(spec)
    root = Path(tempfile.mkdtemp(prefix="kvc-demo-")) if store is None else None
    location = str(store) if store is not None else str(root / "store")  # type: ignore[operator]
    try:
        with contextlib.closing(open_store(location, DEMO_LAYOUT, create=True, durability="data")) as handle:
            reports = []
            for run in ("cold", "warm"):
                cache = offline_cache(handle, DEMO_LAYOUT, device_tokens, host_tokens, prefetch_policy="timeout")
                with contextlib.closing(cache):
                    with progress(f"{run} replay", len(trace), not json) as advance:
                        reports.append(run_replay(cache, trace, verify=True, progress=advance))
            verify = handle.verify()
            stats = handle.stats()
    finally:
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
    cold, warm = reports
    cold_rows = {r.namespace: r for r in cold.namespaces}
    rows = [TenantSavings(w.namespace, w.tokens, cold_rows[w.namespace].hit_tokens.total,
                          cold_rows[w.namespace].hit_tokens.storage, w.hit_tokens.total, w.hit_tokens.storage)
            for w in warm.namespaces]
    ok = cold.ok and warm.ok and verify.ok
    result = DemoOutput(location if store is not None else "(temporary)", len(trace), rows, cold, warm, verify.ok,
                        stats.pages, stats.bytes, ok)
    if json:
        emit_json(result)
    else:
        _print(result, spec)
    if not ok:
        raise typer.Exit(EXIT_FOUND)


def _print(result: DemoOutput, spec: WorkloadSpec) -> None:
    out.print(f"kvc demo: {result.requests} requests from {len(result.tenants)} tenants (each its own namespace; "
              f"the first {spec.shared_prefix_tokens} token ids are the same in all of them), layout "
              f"{DEMO_LAYOUT.describe()}")
    out.print(hit_table(result.cold, "cold: empty L1, L2 and L3"))
    out.print(hit_table(result.warm, "warm: a restarted cache (empty L1, L2) on the same L3 store"))
    table = Table(title="what L3 saved each tenant (prefill tokens served from the store)", title_justify="left")
    for col in ("extra_key", "salt fp", "tokens", "cold hit %", "cold from L3", "warm hit %", "warm from L3",
                "warm prefill saved"):
        table.add_column(col, justify="left" if col in ("extra_key", "salt fp") else "right")
    for t in result.tenants:
        table.add_row(t.namespace.extra_key or "-", t.namespace.salt_fingerprint or "-", str(t.tokens),
                      f"{100 * t.cold_hit_tokens / t.tokens:.1f}", str(t.cold_storage_tokens),
                      f"{100 * t.warm_hit_tokens / t.tokens:.1f}", str(t.warm_storage_tokens),
                      f"{100 * t.warm_storage_tokens / t.tokens:.1f}%")
    out.print(table)
    for name, r in (("cold", result.cold), ("warm", result.warm)):
        out.print(f"{name}: {r.seconds:.2f} s, {r.requests_per_s:,.0f} req/s; verify {r.verified_tokens} cached "
                  f"tokens: {r.verify_mismatches} mismatches; audit {'ok' if r.audit.ok else 'FAILED'}; "
                  f"{r.prefetch.fetched_pages} pages prefetched from L3")
    out.print(f"store: {result.store_pages} pages, {human_bytes(result.store_bytes)}; integrity audit "
              f"{'ok' if result.store_ok else 'FAILED'} -> {'all checks passed' if result.ok else 'CHECKS FAILED'}")
