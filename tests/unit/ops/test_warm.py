"""kvcache.ops.warm: the hottest stored prefixes of a namespace, fetched into L2 under that namespace."""

import numpy as np

from factories import l3_cache, make_layout, make_store
from kvcache import Namespace, SyntheticKV, engine_origins, page_origins, warm_namespace
from kvcache.ops.warm import hottest_prefixes
from kvcache.types.keys import pack_tokens

PS = 4
T1 = Namespace("t1", "s")


def _put(store, tokens, ns=T1):
    layout = store.layout
    hashes, origins = page_origins(layout, pack_tokens(tokens), ns, store.chain_key)
    store.put(hashes, [r.numpy() for r in SyntheticKV(layout).pages(hashes)], origins)
    return hashes


def _read(store, hashes, times):
    out = [np.empty(store.layout.bytes_per_page, dtype=np.uint8) for _ in hashes]
    for _ in range(times):
        assert store.get_into(hashes, out) == len(hashes)


def _seeded_store(tmp_path):
    store = make_store(tmp_path / "s", make_layout(PS))
    shared = list(range(8))  # 2 pages every sequence shares
    cold = _put(store, shared + [100] * 8)
    hot = _put(store, shared + [200] * 12)
    _put(store, shared + [300] * 4, Namespace("t2"))  # another namespace, same first tokens
    _read(store, hot, 5)
    _read(store, cold, 1)
    store.flush()
    return store, shared


def test_hottest_prefix_first_and_budget_in_pages(tmp_path):
    store, shared = _seeded_store(tmp_path)
    plan = hottest_prefixes(store, store.layout, T1, max_pages=100)
    assert plan.pages == 2 + 2 + 3  # shared pages counted once
    assert [len(p.tokens) // 4 for p in plan.prefixes] == [20, 16]  # hot branch (5 hits) first
    small = hottest_prefixes(store, store.layout, T1, max_pages=3)
    assert small.pages == 3 and len(small.prefixes) == 1
    assert small.prefixes[0].tokens == pack_tokens(shared + [200] * 4)  # the hot branch's first page
    by_bytes = hottest_prefixes(store, store.layout, T1, max_pages=100, max_bytes=2 * store.layout.bytes_per_page)
    assert by_bytes.pages == 2 and by_bytes.bytes == 2 * store.layout.bytes_per_page


def test_unknown_namespace_has_nothing_to_warm(tmp_path):
    store, _ = _seeded_store(tmp_path)
    assert hottest_prefixes(store, store.layout, Namespace("t1", "other"), 100).prefixes == []


def test_engine_pages_of_the_namespace_are_never_warm_prefixes(tmp_path):
    # An engine's pages name no tokens: a prefix built from them would be a request of no tokens (or of the
    # engine keys' bytes taken as token ids).
    store, _ = _seeded_store(tmp_path)
    hashes, origins = engine_origins(store.layout, T1, store.chain_key, [bytes([i]) * 32 for i in range(3)])
    store.put(hashes, [r.numpy() for r in SyntheticKV(store.layout).pages(hashes)], origins)
    _read(store, hashes, 9)  # hotter than every token prefix
    store.flush()
    plan = hottest_prefixes(store, store.layout, T1, max_pages=100)
    assert [len(p.tokens) // 4 for p in plan.prefixes] == [20, 16]
    assert all(p.tokens for p in plan.prefixes)


def test_warm_lands_pages_as_host_only_nodes_of_the_namespace(tmp_path):
    store, shared = _seeded_store(tmp_path)
    cache = l3_cache(store, page_size=PS, device_tokens=64, host_tokens=256, prefetch_policy="wait_complete")
    result = warm_namespace(cache, T1, max_pages=100)
    assert result.pages == 7 and result.hit_tokens == 28 and result.prefixes == 2
    assert result.namespace == T1.info(store.fingerprint_key) and not result.declined  # under the store's key
    assert cache.audit().ok
    from kvcache import Request
    m = cache.match(Request("probe", shared + [200] * 12, T1))
    assert m.device_tokens == 0 and m.host_tokens == 20
    other = cache.match(Request("probe2", shared + [300] * 4, Namespace("t2")))
    assert other.host_tokens == 0  # identical token ids, another namespace: nothing warmed for it
    assert cache.host_pool.used_pages == 7
    cache.close()


def test_warming_a_buffer_mode_cache_is_refused_before_anything_moves(tmp_path):
    import pytest

    from kvcache import InvalidInput
    from kvcache.types.config import HostMode

    store, _ = _seeded_store(tmp_path)
    c = l3_cache(store, host_mode=HostMode.BUFFER)
    with pytest.raises(InvalidInput, match="buffer"):
        warm_namespace(c, T1, max_pages=8)  # used to strand staged records and their anchor locks
    assert not c.staged_records() and not c.prefetch_ops() and c.host_pool.used_pages == 0
    assert c.audit().ok
    c.close()
    store.close()
