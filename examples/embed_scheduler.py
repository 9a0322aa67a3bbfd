"""Embedding kvcache in a serving engine: a toy continuous-batching scheduler over a TieredCache with an L3 store.

What an engine does with the cache, step by step: a request arrives -> `prefetch` its L3 miss while it waits ->
`admit` it into the running batch (settles the prefetch, loads back L2 -> L1) -> the forward writes KV for the
uncached tokens -> `commit` (insert, back up to L2 and L3) -> `poll` between steps. The KV here is synthetic
(`SyntheticKV`: bytes derived from each page's hash), so every reused page is checked.

Run: ``python examples/embed_scheduler.py [STORE_DIR]`` (default: a temporary directory). Run it twice with the
same STORE_DIR and the second run starts with prefixes from L3.
"""

import sys
import tempfile
from collections import deque

import torch

from kvcache import (AdmitStatus, CacheConfig, KVLayout, NamespaceMismatch, SyntheticKV, TieredCache, TraceRequest,
                     open_store, page_hashes)

torch.set_num_threads(1)  # small per-page copies beside the L3 I/O thread: one intra-op thread is fastest

layout = KVLayout("toy-llm@r1", layers=2, kv_heads=2, head_dim=16, dtype="float16", page_size=16)
store_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="kvc-embed-")
store = open_store(store_dir, layout, create=True)
cache = TieredCache(CacheConfig(layout, device_tokens=1024, host_tokens=4096, prefetch_policy="wait_complete"),
                    store)
kv = SyntheticKV(layout)

system = list(range(1000, 1064))  # a 64-token system prompt, the same ids for both tenants
# four turns per tenant, each extending the previous one (same ids in both tenants: only the namespace differs)
arrivals = deque(
    TraceRequest(f"{tenant}-{turn}", system + [t * 7 for t in range(16 * (turn + 1))], tenant, f"{tenant}-salt")
    for turn in range(4) for tenant in ("acme", "globex"))

waiting: deque = deque()
hits: dict[str, int] = {}
checked = bad = 0
while arrivals or waiting:
    # 1. arrivals join the queue; their L3 prefetch starts now, keyed by the request's own namespace
    for _ in range(2):
        if arrivals:
            request = arrivals.popleft().request()
            try:
                cache.prefetch(request)
            except NamespaceMismatch:  # an anchor of another namespace: serve without L3, never crash
                pass
            waiting.append(request)
    cache.poll()
    # 2. admit the head of the queue (one request per step keeps the toy simple)
    request = waiting.popleft()
    adm = cache.admit(request)
    label = cache.fingerprints.label(request.namespace)  # its salt's fingerprint under the store's key
    if adm.status is AdmitStatus.TOO_LARGE:  # more tokens than the device pool holds: it never fits
        print(f"{request.rid:9} {label:20} {len(request):4} tokens: too large, skipped")
        continue
    # POOL_FULL means other running requests hold the room (admit itself evicts, waits for copies and cancels
    # prefetch holds first): with one request per step there are none.
    assert adm.status is AdmitStatus.ADMITTED, adm.status
    # 3. the forward: check the reused pages, write the new ones
    ps = layout.page_size
    hashes = page_hashes(layout.layout_id, request.key, ps, cache.chain_key)
    n_cached = len(adm.cached_pages)  # the admission is by page: the cached prefix's pages, then the fresh ones
    bad += len(kv.mismatches(cache.device_pool.pages, adm.cached_pages, hashes[:n_cached]))
    checked += n_cached
    kv.write(cache.device_pool.pages, adm.fresh_pages[:len(hashes) - n_cached], hashes[n_cached:])
    cache.commit(request.rid)
    hits[label] = hits.get(label, 0) + adm.cached_tokens
    print(f"{request.rid:9} {label:20} {len(request):4} tokens: {adm.device_hit_tokens:4} from L1, "
          f"{adm.host_hit_tokens:4} from L2, {adm.storage_hit_tokens:4} from L3")

cache.close()  # flushes the L3 writes
report = cache.audit()
print(f"verified {checked} reused pages: {bad} mismatches; audit ok={report.ok}; store {store_dir}")
store.close()
