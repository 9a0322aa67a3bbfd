"""kvcache/replay.py: the trace-driven scheduler loop, its verification and its report."""

import pytest

from devices import TEST_DEVICE
from factories import make_layout, make_store
from kvcache import CacheConfig, Namespace, Replayer, TieredCache, TraceRequest, WorkloadSpec, generate, replay

SPEC = WorkloadSpec(requests=150, tenants=3, system_prompt_tokens=40, document_tokens=64, documents=5,
                    user_tokens=12, output_tokens=8, seed=3)


def _cache(store=None, device_tokens=512, host_tokens=1024, **kw):
    kw.setdefault("io_thread", False)
    return TieredCache(CacheConfig(make_layout(8), device_tokens=device_tokens, host_tokens=host_tokens,
                                   device=TEST_DEVICE, **kw), store)


@pytest.mark.parametrize("mode", ["cache", "buffer"])
@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_replay_verifies_clean_in_every_mode_and_policy(tmp_path, mode, policy):
    store = make_store(tmp_path / "s", make_layout(8))
    trace = generate(SPEC)
    first = replay(_cache(store, host_mode=mode, prefetch_policy=policy), trace, verify=True)
    assert first.ok and first.verify_mismatches == 0 and first.audit.ok
    assert first.requests + first.refused == len(trace) and first.refused == 0
    assert first.verified_tokens == first.hit_tokens.total > 0
    assert first.backup.storage_pages > 0
    # a new cache on the same store (a restart): what it finds beyond L1/L2 comes from L3, verified
    second = replay(_cache(store, host_mode=mode, prefetch_policy=policy), trace, verify=True)
    assert second.ok and second.hit_tokens.storage > 0
    assert second.prefetch.fetched_pages > 0 and second.prefetch.read_errors == 0


def test_report_splits_hits_per_namespace_and_tier():
    trace = generate(SPEC)
    report = replay(_cache(), trace, verify=True)
    assert report.tokens == sum(len(r.tokens) for r in trace)
    assert {n.namespace.extra_key for n in report.namespaces} == {"tenant-0", "tenant-1", "tenant-2"}
    for field in ("device", "host", "storage"):
        assert getattr(report.hit_tokens, field) == sum(getattr(n.hit_tokens, field) for n in report.namespaces)
    assert report.hit_tokens.storage == 0  # no store
    assert sum(n.requests for n in report.namespaces) == report.requests


def test_corrupted_device_pages_are_mismatches_and_fail_the_report():
    trace = generate(SPEC)
    cache = _cache()
    driver = Replayer(cache, verify=True)
    assert driver.run(trace[:60]).verify_mismatches == 0
    cache.device_pool.storage.fill_(0)  # every cached page now holds the wrong bytes
    report = driver.run(trace[60:])
    assert report.verify_mismatches > 0 and not report.ok
    assert report.mismatches and report.mismatches[0].namespace.extra_key.startswith("tenant-")


def test_tenants_with_identical_tokens_never_hit_each_other():
    tokens = list(range(64))
    trace = [TraceRequest(f"r{i}", tokens, extra_key=f"t{i % 2}", cache_salt="s") for i in range(4)]
    report = replay(_cache(), trace, verify=True, batch=1)
    by_key = {n.namespace.extra_key: n for n in report.namespaces}
    # each namespace misses on its first request and hits on its second
    assert by_key["t0"].hit_tokens.total == by_key["t1"].hit_tokens.total == 64
    assert report.ok


def test_a_request_larger_than_the_device_pool_is_refused_and_the_replay_goes_on():
    trace = [TraceRequest("big", list(range(200))), TraceRequest("small", list(range(16)))]
    report = replay(_cache(device_tokens=64), trace, verify=True)
    assert report.refused == 1 and report.requests == 1 and report.audit.ok


def test_pool_pressure_with_a_batch_requeues_instead_of_refusing():
    trace = [TraceRequest(f"r{i}", [i] * 48, extra_key="t") for i in range(6)]
    report = replay(_cache(device_tokens=128, host_tokens=256), trace, verify=True, batch=4)
    assert report.refused == 0 and report.requests == 6 and report.audit.ok


def test_namespace_of_staged_and_prefetched_pages_is_the_requests(tmp_path):
    store = make_store(tmp_path / "s", make_layout(8))
    tokens = list(range(80))
    replay(_cache(store), [TraceRequest("w", tokens, "t1", "a")], verify=True)
    report = replay(_cache(store, host_mode="buffer"),
                    [TraceRequest("x", tokens, "t1", "b"), TraceRequest("y", tokens, "t1", "a")], verify=True,
                    batch=1)
    by_salt = {n.namespace.salt_fingerprint: n.hit_tokens for n in report.namespaces}
    key = store.fingerprint_key  # the cache's rows show its store's fingerprints
    assert by_salt[Namespace("t1", "b").fingerprint(key)].total == 0
    assert by_salt[Namespace("t1", "a").fingerprint(key)].storage == 80
    assert report.ok
