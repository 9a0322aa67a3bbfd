"""What every backend's store handle keeps in memory: its counters, the log of reads not yet written back, and the
calls in flight its close waits for.

Access times and hit counts are recorded in memory and written in batches (`L3Store.flush`), never one write per
read (kvcache.storage.api): a read is one `AccessLog` entry, its hit credited to the deepest page it reached. The rules
of the read counters (a short read is a miss) are here too, so every backend counts alike.

A handle is used from several threads at once, and any of them may close it (an engine's detach while its prefetch
thread reads). A close that drops what a call is using under it (a connection, a mapping) turns that call into a
crash or a stray exception, so a backend marks the calls that use such things (`StoreHandle.in_flight`) and its
close waits for those running on other threads (`StoreHandle.wait_in_flight`) before it drops them.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import StoreClosed
from .api import AccessPolicy, StoreCounters

if TYPE_CHECKING:
    from ..types.layout import KVLayout

COUNTED = tuple(name for name in StoreCounters.__struct_fields__ if name != "pending_access")
F = TypeVar("F", bound=Callable[..., Any])


def new_counts() -> dict[str, int]:
    """A handle's counters (every StoreCounters field but `pending_access`, which the access log knows), at 0.
    Plain integer increments: a lost update between threads skews a figure, never a result."""
    return dict.fromkeys(COUNTED, 0)


def count_read(counts: dict[str, int], served: int, asked: int, copied: bool = False) -> int:
    """Count one `exists_prefix` (or, `copied`, `get_into`) call that served `served` of `asked` pages: one that
    stopped before the end of its batch is a miss. Returns `served`."""
    if copied:
        counts["pages_read"] += served
    if served < asked:
        counts["misses"] += 1
    return served


class AccessLog:
    """Reads served and not yet written back: one tuple a read, its time first and the pages it served last
    (a backend puts what its flush needs in between: the deepest page, its namespace...). Thread-safe."""

    def __init__(self, policy: AccessPolicy, keep: int = 0) -> None:
        self.policy = policy
        self._keep = keep  # the most entries kept when a failed flush gives them back (0: all); the oldest go
        self._lock = threading.Lock()
        self._entries: list[tuple[Any, ...]] = []
        self._since = 0.0  # when the oldest entry was logged
        self.pages = 0  # pages served by the logged reads (StoreCounters.pending_access)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def record(self, *entry: Any) -> bool:
        """Log one read, `(when, ..., pages)`; whether a flush is due now (AccessPolicy)."""
        now = entry[0]
        with self._lock:
            if not self._entries:
                self._since = now
            self._entries.append(entry)
            self.pages += entry[-1]
            return (len(self._entries) >= self.policy.flush_reads
                    or now - self._since >= self.policy.flush_interval_s)

    def take(self) -> list[tuple[Any, ...]]:
        """Every logged read, oldest first; the log is empty afterwards."""
        with self._lock:
            entries, self._entries, self.pages = self._entries, [], 0
            return entries

    def restore(self, entries: list[tuple[Any, ...]]) -> None:
        """Give back what `take` returned (its flush failed), ahead of reads logged since."""
        with self._lock:
            self._entries[:0] = entries
            if self._keep and len(self._entries) > self._keep:
                del self._entries[:len(self._entries) - self._keep]
            self.pages = sum(e[-1] for e in self._entries)

    def clear(self) -> None:
        """Forget every logged read (a forked child: they are the parent's)."""
        self.take()


class InFlight:
    """The calls of one handle running now, per thread (a call made inside another counts twice, on its thread)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._threads: dict[int, int] = {}  # thread id -> calls of it running

    def enter(self) -> int:
        """Count a call in; the id of its thread, for `leave`."""
        me = threading.get_ident()
        with self._cond:
            self._threads[me] = self._threads.get(me, 0) + 1
        return me

    def leave(self, thread: int) -> None:
        """Count a call out."""
        with self._cond:
            left = self._threads.pop(thread) - 1
            if left:
                self._threads[thread] = left
            else:
                self._cond.notify_all()

    def wait_others(self) -> None:
        """Wait until no other thread runs a call (this thread's own are not waited for: it is inside them)."""
        me = threading.get_ident()
        with self._cond:
            while any(t != me for t in self._threads):
                self._cond.wait()


class StoreHandle:
    """What every backend's handle does alike as a Python object: a context manager that closes it, a repr
    naming where it is, its layout and whether it writes, and the calls in flight its close waits for (see the
    module docstring). A subclass has `location`, `layout`, `readonly` and `close()`."""

    _shown_as = "location"  # the attribute the repr shows (LMDB: the real path)
    # what the subclass sets (declared here for the type checker: no class attributes)
    location: str
    layout: KVLayout | None
    readonly: bool

    if TYPE_CHECKING:
        def close(self) -> None:
            """The subclass's: flush and release the handle."""

    @staticmethod
    def in_flight(method: F) -> F:
        """Decorate a method that uses what `close` drops: it is counted in flight while it runs, and the close
        waits for it (`wait_in_flight`). The method must refuse to start on a closed handle (StoreClosed): a call
        counted in before the close marks the handle closed is waited for, one counted in after sees the mark."""

        @functools.wraps(method)
        def counted(self: StoreHandle, *args: Any, **kwargs: Any) -> Any:
            calls = self._calls()
            thread = calls.enter()
            try:
                return method(self, *args, **kwargs)
            finally:
                calls.leave(thread)

        return counted  # type: ignore[return-value]

    def wait_in_flight(self) -> None:
        """Wait for the `in_flight` calls other threads run on this handle (the close calls it once the handle is
        marked closed, before it drops what they use)."""
        self._calls().wait_others()

    def closed_error(self) -> StoreClosed:
        """The error a call on this handle raises once it is closed (a backend imports only the kit: this is its
        way to the class)."""
        return StoreClosed(getattr(self, self._shown_as))

    def _calls(self) -> InFlight:
        calls = self.__dict__.get("_in_flight_calls")
        if calls is None:  # made on first use (a subclass's __init__ does not call ours); setdefault keeps one
            calls = self.__dict__.setdefault("_in_flight_calls", InFlight())
        return calls

    def __enter__(self) -> "StoreHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        layout = self.layout.describe() if self.layout else "no layout"
        flags = ", read-only" if self.readonly else ""
        return f"{type(self).__name__}({getattr(self, self._shown_as)!r}, {layout}{flags})"
