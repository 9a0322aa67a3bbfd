"""SGLang's host KV pools as kvc sees them: the `KVLayout` of the pages they hold, and each page as one strided view
into the pool's own memory (K's rows then V's, `kv_buffer[:, :, start:end]` for `layer_first`), or a segment list
where the pool's buffers are not one (what the store copies to and from, with no bounce buffer).

SGLang (0.5.23) keeps the host tier in one of a few buffer layouts (`HostKVCache.layout`); a page is the
`page_size` tokens starting at a page-aligned host index. The bytes of a page, as kvc stores them, are those of
SGLang's own flat data page (`get_data_page(index, flat=True)`) for every layout below, so a page written through
the generic interface reads back through the zero-copy one and the other way round:

| pool layout         | MHA buffer (K, V each)    | MLA buffer (one latent)      | arrangement | segments per page |
|---------------------|---------------------------|------------------------------|-------------|-------------------|
| `layer_first`       | (layers, tokens, H, D)    | (layers, tokens, 1, D)       | kv_layer    | 2·layers / layers |
| `page_first`        | (tokens, layers, H, D)    | (tokens, layers, 1, D)       | kv_token    | 2 / 1             |
| `page_first_direct` | (pages, layers, P, H, D)  | (pages, layers, P, 1, D)     | kv_layer    | 2 / 1             |

(`page_first_direct` keeps a page's tokens layer by layer, so its bytes are `kv_layer`'s, not `kv_token`'s.)
Other layouts (`page_head`, `page_unified`, `page_first_kv_split`) interleave heads or split buffers in ways no kvc
arrangement names: registering such a pool raises EngineUnsupported.

Nothing here imports SGLang or torch at module level: a pool is read through the attributes SGLang's pools have
(`layout`, `page_size`, `size`, `dtype`, `layer_num`, `head_num`, `head_dim`, `v_head_dim`, `k_buffer`,
`v_buffer`, `kv_buffer`, `kv_cache_dim`), whatever class it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from ..errors import EngineUnsupported
from ..types.layout import DTYPE_BYTES, KVLayout, Shard

ENGINE = "SGLang HiCache"
KV_POOL = "kv"  # SGLang's PoolName.KV: the host pool of the KV itself, the one pool kvc holds


class Refusal(msgspec.Struct, frozen=True):
    """Host indices that do not name whole pages of the pool, and why (never the indices themselves)."""

    reason: str


class PoolForm(msgspec.Struct, frozen=True):
    """How one SGLang host-pool layout holds a page (a row of POOL_FORMS)."""

    arrangement: str  # the kvc KVLayout.arrangement of its pages' bytes
    per_layer: bool  # a page is one span per layer of each buffer (True) or one span of each buffer (False)


# SGLang host-pool layout -> how it holds a page. The table is the list of layouts the adapter supports.
POOL_FORMS: dict[str, PoolForm] = {
    "layer_first": PoolForm("kv_layer", per_layer=True),
    "page_first": PoolForm("kv_token", per_layer=False),
    "page_first_direct": PoolForm("kv_layer", per_layer=False),
}


def dtype_name(dtype: Any) -> str:
    """The kvc dtype name (a key of DTYPE_BYTES) of a torch dtype; EngineUnsupported for one kvc has not."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise EngineUnsupported(ENGINE, f"a host pool of dtype {name}")
    return name


def _byte_rows(tensor: Any, rows: int, what: str) -> np.ndarray:
    """A CPU, contiguous pool tensor as a (rows, bytes) uint8 numpy array sharing its memory."""
    import torch  # here: torch is a kvc dependency, but this module must import without paying for it

    if tensor.device.type != "cpu":
        raise EngineUnsupported(ENGINE, f"a host pool whose {what} buffer is on {tensor.device}")
    if not tensor.is_contiguous():
        raise EngineUnsupported(ENGINE, f"a host pool whose {what} buffer is not contiguous")
    raw = tensor if tensor.dtype == torch.uint8 else tensor.view(torch.uint8)
    return raw.numpy().reshape(rows, -1)


class HostPages:
    """The pages of one registered SGLang host pool: its `KVLayout` and, per page, the view into the pool's memory
    that the store reads into or writes from (one strided array, or a segment list). Immutable after construction;
    `segments` may be called from any thread (it only slices)."""

    def __init__(self, pool: Any, model: str, mla: bool, shard: Shard | None) -> None:
        layout_name = str(getattr(pool, "layout", ""))
        form = POOL_FORMS.get(layout_name)
        if form is None:
            raise EngineUnsupported(ENGINE, f"host pool layout {layout_name!r} (supported: {', '.join(POOL_FORMS)})")
        self.form = form
        self.page_size = int(pool.page_size)  # tokens per page
        self.tokens = int(pool.size)  # host slots (tokens) the pool holds
        layers = int(pool.layer_num)
        dtype = dtype_name(pool.dtype)
        if mla:
            width = int(pool.kv_cache_dim)  # the latent's elements per token per layer
            self.layout = KVLayout(model=model, layers=layers, kv_heads=1, head_dim=width, dtype=dtype,
                                   page_size=self.page_size, mla=True, arrangement=form.arrangement, shard=shard)
            sides = [pool.kv_buffer]
        else:
            heads, k_dim = int(pool.head_num), int(pool.head_dim)
            v_dim = int(getattr(pool, "v_head_dim", k_dim) or k_dim)
            self.layout = KVLayout(model=model, layers=layers, kv_heads=heads, head_dim=k_dim, dtype=dtype,
                                   page_size=self.page_size, v_head_dim=0 if v_dim == k_dim else v_dim,
                                   arrangement=form.arrangement, shard=shard)
            sides = [pool.k_buffer, pool.v_buffer]
        rows = layers if form.per_layer else 1
        # each buffer as (rows, bytes): one row per layer (per_layer) or the whole buffer in one row
        self._sides = [_byte_rows(t, rows, name) for t, name in zip(sides, ("K", "V") if not mla else ("latent",),
                                                                     strict=True)]
        # bytes of one token in one row of each buffer: a page is [start * stride, (start + page_size) * stride)
        self._strides = [side.shape[1] // self.tokens for side in self._sides]
        if sum(self._strides) * rows * self.page_size != self.layout.bytes_per_page or any(
                side.shape[1] != stride * self.tokens for side, stride in zip(self._sides, self._strides, strict=True)):
            raise EngineUnsupported(ENGINE, f"a {layout_name} host pool whose buffers do not hold "
                                            f"{self.layout.bytes_per_page} bytes per page of {self.layout.describe()}")
        self._whole = _whole(pool, self._sides, mla)
        self._stride = self._strides[0]  # bytes of one token in one row (the same in every side when _whole is set)

    def page(self, start: int) -> Any:
        """The page starting at host slot `start` as the store copies it: one view into the pool (all its rows,
        K's then V's, in the page's byte order; the store copies it with one np.copyto) when the pool's sides
        are one buffer, else `segments`."""
        if self._whole is None:
            return self.segments(start)
        return self._whole[:, :, start * self._stride:(start + self.page_size) * self._stride]

    def page_starts(self, host_indices: Any, pages: int, distinct: bool = False) -> list[int] | Refusal:
        """The first host slot of each of `pages` pages named by SGLang's `host_indices`: one slot per token, each
        page a run of page_size consecutive slots from a page-aligned start inside the pool (as SGLang's host pool
        allocates them). A Refusal saying why when they are not: every slot is checked, since a page is copied to
        or from its whole run, and a slot the caller did not name must never be read into or written from.
        `distinct`: two pages naming the same run are refused too (a read would land both in one place)."""
        ps = self.page_size
        try:
            slots = np.asarray(host_indices)  # a CPU tensor (SGLang's) or an array: no copy
        except (TypeError, RuntimeError, ValueError):  # a tensor on a device, or a sequence numpy cannot take
            slots = np.asarray(host_indices.tolist() if hasattr(host_indices, "tolist") else list(host_indices))
        if slots.ndim != 1 or slots.size != pages * ps:
            return Refusal(f"{slots.size} host slots for {pages} pages of {ps} tokens")
        if slots.dtype.kind not in "iu":
            return Refusal(f"host indices of {slots.dtype} values, not integers")
        runs = slots.reshape(pages, ps)
        starts = runs[:, 0]
        if (starts < 0).any() or (starts > self.tokens - ps).any():
            return Refusal(f"a page outside the pool's {self.tokens} host slots")
        if (starts % ps).any():
            return Refusal(f"a page that does not start at a multiple of the page size {ps}")
        if ps > 1 and (runs != starts[:, None] + np.arange(ps)).any():
            return Refusal(f"a page whose {ps} host slots are not consecutive")
        if distinct and np.unique(starts).size != pages:
            return Refusal("two pages of one read into the same host slots")
        return [int(s) for s in starts]

    def segments(self, start: int) -> list[np.ndarray]:
        """The page starting at host slot `start` as views into the pool, in the page's byte order (K's rows,
        then V's; MLA: the latent's)."""
        end = start + self.page_size
        return [side[row, start * stride:end * stride]
                for side, stride in zip(self._sides, self._strides, strict=True) for row in range(side.shape[0])]

    def pages(self, starts: Sequence[int]) -> list[Any]:
        """`page` of each start."""
        whole = self._whole
        if whole is None:
            return [self.segments(s) for s in starts]
        stride, span = self._stride, self.page_size * self._stride
        return [whole[:, :, s * stride:s * stride + span] for s in starts]


def _whole(pool: Any, sides: list[np.ndarray], mla: bool) -> np.ndarray | None:
    """The pool's sides (each (rows, bytes)) as one (sides, rows, bytes) uint8 array sharing their memory, when
    they are one buffer: MLA's latent, or SGLang's `kv_buffer` whose [0] and [1] are K and V (every MHA host pool
    of SGLang 0.5.23). None otherwise (the pages are then segment lists)."""
    if mla:
        return sides[0][None]
    k, v = sides
    buffer = getattr(pool, "kv_buffer", None)
    if buffer is None or k.shape != v.shape or not buffer.is_contiguous() or buffer.device.type != "cpu":
        return None
    whole = _byte_rows(buffer, 2 * k.shape[0], "KV").reshape(2, *k.shape)
    same = whole[0].ctypes.data == k.ctypes.data and whole[1].ctypes.data == v.ctypes.data
    return whole if same else None
