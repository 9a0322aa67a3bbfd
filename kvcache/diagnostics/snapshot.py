"""Ownership snapshots: a live cache's ledger and reference holders, serialised for an offline audit.

A snapshot is a versioned msgpack document (`Snapshot`): the layout, the pool sizes, every pool's ledger and free
list (int64 arrays as bytes), every reference holder (tree nodes with their namespace id and fingerprint, live
requests, in-flight operations, prefetches, staged records, L3 writes) and the counters. `kvcache.diagnostics.audit.
audit_snapshot` runs on it the very checks `TieredCache.audit()` runs live. The salt never enters a snapshot.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Protocol

import msgspec

from ..errors import InvalidInput
from ..types.layout import KVLayout
from ..types.namespace import Namespace, NamespaceInfo
from ..types.stats import CacheCounters
from .ownership import OwnershipSource, OwnershipState, collect_state

SNAPSHOT_KIND = "kvc.ownership-snapshot"
SNAPSHOT_VERSION = 1


class InvalidSnapshot(InvalidInput):
    """A file that is not a readable kvc snapshot (truncated, foreign, or of a newer format)."""

    def __init__(self, path: str, why: str) -> None:
        self.path = str(path)
        super().__init__(f"{path}: {why}")


class SnapshotNamespace(msgspec.Struct, frozen=True):
    """A namespace that appears in the snapshot: its id and printable fields."""

    id: str  # hex
    info: NamespaceInfo


class Snapshot(msgspec.Struct):
    """One snapshot document."""

    kind: str  # SNAPSHOT_KIND
    version: int  # SNAPSHOT_VERSION of the writer
    created: float  # unix seconds
    layout: KVLayout
    device_pages: int
    host_pages: int
    namespaces: list[SnapshotNamespace]
    state: OwnershipState  # what the audit checks
    counters: CacheCounters


class _Header(msgspec.Struct):
    kind: str = ""
    version: int = 0


class SnapshotSource(OwnershipSource, Protocol):
    """What a snapshot reads of a cache beyond the audit's state: its layout and counters."""

    layout: KVLayout
    counters: CacheCounters


def take_snapshot(cache: SnapshotSource) -> Snapshot:
    """Read `cache` into a snapshot (between scheduler steps: the cache must not change meanwhile)."""
    fingerprints = cache.tree.fingerprints  # the cache's key: its store's, as the store's registry shows them
    namespaces = [SnapshotNamespace(ns.id_hex, fingerprints.info(ns)) for ns in _namespaces(cache)]
    return Snapshot(SNAPSHOT_KIND, SNAPSHOT_VERSION, time.time(), cache.layout, cache.device_pool.num_pages,
                    cache.host_pool.num_pages if cache.host_pool is not None else 0, namespaces,
                    collect_state(cache), msgspec.structs.replace(cache.counters))


def _namespaces(cache: SnapshotSource) -> list[Namespace]:
    """The namespaces the tree holds (its namespace roots' own)."""
    out = []
    for root in cache.tree.namespace_roots():
        assert root.namespace is not None  # a namespace root carries its namespace
        out.append(root.namespace)
    return out


def encode_snapshot(snapshot: Snapshot) -> bytes:
    """The bytes of a snapshot file."""
    return msgspec.msgpack.encode(snapshot)


def write_snapshot(snapshot: Snapshot | bytes, path: str | os.PathLike[str]) -> Path:
    """Write `snapshot` (or the bytes of one, as a live cache sends them) to `path` atomically (a temp file in
    the same directory, fsync, rename)."""
    path = Path(path)
    data = snapshot if isinstance(snapshot, bytes) else encode_snapshot(snapshot)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_snapshot(path: str | os.PathLike[str]) -> Snapshot:
    """Load a snapshot; `InvalidSnapshot` names the file and what is wrong with it."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidSnapshot(str(path), f"cannot read: {exc.strerror or exc}") from None
    return decode_snapshot(data, str(path))


def decode_snapshot(data: bytes, where: str = "<snapshot>") -> Snapshot:
    """Decode snapshot bytes, checking kind and version before the body."""
    try:
        header = msgspec.msgpack.decode(data, type=_Header)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise InvalidSnapshot(where, "not a kvc snapshot (unreadable or truncated)") from None
    if header.kind != SNAPSHOT_KIND:
        raise InvalidSnapshot(where, f"not a kvc snapshot (kind {header.kind!r})")
    if header.version > SNAPSHOT_VERSION:
        raise InvalidSnapshot(where, f"snapshot format {header.version} is newer than this kvc reads "
                                     f"({SNAPSHOT_VERSION}); upgrade kvc")
    try:
        return msgspec.msgpack.decode(data, type=Snapshot)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidSnapshot(where, f"damaged snapshot: {exc}") from None
