"""KVLayout: the shape and identity of the KV a cache holds.

A layout names the model that produced the KV (`model`: name + revision) and its geometry. Its `layout_id`
is folded into the root of every page hash chain, so KV written under one model, dtype or page size can never be
read back under another, in any tier.

What an engine's own host pages need is part of the layout too: MLA (one latent vector per token), K and V of
different widths, the byte order of a page (`arrangement`, a key of ARRANGEMENTS) and the shard of the model the
KV comes from (`Shard`: two tensor-parallel ranks hold different heads, so they must never read each other's
pages). Every such field has a default and defaults are left out of the encoding a `layout_id` digests
(`omit_defaults`), so a layout that uses none of them keeps the id it always had, bit for bit.

Some engines hand over pages whose inner geometry they keep to themselves (vLLM's offload chunks: every worker's
blocks of a chunk, in vLLM's order, with alignment padding). Such a page is opaque (an arrangement of OPAQUE): its
size is `page_bytes`, heads and head width are not named (1), and what tells one deployment's pages from another's
beyond model, dtype, layers and page size is the engine's own run configuration (`engine_config`).
"""

from __future__ import annotations

import hashlib

import msgspec

from ..errors import InvalidLayout

# dtype name -> bytes per element. The table is the list of dtypes kvcache accepts.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


# arrangement -> how a page's bytes are ordered. kvc's own pools use "token"; the others are engines' host pages.
ARRANGEMENTS: dict[str, str] = {
    "token": "token-major: each token's K then V of every layer (kvc's own pools); MLA: each token's latents",
    "kv_token": "the page's K token-major, then its V token-major (SGLang page_first host pools); MLA: the latents "
                "token-major",
    "kv_layer": "K layer by layer, then V layer by layer, each page_size tokens (SGLang layer_first); MLA: the "
                "latents layer by layer",
    "vllm_chunk": "one row of vLLM's CPU offload region: every worker's blocks of one chunk in vLLM's own order, its "
                  "alignment padding included (opaque to kvc: page_bytes long)",
}
# The arrangements whose pages kvc never looks inside: sized by `page_bytes`, no heads, no per-token geometry.
OPAQUE: frozenset[str] = frozenset({"vllm_chunk"})


def _check_count(name: str, value: object, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise InvalidLayout(f"{name} must be an integer >= {least}, got {value!r}")


class Shard(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Which part of a sharded model the KV comes from: its tensor-, pipeline- and context-parallel rank and size.
    Part of a layout's identity: two shards never share a layout_id, hence never a page."""

    tp_rank: int  # tensor-parallel rank, 0 <= tp_rank < tp_size
    tp_size: int  # tensor-parallel size, >= 1
    pp_rank: int = 0  # pipeline-parallel rank, 0 <= pp_rank < pp_size
    pp_size: int = 1
    cp_rank: int = 0  # context-parallel rank, 0 <= cp_rank < cp_size
    cp_size: int = 1

    def __post_init__(self) -> None:
        for axis in ("tp", "pp", "cp"):
            rank, size = getattr(self, f"{axis}_rank"), getattr(self, f"{axis}_size")
            _check_count(f"{axis}_size", size, 1)
            _check_count(f"{axis}_rank", rank, 0)
            if rank >= size:
                raise InvalidLayout(f"{axis}_rank must be below {axis}_size, got {rank} of {size}")

    def describe(self) -> str:
        """`tp=R/S` (and pp, cp when sharded), for listings."""
        parts = [f"tp={self.tp_rank}/{self.tp_size}"]
        parts += [f"{axis}={getattr(self, f'{axis}_rank')}/{getattr(self, f'{axis}_size')}" for axis in ("pp", "cp")
                  if getattr(self, f"{axis}_size") > 1]
        return " ".join(parts)


class KVLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Model identity and KV geometry. One page is `page_size` tokens, `bytes_per_page` contiguous bytes in the
    order `arrangement` names (kvc's own pools: token-major, one token `bytes_per_token` contiguous bytes).

    The fields after `page_size` describe engines' pages; their defaults are kvc's own pools, and a default is
    left out of the encoding, so a layout that keeps them has the `layout_id` it had before they existed."""

    model: str  # model name + revision, e.g. "llama-3-8b@a1b2c3"; part of the identity, not just a label
    layers: int  # transformer layers, >= 1
    kv_heads: int  # KV heads per layer, >= 1
    head_dim: int  # elements per head, >= 1
    dtype: str  # a key of DTYPE_BYTES
    page_size: int  # tokens per page, >= 1; the unit of allocation, L2/L3 movement and page hashes
    v_head_dim: int = 0  # elements per head of V when it differs from K's head_dim; 0 = the same as head_dim
    mla: bool = False  # one latent vector of head_dim elements per token per layer (MLA): kv_heads 1, no V width
    arrangement: str = "token"  # the byte order of a page: a key of ARRANGEMENTS
    shard: Shard | None = None  # the shard of the model the KV comes from; None = not sharded
    # bytes of one page of an OPAQUE arrangement (> 0 exactly then; kv_heads and head_dim are then 1); 0 = the size
    # follows from the geometry
    page_bytes: int = 0
    # an engine's run configuration beyond the fields above, as the engine's adapter names it (a readable summary
    # ending in a digest of all of it): part of the identity, so two deployments that differ in it never share a page
    engine_config: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise InvalidLayout("model must be a non-empty string (model name + revision)")
        for name in ("layers", "kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidLayout(f"{name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise InvalidLayout(f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        _check_count("v_head_dim", self.v_head_dim, 0)
        if not isinstance(self.mla, bool):
            raise InvalidLayout(f"mla must be a bool, got {self.mla!r}")
        if self.mla and (self.kv_heads != 1 or self.v_head_dim):
            raise InvalidLayout(f"an MLA layout has one latent per token: kv_heads must be 1 and v_head_dim 0, got "
                                f"kv_heads={self.kv_heads} v_head_dim={self.v_head_dim}")
        if self.arrangement not in ARRANGEMENTS:
            raise InvalidLayout(f"arrangement {self.arrangement!r} is not one of {', '.join(ARRANGEMENTS)}")
        if self.shard is not None and not isinstance(self.shard, Shard):
            raise InvalidLayout(f"shard must be a Shard or None, got {self.shard!r}")
        _check_count("page_bytes", self.page_bytes, 0)
        if (self.arrangement in OPAQUE) != (self.page_bytes > 0):
            raise InvalidLayout(f"page_bytes is the size of an opaque page ({', '.join(sorted(OPAQUE))}) and only "
                                f"of one: arrangement {self.arrangement!r} with page_bytes={self.page_bytes}")
        if self.page_bytes and (self.kv_heads != 1 or self.head_dim != 1 or self.mla or self.v_head_dim):
            raise InvalidLayout("an opaque page names no heads: kv_heads and head_dim must be 1, mla False and "
                                "v_head_dim 0")
        if not isinstance(self.engine_config, str):
            raise InvalidLayout(f"engine_config must be a string, got {self.engine_config!r}")

    @property
    def bytes_per_token(self) -> int:
        """K and V (MLA: the latent) of every layer for one token, in bytes. InvalidLayout for an opaque page: it has
        no per-token geometry, so no cache of kvc's own can hold it (only a store, page by page)."""
        if self.page_bytes:
            raise InvalidLayout(f"a page of arrangement {self.arrangement} is opaque: kvc's own tiers cannot hold "
                                f"it token by token ({self.model}, {self.page_bytes} bytes a page)")
        if self.mla:
            return self.layers * self.head_dim * DTYPE_BYTES[self.dtype]
        k_and_v = self.head_dim + (self.v_head_dim or self.head_dim)
        return self.layers * self.kv_heads * k_and_v * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_page(self) -> int:
        """One page (`page_size` tokens) in bytes: one contiguous span in L2, one value in L3."""
        return self.page_bytes or self.bytes_per_token * self.page_size

    @property
    def layout_id(self) -> bytes:
        """16-byte digest of every field: two layouts share it only when they are the same layout."""
        return hashlib.blake2b(msgspec.msgpack.encode(self), digest_size=16, person=b"kvc.layout.v1").digest()

    def describe(self) -> str:
        """One line naming the layout, for error messages and listings."""
        if self.page_bytes:
            return (f"{self.model} layers={self.layers} dtype={self.dtype} page_size={self.page_size} "
                    f"arrangement={self.arrangement} page_bytes={self.page_bytes}"
                    + (f" {self.engine_config}" if self.engine_config else ""))
        extra = (f" v_head_dim={self.v_head_dim}" * bool(self.v_head_dim) + " mla" * self.mla
                 + f" arrangement={self.arrangement}" * (self.arrangement != "token")
                 + (f" {self.shard.describe()}" if self.shard is not None else "")
                 + (f" {self.engine_config}" if self.engine_config else ""))
        return (f"{self.model} layers={self.layers} kv_heads={self.kv_heads} head_dim={self.head_dim} "
                f"dtype={self.dtype} page_size={self.page_size}{extra}")
