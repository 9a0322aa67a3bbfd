"""kvcache.storage.kit: the one module a plugin imports, and `base`, its former name."""

from __future__ import annotations

import subprocess
import sys

from kvcache.storage import api, base, checks, kit, maintenance, registry

# Every public name `kvcache.storage.base` had when it held the interface itself (before the kit): plugins written
# against it import these, and must keep finding them.
BASE_NAMES = {
    "AccessPolicy", "CapacityPolicy", "ChildInfo", "DEFAULT_SCHEME", "DeleteResult", "ENTRY_POINT_GROUP",
    "InvalidInput", "KVLayout", "L3Store", "LayoutMismatch", "LayoutRecord", "Namespace", "NamespaceInfo",
    "NamespaceRecord", "NamespaceShares", "NotAStore", "PAGE_HASH_BYTES", "PageMeta", "PageOrigin", "PutResult",
    "REPAIRS", "Shares", "StoreCounters", "StoreError", "StoreReadOnly", "StoreStats", "StoreUnsupported",
    "TOKEN_BYTES", "UnknownBackend", "VERIFY_KINDS", "VerifyFinding", "VerifyRemoval", "VerifyReport",
    "backend_class", "backends", "byte_view", "check_page_hashes", "decode_shares_record", "extend_chain",
    "hash_root", "hash_root_of_id", "layout_to_register", "namespace_root", "new_fingerprint_key", "open_store",
    "out_views_for", "page_bytes", "page_origins", "put_views", "scheme_of",
}


def test_the_kit_exports_what_it_lists_once_each():
    assert len(kit.__all__) == len(set(kit.__all__))
    assert [name for name in kit.__all__ if not hasattr(kit, name)] == []


def test_the_kit_hands_out_the_core_objects_themselves():
    assert kit.L3Store is api.L3Store and kit.PageMeta is api.PageMeta and kit.PageStore is api.PageStore
    assert kit.StoreMaintenance is maintenance.StoreMaintenance and kit.PageDisk is maintenance.PageDisk
    assert kit.put_views is checks.put_views and kit.open_store is registry.open_store


def test_base_is_the_kit_under_its_former_name():
    assert base.__all__ == kit.__all__
    assert all(getattr(base, name) is getattr(kit, name) for name in kit.__all__)
    assert BASE_NAMES <= set(base.__all__)


def test_importing_the_kit_loads_neither_torch_nor_the_lmdb_backend():
    code = ("import sys, kvcache.storage.kit; "
            "print(sorted(m for m in ('torch', 'lmdb', 'kvcache.storage.lmdb', 'kvcache.engine') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
