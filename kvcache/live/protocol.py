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

from ..errors import AdminBadFrame

# The requests and their results are values of kvcache.ops (what the handlers take and return, offline too); the
# socket frames them, and re-exports them so that a client finds the whole wire format here.
from ..ops.requests import (
    MAX_BYTES,
    MAX_PAGES,
    MAX_TIMEOUT_MS,
    PROTOCOL_VERSION,
    AuditRequest,
    Bytes,
    DropRequest,
    DumpChunk,
    DumpRequest,
    EvictOutcome,
    EvictRequest,
    ExpireRequest,
    ExplainRequest,
    LiveNamespace,
    LiveStats,
    LoadBackRequest,
    NamespaceList,
    NamespacesRequest,
    NamespaceTiers,
    Pages,
    PingRequest,
    PoolUse,
    PrefetchRequest,
    ProbeRequest,
    ReplayOutcome,
    RequestResult,
    ServerInfo,
    SharesOutcome,
    SharesRequest,
    SnapshotData,
    SnapshotRequest,
    StageRequest,
    StatsRequest,
    TierProbe,
    TierServe,
    TierUse,
    TimeoutMs,
    Token,
)

MAX_REQUEST_BYTES = 1 << 20  # a request frame's body: 1 MiB (a 200k-token request fits)
MAX_RESPONSE_BYTES = 256 << 20  # a response frame's body, as the client accepts it (audits can list much)
MAX_TRACE_BYTES = 256 << 20  # a replay trace, all chunks together
TRACE_CHUNK_BYTES = MAX_REQUEST_BYTES - 4096  # trace bytes per replay chunk, leaving room for the envelope
MAX_FRAME_DEPTH = 16  # nesting of containers in a frame (a request needs 4)

_LENGTH = struct.Struct(">I")

RequestId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]


# --- requests: the union of kvcache.ops.requests' and the replay upload, in one envelope -------------------------


class ReplayRequest(msgspec.Struct, frozen=True, tag="replay", forbid_unknown_fields=True, omit_defaults=True):
    """A chunk of a JSONL trace for the live cache to replay. Chunks split the trace's bytes anywhere; all but
    the last carry `more=True` and are answered with `ReplayAck`; the last is answered with `ReplayOutcome` (the
    replay's report) once the whole trace ran. The options of the last chunk apply."""

    chunk: bytes
    more: bool = False
    verify: bool = False
    batch: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 4
    lookahead: Annotated[int, msgspec.Meta(ge=0, le=65536)] = 8
    snapshot: bool = False  # send the ownership snapshot taken right after the replay back with its report
    # Send each request's line back with the report (`ReplayOutcome.requests`). Added after protocol version 2 was
    # pinned: defaults are left out of the frame (omit_defaults), so a replay that does not ask for lines is a frame
    # every version-2 server decodes.
    explain: bool = False


AdminRequest = Union[PingRequest, PrefetchRequest, StageRequest, LoadBackRequest, NamespacesRequest, AuditRequest,
                     SnapshotRequest, StatsRequest, EvictRequest, DropRequest, SharesRequest, ExpireRequest,
                     DumpRequest, ProbeRequest, ExplainRequest, ReplayRequest]


class Envelope(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One request frame."""

    v: int  # PROTOCOL_VERSION of the sender
    id: RequestId  # chosen by the client, echoed in the response
    request: AdminRequest


# --- results of the socket's own: the client's record of a snapshot it wrote, a replay chunk's receipt ---------


class SnapshotResult(msgspec.Struct, frozen=True):
    """Where the client wrote a live snapshot and what it holds (`kvc snapshot --json`)."""

    path: str
    bytes: int
    created: float
    nodes: int
    holders: int


class ReplayAck(msgspec.Struct, frozen=True):
    """A replay chunk was received; the trace runs when the last one arrives."""

    received_bytes: int  # of the trace so far


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


__all__ = [
    # the frames and their limits
    "MAX_REQUEST_BYTES", "MAX_RESPONSE_BYTES", "MAX_TRACE_BYTES", "TRACE_CHUNK_BYTES", "MAX_FRAME_DEPTH", "RequestId",
    "AdminRequest", "Envelope", "Response", "ErrorInfo", "ReplayRequest", "ReplayAck", "SnapshotResult", "head_of",
    "decode_envelope", "decode_response", "encode", "frame", "read_frame", "FrameTooLarge", "Truncated",
    # the requests and results of kvcache.ops.requests, re-exported
    "PROTOCOL_VERSION", "MAX_BYTES", "MAX_PAGES", "MAX_TIMEOUT_MS", "Bytes", "Pages", "TimeoutMs", "Token",
    "PingRequest", "PrefetchRequest", "StageRequest", "LoadBackRequest", "NamespacesRequest", "AuditRequest",
    "SnapshotRequest", "StatsRequest", "EvictRequest", "DropRequest", "SharesRequest", "ExpireRequest",
    "EvictOutcome", "LiveNamespace", "LiveStats", "NamespaceList", "NamespaceTiers", "PoolUse", "ReplayOutcome",
    "RequestResult", "ServerInfo", "SharesOutcome", "SnapshotData", "TierUse",
    "DumpRequest", "DumpChunk", "ProbeRequest", "TierProbe", "TierServe", "ExplainRequest",
]
