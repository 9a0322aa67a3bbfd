"""Read-only monitoring: a user who can read a store but not write its lock.mdb (nor anything in its directory)
gets the results the store's owner gets from `audit`, `ns ls`, `ns show`, `ns quota show` and `stats`, told in one
line that the store was read lock-free; `--read-only` writes nothing to the store's directory.

f3c3857 answered that user's audit of a healthy store with `structure_corrupt ... LMDB's B-tree is damaged`
(exit 1), and its `ns ls` and `stats` with "the location is read-only" (exit 2).
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from clirun import KVC, in_process
from kvcache.storage.lmdb.env import ENVS
from read_only_user import NO_CAPS, files_and_mtimes, read_only_store

ROOT = Path(__file__).resolve().parents[2]
TOKENS = ",".join(map(str, range(1, 50)))
NOTE = "read lock-free and read-only (this user cannot write its lock.mdb)"


def kvc(*args, env=None):
    """kvc run by the store's owner, in this process (what it prints, its exit code, the files it leaves)."""
    return in_process(*args, env=env)


def as_monitor(*args, env=None):
    """kvc run as a user who may only read the store (see read_only_user): a process of its own, without the
    capabilities that let root write anything."""
    return subprocess.run([*NO_CAPS, str(KVC), *map(str, args)], capture_output=True, text=True, timeout=120,
                          env=env)


@pytest.fixture(scope="module")
def owners_store(tmp_path_factory):
    """A store with two tenants, made by its owner in this process, once: each test reads or changes a copy."""
    s = tmp_path_factory.mktemp("owner") / "store"
    assert in_process("init", "--store", s).returncode == 0
    for tenant in ("t1", "t2"):
        put = in_process("put", "--store", s, "--extra-key", tenant, "--tokens", TOKENS,
                         env=dict(os.environ, KVC_SALT="s"))
        assert put.returncode == 0, put.stderr
    return s


@pytest.fixture
def store(owners_store, tmp_path):
    """This test's copy of the owner's store."""
    return Path(shutil.copytree(owners_store, tmp_path / "store"))


def test_the_audit_of_a_healthy_store_read_by_a_monitoring_account_is_clean(store):
    owner = json.loads(kvc("audit", "--store", store, "--json").stdout)
    with read_only_store(store):
        result = as_monitor("audit", "--store", store, "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["ok"] and doc["violations"] == [] and "structure_corrupt" not in result.stdout + result.stderr
    assert doc["checked"] == owner["checked"] and doc["checked"]["pages"] == 6
    assert result.stderr.splitlines() == [f"kvc: note: {store}: {NOTE}; nothing is written to the store, and a read "
                                          f"that writers overtake is run again"]


def test_ns_ls_ns_show_and_stats_give_a_monitoring_account_their_normal_results(store):
    def figures(run):
        ls = json.loads(run("ns", "ls", "--store", store, "--json").stdout)["namespaces"]
        stats = json.loads(run("stats", "--store", store, "--json").stdout)
        show = run("ns", "show", "t1", "--store", store, "-o", "tsv", env=dict(os.environ, KVC_SALT="s"))
        # the id column is keyed by fingerprint.key, which a monitoring account may not read (README)
        return ([{k: v for k, v in r.items() if k != "id"} for r in ls], stats, show.stdout)

    owner = figures(kvc)
    with read_only_store(store):
        monitor = figures(as_monitor)
        errors = [as_monitor(*cmd, "--store", store).stderr for cmd in (("ns", "ls"), ("stats",))]
    assert monitor == owner
    assert [r["pages"] for r in monitor[0]] == [3, 3] and monitor[1]["pages"] == 6
    assert monitor[2].count("\n") == 4  # header + the 3 pages of t1's chain
    assert all(NOTE in e and len(e.splitlines()) == 1 for e in errors), errors


@pytest.mark.parametrize("command", [("audit",), ("ns", "ls"), ("ns", "show", "t1"), ("stats",),
                                     ("ns", "quota", "show")])
def test_read_only_writes_nothing_to_the_store_directory(store, command):
    os.unlink(store / "lock.mdb")  # a locked open creates it: a write even a file listing sees
    before = files_and_mtimes(store)
    # --read-only runs in this process: it holds no environment of the store between commands, so the command
    # opens the store afresh, as a process of its own would (the first open in a process decides its locking)
    assert os.path.realpath(store) not in ENVS
    result = kvc(*command, "--read-only", "--store", store, env=dict(os.environ, KVC_SALT="s"))
    assert result.returncode == 0, result.stderr
    assert files_and_mtimes(store) == before
    assert result.stderr.splitlines() == [f"kvc: note: {store}: read lock-free and read-only (--read-only); nothing "
                                          f"is written to the store, and a read that writers overtake is run again"]
    # and with the lock file there, it is not touched either
    assert kvc("stats", "--store", store).returncode == 0
    before = files_and_mtimes(store)
    assert "lock.mdb" in before and os.path.realpath(store) not in ENVS
    assert kvc(*command, "--read-only", "--store", store, env=dict(os.environ, KVC_SALT="s")).returncode == 0
    assert files_and_mtimes(store) == before


def test_a_permission_problem_is_never_reported_as_damage(store):
    os.chmod(store / "data.mdb", 0)
    try:
        for args in (("audit",), ("audit", "--read-only")):
            result = as_monitor(*args, "--store", store, "--json")
            assert result.returncode == 2, result.stderr
            assert json.loads(result.stdout)["error"]["kind"] == "store_access_denied"
            assert "structure_corrupt" not in result.stdout and "damaged" not in result.stdout
            assert "permission denied" in result.stderr
    finally:
        os.chmod(store / "data.mdb", 0o644)


def test_read_only_cannot_go_with_repair(store):
    result = kvc("audit", "--store", store, "--repair", "--read-only")
    assert result.returncode == 2 and "--read-only cannot go with --repair" in result.stderr


def test_the_nightly_audit_runbook_run_as_a_monitoring_account_raises_no_false_alert(store, tmp_path):
    env = dict(os.environ, PATH=f"{KVC.parent}{os.pathsep}{os.environ['PATH']}", KVC_STORE=str(store),
               KVC_AUDIT_LOCK=str(tmp_path / "audit.lock"))
    with read_only_store(store):
        run = subprocess.run([*NO_CAPS, "bash", str(ROOT / "examples" / "runbooks" / "nightly_audit.sh")],
                             capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("nightly_audit: ok (6 pages checked; l3_integrity audit; read lock-free")
    assert "ALERT" not in run.stdout + run.stderr
