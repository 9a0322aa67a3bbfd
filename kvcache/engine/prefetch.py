"""L3 -> L2 prefetch: the operation a request's prefetch creates, its I/O jobs, and the values it reports.

The prefetch key is built from the **request's** namespace: the page hashes of the span come from the request's
own chain (`page_hashes(layout_id, request.key)`), never from a tree node. The anchor the span hangs from is only
checked — it must be the tree's root or of the request's namespace — and a disagreement is `NamespaceMismatch`,
raised before any slot is taken.

The operation is bound to its request: its key (namespace and tokens) is the request's, and admission uses it only
for a request whose tokens start with that key. It *holds* its anchor's path on the one tier its result attaches
to (a host copy in cache mode, the device prefix in buffer mode), never the whole path, and only within bounds.

Life of one operation (all pool and tree moves on the scheduler thread; the I/O worker only reads the store and
writes the bytes of pages the operation owns):

    CHECKING  --exists_prefix-->  (poll) allocate host pages for the hit, FREE -> Op(prefetch)
    FETCHING  --get_into, one batch per step, stoppable between batches-->  (poll) attempt done
    a short attempt is re-armed (bounded, paced) until admission; admission terminates the operation and hands
    what arrived to the request's insert (cache mode) or parks it as a staged record (buffer mode).
"""

from __future__ import annotations

import enum
import threading
import time

import msgspec
import numpy as np

from ..types.keys import RadixKey
from ..types.namespace import Namespace, NamespaceInfo
from ..types.owners import OwnerKind, owner_code
from ..storage.api import L3Store
from ..tree import Tier, TreeNode


class PrefetchState(str, enum.Enum):
    """Where a prefetch operation is."""

    CHECKING = "checking"  # waiting for exists_prefix
    FETCHING = "fetching"  # pages allocated, batches being read
    WAITING = "waiting"  # an attempt ended short; re-armed for a later attempt
    DONE = "done"  # no more attempts; what arrived stays owned by the operation until admission
    FINISHED = "finished"  # handed over (admission) or given back (abort); the operation holds nothing


class PrefetchOp:
    """An L3 -> L2 prefetch for one request. Owns its host pages (Op(prefetch)) until admission or abort."""

    __slots__ = ("id", "owner", "rid", "namespace", "key", "start_page", "hashes", "anchor", "hold", "pages",
                 "fetched", "attempts", "state", "lock", "terminated", "next_attempt", "created", "job", "hit")

    def __init__(self, ident: int, rid: str, key: RadixKey, start_page: int, hashes: list[bytes],
                 anchor: TreeNode | None, hold: Tier | None) -> None:
        self.id = ident
        self.owner = owner_code(OwnerKind.OP_PREFETCH, ident)
        self.rid = rid
        self.namespace: Namespace = key.namespace  # the request's: every hash below was built from it
        self.key = key  # the request's key, page-aligned, up to the end of the span
        self.start_page = start_page  # pages of the key the tree held at issue; the span starts here
        self.hashes = hashes  # page hashes of the span, from the request's own chain
        self.anchor = anchor  # ends the span's prefix [0, start_page); None when the span starts at page 0
        self.hold = hold  # the tier on which the anchor's path is held while the operation lives (None: no hold)
        self.pages = np.empty(0, dtype=np.int64)  # host pages owned by this op; [:fetched] hold span pages
        self.fetched = 0  # pages of the span that have arrived, in order; changed only under `lock`
        self.attempts = 0
        self.state = PrefetchState.CHECKING
        self.lock = threading.Lock()  # held by the worker for one batch; taken by terminate()
        self.terminated = False  # no further batch starts once set
        self.next_attempt = 0.0  # monotonic seconds when a WAITING op is re-armed
        self.created = time.monotonic()
        self.job: CheckJob | FetchJob | None = None  # the job in flight, if any
        self.hit = 0  # pages of the span the store reported present (the longest run seen by any attempt)

    @property
    def wanted(self) -> int:
        """Pages of the span."""
        return len(self.hashes)

    def terminate(self) -> None:
        """Stop between batches: after this returns, the worker writes no more bytes for this op."""
        with self.lock:
            self.terminated = True

    def __repr__(self) -> str:
        return (f"PrefetchOp(#{self.id} {self.rid} {self.namespace.label} {self.state.value} "
                f"{self.fetched}/{self.wanted} pages)")


class CheckJob:
    """How many pages of the op's remaining span the store holds (consecutive from the first missing one)."""

    def __init__(self, op: PrefetchOp) -> None:
        self.op = op
        self.hit = 0
        self.finished = False
        self.error: BaseException | None = None

    def step(self, store: L3Store) -> bool:
        op = self.op
        if not op.terminated:
            self.hit = store.exists_prefix(op.hashes[op.fetched:])
        return False


class FetchJob:
    """Reads the op's hit pages into its host pages, one batch per step."""

    def __init__(self, op: PrefetchOp, views: list, batch: int) -> None:
        self.op = op
        self.views = views  # writable byte views of op.pages[op.fetched:], one per page
        self.batch = batch
        self.done_pages = 0  # pages of `views` filled
        self.finished = False
        self.error: BaseException | None = None

    def step(self, store: L3Store) -> bool:
        op = self.op
        with op.lock:
            if op.terminated:
                return False
            start = op.fetched
            end = min(start + self.batch, start + len(self.views) - self.done_pages)
            if end <= start:
                return False
            got = store.get_into(op.hashes[start:end], self.views[self.done_pages:self.done_pages + end - start])
            self.done_pages += got
            op.fetched = start + got
            # a short batch: the page left the store (evicted, corrupt) since the check; the attempt ends here
            return got == end - start and self.done_pages < len(self.views)
