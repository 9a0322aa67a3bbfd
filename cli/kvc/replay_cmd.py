"""`kvc replay`: run a JSONL trace through a cache on the store; `kvc generate`: write a synthetic trace."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated

import msgspec
import typer
from rich.table import Table

from kvcache import HostMode, PrefetchPolicy, WritePolicy
from kvcache.replay import ReplayReport, replay as run_replay
from kvcache.workload import WorkloadSpec, generate as generate_trace, read_trace, write_trace

from . import live
from .common import (DEFAULT_STORE, EXIT_FOUND, DebugOpt, JsonOpt, StoreOpt, UsageError, command, emit_json,
                     human_bytes, offline_cache, open_for_cache, out, progress)

DeviceOpt = Annotated[int, typer.Option("--device-tokens", help="L1 (device pool) capacity in tokens.")]
HostOpt = Annotated[int, typer.Option("--host-tokens", help="L2 (host pool) capacity in tokens; 0: no L2.")]
PrefetchPolicyOpt = Annotated[PrefetchPolicy, typer.Option(
    "--prefetch-policy", case_sensitive=False,
    help="What admission takes of a request's L3 prefetch: best_effort (what has arrived), wait_complete "
    "(everything the store holds), timeout (what arrives within the prefetch timeout).")]
WritePolicyOpt = Annotated[WritePolicy, typer.Option(
    "--write-policy", case_sensitive=False,
    help="When committed pages are backed up to L2 and L3: write_through (at commit), write_through_selective "
    "(at commit, once a page has been hit twice), write_back (when evicted from the device).")]
ModeOpt = Annotated[HostMode, typer.Option(
    "--mode", case_sensitive=False,
    help="Where prefetched pages wait for their request: cache (host-only tree nodes, shared) or buffer "
    "(a staged record of that request, spliced at its admission).")]
VerifyOpt = Annotated[bool, typer.Option(
    "--verify", help="Compare every cached token handed to a request with the KV its page hash prescribes; "
    "exit 1 on any mismatch.")]
BatchOpt = Annotated[int, typer.Option("--batch", help="Requests admitted together per scheduler step.")]


def replay_options_ok(device_tokens: int, host_tokens: int, batch: int) -> None:
    """Bad sizes are usage errors (exit 2), before anything runs."""
    if device_tokens < 1 or host_tokens < 0 or batch < 1:
        raise UsageError(f"--device-tokens {device_tokens}, --host-tokens {host_tokens}, --batch {batch}: "
                         f"need device >= 1 page, host >= 0, batch >= 1")


@command
def replay(
    trace: Annotated[Path, typer.Argument(help="JSONL trace, one request per line (DESIGN §8).",
                                          show_default=False)],
    store: StoreOpt = DEFAULT_STORE,
    verify: VerifyOpt = False,
    snapshot_out: Annotated[Path | None, typer.Option(
        "--snapshot-out", help="After the replay, write the cache's ownership snapshot here "
        "(check it with `kvc audit --snapshot`).")] = None,
    device_tokens: DeviceOpt = 16384,
    host_tokens: HostOpt = 65536,
    prefetch_policy: PrefetchPolicyOpt = PrefetchPolicy.TIMEOUT,
    write_policy: WritePolicyOpt = WritePolicy.WRITE_THROUGH,
    mode: ModeOpt = HostMode.CACHE,
    batch: BatchOpt = 4,
    socket: live.SocketOpt = None,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Replay a workload through the whole core — match, L3 prefetch, admit, forward (synthetic KV), commit,
    backup, eviction, load-back — on a cache embedded on the store. Committed pages are written to the store
    (flushed before exit), so a later replay in a new process hits L3. Exit 1 when --verify finds a mismatch or
    the final ownership audit fails. With --socket, the live cache runs the trace with its own sizes and
    policies (the tier and policy options are then not used)."""
    replay_options_ok(device_tokens, host_tokens, batch)
    if (sock := live.socket_path(socket)) is not None:
        report = live.replay(sock, trace, verify, batch, snapshot_out)
        if json:
            emit_json(report)
        else:
            print_report(report, f"{trace} on the live cache at {sock}")
        if not report.ok:
            raise typer.Exit(EXIT_FOUND)
        return
    requests = read_trace(trace)  # validated whole before anything runs: a bad line changes nothing
    with contextlib.closing(open_for_cache(store)) as handle:
        cache = offline_cache(handle, handle.layout, device_tokens, host_tokens, prefetch_policy=prefetch_policy,
                              write_policy=write_policy, host_mode=mode)
        with contextlib.closing(cache):
            with progress("replay", len(requests), not json) as advance:
                report = run_replay(cache, requests, verify=verify, batch=batch, progress=advance)
            if snapshot_out is not None:
                cache.snapshot(str(snapshot_out))
    if json:
        emit_json(report)
    else:
        print_report(report, str(trace))
    if not report.ok:
        raise typer.Exit(EXIT_FOUND)


def hit_table(report: ReplayReport, title: str) -> Table:
    """Per namespace × tier hit tokens."""
    table = Table(title=title, title_justify="left")
    for col in ("extra_key", "salt fp", "requests", "tokens", "L1 hit", "L2 hit", "L3 hit", "hit %"):
        table.add_column(col, justify="left" if col in ("extra_key", "salt fp") else "right")
    for row in report.namespaces:
        h = row.hit_tokens
        table.add_row(row.namespace.extra_key or "-", row.namespace.salt_fingerprint or "-", str(row.requests),
                      str(row.tokens), str(h.device), str(h.host), str(h.storage),
                      f"{100 * h.total / row.tokens:.1f}" if row.tokens else "-")
    h = report.hit_tokens
    table.add_row("total", "", str(report.requests), str(report.tokens), str(h.device), str(h.host),
                  str(h.storage), f"{100 * h.total / report.tokens:.1f}" if report.tokens else "-", style="bold")
    return table


def print_report(report: ReplayReport, title: str) -> None:
    """The human form of a replay report."""
    out.print(hit_table(report, f"replay {title}"))
    p = report.prefetch
    declined = ", ".join(f"{k} {v}" for k, v in sorted(p.declined.items())) or "none"
    dropped = ", ".join(f"{k} {v}" for k, v in sorted(p.dropped.items())) or "none"
    cancelled = ", ".join(f"{k} {v}" for k, v in sorted(p.cancelled.items())) or "none"
    out.print(f"prefetch: {p.issued} issued of {p.attempts} ({report.prefetches_reissued} issued again); declined: "
              f"{declined}; {p.hit_pages} pages hit in L3, {p.fetched_pages} fetched ({human_bytes(p.fetched_bytes)}), "
              f"{p.used_pages} used; dropped: {dropped}; cancelled: {cancelled}; {p.read_errors} read errors; "
              f"{report.namespace_mismatches} namespace mismatches")
    b = report.backup
    out.print(f"backup: {b.host_pages} pages L1 -> L2, {b.storage_pages} pages L2 -> L3 "
              f"({human_bytes(b.storage_bytes)}), {b.storage_failed} failed, {b.storage_rejected} rejected")
    if report.verify:
        verdict = "ok" if not report.verify_mismatches else f"{report.verify_mismatches} pages DIFFER"
        out.print(f"verify: {report.verified_tokens} cached tokens compared byte for byte: {verdict}")
        for m in report.mismatches[:5]:
            out.print(f"  {m.rid} page {m.page} ({m.namespace.extra_key}, salt fp {m.namespace.salt_fingerprint})")
    audit = "ok" if report.audit.ok else f"{len(report.audit.violations)} violations ({report.audit.violations[0]})"
    out.print(f"audit: {audit}")
    refused = f"{report.refused} refused: larger than the device pool"
    if report.blocked:
        refused += f"; {report.blocked} blocked by the engine's own requests"
    out.print(f"{report.requests} requests ({refused}), {report.tokens} tokens in "
              f"{report.seconds:.2f} s: {report.requests_per_s:,.0f} req/s, {report.tokens_per_s:,.0f} tokens/s")


class GenerateOutput(msgspec.Struct):
    """`kvc generate --json`."""

    path: str
    requests: int
    tokens: int
    spec: WorkloadSpec


@command
def generate(
    out_path: Annotated[Path, typer.Argument(metavar="OUT", help="Where to write the JSONL trace.",
                                             show_default=False)],
    requests: Annotated[int, typer.Option(help="Requests in the trace.")] = 1000,
    tenants: Annotated[int, typer.Option(help="Tenants (namespaces: extra_key tenant-<i>).")] = 4,
    salted: Annotated[bool, typer.Option(help="Give every tenant a cache_salt.")] = True,
    documents: Annotated[int, typer.Option(help="Documents per tenant (Zipf popularity).")] = 6,
    continue_prob: Annotated[float, typer.Option(help="Chance a request continues an open conversation.")] = 0.5,
    seed: Annotated[int, typer.Option(help="Random seed: the same seed gives the same trace.")] = 0,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Write a synthetic multi-tenant trace: per-tenant system prompts and documents, a prefix with the same
    token ids in every tenant, Zipf-like popularity, multi-turn conversations."""
    spec = WorkloadSpec(requests=requests, tenants=tenants, salted=salted, documents=documents,
                        continue_prob=continue_prob, seed=seed)
    trace = generate_trace(spec)
    write_trace(out_path, trace)
    result = GenerateOutput(str(out_path), len(trace), sum(len(r.tokens) for r in trace), spec)
    if json:
        emit_json(result)
    else:
        out.print(f"{out_path}: {result.requests} requests, {result.tokens} tokens, {tenants} tenants")
