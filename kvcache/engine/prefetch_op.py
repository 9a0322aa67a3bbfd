"""An L3 -> L2 prefetch in flight (`PrefetchOp`) and the two jobs the I/O worker runs for it: a check of how much
of its span the store holds (`CheckJob`) and a fetch of those pages into the op's host pages (`FetchJob`).

The operation owns its host pages (Op(prefetch)) and holds its anchor's path on one tier until admission or abort;
its life (the states below, and every change of them) is `kvcache.engine.prefetch`'s. The I/O worker only reads
the store and writes the bytes of pages the operation owns, one batch at a time under the op's lock, so that a
`terminate` stops it between batches.
"""

from __future__ import annotations

import enum
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from ..diagnostics.ownership import HolderState, encode_pages
from ..types.ids import PageHash
from ..types.keys import RadixKey
from ..types.namespace import Namespace
from ..types.owners import OwnerKind, owner_code
from ..types.tier import Tier
from .operation import anchor_holds

if TYPE_CHECKING:
    from ..storage.api import PageStore
    from ..tree import TreeNode


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

    def __init__(self, ident: int, rid: str, key: RadixKey, start_page: int, hashes: list[PageHash],
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

    @property
    def issued_by(self) -> int:
        """The prefetch that took the hold (this one): holds are cancelled youngest first."""
        return self.id

    def terminate(self) -> None:
        """Stop between batches: after this returns, the worker writes no more bytes for this op."""
        with self.lock:
            self.terminated = True

    def holder_state(self, device_pool: str, host_pool: str) -> HolderState:
        """The host pages it owns, and its anchor's hold."""
        return HolderState("op:prefetch", self.id, self.owner, host_pool, encode_pages(self.pages), rid=self.rid,
                           device_holds=anchor_holds(self, Tier.DEVICE), host_holds=anchor_holds(self, Tier.HOST))

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

    def step(self, store: PageStore) -> bool:
        """Ask the store once; never more to do."""
        op = self.op
        if not op.terminated:
            self.hit = store.exists_prefix(op.hashes[op.fetched:])
        return False


class FetchJob:
    """Reads the op's hit pages into its host pages, one batch per step."""

    def __init__(self, op: PrefetchOp, views: list[np.ndarray], batch: int) -> None:
        self.op = op
        self.views = views  # writable byte views of op.pages[op.fetched:], one per page
        self.batch = batch
        self.done_pages = 0  # pages of `views` filled
        self.finished = False
        self.error: BaseException | None = None

    def step(self, store: PageStore) -> bool:
        """Read one batch; True when more remain."""
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
