"""kvcache/storage/page_set.py: a byte-free, unlimited page store answers what an unlimited LMDB store answers.

The comparison drives both with the same batches (chains of several namespaces, repeats, pages already held, a
namespace dropped) and checks every answer a cache reads: put outcomes and counts, `exists_prefix`, how many pages
`get_into` serves."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from factories import make_layout, make_store
from kvcache.errors import InvalidConfig, InvalidInput
from kvcache.storage.api import L3Store, PageOutcome, PageStore, page_origins
from kvcache.storage.page_set import PageSet
from kvcache.types.keys import derive_chain_key
from kvcache.types.namespace import Namespace
from kvcache.types.shares import Shares

LAYOUT = make_layout(4)
KEY = bytes(range(32))  # the key file of the LMDB stores compared with
CHAIN = derive_chain_key(KEY)  # their chain key: what a page set standing for them is given
TENANTS = [Namespace(None, None), Namespace("t1", "s1"), Namespace("t2", None)]


def _chain(ns: Namespace, tokens: list[int], parent=None):
    packed = np.asarray(tokens, dtype=np.uint32).tobytes()
    return page_origins(LAYOUT, packed, ns, CHAIN, parent)


def _pages(n: int) -> list[np.ndarray]:
    return [np.zeros(LAYOUT.bytes_per_page, dtype=np.uint8) for _ in range(n)]


def test_a_page_set_is_a_page_store_and_not_an_administered_one():
    s = PageSet(LAYOUT, CHAIN)
    assert isinstance(s, PageStore) and not isinstance(s, L3Store)


def test_outcomes_say_written_once_then_existing_and_repeats_in_a_batch_are_existing():
    s = PageSet(LAYOUT, CHAIN)
    hashes, origins = _chain(TENANTS[1], list(range(12)))
    first = s.put(hashes[:2] + hashes[:1], _pages(3), origins[:2] + origins[:1])
    assert list(first.outcomes) == [PageOutcome.WRITTEN, PageOutcome.WRITTEN, PageOutcome.EXISTING]
    assert (first.written, first.existing, first.rejected, first.bytes_written) == (2, 1, 0, 2 * LAYOUT.bytes_per_page)
    again = s.put(hashes, _pages(3), origins)
    assert list(again.outcomes) == [PageOutcome.EXISTING] * 2 + [PageOutcome.WRITTEN]
    assert s.exists_prefix(hashes) == 3 and len(s) == 3


def test_get_into_counts_the_held_run_and_leaves_the_views_alone():
    s = PageSet(LAYOUT, CHAIN)
    hashes, origins = _chain(TENANTS[0], list(range(16)))
    s.put(hashes[:2], _pages(2), origins[:2])
    views = [np.full(LAYOUT.bytes_per_page, 7, dtype=np.uint8) for _ in range(4)]
    assert s.get_into(hashes, views) == 2
    assert s.get_into(hashes, views[:1]) == 1  # no more than the views given
    assert all((v == 7).all() for v in views)


def test_a_token_page_under_a_parent_it_does_not_hold_refuses_the_batch():
    s = PageSet(LAYOUT, CHAIN)
    hashes, origins = _chain(TENANTS[1], list(range(12)))
    with pytest.raises(InvalidInput, match="parent"):
        s.put(hashes[1:], _pages(2), origins[1:])
    assert len(s) == 0  # nothing of the refused batch is held


def test_a_parent_held_under_another_namespace_is_refused_as_lmdb_refuses_it(tmp_path):
    s, lmdb_store = PageSet(LAYOUT, CHAIN), _keyed_store(tmp_path)
    try:
        a_hashes, a_origins = _chain(TENANTS[1], list(range(4)))
        b_hashes, b_origins = _chain(TENANTS[2], list(range(4, 8)), parent=a_hashes[0])
        for store in (s, lmdb_store):
            store.put(a_hashes, _pages(1), a_origins)
            with pytest.raises(InvalidInput):
                store.put(b_hashes, _pages(1), b_origins)
    finally:
        lmdb_store.close()


def test_l1_and_l2_shares_are_kept_and_an_l3_share_is_refused():
    s = PageSet(LAYOUT, CHAIN)
    s.set_shares(TENANTS[1], Shares(device_tokens=64, host_tokens=128))
    (record,) = s.shares()
    assert (record.ns_id_hex, record.shares) == (TENANTS[1].id_hex, Shares(device_tokens=64, host_tokens=128))
    with pytest.raises(InvalidConfig, match="L3 share"):
        s.set_shares(TENANTS[1], Shares(store_bytes=1024))
    s.set_shares(TENANTS[1], Shares())
    assert s.shares() == []


def _keyed_store(path):
    from kvcache.storage.keyfile import install_key

    make_store(path, LAYOUT).close()
    temp = path / "new.key"
    temp.write_text(KEY.hex() + "\n")
    temp.chmod(0o600)
    install_key(str(path), str(temp))
    store = make_store(path, LAYOUT)
    assert store.chain_key == CHAIN
    return store


# One step of the comparison: put a run of a tenant's chain (from page `start`, `n` pages, optionally the batch
# repeated), or drop a tenant.
_STEP = st.one_of(
    st.tuples(st.just("put"), st.integers(0, 2), st.integers(0, 5), st.integers(1, 4), st.booleans()),
    st.tuples(st.just("drop"), st.integers(0, 2)),
)
_CHAINS = {ns.id: _chain(ns, [(i * 7 + t) % 50 for i in range(24)]) for t, ns in enumerate(TENANTS)}


@settings(max_examples=25, deadline=None)
@given(steps=st.lists(_STEP, min_size=1, max_size=12))
def test_every_answer_a_cache_reads_matches_an_unlimited_lmdb_store(tmp_path_factory, steps):
    page_set = PageSet(LAYOUT, CHAIN)
    lmdb_store = _keyed_store(tmp_path_factory.mktemp("lmdb"))
    try:
        for step in steps:
            ns = TENANTS[step[1]]
            hashes, origins = _CHAINS[ns.id]
            if step[0] == "drop":
                assert page_set.delete_namespace(ns.id).pages == lmdb_store.delete_namespace(ns.id).pages
                continue
            _, _, start, n, repeat = step
            start = min(start, page_set.exists_prefix(hashes))  # a cache writes from what is held, never past a gap
            batch = slice(start, start + n)
            h, o = hashes[batch] * (2 if repeat else 1), origins[batch] * (2 if repeat else 1)
            got, want = page_set.put(h, _pages(len(h)), o), lmdb_store.put(h, _pages(len(h)), o)
            assert (got.outcomes, got.written, got.existing, got.rejected, got.evicted, got.bytes_written) == \
                (want.outcomes, want.written, want.existing, want.rejected, want.evicted, want.bytes_written)
            for other in TENANTS:
                all_hashes = _CHAINS[other.id][0]
                assert page_set.exists_prefix(all_hashes) == lmdb_store.exists_prefix(all_hashes)
                views = _pages(len(all_hashes))
                assert page_set.get_into(all_hashes, views) == lmdb_store.get_into(all_hashes, views)
    finally:
        lmdb_store.close()


def test_the_chain_key_is_the_given_one_or_a_fresh_one():
    assert PageSet(LAYOUT, CHAIN).chain_key == CHAIN
    a, b = PageSet(LAYOUT).chain_key, PageSet(LAYOUT).chain_key
    assert a and b and a != b and len(a) == len(CHAIN)
