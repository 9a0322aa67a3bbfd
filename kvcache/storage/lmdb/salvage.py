"""The audit of an LMDB store that may be damaged, and its repair (what `kvc audit [--repair]` runs on LMDB). A
repair never destroys: the original data file is kept, and what cannot be saved is counted, never hidden.

LMDB trusts its pages: a flipped byte in a branch or leaf page can make a walk of the B-tree end in LMDB's own
`abort()`, a SIGSEGV, or a `CorruptedError` / `PageNotFoundError`. So every pass over the store runs in a forked
child (`isolated.run_isolated`, `salvage_child`), and the audit survives whatever the store does to the child:

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
- **repair**, structure damaged: **rebuild** (`salvage_rebuild`): what reads back sound is copied into a fresh
  environment (`salvage_copy` what LMDB still reads, `salvage_scan` what only the file's leaf pages hold, each
  record kept only when it proves itself, `salvage_proofs`), which replaces the data file with one rename, the
  original kept beside it (`rewrite`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import lmdb
import msgspec

from ...errors import (
    InvalidInput,
    NotAStore,
    RepairRefused,
    StoreAccessDenied,
    StoreChanged,
    StoreReadOnly,
    StoreUnsupported,
)
from ..api import VerifyFinding, VerifyReport
from ..isolated import Died, run_isolated
from ..keyfile import KEY_MISMATCH, key_findings
from ..verify_parts import AuditScope
from . import pagefile, pagemap
from .env import DB_NAMES, MAX_DBS, committed_txnid, lock_file_writable
from .rewrite import ORIGINAL_PREFIX, clean_after_killed_repair, keep_consistent_copy
from .salvage_child import Reached, verify_in
from .salvage_rebuild import UNREPAIRED_KINDS, rebuild
from .salvage_scan import first_proving_pair

_ERRORS = {"NotAStore": NotAStore, "StoreUnsupported": StoreUnsupported, "StoreReadOnly": StoreReadOnly,
           "StoreAccessDenied": StoreAccessDenied, "StoreChanged": StoreChanged}
# An open or a read that failed for one of these met a permission, the lock file or writers, never damage: the
# error is the audit's answer (exit 2), never a `structure_corrupt` finding.
_NOT_DAMAGE = {"StoreReadOnly", "StoreAccessDenied", "StoreChanged"}
LOCK_FREE_CHECKS = 3  # runs of a lock-free check that writers keep overtaking before StoreChanged


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
        clean_after_killed_repair(path)
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
        kept = keep_consistent_copy(path)
        fixed, died = run_isolated(lambda report: verify_in(path, report, repair=True, trust_key=trust_key),
                                   Reached, VerifyReport)
        if died is None:
            after = _check(path, scope=AuditScope(workers=workers), record=True)
            if after.ok or all(f.kind in UNREPAIRED_KINDS for f in after.findings):
                return msgspec.structs.replace(fixed, original_kept=kept)
    return rebuild(path, check, force)


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
        report, died = run_isolated(lambda r: verify_in(path, r, repair=False, lock=lock, scope=scope,
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
        if sure or first_proving_pair(path, probe):
            return (f"{where} ({recorded} page(s) recorded, {probe.unreadable_bytes} bytes of the file "
                    f"unreadable); `kvc audit --repair` rebuilds the store from what still reads back sound, {keep}")
    elif probe.is_lmdb and first_proving_pair(path, probe):
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
