"""The operations commands — init, put, prefetch, stage, load-back, replay, generate, demo — on real LMDB stores,
in process (CliRunner): exit codes, the pinned --json fields, and the salt never in any output. Two tests start
the installed `kvc` as a process of its own: a replay in a new process (it can only hit L3 on disk) and a bad
trace's one line from the console script."""

import json
import subprocess

import pytest
import torch
from typer.testing import CliRunner

import clirun
from kvc.main import app
from kvcache import Namespace, WorkloadSpec, generate, write_trace
from kvcache.ledger.copy import Copier
from kvcache.storage.keyfile import read_key
from kvcache.types.namespace import display_id

SALT = "op-salt-zxcvbnm-123"
OTHER_SALT = "op-salt-other-456"
KVC = clirun.KVC
TOKENS = ",".join(str(t) for t in range(1, 101))  # 100 tokens: 6 whole pages of 16
runner = CliRunner()
PINNED_REQUEST = {"requested_tokens", "hit_tokens", "pages", "bytes", "seconds", "namespace"}


def _no_salt(text: str) -> None:
    assert SALT not in text and OTHER_SALT not in text


def kvc(*args, check_rc=None):
    """Run the installed kvc as a subprocess."""
    proc = subprocess.run([str(KVC), *map(str, args)], capture_output=True, text=True, timeout=120)
    _no_salt(proc.stdout + proc.stderr)
    if check_rc is not None:
        assert proc.returncode == check_rc, proc.stderr
    return proc


def invoke(*args):
    result = runner.invoke(app, [str(a) for a in args])
    _no_salt(result.output)
    return result


def as_json(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture
def store(tmp_path):
    path = tmp_path / "store"
    as_json(invoke("init", "--store", path, "--layers", "1", "--kv-heads", "1", "--head-dim", "16", "--json"))
    return path


# --- init -----------------------------------------------------------------------------------------------------

def test_init_is_idempotent_for_the_same_layout_and_refuses_another(tmp_path):
    path = tmp_path / "s"
    first = as_json(invoke("init", "--store", path, "--json"))
    assert first["created"] is True and first["layout"]["page_size"] == 16 and first["bytes_per_page"] == 16384
    again = as_json(invoke("init", "--store", path, "--json"))
    assert again["created"] is False and again["layout_id"] == first["layout_id"]
    other = invoke("init", "--store", path, "--page-size", "8")
    assert other.exit_code == 2 and other.stdout == ""
    assert other.stderr.startswith("kvc: error: ") and "page_size=8 is not in this store" in other.stderr
    assert len(other.stderr.strip().splitlines()) == 1


def test_init_says_what_disk_a_page_takes_against_its_payload(tmp_path):
    # Capacities count payload; init says the data file's ratio for its layout (16 KiB pages of 16 tokens: five
    # 4 KiB overflow pages for the value and its checksum, plus records), in text and in --json, and the
    # estimate is what a store of those pages then takes (within 10%).
    text = invoke("init", "--store", tmp_path / "s")
    assert text.exit_code == 0, text.output
    assert "on disk ~20.8 KiB per page, 1.30x its payload" in text.output and "docs/capacity.md" in text.output
    out = as_json(invoke("init", "--store", tmp_path / "s", "--json"))
    assert out["disk_per_payload"] == 1.302 and out["disk_per_page"] == round(out["disk_per_payload"] * 16384)
    tokens = ",".join(str(t) for t in range(1, 16 * 512 + 1))  # 512 pages of 16 tokens, in one chain
    assert invoke("put", "--store", tmp_path / "s", "--extra-key", "t", "--tokens", tokens).exit_code == 0
    footprint = (tmp_path / "s" / "data.mdb").stat().st_size
    assert 0.9 <= footprint / (512 * out["disk_per_page"]) <= 1.1


def test_init_bad_layout_is_a_usage_error(tmp_path):
    result = invoke("init", "--store", tmp_path / "s", "--dtype", "float7")
    assert result.exit_code == 2 and "float7" in result.output
    assert not (tmp_path / "s").exists()


# --- put / prefetch ---------------------------------------------------------------------------------------------

def test_put_then_prefetch_hits_every_full_page_only_in_the_same_namespace(store):
    put = as_json(invoke("put", "--store", store, "--extra-key", "t1", "--salt", SALT, "--tokens", TOKENS, "--json"))
    assert put["pages"] == 6 and put["written"] == 6 and put["kv"] == "synthetic"
    again = as_json(invoke("put", "--store", store, "--extra-key", "t1", "--salt", SALT, "--tokens", TOKENS,
                           "--json"))
    assert again["written"] == 0 and again["existing"] == 6
    hit = as_json(invoke("prefetch", "--store", store, "--extra-key", "t1", "--salt", SALT, "--tokens", TOKENS,
                         "--json"))
    assert PINNED_REQUEST <= set(hit)
    assert hit["requested_tokens"] == 100 and hit["hit_tokens"] == 96 and hit["pages"] == 6
    assert hit["bytes"] == 6 * 16 * 64
    fingerprint = Namespace("t1", SALT).fingerprint(read_key(str(store)))  # under the store's own key
    assert hit["namespace"] == {"extra_key": "t1", "salt_fingerprint": fingerprint}
    for other in (["--extra-key", "t1", "--salt", OTHER_SALT], ["--extra-key", "t2", "--salt", SALT],
                  ["--extra-key", "t1"], []):
        miss = as_json(invoke("prefetch", "--store", store, *other, "--tokens", TOKENS, "--json"))
        assert miss["hit_tokens"] == 0 and miss["pages"] == 0


def test_prefetch_without_tokens_warms_the_hottest_prefixes_up_to_the_budget(store, tmp_path):
    shared = list(range(1, 33))  # 2 shared pages
    hot, cold = shared + [7] * 48, shared + [9] * 32
    for seq in (hot, cold):
        invoke("put", "--store", store, "--extra-key", "t1", "--salt", SALT, "--tokens", ",".join(map(str, seq)))
    for _ in range(3):  # reads make the hot branch hot
        as_json(invoke("prefetch", "--store", store, "--extra-key", "t1", "--salt", SALT,
                       "--tokens", ",".join(map(str, hot)), "--json"))
    whole = as_json(invoke("prefetch", "--store", store, "--extra-key", "t1", "--salt", SALT, "--json"))
    assert whole["pages"] == 2 + 3 + 2 and whole["prefixes"] == 2 and whole["hit_tokens"] == 7 * 16
    budget = as_json(invoke("prefetch", "--store", store, "--extra-key", "t1", "--salt", SALT, "--max-pages", 4,
                            "--json"))
    assert budget["pages"] == 4 and budget["prefixes"] == 1  # shared pages, then the hot branch
    by_bytes = as_json(invoke("prefetch", "--store", store, "--extra-key", "t1", "--salt", SALT,
                              "--max-bytes", 3 * 1024, "--json"))
    assert by_bytes["bytes"] == 3 * 1024
    nobody = as_json(invoke("prefetch", "--store", store, "--extra-key", "t9", "--json"))
    assert nobody["pages"] == 0 and nobody["prefixes"] == 0


def test_put_real_kv_from_a_tensor_file_and_load_it_back_verified(store, tmp_path):
    kv = torch.randn(40, 2, 16, dtype=torch.float16)  # [tokens, K/V, head_dim]: 64 bytes per token
    torch.save(kv, tmp_path / "kv.pt")
    tokens = ",".join(str(t) for t in range(500, 540))
    put = as_json(invoke("put", "--store", store, "--extra-key", "t1", "--salt", SALT, "--tokens", tokens,
                         "--kv-file", tmp_path / "kv.pt", "--json"))
    assert put["kv"] == "file" and put["pages"] == 2
    back = as_json(invoke("load-back", "--store", store, "--extra-key", "t1", "--salt", SALT, "--tokens", tokens,
                          "--json"))
    assert back["verified_tokens"] == 32 and back["verify_mismatches"] == 0 and back["loaded_back_tokens"] == 32
    torch.save(torch.zeros(40, 3), tmp_path / "bad.pt")
    bad = invoke("put", "--store", store, "--tokens", tokens, "--kv-file", tmp_path / "bad.pt")
    assert bad.exit_code == 2 and "12 bytes per token" in bad.output and "64" in bad.output
    (tmp_path / "junk.pt").write_bytes(b"not a tensor")
    assert invoke("put", "--store", store, "--tokens", tokens, "--kv-file", tmp_path / "junk.pt").exit_code == 2


# --- stage / load-back ---------------------------------------------------------------------------------------------

def test_stage_shows_the_record_with_the_requests_namespace(store):
    invoke("put", "--store", store, "--extra-key", "t1", "--salt", SALT, "--tokens", TOKENS)
    doc = as_json(invoke("stage", "--store", store, "--extra-key", "t1", "--salt", SALT, "--tokens", TOKENS,
                         "--json"))
    ns, key = Namespace("t1", SALT), read_key(str(store))
    staged = doc["staged"]
    assert staged["namespace"] == {"extra_key": "t1", "salt_fingerprint": ns.fingerprint(key)}
    shown_id = display_id(ns.id, key)  # the raw id is never printed: with the extra_key it is a salt oracle
    assert staged["namespace_id"] == shown_id and staged["staged_tokens"] == 96 and len(staged["page_hashes"]) == 6
    assert doc["hit_tokens"] == 96
    other = as_json(invoke("stage", "--store", store, "--extra-key", "t1", "--salt", OTHER_SALT, "--tokens", TOKENS,
                           "--json"))
    assert other["staged"] is None and other["hit_tokens"] == 0
    human = invoke("stage", "--store", store, "--extra-key", "t1", "--salt", SALT, "--tokens", TOKENS)
    assert human.exit_code == 0 and shown_id in human.output and ns.id_hex[:16] not in human.output


@pytest.mark.parametrize("mode", ["cache", "buffer"])
def test_load_back_verifies_the_device_bytes(store, mode):
    invoke("put", "--store", store, "--extra-key", "t1", "--salt", SALT, "--tokens", TOKENS)
    doc = as_json(invoke("load-back", "--store", store, "--extra-key", "t1", "--salt", SALT, "--tokens", TOKENS,
                         "--mode", mode, "--json"))
    assert doc["hit_tokens"] == 96 and doc["verified_tokens"] == 96 and doc["verify_mismatches"] == 0
    assert doc["loaded_back_tokens"] == 96


def test_load_back_exits_1_when_the_copy_corrupts_pages(store, monkeypatch):
    invoke("put", "--store", store, "--extra-key", "t1", "--salt", SALT, "--tokens", TOKENS)
    real = Copier.copy

    def reversed_copy(self, src, src_pages, dst, dst_pages):  # the classic bug: pages land in the wrong slots
        return real(self, src, src_pages[::-1].copy(), dst, dst_pages)

    monkeypatch.setattr(Copier, "copy", reversed_copy)
    result = invoke("load-back", "--store", store, "--extra-key", "t1", "--salt", SALT, "--tokens", TOKENS, "--json")
    assert result.exit_code == 1
    assert json.loads(result.stdout)["verify_mismatches"] == 6


def test_request_option_errors_are_usage_errors(store, tmp_path):
    (tmp_path / "toks").write_text("1 2 three")
    for args in (["--tokens", "1,2", "--tokens-file", tmp_path / "toks"], ["--tokens-file", tmp_path / "toks"],
                 ["--tokens", "1,-2"], ["--tokens-file", tmp_path / "missing"]):
        result = invoke("prefetch", "--store", store, *args)
        assert result.exit_code == 2 and result.output.startswith("kvc: error: "), result.output
    assert invoke("stage", "--store", store).exit_code == 2  # stage needs a request
    assert invoke("prefetch", "--store", tmp_path / "nowhere", "--tokens", "1").exit_code == 2


# --- replay / generate / demo ----------------------------------------------------------------------------------

def _trace(tmp_path, requests=300, seed=1):
    path = tmp_path / f"trace-{seed}.jsonl"
    spec = WorkloadSpec(requests=requests, tenants=3, system_prompt_tokens=48, document_tokens=96,
                        documents=8, seed=seed)
    write_trace(path, generate(spec))
    return path


@pytest.mark.parametrize("mode", ["cache", "buffer"])
@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_replay_verify_is_clean_in_every_mode_and_policy(store, tmp_path, mode, policy):
    trace = _trace(tmp_path)
    args = ["replay", trace, "--store", store, "--verify", "--mode", mode, "--prefetch-policy", policy,
            "--device-tokens", 2048, "--host-tokens", 4096, "--json"]
    first = as_json(invoke(*args))
    assert first["requests"] == 300 and first["verify_mismatches"] == 0
    assert first["audit"]["ok"] is True and first["audit"]["violations"] == []
    assert set(first["hit_tokens"]) == {"device", "host", "storage"}
    second = as_json(invoke(*args))  # a new cache on the store the first replay backed up to
    assert second["verify_mismatches"] == 0 and second["audit"]["ok"]
    # best effort takes what the I/O thread fetched by admission: possibly nothing in a replay with no forward
    # time (tests/unit/workload/test_replay.py checks it with inline I/O, deterministically)
    if policy != "best_effort":
        assert second["hit_tokens"]["storage"] > 0


def test_replay_in_a_new_process_hits_l3_and_the_snapshot_audits_clean(store, tmp_path):
    # the first replay fills the store from this process; the second runs in a process of its own, which holds
    # nothing of the first in memory: what it hits in storage it read from the store on disk
    trace = _trace(tmp_path, 400, seed=2)
    first = as_json(invoke("replay", trace, "--store", store, "--verify", "--json"))
    assert first["hit_tokens"]["storage"] == 0  # an empty store
    snap = tmp_path / "snap.bin"
    second = json.loads(kvc("replay", trace, "--store", store, "--verify", "--prefetch-policy", "wait_complete",
                            "--snapshot-out", snap, "--json", check_rc=0).stdout)
    assert second["hit_tokens"]["storage"] > 0 and second["verify_mismatches"] == 0 and second["audit"]["ok"]
    audit = as_json(invoke("audit", "--snapshot", snap, "--json"))
    assert audit["ok"] is True
    human = invoke("replay", trace, "--store", store, "--verify")
    assert human.exit_code == 0, human.output
    assert "tenant-0" in human.stdout and "verify:" in human.stdout and "audit: ok" in human.stdout


@pytest.mark.parametrize("line, why", [
    ('{"rid": "x", "tokens": [1, -5]}', "Expected `int` >= 0"),
    ('{"rid": "x", "tokens": [1], "tenant": "t1"}', "unknown field `tenant`"),
    ('{"rid": "x", "tokens": [1, 2.5]}', "Expected `int`, got `float`"),
    ('not json', "not a JSON object"),
])
def test_a_bad_trace_exits_2_naming_the_line_and_runs_nothing(store, tmp_path, line, why):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"rid": "a", "tokens": [1, 2, 3], "extra_key": "t1", "cache_salt": "%s"}\n\n%s\n'
                     % (SALT, line))
    result = invoke("replay", trace, "--store", store, "--json")
    assert result.exit_code == 2 and json.loads(result.stdout)["error"]["kind"] == "invalid_trace"
    assert len(result.stderr.strip().splitlines()) == 1
    assert "bad.jsonl:3: " in result.stderr and why in result.stderr
    assert as_json(invoke("stats", "--store", store, "--json"))["pages"] == 0


def test_a_bad_trace_as_a_subprocess_prints_one_line_and_no_traceback(store, tmp_path):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"rid": "a", "tokens": [1, 2, 3]}\n{"rid": "b", "tokens": [1, 2, 3], "extra": 1}\n')
    proc = kvc("replay", trace, "--store", store)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [f"kvc: error: {trace}:2: Object contains unknown field `extra`"]


def test_replay_verify_failure_exits_1(store, tmp_path, monkeypatch):
    real = Copier.copy
    monkeypatch.setattr(Copier, "copy", lambda self, src, sp, dst, dp: real(self, src, sp[::-1].copy(), dst, dp))
    result = invoke("replay", _trace(tmp_path, 200), "--store", store, "--verify", "--device-tokens", 512,
                    "--host-tokens", 4096, "--json")
    assert result.exit_code == 1
    assert json.loads(result.stdout)["verify_mismatches"] > 0


def test_generate_writes_a_trace_replay_accepts(store, tmp_path):
    out = tmp_path / "g.jsonl"
    doc = as_json(invoke("generate", out, "--requests", 50, "--tenants", 2, "--json"))
    assert doc["requests"] == 50 and len(out.read_text().splitlines()) == 50
    assert as_json(invoke("replay", out, "--store", store, "--json"))["requests"] == 50


def test_demo_small_runs_cold_then_warm_and_passes_its_checks():
    doc = as_json(invoke("demo", "--requests", 150, "--tenants", 2, "--json"))
    assert doc["ok"] is True and doc["store_ok"] is True and doc["requests"] == 150
    assert doc["warm"]["hit_tokens"]["storage"] > 0
    assert {t["namespace"]["extra_key"] for t in doc["tenants"]} == {"tenant-0", "tenant-1"}
    human = invoke("demo", "--requests", 100, "--tenants", 2)
    assert human.exit_code == 0, human.output
    assert "what L3 saved each tenant" in human.stdout and "all checks passed" in human.stdout


# --- bench -------------------------------------------------------------------------------------------------------

def test_bench_runs_a_real_script_and_prints_its_ratios():
    doc = as_json(invoke("bench", "--only", "bench_replay", "--json"))
    (run,) = doc["scripts"]
    assert run["script"] == "bench_replay" and run["exit_code"] == 0 and doc["quick"] is True
    assert 0 < run["ratios"]["verify_over_copy"] and run["ratios"]["replay_requests_per_s"] > 0
    assert "## Verified replay" in run["report"]


def test_bench_reports_a_failing_script_with_exit_1(tmp_path):
    (tmp_path / "bench_ok.py").write_text(
        "import json, os\n"
        "line = json.dumps({'script': 'ok', 'ratios': {'x_over_y': 0.5}})\n"
        "open(os.environ['KVC_BENCH_JSON'], 'a').write(line + '\\n')\n"
        "print('## ok')\n")
    (tmp_path / "bench_broken.py").write_text("raise SystemExit('broken on purpose')\n")
    result = invoke("bench", "--dir", tmp_path, "--json")
    assert result.exit_code == 1
    runs = {r["script"]: r for r in json.loads(result.stdout)["scripts"]}
    assert runs["bench_ok"]["ratios"] == {"x_over_y": 0.5} and runs["bench_ok"]["exit_code"] == 0
    assert runs["bench_broken"]["exit_code"] == 1 and "broken on purpose" in runs["bench_broken"]["report"]
    human = invoke("bench", "--dir", tmp_path, "--only", "bench_ok")
    assert human.exit_code == 0 and "x_over_y" in human.stdout


def test_bench_usage_errors(tmp_path):
    for args in (["--dir", tmp_path], ["--only", "bench_nothing"], ["--write"]):
        result = invoke("bench", *args)
        assert result.exit_code == 2 and result.output.startswith("kvc: error: "), result.output
