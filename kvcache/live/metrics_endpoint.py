"""The metrics endpoint of a live cache: Prometheus text over HTTP, on a TCP port or a Unix socket, with bounds.

Who may scrape. On a Unix socket the same uid allow-list as the admin socket applies: the peer's uid is read with
SO_PEERCRED when it connects and a uid off the list is answered `403 Forbidden`, never a figure (the socket file
is created like the admin socket's: mode 0600 by default, in a directory other users cannot write into). Over TCP
there is no such check: whoever reaches the port can scrape, and the labels name tenants (extra_key) and their
salt fingerprints. The port binds loopback unless told otherwise, and a wildcard address is bound with a warning.

Bounded resources. One event-loop thread holds every connection and one render thread reads the figures: an idle
connection costs a file descriptor and a few KiB, never a thread. At most `max_connections` connections are open;
one more closes the connection idle the longest (or, when none is idle, is answered `503`). Idle means kept open
after an answer and waiting for the next request, or accepted and still without its first request head
`head_grace` seconds later: a connection just accepted, whose head is on its way, is never closed to make room
(its scraper did nothing wrong; a burst of connects is answered 503 instead). A connection its scraper dropped
holds its place until its handler's next step, so one over the limit waits a few event-loop steps
(`_ROOM_STEPS`) for such places before it is refused: scrapers below the limit are all served. A connection
silent for `idle_timeout` seconds is closed, a request head must arrive whole within that time and within
`max_request_bytes`, and an answer must be taken at `_SEND_RATE` bytes a second at least.

Scrapes do not load the cache. The figures are read (`collect`, which asks the cache between two scheduler steps)
at most once per `refresh_s` seconds, by one thread, whatever the number of scrapers; the scrapes in between, and
those that arrive while a read is under way, are answered from the same exposition (rendered by
`prometheus_client`, once per content type and encoding).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gzip
import ipaddress
import logging
import os
import queue
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

from .credentials import describe_uid, peer_credentials
from .transport import _bind

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

log = logging.getLogger("kvcache.live")

_SEND_RATE = 1 << 20  # bytes a second a scraper must at least take an answer at (a large answer gets longer)
_CHUNK = 1 << 16  # an answer is written in chunks, so a slow reader holds at most about this much of it buffered
_BACKLOG = min(1024, socket.SOMAXCONN)
_ROOM_STEPS = 8  # event-loop steps a connection over the limit waits for room before it is answered 503
HEAD_GRACE_S = 1.0  # a new connection's first request head is on its way this long: never closed to make room
PATHS = ("/metrics", "/")  # where the exposition is served; anything else is 404


class _RenderThread:
    """One daemon thread that runs the reads and renders, one at a time (a stuck read never blocks exit)."""

    def __init__(self) -> None:
        self._jobs: queue.Queue[tuple[concurrent.futures.Future, Callable[..., Any], tuple] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvc-metrics-render", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Queue `fn(*args)`; its future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn, args))
        return future

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the scrape that waits for it
                future.set_exception(exc)

    def shutdown(self) -> None:
        """Stop after the job in hand (not waiting for it: it may be a read of a cache that no longer answers)."""
        self._jobs.put(None)


class _Exposition:
    """The families of one read, and their renderings by (content type, gzip), each made once."""

    __slots__ = ("at", "families", "renderings")

    def __init__(self, at: float, families: asyncio.Future) -> None:
        self.at = at
        self.families = families  # -> list[Metric]
        self.renderings: dict[tuple[str, bool], asyncio.Future] = {}  # -> bytes


class _Answer:
    __slots__ = ("status", "content_type", "body", "extra", "keep")

    def __init__(self, status: str, body: bytes, *, content_type: str = "text/plain; charset=utf-8",
                 extra: tuple[str, ...] = (), keep: bool = False) -> None:
        self.status, self.body, self.content_type, self.extra, self.keep = status, body, content_type, extra, keep


class MetricsEndpoint:
    """Serves `collect()`'s metric families at /metrics over HTTP, on TCP (`addr`, `port`; 0: any free port) or on
    the Unix socket `path` (file `mode`, peers checked against `allow_uids`, default this process's uid). See the
    module docstring for the bounds (`max_connections`, `idle_timeout`, `head_grace`, `max_request_bytes`) and
    `refresh_s`.
    `start()` binds (an OSError or a typed AdminError when it cannot) and serves on its own threads; `close()`
    stops. Counters: `served` answers with figures, `refused` peers off the allow-list, `evicted` idle connections
    closed to make room, `timed_out` connections closed for silence or a slow request, `peak` the most connections
    open at once."""

    def __init__(self, collect: Callable[[], Iterable[Metric]], *, addr: str = "127.0.0.1", port: int | None = None,
                 path: str | os.PathLike | None = None, mode: int = 0o600, allow_uids: Iterable[int] | None = None,
                 max_connections: int = 64, idle_timeout: float = 10.0, refresh_s: float = 1.0,
                 max_request_bytes: int = 8192, head_grace: float = HEAD_GRACE_S) -> None:
        if (port is None) == (path is None):
            raise ValueError("a metrics endpoint listens on a TCP port or on a Unix socket path: give one")
        self.collect = collect
        self.addr = addr
        self.port = port
        self.path = os.path.abspath(os.fspath(path)) if path is not None else None
        self.mode = mode
        self.allow_uids = frozenset(allow_uids) if allow_uids is not None else frozenset({os.geteuid()})
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self.refresh_s = refresh_s
        self.max_request_bytes = max_request_bytes
        self.head_grace = head_grace
        self.url = ""  # where it serves, once started: http://HOST:PORT/metrics or unix:PATH
        self.wildcard = False  # a TCP endpoint bound to every interface
        self._sock: socket.socket | None = None
        self._inode: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._render: _RenderThread | None = None
        self._current: _Exposition | None = None
        self._conns: OrderedDict[int, asyncio.StreamWriter] = OrderedDict()  # every open connection
        # those waiting for a request, longest first: (writer, since when (monotonic), answered before on it)
        self._idle: OrderedDict[int, tuple[asyncio.StreamWriter, float, bool]] = OrderedDict()
        self._refused_uids: set[int] = set()
        self.served = 0
        self.refused = 0
        self.evicted = 0
        self.timed_out = 0
        self.peak = 0  # the most connections open at once

    # --- life -----------------------------------------------------------------------------------------------

    def start(self) -> "MetricsEndpoint":
        """Bind and start serving (a warning when a TCP endpoint binds every interface). Returns self."""
        self._sock = self._bind_unix() if self.path is not None else self._bind_tcp()
        self._render = _RenderThread()
        started = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(started, failure), name="kvc-metrics", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            self.close()
            raise failure[0]
        if self.wildcard:
            log.warning("the metrics endpoint listens on every interface (%s): anyone who reaches the port can "
                        "read its labels (tenant names, salt fingerprints); bind 127.0.0.1 or use a Unix socket",
                        self.url)
        return self

    def close(self) -> None:
        """Stop serving: every connection closed, the socket file removed (when still ours). Idempotent."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and self._thread is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(stop.set)
            self._thread.join(timeout=10)
        if self._render is not None:
            self._render.shutdown()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.path is not None and self._inode is not None:
            with contextlib.suppress(OSError):
                st = os.stat(self.path)
                if (st.st_dev, st.st_ino) == self._inode:  # another server may have taken the path over since
                    os.unlink(self.path)
            self._inode = None

    def __enter__(self) -> "MetricsEndpoint":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def open_connections(self) -> int:
        """Connections open now."""
        return len(self._conns)

    def _bind_unix(self) -> socket.socket:
        assert self.path is not None
        sock = _bind(self.path, self.mode)  # the admin socket's way: private dir, chmod, rename; never more open
        st = os.stat(self.path)
        self._inode = (st.st_dev, st.st_ino)
        sock.listen(_BACKLOG)
        self.url = f"unix:{self.path}"
        return sock

    def _bind_tcp(self) -> socket.socket:
        host = None if self.addr in ("", "*") else self.addr
        family, kind, proto, _, where = socket.getaddrinfo(host, self.port, type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(where)
            sock.listen(_BACKLOG)
        except BaseException:
            sock.close()
            raise
        bound_host, bound_port = sock.getsockname()[:2]
        self.wildcard = ipaddress.ip_address(bound_host).is_unspecified
        shown = f"[{bound_host}]" if family == socket.AF_INET6 else bound_host
        self.url = f"http://{shown}:{bound_port}/metrics"
        return sock

    def _run(self, started: threading.Event, failure: list[BaseException]) -> None:
        try:
            asyncio.run(self._serve(started))
        except BaseException as exc:
            failure.append(exc)
            started.set()

    async def _serve(self, started: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        assert self._sock is not None
        # the reader's limit bounds what one connection may send before its request head ends; the backlog is
        # asyncio's too (it listens again): a burst of connects waits there instead of being dropped
        start = asyncio.start_unix_server if self.path is not None else asyncio.start_server
        server = await start(self._connection, sock=self._sock, limit=self.max_request_bytes, backlog=_BACKLOG)
        started.set()
        try:
            await self._stop.wait()
        finally:
            server.close()
            for writer in list(self._conns.values()):
                writer.transport.abort()
            await asyncio.sleep(0)  # let the connection tasks see their ends

    # --- connections ----------------------------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        key = id(writer)
        for _ in range(_ROOM_STEPS):  # connections that just ended leave at their next step: let them
            if len(self._conns) < self.max_connections or self._evict_idle():
                break
            await asyncio.sleep(0)
        else:
            await self._answer_and_close(writer, _Answer("503 Service Unavailable", b"too many connections; try "
                                                         b"again\n"))
            return
        self._conns[key] = writer
        self.peak = max(self.peak, len(self._conns))
        writer.transport.set_write_buffer_limits(high=0)  # drain() returns once all is with the kernel
        uid = self._peer_uid(writer)
        answered = False  # an answer went out on this connection: waiting for the next request is idling
        try:
            while True:
                self._idle[key] = (writer, time.monotonic(), answered)
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.idle_timeout)
                except asyncio.TimeoutError:
                    self.timed_out += 1
                    return
                except asyncio.LimitOverrunError:
                    await self._answer(writer, _Answer("431 Request Header Fields Too Large",
                                                       b"the request head is over the limit\n"))
                    return
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the peer closed, or the connection was evicted
                finally:
                    self._idle.pop(key, None)
                if uid is not None and uid not in self.allow_uids:
                    self._refuse(uid)
                    await self._answer(writer, _Answer("403 Forbidden", (
                        f"{describe_uid(uid)} may not scrape this endpoint (the server allows "
                        f"{', '.join(describe_uid(u) for u in sorted(self.allow_uids))})\n").encode()))
                    return
                try:
                    answer, head_only = await self._respond(head)
                except Exception as exc:  # a defect must not cost more than this connection: one line, go on
                    log.warning("metrics endpoint %s: a request failed: %s", self.url,
                                " ".join(f"{type(exc).__name__}: {exc}".split()))
                    await self._answer(writer, _Answer("500 Internal Server Error", b"internal error\n"))
                    return
                if not await self._answer(writer, answer, head_only):
                    return
                if not answer.keep:
                    return
                answered = True
        finally:
            self._conns.pop(key, None)
            self._idle.pop(key, None)
            _end(writer)

    def _evict_idle(self) -> bool:
        """Close the connection idle the longest to make room; False when none is idle. A connection still waiting
        for its first request head is idle only once `head_grace` has passed (see the module docstring)."""
        overdue = time.monotonic() - self.head_grace
        key = next((k for k, (_, since, answered) in self._idle.items()  # longest waiting first
                    if answered or since <= overdue), None)
        if key is None:
            return False
        writer = self._idle.pop(key)[0]
        self._conns.pop(key, None)
        writer.transport.abort()
        self.evicted += 1
        return True

    def _peer_uid(self, writer: asyncio.StreamWriter) -> int | None:
        """The uid of a Unix-socket peer (None over TCP); -1 when it cannot be read (refused like a stranger)."""
        if self.path is None:
            return None
        try:
            return peer_credentials(cast(socket.socket, writer.get_extra_info("socket")))[1]
        except (OSError, TypeError):
            return -1

    def _refuse(self, uid: int) -> None:
        self.refused += 1
        if uid not in self._refused_uids:  # one line per uid, not one per connection: a refused peer may retry
            self._refused_uids.add(uid)
            log.warning("metrics socket %s: refused %s (not on the allow-list)", self.path, describe_uid(uid))

    async def _answer_and_close(self, writer: asyncio.StreamWriter, answer: _Answer) -> None:
        writer.transport.set_write_buffer_limits(high=0)
        try:
            await self._answer(writer, answer)
        finally:
            _end(writer)

    async def _answer(self, writer: asyncio.StreamWriter, answer: _Answer, head_only: bool = False) -> bool:
        """Write `answer`; False when the peer did not take it in time (or went away)."""
        lines = [f"HTTP/1.1 {answer.status}", f"Content-Type: {answer.content_type}",
                 f"Content-Length: {len(answer.body)}", *answer.extra,
                 f"Connection: {'keep-alive' if answer.keep else 'close'}"]
        body = memoryview(b"" if head_only else answer.body)
        deadline = time.monotonic() + self.idle_timeout + len(body) / _SEND_RATE
        try:
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            for start in range(0, len(body), _CHUNK):
                writer.write(body[start:start + _CHUNK])
                await asyncio.wait_for(writer.drain(), max(0.0, deadline - time.monotonic()))
            await asyncio.wait_for(writer.drain(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            self.timed_out += 1
            return False
        except ConnectionError:
            return False
        return True

    # --- requests -------------------------------------------------------------------------------------------

    async def _respond(self, head: bytes) -> tuple[_Answer, bool]:
        """The answer to one request head, and whether it is a HEAD request (headers only)."""
        lines = head[:-4].decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or parts[2] not in ("HTTP/1.0", "HTTP/1.1"):
            return _Answer("400 Bad Request", b"not an HTTP/1.x request line\n"), False
        method, target, version = parts
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                return _Answer("400 Bad Request", b"a malformed header line\n"), False
            headers[name.lower()] = value.strip()
        if headers.get("transfer-encoding") or headers.get("content-length", "0") != "0":
            return _Answer("400 Bad Request", b"a request with a body: this endpoint only answers GET\n"), False
        if method not in ("GET", "HEAD"):
            return _Answer("405 Method Not Allowed", b"only GET and HEAD\n", extra=("Allow: GET, HEAD",)), False
        if target.split("?", 1)[0] not in PATHS:
            return _Answer("404 Not Found", b"the metrics are at /metrics\n"), method == "HEAD"
        keep = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        from prometheus_client.exposition import choose_encoder, gzip_accepted

        try:
            encoder, content_type = choose_encoder(headers.get("accept", ""))
        except (TypeError, ValueError):  # e.g. `version=abc`: prometheus_client compares it as a number
            return _Answer("400 Bad Request", b"an Accept header with an unreadable version\n"), False
        zipped = gzip_accepted(headers.get("accept-encoding", ""))
        try:
            body = await self._rendering(encoder, content_type, zipped)
        except Exception as exc:  # the cache did not answer: say so, keep serving
            text = " ".join(f"{type(exc).__name__}: {exc}".split())
            return _Answer("503 Service Unavailable", f"cannot read the live cache's figures: {text}\n".encode(),
                           keep=keep), method == "HEAD"
        self.served += 1
        return _Answer("200 OK", body, content_type=content_type, keep=keep,
                       extra=("Content-Encoding: gzip",) if zipped else ()), method == "HEAD"

    async def _rendering(self, encoder: Callable[[Any], bytes], content_type: str, zipped: bool) -> bytes:
        """The exposition in this encoding: from the current read when it is younger than `refresh_s` (or still
        under way), else from a new one; each (read, encoding) is rendered once, on the render thread. A failed
        read is not kept: the next scrape reads again."""
        now = time.monotonic()
        current = self._current
        assert self._render is not None, "started"
        if current is None or (current.families.done() and now - current.at >= self.refresh_s):
            current = self._current = _Exposition(now, asyncio.wrap_future(self._render.submit(self._read)))
        try:
            rendering = current.renderings.get((content_type, zipped))
            if rendering is None:
                families = await asyncio.shield(current.families)
                rendering = current.renderings.get((content_type, zipped))  # made by another scrape meanwhile?
                if rendering is None:
                    rendering = current.renderings[(content_type, zipped)] = asyncio.wrap_future(
                        self._render.submit(_encode, encoder, families, zipped))
            return await asyncio.shield(rendering)
        except Exception:
            if self._current is current:
                self._current = None
            raise

    def _read(self) -> list[Metric]:
        return list(self.collect())


def _end(writer: asyncio.StreamWriter) -> None:
    """Close a connection: gracefully when all it was written is with the kernel (then sent, then FIN), at once
    when a reader left part of an answer unread past its deadline (a graceful close would wait for it forever)."""
    if writer.transport.get_write_buffer_size():
        writer.transport.abort()
    else:
        writer.close()


def _encode(encoder: Callable[[Any], bytes], families: list[Metric], zipped: bool) -> bytes:
    from .metrics import registry_of

    text = encoder(registry_of(lambda: families))
    return gzip.compress(text, compresslevel=6) if zipped else text
