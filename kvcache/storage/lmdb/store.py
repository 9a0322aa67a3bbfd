"""LMDBStore: kvc's default L3, one embedded LMDB environment per store directory.

Named sub-databases (all keys are 16-byte page hashes unless said otherwise)::

    pages       page hash -> [u64 checksum, little-endian][payload]   the checksum travels with the bytes (codec)
    meta        page hash -> PageMeta (msgpack); hits and last access rewritten as reads are folded in (access)
    children    parent hash -> child page hash (dupsort, dupfixed)     walks a namespace's tree from its root
    namespaces  namespace id -> NamespaceRecord (msgpack)               never the salt
    layouts     layout id -> LayoutRecord (msgpack)                     every KVLayout the store holds
    store       b"format" -> StoreFormat, b"totals" -> StoreTotals, b"capacity" -> u64 payload limit,
                b"ns_quota" -> u64 payload limit of each namespace,
                b"shares/" + namespace id -> NamespaceShares (msgpack): one tenant's shares (kvcache.types.shares);
                stores written before shares have none, and an older kvc ignores these keys;
                b"serve/", b"drop/", b"drop_seq": the live caches serving it and its drop records (`serve_records`)
    removals    b"h" + page hash / b"n" + namespace id -> why and when it was removed; b"q" + seq -> the log's
                order (`removals`: the newest REMOVALS_KEPT; stores written before it get it from their next writer)

The parts, one module each: `env` (the environment per process: opening, sharing, fork), `shared_env` (its
transactions, map growth, close), `bookkeeping` (registry counters, totals, limits and eviction inside write
transactions), `put` (one batch, one write transaction), `access` (reads logged in memory and pages quarantined on
read, folded into the next write transaction), `tree` (a page's children and the heat of its subtree), `delete` (a
namespace's offboarding), `integrity` (this backend's side of the shared integrity audit, `kvcache.storage.verify`)
and `salvage` (the audit of a store too damaged to open in this process, and its rebuild); `codec` (the page
value, checksums, the format record) is shared with other backends. `LMDBStore` is the handle over them, built of
parts of its own: its lease on the environment (`lease`), its access records, and the data plane's reads and
writes (`reads`: `exists_prefix`, `get_into`; `writes`: `put`, `flush`, `delete_namespace`). This module opens it
and answers the rest through them: the registry views and limits, serving and drop records, the audit.

Integrity (`integrity`): every stored page should hang from its namespace root through stored pages of the same
namespace and layout. `put` keeps that: it refuses a token page whose parent is neither its namespace root nor a
stored page of its namespace (the whole batch), and links an engine page whose parent is unknown under its
namespace root instead (an engine page's hash is its key's under that root: it needs no parent to be read).
Eviction keeps it too (it takes leaves only). A page dropped after failing its checksum, a parent whose records
were lost to damage, or a chain written before `put` refused unknown parents leaves pages below a gap. Those are
reported as `orphan` (one finding per chain head, its subtree counted in the detail) and stay until a writer
stores the missing page again (which heals the chain) or `verify(repair=True)` removes them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import lmdb

# StoreError: re-exported, as the names below are
from ...errors import InvalidInput, StoreDamaged, StoreError  # noqa: F401
from ...types.ids import NamespaceId, PageHash
from ...types.layout import KVLayout
from ...types.namespace import Namespace
from ...types.removals import PageRemoval, RemovalReason
from ...types.shares import NamespaceShares, Shares
from ..api import (
    AccessPolicy,
    CapacityPolicy,
    ChildInfo,
    DeleteResult,
    DropRecord,
    LayoutRecord,
    NamespaceRecord,
    PageMeta,
    PageOrigin,
    PutResult,
    ServeRecord,
    StoreCounters,
    StoreStats,
    VerifyReport,
)
from ..chain import chain_key_of
from ..checks import check_page_hashes, layout_to_register, namespace_root

# The names below are this backend's as much as their modules': re-exported for code and tests that know them here.
from ..codec import (  # noqa: F401
    CHECKSUM_FIELD,
    CHECKSUMS,
    DEFAULT_CHECKSUM,
    FORMAT_MAGIC,
    FORMAT_VERSION,
    HEADER,
    Checksum,
    StoreFormat,
    decode_meta,
    encoder,
)
from ..handle import StoreHandle, new_counts
from ..keyfile import create_key, refuse_mismatch, store_key
from ..location import StoreLocation
from ..maintenance import StoreMaintenance
from ..verify import verify
from ..verify_parts import AuditScope
from ..verify_repair import removed_pages
from .access import AccessRecords
from .bookkeeping import (  # noqa: F401
    StoreTotals,
    has_pages_of,
    key_evidence,
    layout_records,
    limits,
    namespace_records,
    read_shares,
    read_totals,
    set_limits,
    write_shares,
)
from .env import (  # noqa: F401
    DEFAULT_DURABILITY,
    DEFAULT_MAP_SIZE,
    DURABILITY,
    MAX_DBS,
    MAX_READERS,
    acquire,
    lock_file_writable,
    release,
    remove_failed_create,
    resolve_location,
)
from .integrity import REPAIR_BATCH_PAGES, VERIFY_CHUNK_PAGES, LMDBIntegrity  # noqa: F401
from .lease import EnvLease
from .maintenance import LMDBMaintenance
from .pagemap import damaged_detail, refuse_damaged
from .reads import PageReads
from .removals import lookup as removal_lookup
from .serve_records import add_drop, delete_serve, put_serve, read_drop_seq, read_drops, read_serves
from .shared_env import SharedEnv
from .tree import child_pages, children
from .writes import PageWrites

BACKEND = "lmdb"
KEY_CHECK_RECORDS = 256  # namespace records with roots an open checks its key file against (keyfile.KeyEvidence)


class LMDBStore(StoreHandle):
    """The default L3 backend (see the module docstring). Open with `LMDBStore.open` or `open_store`.

    A handle belongs to one process; after a fork, the child's first call reopens the environment. Handles on
    one path in one process share its Environment. Methods are safe to call from several threads.
    """

    backend = BACKEND
    _shown_as = "path"
    maintenance: ClassVar[StoreMaintenance | None] = LMDBMaintenance()  # of a closed store, by location

    def __init__(self, shared: SharedEnv, location: str, layout: KVLayout | None, readonly: bool,
                 access: AccessPolicy, map_size: int, durability: str, lock: bool = True) -> None:
        # the location as given to open, credentials removed (`StoreLocation`): it is shown; `path` is opened
        self.location = str(StoreLocation(location))
        self.path = shared.path
        self.layout = layout
        self.readonly = readonly
        self.access_policy = access
        checksum = CHECKSUMS[shared.format.checksum]
        self._counts = new_counts()
        # Reads not yet folded into `meta`, and pages that failed their checksum here (misses until dropped).
        self._access = AccessRecords(access, checksum, self._counts)
        self._lease = EnvLease(shared, readonly, map_size, durability, lock, on_fork=self._access.reset)
        self._reads = PageReads(self._lease, self._access, self._counts, checksum, layout)
        self._writes = PageWrites(self._lease, self._access, self._counts, checksum, layout)
        # (sub-database, records walked, last key): called as verify and delete_namespace walk the store
        self.progress: Callable[[str, int, bytes | None], None] | None = None

    # -- opening --------------------------------------------------------------------------------------------

    @classmethod
    def open(cls, location: str, layout: KVLayout | None = None, *, create: bool = False, readonly: bool = False,
             add_layout: bool = False, capacity: CapacityPolicy | None = None, access: AccessPolicy | None = None,
             map_size: int = DEFAULT_MAP_SIZE, durability: str = DEFAULT_DURABILITY,
             checksum: str = DEFAULT_CHECKSUM, lock: bool = True) -> "LMDBStore":
        """Open the store at `location` (a path or ``lmdb://PATH``).

        `layout`: the layout this handle writes under; it must be held by the store unless the store is created
        now or `add_layout` registers it (LayoutMismatch otherwise, naming the layouts held). `capacity`: record
        new payload limits (every process then uses them). `map_size`: initial map size in bytes (grows on
        demand). `durability`: a key of DURABILITY (the first handle opened in a process sets it for the
        environment). `checksum`: the algorithm of a store created now (a key of CHECKSUMS); an existing store
        keeps the one it was created with. `lock` False (with `readonly`): open lock-free, writing nothing to the
        store's directory, not even LMDB's lock file; a store whose lock file this user cannot write opens so too
        (`lock_free` says which; reads are checked against writers, see `shared_env`).
        """
        if not lock and not readonly:
            raise InvalidInput("a lock-free open (lock=False) is a read-only one: pass readonly=True")
        path, existed, dir_existed = resolve_location(location, readonly, durability, checksum)
        if existed:
            # before LMDB maps it: a read past a cut end is a SIGBUS nothing catches
            refuse_damaged(path, writer=not readonly)
        shared = acquire(path, create and not readonly, map_size, durability, checksum, lock)
        store = cls(shared, location, layout, readonly or not shared.writable, access or AccessPolicy(), map_size,
                    durability, lock)
        try:
            # the salt fingerprints this store records and shows are keyed by its key file (kvcache.types.namespace)
            # the key is part of the store (a keyed store's page hashes too: a new key would leave every page
            # stored unreachable): a missing or damaged one is refused (keyfile), never replaced here
            made = create and not existed and not store.readonly
            store.fingerprint_key = create_key(path) if made else store_key(path, writable=not store.readonly)
            store.chain_key = chain_key_of(shared.format, store.fingerprint_key)
            if not made and store.fingerprint_key is not None and shared.format.keyed_roots and store.chain_key:
                # a valid key that is not the one the pages were written under: refused before anything is
                # written under it (the registry's recorded roots say so; keyfile.KeyEvidence)
                chain_key = store.chain_key
                refuse_mismatch(path, store._lease.read(lambda txn, dbs: key_evidence(txn, dbs, chain_key,
                                                                                      KEY_CHECK_RECORDS)))
            if layout is not None:
                store._bind_layout(layout, register=(create and not existed) or add_layout)
            if capacity is not None:
                store.set_capacity(capacity.capacity_bytes, capacity.namespace_quota_bytes)
            store._writes.evict_headroom = (capacity or CapacityPolicy()).evict_headroom
        except BaseException as exc:
            store.close()
            if create and not existed and shared.refs == 0:
                remove_failed_create(path, not dir_existed)  # a create is whole or not at all (a full disk, say)
            if isinstance(exc, (lmdb.CorruptedError, lmdb.PageNotFoundError)):  # a damaged page of the records
                raise StoreDamaged(path, damaged_detail(f"LMDB found a damaged page ({type(exc).__name__}) "
                                                        f"reading the store's records")) from None
            raise
        return store

    fingerprint_key: bytes | None = None  # from the store's key file; None: read-only, by a user who may not read it
    # The key of the store's page-hash chain roots (`chain`): derived from the key file; b"" for a format-1 store;
    # None for a reader that may not read the key file (it verifies from the roots the namespace records keep).
    chain_key: bytes | None = None

    @property
    def format_version(self) -> int:
        """The version of the store's format record (FORMAT_VERSION, or an older one `kvc migrate` upgrades)."""
        return self._lease.shared.format.version

    @property
    def lock_free(self) -> bool:
        """Whether the store is read without LMDB's lock file (asked with lock=False, or this user cannot write
        it): read-only, nothing written to its directory, every read checked against writers."""
        return self._lease.shared.lock_free

    @classmethod
    def verify_location(cls, location: str, repair: bool = False, force: bool = False, lock: bool = True,
                        scope: AuditScope | None = None,
                        progress: Callable[[str, int], None] | None = None) -> VerifyReport:
        """`verify(repair)` of the store at `location`, safe against a damaged store: every pass runs in a child
        process, a walk that dies in a damaged B-tree is a `structure_corrupt` finding, and `repair` rebuilds
        such a store from what still reads back sound (see `salvage`), keeping the original data file beside it.
        `force`: replace a file that is not LMDB, or one a rebuild keeps nothing of (refused otherwise). `lock`
        False: read it lock-free, writing nothing to its directory (no repair then). `scope`: the check's workers
        and incremental `since` (`kvcache.storage.verify_parts`); `progress(sub-database, records)` as it walks.
        The audit is recorded in the store when it may be written (`AuditHistory`). Opens nothing in this
        process."""
        from .salvage import audit_location  # here: start-up of the commands that never audit skips it

        return audit_location(location, repair, force, lock, scope, progress)

    @classmethod
    def reads_lock_free(cls, location: str) -> bool:
        """Whether this user reads the store at `location` lock-free whatever it asks: it cannot write the
        store's lock file (see `env`)."""
        path, _, _ = resolve_location(location, True, DEFAULT_DURABILITY, DEFAULT_CHECKSUM)
        return not lock_file_writable(path)

    def _bind_layout(self, layout: KVLayout, register: bool) -> None:
        held = self._lease.read(layout_records)
        if not held and not register and not self.readonly:
            # a store that holds no layout record but pages of this layout: its record was lost (a repair keeps
            # the pages, `unknown_layout`); a layout id is a digest of every field, so this is that layout
            register = self._lease.read(lambda txn, dbs: has_pages_of(txn, dbs, layout.layout_id))
        if not layout_to_register(self.path, layout, held, register):
            return
        record = encoder.encode(LayoutRecord(layout, time.time()))
        self._lease.update(lambda txn, dbs: txn.put(layout.layout_id, record, db=dbs.layouts, overwrite=False))

    # -- reading --------------------------------------------------------------------------------------------

    def exists_prefix(self, hashes: Sequence[PageHash]) -> int:
        """How many pages from the start of `hashes` are stored (stops at the first gap)."""
        return self._reads.exists_prefix(hashes)

    def get_into(self, hashes: Sequence[PageHash], out_views: Sequence[Any]) -> int:
        """Copy pages into caller-provided writable byte views, each inside the read transaction and verified on
        the copy; return how many consecutive pages from the start were copied. A missing, corrupt or unreadable
        page ends the run (and is counted). The pages served are logged, for the next write to fold in."""
        done = self._reads.get_into(hashes, out_views)
        if done and not self.readonly:
            self._access.record(hashes[:done], self.flush)
        return done

    def page_meta(self, page_hash: PageHash) -> PageMeta | None:
        """A page's metadata, or None when it is not stored."""
        raw = self._lease.read(lambda txn, dbs: txn.get(page_hash, db=dbs.meta))
        return None if raw is None else decode_meta(raw)

    def children(self, page_hash: PageHash) -> list[ChildInfo]:
        """Stored children of a page hash or of a namespace root, hottest (most reads through the child, then
        most recent) first. Each child's figures cover its subtree (see `tree`): O(subtree) lookups."""
        return children(self._lease.live(), page_hash)

    def child_pages(self, page_hash: PageHash) -> list[ChildInfo]:
        """Stored children of a page hash or of a namespace root, unordered, each with its own figures (not its
        subtree's): one lookup per child. For a walk of a whole tree (`kvcache.ops.dump`)."""
        return child_pages(self._lease.live(), page_hash)

    # -- the registry ---------------------------------------------------------------------------------------

    def root(self, namespace: Namespace, layout: KVLayout | None = None) -> PageHash:
        """The hash root of `namespace` under `layout` (default: this handle's layout)."""
        return namespace_root(namespace, layout or self.layout, self.chain_key, self.path)

    def layouts(self) -> list[KVLayout]:
        """Every layout the store holds, oldest first."""
        return [r.layout for r in sorted(self._lease.read(layout_records).values(), key=lambda r: r.created)]

    def namespaces(self) -> list[NamespaceRecord]:
        """The namespace registry, most pages first."""
        return self._lease.read(namespace_records)

    def capacity_bytes(self) -> int:
        """The payload limit every process applies (0: unlimited)."""
        return self._lease.read(limits)[0]

    def namespace_quota_bytes(self) -> int:
        """The payload limit of each namespace every process applies (0: none)."""
        return self._lease.read(limits)[1]

    def set_capacity(self, capacity_bytes: int, namespace_quota_bytes: int | None = None) -> None:
        """Record new payload limits (`namespace_quota_bytes` None: keep the current quota). Take effect at the
        next put, which evicts down to them."""
        if capacity_bytes < 0 or (namespace_quota_bytes or 0) < 0:
            raise InvalidInput(f"limits must be >= 0, got {capacity_bytes} and {namespace_quota_bytes}")
        self._lease.update(lambda txn, dbs: set_limits(txn, dbs, capacity_bytes, namespace_quota_bytes))

    def set_shares(self, namespace: Namespace, shares: Shares) -> None:
        """Record `namespace`'s shares (`Shares()` clears them). Its `store_bytes` takes effect at its next put,
        which evicts its own pages down to it."""
        self._lease.check_writable()
        info = namespace.info(self.fingerprint_key)
        record = (None if shares.empty else
                  NamespaceShares(namespace.id_hex, info.extra_key, info.salt_fingerprint, shares, time.time()))
        self._lease.update(lambda txn, dbs: write_shares(txn, dbs, namespace.id, record))

    def shares(self) -> list[NamespaceShares]:
        """Every namespace's shares."""
        return self._lease.read(read_shares)

    def stats(self) -> StoreStats:
        """Totals from the store and this handle's counters."""
        shared = self._lease.live()

        def figures(txn: lmdb.Transaction) -> tuple[StoreTotals, tuple[int, int], int, int]:
            return (read_totals(txn, shared.dbs), limits(txn, shared.dbs), txn.stat(shared.dbs.layouts)["entries"],
                    txn.stat(shared.dbs.namespaces)["entries"])

        totals, (capacity, quota), n_layouts, n_ns = shared.reading(figures)
        footprint = os.path.getsize(os.path.join(self.path, "data.mdb"))
        return StoreStats(BACKEND, self.location, shared.format.version, shared.format.checksum, n_layouts, n_ns,
                          totals.pages, totals.bytes, capacity, quota, footprint, self.counters())

    def counters(self) -> StoreCounters:
        """This handle's counters."""
        fields = {k: v for k, v in self._counts.items() if k in StoreCounters.__struct_fields__}
        return StoreCounters(**fields, pending_access=self._access.log.pages)

    def map_size(self) -> int:
        """The current LMDB map size in bytes."""
        return self._lease.live().env.info()["map_size"]

    # -- writing --------------------------------------------------------------------------------------------

    def put(self, hashes: Sequence[PageHash], pages: Sequence[Any], origins: Sequence[PageOrigin]) -> PutResult:
        """Store a batch of pages in one write transaction (metadata, indexes and counters with it; see `put`).

        Every token page's parent must be its namespace's root or a stored page of its namespace (one earlier in
        the batch counts): a batch with any other token page is refused whole (InvalidInput). An engine page
        (`PageOrigin.key`) under a parent that is no such page is stored under its namespace root. Pages may be
        given as lists of segments (`checks.Segments`). Pages already stored are left as they are (`existing`);
        `outcomes` says what became of each page. Over a namespace's limit (its store share, else the quota), the oldest
        leaf pages (no stored children) of that namespace are evicted to make room; over the capacity, the
        oldest leaf pages of any namespace. Pages that still do not fit are `rejected`: once a page of a
        namespace is rejected, so are the namespace's later pages in the batch (all of them, at the capacity),
        so what is stored of a chain stays a prefix. Logged reads are written in the same transaction.
        """
        return self._writes.put(hashes, pages, origins, self.chain_key, self.fingerprint_key)

    def flush(self) -> None:
        """Write logged reads (hit counts, access times) in one transaction, and drop pages seen corrupt."""
        self._writes.flush(self.fingerprint_key)

    def delete_namespace(self, ns_id: NamespaceId, reason: RemovalReason = RemovalReason.DROP) -> DeleteResult:
        """Remove every page of namespace `ns_id` (16 bytes) and its registry record; the removal log records the
        namespace removed for `reason` (DROP: an offboarding, TTL: an expiry), once.

        Pages are found by scanning `meta` in chunks of short read transactions and removed in bounded write
        transactions (see `delete`), so a large tenant's offboarding never holds the writer lock (or pins old
        pages) for long. Scans repeat until one finds nothing, so pages a concurrent writer adds meanwhile go too."""
        return self._writes.delete_namespace(ns_id, reason, self.fingerprint_key, self.progress)

    def removals(self, hashes: Sequence[PageHash], namespace: NamespaceId | None = None) -> list[PageRemoval | None]:
        """Per hash, the newest record of the removal log that answers for it (see `L3Store.removals`), read in one
        short read transaction: a lookup per hash, one for `namespace`."""
        check_page_hashes(hashes)
        if namespace is not None and (not isinstance(namespace, bytes) or len(namespace) != 16):
            raise InvalidInput(f"a namespace id is 16 bytes, got {namespace!r:.60}")
        return self._lease.read(lambda txn, dbs: removal_lookup(txn, dbs.removals, hashes, namespace))

    # -- who serves the store, what was dropped from it (kvcache.storage.serving) --------------------------

    def register_serve(self, record: ServeRecord) -> None:
        """Record a live cache serving this store."""
        self._lease.update(lambda txn, dbs: put_serve(txn, dbs, record))

    def unregister_serve(self, token: str) -> None:
        """Remove a serving record (no error when it is gone)."""
        self._lease.update(lambda txn, dbs: delete_serve(txn, dbs, token))

    def serves(self) -> list[ServeRecord]:
        """Every serving record, stale ones included."""
        return self._lease.read(read_serves)

    def record_drop(self, ns_id: NamespaceId, extra_key: str | None, salt_fingerprint: str | None,
                    by: str) -> DropRecord:
        """Record a drop as the next of the store's drop sequence (before the namespace's pages go)."""
        self._lease.check_writable()
        if not isinstance(ns_id, bytes) or len(ns_id) != 16:
            raise InvalidInput(f"a namespace id is 16 bytes, got {ns_id!r:.60}")
        return self._lease.update(lambda txn, dbs: add_drop(txn, dbs, ns_id, extra_key, salt_fingerprint, by))

    def drops(self, since: int = 0) -> list[DropRecord]:
        """The drop records numbered above `since`, oldest first."""
        return self._lease.read(lambda txn, dbs: read_drops(txn, dbs, since))

    def drop_seq(self) -> int:
        """The number of the last drop recorded (0: none)."""
        return self._lease.read(read_drop_seq)

    # -- integrity ------------------------------------------------------------------------------------------

    def verify(self, repair: bool = False, scope: AuditScope | None = None) -> VerifyReport:
        """Scan every page (checksum, size, hash, metadata, indexes), the prefix trees and the registry counters
        (`kvcache.storage.verify`, read as this backend's `integrity` module describes: payloads in short read
        transactions, the tree, index and counter checks on one snapshot of the metadata).

        `repair` removes what is provably corrupt or unreachable (api.REPAIRS): each finding's page with every
        page below it, dangling index entries, and recounts the registry. Every removal is rechecked inside its
        write transaction (at most REPAIR_BATCH_PAGES records each) and listed in the report's `removals`; a
        page that is sound and reachable from its namespace root is never removed.

        `scope`: read the pages in forked worker processes, or only those changed since a time
        (`kvcache.storage.verify_parts`); findings are a serial audit's. This call records nothing in the store
        (`kvc audit` does: `verify_location`).
        """
        if repair:
            self._lease.check_writable()
        report = verify(LMDBIntegrity(self._lease.live(), self._lease.write, self.progress), repair, scope)
        gone = removed_pages(report)
        if gone:
            self._access.unquarantine(gone)  # a writer may store them again
        return report

    # -- lifetime -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Flush logged reads and release this handle's share of the environment. Idempotent, and safe while other
        threads use the handle: the last handle's release waits for the reads and writes in flight (`shared_env`),
        and a call that starts after the close raises StoreClosed."""
        self._lease.close(self.flush)
