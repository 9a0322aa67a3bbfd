"""What a store, or a live cache's tier, holds, as the KV events a router would have received (`kvc ns dump`).

A KV-aware router (llm-d's indexer, Dynamo's) learns where pages live from a cache's event feed
(`kvcache.types.events`). One that starts late, or that wants a store no cache announced (L3 written by another
process, or before the feed began), needs the same events for what is held now. This module makes them: one
`BlockStored` per run of consecutive pages of one chain, each page held once per tier, parents before children,
the namespace as the feed names it (extra_key and the salt's keyed fingerprint: never the salt), `medium` in the
feed's words (`MediumNames`).

- A store (`StoreWalk`): each namespace of its registry, each of its roots (one per layout written), walked down
  the store's children index depth first, children in page-hash order. The walk is resumable (`DumpCursor`: the
  position after the last page given), so a live cache can answer it a chunk at a time between scheduler steps;
  what is held is streamed, never gathered: the walk keeps only the children still to visit along its current
  path. Pages written or removed while a dump runs are seen or not, as a feed's late subscriber sees them; a page
  held throughout is given exactly once (the order is by hash, so a position stays well defined when the page it
  names goes). An engine page (`kvc ns probe --engine`) has no tokens: its event carries none.
- A live cache's device (L1) and host (L2) tiers (`tree_events`): every copy the tree holds, as the feed announces
  them when it starts (`kvcache.engine.event_log`), in one answer per tier: the tiers are bounded by the pools.

A walk lists children with the store's `child_pages` where it has one (LMDB and Redis: one lookup per child), else
with `children`, which every store has but which also sums each child's heat over its subtree (a lookup per page
below it): on a deep tree that walk costs far more than one lookup per page.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Annotated

import msgspec
import numpy as np

from ..storage.api import ChildInfo, L3Store, NamespaceRecord
from ..types import ids
from ..types.events import (
    MEDIUMS,
    AllBlocksCleared,
    BlockStored,
    EventBatch,
    KVEvent,
    MediumNames,
    PageHash,
)
from ..types.keys import TOKEN_BYTES

if TYPE_CHECKING:
    from ..engine.cache import TieredCache

RUN_MAX_PAGES = 256  # pages per BlockStored at most: an event stays small whatever the chain's length
BATCH_EVENTS = 256  # events per EventBatch of a dump (a feed batches per scheduler step; a dump has no steps)
CHUNK_MAX_PAGES = 65_536  # a live dump's chunk: pages of one answer at most
CURSOR_MAX_TURNS = 16_384  # places a cursor remembers (branch points with children left): far past any tree


class DumpTier(str, enum.Enum):
    """A tier a dump reads: the live cache's pools, or the store."""

    DEVICE = "device"  # L1
    HOST = "host"  # L2
    STORAGE = "storage"  # L3


class Turn(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """A place of a walk: `parent`'s children after `after` are still to visit (all of them when None)."""

    parent: PageHash
    after: PageHash | None = None


class DumpCursor(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a store walk stopped: in the root `root` of namespace `ns_id` (hex), the places with children left,
    outermost first (the last one: the children of the last page given). Opaque to a client: sent back as it came."""

    ns_id: Annotated[str, msgspec.Meta(min_length=32, max_length=32, pattern="^[0-9a-f]{32}$")]
    root: PageHash
    turns: Annotated[list[Turn], msgspec.Meta(max_length=CURSOR_MAX_TURNS)] = []


class StoredRun(msgspec.Struct, frozen=True, gc=False):
    """Consecutive pages of one chain in the store: what one `BlockStored` announces."""

    namespace: NamespaceRecord
    parent: PageHash | None  # the page before the first one; None for a namespace's first page
    hashes: list[PageHash]
    tokens: bytes  # packed token ids of the pages (b"" for engine pages)
    page_size: int


class _Frame:
    """One level of the walk: the children of `parent` still to visit, in hash order (popped from the end), and the
    one taken last (None: none yet)."""

    __slots__ = ("parent", "todo", "taken")

    def __init__(self, parent: PageHash, todo: list[ChildInfo], taken: PageHash | None = None) -> None:
        self.parent = parent
        self.todo = todo  # reversed: the next child is todo[-1]
        self.taken = taken


class StoreWalk:
    """Every page `store` holds, as runs of consecutive pages, parents before children, resumable.

    Iterate it for the runs; `cursor()` says where the walk stands after the last run given (None: done), and a
    walk made with that cursor goes on from there. Namespaces in id order, roots in hash order, children in
    hash order."""

    def __init__(self, store: L3Store, cursor: DumpCursor | None = None, run_max_pages: int = RUN_MAX_PAGES) -> None:
        self.store = store
        self.run_max_pages = run_max_pages
        records = {r.ns_id_hex: r for r in store.namespaces()}
        starts = sorted((ns_hex, ids.PageHash(bytes.fromhex(root))) for ns_hex, r in records.items() for root in r.roots)
        if cursor is not None:
            starts = [s for s in starts if s > (cursor.ns_id, cursor.root)]
        self._records = records
        self._starts = starts[::-1]  # popped from the end
        self._page_sizes = {lay.layout_id: lay.page_size for lay in store.layouts()}
        self._at: tuple[str, PageHash] | None = None
        self._frames: list[_Frame] = []
        if cursor is not None and cursor.ns_id in records:
            self._at = (cursor.ns_id, cursor.root)
            for turn in cursor.turns:
                kids = self._children(turn.parent)
                if turn.after is not None:
                    kids = [c for c in kids if c.page_hash > turn.after]
                if kids:
                    self._frames.append(_Frame(turn.parent, kids[::-1], turn.after))
        self.pages = 0  # given so far
        self.engine_pages = 0  # of them, engine pages (no tokens)

    def _children(self, page_hash: PageHash) -> list[ChildInfo]:
        # `child_pages` (LMDB, Redis): one lookup per child; `children`, every store's: the heat of each child's
        # subtree too, a lookup per page below it (a walk of a deep tree pays it at every page)
        listing = getattr(self.store, "child_pages", None) or self.store.children
        return sorted(listing(page_hash), key=lambda c: c.page_hash)

    def cursor(self) -> DumpCursor | None:
        """The position after the last run given; None once every page was given."""
        self._settle()
        if self._at is None:
            return None
        turns = [Turn(f.parent, f.taken) for f in self._frames if f.todo]
        return DumpCursor(self._at[0], self._at[1], turns)

    def _settle(self) -> None:
        """Drop the levels with nothing left, and move to the next root when the current one is done."""
        while self._frames and not self._frames[-1].todo:
            self._frames.pop()
        while not self._frames:
            if not self._starts:
                self._at = None
                return
            self._at = self._starts.pop()
            kids = self._children(self._at[1])
            if kids:
                self._frames.append(_Frame(self._at[1], kids[::-1]))

    def __iter__(self) -> Iterator[StoredRun]:
        while True:
            self._settle()
            if self._at is None:
                return
            yield self._run()

    def _run(self) -> StoredRun:
        """The next pages of the walk down one chain: the next child of the innermost level, then, while the page
        just taken has exactly one child, that child (up to run_max_pages)."""
        assert self._at is not None
        ns_hex, root = self._at
        frame = self._frames[-1]
        parent = frame.parent
        hashes: list[PageHash] = []
        tokens: list[bytes] = []
        page_size, engine = 0, False
        while True:
            child = frame.todo[-1]
            size, is_engine = self._page_size(child), bool(child.key)
            if hashes and (size != page_size or is_engine != engine):
                break  # another kind or layout of page: the next run begins with it
            frame.todo.pop()
            frame.taken = child.page_hash
            page_size, engine = size, is_engine
            hashes.append(child.page_hash)
            tokens.append(child.tokens)
            self.pages += 1
            self.engine_pages += is_engine
            kids = self._children(child.page_hash)
            frame = _Frame(child.page_hash, kids[::-1])
            self._frames.append(frame)
            if len(kids) != 1 or len(hashes) >= self.run_max_pages:
                break
        return StoredRun(self._records[ns_hex], None if parent == root else parent, hashes, b"".join(tokens),
                         page_size)

    def _page_size(self, child: ChildInfo) -> int:
        if child.tokens:
            return len(child.tokens) // TOKEN_BYTES
        meta = self.store.page_meta(child.page_hash)  # an engine page: its layout says its page size
        return self._page_sizes.get(meta.layout_id, 0) if meta is not None else 0


def run_event(run: StoredRun, medium: str) -> BlockStored:
    """The `BlockStored` of a run of stored pages in `medium`."""
    ns = run.namespace
    tokens = np.frombuffer(run.tokens, dtype="<u4").tolist()
    return BlockStored(list(run.hashes), run.parent, tokens, max(1, run.page_size), None, medium, None, ns.extra_key,
                       ns.salt_fingerprint)


def store_events(walk: StoreWalk, medium: str, max_pages: int | None = None) -> Iterator[BlockStored]:
    """The events of `walk`'s runs; with `max_pages`, stop after the run that reaches it (`walk.cursor()` then says
    where to go on)."""
    start = walk.pages
    for run in walk:
        yield run_event(run, medium)
        if max_pages is not None and walk.pages - start >= max_pages:
            return


def tree_events(cache: "TieredCache", tier: DumpTier, medium_names: MediumNames = MediumNames.KVC) -> list[KVEvent]:
    """Every copy `cache`'s tree holds in `tier` (DEVICE or HOST), parents first, as the feed announces them: one
    `BlockStored` per tree node."""
    from ..engine.event_log import EventLog
    from ..tree import Tier

    log = EventLog(cache.tree, lambda _batch: None, medium_names=medium_names)
    which = Tier.DEVICE if tier is DumpTier.DEVICE else Tier.HOST
    # fingerprints under the cache's key (its store's), as the store's registry and the storage tier's events name
    # the namespace: the log keys them by the tree's
    out: list[KVEvent] = []
    for node in cache.tree.nodes():
        pages = node.device if which is Tier.DEVICE else node.host
        if pages is not None:
            log.copy_changed(node, which, None, pages)
            out.append(log.pending.pop())
    return out


def medium_of(tier: DumpTier, medium_names: MediumNames) -> str:
    """The `medium` word of `tier` in the vocabulary `medium_names`."""
    medium = MEDIUMS[MediumNames(medium_names)]
    return {DumpTier.DEVICE: medium.device, DumpTier.HOST: medium.host, DumpTier.STORAGE: medium.storage}[tier]


def batches(events: Iterable[KVEvent], per_batch: int = BATCH_EVENTS, cleared: bool = True,
            data_parallel_rank: int = 0) -> Iterator[EventBatch]:
    """`events` in batches of `per_batch`, the first one opened by `AllBlocksCleared` when `cleared` (as a feed
    starts: a consumer forgets what it knew of this cache, then learns what it holds)."""
    pending: list[KVEvent] = [AllBlocksCleared()] if cleared else []
    for ev in events:
        pending.append(ev)
        if len(pending) >= per_batch:
            yield EventBatch(time.time(), pending, data_parallel_rank)
            pending = []
    if pending:
        yield EventBatch(time.time(), pending, data_parallel_rank)


__all__ = ["BATCH_EVENTS", "CHUNK_MAX_PAGES", "CURSOR_MAX_TURNS", "RUN_MAX_PAGES", "DumpCursor", "DumpTier",
           "StoreWalk", "StoredRun", "Turn", "batches", "medium_of", "run_event", "store_events", "tree_events"]
