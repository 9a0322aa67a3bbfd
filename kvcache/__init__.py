"""kvcache: a tiered KV-cache core for LLM serving.

L1 (device) and L2 (host) slot pools under one namespaced radix tree, an optional L3 page store
(`kvcache.storage`), an ownership ledger checked on every slot move and an audit that can run at any moment.
Start with `TieredCache(CacheConfig(layout=KVLayout(...), device_tokens=..., host_tokens=...), store=None)`.
"""

from .admin import AdminClient, AdminServer
from .audit import AuditReport, Violation, ViolationKind
from .cache import Admission, AdmitStatus, CommitResult, EvictResult, TieredCache
from .config import CacheConfig, HostMode, PrefetchPolicy, WritePolicy
from .errors import (AdminBadFrame, AdminError, AdminProtocolMismatch, AdminRemoteError, AdminShuttingDown,
                     AdminSocketInUse, AdminTimeout, AdminUnavailable, AdminUntrusted, DoubleFree, InvalidConfig, InvalidInput, InvalidLayout,
                     InvalidNamespace, InvalidTokens, InvalidTrace, InvariantViolation, KVCacheError,
                     LayoutMismatch, LockUnderflow, NamespaceMismatch, NotAStore, OwnershipError, StoreError,
                     StoreFull, StoreReadOnly, StoreUnsupported, UnknownBackend, UnknownRequest)
from .keys import RadixKey, page_hashes
from .kvdata import SyntheticKV
from .layout import KVLayout
from .namespace import Namespace, NamespaceInfo
from .owners import Owner, OwnerKind
from .prefetch import DeclineReason, DropReason, PrefetchOutcome, SettledPrefetch
from .replay import NamespaceReplay, Replayer, ReplayReport, TierTokens, VerifyMismatch, replay
from .request import Request
from .staging import StagedView
from .stats import BackupStats, CacheCounters, CacheStats, PrefetchStats, TierHits
from .storage.base import L3Store, open_store, page_origins
from .tree import TreeMatch
from .warm import WarmResult, warm_namespace
from .workload import TraceRequest, WorkloadSpec, generate, read_trace, write_trace

__all__ = [
    "Admission", "AdmitStatus", "AuditReport", "BackupStats", "CacheConfig", "CacheCounters", "CacheStats",
    "CommitResult", "DeclineReason", "DropReason", "EvictResult", "HostMode", "KVLayout", "Namespace",
    "NamespaceInfo", "Owner", "OwnerKind", "PrefetchOutcome", "PrefetchPolicy", "PrefetchStats", "RadixKey",
    "Request", "StagedView", "TierHits", "TieredCache", "TreeMatch", "Violation", "ViolationKind", "WritePolicy",
    "page_hashes", "L3Store", "open_store", "page_origins",
    "SettledPrefetch", "SyntheticKV", "WarmResult", "warm_namespace",
    # workloads and the replay driver
    "TraceRequest", "WorkloadSpec", "generate", "read_trace", "write_trace",
    "NamespaceReplay", "Replayer", "ReplayReport", "TierTokens", "VerifyMismatch", "replay",
    # live mode: the admin socket
    "AdminClient", "AdminServer",
    # errors
    "DoubleFree", "InvalidConfig", "InvalidInput", "InvalidLayout", "InvalidNamespace", "InvalidTokens",
    "InvalidTrace", "InvariantViolation", "KVCacheError", "LayoutMismatch", "LockUnderflow", "NamespaceMismatch",
    "NotAStore", "OwnershipError", "StoreError", "StoreFull", "StoreReadOnly", "StoreUnsupported", "UnknownBackend",
    "UnknownRequest",
    "AdminBadFrame", "AdminError", "AdminProtocolMismatch", "AdminRemoteError", "AdminSocketInUse", "AdminTimeout",
    "AdminUnavailable", "AdminUntrusted", "AdminShuttingDown",
]
