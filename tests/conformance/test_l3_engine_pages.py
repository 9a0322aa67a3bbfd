"""Engine-keyed pages (kvcache.storage.api: `engine_origins`, `PageOrigin.key`), run against every registered
backend through `factory`: a page an engine names by its own key is stored, read by key alone, checked, quarantined,
audited, limited and deleted exactly like a token page, and never read under another namespace or layout."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvcache.errors import InvalidInput, StoreUnsupported
from kvcache.storage.api import (
    CapacityPolicy,
    PageOrigin,
    PageOutcome,
    engine_hashes,
    engine_origins,
    page_origins,
)
from kvcache.types.keys import engine_page_hash, extend_chain, hash_root, pack_tokens
from kvcache.types.layout import KVLayout, Shard
from kvcache.types.namespace import Namespace
from kvcache.types.shares import Shares

LAYOUT = KVLayout("conformance-model@r1", layers=2, kv_heads=2, head_dim=16, dtype="float16", page_size=4)
NBYTES = LAYOUT.bytes_per_page
ENGINE = Namespace("sglang")  # how an engine adapter stores its pages: one namespace per engine instance
OTHER = Namespace("sglang-2")
TOKENS = Namespace("tenant-a", "conformance-salt-7f3a9c")
W, E, R = PageOutcome.WRITTEN, PageOutcome.EXISTING, PageOutcome.REJECTED


def engine_keys(n: int, seed: str = "chain") -> list[bytes]:
    """`n` engine page keys as SGLang makes them: 32 raw bytes of a SHA-256 chain."""
    keys, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + f"{seed}/{i}".encode()).digest()
        keys.append(prev)
    return keys


def page_payload(page_hash: bytes, nbytes: int = NBYTES) -> np.ndarray:
    """Deterministic page bytes derived from the page hash: every page's content is distinct and known."""
    return np.frombuffer(hashlib.shake_128(page_hash).digest(nbytes), dtype=np.uint8).copy()


def put_engine(store, keys, namespace=ENGINE, parent_key=None, layout=LAYOUT):
    """Put engine pages named by `keys` (chained from `parent_key`); (hashes, payloads, PutResult)."""
    hashes, origins = engine_origins(layout, namespace, store.chain_key, keys, parent_key)
    payloads = [page_payload(h, layout.bytes_per_page) for h in hashes]
    return hashes, payloads, store.put(hashes, payloads, origins)


def read(store, hashes, nbytes=NBYTES):
    """get_into fresh zeroed views; (count, views)."""
    out = np.zeros((len(hashes), nbytes), dtype=np.uint8)
    return store.get_into(hashes, list(out)), out


def kv_layer_segments(pool: np.ndarray, slot: int, layout: KVLayout = LAYOUT) -> list[np.ndarray]:
    """A page of an SGLang layer_first host pool as segments: K of each layer, then V of each layer, each
    `page_size` tokens, rows of a [2, layers, slots, page_size * kv_heads * head_dim * dtype bytes] array."""
    return [pool[kv, layer, slot] for kv in range(2) for layer in range(layout.layers)]


def new_pool(slots: int, layout: KVLayout = LAYOUT) -> np.ndarray:
    return np.zeros((2, layout.layers, slots, layout.bytes_per_page // (2 * layout.layers)), dtype=np.uint8)


# --- by key alone --------------------------------------------------------------------------------------------


def test_engine_pages_are_put_and_read_by_key_alone_from_a_fresh_handle(factory, location, store):
    keys = engine_keys(6)
    hashes, payloads, result = put_engine(store, keys)
    assert (result.written, result.existing, result.rejected) == (6, 0, 0)
    assert result.outcomes == bytes([W] * 6)
    assert store.exists_prefix(hashes) == 6
    fresh = factory.open(location, LAYOUT)  # another handle: it knows the keys and the namespace, nothing else
    try:
        again = engine_hashes(LAYOUT, ENGINE, fresh.chain_key, keys)
        assert again == hashes
        assert fresh.exists_prefix(again) == 6
        n, out = read(fresh, again)
        assert n == 6 and all(np.array_equal(x, y) for x, y in zip(out, payloads, strict=True))
        meta = fresh.page_meta(again[2])
        assert (meta.key, meta.tokens, meta.nbytes, meta.ns_id) == (keys[2], b"", NBYTES, ENGINE.id)
    finally:
        fresh.close()
    # the same pages again: stored already, each one says so
    _, _, again_result = put_engine(store, keys)
    assert (again_result.written, again_result.existing) == (0, 6)
    assert again_result.outcomes == bytes([E] * 6)
    assert store.verify().ok


def test_an_engine_page_hash_is_its_keys_under_the_namespace_root_and_nothing_else(store):
    keys = engine_keys(3)
    root = store.root(ENGINE)
    hashes, _, _ = put_engine(store, keys)
    assert hashes == [engine_page_hash(root, k) for k in keys]
    # neither a token chain step of the same bytes, nor the same key in another namespace or under another key
    assert hashes[0] != extend_chain(root, keys[0], 8)[0]
    assert engine_hashes(LAYOUT, OTHER, store.chain_key, keys)[0] != hashes[0]
    assert engine_hashes(LAYOUT, ENGINE, b"another chain key", keys)[0] != hashes[0]
    assert store.exists_prefix(engine_hashes(LAYOUT, OTHER, store.chain_key, keys)) == 0


@pytest.mark.parametrize("bad", ["wrong_hash", "tokens_too", "long_key", "other_root"])
def test_put_refuses_an_engine_page_whose_origin_does_not_name_its_hash(store, bad):
    key = engine_keys(1)[0]
    root = store.root(ENGINE)
    h = engine_page_hash(root, key)
    origin = PageOrigin(ENGINE, root, b"", key)
    if bad == "wrong_hash":
        h = extend_chain(root, key, 8)[0]  # the token chain step of the key's bytes
    elif bad == "tokens_too":
        origin = PageOrigin(ENGINE, root, pack_tokens(range(4)), key)
    elif bad == "long_key":
        origin = PageOrigin(ENGINE, root, b"", bytes(65))
    else:  # the key's hash in another namespace, filed as this one's
        h = engine_page_hash(store.root(OTHER), key)
    with pytest.raises(InvalidInput):
        store.put([h], [page_payload(h)], [origin])
    assert store.exists_prefix([h]) == 0 and store.stats().pages == 0


# --- parents: recorded when known, never required --------------------------------------------------------------


def test_an_unknown_parent_hangs_the_page_from_the_root_and_refuses_nothing(store):
    keys = engine_keys(8)
    # SGLang's prefetch below the root names the anchor's ancestors' keys: a parent this store never held
    hashes, payloads, result = put_engine(store, keys[4:], parent_key=keys[3])
    assert result.outcomes == bytes([W] * 4)
    root = store.root(ENGINE)
    assert store.page_meta(hashes[0]).parent == root
    assert [c.page_hash for c in store.children(root)] == [hashes[0]]
    assert [c.page_hash for c in store.children(hashes[0])] == [hashes[1]]  # the rest of the batch chains
    n, out = read(store, hashes)
    assert n == 4 and all(np.array_equal(x, y) for x, y in zip(out, payloads, strict=True))
    assert store.verify().ok


def test_a_known_parent_is_linked_and_children_name_keys_not_tokens(store):
    keys = engine_keys(8)
    first, _, _ = put_engine(store, keys[:4])
    later, _, _ = put_engine(store, keys[4:], parent_key=keys[3])  # another put, the parent stored
    root = store.root(ENGINE)
    assert store.page_meta(later[0]).parent == first[3]
    [child] = store.children(first[3])
    assert (child.page_hash, child.key, child.tokens, child.nbytes) == (later[0], keys[4], b"", NBYTES)
    assert [c.key for c in store.children(root)] == [keys[0]]
    walk, at = [], root  # the keys on the edges rebuild the engine's chain from the store alone
    while kids := store.children(at):
        walk.append(kids[0].key)
        at = kids[0].page_hash
    assert walk == keys
    assert store.verify().ok


def test_a_parent_of_another_namespace_or_a_token_rule_breaker_in_the_batch(store):
    """An engine page whose named parent is a stored page of another namespace hangs from its own root (its hash
    does not depend on the parent); a token page with an unknown parent still refuses its whole batch."""
    foreign, _, _ = put_engine(store, engine_keys(2, "other"), namespace=OTHER)
    key = engine_keys(1)[0]
    root = store.root(ENGINE)
    h = engine_page_hash(root, key)
    result = store.put([h], [page_payload(h)], [PageOrigin(ENGINE, foreign[1], b"", key)])
    assert result.outcomes == bytes([W])
    assert store.page_meta(h).parent == root
    token_hashes, token_origins = page_origins(LAYOUT, pack_tokens(range(8)), TOKENS, store.chain_key)
    key2 = engine_keys(2)[1]
    h2 = engine_page_hash(root, key2)
    with pytest.raises(InvalidInput, match="parent"):
        store.put([h2, token_hashes[1]], [page_payload(h2), page_payload(token_hashes[1])],
                  [PageOrigin(ENGINE, h, b"", key2), token_origins[1]])
    assert store.exists_prefix([h2]) == 0
    assert store.verify().ok


# --- outcomes per page -----------------------------------------------------------------------------------------


def test_put_says_what_became_of_each_page_under_a_share(store):
    store.set_shares(ENGINE, Shares(store_bytes=3 * NBYTES))
    keys = engine_keys(6)
    hashes, _, result = put_engine(store, keys)
    assert result.outcomes == bytes([W, W, W, R, R, R])
    assert (result.written, result.existing, result.rejected) == (3, 0, 3)
    assert store.exists_prefix(hashes) == 3
    store.set_shares(ENGINE, Shares())
    _, _, rest = put_engine(store, keys)
    assert rest.outcomes == bytes([E, E, E, W, W, W])
    assert store.exists_prefix(hashes) == 6


def test_a_repeat_in_one_batch_is_what_its_first_copy_became(store):
    a, b, c = engine_keys(3)
    store.set_shares(OTHER, Shares(store_bytes=NBYTES))
    hashes, origins = engine_origins(LAYOUT, OTHER, store.chain_key, [a, b, a, b])
    result = store.put(hashes, [page_payload(h) for h in hashes], origins)
    assert result.outcomes == bytes([W, R, E, R])
    assert (result.written, result.existing, result.rejected) == (1, 1, 2)
    put_engine(store, [a])
    hashes, origins = engine_origins(LAYOUT, ENGINE, store.chain_key, [a, c, c])
    assert store.put(hashes, [page_payload(h) for h in hashes], origins).outcomes == bytes([E, W, E])


def test_token_pages_get_outcomes_too(store):
    hashes, origins = page_origins(LAYOUT, pack_tokens(range(16)), TOKENS, store.chain_key)
    first = store.put(hashes[:2], [page_payload(h) for h in hashes[:2]], origins[:2])
    assert first.outcomes == bytes([W, W])
    second = store.put(hashes, [page_payload(h) for h in hashes], origins)
    assert second.outcomes == bytes([E, E, W, W])
    assert store.put([], [], []).outcomes == b""


# --- segment lists ---------------------------------------------------------------------------------------------


def test_segment_lists_put_and_get_into_are_the_contiguous_bytes(store):
    keys = engine_keys(5)
    hashes, origins = engine_origins(LAYOUT, ENGINE, store.chain_key, keys)
    src = new_pool(8)
    for slot in range(8):
        src[:, :, slot] = np.random.default_rng(slot).integers(0, 256, src[:, :, slot].shape, dtype=np.uint8)
    slots = [6, 1, 3, 0, 5]  # host slots are not in chain order
    pages = [kv_layer_segments(src, s) for s in slots]
    pages[2] = np.concatenate([seg.ravel() for seg in pages[2]])  # one page contiguous, in the same batch
    assert store.put(hashes, pages, origins).outcomes == bytes([W] * 5)
    n, flat = read(store, hashes)  # the page's bytes are its segments in order
    assert n == 5
    for got, s in zip(flat, slots, strict=True):
        assert np.array_equal(got, np.concatenate([seg.ravel() for seg in kv_layer_segments(src, s)]))
    dst = new_pool(8)
    assert store.get_into(hashes, [kv_layer_segments(dst, s) for s in slots]) == 5
    for s in range(8):
        assert np.array_equal(dst[:, :, s], src[:, :, s] if s in slots else np.zeros_like(src[:, :, s]))
    # token pages take segments alike
    token_hashes, token_origins = page_origins(LAYOUT, pack_tokens(range(8)), TOKENS, store.chain_key)
    store.put(token_hashes, [kv_layer_segments(src, 2), kv_layer_segments(src, 4)], token_origins)
    tokens_dst = new_pool(2)
    assert store.get_into(token_hashes, [kv_layer_segments(tokens_dst, i) for i in range(2)]) == 2
    assert np.array_equal(tokens_dst[:, :, 0], src[:, :, 2]) and np.array_equal(tokens_dst[:, :, 1], src[:, :, 4])
    assert store.verify().ok


def test_segment_lists_that_are_not_a_page_are_refused(store):
    hashes, _, _ = put_engine(store, engine_keys(1))
    short = new_pool(1)
    with pytest.raises(InvalidInput):
        store.get_into(hashes, [kv_layer_segments(short, 0)[:-1]])  # a segment short of a page
    frozen = [seg.copy() for seg in kv_layer_segments(short, 0)]
    frozen[1].flags.writeable = False
    with pytest.raises(InvalidInput):
        store.get_into(hashes, [frozen])
    with pytest.raises(InvalidInput):
        store.get_into(hashes, [[]])
    with pytest.raises(InvalidInput):
        store.get_into(hashes, [[[np.zeros(NBYTES, np.uint8)]]])  # a list inside a list is no buffer
    key = engine_keys(2)[1]
    h, origins = engine_origins(LAYOUT, ENGINE, store.chain_key, [key])
    with pytest.raises(InvalidInput):
        store.put(h, [[np.zeros(NBYTES // 2, np.uint8)] * 3], origins)
    assert store.exists_prefix(h) == 0


# --- checksums, quarantine, audit ------------------------------------------------------------------------------


def test_a_flipped_byte_in_an_engine_page_is_a_miss_quarantined_reported_and_never_served(factory, location):
    s = factory.open(location, LAYOUT)
    keys = engine_keys(6)
    hashes, payloads, _ = put_engine(s, keys)
    s.close()
    factory.corrupt(location, payloads[2].tobytes())
    s = factory.open(location, LAYOUT)
    try:
        report = s.verify()
        assert [(f.kind, f.page_hash) for f in report.findings] == [("checksum_mismatch", hashes[2].hex())]
        dst = new_pool(6)
        assert s.get_into(hashes, [kv_layer_segments(dst, i) for i in range(6)]) == 2  # segments: checked too
        for i in range(2):
            assert np.array_equal(np.concatenate([seg.ravel() for seg in kv_layer_segments(dst, i)]), payloads[i])
        assert not dst[:, :, 3:].any()  # the read stopped at the corrupt page
        assert s.stats().counters.checksum_failures == 1
        assert s.exists_prefix(hashes[2:]) == 0  # quarantined: a miss from now on
        assert read(s, hashes[2:3])[0] == 0
        assert read(s, hashes[3:])[0] == 3  # the pages after it are sound and read by key
        assert s.verify(repair=True).repaired >= 1
        assert s.verify().ok
        put_engine(s, keys)  # the engine writes its pages again: healed
        n, out = read(s, hashes)
        assert n == 6 and all(np.array_equal(x, y) for x, y in zip(out, payloads, strict=True))
        assert s.verify().ok
    finally:
        s.close()


# --- reads credit every page served ----------------------------------------------------------------------------


def heat(store, page_hash: bytes) -> float:
    """The latest access a page carries: its own or its subtree's, as `children()` of its parent reports it (what
    eviction goes by)."""
    parent = store.page_meta(page_hash).parent
    [child] = [c for c in store.children(parent) if c.page_hash == page_hash]
    return child.last_access


def test_every_page_a_read_served_is_credited(store):
    keys = engine_keys(4)
    # unchained: each page hangs from the root, as SGLang's pages do when no parent is known
    hashes = [put_engine(store, [k])[0][0] for k in keys]
    written = [store.page_meta(h).last_access for h in hashes]
    assert read(store, hashes)[0] == 4
    store.flush()
    metas = [store.page_meta(h) for h in hashes]
    assert len({m.last_access for m in metas}) == 1  # one read, one time, in every page it served
    assert all(m.last_access > w for m, w in zip(metas, written, strict=True))
    assert [m.hits for m in metas] == [0, 0, 0, 1]  # the read's hit counts at its deepest page
    record = {r.ns_id_hex: r for r in store.namespaces()}[ENGINE.id_hex]
    assert record.hits == 4 and record.last_access == metas[0].last_access
    # chained pages (an engine chain, a token chain): each carries the read's time, itself or through its child
    chain, _, _ = put_engine(store, engine_keys(3, "chained"))
    token_hashes, token_origins = page_origins(LAYOUT, pack_tokens(range(12)), TOKENS, store.chain_key)
    store.put(token_hashes, [page_payload(h) for h in token_hashes], token_origins)
    for run in (chain, token_hashes):
        before = max(store.page_meta(h).last_access for h in run)
        assert read(store, run)[0] == 3
        store.flush()
        times = {heat(store, h) for h in run}
        assert len(times) == 1 and times.pop() > before
        assert [store.page_meta(h).hits for h in run] == [0, 0, 1]


@pytest.mark.parametrize("chained", [False, True])
def test_a_page_just_read_is_not_the_lru_victim(factory, location, chained):
    try:
        s = factory.open(location, LAYOUT, capacity=CapacityPolicy(capacity_bytes=8 * NBYTES, evict_headroom=0.0))
    except StoreUnsupported:
        pytest.skip("this backend evicts nothing itself (its server's memory policy does)")
    try:
        if chained:  # the oldest pages, one engine chain
            read_first = put_engine(s, engine_keys(4, "read"))[0]
        else:  # the oldest pages, each hanging from the root
            read_first = [put_engine(s, [k])[0][0] for k in engine_keys(4, "read")]
        later = [put_engine(s, [k])[0][0] for k in engine_keys(4, "later")]
        assert read(s, read_first)[0] == 4  # now the most recently used, every one of them
        _, _, result = put_engine(s, engine_keys(1, "new"))
        assert result.outcomes == bytes([W]) and result.evicted == 1
        assert result.evicted_hashes == [later[0]]
        assert s.exists_prefix(read_first) == 4
    finally:
        s.close()


# --- namespaces, deletion, layouts -----------------------------------------------------------------------------


def test_engine_pages_are_a_namespace_like_any_other(store):
    hashes, _, _ = put_engine(store, engine_keys(5))
    other, _, _ = put_engine(store, engine_keys(3), namespace=OTHER)
    token_hashes, token_origins = page_origins(LAYOUT, pack_tokens(range(16)), TOKENS, store.chain_key)
    store.put(token_hashes, [page_payload(h) for h in token_hashes], token_origins)
    records = {r.ns_id_hex: r for r in store.namespaces()}
    engine = records[ENGINE.id_hex]
    assert (engine.extra_key, engine.salt_fingerprint, engine.pages, engine.bytes) == ("sglang", None, 5,
                                                                                       5 * NBYTES)
    assert engine.roots == [store.root(ENGINE).hex()]
    result = store.delete_namespace(ENGINE.id)
    assert (result.pages, result.bytes) == (5, 5 * NBYTES)
    assert store.exists_prefix(hashes) == 0 and store.exists_prefix(hashes[2:]) == 0
    assert store.exists_prefix(other) == 3 and store.exists_prefix(token_hashes) == 4
    assert ENGINE.id_hex not in {r.ns_id_hex for r in store.namespaces()}
    assert store.stats().pages == 7
    assert store.verify().ok


def test_token_pages_beside_engine_pages_are_unaffected(store):
    ns = Namespace("sglang")  # the same namespace holds both kinds
    token_hashes, token_origins = page_origins(LAYOUT, pack_tokens(range(16)), ns, store.chain_key)
    payloads = [page_payload(h) for h in token_hashes]
    store.put(token_hashes, payloads, token_origins)
    engine, _, _ = put_engine(store, engine_keys(3), namespace=ns)
    root = store.root(ns)
    assert {c.page_hash for c in store.children(root)} == {token_hashes[0], engine[0]}
    [token_child] = [c for c in store.children(root) if c.page_hash == token_hashes[0]]
    assert (token_child.key, token_child.tokens) == (b"", pack_tokens(range(4)))
    assert store.page_meta(token_hashes[1]).key == b""
    n, out = read(store, token_hashes)
    assert n == 4 and all(np.array_equal(x, y) for x, y in zip(out, payloads, strict=True))
    assert store.verify().ok


ENGINE_BASE = dict(model="conformance-engine@r1", layers=2, kv_heads=1, head_dim=32, dtype="float16", page_size=4)
VARIANTS = {
    "tp0of2": KVLayout(**ENGINE_BASE, shard=Shard(0, 2)),
    "tp1of2": KVLayout(**ENGINE_BASE, shard=Shard(1, 2)),
    "pp1of2": KVLayout(**ENGINE_BASE, shard=Shard(0, 2, pp_rank=1, pp_size=2)),
    "kv_layer": KVLayout(**ENGINE_BASE, arrangement="kv_layer"),
    "kv_token": KVLayout(**ENGINE_BASE, arrangement="kv_token"),
    "mla": KVLayout(**ENGINE_BASE, mla=True),
    "plain": KVLayout(**ENGINE_BASE),
}


def test_layouts_differing_only_in_shard_mla_or_arrangement_never_read_each_others_pages(factory, location):
    keys = engine_keys(3)
    handles = {name: factory.open(location, layout) for name, layout in VARIANTS.items()}
    try:
        chain_key = handles["plain"].chain_key
        expected = {name: engine_hashes(VARIANTS[name], ENGINE, chain_key, keys) for name in VARIANTS}
        assert len({h for hashes in expected.values() for h in hashes}) == 3 * len(VARIANTS)
        written: dict[str, list[np.ndarray]] = {}
        for name, s in handles.items():
            for other in written:  # before this layout writes, none of its pages is there, whoever wrote first
                assert s.exists_prefix(expected[name]) == 0, (name, other)
            hashes, payloads, result = put_engine(s, keys, layout=VARIANTS[name])
            assert hashes == expected[name] and result.outcomes == bytes([W] * 3)
            written[name] = payloads
        for name, s in handles.items():
            n, out = read(s, expected[name], VARIANTS[name].bytes_per_page)
            assert n == 3 and all(np.array_equal(x, y) for x, y in zip(out, written[name], strict=True))
        assert handles["plain"].verify().ok
    finally:
        for s in handles.values():
            s.close()


def test_an_engine_layouts_root_is_its_own(store):
    mla = VARIANTS["mla"]
    assert hash_root(mla.layout_id, ENGINE, store.chain_key) != store.root(ENGINE)
    assert mla.bytes_per_page == VARIANTS["plain"].bytes_per_page // 2  # one latent, no V


def test_three_threads_write_and_read_engine_pages_at_once(store):
    """SGLang calls its storage from several threads at once (prefetch, backup, the scheduler's exists): puts of
    overlapping chains and reads of what was acknowledged interleave without an error or a wrong byte."""
    import threading

    errors: list[str] = []
    acked: list[tuple[list[bytes], list[np.ndarray]]] = []
    lock = threading.Lock()

    def worker(seed: int) -> None:
        try:
            for round_ in range(12):
                keys = engine_keys(6, f"shared/{round_ % 4}")[: 3 + seed]  # overlapping chains across threads
                hashes, payloads, result = put_engine(store, keys)
                if len(result.outcomes) != len(keys) or R in result.outcomes:
                    errors.append(f"thread {seed}: outcomes {list(result.outcomes)}")
                with lock:
                    acked.append((hashes, payloads))
                    done = list(acked)
                for hashes, payloads in done[-3:]:
                    n, out = read(store, hashes)
                    if n != len(hashes) or not all(np.array_equal(x, y) for x, y in zip(out, payloads, strict=True)):
                        errors.append(f"thread {seed}: read {n}/{len(hashes)} or wrong bytes")
        except Exception as exc:  # an exception in a thread must fail the test, not vanish
            errors.append(f"thread {seed}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert store.stats().pages == 4 * 5  # four chains, five keys at most each
    assert store.verify().ok


def test_an_engine_page_never_becomes_its_own_ancestor(factory, location):
    """A parent hint that would close a loop is not taken: a page named as its own parent, or a page written
    again after its corrupt copy was dropped, under one of the pages that hung below that copy, hangs from its
    root (a cycle would never be evicted, and no walk from the root would reach it)."""
    s = factory.open(location, LAYOUT)
    keys = engine_keys(3)
    hashes, payloads, _ = put_engine(s, keys)
    root = s.root(ENGINE)
    own = engine_page_hash(root, engine_keys(4)[3])
    s.put([own], [page_payload(own)], [PageOrigin(ENGINE, own, b"", engine_keys(4)[3])])
    assert s.page_meta(own).parent == root
    s.close()
    factory.corrupt(location, payloads[0].tobytes())
    s = factory.open(location, LAYOUT)
    try:
        assert read(s, hashes)[0] == 0  # the first page is corrupt: quarantined
        s.flush()  # ... and dropped; the pages below it wait for it
        assert s.page_meta(hashes[0]) is None and s.page_meta(hashes[1]).parent == hashes[0]
        # the engine writes the first page again, naming the last of the chain as its parent
        result = s.put(hashes[:1], payloads[:1], [PageOrigin(ENGINE, hashes[2], b"", keys[0])])
        assert result.outcomes == bytes([W])
        assert s.page_meta(hashes[0]).parent == root  # not below its own subtree
        n, out = read(s, hashes)
        assert n == 3 and all(np.array_equal(x, y) for x, y in zip(out, payloads, strict=True))
        assert s.verify().ok  # the chain is whole again, every page reachable from the root
    finally:
        s.close()
