"""kvcache: a tiered KV-cache core for LLM serving.

L1 (device) and L2 (host) slot pools under one namespaced radix tree, an optional L3 page store
(`kvcache.storage`), an ownership ledger checked on every slot move and an audit that can run at any moment.
Start with `TieredCache(CacheConfig(layout=KVLayout(...), device_tokens=..., host_tokens=...), store=None)`.

The public API (`__all__`, one sorted list) serves four audiences; each name is in one of them
(tests/unit/test_api.py checks that this list and `__all__` agree):

Core — an engine embedding the cache: the cache, its values and policies, the store contracts, the errors:
  `Admission`, `AdmitStatus`, `AuditReport`, `BackupStats`, `CacheClosed`, `CacheConfig`, `CacheCounters`,
  `CacheStats`, `CancelReason`, `CommitResult`, `DeclineReason`, `DoubleFree`, `DropReason`, `engine_hashes`,
  `engine_origins`, `engine_page_hash`, `EngineUnsupported`, `EvictResult`, `ExpiryCause`, `Headroom`, `HostMode`,
  `InvalidConfig`, `InvalidInput`, `InvalidLayout`, `InvalidNamespace`, `InvalidTokens`, `InvalidTrace`,
  `InvariantViolation`, `KeyFileError`, `KeyMismatch`, `KVCacheError`, `KVLayout`, `KVPages`, `L3Store`,
  `LayoutMismatch`, `LockUnderflow`, `Namespace`, `NamespaceDrop`, `NamespaceExpiry`, `NamespaceInfo`,
  `NamespaceMismatch`, `NamespaceShares`, `NamespaceTTL`, `NotAStore`, `open_store`, `Owner`, `OwnerKind`,
  `OwnershipError`, `page_hashes`, `page_origins`, `PageOutcome`, `PageStore`, `PrefetchOutcome`, `PrefetchPolicy`,
  `PrefetchStats`, `RadixKey`, `RepairRefused`, `Request`, `RequestIdInUse`, `SettledPrefetch`, `Shard`, `Shares`,
  `StagedView`,
  `StoreAccessDenied`, `StoreChanged`, `StoreClosed`, `StoreDamaged`, `StoreError`, `StoreFull`, `StoreReadOnly`,
  `StoreUnsupported`, `TieredCache`, `TierHits`, `TierRoom`, `TreeMatch`, `TTLMode`, `TTLPolicy`, `TTLStats`,
  `UnknownBackend`, `UnknownRequest`, `Violation`, `ViolationKind`, `warm_namespace`, `WarmResult`, `WritePolicy`

Workload — traces and the replay driver (what `kvc replay`, `kvc sweep` and the benchmarks run):
  `generate`, `NamespaceReplay`, `read_trace`, `replay`, `Replayer`, `ReplayReport`, `SyntheticKV`, `TierTokens`,
  `TraceRequest`, `VerifyMismatch`, `WorkloadSpec`, `write_trace`

Live — a cache served on an admin socket, and its KV-event feed:
  `AdminBadFrame`, `AdminClient`, `AdminError`, `AdminProtocolMismatch`, `AdminRemoteError`, `AdminServer`,
  `AdminShuttingDown`, `AdminSocketInUse`, `AdminTimeout`, `AdminUnavailable`, `AdminUntrusted`,
  `EventEndpointError`, `KVEventPublisher`, `KVEventSubscriber`

Wire format — the KV events a router or indexer consumes (`kvc serve --events`, `kvc ns dump`):
  `AllBlocksCleared`, `BlockRemoved`, `BlockStored`, `EventBatch`, `MediumNames`
"""

import importlib
from typing import TYPE_CHECKING

from .errors import (
    AdminBadFrame,
    AdminError,
    AdminProtocolMismatch,
    AdminRemoteError,
    AdminShuttingDown,
    AdminSocketInUse,
    AdminTimeout,
    AdminUnavailable,
    AdminUntrusted,
    CacheClosed,
    DoubleFree,
    EngineUnsupported,
    EventEndpointError,
    InvalidConfig,
    InvalidInput,
    InvalidLayout,
    InvalidNamespace,
    InvalidTokens,
    InvalidTrace,
    InvariantViolation,
    KeyFileError,
    KeyMismatch,
    KVCacheError,
    LayoutMismatch,
    LockUnderflow,
    NamespaceMismatch,
    NotAStore,
    OwnershipError,
    RepairRefused,
    RequestIdInUse,
    StoreAccessDenied,
    StoreChanged,
    StoreClosed,
    StoreDamaged,
    StoreError,
    StoreFull,
    StoreReadOnly,
    StoreUnsupported,
    UnknownBackend,
    UnknownRequest,
)

# The values (cheap, no torch), every name in kvcache.types.__all__, imported eagerly.
from .types import (
    Admission,
    AdmitStatus,
    AllBlocksCleared,
    AuditReport,
    BackupStats,
    BlockRemoved,
    BlockStored,
    CacheConfig,
    CacheCounters,
    CacheStats,
    CancelReason,
    CommitResult,
    DeclineReason,
    DropReason,
    EventBatch,
    EvictResult,
    ExpiryCause,
    Headroom,
    HostMode,
    KVLayout,
    MediumNames,
    Namespace,
    NamespaceDrop,
    NamespaceExpiry,
    NamespaceInfo,
    NamespaceReplay,
    NamespaceShares,
    NamespaceTTL,
    Owner,
    OwnerKind,
    PrefetchOutcome,
    PrefetchPolicy,
    PrefetchStats,
    RadixKey,
    ReplayReport,
    Request,
    SettledPrefetch,
    Shard,
    Shares,
    StagedView,
    TierHits,
    TierRoom,
    TierTokens,
    TTLMode,
    TTLPolicy,
    TTLStats,
    VerifyMismatch,
    Violation,
    ViolationKind,
    WarmResult,
    WritePolicy,
    engine_page_hash,
    page_hashes,
)
from .types import AuditChecked as AuditChecked  # kvcache.types has it too; not in __all__, never was

# What needs torch, a store or a socket, imported on first use (PEP 562), so that `import kvcache`, or a kvc
# command that only reads a store, does not pay for torch (seconds) and the cache behind it.
_LAZY: dict[str, tuple[str, ...]] = {
    "engine.cache": ("TieredCache",),
    "ledger.kv": ("KVPages",),
    "storage.api": ("L3Store", "PageOutcome", "PageStore", "engine_hashes", "engine_origins", "page_origins"),
    "storage.registry": ("open_store",),
    "tree": ("TreeMatch",),
    "workload.kvdata": ("SyntheticKV",),
    "workload.replay": ("Replayer", "replay"),
    "workload.traces": ("TraceRequest", "WorkloadSpec", "generate", "read_trace", "write_trace"),
    "ops.warm": ("warm_namespace",),
    "live.client": ("AdminClient",),
    "live.server": ("AdminServer",),
    "live.events": ("KVEventPublisher",),
    "live.subscriber": ("KVEventSubscriber",),
}
_HOME = {name: module for module, names in _LAZY.items() for name in names}

if TYPE_CHECKING:  # the same names for mypy, with their real types (at run time `__getattr__` imports them)
    from .engine.cache import TieredCache
    from .ledger.kv import KVPages
    from .live.client import AdminClient
    from .live.events import KVEventPublisher
    from .live.server import AdminServer
    from .live.subscriber import KVEventSubscriber
    from .ops.warm import warm_namespace
    from .storage.api import L3Store, PageOutcome, PageStore, engine_hashes, engine_origins, page_origins
    from .storage.registry import open_store
    from .tree import TreeMatch
    from .workload.kvdata import SyntheticKV
    from .workload.replay import Replayer, replay
    from .workload.traces import TraceRequest, WorkloadSpec, generate, read_trace, write_trace


def __getattr__(name: str) -> object:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcache' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))


__all__ = [  # sorted; the audiences are in the module docstring
    "AdminBadFrame", "AdminClient", "AdminError", "AdminProtocolMismatch", "AdminRemoteError", "AdminServer",
    "AdminShuttingDown", "AdminSocketInUse", "AdminTimeout", "AdminUnavailable", "AdminUntrusted", "Admission",
    "AdmitStatus", "AllBlocksCleared", "AuditReport", "BackupStats", "BlockRemoved", "BlockStored", "CacheClosed",
    "CacheConfig", "CacheCounters", "CacheStats", "CancelReason", "CommitResult", "DeclineReason", "DoubleFree",
    "DropReason", "EngineUnsupported", "EventBatch", "EventEndpointError", "EvictResult", "ExpiryCause", "Headroom",
    "HostMode", "InvalidConfig", "InvalidInput", "InvalidLayout", "InvalidNamespace", "InvalidTokens", "InvalidTrace",
    "InvariantViolation", "KVCacheError", "KVEventPublisher", "KVEventSubscriber", "KVLayout", "KVPages", "KeyFileError",
    "KeyMismatch", "L3Store", "LayoutMismatch", "LockUnderflow", "MediumNames", "Namespace", "NamespaceDrop",
    "NamespaceExpiry", "NamespaceInfo", "NamespaceMismatch", "NamespaceReplay", "NamespaceShares", "NamespaceTTL",
    "NotAStore", "Owner", "OwnerKind", "OwnershipError", "PageOutcome", "PageStore", "PrefetchOutcome",
    "PrefetchPolicy", "PrefetchStats", "RadixKey", "RepairRefused", "ReplayReport", "Replayer", "Request",
    "RequestIdInUse", "SettledPrefetch", "Shard", "Shares", "StagedView", "StoreAccessDenied", "StoreChanged",
    "StoreClosed", "StoreDamaged", "StoreError", "StoreFull", "StoreReadOnly", "StoreUnsupported", "SyntheticKV",
    "TTLMode", "TTLPolicy", "TTLStats", "TierHits", "TierRoom", "TierTokens", "TieredCache", "TraceRequest",
    "TreeMatch", "UnknownBackend", "UnknownRequest", "VerifyMismatch", "Violation", "ViolationKind", "WarmResult",
    "WorkloadSpec", "WritePolicy", "engine_hashes", "engine_origins", "engine_page_hash", "generate", "open_store",
    "page_hashes", "page_origins", "read_trace", "replay", "warm_namespace", "write_trace",
]
