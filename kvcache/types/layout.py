"""KVLayout: the shape and identity of the KV a cache holds.

A layout names the model that produced the KV (`model`: name + revision) and its geometry. Its `layout_id`
is folded into the root of every page hash chain, so KV written under one model, dtype or page size can never be
read back under another, in any tier.
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


class KVLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Model identity and KV geometry. K and V of every layer are stored token-major: one token is
    `bytes_per_token` contiguous bytes, one page is `page_size` consecutive tokens."""

    model: str  # model name + revision, e.g. "llama-3-8b@a1b2c3"; part of the identity, not just a label
    layers: int  # transformer layers, >= 1
    kv_heads: int  # KV heads per layer, >= 1
    head_dim: int  # elements per head, >= 1
    dtype: str  # a key of DTYPE_BYTES
    page_size: int  # tokens per page, >= 1; the unit of allocation, L2/L3 movement and page hashes

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise InvalidLayout("model must be a non-empty string (model name + revision)")
        for name in ("layers", "kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidLayout(f"{name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPE_BYTES:
            raise InvalidLayout(f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer for one token, in bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_page(self) -> int:
        """One page (`page_size` tokens) in bytes: one contiguous span in L2, one value in L3."""
        return self.bytes_per_token * self.page_size

    @property
    def layout_id(self) -> bytes:
        """16-byte digest of every field: two layouts share it only when they are the same layout."""
        return hashlib.blake2b(msgspec.msgpack.encode(self), digest_size=16, person=b"kvc.layout.v1").digest()

    def describe(self) -> str:
        """One line naming the layout, for error messages and listings."""
        return (f"{self.model} layers={self.layers} kv_heads={self.kv_heads} head_dim={self.head_dim} "
                f"dtype={self.dtype} page_size={self.page_size}")
