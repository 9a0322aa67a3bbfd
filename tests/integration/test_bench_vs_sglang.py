"""benchmarks/bench_vs_sglang.py: where SGLang cannot be imported it says so in one line and exits 0 having written
nothing; kvc's worker does the workload's work (every full hit is whole, the serve loop's tokens add up). Speed is
the script's business, never asserted here."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_vs_sglang.py"


def run(*args: str, env: dict[str, str] | None = None, stdin: str = "") -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("KVC_PEER_PYTHON", "KVC_PEER_PYTHONPATH")}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=SCRIPT.parent, capture_output=True, text=True,
                          env={**base, **(env or {})}, input=stdin, timeout=300)


def test_without_a_peer_it_skips_in_one_line_and_writes_nothing():
    before = (ROOT / "BENCHMARKS.md").read_bytes()
    for args, env, reason in (
        ((), None, "no peer interpreter"),
        (("--peer-python", sys.executable), None, "cannot import sglang"),  # kvc's own venv has no sglang
        ((), {"KVC_PEER_PYTHON": sys.executable}, "cannot import sglang"),
        (("--peer-python", "/nonexistent/python"), None, "does not run"),
    ):
        result = run(*args, env=env)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert len(lines) == 1 and lines[0].startswith("bench_vs_sglang: skipped: ") and reason in lines[0], lines
    assert (ROOT / "BENCHMARKS.md").read_bytes() == before


def test_bad_options_are_usage_errors():
    for args in (["--cases", "tree,nothing"], ["--page-sizes", "3"], ["--reps", "0"]):
        result = run(*args)
        assert result.returncode == 2 and "error:" in result.stderr, (args, result.stderr)


def test_the_kvc_worker_does_the_workload_s_work(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_vs_sglang as bench
    finally:
        sys.path.pop(0)
    spec = argparse.Namespace(sequences=24, seq_len=64, groups=3, seed=5, page_sizes=[1, 16],
                              serve_page_sizes=[16], serve_passes=2, dev_frac=0.25, host_ratio=4.0,
                              cases=["tree", "admit", "serve"])
    workload = tmp_path / "workload.bin"
    header = bench.write_workload(workload, spec)
    again, seqs = bench.read_workload(str(workload))
    assert again == header and len(seqs) == 24 and {len(s) for s in seqs} == {64}
    assert len({tuple(s[:32]) for s in seqs}) <= 3  # the first half is one of the shared prefixes
    assert all(sorted(order) == list(range(24)) for order in header["orders"])

    asks = [{"case": case, "page_size": ps} for case in ("tree", "admit") for ps in (1, 16)]
    asks += [{"case": "admit", "page_size": ps, "options": {"tokens": "native"}} for ps in (1, 16)]
    asks += [{"case": "serve", "page_size": 16}, {"case": "serve", "page_size": 16, "options": {"tokens": "native"}}]
    result = run("--worker", "kvc", "--workload", str(workload), stdin="".join(json.dumps(a) + "\n" for a in asks))
    assert result.returncode == 0, result.stderr
    answers = [json.loads(line[len(bench.RESULT):]) for line in result.stdout.splitlines()
               if line.startswith(bench.RESULT)]
    assert len(answers) == 1 + len(asks) and answers[0]["kvcache"] == str(ROOT / "kvcache")  # ready, then one each
    doc = {f"{a['case']}{'_native' if a.get('options') else ''}_p{a['page_size']}": answer
           for a, answer in zip(asks, answers[1:], strict=True)}
    for ps in (1, 16):
        tree = doc[f"tree_p{ps}"]
        assert tree["match_hits"] == tree["match_prebuilt_hits"] == 24 * 64
        for wall, cpu in (tree["insert"], tree["match"], tree["match_prebuilt"], doc[f"admit_p{ps}"]["admit_commit"],
                          doc[f"admit_native_p{ps}"]["admit_commit"]):
            assert wall > 0 and cpu > 0  # [wall-clock, CPU] seconds
    serve = doc["serve_p16"]
    assert serve["requests"] == 48 and serve["device_slots"] == header["serve"]["16"]["device_tokens"]
    native = doc["serve_native_p16"]  # the same requests from packed bytes: the same hits, token for token
    assert [native[k] for k in ("device_hit", "host_hit", "computed")] == \
        [serve[k] for k in ("device_hit", "host_hit", "computed")]
    assert serve["device_hit"] + serve["host_hit"] + serve["computed"] == 48 * 64
    assert serve["computed"] >= 24 * 32  # every unique tail is computed at least once
