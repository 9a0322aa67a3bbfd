"""The argument checks every L3 backend shares, so that every backend refuses bad input alike (InvalidInput,
LayoutMismatch), and the conversions of callers' page buffers to flat byte views that those checks return."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import InvalidInput, LayoutMismatch, StoreAccessDenied
from ..types.keys import PAGE_HASH_BYTES, TOKEN_BYTES, extend_chain, hash_root
from ..types.layout import KVLayout
from ..types.namespace import Namespace
from .api import LayoutRecord, PageOrigin


def check_page_hashes(hashes: Sequence[bytes]) -> None:
    """Raise InvalidInput unless every element is a PAGE_HASH_BYTES-long bytes value."""
    if all(type(h) is bytes for h in hashes) and set(map(len, hashes)) <= {PAGE_HASH_BYTES}:
        return  # the common case, checked at C speed: reads run this on every batch
    for h in hashes:
        if not isinstance(h, bytes) or len(h) != PAGE_HASH_BYTES:
            raise InvalidInput(f"a page hash must be {PAGE_HASH_BYTES} bytes, got {h!r:.60}")


def out_views_for(hashes: Sequence[bytes], out_views: Sequence[Any], layout: KVLayout | None = None
                  ) -> list[memoryview]:
    """`get_into`'s argument checks, the same for every backend: valid page hashes and one writable byte view
    per hash, of a page's size under `layout` when the handle has one (InvalidInput otherwise). Returns those
    views."""
    if len(out_views) < len(hashes):
        raise InvalidInput(f"get_into needs one out view per page hash: {len(out_views)} views, {len(hashes)} hashes")
    check_page_hashes(hashes)
    outs = [byte_view(v) for v in out_views[:len(hashes)]]
    if layout is not None:
        want = layout.bytes_per_page  # a property: computed once, not per view
        if any(len(out) != want for out in outs):
            raise InvalidInput(f"get_into needs out views of {want} bytes (a page of layout {layout.describe()}), "
                               f"got {sorted({len(o) for o in outs})}")
    return outs


def put_views(layout: KVLayout | None, hashes: Sequence[bytes], pages: Sequence[Any],
              origins: Sequence[PageOrigin]) -> list[memoryview]:
    """`put`'s argument checks, the same for every backend: a handle with a layout, one page and one origin per
    valid page hash, each page of the layout's size and the hash of its origin's parent and tokens, and no page
    whose parent in the same batch is in another namespace (InvalidInput otherwise). Returns the pages' bytes."""
    if layout is None:
        raise InvalidInput("put needs a layout: open the store with layout=...")
    if not (len(hashes) == len(pages) == len(origins)):
        raise InvalidInput(f"put needs as many pages and origins as hashes: {len(hashes)} hashes, "
                           f"{len(pages)} pages, {len(origins)} origins")
    check_page_hashes(hashes)
    nbytes, step = layout.bytes_per_page, layout.page_size * TOKEN_BYTES
    views = []
    for h, page, origin in zip(hashes, pages, origins, strict=True):
        mv = page_bytes(page)
        if len(mv) != nbytes:
            raise InvalidInput(f"page {h.hex()} has {len(mv)} bytes, layout {layout.describe()} needs {nbytes}")
        if len(origin.tokens) != step:
            raise InvalidInput(f"page {h.hex()}: {len(origin.tokens)} token bytes, a page holds {step}")
        if extend_chain(origin.parent, origin.tokens, layout.page_size)[0] != h:
            raise InvalidInput(f"page {h.hex()} is not the hash of its parent and tokens in this origin")
        views.append(mv)
    batch_ns = {h: o.namespace.id for h, o in zip(hashes, origins, strict=True)}
    for h, origin in zip(hashes, origins, strict=True):
        up = batch_ns.get(origin.parent)
        if up is not None and up != origin.namespace.id:
            raise InvalidInput(f"page {h.hex()}: its parent in this batch is in another namespace than "
                               f"{origin.namespace.label}")
    return views


def layout_to_register(location: str, layout: KVLayout, held: dict[bytes, LayoutRecord], register: bool) -> bool:
    """Opening a handle with `layout`: whether the store must register it now (False: it holds it already).
    LayoutMismatch, naming the layouts held, when it does not hold it and `register` is off."""
    if layout.layout_id in held:
        return False
    if not register:
        raise LayoutMismatch(location, layout.describe(), [r.layout.describe() for r in held.values()])
    return True


def namespace_root(namespace: Namespace, layout: KVLayout | None, chain_key: bytes | None, location: str) -> bytes:
    """`L3Store.root`: the hash root of `namespace` under `layout` keyed by the store's `chain_key` (InvalidInput
    when the handle has no layout; StoreAccessDenied when this user may not read the store's secret)."""
    if layout is None:
        raise InvalidInput("root() needs a layout: open the store with one or pass it")
    if chain_key is None:
        raise StoreAccessDenied(location, "the namespace roots of this store are keyed by its secret, which this "
                                           "user cannot read: ask with the store owner's account")
    return hash_root(layout.layout_id, namespace, chain_key)


def byte_view(view: Any) -> memoryview:
    """For backends' `get_into`: a flat writable byte memoryview of a caller's page buffer (numpy array, CPU
    torch tensor, bytearray). numpy views are the fast path (a torch tensor costs a `.numpy()` call per view:
    pass `tensor.numpy()` rows)."""
    if type(view) is not np.ndarray and hasattr(view, "numpy") and hasattr(view, "device"):
        if view.device.type != "cpu":
            raise InvalidInput(f"page views must be in host memory, got a tensor on {view.device}")
        view = view.numpy()
    mv = memoryview(view)
    if mv.readonly:
        raise InvalidInput("page views must be writable")
    if not mv.c_contiguous:
        raise InvalidInput("page views must be contiguous (one page is one span)")
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def page_bytes(page: Any) -> memoryview:
    """For backends' `put`: a flat byte memoryview of a page to write (numpy array, CPU torch tensor, bytes)."""
    if not isinstance(page, (bytes, bytearray, memoryview)) and hasattr(page, "numpy") and hasattr(page, "device"):
        page = page.detach().cpu().numpy()
    mv = memoryview(page)
    if not mv.c_contiguous:
        raise InvalidInput("pages must be contiguous (one page is one span)")
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
