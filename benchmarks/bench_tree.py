"""Radix tree and ledger throughput on the standard workload.

Workload: 2,000 sequences x 1,024 tokens; the first 512 tokens of each are one of 20 shared prefixes, the rest
unique; one namespace; page size 1 and 16; one torch thread; gc.collect() before each timed phase.

Measured:
  (a) the tree alone: insert of every sequence into an empty tree, then match_prefix of every sequence (full hits);
  (b) the tree with ledger-checked pools, through TieredCache: admit + commit of every sequence (match, lock, alloc,
      insert, free duplicates, transfer to nodes, unlock), then the same full-hit matches;
  and the ledger's overhead: (b) with ledger checks on, as a ratio to the same run with them switched off.

Run: ``python benchmarks/bench_tree.py [--sequences N] [--repeat R] [--no-write]``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import sys
import time

import numpy as np
import torch

from _report import machine, publish, table
from kvcache import CacheConfig, KVLayout, Namespace, Request, TieredCache
from kvcache.tree import RadixTree


def workload(n_seqs: int, seq_len: int = 1024, shared: int = 512, n_prefixes: int = 20, seed: int = 0):
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(0, 2**31, size=(n_prefixes, shared))
    out = []
    for i in range(n_seqs):
        tail = rng.integers(0, 2**31, size=seq_len - shared)
        out.append(np.concatenate([prefixes[i % n_prefixes], tail]))
    return out


def timed(fn) -> float:
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_tree_alone(reqs: list[Request], page_size: int) -> tuple[float, float]:
    tree = RadixTree(page_size)
    n_pages = len(reqs[0]) // page_size
    values = [np.arange(i * n_pages, (i + 1) * n_pages, dtype=np.int64) for i in range(len(reqs))]
    keys = [r.key.page_aligned(page_size) for r in reqs]

    def insert():
        for k, v in zip(keys, values, strict=True):
            tree.insert(k, v)

    def match():
        for k in keys:
            tree.match_prefix(k)

    return timed(insert), timed(match)


def bench_cache(reqs: list[Request], page_size: int, ledger: bool) -> tuple[float, float]:
    layout = KVLayout("bench", 1, 1, 4, "float16", page_size)
    cache = TieredCache(CacheConfig(layout, device_tokens=len(reqs) * len(reqs[0]) + 1024, device="cpu",
                                    ledger=ledger))

    def admit_commit():
        for r in reqs:
            cache.admit(r)
            cache.commit(r.rid)

    def match():
        for r in reqs:
            cache.match(r)

    t_insert, t_match = timed(admit_commit), timed(match)
    assert cache.audit().ok or not ledger
    return t_insert, t_match


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sequences", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=5, help="runs per case; the best is reported")
    ap.add_argument("--no-write", action="store_true", help="print only, leave BENCHMARKS.md alone")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ns = Namespace("bench")
    seqs = workload(args.sequences)
    tokens = args.sequences * 1024
    rows, notes, ratios = [], [], {}
    for ps in (1, 16):
        reqs = [Request(f"r{i}", s, ns) for i, s in enumerate(seqs)]
        best = {}
        for case, fn in (("tree", functools.partial(bench_tree_alone, reqs, ps)),
                         ("ledger_on", functools.partial(bench_cache, reqs, ps, True)),
                         ("ledger_off", functools.partial(bench_cache, reqs, ps, False))):
            runs = [fn() for _ in range(args.repeat)]
            best[case] = (min(r[0] for r in runs), min(r[1] for r in runs))
        n = args.sequences
        for case, label in (("tree", "(a) tree alone: insert / match"),
                            ("ledger_on", "(b) tree + ledger-checked pools: admit+commit / match"),
                            ("ledger_off", "(b') same, ledger checks off")):
            ins, mat = best[case]
            rows.append([str(ps), label, f"{n / ins:,.0f}", f"{tokens / ins / 1e6:.1f} M",
                         f"{n / mat:,.0f}", f"{tokens / mat / 1e6:.1f} M"])
        overhead = best["ledger_on"][0] / best["ledger_off"][0]
        ratios[f"ledger_overhead_page{ps}"] = overhead
        ratios[f"match_seq_per_s_page{ps}"] = n / best["tree"][1]
        ratios[f"insert_seq_per_s_page{ps}"] = n / best["tree"][0]
        ratios[f"admit_commit_seq_per_s_page{ps}"] = n / best["ledger_on"][0]
        notes.append(f"page size {ps}: ledger overhead on admit+commit {overhead:.2f}x "
                     f"(checks on {best['ledger_on'][0] * 1e6 / n:.1f} us/seq, off "
                     f"{best['ledger_off'][0] * 1e6 / n:.1f} us/seq)")
    body = "\n".join([
        "## Radix tree and ownership ledger (`benchmarks/bench_tree.py`)",
        "",
        f"{args.sequences:,} sequences x 1,024 tokens, first 512 one of 20 shared prefixes; one torch thread; "
        f"best of {args.repeat}. Machine: {machine()}.",
        "",
        table(["page", "case", "insert seq/s", "insert tok/s", "full-hit match seq/s", "match tok/s"], rows),
        "",
        *[f"- {n}" for n in notes],
    ])
    publish("bench_tree", body, args.no_write, ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
