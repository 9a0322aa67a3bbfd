"""The admin socket's wire protocol: versioned, length-prefixed msgpack frames of msgspec structs (DESIGN §7).

A frame is a 4-byte big-endian body length, then the msgpack body. A client sends one `Envelope` per frame — the
protocol version, a request id it chooses, and one request of the tagged union `AdminRequest` — and reads one
`Response` per frame: the same version and id, and either `result` (the msgpack of the request's result struct,
decoded by the client with the type it expects) or `error` (a kind and a one-line message).

Request frames are bounded (`MAX_REQUEST_BYTES`): a larger length prefix is answered with an error and the
connection is closed, since the rest of the stream can no longer be framed. A trace for `replay` larger than one
frame is sent as several `ReplayRequest` chunks on one connection (`more=True` on all but the last); the server
concatenates them (up to `MAX_TRACE_BYTES`) and runs the whole trace once the last arrives.

The salt of a namespace travels in requests only (to derive the namespace on the server); no result carries it.
"""

from __future__ import annotations

import socket
import struct
from typing import Annotated, Union

import msgspec

from .config import PrefetchPolicy
from .errors import AdminBadFrame
from .layout import KVLayout
from .namespace import NamespaceInfo
from .staging import StagedView
from .stats import CacheStats
from .storage.base import StoreStats

PROTOCOL_VERSION = 1
MAX_REQUEST_BYTES = 1 << 20  # a request frame's body: 1 MiB (a 200k-token request fits)
MAX_RESPONSE_BYTES = 256 << 20  # a response frame's body, as the client accepts it (audits can list much)
MAX_TRACE_BYTES = 256 << 20  # a replay trace, all chunks together
TRACE_CHUNK_BYTES = MAX_REQUEST_BYTES - 4096  # trace bytes per replay chunk, leaving room for the envelope

_LENGTH = struct.Struct(">I")

Token = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]
Pages = Annotated[int, msgspec.Meta(ge=0)]


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
    max_bytes: Pages | None = None
    policy: PrefetchPolicy = PrefetchPolicy.WAIT_COMPLETE  # how this prefetch is settled (not the cache's policy)
    timeout_ms: Annotated[float, msgspec.Meta(ge=0)] = 1000.0


class StageRequest(msgspec.Struct, frozen=True, tag="stage", forbid_unknown_fields=True):
    """Buffer mode: prefetch one request and show its staged record. Answered with `RequestResult`."""

    tokens: list[Token]
    extra_key: str | None = None
    cache_salt: str | None = None
    policy: PrefetchPolicy = PrefetchPolicy.WAIT_COMPLETE
    timeout_ms: Annotated[float, msgspec.Meta(ge=0)] = 1000.0


class LoadBackRequest(msgspec.Struct, frozen=True, tag="load_back", forbid_unknown_fields=True):
    """L3 -> L2 -> L1 for one request, spliced into the tree and compared with the store's bytes. Answered with
    `RequestResult`."""

    tokens: list[Token]
    extra_key: str | None = None
    cache_salt: str | None = None
    policy: PrefetchPolicy = PrefetchPolicy.WAIT_COMPLETE
    timeout_ms: Annotated[float, msgspec.Meta(ge=0)] = 1000.0


class NamespacesRequest(msgspec.Struct, frozen=True, tag="ns_ls", forbid_unknown_fields=True):
    """Namespaces of the cache and its store with per-tier occupancy. Answered with `NamespaceList`."""


class AuditRequest(msgspec.Struct, frozen=True, tag="audit", forbid_unknown_fields=True):
    """The ownership and structure audit of the live cache. Answered with `kvcache.audit.AuditReport`."""


class SnapshotRequest(msgspec.Struct, frozen=True, tag="snapshot", forbid_unknown_fields=True):
    """Write the ownership snapshot to `path` (absolute: the server's working directory is not the client's).
    Answered with `SnapshotResult`."""

    path: str


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
    Answered with `kvcache.cache.NamespaceDrop`."""

    extra_key: str | None = None
    cache_salt: str | None = None


class ReplayRequest(msgspec.Struct, frozen=True, tag="replay", forbid_unknown_fields=True):
    """A chunk of a JSONL trace for the live cache to replay. Chunks split the trace's bytes anywhere; all but
    the last carry `more=True` and are answered with `ReplayAck`; the last is answered with
    `kvcache.replay.ReplayReport` once the whole trace ran. The options of the last chunk apply."""

    chunk: bytes
    more: bool = False
    verify: bool = False
    batch: Annotated[int, msgspec.Meta(ge=1)] = 4
    lookahead: Annotated[int, msgspec.Meta(ge=0)] = 8
    snapshot_out: str | None = None  # absolute path: write the ownership snapshot there after the replay


AdminRequest = Union[PingRequest, PrefetchRequest, StageRequest, LoadBackRequest, NamespacesRequest, AuditRequest,
                     SnapshotRequest, StatsRequest, EvictRequest, DropRequest, ReplayRequest]


class Envelope(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One request frame."""

    v: int  # PROTOCOL_VERSION of the sender
    id: int  # chosen by the client, echoed in the response
    request: AdminRequest


class _Head(msgspec.Struct):
    """What is read of any frame before its body is trusted: the version (and id, to answer)."""

    v: int = 0
    id: int = 0


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
    verified_tokens: int = 0
    verify_mismatches: int = 0
    tiers: NamespaceTiers | None = None


class LiveNamespace(msgspec.Struct):
    """One namespace of a live cache: the offline `kvc ns ls --json` row (L3 figures from the store's registry)
    and per-tier occupancy."""

    extra_key: str | None
    salt_fingerprint: str | None
    id: str  # display_id: the namespace id keyed by the fingerprint key (never the raw id)
    pages: int  # in L3
    tokens: int
    bytes: int
    hits: int
    created: float
    last_access: float
    device: TierUse
    host: TierUse
    storage: TierUse


class NamespaceList(msgspec.Struct):
    """Namespaces of a live cache and its store."""

    store: str  # the store's location ("" without a store)
    namespaces: list[LiveNamespace]


class SnapshotResult(msgspec.Struct, frozen=True):
    """Where a live snapshot was written and what it holds."""

    path: str
    bytes: int
    created: float
    nodes: int
    holders: int


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


class ReplayAck(msgspec.Struct, frozen=True):
    """A replay chunk was received; the trace runs when the last one arrives."""

    received_bytes: int  # of the trace so far


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


# --- responses -----------------------------------------------------------------------------------------------


class ErrorInfo(msgspec.Struct, frozen=True):
    """Why a request failed: a kind (`bad_frame`, `bad_request`, `protocol_version`, `busy`, `shutting_down`,
    `internal`, or the name of the kvcache error raised) and one line."""

    kind: str
    message: str


_NIL = msgspec.Raw(b"\xc0")  # msgpack nil: the result of an error response


class Response(msgspec.Struct, frozen=True):
    """One response frame: `result` (msgpack of the request's result struct) unless `error` is set."""

    v: int
    id: int
    result: msgspec.Raw = _NIL
    error: ErrorInfo | None = None


def head_of(body: bytes) -> tuple[int, int]:
    """(version, id) of a frame body; `AdminBadFrame` when it is not a msgpack map."""
    try:
        head = msgspec.msgpack.decode(body, type=_Head)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise AdminBadFrame("", f"not a kvc admin frame: {exc}") from None
    return head.v, head.id


_ENVELOPE = msgspec.msgpack.Decoder(Envelope)
_RESPONSE = msgspec.msgpack.Decoder(Response)
_ENCODER = msgspec.msgpack.Encoder()


def decode_envelope(body: bytes) -> Envelope:
    """A request frame's body as an `Envelope`; `AdminBadFrame` naming what is wrong (never a field's value)."""
    try:
        return _ENVELOPE.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise AdminBadFrame("", f"bad request: {exc}") from None


def decode_response(body: bytes) -> Response:
    """A response frame's body; `AdminBadFrame` when it is not one."""
    try:
        return _RESPONSE.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise AdminBadFrame("", f"bad response: {exc}") from None


def encode(value: object) -> bytes:
    """msgpack of a struct (a result, before it is wrapped as `Response.result`)."""
    return _ENCODER.encode(value)


def frame(message: object) -> bytes:
    """A whole frame: the length prefix and the msgpack body of `message`."""
    body = _ENCODER.encode(message)
    return _LENGTH.pack(len(body)) + body


class FrameTooLarge(Exception):
    """A length prefix over the reader's limit (internal to the framing: the server answers, then closes)."""

    def __init__(self, length: int, limit: int) -> None:
        self.length, self.limit = length, limit
        super().__init__(f"frame of {length} bytes is over the limit of {limit} bytes")


class Truncated(Exception):
    """The peer closed the connection inside a frame (internal to the framing)."""


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    """Exactly n bytes, or None when the peer closed before the first one; `Truncated` when it closed after."""
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(min(n - len(buf), 1 << 20))
        if not part:
            if not buf:
                return None
            raise Truncated(f"connection closed after {len(buf)} of {n} bytes")
        buf += part
    return bytes(buf)


def read_frame(sock: socket.socket, limit: int) -> bytes | None:
    """The body of the next frame, or None at a clean end of stream (between frames). Raises `FrameTooLarge`
    before reading a body over `limit`, `Truncated` when the stream ends inside a frame, and the socket's own
    errors (timeouts included)."""
    prefix = _read_exact(sock, _LENGTH.size)
    if prefix is None:
        return None
    (length,) = _LENGTH.unpack(prefix)
    if length > limit:
        raise FrameTooLarge(length, limit)
    body = _read_exact(sock, length) if length else b""
    if body is None:
        raise Truncated(f"connection closed before a body of {length} bytes")
    return body
