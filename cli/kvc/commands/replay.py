"""`kvc replay`: run a JSONL trace through a cache on the store; `kvc generate`: write a synthetic trace."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import msgspec
import typer

from kvcache.types.config import HostMode, PrefetchPolicy, WritePolicy
from kvcache.types.explain import Explanation
from kvcache.workload.traces import TraceRequest, WorkloadSpec, read_trace

from .. import live
from ..context import offline_cache, open_for_cache
from ..errors import EXIT_FOUND, UsageError
from ..options import (
    DEFAULT_STORE,
    DebugOpt,
    DeviceOpt,
    HostOpt,
    JsonOpt,
    ModeOpt,
    PrefetchPolicyOpt,
    SocketOpt,
    StoreOpt,
    WritePolicyOpt,
)
from ..outputs import ForceOpt, OutputTarget, is_stdout, output_target, write_file, writing
from ..render.output import emit_json, say
from ..render.progress import progress
from ..render.replay import print_report
from ..render.text import esc, escape_controls, human_bytes
from ..reporting import at_steps, command

if TYPE_CHECKING:
    from kvcache.types.reports import ReplayReport

VerifyOpt = Annotated[bool, typer.Option(
    "--verify", help="Compare every cached token handed to a request with the KV its page hash prescribes; "
    "exit 1 on any mismatch.")]
BatchOpt = Annotated[int, typer.Option("--batch", min=1, max=65536,
                                        help="Requests admitted together per scheduler step.")]


@command
def replay(
    trace: Annotated[Path, typer.Argument(help="JSONL trace, one request per line (docs/trace-format.md).",
                                          show_default=False)],
    store: StoreOpt = DEFAULT_STORE,
    verify: VerifyOpt = False,
    snapshot_out: Annotated[Path | None, typer.Option(
        "--snapshot-out", help="After the replay, write the cache's ownership snapshot here "
        "(check it with `kvc audit --snapshot`), atomically. The name is checked before the replay starts: a "
        "symbolic link, FIFO or device there is refused unless --force.")] = None,
    requests_out: Annotated[Path | None, typer.Option(
        "--requests-out", show_default=False,
        help="Write one JSON line per request here (admitted or refused, in order): its tokens, the tokens each "
        "tier served, how far each tier matched and why its first missing page was missing, and how its "
        "prefetch ended — the object `kvc explain --json` prints. Written atomically when the replay ends; the "
        "name is checked before it starts (--force as for --snapshot-out). Costs one explanation per request.")]
    = None,
    force: ForceOpt = False,
    device_tokens: DeviceOpt = 16384,
    host_tokens: HostOpt = 65536,
    prefetch_policy: PrefetchPolicyOpt = PrefetchPolicy.TIMEOUT,
    write_policy: WritePolicyOpt = WritePolicy.WRITE_THROUGH,
    mode: ModeOpt = HostMode.CACHE,
    batch: BatchOpt = 4,
    socket: SocketOpt = None,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Replay a workload through the whole core — match, L3 prefetch, admit, forward (synthetic KV), commit,
    backup, eviction, load-back — on a cache embedded on the store. Committed pages are written to the store
    (flushed before exit), so a later replay in a new process hits L3. Exit 1 when --verify finds a mismatch,
    the final ownership audit fails, the trace holds no request, or no L3 write succeeded (every one failed or
    was refused: nothing was backed up); a read-only store is refused before the replay starts (exit 2). With
    --socket, the live cache runs the trace with its own sizes and policies (the tier and policy options are then
    not used)."""
    snapshot_target = output_target(snapshot_out, "--snapshot-out", force) if snapshot_out is not None else None
    lines_target = output_target(requests_out, "--requests-out", force) if requests_out is not None else None
    requests = read_trace(trace)  # validated whole before anything runs: a bad line changes nothing
    if (sock := live.socket_path(socket)) is not None:
        report, lines = live.replay(sock, trace, verify, batch, snapshot_target, lines_target is not None)
        if lines_target is not None:
            _write_lines(lines_target, lines)
        _finish(report, requests, f"{trace} on the live cache at {sock}", json)
        return
    from kvcache.workload.replay import replay as run_replay

    with contextlib.closing(open_for_cache(store)) as handle:
        if handle.readonly:
            raise UsageError(f"{store}: the store is read-only here; a replay writes its committed pages to it")
        cache = offline_cache(handle, handle.layout, device_tokens, host_tokens, prefetch_policy=prefetch_policy,
                              write_policy=write_policy, host_mode=mode)
        with at_steps(), contextlib.closing(cache):  # a Ctrl-C lands between the cache's steps
            explained: list[Explanation] = []
            with progress("replay", len(requests), not json) as advance:
                report = run_replay(cache, requests, verify=verify, batch=batch, progress=advance,
                                    on_explained=explained.append if lines_target is not None else None)
            if lines_target is not None:
                _write_lines(lines_target, explained)
            if snapshot_target is not None:
                from kvcache.diagnostics.snapshot import encode_snapshot

                write_file(snapshot_target, encode_snapshot(cache.snapshot()))
    _finish(report, requests, str(trace), json)


def _write_lines(target: OutputTarget, lines: list[Explanation]) -> None:
    """--requests-out: one JSON object a line (the `Explanation` of each request), written atomically."""
    encode = msgspec.json.Encoder().encode
    with writing(target) as f:
        for line in lines:
            f.write(encode(line) + b"\n")


def _finish(report: "ReplayReport", requests: list[TraceRequest], title: str, json: bool) -> None:
    """Print a replay's report; exit 1 when it found problems, when the trace held no request (nothing was
    replayed: a script must not go on as if it had been), or when it wrote pages to L3 and none of them made it (a
    store that refuses writes: the next process would find nothing)."""
    if json:
        emit_json(report)
    else:
        print_report(report, title, requests)
    if not requests:
        sys.stderr.write(f"kvc: error: {escape_controls(title)}: the trace holds no request; nothing was replayed\n")
        raise typer.Exit(EXIT_FOUND)
    b = report.backup
    lost = b.storage_failed or b.storage_rejected
    if lost:
        # failed (the store could not be written: gone, timed out) and refused (capacity, a quota, a share) call for
        # different things, so they are never summed into one word
        said = [f"{b.storage_failed} L3 writes failed (the store could not be written)"] if b.storage_failed else []
        if b.storage_rejected:
            said.append(f"{b.storage_rejected} pages were refused by the store (capacity, a quota or a share)")
        none = ", and no L3 write succeeded" if not b.storage_pages else ""
        sys.stderr.write(f"kvc: warning: {'; '.join(said)}{none}: those pages stayed in L2 only\n")
    if not report.ok or (lost and not b.storage_pages):
        raise typer.Exit(EXIT_FOUND)


MAX_GENERATOR_BYTES = 4 << 30  # what `generate` may hold whatever --requests is: 100k tenants of the defaults fit


class GenerateOutput(msgspec.Struct):
    """`kvc generate --json`."""

    path: str
    requests: int
    tokens: int
    spec: WorkloadSpec


@command
def generate(
    out_path: Annotated[Path, typer.Argument(
        metavar="OUT", help="Where to write the JSONL trace (atomically; a symbolic link, FIFO or device there is "
        "refused unless --force).", show_default=False)],
    requests: Annotated[int, typer.Option(min=1, max=10_000_000, help="Requests in the trace.")] = 1000,
    tenants: Annotated[int, typer.Option(min=1, max=100_000,
                                         help="Tenants (namespaces: extra_key tenant-<i>).")] = 4,
    salted: Annotated[bool, typer.Option(help="Give every tenant a cache_salt.")] = True,
    documents: Annotated[int, typer.Option(min=1, max=100_000,
                                           help="Documents per tenant (Zipf popularity).")] = 6,
    continue_prob: Annotated[float, typer.Option(min=0.0, max=1.0,
                                                 help="Chance a request continues an open conversation.")] = 0.5,
    seed: Annotated[int, typer.Option(min=0, max=2**63 - 1,
                                      help="Random seed: the same seed gives the same trace.")] = 0,
    force: ForceOpt = False,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Write a synthetic multi-tenant trace: per-tenant system prompts and documents, a prefix with the same
    token ids in every tenant, Zipf-like popularity, multi-turn conversations. Requests are written as they are
    made (memory does not grow with --requests), and the file appears whole (written beside it, then renamed)."""
    from kvcache.workload.traces import dump_trace, iter_generate

    target = output_target(out_path, "OUT", force)
    spec = WorkloadSpec(requests=requests, tenants=tenants, salted=salted, documents=documents,
                        continue_prob=continue_prob, seed=seed)
    if spec.held_bytes() > MAX_GENERATOR_BYTES:  # the requests stream; the tenants' documents are held
        raise UsageError(f"--tenants {tenants} x --documents {documents}: the generator would hold "
                         f"{human_bytes(spec.held_bytes())} of prompts, documents and conversations (at most "
                         f"{human_bytes(MAX_GENERATOR_BYTES)}); ask for fewer tenants or documents")
    with writing(target) as f:
        count = dump_trace(f, iter_generate(spec))
    result = GenerateOutput(str(out_path), count.requests, count.tokens, spec)
    if is_stdout(target):  # the trace went to stdout: the summary must not land in it
        sys.stderr.write(msgspec.json.encode(result).decode() + "\n" if json else
                         f"{out_path}: {result.requests} requests, {result.tokens} tokens, {tenants} tenants\n")
    elif json:
        emit_json(result)
    else:
        say(f"{esc(str(out_path))}: {result.requests} requests, {result.tokens} tokens, {tenants} tenants")
