"""The one line on stderr that says a store is of an older format, and that `kvc migrate` upgrades it.

A format-1 store is read and written as before (its page-hash chain roots are not keyed by the store's secret, so
its page hashes let a short salt be brute-forced); kvc says so whenever it opens one for writing or audits one,
and goes on.
"""

from __future__ import annotations

import sys

from kvcache.storage.codec import KEYED_ROOTS_VERSION
from kvcache.storage.location import StoreLocation


def note_old_format(location: StoreLocation | str, version: int) -> None:
    """Say on stderr, in one line, that the store at `location` is of format `version` and `kvc migrate`
    upgrades it (nothing when it is current)."""
    if version >= KEYED_ROOTS_VERSION:
        return
    sys.stderr.write(f"kvc: note: {location}: store format {version}, whose page hashes are not keyed by the "
                     f"store's secret (a short salt can be guessed from them); `kvc migrate --store {location}` "
                     f"upgrades it\n")


def recorded_version(location: StoreLocation) -> int | None:
    """The format version a store records, read without opening it (None: its backend has no maintenance, such as
    a shared store that records its format where opening reads it, or unreadable: the command that reads it says
    why)."""
    from kvcache.errors import KVCacheError
    from kvcache.storage.registry import maintenance_of

    try:
        maintenance = maintenance_of(location.url)
        return maintenance.format_version(location.url) if maintenance is not None else None
    except (KVCacheError, OSError):
        return None
