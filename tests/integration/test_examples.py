"""The examples in examples/ run and say what the README says they say."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_library_quickstart():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "library_quickstart.py")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("a1 (tenant-a/") and "0 cached tokens" in lines[0]
    assert "32 cached tokens" in lines[1]  # a2 shares tenant a's system prompt
    assert "0 cached tokens" in lines[2]  # b1: same tokens, other tenant: nothing shared
    assert lines[-1].startswith("audit ok=True")
    assert "secret" not in out.stdout


import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402

import pytest  # noqa: E402

import clirun  # noqa: E402

KVC_BIN = Path(sys.executable).parent
SALTS = ("t1-example-salt", "t2-example-salt", "acme-salt", "globex-salt")


def _run(cmd, env=None, **kw):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=180, env=env, **kw)
    for salt in SALTS:
        assert salt not in proc.stdout + proc.stderr
    return proc


def test_embed_scheduler_hits_l3_on_its_second_run(tmp_path):
    script = ROOT / "examples" / "embed_scheduler.py"
    first = _run([sys.executable, script, tmp_path / "store"])
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert lines[0].startswith("acme-0") and lines[0].endswith("0 from L3")
    assert "80 from L1" in lines[2]  # acme's next turn extends its first: served from L1
    assert "0 from L1" in lines[1]  # globex: the same token ids, another namespace: nothing shared
    assert lines[-1].startswith("verified") and "0 mismatches; audit ok=True" in lines[-1]
    second = _run([sys.executable, script, tmp_path / "store"])
    assert second.returncode == 0, second.stderr
    assert second.stdout.splitlines()[0].endswith("80 from L3")  # a new process: the prefix comes from L3
    assert "0 mismatches; audit ok=True" in second.stdout


def _in_process(*args, env):
    """kvc `args` in this process (what the tests' own set-up and checks run: no process start per command)."""
    ran = clirun.in_process(*args, env=env)
    for salt in SALTS:
        assert salt not in ran.stdout + ran.stderr
    return ran


@pytest.fixture(scope="module")
def runbook_store(tmp_path_factory):
    """A store holding the sample trace's pages, made once for the module (in this process: the runbooks, not
    its set-up, are what runs as a user would); each test gets its own copy (`runbook_env`)."""
    store = tmp_path_factory.mktemp("runbook") / "store"
    env = dict(os.environ, KVC_STORE=str(store))
    assert _in_process("init", env=env).returncode == 0
    replay = _in_process("replay", ROOT / "examples" / "traces" / "two_tenants.jsonl", "--verify", "--batch", "1",
                         "--json", env=env)
    assert replay.returncode == 0, replay.stderr
    doc = json.loads(replay.stdout)
    assert doc["requests"] == 6 and doc["verify_mismatches"] == 0
    # the sample trace: t1 and t2 send the same token ids; only t1's second turn and t2's reuse their own prefix
    hits = {n["namespace"]["extra_key"]: sum(n["hit_tokens"].values()) for n in doc["namespaces"]}
    assert hits == {"t1": 32 + 32, "t2": 32, None: 0}
    return store


@pytest.fixture
def runbook_env(runbook_store, tmp_path):
    """A copy of the module's store, and the environment a runbook runs in."""
    store = shutil.copytree(runbook_store, tmp_path / "store")
    return dict(os.environ, PATH=f"{KVC_BIN}{os.pathsep}{os.environ['PATH']}", KVC_STORE=str(store))


def _runbook(name, env, *args, **extra):
    return _run(["bash", ROOT / "examples" / "runbooks" / name, *args], env=dict(env, **extra))


def test_warm_tenant_runbook(runbook_env, tmp_path):
    ok = _runbook("warm_tenant.sh", runbook_env, TENANT="t1", KVC_SALT="t1-example-salt")
    assert ok.returncode == 0, ok.stderr
    # 2 system-prompt pages + 1 of the second turn
    assert "tenant t1" in ok.stdout and "3 pages, 48 tokens" in ok.stdout
    assert "visible to every local user" not in ok.stderr  # the runbook never puts the salt on a command line
    salt_file = tmp_path / "t1.salt"
    salt_file.write_text("t1-example-salt\n")
    budget = _runbook("warm_tenant.sh", runbook_env, "2", TENANT="t1", KVC_SALT_FILE=str(salt_file))
    assert budget.returncode == 0 and "2 pages, 32 tokens" in budget.stdout
    wrong = _runbook("warm_tenant.sh", runbook_env, TENANT="t1", KVC_SALT="not-the-salt")
    assert wrong.returncode == 3 and "nothing stored for tenant t1" in wrong.stderr
    broken = _runbook("warm_tenant.sh", dict(runbook_env, KVC_STORE="/nonexistent/store"), TENANT="t1")
    assert broken.returncode == 2 and "kvc: error:" in broken.stderr


def test_runbooks_never_put_a_salt_on_a_command_line():
    for script in (ROOT / "examples" / "runbooks").glob("*.sh"):
        assert "--salt \"" not in script.read_text() and "--salt $" not in script.read_text(), script.name


def test_nightly_audit_runbook_alerts_on_every_failure(runbook_env, tmp_path):
    env = dict(runbook_env, KVC_AUDIT_LOCK=str(tmp_path / "audit.lock"))
    clean = _runbook("nightly_audit.sh", env)
    assert clean.returncode == 0 and clean.stdout.startswith("nightly_audit: ok (") and "l3_integrity" in clean.stdout
    import lmdb

    store = lmdb.open(runbook_env["KVC_STORE"], max_dbs=16, subdir=True)
    pages = store.open_db(b"pages")
    with store.begin(write=True) as txn:
        key, value = next(iter(txn.cursor(pages)))
        txn.put(key, value[:-1] + bytes([value[-1] ^ 0xFF]), db=pages)
    store.close()
    alert = _runbook("nightly_audit.sh", env)
    assert alert.returncode == 1
    assert "ALERT kvc store audit: 1 x checksum_mismatch" in alert.stderr
    # the report: exit 2 (no store) alerted nothing, so a cron job failed silently
    missing = _runbook("nightly_audit.sh", dict(env, KVC_STORE="/nonexistent/store"))
    assert missing.returncode == 2 and "ALERT kvc nightly audit: kvc audit could not run (exit 2)" in missing.stderr
    assert "/nonexistent/store: no store here" in missing.stderr


def test_nightly_audit_runs_never_overlap(runbook_env, tmp_path):
    import fcntl

    lock = tmp_path / "audit.lock"
    with open(lock, "w") as held:  # another run holds the lock
        fcntl.flock(held, fcntl.LOCK_EX)
        busy = _runbook("nightly_audit.sh", runbook_env, KVC_AUDIT_LOCK=str(lock))
    assert busy.returncode == 75 and "another run holds" in busy.stderr
    assert _runbook("nightly_audit.sh", runbook_env, KVC_AUDIT_LOCK=str(lock)).returncode == 0


def _ns_rows(env):
    listing = _in_process("ns", "ls", "--json", env=env)
    assert listing.returncode == 0, listing.stderr
    return {r["extra_key"]: r for r in json.loads(listing.stdout)["namespaces"]}


def test_offboard_tenant_runbook_needs_no_salt_and_is_idempotent(runbook_env):
    ns_id = _ns_rows(runbook_env)["t1"]["id"]
    gone = _runbook("offboard_tenant.sh", runbook_env, NS_ID=ns_id)
    assert gone.returncode == 0, gone.stderr
    assert f"dropped 3 pages of namespace {ns_id}" in gone.stdout and "verified" in gone.stdout
    again = _runbook("offboard_tenant.sh", runbook_env, NS_ID=ns_id)  # the report: a second run failed
    assert again.returncode == 0 and "already offboarded" in again.stdout and "verified" in again.stdout
    still = _runbook("warm_tenant.sh", runbook_env, TENANT="t2", KVC_SALT="t2-example-salt")
    assert still.returncode == 0 and "3 pages" in still.stdout  # the other tenant, same token ids, untouched
    assert "t1" not in _ns_rows(runbook_env)


def test_offboard_tenant_by_extra_key_and_fingerprint(runbook_env):
    fingerprint = _ns_rows(runbook_env)["t2"]["salt_fingerprint"]
    gone = _runbook("offboard_tenant.sh", runbook_env, TENANT="t2", FINGERPRINT=fingerprint)
    assert gone.returncode == 0 and "dropped 3 pages" in gone.stdout, gone.stderr
    assert set(_ns_rows(runbook_env)) == {"t1", None}
