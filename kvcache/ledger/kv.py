"""KVPages: the bytes of a pool's pages, in kvc's own tensor or in tensors an engine owns.

A page is `page_bytes` bytes. Where they sit is a list of *spans*: uint8 views ``[num_pages, width]`` (row p is
this span's part of page p) whose widths, in order, add up to a page. The page's bytes in L2 and L3 are the spans'
rows one after another, so every copy pairs spans by their byte range within a page and moves each pair with one
gather and one scatter, whatever the number of pages.

- kvc's own pool (`KVPages.own`): one token-major tensor ``[slots, bytes_per_token]``, one span as wide as a page.
- An engine's own KV (`KVPages.layer_first`): per layer a K tensor and a V tensor ``[slots, kv_heads, head_dim]``
  (SGLang's MHA pool, vLLM's kv_caches; any dtype), or one latent tensor ``[slots, ..., dim]`` per layer (MLA).
  Each tensor is one span, page p being its slots p*page_size .. (p+1)*page_size - 1: a page in L2 is K layer by
  layer, then V layer by layer (the `kv_layer` arrangement of `KVLayout`; MLA: the latents layer by layer). kvc
  reads and writes those tensors only through its copies, and only pages the ledger says it holds; it never
  allocates, resizes or frees them.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import torch

from ..errors import InvalidConfig


class KVSpan(msgspec.Struct, frozen=True):
    """Where a span's part of a page sits within the page's bytes."""

    offset: int  # bytes from the start of a page, >= 0
    width: int  # bytes of each page in this span, >= 1


class KVPages:
    """The bytes of `num_pages` pages of `page_bytes` each, as spans over one or more tensors on one device."""

    def __init__(self, spans: Sequence[torch.Tensor], arrangement: str, owned: bool) -> None:
        if not spans:
            raise InvalidConfig("a pool's KV needs at least one tensor")
        first = spans[0]
        for s in spans:
            if s.dtype != torch.uint8 or s.dim() != 2 or s.shape[0] != first.shape[0] or s.device != first.device:
                raise InvalidConfig("every span of a pool's KV is a [num_pages, width] uint8 view on one device")
        self.views = list(spans)  # [num_pages, width] uint8 each; rows are pages
        self.num_pages = int(first.shape[0])
        offsets, at = [], 0
        for s in spans:
            offsets.append(KVSpan(at, int(s.shape[1])))
            at += int(s.shape[1])
        self.spans = offsets  # each view's byte range within a page, in page order
        self.page_bytes = at
        self.arrangement = arrangement  # how `KVLayout` names the order of a page's bytes: "token" or "kv_layer"
        self.owned = owned  # True: kvc allocated the tensor (its own pool); False: an engine's tensors
        self.device = first.device

    @classmethod
    def own(cls, num_pages: int, page_size: int, bytes_per_token: int, device: str | torch.device = "cpu",
            pin_memory: bool = False) -> KVPages:
        """kvc's own token-major pool: one ``[num_pages * page_size, bytes_per_token]`` uint8 tensor."""
        storage = torch.empty((num_pages * page_size, bytes_per_token), dtype=torch.uint8, device=device,
                              pin_memory=pin_memory and torch.device(device).type == "cpu")
        return cls([storage.view(num_pages, page_size * bytes_per_token)], "token", owned=True)

    @classmethod
    def layer_first(cls, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor] | None, page_size: int) -> KVPages:
        """An engine's KV: `k` (and `v`, None for MLA's one latent buffer per layer) one tensor per layer, first
        dimension the token slot. Page p is slots p*page_size .. (p+1)*page_size - 1 of every tensor; slots past
        the last whole page are left to the engine. The tensors must be contiguous (a view of their bytes is taken,
        never a copy)."""
        tensors = [*k, *(v or [])]
        if not k or (v is not None and len(v) != len(k)):
            raise InvalidConfig(f"layer-first KV needs one K tensor per layer and, unless MLA, as many V: got "
                                f"{len(k)} K and {len(v) if v is not None else 0} V")
        slots = int(tensors[0].shape[0])
        num_pages = slots // page_size
        views = []
        for i, t in enumerate(tensors):
            if not t.is_contiguous() or t.dim() < 1 or int(t.shape[0]) != slots:
                raise InvalidConfig(f"layer-first KV tensor {i}: shape {tuple(t.shape)}, contiguous="
                                    f"{t.is_contiguous()}; every tensor must be contiguous with {slots} slots first")
            flat = t.view(slots, -1)[: num_pages * page_size].view(torch.uint8)  # [slots, bytes a slot]
            views.append(flat.view(num_pages, page_size * int(flat.shape[1])))
        return cls(views, "kv_layer", owned=False)

    def pair(self, other: KVPages) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This KV's spans matched with `other`'s by byte range within a page: ``(self_view, other_view)`` pairs
        whose columns are the same bytes of a page. One side may be a single span (a host pool): it is cut to the
        other's spans. Two multi-span sides must have the same spans."""
        if self.page_bytes != other.page_bytes:
            raise InvalidConfig(f"a copy between pages of {self.page_bytes} and {other.page_bytes} bytes")
        if len(self.views) == 1 and len(other.views) > 1:
            return [(a, b) for b, a in other.pair(self)]
        if len(other.views) == 1:
            whole = other.views[0]
            return [(view, whole[:, s.offset: s.offset + s.width]) for view, s in zip(self.views, self.spans,
                                                                                      strict=True)]
        if self.spans != other.spans:
            raise InvalidConfig("a copy between two pools whose pages are cut into different spans")
        return list(zip(self.views, other.views, strict=True))

    def read(self, pages: np.ndarray) -> np.ndarray:
        """A copy of `pages` as ``[len(pages), page_bytes]`` uint8 on the host (checks and tests; not a hot path)."""
        index = torch.from_numpy(np.ascontiguousarray(pages, dtype=np.int64)).to(self.device)
        out = np.empty((len(pages), self.page_bytes), dtype=np.uint8)
        for view, span in zip(self.views, self.spans, strict=True):
            out[:, span.offset: span.offset + span.width] = view.index_select(0, index).cpu().numpy()
        return out

    def write(self, pages: np.ndarray, rows: np.ndarray) -> None:
        """Write ``rows`` (``[len(pages), page_bytes]`` uint8) into `pages` (tests and engines' stand-ins: kvc's own
        moves go through `copy_pages`), and wait until they have landed."""
        index = torch.from_numpy(np.ascontiguousarray(pages, dtype=np.int64)).to(self.device)
        data = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.uint8).reshape(len(pages), self.page_bytes))
        for view, span in zip(self.views, self.spans, strict=True):
            view.index_copy_(0, index, data[:, span.offset: span.offset + span.width].to(self.device))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
