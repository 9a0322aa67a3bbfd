"""kvc audit / ns / stats against real LMDB stores and snapshots: exit codes, --json fields, the salt never shown.

Run in this process (typer's CliRunner; `kvc` gives the salt in KVC_SALT as a user would, never on the command
line), on a copy each of one store written once."""

import json
import os
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

import clirun
from factories import forward, l3_cache, make_cache, make_layout, make_store
from kvc.main import app
from kvcache import Namespace, Request
from kvcache.storage.keyfile import read_key
from kvcache.types.owners import OwnerKind, owner_code

SALTS = {"t1": "cli-salt-one-qwerty", "t2": "cli-salt-two-asdfgh"}
runner = CliRunner()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A store of three namespaces (t1 and t2 salted, one unnamed), 12 pages of 4 tokens each, written once."""
    path = tmp_path_factory.mktemp("written") / "store"
    store = make_store(path, make_layout(4))
    cache = l3_cache(store)
    for i, ns in enumerate([Namespace("t1", SALTS["t1"]), Namespace("t2", SALTS["t2"]), Namespace()]):
        req = Request(f"r{i}", list(range(40)) + [i] * 8, ns)
        forward(cache, req, cache.admit(req))
        cache.commit(req.rid)
    cache.close()
    store.close()
    return path


@pytest.fixture
def store_path(written, tmp_path):
    """This test's copy of the written store."""
    return str(shutil.copytree(written, tmp_path / "store"))


def kvc(*args, salt=None):
    """kvc in this process, a salt in KVC_SALT (never on its command line); what it printed and its exit code."""
    ran = clirun.in_process(*args, env=dict(os.environ, KVC_SALT=salt) if salt is not None else None)
    for salt in SALTS.values():
        assert salt not in ran.stdout + ran.stderr
    return ran


def invoke(*args, salt=None):
    result = runner.invoke(app, list(args), env={"KVC_SALT": salt} if salt is not None else None)
    for salt in SALTS.values():
        assert salt not in result.output
    return result


def test_ns_ls_json_lists_the_namespaces_written(store_path):
    out = kvc("ns", "ls", "--store", store_path, "--json")
    assert out.returncode == 0 and out.stderr == ""
    doc = json.loads(out.stdout)
    rows = {(r["extra_key"], r["salt_fingerprint"]) for r in doc["namespaces"]}
    key = read_key(store_path)  # the registry shows fingerprints under the store's own key
    assert rows == {("t1", Namespace("t1", SALTS["t1"]).fingerprint(key)),
                    ("t2", Namespace("t2", SALTS["t2"]).fingerprint(key)), (None, None)}
    assert all(r["pages"] == 12 and r["tokens"] == 48 and r["bytes"] == 12 * 64 for r in doc["namespaces"])


def test_ns_ls_human_and_sorting(store_path):
    result = invoke("ns", "ls", "--store", store_path, "--sort", "extra_key")
    assert result.exit_code == 0 and result.output.index("t1") < result.output.index("t2")
    assert invoke("ns", "ls", "--store", store_path, "--sort", "salt").exit_code == 2


def test_ns_show_walks_the_prefix_tree(store_path):
    doc = json.loads(kvc("ns", "show", "t1", "--store", store_path, "--json", "--depth", "20",
                         salt=SALTS["t1"]).stdout)
    assert doc["namespace"]["extra_key"] == "t1" and doc["pages"] == 12
    node, depth = doc["roots"][0], 1
    assert node["tokens"] == [0, 1, 2, 3]
    while node["children"]:
        node, depth = node["children"][0], depth + 1
    assert depth == 12 and node["tokens"] == [0] * 4
    human = invoke("ns", "show", "t1", "--store", store_path, "--depth", "2", "-o", "table", salt=SALTS["t1"])
    assert human.exit_code == 0 and "0 1 2 3" in human.output and "4 5 6 7" in human.output
    tsv = invoke("ns", "show", "t1", "--store", store_path, "--depth", "2", salt=SALTS["t1"]).stdout.splitlines()
    assert tsv[0] == "depth\tpage_hash\thits\tbytes\ttokens" and tsv[1].endswith("\t0,1,2,3")


def test_ns_show_unknown_namespace_is_exit_2(store_path):
    out = kvc("ns", "show", "t1", "--store", store_path, salt="not-the-salt")
    assert out.returncode == 2 and out.stdout == "" and out.stderr.startswith("kvc: error: no namespace t1/")
    assert len(out.stderr.strip().splitlines()) == 1


def test_ns_drop_needs_yes_and_removes_exactly_one(store_path):
    refused = kvc("ns", "drop", "t2", "--store", store_path, salt=SALTS["t2"])
    assert refused.returncode == 2 and "--yes" in refused.stderr
    dropped = json.loads(invoke("ns", "drop", "t2", "--store", store_path, "--yes", "--json",
                                salt=SALTS["t2"]).stdout)
    assert dropped["store_pages"] == 12 and dropped["namespace"]["extra_key"] == "t2"
    left = json.loads(invoke("ns", "ls", "--store", store_path, "--json").stdout)["namespaces"]
    assert sorted((r["extra_key"] or "") for r in left) == ["", "t1"]
    assert invoke("audit", "--store", store_path).exit_code == 0


def test_stats_json_and_prometheus(store_path):
    doc = json.loads(invoke("stats", "--store", store_path, "--json").stdout)
    assert doc["pages"] == 36 and doc["namespaces"] == 3 and doc["layouts"] == 1
    prom = invoke("stats", "--store", store_path, "--prom").stdout
    assert "# TYPE kvc_store_pages gauge" in prom and 'kvc_store_pages{backend="lmdb",' in prom
    from prometheus_client.parser import text_string_to_metric_families

    values = {s.name: s.value for f in text_string_to_metric_families(prom) for s in f.samples}
    assert values["kvc_store_pages"] == 36


def test_store_audit_clean_is_exit_0_with_pinned_fields(store_path):
    out = kvc("audit", "--store", store_path, "--json")
    doc = json.loads(out.stdout)
    assert out.returncode == 0 and doc["ok"] is True and doc["violations"] == [] and doc["checked"]["pages"] == 36


def test_store_audit_finds_a_corrupted_page_and_repair_removes_it(store_path):
    import lmdb

    env = lmdb.open(store_path, max_dbs=16, subdir=True)
    pages = env.open_db(b"pages")
    with env.begin(write=True) as txn:
        key, value = next(iter(txn.cursor(pages)))
        txn.put(key, value[:-1] + bytes([value[-1] ^ 0xFF]), db=pages)
    env.close()
    found = kvc("audit", "--store", store_path, "--json")
    doc = json.loads(found.stdout)
    assert found.returncode == 1 and doc["ok"] is False
    assert "checksum_mismatch" in {v["kind"] for v in doc["violations"]}
    human = invoke("audit", "--store", store_path)
    assert human.exit_code == 1 and "checksum_mismatch" in human.stdout
    repaired = invoke("audit", "--store", store_path, "--repair", "--json")
    doc = json.loads(repaired.stdout)
    # exit 1: the store needed repairing (a cron job must hear of it), though nothing is left
    assert repaired.exit_code == 1 and not doc["ok"] and doc["remaining"] == [] and doc["repaired"] >= 1
    assert "checksum_mismatch" in {v["kind"] for v in doc["violations"]} and doc["removals"]
    assert doc["repair"] == "done" and doc["audits"] == ["l3_integrity"]
    assert invoke("audit", "--store", store_path).exit_code == 0


def test_snapshot_audit_clean_and_faulty(tmp_path):
    cache = make_cache(page_size=2)
    req = Request("a", range(9), Namespace("t1", SALTS["t1"]))
    forward(cache, req, cache.admit(req))
    cache.commit("a")
    cache.snapshot(tmp_path / "ok.snap")
    out = kvc("audit", "--snapshot", str(tmp_path / "ok.snap"), "--json")
    doc = json.loads(out.stdout)
    assert out.returncode == 0 and doc["ok"] and doc["source"] == "snapshot" and doc["checked"]["nodes"] == 2
    cache.device_pool.alloc(1, owner_code(OwnerKind.REQUEST, 77))  # a leaked slot
    cache.snapshot(tmp_path / "bad.snap")
    bad = invoke("audit", "--snapshot", str(tmp_path / "bad.snap"), "--json")
    assert bad.exit_code == 1 and [v["kind"] for v in json.loads(bad.stdout)["violations"]] == ["leak"]
    human = invoke("audit", "--snapshot", str(tmp_path / "bad.snap"))
    assert human.exit_code == 1 and "leak" in human.output and "request#77" in human.output


@pytest.mark.parametrize("case", ["missing_store", "regular_file", "truncated_snapshot", "newer_snapshot",
                                  "missing_snapshot"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, case):
    import msgspec

    cache = make_cache()
    cache.snapshot(tmp_path / "good.snap")
    data = (tmp_path / "good.snap").read_bytes()
    (tmp_path / "file").write_text("not a store")
    (tmp_path / "trunc.snap").write_bytes(data[: len(data) // 3])
    newer = msgspec.msgpack.decode(data)
    newer["version"] += 1
    (tmp_path / "newer.snap").write_bytes(msgspec.msgpack.encode(newer))
    args = {"missing_store": ["audit", "--store", str(tmp_path / "nowhere")],
            "regular_file": ["ns", "ls", "--store", str(tmp_path / "file")],
            "truncated_snapshot": ["audit", "--snapshot", str(tmp_path / "trunc.snap")],
            "newer_snapshot": ["audit", "--snapshot", str(tmp_path / "newer.snap")],
            "missing_snapshot": ["audit", "--snapshot", str(tmp_path / "none.snap")]}[case]
    out = kvc(*args)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("kvc: error: ") and len(out.stderr.strip().splitlines()) == 1
    assert "Traceback" not in out.stderr


def test_store_audit_finds_an_orphan_chain_and_repair_removes_only_it(store_path):
    from kvcache import open_store, page_origins
    from kvcache.types.keys import pack_tokens
    from lmdb_surgery import raw

    store = open_store(store_path, make_layout(4))
    # a chain whose parent page is lost later (put refuses a parent the store does not hold, so the loss is
    # made by hand, as a damaged disk would)
    ns = Namespace("t1", SALTS["t1"])
    top, top_origins = page_origins(store.layout, pack_tokens(range(600, 604)), ns, store.chain_key)
    store.put(top, [np.zeros(64, dtype=np.uint8)], top_origins)
    hashes, origins = page_origins(store.layout, pack_tokens(range(500, 512)), ns, store.chain_key, parent=top[0])
    store.put(hashes, [np.zeros(64, dtype=np.uint8)] * 3, origins)
    store.close()
    with raw(store_path) as r:
        r.drop(top[0])
    found = kvc("audit", "--store", store_path, "--json")
    doc = json.loads(found.stdout)
    assert found.returncode == 1 and [v["kind"] for v in doc["violations"]] == ["orphan"]
    assert doc["violations"][0]["page_hash"] == hashes[0].hex()
    repaired = invoke("audit", "--store", store_path, "--repair")
    assert repaired.exit_code == 1 and "removed by --repair (3)" in repaired.stdout  # found: exit 1, repaired
    assert "orphan (1)" in repaired.stdout and "0 violation(s) left" in repaired.stdout
    clean = kvc("audit", "--store", store_path, "--json")
    assert clean.returncode == 0 and json.loads(clean.stdout)["checked"]["pages"] == 36  # the valid pages stay
