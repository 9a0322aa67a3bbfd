"""`kvc explain` offline, and the request it explains: one request's L3 tier explained from a store alone.

With a live cache (`--socket`) the cache answers an `ExplainRequest` itself (`TieredCache.explain`: L1, L2, L3
and its last prefetch, `kvcache.ops.handlers`). Offline no cache runs, so only the store's tier is there to
explain: how many of the request's pages it holds from the first on, and why not the next one
(`kvcache.storage.misses`). What an admission on a cold cache would take from L3 is those pages (`hits.storage`).
Reads only (no read is credited, no access time written), and no torch: a store is inspected, not served.

The request comes from tokens and a namespace, or from a trace by its request id (the trace carries its salt, used
in memory only).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import InvalidInput
from ..storage.api import L3Store
from ..storage.misses import explain_storage
from ..types.explain import Explanation, HitTokens
from ..types.fingerprint_key import FingerprintKey
from ..types.keys import RadixKey, hash_root, pack_tokens, page_hashes
from ..types.layout import KVLayout
from ..types.namespace import Namespace
from ..workload.traces import TraceRequest, parse_trace, trace_lines


def explain_stored(store: L3Store, layout: KVLayout, tokens: np.ndarray | list[int], namespace: Namespace,
                   rid: str | None = None, fingerprints: FingerprintKey | None = None) -> Explanation:
    """Why the request of `tokens` in `namespace` misses `store` under `layout`, as a cold cache would meet it:
    L3 only (`device` and `host` are None: no cache runs). The namespace is shown under `fingerprints` (default:
    the store's key, as a cache on it shows it). InvalidInput without tokens, or when this user may not read the
    store's key (the page hashes are keyed by it)."""
    if len(tokens) == 0:
        raise InvalidInput("the request has no tokens")
    chain_key = store.chain_key
    if chain_key is None:
        raise InvalidInput(f"{store.location}: this user cannot read the store's key, which its page hashes are "
                           f"keyed by: nothing can be looked up")
    key = RadixKey(pack_tokens(tokens), namespace)
    ps = layout.page_size
    hashes = page_hashes(layout.layout_id, key, ps, chain_key)
    storage = explain_storage(store, layout, namespace, key.data, hashes, hash_root(layout.layout_id, namespace,
                                                                                     chain_key))
    if fingerprints is None:
        fingerprints = FingerprintKey.of(getattr(store, "fingerprint_key", None))
    return Explanation(fingerprints.info(namespace), len(tokens), ps, HitTokens(storage=storage.matched_tokens), None,
                       None, storage, None, rid)


def trace_request(path: str | Path, rid: str) -> TraceRequest:
    """The first request of the trace at `path` whose id is `rid` (read line by line, validated up to it).
    InvalidInput when no line has it; a bad line before it is InvalidTrace, naming the line."""
    with open(path, "rb") as f:
        for item in parse_trace(trace_lines(f), str(path)):
            if item.rid == rid:
                return item
    raise InvalidInput(f"{path}: no request with rid {rid!r}")
