"""`AdminServer`: a live cache's admin socket, wrapped around a cache it is given (DESIGN §7).

The engine owns the cache and its thread; the server owns a socket. `AdminServer(cache, path)` claims the path
and starts accepting at once; the requests that arrive wait in a queue until the engine calls `server.poll()`
between two scheduler steps, which runs them on the engine's thread (`kvcache.ops.handlers`), so every answer sees
the cache at rest. The cache knows nothing of this: it never imports live mode, and closing the server leaves it
untouched.

A cache with no engine loop (`kvc serve`, tests, benchmarks) is driven by `serve_forever(stop)` — the owner loop:
queued requests, then the cache's finished copies and L3 jobs (`cache.poll()`), again and again — or by
`start_owner_thread()`, which runs that loop on a helper thread that owns the cache until `close()`.

    cache = TieredCache(config, store)
    with AdminServer(cache, "/run/kvc/engine.sock") as server:
        while serving:
            engine_step(cache)
            server.poll()          # admin requests run here, between steps
    cache.close()                  # after the server: a request never meets a closed cache
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

from ..ops.handlers import execute
from .transport import AdminTransport

if TYPE_CHECKING:
    from ..engine.cache import TieredCache


class AdminServer:
    """The admin socket of `cache` at `path`. Options (`mode`, `allow_uids`, `max_connections`, `idle_timeout`,
    upload caps) are `transport.AdminTransport`'s. Usable as a context manager (closes the socket on exit)."""

    def __init__(self, cache: "TieredCache", path: str | os.PathLike, **options: Any) -> None:
        self.cache = cache
        self.transport = AdminTransport(path, self._execute, **options).start()

    def _execute(self, request: object) -> object:
        # A replay polls this server between its steps, so the requests queued meanwhile are answered too.
        return execute(self.cache, request, between_steps=self.transport.poll)

    @property
    def path(self) -> str:
        """The socket's absolute path."""
        return self.transport.path

    @property
    def served(self) -> int:
        """Requests answered so far."""
        return self.transport.served

    @property
    def refused(self) -> int:
        """Connections refused so far: a peer not on the allow-list."""
        return self.transport.refused

    @property
    def busy(self) -> int:
        """Connections answered `busy` so far: the server was at its connection limit."""
        return self.transport.busy

    @property
    def pending(self) -> int:
        """Requests queued and not yet run."""
        return self.transport.pending

    def poll(self, wait: float = 0.0) -> int:
        """Run the admin requests queued now on the calling thread, which must be the cache's owner (the engine,
        between scheduler steps); wait up to `wait` seconds for a first one. Returns how many ran."""
        return self.transport.poll(wait)

    def serve_forever(self, stop: threading.Event, tick: float = 0.01) -> None:
        """The owner loop of a cache with no engine: run queued requests and the cache's finished copies and L3
        jobs until `stop` is set (a signal handler may set it; a running replay then stops at its next step)."""
        self.transport.serve_forever(self.cache.poll, stop, tick)

    def start_owner_thread(self) -> "AdminServer":
        """Run `serve_forever` on a helper thread, which owns the cache from now on: nothing else may call the
        cache until `close()`. Returns self."""
        self.transport.start_owner_thread(self.cache.poll)
        return self

    def close(self) -> None:
        """Stop accepting, answer what is still queued with `shutting_down`, stop the owner thread if one runs,
        and remove the socket file. The cache stays open. Idempotent."""
        self.transport.close()

    def __enter__(self) -> "AdminServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
