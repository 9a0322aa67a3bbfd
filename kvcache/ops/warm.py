"""Warm a namespace: fetch its hottest stored prefixes from L3 into L2 before its traffic arrives (DESIGN §7).

The store keeps each namespace's prefix tree (`children`, with hits and access times that cover each child's
subtree), so the walk needs no engine state: start at the namespace's hash root under the cache's layout, take
the hottest frontier page first, until the page or byte budget is spent. The leaves of the chosen subtree are
prefixes; each is prefetched as a request of that namespace and settled as host-only nodes — the same
`prefetch` / `settle_prefetch` path, and the same namespace checks, as a serving request.
"""

from __future__ import annotations

import heapq
import time

import msgspec

from ..engine.cache import TieredCache
from ..errors import InvalidInput
from ..storage.api import ChildInfo, L3Store
from ..types.config import HostMode, PrefetchPolicy
from ..types.ids import PageHash
from ..types.layout import KVLayout
from ..types.namespace import Namespace
from ..types.reports import WarmResult
from ..types.request import Request


class WarmPrefix(msgspec.Struct, frozen=True):
    """A stored prefix chosen for warming: its packed tokens and the heat of its last page's subtree."""

    tokens: bytes  # packed uint32 token ids, whole pages
    hits: int
    last_access: float


class WarmPlan(msgspec.Struct, frozen=True):
    """The part of a namespace's stored prefix tree chosen for warming."""

    prefixes: list[WarmPrefix]  # ending at the chosen subtree's leaves, hottest first
    pages: int  # distinct pages chosen (shared prefix pages once)
    bytes: int  # their payload bytes


def hottest_prefixes(store: L3Store, layout: KVLayout, namespace: Namespace, max_pages: int,
                     max_bytes: int | None = None) -> WarmPlan:
    """The hottest connected part of `namespace`'s stored prefix tree, at most `max_pages` pages (and
    `max_bytes` payload bytes), as the prefixes ending at its leaves."""
    if max_pages < 0 or (max_bytes is not None and max_bytes < 0):
        raise InvalidInput(f"budget max_pages={max_pages}, max_bytes={max_bytes} must be >= 0")
    # frontier entries: (-hits, -last_access, order, parent index into `chosen`, child)
    frontier: list[tuple[int, float, int, int, ChildInfo]] = []
    order = 0

    def push(parent: int, page_hash: PageHash) -> None:
        nonlocal order
        for child in store.children(page_hash):
            if child.key:  # an engine's page: named by its key, it has no tokens a request could warm
                continue
            heapq.heappush(frontier, (-child.hits, -child.last_access, order, parent, child))
            order += 1

    chosen: list[tuple[int, bytes, int, float]] = []  # (parent index, tokens, hits, last_access)
    has_child: set[int] = set()
    spent = 0
    push(-1, store.root(namespace, layout))
    while frontier and len(chosen) < max_pages:
        _, _, _, parent, child = heapq.heappop(frontier)
        if max_bytes is not None and spent + child.nbytes > max_bytes:
            continue  # a smaller sibling may still fit
        spent += child.nbytes
        chosen.append((parent, child.tokens, child.hits, child.last_access))
        has_child.add(parent)
        push(len(chosen) - 1, child.page_hash)
    out: list[WarmPrefix] = []
    for i, (_, _, hits, last) in enumerate(chosen):
        if i in has_child:
            continue
        parts, at = [], i
        while at >= 0:
            parent, tokens, _, _ = chosen[at]
            parts.append(tokens)
            at = parent
        out.append(WarmPrefix(b"".join(reversed(parts)), hits, last))
    out.sort(key=lambda p: (-p.hits, -p.last_access))
    return WarmPlan(out, len(chosen), spent)


def warm_namespace(cache: TieredCache, namespace: Namespace, max_pages: int, max_bytes: int | None = None,
                   policy: PrefetchPolicy | None = None, timeout_ms: float | None = None) -> WarmResult:
    """Prefetch `namespace`'s hottest stored prefixes into the cache's L2 up to the budget, as host-only nodes.
    Needs a store and a cache-mode host tier (InvalidInput before anything moves otherwise). `policy` /
    `timeout_ms` settle each prefetch instead of the cache's configured ones (see `TieredCache.settle_prefetch`)."""
    if cache.l3_store is None:  # the hottest prefixes are read from the store's page tree
        raise InvalidInput("warming a namespace needs an L3 store")
    if cache.host_pool is None or cache.config.host_mode is not HostMode.CACHE:
        # Buffer mode's L2 holds only staged records until their request's admission: warmed pages would wait
        # there for requests that never come, holding their budget and their anchors.
        raise InvalidInput("warming a namespace needs a host tier in cache mode; this cache's L2 is a bounce "
                           "buffer (buffer mode) or absent")
    start = time.perf_counter()
    ps = cache.page_size
    plan = hottest_prefixes(cache.l3_store, cache.layout, namespace, max_pages, max_bytes)
    inserted = 0
    declined: dict[str, int] = {}
    tag = namespace.id_hex[:12]
    for i, prefix in enumerate(plan.prefixes):
        request = Request(f"warm:{tag}:{i}", prefix.tokens, namespace)
        outcome = cache.prefetch(request)
        if not outcome.issued:
            assert outcome.reason is not None, "a prefetch has a reason exactly when it is not issued"
            reason = outcome.reason.value
            declined[reason] = declined.get(reason, 0) + 1
            continue
        inserted += cache.settle_prefetch(request.rid, policy, timeout_ms).inserted_pages
    return WarmResult(cache.fingerprints.info(namespace), len(plan.prefixes), plan.pages * ps, inserted * ps, inserted,
                      inserted * cache.layout.bytes_per_page, declined, time.perf_counter() - start)
