"""Side by side with SGLang (the peer): the radix tree, the admission path and the L1+L2 serve loop, both sides
interleaved on byte-identical workloads, so the ratios can be measured again by anyone who has SGLang.

This script installs nothing and SGLang is never a dependency of kvc. The peer runs in its own interpreter (a
virtual environment where `import sglang` works: --peer-python, default $KVC_PEER_PYTHON; extra import path for
it, e.g. import-only stand-ins such as a torchvision stub: --peer-pythonpath, default $KVC_PEER_PYTHONPATH).
Where no such interpreter is given, or it cannot import sglang, the script prints one line saying so and exits 0.

The driver (this file, run with kvc's Python) writes one workload file — sequences of token ids (--sequences x
--seq-len, the first half of each one of --groups shared prefixes, the rest random, from a seeded
`random.Random`) and the serve loop's visiting orders — and starts each side's worker on it (this same file with
--worker, in that side's interpreter, once per run). It then drives them phase by phase, --reps times: a phase (one
case at one page size, on a fresh structure) runs on every side back to back, the side going first rotating, so
the two figures of a pair are taken seconds apart under the same load. Every side reads the same bytes and
turns each sequence into a plain Python list before any timing; each builds its key from that list inside the
timed loop, as an engine handing token lists would: kvc `RadixKey.of(tokens, ns)` / `Request(rid, tokens, ns)`,
SGLang `RadixKey(array("q", tokens))` (its scheduler keeps token ids as array("q")). One torch thread each;
gc.collect() before every timed phase; the cyclic GC stays on.

Cases:
  tree    insert of every sequence into an empty tree, then a full-hit match of every sequence (key built from the
          list in the loop; and, for reference, with keys built before the loop). kvc: RadixTree alone (page
          indices as values). SGLang: RadixCache (Python, simulated allocator) and UnifiedRadixCache's Rust tree
          core (values allocated before the loop by its allocator; `free` stubbed out, so the tree's cost is
          measured, not the allocator's free-list concatenation).
  admit   the admission path: kvc's TieredCache admit + commit of every sequence (match, lock, allocate, insert,
          free duplicates, every slot move checked by the ownership ledger), against the Rust core's plain insert
          (free stubbed, as above) and, for reference, its insert with the real allocator freeing duplicates. Run
          twice: each request's tokens handed over as the Python list (keys built in the loop), and prebuilt in
          each side's own form (kvc: packed bytes, from which the loop builds each Request; SGLang: the RadixKey
          of an array("q")); the prebuilt run is measured against the stubbed insert only (the real allocator's
          cost at page 1 would dwarf it).
  serve   the serve loop with L1 -> L2 churn, --serve-passes passes over all sequences in shuffled orders: the
          device pool holds --dev-frac of the unique tokens, the host pool --host-ratio times that, write-through
          (every commit backed up to the host), 32 bytes of KV per token (1 layer, 1 head, head_dim 4, float32).
          kvc: TieredCache admit (match, load back host hits, evict, allocate) + commit (insert, backup), poll()
          every 16 requests. SGLang: HiCache (UnifiedRadixCache + its cache controller, write_through,
          threshold 1) driven the way its scheduler does — match, load_back of host hits, allocate (evicting on
          shortage) under a lock of the matched prefix, insert — check_hicache_events() every 16 requests. HiCache
          needs CUDA for its host buffer and copy kernels; on a CPU torch the worker swaps in plain torch
          equivalents (host buffer from torch.empty, per-layer copies by index, a no-op stream synchronize, a
          one-rank gloo group); its tree, controller and pools are its own. Run twice: each request's tokens
          handed over as the Python list (keys built in the loop), and prebuilt in each side's own form (kvc:
          packed bytes, SGLang: array("q"), what its scheduler keeps).

Figures: sequences (requests) per second, the median of the reps, and every ratio as the median of the
per-rep ratios (kvc over the peer, same phase of the same rep) with their min-max, on wall-clock time; beside
it the median of the same ratios on each process's CPU time, which leaves out time spent waiting for a core.
The load average before and after is printed and published: on a shared machine wall-clock figures move with it.

Run: ``KVC_PEER_PYTHON=/path/to/sglang-venv/bin/python python benchmarks/bench_vs_sglang.py [--reps 5]
[--cases tree,admit,serve] [--kvc-python LABEL=PATH ...] [--no-write]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from pathlib import Path

SCRIPT = Path(__file__).resolve()
CASES = ("tree", "admit", "serve")
KVC_LAYOUT = dict(layers=1, kv_heads=1, head_dim=4, dtype="float32")  # 32 B/token, as the peer's pool below


# --- the workload: written once by the driver, read by every worker -------------------------------------------

def write_workload(path: Path, args: argparse.Namespace) -> dict:
    """Token ids and serve orders into `path` (a JSON header line, then the ids as native int64); the header."""
    rng = random.Random(args.seed)
    half = args.seq_len // 2
    prefixes = [[rng.randrange(1, 150_000) for _ in range(half)] for _ in range(args.groups)]
    ids = array("q")
    for _ in range(args.sequences):
        ids.extend(prefixes[rng.randrange(args.groups)])
        ids.extend(rng.randrange(1, 150_000) for _ in range(args.seq_len - half))
    unique = args.groups * half + args.sequences * (args.seq_len - half)
    serve = {}
    for ps in args.serve_page_sizes:
        device = max(int(unique * args.dev_frac) // ps * ps, 4 * args.seq_len)
        serve[str(ps)] = {"device_tokens": device, "host_ratio": args.host_ratio,
                          "host_tokens": int(device * args.host_ratio) // ps * ps}
    orders = []
    for p in range(args.serve_passes):
        order = list(range(args.sequences))
        random.Random(args.seed + 1000 + p).shuffle(order)
        orders.append(order)
    header = {"sequences": args.sequences, "seq_len": args.seq_len, "groups": args.groups, "seed": args.seed,
              "page_sizes": args.page_sizes, "serve": serve, "orders": orders, "cases": args.cases}
    with open(path, "wb") as f:
        f.write(json.dumps(header).encode() + b"\n")
        ids.tofile(f)
    return header


def read_workload(path: str) -> tuple[dict, list[list[int]]]:
    """The header and every sequence as a Python list of ints."""
    with open(path, "rb") as f:
        header = json.loads(f.readline())
        ids = array("q")
        ids.frombytes(f.read())
    n, length = header["sequences"], header["seq_len"]
    assert len(ids) == n * length, (len(ids), n, length)
    return header, [ids[i * length:(i + 1) * length].tolist() for i in range(n)]


def timed(loop) -> list[float]:
    """[wall-clock seconds, this process's CPU seconds] of one call of `loop`, after a full collection. CPU time
    leaves out the time the process waited for a core, which on a shared machine is most of the noise."""
    gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    loop()
    return [time.perf_counter() - start, time.process_time() - cpu]


# --- kvc's worker ---------------------------------------------------------------------------------------------

class KvcWorker:
    """kvc's side: one method per case, each on a fresh structure, each returning seconds and what was done."""

    def __init__(self, header: dict, seqs: list[list[int]]) -> None:
        import torch

        import kvcache
        from kvcache import Namespace

        torch.set_num_threads(1)
        self.header, self.seqs, self.ns = header, seqs, Namespace("bench")
        self.info = {"kvcache": str(Path(kvcache.__file__).resolve().parent), "torch": torch.__version__}

    def layout(self, ps: int):
        from kvcache import KVLayout

        return KVLayout("bench-vs-sglang", page_size=ps, **KVC_LAYOUT)

    def tree(self, ps: int) -> dict:
        import numpy as np

        from kvcache import RadixKey
        from kvcache.tree import RadixTree  # the tree alone has no public name at the top level; kvcache.tree has it

        seqs, ns, tree = self.seqs, self.ns, RadixTree(ps)
        n_pages = self.header["seq_len"] // ps
        values = [np.arange(i * n_pages, (i + 1) * n_pages, dtype=np.int64) for i in range(len(seqs))]
        hits = [0, 0]

        def insert() -> None:
            for tokens, pages in zip(seqs, values, strict=True):
                tree.insert(RadixKey.of(tokens, ns).page_aligned(ps), pages)

        def match() -> None:
            for tokens in seqs:
                hits[0] += tree.match_prefix(RadixKey.of(tokens, ns)).device_tokens

        keys = [RadixKey.of(tokens, ns) for tokens in seqs]

        def match_prebuilt() -> None:
            for key in keys:
                hits[1] += tree.match_prefix(key).device_tokens

        return {"insert": timed(insert), "match": timed(match), "match_prebuilt": timed(match_prebuilt),
                "match_hits": hits[0], "match_prebuilt_hits": hits[1]}

    def admit(self, ps: int, tokens: str = "list") -> dict:
        """tokens "list": each request's tokens handed over as the Python list; "native": as packed bytes built
        before the loop (what kvc keeps), each Request still built in the loop."""
        from kvcache import CacheConfig, RadixKey, Request, TieredCache

        ns = self.ns
        seqs = self.seqs if tokens == "list" else [RadixKey.of(t, ns).data for t in self.seqs]
        rids = [f"r{i}" for i in range(len(seqs))]
        cache = TieredCache(CacheConfig(self.layout(ps), device_tokens=len(seqs) * self.header["seq_len"] + 1024,
                                        device="cpu"))

        def admit_commit() -> None:
            for rid, tokens in zip(rids, seqs, strict=True):
                cache.admit(Request(rid, tokens, ns))
                cache.commit(rid)

        seconds = timed(admit_commit)
        audit = cache.audit()
        assert audit.ok, audit
        cache.close()
        return {"admit_commit": seconds}

    def serve(self, ps: int, tokens: str = "list") -> dict:
        """tokens "list": each request's tokens handed over as the Python list; "native": as packed bytes built
        before the loop (what kvc keeps; SGLang's side gets its own array("q") the same way)."""
        from kvcache import AdmitStatus, CacheConfig, RadixKey, Request, TieredCache

        ns, orders, size = self.ns, self.header["orders"], self.header["serve"][str(ps)]
        seqs = self.seqs if tokens == "list" else [RadixKey.of(t, ns).data for t in self.seqs]
        rids = [f"s{i}" for i in range(sum(len(o) for o in orders))]
        cache = TieredCache(CacheConfig(self.layout(ps), device_tokens=size["device_tokens"],
                                        host_tokens=size["host_tokens"], write_policy="write_through", device="cpu"))
        counts = {"device_hit": 0, "host_hit": 0, "computed": 0, "load_backs": 0}

        def serve() -> None:
            n_done = 0
            for order in orders:
                for i in order:
                    rid = rids[n_done]
                    admission = cache.admit(Request(rid, seqs[i], ns))
                    assert admission.status is AdmitStatus.ADMITTED, admission.status
                    counts["device_hit"] += admission.device_hit_tokens
                    counts["host_hit"] += admission.host_hit_tokens
                    counts["load_backs"] += admission.host_hit_tokens > 0
                    counts["computed"] += admission.new_tokens
                    cache.commit(rid)
                    n_done += 1
                    if n_done % 16 == 0:
                        cache.poll()
            cache.flush()

        seconds = timed(serve)
        audit = cache.audit()
        assert audit.ok, audit
        cache.close()
        return {"seconds": seconds, "requests": len(rids), **counts, "device_slots": size["device_tokens"],
                "host_slots": size["host_tokens"]}


# --- SGLang's worker (runs in the peer's interpreter; nothing here is imported by kvc) -------------------------

class SglangWorker:
    """SGLang's side, case by case as KvcWorker."""

    def __init__(self, header: dict, seqs: list[list[int]]) -> None:
        import sglang
        import torch

        torch.set_num_threads(1)
        self.header, self.seqs = header, seqs
        self.info = {"sglang": sglang.__version__, "torch": torch.__version__}

    def loops(self, cache, values, match: bool = True, tokens: str = "list") -> dict:
        """Insert every sequence (key from its list; tokens "native": the RadixKey of its array("q"), built before
        the loop), then full-hit matches (key from the list; key prebuilt)."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        seqs, hits = self.seqs, [0, 0]

        prebuilt = [RadixKey(array("q", t)) for t in seqs] if tokens == "native" else None

        def insert() -> None:
            if prebuilt is not None:
                for key, value in zip(prebuilt, values, strict=True):
                    cache.insert(InsertParams(key=key, value=value))
                return
            for tokens, value in zip(seqs, values, strict=True):
                cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=value))

        def match_list() -> None:
            for tokens in seqs:
                hits[0] += cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)))).device_prefix_len

        keys = [RadixKey(array("q", tokens)) for tokens in seqs]

        def match_prebuilt() -> None:
            for key in keys:
                hits[1] += cache.match_prefix(MatchPrefixParams(key=key)).device_prefix_len

        out = {"insert": timed(insert)}
        if match:
            out.update(match=timed(match_list), match_prebuilt=timed(match_prebuilt), match_hits=hits[0],
                       match_prebuilt_hits=hits[1])
        return out

    def tree(self, ps: int) -> dict:
        import torch
        from sglang.srt.mem_cache.radix_cache import RadixCache

        class SimulatedAllocator:  # what RadixCache.create_simulated asks for: counts frees, holds nothing
            device = "cpu"

            def __init__(self) -> None:
                self.freed = 0

            def free(self, idx) -> None:
                self.freed += idx.numel()

            def free_segment(self, idx, start_pos: int = 0) -> None:
                self.freed += idx.numel()

        length, n = self.header["seq_len"], len(self.seqs)
        cache = RadixCache.create_simulated(mock_allocator=SimulatedAllocator(), page_size=ps)
        values = [torch.arange(i * length, (i + 1) * length, dtype=torch.int64) for i in range(n)]
        radix = self.loops(cache, values)
        del cache, values
        gc.collect()
        return {"radix": radix, "rust": self.rust(ps, stubbed=True, match=True)}

    def admit(self, ps: int, tokens: str = "list") -> dict:
        if tokens == "native":
            return {"rust": self.rust(ps, stubbed=True, match=False, tokens=tokens)}
        return {"rust": self.rust(ps, stubbed=True, match=False), "rust_real": self.rust(ps, stubbed=False,
                                                                                           match=False)}

    def rust(self, ps: int, stubbed: bool, match: bool, tokens: str = "list") -> dict:
        """UnifiedRadixCache (its default tree core, Rust) with values allocated before the loop."""
        cache, alloc, core = unified_cache(ps, len(self.seqs) * self.header["seq_len"] + 4096)
        values = [alloc.alloc(self.header["seq_len"]) for _ in self.seqs]
        assert all(v is not None for v in values)
        if stubbed:
            stub_free(alloc)
        return {**self.loops(cache, values, match, tokens), "core": core}

    def serve(self, ps: int, tokens: str = "list") -> dict:
        """As KvcWorker.serve; "native": each sequence's array("q") (what SGLang's scheduler keeps) built before
        the loop."""
        return hicache_serve(ps, self.header["serve"][str(ps)], self.header["orders"], self.seqs, tokens)


def cpu_pool(page_size: int, kv_size: int, dtype_name: str, head_dim: int):
    """SGLang's KV pool on CPU (one layer, one head) and its token or paged allocator, as CacheInitParams fields."""
    import torch
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    dtype = getattr(torch, dtype_name)
    requests = ReqToTokenPool(size=4, max_context_len=4096, device="cpu", enable_memory_saver=False)
    pool = MHATokenToKVPool(size=kv_size, page_size=page_size, dtype=dtype, head_num=1, head_dim=head_dim,
                            layer_num=1, device="cpu", enable_memory_saver=False)
    alloc_type = TokenToKVPoolAllocator if page_size == 1 else PagedTokenToKVPoolAllocator
    extra = {} if page_size == 1 else {"page_size": page_size}
    alloc = alloc_type(size=kv_size, dtype=dtype, device="cpu", kvcache=pool, need_sort=False, **extra)
    return {"req_to_token_pool": requests, "token_to_kv_pool_allocator": alloc, "page_size": page_size}


def unified_cache(page_size: int, kv_size: int):
    """SGLang's UnifiedRadixCache (full-attention component only) over a CPU KV pool; (cache, allocator, the
    class name of the tree core it chose: Rust by default)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=page_size))
    fields = cpu_pool(page_size, kv_size, "bfloat16", head_dim=8)
    cache = UnifiedRadixCache(params=CacheInitParams(**fields, disable=False, tree_components=(ComponentType.FULL,)))
    return cache, fields["token_to_kv_pool_allocator"], type(cache.tree_core).__name__


def stub_free(alloc) -> None:
    """Frees become counters: the allocator's free path (a torch.cat onto its free list per call) is not the
    tree's cost."""
    def free(idx, *args, **kwargs) -> None:
        pass

    alloc.free = alloc.free_segment = alloc.free_page_ids = alloc.free_full_segment = free


def hicache_on_cpu() -> None:
    """Plain-torch stand-ins for the pieces of HiCache that need CUDA (host buffer allocation, the per-layer
    device <-> host copy kernels, stream synchronize) and a one-rank gloo group for its collectives."""
    import torch
    import torch.distributed as dist
    from sglang.srt.mem_cache.pool_host import common as host_common
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    if not dist.is_initialized():
        rendezvous = tempfile.NamedTemporaryFile(prefix="kvc-bench-gloo-", delete=False)
        rendezvous.close()
        os.unlink(rendezvous.name)
        dist.init_process_group(backend="gloo", init_method=f"file://{rendezvous.name}", rank=0, world_size=1)
    host_common.ALLOC_MEMORY_FUNCS["cpu"] = (
        lambda dims, dtype, device, *a, **k: torch.empty(dims, dtype=dtype, device="cpu"))

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend) -> None:
        for layer in range(self.layer_num):
            self.kv_buffer[0, layer, host_indices] = device_pool.k_buffer[layer][device_indices]
            self.kv_buffer[1, layer, host_indices] = device_pool.v_buffer[layer][device_indices]

    def load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend, *,
                                 is_draft=False) -> None:
        device_pool.k_buffer[layer_id][device_indices] = self.kv_buffer[0, layer_id, host_indices]
        device_pool.v_buffer[layer_id][device_indices] = self.kv_buffer[1, layer_id, host_indices]

    MHATokenToKVPoolHost.backup_from_device_all_layer = backup_from_device_all_layer
    MHATokenToKVPoolHost.load_to_device_per_layer = load_to_device_per_layer
    MHATokenToKVPoolHost.get_dummy_flat_data_page = lambda self: torch.zeros(
        (2, self.layer_num, self.page_size, self.head_num, self.head_dim), dtype=self.dtype).flatten()
    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = lambda self: None


def hicache(page_size: int, kv_size: int, host_ratio: float):
    """HiCache (L1 + L2, write_through) over a CPU pool of 32 B per token; (cache, allocator)."""
    import torch
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    hicache_on_cpu()
    server_args = ServerArgs(model_path="dummy", page_size=page_size, enable_hierarchical_cache=True,
                             hicache_io_backend="direct", hicache_mem_layout="layer_first",
                             hicache_write_policy="write_through", hicache_ratio=host_ratio)
    set_global_server_args_for_scheduler(server_args)
    parallel = get_parallel()
    for name, value in dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                            attn_tp_rank=0, attn_tp_size=1, attn_dp_rank=0, dp_rank=0).items():
        try:
            parallel.override_permanently(**{name: value})
        except Exception:  # a rank this version does not keep
            pass
    fields = cpu_pool(page_size, kv_size, "float32", head_dim=4)  # 32 B per token (K + V), as kvc's layout
    params = CacheInitParams(**fields, disable=False, tree_components=(ComponentType.FULL,),
                             tp_cache_group=torch.distributed.group.WORLD)
    cache = UnifiedRadixCache(params=params)
    cache.init_hicache(server_args, params)
    cache.write_through_threshold = 1
    return cache, fields["token_to_kv_pool_allocator"]


def hicache_serve(page_size: int, size: dict, orders: list[list[int]], seqs: list[list[int]],
                  tokens: str) -> dict:
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache, alloc = hicache(page_size, size["device_tokens"], size["host_ratio"])
    counts = {"device_hit": 0, "host_hit": 0, "computed": 0, "load_backs": 0}
    arrays = None if tokens == "list" else [array("q", t) for t in seqs]

    def serve() -> None:
        n_done = 0
        for order in orders:
            for i in order:
                key = RadixKey(array("q", seqs[i]) if arrays is None else arrays[i])
                m = cache.match_prefix(MatchPrefixParams(key=key))
                counts["device_hit"] += m.device_prefix_len  # before load-back, as kvc's device_hit_tokens
                if m.host_hit_length > 0 and cache.load_back(m.best_match_node):
                    cache.ready_to_load_host_cache()
                    cache.check_hicache_events()
                    counts["load_backs"] += 1
                    counts["host_hit"] += m.host_hit_length
                    m = cache.match_prefix(MatchPrefixParams(key=key))
                prefix = cache.path_device_indices(m.last_device_node)
                need = len(key) - len(prefix)
                counts["computed"] += need
                lock = cache.inc_lock_ref(m.last_device_node).to_dec_params()  # the prefix stays while evicting
                new = alloc.alloc(need)
                if new is None:
                    cache.evict(EvictParams(num_tokens=need - alloc.available_size()))
                    new = alloc.alloc(need)
                if new is None:  # the evictable nodes were still being backed up: finish those, as a step would
                    cache.check_hicache_events()
                    cache.evict(EvictParams(num_tokens=need - alloc.available_size()))
                    new = alloc.alloc(need)
                cache.dec_lock_ref(m.last_device_node, lock)
                assert new is not None, (need, alloc.available_size(), cache.evictable_size())
                cache.insert(InsertParams(key=key, value=torch.cat([prefix, new]), prev_prefix_len=len(prefix)))
                n_done += 1
                if n_done % 16 == 0:
                    cache.check_hicache_events()
        cache.check_hicache_events()

    seconds = timed(serve)
    cache.sanity_check()
    return {"seconds": seconds, "requests": sum(len(o) for o in orders), **counts,
            "core": type(cache.tree_core).__name__, "device_slots": size["device_tokens"],
            "host_slots": int(cache.cache_controller.mem_pool_host.size)}


RESULT = "@@bench_vs_sglang "  # marks the worker's answer lines on its stdout (the peer logs there too)


def worker_main(side: str, workload: str) -> int:
    """Serve the driver: after a ready line with versions, one JSON line per phase asked on stdin."""
    header, seqs = read_workload(workload)
    worker = KvcWorker(header, seqs) if side == "kvc" else SglangWorker(header, seqs)
    print(RESULT + json.dumps(worker.info), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        result = getattr(worker, ask["case"])(ask["page_size"], **ask.get("options", {}))
        gc.collect()
        print(RESULT + json.dumps(result), flush=True)
    return 0


# --- the driver -----------------------------------------------------------------------------------------------

class Side:
    """One interpreter the driver runs a worker in."""

    def __init__(self, label: str, kind: str, python: str, pythonpath: str | None = None) -> None:
        self.label, self.kind, self.python, self.pythonpath = label, kind, python, pythonpath

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("KVC_BENCH_JSON", None)
        if self.pythonpath is not None:
            env["PYTHONPATH"] = self.pythonpath
        return env

    def start(self, workload: Path, logs: Path) -> dict:
        """Start this side's worker on `workload`; its ready answer (versions, where kvcache lives)."""
        self.log = open(logs / f"{self.label}.stderr", "w+")
        self.chatter: list[str] = []
        self.proc = subprocess.Popen([self.python, str(SCRIPT), "--worker", self.kind, "--workload", str(workload)],
                                     env=self.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, bufsize=1)
        return self.answer("start", timeout=600)

    def ask(self, case: str, page_size: int, timeout: float, options: dict | None = None) -> dict:
        """Run one phase in the worker and wait for its figures."""
        self.proc.stdin.write(json.dumps({"case": case, "page_size": page_size, "options": options or {}}) + "\n")
        self.proc.stdin.flush()
        return self.answer(f"{case} at page {page_size}", timeout)

    def answer(self, what: str, timeout: float) -> dict:
        watchdog = threading.Timer(timeout, self.proc.kill)  # a hung worker ends the run, with its logs
        watchdog.start()
        try:
            for line in self.proc.stdout:
                if line.startswith(RESULT):
                    return json.loads(line[len(RESULT):])
                self.chatter = (self.chatter + [line.rstrip()])[-10:]
        finally:
            watchdog.cancel()
        self.log.seek(0)
        tail = "\n".join((self.chatter + self.log.read().strip().splitlines())[-20:])
        raise SystemExit(f"bench_vs_sglang: the {self.label} worker ({self.python}) died during {what} (exit code "
                         f"{self.proc.wait()}):\n{tail}")

    def stop(self) -> None:
        if getattr(self, "proc", None) is not None:
            if self.proc.stdin and not self.proc.stdin.closed:
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.log.close()


def peer_problem(peer: Side | None) -> str | None:
    """Why the peer cannot run here (None: it can)."""
    if peer is None or not peer.python:
        return "no peer interpreter (give --peer-python or set KVC_PEER_PYTHON to a Python that can import sglang)"
    try:
        proc = subprocess.run([peer.python, "-c", "import sglang; print(sglang.__version__)"], env=peer.env(),
                              capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the peer interpreter {peer.python} does not run ({exc})"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return f"{peer.python} cannot import sglang ({last})"
    return None


def kvc_sides(specs: list[str]) -> list[Side]:
    sides = []
    for i, spec in enumerate(specs):
        label, _, python = spec.rpartition("=")
        sides.append(Side(label or ("kvc" if len(specs) == 1 else f"kvc{i + 1}"), "kvc", python))
    return sides


def rate(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f}"


def git_head(kvcache_dir: str) -> str:
    """The commit of the checkout holding `kvcache_dir`, and whether its kvcache/ differs from it ("?" outside
    git): read when the worker has imported it, so it names the code measured."""
    try:
        head = subprocess.run(["git", "-C", kvcache_dir, "log", "-1", "--format=%h"], capture_output=True,
                              text=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", kvcache_dir, "status", "--porcelain", "--", "."], capture_output=True,
                               text=True, timeout=30).stdout.strip()
    except OSError:
        return "?"
    return f"{head or '?'}{' + uncommitted changes' if dirty else ''}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer-python", default=os.environ.get("KVC_PEER_PYTHON"),
                        help="the interpreter that can import sglang (default: $KVC_PEER_PYTHON)")
    parser.add_argument("--peer-pythonpath", default=os.environ.get("KVC_PEER_PYTHONPATH"),
                        help="PYTHONPATH for the peer only, e.g. a directory of import-only stand-ins "
                             "(default: $KVC_PEER_PYTHONPATH)")
    parser.add_argument("--kvc-python", action="append", default=None, metavar="[LABEL=]PATH",
                        help="an interpreter whose installed kvcache is measured (repeatable, to measure two trees "
                             "interleaved; default: this interpreter)")
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions; medians are of these "
                                                            "(default 5)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: tree, admit, serve")
    parser.add_argument("--sequences", type=int, default=2000, help="sequences in the workload (default 2000)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    parser.add_argument("--groups", type=int, default=20, help="shared prefixes, half a sequence each (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--page-sizes", default="1,16", help="page sizes of the tree and admit cases (default 1,16)")
    parser.add_argument("--serve-page-sizes", default="16", help="page sizes of the serve loop (default 16)")
    parser.add_argument("--serve-passes", type=int, default=2, help="passes over the sequences (default 2)")
    parser.add_argument("--dev-frac", type=float, default=0.25, help="device pool / unique tokens (default 0.25)")
    parser.add_argument("--host-ratio", type=float, default=4.0, help="host pool / device pool (default 4)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one phase of one side may take "
                                                                   "(default 900)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    parser.add_argument("--worker", choices=("kvc", "sglang"), help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args.worker, args.workload)

    args.cases = [c for c in args.cases.split(",") if c]
    try:
        args.page_sizes = [int(p) for p in args.page_sizes.split(",") if p]
        args.serve_page_sizes = [int(p) for p in args.serve_page_sizes.split(",") if p] if "serve" in args.cases \
            else []
    except ValueError:
        parser.error("page sizes are comma-separated integers")
    bad = sorted(set(args.cases) - set(CASES))
    if bad or not args.cases:
        parser.error(f"--cases: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(CASES)}")
    if args.reps < 1 or args.sequences < 1 or args.groups < 1 or args.serve_passes < 1:
        parser.error("--reps, --sequences, --groups and --serve-passes must be >= 1")
    if any(p < 1 or args.seq_len % p for p in args.page_sizes + args.serve_page_sizes) or args.seq_len < 2:
        parser.error(f"every page size must be >= 1 and divide --seq-len ({args.seq_len})")
    if not 0 < args.dev_frac <= 1 or args.host_ratio < 1:
        parser.error("--dev-frac must be in (0, 1] and --host-ratio >= 1")

    peer = Side("SGLang", "sglang", args.peer_python, args.peer_pythonpath) if args.peer_python else None
    problem = peer_problem(peer)
    if problem:
        print(f"bench_vs_sglang: skipped: {problem}")
        return 0
    sides = kvc_sides(args.kvc_python or [sys.executable]) + [peer]
    return drive(args, sides)


def drive(args: argparse.Namespace, sides: list[Side]) -> int:
    from _report import machine, publish, spread, table

    phases = [("tree", ps, {}) for ps in args.page_sizes if "tree" in args.cases]
    phases += [("admit", ps, {"tokens": tokens}) for ps in args.page_sizes if "admit" in args.cases
               for tokens in ("list", "native")]
    phases += [("serve", ps, {"tokens": tokens}) for ps in args.serve_page_sizes for tokens in ("list", "native")]
    load_before = os.getloadavg()
    infos: dict[str, dict] = {}
    runs: dict[str, list[dict]] = {side.label: [{} for _ in range(args.reps)] for side in sides}
    with tempfile.TemporaryDirectory(prefix="kvc-bench-vs-sglang-") as tmp:
        workload = Path(tmp) / "workload.bin"
        write_workload(workload, args)
        try:
            for side in sides:
                infos[side.label] = side.start(workload, Path(tmp))
                if side.kind == "kvc":
                    infos[side.label]["commit"] = git_head(infos[side.label]["kvcache"])
            for rep in range(args.reps):
                start = time.perf_counter()
                for k, (case, ps, options) in enumerate(phases):
                    turn = (rep + k) % len(sides)  # who goes first rotates phase by phase and rep by rep
                    for side in sides[turn:] + sides[:turn]:
                        result = side.ask(case, ps, args.timeout, options)
                        case_key = f"{case}_native" if options.get("tokens") == "native" else case
                        if side.kind == "kvc":
                            runs[side.label][rep][f"{case_key}_p{ps}"] = result
                        elif case == "tree":
                            runs[side.label][rep].update({f"radix_p{ps}": result["radix"],
                                                          f"rust_p{ps}": result["rust"]})
                        elif case_key == "admit_native":
                            runs[side.label][rep][f"admit_native_rust_p{ps}"] = result["rust"]
                        elif case == "admit":
                            runs[side.label][rep].update({f"admit_rust_p{ps}": result["rust"],
                                                          f"rust_real_p{ps}": result["rust_real"]})
                        else:
                            runs[side.label][rep][f"{case_key}_p{ps}"] = result
                print(f"rep {rep + 1}/{args.reps} done in {time.perf_counter() - start:.1f} s "
                      f"(load average {os.getloadavg()[0]:.2f})", flush=True)
        finally:
            for side in sides:
                side.stop()
    load_after = os.getloadavg()
    peer_label = sides[-1].label
    peer_runs = runs.pop(peer_label)
    peer0 = {**infos[peer_label], **peer_runs[0]}
    n, reqs = args.sequences, None
    problems = []

    def per_rep(kvc_runs: list[dict], kvc_key: str, kvc_field: str, peer_key: str, peer_field: str,
                clock: int = 0) -> list[float]:
        """kvc's speed over the peer's on the same work, rep by rep; clock 0: wall-clock, 1: CPU time."""
        return [p[peer_key][peer_field][clock] / k[kvc_key][kvc_field][clock]
                for k, p in zip(kvc_runs, peer_runs, strict=True)]

    def both(kvc_runs: list[dict], kvc_key: str, kvc_field: str, peer_key: str, peer_field: str,
             bold: bool = True) -> tuple[str, float]:
        """The ratio's cell (wall-clock median (min-max); CPU-time median) and its wall-clock median."""
        wall = per_rep(kvc_runs, kvc_key, kvc_field, peer_key, peer_field)
        cpu = per_rep(kvc_runs, kvc_key, kvc_field, peer_key, peer_field, clock=1)
        mark = "**" if bold else ""
        return f"{mark}{spread(wall)}{mark}; cpu {statistics.median(cpu):.2f}x", statistics.median(wall)

    def seq_rates(results: list[dict], key: str, field: str, work: float = n) -> list[float]:
        return [work / r[key][field][0] for r in results]

    def labelled(header: list[str], rows: list[list[str]], at: int) -> str:
        """The table, without its kvc-label column (index `at`) when one kvc tree is measured."""
        if len(kvc_labels) > 1:
            return table(header, rows)
        return table(header[:at] + header[at + 1:], [r[:at] + r[at + 1:] for r in rows])

    body = ["## Side by side with SGLang (`benchmarks/bench_vs_sglang.py`)", ""]
    ratios: dict[str, float] = {}
    kvc_labels = list(runs)
    body.append(
        f"SGLang {peer0['sglang']} (torch {peer0['torch']}) in its own interpreter, against kvc "
        + ", ".join(f"`{label}` ({infos[label]['kvcache']}, commit {infos[label]['commit']}, "
                    f"torch {infos[label]['torch']})" for label in kvc_labels)
        + f". Workload: {args.sequences:,} sequences x {args.seq_len:,} tokens, the first half one of {args.groups} "
          f"shared prefixes (seed {args.seed}); each side builds its keys from Python lists inside the timed loop. "
          f"One worker process per side for the whole run, driven phase by phase (a case at a page size): each "
          f"phase runs on every side back to back, the side going first rotating, on a fresh structure; "
          f"{args.reps} reps of every phase. Throughputs are medians of the reps, ratios the median of the "
          f"per-rep ratios (kvc over the peer, same phase of the same rep) with their min-max, on wall-clock "
          f"time; beside it, the median ratio on each process's CPU time (time spent waiting for a core left out; "
          f"the peer's helper threads, if any, counted). "
          f"One torch thread per side. Machine: {machine()}; load average {load_before[0]:.2f} / "
          f"{load_before[1]:.2f} before, {load_after[0]:.2f} / {load_after[1]:.2f} after (1 / 5 min). Command: "
          f"`{command_line(args)}`.")
    if "tree" in args.cases:
        rows = []
        for ps in args.page_sizes:
            for label in kvc_labels:
                kr = runs[label]
                for field, what in (("insert", "insert, key from list"), ("match", "full-hit match, key from list"),
                                    ("match_prebuilt", "full-hit match, key built before the loop")):
                    radix_cell, vs_radix = both(kr, f"tree_p{ps}", field, f"radix_p{ps}", field)
                    rust_cell, vs_rust = both(kr, f"tree_p{ps}", field, f"rust_p{ps}", field)
                    rows.append([str(ps), what, label, rate(seq_rates(kr, f"tree_p{ps}", field)),
                                 rate(seq_rates(peer_runs, f"radix_p{ps}", field)),
                                 rate(seq_rates(peer_runs, f"rust_p{ps}", field)), radix_cell, rust_cell])
                    if label == kvc_labels[0] and field in ("insert", "match"):
                        ratios[f"tree_{field}_over_sglang_radix_p{ps}"] = vs_radix
                        ratios[f"tree_{field}_over_sglang_rust_p{ps}"] = vs_rust
                for field in ("match_hits", "match_prebuilt_hits"):
                    want = n * args.seq_len
                    got = {r[f"tree_p{ps}"][field] for r in kr} | {r[f"radix_p{ps}"][field] for r in peer_runs} | \
                          {r[f"rust_p{ps}"][field] for r in peer_runs}
                    if got != {want}:
                        problems.append(f"tree page {ps}: full-hit match tokens {sorted(got)}, expected {want}")
        body += ["", "### Radix tree: insert and full-hit match", "",
                 f"kvc: `RadixTree` alone (values: page indices). SGLang: `RadixCache` (Python, simulated allocator) "
                 f"and `UnifiedRadixCache` with its {peer0[f'rust_p{args.page_sizes[0]}']['core']} (values from its "
                 f"allocator, allocated before the loop; `free` stubbed so the allocator's free-list concatenation "
                 f"is not counted). Every full-hit match returns all {args.seq_len:,} tokens on every side "
                 f"(checked).", "",
                 labelled(["page", "operation", "kvc", "kvc seq/s", "RadixCache seq/s", "Rust core seq/s",
                           "kvc / RadixCache", "kvc / Rust core"], rows, 2)]
    if "admit" in args.cases:
        rows = []
        for ps in args.page_sizes:
            for variant, what in (("admit", "Python list"), ("admit_native", "prebuilt")):
                for label in kvc_labels:
                    kr = runs[label]
                    stub_cell, vs_stub = both(kr, f"{variant}_p{ps}", "admit_commit", f"{variant}_rust_p{ps}",
                                              "insert")
                    real_rate, real_cell = "-", "-"
                    if variant == "admit":
                        real_cell, _ = both(kr, f"admit_p{ps}", "admit_commit", f"rust_real_p{ps}", "insert",
                                            bold=False)
                        real_rate = rate(seq_rates(peer_runs, f"rust_real_p{ps}", "insert"))
                    rows.append([str(ps), what, label, rate(seq_rates(kr, f"{variant}_p{ps}", "admit_commit")),
                                 rate(seq_rates(peer_runs, f"{variant}_rust_p{ps}", "insert")), real_rate,
                                 stub_cell, real_cell])
                    if label == kvc_labels[0]:
                        tag = "" if variant == "admit" else "_native"
                        ratios[f"admit_commit{tag}_over_sglang_rust_insert_p{ps}"] = vs_stub
        body += ["", "### Admission path: ledgered admit + commit against the Rust core's insert", "",
                 "kvc: `TieredCache` (device pool large enough for every sequence, ownership ledger on) "
                 "`admit(Request(rid, tokens, ns))` + `commit(rid)` per sequence: match, lock, allocate, insert, "
                 "free duplicates, every slot move checked; the audit passes after the loop. SGLang: "
                 "`UnifiedRadixCache.insert` of values allocated before the loop, `free` stubbed (the plain "
                 "insert), and with the real allocator freeing the duplicates. Tokens: each request's tokens "
                 "arrive as the Python list (each side builds its key from it in the loop), or prebuilt in each "
                 "side's own form before the loop (kvc: packed bytes, each `Request` still built in the loop; "
                 "SGLang: the `RadixKey` of an `array('q')`); prebuilt, only against the plain insert. kvc's "
                 "admission hands back pages: the per-token slots are built only when read.", "",
                 labelled(["page", "tokens", "kvc", "kvc admit+commit seq/s", "Rust core insert seq/s (free stubbed)",
                           "Rust core insert seq/s (real allocator)", "kvc / Rust core insert",
                           "kvc / Rust core, real allocator"], rows, 2)]
    if "serve" in args.cases:
        rows, slots = [], []
        for ps in args.serve_page_sizes:
            for variant, what in (("serve", "Python list"), ("serve_native", "prebuilt")):
                key = f"{variant}_p{ps}"
                pr = [r[key] for r in peer_runs]
                reqs = pr[0]["requests"]
                for label in kvc_labels:
                    kr = runs[label]
                    cell, vs = both(kr, key, "seconds", key, "seconds")
                    k0 = kr[0][key]
                    rows.append([str(ps), what, label, rate(seq_rates(kr, key, "seconds", reqs)),
                                 rate(seq_rates(peer_runs, key, "seconds", reqs)), cell,
                                 f"{k0['device_hit']:,} / {k0['host_hit']:,} / {k0['computed']:,}",
                                 f"{pr[0]['device_hit']:,} / {pr[0]['host_hit']:,} / {pr[0]['computed']:,}"])
                    if label == kvc_labels[0] and variant == "serve":
                        ratios[f"serve_over_hicache_p{ps}"] = vs
                    elif label == kvc_labels[0]:
                        ratios[f"serve_native_over_hicache_p{ps}"] = vs
            k0 = runs[kvc_labels[0]][0][f"serve_p{ps}"]
            slots.append(f"page {ps}: kvc {k0['device_slots']:,} / {k0['host_slots']:,}, HiCache "
                         f"{pr[0]['device_slots']:,} / {pr[0]['host_slots']:,}")
        body += ["", "### Serve loop: L1 + L2 with churn, write-through", "",
                 f"{args.serve_passes} passes over the {args.sequences:,} sequences in shuffled orders "
                 f"({reqs:,} requests); device pool {args.dev_frac:g} of the unique tokens, host pool "
                 f"{args.host_ratio:g}x the device pool (device / host slots: {'; '.join(slots)}), 32 B of KV per "
                 f"token. kvc: `TieredCache` admit + commit, "
                 f"`poll()` every 16 requests, `flush()` at the end; audit passes after. SGLang: HiCache "
                 f"(`UnifiedRadixCache` with its {pr[0]['core']} + cache controller, write_through, "
                 f"threshold 1) driven as its scheduler does, `check_hicache_events()` every 16 requests; CUDA-only "
                 f"pieces replaced by plain torch on CPU (see the script's docstring). Tokens: each request's tokens "
                 f"arrive as the Python list (each side builds its key from it in the loop), or prebuilt in each "
                 f"side's own form before the loop (kvc: packed bytes, SGLang: `array('q')`, which its scheduler "
                 f"keeps). Token counts of the first rep: a device hit was on the device at the match, a host hit "
                 f"was loaded back from the host tier; each side's own eviction policy decides the split.", "",
                 labelled(["page", "tokens", "kvc", "kvc req/s", "HiCache req/s", "kvc / HiCache",
                           "kvc tokens: device hit / host hit / computed",
                           "HiCache tokens: device hit / host hit / computed"], rows, 2)]
    if len(kvc_labels) > 1:
        body += ["", f"### kvc trees against each other (over `{kvc_labels[0]}`, same phase of the same rep)", "",
                 table(["figure", *[f"{label} / {kvc_labels[0]}" for label in kvc_labels[1:]]],
                       kvc_versus(runs, kvc_labels, args))]
    if problems:
        body += ["", "**The sides did not do the same work:** " + "; ".join(problems)]
    publish("bench_vs_sglang", "\n".join(body), args.no_write, ratios)
    return 1 if problems else 0


def kvc_versus(runs: dict[str, list[dict]], labels: list[str], args: argparse.Namespace) -> list[list[str]]:
    """Rows of speed ratios of every measured kvc tree over the first, per figure (wall-clock; CPU-time median)."""
    from _report import spread

    figures = [(f"tree insert, page {ps}", f"tree_p{ps}", "insert") for ps in args.page_sizes if "tree" in args.cases]
    figures += [(f"tree full-hit match (key from list), page {ps}", f"tree_p{ps}", "match")
                for ps in args.page_sizes if "tree" in args.cases]
    figures += [(f"admit+commit, tokens as lists, page {ps}", f"admit_p{ps}", "admit_commit")
                for ps in args.page_sizes if "admit" in args.cases]
    figures += [(f"admit+commit, tokens prebuilt, page {ps}", f"admit_native_p{ps}", "admit_commit")
                for ps in args.page_sizes if "admit" in args.cases]
    figures += [(f"serve loop, tokens as lists, page {ps}", f"serve_p{ps}", "seconds") for ps in args.serve_page_sizes]
    figures += [(f"serve loop, tokens prebuilt, page {ps}", f"serve_native_p{ps}", "seconds")
                for ps in args.serve_page_sizes]
    rows = []
    for name, key, field in figures:
        row = [name]
        for label in labels[1:]:
            pairs = list(zip(runs[labels[0]], runs[label], strict=True))
            wall = [a[key][field][0] / b[key][field][0] for a, b in pairs]
            cpu = [a[key][field][1] / b[key][field][1] for a, b in pairs]
            row.append(f"**{spread(wall)}**; cpu {statistics.median(cpu):.2f}x")
        rows.append(row)
    return rows


def command_line(args: argparse.Namespace) -> str:
    parts = ["KVC_PEER_PYTHON=... python benchmarks/bench_vs_sglang.py", f"--reps {args.reps}"]
    defaults = {"cases": list(CASES), "sequences": 2000, "seq_len": 1024, "groups": 20, "seed": 0,
                "page_sizes": [1, 16], "serve_passes": 2, "dev_frac": 0.25, "host_ratio": 4.0}
    for name, default in defaults.items():
        value = getattr(args, name)
        if value != default:
            shown = ",".join(map(str, value)) if isinstance(value, list) else value
            parts.append(f"--{name.replace('_', '-')} {shown}")
    if "serve" in args.cases and args.serve_page_sizes != [16]:
        parts.append(f"--serve-page-sizes {','.join(map(str, args.serve_page_sizes))}")
    if args.kvc_python:
        parts += [f"--kvc-python {spec}" for spec in args.kvc_python]
    return " ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
