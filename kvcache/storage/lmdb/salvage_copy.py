"""What LMDB still reads of a damaged store, copied raw into a rebuild's fresh store (`salvage_rebuild`), each
read in a child of its own (a damaged page can kill it): every record a cursor walk of each sub-database reaches
(forward; after a death, forward again one record a commit up to the damage, then backward from the end down to
it), then, for a page reached in one of its two records only, the other looked up by key (restarting past any key
whose lookup kills a child). `openable_copy` gives LMDB a copy of the file it can open when its meta pages are
unreadable or the file was cut short. What is copied is checked afterwards (`salvage_proofs`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import lmdb
import msgspec

from ..isolated import run_isolated
from . import pagefile
from .env import DUPFIXED, MAX_DBS
from .faults import translate
from .rewrite import step
from .salvage_child import env_of
from .shared_env import SharedEnv

COPY_BATCH_PAGES = 256  # records per write transaction of the rebuild's first pass (a death loses one batch)


class Copied(msgspec.Struct):
    """What a rebuild's copy into the fresh store got: keys per sub-database, the entries each one's catalogue
    records (-1: unreadable), and the old store's own records (format, limits, shares)."""

    known: dict[str, set[bytes]]
    recorded: dict[str, int]
    store_records: dict[bytes, bytes]


def copy_readable(source: str, new: str) -> Copied:
    """Copy into the fresh store what LMDB reads of the environment at `source` (see the module docstring), raw:
    the rebuild checks it (`salvage_rebuild`)."""
    store_records = _enumerate(source, "store")
    known: dict[str, set[bytes]] = {}
    recorded: dict[str, int] = {}
    for db in ("layouts", "namespaces", "meta", "pages"):
        known[db], recorded[db] = _copy_walking(source, new, db)
        step("copied_" + db)
    # a page reached in one of its two records only: look the other one up by its key
    for db, other in (("pages", "meta"), ("meta", "pages")):
        known[db] |= _copy_by_key(source, new, db, sorted(known[other] - known[db]))
    return Copied(known, recorded, store_records)


def _enumerate(path: str, db: str) -> dict[bytes, bytes]:
    """The records of a small sub-database that can be read (forward until the walk completes or dies)."""
    got: dict[bytes, bytes] = {}

    def walk(report: Callable[[Any], None]) -> None:
        env = raw_env(path)
        try:
            with env.begin(buffers=True) as txn:
                for key, value in txn.cursor(db=open_db(env, txn, db)):
                    report((bytes(key), bytes(value)))  # one message a record: a death loses nothing read
        finally:
            env.close()

    run_isolated(walk, on_progress=lambda kv: got.__setitem__(bytes(kv[0]), bytes(kv[1])))
    return got


class _Walk(msgspec.Struct, frozen=True):
    """One pass of `_copy_walking`: which way, past which key, and how many records per commit."""

    backward: bool
    bound: bytes | None  # forward: start past this key; backward: stop at (not below) it
    batch: int


def _copy_walking(path: str, new: str, db: str) -> tuple[set[bytes], int]:
    """Copy the records of sub-database `db` that a cursor walk reaches into the fresh store, raw (they are
    checked there). Forward in large commits; after a death, forward again from the last key committed one record
    a commit (so everything before the damage gets in); then backward from the end down to that key. Returns the
    keys copied and the entries the catalogue records (-1: unreadable)."""
    copied: set[bytes] = set()
    entries = -1
    last: bytes | None = None  # the greatest key a forward walk committed
    backward = False

    def on(message: Any) -> None:
        nonlocal entries, last
        kind, value = message
        if kind == "entries":
            entries = value
        else:
            keys = [bytes(k) for k in value]
            copied.update(keys)
            if keys and not backward:
                last = max(keys)

    _, died = run_isolated(lambda r: _walk_copy(path, new, db, _Walk(False, None, COPY_BATCH_PAGES), r),
                           on_progress=on)
    if died is None:
        return copied, entries
    _, died = run_isolated(lambda r: _walk_copy(path, new, db, _Walk(False, last, 1), r), on_progress=on)
    if died is not None:
        backward = True
        run_isolated(lambda r: _walk_copy(path, new, db, _Walk(True, last, 1), r), on_progress=on)
    return copied, entries


@contextlib.contextmanager
def _old_to_new(path: str, new: str, db: str) -> Iterator[tuple[lmdb.Transaction, Any, SharedEnv, Any]]:
    """In a child: a read transaction on the old store with sub-database `db` opened in it, and the fresh store
    with its own `db`: (old txn, old db, fresh store, fresh db)."""
    env = raw_env(path)
    try:
        with env_of(new) as store, env.begin(buffers=True) as txn:
            yield txn, open_db(env, txn, db), store, getattr(store.dbs, db)
    finally:
        env.close()


def _walk_copy(path: str, new: str, db: str, how: _Walk, report: Callable[[Any], None]) -> None:
    """In a child: the walk of `_copy_walking`, reporting ("entries", n) and ("committed", keys)."""
    with _old_to_new(path, new, db) as (txn, dbi, store, target):
        report(("entries", txn.stat(dbi)["entries"]))
        cur = txn.cursor(db=dbi)
        if how.backward:
            ok = cur.last()
        else:
            ok = cur.set_range(how.bound) if how.bound is not None else cur.first()
        batch: list[tuple[bytes, bytes]] = []
        while ok:
            key = bytes(cur.key())
            if how.backward and how.bound is not None and key <= how.bound:
                break
            if how.backward or how.bound is None or key > how.bound:
                batch.append((key, bytes(cur.value())))
                if len(batch) >= how.batch:
                    put_raw(store, target, batch)
                    report(("committed", [k for k, _ in batch]))
                    batch = []
            ok = cur.prev() if how.backward else cur.next()
        put_raw(store, target, batch)
        report(("committed", [k for k, _ in batch]))


def _copy_by_key(path: str, new: str, db: str, keys: list[bytes]) -> set[bytes]:
    """Look each key up in sub-database `db` of the old store and copy what is found; a lookup that kills its
    child is skipped on the next try. Returns the keys copied."""
    copied: set[bytes] = set()
    skip: set[int] = set()
    start = 0
    while start < len(keys):
        state = {"committed": start, "reading": start}

        def on(message: Any, state: dict[str, int] = state) -> None:
            kind, value = message
            if kind == "found":
                copied.update(bytes(k) for k in value)
            else:
                state[kind] = value

        def copy(report: Callable[[Any], None], start: int = start) -> None:
            _lookup_copy(path, new, db, keys, start, skip, report)

        _, died = run_isolated(copy, on_progress=on)
        if died is None:
            break
        skip.add(state["reading"])
        start = state["committed"]
    return copied


def _lookup_copy(path: str, new: str, db: str, keys: list[bytes], start: int, skip: set[int],
                 report: Callable[[Any], None]) -> None:
    """In a child: copy keys[start:] found in `db`, COPY_BATCH_PAGES per commit, reporting ("reading", i) before
    each lookup and ("found", keys) + ("committed", i) after each commit."""
    with _old_to_new(path, new, db) as (txn, dbi, store, target):
        for i in range(start, len(keys), COPY_BATCH_PAGES):
            batch = []
            end = min(i + COPY_BATCH_PAGES, len(keys))
            for j in range(i, end):
                if j in skip:
                    continue
                report(("reading", j))
                value = txn.get(keys[j], db=dbi)
                if value is not None:
                    batch.append((keys[j], bytes(value)))
            put_raw(store, target, batch)
            report(("found", [k for k, _ in batch]))
            report(("committed", end))


def put_raw(store: SharedEnv, target: Any, records: list[tuple[bytes, bytes]]) -> None:
    """Write `records` as they are into sub-database `target` of `store`, in one write transaction."""
    if records:
        store.write(lambda txn: [txn.put(k, v, db=target) for k, v in records])


def raw_env(path: str) -> lmdb.Environment:
    """The environment at `path` opened read-only as LMDB finds it, without kvc's checks on opening."""
    # No lock: the caller holds the store exclusively (exclusive), and LMDB's own open would wait for that lock.
    return lmdb.open(path, readonly=True, lock=False, subdir=True, max_dbs=MAX_DBS)


def open_db(env: lmdb.Environment, txn: lmdb.Transaction, db: str) -> Any:
    """Sub-database `db` of `env` opened in `txn` (never created), with the flags kvc gives it."""
    return env.open_db(db.encode(), txn=txn, create=False, dupsort=db in DUPFIXED, dupfixed=db in DUPFIXED)


def openable_copy(path: str, work: str, probe: pagefile.Probe, length: int = 0) -> str:
    """A copy of the store's data file in `work` that LMDB can open: its meta pages rebuilt (a copy of the one
    that is sound, else ones naming the newest intact catalogue), and a file cut short padded with zeros to the
    `length` its last commit wrote (LMDB then reads zeroed pages there: an error, never a SIGBUS). The store's own
    file is never written."""
    view = os.path.join(work, "view")
    os.mkdir(view)
    target = os.path.join(view, "data.mdb")
    source = os.path.join(path, "data.mdb")
    try:
        shutil.copyfile(source, target)
        with open(target, "r+b") as f:
            if length > probe.size:
                f.truncate(length)
            for slot in (0, 1):
                f.seek(slot * probe.page_size)
                f.write(pagefile.sound_meta_copy(source, probe, slot) if probe.sound_metas
                        else pagefile.view_meta(probe, slot))
    except OSError as exc:
        raise translate(exc, path, "copying the data file to rebuild its meta pages (nothing was changed)",
                        probe.size) from None
    return view
