"""`kvc prefetch`, `kvc stage`, `kvc load-back`: one request (or one namespace) through the L3 path of a cache.

Offline (no --socket) each command embeds a `TieredCache` on the store for the length of the command, sized to
the request, and drives the same calls an engine makes: `prefetch` → `settle_prefetch` (cache mode: host-only
nodes; buffer mode: a staged record) → `admit` (load back L2 → L1 and splice). What it reports is what the
cache did; the L2/L1 contents end with the process — live mode (`--socket`) is where warming persists.
"""

from __future__ import annotations

import contextlib
import time
from typing import Annotated

import msgspec
import numpy as np
import torch
import typer

from kvcache import AdmitStatus, NamespaceInfo, PrefetchPolicy, Request, StagedView
from kvcache.keys import page_hashes
from kvcache.warm import warm_namespace

from . import live
from .common import (DEFAULT_STORE, EXIT_FOUND, DebugOpt, ExtraKeyOpt, JsonOpt, SaltOpt, StoreOpt, TokensFileOpt,
                     TokensOpt, UsageError, command, emit_json, human_bytes, namespace_arg, offline_cache,
                     open_for_cache, out, round_up_pages, tokens_arg)

DEFAULT_MAX_PAGES = 4096

PolicyOpt = Annotated[PrefetchPolicy, typer.Option(
    "--policy", help="When the prefetch is settled: wait_complete (wait for every hit page), timeout (wait up to "
    "--timeout-ms), best_effort (take what has arrived).", case_sensitive=False)]
TimeoutOpt = Annotated[float, typer.Option("--timeout-ms", help="Budget of the timeout policy, in milliseconds.")]


class RequestOutput(msgspec.Struct):
    """`kvc prefetch|stage|load-back --json` (DESIGN §8 pins requested_tokens, hit_tokens, pages, bytes,
    seconds, namespace)."""

    command: str
    namespace: NamespaceInfo
    requested_tokens: int  # tokens of the request (namespace prefetch: of the chosen prefixes, shared pages once)
    hit_tokens: int  # prefetch/stage: tokens that landed in L2; load-back: tokens cached on the device
    pages: int  # pages those tokens fill
    bytes: int  # their payload bytes
    seconds: float
    declined: str | None = None  # why no prefetch was started (DeclineReason), when none was
    prefixes: int = 0  # namespace prefetch: prefixes walked from the store's prefix tree
    staged: StagedView | None = None  # stage: the record, with the request's namespace fingerprint
    loaded_back_tokens: int = 0  # load-back: tokens copied L2 -> L1 by the admission
    verified_tokens: int = 0  # load-back: device tokens compared with the store's bytes
    verify_mismatches: int = 0  # load-back: pages whose device bytes differ from the store's


def _request(extra_key: str | None, salt: str | None, tokens: str | None, tokens_file) -> Request:
    ids = tokens_arg(tokens, tokens_file)
    if ids is None:
        raise UsageError("give the request with --tokens or --tokens-file")
    return Request("kvc-cli", ids, namespace_arg(extra_key, salt))


def _policies(policy: PrefetchPolicy, timeout_ms: float, mode: str) -> dict:
    # offline: the prefetch is the only thing running, so a miss is final (no retries to wait for)
    return dict(prefetch_policy=policy, prefetch_timeout_ms=timeout_ms, prefetch_timeout_per_page_ms=0.0,
                prefetch_retries=0, host_mode=mode)


def _emit(result: RequestOutput, json: bool) -> None:
    if json:
        emit_json(result)
        return
    ns = result.namespace
    label = f"{ns.extra_key or '(no extra_key)'} salt={ns.salt_fingerprint or '-'}"
    what = f"{result.prefixes} prefixes, " if result.prefixes else ""
    out.print(f"{result.command} {label}: {what}{result.hit_tokens}/{result.requested_tokens} tokens hit "
              f"({result.pages} pages, {human_bytes(result.bytes)}) in {result.seconds * 1000:.1f} ms")
    if result.declined:
        out.print(f"  no prefetch started: {result.declined}")
    if result.staged is not None:
        s = result.staged
        out.print(f"  staged record #{s.id} for {s.rid}: namespace id {s.namespace_id[:16]}, tokens "
                  f"{s.start_tokens}..{s.start_tokens + s.staged_tokens} of {s.key_tokens}, op {s.op_id}")
    if result.command == "load-back":
        verdict = "ok" if not result.verify_mismatches else f"{result.verify_mismatches} pages DIFFER"
        out.print(f"  loaded back {result.loaded_back_tokens} tokens L2 -> L1; verified {result.verified_tokens} "
                  f"device tokens against the store: {verdict}")


@command
def prefetch(
    store: StoreOpt = DEFAULT_STORE,
    extra_key: ExtraKeyOpt = None,
    salt: SaltOpt = None,
    tokens: TokensOpt = None,
    tokens_file: TokensFileOpt = None,
    max_pages: Annotated[int, typer.Option(
        "--max-pages", help="Without tokens: most pages to fetch from the namespace's hottest prefixes.")]
    = DEFAULT_MAX_PAGES,
    max_bytes: Annotated[int | None, typer.Option(
        "--max-bytes", help="Without tokens: most payload bytes to fetch.")] = None,
    policy: PolicyOpt = PrefetchPolicy.WAIT_COMPLETE,
    timeout_ms: TimeoutOpt = 1000.0,
    socket: live.SocketOpt = None,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Prefetch from L3 into L2: one request (--tokens / --tokens-file), or, without tokens, the namespace's
    hottest stored prefixes up to --max-pages / --max-bytes, walked from its root in the store."""
    ids = tokens_arg(tokens, tokens_file)
    if max_pages < 0 or (max_bytes is not None and max_bytes < 0):
        raise UsageError("--max-pages and --max-bytes must be >= 0")
    if (sock := live.socket_path(socket)) is not None:  # live: warms the running cache's L2, and it stays
        return _emit(live.prefetch(sock, extra_key, salt, ids, max_pages, max_bytes, policy, timeout_ms), json)
    with contextlib.closing(open_for_cache(store)) as handle:
        layout = handle.layout
        ps = layout.page_size  # type: ignore[union-attr]
        if ids is None:
            ns = namespace_arg(extra_key, salt)
            host = max_pages * ps or ps
            cache = offline_cache(handle, layout, ps, host, **_policies(policy, timeout_ms, "cache"))
            with contextlib.closing(cache):
                warm = warm_namespace(cache, ns, max_pages, max_bytes)
            declined = ", ".join(f"{k}={v}" for k, v in sorted(warm.declined.items())) or None
            result = RequestOutput("prefetch", warm.namespace, warm.requested_tokens, warm.hit_tokens, warm.pages,
                                   warm.bytes, warm.seconds, declined, warm.prefixes)
        else:
            request = Request("kvc-cli", ids, namespace_arg(extra_key, salt))
            size = round_up_pages(len(request), ps)
            cache = offline_cache(handle, layout, ps, size, **_policies(policy, timeout_ms, "cache"))
            with contextlib.closing(cache):
                result = _prefetch_one(cache, request, "prefetch")
    _emit(result, json)


def _prefetch_one(cache, request: Request, command_name: str) -> RequestOutput:
    start = time.perf_counter()
    outcome = cache.prefetch(request)
    pages = 0
    if outcome.issued:
        settled = cache.settle_prefetch(request.rid)
        pages = settled.fetched_pages
    ps = cache.page_size
    return RequestOutput(command_name, request.namespace.info(), len(request), pages * ps, pages,
                         pages * cache.layout.bytes_per_page, time.perf_counter() - start,
                         None if outcome.issued else outcome.reason.value)


@command
def stage(
    store: StoreOpt = DEFAULT_STORE,
    extra_key: ExtraKeyOpt = None,
    salt: SaltOpt = None,
    tokens: TokensOpt = None,
    tokens_file: TokensFileOpt = None,
    policy: PolicyOpt = PrefetchPolicy.WAIT_COMPLETE,
    timeout_ms: TimeoutOpt = 1000.0,
    socket: live.SocketOpt = None,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Prefetch one request in buffer mode and show its staged record: the fetched pages parked for that
    request, with the request's namespace fingerprint, until its admission splices them."""
    request = _request(extra_key, salt, tokens, tokens_file)
    if (sock := live.socket_path(socket)) is not None:
        return _emit(live.stage(sock, extra_key, salt, request.tokens, policy, timeout_ms), json)
    with contextlib.closing(open_for_cache(store)) as handle:
        layout = handle.layout
        ps = layout.page_size  # type: ignore[union-attr]
        cache = offline_cache(handle, layout, ps, round_up_pages(len(request), ps),
                              **_policies(policy, timeout_ms, "buffer"))
        with contextlib.closing(cache):
            result = _prefetch_one(cache, request, "stage")
            records = cache.staged_records()
            result.staged = records[0].view() if records else None
    _emit(result, json)


@command
def load_back(
    store: StoreOpt = DEFAULT_STORE,
    extra_key: ExtraKeyOpt = None,
    salt: SaltOpt = None,
    tokens: TokensOpt = None,
    tokens_file: TokensFileOpt = None,
    mode: Annotated[str, typer.Option(
        "--mode", help="cache: insert the fetched pages as host-only nodes, then load them back; buffer: stage "
        "them, then splice the staged record at admission.")] = "cache",
    policy: PolicyOpt = PrefetchPolicy.WAIT_COMPLETE,
    timeout_ms: TimeoutOpt = 1000.0,
    socket: live.SocketOpt = None,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """L3 -> L2 -> L1 for one request: prefetch, admit (load back into device slots, splice into the tree),
    then compare every cached device token with the store's bytes. Exit 1 when any page differs."""
    if mode not in ("cache", "buffer"):
        raise UsageError(f"--mode {mode!r}: expected cache or buffer")
    request = _request(extra_key, salt, tokens, tokens_file)
    if (sock := live.socket_path(socket)) is not None:  # live: in the cache's own mode; the pages stay loaded
        result = live.load_back(sock, extra_key, salt, request.tokens, policy, timeout_ms)
        _emit(result, json)
        if result.verify_mismatches:
            raise typer.Exit(EXIT_FOUND)
        return
    start = time.perf_counter()
    with contextlib.closing(open_for_cache(store)) as handle:
        layout = handle.layout
        ps = layout.page_size  # type: ignore[union-attr]
        size = round_up_pages(len(request), ps)
        cache = offline_cache(handle, layout, size, size, **_policies(policy, timeout_ms, mode))
        with contextlib.closing(cache):
            outcome = cache.prefetch(request)
            if outcome.issued:
                cache.settle_prefetch(request.rid)
            adm = cache.admit(request)
            if adm.status is not AdmitStatus.ADMITTED:  # the pool is sized to the request: cannot happen
                raise UsageError(f"the device pool refused the request ({adm.status.value})")
            n_pages = adm.cached_tokens // ps
            bad = _compare_with_store(cache, request, adm.slots, n_pages)
            cache.release(request.rid)  # the loaded pages stay in the tree; the request's fresh pages go
            result = RequestOutput("load-back", request.namespace.info(), len(request), adm.cached_tokens,
                                   n_pages, n_pages * layout.bytes_per_page,  # type: ignore[union-attr]
                                   time.perf_counter() - start, None if outcome.issued else outcome.reason.value,
                                   loaded_back_tokens=adm.loaded_back_tokens + adm.storage_hit_tokens
                                   if mode == "buffer" else adm.loaded_back_tokens,
                                   verified_tokens=n_pages * ps, verify_mismatches=bad)
            audit = cache.audit()
            if not audit.ok:
                raise UsageError(f"the cache's ownership audit failed after the load-back: {audit.violations[0]}")
    _emit(result, json)
    if result.verify_mismatches:
        raise typer.Exit(EXIT_FOUND)


def _compare_with_store(cache, request: Request, slots: np.ndarray, n_pages: int) -> int:
    """Pages among the first `n_pages` of the request whose device bytes differ from the store's copy, read
    again from the store by the request's own page hashes."""
    if not n_pages:
        return 0
    ps = cache.page_size
    hashes = page_hashes(cache.layout.layout_id, request.key, ps)[:n_pages]
    want = np.empty((n_pages, cache.layout.bytes_per_page), dtype=np.uint8)
    got_n = cache.store.get_into(hashes, list(want))
    device = cache.device_pool.pages[torch.from_numpy(slots[: n_pages * ps: ps] // ps)].cpu().numpy()
    same = (device[:got_n] == want[:got_n]).all(axis=1)
    return int((~same).sum()) + (n_pages - got_n)
