"""The store an engine adapter opens: under the layout of the engine's pages, created and registered on first use,
and refused in one line when it could never name an engine page.

Engine pages are hashed under the store's secret (`L3Store.chain_key`), so a handle that may not read it could not
read or write a single page: the adapter refuses at once, at the engine's start, rather than answering every call
with a miss. The store backend's own open options pass as the engine's config gives them; one the backend does not
take is one line naming the options, never a TypeError from deep in the backend.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidInput, StoreAccessDenied
from ..storage.api import L3Store
from ..storage.registry import open_store
from ..types.layout import KVLayout


def open_engine_store(location: str, layout: KVLayout, options: dict[str, Any], who: str,
                      runs: str) -> tuple[L3Store, bytes]:
    """The store at `location` opened to hold `layout`'s pages (created, the layout registered), with the
    backend's `options` (the engine config's "kvc_store_options"), and its chain key (what roots the engine's
    pages). `who` names the adapter in messages, `runs` what must run as a user who may read the store's key ("the
    engine", "vLLM"). InvalidInput for an option the backend does not take; StoreAccessDenied when this user may
    not read the store's key."""
    try:
        store = open_store(location, layout, create=True, add_layout=True, **options)
    except TypeError as exc:  # an option the backend does not take
        raise InvalidInput(f"{who}: \"kvc_store_options\" {sorted(options)}: {exc}") from None
    if store.chain_key is None:  # engine pages are hashed under the store's secret: no key, no page
        store.close()
        raise StoreAccessDenied(store.location, f"this user cannot read the store's key, which names every engine "
                                                f"page: run {runs} as a user who may")
    return store, store.chain_key
