"""benchmarks/bench_l3.py at a toy size: the memcpy baseline copies the right bytes (the script checks the rows
against the source), two runs give every ratio as median (min-max), and the headline figures `kvc bench` reads
include the read and write ratios against memcpy. Speed is never asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_two_toy_runs_publish_ratios_against_memcpy_with_their_spread(tmp_path):
    figures = tmp_path / "figures.jsonl"
    before = (ROOT / "BENCHMARKS.md").read_bytes()
    result = subprocess.run(
        [sys.executable, "bench_l3.py", "--store-mb", "1", "--repeat", "1", "--runs", "2", "--read-passes", "1",
         "--no-redis", "--no-peer", "--no-write", "--scratch", str(tmp_path)],
        cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=300,
        env=dict(os.environ, KVC_BENCH_JSON=str(figures)))
    assert result.returncode == 0, result.stderr[-2000:]
    assert (ROOT / "BENCHMARKS.md").read_bytes() == before  # --no-write
    per_run = [line for line in result.stdout.splitlines() if line.startswith("run ") and "kvc read" in line]
    assert len(per_run) == 6 and all("memcpy" in line for line in per_run)  # 2 runs x 3 page sizes
    # where a read's time goes, per run and size, and its table: the copy out of LMDB's map, + lookups, + xxh3
    anatomy = [line for line in result.stdout.splitlines() if line.startswith("run ") and "anatomy" in line]
    assert len(anatomy) == 6 and all("copy from LMDB's map" in line for line in anatomy)
    assert "| page | copy from views into LMDB's map, held |" in result.stdout
    rows = [line for line in result.stdout.splitlines() if line.startswith(("| 16 KiB", "| 64 KiB", "| 256 KiB"))]
    assert len(rows) == 6
    rows = rows[:3]  # the main table (the anatomy table's rows follow)
    for row in rows:  # the read and write ratios against memcpy, each a median with its (min-max)
        cells = [c.strip() for c in row.strip("|").split("|")]
        for cell in (cells[4], cells[9]):
            assert cell.startswith("**") and "x (" in cell and cell.endswith(")**"), cell
        assert cells[5] == cells[6] == "-"  # no HiCacheFile without the peer
        low, high = cells[13].split(" (")[1].rstrip(")").split("-")  # the data file against the payload
        assert 1.0 <= float(low) <= float(high)
    doc = json.loads(figures.read_text())
    for kib in (16, 64, 256):
        for name in (f"lmdb_read_over_memcpy_{kib}k", f"lmdb_write_over_memcpy_{kib}k",
                     f"lmdb_write_over_files_{kib}k"):
            assert doc["ratios"][name] > 0
        assert doc["ratios"][f"lmdb_footprint_over_payload_{kib}k"] >= 1.0
    assert list(tmp_path.iterdir()) == [figures]  # the scratch directory (store, mapped file) is gone


PEER = os.environ.get("KVC_PEER_PYTHON")


@pytest.mark.skipif(not PEER, reason="SGLang's HiCacheFile needs the peer interpreter ($KVC_PEER_PYTHON)")
def test_hicache_file_reads_the_same_pages_in_the_same_rounds(tmp_path):
    figures = tmp_path / "figures.jsonl"
    result = subprocess.run(
        [sys.executable, "bench_l3.py", "--store-mb", "1", "--repeat", "1", "--runs", "1", "--read-passes", "1",
         "--no-redis", "--no-write", "--scratch", str(tmp_path)],
        cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=600,
        env=dict(os.environ, KVC_BENCH_JSON=str(figures)))
    assert result.returncode == 0, result.stderr[-2000:]
    # the worker's rows were checked against the pages (the script asserts it); one HiCacheFile line per size
    assert sum(line.startswith("run ") and "HiCacheFile read" in line for line in result.stdout.splitlines()) == 3
    doc = json.loads(figures.read_text())
    assert all(doc["ratios"][f"lmdb_read_over_hicache_file_{kib}k"] > 0 for kib in (16, 64, 256))
    assert list(tmp_path.iterdir()) == [figures]
