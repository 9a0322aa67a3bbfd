"""`TieredCache.explain`: why a request would miss, tier by tier, from the cache's and its store's own records.

Read only: the tree is walked without a split, a hit or an LRU touch, and the store is asked with `exists_prefix`
and `page_meta`, which credit no read. For each tier the first whole page it does not hold is explained:

- L1 and L2 (the tree; L2 only in cache mode: in buffer mode it is a bounce buffer, no tier): removed by the cache (`RecentRemovals`: capacity, share, an eviction asked for, a drop, a
  TTL expiry — when), else held under other namespaces of the tree (a count), else never held (or "no record" once
  the tier's bounded record has let go of older entries);
- L3: `kvcache.storage.misses.explain_storage` (quarantine, the store's removal and drop records, other
  namespaces and layouts, never written).

With them, `hits` is what an admission now would take from each tier (the device prefix, the host extension past
it, the store's pages past that), and `prefetch` how the last prefetch of the request's prefix ended
(`RecentPrefetches`: the newest record of a prefetch that started at one of its pages).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import msgspec

from ..storage.misses import explain_storage
from ..tree import RadixTree, TreeNode
from ..types.config import HostMode
from ..types.explain import Explanation, FirstMiss, HitTokens, MissReason, TierExplanation
from ..types.ids import NamespaceId, PageHash
from ..types.keys import TOKEN_BYTES, hash_root, page_hashes
from ..types.request import Request
from ..types.results import Admission
from ..types.tier import Tier

if TYPE_CHECKING:
    from ..ledger.pools import SlotPool
    from ..storage.api import L3Store, PageStore
    from ..types.config import CacheConfig
    from ..types.layout import KVLayout
    from .recent import RecentPrefetches, RecentRemovals


class Explained(Protocol):
    """What an explanation reads of a cache (`TieredCache` is one): its tree, pools, store and records."""

    @property
    def config(self) -> CacheConfig: ...  # noqa: D102 - the fields are the cache's, documented there
    @property
    def layout(self) -> KVLayout: ...  # noqa: D102
    @property
    def page_size(self) -> int: ...  # noqa: D102
    @property
    def chain_key(self) -> bytes: ...  # noqa: D102
    @property
    def tree(self) -> RadixTree: ...  # noqa: D102
    @property
    def host_pool(self) -> SlotPool | None: ...  # noqa: D102
    @property
    def store(self) -> PageStore | None: ...  # noqa: D102
    @property
    def l3_store(self) -> L3Store | None: ...  # noqa: D102
    @property
    def removals(self) -> RecentRemovals: ...  # noqa: D102
    @property
    def prefetches(self) -> RecentPrefetches: ...  # noqa: D102


def explain_request(cache: Explained, request: Request) -> Explanation:
    """See `TieredCache.explain`."""
    tree, ps, key = cache.tree, cache.page_size, request.key
    root = hash_root(cache.layout.layout_id, key.namespace, cache.chain_key)
    hashes = page_hashes(cache.layout.layout_id, key, ps, cache.chain_key)
    ns_root = tree.root.children.get(key.namespace.id)
    device, host, held = tree_runs(tree, ns_root, key.data, len(hashes))
    store = cache.store
    storage_hit = store.exists_prefix(hashes[held:]) if store is not None and held < len(hashes) else 0
    hits = HitTokens(device * ps, (held - device) * ps, storage_hit * ps)
    tiers = {tier: _tier(tree, cache.removals, tier, key.namespace.id, key.data, hashes, run)
             for tier, run in ((Tier.DEVICE, device), (Tier.HOST, host))}
    l3_store = cache.l3_store
    storage = (explain_storage(l3_store, cache.layout, key.namespace, key.data, hashes, root)
               if l3_store is not None else None)
    return Explanation(tree.fingerprints.info(key.namespace), len(request), ps, hits, tiers[Tier.DEVICE],
                       tiers[Tier.HOST] if cache.host_pool is not None and cache.config.host_mode is HostMode.CACHE
                       else None, storage,
                       cache.prefetches.last(hashes), request.rid)


def tree_runs(tree: RadixTree, ns_root: TreeNode | None, data: bytes, n_pages: int) -> tuple[int, int, int]:
    """Pages of packed tokens `data` (its first `n_pages` whole pages) that the subtree of `ns_root` holds from the
    first on: (with a device copy, with a host copy, with either). Device and host copies each form a prefix of a
    path, so each run ends at its tier's first node without a copy. Nothing is split or touched."""
    if ns_root is None:
        return 0, 0, 0
    pb = tree.page_size * TOKEN_BYTES
    end = n_pages * pb
    device = host = held = 0
    on_device = on_host = True
    node, pos = ns_root, 0
    while pos < end:
        child = node.children.get(data[pos:pos + pb])
        if child is None:
            break
        n = min(len(child.key), end - pos)
        same = n if data.startswith(child.key[:n], pos) else _common(child.key, data, pos, n)
        pages = same // pb
        on_device = on_device and child.device is not None
        on_host = on_host and child.host is not None
        device += pages if on_device else 0
        host += pages if on_host else 0
        held += pages
        if same < len(child.key):
            break
        node, pos = child, pos + same
    return device, host, held


def _common(node_key: bytes, data: bytes, pos: int, n: int) -> int:
    """Bytes of whole tokens `node_key` and data[pos:pos + n] share from their start."""
    for i in range(0, n, TOKEN_BYTES):
        if node_key[i:i + TOKEN_BYTES] != data[pos + i:pos + i + TOKEN_BYTES]:
            return i
    return n


def _tier(tree: RadixTree, removals: RecentRemovals, tier: Tier, ns_id: NamespaceId, data: bytes,
          hashes: Sequence[PageHash], run: int) -> TierExplanation:
    """One tree tier: its run of the request's pages, and why the page after it is not there."""
    ps = tree.page_size
    if run >= len(hashes):
        return TierExplanation(run * ps)
    others = sum(1 for r in tree.namespace_roots() if r.namespace is not None and r.namespace.id != ns_id
                 and tree_runs(tree, r, data, run + 1)[0 if tier is Tier.DEVICE else 1] > run)
    removal = removals.get(tier, hashes[run])
    if removal is not None:
        reason = MissReason.REMOVED
    elif others:
        reason = MissReason.OTHER_NAMESPACE
    else:
        reason = MissReason.NEVER_WRITTEN if removals.complete(tier) else MissReason.NO_RECORD
    return TierExplanation(run * ps, FirstMiss(run, hashes[run].hex(), reason, removal, others))


def after_admission(cache: Explained, request: Request, before: Explanation, admission: Admission) -> Explanation:
    """`before` (`request` explained just before `admission`) with what the admission did: the tokens it took from
    each tier (a refused one took none) and how the prefetch of the request's prefix ended (its own, settled by
    the admission). A replay's per-request line (`kvc replay --requests-out`)."""
    ps = cache.page_size
    hashes = page_hashes(cache.layout.layout_id, request.key, ps, cache.chain_key)
    hits = HitTokens(admission.device_hit_tokens, admission.host_hit_tokens, admission.storage_hit_tokens)
    return msgspec.structs.replace(before, hits=hits, prefetch=cache.prefetches.last(hashes))
