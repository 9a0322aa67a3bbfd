"""`kvc ns probe --engine sglang`: how many of a prompt's pages an engine's store holds, as the engine would ask.

An engine names its pages by its own keys (`kvcache.engines.sglang_keys`: SGLang's SHA-256 chain, seeded by the
request's extra_key and cache_salt), and its adapter stores them under one kvc namespace of the engine instance
(`Namespace(extra_key=<kvc_namespace>)`, "sglang" by default), as engine pages (`engine_hashes`). The probe
recomputes the engine's keys for the prompt, maps them to the store's page hashes under each layout the store holds
with the page size, and counts: how many pages from the first one on are there (what the engine's prefetch would
get), and how many are there at all. It reads, and changes nothing (no hit, no access time).

The salt is used in memory only, to seed the chain: never stored, printed, or fingerprinted except under the
store's own key (what `kvc ns ls` shows for a kvc namespace with that salt).
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec
import typer

from kvcache.engines.sglang_keys import storage_keys
from kvcache.storage.api import engine_hashes
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace, NamespaceInfo, known_fingerprint_key

from ..context import open_inspect
from ..errors import UsageError
from ..inputs import tokens_arg
from ..options import (
    DEFAULT_STORE,
    DebugOpt,
    JsonOpt,
    NoHeadersOpt,
    OutputOpt,
    ReadOnlyOpt,
    SaltFileOpt,
    SaltOpt,
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

EngineOpt = Annotated[ProbeEngine, typer.Option(
    "--engine", case_sensitive=False, help="Whose page keys to recompute: sglang (SGLang 0.5.23's HiCache "
    "storage keys).")]
EngineKeyOpt = Annotated[str | None, typer.Option(
    "--extra-key", show_default=False,
    help="The engine's extra_key of the prompt's requests (SGLang: the request's extra_key, followed by the LoRA "
    "adapter's id when it has one). Omit for requests without one; '' is SGLang's empty extra_key, a namespace "
    "of its own.")]
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
    engine: EngineOpt,
    extra_key: EngineKeyOpt = None,
    salt: SaltOpt = None,
    salt_file: SaltFileOpt = None,
    tokens: TokensOpt = None,
    tokens_file: TokensFileOpt = None,
    page_size: PageSizeOpt = None,
    namespace: KvcNamespaceOpt = "sglang",
    layout: LayoutOpt = None,
    store: StoreOpt = DEFAULT_STORE,
    read_only: ReadOnlyOpt = False,
    output: OutputOpt = None,
    no_headers: NoHeadersOpt = False,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Say how many of a prompt's pages an engine's store holds: recompute the engine's page keys for the prompt
    (--tokens / --tokens-file) in the engine's namespace (--extra-key, and the salt from --salt-file, --salt -
    or KVC_SALT), find them under the kvc namespace its adapter writes (--namespace) in each layout of the page
    size, and count the pages held from the first one on (what the engine's prefetch gets) and in all. The
    salt only seeds the chain, in memory: it is never stored or printed (its fingerprint is under the store's
    key). Reads only: no hit or access time is recorded."""
    fmt = output_format(output, json)
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
        key = known_fingerprint_key()  # the store's, once it is open (a monitoring user may have none)
    finally:
        st.close()
    result = ProbeResult(str(store), engine.value, kvc_ns.info(), extra_key,
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
