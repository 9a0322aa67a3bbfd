"""LMDBStore: kvc's default L3, one embedded LMDB environment per store directory.

Named sub-databases (all keys are 16-byte page hashes unless said otherwise)::

    pages       page hash -> [u64 checksum, little-endian][payload]   the checksum travels with the bytes
    meta        page hash -> PageMeta (msgpack); hits and last access rewritten by flush()
    children    parent hash -> child page hash (dupsort, dupfixed)     walks a namespace's tree from its root
    namespaces  namespace id -> NamespaceRecord (msgpack)               never the salt
    layouts     layout id -> LayoutRecord (msgpack)                     every KVLayout the store holds
    store       b"format" -> StoreFormat, b"totals" -> StoreTotals, b"capacity" -> u64 payload limit,
                b"ns_quota" -> u64 payload limit of each namespace

Bookkeeping must cost a small fraction of the read it records: a read is logged in memory as one entry (its
deepest page), folded into `meta` by `flush()`, and no access-order index is kept (each index is one more B-tree
every put dirties: ~3 µs per 16 KiB page here). For the same reason no namespace -> pages index is kept:
`delete_namespace` (a rare offboarding) scans `meta` in chunks instead of every put paying for it. Eviction
finds the least recently used leaves by scanning `meta`, and evicts a little more than it needs
(`evict_headroom`) so that scan is paid once per many puts.

Integrity (`verify`): every stored page should hang from its namespace root through stored pages of the same
namespace and layout. Eviction keeps that (it takes leaves only); a page dropped after failing its checksum, or
a put whose parent is not stored (`put` takes such chains: a writer's parent may have been evicted meanwhile),
leaves pages below a gap. Those are reported as `orphan` (one finding per chain head, its subtree counted in the
detail) and stay until a writer stores the missing page again (which heals the chain) or `verify(repair=True)`
removes them.

A batch of puts is one write transaction: pages, metadata, indexes and registry counters commit together or not
at all, so a killed writer never leaves a half page, a page without its metadata, or counters that disagree.

Known traps, measured on the machines this was built on:

- A zero-copy value (``buffers=True``) is a view into the map that is valid only inside its transaction; used
  later it shows other data, and after a map resize it faults (SIGBUS). Pages are copied out inside the read
  transaction, and no view ever leaves this module.
- A read transaction held open while writers churn pins every page it can see: one held across a churn grew a
  1 GiB store to 3.3 GiB. Read transactions here last one batch; `verify` walks the store in chunks.
- ``torch.Tensor.copy_`` with 2 threads fell to ~0.3 GB/s at 256 KiB pages, where ``np.copyto`` into
  ``tensor.numpy()`` ran at ~7 GB/s. Copies go through the buffer protocol (a memoryview slice assignment is one
  memcpy, with less per-call overhead than ``np.copyto``), never through torch.
- LMDB forbids opening one environment twice in a process. Handles share one Environment per process and
  realpath; a forked child closes the parent's without using it and opens its own.
- Running out of disk surfaces from LMDB as EIO at commit; it is reported as StoreFull when the disk is full.
- Checksums are xxh3-64 when the ``xxhash`` package is installed (~45 GB/s on cached data) and zlib's crc32
  otherwise (~2.5 GB/s: the checked read path then runs at about half the speed). A store records its algorithm.
"""

from __future__ import annotations

import errno
import heapq
import os
import struct
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import lmdb
import msgspec
import numpy as np

from ..errors import (InvalidInput, LayoutMismatch, NotAStore, StoreError, StoreFull, StoreReadOnly,
                      StoreUnsupported)
from ..keys import PAGE_HASH_BYTES, TOKEN_BYTES, extend_chain, hash_root, hash_root_of_id
from ..layout import KVLayout
from ..namespace import Namespace
from .base import (AccessPolicy, CapacityPolicy, ChildInfo, DeleteResult, LayoutRecord, NamespaceRecord,
                   PageMeta, PageOrigin, PutResult, StoreCounters, StoreStats, VerifyFinding, VerifyRemoval,
                   VerifyReport, check_page_hashes, out_views_for, page_bytes)
from .keyfile import KEY_FILE, ensure_key, read_key

try:  # xxh3 runs ~8x faster than zlib's crc32 here: it is what keeps the checked read path near memcpy speed
    import xxhash
except ImportError:  # pragma: no cover - depends on the install
    xxhash = None

FORMAT_MAGIC = "kvc-store"
FORMAT_VERSION = 1
BACKEND = "lmdb"
DEFAULT_MAP_SIZE = 256 << 20  # initial map; grows on demand (the file grows with the data, not the map)
MAX_DBS = 16
MAX_READERS = 512  # reader slots across every process; engines plus CLI inspectors with a few threads each
DELETE_BATCH_PAGES = 1024  # pages per write transaction when deleting a namespace
VERIFY_CHUNK_PAGES = 256  # pages per read transaction when verifying (short read transactions, see above)
REPAIR_BATCH_PAGES = 1024  # records removed per write transaction by verify(repair=True)
# Durability name -> (sync, metasync) of the environment. A killed process loses no committed batch in any mode;
# the modes differ on a system crash (power loss, kernel panic):
#   full  every committed batch survives (two fsyncs per commit);
#   data  the store stays intact, the last committed batch may be lost (one fsync per commit; LMDB's NOMETASYNC);
#   none  no fsync: recent batches may be lost, and the store may be damaged (verify; delete and refill).
DURABILITY: dict[str, tuple[bool, bool]] = {"full": (True, True), "data": (True, False), "none": (False, False)}
DEFAULT_DURABILITY = "data"  # a cache: integrity across crashes, not the last batch

_U64 = struct.Struct("<Q")
_HEADER = _U64.size  # checksum before the payload in `pages`
_DB_NAMES = ("pages", "meta", "children", "namespaces", "layouts", "store")
_DUPFIXED = ("children",)


class Checksum(msgspec.Struct, frozen=True):
    """A checksum algorithm: `digest(payload, seed)`, seeded with the first `seed_bytes` of the page hash
    (little-endian) so a payload filed under the wrong key fails too."""

    digest: Callable[[Any, int], int]
    seed_bytes: int  # 4 or 8

    def of(self, payload: Any, page_hash: bytes) -> int:
        """The checksum of `payload` stored under `page_hash`."""
        return self.digest(payload, int.from_bytes(page_hash[:self.seed_bytes], "little"))

    def seeds(self, hashes: Sequence[bytes]) -> list[int]:
        """The seeds of a batch of page hashes, in one vectorised step (the read loop then makes one call)."""
        words = np.frombuffer(b"".join(hashes), dtype=f"<u{self.seed_bytes}")
        return words[::PAGE_HASH_BYTES // self.seed_bytes].tolist()


# Checksum name -> algorithm. The name is recorded in the store; a store is read with the one it was written with.
CHECKSUMS: dict[str, Checksum] = {"crc32": Checksum(zlib.crc32, 4)}
if xxhash is not None:
    CHECKSUMS["xxh3_64"] = Checksum(xxhash.xxh3_64_intdigest, 8)
DEFAULT_CHECKSUM = "xxh3_64" if xxhash is not None else "crc32"


class StoreFormat(msgspec.Struct, frozen=True):
    """The marker that makes an LMDB environment a kvc store."""

    magic: str  # FORMAT_MAGIC
    version: int  # FORMAT_VERSION of the writer that created it
    checksum: str  # a key of CHECKSUMS
    created: float  # unix seconds


class StoreTotals(msgspec.Struct, frozen=True, array_like=True):
    """Store-wide counters, updated in every transaction that adds or removes pages."""

    pages: int
    bytes: int  # payload bytes


_enc = msgspec.msgpack.Encoder()
_dec_meta = msgspec.msgpack.Decoder(PageMeta)
_dec_ns = msgspec.msgpack.Decoder(NamespaceRecord)
_dec_layout = msgspec.msgpack.Decoder(LayoutRecord)
_dec_format = msgspec.msgpack.Decoder(StoreFormat)
_dec_totals = msgspec.msgpack.Decoder(StoreTotals)


class _Dbs(msgspec.Struct, frozen=True):
    """Handles of the named sub-databases of one environment."""

    pages: Any
    meta: Any
    children: Any
    namespaces: Any
    layouts: Any
    store: Any


class _SharedEnv:
    """The one Environment of a store in this process, shared by every handle on it.

    A map resize needs no transaction of this process active, so transactions pass a gate: `active` counts them,
    and a resize waits for zero while new ones wait for it to finish. Writers serialise on `write_lock` before
    the gate (a writer blocked on LMDB's own lock while counted active would deadlock a resize).
    """

    def __init__(self, env: lmdb.Environment, path: str, writable: bool, dbs: _Dbs, fmt: StoreFormat) -> None:
        self.env = env
        self.path = path
        self.writable = writable  # opened read-write (False: a read-only location)
        self.dbs = dbs
        self.format = fmt
        self.pid = os.getpid()
        self.refs = 0  # open handles
        self.write_lock = threading.RLock()
        self._gate = threading.Condition()
        self._active = 0  # transactions of this process in flight
        self._resizing = False

    def _enter(self) -> None:
        with self._gate:
            while self._resizing:
                self._gate.wait()
            self._active += 1

    def _leave(self) -> None:
        with self._gate:
            self._active -= 1
            if self._active == 0:
                self._gate.notify_all()

    def resize(self, map_size: int) -> None:
        """Set the map size (0: adopt the size another process grew it to)."""
        with self._gate:
            self._resizing = True
            try:
                while self._active:
                    self._gate.wait()
                self.env.set_mapsize(map_size)
            finally:
                self._resizing = False
                self._gate.notify_all()

    def _begin(self, write: bool, buffers: bool) -> lmdb.Transaction:
        while True:
            self._enter()
            try:
                return self.env.begin(write=write, buffers=buffers)
            except lmdb.MapResizedError:
                self._leave()
                self.resize(0)
            except BaseException:
                self._leave()
                raise

    @contextmanager
    def read(self, buffers: bool = False) -> Iterator[lmdb.Transaction]:
        """A short read transaction. A record that does not decode in it is a StoreError naming the cure."""
        txn = self._begin(False, buffers)
        try:
            yield txn
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise _damaged(self.path, exc) from None
        finally:
            txn.abort()
            self._leave()

    def write(self, body: Callable[[lmdb.Transaction], Any], grow_hint: int = 0) -> Any:
        """Run `body` in one write transaction and commit. On a full map, grow it and rerun the whole body:
        `body` must keep its effects inside the transaction."""
        with self.write_lock:
            while True:
                txn = self._begin(True, False)
                committed = False
                try:
                    result = body(txn)
                    txn.commit()
                    committed = True
                except lmdb.MapFullError:
                    txn.abort()
                    full = True
                except lmdb.MapResizedError:
                    txn.abort()
                    full = False
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    txn.abort()
                    raise _damaged(self.path, exc) from None
                except BaseException:
                    txn.abort()
                    raise
                finally:
                    self._leave()
                if committed:
                    return result
                if full:
                    size = self.env.info()["map_size"]
                    self.resize(max(2 * size, size + 2 * grow_hint))
                else:
                    self.resize(0)


def _damaged(path: str, exc: BaseException) -> StoreError:
    return StoreError(path, f"a damaged record in the store ({exc}); run `kvc audit` to see it and "
                            f"`kvc audit --repair` to remove it")


_ENVS: dict[str, _SharedEnv] = {}
_ENVS_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    # The parent's environments must not be used here; closing one releases only this process's reader slots
    # and lets the child open the store afresh. One with a transaction in flight at fork (another thread) is
    # abandoned instead: closing it would reset a reader slot the parent still uses.
    global _ENVS_LOCK
    _ENVS_LOCK = threading.Lock()
    for shared in _ENVS.values():
        if shared._active == 0:
            try:
                shared.env.close()
            except lmdb.Error:  # closing is best effort: the environment is being dropped either way
                pass
    _ENVS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _error_code(exc: BaseException) -> int | None:
    code = getattr(exc, "errno", None) or getattr(exc, "code", None)
    return code if isinstance(code, int) else None


def _disk_full(path: str, wanted: int) -> bool:
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < max(wanted, 1 << 20)


def _translate(exc: BaseException, path: str, doing: str, wanted: int = 0) -> StoreError:
    """A typed StoreError for an LMDB or OS fault under `path`."""
    code = _error_code(exc)
    if code in (errno.ENOSPC, errno.EDQUOT) or (code == errno.EIO and _disk_full(path, wanted)):
        need = f" (needed about {wanted} bytes)" if wanted else ""
        return StoreFull(path, f"{doing}: no space left on the disk{need}")
    if code in (errno.EACCES, errno.EPERM, errno.EROFS) or isinstance(exc, lmdb.ReadonlyError):
        return StoreReadOnly(path, f"{doing}: the location is read-only ({exc})")
    return StoreError(path, f"{doing}: {exc}")


def _open_env(path: str, create: bool, map_size: int, durability: str, checksum: str) -> _SharedEnv:
    """Open (or create) the environment at `path` and check that it is a kvc store.

    The open is retried as a whole on a transient fault (OPEN_ATTEMPTS times): another process growing the map
    between our `lmdb.open` and our first transaction (MDB_MAP_RESIZED), a full reader table, EAGAIN. A create
    that fails leaves nothing behind: the files it made are removed, so a later `init` starts afresh.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotAStore(path, "is a regular file, expected a kvc store directory")
    data_file = os.path.join(path, "data.mdb")
    creating = not os.path.exists(data_file)
    made_dir = False
    if creating:
        if not create:
            raise NotAStore(path, "no kvc store here (expected a directory holding data.mdb; create=True makes one)")
        # A lone lock.mdb is what a create that died (a full disk) left: nothing of a store to protect.
        if os.path.isdir(path) and set(os.listdir(path)) - {"lock.mdb"}:
            raise NotAStore(path, "directory is not empty and holds no store; refusing to create one inside it")
        made_dir = not os.path.isdir(path)
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise _translate(exc, path, "creating the store directory") from None
    try:
        _reserve_lock_file(path)
        last: BaseException | None = None
        for attempt in range(OPEN_ATTEMPTS):
            try:
                return _open_env_once(path, create, map_size, durability, checksum)
            except lmdb.Error as exc:
                if not _transient(exc):
                    raise _translate(exc, path, "opening") from None
                last = exc
            time.sleep(min(0.0005 * 2 ** attempt, 0.05))
        raise StoreError(path, f"opening: still failing after {OPEN_ATTEMPTS} attempts ({last})")
    except BaseException:
        if creating:
            _remove_failed_create(path, made_dir)
        raise


OPEN_ATTEMPTS = 100  # whole-open retries on transient faults (a writer may grow the map many times meanwhile)
# LMDB's lock file for MAX_READERS reader slots (192-byte header + 64 bytes a slot), with room to spare: a larger
# file only gives more slots.
LOCK_FILE_BYTES = 64 << 10
_TRANSIENT_ERRNOS = (errno.EAGAIN, errno.EINTR, errno.EBUSY)


def _transient(exc: BaseException) -> bool:
    """Whether an LMDB fault at open goes away by itself: retry the open."""
    return (isinstance(exc, (lmdb.MapResizedError, lmdb.ReadersFullError))
            or _error_code(exc) in _TRANSIENT_ERRNOS)


def _reserve_lock_file(path: str) -> None:
    """Give the lock file its blocks before LMDB maps it. LMDB sizes a new lock file with ftruncate (a sparse
    file) and writes its reader table through the map: on a full disk that write is a SIGBUS, not an error. With
    the blocks allocated here, a full disk is a StoreFull from this call instead."""
    lock_file = os.path.join(path, "lock.mdb")
    try:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if _error_code(exc) in (errno.EACCES, errno.EPERM, errno.EROFS):
            return  # a read-only location: LMDB opens the store read-only (and cannot grow this file either)
        raise _translate(exc, path, "creating the lock file", LOCK_FILE_BYTES) from None
    try:
        size = os.fstat(fd).st_size
        os.posix_fallocate(fd, 0, max(size, LOCK_FILE_BYTES))
    except OSError as exc:
        if _error_code(exc) in (errno.ENOSPC, errno.EDQUOT):
            raise _translate(exc, path, "reserving the lock file", LOCK_FILE_BYTES) from None
        # EOPNOTSUPP/EINVAL: a filesystem without fallocate; LMDB sizes the file itself
    finally:
        os.close(fd)


def _remove_failed_create(path: str, made_dir: bool) -> None:
    """Remove what a failed create left (the store files, and the directory when the create made it)."""
    for name in ("data.mdb", "lock.mdb", KEY_FILE):
        try:
            os.unlink(os.path.join(path, name))
        except OSError:
            pass  # never made, or already gone
    if made_dir:
        try:
            os.rmdir(path)
        except OSError:
            pass  # something else appeared in it: leave it


def _open_env_once(path: str, create: bool, map_size: int, durability: str, checksum: str) -> _SharedEnv:
    data_file = os.path.join(path, "data.mdb")
    existing = os.path.getsize(data_file) if os.path.exists(data_file) else 0
    kwargs = dict(map_size=max(map_size, existing), subdir=True, max_dbs=MAX_DBS, max_readers=MAX_READERS,
                  sync=DURABILITY[durability][0], metasync=DURABILITY[durability][1], meminit=True, lock=True)
    writable = True
    try:
        env = lmdb.open(path, readonly=False, **kwargs)
    except (lmdb.Error, OSError) as exc:
        code = _error_code(exc)
        if isinstance(exc, lmdb.InvalidError) or isinstance(exc, lmdb.VersionMismatchError):
            raise NotAStore(path, f"not an LMDB environment ({exc})") from None
        if isinstance(exc, lmdb.Error) and _transient(exc):
            raise
        if code in (errno.EACCES, errno.EPERM, errno.EROFS) and existing:
            writable = False  # a read-only location: read the store, refuse writes
            try:
                env = lmdb.open(path, readonly=True, **kwargs)
            except (lmdb.Error, OSError) as exc2:
                if isinstance(exc2, lmdb.Error) and _transient(exc2):
                    raise
                raise _translate(exc2, path, "opening read-only") from None
        else:
            raise _translate(exc, path, "opening") from None
    try:
        env.reader_check()  # clear reader slots of dead processes before anything pins old pages
        for _ in range(OPEN_ATTEMPTS):
            try:
                dbs, fmt = _open_dbs(env, path, writable, create, checksum)
                break
            except lmdb.MapResizedError:
                env.set_mapsize(0)  # adopt the map size of the process that grew it, then read again
        else:
            raise StoreError(path, f"opening: the map kept growing under {OPEN_ATTEMPTS} attempts to read it")
    except BaseException:
        env.close()
        raise
    return _SharedEnv(env, path, writable, dbs, fmt)


def _open_dbs(env: lmdb.Environment, path: str, writable: bool, create: bool,
              checksum: str) -> tuple[_Dbs, StoreFormat]:
    with env.begin() as txn:
        names = {bytes(k) for k, _ in txn.cursor()}
    if b"store" not in names:
        if names:
            raise NotAStore(path, "an LMDB environment without kvc's format record (a foreign LMDB)")
        if not (create and writable):
            raise NotAStore(path, "an empty LMDB environment, not a kvc store")
        fmt = StoreFormat(FORMAT_MAGIC, FORMAT_VERSION, checksum, time.time())
        try:
            with env.begin(write=True) as txn:
                handles = {n: env.open_db(n.encode(), txn=txn, create=True, dupsort=n in _DUPFIXED,
                                          dupfixed=n in _DUPFIXED) for n in _DB_NAMES}
                txn.put(b"format", _enc.encode(fmt), db=handles["store"])
                txn.put(b"totals", _enc.encode(StoreTotals(0, 0)), db=handles["store"])
                txn.put(b"capacity", _U64.pack(0), db=handles["store"])
        except lmdb.Error as exc:
            if _transient(exc):
                raise  # the whole open is retried
            raise _translate(exc, path, "creating the store") from None
        return _Dbs(**handles), fmt
    try:
        # Without a txn argument py-lmdb opens each handle in a transaction of its own, the one way a handle
        # opened in a read-only environment stays valid afterwards.
        handles = {n: env.open_db(n.encode(), create=False, dupsort=n in _DUPFIXED, dupfixed=n in _DUPFIXED)
                   for n in _DB_NAMES}
        with env.begin() as txn:
            raw = txn.get(b"format", db=handles["store"])
    except (lmdb.NotFoundError, lmdb.IncompatibleError) as exc:
        raise NotAStore(path, f"an LMDB environment without kvc's sub-databases ({exc})") from None
    try:
        fmt = _dec_format.decode(raw) if raw is not None else None
    except msgspec.DecodeError:
        fmt = None
    if fmt is None or fmt.magic != FORMAT_MAGIC:
        raise NotAStore(path, "an LMDB environment without kvc's format record (a foreign LMDB)")
    if fmt.version > FORMAT_VERSION:
        raise StoreUnsupported(path, f"store format {fmt.version} is newer than this kvc ({FORMAT_VERSION})")
    if fmt.checksum not in CHECKSUMS:
        raise StoreUnsupported(path, f"store checksums use {fmt.checksum!r}; this install has "
                                     f"{', '.join(CHECKSUMS)} (install the 'xxhash' package)")
    return _Dbs(**handles), fmt


def _acquire(path: str, create: bool, map_size: int, durability: str,
             checksum: str = DEFAULT_CHECKSUM) -> _SharedEnv:
    with _ENVS_LOCK:
        shared = _ENVS.get(path)
        if shared is None or shared.pid != os.getpid():
            shared = _open_env(path, create, map_size, durability, checksum)
            _ENVS[path] = shared
        shared.refs += 1
        return shared


def _release(shared: _SharedEnv) -> None:
    with _ENVS_LOCK:
        shared.refs -= 1
        if shared.refs <= 0 and shared.pid == os.getpid():
            if _ENVS.get(shared.path) is shared:
                del _ENVS[shared.path]
            shared.env.close()


def _limits(txn: lmdb.Transaction, dbs: _Dbs) -> tuple[int, int]:
    """(capacity, namespace quota) in payload bytes; 0 = none. Stores written before quotas lack the key."""
    quota = txn.get(b"ns_quota", db=dbs.store)
    return _U64.unpack(txn.get(b"capacity", db=dbs.store))[0], (_U64.unpack(quota)[0] if quota else 0)


class _NsDelta:
    """Registry changes for one namespace, gathered during a transaction and applied at its end."""

    __slots__ = ("pages", "bytes", "hits", "last_access", "roots", "info")

    def __init__(self) -> None:
        self.pages = 0
        self.bytes = 0
        self.hits = 0
        self.last_access = 0.0
        self.roots: set[str] = set()
        self.info: Namespace | None = None  # set by writers, which know extra_key and salt fingerprint


def _decode_or_none(decoder: msgspec.msgpack.Decoder, raw: Any) -> Any:
    """A record decoded, or None when its bytes are damaged."""
    try:
        return decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _chains_to(page_hash: bytes, meta: PageMeta) -> bool:
    """Whether `page_hash` is H(parent || tokens) of its metadata: the chain step of kvcache.keys."""
    n = len(meta.tokens) // TOKEN_BYTES
    return n > 0 and n * TOKEN_BYTES == len(meta.tokens) and extend_chain(meta.parent, meta.tokens, n) == [page_hash]


def _subtree_size(top: bytes, kids: dict[bytes, list[bytes]],
                  tree: dict[bytes, tuple[bytes, bytes, bytes, int]]) -> tuple[int, int]:
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
        nbytes += tree[h][3]
        stack.extend(kids.get(h, ()))
    return pages, nbytes


class _Findings:
    """What one verify found, and what repair may do about each finding (indices into `items`)."""

    __slots__ = ("items", "by_page", "remove", "relink", "unlink", "recount", "fixed", "damaged", "damaged_meta",
                 "lookup_missed", "misrouted")

    def __init__(self) -> None:
        self.items: list[VerifyFinding] = []
        self.by_page: dict[bytes, list[int]] = {}  # page -> the findings about it (fixed when it is removed)
        self.remove: dict[bytes, int] = {}  # page -> the first finding that makes it removable, in scan order
        self.relink: dict[bytes, int] = {}  # page -> its missing_index finding
        self.unlink: list[tuple[bytes, bytes, int]] = []  # (parent, child, finding) of dangling children entries
        self.recount: list[int] = []  # counter_mismatch findings
        self.fixed: set[int] = set()  # findings repaired
        self.damaged: list[tuple[str, bytes, int]] = []  # (sub-database, key, finding) of records that do not decode
        self.damaged_meta: set[bytes] = set()  # pages whose metadata does not decode
        self.lookup_missed: dict[str, set[bytes]] = {"meta": set(), "pages": set()}  # keys a lookup did not find
        self.misrouted: dict[str, int] = {"meta": 0, "pages": 0}  # ... of which a walk found this many

    def add(self, kind: str, page_hash: bytes | None, detail: str, remove: bool = False) -> None:
        """Record a finding; `remove`: the page under `page_hash` is provably corrupt or unreachable."""
        i = len(self.items)
        self.items.append(VerifyFinding(kind, None if page_hash is None else page_hash.hex(), detail))
        if page_hash is not None and kind != "dangling_index" or remove:
            self.by_page.setdefault(page_hash, []).append(i)
        if remove:
            self.remove.setdefault(page_hash, i)


class LMDBStore:
    """The default L3 backend (see the module docstring). Open with `LMDBStore.open` or `open_store`.

    A handle belongs to one process; after a fork, the child's first call reopens the environment. Handles on
    one path in one process share its Environment. Methods are safe to call from several threads.
    """

    backend = BACKEND

    def __init__(self, shared: _SharedEnv, location: str, layout: KVLayout | None, readonly: bool,
                 access: AccessPolicy, map_size: int, durability: str) -> None:
        self._shared = shared
        self.location = location  # the path given to open (realpath in `path`)
        self.path = shared.path
        self.layout = layout
        self.readonly = readonly
        self.access_policy = access
        self._map_size = map_size
        self._durability = durability
        self._checksum = CHECKSUMS[shared.format.checksum]
        self._closed = False
        self._lock = threading.Lock()  # guards the pending access log and the corrupt set
        # Reads are logged as (unix seconds, deepest page hash, pages served) and folded into metadata by flush().
        self._pending: list[tuple[float, bytes, int]] = []
        self._pending_pages = 0
        self._pending_since = 0.0
        self._corrupt: set[bytes] = set()  # pages that failed their checksum here; misses until dropped
        self._counts = {name: 0 for name in StoreCounters.__struct_fields__ if name != "pending_access"}
        # (sub-database, records walked, last key): called as verify walks, by the isolated audit (lmdb_salvage)
        self.progress: Callable[[str, int, bytes | None], None] | None = None

    # -- opening --------------------------------------------------------------------------------------------

    @classmethod
    def open(cls, location: str, layout: KVLayout | None = None, *, create: bool = False, readonly: bool = False,
             add_layout: bool = False, capacity: CapacityPolicy | None = None, access: AccessPolicy | None = None,
             map_size: int = DEFAULT_MAP_SIZE, durability: str = DEFAULT_DURABILITY,
             checksum: str = DEFAULT_CHECKSUM) -> "LMDBStore":
        """Open the store at `location` (a path or ``lmdb://PATH``).

        `layout`: the layout this handle writes under; it must be held by the store unless the store is created
        now or `add_layout` registers it (LayoutMismatch otherwise, naming the layouts held). `capacity`: record
        new payload limits (every process then uses them). `map_size`: initial map size in bytes (grows on
        demand). `durability`: a key of DURABILITY (the first handle opened in a process sets it for the
        environment). `checksum`: the algorithm of a store created now (a key of CHECKSUMS); an existing store
        keeps the one it was created with.
        """
        path = location[len("lmdb://"):] if location[:len("lmdb://")].lower() == "lmdb://" else location
        if not path:
            raise InvalidInput("an LMDB store location needs a path")
        path = os.path.realpath(path)
        if checksum not in CHECKSUMS:
            raise InvalidInput(f"checksum {checksum!r} is not one of {', '.join(CHECKSUMS)}")
        existed = os.path.exists(os.path.join(path, "data.mdb"))
        if readonly and not existed:
            raise NotAStore(path, "no kvc store here to open read-only")
        if durability not in DURABILITY:
            raise InvalidInput(f"durability {durability!r} is not one of {', '.join(DURABILITY)}")
        made_dir = not os.path.exists(path)
        shared = _acquire(path, create and not readonly, map_size, durability, checksum)
        store = cls(shared, location, layout, readonly or not shared.writable, access or AccessPolicy(), map_size,
                    durability)
        try:
            # the salt fingerprints this store records and shows are keyed by its key file (kvcache.namespace)
            store.fingerprint_key = read_key(path) if store.readonly else ensure_key(path)
            if layout is not None:
                store._bind_layout(layout, register=(create and not existed) or add_layout)
            if capacity is not None:
                store.set_capacity(capacity.capacity_bytes, capacity.namespace_quota_bytes)
            store._evict_headroom = (capacity or CapacityPolicy()).evict_headroom
        except BaseException:
            store.close()
            if create and not existed and shared.refs == 0:
                _remove_failed_create(path, made_dir)  # a create is whole or not at all (a full disk, say)
            raise
        return store

    _evict_headroom = CapacityPolicy().evict_headroom
    fingerprint_key: bytes | None = None  # from the store's key file; None: a read-only store made without one

    @classmethod
    def verify_location(cls, location: str, repair: bool = False) -> VerifyReport:
        """`verify(repair)` of the store at `location`, safe against a damaged store: every pass runs in a child
        process, a walk that dies in a damaged B-tree is a `structure_corrupt` finding, and `repair` rebuilds
        such a store from what still reads back sound (see `lmdb_salvage`). Opens nothing in this process."""
        from .lmdb_salvage import audit_location  # the salvage builds on this module

        return audit_location(location, repair)

    def _bind_layout(self, layout: KVLayout, register: bool) -> None:
        held = self._layout_records()
        if layout.layout_id in held:
            return
        if not register:
            raise LayoutMismatch(self.path, layout.describe(), [r.layout.describe() for r in held.values()])
        self._check_writable()
        record = _enc.encode(LayoutRecord(layout, time.time()))
        dbs = self._live().dbs
        self._write(lambda txn: txn.put(layout.layout_id, record, db=dbs.layouts, overwrite=False))

    def _live(self) -> _SharedEnv:
        if self._closed:
            raise StoreError(self.path, "the store handle is closed")
        shared = self._shared
        if shared.pid != os.getpid():
            # A forked child: the parent's Environment (and its pending reads) are not ours.
            self._shared = shared = _acquire(self.path, False, self._map_size, self._durability)
            with self._lock:
                self._pending, self._pending_pages, self._corrupt = [], 0, set()
        return shared

    def _write(self, body: Callable[[lmdb.Transaction], Any], wanted: int = 0) -> Any:
        shared = self._live()
        try:
            return shared.write(body, grow_hint=wanted)
        except StoreError:
            raise
        except (lmdb.Error, OSError) as exc:
            raise _translate(exc, self.path, "writing", wanted) from None

    def _check_writable(self) -> None:
        if self.readonly:
            why = "opened read-only" if self._shared.writable else "at a read-only location"
            raise StoreReadOnly(self.path, f"cannot write: the store is {why}")

    # -- reading --------------------------------------------------------------------------------------------

    def exists_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many pages from the start of `hashes` are stored (stops at the first gap)."""
        if not hashes:
            return 0
        check_page_hashes(hashes)
        shared = self._live()
        corrupt = self._corrupt
        found = 0
        try:
            with shared.read(buffers=True) as txn:
                get, db = txn.get, shared.dbs.pages
                for h in hashes:
                    if get(h, None, db) is None or (corrupt and h in corrupt):
                        break
                    found += 1
        except lmdb.Error:
            self._counts["read_errors"] += 1
        if found < len(hashes):
            self._counts["misses"] += 1
        return found

    def get_into(self, hashes: Sequence[bytes], out_views: Sequence[Any]) -> int:
        """Copy pages into caller-provided writable byte views; return how many consecutive pages from the start
        were copied and verified. A missing, corrupt or unreadable page ends the run (and is counted)."""
        outs = out_views_for(hashes, out_views)
        n = len(outs)
        if n == 0:
            return 0
        if self.layout is not None:
            want = self.layout.bytes_per_page
            if any(len(out) != want for out in outs):
                raise InvalidInput(f"get_into needs out views of {want} bytes (a page of layout "
                                   f"{self.layout.describe()}), got {sorted({len(o) for o in outs})}")
        shared = self._live()
        digest, seeds, stored = self._checksum.digest, self._checksum.seeds(hashes), _U64.unpack_from
        corrupt = self._corrupt
        done = 0
        try:
            with shared.read(buffers=True) as txn:
                get, db = txn.get, shared.dbs.pages
                for h, out, seed in zip(hashes, outs, seeds):
                    value = get(h, None, db)
                    if value is None or (corrupt and h in corrupt):
                        break
                    # A stored size other than a page's (the out views were checked above) is a damaged record:
                    # a miss, quarantined like a checksum failure. The copy happens inside the transaction (see
                    # the module docstring), and is checked on the copy, still in cache: what the caller got is
                    # what was verified.
                    if len(value) - _HEADER != len(out):
                        self._quarantine(h)
                        break
                    out[:] = value[_HEADER:]
                    if digest(out, seed) != stored(value)[0]:
                        self._quarantine(h)
                        break
                    done += 1
        except lmdb.Error:
            self._counts["read_errors"] += 1
        self._counts["pages_read"] += done
        if done < n:
            self._counts["misses"] += 1
        if done and not self.readonly:
            self._record_access(hashes[done - 1], done)
        return done

    def _quarantine(self, page_hash: bytes) -> None:
        """A page failed verification on read: a miss from now on in this handle, dropped by the next write
        transaction (which checks it again first) or by `verify(repair=True)`."""
        with self._lock:
            self._corrupt.add(page_hash)
        self._counts["checksum_failures"] += 1

    def _record_access(self, deepest: bytes, pages: int) -> None:
        # One entry per read, not per page: the read is credited to the deepest page it reached (its ancestors
        # were read with it; see _apply_access).
        now = time.time()
        with self._lock:
            if not self._pending:
                self._pending_since = now
            self._pending.append((now, deepest, pages))
            self._pending_pages += pages
            due = (len(self._pending) >= self.access_policy.flush_reads
                   or now - self._pending_since >= self.access_policy.flush_interval_s)
        if due:
            try:
                self.flush()
            except StoreError:
                # A read must not fail because its bookkeeping could not be written; the log is kept and
                # written by a later flush.
                self._counts["flush_errors"] += 1

    def page_meta(self, page_hash: bytes) -> PageMeta | None:
        """A page's metadata, or None when it is not stored."""
        shared = self._live()
        with shared.read() as txn:
            raw = txn.get(page_hash, db=shared.dbs.meta)
        return None if raw is None else _dec_meta.decode(raw)

    def children(self, page_hash: bytes) -> list[ChildInfo]:
        """Stored children of a page hash or of a namespace root, hottest (most reads through the child, then
        most recent) first. Each child's figures cover its subtree (see _apply_access): O(subtree) lookups."""
        shared = self._live()
        out: list[ChildInfo] = []
        with shared.read() as txn:
            cur = txn.cursor(db=shared.dbs.children)
            for child in self._child_hashes(cur, page_hash):
                raw = txn.get(child, db=shared.dbs.meta)
                if raw is not None:
                    m = _dec_meta.decode(raw)
                    last_access, hits = self._subtree_heat(txn, cur, child, m)
                    out.append(ChildInfo(child, m.tokens, m.nbytes, hits, last_access))
        out.sort(key=lambda c: (-c.hits, -c.last_access))
        return out

    @staticmethod
    def _child_hashes(cur: lmdb.Cursor, page_hash: bytes) -> list[bytes]:
        return [bytes(c) for c in cur.iternext_dup(keys=False, values=True)] if cur.set_key(page_hash) else []

    def _subtree_heat(self, txn: lmdb.Transaction, cur: lmdb.Cursor, top_hash: bytes,
                      top: PageMeta) -> tuple[float, int]:
        """(latest access, reads) over the stored subtree of a page: reads are credited to the deepest page they
        reached, so a page's heat is its subtree's. Costs one lookup per page below it."""
        meta_db = self._shared.dbs.meta
        last, hits = top.last_access, top.hits
        stack = self._child_hashes(cur, top_hash)
        while stack:
            h = stack.pop()
            raw = txn.get(h, db=meta_db)
            if raw is None:
                continue
            m = _dec_meta.decode(raw)
            last, hits = max(last, m.last_access), hits + m.hits
            stack.extend(self._child_hashes(cur, h))
        return last, hits

    def root(self, namespace: Namespace, layout: KVLayout | None = None) -> bytes:
        """The hash root of `namespace` under `layout` (default: this handle's layout)."""
        layout = layout or self.layout
        if layout is None:
            raise InvalidInput("root() needs a layout: open the store with one or pass it")
        return hash_root(layout.layout_id, namespace)

    def _layout_records(self) -> dict[bytes, LayoutRecord]:
        shared = self._live()
        with shared.read() as txn:
            return {bytes(k): _dec_layout.decode(v) for k, v in txn.cursor(db=shared.dbs.layouts)}

    def layouts(self) -> list[KVLayout]:
        """Every layout the store holds, oldest first."""
        return [r.layout for r in sorted(self._layout_records().values(), key=lambda r: r.created)]

    def namespaces(self) -> list[NamespaceRecord]:
        """The namespace registry, most pages first."""
        shared = self._live()
        with shared.read() as txn:
            records = [_dec_ns.decode(v) for _, v in txn.cursor(db=shared.dbs.namespaces)]
        return sorted(records, key=lambda r: (-r.pages, r.ns_id_hex))

    def capacity_bytes(self) -> int:
        """The payload limit every process applies (0: unlimited)."""
        return self._limits()[0]

    def namespace_quota_bytes(self) -> int:
        """The payload limit of each namespace every process applies (0: none)."""
        return self._limits()[1]

    def _limits(self) -> tuple[int, int]:
        shared = self._live()
        with shared.read() as txn:
            return _limits(txn, shared.dbs)

    def set_capacity(self, capacity_bytes: int, namespace_quota_bytes: int | None = None) -> None:
        """Record new payload limits (`namespace_quota_bytes` None: keep the current quota). Take effect at the
        next put, which evicts down to them."""
        if capacity_bytes < 0 or (namespace_quota_bytes or 0) < 0:
            raise InvalidInput(f"limits must be >= 0, got {capacity_bytes} and {namespace_quota_bytes}")
        self._check_writable()
        db = self._live().dbs.store

        def body(txn: lmdb.Transaction) -> None:
            txn.put(b"capacity", _U64.pack(capacity_bytes), db=db)
            if namespace_quota_bytes is not None:
                txn.put(b"ns_quota", _U64.pack(namespace_quota_bytes), db=db)

        self._write(body)

    def stats(self) -> StoreStats:
        """Totals from the store and this handle's counters."""
        shared = self._live()
        with shared.read() as txn:
            totals = _dec_totals.decode(txn.get(b"totals", db=shared.dbs.store))
            capacity, quota = _limits(txn, shared.dbs)
            n_layouts = txn.stat(shared.dbs.layouts)["entries"]
            n_ns = txn.stat(shared.dbs.namespaces)["entries"]
        footprint = os.path.getsize(os.path.join(self.path, "data.mdb"))
        return StoreStats(BACKEND, self.location, shared.format.version, shared.format.checksum, n_layouts, n_ns,
                          totals.pages, totals.bytes, capacity, quota, footprint, self.counters())

    def counters(self) -> StoreCounters:
        """This handle's counters."""
        fields = {k: v for k, v in self._counts.items() if k in StoreCounters.__struct_fields__}
        return StoreCounters(**fields, pending_access=self._pending_pages)

    def map_size(self) -> int:
        """The current LMDB map size in bytes."""
        return self._live().env.info()["map_size"]

    # -- writing --------------------------------------------------------------------------------------------

    def put(self, hashes: Sequence[bytes], pages: Sequence[Any], origins: Sequence[PageOrigin]) -> PutResult:
        """Store a batch of pages in one write transaction (metadata, indexes and counters with it).

        Pages already stored are left as they are (`existing`). Over a namespace's quota, the oldest leaf pages
        (no stored children) of that namespace are evicted to make room; over the capacity, the oldest leaf pages
        of any namespace. Pages that still do not fit are `rejected`: once a page of a namespace is rejected, so
        are the namespace's later pages in the batch (all of them, at the capacity), so what is stored of a chain
        stays a prefix.
        """
        self._check_writable()
        layout = self.layout
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
        if not hashes:
            return PutResult(0, 0, 0, 0, 0)
        batch_ns = {h: o.namespace.id for h, o in zip(hashes, origins)}
        for h, origin in zip(hashes, origins):
            up = batch_ns.get(origin.parent)
            if up is not None and up != origin.namespace.id:
                raise InvalidInput(f"page {h.hex()}: its parent in this batch is in another namespace than "
                                   f"{origin.namespace.label}")
        shared = self._live()
        dbs, layout_id = shared.dbs, layout.layout_id
        roots = {ns.id: hash_root(layout_id, ns) for ns in {o.namespace for o in origins}}
        scratch = bytearray(_HEADER + nbytes)
        value = memoryview(scratch)
        payload = value[_HEADER:]
        digest, seeds = self._checksum.digest, self._checksum.seeds(hashes)
        pending, corrupt = self._take_pending()

        def body(txn: lmdb.Transaction) -> PutResult:
            now = time.time()
            deltas: dict[bytes, _NsDelta] = {}
            totals = _dec_totals.decode(txn.get(b"totals", db=dbs.store))
            capacity, quota = _limits(txn, dbs)
            dropped = self._drop_corrupt(txn, corrupt, deltas)
            self._apply_access(txn, pending, deltas)
            seen: set[bytes] = set()
            fresh: set[bytes] = set()  # pages of this batch not stored before it
            new = []
            for i, h in enumerate(hashes):
                if h in seen or txn.get(h, db=dbs.meta) is not None:
                    seen.add(h)
                    continue
                seen.add(h)
                fresh.add(h)
                new.append(i)
                origin = origins[i]
                if origin.parent != roots[origin.namespace.id] and origin.parent not in fresh:
                    # The chain check above cannot see the namespace; a stored parent can (a parent new in this
                    # batch was checked against the batch before the transaction). A parent that is no stored
                    # page may be another namespace's root: that page would be read in the other namespace's
                    # chain, so it is refused like one.
                    raw = txn.get(origin.parent, db=dbs.meta)
                    if raw is None:
                        raise InvalidInput(f"page {h.hex()}: its parent is not a stored page nor the root of "
                                           f"namespace {origin.namespace.label}")
                    if _dec_meta.decode(raw).ns_id != origin.namespace.id:
                        raise InvalidInput(f"page {h.hex()}: its parent is in another namespace than "
                                           f"{origin.namespace.label}")
            stored_bytes = totals.bytes - dropped[1]
            evicted = 0
            protect = set(hashes) | {o.parent for o in origins}
            # Evictions take a little past the need so the scan behind one is paid once per many puts.
            ns_room: dict[bytes, int] = {}
            if quota:
                ns_need: Counter[bytes] = Counter(origins[i].namespace.id for i in new)
                for ns_id, n_new in ns_need.items():
                    raw = txn.get(ns_id, db=dbs.namespaces)
                    held = _dec_ns.decode(raw).bytes if raw is not None else 0
                    held += deltas[ns_id].bytes if ns_id in deltas else 0  # corrupt pages dropped above
                    if held + n_new * nbytes > quota:
                        target = held + n_new * nbytes - quota + int(self._evict_headroom * quota)
                        n, freed = self._evict(txn, target, protect, deltas, only_ns=ns_id)
                        evicted += n
                        held -= freed
                        stored_bytes -= freed
                    ns_room[ns_id] = quota - held
            need = len(new) * nbytes
            if capacity and stored_bytes + need > capacity:
                target = stored_bytes + need - capacity + int(self._evict_headroom * capacity)
                n, freed = self._evict(txn, target, protect, deltas)
                evicted += n
                stored_bytes -= freed
            room = capacity - stored_bytes if capacity else len(new) * nbytes
            accepted: list[int] = []
            full: set[bytes] = set()  # namespaces with a rejected page in this batch
            for i in new:
                ns_id = origins[i].namespace.id
                if room < nbytes:
                    break
                if ns_id in full or (quota and ns_room[ns_id] < nbytes):
                    full.add(ns_id)
                    continue
                accepted.append(i)
                room -= nbytes
                if quota:
                    ns_room[ns_id] -= nbytes
            metas: list[tuple[bytes, bytes]] = []
            links: list[tuple[bytes, bytes]] = []
            for i in accepted:
                h, origin = hashes[i], origins[i]
                # The checksum is taken of the copy, still in cache: one read of the caller's page instead of
                # two, and what is summed is exactly what is stored even if the caller's buffer changes meanwhile.
                payload[:] = views[i]
                checksum = digest(payload, seeds[i])
                _U64.pack_into(scratch, 0, checksum)
                txn.put(h, value, db=dbs.pages)
                ns_id = origin.namespace.id
                meta = PageMeta(ns_id, layout_id, origin.parent, origin.tokens, nbytes, checksum, now, now, 0)
                metas.append((h, _enc.encode(meta)))
                links.append((origin.parent, h))
                d = deltas.get(ns_id) or deltas.setdefault(ns_id, _NsDelta())
                d.info = origin.namespace
                d.pages += 1
                d.bytes += nbytes
                d.last_access = now
                if origin.parent == roots[ns_id]:
                    d.roots.add(origin.parent.hex())
            written = len(accepted)
            # Index records go in with putmulti: one C loop per sub-database instead of a Python call per record.
            txn.cursor(db=dbs.meta).putmulti(metas)
            txn.cursor(db=dbs.children).putmulti(links)
            self._apply_deltas(txn, deltas, now)
            pages_now = totals.pages - dropped[0] - evicted + written
            txn.put(b"totals", _enc.encode(StoreTotals(pages_now, stored_bytes + written * nbytes)), db=dbs.store)
            return PutResult(written, len(hashes) - len(new), len(new) - written, evicted, written * nbytes)

        try:
            result = self._write(body, wanted=len(hashes) * (nbytes + 512))
        except BaseException:
            self._restore_pending(pending, corrupt)
            raise
        with self._lock:
            self._corrupt -= corrupt
        c = self._counts
        c["pages_written"] += result.written
        c["pages_existing"] += result.existing
        c["pages_rejected"] += result.rejected
        c["pages_evicted"] += result.evicted
        if pending:
            c["flushes"] += 1
        return result

    def _drop_page(self, txn: lmdb.Transaction, page_hash: bytes, meta: PageMeta,
                   deltas: dict[bytes, _NsDelta]) -> None:
        """Remove one page and every index entry of it; its namespace's counters go into `deltas`."""
        dbs = self._shared.dbs
        txn.delete(page_hash, db=dbs.pages)
        txn.delete(page_hash, db=dbs.meta)
        txn.delete(meta.parent, page_hash, db=dbs.children)
        d = deltas.get(meta.ns_id) or deltas.setdefault(meta.ns_id, _NsDelta())
        d.pages -= 1
        d.bytes -= meta.nbytes

    def _evict(self, txn: lmdb.Transaction, need: int, protect: set[bytes], deltas: dict[bytes, _NsDelta],
               only_ns: bytes | None = None) -> tuple[int, int]:
        """Evict least recently used leaf pages (of namespace `only_ns`, or of any) until `need` payload bytes are
        free; (pages, bytes) evicted.

        Only leaves (no stored children) are taken. Evicting a leaf can make its parent a leaf: the parent then
        competes with the time of the child it lost (it was read whenever the child was), so a chain shrinks from
        its tail and what stays of it is a prefix. LRU is approximate: access times are as of the last flush.
        """
        dbs = self._shared.dbs
        items = list(txn.cursor(db=dbs.meta))
        if not items:
            return 0, 0
        metas = [_dec_meta.decode(v) for _, v in items]
        keys = [bytes(k) for (k, _), m in zip(items, metas) if only_ns is None or m.ns_id == only_ns]
        times = [m.last_access for m in metas if only_ns is None or m.ns_id == only_ns]
        if not keys:
            return 0, 0
        order = np.argsort(np.array(times), kind="stable").tolist()
        children = txn.cursor(db=dbs.children)
        freed = evicted = 0
        orphans: list[tuple[float, bytes]] = []  # (effective last access, page hash) of parents become leaves
        i = 0
        while freed < need and (i < len(order) or orphans):
            if orphans and (i >= len(order) or orphans[0][0] <= times[order[i]]):
                when, h = heapq.heappop(orphans)
            else:
                when, h = times[order[i]], keys[order[i]]
                i += 1
            if h in protect or children.set_key(h):
                continue
            raw = txn.get(h, db=dbs.meta)
            if raw is None:
                continue  # taken already
            meta = _dec_meta.decode(raw)
            self._drop_page(txn, h, meta, deltas)
            evicted += 1
            freed += meta.nbytes
            parent_raw = txn.get(meta.parent, db=dbs.meta)
            if parent_raw is not None and not children.set_key(meta.parent):
                parent = _dec_meta.decode(parent_raw)
                heapq.heappush(orphans, (max(when, parent.last_access), meta.parent))
        return evicted, freed

    def _take_pending(self) -> tuple[list[tuple[float, bytes, int]], set[bytes]]:
        with self._lock:
            pending, self._pending, self._pending_pages = self._pending, [], 0
            return pending, set(self._corrupt)

    def _restore_pending(self, pending: list[tuple[float, bytes, int]], corrupt: set[bytes]) -> None:
        with self._lock:
            self._pending[:0] = pending
            self._pending_pages += sum(n for _, _, n in pending)
            self._corrupt |= corrupt

    def _apply_access(self, txn: lmdb.Transaction, pending: list[tuple[float, bytes, int]],
                      deltas: dict[bytes, _NsDelta]) -> int:
        """Fold logged reads into page metadata and namespace counters; pages updated.

        A read of a run of pages is credited to the deepest page of the run: its `hits` count the reads that ended
        there and its `last_access` is the last of them. Ancestors are not rewritten (that would cost a write
        per page read, as much as the read itself at small pages); a page's heat is that of its subtree, which
        is what eviction (a parent inherits the time of the child it loses) and `children()` use.
        """
        if not pending:
            return 0
        hits: Counter[bytes] = Counter()
        pages: Counter[bytes] = Counter()
        last: dict[bytes, float] = {}
        for when, deepest, n in pending:
            hits[deepest] += 1
            pages[deepest] += n
            last[deepest] = when
        cur = txn.cursor(db=self._shared.dbs.meta)
        updated = []
        for key, raw in cur.getmulti(list(hits)):  # the pages still stored
            h = bytes(key)
            meta = _dec_meta.decode(raw)
            when = max(meta.last_access, last[h])
            updated.append((h, _enc.encode(msgspec.structs.replace(meta, hits=meta.hits + hits[h], last_access=when))))
            d = deltas.get(meta.ns_id) or deltas.setdefault(meta.ns_id, _NsDelta())
            d.hits += pages[h]
            d.last_access = max(d.last_access, when)
        cur.putmulti(updated)
        return len(updated)

    def _drop_corrupt(self, txn: lmdb.Transaction, corrupt: set[bytes],
                      deltas: dict[bytes, _NsDelta]) -> tuple[int, int]:
        """Drop pages that failed their checksum (rechecked here); (pages, bytes) dropped."""
        dropped = freed = 0
        dbs = self._shared.dbs
        for h in corrupt:
            value = txn.get(h, db=dbs.pages)
            raw = txn.get(h, db=dbs.meta)
            if value is None or raw is None:
                continue
            meta = _decode_or_none(_dec_meta, raw)
            if meta is None:
                continue  # metadata that does not decode: verify reports it, repair removes the page
            if (len(value) - _HEADER == meta.nbytes
                    and self._checksum.of(value[_HEADER:], h) == _U64.unpack_from(value)[0]):
                continue  # rewritten since
            self._drop_page(txn, h, meta, deltas)
            dropped += 1
            freed += meta.nbytes
        return dropped, freed

    def _apply_deltas(self, txn: lmdb.Transaction, deltas: dict[bytes, _NsDelta], now: float) -> None:
        db = self._shared.dbs.namespaces
        for ns_id, d in deltas.items():
            raw = txn.get(ns_id, db=db)
            if raw is None:
                if d.info is None:
                    continue  # a namespace deleted meanwhile
                info = d.info.info(self.fingerprint_key)
                record = NamespaceRecord(ns_id.hex(), info.extra_key, info.salt_fingerprint, 0, 0, now, now, 0)
            else:
                record = _dec_ns.decode(raw)
            roots = record.roots if not d.roots - set(record.roots) else sorted(set(record.roots) | d.roots)
            record = msgspec.structs.replace(
                record, pages=record.pages + d.pages, bytes=record.bytes + d.bytes, hits=record.hits + d.hits,
                last_access=max(record.last_access, d.last_access), roots=roots)
            txn.put(ns_id, _enc.encode(record), db=db)

    def flush(self) -> None:
        """Write logged reads (hit counts, access times) in one transaction, and drop pages seen corrupt."""
        if self.readonly or self._closed:
            return
        pending, corrupt = self._take_pending()
        if not pending and not corrupt:
            return
        dbs = self._live().dbs

        def body(txn: lmdb.Transaction) -> None:
            deltas: dict[bytes, _NsDelta] = {}
            dropped = self._drop_corrupt(txn, corrupt, deltas)
            self._apply_access(txn, pending, deltas)
            self._apply_deltas(txn, deltas, time.time())
            if dropped[0]:
                totals = _dec_totals.decode(txn.get(b"totals", db=dbs.store))
                txn.put(b"totals", _enc.encode(StoreTotals(totals.pages - dropped[0], totals.bytes - dropped[1])),
                        db=dbs.store)

        try:
            self._write(body)
        except BaseException:
            self._restore_pending(pending, corrupt)
            raise
        with self._lock:
            self._corrupt -= corrupt
        self._counts["flushes"] += 1

    def delete_namespace(self, ns_id: bytes) -> DeleteResult:
        """Remove every page of namespace `ns_id` (16 bytes) and its registry record.

        Pages are found by scanning `meta` in chunks of short read transactions and removed DELETE_BATCH_PAGES per
        write transaction, so a large tenant's offboarding never holds the writer lock (or pins old pages) for
        long. Scans repeat until one finds nothing, so pages a concurrent writer adds meanwhile go too."""
        self._check_writable()
        if not isinstance(ns_id, bytes) or len(ns_id) != 16:
            raise InvalidInput(f"a namespace id is 16 bytes, got {ns_id!r:.60}")
        self.flush()
        shared = self._live()
        dbs = shared.dbs
        pages = nbytes = txns = 0

        def drop(batch: list[bytes], last: bool) -> Callable[[lmdb.Transaction], tuple[int, int]]:
            def body(txn: lmdb.Transaction) -> tuple[int, int]:
                deltas: dict[bytes, _NsDelta] = {}
                dropped = freed = 0
                for h in batch:
                    raw = txn.get(h, db=dbs.meta)
                    if raw is None:
                        continue  # gone meanwhile
                    meta = _dec_meta.decode(raw)
                    self._drop_page(txn, h, meta, deltas)
                    dropped += 1
                    freed += meta.nbytes
                if dropped:
                    totals = _dec_totals.decode(txn.get(b"totals", db=dbs.store))
                    txn.put(b"totals", _enc.encode(StoreTotals(totals.pages - dropped, totals.bytes - freed)),
                            db=dbs.store)
                if last:
                    txn.delete(ns_id, db=dbs.namespaces)
                else:
                    self._apply_deltas(txn, deltas, time.time())
                return dropped, freed
            return body

        while True:
            found = self._pages_of(ns_id)
            for start in range(0, max(len(found), 1), DELETE_BATCH_PAGES):
                batch = found[start:start + DELETE_BATCH_PAGES]
                dropped, freed = self._write(drop(batch, last=start + DELETE_BATCH_PAGES >= len(found)))
                txns += 1
                pages += dropped
                nbytes += freed
            if not found:
                break
        return DeleteResult(pages, nbytes, txns)

    def _pages_of(self, ns_id: bytes) -> list[bytes]:
        """Hashes of the stored pages of one namespace: a scan of `meta`, VERIFY_CHUNK_PAGES x 16 per read txn."""
        shared = self._live()
        return [h for _, h, value in self._scan(shared.dbs.meta, VERIFY_CHUNK_PAGES * 16, "meta")
                if getattr(_decode_or_none(_dec_meta, value), "ns_id", None) == ns_id]

    def _scan(self, db: Any, chunk: int, label: str = "") -> Iterator[tuple[lmdb.Transaction, bytes, Any]]:
        """Every (txn, key, value) of `db` in key order, `chunk` entries per short read transaction (a long one
        pins old pages while writers go on). `value` is a zero-copy view: use it before the next item."""
        shared = self._live()
        after: bytes | None = None
        walked = 0
        while True:
            if self.progress is not None:
                self.progress(label, walked, after)
            with shared.read(buffers=True) as txn:
                cur = txn.cursor(db=db)
                positioned = cur.first() if after is None else cur.set_range(after)
                if positioned and after is not None and bytes(cur.key()) == after:
                    positioned = cur.next()
                n = 0
                while positioned and n < chunk:
                    after = bytes(cur.key())
                    yield txn, after, cur.value()
                    n += 1
                    positioned = cur.next()
                walked += n
            if not positioned:
                return

    # -- integrity ------------------------------------------------------------------------------------------

    def verify(self, repair: bool = False) -> VerifyReport:
        """Scan every page (checksum, size, hash, metadata, indexes), the prefix trees and the registry counters.

        Payloads are checked in chunks of VERIFY_CHUNK_PAGES, each in its own short read transaction, so a verify
        of a large store never pins old pages while writers go on. The tree, index and counter checks read one
        snapshot of the metadata (never payloads): parents, children and counters only agree on one snapshot.

        `repair` removes what is provably corrupt or unreachable (base.REPAIRS): each finding's page with every
        page below it, dangling index entries, and recounts the registry. Every removal is rechecked inside its
        write transaction (at most REPAIR_BATCH_PAGES records each) and listed in the report's `removals`; a
        page that is sound and reachable from its namespace root is never removed.
        """
        if repair:
            self._check_writable()
        shared = self._live()
        found = _Findings()
        layouts = self._verify_layouts(found)
        checked = checked_bytes = 0
        for txn, h, value in self._scan(shared.dbs.pages, VERIFY_CHUNK_PAGES, "pages"):
            checked += 1
            checked_bytes += max(len(value) - _HEADER, 0)
            self._verify_page(txn, h, value, layouts, found)
        kids, tree = self._verify_tree(layouts, found)
        self._check_lookups(found)
        if not repair:
            return VerifyReport(not found.items, checked, checked_bytes, found.items)
        removals = self._repair(found, kids, tree, layouts)
        items = [msgspec.structs.replace(f, repaired=True) if i in found.fixed else f
                 for i, f in enumerate(found.items)]
        return VerifyReport(not items, checked, checked_bytes, items, len(found.fixed), removals)

    def _check_lookups(self, found: _Findings) -> None:
        """A record that a lookup missed but a walk of its sub-database finds is no missing record: the B-tree's
        branch pages misroute lookups. That is `structure_corrupt` (repair rebuilds the store by walking it), and
        repairing the records one by one would remove sound pages."""
        missed = found.lookup_missed["pages"]
        if missed:  # rare: walk the page keys again (no payloads) to see whether they are there
            for _, h, _ in self._scan(self._live().dbs.pages, VERIFY_CHUNK_PAGES * 16, "pages"):
                found.misrouted["pages"] += h in missed
        for db, n in found.misrouted.items():
            if n:
                found.add("structure_corrupt", None, f"lookups in sub-database '{db}' miss {n} record(s) that a walk "
                                                     f"of it finds: a damaged branch page misroutes them")

    def _verify_layouts(self, found: _Findings) -> dict[bytes, KVLayout]:
        """The layouts recorded; a layout record that does not decode is a `damaged_record` finding."""
        shared = self._live()
        out: dict[bytes, KVLayout] = {}
        with shared.read() as txn:
            for key, raw in txn.cursor(db=shared.dbs.layouts):
                record = _decode_or_none(_dec_layout, raw)
                if record is None:
                    found.add("damaged_record", None, f"layout record {bytes(key).hex()} does not decode")
                    found.damaged.append(("layouts", bytes(key), len(found.items) - 1))
                else:
                    out[bytes(key)] = record.layout
        return out

    def _verify_page(self, txn: lmdb.Transaction, h: bytes, value: Any, layouts: dict[bytes, KVLayout],
                     found: _Findings) -> None:
        dbs = self._shared.dbs
        if len(h) != PAGE_HASH_BYTES:
            found.add("dangling_index", h, "a pages key that is not a page hash", remove=True)
            return
        if len(value) < _HEADER:
            found.add("size_mismatch", h, f"{len(value)} bytes stored: not even a checksum", remove=True)
            return
        stored_sum = _U64.unpack_from(value)[0]
        payload = value[_HEADER:]
        if self._checksum.of(payload, h) != stored_sum:
            found.add("checksum_mismatch", h, "payload does not match its checksum", remove=True)
        raw = txn.get(h, db=dbs.meta)
        if raw is None:
            found.add("missing_meta", h, "page without metadata", remove=True)
            found.lookup_missed["meta"].add(h)
            return
        meta = _decode_or_none(_dec_meta, raw)
        if meta is None:
            found.add("missing_meta", h, "its metadata does not decode (a damaged record)", remove=True)
            found.damaged_meta.add(h)
            return
        if meta.checksum != stored_sum:
            found.add("checksum_mismatch", h, "metadata checksum differs from the page's", remove=True)
        if meta.nbytes != len(payload):
            found.add("size_mismatch", h, f"{len(payload)} bytes stored, metadata says {meta.nbytes}", remove=True)
        if not _chains_to(h, meta):
            found.add("hash_mismatch", h, f"not H(parent {meta.parent.hex()} || its {len(meta.tokens)} token "
                                          f"bytes): a page filed under a wrong hash", remove=True)
        layout = layouts.get(meta.layout_id)
        if layout is None:
            found.add("unknown_layout", h, f"layout {meta.layout_id.hex()} is not recorded")
        elif layout.bytes_per_page != len(payload):
            found.add("size_mismatch", h, f"{len(payload)} bytes stored, layout {layout.describe()} pages are "
                                          f"{layout.bytes_per_page}", remove=True)
        if txn.get(meta.ns_id, db=dbs.namespaces) is None:
            found.add("unknown_namespace", h, f"namespace {meta.ns_id.hex()} not registered")
        cur = txn.cursor(db=dbs.children)
        if not cur.set_key_dup(meta.parent, h):
            found.add("missing_index", h, "not listed under its parent in children")
            found.relink.setdefault(h, len(found.items) - 1)

    def _verify_tree(self, layouts: dict[bytes, KVLayout], found: _Findings
                     ) -> tuple[dict[bytes, list[bytes]], dict[bytes, tuple[bytes, bytes, bytes, int]]]:
        """Metadata without pages, orphaned chains, namespace and layout tags against the chain, children entries
        pointing nowhere, and registry counters: one snapshot of the metadata. Returns parent -> children as the
        metadata says (what repair walks, besides the children index), and page -> (parent, namespace id, layout
        id, bytes) of every page whose metadata decodes."""
        shared = self._live()
        dbs = shared.dbs
        with shared.read(buffers=True) as txn:
            pages = txn.cursor(db=dbs.pages)  # set_key positions without copying the payload
            tree: dict[bytes, tuple[bytes, bytes, bytes, int]] = {}  # page -> (parent, ns id, layout id, nbytes)
            per_ns: dict[bytes, list[int]] = {}
            if self.progress is not None:
                self.progress("meta", 0, None)
            for key, raw in txn.cursor(db=dbs.meta):
                h = bytes(key)
                if h in found.lookup_missed["meta"]:
                    found.misrouted["meta"] += 1  # the walk finds what a lookup of it missed
                meta = _decode_or_none(_dec_meta, raw)
                if meta is None:
                    if not pages.set_key(h):  # with a page, the page's check reported it
                        found.add("missing_page", h, "metadata that does not decode, without a page", remove=True)
                        found.damaged_meta.add(h)
                    continue
                tree[h] = (meta.parent, meta.ns_id, meta.layout_id, meta.nbytes)
                if not pages.set_key(h):
                    found.add("missing_page", h, "metadata without a page", remove=True)
                    found.lookup_missed["pages"].add(h)
                    continue
                acc = per_ns.setdefault(meta.ns_id, [0, 0])
                acc[0] += 1
                acc[1] += meta.nbytes
            # A walk that reaches fewer records than the catalogue counts skipped a damaged part of the tree: the
            # records it missed are not missing, and removing what depends on them would lose sound pages.
            walked = {"meta": len(tree) + len(found.damaged_meta),
                      "pages": sum(1 for _ in txn.cursor(db=dbs.pages).iternext(keys=True, values=False))}
            for db, n in walked.items():
                recorded = txn.stat(getattr(dbs, db))["entries"]
                if n != recorded:
                    found.add("structure_corrupt", None, f"a walk of sub-database '{db}' reaches {n} of the "
                                                         f"{recorded} records its catalogue counts")
            if self.progress is not None:
                self.progress("namespaces", len(tree), None)
            registry: dict[bytes, NamespaceRecord] = {}
            for k, v in txn.cursor(db=dbs.namespaces):
                record = _decode_or_none(_dec_ns, v)
                if record is None:
                    found.add("damaged_record", None, f"namespace record {bytes(k).hex()} does not decode")
                    found.damaged.append(("namespaces", bytes(k), len(found.items) - 1))
                else:
                    registry[bytes(k)] = record
            if self.progress is not None:
                self.progress("children", 0, None)
            links = [(bytes(p), bytes(c)) for p, c in txn.cursor(db=dbs.children)]
            totals = _decode_or_none(_dec_totals, txn.get(b"totals", db=dbs.store)) or StoreTotals(-1, -1)
            # Every root a page may hang from: each (layout, namespace) pair the pages or the records name.
            pairs = {(lay, ns) for _, ns, lay, _ in tree.values()} | {(lay, ns) for lay in layouts for ns in registry}
            roots = {hash_root_of_id(lay, ns): (lay, ns) for lay, ns in pairs}
            kids: dict[bytes, list[bytes]] = {}
            for h, (parent, _, _, _) in tree.items():
                kids.setdefault(parent, []).append(h)
            for h, (parent, ns, lay, _) in tree.items():
                up = tree.get(parent)
                if up is not None:
                    if (up[1], up[2]) != (ns, lay):
                        found.add("namespace_mismatch", h, f"tagged namespace {ns.hex()} / layout {lay.hex()}, its "
                                                           f"parent {parent.hex()} namespace {up[1].hex()} / "
                                                           f"layout {up[2].hex()}", remove=True)
                elif parent in roots:
                    if roots[parent] != (lay, ns):
                        other_lay, other_ns = roots[parent]
                        found.add("namespace_mismatch", h, f"tagged namespace {ns.hex()} / layout {lay.hex()}, "
                                                           f"its parent is the root of namespace {other_ns.hex()} "
                                                           f"/ layout {other_lay.hex()}", remove=True)
                elif not pages.set_key(parent):  # parent bytes without metadata: that page's finding covers it
                    below, below_bytes = _subtree_size(h, kids, tree)
                    found.add("orphan", h, f"parent {parent.hex()} is neither a stored page nor a namespace "
                                           f"root: unreachable with the {below} page(s) ({below_bytes} bytes) "
                                           f"below it", remove=True)
        for parent, child in links:
            if child in found.damaged_meta:
                # the entry of a page whose metadata is damaged: it goes when repair removes that page
                found.unlink.append((parent, child, found.by_page[child][0]))
                continue
            up = tree.get(child)
            if up is None or up[0] != parent:
                why = ("names a page that is not stored" if up is None else
                       f"files it under {parent.hex()}, its metadata names parent {up[0].hex()}")
                found.add("dangling_index", child, f"children entry {why}")
                found.unlink.append((parent, child, len(found.items) - 1))
        stored_pages = sum(p for p, _ in per_ns.values())
        stored_bytes = sum(b for _, b in per_ns.values())
        for ns_id, record in registry.items():
            n_pages, n_bytes = per_ns.get(ns_id, [0, 0])
            if (record.pages, record.bytes) != (n_pages, n_bytes):
                found.add("counter_mismatch", None, f"namespace {record.ns_id_hex}: registry says {record.pages} "
                                                    f"pages / {record.bytes} bytes, store holds {n_pages} / "
                                                    f"{n_bytes}")
                found.recount.append(len(found.items) - 1)
        if (totals.pages, totals.bytes) != (stored_pages, stored_bytes):
            said = ("the store totals record does not decode" if totals.pages < 0 else
                    f"store totals say {totals.pages} pages / {totals.bytes} bytes")
            found.add("counter_mismatch", None, f"{said}, the store holds {stored_pages} / {stored_bytes}")
            found.recount.append(len(found.items) - 1)
        return kids, tree

    # -- repair ---------------------------------------------------------------------------------------------

    def _repair(self, found: _Findings, kids: dict[bytes, list[bytes]],
                tree: dict[bytes, tuple[bytes, bytes, bytes, int]],
                layouts: dict[bytes, KVLayout]) -> list[VerifyRemoval]:
        """Apply base.REPAIRS to what verify found; every removal is rechecked in its own write transaction."""
        dbs = self._live().dbs
        removals: list[VerifyRemoval] = []
        removed: set[bytes] = set()
        for name, key, i in found.damaged:
            for r, h in self._drop_damaged(name, key, i, tree, found):
                removals.append(r)
                if h is not None:
                    removed.add(h)
            found.fixed.add(i)
        # Work items: (page, finding index, page it was reached from: None for the finding's own page).
        work: list[tuple[bytes, int, bytes | None]] = [(h, i, None) for h, i in reversed(found.remove.items())]
        while work:
            work, batch = self._write(self._remove_pages(work, kids, layouts, found))
            for r, h in batch:
                removals.append(r)
                removed.add(h)
        for h in removed:
            found.fixed.update(found.by_page.get(h, ()))
        for start in range(0, len(found.unlink), REPAIR_BATCH_PAGES):
            batch_links = found.unlink[start:start + REPAIR_BATCH_PAGES]

            def unlink(txn: lmdb.Transaction, batch_links=batch_links) -> list[tuple[VerifyRemoval, int]]:
                out = []
                cur = txn.cursor(db=dbs.children)
                for parent, child, i in batch_links:
                    raw = txn.get(child, db=dbs.meta)
                    if raw is not None and getattr(_decode_or_none(_dec_meta, raw), "parent", None) == parent:
                        continue  # the page was stored meanwhile: the entry is no longer dangling
                    if cur.set_key_dup(parent, child):
                        cur.delete()
                        out.append((VerifyRemoval(found.items[i].kind, child.hex(), "index", 0), i))
                    else:
                        out.append((None, i))  # gone with a removed page
                return out

            for r, i in self._write(unlink):
                if r is not None:
                    removals.append(r)
                found.fixed.add(i)
        relink = [(h, i) for h, i in found.relink.items() if h not in removed]
        for start in range(0, len(relink), REPAIR_BATCH_PAGES):
            batch_pages = relink[start:start + REPAIR_BATCH_PAGES]

            def add_links(txn: lmdb.Transaction, batch_pages=batch_pages) -> list[int]:
                done = []
                for h, i in batch_pages:
                    meta = _decode_or_none(_dec_meta, txn.get(h, db=dbs.meta) or b"")
                    if meta is not None:
                        txn.put(meta.parent, h, db=dbs.children, dupdata=True)
                        done.append(i)
                return done

            found.fixed.update(self._write(add_links))
        if removals or found.recount:
            self._write(self._recount)
            found.fixed.update(found.recount)
        with self._lock:
            self._corrupt -= removed  # gone: a writer may store them again
        return removals

    def _drop_damaged(self, name: str, key: bytes, i: int, tree: dict[bytes, tuple[bytes, bytes, bytes, int]],
                      found: _Findings) -> list[tuple[VerifyRemoval, bytes | None]]:
        """Remove a namespace or layout record that does not decode, and every page filed under it (they cannot
        be registered again without it), REPAIR_BATCH_PAGES per write transaction."""
        dbs = self._shared.dbs
        db = dbs.namespaces if name == "namespaces" else dbs.layouts
        field = 1 if name == "namespaces" else 2
        pages = [h for h, row in tree.items() if row[field] == key]
        kind = found.items[i].kind
        out: list[tuple[VerifyRemoval, bytes | None]] = []
        for start in range(0, max(len(pages), 1), REPAIR_BATCH_PAGES):
            batch = pages[start:start + REPAIR_BATCH_PAGES]

            def body(txn: lmdb.Transaction, batch=batch, first=start == 0) -> list[tuple[VerifyRemoval, bytes]]:
                done: list[tuple[VerifyRemoval, bytes | None]] = []
                if first and txn.get(key, db=db) is not None and _decode_or_none(
                        _dec_ns if name == "namespaces" else _dec_layout, txn.get(key, db=db)) is None:
                    txn.delete(key, db=db)
                    done.append((VerifyRemoval(kind, key.hex(), "record", 0), None))
                deltas: dict[bytes, _NsDelta] = {}
                freed_pages = freed_bytes = 0
                for h in batch:
                    if txn.get(h, db=dbs.meta) is None and txn.get(h, db=dbs.pages) is None:
                        continue
                    what, nbytes, counted = self._remove_records(txn, h, deltas)
                    freed_pages += counted
                    freed_bytes += nbytes if counted else 0
                    done.append((VerifyRemoval(kind, h.hex(), what, nbytes, key.hex()), h))
                if freed_pages:
                    totals = _decode_or_none(_dec_totals, txn.get(b"totals", db=dbs.store))
                    if totals is not None:
                        txn.put(b"totals", _enc.encode(StoreTotals(totals.pages - freed_pages,
                                                                   totals.bytes - freed_bytes)), db=dbs.store)
                    self._apply_deltas(txn, deltas, time.time())
                return done

            out += self._write(body)
        found.recount.append(i)  # the totals are set from what is left at the end
        return out

    def _remove_pages(self, work: list[tuple[bytes, int, bytes | None]], kids: dict[bytes, list[bytes]],
                      layouts: dict[bytes, KVLayout], found: _Findings
                      ) -> Callable[[lmdb.Transaction], tuple[list, list[tuple[VerifyRemoval, bytes]]]]:
        """A write-transaction body removing up to REPAIR_BATCH_PAGES pages of `work` (depth first: a removed
        page's children join the work). Returns the work left and what it removed; `work` itself is left
        untouched, so a rerun after a map resize starts over."""
        dbs = self._shared.dbs

        def body(txn: lmdb.Transaction) -> tuple[list, list[tuple[VerifyRemoval, bytes]]]:
            stack = list(work)
            out: list[tuple[VerifyRemoval, bytes]] = []
            deltas: dict[bytes, _NsDelta] = {}
            seen: set[bytes] = set()
            links = txn.cursor(db=dbs.children)
            freed_pages = freed_bytes = 0
            while stack and len(out) < REPAIR_BATCH_PAGES:
                h, i, via = stack.pop()
                if h in seen:
                    continue
                seen.add(h)
                if not (self._defect(txn, h, layouts) if via is None else self._below_removed(txn, h, via)):
                    continue  # sound now (rewritten, re-linked, or gone meanwhile): left as it is
                what, nbytes, counted = self._remove_records(txn, h, deltas)
                freed_pages += counted
                freed_bytes += nbytes if counted else 0
                head = found.items[i].page_hash
                out.append((VerifyRemoval(found.items[i].kind, h.hex(), what, nbytes,
                                          None if via is None else head), h))
                below = set(kids.get(h, ()))
                if links.set_key(h):
                    below.update(bytes(c) for c in links.iternext_dup(keys=False, values=True))
                stack.extend((c, i, h) for c in below)
            if freed_pages:
                totals = _decode_or_none(_dec_totals, txn.get(b"totals", db=dbs.store))
                if totals is not None:  # a damaged totals record is rewritten by the recount at the end
                    txn.put(b"totals", _enc.encode(StoreTotals(totals.pages - freed_pages,
                                                               totals.bytes - freed_bytes)), db=dbs.store)
                self._apply_deltas(txn, deltas, time.time())
            return stack, out

        return body

    def _defect(self, txn: lmdb.Transaction, h: bytes, layouts: dict[bytes, KVLayout]) -> bool:
        """Whether the records under `h` are provably corrupt or unreachable now: the check repair repeats inside
        its write transaction before removing a finding's page."""
        dbs = self._shared.dbs
        value = txn.get(h, db=dbs.pages)
        raw = txn.get(h, db=dbs.meta)
        if value is None or raw is None or len(h) != PAGE_HASH_BYTES:
            return value is not None or raw is not None  # half a page, or a key that is no page hash
        meta = _decode_or_none(_dec_meta, raw)
        if meta is None or len(value) < _HEADER:
            return True  # damaged metadata, or bytes too short to hold a checksum
        stored_sum = _U64.unpack_from(value)[0]
        size = len(value) - _HEADER
        layout = layouts.get(meta.layout_id)
        if (self._checksum.of(memoryview(value)[_HEADER:], h) != stored_sum or meta.checksum != stored_sum
                or meta.nbytes != size or (layout is not None and layout.bytes_per_page != size)
                or not _chains_to(h, meta)):
            return True
        up = txn.get(meta.parent, db=dbs.meta)
        if up is not None:
            parent = _decode_or_none(_dec_meta, up)
            if parent is None:
                return False  # the parent's damaged metadata is its own finding; this page goes below it
            return (parent.ns_id, parent.layout_id) != (meta.ns_id, meta.layout_id)
        if meta.parent == hash_root_of_id(meta.layout_id, meta.ns_id):
            return False
        # Not its own root: an orphan, or a child of another namespace's root; a parent with bytes but no
        # metadata is that page's defect, and this page goes as part of its subtree.
        return txn.get(meta.parent, db=dbs.pages) is None

    def _below_removed(self, txn: lmdb.Transaction, h: bytes, via: bytes) -> bool:
        """Whether `h` is a child of the removed page `via` (so unreachable now), checked in this transaction."""
        dbs = self._shared.dbs
        raw = txn.get(h, db=dbs.meta)
        if raw is None or getattr(_decode_or_none(_dec_meta, raw), "parent", None) != via:
            return False  # not stored, or linked under `via` by a wrong index entry only (dangling_index)
        return txn.get(via, db=dbs.meta) is None and txn.get(via, db=dbs.pages) is None

    def _remove_records(self, txn: lmdb.Transaction, h: bytes, deltas: dict[bytes, _NsDelta]
                        ) -> tuple[str, int, bool]:
        """Delete whatever is stored under `h`: (what, payload bytes, whether it was a whole page the counters
        hold, now taken off them via `deltas`)."""
        dbs = self._shared.dbs
        value = txn.get(h, db=dbs.pages)
        raw = txn.get(h, db=dbs.meta)
        if raw is None:
            txn.delete(h, db=dbs.pages)
            return "bytes", max(len(value) - _HEADER, 0), False
        meta = _decode_or_none(_dec_meta, raw)
        if meta is None:  # damaged metadata: its children entry is unlinked by repair, its counters recounted
            txn.delete(h, db=dbs.meta)
            if value is not None:
                txn.delete(h, db=dbs.pages)
            return ("page" if value is not None else "meta"), max(len(value or b"") - _HEADER, 0), False
        if value is None:
            txn.delete(h, db=dbs.meta)
            txn.delete(meta.parent, h, db=dbs.children)
            return "meta", 0, False
        self._drop_page(txn, h, meta, deltas)
        return "page", meta.nbytes, True

    def _recount(self, txn: lmdb.Transaction) -> None:
        """Set every registry counter and the store totals from the pages stored (metadata and bytes both)."""
        dbs = self._shared.dbs
        pages = txn.cursor(db=dbs.pages)
        per_ns: dict[bytes, list[int]] = {}
        for key, raw in txn.cursor(db=dbs.meta):
            meta = _decode_or_none(_dec_meta, raw)
            if meta is not None and pages.set_key(bytes(key)):
                acc = per_ns.setdefault(meta.ns_id, [0, 0])
                acc[0] += 1
                acc[1] += meta.nbytes
        for key, raw in list(txn.cursor(db=dbs.namespaces)):
            record = _decode_or_none(_dec_ns, raw)
            if record is None:
                continue  # a damaged record: verify reports it, repair removes it with its pages
            n_pages, n_bytes = per_ns.get(bytes(key), [0, 0])
            if (record.pages, record.bytes) != (n_pages, n_bytes):
                txn.put(bytes(key), _enc.encode(msgspec.structs.replace(record, pages=n_pages, bytes=n_bytes)),
                        db=dbs.namespaces)
        txn.put(b"totals", _enc.encode(StoreTotals(sum(p for p, _ in per_ns.values()),
                                                   sum(b for _, b in per_ns.values()))), db=dbs.store)

    # -- lifetime -------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Flush logged reads and release this handle's share of the environment. Idempotent."""
        if self._closed:
            return
        try:
            if self._shared.pid == os.getpid():
                self.flush()
        finally:
            self._closed = True
            if self._shared.pid == os.getpid():
                _release(self._shared)

    def __enter__(self) -> "LMDBStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        layout = self.layout.describe() if self.layout else "no layout"
        return f"LMDBStore({self.path!r}, {layout}{', read-only' if self.readonly else ''})"
