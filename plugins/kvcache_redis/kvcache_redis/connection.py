"""The store's link to the server: the redis-py client and the Lua scripts registered on it, and how a fault is
told apart and answered.

A fault of the connection or the server (`FAULTS`) on the data path is counted and starts a pause (exponential,
up to the URL's `backoff_max`) during which data calls answer at once instead of waiting on a dead server; on an
administrative call it is a StoreError, since its caller must know the answer is missing. Messages never quote
redis-py's text (it may echo a URL or a command): `said` puts a fault in kvc's own words.
"""

from __future__ import annotations

import errno
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvcache.storage.kit import InvalidInput, StoreError, StoreHandle, new_counts

from .scripts import NS_ADJUST, PUT_BATCH, PUT_PAGE, RECORD, REMOVE_BATCH, REMOVE_PAGE, TOUCH
from .url import StoreUrl

T = TypeVar("T")
BACKOFF_START_S = 0.05

# Faults of the connection or the server, as opposed to a bug in a request: these degrade to a miss or a
# failed write. ResponseError covers OOM and a server that refuses writes (a replica, MISCONF on a failed save).
FAULTS = (redis.ConnectionError, redis.TimeoutError, redis.ResponseError, redis.exceptions.ClusterError,
          redis.exceptions.RedisClusterException, OSError)

# An OOM reply (maxmemory reached under noeviction), which redis-py raises as its own class where it has one
OOM: tuple[type[BaseException], ...] = tuple(
    c for c in (getattr(redis.exceptions, "OutOfMemoryError", None),) if isinstance(c, type))


def said(exc: BaseException) -> str:
    """kvc's own words for a fault redis-py raised: its kind, the OS error under a connection fault, the code that
    starts a server's error reply. A library's message may quote what it was handed (a URL, a reply echoing a
    command), so it is never printed."""
    if isinstance(exc, redis.AuthenticationError):
        return "the server refused the credentials (a wrong or missing password or user)"
    if isinstance(exc, redis.TimeoutError):
        return "no answer within the timeout"
    if isinstance(exc, redis.BusyLoadingError):
        return "the server is loading its data set"
    if isinstance(exc, (redis.ConnectionError, OSError)):
        cause = exc if isinstance(exc, OSError) else exc.__cause__ or exc.__context__
        if isinstance(cause, OSError) and cause.errno:
            return f"cannot connect ({errno.errorcode.get(cause.errno, cause.errno)}: {os.strerror(cause.errno)})"
        return "the connection failed or was closed"
    if isinstance(exc, redis.ResponseError):
        code = str(exc).split(" ", 1)[0]
        return f"the server answered {code}" if re.fullmatch(r"[A-Z][A-Z_-]{1,31}", code) else \
            "the server answered an error"
    return f"{type(exc).__name__} from the redis client"


def connect(url: StoreUrl, redis_options: dict[str, Any]) -> Any:
    """A redis-py client for `url`. No retries inside redis-py: a fault surfaces at once, and the store's own
    backoff decides when to try again (a scheduler must not sit in a retry loop on a dead server)."""
    opts = url.options
    kwargs: dict[str, Any] = dict(socket_timeout=opts.timeout, socket_connect_timeout=opts.connect_timeout,
                                  retry=Retry(NoBackoff(), 0))
    kwargs.update(redis_options)
    try:
        if url.cluster:
            from redis.cluster import RedisCluster

            return RedisCluster.from_url(url.client_url, **kwargs)
        client = redis.Redis.from_url(url.client_url, retry_on_timeout=False, **kwargs)
        # redis-py checks some options only when it builds a connection: build one now (no I/O) so a bad option
        # is an error of the URL, not of the first command.
        client.connection_pool.make_connection().disconnect()
        return client
    except FAULTS as exc:
        raise StoreError(url.shown, f"cannot reach the server: {said(exc)}") from None
    except (ValueError, TypeError, redis.RedisError) as exc:
        raise InvalidInput(f"{url.shown}: unusable connection option in the URL "
                           f"({_option_error(exc, url.client_url)})") from None


def _option_error(exc: BaseException, client_url: str) -> str:
    """redis-py's complaint about a URL option, in the URL's terms: the option it names, never its text (which
    may quote a value, and a value may be a credential)."""
    text = str(exc)
    m = re.search(r"unexpected keyword argument '(\w+)'", text)
    if m:
        return f"{m.group(1)} is not an option of this kind of connection (TLS options need rediss://)"
    named = [name for name, _ in parse_qsl(urlsplit(client_url).query, keep_blank_values=True)
             if re.search(rf"['\"]{re.escape(name)}['\"]", text)]
    return f"redis-py refused the value of {', '.join(named)}" if named else \
        f"redis-py refused an option ({type(exc).__name__})"


def hmget_many(client: Any, keys: Sequence[bytes], fields: tuple[str, ...]) -> list[list[Any]]:
    """The asked fields of each hash key, one pipelined round trip."""
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.hmget(k, *fields)
    return pipe.execute()


def smembers_many(client: Any, keys: Sequence[bytes]) -> list[set[bytes]]:
    """The members of each set key, one pipelined round trip."""
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.smembers(k)
    return pipe.execute()


@StoreHandle.in_flight
def _counted(handle: StoreHandle, call: Callable[[], T]) -> T:
    """`call()` counted among `handle`'s calls in flight: the handle's close waits for it."""
    return call()


class Connection:
    """One store handle's connection to the server, shared by every part of the handle: the client, the scripts
    registered on it, the handle's counters (and the lock that guards them and the parts' shared state), the
    backoff after a fault, and whether the handle is closed."""

    def __init__(self, handle: StoreHandle, url: StoreUrl, client: Any) -> None:
        # whose close waits for the administrative calls in flight; weak: the handle owns its connection, so a
        # handle dropped unclosed is freed, its connections with it, at once rather than at a garbage collection
        self._handle = weakref.ref(handle)
        self.location = url.shown
        self.cluster = url.cluster
        self.client = client
        self.lock = threading.Lock()  # guards the counters, the backoff and the parts' logs and sets
        self.counts = new_counts()
        self.closed = False
        self._backoff_max = url.options.backoff_max
        self._down_until = 0.0  # monotonic time before which data calls do not try the server
        self._backoff = 0.0
        self.put_batch = client.register_script(PUT_BATCH)
        self.put_page = client.register_script(PUT_PAGE)
        self.ns_adjust = client.register_script(NS_ADJUST)
        self.touch = client.register_script(TOUCH)
        self.remove_batch = client.register_script(REMOVE_BATCH)
        self.remove_page = client.register_script(REMOVE_PAGE)
        self.record = client.register_script(RECORD)

    def call(self, script: Any, keys: list[Any], args: list[Any], client: Any) -> Any:
        """Run a script on `client` (the store's client or a pipeline of it). redis-py's cluster pipeline refuses
        EVALSHA (and shadows `eval`), so a cluster sends EVAL with the text as a plain command, routed by its
        first key: the server caches the compiled script by its SHA-1 all the same."""
        if self.cluster:
            return client.execute_command("EVAL", script.script, len(keys), *keys, *args)
        return script(keys=keys, args=args, client=client)

    def live(self) -> Any:
        """The client; StoreClosed once the handle is closed."""
        if self.closed:
            raise self._owner().closed_error()
        return self.client

    def available(self) -> bool:
        """Whether a data call may try the server now (not inside a backoff pause after a fault)."""
        return time.monotonic() >= self._down_until

    def fault(self, counter: str, exc: BaseException | None = None) -> None:
        """Count a fault; a connection fault (not an error reply: the server is there) starts, or lengthens, the
        pause before the next attempt."""
        with self.lock:
            self.counts[counter] += 1
            if isinstance(exc, redis.ResponseError):
                return
            self._backoff = min(max(2 * self._backoff, BACKOFF_START_S), self._backoff_max)
            self._down_until = time.monotonic() + self._backoff

    def ok(self) -> None:
        """A data call got its answer: the next fault starts the pause afresh."""
        if self._backoff:
            with self.lock:
                self._backoff = 0.0

    def admin(self, call: Callable[[Any], T]) -> T:
        """Run an administrative call on the client, counted in flight: a fault raises StoreError (its caller
        must know the answer is missing)."""
        return _counted(self._owner(), lambda: self._admin(call))

    def _owner(self) -> StoreHandle:
        handle = self._handle()
        assert handle is not None  # the parts that share this connection are called through their handle only
        return handle

    def _admin(self, call: Callable[[Any], T]) -> T:
        client = self.live()
        try:
            return call(client)
        except FAULTS as exc:
            raise StoreError(self.location, f"redis: {said(exc)}") from None

    def used_memory(self) -> int:
        """The server's memory in use, bytes (summed over a cluster's nodes); 0 when it does not answer."""
        try:
            info = self.client.info("memory")
            # A cluster client answers per node: the footprint is the sum over them.
            return (int(info.get("used_memory", 0)) if "used_memory" in info
                    else sum(int(v.get("used_memory", 0)) for v in info.values() if isinstance(v, dict)))
        except FAULTS:
            return 0

    def close(self) -> None:
        """Release the connections (best effort: they are being dropped either way)."""
        try:
            self.client.close()
        except FAULTS:
            pass
