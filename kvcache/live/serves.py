"""The live caches serving a store, found from the store's serving records (`kvcache.storage.serving`).

A record outlives a process killed with SIGKILL, and a socket path may be taken over by another server: a record
counts only when, on this machine, its process is alive and its socket answers a ping from that process. A record
of another machine cannot be checked from here and is kept (its socket is named with its host).
"""

from __future__ import annotations

import contextlib
import os
import socket

import msgspec

from ..storage.api import L3Store, ServeRecord
from .client import AdminClient
from .protocol import LiveNamespace, NamespaceList, NamespacesRequest, PingRequest, ServerInfo

PING_TIMEOUT_S = 5.0  # a live server answers between two steps; one that takes longer is counted as gone


class LiveServe(msgspec.Struct, frozen=True):
    """A serving record that checked out, and what it holds of one namespace (when asked)."""

    record: ServeRecord
    local: bool  # on this machine (checked); False: another machine's, kept unchecked
    holds: LiveNamespace | None = None  # the namespace's row in that cache, when it holds pages of it in L1/L2


def where(record: ServeRecord) -> str:
    """How a serving record is named in messages: its socket, with its host when it is another machine's."""
    return record.socket if record.host == socket.gethostname() else f"{record.host}:{record.socket}"


def alive(pid: int) -> bool:
    """Whether a process with this pid runs on this machine (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _answers(record: ServeRecord, timeout: float) -> bool:
    with contextlib.suppress(Exception):  # any failure to reach it (gone, refused, not ours) is "not answering"
        with AdminClient(record.socket, timeout=timeout) as client:
            return client.call(PingRequest(), ServerInfo).pid == record.pid
    return False


def live_serves(store: L3Store, timeout: float = PING_TIMEOUT_S) -> list[LiveServe]:
    """The store's serving records that are live (stale ones skipped: see the module docstring)."""
    me = socket.gethostname()
    out = []
    for rec in store.serves():
        if rec.host != me:
            out.append(LiveServe(rec, False))
        elif alive(rec.pid) and _answers(rec, timeout):
            out.append(LiveServe(rec, True))
    return out


def holding(serves: list[LiveServe], shown_id: str, timeout: float = PING_TIMEOUT_S) -> list[LiveServe]:
    """The serves that hold namespace `shown_id` (its display id) in L1 or L2; another machine's serves are
    counted as holding it (they cannot be asked from here)."""
    out = []
    for serve in serves:
        if not serve.local:
            out.append(serve)
            continue
        with contextlib.suppress(Exception):  # gone since it was pinged: it holds nothing
            with AdminClient(serve.record.socket, timeout=timeout) as client:
                rows = client.call(NamespacesRequest(), NamespaceList).namespaces
            row = next((r for r in rows if r.id == shown_id), None)
            if row is not None and (row.device.pages or row.host.pages):
                out.append(LiveServe(serve.record, True, row))
    return out
