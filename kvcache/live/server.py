"""`AdminServer`: a live cache's admin socket, wrapped around a cache it is given (DESIGN §7).

The engine owns the cache and its thread; the server owns a socket. `AdminServer(cache, path)` claims the path
and starts accepting at once; the requests that arrive wait in a queue until the engine calls `server.poll()`
between two scheduler steps, which runs them on the engine's thread (`kvcache.ops.handlers`), so every answer sees
the cache at rest. The cache knows nothing of this: it never imports live mode, and closing the server leaves it
untouched.

A cache whose store is a `kvcache.storage.serving.FencedStore` is a serving cache of a shared store: the server
records itself in the store (pid, host, socket) while it runs, and follows the store's drop records — before
each admin request and at least every DROPS_POLL_S in the owner loop, it drops from the cache every namespace
dropped elsewhere (offline or through another live cache), so that it never writes one back.

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

import contextlib
import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from ..errors import StoreError
from ..ops.handlers import execute, held_namespaces
from ..storage.api import ServeRecord
from ..storage.serving import FencedStore, new_serve_record
from ..types.ids import NamespaceId
from .serves import alive
from .transport import AdminTransport

if TYPE_CHECKING:
    import msgspec

    from ..engine.cache import TieredCache


log = logging.getLogger("kvcache")

DROPS_POLL_S = 0.1  # how often the owner loop reads the store's drop number (puts and admin requests always do)


class AdminServer:
    """The admin socket of `cache` at `path`. Options (`mode`, `allow_uids`, `max_connections`, `idle_timeout`,
    upload caps) are `transport.AdminTransport`'s. Usable as a context manager (closes the socket on exit)."""

    def __init__(self, cache: "TieredCache", path: str | os.PathLike[str], **options: Any) -> None:
        self.cache = cache
        store = cache.store
        self.watch = store.watch if isinstance(store, FencedStore) else None  # the drops it follows
        self.serve_record: ServeRecord | None = None  # this server's record in the store, while it is there
        self._drops_polled = 0.0
        self.transport = AdminTransport(path, self._execute, **options).start()
        if self.watch is not None:
            self.watch.by = self.transport.path
            if not self.watch.store.readonly:  # a cache that cannot write its store writes nothing back
                try:
                    self._register()
                except BaseException:
                    self.transport.close()
                    raise

    def _register(self) -> None:
        """Record this server in the store, and remove the records of this machine's servers that died without
        removing theirs (SIGKILL)."""
        assert self.watch is not None
        store, me = self.watch.store, socket.gethostname()
        mine = self.serve_record = new_serve_record(self.transport.path)
        store.register_serve(mine)
        for record in store.serves():
            if record.host == me and record.token != mine.token and not alive(record.pid):
                store.unregister_serve(record.token)

    def _execute(self, request: object) -> msgspec.Struct:
        # A replay polls this server between its steps, so the requests queued meanwhile are answered too.
        self.follow_drops()
        return execute(self.cache, request, between_steps=self.transport.poll)

    def follow_drops(self) -> int:
        """Drop from the cache each namespace the store's new drop records name (on the owner thread). Returns
        how many it held. A store that cannot be read now is read again at the next call."""
        watch = self.watch
        if watch is None:
            return 0
        self._drops_polled = time.monotonic()
        try:
            watch.refresh()
        except StoreError as exc:
            log.warning("cannot read the store's drop records (tried again at the next step): %s", exc)
            return 0
        records = watch.pending()
        if not records:
            return 0
        held, dropped = held_namespaces(self.cache), 0
        for record in records:
            namespace = held.get(NamespaceId(bytes.fromhex(record.ns_id_hex)))
            if namespace is not None:
                with watch.applying():
                    self.cache.drop_namespace(namespace)
                dropped += 1
            watch.done(record)
        return dropped

    def _owner_step(self) -> Any:
        if self.watch is not None and time.monotonic() - self._drops_polled >= DROPS_POLL_S:
            self.follow_drops()
        return self.cache.poll()

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
        between scheduler steps); wait up to `wait` seconds for a first one. Returns how many ran. A serving
        cache follows its store's drop records here too."""
        if self.watch is not None and time.monotonic() - self._drops_polled >= DROPS_POLL_S:
            self.follow_drops()
        return self.transport.poll(wait)

    def serve_forever(self, stop: threading.Event, tick: float = 0.01) -> None:
        """The owner loop of a cache with no engine: run queued requests and the cache's finished copies and L3
        jobs until `stop` is set (a signal handler may set it; a running replay then stops at its next step)."""
        self.transport.serve_forever(self._owner_step, stop, tick)

    def start_owner_thread(self) -> "AdminServer":
        """Run `serve_forever` on a helper thread, which owns the cache from now on: nothing else may call the
        cache until `close()`. Returns self."""
        self.transport.start_owner_thread(self._owner_step)
        return self

    def close(self) -> None:
        """Stop accepting, answer what is still queued with `shutting_down`, stop the owner thread if one runs,
        and remove the socket file and the store's record of this server. The cache stays open. Idempotent."""
        self.transport.close()
        record, self.serve_record = self.serve_record, None
        if record is not None and self.watch is not None:
            with contextlib.suppress(StoreError):  # a store gone meanwhile: the record is stale, and skipped as such
                self.watch.store.unregister_serve(record.token)

    def __enter__(self) -> "AdminServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
