"""RedisStore: kvc's L3 page store on Redis or Valkey, shared by engines on many machines.

Opened by URL (``redis://[user:password@]host:port/db``, ``rediss://`` for TLS, ``redis+cluster://host:port`` and
``rediss+cluster://`` for Redis Cluster / Valkey cluster); kvc's own options ride in the query string
(``?prefix=kvc:&timeout=2&connect_timeout=1&backoff_max=2``), every other query option goes to redis-py.

Key schema (P is the key prefix, default ``kvc:``; several deployments share one Redis under distinct prefixes)::

    P format             string  StoreFormat (msgpack): magic, version, checksum algorithm, created,
                                 fingerprint key (hex)
    P layouts            hash    layout id hex -> LayoutRecord (msgpack)
    P nsidx              set     namespace id hex of every registered namespace
    P shares             hash    <ns id hex> -> NamespaceShares (msgpack); b:<ns id hex> -> its store share in
                                 bytes (only when > 0: what the put script reads). Outlives the namespace's pages
    P ns:<ns id hex>     hash    the namespace record (identity, never the salt; counters; roots)
    P p:<page hash hex>  hash    one page: checksum + payload, PageMeta, namespace, parent, hits, last access
    P c:<hash hex>       set     raw 16-byte hashes of the stored children of a page or of a namespace root
    P serves             hash    token -> ServeRecord (msgpack): the live caches serving the store, their sockets
    P dropseq            string  the number of the last drop recorded (INCR)
    P drops              zset    DropRecord (msgpack) scored by its number; the last DROPS_KEPT are kept
    P rm                 hash    the removal log (kvcache.storage.removals): why and when pages (and namespaces
                                 removed whole) went, a ring of the last REMOVALS_KEPT (scripts.RECORD_LOG)

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
"""

from __future__ import annotations

import errno
import hashlib
import logging
import math
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import msgspec
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvcache.storage.kit import (
    CHECKSUMS,
    DROPS_KEPT,
    FORMAT_MAGIC,
    FORMAT_VERSION,
    HEADER,
    KEYED_ROOTS_VERSION,
    PAGE_HASH_BYTES,
    AccessLog,
    AccessPolicy,
    CapacityPolicy,
    ChildInfo,
    DeleteResult,
    DropRecord,
    Findings,
    Guard,
    InvalidInput,
    KVLayout,
    LayoutRecord,
    Namespace,
    NamespaceId,
    NamespaceInfo,
    NamespaceRecord,
    NamespaceShares,
    NotAStore,
    PageMeta,
    PageOrigin,
    PageOutcome,
    PageRemoval,
    PageRow,
    PageView,
    PutResult,
    Removal,
    RemovalReason,
    RepairOps,
    ScannedPage,
    ServeRecord,
    Shares,
    Snapshot,
    StoreCounters,
    StoreError,
    StoreFormat,
    StoreHandle,
    StoreReadOnly,
    StoreStats,
    StoreUnsupported,
    VerifyReport,
    chain_key_of,
    check_page_hashes,
    count_read,
    decode_format,
    decode_layout,
    decode_meta,
    decode_or_none,
    decode_shares_record,
    encoder,
    hash_root,
    layout_to_register,
    namespace_root,
    new_chain_key,
    new_counts,
    new_fingerprint_key,
    newest_removal,
    out_views_for,
    put_views,
    removals_kept,
    removed_pages,
    verify,
)

from . import scripts

log = logging.getLogger("kvcache_redis")
T = TypeVar("T")
# One logged read: (unix seconds, the pages it served in order (the last is the deepest), their namespace id hex,
# how many): what `flush` folds into the page records and the namespace counters.
_Read = tuple[float, tuple[bytes, ...], str, int]

CHECKSUM = "xxh3_64"  # codec.CHECKSUMS: the same algorithm, under the same name, as the LMDB backend's default
DEFAULT_PREFIX = "kvc:"
DEFAULT_TIMEOUT_S = 2.0  # socket timeout of one command: how long a hung server can stall an L3 job
DEFAULT_CONNECT_TIMEOUT_S = 1.0
DEFAULT_BACKOFF_MAX_S = 2.0  # longest pause between reconnection attempts after a fault
BACKOFF_START_S = 0.05
SCAN_COUNT = 512  # keys per SCAN step (verify, delete_namespace): bounded work per round trip
DELETE_BATCH_PAGES = 512  # pages removed per script when deleting a namespace (a script blocks the server)
REPAIR_BATCH_PAGES = 512
TOUCH_KEYS = 512  # records one access-folding script updates on a standalone server (a script blocks the server)
MAX_PENDING_FACTOR = 16  # logged reads kept while flushes fail: this many times AccessPolicy.flush_reads
_KVC_QUERY = ("prefix", "timeout", "connect_timeout", "backoff_max")
_XXH3 = CHECKSUMS[CHECKSUM]  # a page's `d` field is a codec page value: [u64 checksum][payload]

# Faults of the connection or the server, as opposed to a bug in a request: these degrade to a miss or a
# failed write. ResponseError covers OOM and a server that refuses writes (a replica, MISCONF on a failed save).
_FAULTS = (redis.ConnectionError, redis.TimeoutError, redis.ResponseError, redis.exceptions.ClusterError,
           redis.exceptions.RedisClusterException, OSError)


class RedisOptions(msgspec.Struct, frozen=True):
    """kvc's connection options (URL query parameters or `open` keywords)."""

    prefix: str = DEFAULT_PREFIX  # prepended to every key
    timeout: float = DEFAULT_TIMEOUT_S  # socket timeout of one command, seconds
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S
    backoff_max: float = DEFAULT_BACKOFF_MAX_S  # longest pause between reconnection attempts


_dec_info = msgspec.msgpack.Decoder(NamespaceInfo)
_dec_serve = msgspec.msgpack.Decoder(ServeRecord).decode
_dec_drop = msgspec.msgpack.Decoder(DropRecord).decode


def _page_value(page_hash: bytes, page: PageView) -> bytes:
    """A page record's `d` field: the checksum, then one copy of the caller's page (its segments gathered in
    order), summed as copied (what is summed is exactly what is sent)."""
    value = bytearray(HEADER + len(page))
    payload = memoryview(value)[HEADER:]
    if type(page) is memoryview:
        payload[:] = page
    else:
        page.gather(payload)
    value[:HEADER] = _XXH3.of(payload, page_hash).to_bytes(HEADER, "little")
    del payload  # a bytearray with a view on it cannot be copied out
    return bytes(value)


def _glob_escape(text: str) -> str:
    """`text` as a literal in a Redis MATCH pattern (a prefix may hold glob characters)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class _Url(msgspec.Struct, frozen=True):
    """A parsed store URL: what redis-py gets, whether it is a cluster, kvc's options, the printable form."""

    client_url: str  # redis:// or rediss:// URL without kvc's query options
    cluster: bool
    options: RedisOptions
    shown: str  # the URL with any password replaced by ***


MAX_SECONDS = 3600.0  # the longest timeout or backoff a URL may ask for


# Query parameters whose values are credentials (redis-py reads password= and username= from the query too).
_SECRET_QUERY = re.compile(r"pass|secret|token|auth|credential|key", re.I)


def _redacted(location: str) -> str:
    """How a message names a URL that did not parse: its scheme alone. Its other parts cannot be told apart (an
    unencoded '/' in a password cuts the authority short), so any of them may hold the password."""
    m = re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", location)
    return f"{m.group(0)} URL" if m else "a store URL"


def _shown(location: str) -> str:
    """`location` (parsed already) rebuilt from its parts with each credential (the userinfo's password, a secret
    query value) as ***: by structure, never by replacing the secret's text wherever it occurs (a password `1`
    would turn 127.0.0.1 into ***27.0.0.***, and the template gives it back)."""
    parts = urlsplit(location)
    netloc = parts.netloc
    if parts.password:
        userinfo, _, host = netloc.rpartition("@")
        netloc = f"{userinfo.split(':', 1)[0]}:***@{host}"
    query = []
    for field in parts.query.split("&") if parts.query else []:
        name, eq, value = field.partition("=")
        query.append(f"{name}{eq}***" if eq and value and _SECRET_QUERY.search(unquote(name)) else field)
    return (location[:len(parts.scheme) + 3] + netloc + parts.path + ("?" + "&".join(query) if query else "")
            + ("#" + parts.fragment if parts.fragment else ""))


def _said(exc: BaseException) -> str:
    """kvc's own words for a fault redis-py raised: its kind, the OS error under a connection fault, the code that
    starts a server's error reply. A library's message may quote what it was handed (a URL, a reply echoing a
    command), so it is never printed."""
    if isinstance(exc, redis.AuthenticationError):
        return "the server refused the credentials (a wrong or missing password or user)"
    if isinstance(exc, redis.TimeoutError):
        return "no answer within the timeout"
    if isinstance(exc, redis.BusyLoadingError):
        return "the server is loading its data set"
    if isinstance(exc, (redis.ConnectionError, OSError)):
        cause = exc if isinstance(exc, OSError) else exc.__cause__ or exc.__context__
        if isinstance(cause, OSError) and cause.errno:
            return f"cannot connect ({errno.errorcode.get(cause.errno, cause.errno)}: {os.strerror(cause.errno)})"
        return "the connection failed or was closed"
    if isinstance(exc, redis.ResponseError):
        code = str(exc).split(" ", 1)[0]
        return f"the server answered {code}" if re.fullmatch(r"[A-Z][A-Z_-]{1,31}", code) else \
            "the server answered an error"
    return f"{type(exc).__name__} from the redis client"


def _seconds(name: str, value: Any) -> float:
    """A URL's number of seconds: finite, > 0 and at most MAX_SECONDS."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise InvalidInput(f"{name} must be a number of seconds, got {value!r}") from None
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_SECONDS):
        raise InvalidInput(f"{name} must be > 0 and at most {MAX_SECONDS:g} seconds, got {value!r}")
    return seconds


def _parse_url(location: str, overrides: dict[str, Any]) -> _Url:
    try:
        parts = urlsplit(location)
        hostname, _ = parts.hostname, parts.port  # both parse lazily: a bad host or port raises here
    except ValueError:
        raise InvalidInput(f"{_redacted(location)}: not a usable store URL (its host or port does not parse; a "
                           f"password holding '/', '?' or '#' must be percent-encoded)") from None
    scheme = parts.scheme.lower()
    if scheme not in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
        raise InvalidInput(f"{_redacted(location)}: not a redis://, rediss://, redis+cluster:// or "
                           f"rediss+cluster:// URL")
    if not hostname:
        raise InvalidInput(f"{scheme}:// URL without a host")
    cluster = scheme.endswith("+cluster")
    base = scheme.split("+")[0]
    query = parse_qsl(parts.query, keep_blank_values=True)
    ours = {k: v for k, v in query if k in _KVC_QUERY}
    rest = [(k, v) for k, v in query if k not in _KVC_QUERY]
    fields: dict[str, Any] = {}
    for name in _KVC_QUERY:
        value = overrides.pop(name, None)
        if value is None:
            value = ours.get(name)
        if value is None:
            continue
        if name == "prefix":
            if not isinstance(value, str) or not value:
                raise InvalidInput("the key prefix must be a non-empty string")
            fields[name] = value
        else:
            fields[name] = _seconds(name, value)
    path = parts.path
    if cluster and path.strip("/") not in ("", "0"):
        raise InvalidInput("a Redis Cluster has database 0 only: drop the /db part of the URL")
    if not cluster and not re.fullmatch(r"/?(\d{1,6})?", path):
        # an '@' in the path is a password's unencoded '/' that cut the authority short: the path is not echoed
        said = "the URL's path" if "@" in path else repr(path)
        raise InvalidInput(f"{said}: the database of a redis:// URL is a number, as in redis://host:6379/0 (a "
                           f"password holding '/' must be percent-encoded)")
    client_url = urlunsplit((base, parts.netloc, "" if cluster else path, urlencode(rest), ""))
    return _Url(client_url, cluster, RedisOptions(**fields), _shown(location))


class RedisStore(StoreHandle):
    """An L3 store in Redis / Valkey (see the module docstring). Open with `RedisStore.open` or `open_store`.

    Safe to use from several threads (redis-py's connection pool) and from many processes and machines at once.
    After a fork, the child's first call opens its own connections.
    """

    backend = "redis"
    # No maintenance of a closed store: its format and key live in its format record, a store of an older format
    # is refused when opened, and there is no data file to size.
    maintenance: ClassVar[None] = None

    def __init__(self, url: _Url, client: Any, layout: KVLayout | None, readonly: bool, access: AccessPolicy,
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
        self._client = client
        self._lock = threading.Lock()  # guards the access log, the corrupt set, the counters and the backoff
        # `_Read` entries. A server away (or full) for long must not grow the log without bound: access figures
        # are approximate, the oldest reads are the ones to forget.
        self._log = AccessLog(access, keep=MAX_PENDING_FACTOR * access.flush_reads)
        self._corrupt: dict[bytes, str] = {}  # page -> SHA-1 hex of the bytes that failed their checksum
        self._counts = new_counts()
        self._down_until = 0.0  # monotonic time before which data calls do not try the server
        self._backoff = 0.0
        self._gone = False  # the last put found the format record gone (said once until a put succeeds)
        self._closed = False
        p = self.prefix.encode()
        self._k_format, self._k_layouts, self._k_nsidx = p + b"format", p + b"layouts", p + b"nsidx"
        self._k_shares = p + b"shares"
        self._k_serves, self._k_dropseq, self._k_drops = p + b"serves", p + b"dropseq", p + b"drops"
        self._p_page, self._p_children, self._p_ns = p + b"p:", p + b"c:", p + b"ns:"
        self._k_removals = p + b"rm"
        self._s_put_batch = client.register_script(scripts.PUT_BATCH)
        self._s_put_page = client.register_script(scripts.PUT_PAGE)
        self._s_ns_adjust = client.register_script(scripts.NS_ADJUST)
        self._s_touch = client.register_script(scripts.TOUCH)
        self._s_remove_batch = client.register_script(scripts.REMOVE_BATCH)
        self._s_remove_page = client.register_script(scripts.REMOVE_PAGE)
        self._s_record = client.register_script(scripts.RECORD)

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
        url = _parse_url(location, {k: v for k, v in overrides.items() if v is not None})
        client = _connect(url, redis_options)
        try:
            fmt = cls._open_format(client, url, create and not readonly)
            store = cls(url, client, layout, readonly, access or AccessPolicy(), fmt)
            if layout is not None:
                store._bind_layout(layout, register=create or add_layout)
        except BaseException:
            client.close()
            raise
        return store

    @staticmethod
    def _open_format(client: Any, url: _Url, create: bool) -> StoreFormat:
        key = url.options.prefix.encode() + b"format"
        try:
            raw = client.get(key)
            if raw is None:
                if not create:
                    raise NotAStore(url.shown, f"no kvc store under prefix {url.options.prefix!r} (create=True "
                                               f"makes one)")
                fresh = StoreFormat(FORMAT_MAGIC, FORMAT_VERSION, CHECKSUM, time.time(),
                                    new_fingerprint_key().hex(), new_chain_key().hex())
                client.set(key, encoder.encode(fresh), nx=True)  # two creators race: one record wins, both read it
                raw = client.get(key)
        except _FAULTS as exc:
            raise StoreError(url.shown, f"cannot reach the server: {_said(exc)}") from None
        fmt: StoreFormat | None
        try:
            fmt = decode_format(raw)
        except msgspec.DecodeError:
            fmt = None
        if fmt is None or fmt.magic != FORMAT_MAGIC:
            raise NotAStore(url.shown, f"the key {key.decode()!r} is not a kvc store record")
        if fmt.version > FORMAT_VERSION:
            raise StoreUnsupported(url.shown, f"store format {fmt.version} is newer than this kvc "
                                              f"({FORMAT_VERSION})")
        if fmt.checksum != CHECKSUM:
            raise StoreUnsupported(url.shown, f"store checksums use {fmt.checksum!r}, this backend {CHECKSUM!r}")
        if fmt.version < KEYED_ROOTS_VERSION or not fmt.chain_key:
            # Its page hashes are rooted under no key, so a salt could be tested against them; `kvc migrate`
            # rewrites LMDB stores only (a swap by one rename), and a Redis store is a cache that refills.
            raise StoreUnsupported(url.shown, f"store format {fmt.version} predates keyed page-hash roots and "
                                              f"kvc migrate upgrades LMDB stores only: delete the keys under prefix "
                                              f"{url.options.prefix!r} and let the cache refill")
        return fmt

    def _bind_layout(self, layout: KVLayout, register: bool) -> None:
        if not layout_to_register(self.location, layout, self._layout_records(), register):
            return
        self._check_writable()
        self._admin(lambda c: c.hsetnx(self._k_layouts, layout.layout_id.hex(),
                                       encoder.encode(LayoutRecord(layout, time.time()))))

    # -- keys and plumbing ----------------------------------------------------------------------------------

    def _pk(self, page_hash: bytes) -> bytes:
        return self._p_page + page_hash.hex().encode()

    def _ck(self, page_hash: bytes) -> bytes:
        return self._p_children + page_hash.hex().encode()

    def _nk(self, ns_hex: str) -> bytes:
        return self._p_ns + ns_hex.encode()

    def _call(self, script: Any, keys: list[Any], args: list[Any], client: Any) -> Any:
        """Run a script on `client` (the store's client or a pipeline of it). redis-py's cluster pipeline refuses
        EVALSHA (and shadows `eval`), so a cluster sends EVAL with the text as a plain command, routed by its
        first key: the server caches the compiled script by its SHA-1 all the same."""
        if self.cluster:
            return client.execute_command("EVAL", script.script, len(keys), *keys, *args)
        return script(keys=keys, args=args, client=client)

    def _live(self) -> Any:
        if self._closed:
            raise self.closed_error()
        return self._client

    def _available(self) -> bool:
        """Whether a data call may try the server now (not inside a backoff pause after a fault)."""
        return time.monotonic() >= self._down_until

    def _fault(self, counter: str, exc: BaseException | None = None) -> None:
        """Count a fault; a connection fault (not an error reply: the server is there) starts, or lengthens, the
        pause before the next attempt."""
        with self._lock:
            self._counts[counter] += 1
            if isinstance(exc, redis.ResponseError):
                return
            self._backoff = min(max(2 * self._backoff, BACKOFF_START_S), self.url.options.backoff_max)
            self._down_until = time.monotonic() + self._backoff

    def _ok(self) -> None:
        if self._backoff:
            with self._lock:
                self._backoff = 0.0

    @StoreHandle.in_flight
    def _admin(self, call: Any) -> Any:
        """Run an administrative call: a fault raises StoreError (its caller must know the answer is missing)."""
        client = self._live()
        try:
            return call(client)
        except _FAULTS as exc:
            raise StoreError(self.location, f"redis: {_said(exc)}") from None

    def _check_writable(self) -> None:
        if self.readonly:
            raise StoreReadOnly(self.location, "cannot write: the store is opened read-only")

    # -- reading --------------------------------------------------------------------------------------------

    @StoreHandle.in_flight
    def exists_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many pages from the start of `hashes` are stored (stops at the first gap). A fault is a miss."""
        if not hashes:
            return 0
        check_page_hashes(hashes)
        client = self._live()
        found = 0
        if self._available():
            try:
                pipe = client.pipeline(transaction=False)
                for h in hashes:
                    pipe.exists(self._pk(h))
                corrupt = self._corrupt
                for h, there in zip(hashes, pipe.execute(), strict=True):
                    if not there or (corrupt and h in corrupt):
                        break
                    found += 1
                self._ok()
            except _FAULTS as exc:
                self._fault("read_errors", exc)
        else:
            self._counts["read_errors"] += 1
        return count_read(self._counts, found, len(hashes))

    @StoreHandle.in_flight
    def get_into(self, hashes: Sequence[bytes], out_views: Sequence[Any]) -> int:
        """Copy pages into caller-provided writable byte views (one pipelined round trip for the batch), each
        verified on the copy; return how many consecutive pages from the start were copied. A missing or corrupt
        page ends the run (and is counted); a fault is a miss."""
        outs = out_views_for(hashes, out_views, self.layout)
        n = len(outs)
        if n == 0:
            return 0
        client = self._live()
        done = 0
        ns_hex = ""
        if self._available():
            try:
                pipe = client.pipeline(transaction=False)
                for h in hashes:
                    pipe.hmget(self._pk(h), "d", "n")
                replies = pipe.execute()
                self._ok()
            except _FAULTS as exc:
                self._fault("read_errors", exc)
                replies = []
        else:
            self._counts["read_errors"] += 1
            replies = []
        corrupt = self._corrupt
        for h, out, (value, ns) in zip(hashes, outs, replies, strict=False):
            if value is None or ns is None or (corrupt and h in corrupt):
                break
            # A stored size other than a page's (the out views were checked above) is a damaged record: a miss,
            # quarantined like a checksum failure. Checked on the copy, still in cache: what the caller got is
            # what was verified.
            bad = len(value) - HEADER != len(out)
            if not bad:
                if type(out) is memoryview:
                    out[:] = memoryview(value)[HEADER:]
                    summed = _XXH3.of(out, h)
                else:  # a page in segments (checks.Segments): copied in order, summed as copied
                    out.fill(memoryview(value)[HEADER:])
                    summed = _XXH3.of_parts(out.views, h)
                bad = summed != int.from_bytes(value[:HEADER], "little")
            if bad:
                with self._lock:
                    corrupt[h] = hashlib.sha1(value).hexdigest()
                    self._counts["checksum_failures"] += 1
                break
            done += 1
            ns_hex = ns.decode()
        count_read(self._counts, done, n, copied=True)
        if done and not self.readonly:
            self._record_access(tuple(hashes[:done]), ns_hex)
        return done

    def _record_access(self, served: tuple[bytes, ...], ns_hex: str) -> None:
        # One entry per read: its hit goes to the deepest page it reached, its time to every page it served
        # (kvcache.storage.api: LRU must never evict what was just read, chained or not).
        if self._log.record(time.time(), served, ns_hex, len(served)):
            self.flush()

    def page_meta(self, page_hash: bytes) -> PageMeta | None:
        """A page's metadata (hits and last access as of the last flush), or None when it is not stored."""
        m, hits, last = self._admin(lambda c: c.hmget(self._pk(page_hash), "m", "h", "a"))
        if m is None:
            return None
        meta = decode_meta(m)
        return msgspec.structs.replace(meta, hits=int(hits or 0), last_access=float(last or meta.last_access))

    def children(self, page_hash: bytes) -> list[ChildInfo]:
        """Stored children of a page hash or of a namespace root, hottest (most reads through the child, then
        most recent) first. A child's figures cover its subtree: one pipelined round trip per level below it."""
        kids = sorted(self._admin(lambda c: c.smembers(self._ck(page_hash))))
        out: list[ChildInfo] = []
        if not kids:
            return out
        metas = self._admin(lambda c: self._hmget_many(c, kids, ("m", "h", "a")))
        heads: list[tuple[bytes, PageMeta, int, float]] = []
        for child, (m, hits, last) in zip(kids, metas, strict=True):
            if m is not None:
                meta = decode_meta(m)
                heads.append((child, meta, int(hits or 0), float(last or meta.last_access)))
        # Walk every head's subtree level by level; `top` maps each page reached to the head it is under.
        heat = {child: [hits, last] for child, _, hits, last in heads}
        top = {child: child for child, _, _, _ in heads}
        level = [child for child, _, _, _ in heads]
        seen = set(level)
        while level:
            below = self._admin(lambda c, level=level: self._smembers_many(c, level))
            nxt = []
            for parent, members in zip(level, below, strict=True):
                for k in members:
                    if k not in seen:
                        seen.add(k)
                        top[k] = top[parent]
                        nxt.append(k)
            if not nxt:
                break
            figures = self._admin(lambda c, nxt=nxt: self._hmget_many(c, nxt, ("h", "a")))
            for k, (hits, last) in zip(nxt, figures, strict=True):
                if hits is not None:
                    acc = heat[top[k]]
                    acc[0] += int(hits)
                    acc[1] = max(acc[1], float(last or 0))
            level = nxt
        for child, meta, _, _ in heads:
            hits, last = heat[child]
            out.append(ChildInfo(child, meta.tokens, meta.nbytes, int(hits), last, key=meta.key))
        out.sort(key=lambda c: (-c.hits, -c.last_access))
        return out

    def child_pages(self, page_hash: bytes) -> list[ChildInfo]:
        """Stored children of a page hash or of a namespace root, unordered, each with its own figures (not its
        subtree's): two round trips. For a walk of a whole tree (`kvcache.ops.dump`), where `children` would cost
        a round trip per level below each child."""
        kids = list(self._admin(lambda c: c.smembers(self._ck(page_hash))))
        if not kids:
            return []
        metas = self._admin(lambda c: self._hmget_many(c, kids, ("m", "h", "a")))
        out = []
        for child, (m, hits, last) in zip(kids, metas, strict=True):
            if m is not None:
                meta = decode_meta(m)
                out.append(ChildInfo(child, meta.tokens, meta.nbytes, int(hits or 0), float(last or meta.last_access),
                                     key=meta.key))
        return out

    def _hmget_many(self, client: Any, hashes: Sequence[bytes], fields: tuple[str, ...]) -> list[list[Any]]:
        pipe = client.pipeline(transaction=False)
        for h in hashes:
            pipe.hmget(self._pk(h), *fields)
        return pipe.execute()

    def _smembers_many(self, client: Any, hashes: Sequence[bytes]) -> list[set[bytes]]:
        return self._smembers_keys(client, [self._ck(h) for h in hashes])

    @staticmethod
    def _smembers_keys(client: Any, keys: Sequence[bytes]) -> list[set[bytes]]:
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.smembers(k)
        return pipe.execute()

    def root(self, namespace: Namespace, layout: KVLayout | None = None) -> bytes:
        """The hash root of `namespace` under `layout` (default: this handle's layout)."""
        return namespace_root(namespace, layout or self.layout, self.chain_key, self.location)

    def _layout_records(self) -> dict[bytes, LayoutRecord]:
        raw = self._admin(lambda c: c.hgetall(self._k_layouts))
        return {bytes.fromhex(k.decode()): decode_layout(v) for k, v in raw.items()}

    def layouts(self) -> list[KVLayout]:
        """Every layout the store holds, oldest first."""
        return [r.layout for r in sorted(self._layout_records().values(), key=lambda r: r.created)]

    def _registry(self) -> dict[str, NamespaceRecord]:
        ids = sorted(m.decode() for m in self._admin(lambda c: c.smembers(self._k_nsidx)))

        def fetch(c: Any) -> list[dict]:
            pipe = c.pipeline(transaction=False)
            for ns_hex in ids:
                pipe.hgetall(self._nk(ns_hex))
            return pipe.execute()

        out = {}
        for ns_hex, rec in zip(ids, self._admin(fetch) if ids else [], strict=True):
            if b"info" not in rec:
                continue  # removed meanwhile (delete_namespace), or a counter stub: not a registered namespace
            info = _dec_info.decode(rec[b"info"])
            roots = sorted(k[2:].decode() for k in rec if k.startswith(b"r:"))
            out[ns_hex] = NamespaceRecord(ns_hex, info.extra_key, info.salt_fingerprint, int(rec.get(b"pages", 0)),
                                          int(rec.get(b"bytes", 0)), float(rec.get(b"created", 0)),
                                          float(rec.get(b"last", 0)), int(rec.get(b"hits", 0)), roots)
        return out

    def namespaces(self) -> list[NamespaceRecord]:
        """The namespace registry, most pages first."""
        return sorted(self._registry().values(), key=lambda r: (-r.pages, r.ns_id_hex))

    def set_shares(self, namespace: Namespace, shares: Shares) -> None:
        """Record `namespace`'s shares (`Shares()` clears them). A `store_bytes` share is kept by rejecting the
        namespace's new pages over it (this backend evicts nothing itself)."""
        self._check_writable()
        ns_hex = namespace.id_hex
        info = namespace.info(self.fingerprint_key)

        def write(c: Any) -> None:
            if shares.empty:
                c.hdel(self._k_shares, ns_hex, "b:" + ns_hex)
                return
            record = NamespaceShares(ns_hex, info.extra_key, info.salt_fingerprint, shares, time.time())
            c.hset(self._k_shares, ns_hex, encoder.encode(record))
            if shares.store_bytes:
                c.hset(self._k_shares, "b:" + ns_hex, shares.store_bytes)
            else:
                c.hdel(self._k_shares, "b:" + ns_hex)

        self._admin(write)

    def shares(self) -> list[NamespaceShares]:
        """Every namespace's shares."""
        raw = self._admin(lambda c: c.hgetall(self._k_shares))
        records = (decode_or_none(decode_shares_record, v) for k, v in raw.items() if not k.startswith(b"b:"))
        return sorted((r for r in records if r is not None), key=lambda r: r.ns_id_hex)

    # -- who serves the store, what was dropped from it (kvcache.storage.serving) --------------------------

    def register_serve(self, record: ServeRecord) -> None:
        """Record a live cache serving this store."""
        self._check_writable()
        self._admin(lambda c: c.hset(self._k_serves, record.token, encoder.encode(record)))

    def unregister_serve(self, token: str) -> None:
        """Remove a serving record (no error when it is gone)."""
        self._check_writable()
        self._admin(lambda c: c.hdel(self._k_serves, token))

    def serves(self) -> list[ServeRecord]:
        """Every serving record, stale ones included (one that does not decode is skipped)."""
        raw = self._admin(lambda c: c.hgetall(self._k_serves))
        found = (decode_or_none(_dec_serve, v) for v in raw.values())
        return sorted((r for r in found if r is not None), key=lambda r: (r.started, r.token))

    def record_drop(self, ns_id: bytes, extra_key: str | None, salt_fingerprint: str | None,
                    by: str) -> DropRecord:
        """Record a drop as the next of the store's drop sequence (INCR numbers it; writers on many machines get
        distinct numbers), and forget those beyond DROPS_KEPT."""
        self._check_writable()
        if not isinstance(ns_id, bytes) or len(ns_id) != 16:
            raise InvalidInput(f"a namespace id is 16 bytes, got {ns_id!r:.60}")

        def write(c: Any) -> DropRecord:
            seq = int(c.incr(self._k_dropseq))
            record = DropRecord(seq, ns_id.hex(), extra_key, salt_fingerprint, time.time(), by)
            c.zadd(self._k_drops, {encoder.encode(record): seq})
            c.zremrangebyscore(self._k_drops, "-inf", seq - DROPS_KEPT)
            return record

        return self._admin(write)

    def drops(self, since: int = 0) -> list[DropRecord]:
        """The drop records numbered above `since`, oldest first."""
        raw = self._admin(lambda c: c.zrangebyscore(self._k_drops, f"({max(0, since)}", "+inf"))
        found = (decode_or_none(_dec_drop, v) for v in raw)
        return [r for r in found if r is not None]

    @StoreHandle.in_flight
    def drop_seq(self) -> int:
        """The number of the last drop recorded (0: none). A live cache reads it before every put, so it is a data
        call: a fault is a StoreError at once during the backoff pause (never a wait on a dead server per put),
        counted in `read_errors`."""
        client = self._live()
        if not self._available():
            raise StoreError(self.location, "redis: the server is not answering (backing off)")
        try:
            raw = client.get(self._k_dropseq)
        except _FAULTS as exc:
            self._fault("read_errors", exc)
            raise StoreError(self.location, f"redis: {_said(exc)}") from None
        self._ok()
        return int(raw) if raw is not None else 0

    def capacity_bytes(self) -> int:
        """0: kvc keeps no payload limit here; the server's maxmemory bounds the store."""
        return 0

    def namespace_quota_bytes(self) -> int:
        """0: no per-namespace quota in this backend."""
        return 0

    @StoreHandle.in_flight
    def stats(self) -> StoreStats:
        """Totals from the registry, the server's memory in use, and this handle's counters."""
        records = self._registry()
        n_layouts = self._admin(lambda c: c.hlen(self._k_layouts))
        try:
            info = self._client.info("memory")
            # A cluster client answers per node: the footprint is the sum over them.
            footprint = (int(info.get("used_memory", 0)) if "used_memory" in info
                         else sum(int(v.get("used_memory", 0)) for v in info.values() if isinstance(v, dict)))
        except _FAULTS:
            footprint = 0
        return StoreStats(self.backend, self.location, self.format.version, self.format.checksum, n_layouts,
                          len(records), sum(r.pages for r in records.values()),
                          sum(r.bytes for r in records.values()), 0, 0, footprint, self.counters())

    def counters(self) -> StoreCounters:
        """This handle's counters."""
        with self._lock:
            return StoreCounters(**self._counts, pending_access=self._log.pages)

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
        views = put_views(self.layout, hashes, pages, origins, self.chain_key)
        values = [_page_value(h, mv) for h, mv in zip(hashes, views, strict=True)]
        if not hashes:
            return PutResult(0, 0, 0, 0, 0, outcomes=b"")
        layout = self.layout
        assert layout is not None  # put_views refuses a handle opened without one
        nbytes = layout.bytes_per_page
        client = self._live()
        if not self._available():
            return self._failed_put(len(hashes))  # inside a backoff pause: the server was gone a moment ago
        self._flush_quietly()  # logged reads ride with writes, as in the LMDB backend
        layout_id, now = layout.layout_id, time.time()
        chain_key = self.chain_key
        assert chain_key is not None  # every store this backend opens keeps one (`_open_format`)
        namespaces = {o.namespace for o in origins}
        roots: dict[bytes, bytes] = {ns.id: hash_root(layout_id, ns, chain_key) for ns in namespaces}
        metas: list[bytes] = []
        root_metas: list[bytes] = []  # an engine page's metadata hanging from its root ("" for the others)
        for o, v in zip(origins, values, strict=True):
            meta = PageMeta(o.namespace.id, layout_id, o.parent, o.tokens, nbytes, int.from_bytes(v[:HEADER], "little"),
                            now, now, 0, o.key)
            metas.append(encoder.encode(meta))
            root = roots[o.namespace.id]
            hangs = o.key and o.parent != root
            root_metas.append(encoder.encode(msgspec.structs.replace(meta, parent=root)) if hangs else b"")
        batch = _Batch(hashes, values, metas, root_metas, origins, roots, now)
        try:
            outcomes = self._put_cluster(client, batch) if self.cluster else self._put_batch(client, batch)
            self._ok()
        except redis.ResponseError as exc:
            if str(exc).startswith("KVCNOSTORE"):
                return self._store_gone(len(hashes))
            if str(exc).startswith("KVCNS"):
                _, i, stored = str(exc).split()[:3]
                raise _foreign_parent(hashes[int(i)], origins[int(i)], stored == "stored") from None
            if isinstance(exc, _OOM) or str(exc).startswith("OOM"):  # (redis-py names the reply by its class)
                # The server is full (maxmemory, noeviction): a capacity outcome, like a rejected page in LMDB.
                return self._failed_put(len(hashes), fault=False)
            return self._failed_put(len(hashes), error=exc)
        except _FAULTS as exc:
            return self._failed_put(len(hashes), error=exc)
        written = outcomes.count(PageOutcome.WRITTEN)
        existing = outcomes.count(PageOutcome.EXISTING)
        rejected = len(outcomes) - written - existing
        with self._lock:
            c = self._counts
            c["pages_written"] += written
            c["pages_existing"] += existing
            c["pages_rejected"] += rejected
            back, self._gone = self._gone, False
        if back:
            log.warning("%s: the store's format record is back; writing again", self.location)
        return PutResult(written, existing, rejected, 0, written * nbytes, outcomes=outcomes)

    def _store_gone(self, n: int) -> PutResult:
        """The format record is gone (the server lost its data, or the store was deleted): the batch fails whole
        (FAILED) and is counted (`format_lost`), and it is said once, in one line, until a put succeeds again."""
        with self._lock:
            self._counts["format_lost"] += 1
            first, self._gone = not self._gone, True
        if first:
            log.error("%s: the store's format record under prefix %r is gone (the server lost its data?); writes "
                      "stop until `kvc init` creates the store again", self.location, self.prefix)
        return _failed(n)

    def _failed_put(self, n: int, error: BaseException | None = None, fault: bool = True) -> PutResult:
        """A batch not stored. A fault (`error`, or none known: inside a backoff pause) fails it whole (FAILED,
        counted in write_errors); `fault` False is an OOM reply, the server full: a capacity refusal, rejected
        whole (counted in pages_rejected)."""
        if error is not None:
            self._fault("write_errors", error)
        elif fault:
            with self._lock:
                self._counts["write_errors"] += 1
        if fault:
            return _failed(n)
        with self._lock:
            self._counts["pages_rejected"] += n
        return _rejected(n)

    def _put_batch(self, client: Any, batch: "_Batch") -> bytes:
        """The standalone put: one PUT_BATCH script; the per-page outcomes."""
        ns_order: dict[bytes, int] = {}
        infos: list[Any] = []
        for o in batch.origins:
            if o.namespace.id not in ns_order:
                ns_order[o.namespace.id] = len(ns_order) + 1
                infos.append(o.namespace)
        keys: list[bytes] = [self._k_nsidx] + [self._nk(ns.id_hex) for ns in infos]
        args: list[Any] = [repr(batch.now), len(infos)]
        for ns in infos:
            args += [ns.id_hex, encoder.encode(ns.info(self.fingerprint_key))]
        fresh: set[bytes] = set()
        for h, v, m, rm, o in zip(batch.hashes, batch.values, batch.metas, batch.root_metas, batch.origins,
                                  strict=True):
            root = batch.roots[o.namespace.id]
            kind = ("r" if o.parent == root else "e" if o.key else "b" if o.parent in fresh else "s")
            fresh.add(h)
            keys += [self._pk(h), self._ck(o.parent), self._pk(o.parent), self._ck(root), self._ck(h)]
            args += [h, v, m, ns_order[o.namespace.id], o.parent.hex(), kind, rm, root.hex()]
        keys += [self._k_shares, self._k_format]
        *_, outcomes = self._call(self._s_put_batch, keys, args, client)
        return bytes(outcomes)

    def _put_cluster(self, client: Any, batch: "_Batch") -> bytes:
        """The cluster put: one PUT_PAGE script per page, then the indexes and counters; the per-page outcomes.

        Parents are read first (another slot than the page): a token page's must be a stored page of its
        namespace (a race with a concurrent writer of the parent can only make it miss a wrong parent that a
        content-addressed hash already rules out); an engine page whose parent is not one (nor an earlier page
        of the batch) is written hanging from its root. The format record lives in another slot than the pages:
        checked first, not atomically with the writes (a loss between the check and the writes leaves pages
        that verify reports as orphans, as does a parent removed between its read and the child's write)."""
        hashes, origins, roots = batch.hashes, batch.origins, batch.roots
        parents = [o.parent for o in origins]  # the parent each page is linked under
        metas = list(batch.metas)
        if not client.exists(self._k_format):
            raise redis.ResponseError("KVCNOSTORE the format record is gone")
        fresh = set(hashes)
        earlier: dict[bytes, bytes] = {}  # page hash -> namespace id, of the pages before the one looked at
        to_check: list[int] = []
        for i, (h, o) in enumerate(zip(hashes, origins, strict=True)):
            if o.parent == roots[o.namespace.id]:
                pass
            elif o.key:  # linked under an earlier page of the batch only when that is of its namespace
                if o.parent not in earlier:
                    to_check.append(i)
                elif earlier[o.parent] != o.namespace.id:
                    parents[i], metas[i] = roots[o.namespace.id], batch.root_metas[i]
            elif o.parent not in fresh:
                to_check.append(i)
            earlier.setdefault(h, o.namespace.id)
        if to_check:
            pipe = client.pipeline(transaction=False)
            for i in to_check:
                pipe.hmget(self._pk(origins[i].parent), "n", "m")
            layout_id = self.layout.layout_id if self.layout is not None else b""
            for i, (up, m) in zip(to_check, pipe.execute(), strict=True):
                o = origins[i]
                if not o.key:
                    if up is None or up.decode() != o.namespace.id_hex:
                        raise _foreign_parent(hashes[i], o, stored=up is not None)
                    continue
                meta = None if m is None else decode_or_none(decode_meta, m)
                if meta is None or (meta.ns_id, meta.layout_id) != (o.namespace.id, layout_id):
                    parents[i], metas[i] = roots[o.namespace.id], batch.root_metas[i]
        # An engine page with pages already below it (a dropped corrupt copy of it left them) hangs from its root:
        # linked under one of them it would be its own ancestor, a cycle no eviction or walk ever ends.
        linked = [i for i, o in enumerate(origins) if o.key and parents[i] != roots[o.namespace.id]]
        if linked:
            pipe = client.pipeline(transaction=False)
            for i in linked:
                pipe.exists(self._ck(hashes[i]))
            for i, below in zip(linked, pipe.execute(), strict=True):
                if int(below):
                    parents[i], metas[i] = roots[origins[i].namespace.id], batch.root_metas[i]
        values = batch.values
        over = self._over_share(client, hashes, origins, len(values[0]) - HEADER if values else 0)
        pipe = client.pipeline(transaction=False)
        for i, (h, v, m, o) in enumerate(zip(hashes, values, metas, origins, strict=True)):
            if i in over:  # past its namespace's store share: only asked whether it is stored already
                pipe.exists(self._pk(h))
            else:
                self._call(self._s_put_page, [self._pk(h)],
                           [v, m, o.namespace.id_hex, parents[i].hex(), repr(batch.now)], client=pipe)
        flags = pipe.execute()
        outcomes = bytearray(len(hashes))
        for i, f in enumerate(flags):
            if i in over:
                outcomes[i] = PageOutcome.EXISTING if int(f) else PageOutcome.REJECTED
            else:
                outcomes[i] = PageOutcome.WRITTEN if int(f) == 1 else PageOutcome.EXISTING
        written_idx = [i for i, out in enumerate(outcomes) if out == PageOutcome.WRITTEN]
        # Indexes and counters after the pages: a reader never finds a children entry without its page; a writer
        # that dies here leaves a missing_index / counter_mismatch that verify reports and repair fixes.
        per_ns: dict[bytes, list[Any]] = {}
        pipe = client.pipeline(transaction=False)
        for i in written_idx:
            o = origins[i]
            pipe.sadd(self._ck(parents[i]), hashes[i])
            acc = per_ns.setdefault(o.namespace.id, [o.namespace, 0, 0, ""])
            acc[1] += 1
            acc[2] += len(values[i]) - HEADER
            if o.key or parents[i] == roots[o.namespace.id]:
                acc[3] = roots[o.namespace.id].hex()  # an engine page's hash hangs on its root: recorded always
        for ns, n, b, root in per_ns.values():
            self._call(self._s_ns_adjust, [self._nk(ns.id_hex)],
                       [encoder.encode(ns.info(self.fingerprint_key)), repr(batch.now), n, b, root], pipe)
            pipe.sadd(self._k_nsidx, ns.id_hex)
        if written_idx:
            pipe.execute()
        return bytes(outcomes)

    def _over_share(self, client: Any, hashes: Sequence[bytes], origins: Sequence[PageOrigin],
                    nbytes: int) -> set[int]:
        """Cluster mode: indexes of the batch's pages past their namespace's store share. The pages of a
        namespace with a share are asked whether they are stored (those take no room) in the round trip after
        the limits. The shares hash and the counters live in other slots than the pages, so this is read before
        the writes, not atomically with them: concurrent writers of one namespace can overshoot it by a batch
        each."""
        ns_hexes = sorted({o.namespace.id_hex for o in origins})
        pipe = client.pipeline(transaction=False)
        pipe.hmget(self._k_shares, ["b:" + h for h in ns_hexes])
        for h in ns_hexes:
            pipe.hget(self._nk(h), "bytes")
        limits, *held = pipe.execute()
        room = {h: int(lim) - int(b or 0) for h, lim, b in zip(ns_hexes, limits, held, strict=True) if lim is not None}
        over: set[int] = set()
        if not room:
            return over
        limited = [i for i, o in enumerate(origins) if o.namespace.id_hex in room]
        pipe = client.pipeline(transaction=False)
        for i in limited:
            pipe.exists(self._pk(hashes[i]))
        stored = {i for i, there in zip(limited, pipe.execute(), strict=True) if there}
        counted: set[bytes] = set()  # a repeat of a page in the batch takes its room once
        for i in limited:
            h = origins[i].namespace.id_hex
            if i in stored or hashes[i] in counted:
                continue
            if room[h] < nbytes:
                room[h] = -1  # the rest of the namespace's pages in the batch go too: a stored chain is a prefix
                over.add(i)
            else:
                room[h] -= nbytes
                counted.add(hashes[i])
        return over

    # -- access records -------------------------------------------------------------------------------------

    def _take_pending(self) -> tuple[list[_Read], dict[bytes, str]]:
        pending = self._log.take()
        with self._lock:
            return pending, dict(self._corrupt)

    @StoreHandle.in_flight
    def flush(self) -> None:
        """Write logged reads (hit counts, access times) and drop pages seen corrupt (if still the same bytes).
        A fault keeps the log for the next flush and is counted (`flush_errors`); nothing is raised."""
        if self.readonly or self._closed:
            return
        pending, corrupt = self._take_pending()
        if not pending and not corrupt:
            return
        if not self._available():
            self._log.restore(pending)
            with self._lock:
                self._counts["flush_errors"] += 1
            return
        try:
            self._write_access(self._client, pending)
            if corrupt:
                self._remove([(h, None, None, "sha", sha) for h, sha in corrupt.items()], RemovalReason.QUARANTINE)
            self._ok()
        except (*_FAULTS, StoreError) as exc:
            self._log.restore(pending)
            self._fault("flush_errors", exc)
            return
        with self._lock:
            for h in corrupt:
                self._corrupt.pop(h, None)
            self._counts["flushes"] += 1

    def _flush_quietly(self) -> None:
        if self._log or self._corrupt:
            self.flush()

    def _write_access(self, client: Any, pending: list[_Read]) -> None:
        """Fold logged reads into page records and namespace counters (TOUCH: only records that still exist).
        Each read adds a hit to its deepest page and raises the last access of every page it served."""
        hits: Counter[bytes] = Counter()
        last: dict[bytes, float] = {}
        ns_pages: Counter[str] = Counter()
        ns_last: dict[str, float] = {}
        for when, served, ns_hex, n in pending:
            hits[served[-1]] += 1
            for h in served:
                if last.get(h, 0.0) < when:
                    last[h] = when
            ns_pages[ns_hex] += n
            ns_last[ns_hex] = max(ns_last.get(ns_hex, 0.0), when)
        pipe = client.pipeline(transaction=False)
        self._touch(pipe, [(self._pk(h), hits[h], t) for h, t in last.items()], "h", "a")
        self._touch(pipe, [(self._nk(ns_hex), n, ns_last[ns_hex]) for ns_hex, n in ns_pages.items()], "hits",
                    "last")
        pipe.execute()

    def _touch(self, pipe: Any, records: list[tuple[bytes, int, float]], count: str, when: str) -> None:
        """Queue TOUCH calls on `pipe` for (key, increment, time) records: TOUCH_KEYS records a call on a
        standalone server, one on a cluster (a call's keys must share a slot)."""
        step = 1 if self.cluster else TOUCH_KEYS
        for start in range(0, len(records), step):
            chunk = records[start:start + step]
            args: list[Any] = [count, when]
            for _, inc, t in chunk:
                args += [inc, repr(t)]
            self._call(self._s_touch, [k for k, _, _ in chunk], args, pipe)

    # -- removing -------------------------------------------------------------------------------------------

    def _remove(self, items: list[tuple[bytes, str | None, str | None, str, str]],
                reason: RemovalReason | None) -> list[int]:
        """Remove page records under guards (see scripts.REMOVE_BATCH): items are (page, namespace hex, parent
        hex, guard, sha1 hex); a None namespace or parent is read first. Returns the payload bytes freed per
        item (-1: kept by its guard). Each whole page removed is recorded in the removal log for `reason` (None:
        not one by one; a namespace dropped whole is recorded once by its caller). Standalone: one atomic script
        per REPAIR_BATCH_PAGES pages of items, its records with it; a cluster records them after its removals."""
        client = self._live()
        word, now, kept = (reason.value if reason is not None else ""), repr(time.time()), removals_kept()
        need = [i for i, (_, ns, parent, guard, _) in enumerate(items)
                if guard != "raw" and (ns is None or parent is None)]
        if need:
            read = self._hmget_many(client, [items[i][0] for i in need], ("n", "p"))
            for i, (ns, parent) in zip(need, read, strict=True):
                h, _, _, guard, sha = items[i]
                items[i] = (h, ns.decode() if ns else "", parent.decode() if parent else "", guard, sha)
        # every None is read by now but a "raw" item's, which the scripts take as "" (`ns or ""` below)
        known = [(h, ns or "", parent or "", guard, sha) for h, ns, parent, guard, sha in items]
        out: list[int] = []
        for start in range(0, len(known), REPAIR_BATCH_PAGES):
            chunk = known[start:start + REPAIR_BATCH_PAGES]
            if self.cluster:
                freed = self._remove_cluster(client, chunk)
                out += freed
                gone = [(b"h" + h, ns) for (h, ns, _, guard, _), f in zip(chunk, freed, strict=True)
                        if f >= 0 and guard != "raw"]
                if reason is not None and gone:
                    self._record(client, reason, gone)
                continue
            keys: list[bytes] = []
            args: list[Any] = []
            for h, ns, parent, guard, sha in chunk:
                parent_hash = bytes.fromhex(parent) if parent else b""
                keys += [self._pk(h), self._ck(parent_hash), self._nk(ns or "-"), self._pk(parent_hash)]
                args += [h, ns or "", parent or "", guard, sha or ""]
            keys.append(self._k_removals)
            args += [word, now, kept]
            out += [int(x) for x in self._call(self._s_remove_batch, keys, args, client)]
        return out

    def _record(self, client: Any, reason: RemovalReason, subjects: Sequence[tuple[bytes, str]]) -> None:
        """Record `subjects` ((b"h" + page hash or b"n" + namespace id, namespace id hex) each) in the removal log
        as removed for `reason` now (scripts.RECORD: one call, one key)."""
        args: list[Any] = [reason.value, repr(time.time()), removals_kept()]
        for subject, ns_hex in subjects:
            args += [subject, ns_hex]
        self._call(self._s_record, [self._k_removals], args, client)

    def removals(self, hashes: Sequence[bytes], namespace: bytes | None = None) -> list[PageRemoval | None]:
        """Per hash, the newest record of the removal log that answers for it (see `L3Store.removals`): one
        HMGET of the log (an administrative read: a fault is a StoreError)."""
        check_page_hashes(hashes)
        if namespace is not None and (not isinstance(namespace, bytes) or len(namespace) != 16):
            raise InvalidInput(f"a namespace id is 16 bytes, got {namespace!r:.60}")
        if not hashes:
            return []
        fields = [b"h" + h for h in hashes] + ([b"n" + namespace] if namespace is not None else [])
        raw = self._admin(lambda c: c.hmget(self._k_removals, fields))
        whole = _removal(namespace, raw[-1]) if namespace is not None else None
        return [newest_removal(h, _removal(h, v), whole) for h, v in zip(hashes, raw, strict=False)]

    def _remove_cluster(self, client: Any, chunk: list[tuple[bytes, str, str, str, str]]) -> list[int]:
        pipe = client.pipeline(transaction=False)
        for h, ns, parent, guard, sha in chunk:
            if guard == "below":
                guard = "any"  # the parent's record is in another slot: checked by the caller before
            self._call(self._s_remove_page, [self._pk(h)], [ns or "", parent or "", guard, sha or ""], pipe)
        freed = [int(x) for x in pipe.execute()]
        pipe = client.pipeline(transaction=False)
        per_ns: Counter[str] = Counter()
        per_ns_bytes: Counter[str] = Counter()
        for (h, ns, parent, guard, _), f in zip(chunk, freed, strict=True):
            if f >= 0 and guard != "raw":
                pipe.srem(self._ck(bytes.fromhex(parent)), h)
                per_ns[ns] += 1
                per_ns_bytes[ns] += f
        for ns, n in per_ns.items():
            self._call(self._s_ns_adjust, [self._nk(ns)], ["", "0", -n, -per_ns_bytes[ns], ""], pipe)
        pipe.execute()
        return freed

    def _scan_pages(self, fields: tuple[str, ...]) -> Iterator[tuple[bytes | str, list[Any]]]:
        """Every page record's hash and the asked fields, SCAN_COUNT keys per round trip. A key whose tail is
        not a page hash comes back as that tail, a str (verify reports it)."""
        client = self._live()
        pattern = _glob_escape(self.prefix) + "p:*"
        skip = len(self._p_page)
        batch: list[bytes] = []

        def fetch(keys: list[bytes]) -> list[tuple[bytes | str, list[Any]]]:
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.hmget(k, *fields)
            got = self._admin(lambda c: pipe.execute())
            out: list[tuple[bytes | str, list[Any]]] = []
            for k, vals in zip(keys, got, strict=True):
                tail = k[skip:].decode(errors="replace")
                try:
                    h = bytes.fromhex(tail)
                except ValueError:
                    h = b""
                out.append((h if len(h) == PAGE_HASH_BYTES and len(tail) == 2 * PAGE_HASH_BYTES else tail, vals))
            return out

        keys_iter = self._admin(lambda c: c.scan_iter(match=pattern, count=SCAN_COUNT))
        seen: set[bytes] = set()  # SCAN may return a key twice
        try:
            for key in keys_iter:
                if key in seen:
                    continue
                seen.add(key)
                batch.append(key)
                if len(batch) >= SCAN_COUNT:
                    yield from fetch(batch)
                    batch = []
        except _FAULTS as exc:
            raise StoreError(self.location, f"redis: {_said(exc)}") from None
        if batch:
            yield from fetch(batch)

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
        ns_hex = ns_id.hex()
        pages = nbytes = scripts_run = 0
        while True:
            found = [(h, ns_hex, parent.decode(), "any", "")
                     for h, (ns, parent) in self._scan_pages(("n", "p"))
                     if isinstance(h, bytes) and ns is not None and ns.decode() == ns_hex and parent is not None]
            for start in range(0, len(found), DELETE_BATCH_PAGES):
                freed = self._admin(lambda c, b=found[start:start + DELETE_BATCH_PAGES]: self._remove(b, None))
                scripts_run += 1
                got = [f for f in freed if f >= 0]
                pages += len(got)
                nbytes += sum(got)
            if not found:
                break

        def drop(c: Any) -> None:
            c.srem(self._k_nsidx, ns_hex)
            c.delete(self._nk(ns_hex))
            self._record(c, RemovalReason(reason), [(b"n" + ns_id, ns_hex)])

        self._admin(drop)
        with self._lock:
            for h in [h for h in self._corrupt]:
                self._corrupt.pop(h, None)
        return DeleteResult(pages, nbytes, max(scripts_run, 1))

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
        report = verify(_RedisIntegrity(self), repair)
        with self._lock:
            for h in removed_pages(report):
                self._corrupt.pop(h, None)  # gone: a writer may store them again
        return report

    def _recount(self) -> None:
        """Set every registry counter from the page records stored now."""
        per_ns: dict[str, list[int]] = {}
        for _, (n, size) in self._scan_pages_sizes():
            acc = per_ns.setdefault(n, [0, 0])
            acc[0] += 1
            acc[1] += size
        registry = self._registry()

        def write(c: Any) -> None:
            pipe = c.pipeline(transaction=False)
            for ns_hex, record in registry.items():
                n_pages, n_bytes = per_ns.get(ns_hex, [0, 0])
                if (record.pages, record.bytes) != (n_pages, n_bytes):
                    pipe.hset(self._nk(ns_hex), mapping={"pages": n_pages, "bytes": n_bytes})
            pipe.execute()

        self._admin(write)

    def _scan_pages_sizes(self) -> Iterator[tuple[bytes, tuple[str, int]]]:
        client = self._live()
        batch: list[bytes] = []
        keys = [h for h, (n,) in self._scan_pages(("n",)) if n is not None and isinstance(h, bytes)]
        for start in range(0, len(keys), SCAN_COUNT):
            batch = keys[start:start + SCAN_COUNT]

            def ask(c: Any, batch=batch) -> list[Any]:
                pipe = c.pipeline(transaction=False)
                for h in batch:
                    pipe.hget(self._pk(h), "n")
                    pipe.hstrlen(self._pk(h), "d")
                return pipe.execute()

            got = self._admin(ask)
            for j, h in enumerate(batch):
                n, size = got[2 * j], got[2 * j + 1]
                if n is not None and size:
                    yield h, (n.decode(), int(size) - HEADER)
        del client

    # -- lifetime -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Flush logged reads (best effort: a fault keeps nothing, the handle is going) and release the
        connections. Idempotent. Calls other threads have in flight end first (a connection dropped under one
        would end it in a stray exception); calls made after it raise StoreClosed."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self.wait_in_flight()
            try:
                self._client.close()
            except _FAULTS:  # closing is best effort: the connections are being dropped either way
                pass


class _RedisIntegrity:
    """A Redis store as `kvcache.storage.verify.IntegritySource`. One per verify: Redis has no snapshot, so the
    tree the checks judge is what the scan of the page records saw (kept here), and a children entry the scan
    did not see is read again before it counts as dangling (a page written during the scan is sound)."""

    checksum = _XXH3
    recounts_after_removals = False  # the removal scripts keep the counters; a recount is a racy scan

    def __init__(self, store: "RedisStore") -> None:
        self.store = store
        self.chain_key = store.chain_key  # the format record's: every handle holds it
        self.batch_pages = REPAIR_BATCH_PAGES
        self.registry: dict[str, NamespaceRecord] = {}
        self.rows: dict[bytes, PageRow] = {}
        self.bodiless: set[bytes] = set()
        self.damaged: set[bytes] = set()
        self.headless: set[bytes] = set()

    def layout_records(self) -> dict[bytes, LayoutRecord | None]:
        """The layout records, by layout id (None: does not decode)."""
        raw = self.store._admin(lambda c: c.hgetall(self.store._k_layouts))
        return {bytes.fromhex(k.decode()): decode_or_none(decode_layout, v) for k, v in raw.items()}

    def scan_pages(self, found: Findings) -> Iterator[ScannedPage]:
        """Every page record, SCAN_COUNT per round trip, with one more round trip per chunk for its index
        entries. Records this interface cannot express are reported here: a key whose tail is no page hash, a
        record without its namespace or parent field, fields that disagree with the metadata."""
        s = self.store
        self.registry = s._registry()
        chunk: list[tuple[bytes, Any, PageMeta | None, bool]] = []
        for h, (d, m, n, p) in s._scan_pages(("d", "m", "n", "p")):
            if isinstance(h, str):
                found.add("dangling_index", None, f"a page record key whose tail {h!r} is not a page hash")
                continue
            if n is None or p is None:
                found.add("missing_meta" if d is not None else "missing_page", h,
                          "a page record without its namespace or parent field", remove=True)
                continue
            meta = None if m is None else decode_or_none(decode_meta, m)
            if meta is not None:
                self.rows[h] = PageRow(meta.parent, meta.ns_id, meta.layout_id, meta.nbytes, engine=bool(meta.key))
                if n.decode() != meta.ns_id.hex() or p.decode() != meta.parent.hex():
                    found.add("namespace_mismatch", h, "the record's namespace or parent field differs from its "
                                                       "metadata", remove=Guard.SAME_BYTES)
            if m is not None and meta is None:
                self.damaged.add(h)
            if d is None:
                self.bodiless.add(h)
                continue
            if meta is None:
                self.headless.add(h)
            chunk.append((h, d, meta, m is not None and meta is None))
            if len(chunk) >= SCAN_COUNT:
                yield from self._checked(chunk)
                chunk = []
        yield from self._checked(chunk)

    def _checked(self, chunk: list[tuple[bytes, Any, PageMeta | None, bool]]) -> Iterator[ScannedPage]:
        whole = [(h, meta) for h, _, meta, _ in chunk if meta is not None]

        def ask(c: Any) -> list[Any]:
            pipe = c.pipeline(transaction=False)
            for h, meta in whole:
                pipe.sismember(self.store._ck(meta.parent), h)
            return pipe.execute()

        listed = dict(zip((h for h, _ in whole), self.store._admin(ask) if whole else [], strict=True))
        for h, d, meta, damaged in chunk:
            if meta is None:
                yield ScannedPage(h, d, None, damaged)
            else:
                yield ScannedPage(h, d, meta, indexed=bool(listed[h]), registered=meta.ns_id.hex() in self.registry)

    def snapshot(self, found: Findings) -> Snapshot:
        """What the scan saw, the registry read before it, and the children index read after it."""
        return Snapshot(self.rows, self.bodiless, self.damaged, self.headless,
                        {bytes.fromhex(k): r for k, r in self.registry.items()}, self._links())

    def _links(self) -> list[tuple[bytes, bytes]]:
        s = self.store
        pattern = _glob_escape(s.prefix) + "c:*"
        skip = len(s._p_children)
        keys = sorted(set(s._admin(lambda c: list(c.scan_iter(match=pattern, count=SCAN_COUNT)))))
        links: list[tuple[bytes, bytes]] = []
        for start in range(0, len(keys), SCAN_COUNT):
            chunk = keys[start:start + SCAN_COUNT]
            for key, kids in zip(chunk, s._admin(lambda c, chunk=chunk: s._smembers_keys(c, chunk)), strict=True):
                try:
                    parent = bytes.fromhex(key[skip:].decode())
                except ValueError:
                    continue
                links += [(parent, child) for child in kids]
        suspects = [(parent, child) for parent, child in links
                    if child not in self.rows or self.rows[child].parent != parent]
        if not suspects:
            return links
        now = s._admin(lambda c: s._hmget_many(c, [child for _, child in suspects], ("p", "m")))
        written = {link for link, (p, m) in zip(suspects, now, strict=True)
                   if p is not None and p.decode() == link[0].hex() and m is not None}
        return [link for link in links if link not in written]  # stored under that parent during the scan: sound

    def repair_batch(self, body: Callable[[RepairOps], T]) -> T:
        """`body` with removals by script (Redis has no write transaction to bound: a batch is a round of
        scripts and pipelines)."""
        return body(_RedisRepairOps(self))

    def recount(self) -> None:
        """Every registry counter from the page records stored now."""
        self.store._recount()


class _RedisRepairOps:
    """`verify.RepairOps` by removal scripts, each rechecking its record on the server (scripts.REMOVE_BATCH)."""

    def __init__(self, integrity: _RedisIntegrity) -> None:
        self.seen = integrity
        self.store = integrity.store

    def remove(self, items: Sequence[Removal]) -> list[tuple[str, int] | None]:
        """Each item under its guard, as the scripts take it (a page of a removed record: as judged)."""
        s = self.store
        sha_of = [it.page for it in items if it.guard is Guard.SAME_BYTES]
        sha: dict[bytes, str] = {}
        if sha_of:
            raw = s._admin(lambda c: s._hmget_many(c, sha_of, ("d",)))
            sha = {h: hashlib.sha1(d).hexdigest() for h, (d,) in zip(sha_of, raw, strict=True) if d is not None}
        args = [(it.page, it.row.ns_id.hex() if it.row else None, it.row.parent.hex() if it.row else None,
                 "any" if it.guard is Guard.FILED_UNDER else str(it.guard), sha.get(it.page, "")) for it in items]
        freed = s._admin(lambda c: s._remove(args, RemovalReason.REPAIR))
        # The "raw" scripts delete the record only: metadata without bytes leaves its entry under its parent.
        listed = [(it.row.parent, it.page) for it, f in zip(items, freed, strict=True)
                  if f >= 0 and it.guard is Guard.PARTIAL and it.row is not None]
        if listed:
            s._admin(lambda c: self._srem_all(c, listed))
        return [None if f < 0 else (self._what(it), max(f, 0)) for it, f in zip(items, freed, strict=True)]

    def _what(self, item: Removal) -> str:
        if item.guard is not Guard.PARTIAL:
            return "page"
        if item.page in self.seen.bodiless:
            return "meta"
        return "page" if item.page in self.seen.damaged else "bytes"

    def children(self, pages: Sequence[bytes]) -> list[set[bytes]]:
        """The children sets of each page."""
        return self.store._admin(lambda c: self.store._smembers_many(c, pages))

    def unlink(self, links: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        """Remove children entries (SREM): per entry, whether it was there."""
        return [bool(gone) for gone in self.store._admin(lambda c: self._srem_all(c, links))]

    def _srem_all(self, client: Any, links: Sequence[tuple[bytes, bytes]]) -> list[int]:
        pipe = client.pipeline(transaction=False)
        for parent, child in links:
            pipe.srem(self.store._ck(parent), child)
        return pipe.execute()

    def relink(self, pages: Sequence[tuple[bytes, PageRow]]) -> list[bool]:
        """Add each page to its parent's children set."""
        def run(c: Any) -> None:
            pipe = c.pipeline(transaction=False)
            for h, row in pages:
                pipe.sadd(self.store._ck(row.parent), h)
            pipe.execute()

        self.store._admin(run)
        return [True] * len(pages)

    def drop_record(self, name: str, key: bytes) -> bool:
        """Remove a layout record that still does not decode (a namespace record that does not decode is never
        reported here: the registry read raises on it)."""
        if name != "layouts":
            return False
        s = self.store
        raw = s._admin(lambda c: c.hget(s._k_layouts, key.hex()))
        if raw is None or decode_or_none(decode_layout, raw) is not None:
            return False
        return bool(s._admin(lambda c: c.hdel(s._k_layouts, key.hex())))


def _connect(url: _Url, redis_options: dict[str, Any]) -> Any:
    """A redis-py client for `url`. No retries inside redis-py: a fault surfaces at once, and the store's own
    backoff decides when to try again (a scheduler must not sit in a retry loop on a dead server)."""
    opts = url.options
    kwargs: dict[str, Any] = dict(socket_timeout=opts.timeout, socket_connect_timeout=opts.connect_timeout,
                                  retry=Retry(NoBackoff(), 0))
    kwargs.update(redis_options)
    try:
        if url.cluster:
            from redis.cluster import RedisCluster

            return RedisCluster.from_url(url.client_url, **kwargs)
        client = redis.Redis.from_url(url.client_url, retry_on_timeout=False, **kwargs)
        # redis-py checks some options only when it builds a connection: build one now (no I/O) so a bad option
        # is an error of the URL, not of the first command.
        client.connection_pool.make_connection().disconnect()
        return client
    except _FAULTS as exc:
        raise StoreError(url.shown, f"cannot reach the server: {_said(exc)}") from None
    except (ValueError, TypeError, redis.RedisError) as exc:
        raise InvalidInput(f"{url.shown}: unusable connection option in the URL "
                           f"({_option_error(exc, url.client_url)})") from None


def _option_error(exc: BaseException, client_url: str) -> str:
    """redis-py's complaint about a URL option, in the URL's terms: the option it names, never its text (which
    may quote a value, and a value may be a credential)."""
    text = str(exc)
    m = re.search(r"unexpected keyword argument '(\w+)'", text)
    if m:
        return f"{m.group(1)} is not an option of this kind of connection (TLS options need rediss://)"
    named = [name for name, _ in parse_qsl(urlsplit(client_url).query, keep_blank_values=True)
             if re.search(rf"['\"]{re.escape(name)}['\"]", text)]
    return f"redis-py refused the value of {', '.join(named)}" if named else \
        f"redis-py refused an option ({type(exc).__name__})"


class _Batch(msgspec.Struct, frozen=True):
    """One put batch as the write paths take it: the caller's hashes and origins, and what `put` derived."""

    hashes: Sequence[bytes]
    values: list[bytes]  # each page's `d` field: checksum + payload
    metas: list[bytes]  # each page's PageMeta (msgpack), parent as the origin says
    root_metas: list[bytes]  # an engine page's PageMeta hanging from its namespace root; b"" for the others
    origins: Sequence[PageOrigin]
    roots: dict[bytes, bytes]  # namespace id -> its hash root under the handle's layout
    now: float  # unix seconds of the write


# An OOM reply (maxmemory reached under noeviction), which redis-py raises as its own class where it has one
_OOM: tuple[type[BaseException], ...] = tuple(
    c for c in (getattr(redis.exceptions, "OutOfMemoryError", None),) if isinstance(c, type))


def _removal(subject: bytes, value: bytes | None) -> tuple[int, PageRemoval] | None:
    """(seq, record) of one value of the removal log ("<seq> <reason> <unix seconds> <namespace id hex>") for a
    page hash or namespace id `subject`; None when absent or when it does not decode (an unknown reason)."""
    if value is None:
        return None
    try:
        seq, word, at, ns_hex = value.decode().split(" ")
        return int(seq), PageRemoval(subject, RemovalReason(word), float(at), NamespaceId(bytes.fromhex(ns_hex)))
    except ValueError:
        return None


def _rejected(n: int) -> PutResult:
    """A batch of `n` pages the server refused whole for room (an OOM reply under maxmemory)."""
    return PutResult(0, 0, n, 0, 0, outcomes=bytes([PageOutcome.REJECTED]) * n)


def _failed(n: int) -> PutResult:
    """A batch of `n` pages none of which was written: a fault, a write the server would not take, a lost format
    record."""
    return PutResult(0, 0, 0, 0, 0, outcomes=bytes([PageOutcome.FAILED]) * n)


def _foreign_parent(page_hash: bytes, origin: PageOrigin, stored: bool) -> InvalidInput:
    # A parent that is no stored page may be another namespace's root: the page would be read in that namespace's
    # chain, so it is refused like a parent of another namespace.
    if stored:
        return InvalidInput(f"page {page_hash.hex()}: its parent is in another namespace than "
                            f"{origin.namespace.label}")
    return InvalidInput(f"page {page_hash.hex()}: its parent is not a stored page nor the root of namespace "
                        f"{origin.namespace.label}")
