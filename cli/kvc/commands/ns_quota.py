"""`kvc ns quota`: a namespace's shares of each tier — set, show, clear — kept with the store's namespace registry
(kvcache.types.shares), so every cache on the store applies them; with --socket a live cache applies them now.
`kvc.commands.ns` registers this group under `kvc ns`.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import typer

from kvcache.live.protocol import NamespaceList as LiveNamespaceList
from kvcache.live.protocol import NamespacesRequest, SharesOutcome, SharesRequest
from kvcache.types.ids import NamespaceId
from kvcache.types.namespace import Namespace
from kvcache.types.shares import MAX_SHARE, Shares

from .. import live
from ..context import fingerprints_of, namespace_record, open_inspect
from ..errors import EXIT_FOUND, UsageError
from ..options import (
    DEFAULT_STORE,
    DebugOpt,
    ExtraKeyOpt,
    JsonOpt,
    NoHeadersOpt,
    OutputOpt,
    ReadOnlyOpt,
    SaltFileOpt,
    SaltOpt,
    SocketOpt,
    StoreOpt,
)
from ..render.namespaces import render_shares, share_summary
from ..render.output import emit_json, emit_listing, output_format, say
from ..render.text import ns_label
from ..reporting import command
from ..secrets import salt_from

app = typer.Typer(help="A namespace's shares of L1, L2 and L3 (kvcache.types.shares): set, show, clear.",
                  no_args_is_help=True)


class ShareRow(msgspec.Struct):
    """One namespace in `kvc ns quota show|set|clear --json`: its shares (0: none on that tier) and its use of
    each tier (None where not known: L1 and L2 without --socket)."""

    extra_key: str | None
    salt_fingerprint: str | None
    id: str  # display_id
    shares: Shares
    used_device_tokens: int | None
    used_host_tokens: int | None
    used_store_bytes: int


class ShareChange(ShareRow):
    """`kvc ns quota set|clear --json`: the namespace's row after the change, what it had before and whether that
    changed anything (a clear of a namespace without shares does not: exit 1)."""

    previous: Shares | None = None  # the shares it had before (None: none)
    changed: bool = True


class ShareList(msgspec.Struct):
    """`kvc ns quota show --json`."""

    store: str  # credentials redacted ("" for a live cache without a store)
    live: bool  # the rows are a live cache's (--socket)
    namespaces: list[ShareRow]


@app.command("set", short_help="Set a namespace's shares of L1, L2 and L3 (replacing what it had).")
@command
def quota_set(
    extra_key: ExtraKeyOpt = None,
    salt: SaltOpt = None,
    salt_file: SaltFileOpt = None,
    device_tokens: Annotated[int, typer.Option(
        "--device-tokens", min=0, max=MAX_SHARE, help="L1 tokens the namespace keeps under pressure (whole pages; "
        "0: no share).")] = 0,
    host_tokens: Annotated[int, typer.Option(
        "--host-tokens", min=0, max=MAX_SHARE, help="L2 tokens the namespace keeps under pressure (0: no "
        "share).")] = 0,
    store_bytes: Annotated[int, typer.Option(
        "--store-bytes", min=0, max=MAX_SHARE, help="Most L3 payload bytes the namespace may hold; its puts "
        "over it evict its own oldest pages (0: the store's uniform quota, if any). Payload, not disk: an LMDB "
        "store's data file takes the ratio `kvc init` prints times that (docs/capacity.md).")] = 0,
    store: StoreOpt = DEFAULT_STORE,
    socket: SocketOpt = None,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Set a namespace's shares, replacing what it had (a tier not given has no share). Under pressure, the
    pages of namespaces over their L1/L2 share are evicted first, and a namespace's own admission takes its own
    pages first; L3 never holds more than its store share. Kept with the store's namespace registry, so every
    cache on the store applies it (at its next refresh). With --socket the live cache applies it now and writes
    it to its store."""
    shares = Shares(device_tokens, host_tokens, store_bytes)
    if shares.empty:
        raise UsageError("give at least one of --device-tokens, --host-tokens, --store-bytes (to remove a "
                         "namespace's shares: `kvc ns quota clear`)")
    _quota_write(extra_key, salt_from(salt, salt_file), shares, store, socket, json, "set")


@app.command("clear", short_help="Remove a namespace's shares.")
@command
def quota_clear(
    extra_key: ExtraKeyOpt = None,
    salt: SaltOpt = None,
    salt_file: SaltFileOpt = None,
    store: StoreOpt = DEFAULT_STORE,
    socket: SocketOpt = None,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Remove a namespace's shares from the store (with --socket: from the live cache and its store): it
    competes under plain LRU again, and the store's uniform quota (if any) bounds it in L3. Exit 1 when it has
    no shares: nothing to clear."""
    _quota_write(extra_key, salt_from(salt, salt_file), Shares(), store, socket, json, "cleared")


def _quota_write(extra_key: str | None, salt: str | None, shares: Shares, store, socket: str | None, json: bool,
                 verb: str) -> None:
    ns = Namespace(extra_key, salt)  # checked here, before anything is written or sent
    path = live.socket_path(socket)
    if path is not None:
        outcome = live.call(path, SharesRequest(shares, extra_key, salt), SharesOutcome)
        t = outcome.tiers
        row = ShareChange(outcome.namespace.extra_key, outcome.namespace.salt_fingerprint, outcome.id,
                          outcome.shares, t.device.tokens, t.host.tokens, t.storage.bytes, outcome.previous)
    else:
        st = open_inspect(store, writable=True)
        try:
            previous = next((r.shares for r in st.shares() if r.ns_id_hex == ns.id_hex), None)
            if previous is not None or not shares.empty:  # clearing shares that are not there writes nothing
                st.set_shares(ns, shares)
            rec = namespace_record(st, ns)
            fp = fingerprints_of(st)
            info, shown_id = fp.info(ns), fp.display_id(ns.id)
        finally:
            st.close()
        row = ShareChange(info.extra_key, info.salt_fingerprint, shown_id, shares, None, None,
                          rec.bytes if rec is not None else 0, previous)
    row.changed = row.previous != (None if row.shares.empty else row.shares)
    if json:
        emit_json(row)
    elif row.shares.empty and row.previous is None:
        say(f"namespace {ns_label(row)} has no shares: nothing to clear (check the extra_key and the salt)")
    else:
        shown_shares = f": L1 / L2 / L3 {share_summary(row.shares)}" if not row.shares.empty else ""
        say(f"{verb} the shares of namespace {ns_label(row)}{shown_shares}"
            + (" (the live cache applies them now)" if path is not None else ""))
    if row.shares.empty and row.previous is None:
        raise typer.Exit(EXIT_FOUND)


@app.command("show", short_help="List the namespaces with shares, with their use of each tier.")
@command
def quota_show(
    store: StoreOpt = DEFAULT_STORE,
    socket: SocketOpt = None,
    read_only: ReadOnlyOpt = False,
    output: OutputOpt = None,
    no_headers: NoHeadersOpt = False,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """List every namespace with shares: its L1, L2 and L3 shares and what it uses of each (L1 and L2 use only
    with --socket: offline there is no cache)."""
    fmt = output_format(output, json)
    path = live.socket_path(socket)
    if path is not None:
        listing = live.call(path, NamespacesRequest(), LiveNamespaceList)
        result = ShareList(listing.store, True, [
            ShareRow(r.extra_key, r.salt_fingerprint, r.id, r.shares, r.device.tokens, r.host.tokens,
                     r.storage.bytes) for r in listing.namespaces if r.shares is not None])
    else:
        st = open_inspect(store, read_only=read_only)
        try:
            used, fp = {r.ns_id_hex: r.bytes for r in st.namespaces()}, fingerprints_of(st)
            result = ShareList(str(store), False, [
                ShareRow(r.extra_key, r.salt_fingerprint, fp.display_id(NamespaceId(bytes.fromhex(r.ns_id_hex))),
                         r.shares, None, None, used.get(r.ns_id_hex, 0)) for r in st.shares()])
        finally:
            st.close()
    emit_listing(fmt, result, result.namespaces, lambda: render_shares(result, path, fmt, no_headers))
