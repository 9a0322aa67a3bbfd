"""Two kvc trees on the same benchmarks, interleaved: does a change move the figures?

Each round runs every script once under each interpreter (`--python LABEL=PATH`, e.g. one whose kvcache is the
checkout before a change and one after), alternating which goes first, each with `--no-write`; the scripts'
headline figures (what `publish` hands `kvc bench` through KVC_BENCH_JSON) are collected per run. The table gives,
per figure, each side's median (min-max) over the rounds and the second side's median over the first's, with
which way is better: interleaving puts both sides under the same machine load, so the ratio means more than
either side's absolute figure on a shared machine.

Run: ``python benchmarks/bench_ab.py --python before=/path/old/python --python after=.venv/bin/python
--script "bench_tree.py --repeat 3" --script "bench_scale.py --requests 20000" --rounds 3``
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _report import machine, meaning, publish, table

HERE = Path(__file__).resolve().parent


def run_once(python: str, script: list[str]) -> dict[str, float]:
    """One run of `script` (its path and arguments, under benchmarks/) under `python`: its headline figures."""
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as out:
        env = dict(os.environ, KVC_BENCH_JSON=out.name)
        proc = subprocess.run([python, str(HERE / script[0]), *script[1:], "--no-write"], env=env, cwd=HERE,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"bench_ab: {' '.join(script)} under {python} exited {proc.returncode}:\n"
                             f"{proc.stderr[-2000:]}")
        figures: dict[str, float] = {}
        for line in Path(out.name).read_text().splitlines():
            figures.update(json.loads(line)["ratios"])
        return figures


def _spread(values: list[float]) -> str:
    """`median (min-max)`, four significant digits (figures range from microseconds to millions per second)."""
    med = statistics.median(values)
    return f"{med:.4g}" if len(values) == 1 else f"{med:.4g} ({min(values):.4g}-{max(values):.4g})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", action="append", default=[], metavar="LABEL=PATH",
                    help="an interpreter whose installed kvcache is measured (exactly two)")
    ap.add_argument("--script", action="append", default=[],
                    help="a benchmark script under benchmarks/ and its arguments, quoted (repeatable)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are of these (default 3)")
    ap.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    args = ap.parse_args()
    if not args.python and not args.script:  # `make bench` runs every script bare: nothing to compare
        print("bench_ab: skipped: give two --python LABEL=PATH and at least one --script")
        return 0
    if not args.script:
        ap.error("give at least one --script")
    sides = [spec.partition("=")[::2] for spec in args.python]
    if len(sides) != 2 or not all(label and path for label, path in sides):
        ap.error("give exactly two --python LABEL=PATH")
    scripts = [shlex.split(s) for s in args.script]
    got: dict[str, dict[str, list[float]]] = {label: {} for label, _ in sides}
    for r in range(args.rounds):
        order = sides if r % 2 == 0 else sides[::-1]  # who goes first alternates: drift hits both sides alike
        for script in scripts:
            for label, python in order:
                print(f"bench_ab: round {r + 1}/{args.rounds}: {' '.join(script)} under {label}", file=sys.stderr)
                for name, value in run_once(python, script).items():
                    got[label].setdefault(name, []).append(value)
    (a, _), (b, _) = sides
    rows = []
    for name in sorted(set(got[a]) & set(got[b])):
        unit, better = meaning(name)
        ratio = statistics.median(got[b][name]) / statistics.median(got[a][name])
        rows.append([name, unit, better, _spread(got[a][name]), _spread(got[b][name]), f"{ratio:.3f}"])
    body = "\n".join([
        "## A/B: two kvc trees on the same benchmarks, interleaved (`benchmarks/bench_ab.py`)",
        "",
        f"{args.rounds} rounds; each runs {', '.join(f'`{s}`' for s in args.script)} under `{a}` and `{b}` in "
        f"alternating order. Medians (min-max) of each headline figure; the last column is `{b}`'s median over "
        f"`{a}`'s (above 1 is better where higher is, below 1 where lower is). Machine: {machine()}.",
        "",
        table(["figure", "unit", "better", a, b, f"{b} / {a}"], rows),
    ])
    # the per-figure ratios are not headline figures of their own (their unit is their figure's)
    publish("bench_ab", body, args.no_write, {})
    return 0


if __name__ == "__main__":
    sys.exit(main())
