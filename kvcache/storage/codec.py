"""How an L3 backend encodes what it stores: the page value, its checksum, the format record and the metadata.

Every backend stores a page's bytes as one value, ``[u64 checksum, little-endian][payload]``, so the checksum
travels with the bytes and a page can be verified without its metadata; the metadata is a msgpack `PageMeta`.
The checksum is seeded by the page hash, so a payload filed under the wrong key fails too. A store records its
checksum algorithm in its format record and is always read with the algorithm it was written with.

Checksums are xxh3-64 when the ``xxhash`` package is installed (~45 GB/s on cached data) and zlib's crc32
otherwise (~2.5 GB/s: the checked read path then runs at about half the speed).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec
import numpy as np

from ..types.ids import PageHash
from ..types.keys import ENGINE_KEY_MAX, PAGE_HASH_BYTES, TOKEN_BYTES, engine_page_hash, extend_chain
from .api import LayoutRecord, NamespaceRecord, PageMeta

FORMAT_MAGIC = "kvc-store"
# 2: page-hash chain roots are keyed by the store's secret (kvcache.types.keys); a format-1 store's roots are
# unkeyed: it is read and written as before, and `kvc migrate` rewrites it (every page hash changes).
FORMAT_VERSION = 2
KEYED_ROOTS_VERSION = 2  # the first format whose chain roots are keyed

CHECKSUM_FIELD = struct.Struct("<Q")  # the checksum before the payload in a stored page value
HEADER = CHECKSUM_FIELD.size


class Checksum(msgspec.Struct, frozen=True):
    """A checksum algorithm: `digest(payload, seed)`, seeded with the first `seed_bytes` of the page hash
    (little-endian) so a payload filed under the wrong key fails too; `digest_parts(parts, seed)` is the digest
    of the parts concatenated, taken part by part (a page held as segments is never joined to be summed)."""

    digest: Callable[[Any, int], int]
    seed_bytes: int  # 4 or 8
    digest_parts: Callable[[Sequence[Any], int], int]

    def of(self, payload: Any, page_hash: bytes) -> int:
        """The checksum of `payload` stored under `page_hash`."""
        return self.digest(payload, int.from_bytes(page_hash[:self.seed_bytes], "little"))

    def of_parts(self, parts: Sequence[Any], page_hash: bytes) -> int:
        """The checksum of `parts` concatenated, stored under `page_hash` (= `of` of the joined bytes)."""
        return self.digest_parts(parts, int.from_bytes(page_hash[:self.seed_bytes], "little"))

    def seeds(self, hashes: Sequence[bytes]) -> list[int]:
        """The seeds of a batch of page hashes, in one vectorised step (the read loop then makes one call)."""
        words = np.frombuffer(b"".join(hashes), dtype=f"<u{self.seed_bytes}")
        seeds: list[int] = words[::PAGE_HASH_BYTES // self.seed_bytes].tolist()
        return seeds

    def sound(self, value: Any, page_hash: bytes) -> bool:
        """Whether a stored page value holds a checksum and a payload that matches it."""
        return (len(value) >= HEADER
                and self.of(memoryview(value)[HEADER:], page_hash) == CHECKSUM_FIELD.unpack_from(value)[0])


def _crc32_parts(parts: Sequence[Any], seed: int) -> int:
    """crc32 of the parts concatenated: each part's crc continues from the previous one's."""
    for part in parts:
        seed = zlib.crc32(part, seed)
    return seed


# Checksum name -> algorithm. The name is recorded in the store; a store is read with the one it was written with.
CHECKSUMS: dict[str, Checksum] = {"crc32": Checksum(zlib.crc32, 4, _crc32_parts)}
try:  # xxh3 runs ~8x faster than zlib's crc32 here: it is what keeps the checked read path near memcpy speed
    import xxhash
except ImportError:  # pragma: no cover - depends on the install
    pass
else:
    def _xxh3_parts(parts: Sequence[Any], seed: int) -> int:
        """xxh3-64 of the parts concatenated, streamed part by part."""
        state = xxhash.xxh3_64(seed=seed)
        for part in parts:
            state.update(part)
        return state.intdigest()

    CHECKSUMS["xxh3_64"] = Checksum(xxhash.xxh3_64_intdigest, 8, _xxh3_parts)
DEFAULT_CHECKSUM = "xxh3_64" if "xxh3_64" in CHECKSUMS else "crc32"


def stored_checksum(value: Any) -> int:
    """The checksum recorded at the head of a stored page value (at least HEADER bytes)."""
    checksum: int = CHECKSUM_FIELD.unpack_from(value)[0]
    return checksum


class StoreFormat(msgspec.Struct, frozen=True, omit_defaults=True):
    """The record that makes a location a kvc store (an LMDB environment, a Redis key prefix)."""

    magic: str  # FORMAT_MAGIC
    version: int  # FORMAT_VERSION of the writer that created it
    checksum: str  # a key of CHECKSUMS
    created: float  # unix seconds
    # hex: the key of the salt fingerprints the store records (kvcache.types.namespace), where the store keeps it in
    # this record (Redis); "" where it does not (LMDB: a key file)
    fingerprint_key: str = ""
    # hex: the key of the page-hash chain roots (kvcache.types.keys), where the store keeps it in this record (a
    # shared store: Redis); "" where it does not (LMDB derives it from its key file) or has none (format 1)
    chain_key: str = ""

    @property
    def keyed_roots(self) -> bool:
        """Whether the store's chain roots are keyed (format 2 on); a format-1 store's are not."""
        return self.version >= KEYED_ROOTS_VERSION


encoder = msgspec.msgpack.Encoder()
decode_meta = msgspec.msgpack.Decoder(PageMeta).decode
decode_namespace = msgspec.msgpack.Decoder(NamespaceRecord).decode
decode_layout = msgspec.msgpack.Decoder(LayoutRecord).decode
decode_format = msgspec.msgpack.Decoder(StoreFormat).decode


def decode_or_none(decode: Callable[[Any], Any], raw: Any) -> Any:
    """A record decoded by `decode`, or None when its bytes are damaged."""
    try:
        return decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def chains_to(page_hash: bytes, meta: PageMeta) -> bool:
    """Whether `page_hash` is H(parent || tokens) of its metadata: the chain step of kvcache.types.keys. Never
    for an engine page (no tokens): its hash is its key's under its root (`engine_keyed`)."""
    n = len(meta.tokens) // TOKEN_BYTES
    return n > 0 and n * TOKEN_BYTES == len(meta.tokens) and extend_chain(meta.parent, meta.tokens, n) == [page_hash]


def engine_keyed(page_hash: bytes, meta: PageMeta, roots: Iterable[PageHash]) -> bool:
    """Whether `page_hash` is the hash of its metadata's engine key under one of `roots` (its namespace/layout
    root; several when it is known only as one of its namespace's recorded roots): an engine page's hash check.
    False for a key no engine page can have (empty, too long) or tokens beside it (damaged metadata)."""
    key = meta.key
    if type(key) is not bytes or not 0 < len(key) <= ENGINE_KEY_MAX or meta.tokens:
        return False
    return any(engine_page_hash(root, key) == page_hash for root in roots)
