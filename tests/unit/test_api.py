"""The public API is what kvcache/__init__.py exports; this pins it."""

import inspect

import kvcache
from kvcache import errors

PUBLIC = {
    "Admission", "AdmitStatus", "AuditReport", "BackupStats", "CacheConfig", "CacheCounters", "CacheStats",
    "CommitResult", "DeclineReason", "DropReason", "EvictResult", "HostMode", "KVLayout", "Namespace",
    "NamespaceInfo", "Owner", "OwnerKind", "PrefetchOutcome", "PrefetchPolicy", "PrefetchStats", "RadixKey",
    "Request", "StagedView", "TierHits", "TieredCache", "TreeMatch", "Violation", "ViolationKind", "WritePolicy",
    "page_hashes", "L3Store", "PageStore", "open_store", "page_origins", "NamespaceShares", "Shares",
    "SettledPrefetch", "SyntheticKV", "WarmResult", "warm_namespace",
    "Shard", "engine_page_hash", "engine_origins", "engine_hashes", "PageOutcome",
    "KVPages",
    "ExpiryCause", "NamespaceExpiry", "NamespaceTTL", "TTLMode", "TTLPolicy", "TTLStats",
    "TraceRequest", "WorkloadSpec", "generate", "read_trace", "write_trace",
    "NamespaceReplay", "Replayer", "ReplayReport", "TierTokens", "VerifyMismatch", "replay",
    "DoubleFree", "InvalidConfig", "InvalidInput", "InvalidLayout", "InvalidNamespace", "InvalidTokens",
    "InvalidTrace", "InvariantViolation", "KVCacheError", "LayoutMismatch", "LockUnderflow", "NamespaceMismatch",
    "NotAStore", "OwnershipError", "StoreError", "StoreFull", "StoreReadOnly", "StoreUnsupported", "UnknownBackend",
    "UnknownRequest", "RepairRefused", "StoreAccessDenied", "StoreChanged", "KeyFileError", "EngineUnsupported",
    "KeyMismatch", "StoreClosed", "StoreDamaged",
    "CancelReason", "Headroom", "NamespaceDrop", "TierRoom", "CacheClosed", "RequestIdInUse",
    "AdminClient", "AdminServer", "KVEventPublisher", "KVEventSubscriber",
    "AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch", "MediumNames", "EventEndpointError",
    "AdminBadFrame", "AdminError", "AdminProtocolMismatch", "AdminRemoteError", "AdminSocketInUse", "AdminTimeout",
    "AdminUnavailable", "AdminUntrusted", "AdminShuttingDown",
}


def test_all_is_pinned():
    assert set(kvcache.__all__) == PUBLIC
    for name in kvcache.__all__:
        assert getattr(kvcache, name).__doc__, f"{name} has no docstring"


AUDIENCES = ("Core", "Workload", "Live", "Wire format")


def _audiences() -> dict[str, list[str]]:
    """The names the package docstring lists under each audience heading (a line "Audience — ...:" followed by
    indented lines of `name`s)."""
    import re

    listed: dict[str, list[str]] = {}
    current = None
    for line in kvcache.__doc__.splitlines():
        heading = re.match(r"^(\w[\w ]*) — .*:$", line)
        if heading:
            current = heading.group(1)
            listed[current] = []
        elif current is not None and line.startswith("  "):
            listed[current] += re.findall(r"`(\w+)`", line)
        else:
            current = None
    return listed


def test_all_is_one_sorted_list_and_the_docstring_puts_each_name_in_one_audience():
    assert kvcache.__all__ == sorted(kvcache.__all__)
    listed = _audiences()
    assert tuple(listed) == AUDIENCES
    names = [n for group in listed.values() for n in group]
    assert sorted(names) == sorted(kvcache.__all__), "the docstring's audiences and __all__ disagree"


def test_every_error_is_drawn_in_the_tree_and_exported():
    doc = errors.__doc__
    for name, obj in inspect.getmembers(errors, inspect.isclass):
        if issubclass(obj, errors.KVCacheError):
            assert name in doc, f"{name} is missing from the hierarchy drawn in kvcache/errors.py"
            assert name in kvcache.__all__, f"{name} is not exported from kvcache"


def test_core_never_imports_the_cli_stack():
    import pathlib
    import re

    root = pathlib.Path(kvcache.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(import|from)\s+(typer|rich|kvc)\b", text, re.M), path
