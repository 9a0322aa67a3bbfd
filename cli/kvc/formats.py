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
    """The format version an LMDB store records, read without opening it (None: not LMDB, or unreadable: the
    command that reads it says why)."""
    from kvcache.storage.registry import scheme_of

    if scheme_of(location.url) != "lmdb":
        return None
    from kvcache.errors import KVCacheError
    from kvcache.storage.lmdb.migrate import format_version_of

    try:
        return format_version_of(location.url)
    except (KVCacheError, OSError):
        return None
