"""Golden files for the JSON the `kvc` CLI prints and for an ownership snapshot file: the behaviour a refactor must
keep byte for byte.

`CASES` is a table of kvc command lines run in order, each as its own process (as a user runs kvc: every
invocation starts fresh), all offline on one real LMDB store in a temp directory. Each command's stdout is parsed,
the truly volatile fields its case names are replaced by `PLACEHOLDER`, and `json.dumps(value, indent=2)` (key
order as printed: it is part of the output contract) is compared with `tests/goldens/<case>.json`. Files a command
writes (`generate`'s trace) are compared byte for byte with `tests/goldens/<case>.<file>`. The cases depend on
each other (one store), so the whole table runs once per test process, whichever cases are selected.

What is normalised, and why (nothing else is):
- `seconds`, `prefetch.seconds`, `requests_per_s`, `tokens_per_s`, a bench script's `seconds`: wall-clock times
  and rates derived from them;
- `created` and `last_access` of `kvc ns ls`: unix times of the store's registry records;
- `dropped_before` of a second `kvc ns drop --missing-ok`: the unix time of the store's record of the first drop;
- any occurrence of the temp directory's path (none expected: commands run in it with relative paths).

Determinism: fingerprints and display ids are keyed by env KVC_FINGERPRINT_KEY (recorded by `kvc init` as the
store's key, docs/environment.md); salts come from env KVC_SALT or --salt-file, never the command line. Replays use
`--prefetch-policy wait_complete` (admission waits for every fetch, never a timer) and `--batch 8` (the 6-request
trace is one scheduler step, so the only poll() is the one that starts it: a prefetch retry timer (50 ms) set in
that call is not due by the end of it, unless the process stalls 50 ms inside it, and no later poll() looks);
`kvc prefetch|stage|load-back` run their embedded cache without retries.
`footprint_bytes` of `kvc stats` (the size of LMDB's data.mdb) is pinned: every write to the store comes from
one thread at a time, in program order, so the file grows the same way each run. It grows in OS pages (4 KiB
where the goldens were made): on a machine with larger pages, add it to the stats cases' `volatile`.

The snapshot golden (`test_snapshot_golden`) is an in-process workload on a cache with its L3 I/O run inline;
only the snapshot's `created` time is masked (see the test).

Run against a checkout (its packages first on the path; the kvc subprocesses get the same path):

    PYTHONPATH=$REPO:$REPO/cli:$REPO/tests python -m pytest -q $REPO/tests/integration/test_cli_goldens.py

The installed kvc distribution's `kvcache.storage` entry points must be the checkout's (the LMDB backend is found
through them): with a venv installed from another checkout, put a dist-info with this checkout's entry points
first on PYTHONPATH.

Regenerate the goldens after an intended change: the same with env KVC_UPDATE_GOLDENS=1 (the files are rewritten
instead of compared; review the diff before committing it).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import pytest

import kvc
import kvcache
from kvcache import CacheConfig, HostMode, KVLayout, Namespace, Request, TieredCache, open_store
from kvcache.diagnostics.snapshot import read_snapshot

GOLDENS = Path(__file__).resolve().parents[1] / "goldens"
TRACE = Path(__file__).resolve().parents[2] / "examples" / "traces" / "two_tenants.jsonl"
UPDATE = os.environ.get("KVC_UPDATE_GOLDENS", "") not in ("", "0")
PLACEHOLDER = "<volatile>"
FINGERPRINT_KEY = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"

SALT_T1 = {"KVC_SALT": "golden-salt-t1"}
T1_TOKENS = ",".join(str(t) for t in range(1, 101))  # 100 tokens: 6 whole pages of 16, and a partial one
T2_TOKENS = ",".join(str(t) for t in range(1, 65))  # t1's first 4 pages, in another namespace
T2_ID = "d3c3a759e1c36a68"  # the display id `kvc ns ls` prints for t2 (golden 13_ns_ls.json)
BENCH_SCRIPTS = {  # `kvc bench --dir benchdir`: stand-ins for benchmarks/bench_*.py, deterministic and instant
    "bench_alpha.py": (
        "import json, os\n"
        "figures = [{'name': 'a_over_b', 'value': 0.5, 'unit': 'x (time ratio)', 'better': 'lower'}]\n"
        "line = {'script': 'alpha', 'ratios': {'a_over_b': 0.5, 'c_per_s': 125.0}, 'figures': figures}\n"
        "with open(os.environ['KVC_BENCH_JSON'], 'a') as f:\n"
        "    f.write(json.dumps(line) + '\\n')\n"
        "print('## alpha')\n"),
    "bench_broken.py": "raise SystemExit('broken on purpose')\n",
}


class Case(NamedTuple):
    name: str  # also the golden's file name: tests/goldens/<name>.json
    argv: tuple[str, ...]  # after `kvc`, run in the temp directory
    env: dict[str, str] = {}  # on top of KVC_FINGERPRINT_KEY (every other KVC_* variable is removed)
    exit_code: int = 0
    volatile: tuple[str, ...] = ()  # paths of fields to replace by PLACEHOLDER: "a.b", "list[].field"
    files: tuple[str, ...] = ()  # files the command writes (relative to the temp directory), compared too


def on_store(*argv: str) -> tuple[str, ...]:
    """A command line on the store in the temp directory, printing JSON."""
    return (*argv, "--store", "store", "--json")


SECONDS = ("seconds",)
LS_VOLATILE = ("namespaces[].created", "namespaces[].last_access")
REPLAY = ("replay", "two_tenants.jsonl", "--verify", "--prefetch-policy", "wait_complete", "--batch", "8")
REPLAY_VOLATILE = ("seconds", "requests_per_s", "tokens_per_s", "prefetch.seconds")
LAYOUT = ("--layers", "1", "--kv-heads", "1", "--head-dim", "16")  # 64 bytes per token, pages of 16 tokens

CASES = [
    Case("01_init", on_store("init", *LAYOUT)),
    Case("02_init_again", on_store("init", *LAYOUT)),
    Case("03_put_t1", on_store("put", "--extra-key", "t1", "--tokens", T1_TOKENS), SALT_T1, volatile=SECONDS),
    Case("04_put_t2_salt_file", on_store("put", "--extra-key", "t2", "--salt-file", "t2.salt", "--tokens", T2_TOKENS),
         volatile=SECONDS),
    Case("05_prefetch_t1_tokens_file", on_store("prefetch", "--extra-key", "t1", "--tokens-file", "t1.tokens"),
         SALT_T1, volatile=SECONDS),
    Case("06_prefetch_t1_namespace", on_store("prefetch", "--extra-key", "t1", "--max-pages", "4"), SALT_T1,
         volatile=SECONDS),
    Case("07_stage_t1", on_store("stage", "--extra-key", "t1", "--tokens", T1_TOKENS), SALT_T1, volatile=SECONDS),
    Case("08_load_back_t1", on_store("load-back", "--extra-key", "t1", "--tokens", T1_TOKENS), SALT_T1,
         volatile=SECONDS),
    Case("09_load_back_t1_buffer",
         on_store("load-back", "--extra-key", "t1", "--tokens", T1_TOKENS, "--mode", "buffer"), SALT_T1,
         volatile=SECONDS),
    Case("10_ns_show_t1", on_store("ns", "show", "t1", "--depth", "3", "--width", "2"), SALT_T1),
    Case("11_ns_quota_set_t1", on_store("ns", "quota", "set", "--extra-key", "t1", "--device-tokens", "32",
                                        "--host-tokens", "64", "--store-bytes", "8192"), SALT_T1),
    Case("12_ns_quota_show", on_store("ns", "quota", "show")),
    Case("13_ns_ls", on_store("ns", "ls"), volatile=LS_VOLATILE),
    Case("14_ns_quota_clear_t1", on_store("ns", "quota", "clear", "--extra-key", "t1"), SALT_T1),
    Case("15_ns_quota_show_none", on_store("ns", "quota", "show")),
    Case("16_stats", on_store("stats")),
    Case("17_audit_store", on_store("audit", "--workers", "2")),  # the default is the cores: not a golden
    Case("18_audit_repair_dry_run", on_store("audit", "--repair", "--dry-run", "--workers", "2")),
    Case("19_replay_cold", on_store(*REPLAY), volatile=REPLAY_VOLATILE),
    Case("20_replay_warm", on_store(*REPLAY, "--snapshot-out", "replay.snap"), volatile=REPLAY_VOLATILE),
    Case("21_audit_snapshot", ("audit", "--snapshot", "replay.snap", "--json")),
    Case("22_ns_ls_jsonl_by_extra_key", ("ns", "ls", "--store", "store", "--sort", "extra_key", "-o", "jsonl"),
         volatile=("[].created", "[].last_access")),
    Case("23_ns_drop_t1", on_store("ns", "drop", "t1", "--yes"), SALT_T1),
    Case("24_ns_drop_t1_missing_ok", on_store("ns", "drop", "t1", "--yes", "--missing-ok"), SALT_T1,
         volatile=("dropped_before",)),
    Case("25_ns_drop_t2_by_id", on_store("ns", "drop", "--id", T2_ID, "--yes")),
    Case("26_ns_expire_offline_is_an_error", ("ns", "expire", "t2", "--yes", "--json"), exit_code=2),
    Case("27_stats_after_drops", on_store("stats")),
    Case("28_generate", ("generate", "trace.jsonl", "--requests", "24", "--tenants", "2", "--documents", "3",
                         "--seed", "7", "--json"), files=("trace.jsonl",)),
    Case("29_bench_fixture_scripts", ("bench", "--dir", "benchdir", "--json"), exit_code=1,
         volatile=("scripts[].seconds",)),
]


class Ran(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def _kvc_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment of a kvc process: this process's, without KVC_* settings, with the checkout this test
    imported first on the path, the fixed fingerprint key and the case's variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVC_")}
    roots = [str(Path(kvcache.__file__).resolve().parents[1]), str(Path(kvc.__file__).resolve().parents[1])]
    env["PYTHONPATH"] = os.pathsep.join([*roots, *filter(None, [env.get("PYTHONPATH")])])
    env["KVC_FINGERPRINT_KEY"] = FINGERPRINT_KEY
    env.update(extra)
    return env


def run_kvc(argv: tuple[str, ...], env: dict[str, str], cwd: Path) -> Ran:
    """`kvc ARGV` as its own process, through the console script's entry point (kvc.main:app)."""
    code = "from kvc.main import app; app(prog_name='kvc')"
    # the timeout only stops a hung command; nothing here depends on how long a command takes
    proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=cwd, env=_kvc_env(env), capture_output=True,
                          text=True, timeout=600)
    return Ran(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> tuple[Path, dict[str, Ran]]:
    """Every case of the table, run in order in one temp directory: (that directory, outputs by case name)."""
    work = tmp_path_factory.mktemp("cli-goldens")
    shutil.copy(TRACE, work / "two_tenants.jsonl")
    (work / "t1.tokens").write_text(T1_TOKENS.replace(",", " ") + "\n")
    (work / "t2.salt").write_text("golden-salt-t2\n")
    (work / "t2.salt").chmod(0o600)  # a salt file as docs/security.md says to keep one: no warning
    (work / "benchdir").mkdir()
    for name, text in BENCH_SCRIPTS.items():
        (work / "benchdir" / name).write_text(text)
    return work, {case.name: run_kvc(case.argv, case.env, work) for case in CASES}


def normalise(value: Any, path: str) -> None:
    """Replace the number at `path` ("a.b", "a[].b", "[].b") in `value` by PLACEHOLDER; fail when it is missing
    or not a number (a placeholder must never hide a changed type)."""
    head, _, rest = path.partition(".")
    if head.endswith("[]"):
        items = value[head[:-2]] if head[:-2] else value
        assert isinstance(items, list), f"{path}: not a list"
        for item in items:
            normalise(item, rest)
        return
    assert isinstance(value, dict) and head in value, f"{path}: no field {head!r}"
    if rest:
        normalise(value[head], rest)
        return
    number = value[head]
    assert isinstance(number, (int, float)) and not isinstance(number, bool) and number >= 0, f"{path}: {number!r}"
    value[head] = PLACEHOLDER


def _without_tmp(value: Any, tmp: str) -> Any:
    if isinstance(value, str):
        return value.replace(tmp, "<tmp>")
    if isinstance(value, list):
        return [_without_tmp(v, tmp) for v in value]
    if isinstance(value, dict):
        return {k: _without_tmp(v, tmp) for k, v in value.items()}
    return value


def rendered(case: Case, stdout: str, tmp: Path) -> str:
    """The text a case's golden holds: its stdout's JSON (one object, or with -o jsonl a list of the lines'
    objects), normalised, indented."""
    assert stdout.endswith("\n"), "output does not end with a newline"
    if "jsonl" in case.argv:
        value: Any = [json.loads(line) for line in stdout.splitlines()]
    else:
        assert stdout.count("\n") == 1, "--json prints one line: one object"
        value = json.loads(stdout)
    for path in case.volatile:
        normalise(value, path)
    value = _without_tmp(value, str(tmp))
    return json.dumps(value, sort_keys=False, indent=2) + "\n"


def check_golden(name: str, actual: str | bytes) -> None:
    """Compare with tests/goldens/NAME byte for byte, or (KVC_UPDATE_GOLDENS=1) write it."""
    path = GOLDENS / name
    data = actual.encode() if isinstance(actual, str) else actual
    if UPDATE:
        GOLDENS.mkdir(exist_ok=True)
        path.write_bytes(data)
        return
    assert path.exists(), f"no golden {path}: run with KVC_UPDATE_GOLDENS=1 to create it"
    expected = path.read_bytes()
    if isinstance(actual, str):  # compared as text first, for pytest's line diff
        assert actual == expected.decode(), f"{name} differs from its golden"
    assert data == expected, f"{name} differs from its golden"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_cli_golden(ran, case: Case) -> None:
    work, outputs = ran
    out = outputs[case.name]
    assert out.returncode == case.exit_code, f"exit {out.returncode}; stderr: {out.stderr}"
    text = rendered(case, out.stdout, work)
    if case.exit_code == 2:  # the error contract: the same message as one line on stderr
        assert out.stderr == f"kvc: error: {json.loads(out.stdout)['error']['message']}\n"
    else:  # kvc said nothing on stderr: no warning, no error (anything else there is not kvc's to pin)
        assert not [line for line in out.stderr.splitlines() if line.startswith("kvc")], out.stderr
    check_golden(f"{case.name}.json", text)
    for file in case.files:
        check_golden(f"{case.name}.{file}", (work / file).read_bytes())


# --- the ownership snapshot file -------------------------------------------------------------------------------

@contextlib.contextmanager
def _fixed_fingerprint_key() -> Iterator[None]:
    """A store created inside records FINGERPRINT_KEY as its fingerprint key (env KVC_FINGERPRINT_KEY, as for the
    CLI cases): a snapshot records namespaces' salt fingerprints under its cache's store's key. Env restored
    after."""
    saved = os.environ.get("KVC_FINGERPRINT_KEY")
    os.environ["KVC_FINGERPRINT_KEY"] = FINGERPRINT_KEY
    try:
        yield
    finally:
        if saved is None:
            del os.environ["KVC_FINGERPRINT_KEY"]
        else:
            os.environ["KVC_FINGERPRINT_KEY"] = saved


def _snapshot_workload(tmp: Path) -> Path:
    """A small cache on a real store, caught mid-flight, and its snapshot file: committed requests in three
    namespaces (two salted), a live request, a buffer-mode prefetch holding its device prefix with its fetch
    queued, and a commit's backup still in flight."""
    layout = KVLayout("golden@r1", layers=1, kv_heads=1, head_dim=4, dtype="float16", page_size=2)
    t1, t2, default = Namespace("t1", "snap-salt-1"), Namespace("t2", "snap-salt-2"), Namespace()
    # inline L3 I/O (no thread), no prefetch retries and no share refresh: nothing runs on a timer
    fixed = dict(device="cpu", io_thread=False, prefetch_retries=0, shares_refresh_s=0)
    st = open_store(str(tmp / "store"), layout, create=True)
    try:
        writer = TieredCache(CacheConfig(layout, device_tokens=32, host_tokens=32, **fixed), st)
        for rid, tokens, ns in (("a", range(8), t1), ("b", [0, 1, 2, 3, 9, 9, 9, 9], t1), ("c", range(8), t2),
                                ("d", range(6), default)):
            writer.admit(Request(rid, tokens, ns))
            writer.commit(rid)
        writer.close()  # flushes the L3 writes
        cache = TieredCache(CacheConfig(layout, device_tokens=32, host_tokens=32, host_mode=HostMode.BUFFER,
                                        **fixed), st)
        for rid, tokens, ns in (("f", [0, 1, 2, 3], t1), ("g", [4, 4, 4, 4], t2)):
            cache.admit(Request(rid, tokens, ns))
            cache.commit(rid)
        cache.flush()
        cache.prefetch(Request("p", [0, 1, 2, 3, 9, 9, 9, 9], t1))  # 2 pages past f's, from b's in L3
        cache.poll()  # runs the prefetch's check; its fetch stays queued
        cache.admit(Request("live", [*range(8), 5, 5, 5], t2))
        cache.admit(Request("e", [7, 7, 7, 7, 7], default))
        cache.commit("e")  # its backup stays in flight
        path = tmp / "cache.snap"
        cache.snapshot(str(path))
        cache.close()
    finally:
        st.close()
    return path


def test_snapshot_golden(tmp_path) -> None:
    with _fixed_fingerprint_key():
        path = _snapshot_workload(tmp_path)
    data = path.read_bytes()
    snap = read_snapshot(path)  # the file is a snapshot kvc itself reads
    # Volatile: `created` (unix time of the snapshot) and nothing else. snapshot.bin holds the file's bytes with
    # the 8 bytes of that float64 zeroed (msgpack: the key "created", 0xcb, 8 bytes); snapshot.json the decoded
    # snapshot with `created` replaced, for a readable diff.
    assert isinstance(snap.created, float) and snap.created > 0
    marker = b"\xa7created\xcb"
    assert data.count(marker) == 1
    at = data.index(marker) + len(marker)
    readable = msgspec.json.decode(msgspec.json.encode(snap))
    readable["created"] = PLACEHOLDER
    check_golden("snapshot.json", json.dumps(readable, sort_keys=False, indent=2) + "\n")  # first: a line diff
    check_golden("snapshot.bin", data[:at] + bytes(8) + data[at + 8:])


def test_every_golden_file_has_a_case() -> None:
    if UPDATE:
        pytest.skip("the goldens are being rewritten")
    names = {f"{c.name}.json" for c in CASES} | {f"{c.name}.{f}" for c in CASES for f in c.files}
    names |= {"snapshot.bin", "snapshot.json"}
    names |= {"sglang", "vllm"}  # not kvc's output: vectors the engines wrote, with their generators
    assert sorted(p.name for p in GOLDENS.iterdir()) == sorted(names), "a golden without a case: remove it"
