"""The key file is part of the store (issue 26, item 3), through the CLI on a real LMDB store.

On fbee4ed: a missing `fingerprint.key` was replaced by a new key on the next write (read-only commands ran on a
random key: ids and fingerprints that matched nothing); a corrupt or empty one blocked every command but `audit`,
which said "ok"; one the store's owner could not read gave "internal error: AssertionError"; `audit` said nothing
of a key file group or other could read; there was no `kvc init --rekey`.
"""

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from clirun import KVC, in_process
from kvcache import Namespace
from read_only_user import NO_CAPS, read_only_store
from unit.storage.lmdb.test_migrate import set_format_version

SALT = "kf-salt-Qw3"
TOKENS = ",".join(map(str, range(1, 41)))
ENV = {k: v for k, v in os.environ.items() if k != "KVC_FINGERPRINT_KEY"}


def kvc(*args, caps=True, env=None):
    """kvc in this process (these tests check what it prints and its exit code), or, `caps=False`, in a process
    without the capabilities that let root read any file (what a key file's permissions do needs a process)."""
    if caps:
        return in_process(*args, env=env or ENV)
    return subprocess.run([*NO_CAPS, str(KVC), *map(str, args)], capture_output=True, text=True, timeout=120,
                          env=env or ENV)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A store of two namespaces (t1 salted, t2 not), 20 pages of 4 tokens, under its own key; made once."""
    s = tmp_path_factory.mktemp("keyed") / "store"
    assert kvc("init", "--store", s, "--page-size", 4).returncode == 0
    for args in (("--salt", SALT, "--extra-key", "t1"), ("--extra-key", "t2")):
        put = kvc("put", "--store", s, "--tokens", TOKENS, *args)
        assert put.returncode == 0, put.stderr
    return s


@pytest.fixture
def store(keyed, tmp_path):
    """This test's copy of the keyed store (its key file included)."""
    return Path(shutil.copytree(keyed, tmp_path / "store"))


def _commands(store):
    s = ("--store", store)
    return [("ns", "ls", *s), ("stats", *s), ("ns", "show", "t2", *s), ("put", *s, "--extra-key", "t3", "--tokens",
            TOKENS), ("ns", "drop", "--id", "0123456789abcdef", "--yes", *s), ("audit", *s), ("ns", "quota", "show", *s)]


def _refused_in_one_line(result, what):
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if not line.startswith("kvc: note: ")]  # lock-free
    assert len(lines) == 1 and lines[0].startswith("kvc: error: ") and what in lines[0], result.stderr
    assert "internal error" not in result.stderr


def test_a_missing_key_file_refuses_every_command_in_one_line_and_is_never_replaced(store):
    os.unlink(store / "fingerprint.key")
    for cmd in _commands(store):
        _refused_in_one_line(kvc(*cmd), "fingerprint key file is missing")
    assert not (store / "fingerprint.key").exists()
    doc = json.loads(kvc("audit", "--store", store, "--json").stdout)
    assert [v["kind"] for v in doc["violations"]] == ["key_file"] and not doc["ok"]


@pytest.mark.parametrize("content", [b"", b"not a key at all\n", b"ab" * 8 + b"\n"])
def test_an_empty_or_corrupt_key_file_refuses_every_command_audit_included(store, content):
    (store / "fingerprint.key").write_bytes(content)
    for cmd in _commands(store):
        _refused_in_one_line(kvc(*cmd), "fingerprint key file is")
    audit = kvc("audit", "--store", store, "--json")
    assert audit.returncode == 1
    assert [v["kind"] for v in json.loads(audit.stdout)["violations"]] == ["key_file"]
    assert (store / "fingerprint.key").read_bytes() == content  # left for its owner to restore


def test_a_key_file_its_owner_cannot_read_refuses_a_writer_in_one_line(store):
    os.chmod(store / "fingerprint.key", 0)
    try:
        put = kvc("put", "--store", store, "--extra-key", "t3", "--tokens", TOKENS, caps=False)
        _refused_in_one_line(put, "not readable by this user")
        audit = kvc("audit", "--store", store, "--json", caps=False)  # the owner: a broken store, said so
        assert [v["kind"] for v in json.loads(audit.stdout)["violations"]][:1] == ["key_file"]
    finally:
        os.chmod(store / "fingerprint.key", 0o600)


def test_a_monitoring_account_reads_what_the_registry_recorded_and_is_refused_only_where_the_key_is_needed(store):
    owner = json.loads(kvc("ns", "ls", "--store", store, "--json").stdout)["namespaces"]
    with read_only_store(store):
        ls = kvc("ns", "ls", "--store", store, "--json", caps=False)
        stats = kvc("stats", "--store", store, "--json", caps=False)
        audit = kvc("audit", "--store", store, "--json", caps=False)
        show = kvc("ns", "show", "t1", "--salt", SALT, "--store", store, "--json", caps=False)
        by_id = kvc("ns", "drop", "--id", owner[0]["id"], "--dry-run", "--store", store, caps=False)
    assert ls.returncode == stats.returncode == audit.returncode == show.returncode == 0, (ls.stderr, audit.stdout)
    rows = json.loads(ls.stdout)["namespaces"]
    assert [r["id"] for r in rows] == [None, None]  # nothing derived without the key
    assert [{k: v for k, v in r.items() if k != "id"} for r in rows] == \
        [{k: v for k, v in r.items() if k != "id"} for r in owner]  # what the registry recorded
    assert json.loads(audit.stdout)["ok"]
    assert json.loads(show.stdout)["namespace"]["salt_fingerprint"] == owner[[r["extra_key"] for r in owner].index(
        "t1")]["salt_fingerprint"]
    _refused_in_one_line(by_id, "not readable by this user")


def test_the_audit_flags_a_key_file_others_may_read_and_repair_makes_it_0600(store):
    os.chmod(store / "fingerprint.key", 0o644)
    audit = kvc("audit", "--store", store, "--json")
    assert audit.returncode == 1
    assert [v["kind"] for v in json.loads(audit.stdout)["violations"]] == ["key_mode"]
    assert kvc("audit", "--store", store, "--repair").returncode == 1  # found, then repaired
    assert stat.S_IMODE(os.stat(store / "fingerprint.key").st_mode) == 0o600
    assert kvc("audit", "--store", store).returncode == 0


@pytest.fixture
def format_1_store(tmp_path):
    """A store as a kvc before keyed chain roots wrote it (format 1): its pages outlive a new key."""
    s = tmp_path / "store1"
    assert kvc("init", "--store", s, "--page-size", 4).returncode == 0
    set_format_version(str(s), 1)
    for args in (("--salt", SALT, "--extra-key", "t1"), ("--extra-key", "t2")):
        put = kvc("put", "--store", s, "--tokens", TOKENS, *args)
        assert put.returncode == 0, put.stderr
    return s


def test_init_rekey_of_a_keyed_store_holding_pages_is_refused_without_yes_and_says_they_go(store):
    os.unlink(store / "fingerprint.key")
    refused = kvc("init", "--store", store, "--rekey")
    _refused_in_one_line(refused, "none of its 20 pages would be found again")
    assert not (store / "fingerprint.key").exists()
    rekey = kvc("init", "--store", store, "--rekey", "--yes")
    assert rekey.returncode == 0, rekey.stderr
    assert "20 stored pages were hashed under the old key" in rekey.stdout and "kvc audit --repair" in rekey.stdout
    # until the pages hashed under the old key go, the registry names its roots: the new key reads as another
    # store's (exit 4), a plain repair removes nothing for it, and the forced one (the key replaced on purpose) does
    audit = kvc("audit", "--store", store, "--json")
    assert audit.returncode == 4 and [v["kind"] for v in json.loads(audit.stdout)["violations"]] == ["key_mismatch"]
    _refused_in_one_line(kvc("audit", "--store", store, "--repair"), "nothing was changed")
    assert kvc("audit", "--store", store, "--repair", "--force").returncode == 1
    assert kvc("audit", "--store", store).returncode == 0
    assert json.loads(kvc("stats", "--store", store, "--json").stdout)["pages"] == 0


def test_init_rekey_makes_a_new_key_says_what_changes_and_listed_ids_then_work(format_1_store):
    store = format_1_store
    before = {r["extra_key"]: r for r in json.loads(kvc("ns", "ls", "--store", store, "--json").stdout)["namespaces"]}
    os.unlink(store / "fingerprint.key")
    rekey = kvc("init", "--store", store, "--rekey")
    assert rekey.returncode == 0, rekey.stderr
    assert "the key file was missing" in rekey.stdout and "display id of each of the 2 namespace(s)" in rekey.stdout
    assert "1 salted namespace(s) show fingerprint '?'" in rekey.stdout
    assert stat.S_IMODE(os.stat(store / "fingerprint.key").st_mode) == 0o600
    after = {r["extra_key"]: r for r in json.loads(kvc("ns", "ls", "--store", store, "--json").stdout)["namespaces"]}
    assert after["t1"]["id"] != before["t1"]["id"] and after["t1"]["salt_fingerprint"] == "?"
    assert after["t2"]["salt_fingerprint"] is None
    drop = kvc("ns", "drop", "--id", after["t2"]["id"], "--yes", "--store", store, "--json")
    assert drop.returncode == 0 and json.loads(drop.stdout)["dropped"], drop.stderr
    put = kvc("put", "--store", store, "--extra-key", "t1", "--salt", SALT, "--tokens", "900,901,902,903")
    assert put.returncode == 0, put.stderr
    fp = json.loads(kvc("ns", "ls", "--store", store, "--json").stdout)["namespaces"][0]["salt_fingerprint"]
    key = bytes.fromhex((store / "fingerprint.key").read_text())
    assert fp == Namespace("t1", SALT).fingerprint(key)  # re-recorded under the new key by its next write
