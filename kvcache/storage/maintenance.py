"""What a backend can do to a store by its location, with no handle open: the maintenance contract
(`StoreMaintenance`) and its reports. The CLI reaches a backend's maintenance through the backend registry
(`kvcache.storage.registry.maintenance_of`), never by importing a backend: a backend without one (a shared store
that keeps its format and key in its format record) answers None, and the command says it does not apply.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import msgspec

from ..types.layout import KVLayout
from .api import ServeRecord
from .keyfile import KeyState


class MigrateReport(msgspec.Struct, frozen=True):
    """What `kvc migrate` did to a store."""

    location: str
    from_version: int  # the format the store had
    to_version: int  # the format it has now (FORMAT_VERSION; the same as from_version when nothing was to do)
    migrated: bool  # False: the store was already current, nothing was changed
    pages: int  # pages rewritten under their new hashes
    namespaces: int  # namespace records whose roots were rewritten


class RekeyResult(msgspec.Struct, frozen=True):
    """What `rekey` changed."""

    path: str  # the key file
    previous: KeyState  # what the key file was before (present: a rotation; missing, empty, corrupt: a lost key)
    namespaces: int  # registry records: each one's display id changed
    fingerprints_unknown: int  # salted records whose fingerprint is unknown until their next write
    unreachable_pages: int = 0  # pages whose chain roots the old key keyed (format 2): none is found again


class PageDisk(msgspec.Struct, frozen=True):
    """One page's share of a store's data file, by part (bytes; estimates but `value_pages`). LMDB's parts:
    a value in overflow pages or a leaf, its index records, and the spare pages copy-on-write keeps."""

    payload: int  # the page's bytes: what capacities and quotas count
    value_pages: int  # overflow pages of its value (0: kept inline in a leaf); exact
    value: int  # the value's bytes on disk: its overflow pages, or its share of a leaf
    records: int  # its metadata, index entries and its leaf references, in leaves filled as measured
    spare: int  # its share of the leaf copies copy-on-write keeps (free pages later writes reuse)

    @property
    def total(self) -> int:
        """Bytes of data file per page stored."""
        return self.value + self.records + self.spare

    @property
    def ratio(self) -> float:
        """Data file per payload byte: what to multiply a payload capacity by to get the disk to provision."""
        return self.total / self.payload


class StoreMaintenance(Protocol):
    """A backend's maintenance of a closed store, by location."""

    def format_version(self, location: str) -> int:
        """The format version the store at `location` records, read without opening it (nothing is written)."""

    def migrate(self, location: str) -> MigrateReport:
        """Rewrite the store at `location` to the current format, crash-safe; a current store is left alone."""

    def rekey(self, location: str, live: Callable[[list[ServeRecord]], list[str]] | None = None,
              unreachable_ok: bool = False) -> RekeyResult:
        """Give the store a new fingerprint key. `live(records)`: the live caches among its serving records (a
        rekey is refused while any serve it); `unreachable_ok`: rekey even when the store's page hashes are keyed
        by the old key (its pages are then found no more)."""

    def page_disk(self, layout: KVLayout) -> PageDisk:
        """What one page of `layout` costs on the store's disk, by part: what to provision for a capacity."""
