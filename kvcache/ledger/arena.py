"""SpanArena: a page's spans, over however many tensors, as rows of one view, so one index moves whole pages.

An engine's layer-first KV is 64 tensors for 32 layers (`kv.KVPages.layer_first`); moved span by span, a copy makes
two kernel launches a span, and the calling thread's time grows with the layers. On one device, though, the tensors
share an address space. A view from the lowest span's first byte to the highest span's last byte (the *arena*)
holds them all: cut into rows of ``row_bytes`` (the greatest common divisor of the spans' widths and of their
distances from the lowest one), a page of every span is ``rows_per_page`` rows of it, row k of page p sitting at
``offsets[k] + p * strides[k]``. One `index_select` over those rows gathers whole pages of every span, in page byte
order, and one `index_copy_` scatters them: two launches a copy, whatever the number of layers.

The arena view also covers the bytes between the spans (other allocations, the engine's own); only rows of the
spans are ever indexed, so nothing outside them is read or written. A single span needs no such view: it is its
own arena, one row a page.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ..errors import InvalidConfig
from .kv import KVPages

# A uint8 tensor over `nbytes` bytes at address `ptr` on the spans' device, sharing their memory (no copy).
AddressView = Callable[[int, int], torch.Tensor]

_ELEMENTS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


class SpanArena:
    """Consecutive spans of a page (`views`, ``[num_pages, width]`` uint8 each, contiguous, one device) as rows of
    one view. `gather` and `scatter` move whole pages of them, as ``[pages, bytes]`` of the widest integer element
    the layout allows (`dtype`)."""

    def __init__(self, views: Sequence[torch.Tensor], address_view: AddressView, align: int) -> None:
        """`address_view` makes the view over the spans when there are several. `align`: bytes the element size
        must also divide (the other side of a copy: its column offset and row stride)."""
        if not views:
            raise InvalidConfig("an arena needs at least one span")
        for v in views:
            if v.dtype != torch.uint8 or v.dim() != 2 or not v.is_contiguous() or v.device != views[0].device:
                raise InvalidConfig("an arena's spans are contiguous [num_pages, width] uint8 views on one device")
        self.owners = list(views)  # the spans: held so that their memory lives as long as the arena's view
        self.page_bytes = sum(int(v.shape[1]) for v in views)  # bytes of a page the arena covers, in span order
        base = min(v.data_ptr() for v in views)
        end = max(v.data_ptr() + v.numel() for v in views)
        row_bytes = 0
        for v in views:
            row_bytes = math.gcd(row_bytes, int(v.shape[1]), v.data_ptr() - base)
        size, self.dtype = next((s, d) for s, d in _ELEMENTS
                                if row_bytes % s == 0 and base % s == 0 and align % s == 0)
        self.row_bytes = row_bytes  # bytes of a row; divides every span's width and distance from the lowest
        self.rows_per_page = self.page_bytes // row_bytes
        arena = views[0] if len(views) == 1 else address_view(base, end - base)
        if arena.data_ptr() != base:
            raise InvalidConfig(f"the view over an arena starts at {arena.data_ptr():#x}, its spans at {base:#x}")
        self.rows = arena.view(-1).view(self.dtype).view(-1, row_bytes // size)  # [arena rows, elements a row]
        offsets: list[int] = []
        strides: list[int] = []
        for v in views:
            width_rows = int(v.shape[1]) // row_bytes
            first = (v.data_ptr() - base) // row_bytes
            offsets.extend(range(first, first + width_rows))
            strides.extend([width_rows] * width_rows)
        # row k of page p is offsets[k] + p * strides[k]; None where that is p itself (one span, one row a page)
        self._offsets: torch.Tensor | None = None
        self._strides: torch.Tensor | None = None
        if not (offsets == [0] and strides == [1]):
            self._offsets = torch.tensor(offsets, dtype=torch.int64, device=arena.device)
            self._strides = torch.tensor(strides, dtype=torch.int64, device=arena.device)

    def rows_of(self, pages: torch.Tensor) -> torch.Tensor:
        """The arena rows of `pages` (int64, on the arena's device), page by page in page byte order."""
        if self._offsets is None or self._strides is None:
            return pages
        return (pages[:, None] * self._strides).add_(self._offsets).view(-1)

    def gather(self, pages: torch.Tensor) -> torch.Tensor:
        """`pages` of every span, as ``[len(pages), page_bytes / element size]`` (a new tensor)."""
        return self.rows.index_select(0, self.rows_of(pages)).view(len(pages), -1)

    def scatter(self, pages: torch.Tensor, values: torch.Tensor) -> None:
        """Write `values` (``[len(pages), page_bytes / element size]`` of `dtype`) into `pages` of every span."""
        self.rows.index_copy_(0, self.rows_of(pages), values.reshape(-1, self.rows.shape[1]))


def arenas(kv: KVPages, address_view: AddressView) -> list[tuple[int, SpanArena]]:
    """`kv`'s spans as arenas, each with the first byte of a page it covers: one arena over them all (two launches a
    copy), or one a span where `address_view` refuses a view over the memory between them."""
    try:
        return [(0, SpanArena(kv.views, address_view, kv.page_bytes))]
    except (RuntimeError, TypeError, ValueError, InvalidConfig):
        return [(s.offset, SpanArena([v], address_view, math.gcd(s.offset, kv.page_bytes)))
                for v, s in zip(kv.views, kv.spans, strict=True)]
