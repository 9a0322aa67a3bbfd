"""`kvc ns`: the namespaces a store holds — list, show one's prefix tree, drop one."""

from __future__ import annotations

from typing import Annotated

import msgspec
import typer
from rich.table import Table
from rich.tree import Tree

from kvcache import NamespaceInfo
from kvcache.keys import unpack_tokens
from kvcache.storage.base import NamespaceRecord

from . import live
from .common import (DEFAULT_STORE, DebugOpt, JsonOpt, SaltOpt, StoreOpt, UsageError, command,
                     emit_json, human_bytes, namespace_arg, open_inspect, out, when)

app = typer.Typer(help="Namespaces in the store: list them, show one's prefix tree, drop one (offboarding).",
                  no_args_is_help=True)

SORT_KEYS = ("bytes", "pages", "hits", "last_access", "extra_key")
KeyArg = Annotated[str, typer.Argument(
    help="The namespace's extra_key (\"\" for requests without one).", metavar="EXTRA_KEY")]


class NamespaceRow(msgspec.Struct):
    """One namespace in `kvc ns ls --json`."""

    extra_key: str | None
    salt_fingerprint: str | None
    id: str
    pages: int
    tokens: int
    bytes: int
    hits: int
    created: float
    last_access: float


class NamespaceList(msgspec.Struct):
    """`kvc ns ls --json`."""

    store: str
    namespaces: list[NamespaceRow]


class PrefixNode(msgspec.Struct):
    """One stored page in `kvc ns show --json`: the edge's tokens, its heat, and its children (hottest first)."""

    page_hash: str
    tokens: list[int]
    hits: int
    bytes: int
    children: list["PrefixNode"]
    more: int = 0  # children not shown (width limit)


class NamespaceTree(msgspec.Struct):
    """`kvc ns show --json`."""

    namespace: NamespaceInfo
    id: str
    pages: int
    bytes: int
    roots: list[PrefixNode]
    more: int = 0


class DropOutput(msgspec.Struct):
    """`kvc ns drop --json`."""

    namespace: NamespaceInfo
    id: str
    pages: int
    bytes: int
    transactions: int


def _page_size(store) -> int:
    sizes = {layout.page_size for layout in store.layouts()}
    return sizes.pop() if len(sizes) == 1 else 0  # tokens per page is ambiguous across layouts


def _record(store, ns) -> NamespaceRecord:
    for rec in store.namespaces():
        if rec.ns_id_hex == ns.id_hex:
            return rec
    raise UsageError(f"no namespace {ns.label} in {store.location} (check the extra_key and --salt)")


@app.command("ls")
@command
def ls(
    store: StoreOpt = DEFAULT_STORE,
    sort: Annotated[str, typer.Option("--sort", help=f"Order by one of: {', '.join(SORT_KEYS)} (largest first, "
                                      "extra_key alphabetical).")] = "bytes",
    socket: live.SocketOpt = None,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """List the namespaces in the store: extra_key, salt fingerprint, pages, tokens, bytes, hits, last access.
    With --socket, the live cache's namespaces, with what each holds in L1, L2 and L3."""
    if sort not in SORT_KEYS:
        raise UsageError(f"--sort {sort!r} is not one of {', '.join(SORT_KEYS)}")
    if (sock := live.socket_path(socket)) is not None:
        return live.ns_ls(sock, sort, json)
    st = open_inspect(store)
    try:
        ps = _page_size(st)
        rows = [NamespaceRow(r.extra_key, r.salt_fingerprint, r.ns_id_hex, r.pages, r.pages * ps, r.bytes, r.hits,
                             r.created, r.last_access) for r in st.namespaces()]
    finally:
        st.close()
    if sort == "extra_key":
        rows.sort(key=lambda r: (r.extra_key or "", r.salt_fingerprint or ""))
    else:
        rows.sort(key=lambda r: getattr(r, sort), reverse=True)
    if json:
        emit_json(NamespaceList(store, rows))
        return
    table = Table(title=f"namespaces in {store}")
    for col in ("extra_key", "salt fingerprint", "pages", "tokens", "bytes", "hits", "last access"):
        table.add_column(col, justify="right" if col in ("pages", "tokens", "bytes", "hits") else "left")
    for r in rows:
        table.add_row(r.extra_key if r.extra_key is not None else "-", r.salt_fingerprint or "-", f"{r.pages:,}",
                      f"{r.tokens:,}" if ps else "?", human_bytes(r.bytes), f"{r.hits:,}", when(r.last_access))
    out.print(table)


@app.command("show")
@command
def show(
    extra_key: KeyArg,
    salt: SaltOpt = None,
    store: StoreOpt = DEFAULT_STORE,
    depth: Annotated[int, typer.Option("--depth", min=1, help="Pages of prefix to walk down.")] = 4,
    width: Annotated[int, typer.Option("--width", min=1, help="Children shown per page, hottest first.")] = 5,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Show a namespace's prefix tree in the store, hottest branches first, depth- and width-limited."""
    ns = namespace_arg(extra_key, salt)
    st = open_inspect(store)
    try:
        rec = _record(st, ns)
        roots, more = [], 0
        for layout in st.layouts():
            kids = st.children(st.root(ns, layout))
            roots += [_walk(st, c, depth - 1, width) for c in kids[:width]]
            more += max(0, len(kids) - width)
    finally:
        st.close()
    tree = NamespaceTree(ns.info(), ns.id_hex, rec.pages, rec.bytes, roots, more)
    if json:
        emit_json(tree)
        return
    view = Tree(f"[bold]{ns.label}[/]  {rec.pages:,} pages, {human_bytes(rec.bytes)}")
    for node in roots:
        _render(view, node)
    if more:
        view.add(f"[dim]… {more} more[/]")
    out.print(view)


def _walk(store, child, depth: int, width: int) -> PrefixNode:
    node = PrefixNode(child.page_hash.hex(), unpack_tokens(child.tokens), child.hits, child.nbytes, [])
    if depth > 0:
        kids = store.children(child.page_hash)
        node.children = [_walk(store, c, depth - 1, width) for c in kids[:width]]
        node.more = max(0, len(kids) - width)
    return node


def _render(parent: Tree, node: PrefixNode) -> None:
    toks = node.tokens if len(node.tokens) <= 8 else node.tokens[:8] + ["…"]
    branch = parent.add(f"{' '.join(map(str, toks))}  [dim]hits {node.hits:,} · {node.page_hash[:12]}[/]")
    for child in node.children:
        _render(branch, child)
    if node.more:
        branch.add(f"[dim]… {node.more} more[/]")


@app.command("drop")
@command
def drop(
    extra_key: KeyArg,
    salt: SaltOpt = None,
    store: StoreOpt = DEFAULT_STORE,
    yes: Annotated[bool, typer.Option("--yes", help="Confirm: remove every page of the namespace.")] = False,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Remove every page of one namespace from the store (a tenant's offboarding). Needs --yes."""
    ns = namespace_arg(extra_key, salt)
    if not yes:
        raise UsageError(f"refusing to drop namespace {ns.label} without --yes")
    st = open_inspect(store, writable=True)
    try:
        _record(st, ns)
        result = st.delete_namespace(ns.id)
    finally:
        st.close()
    output = DropOutput(ns.info(), ns.id_hex, result.pages, result.bytes, result.transactions)
    if json:
        emit_json(output)
    else:
        out.print(f"dropped namespace {ns.label}: {result.pages:,} pages, {human_bytes(result.bytes)} "
                  f"({result.transactions} transactions)")

