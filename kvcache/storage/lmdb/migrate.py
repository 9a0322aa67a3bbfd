"""`kvc migrate`: rewrite an LMDB store of an older format to the current one (FORMAT_VERSION).

Format 2 keys the page-hash chain roots by the store's secret (kvcache.types.keys; the chain key derived from the
store's key file), so every page hash of a format-1 store changes: each page is filed under its new hash, its
checksum (seeded by the hash) is taken again, its metadata names its new parent, the children index is rebuilt,
and each namespace record keeps its new roots. An engine page (`PageMeta.key`) is filed under its key's hash under
its namespace's new root. Nothing else changes: layouts, namespace counters, limits, shares,
serving and drop records are copied as they are.

Crash-safe the way a repair's rebuild is (`salvage`, whose pieces it reuses): with the store to itself (LMDB's lock
file held exclusively: a store open in another process is refused), the new store is built in a fresh environment
in a work directory inside the store's, verified, and its data file replaces the store's with one rename; the lock
file is then re-initialised by LMDB. Until the rename the store's data file is untouched, after it the new one is
whole. A migration killed part-way leaves its work directory (a hidden name), which the next migration removes.
Crash tests stop it at its named steps (`rewrite.step`, env KVC_TEST_REPAIR_STOP) and kill it there.

The store must audit clean first (a chain with a missing link has no new hash to go under): `kvc audit --repair`
it, then migrate. All page metadata is held in memory during the rewrite (about 100 bytes plus the page's token
bytes per page).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

import lmdb
import msgspec

from ...errors import InvalidInput, NotAStore, StoreDamaged, StoreError, StoreReadOnly
from ...types.ids import NamespaceId, PageHash
from ...types.keys import TOKEN_BYTES, UNKEYED_CHAIN, derive_chain_key, engine_page_hash, extend_chain, hash_root_of_id
from ..api import NamespaceRecord, PageMeta, VerifyReport
from ..codec import (
    CHECKSUM_FIELD,
    CHECKSUMS,
    FORMAT_VERSION,
    HEADER,
    KEYED_ROOTS_VERSION,
    StoreFormat,
    decode_format,
    decode_meta,
    decode_namespace,
    decode_or_none,
    encoder,
)
from ..isolated import run_isolated
from ..keyfile import KEY_FILE, ensure_key
from ..maintenance import MigrateReport
from .env import DEFAULT_MAP_SIZE, ENVS, acquire, release
from .pagemap import damaged_detail, refuse_damaged
from .rewrite import exclusive, fsync_dir, step, swap
from .salvage import _check, _store_path
from .salvage_child import Reached, verify_in
from .salvage_copy import open_db, raw_env

MIGRATE_PREFIX = ".kvc-migrate-"  # the work directory of a migration, inside the store's
MIGRATE_BATCH_PAGES = 256  # pages per write transaction of the new store


def migrate_location(location: str) -> MigrateReport:
    """Rewrite the LMDB store at `location` to FORMAT_VERSION (see the module docstring). A current store is left
    as it is. StoreError when it is open in another process or does not audit clean; nothing is changed then."""
    path = _store_path(location)
    if not os.access(path, os.W_OK):
        raise StoreReadOnly(path, "cannot migrate: the store's directory is not writable")
    if path in ENVS:
        raise StoreError(path, "cannot migrate: this process has the store open; close it first")
    fmt = _format_of(path)
    if fmt.version >= FORMAT_VERSION:
        # a migration killed after its swap left its work directory: removed when the store is free to take
        with contextlib.suppress(StoreError), exclusive(path, "migrate", "kvc migrate"):
            _remove_leftovers(path)
        return MigrateReport(path, fmt.version, fmt.version, False, 0, 0)
    # The audit runs before the store is taken exclusively (its child opens the store as any reader does); what a
    # writer adds meanwhile keeps the store consistent, and a chain the rewrite cannot follow stops it unchanged.
    check = _check(path)
    if not check.ok:
        raise StoreError(path, f"cannot migrate: the store does not audit clean ({len(check.findings)} "
                               f"finding(s)); run `kvc audit --repair` first; nothing was changed")
    with exclusive(path, "migrate", "kvc migrate") as lock_fd:
        _remove_leftovers(path)
        fmt = _format_of(path)  # again, holding the store: another migration may have run meanwhile
        if fmt.version >= FORMAT_VERSION:
            return MigrateReport(path, fmt.version, fmt.version, False, 0, 0)
        chain_key = derive_chain_key(ensure_key(path))
        work = tempfile.mkdtemp(prefix=MIGRATE_PREFIX, dir=path)
        new = os.path.join(work, "store")
        try:
            os.mkdir(new, 0o700)
            pages, namespaces = _rewrite(path, new, fmt, chain_key)
            shutil.copyfile(os.path.join(path, KEY_FILE), os.path.join(new, KEY_FILE))  # its verify uses the key
            step("rewritten")
            after, died = run_isolated(lambda r: verify_in(new, r, repair=False), Reached, VerifyReport)
            if died is not None or not after.ok:
                why = died.describe() if died is not None else f"{len(after.findings)} finding(s)"
                raise StoreError(path, f"cannot migrate: the rewritten store does not verify ({why}); the store "
                                       f"was left as it was")
            step("verified")
            swap(path, new, lock_fd)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return MigrateReport(path, fmt.version, FORMAT_VERSION, True, pages, namespaces)


def format_version_of(location: str) -> int:
    """The format version the LMDB store at `location` records (read lock-free: nothing is written)."""
    return _format_of(_store_path(location)).version


def _remove_leftovers(path: str) -> None:
    """The work directory of a migration killed part-way (the caller holds the store exclusively)."""
    for name in os.listdir(path):
        if name.startswith(MIGRATE_PREFIX):
            shutil.rmtree(os.path.join(path, name), ignore_errors=True)


def _format_of(path: str) -> StoreFormat:
    """The store's format record, read in a child (LMDB trusts its pages: a damaged tree may kill the reader),
    after the checks that keep LMDB from mapping a file cut short (`pagemap.refuse_damaged`)."""
    refuse_damaged(path)
    fmt, died = run_isolated(lambda _: _read_format(path), result_type=StoreFormat)
    if died is None:
        return fmt
    raised = {"NotAStore": NotAStore, "StoreError": StoreError}.get(died.error_type or "")
    if raised is not None and died.error is not None:
        message = died.error.split(": ", 1)[1]
        raise raised(path, message[len(path) + 2:] if message.startswith(path + ": ") else message)
    if died.error_type == "InvalidInput" and died.error is not None:
        raise InvalidInput(died.error.split(": ", 1)[1])
    raise StoreDamaged(path, damaged_detail(f"reading its format record {died.describe()}"))


def _read_format(path: str) -> StoreFormat:
    try:
        env = raw_env(path)
    except lmdb.Error as exc:
        raise NotAStore(path, f"cannot migrate: the data file does not open as LMDB ({exc}); run `kvc audit`") from None
    try:
        with env.begin() as txn:
            raw = txn.get(b"format", db=open_db(env, txn, "store"))
    except lmdb.Error as exc:
        raise StoreError(path, f"cannot migrate: the format record does not read ({exc}); run `kvc audit`") from None
    finally:
        env.close()
    fmt = decode_or_none(decode_format, raw) if raw is not None else None
    if fmt is None:
        raise NotAStore(path, "cannot migrate: no kvc format record here (not a kvc store, or a damaged one: run "
                              "`kvc audit`)")
    if fmt.checksum not in CHECKSUMS:
        raise InvalidInput(f"{path}: store checksums use {fmt.checksum!r}, which this install lacks")
    return fmt


def _rewrite(path: str, new: str, fmt: StoreFormat, chain_key: bytes) -> tuple[int, int]:
    """Build the format-`FORMAT_VERSION` store at `new` from the store at `path`: (pages, namespace records)."""
    old_key = UNKEYED_CHAIN if fmt.version < KEYED_ROOTS_VERSION else None
    assert old_key is not None  # the one older format there is
    checksum = CHECKSUMS[fmt.checksum]
    env = raw_env(path)
    shared = acquire(new, True, DEFAULT_MAP_SIZE, "none", fmt.checksum)
    try:
        with env.begin(buffers=True) as txn:
            dbs = {name: open_db(env, txn, name) for name in ("pages", "meta", "namespaces", "layouts", "store")}
            metas = {bytes(k): decode_meta(v) for k, v in txn.cursor(db=dbs["meta"])}
            records = {NamespaceId(bytes(k)): decode_namespace(v) for k, v in txn.cursor(db=dbs["namespaces"])}
            store_records = {bytes(k): bytes(v) for k, v in txn.cursor(db=dbs["store"]) if bytes(k) != b"format"}
            layouts = {bytes(k): bytes(v) for k, v in txn.cursor(db=dbs["layouts"])}
        pairs = {(m.layout_id, m.ns_id) for m in metas.values()} | {(lay, ns) for lay in layouts for ns in records}
        roots: dict[bytes, PageHash] = {hash_root_of_id(lay, ns, old_key): hash_root_of_id(lay, ns, chain_key)
                                     for lay, ns in pairs}
        new_roots: dict[tuple[bytes, NamespaceId], PageHash] = {(lay, ns): hash_root_of_id(lay, ns, chain_key)
                                                       for lay, ns in pairs}
        renamed = _new_hashes(path, metas, roots, new_roots)
        # each namespace's roots: those its pages hang from now (a store written before records kept roots too),
        # and every engine page's wherever it hangs (its hash is its key's under that root)
        hung: dict[bytes, set[str]] = {}
        for meta in metas.values():
            if meta.parent in roots:
                hung.setdefault(meta.ns_id, set()).add(roots[meta.parent].hex())
            if meta.key:
                hung.setdefault(meta.ns_id, set()).add(new_roots[(meta.layout_id, meta.ns_id)].hex())
        new_fmt = StoreFormat(fmt.magic, FORMAT_VERSION, fmt.checksum, fmt.created)
        ndbs = shared.dbs

        def records_body(w: lmdb.Transaction) -> None:
            w.put(b"format", encoder.encode(new_fmt), db=ndbs.store)
            for k, v in store_records.items():
                w.put(k, v, db=ndbs.store)
            for k, v in layouts.items():
                w.put(k, v, db=ndbs.layouts)
            for ns_id, record in records.items():
                w.put(ns_id, encoder.encode(_new_roots(record, roots, hung.get(ns_id, set()))), db=ndbs.namespaces)

        shared.write(records_body)
        order = sorted(metas)
        for at in range(0, len(order), MIGRATE_BATCH_PAGES):
            batch = order[at:at + MIGRATE_BATCH_PAGES]
            with env.begin(buffers=True) as txn:
                pages_db = open_db(env, txn, "pages")  # a handle opened in a read transaction lives with it
                values = {h: _stored(path, txn.get(h, db=pages_db), h) for h in batch}

            def pages_body(w: lmdb.Transaction, batch: list[bytes] = batch,
                           values: dict[bytes, bytes] = values) -> None:
                for h in batch:
                    meta, value, nh = metas[h], values[h], renamed[h]
                    payload = memoryview(value)[HEADER:]
                    summed = checksum.of(payload, nh)
                    w.put(nh, CHECKSUM_FIELD.pack(summed) + bytes(payload), db=ndbs.pages)
                    parent = roots.get(meta.parent) or renamed[meta.parent]
                    moved = msgspec.structs.replace(meta, parent=parent, checksum=summed)
                    w.put(nh, encoder.encode(moved), db=ndbs.meta)
                    w.put(parent, nh, db=ndbs.children)

            shared.write(pages_body, grow_hint=len(batch) * (len(next(iter(values.values()), b"")) + 512))
            step("copied_pages", at + len(batch))
        with open(os.path.join(new, "data.mdb"), "rb") as f:
            os.fsync(f.fileno())
        fsync_dir(new)
    finally:
        env.close()
        release(shared)
    return len(metas), len(records)


def _stored(path: str, value: memoryview | None, h: bytes) -> bytes:
    """The page value under `h` (the audit found every page whole; one gone since is a writer's doing)."""
    if value is None:
        raise StoreError(path, f"cannot migrate: page {h.hex()} has metadata and no value (run `kvc audit "
                               f"--repair`); nothing was changed")
    return bytes(value)


def _new_hashes(path: str, metas: dict[bytes, PageMeta], roots: dict[bytes, PageHash],
                new_roots: dict[tuple[bytes, NamespaceId], PageHash]) -> dict[bytes, PageHash]:
    """Old page hash -> new, each chained from its parent's new hash or its namespace's new root (`roots`: old
    root -> new); an engine page's, its key's under its (layout, namespace)'s new root (`new_roots`)."""
    renamed: dict[bytes, PageHash] = {}
    for h in metas:
        for page in reversed(list(_up(path, h, metas, renamed, roots))):
            meta = metas[page]
            if meta.key:
                renamed[page] = engine_page_hash(new_roots[(meta.layout_id, meta.ns_id)], bytes(meta.key))
                continue
            parent = roots.get(meta.parent) or renamed[meta.parent]
            n = len(meta.tokens) // TOKEN_BYTES
            renamed[page] = extend_chain(parent, bytes(meta.tokens), n)[0]
    return renamed


def _up(path: str, h: bytes, metas: dict[bytes, PageMeta], renamed: dict[bytes, PageHash],
        roots: dict[bytes, PageHash]) -> Iterator[bytes]:
    """`h` and the pages above it that have no new hash yet, bottom up, to a renamed page or a root."""
    while h not in renamed:
        yield h
        parent = metas[h].parent
        if parent in roots:
            return
        if parent not in metas:
            raise StoreError(path, f"cannot migrate: page {h.hex()}: its parent is neither a stored page nor a "
                                   f"namespace root (run `kvc audit --repair`); nothing was changed")
        h = parent


def _new_roots(record: NamespaceRecord, roots: dict[bytes, PageHash], hung: set[str]) -> NamespaceRecord:
    """`record` with its roots renamed, and every root its pages hang from now recorded."""
    renamed = {roots[bytes.fromhex(r)].hex() for r in record.roots if bytes.fromhex(r) in roots}
    return msgspec.structs.replace(record, roots=sorted(renamed | hung))
