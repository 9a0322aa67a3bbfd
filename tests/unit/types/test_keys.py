from array import array

import numpy as np
import pytest

from kvcache import InvalidInput, InvalidTokens, Namespace, RadixKey, engine_page_hash, page_hashes
from kvcache.types.keys import (
    ENGINE_KEY_MAX,
    UNKEYED_CHAIN,
    derive_chain_key,
    extend_chain,
    hash_root,
    new_chain_key,
    pack_tokens,
    unpack_tokens,
)

LAYOUT_A, LAYOUT_B = b"a" * 16, b"b" * 16
KEY = b"k" * 32  # a chain key


def test_pack_round_trip():
    toks = [0, 1, 2**32 - 1, 123456]
    assert unpack_tokens(pack_tokens(toks)) == toks
    assert pack_tokens(np.array(toks, dtype=np.uint64)) == pack_tokens(toks)
    assert pack_tokens([]) == b""


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.0], [True], ["7"], [[1, 2]], [2**70]])
def test_bad_tokens(bad):
    with pytest.raises(InvalidTokens):
        pack_tokens(bad)


def test_page_aligned_drops_partial_tail():
    k = RadixKey.of(range(10), Namespace("t"))
    assert len(k.page_aligned(4)) == 8 and k.page_aligned(4).namespace == k.namespace
    assert k.page_aligned(5) is k
    assert len(k.page_aligned(16)) == 0


def test_chain_is_a_chain():
    ns = Namespace("t1", "s")
    key = RadixKey.of(range(12), ns)
    h = page_hashes(LAYOUT_A, key, 4, KEY)
    assert len(h) == 3 and all(len(x) == 16 for x in h)
    # h_i depends only on h_{i-1} and page i: extending from a middle hash gives the same tail
    assert extend_chain(h[0], key.data[16:], 4) == h[1:]
    # a shorter key is a prefix of the chain; the partial tail page has no hash
    assert page_hashes(LAYOUT_A, RadixKey.of(range(9), ns), 4, KEY) == h[:2]


def test_namespace_and_layout_are_in_the_root():
    toks = list(range(8))
    chains = {tuple(page_hashes(lay, RadixKey.of(toks, ns), 4, KEY))
              for lay in (LAYOUT_A, LAYOUT_B) for ns in (Namespace(), Namespace("t1"), Namespace("t1", "s"))}
    assert len(chains) == 6
    assert hash_root(LAYOUT_A, Namespace(""), KEY) == hash_root(LAYOUT_A, Namespace(None), KEY)
    # no page hash of one namespace equals any of another's for the same tokens
    a = set(page_hashes(LAYOUT_A, RadixKey.of(toks, Namespace("t1")), 1, KEY))
    b = set(page_hashes(LAYOUT_A, RadixKey.of(toks, Namespace("t2")), 1, KEY))
    assert not a & b


def test_the_chain_key_is_in_the_root():
    """The root is keyed: another key gives another chain for the same tokens, layout and namespace, so a page
    hash cannot be recomputed from a guessed salt without the key."""
    ns, toks = Namespace("t1", "abc"), RadixKey.of(range(8), Namespace("t1", "abc"))
    other = new_chain_key()
    assert hash_root(LAYOUT_A, ns, KEY) != hash_root(LAYOUT_A, ns, other)
    assert not set(page_hashes(LAYOUT_A, toks, 4, KEY)) & set(page_hashes(LAYOUT_A, toks, 4, other))
    assert len(other) == 32 and other != new_chain_key()


def test_the_unkeyed_chain_is_the_format_1_root():
    """UNKEYED_CHAIN (b"") gives the root a format-1 store was written with: blake2b of layout || id, no key."""
    import hashlib

    ns = Namespace("t1", "s")
    legacy = hashlib.blake2b(LAYOUT_A + ns.id, digest_size=16, person=b"kvc.page.root.v1").digest()
    assert hash_root(LAYOUT_A, ns, UNKEYED_CHAIN) == legacy


def test_a_derived_chain_key_is_its_own_digest_of_the_secret():
    """The chain key derived from a store's secret is stable, differs per secret, and is never the secret."""
    secret = bytes(range(32))
    assert derive_chain_key(secret) == derive_chain_key(secret) != secret
    assert derive_chain_key(secret) != derive_chain_key(bytes(32))
    assert len(derive_chain_key(secret)) == 32


@pytest.mark.parametrize("make", [
    list, tuple, lambda t: iter(t), lambda t: array("I", t), lambda t: array("q", t), lambda t: array("L", t),
    lambda t: np.array(t, dtype="<u4"), lambda t: np.array(t, dtype=np.int64), lambda t: np.array(t, dtype=">u4"),
    lambda t: np.array(t, dtype=np.uint16), lambda t: np.array(t, dtype=np.int64)[::-1][::-1],
])
def test_every_accepted_container_packs_the_same_bytes(make):
    toks = [0, 1, 7, 65535]
    assert pack_tokens(make(toks)) == np.array(toks, dtype="<u4").tobytes()
    assert pack_tokens(make([])) == b""


@pytest.mark.parametrize("bad, fact", [
    ([5, 0, True, 3], "token True is not an integer"), ([1, False], "token False is not an integer"),
    ((4, 2**32), "token 4294967296 is outside"), (array("q", [3, -2]), "token -2 is outside"),
    (np.array([1, 2**33], dtype=np.int64), "token 8589934592 is outside"), (array("d", [1.0]), "token 1.0 is not"),
    (np.array([1, 2], dtype=np.float32), "token 1.0 is not an integer"), ([1, np.float64(2.0)], "not an integer"),
])
def test_bad_tokens_in_any_container_name_the_token(bad, fact):
    with pytest.raises(InvalidTokens, match=fact):
        pack_tokens(bad)


# --- engine-keyed pages ----------------------------------------------------------------------------------------


def test_an_engine_page_hash_is_pinned():
    """The Redis plugin, the SGLang adapter and every stored engine page depend on these bytes."""
    assert engine_page_hash(bytes(range(16)), bytes(range(32))).hex() == "158eec1f176bdf45f55e2fa6265cb83a"
    assert engine_page_hash(b"r" * 16, b"\x01").hex() == "ee095eca158d852f6720622e4f4386d9"


def test_an_engine_page_hash_is_keyed_by_its_root_and_never_a_chain_step():
    root = hash_root(LAYOUT_A, Namespace("sglang"), KEY)
    key = bytes(range(32))
    h = engine_page_hash(root, key)
    assert len(h) == 16
    assert h != extend_chain(root, key, 8)[0]  # the same bytes as a token page's: another digest
    assert h != engine_page_hash(hash_root(LAYOUT_B, Namespace("sglang"), KEY), key)
    assert h != engine_page_hash(hash_root(LAYOUT_A, Namespace("sglang", "salt"), KEY), key)
    assert h != engine_page_hash(hash_root(LAYOUT_A, Namespace("sglang"), new_chain_key()), key)
    assert h != engine_page_hash(root, key[:-1] + b"\x00")
    assert len(engine_page_hash(root, bytes(ENGINE_KEY_MAX))) == 16


@pytest.mark.parametrize("bad", [b"", bytes(ENGINE_KEY_MAX + 1), "00" * 32, bytearray(32), None])
def test_an_engine_page_key_is_1_to_64_bytes(bad):
    with pytest.raises(InvalidInput):
        engine_page_hash(b"r" * 16, bad)
