"""`kvc migrate` and the format-1 note (issue 26, item 1): a format-1 store is read and written as before, and a
command that opens it for writing or audits it says in one line on stderr that `kvc migrate` upgrades it; `kvc
migrate` rewrites it (every page hash changes) and the note is gone; bad input is one line, exit 2.

kvc runs in this process (what it prints and its exit code are what is checked); the engine that holds a store
open while `kvc migrate` is refused is a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import clirun
from unit.storage.lmdb.test_migrate import set_format_version

TOKENS = ",".join(map(str, range(1, 50)))
SALT = dict(os.environ, KVC_SALT="abc")


def kvc(*args, env=None):
    """kvc in this process; `env` its whole environment (None: this process's)."""
    return clirun.in_process(*args, env=env)


def _format_1_store(tmp_path: Path) -> Path:
    store = tmp_path / "store"
    assert kvc("init", "--store", store).returncode == 0
    set_format_version(str(store), 1)  # before any page: the store kvc wrote before keyed roots
    put = kvc("put", "--store", store, "--extra-key", "t1", "--tokens", TOKENS, env=SALT)
    assert put.returncode == 0, put.stderr
    return store


def _note(store: Path) -> str:
    return (f"kvc: note: {store}: store format 1, whose page hashes are not keyed by the store's secret (a short "
            f"salt can be guessed from them); `kvc migrate --store {store}` upgrades it")


def test_a_format_1_store_works_and_says_kvc_migrate_upgrades_it(tmp_path):
    store = _format_1_store(tmp_path)
    put = kvc("put", "--store", store, "--extra-key", "t2", "--tokens", TOKENS, "--json", env=SALT)
    assert put.returncode == 0 and put.stderr.splitlines() == [_note(store)]
    audit = kvc("audit", "--store", store, "--json")
    assert audit.returncode == 0 and json.loads(audit.stdout)["ok"]
    assert audit.stderr.splitlines() == [_note(store)]
    stats = kvc("stats", "--store", store, "--json")  # a read: no note
    assert stats.returncode == 0 and stats.stderr == "" and json.loads(stats.stdout)["format_version"] == 1
    before = json.loads(kvc("ns", "show", "t1", "--store", store, "--json", env=SALT).stdout)

    migrated = kvc("migrate", "--store", store, "--json")
    assert migrated.returncode == 0, migrated.stderr
    doc = json.loads(migrated.stdout)
    assert doc["migrated"] and (doc["from_version"], doc["to_version"]) == (1, 2) and doc["pages"] == 6
    after = json.loads(kvc("ns", "show", "t1", "--store", store, "--json", env=SALT).stdout)
    assert after["pages"] == before["pages"] == 3
    assert after["roots"][0]["tokens"] == before["roots"][0]["tokens"]
    assert after["roots"][0]["page_hash"] != before["roots"][0]["page_hash"]  # the hashes changed
    for cmd in (("audit",), ("put", "--extra-key", "t3", "--tokens", TOKENS)):
        again = kvc(*cmd, "--store", store, env=SALT)
        assert again.returncode == 0 and "kvc migrate" not in again.stderr, again.stderr
    assert json.loads(kvc("stats", "--store", store, "--json").stdout)["format_version"] == 2
    done = kvc("migrate", "--store", store)
    assert done.returncode == 0 and "nothing to do" in done.stdout


def test_migrate_refuses_in_one_line(tmp_path):
    missing = kvc("migrate", "--store", tmp_path / "nowhere")
    assert missing.returncode == 2 and len(missing.stderr.splitlines()) == 1 and "no store here" in missing.stderr
    redis = kvc("migrate", "--store", "redis://127.0.0.1:1/0")
    assert redis.returncode == 2 and len(redis.stderr.splitlines()) == 1 and "LMDB stores only" in redis.stderr
    store = _format_1_store(tmp_path)
    os.unlink(store / "data.mdb")
    (store / "data.mdb").write_bytes(b"\0" * 8192)  # not a store any more
    broken = kvc("migrate", "--store", store)
    assert broken.returncode == 2 and len(broken.stderr.splitlines()) == 1, broken.stderr
    assert "internal error" not in broken.stderr and "`kvc audit`" in broken.stderr


HOLDER = """
import sys
from kvcache.storage.registry import open_store
store = open_store(sys.argv[1])
print("holding", flush=True)
sys.stdin.read()  # until the test closes our stdin
store.close()
"""


def test_migrate_while_an_engine_holds_the_store_says_to_stop_it_or_wait(tmp_path):
    # ebaf189: refused, but the message told the user to rerun `kvc audit --repair`
    store = _format_1_store(tmp_path)
    with subprocess.Popen([sys.executable, "-c", HOLDER, str(store)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as engine:
        assert engine.stdout.readline() == "holding\n"  # the store is open in another process: an engine
        refused = kvc("migrate", "--store", store)
        engine.stdin.close()
        assert engine.wait(timeout=60) == 0
    assert refused.returncode == 2 and len(refused.stderr.splitlines()) == 1, refused.stderr
    line = refused.stderr
    assert "open in another process" in line and "stop it, or wait for it to finish" in line, line
    assert "`kvc migrate`" in line and "audit --repair" not in line and "nothing was changed" in line, line
    done = kvc("migrate", "--store", store, "--json")  # the engine gone: it goes through
    assert done.returncode == 0 and json.loads(done.stdout)["migrated"], done.stderr
