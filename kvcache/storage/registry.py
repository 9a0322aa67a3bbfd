"""The L3 backend registry: backends are found through the entry-point group ``kvcache.storage``, whose
entry-point name is the URL scheme (``lmdb`` for ``lmdb://PATH``; a plain path also opens ``lmdb``), and
`open_store` opens a location with the backend registered for its scheme."""

from __future__ import annotations

import functools
import re
import sys
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Protocol, cast

from ..errors import InvalidInput, UnknownBackend
from ..types.layout import KVLayout
from .api import L3Store
from .maintenance import StoreMaintenance

ENTRY_POINT_GROUP = "kvcache.storage"
DEFAULT_SCHEME = "lmdb"  # the backend a plain filesystem path opens

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class StoreBackend(Protocol):
    """What a backend's entry point loads: its store class, which `open`s a location as an `L3Store` (the
    backend's own options, such as a capacity or a map size, pass through `**options`), and its `maintenance` of
    a closed store by location (None: it has none; a backend written before the attribute is read as None)."""

    maintenance: StoreMaintenance | None

    def open(self, location: str, layout: KVLayout | None = None, *, create: bool = False, readonly: bool = False,
             add_layout: bool = False, **options: Any) -> L3Store: ...


def scheme_of(url_or_path: str) -> str:
    """The backend scheme of a store location: the URL scheme, or DEFAULT_SCHEME for a plain path."""
    m = _SCHEME.match(str(url_or_path))
    return m.group(1).lower() if m else DEFAULT_SCHEME


def backends() -> dict[str, EntryPoint]:
    """Registered backends: entry-point name (URL scheme) -> entry point (not yet imported), as the distributions on
    the current `sys.path` declare them."""
    return dict(_declared(tuple(sys.path)))


@functools.lru_cache(maxsize=8)
def _declared(path: tuple[str, ...]) -> tuple[tuple[str, EntryPoint], ...]:
    # Reading every distribution's metadata costs ~5 ms, and a process opens stores many times on one path; a
    # path that changes (a plugin's folder added) is read again. A plugin installed into a folder already on the
    # path while the process runs is seen by the next process, as an import would be.
    return tuple((ep.name, ep) for ep in entry_points(group=ENTRY_POINT_GROUP))


def backend_class(scheme: str) -> StoreBackend:
    """The backend class registered for `scheme`; UnknownBackend naming the registered schemes otherwise."""
    found = backends()
    if scheme not in found:
        known = ", ".join(sorted(found)) or "none"
        raise UnknownBackend(f"{scheme}://", f"no L3 backend registered for scheme {scheme!r} (registered: {known})")
    return cast(StoreBackend, found[scheme].load())  # an entry point loads an untyped object


def open_store(url_or_path: str, layout: KVLayout | None = None, *, create: bool = False, readonly: bool = False,
               add_layout: bool = False, **options: Any) -> L3Store:
    """Open the store at a path (LMDB) or URL (the backend registered for its scheme).

    `layout`: the layout this handle writes under. It must be one the store holds (LayoutMismatch names those it
    holds) unless `create` makes a new store or `add_layout` registers it. `create`: make the store when it does
    not exist. `readonly`: refuse writes. Backend-specific `options` (capacity, map size, policies) pass through.
    """
    if "\0" in str(url_or_path):
        raise InvalidInput("a store location cannot hold a NUL byte")
    cls = backend_class(scheme_of(url_or_path))
    return cls.open(str(url_or_path), layout=layout, create=create, readonly=readonly, add_layout=add_layout,
                    **options)


def maintenance_of(url_or_path: str) -> StoreMaintenance | None:
    """The maintenance (format version, migrate, rekey, disk per page) of the backend registered for a location's
    scheme; None when that backend has none. UnknownBackend for a scheme no backend is registered for."""
    maintenance: StoreMaintenance | None = getattr(backend_class(scheme_of(url_or_path)), "maintenance", None)
    return maintenance
