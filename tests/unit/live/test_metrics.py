"""kvcache.live.metrics: Prometheus families of a store's and a live cache's figures, exact and escaped."""

from prometheus_client.parser import text_string_to_metric_families

from factories import forward, l3_cache, make_layout, make_store
from kvcache import Namespace, Request
from kvcache.live.metrics import cache_families, exposition, store_families
from kvcache.live.protocol import LiveStats, NamespaceList, NamespacesRequest, StatsRequest
from kvcache.ops.handlers import execute


def _samples(text):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _served(tmp_path, ns, n_tokens):
    """A cache over a fresh LMDB store that served one request of `n_tokens` tokens in `ns`: (store, cache)."""
    store = make_store(tmp_path / "s", make_layout(4))
    cache = l3_cache(store)
    req = Request("r", list(range(n_tokens)), ns)
    forward(cache, req, cache.admit(req))
    cache.commit("r")
    return store, cache


def test_store_families_are_exact_and_label_namespaces(tmp_path):
    ns = Namespace('quote"back\\slash\nnewline', "salt")
    store, cache = _served(tmp_path, ns, 40)
    cache.close()
    stats = store.stats()
    text = exposition(store_families(stats, "/srv/kvc", store.namespaces()))
    values = _samples(text)
    assert values[("kvc_store_pages", (("backend", "lmdb"), ("store", "/srv/kvc")))] == stats.pages == 10
    labels = (("extra_key", ns.extra_key), ("salt_fingerprint", store.namespaces()[0].salt_fingerprint))
    assert values[("kvc_store_namespace_pages", labels)] == 10
    assert 'extra_key="quote\\"back\\\\slash\\nnewline"' in text  # escaped by prometheus_client
    assert "salt" not in text.replace("salt_fingerprint", "")
    big = exposition(store_families(type(stats)(**{**{f: getattr(stats, f) for f in stats.__struct_fields__},
                                                    "bytes": 62275584}), "/srv/kvc"))
    assert _samples(big)[("kvc_store_bytes", (("backend", "lmdb"), ("store", "/srv/kvc")))] == 62275584
    store.close()


def test_cache_families_count_hits_per_namespace_and_tier(tmp_path):
    store = make_store(tmp_path / "s", make_layout(4))
    cache = l3_cache(store)
    for i, ns in enumerate([Namespace("t1", "a"), Namespace("t2", "b")]):
        for turn in range(2):
            req = Request(f"r{i}{turn}", list(range(32)), ns)
            forward(cache, req, cache.admit(req))
            cache.commit(req.rid)
    live = execute(cache, StatsRequest())
    listing = execute(cache, NamespacesRequest())
    assert isinstance(live, LiveStats) and isinstance(listing, NamespaceList)
    values = _samples(exposition(cache_families(live, listing)))
    fp = Namespace("t1", "a").fingerprint(store.fingerprint_key)  # the cache shows its store's fingerprints
    assert values[("kvc_cache_hit_tokens_total", (("extra_key", "t1"), ("salt_fingerprint", fp),
                                                   ("tier", "device")))] == 32
    assert values[("kvc_cache_requests_total", (("outcome", "committed"),))] == 4
    assert values[("kvc_cache_pool_tokens", (("tier", "device"),))] == live.device.tokens
    assert ("kvc_store_pages_read_total", (("backend", "lmdb"), ("store", store.location))) in values
    cache.close()
    store.close()


def test_cache_families_show_each_namespace_share_beside_its_use(tmp_path):
    from kvcache.types.shares import Shares

    t1 = Namespace("t1", "a")
    store, cache = _served(tmp_path, t1, 32)
    cache.set_shares(t1, Shares(device_tokens=64, store_bytes=4096))
    values = _samples(exposition(cache_families(execute(cache, StatsRequest()), execute(cache, NamespacesRequest()))))
    labels = (("extra_key", "t1"), ("salt_fingerprint", t1.fingerprint(store.fingerprint_key)))
    assert values[("kvc_cache_namespace_share_tokens", (*labels, ("tier", "device")))] == 64
    assert values[("kvc_cache_namespace_share_tokens", (*labels, ("tier", "host")))] == 0
    assert values[("kvc_cache_namespace_share_bytes", labels)] == 4096
    assert values[("kvc_cache_namespace_tokens", (*labels, ("tier", "device")))] == 32
    cache.close()
    store.close()


def test_control_characters_in_label_values_never_reach_the_exposition_raw(tmp_path):
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

    from kvcache.live.metrics import registry_of

    hostile = "\x1b[31mred\x1b[0m\rover\ttab\x00nul\u202eevil\nsplit"
    ns = Namespace(hostile, "salt")
    store, cache = _served(tmp_path, ns, 40)
    families = list(cache_families(execute(cache, StatsRequest()), execute(cache, NamespacesRequest())))
    text = exposition(families)
    om = openmetrics_latest(registry_of(lambda: families)).decode()
    for rendering in (text, om):
        assert not any(c in rendering for c in "\x1b\r\t\x00\u202e")  # none raw, in either format
        assert 'extra_key="\\\\x1b[31mred\\\\x1b[0m\\\\rover\\\\ttab\\\\x00nul\\\\u202eevil\\nsplit"' in rendering
    from kvcache.live.metrics import label_value

    shown = "\\x1b[31mred\\x1b[0m\\rover\\ttab\\x00nul\\u202eevil\nsplit"  # what a parser reads back
    assert label_value(hostile) == shown
    values = _samples(text)
    fp = ns.fingerprint(store.fingerprint_key)
    assert values[("kvc_cache_namespace_tokens", (("extra_key", shown), ("salt_fingerprint", fp),
                                                   ("tier", "device")))] == 40
    cache.close()
    offline = exposition(store_families(store.stats(), "/srv/\x1bkvc", store.namespaces()))
    assert "\x1b" not in offline and 'store="/srv/\\\\x1bkvc"' in offline
    store.close()
