"""The audit of an LMDB store that may be damaged, and its repair (what `kvc audit [--repair]` runs on LMDB). A
repair never destroys: the original data file is kept, and what cannot be saved is counted, never hidden.

LMDB trusts its pages: a flipped byte in a branch or leaf page can make a walk of the B-tree end in LMDB's own
`abort()`, a SIGSEGV, or a `CorruptedError` / `PageNotFoundError`. So every pass over the store runs in a forked
child (`isolated.run_isolated`), and the audit survives whatever the store does to the child:

- **check**: first the data file's length (`pagemap.whole`): a file cut short (a live page past its end) or empty
  is a `structure_corrupt` finding at once, never mapped (a read past the end is a SIGBUS, and LMDB takes an
  empty file for a new environment and writes into it). Then `verify()` in a child (the page map of LMDB itself,
  `pagemap`, and a key file that is not the pages' key, `key_mismatch`, included). A child that dies (a signal)
  or fails inside LMDB yields one
  `structure_corrupt` finding naming the sub-database, how many records the walk reached and the last key, and
  what `--repair` would do (`_survey`, from the file's pages: rebuild from what, how many pages the store
  recorded; or that it would refuse, when nothing of a kvc store reads back). A child that could not open or read
  the store for a permission, its lock file or writers (`_NOT_DAMAGE`) raises that error instead: no finding. A
  lock-free check (`env`: a user who cannot write lock.mdb, `lock=False`) that writers overtook — a read that says
  so, or a death while more than one transaction committed — is run again.
- **repair**, structure sound: a consistent copy of the environment is kept as `data.mdb.orig-<UTC time>` (LMDB's
  own copy: others may be writing), then `verify(repair=True)` in a child, then a check. If that repair dies, or
  leaves findings it should have fixed, the store is rebuilt.
- **repair**, structure damaged: **rebuild**. With the store to itself (it takes LMDB's lock file exclusively:
  a store open in another process is refused, and openers wait), it reads the data file's pages (`pagefile.probe`)
  and copies into a fresh environment in the store directory what reads back sound, from one of three sources:
  `tree` -- LMDB opens the file: every record of each sub-database a cursor walk reaches, raw (forward; after a
  death, forward again one record a commit up to the damage, then backward from the end down to it); then, for a
  page reached in one of its two records only, the other is looked up by key (restarting past any key whose lookup
  kills a child) and, failing that, found in the data file's leaf pages directly (a damaged branch hides whole
  intact leaves; only keys the other record names are taken, and only records that prove themselves: a page's
  checksum seeded by its key, metadata that chains to its key). `catalogue` -- LMDB's meta pages are unreadable
  (or the sound one names a catalogue a later commit freed): the same, on a copy of the file whose meta pages
  name the newest intact catalogue of sub-databases found in it. `scan` -- no catalogue survives: every record
  of the file's leaf pages that proves itself (pages, metadata, layout and namespace records naming their own
  ids, the format record), skipping the pages the newest free list names.
  The catalogue a sound meta page names is taken even when a sub-database's root in it is damaged (an older one
  would lose every record written since); one found in the file is taken only when none is named, and then the
  report says which commit replaced it and counts the loss as "at least". What the trees did not reach, the
  file's leaf pages give (`recover`): pages whose two records prove themselves in live leaves, and the namespace,
  layout and store records the pages kept need, from a live leaf or else the newest copy a freed leaf holds.
  Before anything is judged, the key file is set against the records copied (`keyfile.KeyEvidence`): another
  valid key than the pages' is refused unless forced (under it every chain head and engine page would go).
  The fresh store is then checked the ordinary way: the children index is rebuilt from the metadata, counters
  are recounted, `verify(repair=True)` removes what fails its checks (and what hung below it), and it must
  verify clean but for pages whose namespace or layout record is lost everywhere: those are whole, so they are
  kept and reported (`unknown_namespace`, `unknown_layout`) until a write, or `kvc init` with the layout,
  registers the record again. A rebuild that keeps no page, or a file that is not LMDB at all (or empty), is
  refused (`RepairRefused`, nothing changed) unless forced. Then the original data file is
  copied to `data.mdb.orig-<UTC time>` (a hidden name until whole), the fresh data file replaces the store's with
  one rename, and the lock file is re-initialised from the new data by LMDB itself before anyone else can use it.
  Every page that did not make it is listed as a removal; `SalvageReport` counts pages kept and lost (of what the
  store recorded, or "at least" when that count is unreadable) and the unreadable bytes of the file.

The store's own data file is never left half-done: until the rename it is untouched, and the rename is atomic. A
repair killed part-way leaves a work directory or a partial copy (hidden names); the next repair that gets the
store to itself removes them. Crash tests stop the repair at its named steps (`_step`, env KVC_TEST_REPAIR_STOP)
and kill it there.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import shutil
import signal
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import lmdb
import msgspec

from ...errors import (
    InvalidInput,
    NotAStore,
    RepairRefused,
    StoreAccessDenied,
    StoreChanged,
    StoreError,
    StoreFull,
    StoreReadOnly,
    StoreUnsupported,
)
from ...types.keys import PAGE_HASH_BYTES, UNKEYED_CHAIN, derive_chain_key, hash_root_of_id
from ...types.shares import decode_shares_record
from ..api import SalvageReport, VerifyFinding, VerifyRemoval, VerifyReport
from ..codec import (
    CHECKSUMS,
    DEFAULT_CHECKSUM,
    Checksum,
    StoreFormat,
    chains_to,
    decode_format,
    decode_meta,
    decode_namespace,
    decode_or_none,
    engine_keyed,
)
from ..isolated import Died, run_isolated
from ..keyfile import (
    KEY_FILE,
    KEY_MISMATCH,
    KeyEvidence,
    KeyState,
    key_findings,
    key_if_any,
    key_status,
    mismatch_detail,
)
from ..verify import recorded_roots, verify
from ..verify_parts import AuditScope
from . import pagefile, pagemap, recover
from .bookkeeping import SHARES_PREFIX, recount
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
    translate,
)
from .integrity import LMDBIntegrity

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


def audit_location(path: str, repair: bool = False, force: bool = False, lock: bool = True,
                   scope: AuditScope | None = None, progress: Callable[[str, int], None] | None = None) -> VerifyReport:
    """The integrity audit of the LMDB store at `path`, run in child processes (see the module docstring).
    `force`: let a repair replace a data file that is not LMDB, or one from which it would keep nothing. `lock`
    False: read it lock-free, writing nothing to its directory (as a user who cannot write its lock file does
    anyway; `env`). `scope`: the workers and the incremental `since` of the check (`verify_parts`; a repair,
    and the checks after it, read the whole store). `progress(sub-database, records)` as the check walks it.
    Every audit of a store it may write is recorded in it (`AuditHistory`)."""
    scope = scope or AuditScope()
    if repair and (scope.since is not None or scope.since_last):
        raise InvalidInput("a repair needs a full audit: it cannot go with an incremental one (since)")
    if repair and not lock:
        raise InvalidInput("a repair writes the store: it cannot run lock-free (read-only)")
    path = _store_path(path)
    if repair and not os.access(path, os.W_OK):
        raise StoreReadOnly(path, "cannot repair: the store's directory is not writable")
    if repair:
        _clean_after_killed_repair(path)
    keys = key_findings(path, repair)  # the key file is part of the store (keyfile)
    check = _check(path, lock, scope, progress, record=True)
    foreign = next((f for f in check.findings if f.kind == KEY_MISMATCH), None)
    if repair and foreign is not None and not force:
        # under another key every chain head looks orphaned and every engine page misfiled: nothing is removed
        # for it (the right key restored, they are all there)
        raise RepairRefused(path, foreign.detail.split(": ", 1)[1] + "; nothing was changed")
    if repair and not check.ok:
        check = _repair_pages(path, check, force, scope.workers, trust_key=foreign is not None)
    return _with_key_findings(check, keys)


def _with_key_findings(report: VerifyReport, keys: list[VerifyFinding]) -> VerifyReport:
    """`report` with the key file's findings first."""
    if not keys:
        return report
    return msgspec.structs.replace(report, ok=False, findings=[*keys, *report.findings],
                                   repaired=report.repaired + sum(f.repaired for f in keys))


def _repair_pages(path: str, check: VerifyReport, force: bool, workers: int = 1,
                  trust_key: bool = False) -> VerifyReport:
    """The repair of what `check` found in the store's data (not its key file); the check after it with
    `workers`. `trust_key`: the key file is not the pages' key and the repair was forced: what it does not reach
    goes (`LMDBIntegrity.trust_key`)."""
    if not _structural(check):
        kept = _keep_consistent_copy(path)
        fixed, died = run_isolated(lambda report: _verify_in(path, report, repair=True, trust_key=trust_key),
                                   Reached, VerifyReport)
        if died is None:
            after = _check(path, scope=AuditScope(workers=workers), record=True)
            if after.ok or all(f.kind in _UNREPAIRED_KINDS for f in after.findings):
                return msgspec.structs.replace(fixed, original_kept=kept)
    return _rebuild(path, check, force)


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


def _verify_in(path: str, report: Callable[[Any], None], repair: bool, lock: bool = True,
               scope: AuditScope | None = None, record: bool = False, trust_key: bool = False) -> VerifyReport:
    """In a child: open the store and verify it, reporting the walk's progress; `record`: in the store's audit
    record too (`kvc audit`; never a migration's check, which leaves the old data file untouched). `trust_key`
    (a forced repair): check under the key file's key even where the registry says the pages were written under
    another, and drop that other key's roots from the registry after the repair."""
    with _env_of(path, durability=DEFAULT_DURABILITY, lock=lock) as shared:
        if repair and not shared.writable:
            raise StoreReadOnly(path, "cannot repair: the store is at a read-only location")
        progress = lambda db, n, key: report(Reached(db, n, key.hex() if key else ""))  # noqa: E731
        source = LMDBIntegrity(shared, progress=progress, record=record, trust_key=trust_key)
        result = verify(source, repair, scope)
        if repair:
            source.forget_foreign_roots()
        return result


@contextlib.contextmanager
def _env_of(path: str, create: bool = False, durability: str = "none", lock: bool = True) -> Iterator[SharedEnv]:
    """The store at `path` opened in this process (durability "none" for the fresh store: its data file is
    fsynced once, before the swap)."""
    shared = acquire(path, create, DEFAULT_MAP_SIZE, durability, lock=lock)
    try:
        yield shared
    finally:
        release(shared)


def _check(path: str, lock: bool = True, scope: AuditScope | None = None,
           progress: Callable[[str, int], None] | None = None, record: bool = False) -> VerifyReport:
    """verify() in a child; its death (or a fault inside LMDB) is a `structure_corrupt` finding whose detail says
    what `--repair` would do (`_survey`). A lock-free
    check (`env`) is run again when writers overtook it: a read that failed, or a child that died, while the
    store committed more than one transaction may have read pages a writer reused, which is no damage."""
    problem = pagemap.whole(path)
    if problem:  # never mapped: a read past a cut end is a SIGBUS, and LMDB takes an empty file for a new store
        return VerifyReport(False, 0, 0, [VerifyFinding("structure_corrupt", None, f"{problem}: {_survey(path)}")])
    lock_free = not lock or not lock_file_writable(path)
    for _ in range(LOCK_FREE_CHECKS if lock_free else 1):
        before = committed_txnid(path) if lock_free else 0
        report, died = run_isolated(lambda r: _verify_in(path, r, repair=False, lock=lock, scope=scope,
                                                         record=record), Reached,
                                    VerifyReport, on_progress=None if progress is None else
                                    lambda reached: progress(reached.db, reached.records))
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
    return VerifyReport(False, checked, 0, [VerifyFinding("structure_corrupt", None, _where(died, _survey(path)))])


def _message(died: Died, path: str) -> str:
    """The message of the error a child raised, without its type and path."""
    message = died.error.split(": ", 1)[1] if died.error else ""
    return message[len(path) + 2:] if message.startswith(path + ": ") else message


def _where(died: Died, plan: str) -> str:
    reached: Reached | None = died.progress
    if reached is None:
        at = "before the walk began (the catalogue of sub-databases, or the format record)"
    else:
        at = (f"in sub-database '{reached.db}' after {reached.records} records"
              + (f" (last key {reached.last_key[:32]})" if reached.last_key else ""))
    return f"the walk of the store {died.describe()} {at}: {plan}"


def _survey(path: str) -> str:
    """What `kvc audit --repair` would do to the store at `path`, whose walk failed: read from the data file's
    pages (`pagefile.probe`) and, when no catalogue survives, whether any page record in them proves itself."""
    data_file = os.path.join(path, "data.mdb")
    probe = pagefile.probe(data_file, DB_NAMES)
    keep = f"keeping the original file beside the store as {ORIGINAL_PREFIX}<UTC time>"
    if probe.catalogue is not None:
        recorded = probe.catalogue.entries("pages")
        where = ("LMDB's B-tree is damaged" if not probe.needs_view else
                 f"LMDB's meta pages are unreadable; the newest intact catalogue of sub-databases is at page "
                 f"{probe.catalogue.pgno}")
        # the catalogue's count promises pages only while their trees are there to read
        short = bool(pagemap.whole(path))
        sure = recorded > 0 and not short and not {"pages", "meta"} & set(probe.damaged_roots)
        if sure or _first_proving_pair(path, probe):
            return (f"{where} ({recorded} page(s) recorded, {probe.unreadable_bytes} bytes of the file "
                    f"unreadable); `kvc audit --repair` rebuilds the store from what still reads back sound, {keep}")
    elif probe.is_lmdb and _first_proving_pair(path, probe):
        return (f"no catalogue of sub-databases survives ({probe.unreadable_bytes} bytes of the file unreadable); "
                f"`kvc audit --repair` rebuilds the store from the page records found in the file's pages, {keep}")
    what = ("nothing of the store is left in it" if probe.size == 0 else
            "data.mdb is not an LMDB file" if not probe.is_lmdb else "no page of the store reads back sound")
    return (f"{what}: a repair would keep nothing, so `kvc audit --repair` refuses; restore the store from a "
            f"backup, or remove it; `kvc audit --repair --force` replaces the file with an empty store, {keep}")


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


def _rebuild(path: str, check: VerifyReport, force: bool) -> VerifyReport:
    with _exclusive(path) as lock_fd:
        _remove_leftovers(path)
        data_file = os.path.join(path, "data.mdb")
        probe = pagefile.probe(data_file, DB_NAMES)
        extent = pagefile.extent(data_file)
        _step("probed")
        if not probe.is_lmdb and not force:
            what = ("data.mdb is empty (0 bytes)" if probe.size == 0 else
                    "data.mdb is not an LMDB file (no page of it reads as one)")
            raise RepairRefused(path, f"{what}; nothing was changed. `kvc audit --repair --force` replaces it with "
                                      f"an empty store, keeping the file as {ORIGINAL_PREFIX}<UTC time>")
        key = key_status(path)
        if key.state is not KeyState.PRESENT and not force:
            # an engine page's metadata proves itself by the store's key only: a rebuild without it would drop
            # every engine page whose namespace record (the roots it keeps) is lost too
            what = f"not readable by this user ({key.why})" if key.state is KeyState.UNREADABLE else key.why
            raise RepairRefused(path, f"a rebuild proves each engine page by the store's key, and {key.path} is "
                                      f"{what}: restore it (or repair as a user who may read it); "
                                      f"`kvc audit --repair --force` rebuilds without it, dropping the engine pages "
                                      f"it cannot prove; nothing was changed")
        freed = _free_list(data_file, probe)
        work = tempfile.mkdtemp(prefix=REBUILD_PREFIX, dir=path)
        new = os.path.join(work, "store")
        try:
            with _env_of(new, create=True):
                pass
            _share_key(path, new)
            tree = probe.catalogue is not None
            if not tree:
                source_kind, source, copied = "scan", path, _copy_scanned(data_file, new, probe, freed)
            else:
                source_kind = "catalogue" if probe.needs_view else "tree"
                short = extent.needed > extent.size  # read from a copy padded to its length: zeros, not SIGBUS
                source = (_view(path, work, probe, extent.needed if short else 0) if probe.needs_view or short
                          else path)
                copied = _copy_readable(source, new)
            recovered = _recover_missing(data_file, new, probe, freed, copied, pages_too=tree)
            _refuse_foreign_key(path, new, copied.store_records, force)
            _settle_copies(source, new, copied, tree)
            known, recorded, store_records = copied.known, copied.recorded, copied.store_records
            unfiled, died = run_isolated(lambda _: _prepare(new, store_records), result_type=dict[str, int])
            if died is not None:
                raise StoreError(path, f"rebuilding: preparing the fresh store {died.describe()}")
            fixed, died = run_isolated(lambda r: _verify_in(new, r, repair=True, trust_key=force), Reached,
                                       VerifyReport)
            if died is None:
                after, died = run_isolated(lambda r: _verify_in(new, r, repair=False, trust_key=force), Reached,
                                           VerifyReport)
            left = [f for f in after.findings if f.kind not in _UNREPAIRED_KINDS] if died is None else []
            if died is not None or left:
                why = died.describe() if died is not None else f"{len(left)} findings left"
                raise StoreError(path, f"the rebuilt store does not verify ({why}); the store was left as it was")
            final, died = run_isolated(lambda _: _keys_of(new), result_type=dict[str, list[bytes]])
            if died is not None:
                raise StoreError(path, f"rebuilding: reading the fresh store {died.describe()}")
            # the store's own count of its pages: the catalogue's (an older catalogue's count is not the store's:
            # unknown then, and the loss is "at least" what was seen)
            before = -1 if probe.replaced_by else recorded.get("pages", -1)
            if before < 0 and probe.catalogue is not None and not probe.replaced_by:
                before = probe.catalogue.entries("pages")
            if not final["pages"] and not force:
                raise RepairRefused(path, f"a repair would keep nothing (0 of {_count(before)} page(s) read back "
                                          "sound); nothing was changed. Restore the store from a backup, or "
                                          "`kvc audit --repair --force` replaces it with an empty store, keeping "
                                          f"the file as {ORIGINAL_PREFIX}<UTC time>")
            _step("rebuilt")
            original = _keep_original(path)
            _step("original_kept")
            _swap(path, new, lock_fd)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    gone = {r.page_hash for r in fixed.removals}
    unread = sorted((known["pages"] | known["meta"]) - set(final["pages"]) - {bytes.fromhex(h) for h in gone})
    records = sorted((known["namespaces"] - set(final["namespaces"])) | (known["layouts"] - set(final["layouts"])))
    removals = ([VerifyRemoval("structure_corrupt", h.hex(), "page", 0) for h in unread]
                + [VerifyRemoval("structure_corrupt", k.hex(), "record", 0) for k in records
                   if k.hex() not in gone]
                + list(fixed.removals))
    unreached = [f"'{db}' {recorded[db] - len(known[db])} of {recorded[db]}" for db in recorded
                 if recorded[db] > len(known[db])]
    kept = len(final["pages"])
    seen_lost = len((known["pages"] | known["meta"]) - set(final["pages"]))
    # without the store's own count, the pages seen and not kept are a lower bound; none seen: unknown (-1), never 0
    lost = max(seen_lost, before - kept) if before >= 0 else seen_lost or -1
    salvage = SalvageReport(source_kind, before, kept, lost, before >= 0, probe.unreadable_bytes, probe.size)
    notes = _notes(probe, unfiled, recovered, unreached)
    summary = VerifyFinding("structure_corrupt", None, _summary(salvage, original, len(unread), notes), True)
    findings = [msgspec.structs.replace(f, repaired=True) for f in check.findings] + [summary]
    return VerifyReport(False, check.pages_checked, check.bytes_checked, findings, len(findings), removals,
                        original, salvage)


_SOURCES = {
    "tree": "the store's B-tree",
    "catalogue": "the newest intact catalogue found in the file (LMDB's meta pages were unreadable)",
    "scan": "page records found in the file's leaf pages (no catalogue of sub-databases could be read)",
}


def _count(n: int) -> str:
    return str(n) if n >= 0 else "an unknown number of"


def _notes(probe: pagefile.Probe, unfiled: dict[str, int], recovered: dict[str, int],
           unreached: list[str]) -> list[str]:
    """What else the report must say of a rebuild: an older catalogue taken, records found only in the file's
    pages, pages kept whose namespace or layout record is lost, records the walk could not reach."""
    notes = []
    if probe.replaced_by:
        which = (f"the one transaction {probe.replaced_by} replaced" if probe.replaced_by > 0 else
                 "an older one (the commit that replaced it is unknown)")
        notes.append(f"the store's newest catalogue of sub-databases was unreadable: {which} was taken (the newest "
                     f"commit the meta pages record: {probe.last_txnid or 'unknown'}), and what was written after it "
                     f"was looked for in the file's leaf pages; the store's own count of its pages is unknown, so "
                     f"the loss is a lower bound")
    elif probe.catalogue is None and probe.last_txnid:
        notes.append(f"the catalogue of sub-databases that the last commit (transaction {probe.last_txnid}) wrote "
                     f"was unreadable: the records were taken from the file's live leaf pages")
    elif probe.catalogue is None:
        notes.append("pages deleted shortly before the damage may be back")
    found = {k: v for k, v in recovered.items() if v and k != "older"}
    if found:
        notes.append("found in the file's leaf pages past the damaged tree: "
                     + ", ".join(f"{n} {what} record(s)" for what, n in found.items())
                     + (f" ({recovered['older']} registry or store record(s) from an older copy a later commit "
                        f"replaced)" if recovered.get("older") else ""))
    if unfiled.get("unknown_namespace"):
        notes.append(f"{unfiled['unknown_namespace']} page(s) kept whose namespace record is lost everywhere in the "
                     f"file: `kvc audit` lists them as unknown_namespace until a write under the namespace "
                     f"registers it again (or `kvc ns drop --id` removes them)")
    if unfiled.get("unknown_layout"):
        notes.append(f"{unfiled['unknown_layout']} page(s) kept whose layout record is lost everywhere in the "
                     f"file: `kvc audit` lists them as unknown_layout until `kvc init` with that layout registers "
                     f"it again")
    if unreached:
        notes.append(f"records that could not even be reached: {', '.join(unreached)}")
    return notes


def _summary(s: SalvageReport, original: str, unreadable_records: int, notes: list[str]) -> str:
    lost = (f"{s.lost} lost" if s.lost_exact else
            f"{f'at least {s.lost}' if s.lost > 0 else 'an unknown number of pages'} lost (the store's own count "
            f"was unreadable)")
    why = ""
    if s.lost > 0:
        why = (f" ({unreadable_records} of them unreadable, the others failed their checks, lost a record they "
               f"need or hung below a lost page; each one seen is listed as removed)")
    return (f"rebuilt into a fresh environment from {_SOURCES[s.source]}: {s.kept} page(s) kept of "
            f"{_count(s.pages_before)} recorded, {lost}{why}; "
            f"{s.unreadable_bytes} of {s.file_bytes} bytes of the file unreadable; the original data file is kept "
            f"as {original}" + "".join(f"; {note}" for note in notes))


class _Copied(msgspec.Struct):
    """What a rebuild's copy into the fresh store got: keys per sub-database, the entries each one's catalogue
    records (-1: unreadable), and the old store's own records (format, limits, shares)."""

    known: dict[str, set[bytes]]
    recorded: dict[str, int]
    store_records: dict[bytes, bytes]


def _copy_readable(source: str, new: str) -> _Copied:
    """Copy into the fresh store what LMDB reads of the environment at `source` (see the module docstring), raw:
    `_settle_copies` checks it."""
    store_records = _enumerate(source, "store")
    known: dict[str, set[bytes]] = {}
    recorded: dict[str, int] = {}
    for db in ("layouts", "namespaces", "meta", "pages"):
        known[db], recorded[db] = _copy_walking(source, new, db)
        _step("copied_" + db)
    # a page reached in one of its two records only: look the other one up by its key
    for db, other in (("pages", "meta"), ("meta", "pages")):
        known[db] |= _copy_by_key(source, new, db, sorted(known[other] - known[db]))
    return _Copied(known, recorded, store_records)


def _settle_copies(source: str, new: str, copied: _Copied, tree: bool) -> None:
    """Remove the copied records that do not prove themselves; then, after a copy from a tree, find the other half
    of each page reached in one of its records in the file's leaf pages themselves (what the tree cannot reach)."""
    sound, died = run_isolated(lambda _: _drop_unsound(new, copied.store_records), result_type=dict[str, list[bytes]])
    if died is not None:
        raise StoreError(source, f"rebuilding: checking the copied records {died.describe()}")
    if not tree:
        return
    named = copied.known["meta"] | copied.known["pages"]
    found, died = run_isolated(lambda _: _scan_file(source, new, named - set(sound["pages"]),
                                                    named - set(sound["meta"]), copied.store_records),
                               result_type=dict[str, list[bytes]])
    for db, keys in (found or {}).items():
        copied.known[db] |= set(keys)


def _free_list(data_file: str, probe: pagefile.Probe) -> dict[int, int]:
    """The file's free list (page -> the transaction that freed it): the whole free-list tree a sound meta page
    names (`pagemap`), else the newest free-list leaf found in the file (`probe`)."""
    if probe.sound_metas or probe.last_txnid:
        found = pagemap.read_map(data_file)
        if found is not None and found.freed:
            return found.freed
    return dict.fromkeys(probe.freed, 0)


def _recover_missing(data_file: str, new: str, probe: pagefile.Probe, freed: dict[int, int], copied: _Copied,
                     pages_too: bool) -> dict[str, int]:
    """Add to the fresh store what the copy lacks and the file's leaf pages still hold (`recover`); how many records
    of each kind were found ("older": of them, copies a later commit replaced)."""
    def body(_: Callable[[Any], None]) -> recover.Recovered:
        algos = _algorithms(copied.store_records)
        chain_keys = _chain_keys(new)
        with _env_of(new) as store, store.read() as txn:
            have = {db: {bytes(k) for k in txn.cursor(db=getattr(store.dbs, db)).iternext(values=False)}
                    for db in ("pages", "meta", "namespaces", "layouts")}
            metas = [decode_or_none(decode_meta, v) for _, v in txn.cursor(db=store.dbs.meta)]
            recorded = _recorded_roots(txn, store.dbs)
        have["store"] = set(copied.store_records)
        needs = ({m.ns_id for m in metas if m is not None}, {m.layout_id for m in metas if m is not None})
        with pagefile.mapped(data_file) as data:
            got = recover.recover(data, probe.page_size or pagefile.PAGE_SIZES[0], freed, have, needs,
                                  lambda k, v: _page_proves(k, v, algos),
                                  lambda k, v: _meta_proves(k, v, chain_keys, recorded), pages_too)
        with _env_of(new) as store:
            for db in ("pages", "meta", "namespaces", "layouts"):
                _put_raw(store, getattr(store.dbs, db), list(getattr(got, db).items()))
        return got

    got, died = run_isolated(body, result_type=recover.Recovered)
    if died is not None:
        raise StoreError(os.path.dirname(data_file), f"rebuilding: reading the file's leaf pages {died.describe()}")
    for db in ("pages", "meta", "namespaces", "layouts"):
        copied.known[db] |= set(getattr(got, db))
    for key, value in got.store.items():
        copied.store_records.setdefault(key, value)
    return {"page": len(got.pages), "metadata": len(got.meta), "namespace": len(got.namespaces),
            "layout": len(got.layouts), "store": len(got.store), "older": got.older}


def _refuse_foreign_key(path: str, new: str, store_records: dict[bytes, bytes], force: bool) -> None:
    """RepairRefused when the store's key file is not the key its pages were written under (`KeyEvidence` over the
    records copied: namespace roots, chain heads, engine pages): a rebuild under it would drop every engine page
    and every chain as unreachable. `force`: the key was replaced on purpose; go on under it."""
    if force:
        return

    def body(_: Callable[[Any], None]) -> list[int]:
        secret = key_if_any(new)
        fmt = decode_or_none(decode_format, store_records.get(b"format", b""))
        if secret is None or (isinstance(fmt, StoreFormat) and not fmt.keyed_roots):
            return [0, 0]
        evidence = KeyEvidence(derive_chain_key(secret))
        with _env_of(new) as store, store.read() as txn:
            dbs = store.dbs
            metas = {bytes(k): m for k, v in txn.cursor(db=dbs.meta)
                     if (m := decode_or_none(decode_meta, v)) is not None}
            layout_ids = {bytes(k) for k in txn.cursor(db=dbs.layouts).iternext(values=False)}
            layout_ids |= {m.layout_id for m in metas.values()}
            for key, raw in txn.cursor(db=dbs.namespaces):
                record = decode_or_none(decode_namespace, raw)
                if record is not None:
                    evidence.record(bytes(key), record, layout_ids)
        for h, meta in metas.items():
            if meta.key:
                evidence.engine_page(h, meta)
            elif meta.parent not in metas:
                evidence.head(meta)
        return [evidence.proves, evidence.contradicts]

    counts, died = run_isolated(body, result_type=list[int])
    if died is not None or counts is None:
        return  # the checks after the copy say what is wrong with it
    evidence = KeyEvidence(b"")
    evidence.proves, evidence.contradicts = counts
    if evidence.mismatch:
        raise RepairRefused(path, mismatch_detail(path, evidence).split(": ", 1)[1] + "; nothing was changed")


def _view(path: str, work: str, probe: pagefile.Probe, length: int = 0) -> str:
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


def _copy_scanned(data_file: str, new: str, probe: pagefile.Probe, freed: dict[int, int]) -> _Copied:
    """No catalogue could be read: every record of the file's leaf pages that is one of kvc's and proves itself
    (a page's checksum seeded by its key, metadata that chains to its key, a layout record whose id is its key, a
    namespace record naming its own id, the format record), skipping the pages the free list names."""
    found, died = run_isolated(lambda _: _scan_records(data_file, new, probe, set(freed)), result_type=_Copied)
    if died is not None:
        raise StoreError(os.path.dirname(data_file), f"rebuilding: scanning the file's pages {died.describe()}")
    return found


def _scan_records(data_file: str, new: str, probe: pagefile.Probe, freed: set[int]) -> _Copied:
    """In a child: `_copy_scanned`."""
    algos = list(CHECKSUMS.values())
    chain_keys = _chain_keys(new)
    got: dict[str, dict[bytes, bytes]] = {db: {} for db in ("pages", "meta", "namespaces", "layouts", "store")}
    engine_metas: dict[bytes, bytes] = {}  # proved once the namespace records (their recorded roots) are in
    with pagefile.mapped(data_file) as data:
        for key, value in _leaf_records(data, probe.page_size, freed):
            if len(key) == PAGE_HASH_BYTES:
                if key not in got["pages"] and _page_proves(key, value, algos):
                    got["pages"][key] = value
                elif key not in got["meta"] and _meta_proves(key, value, chain_keys):
                    got["meta"][key] = value
                elif key not in got["layouts"] and recover.layout_proves(key, value):
                    got["layouts"][key] = value
                elif key not in got["namespaces"] and recover.namespace_proves(key, value):
                    got["namespaces"][key] = value
                elif getattr(decode_or_none(decode_meta, value), "key", b""):
                    engine_metas.setdefault(key, value)
            elif key == b"format" and isinstance(decode_or_none(decode_format, value), StoreFormat):
                got["store"][key] = value
            elif key.startswith(SHARES_PREFIX) and decode_or_none(decode_shares_record, value) is not None:
                got["store"][key] = value
    recorded = {k: recorded_roots(decode_namespace(v)) for k, v in got["namespaces"].items()}
    for key, value in engine_metas.items():
        if key not in got["meta"] and _meta_proves(key, value, chain_keys, recorded):
            got["meta"][key] = value
    with _env_of(new) as store:
        for db in ("pages", "meta", "namespaces", "layouts"):
            _put_raw(store, getattr(store.dbs, db), list(got[db].items()))
    known = {db: set(got[db]) for db in ("pages", "meta", "namespaces", "layouts")}
    return _Copied(known, {}, got["store"])


def _leaf_records(data: bytes, psize: int, freed: set[int]) -> Iterator[tuple[bytes, bytes]]:
    """(key, value) of every node of every leaf page of the file not on the free list, bounds-checked (a value in
    overflow pages included); a node that does not fit is skipped."""
    for pgno in range(2, len(data) // psize):
        base = pgno * psize
        if pgno in freed or struct.unpack_from("<Q", data, base)[0] != pgno:
            continue
        flags = struct.unpack_from("<H", data, base + 10)[0]
        if not flags & pagefile.P_LEAF or flags & pagefile.P_LEAF2:
            continue
        for nflags, key, size, at in pagefile.nodes(data, pgno, psize):
            if nflags & pagefile.F_SUBDATA:
                continue
            if nflags & pagefile.F_BIGDATA:
                over = int.from_bytes(data[at:at + 8], "little")
                if over in freed or not 2 <= over < len(data) // psize:
                    continue
                at = over * psize + _HEADER_BYTES
            value = bytes(data[at:at + size])
            if len(value) == size:
                yield key, value


def _first_proving_pair(path: str, probe: pagefile.Probe) -> bool:
    """Whether the data file's leaf pages (freed ones too: a rebuild falls back on them) hold a page and its
    metadata that both prove themselves: what a rebuild needs to keep anything (read in a child: the scan is
    Python, but the survey must not depend on it surviving)."""
    def scan(_: Callable[[Any], None]) -> bool:
        algos = list(CHECKSUMS.values())
        chain_keys = _chain_keys(path)
        pages: set[bytes] = set()
        metas: set[bytes] = set()
        with pagefile.mapped(os.path.join(path, "data.mdb")) as data:
            for _rank, k, v in recover.leaf_nodes(data, probe.page_size or pagefile.PAGE_SIZES[0], {}):
                if len(k) != PAGE_HASH_BYTES:
                    continue
                if _page_proves(k, v, algos):
                    pages.add(k)
                elif _meta_proves(k, v, chain_keys):
                    metas.add(k)
                else:
                    continue
                if k in pages and k in metas:
                    return True
        return False

    found, died = run_isolated(scan, result_type=bool)
    return bool(found) and died is None


# --- keeping the original, crash points ----------------------------------------------------------------------

ORIGINAL_PREFIX = "data.mdb.orig-"  # + UTC time: the data file as it was before a repair rewrote anything
REBUILD_PREFIX = ".kvc-rebuild-"
_PARTIAL = ".partial"
STOP_ENV = "KVC_TEST_REPAIR_STOP"  # tests only: "STEP" or "STEP@N" -- the repair stops itself (SIGSTOP) there
_COPY_CHUNK = 256 << 10


def _step(name: str, done: int = 0) -> None:
    """A named point of the repair: a crash test stops the process here (STOP_ENV) and kills it, deterministically
    (stopped at an event, never after a sleep). `done`: progress within the step (bytes, say)."""
    want = os.environ.get(STOP_ENV)
    if not want:
        return
    step, _, at = want.partition("@")
    if step == name and done >= int(at or 0):
        del os.environ[STOP_ENV]  # once
        os.kill(os.getpid(), signal.SIGSTOP)


def _original_name(path: str) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    name, n = ORIGINAL_PREFIX + stamp, 1
    while os.path.exists(os.path.join(path, name)):
        name, n = f"{ORIGINAL_PREFIX}{stamp}.{n}", n + 1
    return name


def _keep_original(path: str) -> str:
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
                _step("keeping_original", copied)
            dst.flush()
            os.fsync(dst.fileno())
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise translate(exc, path, "keeping the original data file beside the store (nothing was changed)",
                        size) from None
    os.replace(partial, final)
    _fsync_dir(path)
    return final


def _keep_consistent_copy(path: str) -> str:
    """Before a repair in place (the structure sound, other processes may be writing): a consistent copy of the
    environment by LMDB's own copy (one read transaction), kept as `data.mdb.orig-<UTC time>`."""
    work = tempfile.mkdtemp(prefix=REBUILD_PREFIX, dir=path)
    try:
        def copy(_: Callable[[Any], None]) -> None:
            with _env_of(path, durability=DEFAULT_DURABILITY) as shared:
                shared.env.copy(work)

        _, died = run_isolated(copy)
        if died is not None:
            raise StoreError(path, f"cannot keep the original data file before repairing: the copy {died.describe()}; "
                                   "nothing was changed")
        with open(os.path.join(work, "data.mdb"), "rb") as f:
            os.fsync(f.fileno())
        final = os.path.join(path, _original_name(path))
        os.replace(os.path.join(work, "data.mdb"), final)
        _fsync_dir(path)
        return final
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _clean_after_killed_repair(path: str) -> None:
    """Remove what a killed repair left, when the store is free to take exclusively (else leave it: a store in
    use is not being repaired by anyone, and the next repair that gets it cleans up)."""
    with contextlib.suppress(StoreError):
        with _exclusive(path):
            _remove_leftovers(path)


def _remove_leftovers(path: str) -> None:
    """What a repair killed half-way left in the store directory: its work directory and a partial copy of the
    original (never a whole copy). The caller holds the store exclusively, so no repair is running."""
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if name.startswith(REBUILD_PREFIX) and os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)
        elif name.startswith("." + ORIGINAL_PREFIX) and name.endswith(_PARTIAL):
            os.unlink(full)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _exclusive(path: str, doing: str = "rebuild", again: str = "kvc audit --repair") -> Iterator[int]:
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
        os.close(fd)  # releases the lock (if _swap's LMDB open has not already)


def _share_key(path: str, new: str) -> None:
    """The store's key file beside the fresh store too, so its checks key the chain roots as the store does
    (kvcache.storage.chain); it is not swapped in (the store keeps its own). A store without one: nothing."""
    key = os.path.join(path, KEY_FILE)
    if key_status(path).state is KeyState.PRESENT:  # one this user cannot read: the checks go by recorded roots
        shutil.copyfile(key, os.path.join(new, KEY_FILE))


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
    chain_keys = _chain_keys(new)
    kept: dict[str, list[bytes]] = {"pages": [], "meta": []}

    def body(txn: lmdb.Transaction) -> None:
        recorded = _recorded_roots(txn, dbs)
        for db, proves in (("pages", lambda k, v: _page_proves(k, v, algos)),
                           ("meta", lambda k, v: _meta_proves(k, v, chain_keys, recorded)),
                           ("namespaces", recover.namespace_proves), ("layouts", recover.layout_proves)):
            target = getattr(dbs, db)
            for key, value in list(txn.cursor(db=target)):
                if proves(bytes(key), value):
                    kept.setdefault(db, []).append(bytes(key))
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


def _meta_proves(key: bytes, value: Any, chain_keys: list[bytes],
                 recorded: dict[bytes, list[bytes]] | None = None) -> bool:
    """A metadata record that decodes and chains to its key: a token page's H(parent || tokens), an engine page's
    key under its namespace/layout root keyed by one of `chain_keys` (`_chain_keys`), or under a root its
    namespace's record keeps (`recorded`: what proves it when this user may not read the key, or it is lost)."""
    meta = decode_or_none(decode_meta, value)
    if meta is None:
        return False
    if not meta.key:
        return chains_to(key, meta)
    roots = [hash_root_of_id(meta.layout_id, meta.ns_id, k) for k in chain_keys]
    return engine_keyed(key, meta, roots + (recorded or {}).get(meta.ns_id, []))


def _recorded_roots(txn: lmdb.Transaction, dbs: Any) -> dict[bytes, list[bytes]]:
    """Namespace id -> the roots its record keeps, for the namespace records in `txn` that prove themselves."""
    out = {}
    for key, raw in txn.cursor(db=dbs.namespaces):
        record = decode_or_none(decode_namespace, raw)
        if record is not None and record.ns_id_hex == bytes(key).hex():
            out[bytes(key)] = recorded_roots(record)
    return out


def _chain_keys(directory: str) -> list[bytes]:
    """The chain keys a store's roots may be keyed by, for the engine pages' proof: the one derived from the key
    file in `directory` (the fresh store holds a copy) and a format-1 store's (none), since the format record
    that says which may be lost."""
    secret = key_if_any(directory)
    return ([derive_chain_key(secret)] if secret is not None else []) + [UNKEYED_CHAIN]


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
    chain_keys = _chain_keys(new)
    with _env_of(new) as store, store.read() as txn:
        recorded = _recorded_roots(txn, store.dbs)
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
            if key in want_meta and key not in metas and _meta_proves(key, value, chain_keys, recorded):
                metas[key] = value
    with _env_of(new) as store:
        _put_raw(store, store.dbs.pages, list(pages.items()))
        _put_raw(store, store.dbs.meta, list(metas.items()))
    return {"pages": list(pages), "meta": list(metas)}


# LMDB's page layout (mdb.c, 64-bit): a 16-byte header (pgno, pad, flags, lower, upper), node offsets from there
# to `lower`; a node is lo, hi, flags, key size (u16 each), the key, then the value (or an overflow page number).
_HEADER_BYTES, _NODE = 16, 8
_F_BIGDATA = 0x01


def _prepare(new: str, store_records: dict[bytes, bytes]) -> dict[str, int]:
    """In a child, on the fresh store: its store records (the old format record when it survived, else one for
    the checksum the pages agree with, dated no later than its oldest page; the limits), the children index built
    from the metadata, the counters recounted. Pages of a namespace or layout whose record is lost everywhere are
    kept (they are whole: a write under the namespace, or `kvc init` with the layout, registers the record
    again); returns how many, per finding kind they show under (unknown_namespace, unknown_layout)."""
    unfiled = {"unknown_layout": 0, "unknown_namespace": 0}
    with _env_of(new) as store:
        dbs = store.dbs

        def body(txn: lmdb.Transaction) -> None:
            layouts = {bytes(k) for k, v in txn.cursor(db=dbs.layouts)}
            namespaces = {bytes(k) for k, v in txn.cursor(db=dbs.namespaces)}
            txn.drop(dbs.children, delete=False)
            oldest = time.time()
            for page_key, raw_meta in list(txn.cursor(db=dbs.meta)):
                h = bytes(page_key)
                meta = decode_or_none(decode_meta, raw_meta)
                if meta is None:
                    continue  # verify(repair=True) removes it next
                if meta.layout_id not in layouts:
                    unfiled["unknown_layout"] += 1
                elif meta.ns_id not in namespaces:
                    unfiled["unknown_namespace"] += 1
                if math.isfinite(meta.created):
                    oldest = min(oldest, meta.created)
                txn.put(meta.parent, h, db=dbs.children, dupdata=True)
            fmt = decode_or_none(decode_format, store_records.get(b"format", b""))
            if not (isinstance(fmt, StoreFormat) and fmt.checksum in CHECKSUMS):
                fresh = txn.get(b"format", db=dbs.store)
                assert fresh is not None, "the fresh store has the format record its creation wrote"
                fmt = msgspec.structs.replace(decode_format(fresh), checksum=_agreed_checksum(txn, dbs),
                                              created=oldest)
            txn.put(b"format", msgspec.msgpack.encode(fmt), db=dbs.store)
            for key in (b"capacity", b"ns_quota"):
                if len(store_records.get(key, b"")) == 8:  # a u64 limit
                    txn.put(key, store_records[key], db=dbs.store)
            for key, raw in store_records.items():  # namespace shares (policy: they outlive the pages)
                if key.startswith(SHARES_PREFIX) and decode_or_none(decode_shares_record, raw) is not None:
                    txn.put(key, raw, db=dbs.store)
            recount(txn, dbs)

        store.write(body)
    return unfiled


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
    _fsync_dir(path)
    _step("swapped")
    env = lmdb.open(path, subdir=True, max_dbs=MAX_DBS, lock=True)
    env.close()
    del lock_fd  # released with LMDB's own descriptor (POSIX locks belong to the process); closed by _exclusive
