"""`kvc init --rekey`: give an LMDB store a new fingerprint key, knowingly.

The key file is part of the store (`kvcache.storage.keyfile`): a store whose key file is lost, damaged or was
never written (a store made before kvc kept one) opens nowhere until it is restored or replaced here. What a new
key changes: every display id (a digest of the namespace id under the key: recomputed from the registry, which
keeps the ids) and every salt fingerprint. The registry's recorded fingerprints were made under the old key and,
the salt never being stored, cannot be made again without it: each salted record's is set to UNKNOWN_FINGERPRINT,
and the namespace's next write records it under the new key (`bookkeeping.apply_deltas`). Nothing mixes two keys.

A store whose chain roots are keyed by its key (format 2) and that holds pages loses them all under a new key
(their hashes cannot be found again): that is refused unless asked for (`--yes`), and said.

Crash-safe in this order: the new key is written to a 0600 temp file, the registry is changed in one write
transaction, then the temp file is renamed over the key file. Killed between the two, the store holds the old key
(or none) and records no fingerprint it could not show: running the rekey again finishes it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import lmdb
import msgspec

from ...errors import StoreError, StoreReadOnly
from ...types.namespace import UNKNOWN_FINGERPRINT
from ..api import ServeRecord
from ..codec import DEFAULT_CHECKSUM, decode_namespace, decode_or_none, encoder
from ..keyfile import install_key, key_status, prepare_new_key
from ..maintenance import RekeyResult
from .env import DEFAULT_DURABILITY, DEFAULT_MAP_SIZE, acquire, release, resolve_location
from .pagemap import refuse_damaged
from .serve_records import read_serves


def rekey(location: str, live: Callable[[list[ServeRecord]], list[str]] | None = None,
          unreachable_ok: bool = False) -> RekeyResult:
    """Give the LMDB store at `location` a new fingerprint key (see the module docstring). `live(records)`: the
    live caches among the store's serving records (they hold the old key in memory and would go on recording
    under it): the rekey is refused while there are any. A store whose page-hash chain roots are keyed by its key
    (format 2, `kvcache.storage.chain`) and that holds pages is refused unless `unreachable_ok`: under a new key
    none of its pages would be found again (an audit then reports them as orphans, and `--repair` removes them).
    StoreReadOnly when this user cannot write the store."""
    path, existed, _ = resolve_location(location, False, DEFAULT_DURABILITY, DEFAULT_CHECKSUM)
    if not existed:
        raise StoreError(path, "no kvc store here to rekey (create one with `kvc init`)")
    previous = key_status(path)
    refuse_damaged(path, writer=True)  # a file cut short would be a SIGBUS in LMDB's walk, not an error
    shared = acquire(path, False, DEFAULT_MAP_SIZE, DEFAULT_DURABILITY)
    temp = None
    try:
        if not shared.writable:
            raise StoreReadOnly(path, "cannot rekey: this user cannot write the store")
        serving = live(shared.reading(lambda txn: read_serves(txn, shared.dbs))) if live is not None else []
        if serving:
            raise StoreError(path, f"cannot rekey while live caches serve the store ({', '.join(serving)}): they "
                                   f"hold its key; stop them first")
        pages = shared.reading(lambda txn: txn.stat(shared.dbs.meta)["entries"])
        if shared.format.keyed_roots and pages and not unreachable_ok:
            raise StoreError(path, f"the page hashes of this store are keyed by its key: under a new key none of its "
                                   f"{pages} pages would be found again. Restore the key file from a backup; or "
                                   f"rekey anyway with --yes (then `kvc audit --repair` removes the pages); nothing "
                                   f"was changed")
        _, temp = prepare_new_key(path)
        namespaces, unknown = shared.write(lambda txn: _forget_fingerprints(txn, shared.dbs))
        install_key(path, temp)
        temp = None
    finally:
        if temp is not None:
            try:
                os.unlink(temp)
            except OSError:
                pass  # already gone
        release(shared)
    return RekeyResult(previous.path, previous.state, namespaces, unknown, pages if shared.format.keyed_roots else 0)


def _forget_fingerprints(txn: lmdb.Transaction, dbs: Any) -> tuple[int, int]:
    """Set every salted registry record's fingerprint to UNKNOWN_FINGERPRINT; (records, records changed)."""
    records = changed = 0
    for key, raw in list(txn.cursor(db=dbs.namespaces)):
        records += 1
        record = decode_or_none(decode_namespace, raw)
        if record is None:
            continue  # a damaged record: the audit reports it (damaged_record); it shows no fingerprint
        if record.salt_fingerprint is not None and record.salt_fingerprint != UNKNOWN_FINGERPRINT:
            txn.put(bytes(key), encoder.encode(msgspec.structs.replace(record,
                                                                        salt_fingerprint=UNKNOWN_FINGERPRINT)),
                    db=dbs.namespaces)
            changed += 1
        elif record.salt_fingerprint == UNKNOWN_FINGERPRINT:
            changed += 1  # already unknown (a rekey run again): still unknown
    return records, changed
