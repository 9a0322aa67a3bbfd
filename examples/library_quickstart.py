"""kvcache as a library: the request lifecycle of a serving engine, two tenants, and an audit.

Run: ``python examples/library_quickstart.py``
"""

import torch

from kvcache import CacheConfig, KVLayout, Namespace, Request, TieredCache

layout = KVLayout("tiny-llm@rev1", layers=2, kv_heads=2, head_dim=8, dtype="float16", page_size=4)
cache = TieredCache(CacheConfig(layout, device_tokens=256, host_tokens=1024))

system_prompt = list(range(100, 132))
tenant_a, tenant_b = Namespace("tenant-a", "a-secret-salt"), Namespace("tenant-b", "b-secret-salt")

for rid, ns, question in [("a1", tenant_a, [1, 2, 3]), ("a2", tenant_a, [4, 5]), ("b1", tenant_b, [1, 2, 3])]:
    req = Request(rid, system_prompt + question, ns)
    adm = cache.admit(req)  # load back from host, lock the cached prefix, allocate the rest
    # The engine's forward writes KV for the uncached tokens into the device pool:
    new_slots = torch.from_numpy(adm.slots[adm.cached_tokens:])
    cache.device_pool.storage[new_slots] = len(rid)
    cache.commit(rid)  # insert into the tree; back up to host (write_through)
    # the namespace as outputs show it: its salt's fingerprint under the cache's key (its store's, when it has one)
    print(f"{rid} ({cache.fingerprints.label(ns)}): {adm.cached_tokens} cached tokens, {adm.new_tokens} computed")

cache.flush()  # wait for in-flight backups
report = cache.audit()
print(f"audit ok={report.ok}, checked {report.checked.pages} pages in {report.checked.nodes} nodes")
