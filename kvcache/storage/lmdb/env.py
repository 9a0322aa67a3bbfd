"""One LMDB environment per store and process: opening it, sharing it between handles, the map size, fork.

LMDB forbids opening one environment twice in a process. Handles share one `SharedEnv` per process and realpath
(`acquire` / `release`); a forked child closes the parent's without using it and opens its own. A map resize
needs no transaction of this process active, so every transaction passes a gate (`SharedEnv.read` / `write`).
An open is retried as a whole on transient faults, a create that fails leaves nothing behind, and LMDB and OS
faults become typed StoreErrors (`translate`: running out of disk surfaces from LMDB as EIO at commit; it is
reported as StoreFull when the disk is full).

Lock-free reading. LMDB's readers register in its lock file (`lock.mdb`), which they must be able to write. A
user who may read the store but not write `lock.mdb` (a monitoring account, a read-only filesystem), or a caller
that asks for it (`lock=False`: nothing at all is written to the store directory), gets the environment opened
read-only *without* the lock file. Such a reader is invisible to writers: a writer may reuse the pages of a
snapshot it reads. LMDB frees the pages a commit replaces and a writer reuses pages freed by transactions up to
two before its own when no reader is registered, so a read of snapshot S is sound as long as no transaction
after S+1 has begun; that is, when the store's last committed transaction is still at most S+1 once the read is
done. Every read transaction of a lock-free environment checks exactly that at its end (`SharedEnv.read`): one
that writers overtook raises StoreChanged instead of returning what it read, and `SharedEnv.reading` runs it
again (LOCK_FREE_ATTEMPTS times). A long read (a verify's snapshot of the metadata) can be overtaken every time
on a busy store; it then fails with StoreChanged, never with a wrong result.

Closing. The last handle's close unmaps the environment, and a thread still in a transaction would then read
unmapped memory (a zero-copy value is a view into the map: SIGSEGV, or SIGBUS). So the close passes the same gate:
it stops new transactions (they raise StoreClosed) and waits for those in flight on other threads before closing
(`SharedEnv.close`). A close from a thread that is itself inside a transaction (a scan whose consumer closes the
store) cannot wait for that one: the environment is closed when it ends. Transactions are short (a scan holds one
per chunk), so the wait is too; a scan left suspended mid-chunk on another thread holds its close until it is
closed or dropped.
"""

from __future__ import annotations

import errno
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import lmdb
import msgspec

from ...errors import (
    InvalidInput,
    NotAStore,
    StoreAccessDenied,
    StoreChanged,
    StoreClosed,
    StoreDamaged,
    StoreError,
    StoreFull,
    StoreReadOnly,
    StoreUnsupported,
)
from ..codec import CHECKSUMS, DEFAULT_CHECKSUM, FORMAT_MAGIC, FORMAT_VERSION, StoreFormat, decode_format, encoder
from ..keyfile import KEY_FILE
from .bookkeeping import init_store_records

DEFAULT_MAP_SIZE = 256 << 20  # initial map; grows on demand (the file grows with the data, not the map)
MAX_DBS = 16
MAX_READERS = 512  # reader slots across every process; engines plus CLI inspectors with a few threads each
# Durability name -> (sync, metasync) of the environment. A killed process loses no committed batch in any mode;
# the modes differ on a system crash (power loss, kernel panic):
#   full  every committed batch survives (two fsyncs per commit);
#   data  the store stays intact, the last committed batch may be lost (one fsync per commit; LMDB's NOMETASYNC);
#   none  no fsync: recent batches may be lost, and the store may be damaged (verify; delete and refill).
DURABILITY: dict[str, tuple[bool, bool]] = {"full": (True, True), "data": (True, False), "none": (False, False)}
DEFAULT_DURABILITY = "data"  # a cache: integrity across crashes, not the last batch
REQUIRED_DBS = ("pages", "meta", "children", "namespaces", "layouts", "store")  # every store has these
# Sub-databases a store may lack (written before them): created with a new store and by a writer's open, read as
# absent (None) by a reader that cannot create them. An older kvc leaves them alone.
OPTIONAL_DBS = ("removals",)  # the removal log (`removals`)
DB_NAMES = REQUIRED_DBS + OPTIONAL_DBS  # every sub-database a store's catalogue may name
DUPFIXED = ("children",)
LOCK_FREE_ATTEMPTS = 8  # runs of a lock-free read that writers keep overtaking before StoreChanged
T = TypeVar("T")


class Dbs(msgspec.Struct, frozen=True):
    """Handles of the named sub-databases of one environment."""

    pages: Any
    meta: Any
    children: Any
    namespaces: Any
    layouts: Any
    store: Any
    removals: Any = None  # the removal log (`removals`); None in a store without it opened by a reader


class SharedEnv:
    """The one Environment of a store in this process, shared by every handle on it.

    A map resize needs no transaction of this process active, so transactions pass a gate: `active` counts them,
    and a resize waits for zero while new ones wait for it to finish. Writers serialise on `write_lock` before
    the gate (a writer blocked on LMDB's own lock while counted active would deadlock a resize). The close waits
    at the same gate (see the module docstring).
    """

    def __init__(self, env: lmdb.Environment, path: str, writable: bool, dbs: Dbs, fmt: StoreFormat,
                 lock_free: bool = False) -> None:
        self.env = env
        self.path = path
        self.writable = writable  # opened read-write (False: a read-only location)
        # opened without LMDB's lock file (read-only; see the module docstring): reads are checked against writers
        self.lock_free = lock_free
        self.dbs = dbs
        self.format = fmt
        self.pid = os.getpid()
        self.refs = 0  # open handles
        self.write_lock = threading.RLock()
        self._gate = threading.Condition()
        self._active = 0  # transactions of this process in flight
        self._threads: dict[int, int] = {}  # thread id -> its transactions in flight (a close never waits for its own)
        self._resizing = False
        self._closing = False  # the last handle let go: no transaction starts any more
        self.closed = False  # the environment is closed (unmapped)

    def _enter(self) -> int:
        """Count a transaction in; the id of its thread, for `_leave`. StoreClosed once the close began."""
        me = threading.get_ident()
        with self._gate:
            while self._resizing:
                self._gate.wait()
            if self._closing:
                raise StoreClosed(self.path)
            self._active += 1
            self._threads[me] = self._threads.get(me, 0) + 1
        return me

    def _leave(self, thread: int) -> None:
        with self._gate:
            self._active -= 1
            left = self._threads.pop(thread) - 1
            if left:
                self._threads[thread] = left
            if self._active == 0:
                self._gate.notify_all()
                if self._closing and not self.closed:
                    self._close_env()  # a close made inside this transaction left it to the transaction's end

    def close(self) -> None:
        """Close the environment once no transaction of another thread is in flight (new ones raise StoreClosed
        from now on); one of this thread's still open (a close inside a scan) closes it when it ends. Idempotent."""
        with self._gate:
            self._closing = True
            mine = self._threads.get(threading.get_ident(), 0)
            while self._active > mine:
                self._gate.wait()
            if self._active == 0 and not self.closed:
                self._close_env()

    def _close_env(self) -> None:
        # under the gate, with no transaction in flight: nothing reads the map while it is unmapped
        self.closed = True
        self.env.close()

    def resize(self, map_size: int) -> None:
        """Set the map size (0: adopt the size another process grew it to). StoreClosed once the close began."""
        with self._gate:
            self._resizing = True
            try:
                while self._active:
                    self._gate.wait()
                if self._closing:
                    raise StoreClosed(self.path)
                self.env.set_mapsize(map_size)
            finally:
                self._resizing = False
                self._gate.notify_all()

    def _begin(self, write: bool, buffers: bool) -> tuple[lmdb.Transaction, int]:
        while True:
            thread = self._enter()
            try:
                txn = self.env.begin(write=write, buffers=True) if buffers else self.env.begin(write=write)
                return txn, thread
            except lmdb.MapResizedError:
                self._leave(thread)
                self.resize(0)
            except BaseException:
                self._leave(thread)
                raise

    @contextmanager
    def read(self, buffers: bool = False) -> Iterator[lmdb.Transaction]:
        """A short read transaction. A record that does not decode in it is a StoreError naming the cure. In a
        lock-free environment, a read that writers overtook raises StoreChanged when it ends (whatever it read may
        come from reused pages: a record that did not decode, or an LMDB fault, is then no sign of damage)."""
        txn, thread = self._begin(False, buffers)
        try:  # the snapshot is checked while still counted in: the environment cannot be closed under the check
            snapshot = txn.id() if self.lock_free else None
            try:
                yield txn
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.check_snapshot(snapshot)
                raise _damaged(self.path, exc) from None
            except lmdb.Error:
                self.check_snapshot(snapshot)
                raise
            finally:
                txn.abort()
            self.check_snapshot(snapshot)
        finally:
            self._leave(thread)

    def check_snapshot(self, snapshot: int | None) -> None:
        """StoreChanged when a lock-free read of transaction `snapshot` may have seen pages a writer reused: the
        store committed more than one transaction after it (see the module docstring). None: a registered
        reader, nothing to check."""
        if snapshot is None:
            return
        last = self.env.info()["last_txnid"]
        if last > snapshot + 1:
            raise StoreChanged(self.path, f"a lock-free read of transaction {snapshot} was overtaken by writers "
                                          f"(transaction {last} is committed): it may have read reused pages")

    def reading(self, body: Callable[[lmdb.Transaction], T], buffers: bool = False) -> T:
        """`body(txn)` in one short read transaction, run again when writers overtook it in a lock-free
        environment (at most LOCK_FREE_ATTEMPTS runs; then StoreChanged). `body` must keep its effects to what
        it returns (or overwrite them when rerun)."""
        for attempt in range(LOCK_FREE_ATTEMPTS):
            try:
                with self.read(buffers) as txn:
                    return body(txn)
            except StoreChanged:
                if attempt + 1 == LOCK_FREE_ATTEMPTS:
                    raise StoreChanged(self.path, f"the store was written during each of {LOCK_FREE_ATTEMPTS} "
                                                  f"lock-free reads of it; read it while writers are idle, or as "
                                                  f"a user who can write lock.mdb") from None
        raise AssertionError("unreachable")

    def write(self, body: Callable[[lmdb.Transaction], Any], grow_hint: int = 0) -> Any:
        """Run `body` in one write transaction and commit. On a full map, grow it and rerun the whole body:
        `body` must keep its effects inside the transaction. `grow_hint`: about how many bytes it writes. An
        LMDB or OS fault is a typed StoreError (`translate`)."""
        try:
            return self._write(body, grow_hint)
        except StoreError:
            raise
        except (lmdb.Error, OSError) as exc:
            raise translate(exc, self.path, "writing", grow_hint) from None

    def _write(self, body: Callable[[lmdb.Transaction], Any], grow_hint: int) -> Any:
        with self.write_lock:
            while True:
                txn, thread = self._begin(True, False)
                committed = False
                size = 0  # the map size when it was full (read while counted in: the close waits for that)
                try:
                    result = body(txn)
                    txn.commit()
                    committed = True
                except lmdb.MapFullError:
                    txn.abort()
                    size = self.env.info()["map_size"]
                except lmdb.MapResizedError:
                    txn.abort()
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    txn.abort()
                    raise _damaged(self.path, exc) from None
                except BaseException:
                    txn.abort()
                    raise
                finally:
                    self._leave(thread)
                if committed:
                    return result
                self.resize(max(2 * size, size + 2 * grow_hint) if size else 0)

    def scan(self, db: Any, chunk: int, progress: Callable[[str, int, bytes | None], None] | None = None,
             label: str = "") -> Iterator[tuple[lmdb.Transaction, bytes, Any]]:
        """Every (txn, key, value) of `db` in key order, `chunk` entries per short read transaction (a long one
        pins old pages while writers go on). `value` is a zero-copy view: use it before the next item. `progress`
        is called before each chunk with (`label`, records walked, last key)."""
        after: bytes | None = None
        walked = 0
        while True:
            if progress is not None:
                progress(label, walked, after)
            with self.read(buffers=True) as txn:
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


def _damaged(path: str, exc: BaseException) -> StoreError:
    return StoreError(path, f"a damaged record in the store ({exc}); run `kvc audit` to see it and "
                            f"`kvc audit --repair` to remove it")


ENVS: dict[str, SharedEnv] = {}
_ENVS_LOCK = threading.Lock()


def after_fork_in_child() -> None:
    # The parent's environments must not be used here; closing one releases only this process's reader slots
    # and lets the child open the store afresh. One with a transaction in flight at fork (another thread) is
    # abandoned instead: closing it would reset a reader slot the parent still uses.
    global _ENVS_LOCK
    _ENVS_LOCK = threading.Lock()
    for shared in ENVS.values():
        if shared._active == 0:
            try:
                shared.env.close()
            except lmdb.Error:  # closing is best effort: the environment is being dropped either way
                pass
    ENVS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=after_fork_in_child)


def _error_code(exc: BaseException) -> int | None:
    code = getattr(exc, "errno", None) or getattr(exc, "code", None)
    return code if isinstance(code, int) else None


def _disk_full(path: str, wanted: int) -> bool:
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < max(wanted, 1 << 20)


def translate(exc: BaseException, path: str, doing: str, wanted: int = 0) -> StoreError:
    """A typed StoreError for an LMDB or OS fault under `path`."""
    code = _error_code(exc)
    if code in (errno.ENOSPC, errno.EDQUOT) or (code == errno.EIO and _disk_full(path, wanted)):
        need = f" (needed about {wanted} bytes)" if wanted else ""
        return StoreFull(path, f"{doing}: no space left on the disk{need}")
    if code in (errno.EACCES, errno.EPERM, errno.EROFS) or isinstance(exc, lmdb.ReadonlyError):
        return StoreReadOnly(path, f"{doing}: the location is read-only ({exc})")
    if isinstance(exc, (lmdb.CorruptedError, lmdb.PageNotFoundError)):
        return StoreDamaged(path, f"{doing}: LMDB found a damaged page ({type(exc).__name__}); `kvc audit` says what "
                                  f"is damaged, and `kvc audit --repair` rebuilds the store from what still reads "
                                  f"back sound (keeping the file beside it)")
    return StoreError(path, f"{doing}: {exc}")


def _open_env(path: str, create: bool, map_size: int, durability: str, checksum: str,
              lock: bool = True) -> SharedEnv:
    """Open (or create) the environment at `path` and check that it is a kvc store.

    The open is retried as a whole on a transient fault (OPEN_ATTEMPTS times): another process growing the map
    between our `lmdb.open` and our first transaction (MDB_MAP_RESIZED), a full reader table, EAGAIN. A create
    that fails leaves nothing behind: the files it made are removed, so a later `init` starts afresh. `lock`
    False: open an existing store read-only and lock-free, writing nothing (see the module docstring); so is a
    store whose lock file this user cannot write.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotAStore(path, "is a regular file, expected a kvc store directory")
    data_file = os.path.join(path, "data.mdb")
    creating = not os.path.exists(data_file)
    made_dir = False
    if not lock:
        if creating:
            raise NotAStore(path, "no kvc store here to open read-only")
        return _open_retried(path, create, map_size, durability, checksum, True)
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
            raise translate(exc, path, "creating the store directory") from None
    try:
        lock_free = not _reserve_lock_file(path) and not creating
        return _open_retried(path, create, map_size, durability, checksum, lock_free)
    except BaseException:
        if creating:
            remove_failed_create(path, made_dir)
        raise


def _open_retried(path: str, create: bool, map_size: int, durability: str, checksum: str,
                  lock_free: bool) -> SharedEnv:
    last: BaseException | None = None
    for attempt in range(OPEN_ATTEMPTS):
        try:
            return _open_env_once(path, create, map_size, durability, checksum, lock_free)
        except lmdb.Error as exc:
            if not _transient(exc):
                raise translate(exc, path, "opening") from None
            last = exc
        time.sleep(min(0.0005 * 2 ** attempt, 0.05))
    raise StoreError(path, f"opening: still failing after {OPEN_ATTEMPTS} attempts ({last})")


OPEN_ATTEMPTS = 100  # whole-open retries on transient faults (a writer may grow the map many times meanwhile)
# LMDB's lock file for MAX_READERS reader slots (192-byte header + 64 bytes a slot), with room to spare: a larger
# file only gives more slots.
LOCK_FILE_BYTES = 64 << 10
_TRANSIENT_ERRNOS = (errno.EAGAIN, errno.EINTR, errno.EBUSY)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)  # what a user who may not write (here) gets


def _transient(exc: BaseException) -> bool:
    """Whether an LMDB fault at open goes away by itself: retry the open."""
    return (isinstance(exc, (lmdb.MapResizedError, lmdb.ReadersFullError))
            or _error_code(exc) in _TRANSIENT_ERRNOS)


def _reserve_lock_file(path: str) -> bool:
    """Give the lock file its blocks before LMDB maps it. LMDB sizes a new lock file with ftruncate (a sparse
    file) and writes its reader table through the map: on a full disk that write is a SIGBUS, not an error. With
    the blocks allocated here, a full disk is a StoreFull from this call instead. False when this user cannot
    write the lock file (nor create it): the store can only be read lock-free."""
    lock_file = os.path.join(path, "lock.mdb")
    try:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if _error_code(exc) in _DENIED:
            return False  # a read-only location, or a monitoring account (the module docstring)
        raise translate(exc, path, "creating the lock file", LOCK_FILE_BYTES) from None
    try:
        size = os.fstat(fd).st_size
        os.posix_fallocate(fd, 0, max(size, LOCK_FILE_BYTES))
    except OSError as exc:
        if _error_code(exc) in (errno.ENOSPC, errno.EDQUOT):
            raise translate(exc, path, "reserving the lock file", LOCK_FILE_BYTES) from None
        # EOPNOTSUPP/EINVAL: a filesystem without fallocate; LMDB sizes the file itself
    finally:
        os.close(fd)
    return True


def remove_failed_create(path: str, made_dir: bool) -> None:
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


def _open_env_once(path: str, create: bool, map_size: int, durability: str, checksum: str,
                   lock_free: bool) -> SharedEnv:
    data_file = os.path.join(path, "data.mdb")
    existing = os.path.getsize(data_file) if os.path.exists(data_file) else 0
    open_env = functools.partial(lmdb.open, path, map_size=max(map_size, existing), subdir=True, max_dbs=MAX_DBS,
                                 max_readers=MAX_READERS, sync=DURABILITY[durability][0],
                                 metasync=DURABILITY[durability][1], meminit=True)
    writable = not lock_free
    try:
        env = open_env(readonly=lock_free, lock=not lock_free)
    except (lmdb.Error, OSError) as exc:
        if isinstance(exc, lmdb.InvalidError) or isinstance(exc, lmdb.VersionMismatchError):
            raise NotAStore(path, f"not an LMDB environment ({exc})") from None
        if isinstance(exc, lmdb.Error) and _transient(exc):
            raise
        if lock_free or _error_code(exc) not in _DENIED or not existing:
            raise _open_error(exc, path, lock_free) from None
        # data.mdb is not writable here (a read-only location, its mode): read the store, refuse writes
        writable = False
        try:
            env = open_env(readonly=True, lock=True)
        except (lmdb.Error, OSError) as exc2:
            if isinstance(exc2, lmdb.Error) and _transient(exc2):
                raise
            raise _open_error(exc2, path, True) from None
    try:
        if not lock_free:
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
    return SharedEnv(env, path, writable, dbs, fmt, lock_free)


def _open_error(exc: BaseException, path: str, reading: bool) -> StoreError:
    """The StoreError of an open that failed for good; a permission refused on a read is StoreAccessDenied (a
    permission problem: never reported as damage or as a read-only location)."""
    if reading and _error_code(exc) in (errno.EACCES, errno.EPERM):
        return StoreAccessDenied(path, f"opening to read: permission denied ({exc}); this user needs read access "
                                       f"to data.mdb and search access to its directory")
    return translate(exc, path, "opening read-only" if reading else "opening")


def _open_dbs(env: lmdb.Environment, path: str, writable: bool, create: bool,
              checksum: str) -> tuple[Dbs, StoreFormat]:
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
                handles = {n: env.open_db(n.encode(), txn=txn, create=True, dupsort=n in DUPFIXED,
                                          dupfixed=n in DUPFIXED) for n in DB_NAMES}
                txn.put(b"format", encoder.encode(fmt), db=handles["store"])
                init_store_records(txn, handles["store"])
        except lmdb.Error as exc:
            if _transient(exc):
                raise  # the whole open is retried
            raise translate(exc, path, "creating the store") from None
        return Dbs(**handles), fmt
    try:
        # Without a txn argument py-lmdb opens each handle in a transaction of its own, the one way a handle
        # opened in a read-only environment stays valid afterwards.
        handles = {n: env.open_db(n.encode(), create=False, dupsort=n in DUPFIXED, dupfixed=n in DUPFIXED)
                   for n in REQUIRED_DBS}
        with env.begin() as txn:
            raw = txn.get(b"format", db=handles["store"])
    except (lmdb.NotFoundError, lmdb.IncompatibleError) as exc:
        raise NotAStore(path, f"an LMDB environment without kvc's sub-databases ({exc})") from None
    try:
        recorded = decode_format(raw) if raw is not None else None
    except msgspec.DecodeError:
        recorded = None
    if recorded is None or recorded.magic != FORMAT_MAGIC:
        raise NotAStore(path, "an LMDB environment without kvc's format record (a foreign LMDB)")
    if recorded.version > FORMAT_VERSION:
        raise StoreUnsupported(path, f"store format {recorded.version} is newer than this kvc ({FORMAT_VERSION})")
    if recorded.checksum not in CHECKSUMS:
        raise StoreUnsupported(path, f"store checksums use {recorded.checksum!r}; this install has "
                                     f"{', '.join(CHECKSUMS)} (install the 'xxhash' package)")
    for name in OPTIONAL_DBS:
        handles[name] = _optional_db(env, name, name.encode() in names, writable)
    return Dbs(**handles), recorded


def _optional_db(env: lmdb.Environment, name: str, present: bool, writable: bool) -> Any:
    """The handle of optional sub-database `name` (OPTIONAL_DBS): opened when the store has it, created by a
    writer when it does not (one small write transaction of its own), None for a reader of a store without it."""
    if present:
        return env.open_db(name.encode(), create=False)
    if not writable:
        return None
    try:
        with env.begin(write=True) as txn:
            env.open_db(name.encode(), txn=txn, create=True)
    except lmdb.Error as exc:
        if isinstance(exc, lmdb.MapResizedError) or _transient(exc):
            raise  # the open is retried whole
        return None  # a store that cannot take this write now (a full disk) opens without it: nothing recorded
    return env.open_db(name.encode(), create=False)  # a handle opened outside any transaction stays valid


def lock_file_writable(path: str) -> bool:
    """Whether this user can write the lock file of the store directory `path` (or create it there): if not, the
    store opens lock-free (see the module docstring). Opening the file to find out changes nothing in it."""
    try:
        fd = os.open(os.path.join(path, "lock.mdb"), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return os.access(path, os.W_OK)
    except OSError:
        return False
    os.close(fd)
    return True


_META_TXNID = 144  # offset of mm_txnid in a meta page: page header (16) + magic, version, address, map size, 2 dbs
_META_MAGIC = 0xBEEFC0DE


def committed_txnid(path: str) -> int:
    """The last committed transaction of the store directory `path`, read from its data file's two meta pages
    (no environment opened, nothing written); 0 when it cannot be read, or neither reads back as a meta page."""
    try:
        with open(os.path.join(path, "data.mdb"), "rb") as f:
            head = f.read(_META_TXNID + 8)
            page_size = int.from_bytes(head[40:44], "little") if len(head) >= 44 else 0  # the free DB's md_pad
            f.seek(page_size)
            metas = (head, f.read(_META_TXNID + 8) if page_size else b"")
    except OSError:
        return 0  # opening the store says why (StoreAccessDenied, NotAStore)
    found = [int.from_bytes(m[_META_TXNID:_META_TXNID + 8], "little") for m in metas
             if len(m) == _META_TXNID + 8 and int.from_bytes(m[16:20], "little") == _META_MAGIC]
    return max(found, default=0)


def resolve_location(location: str, readonly: bool, durability: str,
                     checksum: str) -> tuple[str, bool, bool]:
    """The store directory of `location` (a path or ``lmdb://PATH``, made real), whether a store is there, and
    whether the directory is (a create that fails removes only what it made); `LMDBStore.open`'s arguments are
    checked on the way (InvalidInput, NotAStore)."""
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
    return path, existed, os.path.exists(path)


def acquire(path: str, create: bool, map_size: int, durability: str,
             checksum: str = DEFAULT_CHECKSUM, lock: bool = True) -> SharedEnv:
    """The SharedEnv of `path` in this process, opened (or created) on first use; one more handle holds it.
    `lock` False: open it read-only and lock-free (nothing written to the directory); the first open in a process
    decides, as it does the durability."""
    with _ENVS_LOCK:
        shared = ENVS.get(path)
        if shared is None or shared.pid != os.getpid():
            shared = _open_env(path, create, map_size, durability, checksum, lock)
            ENVS[path] = shared
        shared.refs += 1
        return shared


def release(shared: SharedEnv) -> None:
    """One handle less holds `shared`; the last one closes its environment once the transactions other threads
    have in flight on it end (`SharedEnv.close`). The wait holds the lock of the process's environments, so the
    store is not opened afresh beside the one closing (LMDB forbids two environments of one store in a process)."""
    with _ENVS_LOCK:
        shared.refs -= 1
        if shared.refs <= 0 and shared.pid == os.getpid():
            if ENVS.get(shared.path) is shared:
                del ENVS[shared.path]
            shared.close()


