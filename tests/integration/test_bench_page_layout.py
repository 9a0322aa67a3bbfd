"""benchmarks/bench_page_layout.py at a toy size: it writes both value layouts, reads every page back verified,
publishes the read ratio and both footprints per page size, and leaves nothing behind. Speed is never asserted here;
the footprints are LMDB's page arithmetic, so they are."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_toy_run_publishes_the_read_ratio_and_both_footprints(tmp_path):
    figures = tmp_path / "figures.jsonl"
    before = (ROOT / "BENCHMARKS.md").read_bytes()
    result = subprocess.run(
        [sys.executable, "bench_page_layout.py", "--sizes", "4,16", "--store-mb", "2", "--rounds", "2", "--no-write",
         "--scratch", str(tmp_path)],
        cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=600,
        env=dict(os.environ, KVC_BENCH_JSON=str(figures)))
    assert result.returncode == 0, result.stderr[-2000:]
    assert (ROOT / "BENCHMARKS.md").read_bytes() == before  # --no-write
    assert "| 4 KiB | 512 |" in result.stdout and "| 16 KiB | 128 |" in result.stdout
    doc = json.loads(figures.read_text())
    assert doc["script"] == "bench_page_layout"
    ratios = doc["ratios"]
    assert set(ratios) == {f"{name}[{kib}KiB]" for kib in (4, 16) for name in (
        "tail_in_key_read_over_value_read", "value_footprint_over_payload", "tail_in_key_footprint_over_payload")}
    assert all(ratios[f"tail_in_key_read_over_value_read[{kib}KiB]"] > 0 for kib in (4, 16))
    # A 4 KiB page takes two overflow pages as a value with its checksum, one with its tail in the key; a 16 KiB
    # page five and four. The B-tree leaves and LMDB's meta pages add a little on top.
    assert 2.0 <= ratios["value_footprint_over_payload[4KiB]"] < 2.3
    assert 1.0 <= ratios["tail_in_key_footprint_over_payload[4KiB]"] < 1.15
    assert 1.25 <= ratios["value_footprint_over_payload[16KiB]"] < 1.35
    assert 1.0 <= ratios["tail_in_key_footprint_over_payload[16KiB]"] < 1.05
    assert list(tmp_path.iterdir()) == [figures]  # the scratch directory (the stores) is gone
