"""Shares per tier (kvcache.types.shares): does a quiet tenant keep its system prompt cached next to a busy one?

Two tenants replayed through one cache (L1 and L2, no L3, write-through, requests one at a time):

- B, the quiet tenant, sends requests that each start with its system prompt (`--prompt` tokens) and end with a
  suffix of its own (`--suffix` tokens, new every time);
- A, the busy tenant, sends `--ratio` times as many requests, of `--a-tokens` tokens each: a short system prompt
  of its own (`--a-prompt` tokens) and the rest new every time (unique-ish prompts).

L1 and L2 are sized so that A's traffic between two of B's requests is more than either tier holds: under plain LRU
A's pages push B's prompt out of both tiers before B comes back. The same trace runs three times:

1. **solo**: B's requests alone, the same cache — the hit rate B can have at best;
2. **shares off**: A and B interleaved (one B request after every `--ratio` A requests), plain LRU;
3. **shares on**: the same, with shares set by `TieredCache.set_shares` — B keeps `--b-share` of each tier, A the
   rest.

B's hit rate is the fraction of its tokens found cached at admission (L1 or L2). The acceptance check of issue 17:
with shares on, B's hit rate is within 10 % of its solo run; with shares off it is not. A's hit rate is reported
for both runs (its shares cost it what it could have kept of B's room).

Deterministic (no timing in the figures): the trace is generated from fixed token ranges, and the replay is serial.
Run: ``python benchmarks/bench_shares.py [--b-requests N] [--ratio R] [--no-write]``.
"""

from __future__ import annotations

import argparse
import sys
import time

from _report import machine, publish, table
from kvcache import CacheConfig, KVLayout, Namespace, Replayer, TieredCache, TraceRequest
from kvcache.types.shares import Shares

LAYOUT = KVLayout("bench-shares@r1", layers=1, kv_heads=1, head_dim=8, dtype="float16", page_size=16)
A_KEY, B_KEY = "tenant-a", "tenant-b"
WITHIN = 0.10  # the acceptance bound: B's hit rate with shares on within 10 % of solo


def trace(args: argparse.Namespace, with_a: bool) -> list[TraceRequest]:
    """B's requests, each after `ratio` of A's when `with_a`."""
    out = []
    b_prompt = list(range(1_000_000, 1_000_000 + args.prompt))
    a_prompt = list(range(2_000_000, 2_000_000 + args.a_prompt))
    fresh = 10_000_000  # new tokens: never repeated
    for i in range(args.b_requests):
        if with_a:
            for j in range(args.ratio):
                n = args.a_tokens - args.a_prompt
                out.append(TraceRequest(f"a{i}.{j}", a_prompt + list(range(fresh, fresh + n)), A_KEY))
                fresh += n
        out.append(TraceRequest(f"b{i}", b_prompt + list(range(fresh, fresh + args.suffix)), B_KEY))
        fresh += args.suffix
    return out


def run(args: argparse.Namespace, with_a: bool, shares: bool) -> dict[str, float]:
    """Replay one trace; hit rate (any tier) per tenant and the audit's verdict."""
    pool = args.pool_tokens
    cache = TieredCache(CacheConfig(LAYOUT, device_tokens=pool, host_tokens=pool, device="cpu", io_thread=False))
    if shares:
        b_share = int(pool * args.b_share)
        cache.set_shares(Namespace(B_KEY), Shares(device_tokens=b_share, host_tokens=b_share))
        cache.set_shares(Namespace(A_KEY), Shares(device_tokens=pool - b_share, host_tokens=pool - b_share))
    start = time.perf_counter()
    report = Replayer(cache, batch=1, lookahead=0).run(trace(args, with_a))
    seconds = time.perf_counter() - start
    cache.tree.check()
    cache.close()
    rates = {r.namespace.extra_key: r.hit_tokens.total / r.tokens for r in report.namespaces if r.tokens}
    return {"a": rates.get(A_KEY, 0.0), "b": rates[B_KEY], "audit_ok": float(report.audit.ok),
            "requests": float(report.requests), "seconds": seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--b-requests", type=int, default=200, help="requests of the quiet tenant B")
    parser.add_argument("--ratio", type=int, default=10, help="A's requests per B request")
    parser.add_argument("--prompt", type=int, default=512, help="B's system prompt, tokens")
    parser.add_argument("--suffix", type=int, default=64, help="B's new tokens per request")
    parser.add_argument("--a-prompt", type=int, default=128, help="A's own system prompt, tokens")
    parser.add_argument("--a-tokens", type=int, default=576, help="tokens of each A request")
    parser.add_argument("--pool-tokens", type=int, default=4096, help="L1 and L2 size each, tokens")
    parser.add_argument("--b-share", type=float, default=0.25, help="B's share of each tier (A gets the rest)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = parser.parse_args()

    solo = run(args, with_a=False, shares=False)
    off = run(args, with_a=True, shares=False)
    on = run(args, with_a=True, shares=True)
    on_ok = on["b"] >= (1 - WITHIN) * solo["b"]
    off_ok = off["b"] < (1 - WITHIN) * solo["b"]
    b_share = int(args.pool_tokens * args.b_share)
    rows = [["B alone (solo)", f"{solo['b']:.3f}", "-", f"{int(solo['requests'])}", f"{solo['seconds']:.2f}"],
            ["A and B, shares off (plain LRU)", f"{off['b']:.3f}", f"{off['a']:.3f}", f"{int(off['requests'])}",
             f"{off['seconds']:.2f}"],
            ["A and B, shares on", f"**{on['b']:.3f}**", f"{on['a']:.3f}", f"{int(on['requests'])}",
             f"{on['seconds']:.2f}"]]
    verdict = ("**met**" if on_ok and off_ok else "**not met**")
    body = "\n".join([
        "## Shares per tier: a quiet tenant's system prompt next to a busy tenant (bench_shares.py)",
        "",
        f"Machine: {machine()}. Page {LAYOUT.page_size} tokens; L1 = L2 = {args.pool_tokens:,} tokens; no L3; "
        f"write-through; serial replay. B: {args.b_requests} requests of a {args.prompt}-token system prompt + "
        f"{args.suffix} new tokens. A: {args.ratio}x B's requests, {args.a_tokens} tokens each "
        f"({args.a_prompt}-token prompt of its own, the rest new). Shares on: B {b_share:,} tokens of each tier, "
        f"A {args.pool_tokens - b_share:,}. Hit rate = tokens found cached (L1 or L2) at admission / tokens. "
        f"Deterministic: figures are counts, not timings (seconds for information only).",
        "",
        table(["run", "B hit rate", "A hit rate", "requests", "seconds"], rows),
        "",
        f"Acceptance (issue 17): shares on keeps B within {WITHIN:.0%} of solo "
        f"({on['b']:.3f} vs {solo['b']:.3f}: {'yes' if on_ok else 'no'}); shares off does not "
        f"({off['b']:.3f}: {'yes' if off_ok else 'no'}) — {verdict}. Audits after each run: "
        f"{'ok' if solo['audit_ok'] and off['audit_ok'] and on['audit_ok'] else 'FAILED'}.",
    ])
    ratios = {"b_hit_rate_solo": solo["b"], "b_hit_rate_shares_off": off["b"], "b_hit_rate_shares_on": on["b"],
              "a_hit_rate_shares_off": off["a"], "a_hit_rate_shares_on": on["a"]}
    publish("bench_shares", body, args.no_write, ratios)
    return 0 if on_ok and off_ok and solo["audit_ok"] and off["audit_ok"] and on["audit_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
