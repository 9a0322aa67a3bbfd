"""kvcache: a tiered KV-cache core for LLM serving.

L1 (device) and L2 (host) slot pools under one namespaced radix tree, with an ownership ledger checked on every
slot move and an audit that can run at any moment. Start with `TieredCache(CacheConfig(layout=KVLayout(...),
device_tokens=..., host_tokens=...))`.
"""

from .audit import AuditReport, Violation, ViolationKind
from .cache import Admission, AdmitStatus, CacheCounters, CommitResult, EvictResult, TieredCache
from .config import CacheConfig, WritePolicy
from .errors import (DoubleFree, InvalidConfig, InvalidInput, InvalidLayout, InvalidNamespace, InvalidTokens,
                     InvariantViolation, KVCacheError, LayoutMismatch, LockUnderflow, NamespaceMismatch, NotAStore,
                     OwnershipError, StoreError, StoreFull, StoreReadOnly, UnknownRequest)
from .keys import RadixKey, page_hashes
from .layout import KVLayout
from .namespace import Namespace, NamespaceInfo
from .owners import Owner, OwnerKind
from .request import Request
from .tree import TreeMatch

__all__ = [
    "Admission", "AdmitStatus", "AuditReport", "CacheConfig", "CacheCounters", "CommitResult", "EvictResult",
    "KVLayout", "Namespace", "NamespaceInfo", "Owner", "OwnerKind", "RadixKey", "Request", "TieredCache",
    "TreeMatch", "Violation", "ViolationKind", "WritePolicy", "page_hashes",
    # errors
    "DoubleFree", "InvalidConfig", "InvalidInput", "InvalidLayout", "InvalidNamespace", "InvalidTokens",
    "InvariantViolation", "KVCacheError", "LayoutMismatch", "LockUnderflow", "NamespaceMismatch", "NotAStore",
    "OwnershipError", "StoreError", "StoreFull", "StoreReadOnly", "UnknownRequest",
]
