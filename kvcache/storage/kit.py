"""The storage kit: the one module an L3 backend outside the core imports (DESIGN §2: plugins -> storage.kit).

It re-exports what a backend needs and nothing else: the store contracts (`PageStore`, what a cache asks, and
`L3Store`, it and the administration) and their records (`api`), the maintenance of a closed store
(`maintenance`), the argument checks every backend shares
(`checks`), the stored page value, checksums and record codecs (`codec`), the handle's counters and access log
(`handle`), the shared integrity audit and repair (`verify`), the backend registry (`registry`), the store errors,
and the key, layout, namespace and share values of `kvcache.types`. A plugin that imports only this module depends
on no other part of the core, and the core may rearrange its modules freely behind these names.
`plugins/README.md` says how a backend uses them.
"""

from __future__ import annotations

from ..errors import (
    InvalidInput,
    LayoutMismatch,
    NotAStore,
    StoreClosed,
    StoreError,
    StoreFull,
    StoreReadOnly,
    StoreUnsupported,
    UnknownBackend,
)
from ..types.fingerprint_key import new_fingerprint_key
from ..types.ids import NamespaceId, PageHash
from ..types.keys import (
    ENGINE_KEY_MAX,
    PAGE_HASH_BYTES,
    TOKEN_BYTES,
    engine_page_hash,
    extend_chain,
    hash_root,
    hash_root_of_id,
    new_chain_key,
)
from ..types.layout import ARRANGEMENTS, KVLayout, Shard
from ..types.namespace import Namespace, NamespaceInfo
from ..types.shares import NamespaceShares, Shares, decode_shares_record
from .api import (
    DROPS_KEPT,
    REPAIRS,
    VERIFY_KINDS,
    AccessPolicy,
    CapacityPolicy,
    ChildInfo,
    DeleteResult,
    DropRecord,
    L3Store,
    LayoutRecord,
    NamespaceRecord,
    PageMeta,
    PageOrigin,
    PageOutcome,
    PageStore,
    PutResult,
    ServeRecord,
    StoreCounters,
    StoreStats,
    VerifyFinding,
    VerifyRemoval,
    VerifyReport,
    engine_hashes,
    engine_origins,
    page_origins,
)
from .chain import ChainRoots, chain_key_of
from .checks import (
    PageView,
    Segments,
    Strided,
    byte_view,
    check_page_hashes,
    layout_to_register,
    namespace_root,
    out_views_for,
    page_bytes,
    put_views,
)
from .codec import (
    CHECKSUM_FIELD,
    CHECKSUMS,
    DEFAULT_CHECKSUM,
    FORMAT_MAGIC,
    FORMAT_VERSION,
    HEADER,
    KEYED_ROOTS_VERSION,
    Checksum,
    StoreFormat,
    chains_to,
    decode_format,
    decode_layout,
    decode_meta,
    decode_namespace,
    decode_or_none,
    encoder,
    engine_keyed,
    stored_checksum,
)
from .handle import AccessLog, StoreHandle, count_read, new_counts
from .maintenance import MigrateReport, PageDisk, RekeyResult, StoreMaintenance
from .registry import DEFAULT_SCHEME, ENTRY_POINT_GROUP, backend_class, backends, open_store, scheme_of
from .removals import NAMESPACE_WIDE, REMOVALS_KEPT, PageRemoval, RemovalReason, newest_removal, removals_kept
from .verify import verify
from .verify_repair import removed_pages
from .verify_source import Findings, Guard, IntegritySource, PageRow, Removal, RepairOps, ScannedPage, Snapshot

__all__ = [
    # the protocol and its records (api)
    "L3Store", "PageStore", "StoreMaintenance", "MigrateReport", "RekeyResult", "PageDisk", "PageOrigin", "PageMeta", "NamespaceRecord", "LayoutRecord", "ChildInfo", "PutResult", "DeleteResult",
    "StoreCounters", "StoreStats", "VerifyFinding", "VerifyRemoval", "VerifyReport", "CapacityPolicy",
    "AccessPolicy", "VERIFY_KINDS", "REPAIRS", "page_origins",
    # engine-keyed pages: what becomes of each page of a put, the origins and hashes of an engine's keys (api)
    "PageOutcome", "engine_origins", "engine_hashes",
    # who serves a store and what was dropped from it (api; kvcache.storage.serving follows them)
    "ServeRecord", "DropRecord", "DROPS_KEPT",
    # the bounded log of the pages a store removed, and why (removals)
    "PageRemoval", "RemovalReason", "REMOVALS_KEPT", "NAMESPACE_WIDE", "newest_removal", "removals_kept",
    # the argument checks every backend shares (checks)
    "check_page_hashes", "out_views_for", "put_views", "layout_to_register", "namespace_root", "byte_view",
    "page_bytes", "Segments", "Strided", "PageView",
    # the stored page value, checksums, the format record, record codecs (codec)
    "FORMAT_MAGIC", "FORMAT_VERSION", "CHECKSUM_FIELD", "HEADER", "Checksum", "CHECKSUMS", "DEFAULT_CHECKSUM",
    "StoreFormat", "stored_checksum", "encoder", "decode_meta", "decode_namespace", "decode_layout", "decode_format",
    "decode_or_none", "chains_to", "engine_keyed", "KEYED_ROOTS_VERSION",
    # the key of a store's page-hash chain roots, and the roots an audit checks pages against (chain)
    "chain_key_of", "ChainRoots",
    # the handle's counters and its log of reads not yet flushed (handle)
    "AccessLog", "StoreHandle", "count_read", "new_counts",
    # the shared integrity audit and repair, over the backend's IntegritySource (verify)
    "verify", "removed_pages", "IntegritySource", "RepairOps", "Findings", "Guard", "PageRow", "Removal",
    "ScannedPage", "Snapshot",
    # the backend registry (registry)
    "ENTRY_POINT_GROUP", "DEFAULT_SCHEME", "scheme_of", "backends", "backend_class", "open_store",
    # the errors a backend raises
    "InvalidInput", "LayoutMismatch", "NotAStore", "StoreClosed", "StoreError", "StoreFull", "StoreReadOnly",
    "StoreUnsupported", "UnknownBackend",
    # the values that name a page, a layout, a namespace and its shares (kvcache.types)
    "NamespaceId", "PageHash", "PAGE_HASH_BYTES", "TOKEN_BYTES", "extend_chain", "hash_root", "hash_root_of_id",
    "engine_page_hash", "ENGINE_KEY_MAX", "Shard", "ARRANGEMENTS", "new_chain_key", "KVLayout", "Namespace",
    "NamespaceInfo", "new_fingerprint_key", "NamespaceShares", "Shares", "decode_shares_record",
]
