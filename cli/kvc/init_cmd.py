"""`kvc init`: create a store for one KV layout (idempotent for the same layout)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec
import typer

from kvcache import KVLayout, NotAStore
from kvcache.storage.base import open_store

from .common import DEFAULT_STORE, DebugOpt, JsonOpt, StoreOpt, command, emit_json, human_bytes, out


class InitOutput(msgspec.Struct):
    """`kvc init --json`."""

    store: str
    created: bool  # False: the store already existed with this layout (nothing changed)
    layout: KVLayout
    layout_id: str  # hex
    bytes_per_token: int
    bytes_per_page: int


@command
def init(
    store: StoreOpt = DEFAULT_STORE,
    model: Annotated[str, typer.Option(help="Model name and revision: part of the layout's identity.")]
    = "synthetic@r1",
    page_size: Annotated[int, typer.Option(help="Tokens per page: the unit of caching and of L3 storage.")] = 16,
    layers: Annotated[int, typer.Option(help="Transformer layers.")] = 4,
    kv_heads: Annotated[int, typer.Option(help="KV heads per layer.")] = 2,
    head_dim: Annotated[int, typer.Option(help="Elements per head.")] = 32,
    dtype: Annotated[str, typer.Option(help="KV element type, e.g. float16, bfloat16, float32, float8_e4m3fn.")]
    = "float16",
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Create a store for one KV layout. Running it again with the same layout changes nothing; another
    layout is an error (exit 2): pages of different layouts must never mix."""
    layout = KVLayout(model, layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                      page_size=page_size)
    created = False
    try:
        handle = open_store(store, layout)
    except NotAStore:
        if "://" not in store and Path(store).exists() and any(Path(store).iterdir()):
            raise  # a directory with other things in it is not made into a store
        handle, created = open_store(store, layout, create=True), True
    handle.close()
    result = InitOutput(store, created, layout, layout.layout_id.hex(), layout.bytes_per_token,
                        layout.bytes_per_page)
    if json:
        emit_json(result)
        return
    verb = "created" if created else "already holds this layout:"
    out.print(f"{store}: {verb} {layout.describe()}")
    out.print(f"  {human_bytes(layout.bytes_per_token)} per token, {human_bytes(layout.bytes_per_page)} per page "
              f"of {page_size} tokens; layout id {layout.layout_id.hex()[:16]}")

