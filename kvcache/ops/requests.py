"""The admin requests and what they answer: values the handlers (`kvcache.ops.handlers`) take and return, the
same whether a request comes from an offline `kvc` command or over a live cache's admin socket (DESIGN §7).

Live mode frames these structs on its socket (`kvcache.live.protocol`, which re-exports them), so they are the
wire format too: a request's tag and a struct's field names and order are what travels, never its module. Every
number a request carries is range-checked by its type (finite, bounded: a `timeout_ms` of `inf` or 1e300 is
refused by the decoder, not a wait that overflows). The salt of a namespace travels in requests only (to derive
the namespace where the request runs); no result carries it. `ReplayJob` is what a replay runs: a trace and its
options, however the trace arrived.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Annotated

import msgspec

from ..storage.api import StoreStats
from ..types.config import PrefetchPolicy
from ..types.events import BlockStored, MediumNames, PageHash
from ..types.explain import Explanation
from ..types.ids import DisplayId
from ..types.layout import KVLayout
from ..types.namespace import NamespaceInfo
from ..types.reports import ReplayReport
from ..types.results import StagedView
from ..types.shares import Shares
from ..types.stats import CacheStats
from .dump import CHUNK_MAX_PAGES, DumpCursor, DumpTier

if TYPE_CHECKING:  # a ReplayJob is built and run in process, never encoded: its trace's type is an annotation only
    from ..workload.traces import TraceRequest

# The version of these structs as the admin socket carries them (a live client and server must agree on it).
PROTOCOL_VERSION = 2  # 2: snapshots come back as bytes (no server-side path); bounded numbers
MAX_TIMEOUT_MS = 3_600_000.0  # an hour: the longest wait a request may ask for
MAX_PAGES = 1 << 31
MAX_BYTES = 1 << 50

Token = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]
Pages = Annotated[int, msgspec.Meta(ge=0, le=MAX_PAGES)]
Bytes = Annotated[int, msgspec.Meta(ge=0, le=MAX_BYTES)]
TimeoutMs = Annotated[float, msgspec.Meta(ge=0, le=MAX_TIMEOUT_MS)]  # rejects nan and inf too


# --- requests ------------------------------------------------------------------------------------------------


class PingRequest(msgspec.Struct, frozen=True, tag="ping", forbid_unknown_fields=True):
    """Is a server there, and what is it serving? Answered with `ServerInfo`."""


class PrefetchRequest(msgspec.Struct, frozen=True, tag="prefetch", forbid_unknown_fields=True):
    """L3 -> L2: one request (`tokens`), or the namespace's hottest stored prefixes within the budget.
    Answered with `RequestResult`."""

    extra_key: str | None = None
    cache_salt: str | None = None  # derives the namespace on the server; never echoed, logged or stored
    tokens: list[Token] | None = None  # None: the whole namespace, hottest prefixes first, up to the budget
    max_pages: Pages = 4096
    max_bytes: Bytes | None = None
    policy: PrefetchPolicy = PrefetchPolicy.WAIT_COMPLETE  # how this prefetch is settled (not the cache's policy)
    timeout_ms: TimeoutMs = 1000.0


class StageRequest(msgspec.Struct, frozen=True, tag="stage", forbid_unknown_fields=True):
    """Buffer mode: prefetch one request and show its staged record. Answered with `RequestResult`."""

    tokens: list[Token]
    extra_key: str | None = None
    cache_salt: str | None = None
    policy: PrefetchPolicy = PrefetchPolicy.WAIT_COMPLETE
    timeout_ms: TimeoutMs = 1000.0


class LoadBackRequest(msgspec.Struct, frozen=True, tag="load_back", forbid_unknown_fields=True):
    """L3 -> L2 -> L1 for one request, spliced into the tree and compared with the store's bytes. Answered with
    `RequestResult`."""

    tokens: list[Token]
    extra_key: str | None = None
    cache_salt: str | None = None
    policy: PrefetchPolicy = PrefetchPolicy.WAIT_COMPLETE
    timeout_ms: TimeoutMs = 1000.0


class NamespacesRequest(msgspec.Struct, frozen=True, tag="ns_ls", forbid_unknown_fields=True):
    """Namespaces of the cache and its store with per-tier occupancy. Answered with `NamespaceList`."""


class AuditRequest(msgspec.Struct, frozen=True, tag="audit", forbid_unknown_fields=True):
    """The ownership and structure audit of the live cache. Answered with `kvcache.types.reports.AuditReport`."""


class SnapshotRequest(msgspec.Struct, frozen=True, tag="snapshot", forbid_unknown_fields=True):
    """The ownership snapshot of the live cache now. Answered with `SnapshotData`: the client writes the file (the
    server writes no path a client names)."""


class StatsRequest(msgspec.Struct, frozen=True, tag="stats", forbid_unknown_fields=True):
    """Cache and store figures. Answered with `LiveStats`."""


class EvictRequest(msgspec.Struct, frozen=True, tag="evict", forbid_unknown_fields=True):
    """Evict a namespace's unlocked pages from L1 and/or L2 (its L3 pages stay). Answered with `EvictOutcome`."""

    extra_key: str | None = None
    cache_salt: str | None = None
    device: bool = True
    host: bool = True


class DropRequest(msgspec.Struct, frozen=True, tag="ns_drop", forbid_unknown_fields=True):
    """Offboard a namespace from every tier without writing any of it back (`TieredCache.drop_namespace`).
    Answered with `kvcache.types.results.NamespaceDrop`. Named by extra_key and salt, or without the salt by
    `id` (the display id `kvc ns ls` prints) or `fingerprint` (with `extra_key` to narrow it): then the
    namespace is looked for among those the cache holds and those its store records."""

    extra_key: str | None = None
    cache_salt: str | None = None
    id: str | None = None  # 16 hex digits: a display id (FingerprintKey.display_id)
    fingerprint: str | None = None  # the salt fingerprint, as `kvc ns ls` prints it
    dry_run: bool = False  # change nothing: answer what would go (pages per tier, running requests)


class SharesRequest(msgspec.Struct, frozen=True, tag="ns_quota", forbid_unknown_fields=True):
    """Set a namespace's shares per tier (`TieredCache.set_shares`: applied now, written to the cache's store);
    `Shares()` clears them. Answered with `SharesOutcome`."""

    shares: Shares
    extra_key: str | None = None
    cache_salt: str | None = None


class ExpireRequest(msgspec.Struct, frozen=True, tag="ns_expire", forbid_unknown_fields=True):
    """Expire a namespace now by the cache's TTL rules (`TieredCache.expire_namespace`): dropped from every tier,
    or deferred until its running requests end. Answered with `kvcache.types.results.NamespaceExpiry`; a cache
    without a TTL policy answers `InvalidInput`."""

    extra_key: str | None = None
    cache_salt: str | None = None


class DumpRequest(msgspec.Struct, frozen=True, tag="ns_dump", forbid_unknown_fields=True):
    """One tier of the live cache as the KV events a router would have received (`kvc ns dump --socket`,
    `kvcache.ops.dump`): the device or host tier in one answer (bounded by its pool), the store a chunk of at most
    `max_pages` pages from `cursor` on (None: from the start). Answered with `DumpChunk`."""

    tier: DumpTier
    medium_names: MediumNames = MediumNames.KVC  # the words of `medium`, as `kvc serve --events-medium-names`
    cursor: DumpCursor | None = None
    max_pages: Annotated[int, msgspec.Meta(ge=1, le=CHUNK_MAX_PAGES)] = 4096


class ProbeRequest(msgspec.Struct, frozen=True, tag="ns_probe", forbid_unknown_fields=True):
    """How many pages of a prompt (`tokens`, in the namespace of `extra_key` and the salt) or of a chain of page
    hashes (`page_hashes`, as the KV events carry them) each tier of the live cache would serve, as an admission
    now would: the device prefix, the host pages after it, the store's pages after those. Answered with
    `TierProbe`; reads only (no hit, no access time, no node split)."""

    tokens: list[Token] | None = None
    page_hashes: list[PageHash] | None = None
    extra_key: str | None = None
    cache_salt: str | None = None  # with tokens: derives the namespace on the server; never echoed


class ExplainRequest(msgspec.Struct, frozen=True, tag="explain", forbid_unknown_fields=True):
    """Why one request would miss, tier by tier (`TieredCache.explain`: L1, L2 and L3, and how the last prefetch of
    its prefix ended). Reads only. Answered with `kvcache.types.explain.Explanation`."""

    tokens: list[Token]
    extra_key: str | None = None
    cache_salt: str | None = None  # derives the namespace on the server; never echoed, logged or stored
    rid: str | None = None  # shown back in the answer (a trace's request id); nothing is looked up by it


class ReplayJob(msgspec.Struct):
    """A trace to replay through the cache (answered with `ReplayOutcome`). Live mode builds one from a replay
    upload, validated on a connection thread and read again line by line from the upload while it runs, with the
    options of the upload's last chunk."""

    trace: Iterable[TraceRequest]
    requests: int
    verify: bool
    batch: int
    lookahead: int
    snapshot: bool  # answer the ownership snapshot taken right after the replay with its report
    explain: bool = False  # answer each request's line too (`ReplayOutcome.requests`, `kvc replay --requests-out`)


# --- results -------------------------------------------------------------------------------------------------


class TierUse(msgspec.Struct, frozen=True):
    """What one namespace holds in one tier."""

    pages: int = 0
    tokens: int = 0
    bytes: int = 0


class NamespaceTiers(msgspec.Struct, frozen=True):
    """One namespace's occupancy of the three tiers (L3: the store's registry, shared with other processes)."""

    device: TierUse
    host: TierUse
    storage: TierUse


class RequestResult(msgspec.Struct):
    """What a live prefetch, stage or load-back did: the fields of the offline `kvc prefetch|stage|load-back
    --json` (DESIGN §8), plus the namespace's tier occupancy after the command (`tiers`)."""

    command: str  # "prefetch", "stage" or "load-back"
    namespace: NamespaceInfo
    requested_tokens: int
    hit_tokens: int  # prefetch/stage: tokens that landed in L2; load-back: tokens cached on the device
    pages: int
    bytes: int
    seconds: float
    declined: str | None = None
    prefixes: int = 0
    staged: StagedView | None = None
    loaded_back_tokens: int = 0
    # load-back: its device pages checked against the store's copies. `verified_tokens`: tokens of the pages
    # compared; `verify_mismatches`: pages whose stored bytes differ from the device's (or do not read back) — the
    # failure, exit 1; `verify_absent`: pages the store does not hold (not written yet under write-back, a write in
    # flight, dropped from L3), so not compared — not a failure
    verified_tokens: int = 0
    verify_mismatches: int = 0
    verify_absent: int = 0
    tiers: NamespaceTiers | None = None


class LiveNamespace(msgspec.Struct):
    """One namespace of a live cache: the offline `kvc ns ls --json` row (L3 figures from the store's registry)
    and per-tier occupancy."""

    extra_key: str | None
    salt_fingerprint: str | None
    id: DisplayId  # the namespace id keyed by the fingerprint key (never the raw id)
    pages: int  # in L3
    tokens: int
    bytes: int
    hits: int
    created: float
    last_access: float
    device: TierUse
    host: TierUse
    storage: TierUse
    shares: Shares | None = None  # the namespace's shares per tier (kvcache.types.shares); None: it has none
    # the cache's TTL policy (kvcache.engine.ttl): when the namespace expires, in epoch seconds like `last_access`; None
    # when it is not tracked (no policy, or not used by this cache since it started)
    deadline: float | None = None
    expiry_deferred: bool = False  # past its deadline, waiting for its running requests to end


class SharesOutcome(msgspec.Struct, frozen=True):
    """The shares a live cache applies to a namespace now (`kvc ns quota set|clear --socket`), and what the
    namespace holds in each tier."""

    namespace: NamespaceInfo
    id: str  # display_id
    shares: Shares  # all zero: cleared
    tiers: NamespaceTiers
    previous: Shares | None = None  # the shares it had before (None: none, so a clear changed nothing)


class NamespaceList(msgspec.Struct):
    """Namespaces of a live cache and its store."""

    store: str  # the store's location ("" without a store)
    namespaces: list[LiveNamespace]


class SnapshotData(msgspec.Struct, frozen=True):
    """A live cache's ownership snapshot, as the bytes of its file (`kvcache.diagnostics.snapshot`), for the client
    to write."""

    created: float
    nodes: int
    holders: int
    data: bytes


class PoolUse(msgspec.Struct, frozen=True):
    """One pool's occupancy."""

    pages: int  # capacity
    used_pages: int
    tokens: int  # capacity
    used_tokens: int
    bytes: int  # capacity
    used_bytes: int


class LiveStats(msgspec.Struct):
    """A live cache's figures: its pools, what is in flight, its statistics, and its store's."""

    layout: KVLayout
    device: PoolUse
    host: PoolUse | None
    live_requests: int
    inflight_copies: int
    prefetches: int
    staged: int
    storage_writes: int
    cache: CacheStats
    store: StoreStats | None
    layout_list: list[KVLayout]  # the layouts the store holds (as in offline `kvc stats --json`)


class EvictOutcome(msgspec.Struct, frozen=True):
    """What evicting a namespace from L1/L2 freed, and what the namespace holds after."""

    namespace: NamespaceInfo
    device_pages: int
    host_pages: int
    tiers: NamespaceTiers


class ReplayOutcome(msgspec.Struct, omit_defaults=True):
    """What a live replay answers: its report, and the snapshot taken right after it when asked for. Defaults are
    left out of the frame (omit_defaults): an answer without lines is the bytes it was before `requests`."""

    # A typed value since reports are values (kvcache.types.reports, no torch). It once travelled as msgspec.Raw,
    # decoded on demand, because the report lived with the torch-importing replay driver; the bytes on the wire are
    # the same either way: a Raw field embeds the report's msgpack exactly as a typed field encodes it.
    report: ReplayReport
    snapshot: SnapshotData | None = None
    # with `explain`: one line per admitted or refused request, in order (`kvcache.types.explain.Explanation`)
    requests: list[Explanation] = []

    def replay_report(self) -> ReplayReport:
        """The report (kept for callers written when it arrived as raw bytes to decode)."""
        return self.report


class DumpChunk(msgspec.Struct):
    """A chunk of a live dump: the `BlockStored` events of `pages` pages of one tier, and where the next chunk begins
    (`cursor`, sent back as it came; None: the tier is done)."""

    events: list[BlockStored]
    pages: int
    cursor: DumpCursor | None = None


class TierServe(msgspec.Struct, frozen=True):
    """What one tier would serve of a probed prompt: whole pages, and their tokens."""

    pages: int = 0
    tokens: int = 0


class TierProbe(msgspec.Struct):
    """What each tier of a live cache would serve of a probed prompt or hash chain, in order: the device prefix,
    the host pages after it, the store's pages after those (`kvc ns probe --socket`)."""

    page_size: int
    pages: int  # whole pages probed
    device: TierServe
    host: TierServe
    storage: TierServe
    namespace: NamespaceInfo | None = None  # of a probed prompt (its salt as a fingerprint); None for hashes


class ServerInfo(msgspec.Struct, frozen=True):
    """Who answers on the socket."""

    version: int  # PROTOCOL_VERSION
    pid: int
    layout: KVLayout
    store: str  # location, "" without a store
    device_tokens: int
    host_tokens: int
    host_mode: str
    prefetch_policy: str
    write_policy: str
