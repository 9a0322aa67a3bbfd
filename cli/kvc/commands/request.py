"""`kvc prefetch`, `kvc stage`, `kvc load-back`: one request (or one namespace) through the L3 path of a cache.

Each command builds one admin request (`kvcache.live.protocol`) and has a cache run it with
`kvcache.ops.handlers.execute` — the same code either way. With --socket, the live cache runs it on its owner
thread and what it warms stays. Offline, a `TieredCache` is embedded on the store for the length of the command,
sized to the request: it shows what the cache does (and checks the bytes), and its L2/L1 end with the process.
"""

from __future__ import annotations

import contextlib
from typing import Annotated

import typer

from kvcache.live.protocol import LoadBackRequest, PrefetchRequest, RequestResult, StageRequest
from kvcache.types.config import PrefetchPolicy
from kvcache.types.namespace import Namespace

from .. import live
from ..context import offline_cache, open_for_cache, round_up_pages
from ..errors import EXIT_FOUND, UsageError
from ..inputs import tokens_arg
from ..options import (
    DEFAULT_STORE,
    DebugOpt,
    ExtraKeyOpt,
    JsonOpt,
    SaltFileOpt,
    SaltOpt,
    SocketOpt,
    StoreOpt,
    TokensFileOpt,
    TokensOpt,
)
from ..render.output import emit_json, say
from ..render.text import esc, human_bytes, ns_label
from ..reporting import at_steps, command
from ..secrets import salt_from

DEFAULT_MAX_PAGES = 4096
MAX_PAGES = 2**31 - 1  # a budget, not a size: L2 is sized from what the namespace holds, never from this

PolicyOpt = Annotated[PrefetchPolicy, typer.Option(
    "--policy", help="When the prefetch is settled: wait_complete (wait for every hit page), timeout (wait up to "
    "--timeout-ms), best_effort (take what has arrived).", case_sensitive=False)]
TimeoutOpt = Annotated[float, typer.Option("--timeout-ms", min=0, max=3_600_000,
                                           help="Budget of the timeout policy, in milliseconds.")]


def _namespace(extra_key: str | None, salt: str | None, salt_file) -> tuple[Namespace, str | None]:
    """The request's namespace (checked before anything runs) and the salt the admin request carries."""
    value = salt_from(salt, salt_file)
    return Namespace(extra_key, value), value


def _tokens(tokens: str | None, tokens_file) -> list[int]:
    ids = tokens_arg(tokens, tokens_file)
    if ids is None:
        raise UsageError("give the request with --tokens or --tokens-file")
    return ids.tolist()


def _run(store, socket: str | None, request, mode: str, device_tokens: int, host_tokens: int,
         warm: Namespace | None = None, warm_pages: int = 0) -> RequestResult:
    """Run an admin request on the live cache at `socket`, or on a cache embedded on `store` for this command
    with tiers of `device_tokens` and `host_tokens`; to warm the namespace `warm`, L2 holds what it has stored,
    up to `warm_pages`."""
    if socket is not None:
        return live.call(socket, request, RequestResult)
    with contextlib.closing(open_for_cache(store)) as handle:
        layout = handle.layout
        assert layout is not None
        ps = layout.page_size
        if warm is not None:
            stored = next((r.pages for r in handle.namespaces() if r.ns_id_hex == warm.id_hex), 0)
            host_tokens = max(host_tokens, min(stored, warm_pages) * ps)
        # offline the prefetch is the only thing running, so a miss is final: no retries to wait for
        cache = offline_cache(handle, layout, round_up_pages(device_tokens, ps), round_up_pages(host_tokens, ps),
                              host_mode=mode, prefetch_retries=0)
        with at_steps(), contextlib.closing(cache):  # a Ctrl-C waits for the request and the close
            from kvcache.errors import InvariantViolation
            from kvcache.ops.handlers import execute

            result = execute(cache, request)
            assert isinstance(result, RequestResult)  # prefetch, stage and load-back answer a RequestResult
            audit = cache.audit()
            if not audit.ok:  # a broken invariant is kvc's bug: say so loudly, never print a result
                raise InvariantViolation(f"the ownership audit failed after {result.command}: {audit.violations[0]}")
    return result


def _emit(result: RequestResult, json: bool) -> None:
    if json:
        emit_json(result)
        return
    what = f"{result.prefixes} prefixes, " if result.prefixes else ""
    say(f"{result.command} {ns_label(result.namespace)}: {what}{result.hit_tokens}/{result.requested_tokens} tokens "
        f"hit ({result.pages} pages, {human_bytes(result.bytes)}) in {result.seconds * 1000:.1f} ms")
    if result.declined:
        say(f"  no prefetch started: {esc(result.declined)}")
    if result.staged is not None:
        s = result.staged
        say(f"  staged record #{s.id} for {esc(s.rid)}: namespace id {esc(s.namespace_id)}, tokens "
            f"{s.start_tokens}..{s.start_tokens + s.staged_tokens} of {s.key_tokens}, op {s.op_id}")
    if result.command == "load-back":
        verdict = "ok" if not result.verify_mismatches else f"{result.verify_mismatches} pages DIFFER"
        absent = (f"; {result.verify_absent} pages not in L3 (not written yet, or dropped from it): not compared"
                  if result.verify_absent else "")
        say(f"  loaded back {result.loaded_back_tokens} tokens L2 -> L1; verified {result.verified_tokens} "
            f"device tokens against the store: {verdict}{absent}")


@command
def prefetch(
    store: StoreOpt = DEFAULT_STORE,
    extra_key: ExtraKeyOpt = None,
    salt: SaltOpt = None,
    salt_file: SaltFileOpt = None,
    tokens: TokensOpt = None,
    tokens_file: TokensFileOpt = None,
    max_pages: Annotated[int, typer.Option(
        "--max-pages", min=0, max=MAX_PAGES,
        help="Without tokens: most pages to fetch from the namespace's hottest prefixes.")] = DEFAULT_MAX_PAGES,
    max_bytes: Annotated[int | None, typer.Option(
        "--max-bytes", min=0, max=2**62, help="Without tokens: most payload bytes to fetch.")] = None,
    policy: PolicyOpt = PrefetchPolicy.WAIT_COMPLETE,
    timeout_ms: TimeoutOpt = 1000.0,
    socket: SocketOpt = None,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Prefetch from L3 into L2: one request (--tokens / --tokens-file), or, without tokens, the namespace's
    hottest stored prefixes up to --max-pages / --max-bytes, walked from its root in the store. With --socket
    the pages land in the live cache's L2 and stay."""
    ids = tokens_arg(tokens, tokens_file)
    ns, salt_value = _namespace(extra_key, salt, salt_file)
    request = PrefetchRequest(extra_key, salt_value, None if ids is None else ids.tolist(), max_pages, max_bytes,
                              policy, timeout_ms)
    _emit(_run(store, live.socket_path(socket), request, "cache", 1, 0 if ids is None else len(ids),
               ns if ids is None else None, max_pages), json)


@command
def stage(
    store: StoreOpt = DEFAULT_STORE,
    extra_key: ExtraKeyOpt = None,
    salt: SaltOpt = None,
    salt_file: SaltFileOpt = None,
    tokens: TokensOpt = None,
    tokens_file: TokensFileOpt = None,
    policy: PolicyOpt = PrefetchPolicy.WAIT_COMPLETE,
    timeout_ms: TimeoutOpt = 1000.0,
    socket: SocketOpt = None,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Prefetch one request in buffer mode and show its staged record: the fetched pages parked for that
    request, with the request's namespace fingerprint (the record is given back afterwards)."""
    ids = _tokens(tokens, tokens_file)
    _, salt_value = _namespace(extra_key, salt, salt_file)
    request = StageRequest(ids, extra_key, salt_value, policy, timeout_ms)
    _emit(_run(store, live.socket_path(socket), request, "buffer", 1, len(ids)), json)


@command
def load_back(
    store: StoreOpt = DEFAULT_STORE,
    extra_key: ExtraKeyOpt = None,
    salt: SaltOpt = None,
    salt_file: SaltFileOpt = None,
    tokens: TokensOpt = None,
    tokens_file: TokensFileOpt = None,
    mode: Annotated[str, typer.Option(
        "--mode", help="Offline: cache (insert the fetched pages as host-only nodes, then load them back) or "
        "buffer (stage them, then splice the staged record at admission). A live cache uses its own mode.")]
    = "cache",
    policy: PolicyOpt = PrefetchPolicy.WAIT_COMPLETE,
    timeout_ms: TimeoutOpt = 1000.0,
    socket: SocketOpt = None,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """L3 -> L2 -> L1 for one request: prefetch, admit (load back into device slots, splice into the tree),
    then compare every cached device page with the store's bytes. Exit 1 when any page differs. A page the store
    does not hold (a live cache's page not written yet under write-back, or dropped from L3) is counted as absent,
    not compared, and is no failure."""
    if mode not in ("cache", "buffer"):
        raise UsageError(f"--mode {mode!r}: expected cache or buffer")
    ids = _tokens(tokens, tokens_file)
    _, salt_value = _namespace(extra_key, salt, salt_file)
    request = LoadBackRequest(ids, extra_key, salt_value, policy, timeout_ms)
    result = _run(store, live.socket_path(socket), request, mode, len(ids), len(ids))
    _emit(result, json)
    if result.verify_mismatches:
        raise typer.Exit(EXIT_FOUND)
