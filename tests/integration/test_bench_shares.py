"""benchmarks/bench_shares.py at a toy size, so the script cannot rot: it runs, publishes its hit-rate figures,
leaves BENCHMARKS.md alone with --no-write, and its acceptance check holds on the toy trace (hit rates are token
counts of a deterministic serial replay, not timings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_toy_two_tenant_replay_keeps_the_quiet_tenants_prompt_only_with_shares(tmp_path):
    figures = tmp_path / "figures.jsonl"
    before = (ROOT / "BENCHMARKS.md").read_bytes()
    result = subprocess.run([sys.executable, "bench_shares.py", "--b-requests", "12", "--no-write"],
                            cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, KVC_BENCH_JSON=str(figures)))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert (ROOT / "BENCHMARKS.md").read_bytes() == before
    assert "**met**" in result.stdout and "Audits after each run: ok" in result.stdout
    ratios = json.loads(figures.read_text())["ratios"]
    assert ratios["b_hit_rate_solo"] > 0.5  # B's prompt is most of each request
    assert ratios["b_hit_rate_shares_on"] >= 0.9 * ratios["b_hit_rate_solo"]
    assert ratios["b_hit_rate_shares_off"] < 0.9 * ratios["b_hit_rate_solo"]
    assert 0 < ratios["a_hit_rate_shares_on"] < 1
