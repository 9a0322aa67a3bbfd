"""Transactions on the one LMDB environment a store has in this process (`SharedEnv`, opened and shared by `env`):
the gate every transaction passes, map growth, lock-free reads checked against writers, and the close.

A map resize needs no transaction of this process active, so every transaction passes a gate (`SharedEnv.read` /
`write`); a write that fills the map grows it and runs again. LMDB and OS faults become typed StoreErrors
(`faults`).

Lock-free reading. LMDB's readers register in its lock file (`lock.mdb`), which they must be able to write. A
user who may read the store but not write `lock.mdb` (a monitoring account, a read-only filesystem), or a caller
that asks for it (`lock=False`: nothing at all is written to the store directory), gets the environment opened
read-only *without* the lock file (`env`). Such a reader is invisible to writers: a writer may reuse the pages of a
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

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import lmdb
import msgspec

from ...errors import StoreChanged, StoreClosed, StoreError
from ..codec import StoreFormat
from .faults import damaged, translate

if TYPE_CHECKING:
    from .env import Dbs

LOCK_FREE_ATTEMPTS = 8  # runs of a lock-free read that writers keep overtaking before StoreChanged
T = TypeVar("T")


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

    def drop_in_child(self) -> None:
        """In a forked child, the parent's environment: closed without being used (that releases only this
        process's reader slots), unless a transaction of another thread was in flight at the fork: closing it then
        would reset a reader slot the parent still uses, so it is abandoned instead."""
        if self._active == 0:
            try:
                self.env.close()
            except lmdb.Error:  # closing is best effort: the environment is being dropped either way
                pass

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
                raise damaged(self.path, exc) from None
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
                    raise damaged(self.path, exc) from None
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

