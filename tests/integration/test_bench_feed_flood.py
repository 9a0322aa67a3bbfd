"""benchmarks/bench_feed_flood.py at a toy size: `kvc serve --events` runs a live replay quiet, under 64 replay
flooders and quiet again, a well-behaved client fetches the whole buffer meanwhile, and the headline figures
`kvc bench` reads are published. Neither speed nor memory is asserted here (tests/unit/live/test_events.py bounds
the memory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_toy_run_publishes_the_rss_growth_and_the_throughput_ratio(tmp_path):
    figures = tmp_path / "figures.jsonl"
    before = (ROOT / "BENCHMARKS.md").read_bytes()
    result = subprocess.run([sys.executable, "bench_feed_flood.py", "--seconds", "0", "--requests", "100",
                             "--events-buffer", "100", "--no-write"], cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=600,
                            env=dict(os.environ, KVC_BENCH_JSON=str(figures)))
    assert result.returncode == 0, result.stderr[-2000:]
    assert (ROOT / "BENCHMARKS.md").read_bytes() == before  # --no-write
    assert "| server RSS growth over the flood, peak (bound <= 64 MiB) | **" in result.stdout
    assert "no gap" in result.stdout  # the well-behaved client's fetch, flooders or not
    doc = json.loads(figures.read_text())
    assert doc["script"] == "bench_feed_flood"
    assert {f["name"]: (f["unit"], f["better"]) for f in doc["figures"]} == {
        "replay_ratio_with_feed_flooders": ("x (throughput ratio to no client)", "higher"),
        "feed_flood_rss_growth_mib": ("MiB", "lower")}
    assert doc["ratios"]["replay_ratio_with_feed_flooders"] > 0
