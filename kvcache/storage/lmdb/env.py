"""One LMDB environment per store and process: opening it, sharing it between handles, fork.

LMDB forbids opening one environment twice in a process. Handles share one `SharedEnv` (`shared_env`: the
transactions on it, map growth, its close) per process and realpath (`acquire` / `release`); a forked child closes
the parent's without using it and opens its own. An open is retried as a whole on transient faults, a create that
fails leaves nothing behind, and LMDB and OS faults become typed StoreErrors (`faults`).

Lock-free opening. LMDB's readers register in its lock file (`lock.mdb`), which they must be able to write. A
user who may read the store but not write `lock.mdb` (a monitoring account, a read-only filesystem), or a caller
that asks for it (`lock=False`: nothing at all is written to the store directory), gets the environment opened
read-only *without* the lock file; its reads are then checked against writers (`shared_env`).
"""

from __future__ import annotations

import errno
import functools
import os
import threading
import time
from typing import Any

import lmdb
import msgspec

from ...errors import InvalidInput, NotAStore, StoreAccessDenied, StoreError, StoreUnsupported
from ..codec import CHECKSUMS, DEFAULT_CHECKSUM, FORMAT_MAGIC, FORMAT_VERSION, StoreFormat, decode_format, encoder
from ..keyfile import KEY_FILE
from .bookkeeping import init_store_records
from .faults import error_code, translate
from .shared_env import SharedEnv

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


class Dbs(msgspec.Struct, frozen=True):
    """Handles of the named sub-databases of one environment."""

    pages: Any
    meta: Any
    children: Any
    namespaces: Any
    layouts: Any
    store: Any
    removals: Any = None  # the removal log (`removals`); None in a store without it opened by a reader


ENVS: dict[str, SharedEnv] = {}
_ENVS_LOCK = threading.Lock()


def after_fork_in_child() -> None:
    # The parent's environments must not be used here: each is dropped (`SharedEnv.drop_in_child`) and the
    # child opens the store afresh.
    global _ENVS_LOCK
    _ENVS_LOCK = threading.Lock()
    for shared in ENVS.values():
        shared.drop_in_child()
    ENVS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=after_fork_in_child)


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
            or error_code(exc) in _TRANSIENT_ERRNOS)


def _reserve_lock_file(path: str) -> bool:
    """Give the lock file its blocks before LMDB maps it. LMDB sizes a new lock file with ftruncate (a sparse
    file) and writes its reader table through the map: on a full disk that write is a SIGBUS, not an error. With
    the blocks allocated here, a full disk is a StoreFull from this call instead. False when this user cannot
    write the lock file (nor create it): the store can only be read lock-free."""
    lock_file = os.path.join(path, "lock.mdb")
    try:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if error_code(exc) in _DENIED:
            return False  # a read-only location, or a monitoring account (the module docstring)
        raise translate(exc, path, "creating the lock file", LOCK_FILE_BYTES) from None
    try:
        size = os.fstat(fd).st_size
        os.posix_fallocate(fd, 0, max(size, LOCK_FILE_BYTES))
    except OSError as exc:
        if error_code(exc) in (errno.ENOSPC, errno.EDQUOT):
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
        if lock_free or error_code(exc) not in _DENIED or not existing:
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
    if reading and error_code(exc) in (errno.EACCES, errno.EPERM):
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

