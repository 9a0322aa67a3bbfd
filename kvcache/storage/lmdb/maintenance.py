"""LMDB's maintenance of a closed store (`kvcache.storage.maintenance.StoreMaintenance`): format version,
migration, rekey and the disk a page costs, each in its own module, imported when asked for (a store opened for
reads and writes never pays for them)."""

from __future__ import annotations

from collections.abc import Callable

from ...types.layout import KVLayout
from ..api import ServeRecord
from ..maintenance import MigrateReport, PageDisk, RekeyResult


class LMDBMaintenance:
    """`StoreMaintenance` for LMDB store directories (`migrate`, `rekey`, `footprint`)."""

    def format_version(self, location: str) -> int:
        """The format version the store records (read lock-free: nothing is written)."""
        from .migrate import format_version_of

        return format_version_of(location)

    def migrate(self, location: str) -> MigrateReport:
        """`kvcache.storage.lmdb.migrate.migrate_location`."""
        from .migrate import migrate_location

        return migrate_location(location)

    def rekey(self, location: str, live: Callable[[list[ServeRecord]], list[str]] | None = None,
              unreachable_ok: bool = False) -> RekeyResult:
        """`kvcache.storage.lmdb.rekey.rekey`."""
        from .rekey import rekey

        return rekey(location, live, unreachable_ok)

    def page_disk(self, layout: KVLayout) -> PageDisk:
        """`kvcache.storage.lmdb.footprint.page_disk`."""
        from .footprint import page_disk

        return page_disk(layout)
