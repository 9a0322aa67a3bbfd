"""What every backend's store handle keeps in memory: its counters and the log of reads not yet written back.

Access times and hit counts are recorded in memory and written in batches (`L3Store.flush`), never one write per
read (kvcache.storage.api): a read is one `AccessLog` entry, its hit credited to the deepest page it reached. The rules
of the read counters (a short read is a miss) are here too, so every backend counts alike.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from .api import AccessPolicy, StoreCounters

if TYPE_CHECKING:
    from ..types.layout import KVLayout

COUNTED = tuple(name for name in StoreCounters.__struct_fields__ if name != "pending_access")


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


class StoreHandle:
    """What every backend's handle does alike as a Python object: a context manager that closes it, and a repr
    naming where it is, its layout and whether it writes. A subclass has `location`, `layout`, `readonly` and
    `close()`."""

    _shown_as = "location"  # the attribute the repr shows (LMDB: the real path)
    # what the subclass sets (declared here for the type checker: no class attributes)
    location: str
    layout: KVLayout | None
    readonly: bool

    if TYPE_CHECKING:
        def close(self) -> None:
            """The subclass's: flush and release the handle."""

    def __enter__(self) -> "StoreHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        layout = self.layout.describe() if self.layout else "no layout"
        flags = ", read-only" if self.readonly else ""
        return f"{type(self).__name__}({getattr(self, self._shown_as)!r}, {layout}{flags})"
