"""benchmarks/bench_audit.py at a toy size: it builds its store, times the serial, parallel and incremental audits
(and another checkout's, here this one's) in interleaved rounds, publishes the two ratios with their spread and the
load average, and leaves nothing behind. Speed is never asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_toy_run_publishes_the_parallel_and_incremental_ratios(tmp_path):
    figures = tmp_path / "figures.jsonl"
    before = (ROOT / "BENCHMARKS.md").read_bytes()
    result = subprocess.run(
        [sys.executable, "bench_audit.py", "--pages", "3000", "--rounds", "2", "--workers", "2", "--main", str(ROOT),
         "--no-write", "--scratch", str(tmp_path)],
        cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=600,
        env=dict(os.environ, KVC_BENCH_JSON=str(figures)))
    assert result.returncode == 0, result.stderr[-2000:]
    assert (ROOT / "BENCHMARKS.md").read_bytes() == before  # --no-write
    rounds = [line for line in result.stdout.splitlines() if line.startswith("round ")]
    assert [line.split(":")[0] for line in rounds] == [f"round {r} {v}" for r in (1, 2)
                                                       for v in ("main", "serial", "parallel", "since")]
    assert all("3,030 pages" in line for line in rounds if "since" not in line)  # the store and the 1 % written
    assert all(" 30 pages" in line for line in rounds if "since" in line)  # only what changed
    assert "Load average (1 min)" in result.stdout and "parallel / serial (wall): **" in result.stdout
    doc = json.loads(figures.read_text())
    assert doc["script"] == "bench_audit"
    assert set(doc["ratios"]) == {"audit_parallel_cost_ratio", "audit_since_cost_ratio",
                                  "audit_serial_vs_main_cost_ratio"}
    assert all(value > 0 for value in doc["ratios"].values())
    assert list(tmp_path.iterdir()) == [figures]  # the scratch directory (the store) is gone
