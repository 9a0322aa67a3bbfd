"""Token keys and the page hash chain.

Tokens are kept packed as little-endian uint32 bytes: slicing and comparing bytes is a memcpy/memcmp, which is
what makes radix-tree matching fast in Python. A page is `page_size` tokens = `4 * page_size` bytes of key.

Page hash chain (16-byte blake2b digests)::

    h_0 = H_K(layout_id || namespace.id)        the namespace's root in L3, keyed by the chain key K
    h_i = H(h_{i-1} || tokens of page i)

Namespace and layout are folded into the root, so two namespaces (or two layouts) never share a page hash, and
a page hash alone names its whole prefix.

A page an engine names by its own key (SGLang's 64-hex chain digests: the engine already chains them) is not
chained again: its hash is `engine_page_hash(h_0, key)`, keyed by its namespace/layout root alone, so a reader
needs nothing but the key, and a digest of its own personalisation, so it never equals a token chain hash.

The chain key K is the store's secret (`chain_key` of an L3 store: derived from an LMDB store's key file, a
random secret in a shared store's format record; a cache without a store draws its own). A page hash comes with
its tokens and extra_key wherever kvc shows or publishes it (the KV-event feed, `kvc ns show`): with a root keyed
by a constant, anyone could recompute h_1 for every guessed salt and find a short salt in a second. Under K, a
guess cannot be tested without K. A format-1 store was written with no key (`UNKEYED_CHAIN`, b""): blake2b with
an empty key is the unkeyed digest, so such a store reads as it always did until `kvc migrate` rewrites it.
"""

from __future__ import annotations

import hashlib
import os
import sys
from array import array
from collections.abc import Iterable, Sequence

import msgspec
import numpy as np

from ..errors import InvalidInput, InvalidTokens
from .ids import NamespaceId, PageHash
from .namespace import Namespace

TOKEN_BYTES = 4  # one token id packed as uint32
PAGE_HASH_BYTES = 16
_ROOT_PERSON = b"kvc.page.root.v1"
_ENGINE_PERSON = b"kvc.page.engine1"  # engine-keyed pages: apart from roots and from the (unpersonalised) chain
ENGINE_KEY_MAX = 64  # bytes of an engine's page key at most (a blake2b key's limit; SGLang's are 32)
# The chain key drawn for a store or a cache; one derived from a store's key file has this size too.
CHAIN_KEY_BYTES = 32
# The chain key of a format-1 store (roots under no key): blake2b keyed by b"" is the unkeyed digest.
UNKEYED_CHAIN = b""
# Personalisation of the chain key derived from a store's secret, apart from every other digest of that secret
# (salt fingerprints, display ids), so knowing one never gives the other.
_CHAIN_KEY_PERSON = b"kvc.chain.key.v1"
_LE_U32 = np.dtype("<u4")
_U32 = "I" if array("I").itemsize == 4 else "L"  # the array typecode of a C uint32 on this platform
_SWAP = sys.byteorder != "little"  # array() packs in native order; keys are little-endian


def pack_tokens(tokens: Iterable[int] | np.ndarray | array[int] | bytes) -> bytes:
    """Validate token ids (integers, 0 <= t < 2**32) and pack them as little-endian uint32 bytes.

    The fast paths, measured on 1,024-token lists: a Python list (any other iterable is made one) goes through
    `array('I').fromlist` — one C loop that converts, range-checks and packs, several times faster than
    `numpy.asarray` (~45 us) and about twice as fast as `array('I', tokens)` or `struct.pack`; an `array`, a
    numpy array or `bytes` is taken as its buffer, range-checked in numpy when its type could hold a bad token,
    and copied once. Anything the fast paths refuse is rechecked element by element for the error message.
    """
    if not isinstance(tokens, (list, tuple, bytes, array, np.ndarray, Sequence)):
        tokens = list(tokens)  # a generator, an iterator: read once, then the list path
    if type(tokens) is list or type(tokens) is tuple:
        packed = array(_U32)
        try:
            # fromlist reads the list's items in place: about half the work of array(_U32, tokens) per token
            packed.fromlist(tokens) if type(tokens) is list else packed.extend(tokens)
        except (TypeError, OverflowError):
            return _pack_checked(tokens)
        if _SWAP:
            packed.byteswap()
        data = packed.tobytes()
        # array() takes a bool as 0 or 1: where a 0 or 1 was packed, look at those positions and refuse a bool.
        # argmin, not min: a reduction's setup costs ~3x an argmin over a thousand tokens (4.0 against 1.4 us).
        packed_u32 = np.frombuffer(data, dtype=_LE_U32)
        if data and packed_u32[packed_u32.argmin()] <= 1:
            for i in np.flatnonzero(packed_u32 <= 1).tolist():
                if tokens[i] is True or tokens[i] is False:
                    raise InvalidTokens(f"token {tokens[i]!r} is not an integer")
        return data
    if isinstance(tokens, bytes):
        if len(tokens) % TOKEN_BYTES:
            raise InvalidTokens(f"packed tokens must be a multiple of {TOKEN_BYTES} bytes, got {len(tokens)}")
        return tokens
    if isinstance(tokens, array):
        if tokens.typecode in "fduw":
            return _pack_checked(tokens.tolist())
        tokens = np.frombuffer(tokens, dtype=tokens.typecode) if len(tokens) else np.empty(0, dtype=np.uint32)
    if isinstance(tokens, np.ndarray) and tokens.dtype.kind in "iu" and tokens.ndim == 1:
        if tokens.dtype == _LE_U32:
            return tokens.tobytes()
        if len(tokens) and (tokens.dtype.itemsize >= TOKEN_BYTES or tokens.dtype.kind == "i"):
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0 or hi >= 2**32:
                raise InvalidTokens(f"token {lo if lo < 0 else hi} is outside 0 <= t < 2**32")
        return tokens.astype(_LE_U32).tobytes()
    return _pack_checked(tokens)


def _pack_checked(tokens: Sequence[int] | np.ndarray) -> bytes:
    """`pack_tokens` element by element: slower, and names the first bad token."""
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError) as exc:
        raise InvalidTokens(f"tokens must be a sequence of integers: {exc}") from None
    if arr.size == 0:
        return b""
    if arr.ndim != 1:
        raise InvalidTokens(f"tokens must be one-dimensional, got shape {tuple(arr.shape)}")
    if arr.dtype.kind not in "iu":
        # Python ints beyond int64 arrive as dtype=object; floats and bools are rejected by name.
        bad = next((t for t in arr.tolist() if not (isinstance(t, int) and not isinstance(t, bool))), None)
        if bad is not None:
            raise InvalidTokens(f"token {bad!r} is not an integer")
        arr = np.array([int(t) for t in arr.tolist()], dtype=object)
        lo, hi = min(arr), max(arr)
    else:
        lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= 2**32:
        bad = lo if lo < 0 else hi
        raise InvalidTokens(f"token {bad} is outside 0 <= t < 2**32")
    return np.asarray(arr, dtype=_LE_U32).tobytes()


def unpack_tokens(data: bytes) -> list[int]:
    """The token ids of packed key bytes."""
    tokens: list[int] = np.frombuffer(data, dtype="<u4").tolist()
    return tokens


class RadixKey(msgspec.Struct, frozen=True, gc=False):
    """Tokens plus the namespace they live in: the key of everything cached.

    Build with `RadixKey.of(tokens, namespace)`; `data` is already validated and packed.
    """

    data: bytes  # packed little-endian uint32 token ids; len(data) = 4 * tokens
    namespace: Namespace  # the namespace of the request this key came from

    @classmethod
    def of(cls, tokens: Iterable[int] | np.ndarray | bytes, namespace: Namespace) -> "RadixKey":
        """Validate and pack `tokens` into a key in `namespace`."""
        return cls(pack_tokens(tokens), namespace)

    def __len__(self) -> int:
        return len(self.data) >> 2

    @property
    def tokens(self) -> list[int]:
        """The token ids as Python ints."""
        return unpack_tokens(self.data)

    def page_aligned(self, page_size: int) -> "RadixKey":
        """This key without its partial tail page."""
        size = len(self.data)  # bytes: len(self) would cost a Python call
        end = size - size % (page_size * TOKEN_BYTES)
        return self if end == size else RadixKey(self.data[:end], self.namespace)

    def prefix(self, n_tokens: int) -> "RadixKey":
        """The first `n_tokens` tokens of this key, same namespace."""
        return RadixKey(self.data[: n_tokens * TOKEN_BYTES], self.namespace)

    def starts_with(self, prefix: "RadixKey") -> bool:
        """Same namespace, and `prefix`'s tokens are the first tokens of this key."""
        return self.namespace == prefix.namespace and self.data.startswith(prefix.data)


def hash_root(layout_id: bytes, namespace: Namespace, chain_key: bytes) -> PageHash:
    """h_0 of the chain: the root of `namespace` under `layout_id`, keyed by `chain_key` (the store's or the
    cache's `chain_key`; UNKEYED_CHAIN for a format-1 store)."""
    return hash_root_of_id(layout_id, namespace.id, chain_key)


def hash_root_of_id(layout_id: bytes, ns_id: NamespaceId, chain_key: bytes) -> PageHash:
    """h_0 of the chain from a raw 16-byte `Namespace.id`: what a store that records ids (never salts) and holds
    the chain key can recompute on its own, e.g. to tell a namespace root from a missing parent page."""
    return PageHash(hashlib.blake2b(layout_id + ns_id, digest_size=PAGE_HASH_BYTES, key=chain_key,
                                    person=_ROOT_PERSON).digest())


def new_chain_key() -> bytes:
    """A fresh random chain key: a shared store's (kept in its format record) or a cache's without a store."""
    return os.urandom(CHAIN_KEY_BYTES)


def derive_chain_key(secret: bytes) -> bytes:
    """The chain key of a store whose secret is `secret` (an LMDB store's key file): a digest of it under its own
    personalisation, so the chain key and the salt fingerprints keyed by `secret` never give each other away."""
    return hashlib.blake2b(b"", digest_size=CHAIN_KEY_BYTES, key=secret, person=_CHAIN_KEY_PERSON).digest()


def extend_chain(parent: PageHash, data: bytes, page_size: int) -> list[PageHash]:
    """Page hashes of the whole pages of packed tokens `data`, chained from `parent`."""
    step = page_size * TOKEN_BYTES
    out: list[bytes] = []
    blake = hashlib.blake2b
    last: bytes = parent
    for start in range(0, len(data) - step + 1, step):
        last = blake(last + data[start:start + step], digest_size=PAGE_HASH_BYTES).digest()
        out.append(last)
    # PageHash values: a NewType call per page would cost in this hot loop
    return out  # type: ignore[return-value]  # bytes, as PageHash is


def page_hashes(layout_id: bytes, key: RadixKey, page_size: int, chain_key: bytes) -> list[PageHash]:
    """The page hash chain of `key`'s whole pages, rooted in the key's own namespace under `chain_key` (the
    store's `chain_key`, or the cache's: `TieredCache.chain_key`)."""
    return extend_chain(hash_root(layout_id, key.namespace, chain_key), key.data, page_size)


def engine_page_hash(root: PageHash, key: bytes) -> PageHash:
    """The page hash of a page an engine names by its own `key` (1..ENGINE_KEY_MAX bytes; SGLang: the 32 raw
    bytes of its 64-hex key) under the namespace/layout `root` (`hash_root`). A blake2b of the key keyed by the
    root, with its own personalisation: it never equals a token chain hash, and it is as unguessable as the root
    (the store's chain key is in it). InvalidInput for a key that is not such bytes."""
    if type(key) is not bytes or not 0 < len(key) <= ENGINE_KEY_MAX:
        raise InvalidInput(f"an engine page key is 1..{ENGINE_KEY_MAX} bytes, got {key!r:.80}")
    return PageHash(hashlib.blake2b(key, digest_size=PAGE_HASH_BYTES, key=root, person=_ENGINE_PERSON).digest())
