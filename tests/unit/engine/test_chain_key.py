"""A cache's chain key (issue 26): its store's when it has one, its own random one otherwise, never a global."""

from __future__ import annotations

import pytest

from factories import l3_cache, make_cache, make_layout, make_store
from kvcache import Namespace, Request, page_hashes
from kvcache.errors import StoreAccessDenied


def test_a_cache_without_a_store_draws_its_own_key():
    a, b = make_cache(4), make_cache(4)
    assert len(a.chain_key) == 32 and a.chain_key != b.chain_key
    req = Request("r", list(range(16)), Namespace("t", "abc"))
    assert page_hashes(a.layout.layout_id, req.key, 4, a.chain_key) != page_hashes(b.layout.layout_id, req.key, 4,
                                                                                   b.chain_key)
    a.close()
    b.close()


def test_a_cache_takes_its_stores_key_and_a_store_without_one_cannot_back_a_cache(tmp_path):
    store = make_store(tmp_path / "s", make_layout(4))
    cache = l3_cache(store)
    assert cache.chain_key == store.chain_key and cache.tree.chain_key == store.chain_key
    cache.close()
    store.chain_key = None  # what a handle gets whose user may not read the key file
    with pytest.raises(StoreAccessDenied, match="key file"):
        l3_cache(store)
    store.close()
