"""One error contract (issue 13): every failure is one `kvc: error:` line and exit 2 (with --json also a JSON
object on stdout), Ctrl-C is one line and exit 130 with nothing half-written, sizes are checked before anything
is allocated, repeated warnings collapse, a replay whose L3 writes all failed says so and exits 1.

The bad inputs are the issue's own list; on 0f180b0 each of them ended in a traceback with exit 1 (or was
accepted: --timeout-ms -5, Unicode digits, a missing init parent that was silently created)."""

import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

import clirun
from kvc.main import app
from kvc.reporting import collapsed_warnings
from kvcache import WorkloadSpec, generate, write_trace
from redis_server import RedisServer, require_server

KVC = clirun.KVC
TOKENS = ",".join(str(t) for t in range(1, 101))
runner = CliRunner()


def invoke(*args, **env):
    return runner.invoke(app, [str(a) for a in args], env=env or None)


def kvc(*args, timeout=120, **kw):
    return subprocess.run([str(KVC), *map(os.fsencode, map(str, args))], capture_output=True, timeout=timeout, **kw)


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "store"
    assert invoke("init", "--store", path, "--page-size", 4, "--layers", 1, "--kv-heads", 1,
                  "--head-dim", 16).exit_code == 0
    assert invoke("put", "--store", path, "--extra-key", "t1", "--tokens", TOKENS).exit_code == 0
    return path


def _one_line_exit_2(result, json_mode=False):
    stderr = result.stderr if isinstance(result.stderr, str) else result.stderr.decode()
    stdout = result.stdout if isinstance(result.stdout, str) else result.stdout.decode()
    code = getattr(result, "exit_code", getattr(result, "returncode", None))
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvc: error: ") and "Traceback" not in stderr, stderr
    if json_mode:
        doc = json.loads(stdout)
        assert set(doc) == {"error"} and set(doc["error"]) == {"kind", "message"}
        assert lines[0] == "kvc: error: " + doc["error"]["message"]
        return doc["error"]
    assert stdout == ""
    return lines[0]


BAD = {
    "max_pages_over_int64": (["prefetch", "--extra-key", "t1", "--max-pages", "9223372036854775807"], "usage"),
    "device_tokens_beyond_memory": (["replay", "TRACE", "--device-tokens", "100000000000"], "usage"),
    "host_tokens_beyond_memory": (["replay", "TRACE", "--host-tokens", "100000000000"], "usage"),
    "timeout_ms_too_large": (["load-back", "--extra-key", "t1", "--tokens", "1,2", "--timeout-ms", "1e12"], "usage"),
    "negative_timeout": (["prefetch", "--extra-key", "t1", "--tokens", TOKENS, "--timeout-ms", "-5"], "usage"),
    "unicode_digits": (["put", "--tokens", "٣,٤"], "usage"),
    "nested_brackets": (["put", "--tokens", "[" * 100_000 + "1" + "]" * 100_000], "usage"),
    "bad_port": (["ns", "ls", "--store", "redis://127.0.0.1:notaport/0"], "usage"),
    "typo_option": (["ns", "ls", "--sotr", "bytes"], "usage"),
    "unknown_command": (["nsls"], "usage"),
    "snapshot_out_nowhere": (["replay", "TRACE", "--snapshot-out", "/proc/nope/x"], "usage"),
    "init_missing_parent": (["init", "--store", "/nonexistent/deep/path"], "usage"),
    "missing_store": (["ns", "ls", "--store", "NOWHERE"], "usage"),
    "batch_zero": (["replay", "TRACE", "--batch", "0"], "usage"),
    "ns_drop_unknown_id": (["ns", "drop", "--id", "0123456789abcdef", "--yes"], "usage"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_exit_2_and_a_json_error(store, tmp_path, case):
    args, kind = BAD[case]
    trace = tmp_path / "t.jsonl"
    write_trace(trace, generate(WorkloadSpec(requests=20, tenants=2, seed=1)))
    args = [str(trace) if a == "TRACE" else str(tmp_path / "nowhere") if a == "NOWHERE" else a for a in args]
    if "--store" not in args and args[0] != "nsls":
        args += ["--store", str(store)]
    _one_line_exit_2(invoke(*args))
    error = _one_line_exit_2(invoke(*args, "--json"), json_mode=True)
    assert error["kind"] == kind
    assert not Path("/nonexistent/deep").exists()
    stats = json.loads(invoke("stats", "--store", store, "--json").stdout)
    assert stats["pages"] == 25  # nothing was written by a refused command


def test_undecodable_bytes_on_the_command_line_are_exit_2(store):
    # argv bytes ff fe are lone surrogates to Python: no UTF-8, no digest; 0f180b0 raised UnicodeEncodeError. Every
    # option refuses them as it is parsed (issue 36), naming itself and the byte, never echoing it
    result = kvc("put", "--store", store, "--extra-key", "\udcff\udcfe", "--tokens", "1,2,3,4")  # bytes on argv
    line = _one_line_exit_2(result)
    assert "Invalid value for '--extra-key': not UTF-8 text (an undecodable byte 0xff at character 0)" in line
    doc = invoke("put", "--store", store, "--extra-key", "\udcff\udcfe", "--tokens", "1,2,3,4", "--json")
    assert json.loads(doc.stdout)["error"]["kind"] == "usage"


def test_prefetch_sizes_l2_from_the_store_not_from_max_pages(store):
    # 0f180b0 sized L2 from --max-pages: "tried to allocate 1638400000000 bytes" and a traceback
    result = invoke("prefetch", "--store", store, "--extra-key", "t1", "--max-pages", 100_000_000, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["pages"] == 25  # the namespace's pages, all of them


def test_init_creates_missing_parents_only_when_asked(tmp_path):
    deep = tmp_path / "a" / "b" / "store"
    _one_line_exit_2(invoke("init", "--store", deep))
    assert not (tmp_path / "a").exists()
    assert invoke("init", "--store", deep, "--parents").exit_code == 0 and (deep / "data.mdb").exists()


def test_debug_shows_the_traceback(tmp_path):
    quiet = invoke("ns", "ls", "--store", tmp_path / "nowhere", KVC_DEBUG=None)
    assert quiet.exit_code == 2 and "Traceback" not in quiet.stderr
    for loud in (invoke("--debug", "ns", "ls", "--store", tmp_path / "nowhere", KVC_DEBUG=None),
                 invoke("ns", "ls", "--store", tmp_path / "nowhere", KVC_DEBUG="1")):
        assert loud.exit_code == 2 and "Traceback" in loud.stderr
        assert loud.stderr.strip().splitlines()[-1].startswith("kvc: error: ")


# Runs a command with SIGINT at its default action. A test run from a background job (`make test &`: POSIX shells start
# those with SIGINT ignored) would hand kvc an ignored SIGINT, which kvc rightly leaves ignored (nohup): the replay
# then ran to its end and exited 0.
SIGINT_DEFAULT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                  "os.execv(sys.argv[1], sys.argv[1:])")


def test_ctrl_c_is_one_line_exit_130_and_leaves_the_store_sound(tmp_path):
    """The replay says where it is on KVC_PROGRESS_FD, a pipe this test reads; SIGINT goes once it has run 200
    requests. The pipe holds one page: while this test reads no more, the replay cannot get more than a page of
    lines (a few thousand requests) ahead, so it is still running — at most blocked on the pipe — when SIGINT
    lands. No timing: "SIGINT swallowed" and "replay already over" cannot look alike."""
    store = tmp_path / "store"
    assert invoke("init", "--store", store).exit_code == 0
    trace = tmp_path / "big.jsonl"  # many requests (the replay must not end first), each of a few short pages
    write_trace(trace, generate(WorkloadSpec(requests=20_000, tenants=4, seed=3, shared_prefix_tokens=16,
                                             system_prompt_tokens=16, documents=2, document_tokens=32,
                                             user_tokens=8, output_tokens=4)))
    read, write = os.pipe()
    if hasattr(fcntl, "F_SETPIPE_SZ"):
        fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, 4096)
    proc = subprocess.Popen([sys.executable, "-c", SIGINT_DEFAULT, str(KVC), "replay", str(trace), "--store",
                             str(store), "--snapshot-out", str(tmp_path / "cache.snap")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(write,),
                            env=dict(os.environ, KVC_PROGRESS_FD=str(write), PYTHONFAULTHANDLER="1"))
    os.close(write)
    with os.fdopen(read) as progress:
        seen = []
        for line in progress:  # "replay DONE/20000" after each step; the end of the file if the replay ended
            seen.append(line.strip())
            description, counts = line.split()
            done, total = map(int, counts.split("/"))
            assert (description, total) == ("replay", 20_000) and done < total
            if done >= 200:
                proc.send_signal(signal.SIGINT)
                break
        else:
            proc.wait(timeout=120)
            pytest.fail(f"the replay ended (exit {proc.returncode}) before it ran 200 requests: {seen[-3:]}, "
                        f"{proc.stderr.read()!r}")  # type: ignore[union-attr]
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:  # stuck after the SIGINT: SIGABRT makes it print every thread's stack
        proc.send_signal(signal.SIGABRT)
        pytest.fail(f"kvc replay did not end after SIGINT; its threads:\n{proc.communicate()[1].decode()}")
    assert proc.returncode == 130, err
    assert err.decode().strip().splitlines() == ["kvc: interrupted"] and out == b""
    assert not (tmp_path / "cache.snap").exists()  # no snapshot, and no temp file of one either
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".cache.snap")] == []
    audit = invoke("audit", "--store", store, "--json")
    assert audit.exit_code == 0 and json.loads(audit.stdout)["ok"]  # what was written is whole


@pytest.mark.parametrize("command", ["replay", "sweep"])
def test_a_ctrl_c_inside_the_engine_lands_at_the_next_step_never_inside_it(tmp_path, monkeypatch, command):
    """A KeyboardInterrupt raised wherever the interpreter is can leave an engine lock taken (between its acquire
    and the `with` that would release it) and the cache's close then waits forever: a SIGINT that arrives while an
    admission runs must let that admission finish and stop the command at the next step. In this process, so the
    signal lands inside a chosen call: the admission that sends it records whether it ran to its end."""
    from kvcache.engine.cache import TieredCache

    store = tmp_path / "store"
    assert invoke("init", "--store", store).exit_code == 0
    trace = tmp_path / "t.jsonl"
    write_trace(trace, generate(WorkloadSpec(requests=400, tenants=2, seed=5)))
    real, calls = TieredCache.admit, []

    def admit(self, request):
        calls.append("started")
        if len(calls) == 41:  # the 21st admission: well inside the replay, past its first steps
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs at the next bytecode, inside this call
        adm = real(self, request)
        calls.append("finished")
        return adm

    monkeypatch.setattr(TieredCache, "admit", admit)
    args = ["--store", store] if command == "replay" else ["--store", store, "--device-tokens", "256",
                                                          "--host-tokens", "512", "--workers", "1"]
    result = invoke(command, trace, *args)
    assert result.exit_code == 130, result.output
    assert result.stderr.strip().splitlines() == ["kvc: interrupted"]
    assert calls.count("started") == calls.count("finished") < 400  # none cut short, and the command stopped
    audit = invoke("audit", "--store", store, "--json")
    assert audit.exit_code == 0 and json.loads(audit.stdout)["ok"]


def test_a_replay_no_l3_write_of_which_succeeds_says_so_and_exits_1(tmp_path):
    # a store that will not write (NOREPLICAS) while reads work: 0f180b0 exited 0. Its refusal is the server's, not
    # one for room: the writes failed (issue 36: ebaf189 called them "rejected", the word for capacity and quotas)
    server = RedisServer(require_server(), tmp_path / "redis").start()
    try:
        url = server.store_url()
        assert invoke("init", "--store", url, "--page-size", 4).exit_code == 0
        with server._client() as c:
            c.config_set("min-replicas-to-write", 1)
        trace = tmp_path / "t.jsonl"
        write_trace(trace, generate(WorkloadSpec(requests=100, tenants=2, seed=2)))
        result = invoke("replay", trace, "--store", url, "--json")
    finally:
        server.stop()
    report = json.loads(result.stdout)
    b = report["backup"]
    assert result.exit_code == 1 and b["storage_pages"] == 0 and b["storage_failed"] > 10
    assert b["storage_rejected"] == 0
    assert result.stderr.strip().splitlines() == [
        f"kvc: warning: {b['storage_failed']} L3 writes failed (the store could not be written), and no L3 write "
        f"succeeded: those pages stayed in L2 only"]


def test_a_redis_server_killed_mid_replay_is_failed_writes_never_rejected_ones(tmp_path):
    """Issue 36: a Redis server killed mid-replay was reported as 72,214 "rejected" writes on ebaf189 — the word for
    capacity, quota and share refusals — so an operator read "the store is full" for "the store is gone". The
    replay reports its progress on KVC_PROGRESS_FD; the server is killed once a tenth of the trace has run (pages
    were written by then), and the rest of the writes fail."""
    server = RedisServer(require_server(), tmp_path / "redis").start()
    try:
        url = server.store_url() + "&timeout=0.5&connect_timeout=0.5&backoff_max=0.2"
        assert invoke("init", "--store", url, "--page-size", 4).exit_code == 0
        trace = tmp_path / "t.jsonl"
        write_trace(trace, generate(WorkloadSpec(requests=400, tenants=2, seed=5)))
        read, write = os.pipe()
        proc = subprocess.Popen([str(KVC), "replay", str(trace), "--store", url, "--json"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, pass_fds=(write,),
                                env=dict(os.environ, KVC_PROGRESS_FD=str(write), PYTHONFAULTHANDLER="1"))
        os.close(write)
        with os.fdopen(read) as progress:
            for line in progress:  # read to the end: the replay never waits on a full pipe
                done = int(line.split()[1].split("/")[0])
                if done >= 40 and server.proc is not None and server.proc.poll() is None:
                    server.kill()
        out, err = proc.communicate(timeout=300)
    finally:
        server.stop()
    b = json.loads(out)["backup"]
    assert proc.returncode == 0, err  # pages reached the store before the kill: not "nothing backed up"
    assert b["storage_pages"] > 0 and b["storage_failed"] > 0 and b["storage_rejected"] == 0, b
    warning = [line for line in err.decode().splitlines() if "L3 writes failed" in line]
    assert warning == [f"kvc: warning: {b['storage_failed']} L3 writes failed (the store could not be written): "
                       f"those pages stayed in L2 only"], err.decode()
    assert "refused" not in err.decode() and "rejected" not in err.decode()


def test_a_read_only_store_is_refused_before_the_replay_starts(tmp_path):
    # 0f180b0 ran the replay, printed one identical warning per failed L3 write (3,374) and exited 0
    root = Path(tempfile.mkdtemp(prefix="kvc-ro-"))
    try:
        store = root / "store"
        assert invoke("init", "--store", store).exit_code == 0
        trace = root / "t.jsonl"
        write_trace(trace, generate(WorkloadSpec(requests=50, tenants=2, seed=4)))
        store.chmod(0o555)
        (store / "data.mdb").chmod(0o444)  # readers need the lock file; the data stays read-only
        # As root, the mode bits bind only without CAP_DAC_OVERRIDE: run kvc with every capability dropped. (Not as
        # another user: that one could not reach a checkout under a 0700 directory, e.g. a clone in mktemp -d.)
        no_caps = (["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all"]
                   if os.geteuid() == 0 else [])
        proc = subprocess.run([*no_caps, str(KVC), "replay", str(trace), "--store", str(store)],
                              capture_output=True, text=True, timeout=120, env=dict(os.environ, HOME=str(root)))
        line = _one_line_exit_2(proc)
        assert "read-only" in line
    finally:
        os.chmod(root / "store", 0o755)
        shutil.rmtree(root, ignore_errors=True)


def test_repeated_warnings_collapse_into_one_summary_line(capsys):
    log = logging.getLogger("kvcache")
    with collapsed_warnings():
        for i in range(3374):
            log.warning("L3 write %s failed, nodes left in L2 only: %s", i, "read-only")
        log.warning("prefetch %s of request %s: L3 read failed: %s", 1, "r1", "EIO")
    err = capsys.readouterr().err.splitlines()
    assert err == ["kvc: warning: L3 write 0 failed, nodes left in L2 only: read-only",
                   "kvc: warning: prefetch 1 of request r1: L3 read failed: EIO",
                   "kvc: warning: 3373 more like: L3 write 0 failed, nodes left in L2 only: read-only"]


def test_ns_drop_names_exactly_one_namespace(store):
    invoke("put", "--store", store, "--extra-key", "t2", "--tokens", TOKENS, KVC_SALT="shared")
    invoke("put", "--store", store, "--extra-key", "t3", "--tokens", TOKENS, KVC_SALT="shared")
    rows = json.loads(invoke("ns", "ls", "--store", store, "--json").stdout)["namespaces"]
    fp = {r["extra_key"]: r["salt_fingerprint"] for r in rows}["t2"]
    both = _one_line_exit_2(invoke("ns", "drop", "--fingerprint", fp, "--yes", "--store", store))
    assert "2 namespaces have fingerprint" in both  # t2 and t3 share the salt: name one
    for conflict in (["--id", "0" * 16, "--fingerprint", fp], ["--id", "0" * 16, "--salt", "x"], ["t2", "--id", "x"],
                     []):
        _one_line_exit_2(invoke("ns", "drop", *conflict, "--yes", "--store", store))
    out = json.loads(invoke("ns", "drop", "t3", "--fingerprint", fp, "--yes", "--json", "--store", store).stdout)
    assert out["dropped"] and out["namespace"]["extra_key"] == "t3" and out["store_pages"] == 25
    again = invoke("ns", "drop", "t3", "--fingerprint", fp, "--yes", "--missing-ok", "--json", "--store", store)
    assert again.exit_code == 0 and json.loads(again.stdout)["dropped"] is False
    left = {r["extra_key"] for r in json.loads(invoke("ns", "ls", "--store", store, "--json").stdout)["namespaces"]}
    assert left == {"t1", "t2"}


def test_an_empty_trace_replays_nothing_and_exits_1(tmp_path, store):
    """Issue 36: a trace of no request (an empty file, blank lines only) replayed with exit 0 on ebaf189: a script
    went on as if its workload had run. Exit 1 ("nothing to act on", docs/cli.md), the report as ever, one line."""
    for name, text in (("empty.jsonl", ""), ("blank.jsonl", "\n\n  \n")):
        trace = tmp_path / name
        trace.write_text(text)
        result = invoke("replay", trace, "--store", store, "--json")
        assert result.exit_code == 1, result.output
        assert json.loads(result.stdout)["requests"] == 0
        assert result.stderr.strip().splitlines() == [
            f"kvc: error: {trace}: the trace holds no request; nothing was replayed"]


def test_a_put_of_less_than_a_page_stores_nothing_and_exits_1(store):
    """Issue 36: docs/json.md says a put that stored none of its pages exits 1; one of fewer tokens than a page
    (4 here) has no page to store, and exited 0 on ebaf189."""
    result = invoke("put", "--store", store, "--extra-key", "t9", "--tokens", "1,2,3", "--json")
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert (doc["requested_tokens"], doc["pages"], doc["written"]) == (3, 0, 0)
    assert result.stderr.strip().splitlines() == ["kvc: error: 3 tokens are less than one page of 4: nothing to store"]
    whole = invoke("put", "--store", store, "--extra-key", "t9", "--tokens", "1,2,3,4,5", "--json")
    assert whole.exit_code == 0 and json.loads(whole.stdout)["written"] == 1  # the whole page; the tail is left
