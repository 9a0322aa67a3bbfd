"""benchmarks/bench_sweep.py at a toy size, so the script cannot rot: it runs the sweep and the nine replays through
the installed `kvc`, publishes its figures, and leaves BENCHMARKS.md alone with --no-write. The ratio is a timing:
printed, never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_toy_sweep_against_nine_replays_publishes_its_ratio(tmp_path):
    figures = tmp_path / "figures.jsonl"
    before = (ROOT / "BENCHMARKS.md").read_bytes()
    result = subprocess.run([sys.executable, "bench_sweep.py", "--requests", "20", "--workers", "1", "--no-write"],
                            cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, KVC_BENCH_JSON=str(figures)))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert (ROOT / "BENCHMARKS.md").read_bytes() == before
    assert "Ownership audits: ok" in result.stdout
    assert result.stdout.count("\n| 4,096 |") + result.stdout.count("\n| 16,384 |") + \
        result.stdout.count("\n| 65,536 |") == 9  # a row per size
    ratios = json.loads(figures.read_text())["ratios"]
    assert set(ratios) == {"sweep_over_replays", "sweep_over_replays_cpu", "sweep_seconds", "replays_seconds"}
    assert ratios["sweep_seconds"] > 0 and ratios["replays_seconds"] > 0
