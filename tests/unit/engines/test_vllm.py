"""kvcache.engines.vllm.KvcTier without vLLM: its settings, what it refuses at construction, its faults, timeouts,
events and counters, on real stores (LMDB in a temp dir, a real redis-server) through the stand-in of vLLM's
tiering manager (tests/unit/engines/fake_vllm.py). The contract every backend keeps is in
tests/conformance/test_vllm_tier.py."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcache.engines import vllm as tier_module
from kvcache.engines.vllm import KvcTier
from kvcache.engines.vllm_config import STORE_ENV, LookupMode, tier_config
from kvcache.engines.vllm_counters import METRICS
from kvcache.engines.vllm_io import JobKind
from kvcache.engines.vllm_tier import VLLMTier
from kvcache.engines.vllm_vocabulary import Lookup, TierEvent
from kvcache.errors import EngineUnsupported, InvalidInput
from kvcache.storage.api import CapacityPolicy
from kvcache.storage.location import StoreLocation
from kvcache.storage.registry import open_store
from redis_server import own_redis  # noqa: F401  (fixture)
from unit.engines.fake_vllm import Manager, Region, Spec, chunk_bytes, offload_key, offloading_config

ROOT = Path(__file__).resolve().parents[3]
ROW = 4096


def keys(tag: str, n: int, group: int = 0) -> list[bytes]:
    return [offload_key(hashlib.sha256(f"{tag}-{i}".encode()).digest(), group) for i in range(n)]


def engine(location: str, chunks: int = 32, config=None, row: int = ROW, **settings) -> Manager:
    region = Region(chunks, row)
    spec = Spec(config or offloading_config(), [{"type": "KvcTier", "kvc_store": location}])
    return Manager(KvcTier(offloading_spec=spec, primary_kv_view=region.view, tier_type="KvcTier",
                           kvc_store=location, **settings), region)


def cascade(m: Manager, tag: str, n: int) -> tuple[list[bytes], list[bytes]]:
    ks, data = keys(tag, n), [chunk_bytes(tag, i, m.region.row_bytes) for i in range(n)]
    req = m.request(f"w-{tag}", ks)
    job = m.cascade(ks, data, req)
    m.wait([job])
    m.finish(req)
    return ks, data


# -- settings: one clear error at construction ---------------------------------------------------------------------

@pytest.mark.parametrize("settings, says", [
    (dict(kvc_store="x", kvc_stor="typo"), "unknown settings ['kvc_stor']"),
    (dict(kvc_store="x", kvc_namespace=""), "kvc_namespace"),
    (dict(kvc_store="x", kvc_namespace=3), "kvc_namespace"),
    (dict(kvc_store="x", kvc_store_options=["durability"]), "kvc_store_options"),
    (dict(kvc_store="x", kvc_io_threads=0), "kvc_io_threads"),
    (dict(kvc_store="x", kvc_io_threads=True), "kvc_io_threads"),
    (dict(kvc_store="x", kvc_lookup="maybe"), "kvc_lookup"),
    (dict(kvc_store="x", kvc_load_timeout_s=-1), "kvc_load_timeout_s"),
    (dict(kvc_store="x", kvc_load_timeout_s=float("nan")), "kvc_load_timeout_s"),
    (dict(kvc_store="x", kvc_load_timeout_s=float("inf")), "kvc_load_timeout_s"),
    (dict(kvc_store="x", locality="NEARBY"), "locality"),
])
def test_a_bad_setting_is_invalid_input_naming_it(settings, says):
    with pytest.raises(InvalidInput, match=None) as err:
        tier_config(settings)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_the_store_comes_from_env_kvc_store_when_the_config_names_none(tmp_path, monkeypatch):
    monkeypatch.delenv(STORE_ENV, raising=False)
    with pytest.raises(InvalidInput, match=STORE_ENV):
        tier_config({})
    monkeypatch.setenv(STORE_ENV, str(tmp_path / "l3"))
    assert tier_config({}).store == str(tmp_path / "l3")


def test_lookups_are_synchronous_on_a_path_and_asynchronous_on_a_url_unless_told():
    assert tier_config({"kvc_store": "/var/lib/kvc"}).lookup is LookupMode.SYNC
    assert tier_config({"kvc_store": "redis://h:6379/0"}).lookup is LookupMode.ASYNC
    assert tier_config({"kvc_store": "redis://h:6379/0", "kvc_lookup": "sync"}).lookup is LookupMode.SYNC
    assert tier_config({"kvc_store": "x", "kvc_load_timeout_s": 0}).load_timeout_s == float("inf")


@pytest.mark.parametrize("config, says", [
    (offloading_config(dtype="fp8_inc"), "KV cache dtype 'fp8_inc'"),
    (offloading_config(model=""), "names no model"),
    (offloading_config(groups=0), "without KV cache groups"),
])
def test_a_deployment_kvc_cannot_store_is_engine_unsupported_at_construction(tmp_path, config, says):
    with pytest.raises(EngineUnsupported, match=says):
        engine(str(tmp_path / "l3"), config=config)
    assert not (tmp_path / "l3").exists()  # nothing opened, nothing created


def test_a_region_without_chunk_bytes_is_engine_unsupported(tmp_path):
    with pytest.raises(EngineUnsupported, match="without chunks"):
        engine(str(tmp_path / "l3"), row=0, chunks=4)


def test_store_options_pass_to_the_backend_and_one_it_does_not_take_is_invalid_input(tmp_path):
    m = engine(str(tmp_path / "a"), kvc_store_options={"durability": "none"})
    cascade(m, "opt", 2)
    m.tier.shutdown()
    with pytest.raises(InvalidInput, match="kvc_store_options"):
        engine(str(tmp_path / "b"), kvc_store_options={"no_such_option": 1})


def test_fp8_and_half_names_map_to_kvc_dtypes_and_stay_apart(tmp_path):
    layouts = {}
    for name in ("fp8", "fp8_e4m3", "half", "float16"):
        m = engine(str(tmp_path / name), config=offloading_config(dtype=name))
        layouts[name] = m.tier.layout
        m.tier.shutdown()
    assert layouts["fp8"].dtype == layouts["fp8_e4m3"].dtype == "float8_e4m3fn"
    assert layouts["half"].dtype == layouts["float16"].dtype == "float16"
    assert len({lay.layout_id for lay in layouts.values()}) == 4  # vLLM's own name is part of the identity


# -- without vLLM ------------------------------------------------------------------------------------------------

def test_without_vllm_kvc_tier_is_the_tier_itself_and_vllm_stays_unimported():
    code = ("import sys; from kvcache.engines import vllm; cls = vllm.KvcTier; "
            "print(cls.__name__, [b.__name__ for b in cls.__mro__], 'vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    name, mro, imported = out.stdout.split(" ", 1)[0], out.stdout, out.stdout.strip().endswith("True")
    assert name == "KvcTier" and "VLLMTier" in mro and "SecondaryTierManager" not in mro and not imported
    assert issubclass(KvcTier, VLLMTier)


def test_a_vllm_outside_the_supported_releases_is_refused_when_the_class_is_built(monkeypatch):
    assert tier_module._vllm_version() is None  # not installed here: the stand-in path
    monkeypatch.setattr(tier_module, "_vllm_version", lambda: (0, 36))
    low, high = tier_module.VLLM_SUPPORTED
    assert low <= (0, 34) < high and not low <= (0, 36) < high


# -- faults: failed jobs and misses, counted, logged once, never an exception --------------------------------------

def test_a_stopped_redis_server_fails_jobs_and_answers_miss_never_an_exception(tmp_path, own_redis, caplog):  # noqa: F811
    url = own_redis.store_url() + "&backoff_max=0.001&timeout=2"
    m = engine(url, kvc_lookup="sync")
    ks, data = cascade(m, "stop", 3)
    reader = engine(url, kvc_lookup="sync")  # another vLLM on the same store (opening it needs the server)
    own_redis.stop()
    caplog.set_level(logging.DEBUG, logger="kvcache.engines.vllm")
    more, payload = keys("stop-more", 2), [chunk_bytes("stop-more", i, ROW) for i in range(2)]
    req = m.request("w2", more)
    jobs = [m.cascade(more[:1], payload[:1], req), m.cascade(more[1:], payload[1:], req)]
    m.wait(jobs)
    assert not any(m.reports[j].success for j in jobs)
    req = reader.request("r", ks)
    assert reader.settle(ks, req) == 0  # lookups answer MISS, nothing raised
    reader.finish(req)  # its verdicts go with it
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "fault" in r.getMessage()]
    assert len(warnings) <= 2  # one per new fault, not one per job
    own_redis.start()
    # every failed job is counted: by the tier (a fault it caught) or by the store (one it served as a rejection
    # or a miss), whose counters read again once the server is back
    wrote, read = m.tier.kvc_stats(), reader.tier.kvc_stats()
    assert wrote.store_faults + wrote.store.write_errors >= 2 and wrote.chunks_stored == 3
    assert read.lookup_faults + read.store.read_errors >= 1
    assert reader.settle(ks, reader.request("r2", ks)) == 3  # the server is back with every chunk it kept
    assert [reader.region.read(reader.ready[k]) for k in ks] == data
    for x in (m, reader):
        x.drain()
        x.tier.shutdown()


def test_a_promotion_still_copying_at_its_deadline_is_failed_with_a_deferred_release(tmp_path, own_redis):  # noqa: F811
    url = own_redis.store_url() + "&timeout=60"  # a stalled server stalls the copy, it does not fail it
    m = engine(url)
    ks, data = cascade(m, "late", 3)
    reader = engine(url, kvc_lookup="sync", kvc_load_timeout_s=0.5)
    req = reader.request("r", ks)
    assert reader.scan(ks, req) == 3  # HITs: promotions pending for the step's end
    os.kill(own_redis.proc.pid, signal.SIGSTOP)
    try:
        reader.step()  # submit_load: the copy starts and stalls on the server
        deadline = time.monotonic() + 60
        while not any(j.kind is JobKind.LOAD for j in reader.tier._pool.running()):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        while not reader.reports:  # the deadline passes while it copies: reported failed, release deferred
            assert time.monotonic() < deadline
            reader.collect()
            time.sleep(0.001)
        (report,) = reader.reports.values()
        assert not report.success and report.deferred_release is not None
        assert not report.deferred_release.is_set() and reader.deferred  # vLLM still holds the chunks
        assert reader.tier.kvc_stats().load_timeouts == 1
    finally:
        os.kill(own_redis.proc.pid, signal.SIGCONT)
    assert report.deferred_release.wait(60)  # set when the copy ends
    reader.collect()
    assert not reader.deferred and len(reader.free) == reader.region.chunks
    assert reader.tier.lookup(ks[0], req) == Lookup.MISS  # not promoted again for this request
    reader.drain()
    for x in (m, reader):
        x.tier.shutdown()


# -- capacity and events -------------------------------------------------------------------------------------------

def test_cascades_are_reported_stored_and_chunks_the_store_evicted_for_them_removed(tmp_path):
    location = str(tmp_path / "l3")
    layout = engine(location).tier.layout  # registers the deployment's layout
    open_store(location, layout, capacity=CapacityPolicy(capacity_bytes=8 * ROW, evict_headroom=0.0)).close()
    m = engine(location, enable_kv_events=True)
    first, _ = cascade(m, "cap-a", 6)
    stored = [e for e in m.events if not e.removed]
    assert isinstance(stored[0], TierEvent) and stored[0].medium == "STORAGE" and stored[0].keys == first
    assert stored[0].ownership == "kvc" and stored[0].req_context is not None
    m.events.clear()
    second, _ = cascade(m, "cap-b", 6)  # needs room: the oldest leaves of the first prompt go
    removed = [k for e in m.events if e.removed for k in e.keys]
    assert removed and set(removed) <= set(first)
    assert [k for e in m.events if not e.removed for k in e.keys] == second
    stats = m.tier.kvc_stats()
    assert stats.chunks_evicted == len(removed) and stats.store.pages_evicted == len(removed)
    m.tier.shutdown()


def test_events_are_taken_only_when_asked_for_and_vllms_events_are_on(tmp_path):
    location = str(tmp_path / "l3")
    quiet = engine(location)
    cascade(quiet, "ev-q", 2)
    assert quiet.events == []
    off = engine(location, config=offloading_config(events=False), enable_kv_events=True)  # globally off: none
    cascade(off, "ev-o", 2)
    assert off.events == []
    for x in (quiet, off):
        x.tier.shutdown()


# -- counters as vLLM's metrics see them --------------------------------------------------------------------------

def test_stat_deltas_are_the_increments_since_the_last_call(tmp_path):
    m = engine(str(tmp_path / "l3"))
    cascade(m, "st", 3)
    first = m.tier.stat_deltas()
    assert first["chunks_stored"] == 3 and first["bytes_written"] == 3 * ROW
    assert m.tier.stat_deltas() == {}  # nothing since
    cascade(m, "st", 3)  # stored already
    assert m.tier.stat_deltas() == {"chunks_existing": 3}
    assert set(METRICS) <= set(m.tier.kvc_stats().__struct_fields__) | {"checksum_misses"}
    m.tier.shutdown()


def test_config_info_names_the_store_without_its_password(own_redis):  # noqa: F811
    url = own_redis.store_url().replace("redis://", "redis://:hunter2@")
    info = tier_config({"kvc_store": url})
    assert info.store == url
    shown = str(StoreLocation(url))
    assert "hunter2" not in shown


# -- lookup verdicts live as long as a request that asked -------------------------------------------------------

def test_a_verdict_is_kept_while_a_request_that_asked_lives_and_asked_again_after(tmp_path):
    location = str(tmp_path / "l3")
    reader = engine(location, kvc_lookup="sync")
    (k,) = keys("v", 1)
    a, b = reader.request("a", [k]), reader.request("b", [k])
    assert reader.tier.lookup(k, a) == Lookup.MISS
    writer = engine(location)
    cascade(writer, "v", 1)  # another engine stores it meanwhile
    assert reader.tier.lookup(k, b) == Lookup.MISS  # the verdict a asked for, shared with b
    reader.finish(a)
    assert reader.tier.lookup(k, b) == Lookup.MISS  # b still lives: kept
    reader.finish(b)
    assert reader.tier._verdicts.known == {} and reader.tier._verdicts.refs == {}
    c = reader.request("c", [k])
    assert reader.tier.lookup(k, c) == Lookup.HIT  # asked again: found
    for x in (reader, writer):
        x.tier.shutdown()
