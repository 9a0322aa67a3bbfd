"""The public API is what kvcache/__init__.py exports; this pins it."""

import inspect

import kvcache
from kvcache import errors

PUBLIC = {
    "Admission", "AdmitStatus", "AuditReport", "CacheConfig", "CacheCounters", "CommitResult", "EvictResult",
    "KVLayout", "Namespace", "NamespaceInfo", "Owner", "OwnerKind", "RadixKey", "Request", "TieredCache",
    "TreeMatch", "Violation", "ViolationKind", "WritePolicy", "page_hashes",
    "DoubleFree", "InvalidConfig", "InvalidInput", "InvalidLayout", "InvalidNamespace", "InvalidTokens",
    "InvariantViolation", "KVCacheError", "LayoutMismatch", "LockUnderflow", "NamespaceMismatch", "NotAStore",
    "OwnershipError", "StoreError", "StoreFull", "StoreReadOnly", "UnknownRequest",
}


def test_all_is_pinned():
    assert set(kvcache.__all__) == PUBLIC
    for name in kvcache.__all__:
        assert getattr(kvcache, name).__doc__, f"{name} has no docstring"


def test_every_error_is_drawn_in_the_tree():
    doc = errors.__doc__
    for name, obj in inspect.getmembers(errors, inspect.isclass):
        if issubclass(obj, errors.KVCacheError):
            assert name in doc, f"{name} is missing from the hierarchy drawn in kvcache/errors.py"


def test_core_never_imports_the_cli_stack():
    import pathlib
    import re

    root = pathlib.Path(kvcache.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(import|from)\s+(typer|rich|kvc)\b", text, re.M), path
