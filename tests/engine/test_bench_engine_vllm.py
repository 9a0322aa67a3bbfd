"""benchmarks/bench_engine_vllm.py: one line and exit 0 without vLLM's interpreter; at toy size with it (the figures
are printed, never asserted; the integrity rows are: `fs` hands vLLM the corrupt chunk, kvc never does; BENCHMARKS.md
is left alone with --no-write)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_engine_vllm.py"


def run(*args: str, python: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KVC_VLLM_PYTHON"}
    if python:
        env["KVC_VLLM_PYTHON"] = python
    return subprocess.run([sys.executable, str(SCRIPT), "--no-write", *args], env=env, cwd=SCRIPT.parent,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(("python", "why"), [
    (None, "no vLLM interpreter"),
    ("/nonexistent/python", "does not run"),
])
def test_without_vllms_interpreter_it_skips_in_one_line(python, why):
    before = (ROOT / "BENCHMARKS.md").read_text()
    proc = run(python=python)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_engine_vllm: skipped: ") and why in lines[0], lines
    assert (ROOT / "BENCHMARKS.md").read_text() == before


def test_at_toy_size_it_measures_kvc_against_fs_and_counts_corrupt_chunks_handed():
    pytest.importorskip("vllm.v1.kv_offload.tiering.base", reason="vLLM is not installed here: `make engine-check` "
                                                                   "runs this in its venv")
    before = (ROOT / "BENCHMARKS.md").read_text()
    proc = run("--rounds", "1", "--mib", "8", "--prompts", "2", python=sys.executable)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| ")]
    figures = [c for c in cells if len(c) == 5 and c[0] != "chunk"]
    assert [(c[0], c[1]) for c in figures] == [
        (size, tier) for size in ("256 KiB", "2 MiB")
        for tier in ("fs", "kvc", "kvc-nosync", "kvc-nosync-4io", "fs-buffered (reference)")], proc.stdout
    integrity = {(c[0], c[1]): c[4] for c in cells if len(c) == 6 and c[0] != "chunk"}
    assert integrity == {(size, tier): "**1**" if tier == "fs" else "**0**"
                         for size in ("256 KiB", "2 MiB")
                         for tier in ("fs", "kvc", "kvc-nosync", "kvc-nosync-4io")}, proc.stdout
    assert any(line.startswith("Acceptance (2 MiB chunks") for line in lines), proc.stdout
    assert (ROOT / "BENCHMARKS.md").read_text() == before
