"""`kvc explain` and `kvc replay --requests-out`, offline on an LMDB store and live on a cache serving its admin
socket (in process: CliRunner and an AdminServer with an owner thread): the reasons as the CLI prints them, the
per-request lines against the replay's report and against `kvc explain`, and the CLI's error contract. The salt
never appears in what kvc prints."""

from __future__ import annotations

import json

import pytest

from clirun import salted
from factories import forward, l3_cache, make_layout, make_store
from kvcache import AdminServer, Namespace, Request, WorkloadSpec, generate, write_trace
from redis_server import redis_server  # noqa: F401  (session fixture)

SALT = "explain-salt-qazwsx-17"
T1 = Namespace("t1", SALT)
TOKENS = ",".join(str(t) for t in range(1, 41))  # 10 pages of 4


def invoke(*args, code=0):
    return salted(*args, salt=SALT, code=code)


def doc(*args):
    return json.loads(invoke(*args, "--json").stdout)


@pytest.fixture
def store_path(tmp_path):
    store = make_store(tmp_path / "store", make_layout(4))
    store.close()
    return str(tmp_path / "store")


@pytest.fixture(params=["lmdb", "redis"])
def location(request, tmp_path):
    """An empty store of 4-token pages, by its location: LMDB, or Redis (the session's shared server)."""
    if request.param == "lmdb":
        where = str(tmp_path / "store")
        store = make_store(where, make_layout(4))
    else:
        from kvcache.storage.registry import open_store

        where = request.getfixturevalue("redis_server").store_url()
        store = open_store(where, make_layout(4), create=True)
    store.close()
    return where


def test_offline_explain_names_the_l3_reasons(location):
    store_path = location
    e = doc("explain", "--store", store_path, "--extra-key", "t1", "--tokens", TOKENS)
    assert e["device"] is None and e["host"] is None and e["prefetch"] is None
    assert e["storage"]["first_miss"]["reason"] == "never_written" and e["namespace"]["extra_key"] == "t1"
    invoke("put", "--store", store_path, "--extra-key", "t1", "--tokens", ",".join(TOKENS.split(",")[:24]))
    e = doc("explain", "--store", store_path, "--extra-key", "t1", "--tokens", TOKENS)
    assert e["storage"]["matched_tokens"] == 24 and e["hits"] == {"device": 0, "host": 0, "storage": 24}
    assert e["storage"]["first_miss"]["page"] == 6
    other = doc("explain", "--store", store_path, "--extra-key", "t2", "--tokens", TOKENS)
    miss = other["storage"]["first_miss"]
    assert (miss["page"], miss["reason"], miss["other_namespaces"]) == (0, "other_namespace", 1)
    text = invoke("explain", "--store", store_path, "--extra-key", "t2", "--tokens", TOKENS).stdout
    assert "held under 1 other namespace of this layout" in text and "t1" not in text.replace("t1/", "")
    invoke("ns", "drop", "t1", "--yes", "--store", store_path)
    miss = doc("explain", "--store", store_path, "--extra-key", "t1", "--tokens", TOKENS)["storage"]["first_miss"]
    assert miss["reason"] == "removed" and miss["removal"]["reason"] == "drop"
    assert "removed (drop, at " in invoke("explain", "--store", store_path, "--extra-key", "t1", "--tokens",
                                          TOKENS).stdout


def test_explain_errors_follow_the_cli_contract(store_path, tmp_path):
    for args in (["--rid", "r1", "--tokens", "1,2"], ["--trace", tmp_path / "t.jsonl"], []):
        result = invoke("explain", "--store", store_path, *args, code=2)
        assert result.stderr.count("\n") == 1 and not result.stdout
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"rid": "r1", "tokens": [1, 2, 3, 4], "extra_key": "t1", "cache_salt": SALT}) + "\n")
    err = json.loads(invoke("explain", "--store", store_path, "--trace", trace, "--rid", "r9", "--json",
                            code=2).stdout)["error"]
    assert "r9" in err["message"]
    invoke("explain", "--store", store_path, "--trace", trace, "--rid", "r1", "--tokens", "1", code=2)
    invoke("explain", "--store", store_path, "--extra-key", "t1", "--tokens", "1,2", "--layout", "zz", code=2)
    invoke("explain", "--store", store_path + "-missing", "--extra-key", "t1", "--tokens", "1,2", code=2)
    e = doc("explain", "--store", store_path, "--trace", trace, "--rid", "r1")
    assert e["rid"] == "r1" and e["namespace"]["salt_fingerprint"]


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_replay_lines_sum_to_the_report_and_equal_explain(store_path, tmp_path):
    trace = tmp_path / "trace.jsonl"
    write_trace(str(trace), generate(WorkloadSpec(requests=40, tenants=2, documents=2, document_tokens=32, seed=5)))
    sizes = ("--device-tokens", 1024, "--host-tokens", 2048, "--prefetch-policy", "wait_complete")  # under pressure
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    report = doc("replay", trace, "--store", store_path, *sizes, "--requests-out", first)
    lines = _lines(first)
    assert len(lines) == report["requests"] == 40 and report["refused"] == 0
    for tier in ("device", "host", "storage"):
        assert sum(line["hits"][tier] for line in lines) == report["hit_tokens"][tier]
    assert sum(line["tokens"] for line in lines) == report["tokens"]
    assert report["hit_tokens"]["device"] > 0  # the trace shares prefixes: the lines are not all misses
    # In a new process, the first request meets a cold L1 and L2 and the store as the first replay left it: what
    # offline `kvc explain` says of it now is its line (the fields both have: no cache runs offline).
    rid = lines[0]["rid"]
    said = doc("explain", "--store", store_path, "--trace", trace, "--rid", rid)
    report = doc("replay", trace, "--store", store_path, *sizes, "--requests-out", second)
    line = _lines(second)[0]
    assert line["rid"] == rid and line["hits"]["storage"] > 0
    for field in ("rid", "namespace", "tokens", "page_size", "hits", "storage"):
        assert line[field] == said[field], field
    assert line["prefetch"]["fate"] == "completed"
    assert sum(x["hits"]["storage"] for x in _lines(second)) == report["hit_tokens"]["storage"]


def test_live_explain_and_replay_lines(store_path, tmp_path):
    from kvcache.storage.registry import open_store

    store = open_store(store_path, make_layout(4))
    cache = l3_cache(store, device_tokens=256, host_tokens=256)
    served = Request("r1", [int(t) for t in TOKENS.split(",")][:24], T1)
    adm = cache.admit(served)
    forward(cache, served, adm)
    cache.commit("r1")
    cache.flush()
    sock = str(tmp_path / "s.sock")
    server = AdminServer(cache, sock).start_owner_thread()
    try:
        e = doc("--socket", sock, "explain", "--extra-key", "t1", "--tokens", TOKENS)
        assert [e[t]["matched_tokens"] for t in ("device", "host", "storage")] == [24, 24, 24]
        assert e["device"]["first_miss"]["page"] == 6 and e["device"]["first_miss"]["reason"] == "never_written"
        assert e["hits"] == {"device": 24, "host": 0, "storage": 0}
        text = invoke("--socket", sock, "explain", "--extra-key", "t1", "--tokens", TOKENS).stdout
        assert "L1 device   24/40 tokens" in text and "no live cache" not in text
        invoke("--socket", sock, "ns", "drop", "t1", "--yes")
        e = doc("--socket", sock, "explain", "--extra-key", "t1", "--tokens", TOKENS)
        for tier in ("device", "host", "storage"):
            assert e[tier]["first_miss"]["removal"]["reason"] == "drop", tier
        trace = tmp_path / "trace.jsonl"
        write_trace(str(trace), generate(WorkloadSpec(requests=12, tenants=2, documents=2, document_tokens=16,
                                                      seed=3)))
        out = tmp_path / "lines.jsonl"
        report = doc("--socket", sock, "replay", trace, "--requests-out", out)
        lines = _lines(out)
        assert [line["rid"] for line in lines] == [json.loads(x)["rid"] for x in trace.read_text().splitlines()]
        for tier in ("device", "host", "storage"):
            assert sum(line["hits"][tier] for line in lines) == report["hit_tokens"][tier]
        assert all(line["device"] is not None for line in lines)
        invoke("--socket", sock, "explain", "--extra-key", "t1", "--tokens", "1,2", "--layout", "abcdef12", code=2)
    finally:
        server.close()
    cache.close()
    store.close()
