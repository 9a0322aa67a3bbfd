"""Live mode's transport: the admin socket server of a running cache, and its client (DESIGN §7).

`AdminServer` listens on a Unix domain socket (mode 0600 by default: the owner only). Its threads only move
bytes: the accept thread hands each connection to a connection thread, which reads frames, checks them and
**queues** the decoded requests. Nothing on those threads touches the cache. The cache's owner thread runs the
queued requests in `poll` (`TieredCache.poll_admin()`, between scheduler steps), so every answer sees a
consistent state and the admin path never races the engine; the connection thread then writes the answer back.
A standalone cache (`kvc serve`) has no engine loop: `serve_forever` is that loop.

A malformed frame never ends the server: a body that is not a request is answered with an error and the
connection goes on; a length prefix over the limit is answered and the connection closed (the stream cannot be
framed any more); a connection that stops mid-frame is closed. The salt in a request derives the namespace on the
owner thread and goes no further: requests are never logged or echoed.

`AdminClient` is the other end: one connection, one request at a time, typed errors (`AdminUnavailable`,
`AdminTimeout`, `AdminProtocolMismatch`, `AdminRemoteError`, `AdminBadFrame`) naming the socket.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import stat
import tempfile
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from .admin_protocol import (MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES, MAX_TRACE_BYTES, PROTOCOL_VERSION,
                             TRACE_CHUNK_BYTES, AdminRequest, Envelope, ErrorInfo, FrameTooLarge, ReplayAck,
                             ReplayRequest, Response, Truncated, decode_envelope, decode_response, encode, frame,
                             head_of, read_frame)
from .errors import (AdminBadFrame, AdminError, AdminProtocolMismatch, AdminRemoteError, AdminSocketInUse,
                     AdminTimeout, AdminUnavailable, InvalidTrace, KVCacheError)
from .workload import TraceRequest, parse_trace

log = logging.getLogger("kvcache.admin")

_SUN_PATH_MAX = 107  # bytes of a Unix socket path (sun_path is 108 with the terminating NUL)
_WAKE = 0.25  # seconds: how often waiting threads look whether the server is closing

T = TypeVar("T")


class ReplayJob(msgspec.Struct):
    """What the owner thread runs for a replay: the whole trace, already validated on the connection thread."""

    trace: list[TraceRequest]
    verify: bool
    batch: int
    lookahead: int
    snapshot_out: str | None


class _Job:
    """A queued request and, once the owner thread ran it, its answer."""

    __slots__ = ("request", "done", "body", "error")

    def __init__(self, request: AdminRequest | ReplayJob) -> None:
        self.request = request
        self.done = threading.Event()
        self.body: bytes | None = None  # msgpack of the result
        self.error: ErrorInfo | None = None

    def fail(self, kind: str, message: str) -> None:
        self.error = ErrorInfo(kind, message)
        self.done.set()


Executor = Callable[[Any], msgspec.Struct]


def _one_line(text: str) -> str:
    return " ".join(text.split())


class AdminServer:
    """The admin socket of one cache: accepts connections and queues their requests for `poll`."""

    def __init__(self, path: str | os.PathLike, execute: Executor, *, mode: int = 0o600,
                 max_request_bytes: int = MAX_REQUEST_BYTES, max_trace_bytes: int = MAX_TRACE_BYTES,
                 max_connections: int = 64, idle_timeout: float = 600.0) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.mode = mode
        self.max_request_bytes = max_request_bytes
        self.max_trace_bytes = max_trace_bytes
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout  # a connection silent this long is closed (its thread ends)
        self._execute = execute
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._sock: socket.socket | None = None
        self._inode: tuple[int, int] | None = None  # (st_dev, st_ino) of our socket file: unlink only ours
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._accept_thread: threading.Thread | None = None
        self._owner_thread: threading.Thread | None = None
        self._owner_stop = threading.Event()
        self._depth = 0  # poll nesting: a replay polls between its steps
        self.served = 0  # requests answered by poll

    # --- life -----------------------------------------------------------------------------------------------

    def start(self) -> "AdminServer":
        """Claim the path (refusing one a live server answers on, taking over a stale socket), listen, and start
        accepting. Returns self."""
        self._sock = _bind(self.path, self.mode)
        st = os.stat(self.path)
        self._inode = (st.st_dev, st.st_ino)
        self._sock.listen(max(8, self.max_connections))
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kvc-admin-accept", daemon=True)
        self._accept_thread.start()
        return self

    def serve_forever(self, poll_cache: Callable[[], Any], stop: threading.Event, tick: float = 0.01) -> None:
        """The owner loop of a standalone cache: run queued requests and complete the cache's finished copies and
        L3 jobs (`poll_cache`) until `stop` is set. Wakes at least every `tick` seconds."""
        while not stop.is_set() and not self._closing.is_set():
            self.poll(tick)
            poll_cache()

    def start_owner_thread(self, poll_cache: Callable[[], Any]) -> None:
        """Run `serve_forever` on a helper thread: for a cache with no engine loop, which that thread then owns
        (nothing else may call the cache until `close`)."""
        self._owner_thread = threading.Thread(target=self.serve_forever, args=(poll_cache, self._owner_stop),
                                              name="kvc-admin-owner", daemon=True)
        self._owner_thread.start()

    def close(self) -> None:
        """Stop accepting, answer what is still queued with `shutting_down`, close every connection and remove
        the socket file (when it is still ours). Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        if self._owner_thread is not None:
            self._owner_stop.set()
            if self._owner_thread is not threading.current_thread():
                self._owner_thread.join()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
            except OSError:
                pass  # already shut down
            self._sock.close()
        self._unlink()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=5)
        while True:
            try:
                self._queue.get_nowait().fail("shutting_down", "the server is shutting down")
            except queue.Empty:
                break
        with self._lock:
            conns = list(self._conns.items())
        for conn, _ in conns:
            try:
                conn.shutdown(socket.SHUT_RD)  # wakes threads blocked in recv; those answering may still send
            except OSError:
                pass  # the peer already closed it
        for _, thread in conns:
            thread.join(timeout=2)

    @property
    def pending(self) -> int:
        """Requests queued and not yet run."""
        return self._queue.qsize()

    @property
    def closed(self) -> bool:
        """True once `close` began."""
        return self._closing.is_set()

    def _unlink(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError:
            return
        if self._inode == (st.st_dev, st.st_ino):  # another server may have taken the path over since
            try:
                os.unlink(self.path)
            except OSError:
                pass  # already gone: nothing to clean

    # --- the owner thread -----------------------------------------------------------------------------------

    def poll(self, wait: float = 0.0) -> int:
        """Run the requests queued now, on the calling (owner) thread; wait up to `wait` seconds for a first one.
        Requests that arrive meanwhile wait for the next poll, so one poll's work is bounded by what was queued
        when it began. A replay's own polls between its steps leave other replays queued. Returns how many
        requests ran."""
        try:
            job = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
        except queue.Empty:
            return 0
        budget = self._queue.qsize()
        deferred: list[_Job] = []
        ran = 0
        self._depth += 1
        try:
            while True:
                if self._depth > 1 and isinstance(job.request, ReplayJob):
                    deferred.append(job)
                else:
                    self._run(job)
                    ran += 1
                if budget <= 0:
                    break
                budget -= 1
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
        finally:
            self._depth -= 1
            for job in deferred:
                self._queue.put(job)
        return ran

    def _run(self, job: _Job) -> None:
        if job.done.is_set():  # failed by close() in between
            return
        try:
            job.body = encode(self._execute(job.request))
        except KVCacheError as exc:
            job.error = ErrorInfo(type(exc).__name__, _one_line(str(exc)) or type(exc).__name__)
        except Exception as exc:  # a bug must not take the engine down with it: answer, log, go on
            log.exception("admin request %s failed", type(job.request).__name__)
            job.error = ErrorInfo("internal", _one_line(f"{type(exc).__name__}: {exc}"))
        self.served += 1
        job.done.set()

    # --- the accept and connection threads ------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._closing.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closing.is_set():
                    return
                self._closing.wait(0.05)  # e.g. out of file descriptors: try again shortly
                continue
            thread = threading.Thread(target=self._connection, args=(conn,), name="kvc-admin-conn", daemon=True)
            with self._lock:
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns[conn] = thread
            if full:
                self._reply_and_close(conn, ErrorInfo("busy", f"the server has {self.max_connections} "
                                                              f"connections open; try again"))
                continue
            thread.start()

    def _reply_and_close(self, conn: socket.socket, error: ErrorInfo) -> None:
        try:
            conn.settimeout(1.0)
            conn.sendall(frame(Response(PROTOCOL_VERSION, 0, error=error)))
        except OSError:
            pass  # the peer went away: nothing to answer
        conn.close()

    def _connection(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(self.idle_timeout)
            self._converse(conn)
        except OSError:
            pass  # the peer went away or stayed silent: nothing to answer
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _converse(self, conn: socket.socket) -> None:
        trace = bytearray()  # replay chunks received on this connection so far
        while not self._closing.is_set():
            try:
                body = read_frame(conn, self.max_request_bytes)
            except FrameTooLarge as exc:
                _send(conn, 0, error=ErrorInfo("bad_frame", f"{exc}; closing the connection"))
                _drain(conn)
                return
            except Truncated:
                return
            if body is None:
                return
            try:
                version, ident = head_of(body)
            except AdminBadFrame as exc:
                _send(conn, 0, error=ErrorInfo("bad_frame", str(exc)))
                continue
            if version != PROTOCOL_VERSION:
                _send(conn, ident, error=ErrorInfo(
                    "protocol_version", f"admin protocol mismatch: the client speaks version {version}, this "
                                        f"server speaks version {PROTOCOL_VERSION}"))
                continue
            try:
                request = decode_envelope(body).request
            except AdminBadFrame as exc:
                _send(conn, ident, error=ErrorInfo("bad_request", str(exc)))
                continue
            if isinstance(request, ReplayRequest):
                job_request, reply = self._replay_chunk(trace, request)
                if job_request is None:
                    _send(conn, ident, **reply)
                    continue
            else:
                job_request = request
            job = _Job(job_request)
            self._queue.put(job)
            while not job.done.wait(_WAKE):
                if self._closing.is_set():
                    job.fail("shutting_down", "the server is shutting down")
            if job.error is not None:
                _send(conn, ident, error=job.error)
            else:
                _send(conn, ident, result=msgspec.Raw(job.body))  # type: ignore[arg-type]

    def _replay_chunk(self, trace: bytearray, request: ReplayRequest) -> tuple[ReplayJob | None, dict]:
        """Add a chunk to the connection's trace: the job to queue once the last chunk is in (validated here, off
        the owner thread), or else the reply to send now."""
        if len(trace) + len(request.chunk) > self.max_trace_bytes:
            trace.clear()
            return None, {"error": ErrorInfo("bad_request", f"the trace is over the limit of "
                                                            f"{self.max_trace_bytes} bytes")}
        trace += request.chunk
        if request.more:
            return None, {"result": msgspec.Raw(encode(ReplayAck(len(trace))))}
        data = bytes(trace)
        trace.clear()
        try:
            items = list(parse_trace(data.splitlines(), "trace"))
        except InvalidTrace as exc:
            return None, {"error": ErrorInfo("InvalidTrace", _one_line(str(exc)))}
        return ReplayJob(items, request.verify, request.batch, request.lookahead, request.snapshot_out), {}


def _drain(conn: socket.socket, limit: int = 16 << 20, seconds: float = 1.0) -> None:
    """End our side, then read and drop what the peer is still sending (bounded), so that our answer is not
    lost to a reset: a socket closed with unread data resets the connection."""
    conn.shutdown(socket.SHUT_WR)
    conn.settimeout(seconds)
    while limit > 0:
        part = conn.recv(min(limit, 1 << 16))
        if not part:
            return
        limit -= len(part)


def _send(conn: socket.socket, ident: int, *, result: msgspec.Raw | None = None,
          error: ErrorInfo | None = None) -> None:
    response = (Response(PROTOCOL_VERSION, ident, error=error) if result is None
                else Response(PROTOCOL_VERSION, ident, result))
    conn.sendall(frame(response))


def _bind(path: str, mode: int) -> socket.socket:
    """A socket bound at `path` with `mode`, never more open than that: bound in a private directory, chmod'ed,
    then renamed into place. A live server there is refused; a stale socket file is replaced."""
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        raise AdminError(path, f"a Unix socket path takes at most {_SUN_PATH_MAX} bytes; use a shorter one")
    _claim(path)
    parent = os.path.dirname(path)
    private = tempfile.mkdtemp(prefix=".kvc", dir=parent)  # mode 0700
    tmp = os.path.join(private, "s")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(tmp)
        os.chmod(tmp, mode)
        os.rename(tmp, path)
    except BaseException:
        sock.close()
        try:
            os.unlink(tmp)
        except OSError:
            pass  # already renamed or removed
        raise
    finally:
        try:
            os.rmdir(private)
        except OSError:
            pass  # not empty or already removed: harmless
    return sock


def _claim(path: str) -> None:
    """Make `path` free for a new socket: refuse a live server or a file that is not a socket; remove a stale
    socket (one nobody accepts on)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise AdminSocketInUse(path, "exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # stale: left by a server that died; take it over
        return
    except OSError as exc:
        raise AdminSocketInUse(path, f"cannot tell whether a server answers here ({exc.strerror or exc})") from None
    finally:
        probe.close()
    raise AdminSocketInUse(path, "a server is already listening on this socket")


# --- the client --------------------------------------------------------------------------------------------


class AdminClient:
    """A connection to a live cache's admin socket. One request at a time; usable as a context manager."""

    def __init__(self, path: str | os.PathLike, timeout: float | None = 30.0) -> None:
        self.path = os.fspath(path)
        self.timeout = timeout  # seconds to wait for each answer; None: no limit
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
        ident = self._next_id
        self._next_id += 1
        data = frame(Envelope(PROTOCOL_VERSION, ident, request))
        if len(data) - 4 > MAX_REQUEST_BYTES:
            raise AdminBadFrame(self.path, f"the request is {len(data) - 4} bytes, over the admin socket's limit "
                                           f"of {MAX_REQUEST_BYTES} bytes")
        sock = self._connect()
        try:
            sock.settimeout(wait)
            sock.sendall(data)
            body = read_frame(sock, MAX_RESPONSE_BYTES)
        except (TimeoutError, socket.timeout):
            self.close()  # the answer may still come: this connection can no longer be framed
            raise AdminTimeout(self.path, wait or 0.0) from None
        except (Truncated, FrameTooLarge, OSError) as exc:
            self.close()
            raise AdminUnavailable(self.path, f"the server dropped the connection ({exc})") from None
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
            raise AdminRemoteError(self.path, response.error.kind, response.error.message)
        try:
            return msgspec.msgpack.decode(response.result, type=result_type)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise AdminBadFrame(self.path, f"unexpected result: {exc}") from None

    def replay(self, trace: bytes, result_type: type[T], *, verify: bool = False, batch: int = 4,
               lookahead: int = 8, snapshot_out: str | None = None, timeout: float | None | bool = None) -> T:
        """Have the live cache replay a JSONL trace (sent in chunks of at most one frame); returns its report.
        `timeout` applies to the final answer (default: none, a long trace takes what it takes)."""
        chunks = [trace[i:i + TRACE_CHUNK_BYTES] for i in range(0, len(trace), TRACE_CHUNK_BYTES)] or [b""]
        for chunk in chunks[:-1]:
            self.call(ReplayRequest(chunk, more=True), ReplayAck)
        return self.call(ReplayRequest(chunks[-1], False, verify, batch, lookahead, snapshot_out), result_type,
                         timeout)

    def _connect(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout if self.timeout is not None else 30.0)
        try:
            sock.connect(self.path)
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
        self._sock = sock
        return sock
