"""benchmarks/bench_engine_sglang.py: one line and exit 0 without SGLang's interpreter; at toy size with it (the
figures are printed, never asserted, and BENCHMARKS.md is left alone with --no-write)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_engine_sglang.py"


def run(*args: str, peer: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KVC_PEER_PYTHON"}
    if peer:
        env["KVC_PEER_PYTHON"] = peer
    return subprocess.run([sys.executable, str(SCRIPT), "--no-write", *args], env=env, cwd=SCRIPT.parent,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(("peer", "why"), [
    (None, "no peer interpreter"),
    ("/nonexistent/python", "does not run"),
])
def test_without_sglangs_interpreter_it_skips_in_one_line(peer, why):
    before = (ROOT / "BENCHMARKS.md").read_text()
    proc = run(peer=peer)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_engine_sglang: skipped: ") and why in lines[0], lines
    assert (ROOT / "BENCHMARKS.md").read_text() == before


def test_at_toy_size_it_measures_both_interfaces_against_file():
    pytest.importorskip("sglang", reason="SGLang is not installed here: `make engine-check` runs this in its venv")
    before = (ROOT / "BENCHMARKS.md").read_text()
    proc = run("--rounds", "1", "--pages", "128", peer=sys.executable)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "KiB" in line]
    assert [r.split(" | ")[2] for r in rows] == ["generic", "v1", "v1-nosync"] * 3, proc.stdout
    assert "Acceptance (64 KiB pages" in proc.stdout
    assert (ROOT / "BENCHMARKS.md").read_text() == before
