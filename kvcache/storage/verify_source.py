"""What a backend gives the shared integrity audit (`kvcache.storage.verify`), and what the audit hands back.

A backend implements `IntegritySource`: it reads its records (pages with their metadata, the children index, the
namespace registry, the layouts) the way its storage allows, as `ScannedPage`s and one `Snapshot`, and reports what
its own structure shows into a `Findings`. A repair asks it for bounded batches of removals (`RepairOps`), each a
`Removal` that it rechecks against the record as it is then (`Guard`), so a page that a writer stored again, or that
is sound and reachable from its namespace root, is never removed. `Findings` is the audit's record of what it found
and of what a repair may do about each finding; the checks fill it (`verify_checks`), the repair acts on it
(`verify_repair`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import msgspec

from .api import LayoutRecord, NamespaceRecord, PageMeta, VerifyFinding
from .codec import Checksum

T = TypeVar("T")

IMPLAUSIBLE = "implausible_meta"  # a page's metadata with a time or a hit count that cannot be (`verify_checks`)


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
