"""The L3 store interface: the `L3Store` protocol and the values and records it trades in.

An L3 store maps page hashes to page bytes. A page hash names its whole prefix, its namespace and its layout
(see `kvcache.types.keys`), so a store needs no other key and two namespaces or two layouts can never read each other's
pages. Everything is batched and everything is by page hash.

A page is a token page or an engine page. A token page's hash chains its tokens (`page_origins`); an engine page
is named by an engine's own key (SGLang's chain digests) and its hash is `engine_page_hash(root, key)` under its
namespace/layout root (`engine_origins`), so a reader needs the key alone. Both kinds are stored, checked,
quarantined, audited, limited, shared, expired and deleted alike.

Rules every backend keeps (tests/conformance checks them for each registered backend):

- `exists_prefix` and `get_into` count consecutive pages from the start of the batch and stop at the first gap.
- A page given to `put` or read by `get_into` is one byte buffer or a list/tuple of buffers (segments) whose
  lengths add up to a page: the page's bytes are the segments in order (an engine's host page is split across
  its layers or K and V), or one numpy array / CPU tensor that is contiguous in its innermost axis only (a page
  strided through an engine's host pool): its bytes in C order, copied in one `np.copyto` each way. A read
  verifies the checksum of exactly what it copied into the segments or the array.
- A token page hangs from its namespace root or a stored page of its namespace (an earlier page of the batch
  counts); a batch with any other is refused whole. An engine page's parent is recorded when it is known (a
  stored engine page of its namespace and layout, or one earlier in the batch) and never required: under an
  unknown parent it is stored hanging from its namespace root.
- `put` says what became of each page (`PutResult.outcomes`: a `PageOutcome` per page, in order).
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
  A read credits every page it served with its time, so LRU never evicts what was just read: in the page's own
  `last_access`, or, for a page the read went through to its child (a chain), in that child's (a page's heat,
  which eviction and `children()` use, is its subtree's); a backend may credit every page in its own record.
  The read's hit counts once, at the deepest page it reached.
- A store knows who serves it and what was dropped from it (`kvcache.storage.serving`): each live cache records
  itself and its admin socket (`register_serve`, removed on exit), and every offboarding leaves a `DropRecord`
  (`record_drop`, numbered in order, the last DROPS_KEPT kept) that the other caches of the store follow, so
  none of them writes a dropped namespace back.
- A store keeps a bounded log of the pages it removed and why (`removals`; the rules in
  `kvcache.storage.removals`): every eviction, quarantine and repair removal recorded with the removal, a
  namespace dropped whole (`delete_namespace`, DROP or TTL) once for the namespace; the newest REMOVALS_KEPT kept.

The argument checks every backend shares are in `checks`, the backend registry (`open_store`) in `registry`, and
what a backend outside the core imports in `kit`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec

from ..types.ids import NamespaceId, PageHash
from ..types.keys import TOKEN_BYTES, engine_page_hash, extend_chain, hash_root
from ..types.layout import KVLayout
from ..types.namespace import Namespace
from ..types.removals import PageRemoval, RemovalReason
from ..types.shares import NamespaceShares, Shares


class PageOrigin(msgspec.Struct, frozen=True, gc=False):
    """Where a page comes from, as given to `L3Store.put`: its namespace, parent and tokens (a token page) or
    engine key (an engine page). The store derives the rest (size, checksum, times) itself; `page_origins` builds
    these for a token sequence, `engine_origins` for an engine's keys."""

    namespace: Namespace  # the namespace of the request that produced the page; its id is folded into the hash
    parent: PageHash  # PAGE_HASH_BYTES: the previous page's hash, or the namespace root for a first page
    tokens: bytes  # packed uint32 token ids of a token page (len = TOKEN_BYTES * page_size); b"" for an engine page
    # An engine page's own key (1..64 bytes; SGLang: 32 raw bytes); b"" for a token page. Its hash is then
    # engine_page_hash(root, key), and an unknown parent hangs it from the root instead of refusing the batch.
    key: bytes = b""


class PageMeta(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """What a store records about one page besides its bytes."""

    ns_id: NamespaceId  # 16-byte Namespace.id of the page
    layout_id: bytes  # 16-byte KVLayout.layout_id the page was written under
    parent: PageHash  # PAGE_HASH_BYTES: parent page hash (the namespace root for a first page)
    tokens: bytes  # packed uint32 token ids of the page (TOKEN_BYTES * page_size bytes)
    nbytes: int  # payload size in bytes, = layout.bytes_per_page
    checksum: int  # 64-bit checksum of the payload, seeded by the page hash (algorithm: StoreStats.checksum)
    created: float  # unix seconds of the first write
    last_access: float  # unix seconds of the write or of the last read credited here (the rules), as of the last flush
    hits: int  # reads that ended at this page (a read of a run is credited to its deepest page), as of the last flush
    # An engine page's key (tokens are then b""); b"" for a token page. Last, with a default: records written
    # before it (one element shorter) decode unchanged, and an older kvc reads these (it ignores the extra one).
    key: bytes = b""


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

    page_hash: PageHash  # PAGE_HASH_BYTES
    tokens: bytes  # packed token ids of the child page: the key of the edge from its parent
    nbytes: int  # payload bytes
    hits: int  # reads that reached the child: those that ended anywhere in its subtree, as of the last flush
    last_access: float  # unix seconds, the latest over its subtree, as of the last flush
    key: bytes = b""  # the child's engine key when it is an engine page (`tokens` is then b"")


class PageOutcome(enum.IntEnum):
    """What `put` did with one page of its batch (`PutResult.outcomes`, one byte each). An engine that wants a
    bool per page reads `outcome in STORED` (`stored(outcome)`): REJECTED and FAILED pages are not in the store.
    The two are told apart because they call for different things: a refusal stands until room is made (evict,
    raise a share), a failure is the store's, and the same put may succeed in a moment."""

    WRITTEN = 0  # stored by this put
    EXISTING = 1  # already stored (content-addressed: left as it was), or a repeat of a page written earlier in it
    REJECTED = 2  # refused: over the capacity, its namespace's quota or store share, even after eviction
    FAILED = 3  # not written: the store could not be reached or written (connection lost, timeout, a fault)


STORED = frozenset({PageOutcome.WRITTEN, PageOutcome.EXISTING})  # the outcomes of a page the store holds


def stored(outcome: int) -> bool:
    """Whether a page of `outcome` (a byte of `PutResult.outcomes`) is in the store after its put."""
    return outcome in STORED


class PutResult(msgspec.Struct, frozen=True):
    """What one `put` batch did. `written + existing + rejected + failed` = pages in the batch, and `outcomes`
    says which page is which."""

    written: int  # new pages stored
    existing: int  # pages already stored (content-addressed: left as they were)
    rejected: int  # pages refused: over the capacity, their namespace's quota or share even after eviction
    evicted: int  # older pages evicted to make room
    bytes_written: int  # payload bytes of the written pages
    # The hashes of the `evicted` pages, when the backend names them (LMDB does; a backend that evicts nothing
    # leaves it empty): a cache that wrote them marks them gone from L3 and reports them removed (KV events).
    evicted_hashes: list[PageHash] = []
    # The engine key of each page of `evicted_hashes`, in the same order (b"" for a token page), when the backend
    # names evicted pages: an engine adapter reports what left the store by the engine's own keys (KV events).
    evicted_keys: list[bytes] = []
    # One PageOutcome per page of the batch, in order (len == pages in the batch; every backend fills it): the
    # counts above are the tallies of these bytes.
    outcomes: bytes = b""

    @property
    def failed(self) -> int:
        """Pages not written because the store could not be (PageOutcome.FAILED): counted from `outcomes`, so a
        wrapper that passes the outcomes on (a fenced store) passes the failures on."""
        return self.outcomes.count(PageOutcome.FAILED)


class DeleteResult(msgspec.Struct, frozen=True):
    """What `delete_namespace` removed."""

    pages: int
    bytes: int
    transactions: int  # bounded write transactions used


class ServeRecord(msgspec.Struct, frozen=True):
    """A live cache serving a store, as recorded in the store (`L3Store.register_serve`): where to reach it."""

    token: str  # unique per serving process (its key in the store)
    pid: int
    host: str  # the machine's hostname: a pid and a socket path mean something on that machine only
    socket: str  # the absolute path of its admin socket
    started: float  # unix seconds


class DropRecord(msgspec.Struct, frozen=True):
    """One namespace dropped from a store (`L3Store.record_drop`), kept so that every live cache of the store
    lets go of it too and a second offboarding can tell "already dropped" from "never there"."""

    seq: int  # 1, 2, 3... in the order the drops were recorded (the store's drop sequence)
    ns_id_hex: str  # the raw namespace id, as the registry keys it (the store holds it anyway)
    extra_key: str | None  # as the registry recorded it (None when the store did not hold the namespace)
    salt_fingerprint: str | None
    at: float  # unix seconds
    by: str  # who dropped it: "offline", or the admin socket of the live cache it went through


DROPS_KEPT = 4096  # drop records a store keeps (the oldest go first): live caches read them within a step


class StoreCounters(msgspec.Struct, frozen=True):
    """Counts kept by this handle in this process since it was opened."""

    pages_read: int = 0  # pages copied out to callers
    misses: int = 0  # get_into/exists_prefix calls that stopped before the end of their batch
    checksum_failures: int = 0  # pages that failed verification on read (checksum or size): misses, quarantined
    read_errors: int = 0  # I/O faults on read (served as misses)
    write_errors: int = 0  # faults on write (a server gone, a timeout): the batch failed (PageOutcome.FAILED)
    format_lost: int = 0  # batches failed because the store's format record is gone (a shared store lost its data)
    pages_written: int = 0
    pages_existing: int = 0
    pages_rejected: int = 0  # refused for capacity, a quota or a share (a batch that failed is `write_errors`)
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
    "hash_mismatch": "the page hash is not H(parent || tokens) of its metadata, nor, for an engine page, the hash of "
                     "its key under its namespace root (a page filed under a wrong hash)",
    "missing_meta": "a page without metadata",
    "missing_page": "metadata without a page",
    "orphan": "the head of a chain whose parent is neither a stored page nor its namespace root: it and every "
              "page below it (counted in the detail) are unreachable (a token page's: an engine page's parent is a "
              "hint, its key proves it, so it is never an orphan nor removed with a parent)",
    "namespace_mismatch": "a page whose namespace or layout differs from its parent's, or whose parent is the "
                          "root of another namespace or layout",
    "unknown_layout": "a page written under a layout the store does not record",
    "unknown_namespace": "a page of a namespace missing from the registry",
    "missing_index": "a page missing from an index (children, namespace, access order)",
    "dangling_index": "an index entry naming a page that is not stored (or not under that parent)",
    "counter_mismatch": "registry counters differ from the pages stored",
    "damaged_record": "a namespace, layout or store record that does not decode, or an entry of the store's removal "
                      "log that does not (or names no record)",
    "structure_corrupt": "the store's own structure (an LMDB B-tree page, its catalogue of sub-databases) is "
                         "damaged: the walk of it failed or died; the detail says where it got to",
    "key_file": "the store's fingerprint key file is missing, empty, not a key, or not readable by a user who "
                "writes the store: no id or fingerprint can be derived (restore it, or `kvc init --rekey`)",
    "key_mode": "the store's fingerprint key file may be read or written by group or other (it should be 0600)",
    "key_mismatch": "the store's key file holds a valid key, but not the one its pages were written under: the "
                    "roots the registry recorded are none of the roots it gives (restore the store's own key; a "
                    "repair removes nothing for it)",
    "implausible_meta": "a page's metadata holds a time or a hit count that cannot be: a time outside the store's "
                        "life, created after last_access, more hits than its namespace counted",
}
# What verify(repair=True) does per kind. Removed pages go with their whole subtree (what was reachable only
# through them). `unknown_layout` and `unknown_namespace` are reported, never repaired: the missing record cannot
# be rebuilt from the pages, and the pages are not provably unreachable (re-registering the layout, or
# delete_namespace, settles them). Nor is `key_file`: a lost key cannot be rebuilt (`kvc init --rekey` makes a new
# one, knowingly).
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
                      "again without it); totals are recounted (a removal log entry goes alone: it is diagnostics)",
    "structure_corrupt": "rebuild: copy every page that reads back sound into a fresh store (from the file's pages "
                         "when LMDB's meta pages are lost), verify it, keep the original file beside the store, and "
                         "swap the fresh one in atomically; every page that could not be copied is counted as lost; "
                         "a repair that would keep nothing, or a file that is not LMDB, is refused (--force)",
    "key_mode": "chmod 600 the key file",
    "implausible_meta": "reset the fields that cannot be (times outside the store's life to now, impossible hits to "
                        "0); the page is kept",
}


class SalvageReport(msgspec.Struct, frozen=True):
    """What a rebuild of a damaged store kept and lost (`VerifyReport.salvage`).

    `pages_before` is what the store's own catalogue of sub-databases recorded (-1: unreadable; `lost` then counts
    only the pages seen in the file and not kept, a lower bound, or is -1 when none was seen, and `lost_exact` is
    False). `unreadable_bytes`: bytes of the data
    file in pages that read as no LMDB page at all (zeroed or garbled), plus what a truncation cut off."""

    source: str  # "tree": LMDB read the file; "catalogue": its meta pages were rebuilt from the newest catalogue
    #              found in the file; "scan": no catalogue survived, the records were found in the file's leaf pages
    pages_before: int
    kept: int
    lost: int
    lost_exact: bool
    unreadable_bytes: int
    file_bytes: int  # size of the original data file


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
    original_kept: str | None = None  # with repair: where the data file was kept before anything was rewritten
    salvage: SalvageReport | None = None  # with repair of a damaged structure: what the rebuild kept and lost
    scope: str = "full"  # "full": every page and every check; "incremental": only pages changed since `since`
    since: float | None = None  # incremental: unix seconds; pages written (or read back) since then were checked
    not_checked: list[str] = []  # incremental: the checks it did not do (keys of verify.NOT_CHECKED)
    workers: int = 1  # processes that read the store's pages (1: one pass in the auditing process)
    recorded: bool = False  # written to the store's audit record (`AuditHistory`); False when read-only or lock-free


class AuditRecord(msgspec.Struct, frozen=True):
    """One integrity audit as a store records it (`AuditHistory`)."""

    started: float  # unix seconds, taken in a write transaction before the first page was read: every page
    #                 written later carries a later `PageMeta.created`
    finished: float  # unix seconds
    ok: bool  # nothing found
    scope: str  # "full" or "incremental" (VerifyReport.scope)
    since: float | None  # incremental: the pages changed since then were checked
    pages_checked: int


class AuditHistory(msgspec.Struct, frozen=True):
    """A store's record of its integrity audits: `kvc audit --since last` checks the pages changed since
    `last_clean.started`."""

    last: AuditRecord | None = None  # the latest audit recorded, clean or not
    last_clean: AuditRecord | None = None  # the latest that found nothing (it only ever moves on a clean audit)


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
class PageStore(Protocol):
    """What a cache asks of its L3 (DESIGN §6): pages by hash, batch by batch, and the namespace-wide operations a
    cache performs on its own (dropping a namespace, reading and setting shares). A new backend starts here; a
    `TieredCache`, the I/O worker and the engine adapters need nothing more."""

    location: str  # the path or URL it was opened at
    layout: KVLayout | None  # the layout this handle writes under (None: inspect/read only)
    readonly: bool
    # The key of the store's page-hash chain roots (kvcache.types.keys): what a cache wired to this store chains
    # its page hashes with. UNKEYED_CHAIN (b"") for a format-1 store; None for a reader that may not read the
    # store's secret (it still verifies, from the roots the namespace records keep).
    chain_key: bytes | None

    def exists_prefix(self, hashes: Sequence[PageHash]) -> int:
        """How many pages from the start of `hashes` are stored (stops at the first gap)."""

    def get_into(self, hashes: Sequence[PageHash], out_views: Sequence[Any]) -> int:
        """Copy pages into caller-provided writable byte views (numpy/torch uint8, memoryview), one per page or a
        list of segments per page; return how many consecutive pages from the start were copied. A missing,
        corrupt or unreadable page ends the run. Every page served is credited with the read's time."""

    def put(self, hashes: Sequence[PageHash], pages: Sequence[Any], origins: Sequence[PageOrigin]) -> PutResult:
        """Store a batch of pages (each one buffer or a list of segments) in one transaction; pages already stored
        are left as they are; `outcomes` says what became of each. A backend that evicts pages to make room names
        them in `PutResult.evicted_hashes` (a cache marks them gone). A batch the store could not write (a server
        gone, a timeout) is answered FAILED page by page, or raised as a StoreError; never counted `rejected`,
        which is for refusals (capacity, quota, share)."""

    def delete_namespace(self, ns_id: NamespaceId, reason: RemovalReason = RemovalReason.DROP) -> DeleteResult:
        """Remove every page of one namespace and its registry record, in bounded transactions, and record the
        removal once for the namespace in the removal log: `reason` DROP (an offboarding) or TTL (an expiry)."""

    def set_shares(self, namespace: Namespace, shares: Shares) -> None:
        """Record `namespace`'s shares with the registry (`Shares()` clears them); every process sees them."""

    def shares(self) -> list[NamespaceShares]:
        """Every namespace's recorded shares."""

    def flush(self) -> None:
        """Write pending access times and hit counts."""

    def close(self) -> None:
        """Flush and release the handle. Idempotent."""


@runtime_checkable
class L3Store(PageStore, Protocol):
    """A persistent page store with its administration (DESIGN §6): the registry, the removal and drop logs,
    layouts, the page tree a walk reads, verification and the serving records. Every backend `open_store`
    returns implements this; the CLI, `kvcache.ops` and the live server ask it."""

    def removals(self, hashes: Sequence[PageHash], namespace: NamespaceId | None = None) -> list[PageRemoval | None]:
        """One answer per hash, in order, from the store's bounded removal log (`kvcache.storage.removals`): the
        newest record of what removed that page and when, or None (never removed, or its record aged out of the
        log, or a store without the log). A namespace removed whole (DROP, TTL) is one record for the namespace,
        not one per page: with `namespace` (the id the pages were written under) it answers for every hash of
        that namespace whose own record is older or absent, under that hash (the store cannot tell, after a
        drop, which pages the namespace held). Reads only: a read-only handle answers too."""

    def namespaces(self) -> list[NamespaceRecord]:
        """The namespace registry."""

    def layouts(self) -> list[KVLayout]:
        """Every layout the store holds."""

    def root(self, namespace: Namespace, layout: KVLayout | None = None) -> PageHash:
        """The hash root of `namespace` under `layout` (default: this handle's): where its prefix tree starts."""

    def children(self, page_hash: PageHash) -> list[ChildInfo]:
        """Stored children of a page hash or of a root, hottest first."""

    def page_meta(self, page_hash: PageHash) -> PageMeta | None:
        """A page's metadata, or None when it is not stored."""

    def stats(self) -> StoreStats:
        """Totals and counters."""

    def verify(self, repair: bool = False) -> VerifyReport:
        """Scan every page and index; with `repair`, remove what is provably corrupt or unreachable (REPAIRS),
        in bounded transactions, and never a page that is reachable from its namespace root and sound."""

    def register_serve(self, record: ServeRecord) -> None:
        """Record a live cache serving this store (replaces one with the same token)."""

    def unregister_serve(self, token: str) -> None:
        """Remove a serving record (no error when it is gone)."""

    def serves(self) -> list[ServeRecord]:
        """Every serving record, stale ones included (`kvcache.live.server.live_serves` checks them)."""

    def record_drop(self, ns_id: NamespaceId, extra_key: str | None, salt_fingerprint: str | None,
                    by: str) -> DropRecord:
        """Record that namespace `ns_id` is being dropped, before its pages go: the next number of the store's drop
        sequence, the oldest records beyond DROPS_KEPT removed."""

    def drops(self, since: int = 0) -> list[DropRecord]:
        """The drop records numbered above `since`, oldest first."""

    def drop_seq(self) -> int:
        """The number of the last drop recorded (0: none). One small read: live caches call it before each put."""


def page_origins(layout: KVLayout, tokens: bytes, namespace: Namespace, chain_key: bytes,
                 parent: PageHash | None = None) -> tuple[list[PageHash], list[PageOrigin]]:
    """Page hashes and origins of the whole pages of packed `tokens` in `namespace`, chained from `parent`
    (default: the namespace root under `layout`, keyed by `chain_key`: the store's). What a writer passes to
    `L3Store.put`."""
    step = layout.page_size * TOKEN_BYTES
    start = hash_root(layout.layout_id, namespace, chain_key) if parent is None else parent
    hashes = extend_chain(start, tokens, layout.page_size)
    parents = [start, *hashes[:-1]]
    origins = [PageOrigin(namespace, parents[i], tokens[i * step:(i + 1) * step]) for i in range(len(hashes))]
    return hashes, origins


def engine_origins(layout: KVLayout, namespace: Namespace, chain_key: bytes, keys: Sequence[bytes],
                   parent_key: bytes | None = None) -> tuple[list[PageHash], list[PageOrigin]]:
    """Page hashes and origins of engine pages named by `keys` (an engine's own page keys, in chain order) in
    `namespace` under `layout`, keyed by `chain_key` (the store's): each page's parent is the previous key's
    page, the first one's `parent_key`'s page (the root when None). What a writer of engine pages passes to
    `L3Store.put`; a parent the store does not hold is no error (the page then hangs from the root)."""
    root = hash_root(layout.layout_id, namespace, chain_key)
    hashes = [engine_page_hash(root, k) for k in keys]
    parent = root if parent_key is None else engine_page_hash(root, parent_key)
    origins = []
    for key, h in zip(keys, hashes, strict=True):
        origins.append(PageOrigin(namespace, parent, b"", key))
        parent = h
    return hashes, origins


def engine_hashes(layout: KVLayout, namespace: Namespace, chain_key: bytes, keys: Sequence[bytes]) -> list[PageHash]:
    """The page hashes of engine pages named by `keys` in `namespace` under `layout`, keyed by `chain_key`: all a
    reader needs (`exists_prefix`, `get_into`); no parent is involved."""
    root = hash_root(layout.layout_id, namespace, chain_key)
    return [engine_page_hash(root, k) for k in keys]
