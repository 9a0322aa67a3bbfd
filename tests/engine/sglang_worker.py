"""One process of the engine check: SGLang 0.5.23's own HiCache on CPU, with one L3 backend (run by the peer python).

`write` plays an engine that served a multi-tenant workload: every prompt goes through SGLang's UnifiedRadixCache
(insert -> write-through to the host pool -> the cache controller's backup thread writes the pages to L3), and the
process waits for every L3 write acknowledgement before it records what it wrote (the KV bytes of every prompt).
`read` is a fresh engine on the same store: for every prompt it prefetches from L3 as SGLang's scheduler does
(match_prefix, prefetch_from_storage anchored at the deepest host node, check_prefetch_progress until the prefetch
is acknowledged, pop_prefetch_loaded_span), loads the hit back into the device pool and compares every byte with
what `write` recorded; it also asks for the same prompts under a namespace that never wrote them.

The tree, the cache controller, its threads and the storage backend are SGLang's own; the stand-ins are only what a
CPU-only torch lacks (cudaHostRegister'ed host memory, the sgl_kernel copy ops, a CPU stream's synchronize, a
one-rank process group). Usage: `python sglang_worker.py write|read CONFIG.json`; the result is a JSON file.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from queue import Queue

import torch

os.environ.setdefault("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python")
HEADS, HEAD_DIM, LAYERS = 2, 16, 2  # one token's K of one layer is 128 bytes: a unique needle to find a page by
DTYPE = torch.float32
MODEL = "kvc-engine-check/toy-mha"  # the served model name SGLang hands the backend: part of kvc's layout


@dataclass(frozen=True)
class Tenant:
    """One SGLang namespace: a request's extra_key and cache_salt (None = absent)."""

    extra_key: str | None
    cache_salt: str | None


@dataclass(frozen=True)
class Config:
    """What both processes agree on: backend, store, geometry and workload."""

    backend: str  # "kvc" (kvcache.engines.sglang.KvcStorage through `dynamic`) or "file" (SGLang's HiCacheFile)
    store: str  # kvc store URL / path, or the file backend's directory
    result: str  # where the process writes its JSON result
    expected: str  # the KV bytes `write` recorded (torch.save), read by `read`
    page_size: int = 16
    prompt_tokens: int = 512  # per tenant; >= SGLang's prefetch threshold (256 tokens)
    tenants: list[Tenant] = field(default_factory=list)
    stranger: Tenant = Tenant("never-wrote", None)  # a namespace that never wrote the prompts
    interface_v1: bool = False  # the zero-copy batch_get_v1/batch_set_v1 interface
    layout: str = "layer_first"  # SGLang's host memory layout: layer_first or page_first_direct (its CPU-direct ones)
    pass_prefix_keys: bool = True  # SGLang's hicache_storage_pass_prefix_keys: parents' keys on every call

    @staticmethod
    def load(path: str) -> Config:
        raw = json.loads(open(path).read())
        raw["tenants"] = [Tenant(**t) for t in raw["tenants"]]
        raw["stranger"] = Tenant(**raw["stranger"])
        return Config(**raw)

    def dump(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f)


def prompt(config: Config, shared: bool) -> list[int]:
    """The tokens every tenant sends (shared) or one tenant alone sends: deterministic, page-aligned."""
    g = torch.Generator().manual_seed(7 if shared else 8)
    return torch.randint(1, 150_000, (config.prompt_tokens,), generator=g).tolist()


def _cpu_stand_ins() -> None:
    """Patch what a CPU-only torch lacks; SGLang's tree, controller and storage logic run unchanged."""
    from sglang.srt.mem_cache.pool_host import common as host_common
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    host_common.ALLOC_MEMORY_FUNCS["cpu"] = lambda dims, dtype, device, *a, **k: torch.zeros(dims, dtype=dtype)

    def host_rows(self, host_indices, layer):
        """The host pool's rows of `layer` at `host_indices`, per layout: (buffer index for K, for V)."""
        if self.layout == "layer_first":  # [2, layers, size, heads, dim]
            return (0, layer, host_indices), (1, layer, host_indices)
        page, offset = host_indices // self.page_size, host_indices % self.page_size
        # page_first_direct: [2, pages, layers, page_size, heads, dim]
        return (0, page, layer, offset), (1, page, layer, offset)

    def backup_all_layers(self, device_pool, host_indices, device_indices, io_backend):
        for layer in range(self.layer_num):
            k_at, v_at = host_rows(self, host_indices, layer)
            self.kv_buffer[k_at] = device_pool.k_buffer[layer][device_indices]
            self.kv_buffer[v_at] = device_pool.v_buffer[layer][device_indices]

    def load_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft=False):
        k_at, v_at = host_rows(self, host_indices, layer_id)
        device_pool.k_buffer[layer_id][device_indices] = self.kv_buffer[k_at]
        device_pool.v_buffer[layer_id][device_indices] = self.kv_buffer[v_at]

    MHATokenToKVPoolHost.backup_from_device_all_layer = backup_all_layers
    MHATokenToKVPoolHost.load_to_device_per_layer = load_layer
    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = lambda self: None


def build(config: Config):
    """SGLang's UnifiedRadixCache with HiCache (write_through, wait_complete prefetch) on the configured L3."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend="gloo", rank=0, world_size=1)
    _cpu_stand_ins()
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    if config.backend == "kvc":
        backend = "dynamic"
        extra = {"backend_name": "kvc", "module_path": "kvcache.engines.sglang", "class_name": "KvcStorage",
                 "kvc_store": config.store}
    else:
        backend = "file"
        extra = {"file_storage_path": config.store}
    extra.update(interface_v1=int(config.interface_v1), hicache_storage_pass_prefix_keys=config.pass_prefix_keys)
    args = ServerArgs(model_path="dummy", served_model_name=MODEL, page_size=config.page_size,
                      enable_hierarchical_cache=True,
                      hicache_io_backend="direct", hicache_mem_layout=config.layout,
                      hicache_write_policy="write_through", hicache_ratio=2.0,
                      hicache_storage_backend=backend, hicache_storage_prefetch_policy="wait_complete",
                      hicache_storage_backend_extra_config=json.dumps(extra))
    set_global_server_args_for_scheduler(args)
    parallel = get_parallel()
    for name, value in dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                            attn_tp_rank=0, attn_tp_size=1, attn_dp_rank=0, dp_rank=0).items():
        try:
            parallel.override_permanently(**{name: value})
        except Exception:  # noqa: BLE001 - a rank this SGLang build does not track needs no stamp
            pass
    tokens = 4 * config.prompt_tokens * (len(config.tenants) + 2)
    pool = MHATokenToKVPool(size=tokens, page_size=config.page_size, dtype=DTYPE, head_num=HEADS,
                            head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    alloc = PagedTokenToKVPoolAllocator(size=tokens, page_size=config.page_size, dtype=DTYPE, device="cpu",
                                        kvcache=pool, need_sort=False)
    params = CacheInitParams(req_to_token_pool=ReqToTokenPool(size=4, max_context_len=4 * config.prompt_tokens,
                                                              device="cpu", enable_memory_saver=False),
                             token_to_kv_pool_allocator=alloc, page_size=config.page_size, disable=False,
                             tree_components=(ComponentType.FULL,), tp_cache_group=torch.distributed.group.WORLD)
    cache = UnifiedRadixCache(params=params)
    cache.init_hicache(args, params)
    cache.write_through_threshold = 1
    # The generic L3 interface reads into bounce pages the host pool allocates pinned: plain memory on CPU.
    cache.cache_controller.storage_host_pool.pin_memory = False
    return cache, alloc, pool


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_item(queue: Queue, what: str) -> None:
    """Block until `queue` holds an item (an SGLang thread put an acknowledgement there): an event, not a sleep.

    The bound only turns a hung SGLang thread into a failure instead of a hung check."""
    with queue.not_empty:  # holds the queue's mutex: look at its deque directly (qsize() would take it again)
        if not queue.not_empty.wait_for(lambda: len(queue.queue) > 0, timeout=120):
            raise TimeoutError(f"no {what} acknowledgement from SGLang's cache controller within 120 s")


def requests(config: Config) -> list[tuple[str, Tenant, list[int]]]:
    """(request id, tenant, tokens): every tenant sends the shared prompt, the first one also its own prompt."""
    shared, own = prompt(config, True), prompt(config, False)
    out = [(f"t{i}-shared", t, shared) for i, t in enumerate(config.tenants)]
    out.append(("t0-own", config.tenants[0], own))
    return out


def write(config: Config) -> dict:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache, alloc, pool = build(config)
    expected: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(11)
    for rid, tenant, tokens in requests(config):
        key = RadixKey(tokens, extra_key=tenant.extra_key, cache_salt=tenant.cache_salt)
        match = cache.match_prefix(MatchPrefixParams(key=key))
        assert match.device_prefix_len == 0, f"{rid}: tenants must not share KV ({match.device_prefix_len} hit)"
        slots = alloc.alloc(len(tokens))
        assert slots is not None, "device pool too small for the workload"
        kv = torch.randn((2, LAYERS, len(tokens), HEADS, HEAD_DIM), generator=g, dtype=DTYPE)
        for layer in range(LAYERS):
            pool.k_buffer[layer][slots] = kv[0, layer]
            pool.v_buffer[layer][slots] = kv[1, layer]
        cache.insert(InsertParams(key=key, value=slots, prev_prefix_len=0))
        expected[rid] = kv
    # Write-through: device -> host (acks on the write queue), then host -> L3 (acks on the backup queue).
    cache.writing_check(write_back=True)
    controller = cache.cache_controller
    while cache.ongoing_write_through or cache.ongoing_backup:
        cache.check_hicache_events()
        if cache.ongoing_backup:
            _wait_for_item(controller.ack_backup_queue, "L3 backup")
            cache.check_hicache_events()
    torch.save(expected, config.expected)
    pages = sum(len(t) // config.page_size for _, _, t in requests(config))
    return {"pages_written": pages, "tokens_written": pages * config.page_size, "kvc_stats": kvc_stats(cache)}


def kvc_stats(cache) -> dict | None:
    """The kvc adapter's own counters (None for SGLang's file backend)."""
    import msgspec

    backend = cache.cache_controller.storage_backend
    return msgspec.to_builtins(backend.kvc_stats()) if hasattr(backend, "kvc_stats") else None


def prefetch(cache, rid: str, tenant: Tenant, tokens: list[int]) -> tuple[int, int]:
    """Ask L3 for `tokens` as SGLang's scheduler does; (tokens already on host/device, tokens loaded from L3)."""
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    key = RadixKey(tokens, extra_key=tenant.extra_key, cache_salt=tenant.cache_salt)
    match = cache.match_prefix(MatchPrefixParams(key=key))
    matched = match.device_prefix_len + match.host_hit_length
    anchor = match.last_host_node
    handle = CacheRequestHandle(rid, 0)
    prefix_keys = cache.get_prefix_hash_values(anchor) if cache.hicache_storage_pass_prefix_keys else None
    cache.prefetch_from_storage(handle, anchor, tokens[matched:], cache.get_last_hash_value(anchor), prefix_keys,
                                matched_prefix_tokens=tokens[:matched], extra_key=tenant.extra_key,
                                cache_salt=tenant.cache_salt)
    controller = cache.cache_controller
    if cache.has_ongoing_prefetch(handle):
        # The controller's query thread answers how many pages L3 holds; the scheduler then stages the hit (or
        # revokes a miss), and the IO thread acknowledges the pages it read.
        _wait_for_item(controller.prefetch_hit_queue, "L3 hit query")
        cache.check_hicache_events()
    while not cache.check_prefetch_progress(handle):
        _wait_for_item(controller.ack_prefetch_queue, "prefetch")
        cache.check_hicache_events()
    loaded, _start = cache.pop_prefetch_loaded_span(handle)
    return matched, loaded


def device_kv(cache, pool, tenant: Tenant, tokens: list[int]) -> torch.Tensor:
    """The KV the engine would attend to for `tokens` now: load the host hit back to the device, read the pool."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    key = RadixKey(tokens, extra_key=tenant.extra_key, cache_salt=tenant.cache_salt)
    match = cache.match_prefix(MatchPrefixParams(key=key))
    if match.host_hit_length > 0:
        assert cache.load_back(match.best_match_node), "load_back refused"
        cache.ready_to_load_host_cache()
        cache.loading_check() if hasattr(cache, "loading_check") else None
        cache.check_hicache_events()
        match = cache.match_prefix(MatchPrefixParams(key=key))
    slots = cache.path_device_indices(match.last_device_node)
    out = torch.empty((2, LAYERS, len(slots), HEADS, HEAD_DIM), dtype=DTYPE)
    for layer in range(LAYERS):
        out[0, layer] = pool.k_buffer[layer][slots]
        out[1, layer] = pool.v_buffer[layer][slots]
    return out


def read(config: Config) -> dict:
    cache, _alloc, pool = build(config)
    expected: dict[str, torch.Tensor] = torch.load(config.expected)
    per_request = {}
    differing = 0
    for rid, tenant, tokens in requests(config):
        # First half, then the whole prompt: the second prefetch is anchored below the root (at the first half's
        # host node), the case where SGLang passes the anchor's ancestors' hashes as prefix_keys.
        half = (len(tokens) // 2) // config.page_size * config.page_size
        _, first = prefetch(cache, rid + "/half", tenant, tokens[:half])
        on_host, second = prefetch(cache, rid, tenant, tokens)
        got = device_kv(cache, pool, tenant, tokens)
        want = expected[rid][:, :, : got.shape[2]]
        diff = int((got.contiguous().view(torch.uint8) != want.contiguous().view(torch.uint8)).sum())
        differing += diff
        per_request[rid] = {"l3_tokens": first + second, "host_before_second": on_host,
                            "device_tokens": got.shape[2], "bytes_differing": diff}
    stranger = {}
    for rid, _tenant, tokens in requests(config):
        _, loaded = prefetch(cache, rid + "/stranger", config.stranger, tokens)
        stranger[rid] = loaded
    return {"requests": per_request, "bytes_differing": differing, "stranger_l3_tokens": stranger,
            "l3_tokens": sum(r["l3_tokens"] for r in per_request.values()), "kvc_stats": kvc_stats(cache)}


def main(argv: list[str]) -> int:
    mode, path = argv
    config = Config.load(path)
    torch.set_num_threads(1)
    result = write(config) if mode == "write" else read(config)
    with open(config.result, "w") as f:
        json.dump(result, f)
    # SGLang's storage threads are not daemons: leave without waiting for them (the result is on disk).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
