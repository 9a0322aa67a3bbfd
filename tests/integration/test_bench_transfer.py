"""benchmarks/bench_transfer.py at a toy size, so the script cannot rot: both pool kinds, both page orders, the
limit beside them, bytes checked by the script, figures published, BENCHMARKS.md left alone with --no-write. The
ratios are timings: printed, never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_toy_transfer_run_measures_every_variant_against_the_limit(tmp_path):
    figures = tmp_path / "figures.jsonl"
    before = (ROOT / "BENCHMARKS.md").read_bytes()
    result = subprocess.run([sys.executable, "bench_transfer.py", "--mib", "1", "--rounds", "1", "--pages-kib",
                             "4,128", "--device", "cpu", "--no-write"], cwd=ROOT / "benchmarks", capture_output=True,
                            text=True, timeout=300, env=dict(os.environ, KVC_BENCH_JSON=str(figures)))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert (ROOT / "BENCHMARKS.md").read_bytes() == before
    rows = [line for line in result.stdout.splitlines() if line.startswith("| 4 KiB") or line.startswith("| 128 KiB")]
    assert len(rows) == 8  # 2 page sizes x 2 pool kinds x 2 page orders
    ratios = json.loads(figures.read_text())["ratios"]
    assert set(ratios) == {f"{kind}_{order}_128k_over_limit" for kind in ("token_major", "layer_first")
                           for order in ("scattered", "consecutive")}
    assert all(v > 0 for v in ratios.values())
