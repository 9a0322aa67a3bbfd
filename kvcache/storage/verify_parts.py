"""The integrity audit over key ranges: every core reads pages (`AuditScope.workers`), and an incremental audit
reads only the pages changed since a time (`AuditScope.since`). The shared audit (`kvcache.storage.verify`) runs
this for a backend that can read a key range on its own (`PartedSource`: LMDB); any other is audited serially.

Workers. The page keys are split into one range per worker (`PartedSource.key_ranges`: page hashes are uniform,
so the ranges are even), each read by a forked child (`isolated.run_isolated_all`) with its own read-only handle
and short read transactions, exactly as the serial scan reads (`check_page` per page). Each child sends back the
findings of its range as it recorded them (`Replay`); the parent adds them range after range, so the findings
and their order are those of a serial audit (pages are scanned in key order either way).

The structure checks (the prefix trees, the children index, the counters) need the whole store on one snapshot.
The children check them from their side on the fly: each scanned page's parent is looked up in the same read
transaction (a stored parent of the same namespace and layout, or its namespace root under `ChainRoots`), every
metadata key of the range must belong to a scanned page, the pages are summed per namespace; the parent then sets
the sums against the registry, the totals and the catalogue counts it reads in one transaction of its own
(`Catalogue`). That proves the store clean only when every read of every child and the parent's were of one
snapshot (one transaction id: no writer committed during the audit) and nothing at all was found. Otherwise the
serial structure pass runs (`IntegritySource.snapshot`, `check_snapshot`): the findings are then exactly a
serial audit's, whatever the damage.

Incremental. `since` (unix seconds): only the pages whose metadata says they were written, or read back, at or
after it are checked (`PageMeta.created`, `last_access`: one walk of the metadata, no payload read) with every
check of a page (`check_page`; a changed page without bytes is `missing_page`). What needs the whole store is not
checked and the report lists it (`NOT_CHECKED`). Removals (repair, quarantine, delete) leave nothing to check of
the pages they removed; what they change of the trees, the index and the counters is what a full audit checks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec

from ..types.layout import KVLayout
from .api import NamespaceRecord, PageMeta, VerifyFinding
from .chain import ChainRoots
from .codec import Checksum

# What an incremental audit leaves unchecked, by the key VerifyReport.not_checked lists.
NOT_CHECKED: dict[str, str] = {
    "unchanged_pages": "pages not written or read back since the time given (a full audit checks every page)",
    "tree": "orphans and namespace or layout mismatches between a page and its parent",
    "children_index": "children index entries that name no page filed under that parent",
    "counters": "registry counters and store totals against the pages stored",
    "headless_pages": "page bytes stored without metadata",
    "catalogue": "sub-database walks against the counts their catalogue keeps",
    "page_map": "the store's own page map: each page's recorded number and kind against its place, the free list "
                "against the trees, the key file against the roots the registry recorded",
}


class AuditScope(msgspec.Struct, frozen=True):
    """What one audit reads, and with how many processes."""

    workers: int = 1  # processes reading pages (1: one pass in the auditing process)
    since: float | None = None  # unix seconds: check only the pages changed since then; None: a full audit
    since_last: bool = False  # since the start of the store's last clean audit (a full audit when none is recorded)


class KeyRange(msgspec.Struct, frozen=True, array_like=True):
    """The page keys from `lo` (inclusive) up to `hi` (exclusive); None: from the first, to the last."""

    lo: bytes | None
    hi: bytes | None


class Replay(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One finding as a child recorded it, added again in the parent (`Findings.add`) in the same order."""

    kind: str
    page_hash: bytes | None
    detail: str
    guard: str | None  # the Guard value under which it made its page removable; None: it did not
    relink: bool  # it is the page's missing_index finding (repair lists it again)


class NsSum(msgspec.Struct, frozen=True, array_like=True):
    """Pages stored (bytes and metadata) of one namespace in one range, their payload bytes and their hits."""

    ns_id: bytes
    pages: int
    nbytes: int
    hits: int = 0


class HeldPage(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """An engine page a child could not judge without the chain key (`verify_checks.EngineHashes.held`): the parent
    judges it with the registry."""

    page_hash: bytes
    meta: PageMeta


class PartReport(msgspec.Struct, array_like=True):
    """What a child read of its key range."""

    findings: list[Replay]
    missed_meta: list[bytes]  # scanned pages whose metadata a lookup did not find (the serial snapshot's check)
    pages: int  # page values checked
    nbytes: int  # their payload bytes
    txnids: list[int]  # the transaction ids its reads saw (one: no writer committed while it read)
    meta_keys: int = 0  # full: metadata records in the range
    sums: list[NsSum] = []  # full: pages per namespace
    unsure: str = ""  # full: why the range's structure is not proven clean ("": it is)
    changed: int = 0  # incremental: metadata records found changed
    held: list[HeldPage] = []  # engine pages held for the registry (no chain key), in key order


class PartProgress(msgspec.Struct, frozen=True, array_like=True):
    """How far a child got: pages (or, incremental, metadata records) read, the last key."""

    records: int
    last_key: bytes


class Catalogue(msgspec.Struct):
    """What the parent reads in one transaction before the children start: the registry, the totals and the
    record counts of the sub-databases, and the transaction's id."""

    txnid: int
    registry: dict[bytes, NamespaceRecord | None]  # namespace id -> record (None: does not decode)
    totals: tuple[int, int] | None  # (pages, payload bytes); (-1, -1): does not decode; None: none kept
    entries: dict[str, int]  # sub-database -> records its catalogue counts ("pages", "meta", "children")


class PartContext:
    """What every child checks against (inherited through the fork, never sent)."""

    __slots__ = ("layouts", "checksum", "registry", "roots", "since", "txnid", "recorded", "times", "records")

    def __init__(self, layouts: dict[bytes, KVLayout], checksum: Checksum, cat: Catalogue, roots: ChainRoots,
                 since: float | None, times: tuple[float, float] = (0.0, 0.0)) -> None:
        self.layouts, self.checksum, self.roots, self.since = layouts, checksum, roots, since
        self.times = times  # the store's life: what a page's created and last_access may be (verify_checks.implausible)
        self.registry = {k: r for k, r in cat.registry.items() if r is not None}  # the records that decode
        self.recorded = frozenset(cat.registry)  # every namespace id recorded, as of transaction `txnid`
        self.records = dict(cat.registry)  # ... with its record (None: it does not decode)
        self.txnid = cat.txnid


@runtime_checkable
class PartedSource(Protocol):
    """An `IntegritySource` that can read key ranges in forked children."""

    def key_ranges(self, n: int) -> list[KeyRange]:
        """`n` ranges covering every key, in key order."""

    def catalogue(self) -> Catalogue:
        """The registry, totals and catalogue counts, read in one transaction."""

    def scan_part(self, part: KeyRange, ctx: PartContext, report: Callable[[PartProgress], None]) -> PartReport:
        """In a child (or, with one worker, in this process): check the pages of `part` (all, or those changed
        since `ctx.since`), reporting progress as it goes."""

    def missed_meta(self, hashes: Sequence[bytes]) -> None:
        """Note the scanned pages whose metadata a lookup did not find (for `snapshot`'s structure checks)."""

    def parts_progress(self, records: int, last_key: bytes | None) -> None:
        """Pass the children's progress on (records read by all of them, the last key one of them reported)."""

    def part_failed(self, part: KeyRange, died: Any) -> None:
        """Raise what a child's death (an `isolated.Died`) means for the audit."""


@runtime_checkable
class AuditLog(Protocol):
    """A source that records its audits (`AuditHistory`) and can say when the last clean one began."""

    def begin_audit(self) -> float | None:
        """The audit's start, taken in a write transaction (every page written later carries a later stamp);
        None: this audit cannot be recorded (read-only, lock-free)."""

    def last_clean(self) -> float | None:
        """When the store's last clean audit began (None: none recorded)."""

    def record_audit(self, started: float, report: Any) -> bool:
        """Record the audit that began at `started` with `report`; whether it was recorded."""


def replays(items: list[VerifyFinding], by_hex: dict[str, bytes], remove: dict[bytes, tuple[int, Any]],
            relink: dict[bytes, int]) -> list[Replay]:
    """A child's findings (a `verify_source.Findings`'s items and maps) as `Replay`s."""
    out = []
    for i, f in enumerate(items):
        h = by_hex.get(f.page_hash) if f.page_hash is not None else None
        removal = remove.get(h) if h is not None else None
        guard = removal[1].value if removal is not None and removal[0] == i else None
        out.append(Replay(f.kind, h, f.detail, guard, h is not None and relink.get(h) == i))
    return out


def run_parts(source: PartedSource, ctx: PartContext, workers: int) -> list[PartReport]:
    """Every key range read: in `workers` forked children, or here when one."""
    from .isolated import run_isolated_all

    parts = source.key_ranges(max(workers, 1))
    if len(parts) == 1:
        return [source.scan_part(parts[0], ctx, lambda p: source.parts_progress(p.records, p.last_key))]
    reached = [PartProgress(0, b"")] * len(parts)

    def on_progress(i: int, p: PartProgress) -> None:
        reached[i] = p
        source.parts_progress(sum(r.records for r in reached), p.last_key or None)

    def reader(part: KeyRange) -> Callable[[Callable[[Any], None]], PartReport]:
        return lambda report: source.scan_part(part, ctx, report)

    outcomes = run_isolated_all([reader(part) for part in parts], PartProgress, PartReport, on_progress)
    for part, (_, died) in zip(parts, outcomes, strict=True):
        if died is not None:
            source.part_failed(part, died)
    return [result for result, _ in outcomes]


def structure_proven(cat: Catalogue, reports: list[PartReport]) -> bool:
    """Whether the children's checks and the catalogue prove the structure clean (see the module docstring): one
    snapshot, nothing found, every range sure, the sums equal to the registry, totals and catalogue counts."""
    txnids = {cat.txnid}
    for r in reports:
        txnids.update(r.txnids)
        if r.findings or r.missed_meta or r.unsure:
            return False
    if len(txnids) != 1 or any(record is None for record in cat.registry.values()):
        return False
    pages = sum(r.pages for r in reports)
    if (pages, sum(r.meta_keys for r in reports)) != (cat.entries["pages"], cat.entries["meta"]):
        return False
    if cat.entries["children"] != pages:  # every page is listed under its parent (no missing_index), no more
        return False
    per_ns: dict[bytes, list[int]] = {}
    for r in reports:
        for s in r.sums:
            acc = per_ns.setdefault(s.ns_id, [0, 0, 0])
            acc[0] += s.pages
            acc[1] += s.nbytes
            acc[2] += s.hits
    for ns_id, record in cat.registry.items():
        assert record is not None
        n_pages, n_bytes, n_hits = per_ns.get(ns_id, [0, 0, 0])
        if [record.pages, record.bytes] != [n_pages, n_bytes] or n_hits > record.hits:
            return False
    if not set(per_ns) <= set(cat.registry):
        return False  # a page of an unregistered namespace (its own finding: never here)
    stored = (sum(p[0] for p in per_ns.values()), sum(p[1] for p in per_ns.values()))
    return cat.totals is None or cat.totals == stored
