"""Reports: what an audit found, what a replay and a warm-up did. Values only (no torch, no I/O)."""

from __future__ import annotations

import enum

import msgspec

from .ids import NodeId
from .namespace import NamespaceInfo
from .stats import BackupStats, PrefetchStats


class ViolationKind(str, enum.Enum):
    """What an audit can find."""

    LEAK = "leak"
    DOUBLE_OWNER = "double_owner"
    DANGLING_REF = "dangling_ref"
    FREE_BUT_REFERENCED = "free_but_referenced"
    FREE_LIST_MISMATCH = "free_list_mismatch"
    LOCK_UNDERFLOW = "lock_underflow"
    LOCK_MISMATCH = "lock_mismatch"
    HOLD_MISMATCH = "hold_mismatch"
    PIN_MISMATCH = "pin_mismatch"
    DEVICE_NOT_PREFIX = "device_not_prefix"
    HOST_NOT_PREFIX = "host_not_prefix"
    EMPTY_NODE = "empty_node"
    PAGE_COUNT_MISMATCH = "page_count_mismatch"
    NAMESPACE_MIX = "namespace_mix"
    DETACHED_REF = "detached_ref"
    SIZE_MISMATCH = "size_mismatch"


class Violation(msgspec.Struct, omit_defaults=True):
    """One finding, with the facts needed to act on it."""

    kind: ViolationKind
    detail: str  # one readable line
    pool: str | None = None  # "device" / "host" for page findings
    pages: list[int] = []  # the pages involved (first 32)
    count: int = 0  # how many pages are involved in all
    owners: list[str] = []  # owners involved, as the ledger or the holders name them
    node: NodeId | None = None  # the tree node involved
    rid: str | None = None  # the request involved


class AuditChecked(msgspec.Struct):
    """What the audit looked at."""

    pages: int
    nodes: int
    requests: int
    ops: int
    staged: int


class AuditReport(msgspec.Struct):
    """The audit's verdict: `ok` when there are no violations."""

    ok: bool
    violations: list[Violation]
    checked: AuditChecked


class TierTokens(msgspec.Struct):
    """Tokens found in each tier at admission."""

    device: int = 0
    host: int = 0
    storage: int = 0

    @property
    def total(self) -> int:
        """Tokens found in any tier."""
        return self.device + self.host + self.storage


class NamespaceReplay(msgspec.Struct):
    """One namespace's share of a replay, counted by the process that ran it (its fingerprint under that
    process's store key: a client never keys the rows itself)."""

    namespace: NamespaceInfo
    requests: int = 0  # admitted and committed
    tokens: int = 0
    hit_tokens: TierTokens = msgspec.field(default_factory=TierTokens)
    sent: int = 0  # requests of the namespace in the trace
    refused: int = 0  # too large for L1 (never admitted)


class VerifyMismatch(msgspec.Struct, frozen=True):
    """A cached page whose bytes are not those of its page hash."""

    rid: str
    page: int  # index of the page in the request
    namespace: NamespaceInfo


class ReplayReport(msgspec.Struct):
    """What a replay did. `requests`, `tokens`, `hit_tokens`, `verify_mismatches` and `audit` are pinned
    (DESIGN §8)."""

    requests: int  # admitted and committed
    refused: int  # requests larger than the device pool (TOO_LARGE: skipped)
    tokens: int  # tokens of the committed requests
    hit_tokens: TierTokens  # of those, found cached, by tier
    namespaces: list[NamespaceReplay]
    verify: bool
    verified_tokens: int  # cached tokens compared byte for byte (0 without verify)
    verify_mismatches: int  # pages whose bytes differed from their page hash's
    mismatches: list[VerifyMismatch]  # the first few
    namespace_mismatches: int  # prefetches refused for an anchor of another namespace
    prefetches_cancelled: int  # waiting requests' prefetch holds an admission cancelled (prefetch.cancelled)
    prefetch: PrefetchStats  # during this replay
    backup: BackupStats  # during this replay
    audit: AuditReport  # of the whole cache after the final flush
    seconds: float  # the loop and the final flush
    requests_per_s: float
    tokens_per_s: float
    prefetches_reissued: int = 0  # prefetches issued again after a bound declined them or an admission cancelled
    blocked: int = 0  # live mode: requests skipped because requests outside this replay held the device pool

    @property
    def ok(self) -> bool:
        """No verify mismatch and a clean audit."""
        return self.verify_mismatches == 0 and self.audit.ok


class WarmResult(msgspec.Struct):
    """What warming a namespace did. Token and page figures count pages that landed in L2."""

    namespace: NamespaceInfo
    prefixes: int  # prefixes chosen from the store
    requested_tokens: int  # tokens of the chosen prefixes, counting shared parts once
    hit_tokens: int  # tokens now in L2 as host-only nodes of the namespace (fetched, minus duplicates)
    pages: int
    bytes: int
    declined: dict[str, int]  # DeclineReason value -> prefixes not prefetched
    seconds: float
