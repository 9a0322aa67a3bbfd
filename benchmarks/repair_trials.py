"""Repair trials: `kvc audit --repair` on real stores of a few thousand pages, damaged five ways (issue 25, item 1).

A store is filled by `kvc replay` of a generated multi-tenant trace, then copied and damaged per trial:

- meta pages zeroed: the file's first 8 KiB (LMDB's two meta pages), the report's reproduction;
- random B-tree pages zeroed: five live branch or leaf pages, seeded;
- the file truncated: its last third cut off;
- a junk file: data.mdb replaced by random bytes of the same size (repair refused, then --force);
- kill -9 during the repair: the repair of zeroed meta pages stopped half-way through keeping the original (an
  event: it stops itself there, KVC_TEST_REPAIR_STOP) and killed with SIGKILL, then repaired again.

Each row: the pages the store held before the damage, the pages it holds after the repair, the pages lost, the
bytes of the data file the repair found unreadable, whether the original file was kept byte for byte, and the
exit codes of `audit`, `audit --repair` (and of the repair after the kill or with --force). Every store is checked
clean by a last `kvc audit` (the `clean` column). Not part of `make test`.

Run: ``python benchmarks/repair_trials.py [--requests N] [--seed S] [--keep DIR]``.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "faults"))
import lmdbpages  # noqa: E402  (the test kit's reader of LMDB's page format: finds live B-tree pages)

KVC = [sys.executable, "-m", "kvc"]


def kvc(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*KVC, *map(str, args)], capture_output=True, text=True, env=env, timeout=1800)


def pages_of(store: Path) -> int:
    done = kvc("stats", "--store", store, "--json")
    return json.loads(done.stdout)["pages"] if done.returncode == 0 else -1


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(where: Path, requests: int, seed: int) -> Path:
    store, trace = where / "template", where / "trace.jsonl"
    for argv in (("init", "--store", store, "--page-size", "16"),
                 ("generate", trace, "--requests", requests, "--seed", seed, "--tenants", 6),
                 ("replay", trace, "--store", store)):
        done = kvc(*argv)
        if done.returncode != 0:
            sys.exit(f"building the store: kvc {argv[0]} failed: {done.stderr.strip()}")
    return store


def zero_meta(store: Path, rng: random.Random) -> str:
    with open(store / "data.mdb", "r+b") as f:
        f.write(b"\0" * 8192)
    return "first 8 KiB zeroed"


def zero_tree_pages(store: Path, rng: random.Random) -> str:
    live = [p for p in lmdbpages.live_pages(str(store)) if p.kind in ("branch", "leaf")]
    picked = rng.sample(live, 5)
    psize = lmdbpages.page_size((store / "data.mdb").read_bytes()[:64])
    with open(store / "data.mdb", "r+b") as f:
        for p in picked:
            f.seek(p.pgno * psize)
            f.write(b"\0" * psize)
    return "zeroed " + ", ".join(f"{p.kind} of '{p.db}'" for p in picked)


def truncate(store: Path, rng: random.Random) -> str:
    size = (store / "data.mdb").stat().st_size
    os.truncate(store / "data.mdb", size * 2 // 3)
    return f"cut to {size * 2 // 3:,} of {size:,} bytes"


def junk(store: Path, rng: random.Random) -> str:
    size = (store / "data.mdb").stat().st_size
    (store / "data.mdb").write_bytes(rng.randbytes(size))
    return f"{size:,} random bytes"


def run_repair(store: Path, force: bool = False) -> tuple[int, dict]:
    done = kvc("audit", "--store", store, "--repair", "--json", *(["--force"] if force else []))
    return done.returncode, (json.loads(done.stdout) if done.stdout.strip() else {"error": done.stderr.strip()})


def killed_repair(store: Path) -> int:
    """The repair stopped half-way through keeping the original, killed with SIGKILL; returns the signal."""
    half = (store / "data.mdb").stat().st_size // 2
    env = dict(os.environ, KVC_TEST_REPAIR_STOP=f"keeping_original@{half}")
    with open(os.devnull, "wb") as null:
        proc = subprocess.Popen([*KVC, "audit", "--store", str(store), "--repair"], env=env, stdout=null,
                                stderr=null)
    _, status = os.waitpid(proc.pid, os.WUNTRACED)
    if not os.WIFSTOPPED(status):
        sys.exit(f"the repair never reached its stop point (status {status})")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return -proc.returncode


def trial(name: str, template: Path, work: Path, damage, rng: random.Random, before: int) -> dict:
    store = work / name.replace(" ", "-")
    shutil.copytree(template, store)
    note = damage(store, rng)
    damaged = digest(store / "data.mdb")
    audit = kvc("audit", "--store", store)
    codes = [str(audit.returncode)]
    if name == "kill -9 during the repair":
        sig = killed_repair(store)
        intact = digest(store / "data.mdb") == damaged
        note += f"; repair killed by signal {sig} half-way through keeping the original: data.mdb " + \
                ("untouched" if intact else "CHANGED")
        codes.append("killed")
    rc, report = run_repair(store)
    codes.append(str(rc))
    if rc == 2 and name == "a junk file":
        error = report.get("error", "")
        message = error.get("message", "") if isinstance(error, dict) else str(error)
        note += f"; refused ({error.get('kind') if isinstance(error, dict) else 'error'}): {message[:90]}…; then --force"
        rc, report = run_repair(store, force=True)
        codes.append(f"{rc} (--force)")
    after = pages_of(store)
    kept = sorted(glob.glob(str(store / "data.mdb.orig-*")))
    original = "yes" if kept and all(digest(Path(k)) == damaged for k in kept) else ("no" if not kept else "CHANGED")
    salvage = report.get("salvage") or {}
    clean = kvc("audit", "--store", store).returncode == 0
    return {"trial": name, "before": before, "kept": after, "lost": before - after,
            "reported": f"{salvage.get('kept', '-')} kept / " + (
                f"{salvage.get('lost', '-')} lost" if salvage.get("lost_exact", True) else
                f"at least {salvage['lost']} lost" if salvage["lost"] > 0 else "unknown lost"),
            "unreadable": salvage.get("unreadable_bytes", "-"), "original": original, "codes": " → ".join(codes),
            "clean": "yes" if clean else "NO", "note": note}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1500, help="requests in the trace that fills the store")
    parser.add_argument("--seed", type=int, default=25)
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it (default: a temporary one)")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="kvc-repair-trials-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        template = build(work, args.requests, args.seed)
        before = pages_of(template)
        if before < 1000:
            sys.exit(f"the store holds {before} pages; use more --requests")
        rng = random.Random(args.seed)
        rows = [trial(name, template, work, damage, rng, before) for name, damage in (
            ("meta pages zeroed", zero_meta), ("random B-tree pages zeroed", zero_tree_pages),
            ("the file truncated", truncate), ("a junk file", junk), ("kill -9 during the repair", zero_meta))]
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    head = ["trial", "pages before", "kept", "lost", "repair reported", "unreadable bytes", "original kept",
            "exit codes (audit → repair)", "audit after"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print(f"| {r['trial']} | {r['before']:,} | {r['kept']:,} | {r['lost']:,} | {r['reported']} | "
              f"{r['unreadable'] if isinstance(r['unreadable'], str) else format(r['unreadable'], ',')} | "
              f"{r['original']} | {r['codes']} | {'clean' if r['clean'] == 'yes' else 'NOT CLEAN'} |")
    print()
    for r in rows:
        print(f"- {r['trial']}: {r['note']}")


if __name__ == "__main__":
    main()
