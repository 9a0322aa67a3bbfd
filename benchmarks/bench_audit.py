"""`kvc audit` of a large LMDB store: the serial audit against the one read by worker processes, and an
incremental audit after 1 % of the pages changed against a full one, same run.

The store (--pages pages of a small layout: 4 tokens, 64 B of payload each, in chains of 64 written by bulk puts
of ~16k pages, durability "none") is built in a scratch directory once, audited clean (which records the audit),
and then --changed-percent of its page count is written anew (new chains, after a recorded time T). Each round
then runs, in turn:

  main      (with --main PATH) the audit of another checkout's code (`audit_store(location)` as that checkout
            has it: PATH/kvcache): today's serial audit, to show that `serial` below is as fast as it;
  serial    `audit_store(location, scope=AuditScope(workers=1))`: one process reads every page, the code path of
            the audit before workers existed (the baseline of the parallel ratio);
  parallel  the same with --workers worker processes (default: the cores): what `kvc audit` runs;
  since     `AuditScope(since=T, workers=--workers)`: only the pages written after T (`kvc audit --since`).

Each is the library call `kvc audit` makes, timed (wall clock) in a fresh Python process so no run inherits a
warm interpreter or an open environment from another; the store is in the page cache for all of them (a warm-up
audit runs first). Figures are medians of --rounds rounds (interleaved: drift in the machine's load reaches every
variant alike), with their min-max. The machine's 1-minute load average is sampled before each timed run and
published with the figures: on a machine other processes share, the parallel ratio says little unless the load
left the cores to the audit.

Run: ``python benchmarks/bench_audit.py [--pages 1000000] [--rounds 5] [--workers N] [--main /path/to/checkout]
[--scratch DIR] [--no-write]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from _report import machine, publish, spread, table

ROOT = Path(__file__).resolve().parents[1]
CHAIN = 64  # pages per chain
BATCH = 16384  # pages per put (one write transaction)
TARGET_PARALLEL = 0.6  # parallel / serial wall time, 2 cores (issue 27)
TARGET_SINCE = 0.1  # incremental after 1 % changed / parallel full

# Run in a fresh process per timed audit: argv = location, code root, workers, since ("" = full), "main"/"new".
TIMED = r"""
import json, sys, time
root, location, workers, since, which = sys.argv[1:6]
sys.path.insert(0, root)
from kvcache.diagnostics.audit import audit_store
if which == "main":
    start = time.perf_counter()
    report = audit_store(location)
else:
    from kvcache.storage.verify_parts import AuditScope
    scope = AuditScope(workers=int(workers), since=float(since) if since else None)
    start = time.perf_counter()
    report = audit_store(location, scope=scope)
wall = time.perf_counter() - start
print(json.dumps({"wall": wall, "ok": report.ok, "pages": report.pages_checked}))
"""


def build(path: str, pages: int, seed: int, first: bool) -> None:
    """`pages` pages in chains of CHAIN, written by bulk puts (`first`: create the store)."""
    from kvcache import KVLayout, Namespace, page_origins
    from kvcache.storage.lmdb.store import LMDBStore
    from kvcache.types.keys import pack_tokens

    layout = KVLayout("audit-bench@r1", layers=1, kv_heads=1, head_dim=8, dtype="float16", page_size=4)
    rng = np.random.default_rng(seed)
    ns = Namespace("bench", "bench-salt")
    with LMDBStore.open(path, layout, create=first, durability="none", map_size=1 << 30) as store:
        done = 0
        while done < pages:
            hashes: list[bytes] = []
            origins: list = []
            while len(hashes) < BATCH and done + len(hashes) < pages:
                n = min(CHAIN, pages - done - len(hashes))
                tokens = rng.integers(0, 1 << 30, n * layout.page_size, dtype=np.uint32)
                h, o = page_origins(layout, pack_tokens(tokens.tolist()), ns, store.chain_key)
                hashes += h
                origins += o
            payload = rng.integers(0, 255, (len(hashes), layout.bytes_per_page), dtype=np.uint8)
            result = store.put(hashes, list(payload), origins)
            assert result.written == len(hashes), result
            done += len(hashes)


def timed(root: Path, location: str, workers: int, since: float | None, which: str) -> dict:
    """One audit in a fresh process: its wall time, outcome and pages checked, and the load before it."""
    load = os.getloadavg()[0]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", TIMED, str(root), location, str(workers),
                           "" if since is None else repr(since), which],
                          capture_output=True, text=True, env=env, timeout=3600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the {which} audit failed: {done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if not out["ok"]:
        raise SystemExit(f"the {which} audit found violations in the benchmark's store")
    out["load"] = load
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=1_000_000, help="pages in the store")
    parser.add_argument("--changed-percent", type=float, default=1.0, help="pages written anew before --since")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians are published)")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="processes that read")
    parser.add_argument("--main", type=Path, default=None, help="another checkout whose audit is timed too")
    parser.add_argument("--scratch", default=None, help="directory for the store (default: a temporary one)")
    parser.add_argument("--no-write", action="store_true", help="print, do not write BENCHMARKS.md")
    args = parser.parse_args()

    scratch = tempfile.mkdtemp(prefix="kvc-bench-audit-", dir=args.scratch)
    try:
        location = os.path.join(scratch, "store")
        start = time.perf_counter()
        build(location, args.pages, seed=1, first=True)
        built_s = time.perf_counter() - start
        first = timed(ROOT, location, args.workers, None, "new")  # warms the page cache, records a clean audit
        assert first["pages"] == args.pages
        changed = max(1, int(args.pages * args.changed_percent / 100))
        since = time.time()
        build(location, changed, seed=2, first=False)
        variants = (["main"] if args.main is not None else []) + ["serial", "parallel", "since"]
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        for r in range(args.rounds):
            for v in variants:
                if v == "main":
                    out = timed(args.main.resolve(), location, 1, None, "main")
                else:
                    out = timed(ROOT, location, 1 if v == "serial" else args.workers,
                                since if v == "since" else None, "new")
                runs[v].append(out)
                print(f"round {r + 1} {v}: {out['wall']:.3f} s, {out['pages']:,} pages, load {out['load']:.2f}",
                      flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def walls(v: str) -> list[float]:
        return [o["wall"] for o in runs[v]]

    parallel_ratio = [p / s for p, s in zip(walls("parallel"), walls("serial"), strict=True)]
    since_ratio = [i / p for i, p in zip(walls("since"), walls("parallel"), strict=True)]
    loads = [o["load"] for v in variants for o in runs[v]]
    rows = [[v, f"{statistics.median(walls(v)):.3f} s", spread(walls(v), 3, " s"), f"{runs[v][0]['pages']:,}"]
            for v in variants]
    ratios = {"audit_parallel_cost_ratio": statistics.median(parallel_ratio),
              "audit_since_cost_ratio": statistics.median(since_ratio)}
    lines = [f"- parallel / serial (wall): **{spread(parallel_ratio)}** (target <= {TARGET_PARALLEL}x)",
             f"- incremental after {args.changed_percent:g} % changed / parallel full: **{spread(since_ratio)}** "
             f"(target <= {TARGET_SINCE}x)"]
    if "main" in runs:
        main_ratio = [s / m for s, m in zip(walls("serial"), walls("main"), strict=True)]
        ratios["audit_serial_vs_main_cost_ratio"] = statistics.median(main_ratio)
        lines.append(f"- serial (this code, one process) / main's audit: **{spread(main_ratio)}**")
    body = "\n".join([
        "## Integrity audit (`benchmarks/bench_audit.py`)",
        "",
        f"{machine()}. A store of {args.pages:,} pages of 64 B (chains of {CHAIN}; built in {built_s:.0f} s), then "
        f"{changed:,} pages written anew; {args.rounds} interleaved rounds, medians (min-max), each audit the "
        f"library call `kvc audit` makes, in a fresh process, store in the page cache; {args.workers} worker "
        f"process(es) for `parallel` and `since`. Load average (1 min) before the timed runs: median "
        f"{statistics.median(loads):.2f}, {min(loads):.2f}-{max(loads):.2f}.",
        "",
        table(["audit", "wall (median)", "wall (min-max)", "pages checked"], rows),
        "",
        *lines,
    ])
    publish("bench_audit", body, args.no_write, ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
