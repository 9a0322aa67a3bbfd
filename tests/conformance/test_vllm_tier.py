"""vLLM's secondary-tier contract, kept by kvc's tier (`kvcache.engines.vllm`) on every L3 backend, without vLLM.

A stand-in of vLLM's TieringOffloadingManager (tests/unit/engines/fake_vllm.py) makes the calls vLLM makes —
`on_new_request`, `lookup`, `submit_store`, `submit_load`, `get_finished_jobs`, `drain_jobs` (and the step's end,
a request's end, `take_events`, `shutdown`) — over a real primary region, and checks what vLLM checks: every job
reported exactly once, `successful_keys` a subset of the job's keys, deferred releases set by the time
`drain_jobs` returns, promoted chunks byte-identical to what was cascaded.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvcache.engines.vllm import KvcTier
from kvcache.engines.vllm_vocabulary import Lookup
from kvcache.storage.api import engine_hashes
from kvcache.types.namespace import Namespace
from unit.engines.fake_vllm import Manager, Region, Spec, chunk_bytes, offload_key, offloading_config

ROW = 4096  # bytes of one chunk row (vLLM's are 256 KiB to MiBs; the contract is the same)


def keys(tag: str, n: int, group: int = 0) -> list[bytes]:
    """vLLM OffloadKeys: a sha256 block hash and the group index."""
    return [offload_key(hashlib.sha256(f"{tag}-{i}".encode()).digest(), group) for i in range(n)]


def tier(location: str, region: Region, config=None, **settings) -> KvcTier:
    spec = Spec(config or offloading_config(), [{"type": "KvcTier", "kvc_store": location}])
    return KvcTier(offloading_spec=spec, primary_kv_view=region.view, tier_type="KvcTier", kvc_store=location,
                   **settings)


def engine(location: str, chunks: int = 32, config=None, **settings) -> Manager:
    region = Region(chunks, ROW)
    return Manager(tier(location, region, config, **settings), region)


def cascade(m: Manager, tag: str, n: int, req_id: str = "w") -> tuple[list[bytes], list[bytes]]:
    ks, data = keys(tag, n), [chunk_bytes(tag, i, ROW) for i in range(n)]
    req = m.request(req_id, ks)
    job = m.cascade(ks, data, req)
    m.wait([job])
    assert m.reports[job].success
    m.finish(req)
    return ks, data


def promote(m: Manager, ks: list[bytes], req_id: str = "r") -> int:
    """Scan a prompt's keys as vLLM's scheduler does (up to the first miss, again while lookups are deferred) and
    wait for the promotions the hits started: how many keys from the start hit."""
    req = m.request(req_id, ks)
    hits = m.settle(ks, req)
    m.finish(req)
    return hits


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_chunks_cascaded_by_one_engine_are_promoted_byte_identical_by_another(location, mode):
    writer = engine(location, kvc_lookup=mode)
    ks, data = cascade(writer, "a", 6)
    reader = engine(location, kvc_lookup=mode)
    assert promote(reader, ks) == 6
    (job,) = reader.reports.values()
    assert job.success and job.transfer_bytes == 6 * ROW and job.deferred_release is None
    assert [reader.region.read(reader.ready[k]) for k in ks] == data
    stats = reader.tier.kvc_stats()
    assert (stats.chunks_loaded, stats.chunks_missed, stats.bytes_read) == (6, 0, 6 * ROW)
    for m in (writer, reader):
        m.drain()
        m.tier.shutdown()


def test_a_cascade_of_chunks_stored_already_leaves_them_and_succeeds(location):
    m = engine(location)
    ks, data = cascade(m, "b", 4)
    again = engine(location)
    more = keys("b-more", 2)
    req = again.request("w2")
    job = again.cascade(ks + more, data + [chunk_bytes("b-more", i, ROW) for i in range(2)], req)
    again.wait([job])
    assert again.reports[job].success
    stats = again.tier.kvc_stats()
    assert (stats.chunks_stored, stats.chunks_existing) == (2, 4)
    for x in (m, again):
        x.tier.shutdown()


def test_a_key_never_stored_is_a_miss_and_a_prompt_stops_at_its_first_gap(location):
    m = engine(location)
    ks, _ = cascade(m, "c", 3)
    reader = engine(location)
    probe = ks[:2] + keys("c-absent", 1) + ks[2:]
    assert promote(reader, probe) == 2
    assert reader.tier.kvc_stats().chunks_loaded == 2
    for x in (m, reader):
        x.tier.shutdown()


@pytest.mark.parametrize("change", [dict(dtype="float16"), dict(tp=2), dict(model="Qwen/Qwen3-0.6B@other"),
                                    dict(blocks_per_chunk=2), dict(tokens_per_block=32), dict(layers=5),
                                    dict(groups=2), dict(kv_cache_layout="HND")])
def test_a_deployment_that_differs_in_any_identity_field_never_reads_the_chunks(location, change):
    m = engine(location)
    ks, _ = cascade(m, "d", 3)
    other = engine(location, config=offloading_config(**change))
    assert other.tier.layout.layout_id != m.tier.layout.layout_id
    assert promote(other, ks) == 0
    same = engine(location)  # the same deployment again, e.g. another data-parallel replica: it reads them
    assert promote(same, ks) == 3
    for x in (m, other, same):
        x.tier.shutdown()


def test_chunks_live_under_the_configured_namespace_and_another_namespace_reads_none(location):
    m = engine(location, kvc_namespace="prod-llama")
    ks, _ = cascade(m, "e", 3)
    assert {r.extra_key for r in m.tier.store.namespaces()} == {"prod-llama"}
    h = engine_hashes(m.tier.layout, Namespace(extra_key="prod-llama"), m.tier.store.chain_key, ks)
    assert m.tier.store.exists_prefix(h) == 3  # a read needs nothing but the keys (and the deployment)
    other = engine(location)  # the default namespace, "vllm"
    assert promote(other, ks) == 0
    for x in (m, other):
        x.tier.shutdown()


def test_a_prefix_is_stored_as_a_chain_in_each_group_by_the_positions_vllm_recorded(location):
    m = engine(location, config=offloading_config(groups=2))
    g0, g1 = keys("f", 3, group=0), keys("f", 3, group=1)
    req = m.request("w")
    # interleaved groups, out of order: what the store links is each group's chunk after its predecessor
    order = [g1[2], g0[1], g1[0], g0[0], g1[1], g0[2]]
    for g in (g0, g1):
        req.positions.update({k: (i + 1) * 16 for i, k in enumerate(g)})
    job = m.cascade(order, [chunk_bytes("f", i, ROW) for i in range(6)], req)
    m.wait([job])
    t = m.tier
    for g in (g0, g1):
        hs = engine_hashes(t.layout, t.namespace, t.store.chain_key, g)
        assert t.store.page_meta(hs[1]).parent == hs[0] and t.store.page_meta(hs[2]).parent == hs[1]
        first_parent = t.store.page_meta(hs[0]).parent
        assert first_parent not in hs and t.store.page_meta(first_parent) is None  # the namespace root
    t.shutdown()


def test_a_flipped_byte_is_never_promoted_its_chunk_is_zeroed_and_the_key_answers_miss(factory, location):
    m = engine(location)
    ks, data = cascade(m, "g", 4)
    factory.corrupt(location, data[2][1000:1064])
    reader = engine(location, kvc_lookup="sync")
    req = reader.request("r", ks)
    assert reader.settle(ks, req) == 4  # the store holds all four: each a HIT, one promotion job
    (job,) = reader.reports.values()
    assert not job.success and set(job.successful_keys) == {ks[0], ks[1], ks[3]} and job.deferred_release is None
    assert [reader.region.read(reader.ready[k]) for k in (ks[0], ks[1], ks[3])] == [data[0], data[1], data[3]]
    assert ks[2] not in reader.ready
    # only the three good chunks hold bytes: the corrupt one's chunk was zeroed
    assert np.count_nonzero(reader.region.array) == sum(ROW - d.count(0) for d in (data[0], data[1], data[3]))
    assert reader.tier.lookup(ks[2], req) == Lookup.MISS  # never promoted again for this request
    reader.finish(req)
    stats = reader.tier.kvc_stats()
    assert stats.chunks_loaded == 3 and stats.chunks_missed == 1 and stats.store.checksum_failures == 1
    assert promote(reader, [ks[2]], "r2") == 0  # quarantined: a miss for later requests too
    for x in (m, reader):
        x.tier.shutdown()


def test_drain_cancels_what_has_not_started_reports_it_failed_and_leaves_nothing_running(location):
    m = engine(location, chunks=64, kvc_io_threads=1)
    ks, data = keys("h", 40), [chunk_bytes("h", i, ROW) for i in range(40)]
    req = m.request("w", ks)
    jobs = [m.cascade(ks[i:i + 2], data[i:i + 2], req) for i in range(0, 40, 2)]
    m.drain()  # every job reported: done, or cancelled before it started
    assert set(m.reports) == set(jobs)
    done = [j for j in jobs if m.reports[j].success]
    cancelled = len(jobs) - len(done)
    assert m.tier.kvc_stats().cancelled == cancelled
    assert m.tier.kvc_stats().chunks_stored == 2 * len(done)
    assert not m.tier.has_pending_work()
    m.tier.shutdown()


def test_shutdown_releases_every_view_of_vllms_region(location):
    m = engine(location)
    ks, _ = cascade(m, "i", 3)
    reader = engine(location)
    assert promote(reader, ks) == 3
    for x in (m, reader):
        x.tier.shutdown()
        x.tier.shutdown()  # idempotent
        x.region.view.release()  # raises BufferError while the tier still holds a view of it


def test_jobs_submitted_after_shutdown_are_reported_failed_not_lost(location):
    m = engine(location)
    m.tier.shutdown()
    req = m.request("late")
    job = m.cascade(keys("j", 1), [chunk_bytes("j", 0, ROW)], req)
    m.collect()
    assert not m.reports[job].success


@pytest.mark.parametrize("heal", ["self-heal", "repair"])
def test_a_corrupt_chunk_dropped_takes_none_of_the_prompts_other_chunks_with_it(factory, location, heal):
    # A prompt's chunks are a chain in the store, but an engine page's parent is a hint: when the store drops a
    # corrupt chunk (its next write after the failed read, or `verify(repair=True)`), the chunks after it are intact
    # and readable by their keys: neither called orphans nor removed with it.
    m = engine(location)
    ks, data = cascade(m, "heal", 5)
    m.tier.shutdown()
    factory.corrupt(location, data[2][1000:1064])
    if heal == "self-heal":
        reader = engine(location, kvc_lookup="sync")
        assert promote(reader, ks) == 5  # five HITs; the promotion of chunk 2 fails its checksum
        reader.tier.shutdown()  # its last flush drops the corrupt chunk
    store = factory.open(location, m.tier.layout)
    try:
        report = store.verify(repair=True)
        assert "orphan" not in {f.kind for f in report.findings}, report.findings
        assert {r.page_hash for r in report.removals} <= {engine_hashes(m.tier.layout, m.tier.namespace,
                                                                        store.chain_key, ks[2:3])[0].hex()}
        assert store.verify().ok
    finally:
        store.close()
    after = engine(location)
    assert promote(after, ks[3:]) == 2  # the chunks after it, still there, byte for byte
    assert [after.region.read(after.ready[k]) for k in ks[3:]] == data[3:]
    assert promote(after, ks[2:3], "r2") == 0
    after.tier.shutdown()
