"""`kvc bench`: run the benchmark scripts of a source checkout and print their headline ratios."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated

import msgspec
import typer

from ..errors import EXIT_FOUND, UsageError
from ..options import DebugOpt, JsonOpt
from ..render.output import Column, Kind, Listing, emit_json, output_format, render, say
from ..render.progress import progress
from ..reporting import command

# script -> arguments of its quick run (a few seconds each; the full runs are what BENCHMARKS.md records)
QUICK_ARGS: dict[str, list[str]] = {
    "bench_tree": ["--sequences", "400", "--repeat", "1"],
    "bench_prefetch": ["--pages", "256", "--sequences", "400", "--repeat", "1"],
    "bench_replay": ["--pages", "512", "--requests", "1000", "--repeat", "1"],
    "bench_l3": ["--store-mb", "32", "--redis-mb", "32", "--repeat", "1", "--runs", "1"],
    "bench_admin": ["--requests", "500", "--round-trips", "500", "--repeat", "1"],
    "bench_events": ["--requests", "300", "--repeat", "2"],
    "bench_startup": ["--runs", "3"],
    "bench_scale": ["--requests", "4000"],
    "bench_shares": ["--b-requests", "40"],
    "bench_feed_flood": ["--seconds", "3", "--requests", "100"],
    "bench_audit": ["--pages", "50000", "--rounds", "1"],
    "bench_page_layout": ["--store-mb", "32", "--rounds", "3"],
    "bench_sweep": ["--requests", "1000"],
}
DEFAULT_DIR = Path(__file__).resolve().parents[3] / "benchmarks"  # cli/kvc/commands/ -> the checkout's benchmarks/


class BenchFigure(msgspec.Struct, frozen=True):
    """One headline figure: its value, its unit, and which way is better."""

    name: str
    value: float
    unit: str  # e.g. "x (speed ratio)", "x (time ratio)", "per second", "GB/s", "seconds"; "?" when unknown
    better: str  # "higher" or "lower" ("?" when the script did not say)


class BenchScript(msgspec.Struct):
    """One script's run."""

    script: str
    exit_code: int
    seconds: float
    ratios: dict[str, float]  # the script's headline figures by name (ratios to same-run baselines, rates)
    figures: list[BenchFigure]  # the same, each with its unit and direction
    report: str  # the Markdown section it printed (what BENCHMARKS.md holds after a --write run)


class BenchOutput(msgspec.Struct):
    """`kvc bench --json`."""

    directory: str
    quick: bool
    scripts: list[BenchScript]


@command
def bench(
    only: Annotated[list[str] | None, typer.Option(
        "--only", help="Run only this script (repeatable), e.g. --only bench_replay.")] = None,
    quick: Annotated[bool, typer.Option(
        "--quick/--full", help="Small sizes (seconds per script) or the scripts' full defaults.")] = True,
    write: Annotated[bool, typer.Option(
        "--write", help="Let the scripts rewrite their sections of BENCHMARKS.md (full runs only).")] = False,
    directory: Annotated[Path, typer.Option(
        "--dir", help="The benchmarks/ directory of a kvc source checkout.")] = DEFAULT_DIR,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Run the benchmark scripts (benchmarks/bench_*.py) and print the ratios each measures against its
    same-run baseline (memcpy, a one-file-per-page store, the ledger switched off). Exit 1 if a script fails."""
    if write and quick:
        raise UsageError("--write records full runs only: add --full")
    scripts = sorted(p.stem for p in directory.glob("bench_*.py")) if directory.is_dir() else []
    if not scripts:
        raise UsageError(f"{directory}: no benchmark scripts here (kvc bench runs from a source checkout; "
                         f"pass --dir)")
    if only:
        unknown = sorted(set(only) - set(scripts))
        if unknown:
            raise UsageError(f"--only {', '.join(unknown)}: not among {', '.join(scripts)}")
        scripts = [s for s in scripts if s in only]
    results = []
    with tempfile.TemporaryDirectory(prefix="kvc-bench-") as tmp, \
            progress("bench", len(scripts), not json) as advance:
        for i, name in enumerate(scripts):
            results.append(_run(directory, name, quick, write, Path(tmp) / f"{name}.jsonl"))
            advance(i + 1)
    result = BenchOutput(str(directory), quick, results)
    if json:
        emit_json(result)
    else:
        _print(result)
    if any(r.exit_code for r in results):
        raise typer.Exit(EXIT_FOUND)


def _run(directory: Path, name: str, quick: bool, write: bool, ratios_file: Path) -> BenchScript:
    args = [sys.executable, f"{name}.py", *(QUICK_ARGS.get(name, []) if quick else [])]
    if not write:
        args.append("--no-write")
    start = time.perf_counter()
    proc = subprocess.run(args, cwd=directory, capture_output=True, text=True,
                          env=dict(os.environ, KVC_BENCH_JSON=str(ratios_file)))
    seconds = time.perf_counter() - start
    ratios: dict[str, float] = {}
    figures: list[BenchFigure] = []
    if ratios_file.exists():
        for line in ratios_file.read_text().splitlines():
            doc = msgspec.json.decode(line)
            ratios.update(doc["ratios"])
            figures += [BenchFigure(**f) for f in doc.get("figures", [])]
    known = {f.name for f in figures}
    figures += [BenchFigure(k, v, "?", "?") for k, v in ratios.items() if k not in known]
    report = proc.stdout if proc.returncode == 0 else (proc.stdout + proc.stderr)[-2000:]
    return BenchScript(name, proc.returncode, seconds, ratios, figures, report)


def _print(result: BenchOutput) -> None:
    rows: list[list] = []
    for r in result.scripts:
        if r.exit_code:
            rows.append([r.script, f"FAILED (exit {r.exit_code})", None, "", "", r.seconds])
            continue
        for i, f in enumerate(r.figures):
            better = f"{f.better} is better" if f.better != "?" else "?"
            rows.append([r.script if i == 0 else "", f.name, f.value, f.unit, better, r.seconds if i == 0 else None])
        if not r.figures:
            rows.append([r.script, "(no headline figures: see its report)", None, "", "", r.seconds])
    columns = [Column("script"), Column("figure"), Column("value", Kind.FLOAT), Column("unit"),
               Column("better"), Column("seconds", Kind.FLOAT)]
    render(Listing(f"kvc bench ({'quick' if result.quick else 'full'} runs of {result.directory})", columns, rows),
           output_format(None), titled=True)
    for r in result.scripts:
        if r.exit_code:
            from rich.markup import escape

            say(escape(f"{r.script} failed:\n{r.report}"))
