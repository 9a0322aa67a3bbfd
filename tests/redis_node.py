"""One serving node on a shared Redis L3, for the Redis integration tests (importable as `redis_node`, and run
as a process: ``python tests/redis_node.py URL TENANT:SALT:SEED:N ...``, printing one JSON line: per job, in
order, on the one cache).

A node is its own `TieredCache` (own L1 and L2) over a `RedisStore`, driven by a plain scheduler loop per
request: match -> prefetch -> poll -> admit -> check reused bytes -> forward -> commit, then flush. Every reused
token is checked against the synthetic KV its page hash defines (the `--verify` of a replay).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from factories import device_bytes_ok, forward, l3_cache, make_layout  # noqa: E402
from kvcache import AdmitStatus, Namespace, Request  # noqa: E402

PAGE_SIZE = 4
SYSTEM = list(range(5000, 5096))  # a shared system prompt: 24 pages


def requests(tenant: str, salt: str, seed: int, n: int, docs_from: int = 0) -> list[Request]:
    """`n` requests of one tenant: the system prompt, one of 3 documents (numbered from `docs_from`), a
    per-request question."""
    ns = Namespace(tenant, salt)
    out = []
    for i in range(n):
        doc = [9000 + 100 * (docs_from + i % 3) + t for t in range(32)]
        question = [seed * 1000 + 10 * i + t for t in range(6)]
        out.append(Request(f"{tenant}-{seed}-{i}", SYSTEM + doc + question, ns))
    return out


def serve(cache, reqs: list[Request], before=None) -> dict:
    """Run `reqs` through `cache` one by one (calling `before(i)` ahead of request i when given); return the
    namespace's hit tokens per tier (cumulative over the cache's life), byte mismatches and refusals."""
    mismatches = refused = 0
    for i, req in enumerate(reqs):
        if before is not None:
            before(i)
        cache.prefetch(req, cache.match(req))
        cache.poll()
        adm = cache.admit(req)
        if adm.status is not AdmitStatus.ADMITTED:
            refused += 1
            continue
        if not device_bytes_ok(cache, req, adm.slots, adm.cached_tokens - adm.cached_tokens % PAGE_SIZE):
            mismatches += 1
        forward(cache, req, adm)
        cache.commit(req.rid)
        cache.poll()
    cache.flush()
    stats = cache.stats()
    hits = {"device": 0, "host": 0, "storage": 0}
    for h in stats.hits:
        if reqs and h.namespace != cache.fingerprints.info(reqs[0].namespace):
            continue
        hits["device"] += h.device
        hits["host"] += h.host
        hits["storage"] += h.storage
    return {"requests": len(reqs), "hit_tokens": hits, "verify_mismatches": mismatches, "refused": refused,
            "storage_pages_written": stats.backup.storage_pages, "audit_ok": cache.audit().ok}


def main(argv: list[str]) -> int:
    from kvcache.storage.registry import open_store

    url = argv[0]
    store = open_store(url, make_layout(PAGE_SIZE), create=True, add_layout=True)
    cache = l3_cache(store, page_size=PAGE_SIZE, device_tokens=1024, host_tokens=2048, io_thread=True,
                     prefetch_policy="wait_complete")
    jobs = []
    for spec in argv[1:]:
        tenant, salt, seed, n = spec.split(":")
        jobs.append(serve(cache, requests(tenant, salt, int(seed), int(n))))
    cache.close()
    result: dict = {"jobs": jobs, "audit_ok": cache.audit().ok}
    counters = store.stats().counters
    result["store"] = {"read_errors": counters.read_errors, "write_errors": counters.write_errors,
                       "checksum_failures": counters.checksum_failures}
    store.close()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
