"""Offboarding that sticks (issue 25, items 3, 6 and 7): real `kvc serve` processes under write-back on one LMDB
store, whose L1/L2 hold pages of a tenant that the store does not have yet. An offline drop of a tenant a live
cache holds is refused (naming its socket); a drop through one live cache reaches every other one; nothing is
written back afterwards, on `ns evict` or when the servers stop. The runbook uses it and fails loudly on a typo.

Each step waits for its answer (a command's exit), never for time. The servers are forked from a server that
imported kvc once (`forkrun`, the `engine_forks` fixture); the runbook, a shell script, runs the console script as
an operator's shell does."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from test_live import PROMPT, SALT, Server, as_json, invoke, make_store

import clirun
from redis_server import redis_server  # noqa: F401  (session fixture)

ROOT = Path(__file__).resolve().parents[2]
NEW_TAILS = 4  # requests of t1, each 4 new pages (16 tokens) past the 16 pages of PROMPT the store holds


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """test_live's store: t1 (salted, 21 pages) and t2."""
    return make_store(tmp_path_factory.mktemp("template") / "store")


def _write_back_server(forks, store: str, sock: Path) -> Server:
    return Server(forks, store, str(sock), "--write-policy", "write_back")


def _hold_unstored_pages_of_t1(sock: str, tmp_path: Path) -> int:
    """Replay requests of t1 through the live cache: under write-back their new pages stay in L1, not in the
    store. Returns the pages t1 holds in L1 and L2 afterwards."""
    trace = tmp_path / f"t1-{Path(sock).stem}.jsonl"
    with open(trace, "w") as f:
        for i in range(NEW_TAILS):
            f.write(json.dumps({"rid": f"r{i}", "tokens": PROMPT + [100 + i] * 16, "extra_key": "t1",
                                "cache_salt": SALT}) + "\n")
    as_json(invoke("--socket", sock, "replay", trace, "--json"))
    row = _live_rows(sock)["t1"]
    assert row["pages"] == 21  # the store was not written: write-back writes on eviction only
    return row["device"]["pages"] + row["host"]["pages"]


def _live_rows(sock: str) -> dict:
    return {r["extra_key"]: r for r in as_json(invoke("--socket", sock, "ns", "ls", "--json"))["namespaces"]}


def _store_rows(store: str) -> dict:
    return {r["extra_key"]: r for r in as_json(invoke("ns", "ls", "--store", store, "--json"))["namespaces"]}


def test_an_offline_drop_of_a_tenant_a_live_cache_holds_is_refused_and_one_through_it_sticks(tmp_path, template,
                                                                                            engine_forks):
    store = str(shutil.copytree(template, tmp_path / "store"))
    server = _write_back_server(engine_forks, store, tmp_path / "a.sock")
    try:
        sock = server.sock
        assert _hold_unstored_pages_of_t1(sock, tmp_path) > 16
        t1_id = _store_rows(store)["t1"]["id"]
        salt_file = tmp_path / "t1.salt"
        salt_file.write_text(SALT)
        salt_file.chmod(0o600)  # private, as a salt file must be: no warning line
        refused = invoke("ns", "drop", "--store", store, "t1", "--salt-file", salt_file, "--yes")
        assert refused.exit_code == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert f"held by a live cache serving this store ({sock})" in refused.stderr
        assert _store_rows(store)["t1"]["pages"] == 21  # nothing was dropped
        by_id = invoke("ns", "drop", "--store", store, "--id", t1_id, "--yes")
        assert by_id.exit_code == 2 and sock in by_id.stderr
        # a tenant the store has never seen, only the live cache (write-back): refused as well, not "not there"
        new = tmp_path / "t3.jsonl"
        new.write_text(json.dumps({"rid": "n", "tokens": PROMPT, "extra_key": "t3", "cache_salt": SALT}) + "\n")
        as_json(invoke("--socket", sock, "replay", new, "--json"))
        unstored = invoke("ns", "drop", "--store", store, "t3", "--salt-file", salt_file, "--yes", "--missing-ok")
        assert unstored.exit_code == 2 and sock in unstored.stderr and "t3" not in _store_rows(store)
        dry = as_json(invoke("ns", "drop", "--store", store, "--id", t1_id, "--dry-run", "--json"))
        assert dry["dry_run"] is True and dry["dropped"] is False and dry["store_pages"] == 21
        assert dry["live_caches"] == [sock] and dry["device_pages"] + dry["host_pages"] > 16

        doc = as_json(invoke("--socket", sock, "ns", "drop", "--id", t1_id, "--yes", "--json"))
        assert doc["dropped"] is True and doc["socket"] == sock and doc["store_pages"] == 21
        assert doc["device_pages"] + doc["host_pages"] > 16
        evicted = as_json(invoke("--socket", sock, "ns", "evict", "t1", "--salt", SALT, "--json"))
        assert evicted["device_pages"] == evicted["host_pages"] == 0
        assert "t1" not in _store_rows(store) and "t2" in _store_rows(store)
    finally:
        assert server.stop() == 0
    assert "t1" not in _store_rows(store)  # nothing written back when the cache stopped either
    assert as_json(invoke("audit", "--store", store, "--json"))["ok"] is True


def test_a_drop_through_one_live_cache_reaches_the_other_which_writes_nothing_back(tmp_path, template,
                                                                                  engine_forks):
    _two_caches_one_drop(str(shutil.copytree(template, tmp_path / "store")), tmp_path, engine_forks)


def test_a_drop_through_one_live_cache_reaches_the_other_on_a_redis_store(tmp_path, redis_server,  # noqa: F811
                                                                          engine_forks):
    _two_caches_one_drop(make_store(redis_server.store_url()), tmp_path, engine_forks)


def _two_caches_one_drop(store: str, tmp_path: Path, engine_forks) -> None:
    first = _write_back_server(engine_forks, store, tmp_path / "a.sock")
    second = _write_back_server(engine_forks, store, tmp_path / "b.sock")
    try:
        held = _hold_unstored_pages_of_t1(second.sock, tmp_path)  # the other cache holds t1's new pages
        assert held > 16
        doc = as_json(invoke("--socket", first.sock, "ns", "drop", "t1", "--salt", SALT, "--yes", "--json"))
        assert "t1" not in _store_rows(store)
        # the second cache let go of t1 too: evicting it (write-back: L1 -> L2 -> L3) has nothing to write
        evicted = as_json(invoke("--socket", second.sock, "ns", "evict", "t1", "--salt", SALT, "--json"))
        assert "t1" not in _store_rows(store) and "t1" not in _live_rows(second.sock)
        assert evicted["device_pages"] == evicted["host_pages"] == 0
        assert doc["dropped"] is True and doc["store_pages"] == 21
        assert doc["device_pages"] == doc["host_pages"] == 0  # the first cache held nothing of it
        # a new request of t1 after the drop is a new use: the second cache stores it again, as it should
        again = tmp_path / "again.jsonl"
        again.write_text(json.dumps({"rid": "n", "tokens": PROMPT, "extra_key": "t1", "cache_salt": SALT}) + "\n")
        as_json(invoke("--socket", second.sock, "replay", again, "--json"))
        as_json(invoke("--socket", second.sock, "ns", "evict", "t1", "--salt", SALT, "--json"))
        assert _store_rows(store)["t1"]["pages"] == 16
    finally:
        assert second.stop() == 0 and first.stop() == 0
    assert _store_rows(store)["t1"]["pages"] == 16  # only the new use: none of the dropped pages came back


def test_serving_records_are_kept_while_serving_removed_on_exit_and_stale_ones_ignored(tmp_path, template,
                                                                                      engine_forks):
    store = str(shutil.copytree(template, tmp_path / "store"))
    from kvcache.live.serves import live_serves
    from kvcache.storage.registry import open_store

    def records():
        st = open_store(store, readonly=True)
        try:
            return st.serves(), [s.record.socket for s in live_serves(st)]
        finally:
            st.close()

    server = _write_back_server(engine_forks, store, tmp_path / "a.sock")
    try:
        kept, live = records()
        assert [(r.pid, r.socket) for r in kept] == [(server.proc.pid, server.sock)] and live == [server.sock]
    finally:
        assert server.stop() == 0
    assert records() == ([], [])
    killed = _write_back_server(engine_forks, store, tmp_path / "b.sock")
    assert _hold_unstored_pages_of_t1(killed.sock, tmp_path) > 16
    killed.stop(9)  # SIGKILL: its record stays, stale
    kept, live = records()
    assert len(kept) == 1 and live == []
    doc = as_json(invoke("ns", "drop", "--store", store, "t1", "--salt", SALT, "--yes", "--json"))
    assert doc["dropped"] is True and doc["store_pages"] == 21  # a dead cache holds nothing: no refusal


def test_ns_evict_says_it_may_write_back_and_ns_drop_offers_a_dry_run():
    evict = invoke("ns", "evict", "--help")
    assert evict.exit_code == 0 and "written back first" in " ".join(evict.stdout.split())
    drop = invoke("ns", "drop", "--help")
    assert drop.exit_code == 0 and "--dry-run" in drop.stdout


def test_ns_drop_takes_exactly_16_hex_digits_for_an_id(tmp_path, template):
    store = str(shutil.copytree(template, tmp_path / "store"))
    for bad in ("zz", "zz;rm", "0123456789abcde", "0123456789abcdef0", "0123456789abcdeg", ""):
        result = invoke("ns", "drop", "--store", store, "--id", bad, "--yes", "--missing-ok")
        assert result.exit_code == 2 and result.stderr.count("\n") == 1, (bad, result.stderr)
        assert "exactly 16 hex digits" in result.stderr
    bad_fp = invoke("ns", "drop", "--store", store, "--fingerprint", "xyz", "t1", "--yes", "--missing-ok")
    assert bad_fp.exit_code == 2 and "12 hex digits" in bad_fp.stderr
    assert _store_rows(store)["t1"]["pages"] == 21


def _runbook(env: dict, **extra) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", str(ROOT / "examples" / "runbooks" / "offboard_tenant.sh")], capture_output=True,
                          text=True, timeout=180, env=dict(env, **extra))
    assert SALT not in proc.stdout + proc.stderr
    return proc


def test_the_runbook_fails_loudly_on_a_typo_and_goes_through_a_live_cache(tmp_path, template, engine_forks):
    store = str(shutil.copytree(template, tmp_path / "store"))
    env = dict(os.environ, PATH=f"{clirun.KVC.parent}{os.pathsep}{os.environ['PATH']}", KVC_STORE=store)
    env.pop("KVC_SOCKET", None)
    rows = _store_rows(store)
    typo = _runbook(env, NS_ID="zz;rm")
    assert typo.returncode == 2 and "verified" not in typo.stdout and "16 hex digits" in typo.stderr
    wrong = _runbook(env, TENANT="t1", FINGERPRINT="0" * 12)  # well formed, names nothing
    assert wrong.returncode == 1 and "verified" not in wrong.stdout and "no namespace t1/000000000000" in wrong.stderr
    assert _store_rows(store)["t1"]["pages"] == 21

    server = _write_back_server(engine_forks, store, tmp_path / "a.sock")
    try:
        assert _hold_unstored_pages_of_t1(server.sock, tmp_path) > 16
        held = _runbook(env, NS_ID=rows["t1"]["id"])
        assert held.returncode == 2 and server.sock in held.stderr and "verified" not in held.stdout
        through = _runbook(env, NS_ID=rows["t1"]["id"], KVC_SOCKET=server.sock)
        assert through.returncode == 0, through.stderr
        assert "verified: the namespace is no longer in the store nor in the live cache" in through.stdout
        as_json(invoke("--socket", server.sock, "ns", "evict", "t1", "--salt", SALT, "--json"))
    finally:
        assert server.stop() == 0
    again = _runbook(env, NS_ID=rows["t1"]["id"])
    assert again.returncode == 0 and "already offboarded" in again.stdout and "verified" in again.stdout
    assert "t1" not in _store_rows(store)
