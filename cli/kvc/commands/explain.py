"""`kvc explain`: why one request misses, tier by tier, from the cache's and the store's own records.

The request is given by its tokens (--tokens / --tokens-file) and namespace (--extra-key, the salt from --salt-file,
--salt - or KVC_SALT), or by its id in a trace (--trace FILE --rid R: the trace line carries its namespace). With
--socket the live cache explains it (`TieredCache.explain`: L1, L2, L3 and the last prefetch of its prefix);
offline the store alone does (L3: `kvcache.ops.explain`). `--json` prints the library's `Explanation` as it is.
The salt is used in memory only: the output shows its keyed fingerprint, and a count of other namespaces, never
which.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated

import typer

from kvcache.errors import InvalidInput
from kvcache.live.protocol import ExplainRequest
from kvcache.types.explain import Explanation, FirstMiss, MissReason, PrefetchFate, TierExplanation
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace

from .. import live
from ..context import fingerprints_of, open_inspect
from ..errors import UsageError
from ..inputs import tokens_arg
from ..options import (
    DEFAULT_STORE,
    DebugOpt,
    ExtraKeyOpt,
    JsonOpt,
    ReadOnlyOpt,
    SaltFileOpt,
    SaltOpt,
    SocketOpt,
    StoreOpt,
    TokensFileOpt,
    TokensOpt,
)
from ..render.output import emit_json, say
from ..render.text import esc, ns_label, when
from ..reporting import command
from ..secrets import salt_from

LAYOUT_ID_MIN_HEX = 8  # --layout: a prefix of the layout id this long at least (`kvc init` prints 16 digits)

TraceOpt = Annotated[Path | None, typer.Option(
    "--trace", show_default=False, help="A JSONL trace (docs/trace-format.md): explain its request --rid, in the "
    "namespace its line names (its salt is used in memory only). Instead of --tokens and the namespace options.")]
RidOpt = Annotated[str | None, typer.Option(
    "--rid", show_default=False, help="With --trace: the id of the request to explain (the first line with it).")]
LayoutOpt = Annotated[str | None, typer.Option(
    "--layout", show_default=False, metavar="ID",
    help=f"Offline, for a store of several layouts: explain under this one, a prefix of its id (at least "
    f"{LAYOUT_ID_MIN_HEX} hex digits, as `kvc init` prints it). A live cache uses its own.")]


def _request(tokens: str | None, tokens_file: Path | None, extra_key: str | None, salt: str | None,
             salt_file: Path | None, trace: Path | None, rid: str | None) -> ExplainRequest:
    """The request to explain, from the request options or from the trace; UsageError for a mix of the two."""
    if trace is None:
        if rid is not None:
            raise UsageError("--rid names a request of a trace: give --trace FILE too")
        ids = tokens_arg(tokens, tokens_file)
        if ids is None:
            raise UsageError("give the request with --tokens or --tokens-file (or --trace FILE --rid R)")
        return ExplainRequest(ids.tolist(), extra_key, salt_from(salt, salt_file))
    if rid is None:
        raise UsageError("--trace needs --rid: the id of the request to explain")
    if tokens is not None or tokens_file is not None or extra_key is not None or salt is not None \
            or salt_file is not None:
        raise UsageError("--trace gives the request and its namespace: leave out --tokens, --tokens-file, "
                         "--extra-key and the salt options")
    from kvcache.ops.explain import trace_request

    try:
        item = trace_request(trace, rid)
    except OSError as exc:
        raise UsageError(f"--trace {trace}: {exc.strerror or exc}") from None
    return ExplainRequest(item.tokens, item.extra_key, item.cache_salt, item.rid)


def _layout(held: list[KVLayout], layout: str | None, where: str) -> KVLayout:
    """The store's layout to explain under: its only one, or the one `layout` names (a prefix of its id)."""
    chosen = held
    if layout is not None:
        prefix = layout.lower()
        if len(prefix) < LAYOUT_ID_MIN_HEX or any(c not in "0123456789abcdef" for c in prefix):
            raise UsageError(f"--layout {layout!r}: a layout id prefix of at least {LAYOUT_ID_MIN_HEX} hex digits")
        chosen = [lay for lay in held if lay.layout_id.hex().startswith(prefix)]
    if len(chosen) != 1:
        ids = ", ".join(lay.layout_id.hex()[:16] for lay in held) or "none"
        raise UsageError(f"{where} holds {len(held)} layouts ({ids}); "
                         + ("none has that id" if layout is not None and not chosen else "name one with --layout"))
    return chosen[0]


def _offline(store, request: ExplainRequest, layout: str | None, read_only: bool) -> Explanation:
    from kvcache.ops.explain import explain_stored

    with contextlib.closing(open_inspect(store, read_only=read_only)) as handle:
        chosen = _layout(handle.layouts(), layout, str(store))
        try:
            return explain_stored(handle, chosen, request.tokens, Namespace(request.extra_key, request.cache_salt),
                                  request.rid, fingerprints_of(handle))
        except InvalidInput as exc:
            raise UsageError(str(exc)) from None


_SAID: dict[MissReason, str] = {
    MissReason.NEVER_WRITTEN: "never written (no record of it anywhere)",
    MissReason.REMOVED: "removed",
    MissReason.OTHER_NAMESPACE: "not in this namespace",
    MissReason.OTHER_LAYOUT: "held only under another layout",
    MissReason.QUARANTINED: "quarantined: its bytes failed their checksum",
    MissReason.NO_RECORD: "not held, and no record of it is kept any more",
}


def _miss(miss: FirstMiss, page_size: int) -> str:
    """One line on a tier's first missing page."""
    said = _SAID[miss.reason]
    if miss.removal is not None:
        said += f" ({miss.removal.reason.value}, at {when(miss.removal.at)})"
    elsewhere = []
    if miss.other_namespaces:
        elsewhere.append(f"{miss.other_namespaces} other namespace{'s' if miss.other_namespaces > 1 else ''} of "
                         f"this layout")
    if miss.other_layouts:
        elsewhere.append(f"{miss.other_layouts} other layout{'s' if miss.other_layouts > 1 else ''}")
    if elsewhere:
        said += f"; the prefix is held under {' and '.join(elsewhere)}{'' if miss.searched else ' (at least)'}"
    return f"first miss page {miss.page} (tokens {miss.page * page_size}..): {said}"


def _tier(name: str, tier: TierExplanation | None, tokens: int, page_size: int, absent: str) -> None:
    if tier is None:
        say(f"  {name:<11} {absent}")
        return
    rest = "every whole page held" if tier.first_miss is None else _miss(tier.first_miss, page_size)
    say(f"  {name:<11} {tier.matched_tokens}/{tokens} tokens: {esc(rest)}")


def _prefetch(e: Explanation, live_cache: bool) -> None:
    p = e.prefetch
    if p is None:
        say("  prefetch    " + ("none recorded for this prefix" if live_cache else "-: no live cache (--socket)"))
        return
    why = p.declined or p.dropped
    detail = (f"{p.fate.value}{f' ({why.value})' if why is not None else ''} at {when(p.at)}: from token "
              f"{p.start_tokens}, {p.requested_tokens} asked")
    if p.fate not in (PrefetchFate.DECLINED, PrefetchFate.NAMESPACE_MISMATCH):
        detail += f", {p.hit_tokens} in L3, {p.fetched_tokens} fetched"
    say(f"  prefetch    {detail}")


def _emit(e: Explanation, live_cache: bool, json: bool) -> None:
    if json:
        emit_json(e)
        return
    rid = f" {esc(e.rid)}" if e.rid is not None else ""
    say(f"explain{rid} {ns_label(e.namespace)}: {e.tokens} tokens, pages of {e.page_size}")
    say(f"  hits        device {e.hits.device}, host {e.hits.host}, storage {e.hits.storage} tokens")
    no_cache = "-: no live cache (--socket)" if not live_cache else "-: this cache has no such tier"
    _tier("L1 device", e.device, e.tokens, e.page_size, no_cache)
    _tier("L2 host", e.host, e.tokens, e.page_size, no_cache)
    _tier("L3 storage", e.storage, e.tokens, e.page_size, "-: the cache has no store")
    _prefetch(e, live_cache)


@command
def explain(
    store: StoreOpt = DEFAULT_STORE,
    extra_key: ExtraKeyOpt = None,
    salt: SaltOpt = None,
    salt_file: SaltFileOpt = None,
    tokens: TokensOpt = None,
    tokens_file: TokensFileOpt = None,
    trace: TraceOpt = None,
    rid: RidOpt = None,
    layout: LayoutOpt = None,
    read_only: ReadOnlyOpt = False,
    socket: SocketOpt = None,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Say why one request misses: per tier, how many of its tokens match from the first on, and why the first
    page a tier does not hold is missing — never written; removed, when and why (capacity, share, TTL, drop,
    repair, an eviction asked for); held under other namespaces of this layout (a count, never which) or under
    another layout; quarantined by a checksum. With --socket the live cache explains L1, L2 and L3 and what
    became of the last prefetch of the request's prefix; offline the store explains L3. Reads only. The salt is
    used in memory only, never printed (its keyed fingerprint is)."""
    request = _request(tokens, tokens_file, extra_key, salt, salt_file, trace, rid)
    sock = live.socket_path(socket)
    if sock is not None:
        if layout is not None:
            raise UsageError("--layout is for a store explained offline: a live cache uses its own layout")
        result = live.call(sock, request, Explanation)
    else:
        result = _offline(store, request, layout, read_only)
    _emit(result, sock is not None, json)
