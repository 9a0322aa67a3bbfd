"""kvcache.types: the values of kvcache — identifiers, namespaces, keys, layouts, requests, configuration and its
rule tables, statistics, KV events, results and reports. No torch and no I/O: anything may import them cheaply
(the CLI, the admin protocol, scripts), and `import kvcache` re-exports them eagerly."""

from .config import CacheConfig, HostMode, PrefetchPolicy, TTLMode, TTLPolicy, WritePolicy
from .events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, MediumNames
from .keys import RadixKey, engine_page_hash, page_hashes
from .layout import KVLayout, Shard
from .namespace import Namespace, NamespaceInfo
from .owners import Owner, OwnerKind
from .reports import (
    AuditChecked,
    AuditReport,
    NamespaceReplay,
    ReplayReport,
    TierTokens,
    VerifyMismatch,
    Violation,
    ViolationKind,
    WarmResult,
)
from .request import Request
from .results import (
    Admission,
    AdmitStatus,
    CancelReason,
    CommitResult,
    DeclineReason,
    DropReason,
    EvictResult,
    ExpiryCause,
    Headroom,
    NamespaceDrop,
    NamespaceExpiry,
    NamespaceTTL,
    PrefetchOutcome,
    SettledPrefetch,
    StagedView,
    TierRoom,
)
from .shares import NamespaceShares, Shares
from .stats import BackupStats, CacheCounters, CacheStats, PrefetchStats, TierHits, TTLStats

__all__ = [
    "Admission", "AdmitStatus", "AllBlocksCleared", "AuditChecked", "AuditReport", "BackupStats", "BlockRemoved",
    "BlockStored", "CacheConfig", "CacheCounters", "CacheStats", "CancelReason", "CommitResult", "DeclineReason",
    "DropReason", "EventBatch", "EvictResult", "ExpiryCause", "Headroom", "HostMode", "KVLayout", "MediumNames",
    "Namespace", "NamespaceDrop", "NamespaceExpiry", "NamespaceInfo", "NamespaceReplay", "NamespaceShares",
    "NamespaceTTL", "Owner", "OwnerKind", "PrefetchOutcome", "PrefetchPolicy", "PrefetchStats", "RadixKey",
    "ReplayReport", "Request", "SettledPrefetch", "Shard", "Shares", "StagedView", "TTLMode", "TTLPolicy", "TTLStats",
    "TierHits", "TierRoom", "TierTokens", "VerifyMismatch", "Violation", "ViolationKind", "WarmResult",
    "WritePolicy", "engine_page_hash", "page_hashes",
]
