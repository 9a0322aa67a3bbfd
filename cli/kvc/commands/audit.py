"""`kvc audit`: the L3 integrity audit of a store, the ownership audit of a snapshot, or the ownership and
structure audit of a live cache — and the output says which ran.

Exit 0 when nothing was found; 1 whenever violations were found, whether --repair then fixed them or not (a
cron job must hear about a store that needed repairing); 4 when the store's key file is not the key its pages were
written under (restore the key: a repair refuses to remove anything for it); 2 when the audit could not run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec
import typer

from kvcache.errors import KeyFileError
from kvcache.storage.api import REPAIRS
from kvcache.storage.keyfile import KEY_FILE, KEY_MISMATCH
from kvcache.storage.verify_parts import AuditScope

from .. import live
from ..context import reads_lock_free, require_store
from ..errors import EXIT_FOUND, EXIT_OK, UsageError
from ..formats import note_old_format, recorded_version
from ..inputs import cpus, since_arg
from ..options import DEFAULT_STORE, DebugOpt, JsonOpt, NoHeadersOpt, OutputOpt, ReadOnlyOpt, SocketOpt, StoreOpt
from ..render.audit import AuditOutput, Finding, PlannedRepair, findings_of, render_audit
from ..render.output import Output, emit_listing, output_format
from ..render.progress import progress
from ..reporting import command


@command
def audit(
    store: StoreOpt = DEFAULT_STORE,
    snapshot: Annotated[Path | None, typer.Option(
        "--snapshot", help="Audit the ownership snapshot in this file (written by `kvc snapshot` or "
        "TieredCache.snapshot) instead of the store.")] = None,
    repair: Annotated[bool, typer.Option(
        "--repair", help="Remove what is provably corrupt or unreachable in the store, reporting each removal.")]
    = False,
    force: Annotated[bool, typer.Option(
        "--force", help="With --repair: replace a data file that is not LMDB, or one from which a rebuild would keep "
        "nothing, with an empty store (the file is still kept beside it as data.mdb.orig-<UTC time>). Without it "
        "such a repair is refused (exit 2) and nothing changes.")] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="With --repair: change nothing, print what --repair would do about each finding.")]
    = False,
    since: Annotated[str | None, typer.Option(
        "--since", help="Incremental audit: check only the pages written or read back since the start of the "
        "store's last clean audit ('last'; a full audit when none is recorded) or since a time (unix seconds, or "
        "ISO 8601 such as 2026-12-03T20:00:00+00:00). What needs the whole store (orphans, the children index, "
        "counters) is not checked, and the output says so. LMDB stores; any other is audited in full.")] = None,
    workers: Annotated[int | None, typer.Option(
        "--workers", min=1, max=cpus(), help="Processes reading the store's pages (default, and at most: the cores "
        "this process may use). "
        "Findings and their order do not depend on it; a repair itself runs in one.")] = None,
    socket: SocketOpt = None,
    read_only: ReadOnlyOpt = False,
    output: OutputOpt = None,
    no_headers: NoHeadersOpt = False,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Check a store's integrity (checksums, metadata, indexes, registry), or a snapshot's slot ownership, or
    with --socket the live cache's slot ownership and tree structure. The output names the audits that ran.

    Exit 0 when nothing was found, 1 when violations were found (repaired or not), 4 when the store's key file is
    not the key its pages were written under, 2 on bad usage or input.
    """
    if dry_run and not repair:
        raise UsageError("--dry-run goes with --repair")
    if force and not repair:
        raise UsageError("--force goes with --repair")
    if read_only and repair and not dry_run:
        raise UsageError("--read-only cannot go with --repair (a repair writes the store)")
    if since is not None and repair:
        raise UsageError("--since cannot go with --repair (a repair needs a full audit)")
    sock = live.socket_path(socket)
    if repair and (snapshot is not None or sock is not None):
        raise UsageError("--repair works on a store, not on a snapshot or a live cache")
    if (since is not None or workers is not None) and (snapshot is not None or sock is not None):
        raise UsageError("--since and --workers go with a store's audit, not a snapshot's or a live cache's")
    if snapshot is not None:
        result = _snapshot_audit(snapshot)
    elif sock is not None:
        result = live.audit(sock)
    else:
        scope = AuditScope(workers or cpus(), *since_arg(since))
        result = _store_audit(store, repair, dry_run, force, read_only, scope, output_format(output, json))
    fmt = output_format(output, json)
    lost = next((f for f in result.violations if f.kind == "key_file"), None)
    if lost is not None and fmt not in (Output.JSON, Output.JSONL):
        # the key file is part of the store: without it no command runs, and this one says so the same way (with
        # --json it is a finding among the others)
        path, _, why = lost.detail.partition(f"{KEY_FILE}: ")
        raise KeyFileError(path + KEY_FILE, why)
    emit_listing(fmt, result, result.violations, lambda: render_audit(result, fmt, output is Output.TSV, no_headers))
    raise typer.Exit(exit_code(result))


EXIT_KEY_MISMATCH = 4  # the store's key file is not the key its pages were written under (docs/cli.md)


def exit_code(result: AuditOutput) -> int:
    """0 when nothing was found; EXIT_KEY_MISMATCH when the key file is not the pages' key and nothing was repaired
    (a runbook must tell "restore the key" from "the store needs a repair"); else 1."""
    if result.ok:
        return EXIT_OK
    if result.repair != "done" and any(f.kind == KEY_MISMATCH for f in result.violations):
        return EXIT_KEY_MISMATCH
    return EXIT_FOUND


def _snapshot_audit(path: Path) -> AuditOutput:
    from kvcache.diagnostics.audit import audit_snapshot
    from kvcache.diagnostics.snapshot import read_snapshot

    report = audit_snapshot(read_snapshot(path))
    return AuditOutput("snapshot", str(path), ["ownership"], report.ok, findings_of(report.violations),
                       msgspec.structs.asdict(report.checked))


def _store_audit(location, repair: bool, dry_run: bool, force: bool, read_only: bool, scope: AuditScope,
                 fmt: Output) -> AuditOutput:
    from kvcache.diagnostics.audit import audit_store

    require_store(location)
    # audit_store survives a damaged store (LMDB: its walks run in child processes; see kvcache.diagnostics.audit)
    fix = repair and not dry_run
    lock = not reads_lock_free(location, read_only)  # a lock-free audit is said on stderr
    # the bar counts the pages read (a terminal only; KVC_PROGRESS_FD lines either way)
    with progress("audit pages", None, enabled=fmt is Output.TABLE) as advance:
        report = audit_store(location.url, repair=fix, force=force, lock=lock, scope=scope,
                             progress=lambda what, n: advance(n) if what == "pages" else None)
    version = recorded_version(location)
    if version is not None:
        note_old_format(location, version)
    after = audit_store(location.url, scope=AuditScope(scope.workers)) if fix and not report.ok else None
    checked = {"pages": report.pages_checked, "bytes": report.bytes_checked}
    found = [Finding(f.kind, location.redact(f.detail), page_hash=f.page_hash) for f in report.findings]
    result = AuditOutput("store", str(location), ["l3_integrity"], report.ok, found, checked, scope=report.scope,
                         since=report.since, not_checked=report.not_checked, workers=report.workers,
                         recorded=report.recorded)
    if dry_run:
        result.repair = "dry_run"
        result.planned = [PlannedRepair(f.kind, f.page_hash, REPAIRS.get(f.kind)
                                        or "reported only") for f in found]
    elif repair:
        result.repair = "done"
        result.repaired = report.repaired
        result.removals = report.removals
        result.original_kept = location.redact(report.original_kept) if report.original_kept else None
        result.salvage = report.salvage
        result.remaining = [Finding(f.kind, location.redact(f.detail), page_hash=f.page_hash)
                            for f in (after.findings if after is not None else [])]
    return result


