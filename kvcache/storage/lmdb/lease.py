"""A store handle's lease on its store's environment (`EnvLease`): every transaction the handle's parts run goes
through it.

The environment is the process's (`env.acquire`: one `SharedEnv` per store and process, `shared_env`); a handle
holds it from its open to its close, which gives it back (`env.release`). A handle belongs to one process: after a
fork, the child's first call acquires the environment afresh, and what the handle kept in memory of the parent's
reads is dropped (`on_fork`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import lmdb

from ...errors import StoreClosed, StoreReadOnly
from .env import acquire, release
from .shared_env import SharedEnv

T = TypeVar("T")


class EnvLease:
    """One handle's hold on its store's `SharedEnv`. Owns the environment while the handle is open, what a forked
    child needs to acquire it again (map size, durability, lock), the handle's closed mark, and the refusal of a
    write on a handle that may not write. Safe to use from several threads."""

    def __init__(self, shared: SharedEnv, readonly: bool, map_size: int, durability: str, lock: bool,
                 on_fork: Callable[[], None]) -> None:
        self.shared = shared  # as last acquired: `live` checks that it is this process's
        self.path = shared.path
        self.readonly = readonly
        self._map_size = map_size
        self._durability = durability
        self._lock = lock
        self._on_fork = on_fork
        self.closed = False
        self._closing = threading.Lock()  # held by `close`

    def live(self) -> SharedEnv:
        """The environment, this process's (StoreClosed once the handle is closed)."""
        if self.closed:
            raise StoreClosed(self.path)
        shared = self.shared
        if shared.pid != os.getpid():
            # A forked child: the parent's Environment (and its pending reads) are not ours.
            self.shared = shared = acquire(self.path, False, self._map_size, self._durability, lock=self._lock)
            self._on_fork()
        return shared

    def write(self, body: Callable[[lmdb.Transaction], Any], wanted: int = 0) -> Any:
        """`body(txn)` in one write transaction, committed (`SharedEnv.write`; `wanted`: about how many bytes it
        writes)."""
        return self.live().write(body, grow_hint=wanted)

    def read(self, reader: Callable[[lmdb.Transaction, Any], T]) -> T:
        """`reader(txn, dbs)` in one short read transaction."""
        shared = self.live()
        return shared.reading(lambda txn: reader(txn, shared.dbs))

    def update(self, body: Callable[[lmdb.Transaction, Any], T]) -> T:
        """`body(txn, dbs)` in one write transaction, committed; StoreReadOnly when the handle may not write."""
        self.check_writable()
        shared = self.live()
        return shared.write(lambda txn: body(txn, shared.dbs))

    def check_writable(self) -> None:
        """StoreReadOnly when the handle may not write (opened read-only, or at a read-only location)."""
        if self.readonly:
            why = "opened read-only" if self.shared.writable else "at a read-only location"
            raise StoreReadOnly(self.path, f"cannot write: the store is {why}")

    def close(self, flush: Callable[[], None]) -> None:
        """Run `flush` (the handle's) and give the environment back, both only in the process that holds it.
        Idempotent, and safe while other threads use the handle: the last handle's release waits for the reads
        and writes in flight (`shared_env`), and a call that starts after the close raises StoreClosed."""
        with self._closing:  # two threads closing one handle release its share once
            if self.closed:
                return
            try:
                if self.shared.pid == os.getpid():
                    flush()
            finally:
                self.closed = True
                if self.shared.pid == os.getpid():
                    release(self.shared)
