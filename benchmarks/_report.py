"""Shared by the benchmark scripts: environment facts and the BENCHMARKS.md section each script owns."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
_HEADER = ("# Benchmarks\n\nWritten by the scripts under `benchmarks/`; each owns the section between its markers. "
           "Figures are ratios against baselines measured in the same run, so they travel between machines better "
           "than the absolute numbers beside them.\n")


def machine() -> str:
    """One line describing where the figures were measured."""
    import numpy
    import torch

    return (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"torch {torch.__version__}, numpy {numpy.__version__}")


def write_section(name: str, body: str, path: Path = BENCHMARKS_MD) -> None:
    """Replace (or append) the section `name` of BENCHMARKS.md with `body`."""
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    text = path.read_text() if path.exists() else _HEADER
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def spread(values: list[float], digits: int = 2, unit: str = "x") -> str:
    """`median (min-max)` of the figures of repeated runs; the median alone for one run."""
    import statistics

    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}{unit}"
    return f"{med:.{digits}f}{unit} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# What a headline figure measures, by its name: (pattern, unit, which way is better). First match wins; every
# figure a script publishes must match one (tests/unit/test_bench_report.py checks the names the scripts use).
FIGURES: list[tuple[str, str, str]] = [
    (r"_per_s(\[|_|$)", "per second", "higher"),
    (r"_cost_ratio$", "x (cost ratio)", "lower"),
    (r"gbps$", "GB/s", "higher"),
    (r"_seconds$", "seconds", "lower"),
    (r"^ledger_overhead|_over_no_|^verify_over_|_over_python$", "x (time ratio)", "lower"),
    (r"^replay_ratio_with", "x (throughput ratio to no client)", "higher"),
    (r"_footprint_over_payload", "x (disk / payload)", "lower"),
    (r"_over_", "x (speed ratio)", "higher"),
    (r"_hit_rate_", "fraction of tokens found cached", "higher"),
    (r"_mib$", "MiB", "lower"),
]


def meaning(figure: str) -> tuple[str, str]:
    """(unit, "higher" or "lower" is better) of a headline figure's name; ("?", "?") when none matches."""
    for pattern, unit, better in FIGURES:
        if re.search(pattern, figure):
            return unit, better
    return "?", "?"


def publish(name: str, body: str, no_write: bool, ratios: dict[str, float]) -> None:
    """A script's result: print `body`, write it as section `name` of BENCHMARKS.md unless `no_write`, and, when
    `kvc bench` runs the script (env KVC_BENCH_JSON names a file), append the headline figures there as one JSON
    line, each with its unit and which way is better, so the CLI can print them."""
    import json

    print(body)
    if not no_write:
        write_section(name, body)
    out = os.environ.get("KVC_BENCH_JSON")
    if out:
        figures = [{"name": k, "value": v, "unit": meaning(k)[0], "better": meaning(k)[1]} for k, v in ratios.items()]
        with open(out, "a") as f:
            f.write(json.dumps({"script": name, "ratios": ratios, "figures": figures}) + "\n")
