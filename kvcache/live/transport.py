"""Live mode's transport: the admin socket of a running cache, which only moves bytes (DESIGN §7).

`AdminTransport` listens on a Unix domain socket (mode 0600 by default: the owner only). Its threads only move
bytes: the accept thread checks who connects and hands each connection to a connection thread, which reads
frames, checks them and **queues** the decoded requests. Nothing on those threads runs a request. The owner thread
runs the queued requests in `poll` (the engine calls it between scheduler steps, through `AdminServer.poll`), with
the executor it was given, so every answer sees a consistent state and the admin path never races the engine; the
connection thread then writes the answer back. A standalone cache (`kvc serve`) has no engine loop:
`serve_forever` is that loop. The transport knows nothing of the cache: `server.AdminServer` gives it one.

Trust, both ways. The server reads each peer's credentials (SO_PEERCRED) and answers `forbidden` to a uid not on
its allow-list (default: its own uid). The client (`client.AdminClient`) reads the server's credentials before it
sends a byte and refuses a server whose uid it does not trust: a salt never goes to an impostor who bound the path
first. The server refuses a socket path in a directory other users can write without the sticky bit (they could
replace the socket). The server writes no file a client names: snapshots go back as bytes.

Bounded resources. At most `max_connections` connections are served; one more is answered `busy` at once by the
accept thread (the listen backlog is sized well past the limit so a burst of connects is answered, not refused),
and the client retries `busy` within its timeout. A connection silent for `idle_timeout` seconds is closed, and a
frame must arrive whole within that time of its first byte. Replay uploads are spooled to anonymous temp files
under a per-trace and a total cap, and replayed from there line by line. Frame sizes and nesting are bounded
(`protocol`). A slow or silent client holds at most its own connection thread, never the owner thread.

A malformed frame never ends the server: a body that is not a request is answered with an error and the
connection goes on; a length prefix over the limit is answered and the connection closed (the stream cannot be
framed any more); a connection that stops mid-frame is closed. The salt in a request derives the namespace on the
owner thread and goes no further: requests are never logged or echoed.

Stopping: `close()` (or the `stop` event of `serve_forever`, set by a signal handler) stops a running replay at its
next step: the replay's own polls between steps raise `AdminShuttingDown`, the replay releases what it held, and
its client is answered `shutting_down`.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable
from typing import IO, Any, TypedDict

import msgspec

from ..errors import AdminBadFrame, AdminError, AdminShuttingDown, AdminSocketInUse, InvalidTrace, KVCacheError
from ..ops.requests import ReplayJob
from ..workload.traces import parse_trace, trace_lines
from .credentials import describe_uid, peer_credentials
from .protocol import (
    MAX_REQUEST_BYTES,
    MAX_TRACE_BYTES,
    PROTOCOL_VERSION,
    AdminRequest,
    ErrorInfo,
    FrameTooLarge,
    ReplayAck,
    ReplayRequest,
    Response,
    Truncated,
    decode_envelope,
    encode,
    frame,
    head_of,
    read_frame,
)

log = logging.getLogger("kvcache.live")

_SUN_PATH_MAX = 107  # bytes of a Unix socket path (sun_path is 108 with the terminating NUL)
_WAKE = 0.25  # seconds: how often waiting threads look whether the server is closing
_SEND_RATE = 1 << 20  # bytes a second a reader must at least take an answer at (a large answer gets longer)


class _Upload:
    """A replay trace arriving in chunks, spooled to an anonymous temp file (counted against the server's total)."""

    __slots__ = ("file", "size")

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file
        self.size = 0


class _Reply(TypedDict, total=False):
    """The keyword arguments of `AdminTransport._send` for a reply sent at once: its result, or its error."""

    result: msgspec.Raw
    error: ErrorInfo


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


Executor = Callable[[AdminRequest | ReplayJob], msgspec.Struct]  # runs a request, returns its result


def _one_line(text: str) -> str:
    return " ".join(text.split())


class AdminTransport:
    """The admin socket: accepts connections and queues their requests for `poll`, which runs them with `execute`.

    `allow_uids`: the uids a peer may have (default: this process's). `max_connections`: connections served at
    once (one more is answered `busy`). `idle_timeout`: seconds a connection may stay silent, and a frame may take
    from its first byte. `max_trace_bytes`: one replay upload; `max_upload_bytes`: every upload in flight together
    (default twice `max_trace_bytes`), spooled to temp files in `upload_dir` (default: the system's). `backlog`:
    the listen backlog (default: 16 x `max_connections`, at least 1024, at most SOMAXCONN).
    """

    def __init__(self, path: str | os.PathLike[str], execute: Executor, *, mode: int = 0o600,
                 allow_uids: Iterable[int] | None = None, max_request_bytes: int = MAX_REQUEST_BYTES,
                 max_trace_bytes: int = MAX_TRACE_BYTES, max_upload_bytes: int | None = None,
                 upload_dir: str | None = None, max_connections: int = 64, idle_timeout: float = 10.0,
                 backlog: int | None = None) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.mode = mode
        self.allow_uids = frozenset(allow_uids) if allow_uids is not None else frozenset({os.geteuid()})
        self.max_request_bytes = max_request_bytes
        self.max_trace_bytes = max_trace_bytes
        self.max_upload_bytes = max_upload_bytes if max_upload_bytes is not None else 2 * max_trace_bytes
        self.upload_dir = upload_dir
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        # A burst of connects waits in the backlog until the accept thread answers it (served or `busy`): sized
        # well past the limit, so such a burst is answered instead of refused (the kernel caps it at somaxconn).
        self.backlog = backlog if backlog is not None else min(max(1024, 16 * max_connections), socket.SOMAXCONN)
        self._execute = execute
        # queue.Queue, not SimpleQueue: on CPython 3.11 a signal that lands in SimpleQueue.get(timeout=...) after its
        # deadline can leave it waiting forever (a negative timeout), and `kvc serve` then never sees its SIGTERM.
        self._queue: queue.Queue[_Job] = queue.Queue()
        self._sock: socket.socket | None = None
        self._inode: tuple[int, int] | None = None  # (st_dev, st_ino) of our socket file: unlink only ours
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._lock = threading.Lock()
        self._uploaded = 0  # bytes of every upload in flight (guarded by _lock)
        self._closing = threading.Event()
        self._stop: threading.Event | None = None  # serve_forever's: set by a signal handler to stop
        self._accept_thread: threading.Thread | None = None
        self._owner_thread: threading.Thread | None = None
        self._owner_stop = threading.Event()
        self._depth = 0  # poll nesting: a replay polls between its steps
        self.served = 0  # requests answered by poll
        self.refused = 0  # connections refused: a peer not on the allow-list
        self.busy = 0  # connections answered `busy`

    # --- life -----------------------------------------------------------------------------------------------

    def start(self) -> "AdminTransport":
        """Claim the path (refusing one a live server answers on, taking over a stale socket), listen, and start
        accepting. Returns self."""
        self._sock = _bind(self.path, self.mode)
        try:  # a start that fails returns no transport to close: undo it here (the socket, its file)
            st = os.stat(self.path)
            self._inode = (st.st_dev, st.st_ino)
            self._sock.listen(self.backlog)
            self._accept_thread = threading.Thread(target=self._accept_loop, name="kvc-admin-accept", daemon=True)
            self._accept_thread.start()
        except BaseException:
            self._closing.set()
            self._sock.close()
            self._unlink()
            raise
        return self

    def serve_forever(self, poll_cache: Callable[[], Any], stop: threading.Event, tick: float = 0.01) -> None:
        """The owner loop of a standalone cache: run queued requests and complete the cache's finished copies and
        L3 jobs (`poll_cache`) until `stop` is set. Wakes at least every `tick` seconds. Setting `stop` (from a
        signal handler) also stops a running replay at its next step."""
        self._stop = stop
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

    @property
    def stopping(self) -> bool:
        """True once `close` began or `serve_forever`'s stop event is set: a running replay stops."""
        return self._closing.is_set() or (self._stop is not None and self._stop.is_set())

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
        when it began. A replay's own polls between its steps leave other replays queued, and raise
        `AdminShuttingDown` once the server is stopping (the replay ends there). Returns how many requests ran."""
        if self._depth and self.stopping:
            raise AdminShuttingDown(self.path, "the server is shutting down")
        if wait <= 0 and not self._queue.queue:  # the engine polls every step: an empty queue costs no lock
            return 0
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
        except AdminShuttingDown:
            job.error = ErrorInfo("shutting_down", "the server is shutting down: the request stopped between two "
                                                   "steps and released what it held")
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
            try:
                _, uid, _ = peer_credentials(conn)
            except OSError:
                conn.close()
                continue
            if uid not in self.allow_uids:
                self.refused += 1
                log.warning("admin socket %s: refused a connection from %s (not on the allow-list)", self.path,
                            describe_uid(uid))
                self._reply_and_close(conn, ErrorInfo("forbidden", f"{describe_uid(uid)} may not use this admin socket "
                                                                   f"(the server allows {self._allowed()})"))
                continue
            thread = threading.Thread(target=self._connection, args=(conn,), name="kvc-admin-conn", daemon=True)
            with self._lock:
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns[conn] = thread
            if full:
                self.busy += 1
                self._reply_and_close(conn, ErrorInfo("busy", f"the server has {self.max_connections} "
                                                              f"connections open; try again"))
                continue
            try:
                thread.start()
            except RuntimeError:  # no thread to be had (a process at its limit): this connection is not served
                with self._lock:
                    self._conns.pop(conn, None)
                self.busy += 1
                self._reply_and_close(conn, ErrorInfo("busy", "the server cannot start a thread for this "
                                                              "connection now; try again"))

    def _allowed(self) -> str:
        return ", ".join(describe_uid(uid) for uid in sorted(self.allow_uids))

    def _reply_and_close(self, conn: socket.socket, error: ErrorInfo) -> None:
        try:
            conn.settimeout(1.0)
            conn.sendall(frame(Response(PROTOCOL_VERSION, 0, error=error)))
        except OSError:
            pass  # the peer went away: nothing to answer
        conn.close()

    def _connection(self, conn: socket.socket) -> None:
        upload: list[_Upload] = []  # the replay upload in progress on this connection (0 or 1)
        try:
            self._converse(conn, upload)
        except OSError:
            pass  # the peer went away, stayed silent, or trickled a frame too slowly: nothing to answer
        finally:
            for u in upload:
                self._discard(u)
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _converse(self, conn: socket.socket, upload: list[_Upload]) -> None:
        while not self._closing.is_set():
            conn.settimeout(self.idle_timeout)
            try:
                body = read_frame(conn, self.max_request_bytes, self.idle_timeout)
            except FrameTooLarge as exc:
                self._send(conn, 0, error=ErrorInfo("bad_frame", f"{exc}; closing the connection"))
                _drain(conn)
                return
            except Truncated:
                return
            if body is None:
                return
            try:
                version, ident = head_of(body)
            except AdminBadFrame as exc:
                self._send(conn, 0, error=ErrorInfo("bad_frame", str(exc)))
                continue
            if version != PROTOCOL_VERSION:
                self._send(conn, ident, error=ErrorInfo(
                    "protocol_version", f"admin protocol mismatch: the client speaks version {version}, this "
                                        f"server speaks version {PROTOCOL_VERSION}"))
                continue
            try:
                request = decode_envelope(body).request
            except AdminBadFrame as exc:
                self._send(conn, ident, error=ErrorInfo("bad_request", str(exc)))
                continue
            if isinstance(request, ReplayRequest):
                replay, reply = self._replay_chunk(upload, request)
                if replay is None:
                    self._send(conn, ident, **reply)
                    continue
                job = _Job(replay)
            else:
                job = _Job(request)
            self._queue.put(job)
            try:
                while not job.done.wait(_WAKE):
                    if self._closing.is_set():
                        job.fail("shutting_down", "the server is shutting down")
            finally:
                for u in upload:  # a replay's upload is read until the job ends
                    self._discard(u)
                upload.clear()
            if job.error is not None:
                self._send(conn, ident, error=job.error)
            else:
                assert job.body is not None, "a job done without an error has its result"
                self._send(conn, ident, result=msgspec.Raw(job.body))

    def _send(self, conn: socket.socket, ident: int, *, result: msgspec.Raw | None = None,
              error: ErrorInfo | None = None) -> None:
        """Answer on the connection thread; a reader slower than _SEND_RATE (or gone) ends the connection."""
        response = (Response(PROTOCOL_VERSION, ident, error=error) if result is None
                    else Response(PROTOCOL_VERSION, ident, result))
        data = frame(response)
        conn.settimeout(self.idle_timeout + len(data) / _SEND_RATE)
        conn.sendall(data)

    # --- replay uploads -------------------------------------------------------------------------------------

    def _replay_chunk(self, upload: list[_Upload], request: ReplayRequest) -> tuple[ReplayJob | None, _Reply]:
        """Add a chunk to the connection's upload: the job to queue once the last chunk is in (validated here,
        off the owner thread), or else the reply to send now. An upload over a cap is dropped whole."""
        n = len(request.chunk)
        current = upload[0] if upload else None
        if (current.size if current is not None else 0) + n > self.max_trace_bytes:
            if current is not None:
                self._discard(upload.pop())
            return None, {"error": ErrorInfo("bad_request", f"the trace is over the limit of "
                                                            f"{self.max_trace_bytes} bytes")}
        with self._lock:
            room = self._uploaded + n <= self.max_upload_bytes
            if room:
                self._uploaded += n
        if not room:
            if current is not None:
                self._discard(upload.pop())
            return None, {"error": ErrorInfo("busy", f"uploads in flight are at the server's limit of "
                                                     f"{self.max_upload_bytes} bytes; try again")}
        if current is None:
            try:
                current = _Upload(tempfile.TemporaryFile(prefix="kvc-trace-", dir=self.upload_dir))
            except OSError as exc:
                with self._lock:
                    self._uploaded -= n
                return None, {"error": ErrorInfo("internal", f"cannot spool the trace: {exc}")}
            upload.append(current)
        current.size += n  # counted before the write: _discard takes it off the total whatever happens
        try:
            current.file.write(request.chunk)
        except OSError as exc:
            self._discard(upload.pop())
            return None, {"error": ErrorInfo("internal", f"cannot spool the trace: {exc}")}
        if request.more:
            return None, {"result": msgspec.Raw(encode(ReplayAck(current.size)))}
        f = current.file
        try:
            f.seek(0)
            count = sum(1 for _ in parse_trace(trace_lines(f), "trace"))
            f.seek(0)
        except InvalidTrace as exc:
            self._discard(upload.pop())
            return None, {"error": ErrorInfo("InvalidTrace", _one_line(str(exc)))}
        except OSError as exc:
            self._discard(upload.pop())
            return None, {"error": ErrorInfo("internal", f"cannot read the spooled trace: {exc}")}
        trace = parse_trace(trace_lines(f), "trace")
        return ReplayJob(trace, count, request.verify, request.batch, request.lookahead, request.snapshot,
                         request.explain), {}

    def _discard(self, upload: _Upload) -> None:
        with self._lock:
            self._uploaded -= upload.size
        upload.size = 0
        try:
            upload.file.close()
        except OSError:
            pass  # an anonymous temp file: closing frees it, a failure changes nothing

    @property
    def uploaded_bytes(self) -> int:
        """Bytes of the replay uploads in flight now."""
        return self._uploaded


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


def _bind(path: str, mode: int) -> socket.socket:
    """A socket bound at `path` with `mode`, never more open than that: bound in a private directory, chmod'ed,
    then renamed into place. A directory other users may write (without the sticky bit) is refused, a live server
    there is refused; a stale socket file is replaced."""
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        raise AdminError(path, f"a Unix socket path takes at most {_SUN_PATH_MAX} bytes; use a shorter one")
    parent = os.path.dirname(path)
    _check_directory(path, parent)
    _claim(path)
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


def _check_directory(path: str, parent: str) -> None:
    """Refuse a socket directory that other users may write without the sticky bit: any of them could remove our
    socket and bind their own in its place."""
    try:
        st = os.stat(parent)
    except OSError as exc:
        raise AdminError(path, f"cannot use the socket's directory {parent}: {exc.strerror or exc}") from None
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        who = "every user" if st.st_mode & stat.S_IWOTH else "its group"
        raise AdminError(path, f"the socket's directory {parent} is writable by {who} and has no sticky bit: "
                               f"another user could replace the socket; serve from a directory only you can write "
                               f"(e.g. $XDG_RUNTIME_DIR) or one with the sticky bit")


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
        _, uid, _ = peer_credentials(probe)
    except (ConnectionRefusedError, FileNotFoundError):
        try:
            os.unlink(path)  # stale: left by a server that died; take it over
        except PermissionError:
            raise AdminSocketInUse(path, f"a stale socket of {describe_uid(st.st_uid)} that this user cannot remove"
                                   ) from None
        return
    except OSError as exc:
        raise AdminSocketInUse(path, f"cannot tell whether a server answers here ({exc.strerror or exc})") from None
    finally:
        probe.close()
    mine = uid == os.geteuid()
    whose = ("" if mine else f", run by {describe_uid(uid)}, not by this user: someone else bound the path first "
             f"(serve from a directory only you can write)")
    raise AdminSocketInUse(path, "a server is already listening on this socket" + whose)
