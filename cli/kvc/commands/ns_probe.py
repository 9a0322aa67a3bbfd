"""`kvc ns probe`: how many of a prompt's pages each tier would serve — the question a KV-aware router asks (Dynamo's
FindMatchesHashed) — or, with --engine sglang, how many an engine's store holds, as the engine would ask.

Without --engine the probe is by kvc's page hashes (`kvcache.types.keys`): of a prompt (--tokens / --tokens-file in
the namespace of --extra-key and the salt) or of a chain of page hashes as the KV events carry them (--hashes /
--hashes-file: hex, the chain's first page first; a hash names its namespace and its whole prefix, so no namespace
is given). Offline it asks the store (L3) how many pages from the first one on it holds, under each layout of the
page size for a prompt. With --socket it asks the live cache what an admission would take from each tier now, in
order: the device prefix (L1), the host pages after it (L2), the store's pages after those (L3). It reads, and
changes nothing (no hit, no access time).

With --engine sglang: an engine names its pages by its own keys (`kvcache.engines.sglang_keys`: SGLang's SHA-256
chain, seeded by the request's extra_key and cache_salt), and its adapter stores them under one kvc namespace of
the engine instance (`Namespace(extra_key=<kvc_namespace>)`, "sglang" by default), as engine pages
(`engine_hashes`). The probe recomputes the engine's keys for the prompt, maps them to the store's page hashes
under each layout the store holds with the page size, and counts: how many pages from the first one on are there
(what the engine's prefetch would get), and how many are there at all.

The salt is used in memory only, to seed the chain: never stored, printed, or fingerprinted except under the
store's own key (what `kvc ns ls` shows for a kvc namespace with that salt).
"""

from __future__ import annotations

import enum
import re
from pathlib import Path
from typing import Annotated, cast

import msgspec
import typer

from kvcache.engines.sglang_keys import storage_keys
from kvcache.live.protocol import ProbeRequest, TierProbe
from kvcache.storage.api import engine_hashes
from kvcache.types.ids import PageHash
from kvcache.types.keys import page_hashes
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace, NamespaceInfo
from kvcache.types.request import Request

from .. import live
from ..context import fingerprints_of, open_inspect
from ..errors import UsageError
from ..inputs import read_bounded, tokens_arg
from ..options import (
    DEFAULT_STORE,
    DebugOpt,
    JsonOpt,
    NoHeadersOpt,
    OutputOpt,
    ReadOnlyOpt,
    SaltFileOpt,
    SaltOpt,
    SocketOpt,
    StoreOpt,
    TokensFileOpt,
    TokensOpt,
)
from ..render.output import Column, Kind, Listing, emit_listing, output_format, render
from ..render.text import shown
from ..secrets import salt_from

LAYOUT_ID_MIN_HEX = 8  # --layout: a prefix of the layout id this long at least (init prints 16 digits)


class ProbeEngine(str, enum.Enum):
    """Engines whose page keys kvc recomputes."""

    SGLANG = "sglang"  # SGLang 0.5.23's HiCache storage keys (kvcache.engines.sglang_keys)


class LayoutProbe(msgspec.Struct):
    """What one layout of the store holds of the prompt."""

    layout_id: str  # hex
    layout: str  # KVLayout.describe()
    consecutive: int  # pages held from the prompt's first page on, up to the first missing one: what a prefetch gets
    present: int  # pages of the prompt held at all (an engine page may outlive its parent: no chain is required)


class ProbeResult(msgspec.Struct):
    """`kvc ns probe --json`."""

    store: str  # credentials redacted
    engine: str
    namespace: NamespaceInfo  # the kvc namespace the engine's adapter writes (--namespace; no salt)
    extra_key: str | None  # the engine's extra_key of the prompt (None: none given)
    salt_fingerprint: str | None  # the engine salt's fingerprint under the store's key; None without a salt
    # (or when this user may not read the store's key)
    tokens: int  # of the prompt
    page_size: int
    pages: int  # whole pages of the prompt: the engine stores no partial page
    layouts: list[LayoutProbe]


COLUMNS = [Column("layout id"), Column("layout", Kind.USER), Column("pages", Kind.INT),
           Column("consecutive", Kind.INT), Column("present", Kind.INT), Column("consecutive tokens", Kind.INT)]

EngineOpt = Annotated[ProbeEngine | None, typer.Option(
    "--engine", case_sensitive=False, show_default=False,
    help="Whose page keys to recompute: sglang (SGLang 0.5.23's HiCache storage keys, in the store an SGLang "
    "adapter writes). Without it: kvc's own page hashes, per tier.")]
EngineKeyOpt = Annotated[str | None, typer.Option(
    "--extra-key", show_default=False,
    help="The prompt's extra_key: kvc's namespace (omit, or '', for requests without one); with --engine, the "
    "engine's extra_key of the prompt's requests (SGLang: the request's extra_key, followed by the LoRA "
    "adapter's id when it has one; '' is SGLang's empty extra_key, a namespace of its own).")]
HashesOpt = Annotated[str | None, typer.Option(
    "--hashes", show_default=False, metavar="HEX,...",
    help="Probe this chain of page hashes instead of a prompt: 32 hex digits each, as `kvc events` and `kvc ns "
    "dump` print them, the chain's first page first, comma- or space-separated or a JSON array. Not with "
    "--engine.")]
HashesFileOpt = Annotated[Path | None, typer.Option(
    "--hashes-file", show_default=False,
    help="A file of page hashes, as --hashes takes them.")]

MAX_HASHES = 50_000  # page hashes a probe takes (a live request frame carries them: 1 MiB)
MAX_HASHES_FILE_BYTES = 4 << 20
_HEX32 = re.compile(r"[0-9a-fA-F]{32}")
PageSizeOpt = Annotated[int | None, typer.Option(
    "--page-size", min=1, max=1 << 20, show_default=False,
    help="Tokens per page (the engine's --page-size). Default: the page size of the store's layouts, when they "
    "have one.")]
KvcNamespaceOpt = Annotated[str, typer.Option(
    "--namespace", help="The kvc namespace (extra_key, no salt) the engine's adapter writes: its kvc_namespace "
    "setting.")]
LayoutOpt = Annotated[str | None, typer.Option(
    "--layout", show_default=False, metavar="ID",
    help=f"Probe only this layout of the store: a prefix of its id (at least {LAYOUT_ID_MIN_HEX} hex digits, as "
    "`kvc init` and this command print it). Default: every layout of the page size.")]


def _layouts(held: list[KVLayout], page_size: int | None, layout: str | None, where: str) -> list[KVLayout]:
    """The layouts to probe: those of `page_size` (default: the one page size the store's layouts have), narrowed
    to the one `layout` names. UsageError when none is left, or the choice is ambiguous."""
    if page_size is None:
        sizes = sorted({lay.page_size for lay in held})
        if len(sizes) != 1:
            raise UsageError(f"{where} holds layouts of page sizes {', '.join(map(str, sizes)) or 'none'}: give "
                             f"--page-size (the engine's)")
        page_size = sizes[0]
    chosen = [lay for lay in held if lay.page_size == page_size]
    if layout is not None:
        prefix = layout.lower()
        if len(prefix) < LAYOUT_ID_MIN_HEX or any(c not in "0123456789abcdef" for c in prefix):
            raise UsageError(f"--layout {layout!r}: a layout id prefix of at least {LAYOUT_ID_MIN_HEX} hex digits")
        chosen = [lay for lay in chosen if lay.layout_id.hex().startswith(prefix)]
    if not chosen:
        held_sizes = ", ".join(str(n) for n in sorted({lay.page_size for lay in held})) or "none"
        named = f" with id {layout}" if layout is not None else ""
        raise UsageError(f"{where} holds no layout of page size {page_size}{named} (its page sizes: {held_sizes})")
    return chosen


def probe(
    engine: EngineOpt = None,
    chain_text: HashesOpt = None,
    hashes_file: HashesFileOpt = None,
    extra_key: EngineKeyOpt = None,
    salt: SaltOpt = None,
    salt_file: SaltFileOpt = None,
    tokens: TokensOpt = None,
    tokens_file: TokensFileOpt = None,
    page_size: PageSizeOpt = None,
    namespace: KvcNamespaceOpt = "sglang",
    layout: LayoutOpt = None,
    store: StoreOpt = DEFAULT_STORE,
    socket: SocketOpt = None,
    read_only: ReadOnlyOpt = False,
    output: OutputOpt = None,
    no_headers: NoHeadersOpt = False,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Say how many of a prompt's pages each tier would serve, by kvc's page hashes: of a prompt (--tokens /
    --tokens-file in the namespace of --extra-key and the salt) or of a chain of page hashes (--hashes /
    --hashes-file, as the KV events print them). Offline: the store's pages from the first one on, per layout of
    the page size. With --socket: what an admission of the live cache would take now from L1 (the device prefix),
    L2 (the host pages after it) and L3 (the store's pages after those).

    With --engine sglang, say how many of a prompt's pages an engine's store holds: recompute the engine's page
    keys for the prompt (--tokens / --tokens-file) in the engine's namespace (--extra-key, and the salt from
    --salt-file, --salt - or KVC_SALT), find them under the kvc namespace its adapter writes (--namespace) in each
    layout of the page size, and count the pages held from the first one on (what the engine's prefetch gets) and
    in all. The salt only seeds the chain, in memory: it is never stored or printed (its fingerprint is under the
    store's key). Reads only: no hit or access time is recorded."""
    fmt = output_format(output, json)
    chain = hashes_arg(chain_text, hashes_file)
    if engine is None:
        return probe_tiers(chain, extra_key, salt, salt_file, tokens, tokens_file, page_size, layout, store,
                           live.socket_path(socket), read_only, fmt, no_headers)
    if chain is not None or socket is not None:
        raise UsageError("--engine probes an engine's store by the engine's keys, offline: leave out --hashes, "
                         "--hashes-file and --socket")
    prompt = tokens_arg(tokens, tokens_file)
    if prompt is None:
        raise UsageError("kvc ns probe needs the prompt: --tokens or --tokens-file")
    cache_salt = salt_from(salt, salt_file)  # read once: it may come from stdin
    kvc_ns = Namespace(namespace)
    st = open_inspect(store, read_only=read_only)
    try:
        chosen = _layouts(st.layouts(), page_size, layout, str(store))
        if st.chain_key is None:
            raise UsageError(f"{store}: this user cannot read the store's key, which engine page hashes are keyed "
                             f"by")
        size = chosen[0].page_size
        keys = storage_keys(prompt, size, extra_key, cache_salt)
        rows = []
        for lay in chosen:
            hashes = engine_hashes(lay, kvc_ns, st.chain_key, keys)
            present = sum(st.page_meta(h) is not None for h in hashes)
            rows.append(LayoutProbe(lay.layout_id.hex(), lay.describe(), st.exists_prefix(hashes), present))
        fp = fingerprints_of(st)  # the store's (a monitoring user may have none)
        key = fp.known
    finally:
        st.close()
    result = ProbeResult(str(store), engine.value, fp.info(kvc_ns), extra_key,
                         Namespace(None, cache_salt).fingerprint(key) if key is not None else None,
                         len(prompt), size, len(keys), rows)

    def table() -> None:
        salt_said = f", salt {result.salt_fingerprint}" if result.salt_fingerprint else \
            (", a salt" if cache_salt else "")
        title = (f"{len(keys):,} pages of {size} tokens ({len(prompt):,} tokens, {engine.value} extra_key "
                 f"{shown(extra_key)}{salt_said}) in namespace {shown(namespace or None)} of {store}")
        cells = [[r.layout_id[:16], r.layout, len(keys), r.consecutive, r.present, r.consecutive * size]
                 for r in rows]
        render(Listing(title, COLUMNS, cells), fmt, no_headers)

    emit_listing(fmt, result, rows, table)


# --- by kvc's page hashes, per tier --------------------------------------------------------------------------------


class TierRow(msgspec.Struct):
    """What one tier would serve: its pages from where the tier before it stopped (L1 from the first page)."""

    tier: str  # device, host or storage
    pages: int
    tokens: int
    layout_id: str | None = None  # offline, by a prompt: the store's layout probed (hex)


class TierProbeResult(msgspec.Struct):
    """`kvc ns probe --json` without --engine: what each tier would serve of a prompt or a hash chain."""

    store: str | None  # offline: the store probed (credentials redacted)
    socket: str | None  # live: the admin socket
    namespace: NamespaceInfo | None  # of a prompt (the salt as its fingerprint); None for hashes
    tokens: int | None  # of a prompt; None for hashes
    page_size: int
    pages: int  # whole pages probed
    tiers: list[TierRow]
    served_tokens: int  # what all the tiers serve together, in order (offline: the store alone)


TIER_COLUMNS = [Column("tier"), Column("layout id"), Column("pages", Kind.INT), Column("tokens", Kind.INT)]


def hashes_arg(hashes: str | None, hashes_file: Path | None) -> list[PageHash] | None:
    """The page hashes of --hashes or --hashes-file (not both); None when neither is given."""
    if hashes is not None and hashes_file is not None:
        raise UsageError("give --hashes or --hashes-file, not both")
    if hashes_file is not None:
        return parse_hashes(read_bounded(hashes_file, MAX_HASHES_FILE_BYTES, "--hashes-file"), str(hashes_file))
    return parse_hashes(hashes, "--hashes") if hashes is not None else None


def parse_hashes(text: str, source: str) -> list[PageHash]:
    """Page hashes from hex words separated by commas or whitespace, or a JSON array of hex strings; UsageError
    naming the first bad one."""
    text = text.strip()
    if text.startswith("["):
        try:
            words = msgspec.json.decode(text, type=list[str])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise UsageError(f"{source}: not a JSON array of page hashes: {exc}") from None
    else:
        words = [w for w in re.split(r"[\s,]+", text) if w]
    if not words:
        raise UsageError(f"{source}: no page hashes")
    if len(words) > MAX_HASHES:
        raise UsageError(f"{source}: {len(words):,} page hashes, more than the {MAX_HASHES:,} a probe takes")
    for i, w in enumerate(words):
        if not _HEX32.fullmatch(w):
            raise UsageError(f"{source}: page hash {i} is {w[:40]!r}, not 32 hex digits")
    return cast("list[PageHash]", [bytes.fromhex(w) for w in words])  # checked: 16-byte page hashes


def probe_tiers(chain: list[PageHash] | None, extra_key: str | None, salt: str | None, salt_file: Path | None,
                tokens: str | None, tokens_file: Path | None, page_size: int | None, layout: str | None,
                store: object, sock: str | None, read_only: bool, fmt, no_headers: bool) -> None:
    """`kvc ns probe` without --engine: per tier, by kvc's page hashes, offline (the store) or live."""
    prompt = tokens_arg(tokens, tokens_file)
    if (prompt is None) == (chain is None):
        raise UsageError("kvc ns probe needs a prompt (--tokens / --tokens-file) or page hashes (--hashes / "
                         "--hashes-file), not both")
    if chain is not None and (extra_key is not None or salt is not None or salt_file is not None):
        raise UsageError("page hashes name their namespace: leave out --extra-key, --salt and --salt-file")
    cache_salt = salt_from(salt, salt_file) if prompt is not None else None  # read once: it may come from stdin
    if sock is not None:
        if page_size is not None or layout is not None:
            raise UsageError("a live cache probes under its own layout: leave out --page-size and --layout")
        got = live.call(sock, ProbeRequest(prompt.tolist() if prompt is not None else None, chain, extra_key,
                                           cache_salt), TierProbe)
        rows = [TierRow(name, use.pages, use.tokens) for name, use in
                (("device", got.device), ("host", got.host), ("storage", got.storage))]
        result = TierProbeResult(None, sock, got.namespace, len(prompt) if prompt is not None else None,
                                 got.page_size, got.pages, rows, sum(r.tokens for r in rows))
    else:
        result = _probe_store(chain, prompt, Namespace(extra_key, cache_salt), page_size, layout, store, read_only)
    _show_tiers(result, fmt, no_headers)


def _probe_store(chain: list[PageHash] | None, prompt, ns: Namespace, page_size: int | None, layout: str | None,
                 store, read_only: bool) -> TierProbeResult:
    """The store's pages of a prompt (per layout of the page size) or of a hash chain, from the first one on."""
    st = open_inspect(store, read_only=read_only)
    try:
        if chain is not None:
            if layout is not None:
                raise UsageError("page hashes name their layout: leave out --layout")
            size = page_size or _page_size_of(st.layouts(), str(store))
            got = st.exists_prefix(chain)
            return TierProbeResult(str(store), None, None, None, size, len(chain),
                                   [TierRow("storage", got, got * size)], got * size)
        chosen = _layouts(st.layouts(), page_size, layout, str(store))
        if st.chain_key is None:
            raise UsageError(f"{store}: this user cannot read the store's key, which page hashes are keyed by")
        size = chosen[0].page_size
        key = Request("kvc-probe", prompt, ns).key
        rows = []
        for lay in chosen:
            got = st.exists_prefix(page_hashes(lay.layout_id, key, size, st.chain_key))
            rows.append(TierRow("storage", got, got * size, lay.layout_id.hex()))
        fingerprint_key = fingerprints_of(st).known  # the store's (a monitoring user may have none)
        info = ns.info(fingerprint_key) if fingerprint_key is not None else NamespaceInfo(ns.extra_key, None)
    finally:
        st.close()
    return TierProbeResult(str(store), None, info, len(prompt), size, len(prompt) // size, rows,
                           max(r.tokens for r in rows))


def _page_size_of(held: list[KVLayout], where: str) -> int:
    sizes = sorted({lay.page_size for lay in held})
    if len(sizes) != 1:
        raise UsageError(f"{where} holds layouts of page sizes {', '.join(map(str, sizes)) or 'none'}: give "
                         f"--page-size")
    return sizes[0]


def _show_tiers(result: TierProbeResult, fmt, no_headers: bool) -> None:
    def table() -> None:
        what = (f"{result.tokens:,} tokens ({result.pages:,} pages of {result.page_size}) of namespace "
                f"{shown(result.namespace.extra_key)}/{result.namespace.salt_fingerprint or '-'}"
                if result.namespace is not None and result.tokens is not None else
                f"a chain of {result.pages:,} page hashes")
        where = f"the live cache at {result.socket}" if result.socket else f"{result.store}"
        title = f"{what} in {where}: {result.served_tokens:,} tokens served"
        cells = [[r.tier, r.layout_id[:16] if r.layout_id else None, r.pages, r.tokens] for r in result.tiers]
        render(Listing(title, TIER_COLUMNS, cells), fmt, no_headers)

    emit_listing(fmt, result, result.tiers, table)
