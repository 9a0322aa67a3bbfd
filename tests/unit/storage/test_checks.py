"""kvcache.storage.checks: the argument checks every backend shares."""

from __future__ import annotations

import pytest

from kvcache.errors import InvalidInput
from kvcache.storage.checks import check_page_hashes


def test_check_page_hashes_rejects_anything_but_16_bytes():
    check_page_hashes([bytes(16), b"x" * 16])
    for bad in (b"short", bytes(17), "0" * 16, None):
        with pytest.raises(InvalidInput):
            check_page_hashes([bytes(16), bad])


# --- pages as segments, engine origins -------------------------------------------------------------------------

import numpy as np  # noqa: E402

from kvcache.storage.api import PageOrigin, engine_origins, page_origins  # noqa: E402
from kvcache.storage.checks import Segments, out_views_for, put_views  # noqa: E402
from kvcache.types.keys import hash_root, pack_tokens  # noqa: E402
from kvcache.types.layout import KVLayout  # noqa: E402
from kvcache.types.namespace import Namespace  # noqa: E402

LAYOUT = KVLayout("checks-model@r1", layers=2, kv_heads=1, head_dim=8, dtype="float16", page_size=2)  # 128 B pages
NBYTES = LAYOUT.bytes_per_page
CHAIN_KEY = b"c" * 32
NS = Namespace("sglang")


def test_a_page_may_be_one_buffer_or_a_list_of_segments():
    hashes = [bytes(16), b"x" * 16, b"y" * 16]
    pool = np.zeros((4, NBYTES // 4), dtype=np.uint8)
    whole = np.zeros(NBYTES, dtype=np.uint8)
    outs = out_views_for(hashes, [list(pool), whole, (whole,)], LAYOUT)
    assert isinstance(outs[0], Segments) and len(outs[0]) == outs[0].nbytes == NBYTES
    assert type(outs[1]) is memoryview and type(outs[2]) is memoryview  # one segment is that buffer
    outs[0].fill(memoryview(bytes(range(NBYTES))))
    assert pool.tobytes() == bytes(range(NBYTES))
    back = bytearray(NBYTES)
    outs[0].gather(memoryview(back))
    assert bytes(back) == bytes(range(NBYTES)) == outs[0].tobytes()
    assert type(out_views_for(hashes[:1], [whole], LAYOUT)[0]) is memoryview  # the common case, untouched


@pytest.mark.parametrize("bad", ["short", "readonly", "empty", "nested", "number"])
def test_segments_that_are_not_a_writable_page_are_refused(bad):
    pool = np.zeros((4, NBYTES // 4), dtype=np.uint8)
    views = {"short": list(pool[:3]), "empty": [], "nested": [[pool[0]], pool[1]], "number": [3, pool[0]]}
    if bad == "readonly":
        pool.flags.writeable = False
        views["readonly"] = list(pool)
    with pytest.raises(InvalidInput):
        out_views_for([bytes(16)], [views[bad]], LAYOUT)


def test_put_views_take_segments_and_check_each_engine_pages_hash_under_its_root():
    keys = [bytes([i]) * 32 for i in range(3)]
    hashes, origins = engine_origins(LAYOUT, NS, CHAIN_KEY, keys)
    pages = [[np.full(NBYTES // 2, i, np.uint8), np.full(NBYTES // 2, 9, np.uint8)] for i in range(3)]
    views = put_views(LAYOUT, hashes, pages, origins, CHAIN_KEY)
    assert all(isinstance(v, Segments) for v in views) and views[1].tobytes() == bytes([1] * 64 + [9] * 64)
    with pytest.raises(InvalidInput, match="chain key"):
        put_views(LAYOUT, hashes, pages, origins)  # a backend that did not pass its chain key
    with pytest.raises(InvalidInput, match="engine key"):
        put_views(LAYOUT, hashes, pages, origins, b"d" * 32)  # under another store's key: another root
    with pytest.raises(InvalidInput, match="bytes"):
        put_views(LAYOUT, hashes[:1], [[np.zeros(NBYTES - 1, np.uint8)]], origins[:1], CHAIN_KEY)
    with pytest.raises(InvalidInput, match="parent"):
        put_views(LAYOUT, hashes[:1], pages[:1], [PageOrigin(NS, b"short", b"", keys[0])], CHAIN_KEY)


def test_an_engine_pages_parent_in_another_namespace_is_no_error_a_token_pages_is():
    other = Namespace("other")
    a_hashes, a_origins = engine_origins(LAYOUT, other, CHAIN_KEY, [b"a" * 32])
    b_hashes, b_origins = engine_origins(LAYOUT, NS, CHAIN_KEY, [b"b" * 32])
    linked = PageOrigin(NS, a_hashes[0], b"", b"b" * 32)  # names a page of `other` as its parent
    pages = [np.zeros(NBYTES, np.uint8)] * 2
    assert len(put_views(LAYOUT, a_hashes + b_hashes, pages, a_origins + [linked], CHAIN_KEY)) == 2
    t_hashes, t_origins = page_origins(LAYOUT, pack_tokens(range(4)), NS, CHAIN_KEY)
    root_other = hash_root(LAYOUT.layout_id, other, CHAIN_KEY)
    o_hashes, o_origins = page_origins(LAYOUT, pack_tokens(range(2)), other, CHAIN_KEY)
    from kvcache.types.keys import extend_chain

    h = extend_chain(o_hashes[0], pack_tokens(range(2, 4)), LAYOUT.page_size)[0]
    assert o_origins[0].parent == root_other
    with pytest.raises(InvalidInput, match="another namespace"):
        put_views(LAYOUT, [o_hashes[0], h], pages, [o_origins[0], PageOrigin(NS, o_hashes[0],
                                                                                pack_tokens(range(2, 4)))], CHAIN_KEY)
    assert t_hashes  # token pages of the namespace itself pass
    assert len(put_views(LAYOUT, t_hashes, pages, t_origins, CHAIN_KEY)) == 2


# --- pages as one strided array (an engine's host page viewed in place) ----------------------------------------

from kvcache.storage.checks import Strided  # noqa: E402
from kvcache.storage.codec import CHECKSUMS, DEFAULT_CHECKSUM  # noqa: E402


def host_pool() -> np.ndarray:
    """A layer_first-like host pool of LAYOUT's pages: [K/V, layers, 4 pages' rows, row bytes]; page p is
    pool[:, :, 2p:2p+2] (its 2 tokens), 4 runs of 32 bytes spread over the pool."""
    return np.arange(2 * 2 * 8 * 16, dtype=np.uint16).astype(np.uint8).reshape(2, 2, 8, 16)


def test_a_non_contiguous_array_is_one_page_of_its_bytes_in_c_order():
    pool = host_pool()
    page = pool[:, :, 2:4]  # not contiguous: 4 runs of 2 tokens x 16 bytes
    [out] = out_views_for([bytes(16)], [page], LAYOUT)
    assert isinstance(out, Strided) and len(out) == out.nbytes == NBYTES
    want = page.tobytes()  # the page's bytes: the array's, in C order
    assert out.tobytes() == want and b"".join(bytes(v) for v in out.views) == want and len(out.views) == 4
    back = bytearray(NBYTES)
    out.gather(memoryview(back))
    assert bytes(back) == want
    out.fill(memoryview(bytes(range(NBYTES))))
    assert page.tobytes() == bytes(range(NBYTES)) and pool[:, :, :2].tobytes() == host_pool()[:, :, :2].tobytes()
    checksum = CHECKSUMS[DEFAULT_CHECKSUM]  # summed over the runs = summed over the page's bytes
    assert checksum.of_parts(out.views, bytes(16)) == checksum.of(bytes(range(NBYTES)), bytes(16))
    # a torch CPU tensor view is taken the same way, and so is a write's page
    import torch

    t_out = out_views_for([bytes(16)], [torch.from_numpy(pool)[:, :, 4:6]], LAYOUT)[0]
    assert isinstance(t_out, Strided) and t_out.tobytes() == pool[:, :, 4:6].tobytes()
    hashes, origins = engine_origins(LAYOUT, NS, CHAIN_KEY, [b"k" * 32])
    [src] = put_views(LAYOUT, hashes, [pool[:, :, 6:8]], origins, CHAIN_KEY)
    assert isinstance(src, Strided) and src.tobytes() == pool[:, :, 6:8].tobytes()


def test_runs_that_do_not_merge_into_rows_are_still_summed_in_page_order():
    base = np.arange(4 * 3 * 40, dtype=np.uint8).reshape(4, 3, 40)
    page = base[::2, 1:, 4:36]  # leading axes that cannot be viewed as one: 2 x 2 runs of 32 bytes
    hashes, origins = engine_origins(LAYOUT, NS, CHAIN_KEY, [b"r" * 32])
    [strided] = put_views(LAYOUT, hashes, [page], origins, CHAIN_KEY)
    assert isinstance(strided, Strided) and len(strided.views) == 4
    assert b"".join(bytes(v) for v in strided.views) == page.tobytes()


@pytest.mark.parametrize("bad", ["scattered", "readonly", "short"])
def test_a_strided_page_that_is_not_a_writable_page_of_rows_is_refused(bad):
    pool = host_pool()
    views = {"scattered": np.zeros((NBYTES, 2), np.uint8)[:, 0].reshape(8, 16),  # strided in its last axis
             "short": pool[:, :, 2:3]}
    if bad == "readonly":
        pool.flags.writeable = False
        views["readonly"] = pool[:, :, 2:4]
    with pytest.raises(InvalidInput, match={"scattered": "contiguous", "readonly": "writable",
                                            "short": "out views of"}[bad]):
        out_views_for([bytes(16)], [views[bad]], LAYOUT)
