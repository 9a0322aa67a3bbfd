"""The argument checks every L3 backend shares, so that every backend refuses bad input alike (InvalidInput,
LayoutMismatch), and the conversions of callers' page buffers to flat byte views that those checks return.

A page is one buffer or a list/tuple of buffers (segments: an engine's host page split across layers, or K and
V): the checks return a flat `memoryview` for the first and `Segments` for the second, and a backend's copy loop
tells them apart by type (`type(view) is memoryview`, the common case first). One numpy array (or CPU tensor) that
is not contiguous but whose innermost axis is (an engine's host page viewed in place: its rows spread over the
pool's layers, K then V) is one page too, its bytes the array's in C order: the checks return it as `Strided`,
which a backend copies as it copies `Segments` (`fill`/`gather`, one `np.copyto` each) and sums over its
contiguous runs (`views`). An array strided in its innermost axis (bytes scattered one by one) is refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import InvalidInput, LayoutMismatch, StoreAccessDenied
from ..types.ids import NamespaceId, PageHash
from ..types.keys import ENGINE_KEY_MAX, PAGE_HASH_BYTES, TOKEN_BYTES, engine_page_hash, extend_chain, hash_root
from ..types.layout import KVLayout
from ..types.namespace import Namespace
from .api import LayoutRecord, PageOrigin


class Segments:
    """One page given as segments (writable views for `get_into`, readable ones for `put`): the page's bytes are
    `views` concatenated in order. What the checks return for a list/tuple page; a backend copies through
    `fill`/`gather` and checksums through `Checksum.of_parts`."""

    __slots__ = ("views", "nbytes")

    def __init__(self, views: tuple[memoryview, ...]) -> None:
        self.views = views  # flat byte memoryviews, in page order
        self.nbytes = sum(len(v) for v in views)  # the page's size: the segments' lengths added up

    def __len__(self) -> int:
        return self.nbytes

    def fill(self, src: Any) -> None:
        """Copy `src` (a flat byte view of `nbytes`) into the segments, in order: a read's copy out."""
        at = 0
        for v in self.views:
            end = at + len(v)
            v[:] = src[at:end]
            at = end

    def gather(self, dst: Any) -> None:
        """Copy the segments, in order, into `dst` (a flat writable byte view of `nbytes`): a write's copy in."""
        at = 0
        for v in self.views:
            end = at + len(v)
            dst[at:end] = v
            at = end

    def tobytes(self) -> bytes:
        """The page's bytes in one value (a backend that sends a page as one value)."""
        return b"".join(self.views)


class Strided:
    """One page given as one non-contiguous array whose innermost axis is contiguous (an engine's host page viewed
    in place, e.g. SGLang's `kv_buffer[:, :, start:end]`): the page's bytes are the array's in C order. The same
    interface as `Segments` (`fill`, `gather`, `views`, `nbytes`, `tobytes`), so every backend copies it unchanged,
    but each copy is one `np.copyto` instead of a Python step per segment."""

    __slots__ = ("array", "nbytes")

    def __init__(self, array: np.ndarray) -> None:
        self.array = array  # a uint8 view of the caller's memory; its last axis contiguous, at least 2 axes
        self.nbytes = array.size  # the page's size in bytes

    def __len__(self) -> int:
        return self.nbytes

    def fill(self, src: Any) -> None:
        """Copy `src` (a flat byte view of `nbytes`) into the array, in C order: a read's copy out."""
        np.copyto(self.array, np.frombuffer(src, np.uint8).reshape(self.array.shape))

    def gather(self, dst: Any) -> None:
        """Copy the array, in C order, into `dst` (a flat writable byte view of `nbytes`): a write's copy in."""
        np.copyto(np.frombuffer(dst, np.uint8).reshape(self.array.shape), self.array)

    @property
    def views(self) -> list[np.ndarray]:
        """The page's contiguous runs, in page order: what a checksum streams over (`Checksum.of_parts`), so a
        read sums exactly the bytes the caller's memory now holds."""
        array = self.array
        lead = array.ndim - _trailing_axes(array)  # the axes that index runs; the others make up one run
        try:  # the runs as the rows of one 2-D view (no copy: numpy refuses when the leading axes do not merge)
            return list(array.reshape(-1, math.prod(array.shape[lead:]), copy=False))
        except ValueError:
            return [array[i].reshape(-1) for i in np.ndindex(array.shape[:lead])]

    def tobytes(self) -> bytes:
        """The page's bytes in one value (a backend that sends a page as one value)."""
        return self.array.tobytes()


def _trailing_axes(array: np.ndarray) -> int:
    """How many trailing axes of a uint8 array are laid out back to back (at least 1: its last axis, which the
    caller checked contiguous)."""
    expect, axes = 1, 0
    for size, stride in zip(reversed(array.shape), reversed(array.strides), strict=True):
        if size != 1 and stride != expect:
            break
        expect *= size
        axes += 1
    return max(axes, 1)


PageView = memoryview | Segments | Strided  # one page as the checks return it: a flat byte view, its segments,
#                                             or one strided array
_SEGMENTED = (list, tuple)  # a page given as these is a list of segments; any other object is one buffer


def check_page_hashes(hashes: Sequence[bytes]) -> None:
    """Raise InvalidInput unless every element is a PAGE_HASH_BYTES-long bytes value."""
    if all(type(h) is bytes for h in hashes) and set(map(len, hashes)) <= {PAGE_HASH_BYTES}:
        return  # the common case, checked at C speed: reads run this on every batch
    for h in hashes:
        if not isinstance(h, bytes) or len(h) != PAGE_HASH_BYTES:
            raise InvalidInput(f"a page hash must be {PAGE_HASH_BYTES} bytes, got {h!r:.60}")


def out_views_for(hashes: Sequence[bytes], out_views: Sequence[Any], layout: KVLayout | None = None
                  ) -> list[PageView]:
    """`get_into`'s argument checks, the same for every backend: valid page hashes and, per hash, one writable
    byte view, a list of them (segments, returned as `Segments`) or one array contiguous in its innermost axis
    only (returned as `Strided`), of a page's size under `layout` when the
    handle has one (InvalidInput otherwise). Returns those views."""
    if len(out_views) < len(hashes):
        raise InvalidInput(f"get_into needs one out view per page hash: {len(out_views)} views, {len(hashes)} hashes")
    check_page_hashes(hashes)
    views = out_views[:len(hashes)]
    outs: list[PageView]
    try:
        outs = [byte_view(v) for v in views]  # the common case: one buffer per page (a list is refused here)
    except (TypeError, InvalidInput):  # segments, strided arrays, or a bad view (refused again below)
        outs = [_segments(v, byte_view) if type(v) in _SEGMENTED else _one(v, page_view) for v in views]
    if layout is not None:
        want = layout.bytes_per_page  # a property: computed once, not per view
        if any(len(out) != want for out in outs):
            raise InvalidInput(f"get_into needs out views of {want} bytes (a page of layout {layout.describe()}), "
                               f"got {sorted({len(o) for o in outs})}")
    return outs


def put_views(layout: KVLayout | None, hashes: Sequence[bytes], pages: Sequence[Any],
              origins: Sequence[PageOrigin], chain_key: bytes | None = None) -> list[PageView]:
    """`put`'s argument checks, the same for every backend: a handle with a layout, one page (a buffer, a list of
    segments: returned as `Segments`, or an array contiguous in its innermost axis only: `Strided`) and one origin per valid page hash, each page of the layout's size, and
    each hash what its origin names: H(parent || tokens) for a token page, `engine_page_hash` of its key under
    its namespace root (keyed by `chain_key`, the store's) for an engine page; and no token page whose parent in
    the same batch is in another namespace (InvalidInput otherwise). Returns the pages' bytes."""
    if layout is None:
        raise InvalidInput("put needs a layout: open the store with layout=...")
    if not (len(hashes) == len(pages) == len(origins)):
        raise InvalidInput(f"put needs as many pages and origins as hashes: {len(hashes)} hashes, "
                           f"{len(pages)} pages, {len(origins)} origins")
    check_page_hashes(hashes)
    nbytes, step = layout.bytes_per_page, layout.page_size * TOKEN_BYTES
    views: list[PageView] = []
    engine_roots: dict[NamespaceId, PageHash] = {}  # namespace id -> its root under `layout`, for engine pages
    for h, page, origin in zip(hashes, pages, origins, strict=True):
        mv = page_source(page) if type(page) not in _SEGMENTED else _segments(page, page_bytes)
        if len(mv) != nbytes:
            raise InvalidInput(f"page {h.hex()} has {len(mv)} bytes, layout {layout.describe()} needs {nbytes}")
        if origin.key:
            _check_engine_origin(h, origin, layout, chain_key, engine_roots)
        elif len(origin.tokens) != step:
            raise InvalidInput(f"page {h.hex()}: {len(origin.tokens)} token bytes, a page holds {step}")
        elif extend_chain(origin.parent, origin.tokens, layout.page_size)[0] != h:
            raise InvalidInput(f"page {h.hex()} is not the hash of its parent and tokens in this origin")
        views.append(mv)
    batch_ns = {h: o.namespace.id for h, o in zip(hashes, origins, strict=True)}
    for h, origin in zip(hashes, origins, strict=True):
        up = batch_ns.get(origin.parent)
        if up is not None and up != origin.namespace.id and not origin.key:
            # an engine page's parent is a link, never part of its hash: under a wrong one it hangs from its root
            raise InvalidInput(f"page {h.hex()}: its parent in this batch is in another namespace than "
                               f"{origin.namespace.label}")
    return views


def _check_engine_origin(h: bytes, origin: PageOrigin, layout: KVLayout, chain_key: bytes | None,
                         roots: dict[NamespaceId, PageHash]) -> None:
    """An engine page's origin: a key of 1..ENGINE_KEY_MAX bytes, no tokens, a 16-byte parent, and `h` the hash
    of the key under its namespace root (`roots` caches the roots per namespace)."""
    if type(origin.key) is not bytes or len(origin.key) > ENGINE_KEY_MAX:
        raise InvalidInput(f"page {h.hex()}: an engine key is 1..{ENGINE_KEY_MAX} bytes, got {origin.key!r:.80}")
    if origin.tokens:
        raise InvalidInput(f"page {h.hex()}: an engine page (a key) has no tokens, got {len(origin.tokens)} bytes")
    if type(origin.parent) is not bytes or len(origin.parent) != PAGE_HASH_BYTES:
        raise InvalidInput(f"page {h.hex()}: a parent is a {PAGE_HASH_BYTES}-byte page hash, got "
                           f"{origin.parent!r:.60}")
    if chain_key is None:
        raise InvalidInput("an engine page needs the store's chain key to check its hash: this handle has none")
    ns = origin.namespace
    root = roots.get(ns.id)
    if root is None:
        root = roots[ns.id] = hash_root(layout.layout_id, ns, chain_key)
    if engine_page_hash(root, origin.key) != h:
        raise InvalidInput(f"page {h.hex()} is not the hash of its engine key under the root of namespace "
                           f"{ns.label} and layout {layout.describe()}")


def layout_to_register(location: str, layout: KVLayout, held: dict[bytes, LayoutRecord], register: bool) -> bool:
    """Opening a handle with `layout`: whether the store must register it now (False: it holds it already).
    LayoutMismatch, naming the layouts held, when it does not hold it and `register` is off."""
    if layout.layout_id in held:
        return False
    if not register:
        raise LayoutMismatch(location, layout.describe(), [r.layout.describe() for r in held.values()])
    return True


def namespace_root(namespace: Namespace, layout: KVLayout | None, chain_key: bytes | None, location: str) -> PageHash:
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
    pass `tensor.numpy()` rows). A non-contiguous array is refused here (`page_view` takes it whole)."""
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


def page_view(view: Any) -> memoryview | Strided:
    """For backends' `get_into`: `byte_view` of one page buffer, or, for a writable array (or CPU tensor) that is
    not contiguous but whose innermost axis is, that array as `Strided` (InvalidInput for a page strided in its
    innermost axis)."""
    strided = _strided(view)
    if strided is None:
        return byte_view(view)
    if not strided.array.flags.writeable:
        raise InvalidInput("page views must be writable")
    return strided


def _strided(page: Any) -> Strided | None:
    """A non-contiguous numpy array or CPU tensor whose innermost axis is contiguous, as `Strided` over a uint8
    view of its memory; None for anything else (contiguous, a scattered innermost axis, not an array, on a
    device), which the contiguous path takes or refuses."""
    if type(page) is not np.ndarray:
        if not (hasattr(page, "numpy") and hasattr(page, "device") and hasattr(page, "is_contiguous")) or (
                page.device.type != "cpu" or page.is_contiguous()):
            return None
        page = page.detach().numpy()
    if page.ndim < 2 or page.flags.c_contiguous or page.strides[-1] != page.itemsize:
        return None
    return Strided(page.view(np.uint8))


def _segments(page: Any, view: Any) -> Segments | memoryview:
    """A list/tuple page as `Segments` of `view`'s (byte_view or page_bytes) views; one segment is that view."""
    if not page:
        raise InvalidInput("a page given as segments needs at least one segment")
    views = tuple(_one(v, view) for v in page)
    return views[0] if len(views) == 1 else Segments(views)


def _one(buffer: Any, view: Any) -> memoryview:
    """`view(buffer)`, with InvalidInput for an object that is no buffer (a list inside a list, a number)."""
    if type(buffer) in _SEGMENTED:
        raise InvalidInput("a page's segments must be buffers, not lists")
    try:
        return view(buffer)
    except TypeError:
        raise InvalidInput(f"a page must be a buffer (numpy, a CPU tensor, bytes...) or a list of buffers, got "
                           f"{type(buffer).__name__}") from None


def page_bytes(page: Any) -> memoryview:
    """For backends' `put`: a flat byte memoryview of a page to write (numpy array, CPU torch tensor, bytes)."""
    if not isinstance(page, (bytes, bytearray, memoryview)) and hasattr(page, "numpy") and hasattr(page, "device"):
        page = page.detach().cpu().numpy()
    mv = memoryview(page)
    if not mv.c_contiguous:
        raise InvalidInput("pages must be contiguous (one page is one span)")
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def page_source(page: Any) -> memoryview | Strided:
    """For backends' `put`: `page_bytes` of one page, or, for an array (or CPU tensor) that is not contiguous but
    whose innermost axis is, that array as `Strided` (InvalidInput for a page strided in its innermost axis)."""
    strided = _strided(page)
    return page_bytes(page) if strided is None else strided
