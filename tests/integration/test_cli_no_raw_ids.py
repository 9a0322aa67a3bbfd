"""One key per store (issue 26, item 2): every command, offline on a real LMDB store and live against `kvc serve`,
in each of its output forms (text, --json, -o tsv), prints no raw namespace id and no salt; the fingerprints a
message shows are the store's (never a random per-process key's); a live replay lists each tenant once.

On fbee4ed: an audit's `unknown_namespace` detail printed the raw id; `ns drop` of an absent namespace and
`ns expire` without --yes printed fingerprints under a random key (a new value each run); the live replay table
listed every tenant twice (client and server keys), with a negative "refused".

`kvc serve` is a process of its own forked from a server that imported kvc and torch once (`forkrun`, the
`engine_forks` fixture); the `in_processes` runs start the console script each: a key drawn per process differs
only between two real starts."""

import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import NamedTuple

import lmdb
import pytest
from typer.testing import CliRunner

import clirun
import forkrun
from kvc.main import app
from kvcache import Namespace, WorkloadSpec, generate, write_trace
from kvcache.storage.keyfile import read_key
from kvcache.types.namespace import display_id

KVC = clirun.KVC
SALT = "zqxv-Salt-77"
TOKENS = ",".join(map(str, range(1, 41)))  # 10 pages of 4
T1, T2, ABSENT = Namespace("t1", SALT), Namespace("t2"), Namespace("t9", SALT)
RAW_IDS = [ns.id_hex for ns in (T1, T2, ABSENT)]
ENV = dict(os.environ, KVC_SALT=SALT)


def _leaks(text: str) -> list[str]:
    """The secrets in `text`: the salt, any raw namespace id (whole, or 12 hex digits of it anywhere)."""
    low = text.lower()
    found = [SALT] if SALT.lower() in low else []
    for raw in RAW_IDS:
        if any(raw[i:i + 12] in low for i in range(0, len(raw) - 11)):
            found.append(raw)
    return found


class Ran(NamedTuple):
    """What one kvc run printed and its exit code."""

    stdout: str
    stderr: str
    returncode: int


class Runs:
    """Every kvc run of a test, and what each printed. In this process (typer's runner: what is printed is what
    these tests check), or `in_processes` (a new kvc process each: what differs between two runs of it, such as a
    key drawn per process, shows only there)."""

    def __init__(self, in_processes: bool = False) -> None:
        self.outputs: list[tuple[list[str], str]] = []
        self.in_processes = in_processes

    def __call__(self, *args, code=None, stdin=None):
        args = [str(a) for a in args]
        if self.in_processes:
            proc = subprocess.run([str(KVC), *args], capture_output=True, text=True, timeout=300, env=ENV,
                                  input=stdin)
            ran = Ran(proc.stdout, proc.stderr, proc.returncode)
        else:
            result = CliRunner().invoke(app, args, env={"KVC_SALT": SALT}, input=stdin)
            ran = Ran(result.stdout, result.stderr, result.exit_code)
        self.outputs.append((args, ran.stdout + ran.stderr))
        if code is not None:
            assert ran.returncode == code, (args, ran.stdout, ran.stderr)
        return ran

    def forms(self, *args, code=0, tsv=False):
        """The command as text, --json and (`tsv`) -o tsv."""
        for extra in ([], ["--json"], *([["-o", "tsv"]] if tsv else [])):
            self(*args, *extra, code=code)

    def assert_no_leaks(self) -> None:
        leaks = [(args, found) for args, text in self.outputs if (found := _leaks(text))]
        assert not leaks, leaks


def _store(path: Path, run: Runs) -> Path:
    run("init", "--store", path, "--page-size", 4, code=0)
    run("put", "--store", path, "--extra-key", "t1", "--tokens", TOKENS, code=0)
    run("put", "--store", path, "--extra-key", "t2", "--tokens", TOKENS, "--salt", "", code=0)
    return path


def _unregister(store: Path, ns: Namespace) -> None:
    """Remove `ns`'s registry record (its pages stay): the audit's `unknown_namespace`."""
    env = lmdb.open(str(store), max_dbs=16, subdir=True)
    try:
        db = env.open_db(b"namespaces", create=False)
        with env.begin(write=True) as txn:
            assert txn.delete(ns.id, db=db)
    finally:
        env.close()


def test_no_offline_command_prints_a_raw_namespace_id_or_the_salt(tmp_path):
    run = Runs()
    store = _store(tmp_path / "store", run)
    s = ("--store", store)
    trace = tmp_path / "trace.jsonl"
    write_trace(str(trace), generate(WorkloadSpec(requests=12, tenants=2, documents=2, document_tokens=16,
                                                  seed=3)))
    run.forms("init", *s, "--page-size", 4)
    run.forms("put", *s, "--extra-key", "t1", "--tokens", TOKENS)
    run.forms("prefetch", *s, "--extra-key", "t1", "--tokens", TOKENS)
    run.forms("stage", *s, "--extra-key", "t1", "--tokens", TOKENS)
    run.forms("load-back", *s, "--extra-key", "t1", "--tokens", TOKENS)
    run.forms("ns", "ls", *s, tsv=True)
    run.forms("ns", "show", "t1", *s, tsv=True)
    run.forms("ns", "quota", "set", "--extra-key", "t1", *s, "--store-bytes", 1048576)
    run.forms("ns", "quota", "show", *s, tsv=True)
    for form in ([], ["--json"]):
        run("ns", "quota", "set", "--extra-key", "t1", *s, "--store-bytes", 1048576, code=0)
        run("ns", "quota", "clear", "--extra-key", "t1", *s, *form, code=0)
    run.forms("stats", *s, tsv=True)
    run("stats", *s, "--prom", code=0)
    run.forms("audit", *s, tsv=True)
    run.forms("audit", *s, "--repair", "--dry-run", tsv=True)
    run.forms("ns", "drop", "t9", *s, code=2)  # refusing without --yes
    run.forms("ns", "drop", "t9", *s, "--yes", code=2)  # not there
    run.forms("ns", "drop", "t9", *s, "--yes", "--missing-ok")
    run.forms("ns", "drop", "t1", *s, "--dry-run")
    run.forms("ns", "expire", "t1", code=2)  # offline: an error
    run.forms("ns", "evict", "t1", code=2)
    run.forms("replay", trace, *s)
    run.forms("generate", tmp_path / "g.jsonl", "--requests", 5)
    run.forms("version")
    _unregister(store, T1)
    run.forms("audit", *s, code=1, tsv=True)
    assert any("unknown_namespace" in text for _, text in run.outputs)
    run.forms("audit", *s, "--repair", "--dry-run", code=1, tsv=True)
    run.forms("ns", "drop", "t2", *s, "--yes", "--salt", "", "--missing-ok")
    run.assert_no_leaks()


def _serve(forks: forkrun.Forks, store: Path, sock: Path) -> forkrun.Piped:
    proc = forks.piped(["serve", "--store", store, "--socket", sock, "--json", "--device-tokens", "4096",
                        "--host-tokens", "8192"])
    line = proc.readline()
    if not line:
        proc.wait(timeout=60)
        err = proc.stderr
        proc.close()
        raise AssertionError(f"kvc serve did not start: {err}")
    return proc


def _stop(proc: forkrun.Piped) -> str:
    proc.send_signal(signal.SIGTERM)
    out = proc.read(timeout=60)
    code, err = proc.wait(timeout=60), proc.stderr
    proc.close()
    assert code == 0, err
    return out + err


def test_no_live_command_prints_a_raw_namespace_id_or_the_salt(tmp_path, engine_forks):
    run = Runs()
    store = _store(tmp_path / "store", run)
    sock = tmp_path / "s.sock"
    trace = tmp_path / "trace.jsonl"
    write_trace(str(trace), generate(WorkloadSpec(requests=12, tenants=2, documents=2, document_tokens=16,
                                                  seed=3)))
    server = _serve(engine_forks, store, sock)
    try:
        s = ("--socket", sock)
        run.forms("ping", *s)
        run.forms("prefetch", *s, "--extra-key", "t1", "--tokens", TOKENS)
        run.forms("stage", *s, "--extra-key", "t1", "--tokens", TOKENS, code=2)  # cache mode: refused
        run.forms("ns", "ls", *s, tsv=True)
        run.forms("stats", *s, tsv=True)
        run.forms("audit", *s, tsv=True)
        run.forms("ns", "evict", "t1", *s)
        run.forms("ns", "quota", "set", "--extra-key", "t1", *s, "--store-bytes", 1048576)
        run.forms("ns", "quota", "show", *s, tsv=True)
        run.forms("ns", "expire", "t1", *s, code=2)  # refusing without --yes
        run.forms("ns", "drop", "t9", *s, code=2)  # refusing without --yes
        run.forms("ns", "drop", "t9", *s, "--yes", code=2)  # not there
        run.forms("ns", "drop", "t1", *s, "--dry-run")
        run.forms("replay", trace, *s)
        run("snapshot", tmp_path / "snap.bin", *s, code=0)
        run("snapshot", tmp_path / "snap2.bin", *s, "--json", code=0)
        run.forms("audit", "--snapshot", tmp_path / "snap.bin", tsv=True)
        run.forms("ns", "drop", "--id", _listed_id(run, sock, "t2"), *s, "--yes", "--missing-ok")
        run.forms("ns", "drop", "t1", *s, "--yes", "--missing-ok")
    finally:
        run.outputs.append((["serve"], _stop(server)))
    run.assert_no_leaks()


def _listed_id(run: Runs, sock: Path, extra_key: str) -> str:
    doc = json.loads(run("ns", "ls", "--socket", sock, "--json", code=0).stdout)
    return next(r["id"] for r in doc["namespaces"] if r["extra_key"] == extra_key)


def test_messages_about_an_absent_namespace_show_the_stores_fingerprint_or_none(tmp_path):
    here = Runs()
    store = _store(tmp_path / "store", here)
    run = Runs(in_processes=True)  # two runs must print the same: a key drawn per process would differ
    fingerprint = ABSENT.fingerprint(read_key(str(store)))
    hex12 = re.compile(r"\b[0-9a-f]{12}\b")
    outs = [run("ns", "drop", "t9", "--store", store, "--yes", code=2).stderr for _ in range(2)]
    assert outs[0] == outs[1] and f"t9/{fingerprint}" in outs[0]  # the same each run: the store's key
    refusals = [run("ns", "drop", "t9", "--store", store, code=2).stderr,
                run("ns", "expire", "t9", "--socket", tmp_path / "none.sock", code=2).stderr]
    for text in refusals:  # said before any store or live cache is at hand: no fingerprint at all
        assert "t9" in text and not set(hex12.findall(text)) - {fingerprint}, text
    assert "refusing to drop namespace t9 (with the salt given) without --yes" in refusals[0]
    # and a drop named by id uses the listed id (the store's key): it matches
    doc = json.loads(here("ns", "ls", "--store", store, "--json", code=0).stdout)
    listed = {r["extra_key"]: r["id"] for r in doc["namespaces"]}
    assert listed["t1"] == display_id(T1.id, read_key(str(store)))
    here.assert_no_leaks()
    run.assert_no_leaks()


def test_a_live_replay_lists_each_tenant_once_with_what_the_server_counted(tmp_path, engine_forks):
    run = Runs()
    store = _store(tmp_path / "store", run)
    sock = tmp_path / "s.sock"
    trace = tmp_path / "trace.jsonl"
    spec = WorkloadSpec(requests=16, tenants=3, documents=2, document_tokens=16, seed=5)
    write_trace(str(trace), generate(spec))
    server = _serve(engine_forks, store, sock)
    try:
        text = run("replay", trace, "--socket", sock, code=0).stdout
        doc = json.loads(run("replay", trace, "--socket", sock, "--json", code=0).stdout)
    finally:
        _stop(server)
    tenants = [line.split()[0] for line in text.splitlines() if line.split() and line.split()[0].startswith("tenant-")]
    assert sorted(tenants) == ["tenant-0", "tenant-1", "tenant-2"], text
    rows = doc["namespaces"]
    assert sorted(r["namespace"]["extra_key"] for r in rows) == ["tenant-0", "tenant-1", "tenant-2"]
    key = read_key(str(store))
    for r in rows:  # the server's store's key keyed them; sent = done + refused (+ blocked)
        assert r["sent"] >= r["requests"] + r["refused"] and r["refused"] >= 0
        assert len(r["namespace"]["salt_fingerprint"]) == 12
    assert sum(r["sent"] for r in rows) == spec.requests
    assert key is not None
    run.assert_no_leaks()


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch):
    monkeypatch.delenv("KVC_FINGERPRINT_KEY", raising=False)
    ENV.pop("KVC_FINGERPRINT_KEY", None)
