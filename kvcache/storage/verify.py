"""The L3 integrity audit and its repair, written once for every backend (`L3Store.verify`): `verify` runs it.

A backend implements `IntegritySource` (`verify_source`): it reads its records (pages with their metadata, the
children index, the namespace registry, the layouts) the way its storage allows, and removes records under a
recheck when asked (`RepairOps`). Everything else is shared, one module per part:

- `verify_source`: the contract with a backend, and `Findings`, what an audit found and what a repair may do
  about each finding;
- `verify_checks`: the checks, what counts as a finding of each VERIFY_KINDS kind and which findings make a page
  removable (`check_page` for every stored page value, `check_snapshot` for the prefix trees, the children index
  and the counters of one snapshot);
- `verify_repair`: what a repair does per kind (api.REPAIRS): removals depth first, in bounded batches, each
  rechecked by the backend;
- `verify_parts`: the audit over key ranges (parallel workers, incremental audits) for a backend that reads them;
- here: the audit itself, serial and whole or in parts, and its record in the store (`verify_parts.AuditLog`).
"""

from __future__ import annotations

import msgspec

from ..errors import InvalidInput
from ..types.layout import KVLayout
from .api import VerifyReport
from .chain import ChainRoots
from .codec import HEADER
from .verify_checks import EngineHashes, check_page, check_snapshot, hash_mismatch, life
from .verify_parts import (
    NOT_CHECKED,
    AuditLog,
    AuditScope,
    PartContext,
    PartedSource,
    run_parts,
    structure_proven,
)
from .verify_repair import repair as apply_repairs
from .verify_source import (
    Findings,
    Guard,
    IntegritySource,
    OwnChecks,
)

UNRECORDED = ("structure_corrupt", "key_mismatch")  # findings after which an audit writes nothing to the store


def verify(source: IntegritySource, repair: bool = False, scope: AuditScope | None = None) -> VerifyReport:
    """Audit the store behind `source` (and with `repair`, apply api.REPAIRS): the body of `L3Store.verify`.
    The caller checks that the store is writable before a repair.

    `scope`: with more than one worker, or a `since`, a source that reads key ranges (`verify_parts.PartedSource`)
    is read by forked children, or only its pages changed since then; any other source, and any repair, is
    audited serially and whole. A source that records its audits (`verify_parts.AuditLog`) records this one."""
    scope = scope or AuditScope()
    log = source if isinstance(source, AuditLog) else None
    since = scope.since
    if scope.since_last:
        since = log.last_clean() if log is not None else None
    if repair and since is not None:
        raise InvalidInput("a repair needs a full audit (it removes what the whole store's checks find)")
    started = log.begin_audit() if log is not None else None
    parted = source if isinstance(source, PartedSource) and not repair and (
        since is not None or scope.workers > 1) else None
    report = _audit(source, repair, parted, since, scope.workers)
    if log is not None and started is not None and not any(f.kind in UNRECORDED for f in report.findings):
        # never a write into a store whose own structure is damaged (the write's copies would spread it), nor
        # under a key that is not the store's
        report = msgspec.structs.replace(report, recorded=log.record_audit(started, report))
    return report


def _audit(source: IntegritySource, repair: bool, parted: PartedSource | None, since: float | None,
           workers: int) -> VerifyReport:
    found = Findings()
    layouts: dict[bytes, KVLayout] = {}
    for key, record in source.layout_records().items():
        if record is None:
            found.damaged_record("layouts", key)
        else:
            layouts[key] = record.layout
    if since is None and isinstance(source, OwnChecks):
        source.own_checks(found)
    times = life(getattr(source, "store_created", 0.0))  # a backend that knows when its store was created says so
    if parted is not None:
        return _audit_parts(source, parted, found, layouts, since, workers, times)
    checked = checked_bytes = 0
    engine = EngineHashes(source.chain_key)
    for page in source.scan_pages(found):
        checked += 1
        checked_bytes += max(len(page.value) - HEADER, 0)
        check_page(found, page, layouts, source.checksum, engine, times)
    snap = source.snapshot(found)
    kids = check_snapshot(found, snap, layouts, source.chain_key, engine)
    if not repair:
        return VerifyReport(not found.items, checked, checked_bytes, found.items)
    removals = apply_repairs(source, found, kids, snap.tree)
    items = [msgspec.structs.replace(f, repaired=True) if i in found.fixed else f for i, f in enumerate(found.items)]
    return VerifyReport(not items, checked, checked_bytes, items, len(found.fixed), removals)


def _audit_parts(source: IntegritySource, parted: PartedSource, found: Findings, layouts: dict[bytes, KVLayout],
                 since: float | None, workers: int, times: tuple[float, float]) -> VerifyReport:
    """The audit read in key ranges (`verify_parts`): the ranges' findings in key order, then, for a full audit,
    the structure checks unless the ranges proved them clean."""
    cat = parted.catalogue()
    registry = {k: r for k, r in cat.registry.items() if r is not None}
    roots = ChainRoots(source.chain_key, {(lay, ns) for lay in layouts for ns in registry}, registry)
    reports = run_parts(parted, PartContext(layouts, source.checksum, cat, roots, since, times), workers)
    engine = EngineHashes(source.chain_key)
    for r in reports:
        for f in r.findings:
            i = found.add(f.kind, f.page_hash, f.detail, Guard(f.guard) if f.guard is not None else False)
            if f.relink and f.page_hash is not None:
                found.relink.setdefault(f.page_hash, i)
        parted.missed_meta(r.missed_meta)
        engine.held += [(p.page_hash, p.meta) for p in r.held]  # in key order, as a serial scan holds them
    checked, checked_bytes = sum(r.pages for r in reports), sum(r.nbytes for r in reports)
    workers = max(1, min(workers, len(reports)))
    if since is not None:
        for h, meta in engine.settle(registry):
            hash_mismatch(found, h, meta)
        return VerifyReport(not found.items, checked, checked_bytes, found.items, scope="incremental", since=since,
                            not_checked=list(NOT_CHECKED), workers=workers)
    held = list(engine.held)  # judged with the registry: by the catalogue's here, by the snapshot's if it runs
    if not structure_proven(cat, reports) or engine.settle(registry):
        engine.held = held
        check_snapshot(found, source.snapshot(found), layouts, source.chain_key, engine)
    return VerifyReport(not found.items, checked, checked_bytes, found.items, workers=workers)
