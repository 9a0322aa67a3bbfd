"""`kvc ns quota set|show|clear` and the shares in `kvc ns ls`, offline on an LMDB store and live on a cache
serving its admin socket (in process: CliRunner and an AdminServer with an owner thread), with the CLI's error
contract. The salt never appears in what kvc prints."""

from __future__ import annotations

import json

import pytest

from clirun import salted
from factories import l3_cache, make_layout, make_store
from kvcache import AdminServer, Namespace, Request
from kvcache.types.shares import Shares

SALT = "quota-salt-plokij-42"
T1 = Namespace("t1", SALT)


def invoke(*args, code=0):
    return salted(*args, salt=SALT, code=code)


def doc(*args):
    return json.loads(invoke(*args, "--json").stdout)


@pytest.fixture
def store_path(tmp_path):
    store = make_store(tmp_path / "store", make_layout(4))
    store.close()
    return str(tmp_path / "store")


def test_offline_set_show_ls_and_clear(store_path):
    row = doc("ns", "quota", "set", "--store", store_path, "--extra-key", "t1", "--device-tokens", 256,
              "--host-tokens", 512, "--store-bytes", 1 << 20)
    assert row["shares"] == {"device_tokens": 256, "host_tokens": 512, "store_bytes": 1 << 20}
    assert row["extra_key"] == "t1" and row["salt_fingerprint"] and row["used_device_tokens"] is None
    invoke("ns", "quota", "set", "--store", store_path, "--extra-key", "t2", "--store-bytes", 4096)
    listing = doc("ns", "quota", "show", "--store", store_path)
    assert not listing["live"] and {r["extra_key"]: r["shares"] for r in listing["namespaces"]} == {
        "t1": {"device_tokens": 256, "host_tokens": 512, "store_bytes": 1 << 20}, "t2": {"store_bytes": 4096}}
    tsv = invoke("ns", "quota", "show", "--store", store_path, "-o", "tsv").stdout.splitlines()
    assert tsv[0].split("\t")[3:] == ["L1 share", "L1 used", "L2 share", "L2 used", "L3 share", "L3 used"]
    assert doc("ns", "quota", "clear", "--store", store_path, "--extra-key", "t2")["shares"] == {}
    assert [r["extra_key"] for r in doc("ns", "quota", "show", "--store", store_path)["namespaces"]] == ["t1"]
    assert doc("ns", "ls", "--store", store_path)["namespaces"] == []  # shares alone are no pages


def test_quota_errors_follow_the_cli_contract(store_path):
    result = invoke("ns", "quota", "set", "--store", store_path, "--extra-key", "t1", code=2)
    assert result.stderr.count("\n") == 1 and "--device-tokens" in result.stderr and not result.stdout
    error = json.loads(invoke("ns", "quota", "set", "--store", store_path, "--extra-key", "t1",
                              "--host-tokens", "-3", "--json", code=2).stdout)["error"]
    assert error["kind"] == "usage" and "--host-tokens" in error["message"]
    invoke("ns", "quota", "show", "--store", store_path + "-missing", code=2)


def test_live_set_applies_now_writes_the_store_and_shows_use(store_path):
    from kvcache.storage.registry import open_store

    store = open_store(store_path, make_layout(4))
    cache = l3_cache(store, device_tokens=256, host_tokens=256)
    cache.admit(Request("r1", list(range(32)), T1))
    cache.commit("r1")
    sock = str(store_path) + ".sock"
    server = AdminServer(cache, sock).start_owner_thread()
    try:
        row = doc("--socket", sock, "ns", "quota", "set", "--extra-key", "t1", "--device-tokens", 64)
        assert row["shares"] == {"device_tokens": 64} and row["used_device_tokens"] == 32
        listing = doc("--socket", sock, "ns", "quota", "show")
        assert listing["live"] and [(r["extra_key"], r["used_device_tokens"]) for r in listing["namespaces"]] == [
            ("t1", 32)]
        ls = {r["extra_key"]: r for r in doc("--socket", sock, "ns", "ls")["namespaces"]}
        assert ls["t1"]["shares"] == {"device_tokens": 64} and ls["t1"]["device"]["tokens"] == 32
        table = invoke("--socket", sock, "ns", "ls", "-o", "tsv").stdout
        assert "64/-/-" in table
        assert doc("--socket", sock, "ns", "quota", "clear", "--extra-key", "t1")["shares"] == {}
    finally:
        server.close()
    assert cache.tree.share_of(T1.id) is None and [r.shares for r in store.shares()] == []
    cache.set_shares(T1, Shares(host_tokens=8))  # the library call writes through as the socket's did
    assert [r.shares for r in store.shares()] == [Shares(host_tokens=8)]
    cache.close()
    store.close()


def test_clearing_shares_a_namespace_does_not_have_says_so_and_exits_1(store_path):
    """Issue 25 #10: `ns quota clear` on a namespace without shares said "cleared" and exited 0 (a typo in the
    extra_key or the salt went unnoticed). Offline and live: nothing to clear is exit 1, `changed` false."""
    from kvcache.storage.registry import open_store

    nothing = doc_code(1, "ns", "quota", "clear", "--store", store_path, "--extra-key", "t9")
    assert nothing["changed"] is False and nothing["previous"] is None and nothing["shares"] == {}
    human = invoke("ns", "quota", "clear", "--store", store_path, "--extra-key", "t9", code=1)
    assert "nothing to clear" in human.stdout and "cleared" not in human.stdout
    invoke("ns", "quota", "set", "--store", store_path, "--extra-key", "t1", "--host-tokens", 64)
    cleared = doc("ns", "quota", "clear", "--store", store_path, "--extra-key", "t1")
    assert cleared["changed"] is True and cleared["previous"] == {"host_tokens": 64}
    doc_code(1, "ns", "quota", "clear", "--store", store_path, "--extra-key", "t1")  # the second time: nothing
    store = open_store(store_path, make_layout(4))
    cache = l3_cache(store, device_tokens=256, host_tokens=256)
    sock = str(store_path) + ".sock"
    server = AdminServer(cache, sock).start_owner_thread()
    try:
        live = doc_code(1, "--socket", sock, "ns", "quota", "clear", "--extra-key", "t9")
        assert live["changed"] is False and live["previous"] is None
        doc("--socket", sock, "ns", "quota", "set", "--extra-key", "t1", "--device-tokens", 32)
        assert doc("--socket", sock, "ns", "quota", "clear", "--extra-key", "t1")["previous"] == {"device_tokens": 32}
    finally:
        server.close()
    assert store.shares() == []
    cache.close()
    store.close()


def doc_code(code, *args):
    return json.loads(invoke(*args, "--json", code=code).stdout)
