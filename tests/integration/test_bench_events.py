"""benchmarks/bench_events.py at a toy size: both kinds of run complete, the subscriber process receives exactly the
events the publisher sent (the script checks it), and the headline figures `kvc bench` reads are published. Speed
is never asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_toy_run_publishes_the_event_rate_and_the_slowdown(tmp_path):
    figures = tmp_path / "figures.jsonl"
    before = (ROOT / "BENCHMARKS.md").read_bytes()
    result = subprocess.run([sys.executable, "bench_events.py", "--requests", "30", "--repeat", "1", "--no-write"],
                            cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, KVC_BENCH_JSON=str(figures)))
    assert result.returncode == 0, result.stderr[-2000:]
    assert (ROOT / "BENCHMARKS.md").read_bytes() == before  # --no-write
    runs = [line for line in result.stdout.splitlines() if line.startswith("run ")]
    assert len(runs) == 1 and "events in" in runs[0]
    assert "| replay wall time, with the feed over without (target <= 1.10x) | **" in result.stdout
    doc = json.loads(figures.read_text())
    assert doc["script"] == "bench_events"
    assert {f["name"]: (f["unit"], f["better"]) for f in doc["figures"]} == {
        "replay_time_events_over_no_events": ("x (time ratio)", "lower"),
        "replay_cpu_events_over_no_events": ("x (time ratio)", "lower"),
        "kv_events_published_per_s": ("per second", "higher"),
        "replay_time_feed_alone_over_no_events": ("x (time ratio)", "lower")}
    assert doc["ratios"]["kv_events_published_per_s"] > 0
