"""Start-up time of the kvc commands that move no KV (issue 13: under 0.5 s, so a Prometheus textfile scrape, a cron
audit or a shell loop can call kvc freely).

Each command runs as a fresh process of the installed `kvc`, on a small LMDB store made for the run; the wall
time of each run is measured from here (fork/exec to exit), and the median of `--runs` runs is reported, next to
two baselines measured in the same run: `python -c pass` (the interpreter alone) and `python -c "import torch"`
(what these commands no longer pay). The machine's load average is recorded beside the figures: the machine is
shared, and start-up time moves with it.

    python benchmarks/bench_startup.py [--runs 5] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _report import machine, publish, table

KVC = Path(sys.executable).with_name("kvc")
COMMANDS = {
    "kvc --version": ["--version"],
    "kvc --help": ["--help"],
    "kvc ns ls": ["ns", "ls"],
    "kvc stats": ["stats"],
    "kvc stats --prom": ["stats", "--prom"],
    "kvc audit": ["audit"],
}
TARGET_S = 0.5


def _once(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.decode()[-500:]}")
    return elapsed


def walls(cmds: dict[str, list[str]], env: dict[str, str], runs: int) -> dict[str, list[float]]:
    """Wall seconds of `runs` runs of each command, round-robin (so a burst of load on this shared machine falls on
    every command alike), after one untimed round that warms the page cache."""
    times: dict[str, list[float]] = {name: [] for name in cmds}
    for i in range(runs + 1):
        for name, cmd in cmds.items():
            elapsed = _once(cmd, env)
            if i:
                times[name].append(elapsed)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="timed runs per command (the median is reported)")
    parser.add_argument("--no-write", action="store_true", help="print the section, do not write BENCHMARKS.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvc-bench-startup-") as tmp:
        store = Path(tmp) / "store"
        env = dict(os.environ, KVC_STORE=str(store), KVC_SALT="bench-startup-salt")
        subprocess.run([str(KVC), "init", "--page-size", "16"], env=env, check=True, stdout=subprocess.DEVNULL)
        for tenant in range(8):
            subprocess.run([str(KVC), "put", "--extra-key", f"tenant-{tenant}", "--tokens",
                            ",".join(map(str, range(tenant, tenant + 256)))], env=env, check=True,
                           stdout=subprocess.DEVNULL)
        load_before = os.getloadavg()
        cmds = {"python": [sys.executable, "-c", "pass"], "torch": [sys.executable, "-c", "import torch"],
                **{name: [str(KVC), *argv] for name, argv in COMMANDS.items()}}
        results = walls(cmds, env, args.runs)
        python, torch = (statistics.median(results.pop(k)) for k in ("python", "torch"))
        load_after = os.getloadavg()
    rows = []
    ratios: dict[str, float] = {}
    for name, times in results.items():
        med = statistics.median(times)
        rows.append([f"`{name}`", f"{med:.3f}", f"{min(times):.3f}", f"{max(times):.3f}", f"{med / python:.1f}x",
                     "meets" if med < TARGET_S else "**ABOVE**"])
        key = name.removeprefix("kvc ").replace("--", "").replace(" ", "_")
        ratios[f"kvc_{key}_seconds"] = med
        ratios[f"kvc_{key}_over_python"] = med / python
    body = "\n".join([
        "## Start-up of the commands that move no KV (`benchmarks/bench_startup.py`)",
        "",
        f"Wall time of a fresh `kvc` process from fork to exit, median of {args.runs} runs (round-robin over the "
        f"commands and baselines, after one untimed round), "
        f"on an LMDB store of 8 namespaces; stdout to /dev/null. Same-run baselines: `python -c pass` "
        f"{python:.3f} s, `python -c \"import torch\"` {torch:.3f} s (what these commands no longer import: a "
        f"test asserts it). Target: under {TARGET_S} s. Load average before / after: "
        f"{load_before[0]:.2f} / {load_after[0]:.2f} (the machine is shared: figures move with it). "
        f"Machine: {machine()}. Command: `python benchmarks/bench_startup.py --runs {args.runs}`.",
        "",
        table(["command", "median s", "min s", "max s", "vs python -c pass", f"< {TARGET_S} s"], rows),
    ])
    publish("bench_startup", body, args.no_write, ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
