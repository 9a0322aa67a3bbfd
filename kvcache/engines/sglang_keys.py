"""SGLang 0.5.23's HiCache storage keys, recomputed without SGLang.

SGLang names every page it hands an L3 backend by an opaque 64-hex key: a SHA-256 chain over the prompt's pages,
seeded per namespace. Knowing how lets kvc say which of a prompt's pages an engine's store holds (`kvc ns probe
--engine sglang`) without SGLang installed. What SGLang does (`sglang.srt.mem_cache.utils`: `get_hash_str`,
`storage_namespace_seed`, `get_storage_hash_str`; the page loop in `mem_cache/cpp_utils/hash_binding.cpp`):

- the seed of a namespace is ``SHA-256("sglang-cache-namespace-v1" || part(extra_key) || part(cache_salt))``, where
  ``part(None) = 0x00`` and ``part(s) = 0x01 || len(utf8(s)) as 8 bytes little-endian || utf8(s)``; a request with
  neither (both None) has no seed: its chain starts from nothing;
- page i's key is ``k_i = SHA-256(k_{i-1} || tokens of page i)`` (``k_0`` = the seed, left out when there is
  none), the tokens packed as little-endian uint32 — or, when one of the page's tokens does not fit in 32 bits,
  a 0xff byte then all the page's tokens as little-endian uint64 (the odd length keeps the two apart);
- the last page may be short: SGLang's function hashes it as it is. Its storage never holds one (prefetch and
  write-through take whole pages only), so `storage_keys` stops at the last whole page.

Golden vectors written by SGLang's own functions (tests/goldens/sglang/make_sglang_keys.py) pin all of this.
Only plain token ids are covered: SGLang's EAGLE bigram keys and tuple tokens (multimodal) are not.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Sequence

import numpy as np

from ..errors import InvalidInput

KEY_BYTES = 32  # a SHA-256 digest: the raw form of SGLang's 64-hex key
_SEED_TAG = b"sglang-cache-namespace-v1"
_WIDE_TAG = b"\xff"  # before a page of uint64 tokens: an odd byte count that no uint32 page has
_U32_MAX = 2**32 - 1
_TOKEN_LIMIT = 2**63  # SGLang refuses a token id that is not a non-negative int64


def _part(value: str | None) -> bytes:
    if value is None:
        return b"\x00"
    raw = value.encode("utf-8")
    return b"\x01" + len(raw).to_bytes(8, "little") + raw


def storage_namespace_seed(extra_key: str | None, cache_salt: str | None) -> bytes | None:
    """The 32-byte seed of the storage chain of requests with this extra_key and cache_salt; None when both are
    None (SGLang's unnamespaced chain). ``""`` is not None here, as in SGLang: an empty extra_key is a namespace
    of its own (SGLang turns an empty cache_salt into None before it gets here)."""
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(_SEED_TAG)
    for part in (extra_key, cache_salt):
        digest.update(_part(part))
    return digest.digest()


def _checked(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """The token ids as uint64, InvalidInput when one is not in 0 .. 2**63 - 1 (SGLang's range)."""
    if isinstance(tokens, np.ndarray) and tokens.dtype.kind == "u":  # unsigned: only the upper bound to check
        arr = tokens.astype(np.uint64, copy=False)
        if arr.size and int(arr.max()) >= _TOKEN_LIMIT:
            raise InvalidInput("an SGLang token id is a non-negative int64")
        return arr
    try:  # operator.index: an integer, never a float truncated into one
        values = [operator.index(t) for t in tokens]
    except TypeError:
        raise InvalidInput("an SGLang token id is an integer") from None
    if any(not 0 <= t < _TOKEN_LIMIT for t in values):
        raise InvalidInput("an SGLang token id is a non-negative int64")
    return np.array(values, dtype=np.uint64)


def page_keys(tokens: Sequence[int] | np.ndarray, page_size: int, seed: bytes | None = None) -> list[bytes]:
    """The 32-byte key of every page of `tokens`, the last one possibly short, chained from `seed` (a
    `storage_namespace_seed`, None for none): what SGLang's ``get_hash_str(tokens, seed.hex(), page_size)``
    returns, as raw bytes."""
    if page_size < 1:
        raise InvalidInput(f"page_size={page_size} must be >= 1")
    if seed is not None and len(seed) != KEY_BYTES:
        raise InvalidInput(f"a seed is {KEY_BYTES} bytes, got {len(seed)}")
    arr = _checked(tokens)
    # the common case, every token within 32 bits, packs once and slices per page; else each page decides
    narrow = arr.astype("<u4").tobytes() if arr.size == 0 or int(arr.max()) <= _U32_MAX else None
    keys: list[bytes] = []
    prior = seed
    sha = hashlib.sha256
    for start in range(0, len(arr), page_size):
        h = sha(prior) if prior is not None else sha()
        if narrow is not None:
            h.update(narrow[4 * start:4 * (start + page_size)])
        else:
            page = arr[start:start + page_size]
            if int(page.max()) > _U32_MAX:
                h.update(_WIDE_TAG)
                h.update(page.astype("<u8").tobytes())
            else:
                h.update(page.astype("<u4").tobytes())
        prior = h.digest()
        keys.append(prior)
    return keys


def storage_keys(tokens: Sequence[int] | np.ndarray, page_size: int, extra_key: str | None = None,
                 cache_salt: str | None = None) -> list[bytes]:
    """The keys SGLang's HiCache gives an L3 backend for a prompt of `tokens` in the namespace (extra_key,
    cache_salt): one per whole page, from the first (a short last page is never stored). An empty cache_salt is
    no salt, as SGLang's request makes it."""
    if page_size < 1:
        raise InvalidInput(f"page_size={page_size} must be >= 1")
    whole = len(tokens) // page_size * page_size
    return page_keys(tokens[:whole], page_size, storage_namespace_seed(extra_key, cache_salt or None))
