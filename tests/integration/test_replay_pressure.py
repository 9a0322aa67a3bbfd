"""The multi-tenant replay under memory pressure, as a new user first ran it: four tenants whose 1,024-token system
prompts an earlier process left in L3, a device pool of two to eight requests, a host pool twice the device
pool, threaded I/O, both host modes and every prefetch policy.

What must hold (DESIGN §4, "Holds under pressure"): no request that fits the device pool is refused; under
wait_complete every tenant's first request after the restart is served its whole stored prefix from L3; every
reused byte verifies; the audit is clean. On the old main, waiting requests' prefetches locked their anchors in
full, so the replay cancelled most of them and refused requests that would fit an empty pool.
"""

import shutil

import pytest

from devices import TEST_DEVICE
from factories import make_layout, make_store
from kvcache import CacheConfig, TieredCache, TraceRequest, WorkloadSpec, generate, replay

PS = 16
SYSTEM = 1024  # tokens before the documents: the shared prefix and the tenant's system prompt
SPEC = WorkloadSpec(requests=48, tenants=4, shared_prefix_tokens=32, system_prompt_tokens=SYSTEM - 32,
                    documents=3, document_tokens=96, user_tokens=32, output_tokens=16, continue_prob=0.4,
                    max_turns=3, zipf=0.5, seed=11)


def _trace():
    trace = generate(SPEC)
    firsts: dict[str, TraceRequest] = {}
    for item in trace:
        firsts.setdefault(item.extra_key, item)
    assert len(firsts) == SPEC.tenants
    return trace, firsts


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """An earlier process served one request per tenant made of its system prompt, and wrote it to L3."""
    trace, firsts = _trace()
    path = tmp_path_factory.mktemp("pressure") / "store"
    store = make_store(path, make_layout(PS))
    writer = TieredCache(CacheConfig(make_layout(PS), device_tokens=8 * SYSTEM, host_tokens=8 * SYSTEM,
                                     device=TEST_DEVICE), store)
    prompts = [TraceRequest(f"sys-{key}", first.tokens[:SYSTEM], first.extra_key, first.cache_salt)
               for key, first in firsts.items()]
    report = replay(writer, prompts)
    assert report.backup.storage_pages == SPEC.tenants * SYSTEM // PS
    writer.close()
    store.close()
    return path, trace, firsts


@pytest.mark.parametrize("pool", [2, 3, 4, 8])
@pytest.mark.parametrize("policy", ["wait_complete", "best_effort", "timeout"])
@pytest.mark.parametrize("mode", ["cache", "buffer"])
def test_a_pool_of_a_few_requests_refuses_nothing_and_serves_first_requests_from_l3(seeded, tmp_path, mode, policy,
                                                                                      pool):
    seed_path, trace, firsts = seeded
    path = tmp_path / "store"
    shutil.copytree(seed_path, path)  # every run restarts from the same L3: the system prompts only
    store = make_store(path, make_layout(PS))
    one = max(len(item.tokens) for item in trace)  # one request: the longest of the trace
    device = pool * one
    cache = TieredCache(CacheConfig(make_layout(PS), device_tokens=device, host_tokens=2 * device, device=TEST_DEVICE,
                                    host_mode=mode, prefetch_policy=policy), store)
    admitted = {}

    def first_admission(request, adm):
        if request.rid == firsts[request.namespace.extra_key].rid:
            admitted[request.namespace.extra_key] = adm

    report = replay(cache, trace, verify=True, on_admit=first_admission)
    cache.close()
    store.close()
    assert report.refused == 0 and report.blocked == 0 and report.requests == len(trace)
    assert report.verify_mismatches == 0 and report.verified_tokens > 0 and report.audit.ok
    assert len(admitted) == SPEC.tenants
    if policy == "wait_complete":
        for key, adm in admitted.items():
            assert adm.device_hit_tokens == adm.host_hit_tokens == 0
            assert adm.storage_hit_tokens == SYSTEM, f"{key}'s first request got {adm.storage_hit_tokens} tokens " \
                                                      f"from L3 of its {SYSTEM} stored"
