"""Why a store does not hold a request's page: the L3 part of an explanation (`kvcache.types.explain`).

Read from the store's own records, in this order, the first that applies:

1. the page is stored but this handle holds it quarantined (its bytes failed their checksum on a read here);
2. the store's newest removal record of the page (`L3Store.removals`): capacity, share, TTL, drop, repair or a
   quarantine — what removed it and when;
3. a drop record of the request's namespace (`L3Store.drops`): the namespace was dropped, and the page with it;
4. the same tokens held under other namespaces of this layout, or under other layouts: the registry records each
   namespace's hash roots, and a token page's hash is its parent's hash and its tokens only, so the chain of the
   request's tokens from another root names the pages that root would hold — one `exists_prefix` per root;
5. never written: no record of it anywhere.

The counts of other namespaces and layouts are computed whatever the reason (a removed prefix also held elsewhere
shows both) and never say which namespace. Reads only: `exists_prefix` and `page_meta` credit no read.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..types.explain import FirstMiss, MissReason, Removal, TierExplanation
from ..types.ids import PageHash
from ..types.keys import TOKEN_BYTES, extend_chain
from ..types.layout import KVLayout
from ..types.namespace import Namespace
from ..types.removals import RemovalReason
from .api import L3Store

ROOTS_SEARCHED = 1024  # namespace roots (namespaces x layouts) searched for the tokens at most; more: counts are lower bounds


def explain_storage(store: L3Store, layout: KVLayout, namespace: Namespace, tokens: bytes, hashes: Sequence[PageHash],
                    root: PageHash) -> TierExplanation:
    """How many of a request's whole pages `store` holds from the first on, and why not the next one. `tokens`:
    the request's packed tokens; `hashes`: its page hashes under `layout`, chained from `root` (the namespace's
    root: `hash_root(layout.layout_id, namespace, store.chain_key)`)."""
    ps = layout.page_size
    matched = store.exists_prefix(hashes) if hashes else 0
    if matched >= len(hashes):
        return TierExplanation(matched * ps)
    page = matched
    h = hashes[page]
    others, layouts, searched = held_elsewhere(store, layout, tokens[:(page + 1) * ps * TOKEN_BYTES], root)
    removal = None
    if store.page_meta(h) is not None:
        reason = MissReason.QUARANTINED  # stored, and still no match: this handle holds it failed
    else:
        record = store.removals([h], namespace.id)[0]
        if record is not None:
            removal = Removal(record.reason, record.at)
            reason = MissReason.QUARANTINED if record.reason is RemovalReason.QUARANTINE else MissReason.REMOVED
        else:
            drops = [d for d in store.drops() if d.ns_id_hex == namespace.id_hex]
            if drops:
                removal = Removal(RemovalReason.DROP, drops[-1].at)
                reason = MissReason.REMOVED
            elif others:
                reason = MissReason.OTHER_NAMESPACE
            elif layouts:
                reason = MissReason.OTHER_LAYOUT
            else:
                reason = MissReason.NEVER_WRITTEN
    return TierExplanation(matched * ps, FirstMiss(page, h.hex(), reason, removal, others, layouts, searched))


def held_elsewhere(store: L3Store, layout: KVLayout, prefix: bytes, root: PageHash) -> tuple[int, int, bool]:
    """(other namespaces of `layout`, other layouts, every root searched) whose stored pages hold the packed tokens
    `prefix` (whole pages of `layout`) from their root on, every page of it. `root` (the request's own) is skipped;
    the request's namespace under another layout counts as another layout."""
    sizes = sorted({lay.page_size for lay in store.layouts()})
    namespaces: set[str] = set()
    layouts: set[bytes] = set()
    roots = [(rec.ns_id_hex, PageHash(bytes.fromhex(r))) for rec in store.namespaces() for r in rec.roots]
    roots = [(ns, r) for ns, r in roots if r != root]
    for ns_hex, other in roots[:ROOTS_SEARCHED]:
        for size in sizes:
            # the tokens through the page, in whole pages of this size (a larger page may need a few more tokens:
            # then this page size cannot tell, and is skipped)
            step = size * TOKEN_BYTES
            n = -(-len(prefix) // step)
            if n * step != len(prefix):
                continue
            chain = extend_chain(other, prefix, size)
            if store.exists_prefix(chain) < n:
                continue
            meta = store.page_meta(chain[0])
            if meta is None:  # removed since: not held
                continue
            if meta.layout_id == layout.layout_id:
                namespaces.add(ns_hex)
            else:
                layouts.add(meta.layout_id)
            break
    return len(namespaces), len(layouts), len(roots) <= ROOTS_SEARCHED
