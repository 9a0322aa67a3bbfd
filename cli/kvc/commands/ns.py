"""`kvc ns`: the namespaces a store holds — list, show one's prefix tree, drop one — and, with a live cache, evict
or expire one; their shares of each tier are the `kvc ns quota` group (`kvc.commands.ns_quota`), what each tier
(or an engine's store) holds of a prompt is `kvc ns probe` (`kvc.commands.ns_probe`), and what a store or a live
cache holds, as KV events for a router, is `kvc ns dump` (`kvc.commands.ns_dump`).

A namespace is named on the command line by its extra_key and salt (EXTRA_KEY with --salt / --salt-file /
KVC_SALT), or, where the salt is not at hand (offboarding from a runbook), by the id or the salt fingerprint that
`kvc ns ls` prints. Both are keyed by the store's fingerprint key, so neither lets a short salt be guessed back.
"""

from __future__ import annotations

import contextlib
import fnmatch
import re
import time
from typing import Annotated

import msgspec
import typer

from kvcache.live.protocol import DropRequest, EvictOutcome, EvictRequest, ExpireRequest, NamespacesRequest
from kvcache.live.protocol import NamespaceList as LiveNamespaceList
from kvcache.storage.api import DropRecord, L3Store, NamespaceRecord
from kvcache.storage.location import StoreLocation
from kvcache.types.fingerprint_key import FingerprintKey
from kvcache.types.ids import NamespaceId, PageHash
from kvcache.types.keys import unpack_tokens
from kvcache.types.namespace import Namespace, NamespaceInfo
from kvcache.types.shares import Shares

from .. import live
from ..context import fingerprints_of, namespace_record, no_store_fingerprints, open_inspect
from ..errors import EXIT_FOUND, UsageError
from ..inputs import namespace_arg
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
)
from ..render.namespaces import prefix_rows, render_live_namespaces, render_prefix_tree, sort_namespaces, with_shares
from ..render.output import Column, Kind, Listing, emit_json, emit_listing, output_format, render, say
from ..render.text import human_bytes, literal, ns_label, shown
from ..reporting import command
from ..secrets import salt_from
from .ns_dump import dump
from .ns_probe import probe
from .ns_quota import app as quota_app

app = typer.Typer(help="Namespaces in the store: list them, show one's prefix tree, drop one (offboarding); "
                  "with a live cache, evict or expire one.",
                  no_args_is_help=True)

SORT_KEYS = ("bytes", "pages", "hits", "last_access", "extra_key")
KeyArg = Annotated[str, typer.Argument(
    help="The namespace's extra_key (\"\" for requests without one).", metavar="EXTRA_KEY")]


class NamespaceRow(msgspec.Struct):
    """One namespace in `kvc ns ls --json`."""

    extra_key: str | None
    salt_fingerprint: str | None
    id: str | None  # display_id: keyed by the store's fingerprint key (`kvc ns drop --id` takes it); None: this
    # user may not read the key (read-only monitoring shows what the registry recorded, nothing derived)
    pages: int
    tokens: int
    bytes: int
    hits: int
    created: float
    last_access: float
    shares: Shares | None = None  # the namespace's shares per tier (`kvc ns quota`); None: it has none


class NamespaceList(msgspec.Struct):
    """`kvc ns ls --json`."""

    store: str  # credentials redacted
    namespaces: list[NamespaceRow]


class PrefixNode(msgspec.Struct):
    """One stored page in `kvc ns show --json`: the edge's tokens (an engine page: its engine key, and no
    tokens), its heat, and its children (hottest first)."""

    page_hash: str
    tokens: list[int]  # [] for an engine page
    hits: int
    bytes: int
    children: list["PrefixNode"]
    more: int = 0  # children not shown (width limit)
    # An engine page's own key in hex (SGLang: its 64-hex storage key); left out for a token page (unset)
    key: str | msgspec.UnsetType = msgspec.UNSET


class NamespaceTree(msgspec.Struct):
    """`kvc ns show --json`."""

    namespace: NamespaceInfo  # as the store's registry recorded it
    id: str | None  # display_id; None: this user may not read the store's key (monitoring)
    pages: int
    bytes: int
    roots: list[PrefixNode]
    more: int = 0


class DropOutput(msgspec.Struct):
    """`kvc ns drop --json`, offline and live alike. `dropped` is False when nothing was dropped: the namespace
    was not there (only with --missing-ok), or --dry-run (then the figures are what would go)."""

    namespace: NamespaceInfo | None  # None: named by an id that matched nothing
    id: str | None  # display id, as `kvc ns ls` prints it
    dropped: bool
    dry_run: bool
    store_pages: int  # L3 pages deleted (or, --dry-run, that would be)
    store_bytes: int
    device_pages: int  # L1 and L2 pages freed in the live cache (0 offline, where no cache holds it)
    host_pages: int
    live_requests: int  # running requests of the namespace in the live cache: their pages stay until they end
    transactions: int  # bounded write transactions the offline delete used (0 live)
    socket: str | None  # the live cache the drop went through; None: offline
    live_caches: list[str] = []  # --dry-run offline: the sockets of live caches that hold it (an offline drop refuses)
    dropped_before: float | None = None  # not there, and the store records its earlier drop at this time (a re-run)


LS_COLUMNS = [Column("id"), Column("extra_key", Kind.USER), Column("salt fingerprint"), Column("pages", Kind.INT),
              Column("tokens", Kind.INT), Column("bytes", Kind.BYTES), Column("hits", Kind.INT),
              Column("last access", Kind.TIME)]


def _page_size(store: L3Store) -> int:
    sizes = {layout.page_size for layout in store.layouts()}
    return sizes.pop() if len(sizes) == 1 else 0  # tokens per page is ambiguous across layouts


def _shown_id(rec: NamespaceRecord, fp: FingerprintKey) -> str:
    return fp.display_id(NamespaceId(bytes.fromhex(rec.ns_id_hex)))


def _listed_id(rec: NamespaceRecord, fp: FingerprintKey) -> str | None:
    """The display id of a listed record; None when the store's key is not at hand (a monitoring account that may
    not read it: a listing shows what the registry recorded and derives nothing)."""
    return _shown_id(rec, fp) if not fp.is_withheld else None


def _named(ns: Namespace, fp: FingerprintKey) -> str:
    """A namespace named by its extra_key and salt, for a message: ``extra_key/fingerprint`` under `fp` (the
    store's key, once it is open) when it is at hand, else the extra_key alone, saying a salt was given: a
    fingerprint under any other key would match nothing the store or a live cache shows."""
    if not ns.has_salt:
        return f"{shown(ns.extra_key)}/-"
    key = fp.known
    return f"{shown(ns.extra_key)}/{ns.fingerprint(key)}" if key is not None else \
        f"{shown(ns.extra_key)} (with the salt given)"


@app.command("ls", short_help="List the namespaces in the store (or a live cache), with their ids; PATTERN: a glob "
             "on extra_key.")
@command
def ls(
    pattern: Annotated[str | None, typer.Argument(
        help="Only namespaces whose extra_key matches this shell-style glob, case-sensitive: * any run, ? one "
        "character, [abc] / [!abc] one of / none of (quote it from the shell: 'tenant-*'). \"\" matches the "
        "namespace without an extra_key.", metavar="[PATTERN]", show_default=False)] = None,
    store: StoreOpt = DEFAULT_STORE,
    sort: Annotated[str, typer.Option("--sort", help=f"Order by one of: {', '.join(SORT_KEYS)} (largest first, "
                                      "extra_key alphabetical).")] = "bytes",
    socket: SocketOpt = None,
    read_only: ReadOnlyOpt = False,
    output: OutputOpt = None,
    no_headers: NoHeadersOpt = False,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """List the namespaces in the store: id, extra_key, salt fingerprint, pages, tokens, bytes, hits, last
    access; with PATTERN, only those whose extra_key matches it (`kvc ns ls 'tenant-*'`). With --socket, the live
    cache's namespaces, with what each holds in L1, L2 and L3 and, under a TTL policy (`kvc serve
    --ttl-default-s`), when each expires (`deadline`, epoch seconds; `expiry_deferred` while running requests hold
    off a due expiry)."""
    if sort not in SORT_KEYS:
        raise UsageError(f"--sort {sort!r} is not one of {', '.join(SORT_KEYS)}")
    fmt = output_format(output, json)
    if (sock := live.socket_path(socket)) is not None:
        listing = live.call(sock, NamespacesRequest(), LiveNamespaceList)
        listing.namespaces = _matching(listing.namespaces, pattern)
        sort_namespaces(listing.namespaces, sort)
        emit_listing(fmt, listing, listing.namespaces,
                     lambda: render_live_namespaces(listing, sock, fmt, no_headers))
        return
    st = open_inspect(store, read_only=read_only)
    try:
        ps, fp = _page_size(st), fingerprints_of(st)
        shares = {r.ns_id_hex: r.shares for r in st.shares()}
        rows = [NamespaceRow(r.extra_key, r.salt_fingerprint, _listed_id(r, fp), r.pages, r.pages * ps, r.bytes, r.hits,
                             r.created, r.last_access, shares.get(r.ns_id_hex)) for r in st.namespaces()]
    finally:
        st.close()
    rows = _matching(rows, pattern)
    sort_namespaces(rows, sort)

    def table() -> None:
        cells = [[r.id, r.extra_key, r.salt_fingerprint, r.pages, r.tokens if ps else None, r.bytes, r.hits,
                  r.last_access] for r in rows]
        render(with_shares(Listing(f"namespaces in {store}", LS_COLUMNS, cells), [r.shares for r in rows], fmt),
               fmt, no_headers)

    emit_listing(fmt, NamespaceList(str(store), rows), rows, table)


def _matching(rows: list, pattern: str | None) -> list:
    """The `ns ls` rows (offline or live) whose extra_key matches the glob `pattern` (all without one); a namespace
    without an extra_key matches as the empty string."""
    if pattern is None:
        return rows
    return [r for r in rows if fnmatch.fnmatchcase(r.extra_key or "", pattern)]


@app.command("show", short_help="Show a namespace's prefix tree in the store, hottest first.")
@command
def show(
    extra_key: KeyArg,
    salt: SaltOpt = None,
    salt_file: SaltFileOpt = None,
    store: StoreOpt = DEFAULT_STORE,
    depth: Annotated[int, typer.Option("--depth", min=1, max=4096, help="Pages of prefix to walk down.")] = 4,
    width: Annotated[int, typer.Option("--width", min=1, max=4096,
                                       help="Children shown per page, hottest first.")] = 5,
    read_only: ReadOnlyOpt = False,
    output: OutputOpt = None,
    no_headers: NoHeadersOpt = False,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Show a namespace's prefix tree in the store, hottest branches first, depth- and width-limited. A page an
    engine wrote under its own key (`kvc ns probe`) shows that key instead of tokens. tsv: one line per page
    (depth, page hash, hits, bytes, tokens, and a key column when the tree has engine pages)."""
    ns = namespace_arg(extra_key, salt, salt_file)
    fmt = output_format(output, json)
    st = open_inspect(store, read_only=read_only)
    try:
        fp = fingerprints_of(st)
        rec = namespace_record(st, ns)
        if rec is None:
            raise UsageError(f"no namespace {_named(ns, fp)} in {store} (check the extra_key and the salt)")
        roots, more = [], 0
        # a reader who may not read the store's key cannot key a root: the record keeps the roots it has
        heads = ([st.root(ns, layout) for layout in st.layouts()] if st.chain_key is not None
                 else [PageHash(bytes.fromhex(r)) for r in rec.roots])
        for head in heads:
            kids = st.children(head)
            roots += [_walk(st, c, depth - 1, width) for c in kids[:width]]
            more += max(0, len(kids) - width)
    finally:
        st.close()
    tree = NamespaceTree(NamespaceInfo(rec.extra_key, rec.salt_fingerprint), _listed_id(rec, fp), rec.pages, rec.bytes,
                         roots, more)
    emit_listing(fmt, tree, prefix_rows(tree), lambda: render_prefix_tree(tree, fmt, no_headers))


def _walk(store: L3Store, child, depth: int, width: int) -> PrefixNode:
    node = PrefixNode(child.page_hash.hex(), unpack_tokens(child.tokens), child.hits, child.nbytes, [])
    if child.key:  # an engine page: named by the engine's key, it has no tokens
        node.key = child.key.hex()
    if depth > 0:
        kids = store.children(child.page_hash)
        node.children = [_walk(store, c, depth - 1, width) for c in kids[:width]]
        node.more = max(0, len(kids) - width)
    return node


def _targets(store: L3Store, fp: FingerprintKey, extra_key: str | None, ns: Namespace | None, ns_id: str | None,
             fingerprint: str | None) -> list[NamespaceRecord]:
    """The registry records a drop names (at most one unless the name is ambiguous); ids under `fp`."""
    records = store.namespaces()
    if ns_id is not None:
        return [r for r in records if _shown_id(r, fp) == ns_id.lower()]
    if fingerprint is not None:
        key = extra_key or None
        return [r for r in records if r.salt_fingerprint == fingerprint.lower()
                and (extra_key is None or r.extra_key == key)]
    assert ns is not None
    return [r for r in records if r.ns_id_hex == ns.id_hex]


_HEX16 = re.compile(r"[0-9a-fA-F]{16}")
_HEX12 = re.compile(r"[0-9a-fA-F]{12}")


@app.command("drop", short_help="Drop a namespace from the store: by extra_key and salt, --id or --fingerprint.")
@command
def drop(
    extra_key: Annotated[str | None, typer.Argument(
        help="The namespace's extra_key (\"\" for requests without one); with --fingerprint, narrows it to this "
        "extra_key.", metavar="[EXTRA_KEY]", show_default=False)] = None,
    salt: SaltOpt = None,
    salt_file: SaltFileOpt = None,
    ns_id: Annotated[str | None, typer.Option(
        "--id", help="Name the namespace by the id `kvc ns ls` prints: exactly 16 hex digits (no salt needed).",
        show_default=False)] = None,
    fingerprint: Annotated[str | None, typer.Option(
        "--fingerprint", help="Name it by its salt fingerprint as `kvc ns ls` prints it, 12 hex digits (with "
        "EXTRA_KEY when tenants share a salt; no salt needed).", show_default=False)] = None,
    missing_ok: Annotated[bool, typer.Option(
        "--missing-ok", help="A namespace that is not in the store is not an error: nothing to drop, exit 0 "
        "(a second run of an offboarding succeeds; --json `dropped_before` then says when the store recorded "
        "its drop, null when it never did).")] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Change nothing: show what would go (pages per tier) and which live caches hold it. "
        "Needs no --yes.")] = False,
    store: StoreOpt = DEFAULT_STORE,
    socket: SocketOpt = None,
    yes: Annotated[bool, typer.Option("--yes", help="Confirm: remove every page of the namespace.")] = False,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Remove every page of one namespace from the store (a tenant's offboarding). Name it by EXTRA_KEY and its
    salt, by --id, or by --fingerprint [EXTRA_KEY]. Needs --yes (or --dry-run). Exit 2 when it names no namespace
    (0 with --missing-ok) or more than one.

    Every live cache serving the store (`kvc serve`, found from the store's record of them) follows the drop:
    it lets go of the namespace and never writes it back. Offline, a drop of a namespace that a live cache holds
    in L1 or L2 is refused (exit 2, naming its socket): drop it through that cache with --socket, which frees it
    from L1, L2 and the store at once, writing nothing back."""
    if ns_id is not None and not _HEX16.fullmatch(ns_id):
        raise UsageError(f"--id {shown(ns_id)}: an id is exactly 16 hex digits, as `kvc ns ls` prints it")
    if fingerprint is not None and not _HEX12.fullmatch(fingerprint):
        raise UsageError(f"--fingerprint {shown(fingerprint)}: a salt fingerprint is exactly 12 hex digits, as "
                         f"`kvc ns ls` prints it")
    ns_id = ns_id.lower() if ns_id is not None else None
    fingerprint = fingerprint.lower() if fingerprint is not None else None
    if ns_id is not None and fingerprint is not None:
        raise UsageError("give --id or --fingerprint, not both")
    by_digest = ns_id is not None or fingerprint is not None
    if by_digest and (salt is not None or salt_file is not None):
        raise UsageError("--id and --fingerprint name a namespace without its salt: drop --salt / --salt-file")
    if ns_id is not None and extra_key is not None:
        raise UsageError("--id names the namespace alone: drop EXTRA_KEY")
    if not by_digest and extra_key is None:
        raise UsageError("name the namespace: EXTRA_KEY (with its salt), --id ID or --fingerprint FP")
    salt_value = None if by_digest else salt_from(salt, salt_file)  # read once: it may come from stdin
    ns = None if by_digest else Namespace(extra_key, salt_value)
    if not yes and not dry_run:  # nothing is open yet: the name as given, no fingerprint (_named)
        named = _what(ns, ns_id, fingerprint, extra_key, no_store_fingerprints())
        raise UsageError(f"refusing to drop namespace {named} without --yes (--dry-run shows what would go)")
    path = live.socket_path(socket)
    if path is not None:
        request = DropRequest(extra_key, salt_value, ns_id, fingerprint, dry_run)
        return _drop_live(path, request, store, missing_ok, json)
    st = open_inspect(store, writable=not dry_run)
    try:
        fp = fingerprints_of(st)
        what = _what(ns, ns_id, fingerprint, extra_key, fp)  # the store is open: a fingerprint under its key
        found = _targets(st, fp, extra_key, ns, ns_id, fingerprint)
        if len(found) > 1:
            raise UsageError(f"{len(found)} namespaces have {what}: name one by --id (see `kvc ns ls`)")
        if not found:
            shown_id = fp.display_id(ns.id) if ns is not None else ns_id
            if shown_id is not None and not dry_run:
                _refuse_if_held(st, fp.info(ns) if ns is not None else None, shown_id)
            before = _dropped_before(st, fp, ns, ns_id, extra_key, fingerprint)
            if not missing_ok:
                again = " (the store recorded its drop before: --missing-ok makes a re-run a success)" if before \
                    else " (--missing-ok makes that a success)"
                raise UsageError(f"no namespace {what} in {store}{again}")
            info = fp.info(ns) if ns is not None else None
            if info is None and before is not None:
                info = NamespaceInfo(before.extra_key, before.salt_fingerprint)
            output = DropOutput(info, shown_id, False, dry_run, 0, 0, 0, 0, 0, 0, None,
                                dropped_before=before.at if before is not None else None)
        else:
            output = _drop_offline(st, fp, found[0], dry_run)
    finally:
        st.close()
    _say_dropped(output, what, store, json)


def _what(ns: Namespace | None, ns_id: str | None, fingerprint: str | None, extra_key: str | None,
          fp: FingerprintKey) -> str:
    """How a drop names its namespace in messages: as the command line named it (a salt's fingerprint under
    `fp`, when it is at hand)."""
    if ns_id is not None:
        return f"id {ns_id}"
    if fingerprint is not None:
        return f"fingerprint {fingerprint}" + (f" and extra_key {shown(extra_key)}" if extra_key else "")
    assert ns is not None  # named by EXTRA_KEY and its salt
    return _named(ns, fp)


def _drop_offline(st: L3Store, fp: FingerprintKey, rec: NamespaceRecord, dry_run: bool) -> DropOutput:
    """Drop (or, `dry_run`, show) one namespace offline: refused while a live cache holds it."""
    from kvcache.live.serves import holding, live_serves, where
    from kvcache.storage.serving import OFFLINE, recorded_drop

    info, shown_id = NamespaceInfo(rec.extra_key, rec.salt_fingerprint), _shown_id(rec, fp)
    holders = holding(live_serves(st), shown_id)
    if dry_run:
        rows = [h.holds for h in holders if h.holds is not None]
        return DropOutput(info, shown_id, False, True, rec.pages, rec.bytes, sum(r.device.pages for r in rows),
                          sum(r.host.pages for r in rows), 0, 0, None, [where(h.record) for h in holders])
    _refuse_if_held(st, info, shown_id, holders)
    _, result = recorded_drop(st, NamespaceId(bytes.fromhex(rec.ns_id_hex)), OFFLINE)
    return DropOutput(info, shown_id, True, False, result.pages, result.bytes, 0, 0, 0, result.transactions, None)


def _refuse_if_held(st: L3Store, info: NamespaceInfo | None, shown_id: str, holders: list | None = None) -> None:
    """UsageError naming the live caches of the store that hold namespace `shown_id` in L1/L2: they would write
    it back (write-back), so the drop must go through one of them."""
    from kvcache.live.serves import holding, live_serves, where

    holders = holding(live_serves(st), shown_id) if holders is None else holders
    if holders:
        names = ", ".join(where(h.record) for h in holders)
        label = f"{shown(info.extra_key)}/{info.salt_fingerprint or '-'}" if info is not None else "-"
        raise UsageError(f"namespace {label} (id {shown_id}) is held by a live cache serving this store "
                         f"({names}): drop it through it, `kvc --socket {holders[0].record.socket} ns drop --id "
                         f"{shown_id} --yes`")


def _dropped_before(st: L3Store, fp: FingerprintKey, ns: Namespace | None, ns_id: str | None,
                    extra_key: str | None, fingerprint: str | None) -> DropRecord | None:
    """The store's latest record of a drop of the namespace named so (None: it records none); ids under `fp`."""
    from kvcache.storage.serving import last_drop

    if ns is not None:
        rec = last_drop(st, ns_id_hex=ns.id_hex)
    elif ns_id is not None:
        rec = next((r for r in reversed(st.drops())
                    if fp.display_id(NamespaceId(bytes.fromhex(r.ns_id_hex))) == ns_id), None)
    else:
        rec = last_drop(st, extra_key=extra_key or None if extra_key is not None else None,
                        salt_fingerprint=fingerprint)
    return rec


def _say_dropped(output: DropOutput, what: str, store: object, json: bool) -> None:
    if json:
        emit_json(output)
        return
    via = f" through the live cache at {output.socket}" if output.socket else ""
    if output.dry_run and (output.store_pages or output.device_pages or output.host_pages or output.live_caches):
        held = (f"; held by live cache(s) {', '.join(output.live_caches)}: an offline drop refuses, drop it "
                f"through one with --socket" if output.live_caches else "")
        say(literal(f"would drop namespace {ns_label(output.namespace)} (id {output.id}){via}: "
                    f"{output.device_pages:,} L1 pages, {output.host_pages:,} L2 pages, {output.store_pages:,} L3 "
                    f"pages ({human_bytes(output.store_bytes)}){held}"))
    elif not output.dropped:
        at = output.dropped_before
        before = (f" (the store recorded its drop at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(at))})"
                  if at is not None else "")
        say(literal(f"namespace {what} is not in {shown(str(store))}{via}: nothing to drop{before}"))
    elif output.socket is None:
        say(literal(f"dropped namespace {ns_label(output.namespace)} (id {output.id}): {output.store_pages:,} pages, "
                    f"{human_bytes(output.store_bytes)} ({output.transactions} transactions)"))
    else:
        running = (f"; {output.live_requests} running request(s) keep their pages until they end"
                   if output.live_requests else "")
        say(literal(f"dropped namespace {ns_label(output.namespace)} (id {output.id}){via}: "
                    f"{output.device_pages:,} L1 pages, {output.host_pages:,} L2 pages, {output.store_pages:,} L3 "
                    f"pages ({human_bytes(output.store_bytes)}){running}"))


def _drop_live(path: str, request: DropRequest, store: StoreLocation, missing_ok: bool, json: bool) -> None:
    """`kvc --socket S ns drop ...`: offboard a namespace from the live cache's L1 and L2 (nothing written back)
    and from its store, in one request (`TieredCache.drop_namespace`); every other live cache of the store
    follows. Named by --id or --fingerprint, the cache looks among what it holds and what its store records."""
    from kvcache.types.results import NamespaceDrop

    ns = None
    if request.id is None and request.fingerprint is None:
        ns = Namespace(request.extra_key, request.cache_salt)  # checked here, before the request goes out
    outcome = live.call(path, request, NamespaceDrop)
    # named by its salt, the namespace is said as the live cache shows it (its store's key); else as given
    info = outcome.namespace
    what = f"{shown(info.extra_key)}/{info.salt_fingerprint or '-'}" if ns is not None else \
        _what(None, request.id, request.fingerprint, request.extra_key, no_store_fingerprints())
    held = outcome.device_pages + outcome.host_pages + outcome.store_pages
    found = bool(held or outcome.live_requests)
    before = None
    if not found:
        before = _live_dropped_before(store, request)
        if not missing_ok:
            raise UsageError(f"namespace {what} holds nothing in the live cache at {path} or its store "
                             f"(--missing-ok makes that a success)")
    output = DropOutput(outcome.namespace, outcome.namespace_id or None, found and not request.dry_run,
                        request.dry_run, outcome.store_pages, outcome.store_bytes, outcome.device_pages,
                        outcome.host_pages, outcome.live_requests, 0, path, dropped_before=before)
    _say_dropped(output, what, store, json)


def _live_dropped_before(store: StoreLocation, request: DropRequest) -> float | None:
    """The time of the namespace's recorded drop, read from --store when it opens (the live cache's store, when
    the caller names it); None otherwise."""
    with contextlib.suppress(Exception):  # not that store, or none at all: nothing known
        st = open_inspect(store)
        try:
            ns = Namespace(request.extra_key, request.cache_salt) if request.id is None and \
                request.fingerprint is None else None
            rec = _dropped_before(st, fingerprints_of(st), ns, request.id, request.extra_key, request.fingerprint)
            return rec.at if rec is not None else None
        finally:
            st.close()
    return None


@app.command("evict", short_help="Live cache only: evict a namespace's pages from L1 and/or L2 (under "
             "write-back they may be written back to L3 first).")
@command
def evict(
    extra_key: Annotated[str, typer.Argument(help="The namespace's extra_key (\"\" for requests without one).",
                                             metavar="EXTRA_KEY")],
    salt: SaltOpt = None,
    salt_file: SaltFileOpt = None,
    socket: SocketOpt = None,
    device: Annotated[bool, typer.Option("--device/--no-device", help="Evict from L1.")] = True,
    host: Annotated[bool, typer.Option("--host/--no-host", help="Evict from L2.")] = True,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Live cache only: evict a namespace's pages from L1 and/or L2 (what requests and copies use stays; its L3
    pages stay). This is not offboarding: under write-back, pages not yet in the store are written back first
    (device pages to L2, L2 pages to L3), so the namespace's pages may appear in L3. To remove a namespace
    everywhere, `kvc ns drop` (nothing is written back)."""
    path = live.socket_path(socket)
    if path is None:
        raise UsageError("kvc ns evict acts on a live cache: give --socket PATH (or KVC_SOCKET)")
    salt_value = salt_from(salt, salt_file)
    Namespace(extra_key, salt_value)  # checked here, before the request goes out
    outcome = live.call(path, EvictRequest(extra_key, salt_value, device, host), EvictOutcome)
    if json:
        emit_json(outcome)
        return
    t = outcome.tiers
    say(f"evicted namespace {ns_label(outcome.namespace)}: {outcome.device_pages:,} L1 pages, "
        f"{outcome.host_pages:,} L2 pages; it now holds {t.device.tokens:,} tokens in L1, {t.host.tokens:,} in L2, "
        f"{t.storage.tokens:,} in L3")


@app.command("expire", short_help="Live cache only: expire a namespace now, by the cache's TTL rules.")
@command
def expire(
    extra_key: KeyArg,
    salt: SaltOpt = None,
    salt_file: SaltFileOpt = None,
    socket: SocketOpt = None,
    yes: Annotated[bool, typer.Option("--yes", help="Confirm: the namespace leaves L1, L2 and the store.")] = False,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Live cache only: expire a namespace now, as if its time to live ran out (the cache needs a TTL policy:
    `kvc serve --ttl-default-s`). It is dropped from L1, L2 and the store without writing anything back; while
    requests of it are running its expiry is deferred until the last one ends, and a new request of it before
    then cancels the expiry. Needs --yes. Exit 1 when the cache does not know the namespace (nothing in any tier,
    no deadline): nothing expired. Offline there is no deadline to run out: `kvc ns drop` removes a namespace from
    the store."""
    path = live.socket_path(socket)
    if path is None:
        raise UsageError("kvc ns expire acts on a live cache's TTL policy: give --socket PATH (or KVC_SOCKET); "
                         "offline, `kvc ns drop EXTRA_KEY --yes` removes a namespace from the store")
    salt_value = salt_from(salt, salt_file)
    ns = Namespace(extra_key, salt_value)  # checked here, before the request goes out
    if not yes:
        raise UsageError(f"refusing to expire namespace {_named(ns, no_store_fingerprints())} without --yes")
    from kvcache.types.results import NamespaceExpiry

    outcome = live.call(path, ExpireRequest(extra_key, salt_value), NamespaceExpiry)
    if json:
        emit_json(outcome)
    elif not outcome.expired and not outcome.deferred:
        say(f"namespace {ns_label(outcome.namespace)} holds nothing in the live cache or its store and has no "
            f"deadline: nothing expired (check the extra_key and the salt)")
    elif outcome.deferred:
        say(f"namespace {ns_label(outcome.namespace)} expires when its {outcome.live_requests} running request(s) "
            f"end (a new request of it before then cancels the expiry)")
    else:
        say(f"expired namespace {ns_label(outcome.namespace)} (id {outcome.id}): {outcome.device_pages:,} L1 "
            f"pages, {outcome.host_pages:,} L2 pages, {outcome.store_pages:,} L3 pages "
            f"({human_bytes(outcome.store_bytes)})")
    if not outcome.expired and not outcome.deferred:
        raise typer.Exit(EXIT_FOUND)  # a namespace the cache does not know: a typo, or gone already


app.add_typer(quota_app, name="quota", short_help="A namespace's shares of L1, L2 and L3: set, show, clear.")
app.command("probe", short_help="How many of a prompt's pages (or of a chain of page hashes) each tier would "
            "serve: the store offline, L1/L2/L3 of a live cache; or an engine's store (--engine sglang).")(
    command(probe))
app.command("dump", short_help="What the store (or a live cache, per tier) holds, as the KV events a router would "
            "have received.")(command(dump))
