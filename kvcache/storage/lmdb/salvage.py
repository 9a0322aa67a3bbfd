"""The audit of an LMDB store that may be damaged, and its rebuild (what `kvc audit [--repair]` runs on LMDB).

LMDB trusts its pages: a flipped byte in a branch or leaf page can make a walk of the B-tree end in LMDB's own
`abort()`, a SIGSEGV, or a `CorruptedError` / `PageNotFoundError`. So every pass over the store runs in a forked
child (`isolated.run_isolated`), and the audit survives whatever the store does to the child:

- **check**: `verify()` in a child. A child that dies (a signal) or fails inside LMDB yields one
  `structure_corrupt` finding naming the sub-database, how many records the walk reached and the last key. A
  child that could not open or read the store for a permission, its lock file or writers (`_NOT_DAMAGE`) raises
  that error instead: no finding. A lock-free check (`env`: a user who cannot write lock.mdb, `lock=False`) that
  writers overtook — a read that says so, or a death while more than one transaction committed — is run again.
- **repair**, structure sound: `verify(repair=True)` in a child, then a check. If that repair dies, or leaves
  findings it should have fixed, the store is rebuilt.
- **repair**, structure damaged: **rebuild**. With the store to itself (it takes LMDB's lock file exclusively:
  a store open in another process is refused, and openers wait), it copies into a fresh environment in the store
  directory, raw, every record of each sub-database a cursor walk reaches (forward; after a death, forward again
  one record a commit up to the damage, then backward from the end down to it); then, for a page reached in one
  of its two records only, it looks the other up by key (restarting past any key whose lookup kills a child) and,
  failing that, finds it in the data file's leaf pages directly (a damaged branch hides whole intact leaves; only
  keys the other record names are taken, and only records that prove themselves: a page's checksum seeded by its
  key, metadata that chains to its key). The fresh store is then checked the ordinary way: pages of a namespace
  or layout whose record was lost go, the children index is rebuilt from the metadata, counters are recounted,
  `verify(repair=True)` removes what fails its checks (and what hung below it), and it must verify clean before
  its data file replaces the store's with one rename. The lock file is then re-initialised from the new data by
  LMDB itself before anyone else can use it. Every page that did not make it is listed as a removal, and the
  finding's detail says how many records of each sub-database could not even be reached.

The store's own directory is never left half-done: until the rename, the original is untouched; the fresh
environment is removed whatever happens.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import lmdb
import msgspec

from ...errors import (
    InvalidInput,
    NotAStore,
    StoreAccessDenied,
    StoreChanged,
    StoreError,
    StoreReadOnly,
    StoreUnsupported,
)
from ...types.keys import PAGE_HASH_BYTES
from ...types.shares import decode_shares_record
from ..api import VerifyFinding, VerifyRemoval, VerifyReport
from ..codec import (
    CHECKSUMS,
    DEFAULT_CHECKSUM,
    HEADER,
    Checksum,
    StoreFormat,
    chains_to,
    decode_format,
    decode_meta,
    decode_or_none,
)
from ..isolated import Died, run_isolated
from ..verify import verify
from .env import (
    DB_NAMES,
    DEFAULT_DURABILITY,
    DEFAULT_MAP_SIZE,
    DUPFIXED,
    ENVS,
    MAX_DBS,
    SharedEnv,
    acquire,
    committed_txnid,
    lock_file_writable,
    release,
)
from .registry import SHARES_PREFIX, recount
from .verify import LMDBIntegrity

COPY_BATCH_PAGES = 256  # records per write transaction of the rebuild's first pass (a death loses one batch)
_ERRORS = {"NotAStore": NotAStore, "StoreUnsupported": StoreUnsupported, "StoreReadOnly": StoreReadOnly,
           "StoreAccessDenied": StoreAccessDenied, "StoreChanged": StoreChanged}
# An open or a read that failed for one of these met a permission, the lock file or writers, never damage: the
# error is the audit's answer (exit 2), never a `structure_corrupt` finding.
_NOT_DAMAGE = {"StoreReadOnly", "StoreAccessDenied", "StoreChanged"}
LOCK_FREE_CHECKS = 3  # runs of a lock-free check that writers keep overtaking before StoreChanged
_UNREPAIRED_KINDS = {"unknown_layout", "unknown_namespace"}  # reported, never repaired (api.REPAIRS)


class Reached(msgspec.Struct, frozen=True, array_like=True):
    """How far a walk got: the sub-database, records walked, the last key (hex, "" before the first)."""

    db: str
    records: int
    last_key: str


def audit_location(path: str, repair: bool = False, lock: bool = True) -> VerifyReport:
    """The integrity audit of the LMDB store at `path`, run in child processes (see the module docstring).
    `lock` False: read it lock-free, writing nothing to its directory (as a user who cannot write its lock file
    does anyway; `env`)."""
    if repair and not lock:
        raise InvalidInput("a repair writes the store: it cannot run lock-free (read-only)")
    path = _store_path(path)
    if repair and not os.access(path, os.W_OK):
        raise StoreReadOnly(path, "cannot repair: the store's directory is not writable")
    check = _check(path, lock)
    if not repair or check.ok:
        return check
    if not _structural(check):
        fixed, died = run_isolated(lambda report: _verify_in(path, report, repair=True), Reached, VerifyReport)
        if died is None:
            after = _check(path)
            if after.ok or all(f.kind in _UNREPAIRED_KINDS for f in after.findings):
                return fixed
    return _rebuild(path, check)


def _store_path(location: str) -> str:
    path = location[len("lmdb://"):] if location[:len("lmdb://")].lower() == "lmdb://" else location
    path = os.path.realpath(path)
    if not os.path.isdir(path):
        raise NotAStore(path, "no kvc store here (expected a directory holding data.mdb)")
    if not os.path.exists(os.path.join(path, "data.mdb")):
        raise NotAStore(path, "no kvc store here (expected a directory holding data.mdb)")
    return path


def _structural(report: VerifyReport) -> bool:
    return any(f.kind == "structure_corrupt" for f in report.findings)


def _verify_in(path: str, report: Callable[[Any], None], repair: bool, lock: bool = True) -> VerifyReport:
    """In a child: open the store and verify it, reporting the walk's progress."""
    with _env_of(path, durability=DEFAULT_DURABILITY, lock=lock) as shared:
        if repair and not shared.writable:
            raise StoreReadOnly(path, "cannot repair: the store is at a read-only location")
        progress = lambda db, n, key: report(Reached(db, n, key.hex() if key else ""))  # noqa: E731
        return verify(LMDBIntegrity(shared, progress=progress), repair)


@contextlib.contextmanager
def _env_of(path: str, create: bool = False, durability: str = "none", lock: bool = True) -> Iterator[SharedEnv]:
    """The store at `path` opened in this process (durability "none" for the fresh store: its data file is
    fsynced once, before the swap)."""
    shared = acquire(path, create, DEFAULT_MAP_SIZE, durability, lock=lock)
    try:
        yield shared
    finally:
        release(shared)


def _check(path: str, lock: bool = True) -> VerifyReport:
    """verify() in a child; its death (or a fault inside LMDB) is a `structure_corrupt` finding. A lock-free
    check (`env`) is run again when writers overtook it: a read that failed, or a child that died, while the
    store committed more than one transaction may have read pages a writer reused, which is no damage."""
    lock_free = not lock or not lock_file_writable(path)
    for _ in range(LOCK_FREE_CHECKS if lock_free else 1):
        before = committed_txnid(path) if lock_free else 0
        report, died = run_isolated(lambda r: _verify_in(path, r, repair=False, lock=lock), Reached, VerifyReport)
        if died is None:
            return report
        overtaken = died.error_type == "StoreChanged" or (
            lock_free and died.error_type not in _ERRORS and committed_txnid(path) > before + 1)
        if not overtaken:
            break
    else:
        raise StoreChanged(path, f"the store was written during each of {LOCK_FREE_CHECKS} lock-free audits of it "
                                 f"(a lock-free reader cannot hold a snapshot while writers go on): audit it while "
                                 f"writers are idle, or as a user who can write lock.mdb")
    if died.error_type in _NOT_DAMAGE:
        raise _ERRORS[died.error_type](path, _message(died, path))
    if died.error_type in _ERRORS and not _kvc_catalogue(path):
        raise _ERRORS[died.error_type](path, _message(died, path))
    reached: Reached | None = died.progress
    checked = reached.records if reached is not None and reached.db == "pages" else 0
    return VerifyReport(False, checked, 0, [VerifyFinding("structure_corrupt", None, _where(died))])


def _message(died: Died, path: str) -> str:
    """The message of the error a child raised, without its type and path."""
    message = died.error.split(": ", 1)[1] if died.error else ""
    return message[len(path) + 2:] if message.startswith(path + ": ") else message


def _where(died: Died) -> str:
    reached: Reached | None = died.progress
    if reached is None:
        at = "before the walk began (the catalogue of sub-databases, or the format record)"
    else:
        at = (f"in sub-database '{reached.db}' after {reached.records} records"
              + (f" (last key {reached.last_key[:32]})" if reached.last_key else ""))
    return (f"the walk of the store {died.describe()} {at}: LMDB's B-tree is damaged there; "
            f"`kvc audit --repair` rebuilds the store from what still reads back sound")


def _kvc_catalogue(path: str) -> bool:
    """Whether the environment's catalogue names kvc's sub-databases (then an open that fails met damage, not a
    foreign store). Read in a child: the catalogue itself may be what is damaged."""
    def names(_: Callable[[Any], None]) -> list[str]:
        env = lmdb.open(path, readonly=True, lock=False, subdir=True, max_dbs=MAX_DBS)
        try:
            with env.begin() as txn:
                return [bytes(k).decode("latin-1") for k, _ in txn.cursor()]
        finally:
            env.close()

    found, died = run_isolated(names, result_type=list[str])
    return died is not None or len(set(found or ()) & set(DB_NAMES)) >= 2


# --- the rebuild ---------------------------------------------------------------------------------------------


def _rebuild(path: str, check: VerifyReport) -> VerifyReport:
    with _exclusive(path) as lock_fd:
        work = tempfile.mkdtemp(prefix=".kvc-rebuild-", dir=path)
        new = os.path.join(work, "store")
        try:
            store_records = _enumerate(path, "store")
            with _env_of(new, create=True):
                pass
            known: dict[str, set[bytes]] = {}
            recorded: dict[str, int] = {}
            for db in ("layouts", "namespaces", "meta", "pages"):
                known[db], recorded[db] = _copy_walking(path, new, db)
            # a page reached in one of its two records only: look the other one up by its key, and what the tree
            # cannot reach, find in the file's leaf pages themselves
            for db, other in (("pages", "meta"), ("meta", "pages")):
                known[db] |= _copy_by_key(path, new, db, sorted(known[other] - known[db]))
            sound, died = run_isolated(lambda _: _drop_unsound(new, store_records), result_type=dict[str, list[bytes]])
            if died is not None:
                raise StoreError(path, f"rebuilding: checking the copied records {died.describe()}")
            named = known["meta"] | known["pages"]
            found, died = run_isolated(lambda _: _scan_file(path, new, named - set(sound["pages"]),
                                                            named - set(sound["meta"]), store_records),
                                       result_type=dict[str, list[bytes]])
            for db, keys in (found or {}).items():
                known[db] |= set(keys)
            pruned, died = run_isolated(lambda _: _prepare(new, store_records), result_type=list[VerifyRemoval])
            if died is not None:
                raise StoreError(path, f"rebuilding: preparing the fresh store {died.describe()}")
            fixed, died = run_isolated(lambda r: _verify_in(new, r, repair=True), Reached, VerifyReport)
            if died is None:
                after, died = run_isolated(lambda r: _verify_in(new, r, repair=False), Reached, VerifyReport)
            if died is not None or not after.ok:
                why = died.describe() if died is not None else f"{len(after.findings)} findings left"
                raise StoreError(path, f"the rebuilt store does not verify ({why}); the store was left as it was")
            final, died = run_isolated(lambda _: _keys_of(new), result_type=dict[str, list[bytes]])
            if died is not None:
                raise StoreError(path, f"rebuilding: reading the fresh store {died.describe()}")
            _swap(path, new, lock_fd)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    gone = {r.page_hash for r in pruned} | {r.page_hash for r in fixed.removals}
    unread = sorted((known["pages"] | known["meta"]) - set(final["pages"]) - {bytes.fromhex(h) for h in gone})
    records = sorted((known["namespaces"] - set(final["namespaces"])) | (known["layouts"] - set(final["layouts"])))
    removals = ([VerifyRemoval("structure_corrupt", h.hex(), "page", 0) for h in unread]
                + [VerifyRemoval("structure_corrupt", k.hex(), "record", 0) for k in records
                   if k.hex() not in gone]
                + pruned + list(fixed.removals))
    unreached = [f"'{db}' {recorded[db] - len(known[db])} of {recorded[db]}" for db in recorded
                 if recorded[db] > len(known[db])]
    lost_pages = len((known["pages"] | known["meta"]) - set(final["pages"]))
    summary = VerifyFinding(
        "structure_corrupt", None,
        f"rebuilt into a fresh environment: {len(final['pages'])} page(s) kept, {lost_pages} lost ({len(unread)} "
        f"unreadable, {lost_pages - len(unread)} failed their checks or lost their namespace or layout record)"
        + (f"; records that could not even be reached: {', '.join(unreached)}" if unreached else ""), True)
    findings = [msgspec.structs.replace(f, repaired=True) for f in check.findings] + [summary]
    return VerifyReport(False, check.pages_checked, check.bytes_checked, findings, len(findings), removals)


@contextlib.contextmanager
def _exclusive(path: str) -> Iterator[int]:
    """Hold byte 0 of LMDB's lock file for writing: every process with the environment open holds it for reading,
    so this succeeds only when none does, and openers wait until it is released."""
    if path in ENVS:
        raise StoreError(path, "cannot rebuild: this process has the store open; close it first")
    fd = os.open(os.path.join(path, "lock.mdb"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0, 0)
        except OSError:
            raise StoreError(path, "cannot rebuild: the store is open in another process (a `kvc serve`, an "
                                   "engine, a writer); stop it and run `kvc audit --repair` again") from None
        yield fd
    finally:
        os.close(fd)  # releases the lock (if _swap's LMDB open has not already)


def _raw_env(path: str) -> lmdb.Environment:
    # No lock: the caller holds the store exclusively (_exclusive), and LMDB's own open would wait for that lock.
    return lmdb.open(path, readonly=True, lock=False, subdir=True, max_dbs=MAX_DBS)


def _open_db(env: lmdb.Environment, txn: lmdb.Transaction, db: str) -> Any:
    return env.open_db(db.encode(), txn=txn, create=False, dupsort=db in DUPFIXED, dupfixed=db in DUPFIXED)


def _enumerate(path: str, db: str) -> dict[bytes, bytes]:
    """The records of a small sub-database that can be read (forward until the walk completes or dies)."""
    got: dict[bytes, bytes] = {}

    def walk(report: Callable[[Any], None]) -> None:
        env = _raw_env(path)
        try:
            with env.begin(buffers=True) as txn:
                for key, value in txn.cursor(db=_open_db(env, txn, db)):
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
    env = _raw_env(path)
    try:
        with _env_of(new) as store, env.begin(buffers=True) as txn:
            yield txn, _open_db(env, txn, db), store, getattr(store.dbs, db)
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
                    _put_raw(store, target, batch)
                    report(("committed", [k for k, _ in batch]))
                    batch = []
            ok = cur.prev() if how.backward else cur.next()
        _put_raw(store, target, batch)
        report(("committed", [k for k, _ in batch]))


def _put_raw(store: SharedEnv, target: Any, records: list[tuple[bytes, bytes]]) -> None:
    if records:
        store.write(lambda txn: [txn.put(k, v, db=target) for k, v in records])


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
            _put_raw(store, target, batch)
            report(("found", [k for k, _ in batch]))
            report(("committed", end))


def _drop_unsound(new: str, store_records: dict[bytes, bytes]) -> dict[str, list[bytes]]:
    """In a child, on the fresh store: remove copied page and metadata records that do not prove themselves (a
    walk of a damaged leaf can return garbage); returns the keys of those that do, per sub-database."""
    algos = _algorithms(store_records)
    kept: dict[str, list[bytes]] = {"pages": [], "meta": []}

    def body(txn: lmdb.Transaction) -> None:
        for db, proves in (("pages", lambda k, v: _page_proves(k, v, algos)), ("meta", _meta_proves)):
            target = getattr(dbs, db)
            for key, value in list(txn.cursor(db=target)):
                if proves(bytes(key), value):
                    kept[db].append(bytes(key))
                else:
                    txn.delete(bytes(key), db=target)

    with _env_of(new) as store:
        dbs = store.dbs
        store.write(body)
    return kept


def _algorithms(store_records: dict[bytes, bytes]) -> list[Checksum]:
    """The checksum the store's format record names, or every one when that record is lost."""
    fmt = decode_or_none(decode_format, store_records.get(b"format", b""))
    if isinstance(fmt, StoreFormat) and fmt.checksum in CHECKSUMS:
        return [CHECKSUMS[fmt.checksum]]
    return list(CHECKSUMS.values())


def _page_proves(key: bytes, value: Any, algos: list[Checksum]) -> bool:
    """A page record whose checksum, seeded by its key, matches its payload."""
    return len(key) == PAGE_HASH_BYTES and any(a.sound(value, key) for a in algos)


def _meta_proves(key: bytes, value: Any) -> bool:
    """A metadata record that decodes and chains to its key."""
    meta = decode_or_none(decode_meta, value)
    return meta is not None and chains_to(key, meta)


def _scan_file(path: str, new: str, want_pages: set[bytes], want_meta: set[bytes],
               store_records: dict[bytes, bytes]) -> dict[str, list[bytes]]:
    """In a child: find the records of `want_pages` / `want_meta` in the leaf pages of the data file, past the
    B-tree that could not reach them (a damaged branch page hides whole leaves that are intact). Only keys known
    from the other sub-database are taken (a freed page still holds records of pages deleted since: those must not
    come back), and only a record that proves itself: a page whose checksum, seeded by its key, matches; metadata
    that decodes and chains to its key. Parsed in Python, bounds-checked: a damaged page is skipped, never read
    past. Writes what it finds into the fresh store; returns the keys, per sub-database."""
    if not (want_pages or want_meta):
        return {}
    algos = _algorithms(store_records)
    pages: dict[bytes, bytes] = {}
    metas: dict[bytes, bytes] = {}
    with open(os.path.join(path, "data.mdb"), "rb") as f:
        data = f.read()
    psize = int.from_bytes(data[40:44], "little") or 4096  # recorded in meta page 0 (LMDB's free db pad field)
    for base in range(2 * psize, len(data) - psize + 1, psize):
        # Any page whose node table fits is parsed as a leaf: its flags or free-space bound may be what was
        # damaged, and every record taken must prove itself anyway (a branch node parsed so proves nothing).
        (lower,) = struct.unpack_from("<H", data, base + 12)
        if not _HEADER_BYTES <= lower <= psize:
            continue
        for i in range((lower - _HEADER_BYTES) // 2):
            node = base + struct.unpack_from("<H", data, base + _HEADER_BYTES + 2 * i)[0]
            if node + _NODE > base + psize:
                continue
            lo, hi, nflags, ksize = struct.unpack_from("<HHHH", data, node)
            key = data[node + _NODE:node + _NODE + ksize]
            if ksize != PAGE_HASH_BYTES or (key not in want_pages and key not in want_meta):
                continue
            size, at = lo | hi << 16, node + _NODE + ksize
            if nflags & _F_BIGDATA:
                over = int.from_bytes(data[at:at + 8], "little") * psize
                at = over + _HEADER_BYTES
                if not 0 < over < len(data) - _HEADER_BYTES:
                    continue
            value = data[at:at + size]
            if len(value) != size:
                continue
            if key in want_pages and key not in pages and _page_proves(key, value, algos):
                pages[key] = value
            if key in want_meta and key not in metas and _meta_proves(key, value):
                metas[key] = value
    with _env_of(new) as store:
        _put_raw(store, store.dbs.pages, list(pages.items()))
        _put_raw(store, store.dbs.meta, list(metas.items()))
    return {"pages": list(pages), "meta": list(metas)}


# LMDB's page layout (mdb.c, 64-bit): a 16-byte header (pgno, pad, flags, lower, upper), node offsets from there
# to `lower`; a node is lo, hi, flags, key size (u16 each), the key, then the value (or an overflow page number).
_HEADER_BYTES, _NODE = 16, 8
_F_BIGDATA = 0x01


def _prepare(new: str, store_records: dict[bytes, bytes]) -> list[VerifyRemoval]:
    """In a child, on the fresh store: its store records (the old format record when it survived, else one for
    the checksum the pages agree with; the limits), pages of a namespace or layout whose record was lost removed
    (listed), the children index built from the metadata, the counters recounted."""
    removed: list[VerifyRemoval] = []
    with _env_of(new) as store:
        dbs = store.dbs

        def body(txn: lmdb.Transaction) -> None:
            fmt = decode_or_none(decode_format, store_records.get(b"format", b""))
            if not (isinstance(fmt, StoreFormat) and fmt.checksum in CHECKSUMS):
                fresh = txn.get(b"format", db=dbs.store)
                assert fresh is not None, "the fresh store has the format record its creation wrote"
                fmt = msgspec.structs.replace(decode_format(fresh), checksum=_agreed_checksum(txn, dbs))
            txn.put(b"format", msgspec.msgpack.encode(fmt), db=dbs.store)
            for key in (b"capacity", b"ns_quota"):
                if len(store_records.get(key, b"")) == 8:  # a u64 limit
                    txn.put(key, store_records[key], db=dbs.store)
            for key, raw in store_records.items():  # namespace shares (policy: they outlive the pages)
                if key.startswith(SHARES_PREFIX) and decode_or_none(decode_shares_record, raw) is not None:
                    txn.put(key, raw, db=dbs.store)
            layouts = {bytes(k) for k, v in txn.cursor(db=dbs.layouts)}
            namespaces = {bytes(k) for k, v in txn.cursor(db=dbs.namespaces)}
            txn.drop(dbs.children, delete=False)
            for page_key, raw_meta in list(txn.cursor(db=dbs.meta)):
                h = bytes(page_key)
                meta = decode_or_none(decode_meta, raw_meta)
                if meta is None:
                    continue  # verify(repair=True) removes it next
                lost = ("unknown_layout" if meta.layout_id not in layouts else
                        "unknown_namespace" if meta.ns_id not in namespaces else "")
                if lost:
                    value = txn.get(h, db=dbs.pages)
                    txn.delete(h, db=dbs.meta)
                    txn.delete(h, db=dbs.pages)
                    removed.append(VerifyRemoval(lost, h.hex(), "page", max(len(value or b"") - HEADER, 0)))
                else:
                    txn.put(meta.parent, h, db=dbs.children, dupdata=True)
            recount(txn, dbs)

        store.write(body)
    return removed


def _agreed_checksum(txn: lmdb.Transaction, dbs: Any) -> str:
    """The checksum algorithm the first pages agree with (the format record that named it was lost)."""
    counts = {name: 0 for name in CHECKSUMS}
    for n, (key, value) in enumerate(txn.cursor(db=dbs.pages)):
        if n >= 64:
            break
        for name, algo in CHECKSUMS.items():
            counts[name] += algo.sound(value, bytes(key))
    return max(counts, key=counts.__getitem__) if any(counts.values()) else DEFAULT_CHECKSUM


def _keys_of(new: str) -> dict[str, list[bytes]]:
    with _env_of(new) as store, store.read() as txn:
        return {db: [bytes(k) for k, _ in txn.cursor(db=getattr(store.dbs, db))]
                for db in ("pages", "namespaces", "layouts")}


def _swap(path: str, new_path: str, lock_fd: int) -> None:
    """Move the fresh data file over the store's with one rename, then have LMDB re-initialise the lock file from
    it: this process holds the lock exclusively, so LMDB's open takes it as the first user and resets the reader
    table and transaction id; closing that environment releases the lock to the openers waiting for it."""
    new_data = os.path.join(new_path, "data.mdb")
    with open(new_data, "rb") as f:
        os.fsync(f.fileno())
    os.replace(new_data, os.path.join(path, "data.mdb"))
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    env = lmdb.open(path, subdir=True, max_dbs=MAX_DBS, lock=True)
    env.close()
    del lock_fd  # released with LMDB's own descriptor (POSIX locks belong to the process); closed by _exclusive
