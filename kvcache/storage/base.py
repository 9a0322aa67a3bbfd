"""The L3 store interface: the `L3Store` protocol, the values it trades in, and the backend registry.

An L3 store maps page hashes to page bytes. A page hash names its whole prefix, its namespace and its layout
(see `kvcache.types.keys`), so a store needs no other key and two namespaces or two layouts can never read each other's
pages. Everything is batched and everything is by page hash.

Rules every backend keeps (tests/conformance checks them for each registered backend):

- `exists_prefix` and `get_into` count consecutive pages from the start of the batch and stop at the first gap.
- A page whose bytes fail their checksum, or whose stored size is not a page's, is a miss: counted, quarantined
  (a miss again on every later read, until a write or `verify(repair=True)` removes it), reported by `verify()`,
  never served.
- Expected outcomes are values: a miss is a short count, a page over the capacity or a quota is `rejected` in
  the `PutResult`. Exceptions are for unusable input and for faults the caller must see (`kvcache.errors`).
- A read fault (an I/O error under a read) degrades to a miss and is counted.
- The salt of a namespace is never stored: the registry keeps `extra_key` and the salt fingerprint only.
- Namespace shares (`kvcache.types.shares`) are kept with the registry and outlive the namespace's pages
  (`delete_namespace` leaves them). A namespace's `store_bytes` share replaces the uniform
  `namespace_quota_bytes` for it: a put never leaves it holding more (the backend evicts its own least recently
  used pages, or rejects the pages over it).
- Access times and hit counts are recorded in memory and written in batches (`flush()`), never one write per read.
  A read of a run of pages counts once, at the deepest page it reached; a page's heat is its subtree's.

Backends are found through the entry-point group ``kvcache.storage``: the entry-point name is the URL scheme
(``lmdb`` for ``lmdb://PATH``; a plain path also opens ``lmdb``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

import msgspec
import numpy as np

from ..errors import InvalidInput, UnknownBackend
from ..types.keys import PAGE_HASH_BYTES, TOKEN_BYTES, extend_chain, hash_root
from ..types.layout import KVLayout
from ..types.namespace import Namespace

# What a backend needs besides the names above, re-exported so that a plugin imports kvcache.storage.base only
# (DESIGN §2: plugins -> kvcache.storage.base, never the rest of the core).
from ..errors import LayoutMismatch, NotAStore, StoreError, StoreReadOnly, StoreUnsupported  # noqa: E402,F401
from ..types.keys import hash_root_of_id  # noqa: E402,F401
from ..types.namespace import NamespaceInfo, new_fingerprint_key  # noqa: E402,F401
from ..types.shares import NamespaceShares, Shares, decode_shares_record  # noqa: E402,F401

ENTRY_POINT_GROUP = "kvcache.storage"
DEFAULT_SCHEME = "lmdb"  # the backend a plain filesystem path opens


class PageOrigin(msgspec.Struct, frozen=True, gc=False):
    """Where a page comes from, as given to `L3Store.put`: its namespace, parent and tokens. The store derives
    the rest (size, checksum, times) itself; `page_origins` builds these for a token sequence."""

    namespace: Namespace  # the namespace of the request that produced the page; its id is folded into the hash
    parent: bytes  # PAGE_HASH_BYTES: the previous page's hash, or the namespace root for a first page
    tokens: bytes  # packed uint32 token ids of this page; len = TOKEN_BYTES * page_size


class PageMeta(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """What a store records about one page besides its bytes."""

    ns_id: bytes  # 16-byte Namespace.id of the page
    layout_id: bytes  # 16-byte KVLayout.layout_id the page was written under
    parent: bytes  # PAGE_HASH_BYTES: parent page hash (the namespace root for a first page)
    tokens: bytes  # packed uint32 token ids of the page (TOKEN_BYTES * page_size bytes)
    nbytes: int  # payload size in bytes, = layout.bytes_per_page
    checksum: int  # 64-bit checksum of the payload, seeded by the page hash (algorithm: StoreStats.checksum)
    created: float  # unix seconds of the first write
    last_access: float  # unix seconds of the write or of the last read that ended at this page, as of the last flush
    hits: int  # reads that ended at this page (a read of a run is credited to its deepest page), as of the last flush


class NamespaceRecord(msgspec.Struct, frozen=True):
    """One namespace in a store's registry: identity (never the salt) and counters."""

    ns_id_hex: str  # Namespace.id_hex
    extra_key: str | None
    salt_fingerprint: str | None  # keyed digest of the salt; the salt itself is never stored
    pages: int  # pages stored now
    bytes: int  # payload bytes stored now
    created: float  # unix seconds of the first page written
    last_access: float  # unix seconds, as of the last flush
    hits: int  # pages served from this namespace, as of the last flush
    roots: list[str] = []  # hex hash roots (one per layout written) where the namespace's prefix tree starts


class LayoutRecord(msgspec.Struct, frozen=True):
    """A KVLayout the store holds, with when it was first registered."""

    layout: KVLayout
    created: float  # unix seconds


class ChildInfo(msgspec.Struct, frozen=True, gc=False):
    """A stored child of a page hash (or of a namespace root): enough to walk a prefix tree hottest-first."""

    page_hash: bytes  # PAGE_HASH_BYTES
    tokens: bytes  # packed token ids of the child page: the key of the edge from its parent
    nbytes: int  # payload bytes
    hits: int  # reads that reached the child: those that ended anywhere in its subtree, as of the last flush
    last_access: float  # unix seconds, the latest over its subtree, as of the last flush


class PutResult(msgspec.Struct, frozen=True):
    """What one `put` batch did. `written + existing + rejected` = pages in the batch."""

    written: int  # new pages stored
    existing: int  # pages already stored (content-addressed: left as they were)
    rejected: int  # pages over the capacity or their namespace's quota even after eviction (tails of chains)
    evicted: int  # older pages evicted to make room
    bytes_written: int  # payload bytes of the written pages


class DeleteResult(msgspec.Struct, frozen=True):
    """What `delete_namespace` removed."""

    pages: int
    bytes: int
    transactions: int  # bounded write transactions used


class StoreCounters(msgspec.Struct, frozen=True):
    """Counts kept by this handle in this process since it was opened."""

    pages_read: int = 0  # pages copied out to callers
    misses: int = 0  # get_into/exists_prefix calls that stopped before the end of their batch
    checksum_failures: int = 0  # pages that failed verification on read (checksum or size): misses, quarantined
    read_errors: int = 0  # I/O faults on read (served as misses)
    write_errors: int = 0  # faults on write (a server gone, a timeout): the batch failed, counted as rejected
    format_lost: int = 0  # batches refused because the store's format record is gone (a shared store lost its data)
    pages_written: int = 0
    pages_existing: int = 0
    pages_rejected: int = 0
    pages_evicted: int = 0
    flushes: int = 0  # access-time flushes written
    flush_errors: int = 0  # automatic flushes that failed (the log is kept for the next one)
    pending_access: int = 0  # pages served and logged in memory, not yet flushed


class StoreStats(msgspec.Struct, frozen=True):
    """A store's totals and this handle's counters."""

    backend: str  # entry-point name, e.g. "lmdb"
    location: str  # path or URL
    format_version: int
    checksum: str  # checksum algorithm name
    layouts: int
    namespaces: int
    pages: int
    bytes: int  # payload bytes stored
    capacity_bytes: int  # payload limit; 0 = unlimited
    namespace_quota_bytes: int  # payload limit of each namespace; 0 = none
    footprint_bytes: int  # what the store occupies in its medium (file size for LMDB)
    counters: StoreCounters


class VerifyFinding(msgspec.Struct, frozen=True):
    """One problem `verify()` found. `kind` is one of VERIFY_KINDS."""

    kind: str
    page_hash: str | None  # hex, when the finding is about one page (dangling_index: the page the entry names)
    detail: str
    repaired: bool = False  # verify(repair=True) fixed it: see VerifyReport.removals for what went


VERIFY_KINDS: dict[str, str] = {
    "checksum_mismatch": "page bytes do not match their checksum",
    "size_mismatch": "page size differs from its metadata or its layout",
    "hash_mismatch": "the page hash is not H(parent || tokens) of its metadata (a page filed under a wrong hash)",
    "missing_meta": "a page without metadata",
    "missing_page": "metadata without a page",
    "orphan": "the head of a chain whose parent is neither a stored page nor its namespace root: it and every "
              "page below it (counted in the detail) are unreachable",
    "namespace_mismatch": "a page whose namespace or layout differs from its parent's, or whose parent is the "
                          "root of another namespace or layout",
    "unknown_layout": "a page written under a layout the store does not record",
    "unknown_namespace": "a page of a namespace missing from the registry",
    "missing_index": "a page missing from an index (children, namespace, access order)",
    "dangling_index": "an index entry naming a page that is not stored (or not under that parent)",
    "counter_mismatch": "registry counters differ from the pages stored",
    "damaged_record": "a namespace, layout or store record that does not decode",
    "structure_corrupt": "the store's own structure (an LMDB B-tree page, its catalogue of sub-databases) is "
                         "damaged: the walk of it failed or died; the detail says where it got to",
}
# What verify(repair=True) does per kind. Removed pages go with their whole subtree (what was reachable only
# through them). `unknown_layout` and `unknown_namespace` are reported, never repaired: the missing record cannot
# be rebuilt from the pages, and the pages are not provably unreachable (re-registering the layout, or
# delete_namespace, settles them).
REPAIRS: dict[str, str] = {
    "checksum_mismatch": "remove the page and its subtree",
    "size_mismatch": "remove the page and its subtree",
    "hash_mismatch": "remove the page and its subtree",
    "missing_meta": "remove the page bytes and the subtree below them",
    "missing_page": "remove the metadata and its subtree",
    "orphan": "remove the chain head and its subtree",
    "namespace_mismatch": "remove the page and its subtree",
    "missing_index": "re-add the index entry",
    "dangling_index": "remove the index entry",
    "counter_mismatch": "recount every registry counter from the pages",
    "damaged_record": "remove the record; a namespace's or a layout's pages go with it (they cannot be registered "
                      "again without it); totals are recounted",
    "structure_corrupt": "rebuild: copy every page that reads back sound into a fresh store, verify it, and swap it "
                         "in atomically; every page that could not be copied is listed as removed",
}


class VerifyRemoval(msgspec.Struct, frozen=True):
    """One record `verify(repair=True)` removed."""

    kind: str  # the VERIFY_KINDS kind of the finding that caused it
    page_hash: str  # hex of the page removed (what="index": of the page the entry named)
    what: str  # "page" (bytes, metadata, index entry), "bytes" (bytes without metadata), "meta" (metadata without
    #            bytes, and its index entry), "index" (one children entry), "record" (a namespace or layout record;
    #            `page_hash` is then its key)
    nbytes: int  # payload bytes freed
    below: str | None = None  # hex of the finding's page when this one went as part of that page's subtree


class VerifyReport(msgspec.Struct, frozen=True):
    """The outcome of a full integrity scan.

    `ok` and `findings` describe the store as scanned, before any repair. With repair, `repaired` counts the
    findings fixed (those with `repaired=True`) and `removals` lists every record removed, one entry each: a
    finding's own page and every page below it (`below` names the finding's page).
    """

    ok: bool  # no findings
    pages_checked: int
    bytes_checked: int
    findings: list[VerifyFinding]
    repaired: int = 0  # findings fixed by verify(repair=True)
    removals: list[VerifyRemoval] = []  # every record verify(repair=True) removed


class CapacityPolicy(msgspec.Struct, frozen=True):
    """How much payload a store may hold and how it makes room."""

    capacity_bytes: int = 0  # payload limit; 0 = unlimited. Recorded in the store so every process agrees
    namespace_quota_bytes: int = 0  # payload limit of each namespace (a tenant); 0 = none. Recorded likewise
    evict_headroom: float = 0.02  # evict this fraction of the capacity beyond the need: one scan, many puts


class AccessPolicy(msgspec.Struct, frozen=True):
    """When recorded reads (hits, access times) are written back."""

    flush_reads: int = 4096  # flush once this many reads (get_into calls that served pages) are logged
    flush_interval_s: float = 10.0  # ... or when the oldest pending read is this old (checked on each call)


@runtime_checkable
class L3Store(Protocol):
    """A persistent page store keyed by page hash. Every backend implements this (DESIGN §6)."""

    location: str  # the path or URL it was opened at
    layout: KVLayout | None  # the layout this handle writes under (None: inspect/read only)
    readonly: bool

    def exists_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many pages from the start of `hashes` are stored (stops at the first gap)."""

    def get_into(self, hashes: Sequence[bytes], out_views: Sequence[Any]) -> int:
        """Copy pages into caller-provided writable byte views (numpy/torch uint8, memoryview); return how many
        consecutive pages from the start were copied. A missing, corrupt or unreadable page ends the run."""

    def put(self, hashes: Sequence[bytes], pages: Sequence[Any], origins: Sequence[PageOrigin]) -> PutResult:
        """Store a batch of pages in one transaction; pages already stored are left as they are."""

    def delete_namespace(self, ns_id: bytes) -> DeleteResult:
        """Remove every page of one namespace and its registry record, in bounded transactions."""

    def namespaces(self) -> list[NamespaceRecord]:
        """The namespace registry."""

    def set_shares(self, namespace: Namespace, shares: Shares) -> None:
        """Record `namespace`'s shares with the registry (`Shares()` clears them); every process sees them."""

    def shares(self) -> list[NamespaceShares]:
        """Every namespace's recorded shares."""

    def layouts(self) -> list[KVLayout]:
        """Every layout the store holds."""

    def root(self, namespace: Namespace, layout: KVLayout | None = None) -> bytes:
        """The hash root of `namespace` under `layout` (default: this handle's): where its prefix tree starts."""

    def children(self, page_hash: bytes) -> list[ChildInfo]:
        """Stored children of a page hash or of a root, hottest first."""

    def page_meta(self, page_hash: bytes) -> PageMeta | None:
        """A page's metadata, or None when it is not stored."""

    def stats(self) -> StoreStats:
        """Totals and counters."""

    def verify(self, repair: bool = False) -> VerifyReport:
        """Scan every page and index; with `repair`, remove what is provably corrupt or unreachable (REPAIRS),
        in bounded transactions, and never a page that is reachable from its namespace root and sound."""

    def flush(self) -> None:
        """Write pending access times and hit counts."""

    def close(self) -> None:
        """Flush and release the handle. Idempotent."""


def page_origins(layout: KVLayout, tokens: bytes, namespace: Namespace,
                 parent: bytes | None = None) -> tuple[list[bytes], list[PageOrigin]]:
    """Page hashes and origins of the whole pages of packed `tokens` in `namespace`, chained from `parent`
    (default: the namespace root under `layout`). What a writer passes to `L3Store.put`."""
    step = layout.page_size * TOKEN_BYTES
    start = hash_root(layout.layout_id, namespace) if parent is None else parent
    hashes = extend_chain(start, tokens, layout.page_size)
    parents = [start, *hashes[:-1]]
    origins = [PageOrigin(namespace, parents[i], tokens[i * step:(i + 1) * step]) for i in range(len(hashes))]
    return hashes, origins


def check_page_hashes(hashes: Sequence[bytes]) -> None:
    """Raise InvalidInput unless every element is a PAGE_HASH_BYTES-long bytes value."""
    if all(type(h) is bytes for h in hashes) and set(map(len, hashes)) <= {PAGE_HASH_BYTES}:
        return  # the common case, checked at C speed: reads run this on every batch
    for h in hashes:
        if not isinstance(h, bytes) or len(h) != PAGE_HASH_BYTES:
            raise InvalidInput(f"a page hash must be {PAGE_HASH_BYTES} bytes, got {h!r:.60}")


def out_views_for(hashes: Sequence[bytes], out_views: Sequence[Any], layout: KVLayout | None = None
                  ) -> list[memoryview]:
    """`get_into`'s argument checks, the same for every backend: valid page hashes and one writable byte view
    per hash, of a page's size under `layout` when the handle has one (InvalidInput otherwise). Returns those
    views."""
    if len(out_views) < len(hashes):
        raise InvalidInput(f"get_into needs one out view per page hash: {len(out_views)} views, {len(hashes)} hashes")
    check_page_hashes(hashes)
    outs = [byte_view(v) for v in out_views[:len(hashes)]]
    if layout is not None:
        want = layout.bytes_per_page  # a property: computed once, not per view
        if any(len(out) != want for out in outs):
            raise InvalidInput(f"get_into needs out views of {want} bytes (a page of layout {layout.describe()}), "
                               f"got {sorted({len(o) for o in outs})}")
    return outs


def put_views(layout: KVLayout | None, hashes: Sequence[bytes], pages: Sequence[Any],
              origins: Sequence[PageOrigin]) -> list[memoryview]:
    """`put`'s argument checks, the same for every backend: a handle with a layout, one page and one origin per
    valid page hash, each page of the layout's size and the hash of its origin's parent and tokens, and no page
    whose parent in the same batch is in another namespace (InvalidInput otherwise). Returns the pages' bytes."""
    if layout is None:
        raise InvalidInput("put needs a layout: open the store with layout=...")
    if not (len(hashes) == len(pages) == len(origins)):
        raise InvalidInput(f"put needs as many pages and origins as hashes: {len(hashes)} hashes, "
                           f"{len(pages)} pages, {len(origins)} origins")
    check_page_hashes(hashes)
    nbytes, step = layout.bytes_per_page, layout.page_size * TOKEN_BYTES
    views = []
    for h, page, origin in zip(hashes, pages, origins):
        mv = page_bytes(page)
        if len(mv) != nbytes:
            raise InvalidInput(f"page {h.hex()} has {len(mv)} bytes, layout {layout.describe()} needs {nbytes}")
        if len(origin.tokens) != step:
            raise InvalidInput(f"page {h.hex()}: {len(origin.tokens)} token bytes, a page holds {step}")
        if extend_chain(origin.parent, origin.tokens, layout.page_size)[0] != h:
            raise InvalidInput(f"page {h.hex()} is not the hash of its parent and tokens in this origin")
        views.append(mv)
    batch_ns = {h: o.namespace.id for h, o in zip(hashes, origins)}
    for h, origin in zip(hashes, origins):
        up = batch_ns.get(origin.parent)
        if up is not None and up != origin.namespace.id:
            raise InvalidInput(f"page {h.hex()}: its parent in this batch is in another namespace than "
                               f"{origin.namespace.label}")
    return views



def layout_to_register(location: str, layout: KVLayout, held: dict[bytes, LayoutRecord], register: bool) -> bool:
    """Opening a handle with `layout`: whether the store must register it now (False: it holds it already).
    LayoutMismatch, naming the layouts held, when it does not hold it and `register` is off."""
    if layout.layout_id in held:
        return False
    if not register:
        raise LayoutMismatch(location, layout.describe(), [r.layout.describe() for r in held.values()])
    return True

def namespace_root(namespace: Namespace, layout: KVLayout | None) -> bytes:
    """`L3Store.root`: the hash root of `namespace` under `layout` (InvalidInput when the handle has none)."""
    if layout is None:
        raise InvalidInput("root() needs a layout: open the store with one or pass it")
    return hash_root(layout.layout_id, namespace)


def byte_view(view: Any) -> memoryview:
    """For backends' `get_into`: a flat writable byte memoryview of a caller's page buffer (numpy array, CPU
    torch tensor, bytearray). numpy views are the fast path (a torch tensor costs a `.numpy()` call per view:
    pass `tensor.numpy()` rows)."""
    if type(view) is not np.ndarray and hasattr(view, "numpy") and hasattr(view, "device"):
        if view.device.type != "cpu":
            raise InvalidInput(f"page views must be in host memory, got a tensor on {view.device}")
        view = view.numpy()
    mv = memoryview(view)
    if mv.readonly:
        raise InvalidInput("page views must be writable")
    if not mv.c_contiguous:
        raise InvalidInput("page views must be contiguous (one page is one span)")
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def page_bytes(page: Any) -> memoryview:
    """For backends' `put`: a flat byte memoryview of a page to write (numpy array, CPU torch tensor, bytes)."""
    if not isinstance(page, (bytes, bytearray, memoryview)) and hasattr(page, "numpy") and hasattr(page, "device"):
        page = page.detach().cpu().numpy()
    mv = memoryview(page)
    if not mv.c_contiguous:
        raise InvalidInput("pages must be contiguous (one page is one span)")
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def scheme_of(url_or_path: str) -> str:
    """The backend scheme of a store location: the URL scheme, or DEFAULT_SCHEME for a plain path."""
    m = _SCHEME.match(str(url_or_path))
    return m.group(1).lower() if m else DEFAULT_SCHEME


def backends() -> dict[str, Any]:
    """Registered backends: entry-point name (URL scheme) -> entry point (not yet imported)."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def backend_class(scheme: str) -> type:
    """The backend class registered for `scheme`; UnknownBackend naming the registered schemes otherwise."""
    found = backends()
    if scheme not in found:
        known = ", ".join(sorted(found)) or "none"
        raise UnknownBackend(f"{scheme}://", f"no L3 backend registered for scheme {scheme!r} (registered: {known})")
    return found[scheme].load()


def open_store(url_or_path: str, layout: KVLayout | None = None, *, create: bool = False, readonly: bool = False,
               add_layout: bool = False, **options: Any) -> L3Store:
    """Open the store at a path (LMDB) or URL (the backend registered for its scheme).

    `layout`: the layout this handle writes under. It must be one the store holds (LayoutMismatch names those it
    holds) unless `create` makes a new store or `add_layout` registers it. `create`: make the store when it does
    not exist. `readonly`: refuse writes. Backend-specific `options` (capacity, map size, policies) pass through.
    """
    if "\0" in str(url_or_path):
        raise InvalidInput("a store location cannot hold a NUL byte")
    cls = backend_class(scheme_of(url_or_path))
    return cls.open(str(url_or_path), layout=layout, create=create, readonly=readonly, add_layout=add_layout,
                    **options)
