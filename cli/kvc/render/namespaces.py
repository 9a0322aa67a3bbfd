"""The namespace views: `kvc ns ls` of a live cache (what each namespace holds in L1, L2 and L3, and when it
expires), the shares column of any `ns ls`, `kvc ns show`'s prefix tree, and `kvc ns quota show`'s shares beside
their use."""

from __future__ import annotations

from typing import Any

import msgspec

from kvcache.live.protocol import NamespaceList
from kvcache.types.shares import Shares

from .output import Column, Kind, Listing, Output, console, render
from .text import human_bytes, ns_label


def sort_namespaces(rows: list, sort: str) -> None:
    """Order `ns ls` rows (offline or live) by one of SORT_KEYS."""
    if sort == "extra_key":
        rows.sort(key=lambda r: (r.extra_key or "", r.salt_fingerprint or ""))
    else:
        rows.sort(key=lambda r: getattr(r, sort), reverse=True)


def render_live_namespaces(listing: NamespaceList, socket: str, fmt: Output, no_headers: bool) -> None:
    """`kvc ns ls` of a live cache as a table: the store's rows plus what each namespace holds in L1, L2 and L3,
    and when it expires under the cache's TTL policy."""
    columns = [Column("id"), Column("extra_key", Kind.USER), Column("salt fingerprint"),
               Column("L1 tokens", Kind.INT), Column("L2 tokens", Kind.INT), Column("L3 tokens", Kind.INT),
               Column("L3 bytes", Kind.BYTES), Column("hits", Kind.INT), Column("last access", Kind.TIME),
               Column("expires", Kind.TIME), Column("expiry")]
    rows = [[r.id, r.extra_key, r.salt_fingerprint, r.device.tokens, r.host.tokens, r.storage.tokens,
             r.storage.bytes, r.hits, r.last_access, r.deadline, _expiry(r)] for r in listing.namespaces]
    title = f"namespaces of the live cache at {socket} (store {listing.store or '-'})"
    render(with_shares(Listing(title, columns, rows), [r.shares for r in listing.namespaces], fmt), fmt, no_headers)



def share_summary(shares: Shares, human: bool = True) -> str:
    """A namespace's shares in one cell: L1 tokens / L2 tokens / L3 bytes, `-` for no share on a tier; plain
    integers joined by `/` when not `human` (tsv)."""
    if not human:
        return "/".join(str(v or "-") for v in (shares.device_tokens, shares.host_tokens, shares.store_bytes))
    return " / ".join([f"{shares.device_tokens:,}" if shares.device_tokens else "-",
                       f"{shares.host_tokens:,}" if shares.host_tokens else "-",
                       human_bytes(shares.store_bytes) if shares.store_bytes else "-"])


def with_shares(listing: Listing, shares: list[Shares | None], fmt: Output) -> Listing:
    """An `ns ls` listing with a `shares L1 / L2 / L3` column added when any namespace has shares (`shares`: one
    per row); unchanged otherwise, so tables without shares stay as narrow as before."""
    if all(s is None for s in shares):
        return listing
    human = fmt is Output.TABLE
    rows = [row + [share_summary(s, human) if s is not None else None]
            for row, s in zip(listing.rows, shares, strict=True)]
    return Listing(listing.title, [*listing.columns, Column("shares L1 / L2 / L3")], rows)


def render_shares(result: Any, socket: str | None, fmt: Output, no_headers: bool) -> None:
    """`kvc ns quota show` (a `kvc.commands.ns_quota.ShareList`): each namespace's share of a tier beside its use
    of it."""
    columns = [Column("id"), Column("extra_key", Kind.USER), Column("salt fingerprint"),
               Column("L1 share", Kind.INT), Column("L1 used", Kind.INT), Column("L2 share", Kind.INT),
               Column("L2 used", Kind.INT), Column("L3 share", Kind.BYTES), Column("L3 used", Kind.BYTES)]
    rows = [[r.id, r.extra_key, r.salt_fingerprint, r.shares.device_tokens or None, r.used_device_tokens,
             r.shares.host_tokens or None, r.used_host_tokens, r.shares.store_bytes or None, r.used_store_bytes]
            for r in result.namespaces]
    where = f"the live cache at {socket}" if socket is not None else (result.store or "-")
    render(Listing(f"namespace shares in {where}", columns, rows), fmt, no_headers)


def _expiry(row) -> str:
    """A live namespace's TTL state: not tracked ("-": no policy, or unused since the cache started), waiting for
    its deadline, or past it and deferred until its running requests end."""
    if row.deadline is None:
        return "-"
    return "deferred: requests running" if row.expiry_deferred else "scheduled"


class PrefixRow(msgspec.Struct, frozen=True):
    """One page of `kvc ns show -o jsonl|tsv`: the tree flattened, each page after its parent (depth 1: a first
    page of the namespace)."""

    depth: int
    page_hash: str
    hits: int
    bytes: int
    tokens: list[int]  # [] for an engine page
    key: str | msgspec.UnsetType = msgspec.UNSET  # an engine page's key in hex; left out for a token page


def prefix_rows(tree: Any) -> list[PrefixRow]:
    """The pages of `kvc ns show`'s tree (a `kvc.commands.ns.NamespaceTree`), depth first, hottest first."""
    rows: list[PrefixRow] = []
    _flatten(tree.roots, 1, rows)
    return rows


def render_prefix_tree(tree: Any, fmt: Output, no_headers: bool) -> None:
    """`kvc ns show` (a `kvc.commands.ns.NamespaceTree`) as a rich tree, hottest branches first; tsv: one line per
    page (depth, page hash, hits, bytes, tokens, and the engine key when the tree has engine pages). An engine
    page is shown by its key: it has no tokens."""
    if fmt is Output.TSV:
        flat = prefix_rows(tree)
        keyed = any(r.key is not msgspec.UNSET for r in flat)
        rows = [[r.depth, r.page_hash, r.hits, r.bytes, ",".join(map(str, r.tokens))]
                + ([r.key if r.key is not msgspec.UNSET else None] if keyed else []) for r in flat]
        columns = [Column("depth", Kind.INT), Column("page_hash"), Column("hits", Kind.INT),
                   Column("bytes", Kind.BYTES), Column("tokens")] + ([Column("key")] if keyed else [])
        render(Listing("", columns, rows), fmt, no_headers)
        return
    from rich.tree import Tree

    view = Tree(f"[bold]{ns_label(tree.namespace)}[/]  id {tree.id}  {tree.pages:,} pages, {human_bytes(tree.bytes)}")
    for node in tree.roots:
        _branch(view, node)
    if tree.more:
        view.add(f"[dim]… {tree.more} more[/]")
    console().print(view)


def _flatten(nodes: list, depth: int, rows: list[PrefixRow]) -> None:
    for node in nodes:
        rows.append(PrefixRow(depth, node.page_hash, node.hits, node.bytes, node.tokens, node.key))
        _flatten(node.children, depth + 1, rows)


def _branch(parent: Any, node: Any) -> None:
    if node.key is not msgspec.UNSET:  # an engine page: its key (hex, kvc's or the engine's own words) names it
        label = f"key {node.key[:16]}…" if len(node.key) > 16 else f"key {node.key}"
    else:
        toks = node.tokens if len(node.tokens) <= 8 else node.tokens[:8] + ["…"]
        label = " ".join(map(str, toks))
    branch = parent.add(f"{label}  [dim]hits {node.hits:,} · {node.page_hash[:12]}[/]")
    for child in node.children:
        _branch(branch, child)
    if node.more:
        branch.add(f"[dim]… {node.more} more[/]")
