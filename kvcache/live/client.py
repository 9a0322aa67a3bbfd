"""The client end of a live cache's admin socket (DESIGN §7): one connection, one request at a time, typed errors
(`AdminUnavailable`, `AdminUntrusted`, `AdminTimeout`, `AdminProtocolMismatch`, `AdminRemoteError`,
`AdminBadFrame`) naming the socket. It imports neither torch nor the cache: `kvc --socket` commands start fast.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Generator, Iterable
from typing import IO, Any, TypeVar

import msgspec

from ..errors import (
    AdminBadFrame,
    AdminProtocolMismatch,
    AdminRemoteError,
    AdminTimeout,
    AdminUnavailable,
    AdminUntrusted,
)
from .credentials import describe_uid, peer_credentials
from .protocol import (
    MAX_REQUEST_BYTES,
    MAX_RESPONSE_BYTES,
    PROTOCOL_VERSION,
    TRACE_CHUNK_BYTES,
    Envelope,
    FrameTooLarge,
    ReplayAck,
    ReplayRequest,
    Truncated,
    decode_response,
    frame,
    head_of,
    read_frame,
)

_BUSY_RETRY_START = 0.02  # seconds before a client retries a `busy` answer (doubling, up to _BUSY_RETRY_MAX)
_BUSY_RETRY_MAX = 0.5

T = TypeVar("T")


# --- the client --------------------------------------------------------------------------------------------


class AdminClient:
    """A connection to a live cache's admin socket. One request at a time; usable as a context manager.

    The client owns one connection, opened by its first call and kept for the calls after it (a replay upload is
    per connection: its chunks must share one) until `close()` or the end of a `with` block; close it, or use
    `with`, as for a file: a client dropped while connected leaves its socket to the garbage collector (a
    ResourceWarning). A call that fails leaves the connection open only when it can still carry the next request.

    Before it sends anything, the client checks who serves the socket (SO_PEERCRED): a server whose uid is not in
    `trusted_uids` (default: this process's and root's) is refused with `AdminUntrusted`. A `busy` answer (the
    server at its connection limit) is retried within the timeout.
    """

    def __init__(self, path: str | os.PathLike[str], timeout: float | None = 30.0,
                 trusted_uids: Iterable[int] | None = None) -> None:
        self.path = os.fspath(path)
        self.timeout = timeout  # seconds to wait for each answer; None: no limit
        self.trusted_uids = frozenset(trusted_uids) if trusted_uids is not None else frozenset({os.geteuid(), 0})
        self._sock: socket.socket | None = None
        self._next_id = 1

    def __enter__(self) -> "AdminClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection (a later call reconnects)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def call(self, request: Any, result_type: type[T], timeout: float | None | bool = True) -> T:
        """Send `request`, wait for its answer and decode it as `result_type`. `timeout=True`: the client's."""
        wait = self.timeout if timeout is True else timeout
        deadline = None if wait is None else time.monotonic() + wait
        pause = _BUSY_RETRY_START
        while True:
            try:
                return self._call_once(request, result_type, wait)
            except AdminRemoteError as exc:
                if exc.kind != "busy" or (deadline is not None and time.monotonic() + pause > deadline):
                    raise
            time.sleep(pause)  # the server's connection limit: try again shortly, within the timeout
            pause = min(2 * pause, _BUSY_RETRY_MAX)

    def _call_once(self, request: Any, result_type: type[T], wait: float | None) -> T:
        ident = self._next_id
        self._next_id += 1
        data = frame(Envelope(PROTOCOL_VERSION, ident, request))
        if len(data) - 4 > MAX_REQUEST_BYTES:
            raise AdminBadFrame(self.path, f"the request is {len(data) - 4} bytes, over the admin socket's limit "
                                           f"of {MAX_REQUEST_BYTES} bytes")
        sock = self._connect()
        try:
            sock.settimeout(wait)
            try:
                sock.sendall(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server answered and closed before reading (busy, forbidden): read that answer
            body = read_frame(sock, MAX_RESPONSE_BYTES)
        except (TimeoutError, socket.timeout):
            self.close()  # the answer may still come: this connection can no longer be framed
            raise AdminTimeout(self.path, wait or 0.0) from None
        except (Truncated, FrameTooLarge, OSError) as exc:
            self.close()
            raise AdminUnavailable(self.path, f"the server dropped the connection ({exc})") from None
        except BaseException:
            self.close()  # interrupted mid-request (Ctrl-C, a bad timeout): the answer would meet the next call
            raise
        if body is None:
            self.close()
            raise AdminUnavailable(self.path, "the server closed the connection without answering")
        try:
            version, _ = head_of(body)
            if version != PROTOCOL_VERSION:
                self.close()
                raise AdminProtocolMismatch(self.path, PROTOCOL_VERSION, version)
            response = decode_response(body)
        except AdminBadFrame as exc:
            self.close()
            raise AdminBadFrame(self.path, str(exc)) from None
        if response.error is not None:
            if response.error.kind == "protocol_version":
                raise AdminProtocolMismatch(self.path, PROTOCOL_VERSION, response.v)
            if response.error.kind in ("busy", "forbidden", "shutting_down"):
                self.close()  # the server closed this connection after answering (or is about to: it is stopping)
            raise AdminRemoteError(self.path, response.error.kind, response.error.message)
        try:
            return msgspec.msgpack.decode(response.result, type=result_type)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise AdminBadFrame(self.path, f"unexpected result: {exc}") from None
        except RecursionError:
            raise AdminBadFrame(self.path, "unexpected result: nested too deep") from None

    def replay(self, trace: bytes | str | os.PathLike[str] | IO[bytes], result_type: type[T], *, verify: bool = False,
               batch: int = 4, lookahead: int = 8, snapshot: bool = False,
               timeout: float | None | bool = None, explain: bool = False) -> T:
        """Have the live cache replay a JSONL trace (its bytes, a path or a binary file, sent in chunks of at most
        one frame, never read whole); returns its answer as `result_type` (`admin_protocol.ReplayOutcome`).
        `timeout` applies to the final answer (default: none, a long trace takes what it takes). `explain`: the
        answer carries each request's line (`ReplayOutcome.requests`)."""
        last = b""
        with contextlib.closing(_chunks(trace)) as chunks:  # a failed chunk closes the trace file now, not at GC
            for chunk in chunks:
                if last:
                    self.call(ReplayRequest(last, more=True), ReplayAck)
                last = chunk
        return self.call(ReplayRequest(last, False, verify, batch, lookahead, snapshot, explain), result_type,
                         timeout)

    def _connect(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:  # the socket is ours until it is stored: every way out of here but success closes it
            sock.settimeout(self.timeout if self.timeout is not None else 30.0)
            sock.connect(self.path)
            _, uid, _ = peer_credentials(sock)
        except FileNotFoundError:
            sock.close()
            raise AdminUnavailable(self.path, "no kvc server: the socket does not exist "
                                              "(start one with `kvc serve`)") from None
        except ConnectionRefusedError:
            sock.close()
            raise AdminUnavailable(self.path, "no kvc server: nothing is listening on this socket "
                                              "(a stale socket, or not a socket)") from None
        except (TimeoutError, socket.timeout):
            sock.close()
            raise AdminTimeout(self.path, sock.gettimeout() or 0.0) from None
        except OSError as exc:
            sock.close()
            raise AdminUnavailable(self.path, f"cannot connect: {exc.strerror or exc}") from None
        except BaseException:
            sock.close()  # interrupted while connecting, or a timeout settimeout refuses
            raise
        if uid not in self.trusted_uids:
            sock.close()
            raise AdminUntrusted(self.path, f"the server on this socket runs as {describe_uid(uid)}, which this client "
                                            f"does not trust; nothing was sent (to trust it: KVC_SERVER_UID={uid})")
        self._sock = sock
        return sock


def _chunks(trace: bytes | str | os.PathLike[str] | IO[bytes]) -> Generator[bytes, None, None]:
    """A trace's bytes in replay chunks (TRACE_CHUNK_BYTES each); at least one, maybe empty."""
    if isinstance(trace, (bytes, bytearray, memoryview)):
        data = bytes(trace)
        yield from (data[i:i + TRACE_CHUNK_BYTES] for i in range(0, len(data), TRACE_CHUNK_BYTES))
        if not data:
            yield b""
        return
    if isinstance(trace, (str, os.PathLike)):
        with open(trace, "rb") as f:
            yield from _chunks(f)
        return
    sent = False
    while chunk := trace.read(TRACE_CHUNK_BYTES):
        sent = True
        yield chunk
    if not sent:
        yield b""
