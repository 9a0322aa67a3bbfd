"""kvcache/workload/sweep.py: a sweep's hits at a size are exactly a full replay's at that size (the real replay
driver writing synthetic KV, verified, on a real LMDB store with that capacity), per tenant and per tier."""

import pytest

from factories import make_layout
from kvcache import TieredCache, WorkloadSpec, generate, replay
from kvcache.errors import InvalidConfig, InvalidInput
from kvcache.storage.api import CapacityPolicy
from kvcache.storage.registry import open_store
from kvcache.types.config import PrefetchPolicy
from kvcache.types.fingerprint_key import FINGERPRINT_KEY_ENV
from kvcache.types.sweep import MAX_SWEEP_POINTS, SweepPoint, SweepPolicies
from kvcache.workload.sweep import namespaces_of, sweep, sweep_config

LAYOUT = make_layout(8)
SPEC = WorkloadSpec(requests=200, tenants=3, system_prompt_tokens=40, document_tokens=64, documents=5,
                    user_tokens=12, output_tokens=8, seed=3)
PAGE = LAYOUT.bytes_per_page
KEY = bytes(range(32))  # one store key for every store of a test: the same page hashes everywhere
# (L1, L2, L3), the longest request 228 tokens: L1 alone far too small (L2 and L3 serve what it cannot hold); L2 big
# enough to matter; L3 limited to 40 pages, so the store evicts and serves less than an unlimited one.
SIZES = {
    "l1_too_small": SweepPoint(256, 512, 0),
    "l2_matters": SweepPoint(256, 4096, 0),
    "l3_limited": SweepPoint(256, 512, 40 * PAGE),
}


def _full_replay(tmp_path, name, point, policies):
    """`kvc replay` at `point` on a new store: KV written and verified, the store fsynced (default durability)."""
    store = open_store(str(tmp_path / name), LAYOUT, create=True,
                       capacity=CapacityPolicy(capacity_bytes=point.storage_bytes))
    cache = TieredCache(sweep_config(LAYOUT, point, policies), store)
    try:
        report = replay(cache, generate(SPEC), verify=True, batch=policies.batch, lookahead=policies.lookahead)
    finally:
        cache.close()
    return store, report


@pytest.mark.parametrize("policies, workers", [
    (SweepPolicies(), 2),  # sizes in two processes
    (SweepPolicies(prefetch_policy=PrefetchPolicy.BEST_EFFORT, host_mode="buffer"), 1),  # in this one
], ids=["cache-wait_complete-2-processes", "buffer-best_effort-1-process"])
def test_a_sweep_reports_exactly_the_hits_of_full_replays_at_each_size(tmp_path, monkeypatch, policies, workers):
    monkeypatch.setenv(FINGERPRINT_KEY_ENV, KEY.hex())  # what a new store takes as its key (one per deployment)
    trace = generate(SPEC)
    replays = {}
    for name, point in SIZES.items():
        store, report = _full_replay(tmp_path, name, point, policies)
        assert store.fingerprint_key == KEY
        assert report.ok and report.verify_mismatches == 0 and report.verified_tokens == report.hit_tokens.total
        replays[point] = report
        store.close()
    # the sweep's scratch stores take the same key: page hashes, and so LRU ties among pages stored together, alike
    got = sweep(LAYOUT, trace, list(SIZES.values()), policies, workers=workers, store_key=KEY)
    assert [r.point for r in got.points] == list(SIZES.values()) and got.workers == workers and got.ok
    assert got.requests == len(trace) and got.tokens == sum(len(t.tokens) for t in trace)
    for result in got.points:
        full = replays[result.point]
        assert (result.requests, result.refused, result.tokens) == (full.requests, full.refused, full.tokens)
        assert result.hit_tokens == full.hit_tokens
        assert result.storage_pages == full.backup.storage_pages
        assert result.storage_rejected == full.backup.storage_rejected
        rows = {row.namespace: row for row in full.namespaces}
        assert [t.namespace for t in result.tenants] == [ns.info(KEY) for ns in namespaces_of(trace)]
        for tenant in result.tenants:
            row = rows[tenant.namespace]
            assert (tenant.requests, tenant.tokens, tenant.hit_tokens) == (row.requests, row.tokens, row.hit_tokens)
            assert tenant.refused == row.refused == 0
            assert tenant.hit_rate == pytest.approx(row.hit_tokens.total / row.tokens)
    if policies.host_mode != "cache":
        return  # buffer mode: L2 only stages prefetches (no L2 hits)
    by = {name: got.points[i].hit_tokens for i, name in enumerate(SIZES)}
    # each size is the case it is named for: L2 and L3 serve what L1 cannot hold; a larger L2 serves more; the same
    # L1 and L2 with a 40-page L3 (the store evicting to make room) serve less from L3 than with an unlimited one
    assert by["l1_too_small"].host > 0 and by["l1_too_small"].storage > 0
    assert by["l2_matters"].host > by["l1_too_small"].host
    assert 0 < by["l3_limited"].storage < by["l1_too_small"].storage
    assert got.points[2].storage_rejected == 0  # the store made room by evicting, refusing nothing


def test_progress_is_called_after_each_size():
    seen = []
    sweep(LAYOUT, generate(WorkloadSpec(requests=10, tenants=2, seed=1)), [SweepPoint(256, 512), SweepPoint(512, 512)],
          progress=seen.append)
    assert seen == [1, 2]


def test_an_empty_trace_gives_zero_rows():
    report = sweep(LAYOUT, [], [SweepPoint(256, 512)])
    (point,) = report.points
    assert (report.requests, point.requests, point.tokens, point.tenants, point.hit_rate) == (0, 0, 0, [], 0.0)


@pytest.mark.parametrize("points, error", [
    ([], InvalidInput),
    ([SweepPoint(256, 0)] * (MAX_SWEEP_POINTS + 1), InvalidInput),
    ([SweepPoint(256, -1)], InvalidInput),
    ([SweepPoint(4, 0)], InvalidConfig),  # below one page
])
def test_bad_sizes_are_refused_before_anything_runs(points, error):
    with pytest.raises(error):
        sweep(LAYOUT, generate(SPEC), points)


def test_the_timeout_policy_is_refused_it_reads_the_clock():
    with pytest.raises(InvalidConfig, match="timeout"):
        sweep(LAYOUT, generate(SPEC), [SweepPoint(256, 512)], SweepPolicies(prefetch_policy=PrefetchPolicy.TIMEOUT))


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_a_size_that_fails_raises_the_same_error_in_this_process_or_a_worker(tmp_path, workers):
    # An L3-limited size replays on a scratch store made under scratch_dir, which does not exist: the first size
    # to start fails, wherever it runs (with 2 or 3 lanes this process takes the last size, a worker the first).
    points = [SweepPoint(256, 512, 40 * PAGE), SweepPoint(512, 512, 40 * PAGE), SweepPoint(256, 1024, 40 * PAGE)]
    with pytest.raises(RuntimeError, match=r"^sweep at L1 \d+ / L2 \d+ / L3 \d+ bytes: FileNotFoundError: "):
        sweep(LAYOUT, generate(SPEC), points, workers=workers, scratch_dir=str(tmp_path / "absent"))


def test_progress_counts_the_sizes_done_in_this_process_and_in_workers():
    seen = []
    points = [SweepPoint(256, 512), SweepPoint(512, 512), SweepPoint(256, 1024), SweepPoint(512, 1024)]
    report = sweep(LAYOUT, generate(WorkloadSpec(requests=20, tenants=2, seed=1)), points, workers=2,
                   progress=seen.append)
    assert seen == [1, 2, 3, 4] and [p.point for p in report.points] == points and report.workers == 2
