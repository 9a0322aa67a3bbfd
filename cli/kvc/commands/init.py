"""`kvc init`: create a store for one KV layout (idempotent for the same layout)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Annotated

import msgspec
import typer

from kvcache.errors import NotAStore
from kvcache.storage.keyfile import KEY_FILE
from kvcache.storage.location import StoreLocation
from kvcache.storage.registry import maintenance_of, open_store, scheme_of
from kvcache.types.layout import KVLayout

from ..context import require_store
from ..errors import UsageError
from ..options import DEFAULT_STORE, DebugOpt, JsonOpt, StoreOpt
from ..render.output import emit_json, say
from ..render.text import esc, human_bytes
from ..reporting import command


class RekeyOutput(msgspec.Struct):
    """`kvc init --rekey --json`."""

    store: str  # credentials redacted
    key_file: str
    previous: str  # what the key file was: present (a rotation), missing, empty, corrupt or unreadable
    namespaces: int  # registry records: the display id of each changed
    fingerprints_unknown: int  # salted records whose fingerprint shows "?" until the namespace's next write
    unreachable_pages: int  # pages hashed under the old key (--yes): never found again; `kvc audit --repair --force`


class InitOutput(msgspec.Struct):
    """`kvc init --json`."""

    store: str  # credentials redacted
    created: bool  # False: the store already existed with this layout (nothing changed)
    layout: KVLayout
    layout_id: str  # hex
    bytes_per_token: int
    bytes_per_page: int
    fingerprint_key: str  # where the store's fingerprint key is kept: its key file, or "format record"
    # LMDB: the data file one page of the layout takes (bytes, estimated: kvcache.storage.lmdb.footprint) and its
    # ratio to the payload, what to multiply a payload capacity by to get the disk to provision; 0 for a shared
    # store (Redis: its server's memory, not counted here)
    disk_per_page: int = 0
    disk_per_payload: float = 0.0


@command
def init(
    store: StoreOpt = DEFAULT_STORE,
    model: Annotated[str, typer.Option(help="Model name and revision: part of the layout's identity.")]
    = "synthetic@r1",
    page_size: Annotated[int, typer.Option(min=1, max=1 << 20,
                                           help="Tokens per page: the unit of caching and of L3 storage.")] = 16,
    layers: Annotated[int, typer.Option(min=1, max=1 << 16, help="Transformer layers.")] = 4,
    kv_heads: Annotated[int, typer.Option(min=1, max=1 << 16, help="KV heads per layer.")] = 2,
    head_dim: Annotated[int, typer.Option(min=1, max=1 << 16, help="Elements per head.")] = 32,
    dtype: Annotated[str, typer.Option(help="KV element type, e.g. float16, bfloat16, float32, float8_e4m3fn.")]
    = "float16",
    parents: Annotated[bool, typer.Option("--parents", help="Create missing parent directories of the store "
                                                            "path (like mkdir -p).")] = False,
    rekey: Annotated[bool, typer.Option(
        "--rekey", help="Give the existing LMDB store a new fingerprint key (its key file lost, damaged, or never "
        "written by an older kvc; or to rotate it). Every display id and salt fingerprint changes: the registry's "
        "recorded fingerprints show '?' until each namespace's next write. Refused while a live cache serves the "
        "store. The layout options are not used.")] = False,
    yes: Annotated[bool, typer.Option(
        "--yes", help="With --rekey: go ahead even though the store's page hashes are keyed by its key (a format-2 "
        "store holding pages): none of them would be found again (`kvc audit --repair --force` then removes them). "
        "Refused without it.")] = False,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Create a store for one KV layout, with its own fingerprint key (a 0600 key file beside an LMDB store;
    env KVC_FINGERPRINT_KEY, when set, is the key instead of a random one). Running it again with the same
    layout changes nothing; another layout is an error (exit 2): pages of different layouts must never mix. A
    store path whose parent directory is missing is refused unless --parents."""
    if yes and not rekey:
        raise UsageError("--yes goes with --rekey")
    if rekey:
        _rekey(store, yes, json)
        return
    layout = KVLayout(model, layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                      page_size=page_size)
    path = _directory(store)
    if path is not None and not path.parent.exists():
        if not parents:
            raise UsageError(f"{store}: the parent directory {path.parent} does not exist (typo? pass --parents "
                             f"to create it)")
        os.makedirs(path.parent, exist_ok=True)
    created = False
    try:
        handle = open_store(store.url, layout)
    except NotAStore:
        if path is not None and path.exists() and any(path.iterdir()):
            raise  # a directory with other things in it is not made into a store
        handle, created = open_store(store.url, layout, create=True), True
    handle.close()
    key = store.redact(str(path / KEY_FILE)) if path is not None else "format record"  # the path may hold a token
    maintenance = maintenance_of(store.url)  # a backend with a data file to size (LMDB) says what a page costs
    disk = maintenance.page_disk(layout) if maintenance is not None else None
    result = InitOutput(str(store), created, layout, layout.layout_id.hex(), layout.bytes_per_token,
                        layout.bytes_per_page, key, disk.total if disk else 0, round(disk.ratio, 3) if disk else 0.0)
    if json:
        emit_json(result)
        return
    verb = "created" if created else "already holds this layout:"
    say(f"{esc(str(store))}: {verb} {esc(layout.describe())}")
    say(f"  {human_bytes(layout.bytes_per_token)} per token, {human_bytes(layout.bytes_per_page)} per page "
        f"of {page_size} tokens; layout id {layout.layout_id.hex()[:16]}; fingerprint key in {esc(key)}")
    if disk is not None:
        say(f"  on disk ~{human_bytes(disk.total)} per page, {disk.ratio:.2f}x its payload: capacities and quotas "
            f"count payload, so provision {disk.ratio:.2f}x the capacity you set (docs/capacity.md)")


def _directory(store: StoreLocation) -> Path | None:
    """The directory of an LMDB store (a path, or an lmdb:// URL); None for a shared store's URL, which keeps its
    key in its format record."""
    if scheme_of(store.url) != "lmdb":
        return None
    url = store.url
    return Path(url[len("lmdb://"):] if url[:len("lmdb://")].lower() == "lmdb://" else url)


def _rekey(store: StoreLocation, yes: bool, json: bool) -> None:
    """`kvc init --rekey`: a new key for an existing LMDB store, saying what changes."""
    maintenance = maintenance_of(store.url)
    if maintenance is None:
        raise UsageError(f"--rekey: {store} keeps its fingerprint key in its format record, not a key file; "
                         f"--rekey gives an LMDB store a new key file")
    require_store(store)
    from kvcache.live.serves import alive, where

    me = socket.gethostname()
    result = maintenance.rekey(store.url, lambda records: [where(r) for r in records if r.host != me or alive(r.pid)], yes)
    out = RekeyOutput(str(store), store.redact(result.path), str(result.previous), result.namespaces,
                      result.fingerprints_unknown, result.unreachable_pages)
    if json:
        emit_json(out)
        return
    was = {"present": "replaced the previous key", "missing": "the key file was missing"}.get(
        out.previous, f"the key file was {out.previous}")
    say(f"{esc(str(store))}: new fingerprint key in {esc(out.key_file)} ({was})")
    say(f"  what changes: the display id of each of the {out.namespaces} namespace(s) (`kvc ns ls` shows the new "
        f"ones; ids noted before match nothing now), and every salt fingerprint: {out.fingerprints_unknown} "
        f"salted namespace(s) show fingerprint '?' until their next write records it under the new key "
        f"(meanwhile name them by --id, or by their extra_key and salt)")
    if out.unreachable_pages:
        say(f"  {out.unreachable_pages:,} stored pages were hashed under the old key and will not be found again: "
            f"`kvc audit --repair --force --store {esc(str(store))}` removes them")
