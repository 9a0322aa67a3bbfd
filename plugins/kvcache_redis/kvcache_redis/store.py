"""RedisStore: kvc's L3 page store on Redis or Valkey, shared by engines on many machines.

Opened by URL (``redis://[user:password@]host:port/db``, ``rediss://`` for TLS, ``redis+cluster://host:port`` and
``rediss+cluster://`` for Redis Cluster / Valkey cluster); kvc's own options ride in the query string
(``?prefix=kvc:&timeout=2&connect_timeout=1&backoff_max=2``), every other query option goes to redis-py.

A page and its metadata are fields of one hash, so no reader, and no eviction by the server, ever sees one
without the other. On a standalone server a `put` batch is one Lua script: pages, children entries and
namespace counters of the whole batch appear together or not at all, also under concurrent writers on many
nodes (pages are content-addressed: a page already stored is `existing`, counted once). In cluster mode each
page is written by a one-key script (the page still never appears without its metadata) and the indexes and
counters follow in a pipeline (see README.md, "Cluster mode").

Engine pages (`PageOrigin.key`: a page an engine names by its own key) are page records like token pages, under
the hash of their key below their namespace root, so a reader needs the key alone. Their parent link is a hint:
the put script keeps it when the parent is a stored page of the page's namespace and layout when it writes the
page, and hangs the page from its namespace root otherwise (never refusing the batch, as it does a token page
under an unknown parent). `put` reports an outcome per page (`PutResult.outcomes`), pages may come and go as
segment lists (`checks.Segments`: gathered into the value sent, filled from the value read and summed as filled),
and a read's time goes to every page it served (its hit to the deepest), folded in by `flush`.

Faults: a refused connection, a timeout, a server killed mid-batch or an ``OOM`` reply make a read a miss and a
write a failed (rejected) batch, counted in `stats().counters` (`read_errors`, `write_errors`, `flush_errors`);
nothing is raised to the caller of the data path (`exists_prefix`, `get_into`, `put`, `flush`). After a
connection fault the store backs off (exponentially, up to `backoff_max` seconds), answering misses and failed
writes at once instead of waiting on a dead server, then reconnects. Administrative calls (`namespaces`, `stats`,
`verify`, `delete_namespace`, ...) raise `StoreError` on a fault: their caller must know the answer is missing.

A server that loses its data (a restart without persistence, a FLUSHALL) loses the format record too: every put
checks it inside its script, and a writer that finds it gone stops writing (each batch refused whole and counted
in `format_lost`) and says so once, in one line on the `kvcache_redis` logger, until `kvc init` creates the store
again. Writing on would fill a prefix that is no store with pages whose parents and registry are gone.

The parts, one module each, built by the handle and sharing its `connection.Connection` (the client, its scripts,
the counters and the backoff after a fault): `url` (parsing and showing a store URL), `schema` (the key schema
and the format record), `reads` (the read path and the page tree), `writes` (the write path), `access` (reads
logged and pages quarantined, written back by `flush`), `removing` (guarded removals, namespace deletion, the
removal log), `registry` (layouts, namespace records, shares), `serve_records` (serving records and the drop
log), `scan` (SCAN walks) and `integrity` (this backend's side of the shared audit); `scripts` holds the Lua.
This module is the handle over them: opening, the calls in flight its close waits for, and the PageStore /
L3Store methods, each handed to its part.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from kvcache.storage.kit import (
    AccessPolicy,
    CapacityPolicy,
    ChildInfo,
    DeleteResult,
    DropRecord,
    InvalidInput,
    KVLayout,
    Namespace,
    NamespaceRecord,
    NamespaceShares,
    PageMeta,
    PageOrigin,
    PageRemoval,
    PutResult,
    RemovalReason,
    ServeRecord,
    Shares,
    StoreCounters,
    StoreFormat,
    StoreHandle,
    StoreReadOnly,
    StoreStats,
    StoreUnsupported,
    VerifyReport,
    chain_key_of,
    layout_to_register,
    namespace_root,
    removed_pages,
    verify,
)

from .access import AccessRecords
from .connection import Connection, connect
from .integrity import RedisIntegrity
from .reads import PageReads
from .registry import Registry
from .removing import Removals
from .scan import RecordScan
from .schema import Keys, read_format
from .serve_records import ServeRecords
from .url import StoreUrl, parse_url
from .writes import PageWrites


class RedisStore(StoreHandle):
    """An L3 store in Redis / Valkey (see the module docstring). Open with `RedisStore.open` or `open_store`.

    Safe to use from several threads (redis-py's connection pool) and from many processes and machines at once.
    After a fork, the child's first call opens its own connections.
    """

    backend = "redis"
    # No maintenance of a closed store: its format and key live in its format record, a store of an older format
    # is refused when opened, and there is no data file to size.
    maintenance: ClassVar[None] = None

    def __init__(self, url: StoreUrl, client: Any, layout: KVLayout | None, readonly: bool, access: AccessPolicy,
                 fmt: StoreFormat) -> None:
        self.location = url.shown  # the URL opened, with any password replaced by ***
        self.url = url
        self.cluster = url.cluster
        self.prefix = url.options.prefix
        self.layout = layout
        self.readonly = readonly
        self.access_policy = access
        self.format = fmt
        self.fingerprint_key = bytes.fromhex(fmt.fingerprint_key) if fmt.fingerprint_key else None
        # the key of the page-hash chain roots: a random secret in the format record (kvcache.storage.chain)
        self.chain_key = chain_key_of(fmt, self.fingerprint_key)
        self._keys = keys = Keys.under(self.prefix)
        self._conn = conn = Connection(self, url, client)
        self._scan = RecordScan(conn, keys)
        self._registry = Registry(conn, keys, self._scan, self.fingerprint_key)
        self._removals = Removals(conn, keys, self._scan)
        self._access = AccessRecords(conn, keys, access, readonly, self._removals)
        self._reads = PageReads(conn, keys, self._access, layout, readonly)
        self._writes = PageWrites(conn, keys, self._access, layout, self.chain_key, self.fingerprint_key)
        self._serves = ServeRecords(conn, keys)

    # -- opening --------------------------------------------------------------------------------------------

    @classmethod
    def open(cls, location: str, layout: KVLayout | None = None, *, create: bool = False, readonly: bool = False,
             add_layout: bool = False, capacity: CapacityPolicy | None = None, access: AccessPolicy | None = None,
             prefix: str | None = None, timeout: float | None = None, connect_timeout: float | None = None,
             backoff_max: float | None = None, **redis_options: Any) -> "RedisStore":
        """Open the store under the key prefix of `location` (a redis://, rediss://, redis+cluster:// or
        rediss+cluster:// URL).

        `layout`: the layout this handle writes under; it must be held by the store unless the store is created
        now or `add_layout` registers it (LayoutMismatch otherwise). `create`: make the store when the prefix
        holds none. `prefix`, `timeout`, `connect_timeout`, `backoff_max` override the URL's query options;
        `redis_options` go to redis-py. `capacity` limits are not kept by kvc here: Redis' `maxmemory` and its
        policy bound the store (README.md), so a non-zero limit raises StoreUnsupported. A server that cannot
        be reached raises StoreError.
        """
        if capacity is not None and (capacity.capacity_bytes or capacity.namespace_quota_bytes):
            raise StoreUnsupported(location, "the redis backend keeps no capacity or quota of its own: bound it "
                                             "with the server's maxmemory (see kvcache_redis README)")
        overrides = {"prefix": prefix, "timeout": timeout, "connect_timeout": connect_timeout,
                     "backoff_max": backoff_max}
        url = parse_url(location, {k: v for k, v in overrides.items() if v is not None})
        client = connect(url, redis_options)
        try:
            fmt = read_format(client, url, create and not readonly)
            store = cls(url, client, layout, readonly, access or AccessPolicy(), fmt)
            if layout is not None:
                store._bind_layout(layout, register=create or add_layout)
        except BaseException:
            client.close()
            raise
        return store

    def _bind_layout(self, layout: KVLayout, register: bool) -> None:
        if not layout_to_register(self.location, layout, self._registry.layout_records(), register):
            return
        self._check_writable()
        self._registry.add_layout(layout)

    def _check_writable(self) -> None:
        if self.readonly:
            raise StoreReadOnly(self.location, "cannot write: the store is opened read-only")

    # -- reading --------------------------------------------------------------------------------------------

    @StoreHandle.in_flight
    def exists_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many pages from the start of `hashes` are stored (stops at the first gap). A fault is a miss."""
        return self._reads.exists_prefix(hashes)

    @StoreHandle.in_flight
    def get_into(self, hashes: Sequence[bytes], out_views: Sequence[Any]) -> int:
        """Copy pages into caller-provided writable byte views (one pipelined round trip for the batch), each
        verified on the copy; return how many consecutive pages from the start were copied. A missing or corrupt
        page ends the run (and is counted); a fault is a miss."""
        return self._reads.get_into(hashes, out_views)

    def page_meta(self, page_hash: bytes) -> PageMeta | None:
        """A page's metadata (hits and last access as of the last flush), or None when it is not stored."""
        return self._reads.page_meta(page_hash)

    def children(self, page_hash: bytes) -> list[ChildInfo]:
        """Stored children of a page hash or of a namespace root, hottest (most reads through the child, then
        most recent) first. A child's figures cover its subtree: one pipelined round trip per level below it."""
        return self._reads.children(page_hash)

    def child_pages(self, page_hash: bytes) -> list[ChildInfo]:
        """Stored children of a page hash or of a namespace root, unordered, each with its own figures (not its
        subtree's): two round trips. For a walk of a whole tree (`kvcache.ops.dump`), where `children` would cost
        a round trip per level below each child."""
        return self._reads.child_pages(page_hash)

    def root(self, namespace: Namespace, layout: KVLayout | None = None) -> bytes:
        """The hash root of `namespace` under `layout` (default: this handle's layout)."""
        return namespace_root(namespace, layout or self.layout, self.chain_key, self.location)

    # -- the registry: layouts, namespaces, shares ----------------------------------------------------------

    def layouts(self) -> list[KVLayout]:
        """Every layout the store holds, oldest first."""
        return self._registry.layouts()

    def namespaces(self) -> list[NamespaceRecord]:
        """The namespace registry, most pages first."""
        return self._registry.namespaces()

    def set_shares(self, namespace: Namespace, shares: Shares) -> None:
        """Record `namespace`'s shares (`Shares()` clears them). A `store_bytes` share is kept by rejecting the
        namespace's new pages over it (this backend evicts nothing itself)."""
        self._check_writable()
        self._registry.set_shares(namespace, shares)

    def shares(self) -> list[NamespaceShares]:
        """Every namespace's shares."""
        return self._registry.shares()

    # -- who serves the store, what was dropped from it (kvcache.storage.serving) --------------------------

    def register_serve(self, record: ServeRecord) -> None:
        """Record a live cache serving this store."""
        self._check_writable()
        self._serves.register(record)

    def unregister_serve(self, token: str) -> None:
        """Remove a serving record (no error when it is gone)."""
        self._check_writable()
        self._serves.unregister(token)

    def serves(self) -> list[ServeRecord]:
        """Every serving record, stale ones included (one that does not decode is skipped)."""
        return self._serves.serves()

    def record_drop(self, ns_id: bytes, extra_key: str | None, salt_fingerprint: str | None,
                    by: str) -> DropRecord:
        """Record a drop as the next of the store's drop sequence (INCR numbers it; writers on many machines get
        distinct numbers), and forget those beyond DROPS_KEPT."""
        self._check_writable()
        return self._serves.record_drop(ns_id, extra_key, salt_fingerprint, by)

    def drops(self, since: int = 0) -> list[DropRecord]:
        """The drop records numbered above `since`, oldest first."""
        return self._serves.drops(since)

    @StoreHandle.in_flight
    def drop_seq(self) -> int:
        """The number of the last drop recorded (0: none). A live cache reads it before every put, so it is a data
        call: a fault is a StoreError at once during the backoff pause (never a wait on a dead server per put),
        counted in `read_errors`."""
        return self._serves.drop_seq()

    # -- figures --------------------------------------------------------------------------------------------

    def capacity_bytes(self) -> int:
        """0: kvc keeps no payload limit here; the server's maxmemory bounds the store."""
        return 0

    def namespace_quota_bytes(self) -> int:
        """0: no per-namespace quota in this backend."""
        return 0

    @StoreHandle.in_flight
    def stats(self) -> StoreStats:
        """Totals from the registry, the server's memory in use, and this handle's counters."""
        records = self._registry.records()
        n_layouts = self._registry.layout_count()
        footprint = self._conn.used_memory()
        return StoreStats(self.backend, self.location, self.format.version, self.format.checksum, n_layouts,
                          len(records), sum(r.pages for r in records.values()),
                          sum(r.bytes for r in records.values()), 0, 0, footprint, self.counters())

    def counters(self) -> StoreCounters:
        """This handle's counters."""
        with self._conn.lock:
            return StoreCounters(**self._conn.counts, pending_access=self._access.log.pages)

    # -- writing --------------------------------------------------------------------------------------------

    @StoreHandle.in_flight
    def put(self, hashes: Sequence[bytes], pages: Sequence[Any], origins: Sequence[PageOrigin]) -> PutResult:
        """Store a batch of pages: one atomic script on a standalone server (pages, metadata, children entries
        and namespace counters together), one atomic script per page and pipelined index updates on a cluster.

        Pages already stored are left as they are (`existing`). A batch the server refuses for room (OOM under
        `maxmemory`) is `rejected` whole; one it cannot answer (connection lost, timeout), will not write
        (NOREPLICAS, a read-only replica) or no longer holds the store for (its format record gone) is `failed`
        whole (PageOutcome.FAILED: the store's fault, not a refusal); both are counted and nothing is raised (a
        lost reply may hide a batch that was stored: the next put of it finds it `existing`).
        `outcomes` says which, page by page. Pages may be lists of segments (`checks.Segments`). An engine page
        (`PageOrigin.key`) whose parent is not a stored page of its namespace and layout (nor an earlier one of
        the batch) hangs from its namespace root instead (its recorded parent is the root); a token page's parent
        must be one (InvalidInput otherwise, nothing written).
        """
        self._check_writable()
        return self._writes.put(hashes, pages, origins)

    @StoreHandle.in_flight
    def flush(self) -> None:
        """Write logged reads (hit counts, access times) and drop pages seen corrupt (if still the same bytes).
        A fault keeps the log for the next flush and is counted (`flush_errors`); nothing is raised."""
        self._access.flush()

    # -- removing -------------------------------------------------------------------------------------------

    def removals(self, hashes: Sequence[bytes], namespace: bytes | None = None) -> list[PageRemoval | None]:
        """Per hash, the newest record of the removal log that answers for it (see `L3Store.removals`): one
        HMGET of the log (an administrative read: a fault is a StoreError)."""
        return self._removals.lookup(hashes, namespace)

    def delete_namespace(self, ns_id: bytes, reason: RemovalReason = RemovalReason.DROP) -> DeleteResult:
        """Remove every page of namespace `ns_id` (16 bytes) and its registry record; the removal log records the
        namespace removed for `reason` (DROP: an offboarding, TTL: an expiry), once, with the registry's removal.

        Pages are found by SCAN (SCAN_COUNT keys per round trip) and removed DELETE_BATCH_PAGES per script, so a
        large tenant's offboarding never blocks the server for long. Scans repeat until one finds nothing, so
        pages a concurrent writer adds meanwhile go too."""
        self._check_writable()
        if not isinstance(ns_id, bytes) or len(ns_id) != 16:
            raise InvalidInput(f"a namespace id is 16 bytes, got {ns_id!r:.60}")
        if reason not in (RemovalReason.DROP, RemovalReason.TTL):
            raise InvalidInput(f"a namespace is removed whole for a drop or a TTL expiry, not for {reason!r}")
        self.flush()
        result = self._removals.delete_namespace(ns_id, reason)
        self._access.forget_all()
        return result

    # -- integrity ------------------------------------------------------------------------------------------

    def verify(self, repair: bool = False) -> VerifyReport:
        """Scan every page record (checksum, size, hash, metadata, children index), the prefix trees and the
        registry counters (`kvcache.storage.verify`); with `repair`, remove what is provably corrupt or
        unreachable (base.REPAIRS), each removal re-checked by its script against the record as it is then.

        The scan is not one snapshot: a page written during it can show up as a `dangling_index` (rechecked
        before it is reported) and registry counters moved by concurrent writers as a `counter_mismatch`. Run
        the counter check (and its repair, a recount) when writers are quiet."""
        if repair:
            self._check_writable()
        source = RedisIntegrity(self._conn, self._keys, self._registry, self._scan, self._removals, self.chain_key)
        report = verify(source, repair)
        self._access.forget(removed_pages(report))  # gone: a writer may store them again
        return report

    # -- lifetime -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Flush logged reads (best effort: a fault keeps nothing, the handle is going) and release the
        connections. Idempotent. Calls other threads have in flight end first (a connection dropped under one
        would end it in a stray exception); calls made after it raise StoreClosed."""
        if self._conn.closed:
            return
        try:
            self.flush()
        finally:
            self._conn.closed = True
            self.wait_in_flight()
            self._conn.close()
