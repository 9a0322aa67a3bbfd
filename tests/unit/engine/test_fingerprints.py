"""A cache shows every namespace under its own store's fingerprint key (issue 35 item 4): a library user who opens
a cache on a store sees in every output the salt fingerprints and display ids the store's registry (`kvc ns ls`)
shows, with nothing to set up; two stores with different keys in one process each show their own."""

import pytest

from factories import forward, l3_cache, make_layout, make_store
from kvcache import BlockStored, Namespace, Request, TTLPolicy
from kvcache.live.protocol import NamespacesRequest
from kvcache.ops.handlers import execute
from kvcache.types.namespace import display_id

PS = 4
TENANT = Namespace("t1", "library-user-salt")
TOKENS = list(range(100, 132))  # 8 pages


def _serve(cache, rid: str, ns: Namespace = TENANT) -> Request:
    request = Request(rid, TOKENS, ns)
    forward(cache, request, cache.admit(request))
    cache.commit(rid)
    cache.flush()  # the pages reach L3: the store's registry records the namespace
    return request


def _shown(cache, store, request: Request) -> dict[str, set]:
    """Every salt fingerprint and display id `cache`'s outputs show for `request`'s namespace, by output."""
    ns = request.namespace
    events: list = []
    cache.attach_events(events.append)
    rows = [r for r in execute(cache, NamespacesRequest()).namespaces if r.extra_key == ns.extra_key]
    prefetch = cache.prefetch(Request("again", TOKENS + [7] * PS, ns))  # what it holds goes with the drop below
    shown = {
        "snapshot": {n.info.salt_fingerprint for n in cache.snapshot().namespaces if n.info.extra_key},
        "stats": {h.namespace.salt_fingerprint for h in cache.stats().hits},
        "explain": {cache.explain(request).namespace.salt_fingerprint},
        "prefetch": {prefetch.namespace.salt_fingerprint} if prefetch.namespace is not None else set(),
        "listing": {r.salt_fingerprint for r in rows},
        "events": {e.salt_fingerprint for b in events for e in b.events if isinstance(e, BlockStored)},
        "ttl": {t.namespace.salt_fingerprint for t in cache.namespace_ttls()},
        "listing id": {r.id for r in rows},
        "ttl id": {t.id for t in cache.namespace_ttls()},
    }
    drop = cache.drop_namespace(ns)
    shown["drop"], shown["drop id"] = {drop.namespace.salt_fingerprint}, {drop.namespace_id}
    return shown


def _registry(store, ns: Namespace) -> tuple[str, str]:
    """(salt fingerprint, display id) of `ns` as the store shows it: its registry's record, its key's id."""
    [record] = [r for r in store.namespaces() if r.ns_id_hex == ns.id_hex]
    return record.salt_fingerprint, display_id(ns.id, store.fingerprint_key)


def _check(cache, store) -> str:
    request = _serve(cache, "r")
    fingerprint, shown_id = _registry(store, request.namespace)
    assert fingerprint is not None and len(fingerprint) == 12
    for output, values in _shown(cache, store, request).items():
        assert values == ({shown_id} if output.endswith(" id") else {fingerprint}), output
    return fingerprint


def _ttl_cache(store):
    return l3_cache(store, page_size=PS, ttl=TTLPolicy(default_ttl_s=3600.0))


def test_a_cache_on_a_fresh_store_shows_its_registrys_fingerprints_with_nothing_set_up(tmp_path, monkeypatch):
    monkeypatch.delenv("KVC_FINGERPRINT_KEY", raising=False)  # a fresh store draws a key of its own
    store = make_store(tmp_path / "store", make_layout(PS))
    try:
        _check(_ttl_cache(store), store)
    finally:
        store.close()


def test_two_stores_with_different_keys_in_one_process_each_show_their_own(tmp_path, monkeypatch):
    monkeypatch.delenv("KVC_FINGERPRINT_KEY", raising=False)
    a = make_store(tmp_path / "a", make_layout(PS))
    b = make_store(tmp_path / "b", make_layout(PS))
    try:
        assert a.fingerprint_key != b.fingerprint_key
        cache_a, cache_b = _ttl_cache(a), _ttl_cache(b)  # both open at once
        assert _check(cache_a, a) != _check(cache_b, b)
    finally:
        a.close()
        b.close()


def test_a_cache_without_a_store_keys_by_env_else_by_a_key_of_its_own(tmp_path, monkeypatch):
    from factories import make_cache

    monkeypatch.delenv("KVC_FINGERPRINT_KEY", raising=False)
    one, two = make_cache(PS), make_cache(PS)
    assert one.fingerprints.fingerprint(TENANT) != two.fingerprints.fingerprint(TENANT)  # no key of the process
    monkeypatch.setenv("KVC_FINGERPRINT_KEY", "ab" * 32)
    assert make_cache(PS).fingerprints.fingerprint(TENANT) == TENANT.fingerprint(b"\xab" * 32)


@pytest.mark.parametrize("keyed", [True, False])
def test_a_store_key_wins_over_env(tmp_path, monkeypatch, keyed):
    monkeypatch.delenv("KVC_FINGERPRINT_KEY", raising=False)
    store = make_store(tmp_path / "store", make_layout(PS))
    try:
        if keyed:
            monkeypatch.setenv("KVC_FINGERPRINT_KEY", "cd" * 32)  # the deployment's key: not this store's
        cache = l3_cache(store, page_size=PS)
        assert cache.fingerprints.fingerprint(TENANT) == TENANT.fingerprint(store.fingerprint_key)
        cache.close()
    finally:
        store.close()
