"""A store's data file rewritten and swapped in without ever being left half-done (a repair's rebuild, `kvc
migrate`): the store held exclusively (`exclusive`), the original kept beside it (`keep_original`,
`keep_consistent_copy`), the fresh file moved over the old with one rename (`swap`), and what a killed one left
removed (`remove_leftovers`).

The store's own data file is never left half-done: until the rename it is untouched, and the rename is atomic. A
repair killed part-way leaves a work directory or a partial copy (hidden names); the next repair that gets the
store to itself removes them. Crash tests stop the repair at its named steps (`step`, env KVC_TEST_REPAIR_STOP)
and kill it there.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import lmdb

from ...errors import StoreError, StoreFull
from ..isolated import run_isolated
from .env import DEFAULT_DURABILITY, ENVS, MAX_DBS
from .faults import translate
from .salvage_child import env_of

ORIGINAL_PREFIX = "data.mdb.orig-"  # + UTC time: the data file as it was before a repair rewrote anything
REBUILD_PREFIX = ".kvc-rebuild-"
_PARTIAL = ".partial"
STOP_ENV = "KVC_TEST_REPAIR_STOP"  # tests only: "STEP" or "STEP@N" -- the repair stops itself (SIGSTOP) there
_COPY_CHUNK = 256 << 10


def step(name: str, done: int = 0) -> None:
    """A named point of the repair: a crash test stops the process here (STOP_ENV) and kills it, deterministically
    (stopped at an event, never after a sleep). `done`: progress within the step (bytes, say)."""
    want = os.environ.get(STOP_ENV)
    if not want:
        return
    stop_at, _, at = want.partition("@")
    if stop_at == name and done >= int(at or 0):
        del os.environ[STOP_ENV]  # once
        os.kill(os.getpid(), signal.SIGSTOP)


def _original_name(path: str) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    name, n = ORIGINAL_PREFIX + stamp, 1
    while os.path.exists(os.path.join(path, name)):
        name, n = f"{ORIGINAL_PREFIX}{stamp}.{n}", n + 1
    return name


def keep_original(path: str) -> str:
    """Copy the data file to `data.mdb.orig-<UTC time>` beside it (written under a hidden name, fsynced, then
    renamed: the name only ever shows a whole copy); returns its path. The caller holds the store exclusively."""
    source = os.path.join(path, "data.mdb")
    size = os.path.getsize(source)
    st = os.statvfs(path)
    if st.f_bavail * st.f_frsize < size + (1 << 20):
        raise StoreFull(path, f"cannot keep the original data file beside the store before repairing it: it needs "
                              f"{size} bytes free; nothing was changed")
    name = _original_name(path)
    final = os.path.join(path, name)
    partial = os.path.join(path, "." + name + _PARTIAL)
    try:
        with open(source, "rb") as src, open(partial, "wb") as dst:
            copied = 0
            while chunk := src.read(_COPY_CHUNK):
                dst.write(chunk)
                copied += len(chunk)
                step("keeping_original", copied)
            dst.flush()
            os.fsync(dst.fileno())
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise translate(exc, path, "keeping the original data file beside the store (nothing was changed)",
                        size) from None
    os.replace(partial, final)
    fsync_dir(path)
    return final


def keep_consistent_copy(path: str) -> str:
    """Before a repair in place (the structure sound, other processes may be writing): a consistent copy of the
    environment by LMDB's own copy (one read transaction), kept as `data.mdb.orig-<UTC time>`."""
    work = tempfile.mkdtemp(prefix=REBUILD_PREFIX, dir=path)
    try:
        def copy(_: Callable[[Any], None]) -> None:
            with env_of(path, durability=DEFAULT_DURABILITY) as shared:
                shared.env.copy(work)

        _, died = run_isolated(copy)
        if died is not None:
            raise StoreError(path, f"cannot keep the original data file before repairing: the copy {died.describe()}; "
                                   "nothing was changed")
        with open(os.path.join(work, "data.mdb"), "rb") as f:
            os.fsync(f.fileno())
        final = os.path.join(path, _original_name(path))
        os.replace(os.path.join(work, "data.mdb"), final)
        fsync_dir(path)
        return final
    finally:
        shutil.rmtree(work, ignore_errors=True)


def clean_after_killed_repair(path: str) -> None:
    """Remove what a killed repair left, when the store is free to take exclusively (else leave it: a store in
    use is not being repaired by anyone, and the next repair that gets it cleans up)."""
    with contextlib.suppress(StoreError):
        with exclusive(path):
            remove_leftovers(path)


def remove_leftovers(path: str) -> None:
    """What a repair killed half-way left in the store directory: its work directory and a partial copy of the
    original (never a whole copy). The caller holds the store exclusively, so no repair is running."""
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if name.startswith(REBUILD_PREFIX) and os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)
        elif name.startswith("." + ORIGINAL_PREFIX) and name.endswith(_PARTIAL):
            os.unlink(full)


def fsync_dir(path: str) -> None:
    """fsync the directory `path`, so that a rename or a new file in it survives a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def exclusive(path: str, doing: str = "rebuild", again: str = "kvc audit --repair") -> Iterator[int]:
    """Hold byte 0 of LMDB's lock file for writing: every process with the environment open holds it for reading,
    so this succeeds only when none does, and openers wait until it is released. `doing`, `again`: what the
    refusal says could not be done, and the command to run once the store is free."""
    if path in ENVS:
        raise StoreError(path, f"cannot {doing}: this process has the store open; close it first")
    fd = os.open(os.path.join(path, "lock.mdb"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0, 0)
        except OSError:
            raise StoreError(path, f"cannot {doing}: the store is open in another process (a `kvc serve`, an "
                                   f"engine, a writer): stop it, or wait for it to finish, then run `{again}` "
                                   f"again; nothing was changed") from None
        yield fd
    finally:
        os.close(fd)  # releases the lock (if swap's LMDB open has not already)


def swap(path: str, new_path: str, lock_fd: int) -> None:
    """Move the fresh data file over the store's with one rename, then have LMDB re-initialise the lock file from
    it: this process holds the lock exclusively, so LMDB's open takes it as the first user and resets the reader
    table and transaction id; closing that environment releases the lock to the openers waiting for it."""
    new_data = os.path.join(new_path, "data.mdb")
    with open(new_data, "rb") as f:
        os.fsync(f.fileno())
    os.replace(new_data, os.path.join(path, "data.mdb"))
    fsync_dir(path)
    step("swapped")
    env = lmdb.open(path, subdir=True, max_dbs=MAX_DBS, lock=True)
    env.close()
    del lock_fd  # released with LMDB's own descriptor (POSIX locks belong to the process); closed by exclusive
