"""The identifiers of kvc, each its own type (for the type checker; at run time they are the plain values).

Two namespace ids exist and must never be confused: the raw `NamespaceId` (a digest of extra_key and salt, the
L3 root seed and the store's registry key) is never printed, logged or returned in a user-facing struct — next to
its extra_key it would let a short salt be brute-forced offline; outputs show a `DisplayId`, a digest of the raw
id keyed by the deployment's fingerprint key. `tests/test_layers.py` checks that no user-facing struct carries a
`NamespaceId`.
"""

from typing import NewType

NamespaceId = NewType("NamespaceId", bytes)  # 16 bytes: blake2b of (extra_key, cache_salt); never shown
DisplayId = NewType("DisplayId", str)  # 16 hex digits: a NamespaceId keyed by the fingerprint key; what outputs show
PageHash = NewType("PageHash", bytes)  # 16 bytes: the chain digest of a page and its whole prefix (DESIGN §3)
OwnerCode = NewType("OwnerCode", int)  # int64: a ledger owner, kind and id packed (kvcache.types.owners)
NodeId = NewType("NodeId", int)  # a tree node's id, < 2**48, never reused; its ledger owner is Node(id)
