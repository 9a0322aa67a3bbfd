"""The admin socket's wire protocol: versioned, length-prefixed msgpack frames of msgspec structs (DESIGN §7).

A frame is a 4-byte big-endian body length, then the msgpack body. A client sends one `Envelope` per frame — the
protocol version, a request id it chooses, and one request of the tagged union `AdminRequest` — and reads one
`Response` per frame: the same version and id, and either `result` (the msgpack of the request's result struct,
decoded by the client with the type it expects) or `error` (a kind and a one-line message).

Request frames are bounded (`MAX_REQUEST_BYTES`): a larger length prefix is answered with an error and the
connection is closed, since the rest of the stream can no longer be framed. A trace for `replay` larger than one
frame is sent as several `ReplayRequest` chunks on one connection (`more=True` on all but the last); the server
concatenates them (up to `MAX_TRACE_BYTES`) and runs the whole trace once the last arrives.

Every number a request carries is range-checked by its type (finite, bounded: a `timeout_ms` of `inf` or 1e300
is a `bad_request`, not a wait that overflows), and a frame's nesting is bounded: the head of a frame is read by a
small iterative reader that refuses nesting past `MAX_FRAME_DEPTH`, and the body is decoded into typed structs,
which refuse a container where a scalar belongs at once (no recursion into what the types do not expect).

Snapshots travel back to the client as bytes (`SnapshotData`, `ReplayOutcome.snapshot`): the server writes no
file a client names.

The salt of a namespace travels in requests only (to derive the namespace on the server); no result carries it.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Annotated, Union

import msgspec

from ..types.config import PrefetchPolicy
from ..errors import AdminBadFrame
from ..types.layout import KVLayout
from ..types.namespace import NamespaceInfo
from ..types.shares import Shares
from ..types.results import StagedView
from ..types.stats import CacheStats
from ..storage.api import StoreStats

PROTOCOL_VERSION = 2  # 2: snapshots come back as bytes (no server-side path); bounded numbers
MAX_REQUEST_BYTES = 1 << 20  # a request frame's body: 1 MiB (a 200k-token request fits)
MAX_RESPONSE_BYTES = 256 << 20  # a response frame's body, as the client accepts it (audits can list much)
MAX_TRACE_BYTES = 256 << 20  # a replay trace, all chunks together
TRACE_CHUNK_BYTES = MAX_REQUEST_BYTES - 4096  # trace bytes per replay chunk, leaving room for the envelope
MAX_FRAME_DEPTH = 16  # nesting of containers in a frame (a request needs 4)
MAX_TIMEOUT_MS = 3_600_000.0  # an hour: the longest wait a request may ask for
MAX_PAGES = 1 << 31
MAX_BYTES = 1 << 50

_LENGTH = struct.Struct(">I")

Token = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]
Pages = Annotated[int, msgspec.Meta(ge=0, le=MAX_PAGES)]
Bytes = Annotated[int, msgspec.Meta(ge=0, le=MAX_BYTES)]
TimeoutMs = Annotated[float, msgspec.Meta(ge=0, le=MAX_TIMEOUT_MS)]  # rejects nan and inf too
RequestId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]


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
    """The ownership and structure audit of the live cache. Answered with `kvcache.diagnostics.audit.AuditReport`."""


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
    Answered with `kvcache.engine.cache.NamespaceDrop`."""

    extra_key: str | None = None
    cache_salt: str | None = None


class SharesRequest(msgspec.Struct, frozen=True, tag="ns_quota", forbid_unknown_fields=True):
    """Set a namespace's shares per tier (`TieredCache.set_shares`: applied now, written to the cache's store);
    `Shares()` clears them. Answered with `SharesOutcome`."""

    shares: Shares
    extra_key: str | None = None
    cache_salt: str | None = None


class ExpireRequest(msgspec.Struct, frozen=True, tag="ns_expire", forbid_unknown_fields=True):
    """Expire a namespace now by the cache's TTL rules (`TieredCache.expire_namespace`): dropped from every tier,
    or deferred until its running requests end. Answered with `kvcache.engine.ttl.NamespaceExpiry`; a cache without a
    TTL policy answers `InvalidInput`."""

    extra_key: str | None = None
    cache_salt: str | None = None


class ReplayRequest(msgspec.Struct, frozen=True, tag="replay", forbid_unknown_fields=True):
    """A chunk of a JSONL trace for the live cache to replay. Chunks split the trace's bytes anywhere; all but
    the last carry `more=True` and are answered with `ReplayAck`; the last is answered with
    `kvcache.workload.replay.ReplayReport` once the whole trace ran. The options of the last chunk apply."""

    chunk: bytes
    more: bool = False
    verify: bool = False
    batch: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 4
    lookahead: Annotated[int, msgspec.Meta(ge=0, le=65536)] = 8
    snapshot: bool = False  # send the ownership snapshot taken right after the replay back with its report


AdminRequest = Union[PingRequest, PrefetchRequest, StageRequest, LoadBackRequest, NamespacesRequest, AuditRequest,
                     SnapshotRequest, StatsRequest, EvictRequest, DropRequest, SharesRequest, ExpireRequest,
                     ReplayRequest]


class Envelope(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One request frame."""

    v: int  # PROTOCOL_VERSION of the sender
    id: RequestId  # chosen by the client, echoed in the response
    request: AdminRequest


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


class NamespaceList(msgspec.Struct):
    """Namespaces of a live cache and its store."""

    store: str  # the store's location ("" without a store)
    namespaces: list[LiveNamespace]


class SnapshotData(msgspec.Struct, frozen=True):
    """A live cache's ownership snapshot, as the bytes of its file (`kvcache.diagnostics.snapshot`), for the client to write."""

    created: float
    nodes: int
    holders: int
    data: bytes


class SnapshotResult(msgspec.Struct, frozen=True):
    """Where the client wrote a live snapshot and what it holds (`kvc snapshot --json`)."""

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


class ReplayOutcome(msgspec.Struct):
    """What a live replay answers: its report, and the snapshot taken right after it when asked for."""

    # a kvcache.workload.replay.ReplayReport, msgpack-encoded: decoding it needs the replay driver, which imports torch,
    # and the protocol is imported by commands that must start without it
    report: msgspec.Raw
    snapshot: SnapshotData | None = None

    def replay_report(self):
        """The report, decoded (`kvcache.workload.replay.ReplayReport`; imports the replay driver)."""
        from ..types.reports import ReplayReport

        return msgspec.msgpack.decode(self.report, type=ReplayReport)


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
    """(version, id) of a frame body, read before the body is trusted; `AdminBadFrame` when it is not a msgpack
    map, or nests deeper than MAX_FRAME_DEPTH before its head. A missing field reads as 0."""
    found = _read_head(body)
    return found.get("v", 0), found.get("id", 0)


_FIXED = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2,
          0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}  # tag -> bytes after it
_SIZED = {0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0), 0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1), 0xD9: (1, 0),
          0xDA: (2, 0), 0xDB: (4, 0)}  # tag -> (length bytes, ext type bytes): bin, ext, str
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}  # tag -> (count bytes, items per count)
_INTS = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}


def _header(body: bytes, pos: int) -> tuple[int, int, int]:
    """One msgpack value header at `pos`: (position after the header, items a container holds or -1, position
    after the whole value when it is no container)."""
    if pos >= len(body):
        raise AdminBadFrame("", "not a kvc admin frame: truncated msgpack")
    tag = body[pos]
    if tag <= 0x7F or tag >= 0xE0:
        return pos + 1, -1, pos + 1
    if 0x80 <= tag <= 0x8F:
        return pos + 1, 2 * (tag & 0x0F), -1
    if 0x90 <= tag <= 0x9F:
        return pos + 1, tag & 0x0F, -1
    if 0xA0 <= tag <= 0xBF:
        return pos + 1, -1, pos + 1 + (tag & 0x1F)
    if tag in _FIXED:
        return pos + 1, -1, pos + 1 + _FIXED[tag]
    if tag in _SIZED:
        width, ext = _SIZED[tag]
        n = int.from_bytes(body[pos + 1:pos + 1 + width], "big")
        return pos + 1, -1, pos + 1 + width + ext + n
    if tag in _CONTAINERS:
        width, per = _CONTAINERS[tag]
        return pos + 1 + width, per * int.from_bytes(body[pos + 1:pos + 1 + width], "big"), -1
    raise AdminBadFrame("", f"not a kvc admin frame: byte {tag:#x} starts no msgpack value")


def _skip(body: bytes, pos: int) -> int:
    """The position after the value at `pos`, walked iteratively; `AdminBadFrame` past MAX_FRAME_DEPTH."""
    pending = [1]  # values still to skip, per open container
    while pending:
        if pending[-1] == 0:
            pending.pop()
            continue
        pending[-1] -= 1
        after_header, items, end = _header(body, pos)
        if items < 0:
            pos = end
        else:
            if len(pending) > MAX_FRAME_DEPTH:
                raise AdminBadFrame("", f"a frame nested deeper than {MAX_FRAME_DEPTH} levels")
            pos = after_header
            pending.append(items)
    if pos > len(body):
        raise AdminBadFrame("", "not a kvc admin frame: truncated msgpack")
    return pos


def _read_head(body: bytes) -> dict[str, int]:
    """The integer fields `v` and `id` of the top-level map of a frame, skipping (iteratively) what comes before
    them: a kvc client writes them first, so a well-formed frame costs two fields."""
    pos, items, _ = _header(body, 0)
    if items < 0 or not (0x80 <= body[0] <= 0x8F or body[0] in (0xDE, 0xDF)):
        raise AdminBadFrame("", "not a kvc admin frame: Expected `object`")
    found: dict[str, int] = {}
    for _ in range(items // 2):
        key_start = pos
        pos = _skip(body, pos)
        key = body[key_start:pos]
        name = key[1:].decode("utf-8", "replace") if key and 0xA0 <= key[0] <= 0xBF else None
        value_start = pos
        pos = _skip(body, pos)
        if name in ("v", "id"):
            tag = body[value_start]
            if tag <= 0x7F:
                found[name] = tag
            elif tag in _INTS:
                found[name] = struct.unpack_from(_INTS[tag], body, value_start + 1)[0]
            elif tag >= 0xE0:
                found[name] = tag - 0x100
            else:
                raise AdminBadFrame("", f"not a kvc admin frame: `{name}` is not an integer")
            if len(found) == 2:
                break
    return found


_ENVELOPE = msgspec.msgpack.Decoder(Envelope)
_RESPONSE = msgspec.msgpack.Decoder(Response)
_ENCODER = msgspec.msgpack.Encoder()


def decode_envelope(body: bytes) -> Envelope:
    """A request frame's body as an `Envelope`; `AdminBadFrame` naming what is wrong (never a field's value)."""
    try:
        return _ENVELOPE.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise AdminBadFrame("", f"bad request: {exc}") from None
    except RecursionError:  # typed decoding refuses unexpected containers at once; this is a last guard
        raise AdminBadFrame("", f"a frame nested deeper than {MAX_FRAME_DEPTH} levels") from None


def decode_response(body: bytes) -> Response:
    """A response frame's body; `AdminBadFrame` when it is not one."""
    try:
        return _RESPONSE.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise AdminBadFrame("", f"bad response: {exc}") from None
    except RecursionError:
        raise AdminBadFrame("", f"a response nested deeper than {MAX_FRAME_DEPTH} levels") from None


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


def _read_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes | None:
    """Exactly n bytes, or None when the peer closed before the first one; `Truncated` when it closed after.
    With a `deadline` (time.monotonic()), a socket timeout is raised once it passes, however the bytes trickle."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout(f"frame not complete in time ({len(buf)} of {n} bytes)")
            sock.settimeout(left)
        part = sock.recv(min(n - len(buf), 1 << 20))
        if not part:
            if not buf:
                return None
            raise Truncated(f"connection closed after {len(buf)} of {n} bytes")
        buf += part
    return bytes(buf)


def read_frame(sock: socket.socket, limit: int, frame_seconds: float | None = None) -> bytes | None:
    """The body of the next frame, or None at a clean end of stream (between frames). Raises `FrameTooLarge`
    before reading a body over `limit`, `Truncated` when the stream ends inside a frame, and the socket's own
    errors (timeouts included). With `frame_seconds`, the rest of a frame must arrive within that many seconds
    of its first byte (a peer trickling a frame byte by byte cannot hold a reader forever); the wait for the first
    byte is the socket's own timeout."""
    first = _read_exact(sock, 1)
    if first is None:
        return None
    deadline = None if frame_seconds is None else time.monotonic() + frame_seconds
    rest = _read_exact(sock, _LENGTH.size - 1, deadline)
    if rest is None:
        raise Truncated("connection closed inside a length prefix")
    (length,) = _LENGTH.unpack(first + rest)
    if length > limit:
        raise FrameTooLarge(length, limit)
    body = _read_exact(sock, length, deadline) if length else b""
    if body is None:
        raise Truncated(f"connection closed before a body of {length} bytes")
    return body
