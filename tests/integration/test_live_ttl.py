"""Namespace TTL end to end: `kvc serve --ttl-*` as a real process (forked: `forkrun`) on an LMDB store made by
`kvc init` and `kvc put`; `kvc ns ls` shows each namespace's deadline, `kvc ns expire` expires one now; the options
and the offline command fail by the CLI's error contract. (The expiry rules themselves, on a fake clock: tests/unit/
test_ttl.py.)"""

import json
import time

import pytest
from test_live import PROMPT, SALT, Server, as_json, invoke, kvc


def make_store(path) -> str:
    """test_live's store (t1 with a salt: 21 pages; t2 without), made in process (faster than subprocesses)."""
    assert invoke("init", "--store", path, "--page-size", 4).exit_code == 0
    for tail in ([7] * 8, [9] * 12):
        assert invoke("put", "--store", path, "--extra-key", "t1", "--salt", SALT,
                      "--tokens", ",".join(map(str, PROMPT + tail))).exit_code == 0
    assert invoke("put", "--store", path, "--extra-key", "t2", "--tokens", ",".join(map(str, PROMPT))).exit_code == 0
    return str(path)


@pytest.fixture(scope="module")
def served(tmp_path_factory, engine_forks):
    root = tmp_path_factory.mktemp("ttl")
    store = make_store(root / "store")
    server = Server(engine_forks, store, str(root / "s.sock"), "--ttl-default-s", "3600", "--ttl-max-s", "7200",
                    "--ttl-mode", "absolute", "--ttl-max-namespaces", "50", "--ttl-sweep-s", "0.5")
    yield store, server
    assert server.stop() == 0


def _rows(sock):
    return {r["extra_key"]: r for r in as_json(invoke("--socket", sock, "ns", "ls", "--json"))["namespaces"]}


def test_serve_reports_its_policy_and_ns_ls_shows_deadlines(served, engine_forks):
    store, server = served
    assert server.ready["ttl"] == {"mode": "absolute", "default_ttl_s": 3600.0, "max_ttl_s": 7200.0,
                                   "max_namespaces": 50, "sweep_interval_s": 0.5}
    assert "TTL absolute 3600 s (max 7200 s, 50 namespaces)" in server.stderr
    sock = server.sock
    before = _rows(sock)
    assert before["t1"]["deadline"] is None  # in the store, not used by this cache yet: not tracked
    start = time.time()
    kvc(engine_forks, "--socket", sock, "prefetch", "--extra-key", "t1", "--salt", SALT, check_rc=0)  # a use: tracked now
    row = _rows(sock)["t1"]
    assert start + 3600 - 60 <= row["deadline"] <= time.time() + 3600 and row["expiry_deferred"] is False
    table = invoke("--socket", sock, "ns", "ls")
    assert table.exit_code == 0 and "expires" in table.stdout and "scheduled" in table.stdout
    tsv = invoke("--socket", sock, "ns", "ls", "-o", "tsv", "--sort", "extra_key").stdout.splitlines()
    assert tsv[0].split("\t")[-2:] == ["expires", "expiry"]
    assert [line.split("\t")[-1] for line in tsv[1:]] == ["scheduled", "-"]  # t1 tracked, t2 not


def test_ns_expire_drops_the_namespace_from_every_tier_at_once(served, engine_forks):
    store, server = served
    sock = server.sock
    kvc(engine_forks, "--socket", sock, "prefetch", "--extra-key", "t1", "--salt", SALT, check_rc=0)
    assert _rows(sock)["t1"]["host"]["tokens"] == 84
    refused = invoke("--socket", sock, "ns", "expire", "t1", "--salt", SALT)
    assert refused.exit_code == 2 and "without --yes" in refused.stderr
    doc = as_json(invoke("--socket", sock, "ns", "expire", "t1", "--salt", SALT, "--yes", "--json"))
    assert doc["expired"] is True and doc["deferred"] is False and doc["cause"] == "on_demand"
    assert doc["host_pages"] == 21 and doc["store_pages"] == 21 and doc["live_requests"] == 0
    assert "t1" not in _rows(sock) and "t2" in _rows(sock)  # not listed live ...
    offline = as_json(invoke("ns", "ls", "--store", store, "--json"))
    assert {r["extra_key"] for r in offline["namespaces"]} == {"t2"}  # ... nor in the store
    fetched = as_json(invoke("--socket", sock, "prefetch", "--extra-key", "t1", "--salt", SALT, "--json"))
    assert fetched["hit_tokens"] == 0  # nothing of it is fetchable
    audit = as_json(invoke("--socket", sock, "audit", "--json"))
    assert audit["ok"] is True
    ttl = as_json(invoke("--socket", sock, "stats", "--json"))["cache"]["ttl"]
    assert ttl["expired"] == {"on_demand": 1} and ttl["store_pages"] == 21 and ttl["tracked"] == 0
    stats = invoke("--socket", sock, "stats", "-o", "tsv").stdout.splitlines()
    assert {"cache.ttl.tracked\t0", "cache.ttl.expired.on_demand\t1", "cache.ttl.store_pages\t21"} <= set(stats)
    said = invoke("--socket", sock, "ns", "expire", "t2", "--yes")
    assert said.exit_code == 0 and said.stdout.startswith("expired namespace t2") and "21 L3 pages" not in said.stdout


def test_expiring_a_namespace_the_cache_does_not_know_says_so_and_exits_1(served):
    """Issue 25 #10: `kvc ns expire ghost --yes` on a namespace that never existed answered `"expired": true` and
    counted an expiry. Now: `expired` false, nothing counted, exit 1."""
    store, server = served
    sock = server.sock
    before = as_json(invoke("--socket", sock, "stats", "--json"))["cache"]["ttl"]["expired"]
    result = invoke("--socket", sock, "ns", "expire", "ghost", "--salt", SALT, "--yes", "--json")
    assert result.exit_code == 1, result.stderr
    doc = json.loads(result.stdout)
    assert doc["expired"] is False and doc["deferred"] is False and doc["namespace"]["extra_key"] == "ghost"
    said = invoke("--socket", sock, "ns", "expire", "ghost", "--yes")
    assert said.exit_code == 1 and "nothing expired" in said.stdout and not said.stdout.startswith("expired")
    assert as_json(invoke("--socket", sock, "stats", "--json"))["cache"]["ttl"]["expired"] == before


def test_ns_expire_offline_points_to_ns_drop():
    result = invoke("ns", "expire", "t1", "--salt", SALT, "--yes", "--json")
    assert result.exit_code == 2
    assert "give --socket" in result.stderr and "kvc ns drop" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert json.loads(result.stdout)["error"]["kind"] == "usage"


@pytest.mark.parametrize("args, says", [
    (["--ttl-max-s", "60"], "--ttl-max-s needs --ttl-default-s"),
    (["--ttl-default-s", "60", "--ttl-max-s", "30"], "--ttl-max-s: ttl max_ttl_s=30.0 must be finite and >= "
                                                     "default_ttl_s=60.0"),
    (["--ttl-default-s", "0"], "--ttl-default-s: ttl default_ttl_s=0.0 must be > 0"),
    (["--ttl-default-s", "60", "--ttl-sweep-s", "-1"], "--ttl-sweep-s: ttl sweep_interval_s=-1.0 must be >= 0"),
    (["--ttl-default-s", "60", "--ttl-mode", "forever"], "'forever' is not one of"),
])
def test_bad_ttl_options_are_one_line_and_exit_2(tmp_path, args, says):
    result = invoke("serve", "--store", tmp_path / "nothing", "--socket", tmp_path / "s.sock", *args)
    assert result.exit_code == 2, result.stdout
    assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "s.sock").exists()
