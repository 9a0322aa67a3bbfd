"""What the salvage's forked children do with a store directory (`isolated.run_isolated`): open it in the child
(`env_of`), verify it there (`verify_in`), and say how far the walk got before a death (`Reached`).

LMDB trusts its pages, so a walk of a damaged store can end in LMDB's own `abort()` or a SIGSEGV: every read of a
store that may be damaged runs in a child, and the parent learns what it reached from its progress messages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from ...errors import StoreReadOnly
from ..api import VerifyReport
from ..verify import verify
from ..verify_parts import AuditScope
from .env import DEFAULT_DURABILITY, DEFAULT_MAP_SIZE, acquire, release
from .integrity import LMDBIntegrity
from .shared_env import SharedEnv


class Reached(msgspec.Struct, frozen=True, array_like=True):
    """How far a walk got: the sub-database, records walked, the last key (hex, "" before the first)."""

    db: str
    records: int
    last_key: str


@contextlib.contextmanager
def env_of(path: str, create: bool = False, durability: str = "none", lock: bool = True) -> Iterator[SharedEnv]:
    """The store at `path` opened in this process (durability "none" for the fresh store: its data file is
    fsynced once, before the swap)."""
    shared = acquire(path, create, DEFAULT_MAP_SIZE, durability, lock=lock)
    try:
        yield shared
    finally:
        release(shared)


def verify_in(path: str, report: Callable[[Any], None], repair: bool, lock: bool = True,
              scope: AuditScope | None = None, record: bool = False, trust_key: bool = False) -> VerifyReport:
    """In a child: open the store and verify it, reporting the walk's progress; `record`: in the store's audit
    record too (`kvc audit`; never a migration's check, which leaves the old data file untouched). `trust_key`
    (a forced repair): check under the key file's key even where the registry says the pages were written under
    another, and drop that other key's roots from the registry after the repair."""
    with env_of(path, durability=DEFAULT_DURABILITY, lock=lock) as shared:
        if repair and not shared.writable:
            raise StoreReadOnly(path, "cannot repair: the store is at a read-only location")
        progress = lambda db, n, key: report(Reached(db, n, key.hex() if key else ""))  # noqa: E731
        source = LMDBIntegrity(shared, progress=progress, record=record, trust_key=trust_key)
        result = verify(source, repair, scope)
        if repair:
            source.forget_foreign_roots()
        return result
