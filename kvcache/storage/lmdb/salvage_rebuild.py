"""The rebuild of a damaged LMDB store (`kvc audit --repair` when its structure is damaged, `salvage`): what reads
back sound copied into a fresh environment that replaces the data file, the original kept, what is lost counted.

With the store to itself (it takes LMDB's lock file exclusively, `rewrite.exclusive`: a store open in another
process is refused, and openers wait), it reads the data file's pages (`pagefile.probe`) and copies into a fresh
environment in the store directory what reads back sound, from one of three sources:
`tree` -- LMDB opens the file: every record of each sub-database a cursor walk reaches, raw (`salvage_copy`); a
page reached in one of its two records only has the other looked up by key and, failing that, found in the data
file's leaf pages directly (`salvage_scan`: a damaged branch hides whole intact leaves; only keys the other record
names are taken, and only records that prove themselves, `salvage_proofs`). `catalogue` -- LMDB's meta pages are
unreadable (or the sound one names a catalogue a later commit freed): the same, on a copy of the file whose meta
pages name the newest intact catalogue of sub-databases found in it. `scan` -- no catalogue survives: every record
of the file's leaf pages that proves itself (pages, metadata, layout and namespace records naming their own ids,
the format record), skipping the pages the newest free list names.

The catalogue a sound meta page names is taken even when a sub-database's root in it is damaged (an older one
would lose every record written since); one found in the file is taken only when none is named, and then the
report says which commit replaced it and counts the loss as "at least". What the trees did not reach, the file's
leaf pages give (`recover`): pages whose two records prove themselves in live leaves, and the namespace, layout and
store records the pages kept need, from a live leaf or else the newest copy a freed leaf holds. Before anything is
judged, the key file is set against the records copied (`keyfile.KeyEvidence`): another valid key than the pages'
is refused unless forced (under it every chain head and engine page would go).

The fresh store is then checked the ordinary way: the children index is rebuilt from the metadata, counters are
recounted (`prepare`), `verify(repair=True)` removes what fails its checks (and what hung below it), and it must
verify clean but for pages whose namespace or layout record is lost everywhere: those are whole, so they are kept
and reported (`unknown_namespace`, `unknown_layout`) until a write, or `kvc init` with the layout, registers the
record again. A rebuild that keeps no page, or a file that is not LMDB at all (or empty), is refused
(`RepairRefused`, nothing changed) unless forced. Then the original data file is copied to
`data.mdb.orig-<UTC time>` (a hidden name until whole), the fresh data file replaces the store's with one rename,
and the lock file is re-initialised from the new data by LMDB itself before anyone else can use it (`rewrite`).
Every page that did not make it is listed as a removal; `SalvageReport` counts pages kept and lost (of what the
store recorded, or "at least" when that count is unreadable) and the unreadable bytes of the file.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import lmdb
import msgspec

from ...errors import RepairRefused, StoreError
from ...types.ids import NamespaceId
from ...types.keys import derive_chain_key
from ...types.shares import decode_shares_record
from ..api import SalvageReport, VerifyFinding, VerifyRemoval, VerifyReport
from ..codec import (
    CHECKSUMS,
    DEFAULT_CHECKSUM,
    StoreFormat,
    decode_format,
    decode_meta,
    decode_namespace,
    decode_or_none,
)
from ..isolated import run_isolated
from ..keyfile import KEY_FILE, KeyEvidence, KeyState, key_if_any, key_status, mismatch_detail
from . import pagefile
from .bookkeeping import SHARES_PREFIX, recount
from .env import DB_NAMES
from .rewrite import ORIGINAL_PREFIX, REBUILD_PREFIX, exclusive, keep_original, remove_leftovers, step, swap
from .salvage_child import Reached, env_of, verify_in
from .salvage_copy import Copied, copy_readable, openable_copy
from .salvage_proofs import drop_unsound
from .salvage_scan import copy_scanned, free_list, recover_missing, scan_file

UNREPAIRED_KINDS = {"unknown_layout", "unknown_namespace"}  # reported, never repaired (api.REPAIRS)


def rebuild(path: str, check: VerifyReport, force: bool) -> VerifyReport:
    """Rebuild the store at `path`, whose `check` found its structure damaged (see the module docstring); its
    report, `check`'s findings marked repaired. `force`: go on where a rebuild would refuse."""
    with exclusive(path) as lock_fd:
        remove_leftovers(path)
        data_file = os.path.join(path, "data.mdb")
        probe = pagefile.probe(data_file, DB_NAMES)
        extent = pagefile.extent(data_file)
        step("probed")
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
        freed = free_list(data_file, probe)
        work = tempfile.mkdtemp(prefix=REBUILD_PREFIX, dir=path)
        new = os.path.join(work, "store")
        try:
            with env_of(new, create=True):
                pass
            _share_key(path, new)
            tree = probe.catalogue is not None
            if not tree:
                source_kind, source, copied = "scan", path, copy_scanned(data_file, new, probe, freed)
            else:
                source_kind = "catalogue" if probe.needs_view else "tree"
                short = extent.needed > extent.size  # read from a copy padded to its length: zeros, not SIGBUS
                source = (openable_copy(path, work, probe, extent.needed if short else 0) if probe.needs_view or short
                          else path)
                copied = copy_readable(source, new)
            recovered = recover_missing(data_file, new, probe, freed, copied, pages_too=tree)
            _refuse_foreign_key(path, new, copied.store_records, force)
            _settle_copies(source, new, copied, tree)
            known, recorded, store_records = copied.known, copied.recorded, copied.store_records
            unfiled, died = run_isolated(lambda _: prepare(new, store_records), result_type=dict[str, int])
            if died is not None:
                raise StoreError(path, f"rebuilding: preparing the fresh store {died.describe()}")
            fixed, died = run_isolated(lambda r: verify_in(new, r, repair=True, trust_key=force), Reached,
                                       VerifyReport)
            if died is None:
                after, died = run_isolated(lambda r: verify_in(new, r, repair=False, trust_key=force), Reached,
                                           VerifyReport)
            left = [f for f in after.findings if f.kind not in UNREPAIRED_KINDS] if died is None else []
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
            step("rebuilt")
            original = keep_original(path)
            step("original_kept")
            swap(path, new, lock_fd)
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


def _settle_copies(source: str, new: str, copied: Copied, tree: bool) -> None:
    """Remove the copied records that do not prove themselves; then, after a copy from a tree, find the other half
    of each page reached in one of its records in the file's leaf pages themselves (what the tree cannot reach)."""
    sound, died = run_isolated(lambda _: drop_unsound(new, copied.store_records), result_type=dict[str, list[bytes]])
    if died is not None:
        raise StoreError(source, f"rebuilding: checking the copied records {died.describe()}")
    if not tree:
        return
    named = copied.known["meta"] | copied.known["pages"]
    found, died = run_isolated(lambda _: scan_file(source, new, named - set(sound["pages"]),
                                                   named - set(sound["meta"]), copied.store_records),
                               result_type=dict[str, list[bytes]])
    for db, keys in (found or {}).items():
        copied.known[db] |= set(keys)


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
        with env_of(new) as store, store.read() as txn:
            dbs = store.dbs
            metas = {bytes(k): m for k, v in txn.cursor(db=dbs.meta)
                     if (m := decode_or_none(decode_meta, v)) is not None}
            layout_ids = {bytes(k) for k in txn.cursor(db=dbs.layouts).iternext(values=False)}
            layout_ids |= {m.layout_id for m in metas.values()}
            for key, raw in txn.cursor(db=dbs.namespaces):
                record = decode_or_none(decode_namespace, raw)
                if record is not None:
                    evidence.record(NamespaceId(bytes(key)), record, layout_ids)
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


def _share_key(path: str, new: str) -> None:
    """The store's key file beside the fresh store too, so its checks key the chain roots as the store does
    (kvcache.storage.chain); it is not swapped in (the store keeps its own). A store without one: nothing."""
    key = os.path.join(path, KEY_FILE)
    if key_status(path).state is KeyState.PRESENT:  # one this user cannot read: the checks go by recorded roots
        shutil.copyfile(key, os.path.join(new, KEY_FILE))


def prepare(new: str, store_records: dict[bytes, bytes]) -> dict[str, int]:
    """In a child, on the fresh store: its store records (the old format record when it survived, else one for
    the checksum the pages agree with, dated no later than its oldest page; the limits), the children index built
    from the metadata, the counters recounted. Pages of a namespace or layout whose record is lost everywhere are
    kept (they are whole: a write under the namespace, or `kvc init` with the layout, registers the record
    again); returns how many, per finding kind they show under (unknown_namespace, unknown_layout)."""
    unfiled = {"unknown_layout": 0, "unknown_namespace": 0}
    with env_of(new) as store:
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
    with env_of(new) as store, store.read() as txn:
        return {db: [bytes(k) for k, _ in txn.cursor(db=getattr(store.dbs, db))]
                for db in ("pages", "namespaces", "layouts")}
