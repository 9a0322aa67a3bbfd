"""`kvc ns dump` and `kvc ns probe` by page hashes, the router's views (issue 37 item 4), through the CLI in process:
offline on a real LMDB store and a real redis-server on loopback, live on a cache serving its admin socket (an
AdminServer with an owner thread) over an LMDB store, with pages on the device, in host memory and in the store.

A dump replayed into an empty consumer (`kvcache.live.holdings`, what `kvc events` counts with) rebuilds what
`kvc ns ls` and `kvc stats` say each namespace holds in each tier; a live probe says what an admission then takes
from each tier. The salt never reaches stdout or stderr."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from factories import forward, l3_cache, make_layout, make_store
from kvc.main import app
from kvcache import AdminServer, Namespace, Request
from kvcache.live.holdings import Holdings, read_batches
from kvcache.storage.api import page_origins
from kvcache.storage.registry import open_store
from kvcache.types.config import PrefetchPolicy
from redis_server import redis_server  # noqa: F401  (session fixture)

SALT = "dump-cli-salt-poiuyt"
LAYOUT = make_layout(4)
T1, T2 = Namespace("t1", SALT), Namespace("t2")
PROMPT = list(range(200, 264))  # 16 pages of 4
runner = CliRunner()


def kvc(*args, code=0, stdin=None):
    result = runner.invoke(app, [str(a) for a in args], env={"KVC_SALT": SALT, "KVC_SOCKET": None}, input=stdin)
    assert SALT not in result.stdout + result.stderr
    assert result.exit_code == code, result.stdout + result.stderr
    return result


def doc(*args):
    return json.loads(kvc(*args).stdout)


def _put(store, ns: Namespace, tokens: list[int]) -> None:
    packed = np.asarray(tokens, dtype="<u4").tobytes()
    hashes, origins = page_origins(LAYOUT, packed, ns, store.chain_key)
    store.put(hashes, [np.zeros(LAYOUT.bytes_per_page, dtype=np.uint8)] * len(hashes), origins)


@pytest.fixture(params=["lmdb", "redis"])
def location(request, tmp_path):
    """A store holding two namespaces (one salted, branching), by its location."""
    if request.param == "lmdb":
        where = str(tmp_path / "store")
        store = make_store(where, LAYOUT)
    else:
        where = request.getfixturevalue("redis_server").store_url()
        store = open_store(where, LAYOUT, create=True)
    for i in range(3):
        _put(store, T1, PROMPT[:32] + [i] * 4 * (i + 1))
    _put(store, T2, PROMPT)
    store.close()
    return where


def _held(events_file: Path) -> Holdings:
    held = Holdings()
    for batch in read_batches(events_file.read_bytes()):
        held.apply_batch(batch)
    return held


def test_a_store_dump_rebuilds_what_ns_ls_and_stats_say_the_store_holds(location, tmp_path):
    out = tmp_path / "dump.kvev"
    summary = doc("ns", "dump", "--store", location, "--out", out, "--json")
    held = _held(out)
    listed = doc("ns", "ls", "--store", location, "--json")["namespaces"]
    want = {(r["extra_key"], r["salt_fingerprint"]): r["pages"] for r in listed}
    assert {(r.extra_key, r.salt_fingerprint): r.pages for r in held.namespaces()} == want
    assert want[("t1", listed[0]["salt_fingerprint"] if listed[0]["extra_key"] == "t1" else
                 listed[1]["salt_fingerprint"])] == 8 + 1 + 2 + 3
    assert held.counts() == {"storage": doc("stats", "--store", location, "--json")["pages"]}
    assert summary["type"] == "Summary" and summary["pages"] == held.counts() and summary["out"] == str(out)
    # without --out: the same events as JSON lines, as `kvc events --json` prints them, then the summary
    lines = [json.loads(x) for x in kvc("ns", "dump", "--store", location, "--json").stdout.splitlines()]
    assert lines[0]["type"] == "AllBlocksCleared" and lines[-1]["type"] == "Summary"
    stored = [h for rec in lines[1:-1] for h in rec["block_hashes"]]
    assert sorted(stored) == sorted(h.hex() for h in _hashes(held, "storage"))
    sglang = doc("ns", "dump", "--store", location, "--medium-names", "sglang", "--json", "--out", tmp_path / "s")
    assert sglang["pages"] == {"DISK": held.counts()["storage"]}


def _hashes(held: Holdings, medium: str) -> list[bytes]:
    return [h for h in held._held.get(medium, {})]


def test_dump_usage_errors_are_one_line_and_write_nothing(tmp_path):
    store = str(tmp_path / "store")
    make_store(store, LAYOUT).close()
    for args in (["--tier", "device"], ["--lines"], ["--out", tmp_path]):
        result = kvc("ns", "dump", "--store", store, *args, code=2)
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("kvc: error:")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


@pytest.fixture
def served(tmp_path):
    """A live cache over an LMDB store: t1's prompt with its first 4 pages on the device, the next 4 only in host
    memory, the next 4 only in the store (and t2 elsewhere); serving its admin socket from an owner thread."""
    store = make_store(tmp_path / "store", LAYOUT)
    cache = l3_cache(store, device_tokens=256, host_tokens=512, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    for i, n in enumerate((16, 32, 48)):  # three nodes down one chain: [0:16] [16:32] [32:48]
        req = Request(f"w{i}", PROMPT[:n], T1)
        forward(cache, req, cache.admit(req))
        cache.commit(req.rid)
    other = Request("o", PROMPT[:24], T2)
    forward(cache, other, cache.admit(other))
    cache.commit("o")
    cache.flush()  # written through to the host and the store
    cache.match(Request("m", PROMPT[:32], T1))  # t1's first two nodes and t2 more recent than the leaf
    cache.match(Request("m2", PROMPT[:24], T2))
    cache.evict(device_tokens=16)  # the LRU leaf [32:48] leaves the device ...
    cache.evict(host_tokens=16)  # ... and host memory: only the store holds it now
    cache.evict(device_tokens=16)  # the next LRU leaf, [16:32], keeps its host copy only
    sock = str(tmp_path / "s.sock")
    server = AdminServer(cache, sock).start_owner_thread()
    yield cache, sock, server
    server.close()
    cache.close()
    store.close()


def test_a_live_dump_gives_each_tier_as_the_cache_counts_it(served, tmp_path):
    cache, sock, _ = served
    out = tmp_path / "live.kvev"
    summary = doc("ns", "dump", "--socket", sock, "--out", out, "--json")
    held = _held(out)
    rows = doc("ns", "ls", "--socket", sock, "--json")["namespaces"]
    want = {}
    for r in rows:
        for tier in ("device", "host", "storage"):
            if r[tier]["pages"]:
                want[(tier, r["extra_key"], r["salt_fingerprint"])] = r[tier]["pages"]
    assert {(h.medium, h.extra_key, h.salt_fingerprint): h.pages for h in held.namespaces()} == want
    stats = doc("stats", "--socket", sock, "--json")
    assert held.counts() == {"device": stats["device"]["used_pages"], "host": stats["host"]["used_pages"],
                             "storage": stats["store"]["pages"]}
    assert want[("device", "t1", rows[0]["salt_fingerprint"] if rows[0]["extra_key"] == "t1" else
                 rows[1]["salt_fingerprint"])] == 4
    assert summary["source"] == "live" and summary["pages"] == held.counts()
    # a tier alone, in chunks of one page from the store
    only = doc("ns", "dump", "--socket", sock, "--tier", "storage", "--chunk-pages", 1, "--json",
               "--out", tmp_path / "st")
    assert only["pages"] == {"storage": held.counts()["storage"]}


def test_a_live_probe_by_prompt_or_by_page_hashes_says_what_each_tier_serves(served):
    cache, sock, _ = served
    prompt = PROMPT[:48] + [7] * 8  # device 16, host 16, store 16, then 8 nothing holds
    got = doc("ns", "probe", "--socket", sock, "--extra-key", "t1", "--tokens", ",".join(map(str, prompt)),
              "--json")
    tiers = {r["tier"]: r["tokens"] for r in got["tiers"]}
    assert tiers == {"device": 16, "host": 16, "storage": 16} and got["served_tokens"] == 48
    # the same chain by its page hashes, as a router holds them from the feed (no namespace given)
    lines = [json.loads(x) for x in kvc("ns", "dump", "--socket", sock, "--tier", "storage", "--json").stdout
             .splitlines()]
    chain = _chain(lines, "t1")
    assert len(chain) == 12
    by_hash = doc("ns", "probe", "--socket", sock, "--hashes", ",".join(chain), "--json")
    assert [(r["tier"], r["tokens"]) for r in by_hash["tiers"]] == [("device", 16), ("host", 16), ("storage", 16)]
    tail = doc("ns", "probe", "--socket", sock, "--hashes", ",".join(chain[4:]), "--json")  # no first page
    assert [r["tokens"] for r in tail["tiers"]] == [0, 0, 32] and tail["namespace"] is None
    offline = doc("ns", "probe", "--store", cache.store.location, "--hashes", ",".join(chain), "--json")
    assert offline["served_tokens"] == 48  # the store alone holds all 12 pages from the first on
    # the probe read and changed nothing
    assert doc("ns", "probe", "--socket", sock, "--extra-key", "t1", "--tokens", ",".join(map(str, prompt)),
               "--json") == got


def test_the_live_probe_matches_the_admission_it_predicts(served):
    cache, sock, server = served
    prompt = PROMPT[:48] + [7] * 8
    got = doc("ns", "probe", "--socket", sock, "--extra-key", "t1", "--tokens", ",".join(map(str, prompt)),
              "--json")
    tiers = {r["tier"]: r["tokens"] for r in got["tiers"]}
    server.close()  # the owner thread gives the cache back: the admission runs here, as the engine's would
    req = Request("probe-check", prompt, T1)
    assert cache.prefetch(req).issued
    adm = cache.admit(req)  # settles the prefetch: it waits for the store's pages
    assert (adm.device_hit_tokens, adm.host_hit_tokens, adm.storage_hit_tokens) == (
        tiers["device"], tiers["host"], tiers["storage"]) == (16, 16, 16)
    cache.release(req.rid)
    assert cache.audit().ok


def _chain(lines: list[dict], extra_key: str) -> list[str]:
    """The page hashes of `extra_key`'s one chain in a dump's JSON lines, from its first page down."""
    events = [r for r in lines if r["type"] == "BlockStored" and r["extra_key"] == extra_key]
    by_parent = {r.get("parent_block_hash"): r for r in events}  # omitted when none (the first page)
    chain: list[str] = []
    parent = None
    while parent in by_parent:
        chain += by_parent[parent]["block_hashes"]
        parent = chain[-1]
    return chain
