"""kvcache: a tiered KV-cache core for LLM serving.

L1 (device) and L2 (host) slot pools under one namespaced radix tree, an optional L3 page store
(`kvcache.storage`), an ownership ledger checked on every slot move and an audit that can run at any moment.
Start with `TieredCache(CacheConfig(layout=KVLayout(...), device_tokens=..., host_tokens=...), store=None)`.
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
    "storage.api": ("L3Store", "PageOutcome", "PageStore", "engine_hashes", "engine_origins", "page_origins"),
    "storage.registry": ("open_store",),
    "tree": ("TreeMatch",),
    "workload.kvdata": ("SyntheticKV",),
    "workload.replay": ("Replayer", "replay"),
    "workload.traces": ("TraceRequest", "WorkloadSpec", "generate", "read_trace", "write_trace"),
    "ops.warm": ("warm_namespace",),
    "live.client": ("AdminClient",),
    "live.server": ("AdminServer",),
    "live.events": ("KVEventPublisher", "KVEventSubscriber"),
}
_HOME = {name: module for module, names in _LAZY.items() for name in names}

if TYPE_CHECKING:  # the same names for mypy, with their real types (at run time `__getattr__` imports them)
    from .engine.cache import TieredCache
    from .live.client import AdminClient
    from .live.events import KVEventPublisher, KVEventSubscriber
    from .live.server import AdminServer
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


__all__ = [
    "Admission", "AdmitStatus", "AuditReport", "BackupStats", "CacheConfig", "CacheCounters", "CacheStats",
    "CancelReason", "CommitResult", "DeclineReason", "DropReason", "EvictResult", "Headroom", "HostMode", "KVLayout",
    "Namespace", "NamespaceDrop", "TierRoom", "NamespaceInfo", "Owner", "OwnerKind", "PrefetchOutcome",
    "PrefetchPolicy", "PrefetchStats", "RadixKey",
    "Request", "StagedView", "TierHits", "TieredCache", "TreeMatch", "Violation", "ViolationKind", "WritePolicy",
    "page_hashes", "L3Store", "PageStore", "open_store", "page_origins", "NamespaceShares", "Shares",
    "SettledPrefetch", "SyntheticKV", "WarmResult", "warm_namespace",
    # engine-keyed pages and engines' layouts (an engine's own page keys in the store)
    "Shard", "engine_page_hash", "engine_origins", "engine_hashes", "PageOutcome",
    # namespace time to live
    "ExpiryCause", "NamespaceExpiry", "NamespaceTTL", "TTLMode", "TTLPolicy", "TTLStats",
    # workloads and the replay driver
    "TraceRequest", "WorkloadSpec", "generate", "read_trace", "write_trace",
    "NamespaceReplay", "Replayer", "ReplayReport", "TierTokens", "VerifyMismatch", "replay",
    # live mode: the admin socket, the KV-event feed
    "AdminClient", "AdminServer", "KVEventPublisher", "KVEventSubscriber",
    # KV events: the wire format
    "AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch", "MediumNames",
    # errors
    "CacheClosed", "DoubleFree", "InvalidConfig", "InvalidInput", "InvalidLayout", "InvalidNamespace",
    "InvalidTokens",
    "InvalidTrace", "InvariantViolation", "KVCacheError", "LayoutMismatch", "LockUnderflow", "NamespaceMismatch",
    "NotAStore", "OwnershipError", "StoreError", "StoreFull", "StoreReadOnly", "StoreUnsupported", "UnknownBackend",
    "RequestIdInUse", "UnknownRequest", "EventEndpointError", "RepairRefused", "StoreAccessDenied", "StoreChanged",
    "KeyFileError", "EngineUnsupported", "KeyMismatch", "StoreClosed", "StoreDamaged",
    "AdminBadFrame", "AdminError", "AdminProtocolMismatch", "AdminRemoteError", "AdminSocketInUse", "AdminTimeout",
    "AdminUnavailable", "AdminUntrusted", "AdminShuttingDown",
]
