"""The L3 integrity audit and its repair, written once for every backend (`L3Store.verify`).

A backend implements `IntegritySource`: it reads its records (pages with their metadata, the children index, the
namespace registry, the layouts) the way its storage allows, and removes records under a recheck when asked
(`RepairOps`). Everything else lives here: what counts as a finding of each VERIFY_KINDS kind, which findings make
a page removable, which pages go with it, and what a repair does per kind (api.REPAIRS).

The checks:

- every stored page value: its checksum, its size against its metadata and its layout, its hash against its
  metadata's parent and tokens (an engine page's: against its key under its namespace root, `EngineHashes`),
  whether its layout and namespace are recorded and whether the children index lists it under its parent
  (`check_page`, fed by `IntegritySource.scan_pages`);
- the prefix trees, read as one snapshot where the backend has one (`Snapshot`): metadata without bytes, chains
  whose head hangs from neither a stored page nor its namespace root (`orphan`), pages tagged with another
  namespace or layout than their parent's, children entries that name no page filed under that parent, and
  registry counters against the pages stored (`check_snapshot`).

Every field of a page's metadata record (`PageMeta`) is covered by a check: `ns_id` and `layout_id` (recorded in
the registry and the layouts, the same as its parent's), `parent` and `tokens` (the hash chain: the page's hash is
H(parent || tokens), and the parent is a stored page or its namespace's root), `key` (an engine page's hash under
its root), `nbytes` (the stored size, the layout's page size), `checksum` (the value's own), `created` and
`last_access` (finite, inside the store's life give or take a day of clock skew, and created <= last_access), and
`hits` (not negative, not above its namespace's count, and the pages of a namespace together not above it:
`implausible`, `_check_counters`). A low bit flipped in a time, or a hit count that stays plausible, is beyond any
check; one that would steer eviction or an incremental audit far off is not.

Repair removes each removable finding's page and, depth first, every page below it (a page below is removed only
while the page above stays gone), in bounded batches (`IntegritySource.repair_batch`: one write transaction, one
script...). Each removal is rechecked by the backend against the record as it is then (`Guard`), so a page that a
writer stored again, or that is sound and reachable from its namespace root, is never removed.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import msgspec

from ..errors import InvalidInput
from ..types.keys import hash_root_of_id
from ..types.layout import KVLayout
from .api import LayoutRecord, NamespaceRecord, PageMeta, VerifyFinding, VerifyRemoval, VerifyReport
from .chain import ChainRoots
from .codec import HEADER, Checksum, chains_to, engine_keyed, stored_checksum
from .verify_parts import (
    NOT_CHECKED,
    AuditLog,
    AuditScope,
    PartContext,
    PartedSource,
    run_parts,
    structure_proven,
)

T = TypeVar("T")


UNRECORDED = ("structure_corrupt", "key_mismatch")  # findings after which an audit writes nothing to the store


class Guard(enum.StrEnum):
    """What a backend rechecks, against the record as it is at removal time, before it removes a page."""

    SAME_RECORD = "any"  # the page is still the record verify judged (same namespace and parent)
    SAME_BYTES = "sha"  # ... and it still holds the bytes verify found corrupt (not a rewrite)
    PARTIAL = "raw"  # a record that is not a whole page (bytes or metadata alone, a key no page hash): delete it
    PARENT_GONE = "below"  # a page below a removed one: only while the page above stays gone (unreachable)
    FILED_UNDER = "filed"  # a page of a namespace or layout whose record was removed: whatever is stored under it


# Finding kind -> the guard of its page's removal. Kinds absent here never remove a page (api.REPAIRS).
REMOVAL_GUARDS: dict[str, Guard] = {
    "checksum_mismatch": Guard.SAME_BYTES,
    "size_mismatch": Guard.SAME_BYTES,
    "hash_mismatch": Guard.SAME_BYTES,
    "missing_meta": Guard.PARTIAL,
    "missing_page": Guard.PARTIAL,
    "dangling_index": Guard.PARTIAL,  # a pages key that is no page hash
    "namespace_mismatch": Guard.SAME_RECORD,
    "orphan": Guard.PARENT_GONE,
}


class PageRow(msgspec.Struct, frozen=True, gc=False):
    """What the tree checks keep of one page whose metadata decodes."""

    parent: bytes
    ns_id: bytes
    layout_id: bytes
    nbytes: int  # by its metadata
    hits: int = -1  # by its metadata (-1: the backend keeps hits elsewhere; not summed against the registry)
    # an engine page (named by its engine's key, its hash proved by the key under its root): its parent is a hint,
    # so a parent gone (a corrupt one dropped) leaves it reachable by its key, never an orphan nor part of a subtree
    # a repair takes with a parent
    engine: bool = False


class ScannedPage(msgspec.Struct, frozen=True, gc=False):
    """One stored page value as a backend's scan read it, with what the backend read about it in the same view."""

    page_hash: bytes
    value: Any  # as stored: checksum + payload (a zero-copy view is fine: used before the next page is asked for)
    meta: PageMeta | None  # None: no metadata stored, or none that decodes (`damaged`)
    damaged: bool = False  # metadata is stored but does not decode
    indexed: bool = True  # the children index lists it under the parent its metadata names
    registered: bool = True  # the namespace its metadata names is in the registry
    ns_hits: int = -1  # the hits its namespace's record counts, read in the same view (-1: not known here)


class Snapshot(msgspec.Struct):
    """The metadata side of a store, for the tree, index and counter checks: one consistent view of it where the
    backend has one (parents, children and counters agree only on one snapshot)."""

    tree: dict[bytes, PageRow]  # every page whose metadata decodes, whether its bytes are stored or not
    bodiless: set[bytes]  # pages with metadata (decoding or not) and no bytes
    damaged: set[bytes]  # pages whose metadata does not decode
    headless: set[bytes]  # page bytes stored without metadata that decodes
    registry: dict[bytes, NamespaceRecord | None]  # namespace id -> record (None: it does not decode)
    links: list[tuple[bytes, bytes]]  # (parent, child) entries of the children index
    totals: tuple[int, int] | None = None  # (pages, payload bytes) by the store's totals record, (-1, -1) when it
    #                                        does not decode; None: the backend keeps no totals


class Removal(msgspec.Struct, frozen=True, gc=False):
    """A page repair asks a backend to remove, and how it must recheck it first."""

    page: bytes
    finding: int  # index of the finding it goes for
    via: bytes | None  # the removed page it hung from (None: the finding's own page)
    guard: Guard
    row: PageRow | None  # what verify read of it (None: its metadata did not decode)


class RepairOps(Protocol):
    """The removals of one bounded batch (one write transaction, one script round): each call rechecks what it
    removes against the records as they are now."""

    def remove(self, items: Sequence[Removal]) -> list[tuple[str, int] | None]:
        """Remove each item's records if its guard still holds: per item (what, payload bytes freed), `what` as in
        VerifyRemoval ("page", "bytes", "meta"); None where the guard kept it (or nothing is stored)."""

    def children(self, pages: Sequence[bytes]) -> Sequence[Iterable[bytes]]:
        """The children index entries of each page (what may hang below it besides what its metadata said)."""

    def unlink(self, links: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        """Remove (parent, child) index entries unless the child is now stored under that parent: per entry,
        whether one was removed."""

    def relink(self, pages: Sequence[tuple[bytes, PageRow]]) -> list[bool]:
        """List each page under its parent in the children index: per page, whether it is still stored."""

    def drop_record(self, name: str, key: bytes) -> bool:
        """Remove the "namespaces" or "layouts" record under `key` if it still does not decode."""


@runtime_checkable
class ResetsFields(Protocol):
    """`RepairOps` of a backend that can repair a page's implausible metadata fields in place (LMDB)."""

    def reset_fields(self, pages: Sequence[bytes]) -> list[bool]:
        """Set each page's implausible `created`, `last_access` and `hits` to what can be (`implausible`'s
        bounds, as of now), rechecked first: per page, whether it was reset (or is plausible now)."""


class IntegritySource(Protocol):
    """What a backend implements so that `verify` can audit and repair it."""

    checksum: Checksum  # the algorithm the store's page values were written with
    # the key of the store's chain roots (kvcache.storage.chain); None: this user may not read the store's
    # secret, and roots are taken from the namespace records
    chain_key: bytes | None
    batch_pages: int  # records removed per `repair_batch` at most
    recounts_after_removals: bool  # recount after any removal (cheap and exact in one transaction), or only on a
    #                                counter finding (a recount that is a racy scan of a shared store)

    def layout_records(self) -> dict[bytes, LayoutRecord | None]:
        """The layouts recorded, by layout id (None: the record does not decode)."""

    def scan_pages(self, found: "Findings") -> Iterator[ScannedPage]:
        """Every stored page value, read in short consistent views. A key or a record this interface cannot
        express (a key that is no page hash, a record missing a field) the backend reports to `found` itself;
        metadata without bytes is the snapshot's (`Snapshot.bodiless`)."""

    def snapshot(self, found: "Findings") -> Snapshot:
        """The metadata side, after the scan (faults of the backend's own structure go to `found`)."""

    def repair_batch(self, body: Callable[[RepairOps], T]) -> T:
        """Run `body` in one bounded unit of removals and return its result. `body` keeps its effects inside the
        unit: a backend may run it again (an LMDB map that had to grow)."""

    def recount(self) -> None:
        """Set every registry counter (and the store totals, where kept) from the pages stored."""


@runtime_checkable
class OwnChecks(Protocol):
    """A source with checks of its own besides the records (LMDB: its page map, its key file against the pages):
    a full audit asks it first."""

    def own_checks(self, found: "Findings") -> None:
        """Run them; each problem a finding in `found`."""


class Findings:
    """What one verify found, and what repair may do about each finding (indices into `items`)."""

    __slots__ = ("items", "by_page", "remove", "relink", "unlink", "recount", "damaged", "fixed", "reset")

    def __init__(self) -> None:
        self.items: list[VerifyFinding] = []
        self.by_page: dict[bytes, list[int]] = {}  # page -> the findings about it (fixed when it is removed)
        self.remove: dict[bytes, tuple[int, Guard]] = {}  # page -> its first finding making it removable, guard
        self.relink: dict[bytes, int] = {}  # page -> its missing_index finding
        self.unlink: list[tuple[bytes, bytes, int]] = []  # (parent, child, finding) of dangling children entries
        self.recount: list[int] = []  # findings a recount fixes
        self.damaged: list[tuple[str, bytes, int]] = []  # ("namespaces" | "layouts", key, finding): undecodable
        self.fixed: set[int] = set()  # findings repaired
        self.reset: dict[bytes, int] = {}  # page -> its implausible_meta finding (repair resets the fields)

    def add(self, kind: str, page_hash: bytes | None, detail: str, remove: bool | Guard = False) -> int:
        """Record a finding; `remove`: the page under `page_hash` is provably corrupt or unreachable, removable
        under its kind's guard (REMOVAL_GUARDS) or the one given. Returns the finding's index."""
        i = len(self.items)
        self.items.append(VerifyFinding(kind, None if page_hash is None else page_hash.hex(), detail))
        if page_hash is not None and (kind != "dangling_index" or remove):
            self.by_page.setdefault(page_hash, []).append(i)
        if remove and page_hash is not None:
            self.remove.setdefault(page_hash, (i, REMOVAL_GUARDS[kind] if remove is True else remove))
        if kind == IMPLAUSIBLE and page_hash is not None:
            self.reset.setdefault(page_hash, i)
        return i

    def damaged_record(self, name: str, key: bytes, why: str = "") -> None:
        """A namespace or layout record that does not decode (repair removes it and the pages filed under it), or
        another record of sub-database `name` that is damaged for `why` (repair removes it; no page is filed under
        it: a backend's removal log, say)."""
        what = {"namespaces": "namespace record", "layouts": "layout record"}.get(name, f"{name} key")
        detail = f"{what} {key.hex()}: {why}" if why else f"{what} {key.hex()} does not decode"
        self.damaged.append((name, key, self.add("damaged_record", None, detail)))


class EngineHashes:
    """The hash check of engine pages in one audit: a page's hash is its key's under its namespace/layout root
    (`codec.engine_keyed`). With the chain key each (layout, namespace) root is computed once and a page is judged
    as it is scanned; without it (a reader who may not read the store's secret) a root is one its namespace's
    record keeps, known with the snapshot only, so the page is held until then (`settle`)."""

    __slots__ = ("chain_key", "roots", "held")

    def __init__(self, chain_key: bytes | None) -> None:
        self.chain_key = chain_key
        self.roots: dict[tuple[bytes, bytes], bytes] = {}  # (layout id, namespace id) -> its root
        self.held: list[tuple[bytes, PageMeta]] = []  # pages to judge once the registry is read (no chain key)

    def sound(self, page_hash: bytes, meta: PageMeta) -> bool | None:
        """Whether engine page `page_hash` is its key's under its root; None: held for `settle`."""
        if self.chain_key is None:
            self.held.append((page_hash, meta))
            return None
        pair = (meta.layout_id, meta.ns_id)
        root = self.roots.get(pair)
        if root is None:
            root = self.roots[pair] = hash_root_of_id(meta.layout_id, meta.ns_id, self.chain_key)
        return engine_keyed(page_hash, meta, (root,))

    def settle(self, registry: dict[bytes, NamespaceRecord]) -> list[tuple[bytes, PageMeta]]:
        """The held pages whose hash is their key's under none of the roots their namespace's record keeps. A page
        of a namespace without a record that decodes is not judged: that record's own finding covers it."""
        bad = []
        for h, meta in self.held:
            record = registry.get(meta.ns_id)
            if record is not None and not engine_keyed(h, meta, recorded_roots(record)):
                bad.append((h, meta))
        self.held = []
        return bad


def recorded_roots(record: NamespaceRecord) -> list[bytes]:
    """The roots a namespace record keeps (a damaged entry names none)."""
    roots = []
    for root in record.roots:
        try:
            roots.append(bytes.fromhex(root))
        except ValueError:
            continue
    return roots


def _hash_mismatch(found: Findings, h: bytes, meta: PageMeta) -> None:
    """A page filed under a hash its metadata does not give."""
    if meta.key:
        found.add("hash_mismatch", h, f"not the hash of its {len(meta.key)}-byte engine key under the root of its "
                                      f"namespace and layout: a page filed under a wrong hash", remove=True)
    else:
        found.add("hash_mismatch", h, f"not H(parent {meta.parent.hex()} || its {len(meta.tokens)} token "
                                      f"bytes): a page filed under a wrong hash", remove=True)


IMPLAUSIBLE = "implausible_meta"  # a page's metadata with a time or a hit count that cannot be
# The finding kinds this audit adds to api.VERIFY_KINDS, and what a repair does about them (api.REPAIRS).
CLOCK_SKEW_S = 86400.0  # how far a page's times may lie outside the store's life before they are a finding


def life(created: float, now: float | None = None) -> tuple[float, float]:
    """The times a page's `created` and `last_access` may take in a store created at `created` (0: unknown),
    audited `now`: from its creation to now, give or take CLOCK_SKEW_S (a clock stepped back or ahead)."""
    import time

    return (created - CLOCK_SKEW_S if created > 0 else 0.0,
            (time.time() if now is None else now) + CLOCK_SKEW_S)


def implausible(meta: PageMeta, times: tuple[float, float], ns_hits: int = -1) -> str:
    """What in `meta`'s own fields cannot be ("": nothing): what no check of the page's bytes, hash or place
    covers. `created` and `last_access` are finite, not before the store's creation nor after now (`times`, as
    `life` gives them; (0, 0): the upper bound unknown), and `created <= last_access` (a write sets both, a read
    only moves `last_access` on); `hits` is not negative and not above the hits its namespace's record counts
    (`ns_hits`, -1: unknown; every read that ends at a page counts in its namespace too, so a page never holds
    more). A flip there would steer `--since` and eviction, which trust them."""
    low, high = times
    for name, value in (("created", meta.created), ("last_access", meta.last_access)):
        if not math.isfinite(value) or value < low or (high > 0 and value > high):
            return f"its {name} {value!r} lies outside the store's life ({low:.0f} to {high:.0f}, unix seconds)"
    if meta.created > meta.last_access:
        return f"its created {meta.created!r} is after its last_access {meta.last_access!r}"
    if meta.hits < 0 or (ns_hits >= 0 and meta.hits > ns_hits):
        return f"its hits {meta.hits} are not between 0 and the {ns_hits} its namespace counts" if ns_hits >= 0 \
            else f"its hits {meta.hits} are negative"
    return ""


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
    removals = _repair(source, found, kids, snap.tree)
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
            _hash_mismatch(found, h, meta)
        return VerifyReport(not found.items, checked, checked_bytes, found.items, scope="incremental", since=since,
                            not_checked=list(NOT_CHECKED), workers=workers)
    held = list(engine.held)  # judged with the registry: by the catalogue's here, by the snapshot's if it runs
    if not structure_proven(cat, reports) or engine.settle(registry):
        engine.held = held
        check_snapshot(found, source.snapshot(found), layouts, source.chain_key, engine)
    return VerifyReport(not found.items, checked, checked_bytes, found.items, workers=workers)




def check_page(found: Findings, page: ScannedPage, layouts: dict[bytes, KVLayout], checksum: Checksum,
               engine: EngineHashes, times: tuple[float, float] = (0.0, 0.0)) -> None:
    """The checks of one stored page value against its checksum, its metadata and its layout (an engine page's
    hash through `engine`), and of its metadata's own fields (`implausible`; `times`: the store's life, as
    `life` gives it)."""
    h, value, meta = page.page_hash, page.value, page.meta
    if len(value) < HEADER:
        found.add("size_mismatch", h, f"{len(value)} bytes stored: not even a checksum", remove=True)
        return
    stored_sum = stored_checksum(value)
    payload = memoryview(value)[HEADER:]
    if checksum.of(payload, h) != stored_sum:
        found.add("checksum_mismatch", h, "payload does not match its checksum", remove=True)
    if meta is None:
        found.add("missing_meta", h, "its metadata does not decode (a damaged record)" if page.damaged else
                  "page without metadata", remove=True)
        return
    size = len(payload)
    if meta.checksum != stored_sum:
        found.add("checksum_mismatch", h, "metadata checksum differs from the page's", remove=True)
    if meta.nbytes != size:
        found.add("size_mismatch", h, f"{size} bytes stored, metadata says {meta.nbytes}", remove=True)
    if (engine.sound(h, meta) if meta.key else chains_to(h, meta)) is False:
        _hash_mismatch(found, h, meta)
    layout = layouts.get(meta.layout_id)
    if layout is None:
        found.add("unknown_layout", h, f"layout {meta.layout_id.hex()} is not recorded")
    elif layout.bytes_per_page != size:
        found.add("size_mismatch", h, f"{size} bytes stored, layout {layout.describe()} pages are "
                                      f"{layout.bytes_per_page}", remove=True)
    if not page.registered:
        # never the raw namespace id: next to a page's tokens it would let a short salt be guessed back
        found.add("unknown_namespace", h, "its namespace is not in the registry")
    odd = implausible(meta, times, page.ns_hits)
    if odd:
        found.add(IMPLAUSIBLE, h, odd)
    if not page.indexed:
        found.relink.setdefault(h, found.add("missing_index", h, "not listed under its parent in children"))


def check_snapshot(found: Findings, snap: Snapshot, layouts: dict[bytes, KVLayout],
                   chain_key: bytes | None, engine: EngineHashes | None = None) -> dict[bytes, list[bytes]]:
    """The tree, index and counter checks of one snapshot, namespace roots keyed by `chain_key` (None: the roots
    the namespace records keep), and the hash checks of the engine pages `engine` held for the registry. Returns
    parent -> children as the metadata says (what repair walks, besides the children index)."""
    tree = snap.tree
    for h in sorted(snap.bodiless):
        why = "metadata that does not decode, without a page" if h in snap.damaged else "metadata without a page"
        found.add("missing_page", h, why, remove=True)
    registry: dict[bytes, NamespaceRecord] = {}
    for ns_id, record in snap.registry.items():
        if record is None:
            found.damaged_record("namespaces", ns_id)
        else:
            registry[ns_id] = record
    for h, meta in engine.settle(registry) if engine is not None else ():
        _hash_mismatch(found, h, meta)
    # Every root a page may hang from: each (layout, namespace) pair the pages or the records name.
    pairs = {(row.layout_id, row.ns_id) for row in tree.values()} | {(lay, ns) for lay in layouts for ns in registry}
    roots = ChainRoots(chain_key, pairs, registry)
    kids: dict[bytes, list[bytes]] = {}
    for h, row in tree.items():
        kids.setdefault(row.parent, []).append(h)
    for h, row in tree.items():
        up = tree.get(row.parent)
        if up is not None:
            if (up.ns_id, up.layout_id) != (row.ns_id, row.layout_id):
                found.add("namespace_mismatch", h, f"tagged namespace {row.ns_id.hex()} / layout "
                                                   f"{row.layout_id.hex()}, its parent {row.parent.hex()} namespace "
                                                   f"{up.ns_id.hex()} / layout {up.layout_id.hex()}", remove=True)
        elif (owner := roots.owner(row.parent)) is not None:
            if not roots.belongs(row.parent, row.layout_id, row.ns_id):
                other_lay, other_ns = owner
                found.add("namespace_mismatch", h, f"tagged namespace {row.ns_id.hex()} / layout "
                                                   f"{row.layout_id.hex()}, its parent is the root of namespace "
                                                   f"{other_ns.hex()} / layout "
                                                   f"{other_lay.hex() if other_lay else '(unknown)'}", remove=True)
        elif not roots.keyed and row.ns_id not in registry:
            pass  # no key and no record of its namespace to read roots from: its record's finding covers it
        elif row.engine:
            pass  # its parent is a hint: reachable by its key (its hash is checked apart: hash_mismatch)
        elif row.parent not in snap.headless:  # parent bytes without metadata: that page's finding covers it
            below, below_bytes = subtree_size(h, kids, tree)
            found.add("orphan", h, f"parent {row.parent.hex()} is neither a stored page nor a namespace root: "
                                   f"unreachable with the {below} page(s) ({below_bytes} bytes) below it", remove=True)
    for parent, child in snap.links:
        if child in snap.damaged and child in found.by_page:
            # the entry of a page whose metadata is damaged: it goes when repair removes that page
            found.unlink.append((parent, child, found.by_page[child][0]))
            continue
        up = tree.get(child)
        if up is None or up.parent != parent:
            why = ("names a page that is not stored" if up is None else
                   f"files it under {parent.hex()}, its metadata names parent {up.parent.hex()}")
            found.unlink.append((parent, child, found.add("dangling_index", child, f"children entry {why}")))
    _check_counters(found, snap, registry)
    return kids


def _check_counters(found: Findings, snap: Snapshot, registry: dict[bytes, NamespaceRecord]) -> None:
    per_ns: dict[bytes, list[int]] = {}
    for h, row in snap.tree.items():
        if h not in snap.bodiless:
            acc = per_ns.setdefault(row.ns_id, [0, 0, 0])
            acc[0] += 1
            acc[1] += row.nbytes
            acc[2] = -1 if row.hits < 0 or acc[2] < 0 else acc[2] + row.hits
    for ns_id, record in registry.items():
        n_pages, n_bytes, n_hits = per_ns.get(ns_id, [0, 0, 0])
        if (record.pages, record.bytes) != (n_pages, n_bytes):
            found.recount.append(found.add("counter_mismatch", None, f"namespace {record.ns_id_hex}: registry says "
                                                                     f"{record.pages} pages / {record.bytes} bytes, "
                                                                     f"store holds {n_pages} / {n_bytes}"))
        if n_hits > record.hits:
            # every read that ends at a page counts in its namespace too: the pages never hold more hits
            found.recount.append(found.add("counter_mismatch", None, f"namespace {record.ns_id_hex}: its pages "
                                                                     f"count {n_hits} hits, the registry "
                                                                     f"{record.hits}"))
    if snap.totals is None:
        return
    stored = (sum(p[0] for p in per_ns.values()), sum(p[1] for p in per_ns.values()))
    if snap.totals != stored:
        said = ("the store totals record does not decode" if snap.totals[0] < 0 else
                f"store totals say {snap.totals[0]} pages / {snap.totals[1]} bytes")
        found.recount.append(found.add("counter_mismatch", None, f"{said}, the store holds {stored[0]} / "
                                                                 f"{stored[1]}"))


def subtree_size(top: bytes, kids: dict[bytes, list[bytes]], tree: dict[bytes, PageRow]) -> tuple[int, int]:
    """(pages, payload bytes) below `top` by the parents its descendants' metadata name."""
    pages = nbytes = 0
    seen = {top}
    stack = list(kids.get(top, ()))
    while stack:
        h = stack.pop()
        if h in seen:
            continue  # only a corrupt parent link can cycle; hash_mismatch reports it
        seen.add(h)
        pages += 1
        nbytes += tree[h].nbytes
        stack.extend(kids.get(h, ()))
    return pages, nbytes



def removed_pages(report: VerifyReport) -> set[bytes]:
    """The page hashes a repair removed records of (index entries and namespace or layout records apart): what a
    backend forgets from its quarantine, since a writer may store them again."""
    return {bytes.fromhex(r.page_hash) for r in report.removals if r.what not in ("index", "record")}

# --- repair ---------------------------------------------------------------------------------------------------


def _repair(source: IntegritySource, found: Findings, kids: dict[bytes, list[bytes]],
            tree: dict[bytes, PageRow]) -> list[VerifyRemoval]:
    """Apply api.REPAIRS to what verify found, in bounded batches, each removal rechecked by the backend."""
    limit = max(source.batch_pages, 1)
    removals: list[VerifyRemoval] = []
    removed: set[bytes] = set()
    for name, key, i in found.damaged:
        for r, h in _drop_damaged(source, found, name, key, i, tree, limit):
            removals.append(r)
            if h is not None:
                removed.add(h)
        found.fixed.add(i)
        found.recount.append(i)  # the totals are set from what is left at the end
    work = [Removal(h, i, None, guard, tree.get(h)) for h, (i, guard) in reversed(found.remove.items())]
    while work:

        def remove_some(ops: RepairOps,
                        work: list[Removal] = work) -> tuple[list[Removal], list[tuple[VerifyRemoval, bytes]]]:
            return _remove_some(ops, work, kids, tree, found, limit)

        work, batch = source.repair_batch(remove_some)
        for r, h in batch:
            removals.append(r)
            removed.add(h)
    for h in removed:
        found.fixed.update(found.by_page.get(h, ()))
    for start in range(0, len(found.unlink), limit):
        chunk = found.unlink[start:start + limit]

        def unlink(ops: RepairOps, chunk: list[tuple[bytes, bytes, int]] = chunk) -> list[bool]:
            return ops.unlink([(p, c) for p, c, _ in chunk])

        gone = source.repair_batch(unlink)
        for (_, child, i), entry_removed in zip(chunk, gone, strict=True):
            if entry_removed:
                removals.append(VerifyRemoval(found.items[i].kind, child.hex(), "index", 0))
            found.fixed.add(i)
    resets = [(h, i) for h, i in found.reset.items() if h not in removed]
    for start in range(0, len(resets), limit):
        pages = resets[start:start + limit]

        def reset_some(ops: RepairOps, pages: list[tuple[bytes, int]] = pages) -> list[bool]:
            return ops.reset_fields([h for h, _ in pages]) if isinstance(ops, ResetsFields) else []

        done = source.repair_batch(reset_some)
        found.fixed.update(i for (_, i), ok in zip(pages, done, strict=False) if ok)
    relink = [(h, i) for h, i in found.relink.items() if h not in removed and h in tree]
    for start in range(0, len(relink), limit):
        pages = relink[start:start + limit]

        def relink_some(ops: RepairOps, pages: list[tuple[bytes, int]] = pages) -> list[bool]:
            return ops.relink([(h, tree[h]) for h, _ in pages])

        done = source.repair_batch(relink_some)
        found.fixed.update(i for (_, i), ok in zip(pages, done, strict=True) if ok)
    if found.recount or (removals and source.recounts_after_removals):
        source.recount()
        found.fixed.update(found.recount)
    return removals


def _remove_some(ops: RepairOps, work: list[Removal], kids: dict[bytes, list[bytes]], tree: dict[bytes, PageRow],
                 found: Findings, limit: int) -> tuple[list[Removal], list[tuple[VerifyRemoval, bytes]]]:
    """One batch: remove up to `limit` pages of `work`, depth first (a removed page's children join the work,
    guarded by PARENT_GONE). Returns the work left and what it removed; `work` itself is left untouched, so a
    rerun of the batch starts over."""
    stack = list(work)
    out: list[tuple[VerifyRemoval, bytes]] = []
    seen: set[bytes] = set()
    while stack and len(out) < limit:
        take: list[Removal] = []
        while stack and len(take) < limit - len(out):
            item = stack.pop()
            if item.page not in seen:
                seen.add(item.page)
                take.append(item)
        gone = [(item, done) for item, done in zip(take, ops.remove(take), strict=True) if done is not None]
        for item, (what, nbytes) in gone:
            head = found.items[item.finding].page_hash
            out.append((VerifyRemoval(found.items[item.finding].kind, item.page.hex(), what, nbytes,
                                      None if item.via is None else head), item.page))
        listed = ops.children([item.page for item, _ in gone]) if gone else []
        for (item, _), entries in zip(gone, listed, strict=True):
            below = set(kids.get(item.page, ())) | set(entries)
            # an engine page below stays: it proves itself by its key (an intact page is never taken for its parent)
            stack.extend(Removal(c, item.finding, item.page, Guard.PARENT_GONE, tree.get(c)) for c in below
                         if c not in tree or not tree[c].engine)
    return stack, out


def _drop_damaged(source: IntegritySource, found: Findings, name: str, key: bytes, i: int,
                  tree: dict[bytes, PageRow], limit: int) -> list[tuple[VerifyRemoval, bytes | None]]:
    """Remove a namespace or layout record that does not decode, and every page filed under it (they cannot be
    registered again without it), `limit` pages per batch."""
    filed = {"namespaces": "ns_id", "layouts": "layout_id"}.get(name)  # other records file no page under them
    pages = [h for h, row in tree.items() if getattr(row, filed) == key] if filed else []
    kind = found.items[i].kind
    out: list[tuple[VerifyRemoval, bytes | None]] = []
    for start in range(0, max(len(pages), 1), limit):
        batch = [Removal(h, i, None, Guard.FILED_UNDER, tree[h]) for h in pages[start:start + limit]]

        def body(ops: RepairOps, batch=batch, first=start == 0) -> list[tuple[VerifyRemoval, bytes | None]]:
            done: list[tuple[VerifyRemoval, bytes | None]] = []
            if first and ops.drop_record(name, key):
                done.append((VerifyRemoval(kind, key.hex(), "record", 0), None))
            for item, gone in zip(batch, ops.remove(batch) if batch else [], strict=True):
                if gone is not None:
                    done.append((VerifyRemoval(kind, item.page.hex(), gone[0], gone[1], key.hex()), item.page))
            return done

        out += source.repair_batch(body)
    return out
