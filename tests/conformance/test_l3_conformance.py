"""The L3 contract (kvcache.storage.api), run against every registered backend through `factory`."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest
import torch

from kvcache.errors import LayoutMismatch, StoreError
from kvcache.storage.api import L3Store, PageOutcome, page_origins, stored
from kvcache.storage.registry import open_store
from kvcache.types.keys import pack_tokens
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace

LAYOUT = KVLayout("conformance-model@r1", layers=2, kv_heads=2, head_dim=16, dtype="float16", page_size=4)
OTHER_LAYOUT = KVLayout("conformance-model@r2", layers=2, kv_heads=2, head_dim=16, dtype="float16", page_size=4)

SALT = "conformance-salt-7f3a9c"
NS_A = Namespace("tenant-a", SALT)
NS_B = Namespace("tenant-b", SALT)


def page_payload(page_hash: bytes, nbytes: int) -> np.ndarray:
    """Deterministic page bytes derived from the page hash: every page's content is distinct and known."""
    return np.frombuffer(hashlib.shake_128(page_hash).digest(nbytes), dtype=np.uint8).copy()


def test_suite_layouts_are_the_fixtures(layout, other_layout):
    assert (layout, other_layout) == (LAYOUT, OTHER_LAYOUT)


def write(store, tokens, namespace, layout=LAYOUT):
    """Put the whole pages of `tokens`; return (hashes, payloads)."""
    hashes, origins = page_origins(layout, pack_tokens(tokens), namespace, store.chain_key)
    payloads = [page_payload(h, layout.bytes_per_page) for h in hashes]
    result = store.put(hashes, payloads, origins)
    assert result.written + result.existing == len(hashes)
    return hashes, payloads


def read(store, hashes, layout=LAYOUT):
    """get_into fresh zeroed views; return (count, views)."""
    out = np.zeros((len(hashes), layout.bytes_per_page), dtype=np.uint8)
    n = store.get_into(hashes, list(out))
    return n, out


def test_backend_implements_the_protocol(store):
    assert isinstance(store, L3Store)


def test_put_get_round_trip_is_bit_exact(store):
    hashes, payloads = write(store, range(40), NS_A)
    n, out = read(store, hashes)
    assert n == len(hashes) == 10
    for got, want in zip(out, payloads, strict=True):
        assert np.array_equal(got, want)


def test_get_into_torch_views_of_one_host_tensor(store):
    hashes, payloads = write(store, range(24), NS_A)
    slots = torch.zeros((8, LAYOUT.bytes_per_page), dtype=torch.uint8)
    order = [5, 0, 7, 2, 1, 6]  # L2 slots are not in chain order
    assert store.get_into(hashes, [slots[i] for i in order]) == 6
    for i, want in zip(order, payloads, strict=True):
        assert np.array_equal(slots[i].numpy(), want)
    assert int(slots[3].sum()) == 0 and int(slots[4].sum()) == 0  # untouched slots stay untouched


def test_put_of_stored_pages_leaves_them_and_counts_them(store):
    hashes, _ = write(store, range(16), NS_A)
    hashes2, origins = page_origins(LAYOUT, pack_tokens(range(24)), NS_A, store.chain_key)
    result = store.put(hashes2, [page_payload(h, LAYOUT.bytes_per_page) for h in hashes2], origins)
    assert (result.existing, result.written) == (4, 2)
    assert store.stats().pages == 6


def test_exists_prefix_counts_from_the_start_and_stops_at_the_first_gap(store):
    hashes, _ = write(store, range(32), NS_A)
    gap = page_origins(LAYOUT, pack_tokens(range(500, 504)), NS_A, store.chain_key)[0][0]  # a page never stored
    asked = hashes[:3] + [gap] + hashes[4:]
    assert store.exists_prefix(asked) == 3
    assert store.exists_prefix(hashes[4:]) == 4
    assert store.exists_prefix(asked[3:]) == 0
    assert store.exists_prefix([]) == 0
    n, _ = read(store, asked)
    assert n == 3


def test_put_refuses_a_chain_whose_parent_is_not_stored(store):
    """No orphan enters the store through put: a chain continues a stored page of its namespace or starts at its
    namespace root. (A writer whose parent was evicted meanwhile gets the error and writes the path again.)"""
    from kvcache.errors import InvalidInput

    hashes, origins = page_origins(LAYOUT, pack_tokens(range(32)), NS_A, store.chain_key)
    with pytest.raises(InvalidInput, match="parent"):
        store.put(hashes[4:], [page_payload(h, LAYOUT.bytes_per_page) for h in hashes[4:]], origins[4:])
    assert store.exists_prefix(hashes[4:]) == 0 and store.verify().ok


def test_a_miss_is_a_value(store):
    hashes, _ = page_origins(LAYOUT, pack_tokens(range(8)), NS_A, store.chain_key)
    assert store.exists_prefix(hashes) == 0
    n, out = read(store, hashes)
    assert n == 0 and not out.any()


def test_namespaces_never_see_each_others_pages_for_identical_tokens(store):
    tokens = list(range(100, 140))
    ha, pa = write(store, tokens, NS_A)
    hb, _ = page_origins(LAYOUT, pack_tokens(tokens), NS_B, store.chain_key)
    assert set(ha).isdisjoint(hb)
    assert store.exists_prefix(hb) == 0
    assert read(store, hb)[0] == 0
    hb, pb = write(store, tokens, NS_B)
    na, outa = read(store, ha)
    nb, outb = read(store, hb)
    assert na == nb == 10
    assert all(np.array_equal(x, y) for x, y in zip(outa, pa, strict=True))
    assert all(np.array_equal(x, y) for x, y in zip(outb, pb, strict=True))
    assert not any(np.array_equal(x, y) for x, y in zip(outa, outb, strict=True))


def test_only_the_salt_differs_and_still_no_sharing(store):
    plain = Namespace("tenant-a")
    hashes, _ = write(store, range(16), NS_A)
    other, _ = page_origins(LAYOUT, pack_tokens(range(16)), plain, store.chain_key)
    assert store.exists_prefix(other) == 0


def test_layouts_never_see_each_others_pages(factory, location):
    tokens = list(range(64))
    first = factory.open(location, LAYOUT)
    ha, _ = write(first, tokens, NS_A, LAYOUT)
    second = factory.open(location, OTHER_LAYOUT)
    try:
        hb, _ = page_origins(OTHER_LAYOUT, pack_tokens(tokens), NS_A, second.chain_key)
        assert set(ha).isdisjoint(hb)
        assert second.exists_prefix(hb) == 0
        assert read(second, hb, OTHER_LAYOUT)[0] == 0
        hb, _ = write(second, tokens, NS_A, OTHER_LAYOUT)
        assert {lay.layout_id for lay in second.layouts()} == {LAYOUT.layout_id, OTHER_LAYOUT.layout_id}
        assert first.exists_prefix(ha) == second.exists_prefix(hb) == 16
    finally:
        second.close()
        first.close()


def test_opening_with_a_layout_the_store_does_not_hold_names_the_held_ones(factory, location, store):
    write(store, range(8), NS_A)
    with pytest.raises(LayoutMismatch) as info:
        open_store(location, OTHER_LAYOUT)
    assert info.value.held == [LAYOUT.describe()]
    assert OTHER_LAYOUT.describe() == info.value.requested
    assert "conformance-model@r1" in str(info.value)


def test_delete_namespace_removes_exactly_one_namespace(store):
    ha, _ = write(store, range(40), NS_A)
    hb, pb = write(store, range(40), NS_B)
    result = store.delete_namespace(NS_A.id)
    assert (result.pages, result.bytes) == (10, 10 * LAYOUT.bytes_per_page)
    assert store.exists_prefix(ha) == 0
    nb, outb = read(store, hb)
    assert nb == 10 and all(np.array_equal(x, y) for x, y in zip(outb, pb, strict=True))
    assert [r.ns_id_hex for r in store.namespaces()] == [NS_B.id_hex]
    assert store.stats().pages == 10
    assert store.verify().ok


def test_namespace_registry_keeps_identity_and_counters_never_the_salt(store):
    write(store, range(40), NS_A)
    hashes, _ = write(store, range(8), NS_B)
    read(store, hashes)
    store.flush()
    records = {r.ns_id_hex: r for r in store.namespaces()}
    a, b = records[NS_A.id_hex], records[NS_B.id_hex]
    # the registry's fingerprint is keyed by the store's own fingerprint key (kvcache.types.namespace)
    assert (a.extra_key, a.salt_fingerprint, a.pages, a.bytes) == (
        "tenant-a", NS_A.fingerprint(store.fingerprint_key), 10, 10 * LAYOUT.bytes_per_page)
    assert (b.pages, b.hits) == (2, 2)
    assert b.last_access >= b.created
    assert SALT not in repr(records)


def test_prefix_tree_walks_from_the_namespace_root_hottest_first(store):
    shared = list(range(8))
    h1, _ = write(store, shared + [1] * 8, NS_A)
    h2, _ = write(store, shared + [2] * 8, NS_A)
    read(store, h2)
    read(store, h2)
    store.flush()
    root = store.root(NS_A)
    record = next(r for r in store.namespaces() if r.ns_id_hex == NS_A.id_hex)
    assert record.roots == [root.hex()]
    level0 = store.children(root)
    assert [c.page_hash for c in level0] == [h1[0]]
    level2 = store.children(h1[1])
    assert [c.page_hash for c in level2] == [h2[2], h1[2]]  # h2's branch has the hits
    assert level2[0].hits == 2 and level2[1].hits == 0
    # The tokens on the edges rebuild the sequence: the tree is walkable from the store alone.
    walk, at = b"", root
    for _ in range(4):
        child = store.children(at)[0]
        walk += child.tokens
        at = child.page_hash
    assert walk == pack_tokens(shared + [2] * 8)
    assert store.children(h2[-1]) == []


def test_verify_finds_injected_corruption_and_the_page_is_never_served(factory, location):
    s = factory.open(location, LAYOUT)
    hashes, payloads = write(s, range(40), NS_A)
    assert s.verify().ok
    s.close()
    factory.corrupt(location, payloads[4].tobytes())
    s = factory.open(location, LAYOUT)
    try:
        report = s.verify()
        assert not report.ok
        assert [(f.kind, f.page_hash) for f in report.findings] == [("checksum_mismatch", hashes[4].hex())]
        n, out = read(s, hashes)
        assert n == 4
        assert s.stats().counters.checksum_failures == 1
        assert s.exists_prefix(hashes) == 4  # known corrupt: a miss from now on
        repaired = s.verify(repair=True)
        assert repaired.repaired == 1
        assert s.verify().ok
        write(s, range(40), NS_A)  # a later writer heals the chain
        n, out = read(s, hashes)
        assert n == 10 and np.array_equal(out[4], payloads[4])
    finally:
        s.close()


def test_pages_and_registry_survive_reopen(factory, location):
    s = factory.open(location, LAYOUT)
    hashes, payloads = write(s, range(40), NS_A)
    read(s, hashes[:3])
    s.close()
    s = factory.open(location, LAYOUT)
    try:
        n, out = read(s, hashes)
        assert n == 10 and all(np.array_equal(x, y) for x, y in zip(out, payloads, strict=True))
        record = s.namespaces()[0]
        assert (record.pages, record.hits) == (10, 3)
        assert s.verify().ok
    finally:
        s.close()


def test_concurrent_readers_during_writes(store):
    stable, stable_payloads = write(store, range(64), NS_A)
    errors: list[str] = []
    written: list[tuple[list[bytes], list[np.ndarray]]] = []
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            n, out = read(store, stable)
            if n != len(stable) or not all(np.array_equal(x, y) for x, y in zip(out, stable_payloads, strict=True)):
                errors.append(f"stable prefix read {n} pages or wrong bytes")
            for hashes, payloads in list(written):
                n, out = read(store, hashes)
                if n != len(hashes) or not all(np.array_equal(x, y) for x, y in zip(out, payloads, strict=True)):
                    errors.append(f"acknowledged batch read {n}/{len(hashes)} pages or wrong bytes")

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for i in range(30):
            written.append(write(store, range(1000 * i, 1000 * i + 32), NS_B))
    finally:
        done.set()
        for t in threads:
            t.join()
    assert errors == []
    assert store.verify().ok


def test_put_refuses_a_page_whose_parent_is_another_namespaces_root(store):
    """The chain check cannot see the namespace when the parent is a namespace root: a page tagged B whose parent
    is A's root would be read by A (its hash is in A's chain) and survive delete_namespace(A)."""
    from kvcache.errors import InvalidInput
    from kvcache.storage.api import PageOrigin
    from kvcache.types.keys import extend_chain, hash_root

    write(store, range(8), NS_A)
    tokens = pack_tokens(range(50, 54))
    for foreign_root in (hash_root(LAYOUT.layout_id, NS_A, store.chain_key),  # a root with pages under it
                         hash_root(LAYOUT.layout_id, Namespace("tenant-c", SALT), store.chain_key)):  # and one without
        h = extend_chain(foreign_root, tokens, LAYOUT.page_size)[0]
        with pytest.raises(InvalidInput, match="parent"):
            store.put([h], [page_payload(h, LAYOUT.bytes_per_page)], [PageOrigin(NS_B, foreign_root, tokens)])
        assert store.exists_prefix([h]) == 0
    assert NS_B.id_hex not in {r.ns_id_hex for r in store.namespaces()}


# --- shares (kvcache.types.shares) -------------------------------------------------------------------------------


def test_shares_are_kept_with_the_registry_never_the_salt_and_outlive_the_pages(factory, location, store):
    from kvcache.types.shares import Shares

    assert store.shares() == []
    write(store, range(8), NS_A)
    store.set_shares(NS_A, Shares(device_tokens=64, host_tokens=128, store_bytes=4096))
    store.set_shares(NS_B, Shares(device_tokens=8))  # before the namespace has any page
    other = factory.open(location, LAYOUT)  # another handle (another process would see the same)
    try:
        got = {r.ns_id_hex: r for r in other.shares()}
    finally:
        other.close()
    assert set(got) == {NS_A.id_hex, NS_B.id_hex}
    a = got[NS_A.id_hex]
    assert (a.shares, a.extra_key, a.salt_fingerprint) == (
        Shares(64, 128, 4096), "tenant-a", NS_A.fingerprint(store.fingerprint_key))
    assert SALT not in repr(got)
    store.delete_namespace(NS_A.id)  # policy, not data: the share stays
    assert {r.ns_id_hex for r in store.shares()} == {NS_A.id_hex, NS_B.id_hex}
    store.set_shares(NS_A, Shares())  # all zero clears
    assert [r.ns_id_hex for r in store.shares()] == [NS_B.id_hex]
    assert store.verify().ok


def test_a_store_share_bounds_its_namespace_and_no_other(store):
    from kvcache.types.shares import Shares

    nbytes = LAYOUT.bytes_per_page
    store.set_shares(NS_A, Shares(store_bytes=3 * nbytes))
    hashes, origins = page_origins(LAYOUT, pack_tokens(range(40)), NS_A, store.chain_key)
    result = store.put(hashes, [page_payload(h, nbytes) for h in hashes], origins)
    assert result.written + result.existing + result.rejected == 10
    assert result.written <= 3
    write(store, range(40), NS_B)  # no share, no quota: all of it
    records = {r.ns_id_hex: r for r in store.namespaces()}
    assert records[NS_A.id_hex].bytes <= 3 * nbytes and records[NS_B.id_hex].pages == 10
    assert store.exists_prefix(hashes) == records[NS_A.id_hex].pages  # what is stored of the chain is a prefix
    store.set_shares(NS_A, Shares())
    write(store, range(40), NS_A)  # cleared: the namespace takes the rest
    assert store.exists_prefix(hashes) == 10
    assert store.verify().ok


def test_the_chain_roots_are_keyed_by_the_stores_own_secret(factory, location, tmp_path, store):
    """Every backend keys its page-hash chain roots by a secret of the store (LMDB: derived from its key file;
    a shared store: a random one in its format record), the same for every handle on the store and another for
    another store, so a page hash cannot be recomputed from a guessed salt without it (issue 26)."""
    from kvcache.types.keys import UNKEYED_CHAIN, hash_root

    key = store.chain_key
    assert isinstance(key, bytes) and len(key) >= 16 and key != UNKEYED_CHAIN
    assert store.root(NS_A) == hash_root(LAYOUT.layout_id, NS_A, key)
    assert store.root(NS_A) != hash_root(LAYOUT.layout_id, NS_A, UNKEYED_CHAIN)
    hashes, _ = write(store, range(8), NS_A)
    again = factory.open(location, LAYOUT)
    try:
        assert again.chain_key == key and again.exists_prefix(hashes) == 2
    finally:
        again.close()
    other = factory.open(factory.location(tmp_path / "other"), LAYOUT)
    try:
        assert other.chain_key not in (key, None, UNKEYED_CHAIN)
        assert other.root(NS_A) != store.root(NS_A)
    finally:
        other.close()
    # the roots its namespace records keep (what an audit without the key checks pages against)
    [record] = [r for r in store.namespaces() if r.ns_id_hex == NS_A.id_hex]
    assert record.roots == [store.root(NS_A).hex()]


def test_a_put_the_store_cannot_write_fails_and_is_never_a_refusal(factory, tmp_path):
    """Issue 36: a Redis server killed mid-replay was reported as 72,214 `rejected` pages, the word for capacity,
    quota and share refusals, so a full store and a dead one read alike. A put the store cannot carry out (its
    server gone, its disk full) is either raised (StoreError: LMDB's failed commit) or answered FAILED page by page
    (`PutResult.failed`), never `rejected`; a share's refusal is REJECTED and never `failed`. Either way nothing of
    the batch is stored, and the store is sound after."""
    from kvcache.types.shares import Shares

    nbytes = LAYOUT.bytes_per_page
    with factory.outage(tmp_path) as (location, cut):
        store = factory.open(location, LAYOUT)
        try:
            store.set_shares(NS_B, Shares(store_bytes=2 * nbytes))
            hashes, origins = page_origins(LAYOUT, pack_tokens(range(16)), NS_B, store.chain_key)
            refused = store.put(hashes, [page_payload(h, nbytes) for h in hashes], origins)
            assert (refused.written, refused.rejected, refused.failed) == (2, 2, 0)
            assert bytes(refused.outcomes[2:]) == bytes([PageOutcome.REJECTED]) * 2
            assert [stored(o) for o in refused.outcomes] == [True, True, False, False]

            kept, _ = write(store, range(16), NS_A)
            hashes, origins = page_origins(LAYOUT, pack_tokens(range(16, 16 + 4 * 64)), NS_A, store.chain_key)
            cut()
            try:
                result = store.put(hashes, [page_payload(h, nbytes) for h in hashes], origins)
            except StoreError:
                result = None  # raised: the contract's other answer
            if result is not None:
                assert (result.written, result.existing, result.rejected, result.failed) == (0, 0, 0, 64)
                assert result.outcomes == bytes([PageOutcome.FAILED]) * 64
                assert not any(stored(o) for o in result.outcomes)
            counters = store.counters()
            assert counters.pages_rejected == 2  # the share's refusals, and nothing of the failed batch
        finally:
            store.close()
        again = factory.open(location, LAYOUT) if result is None else None  # LMDB: the same file, sound
        if again is not None:
            try:
                assert again.exists_prefix(kept) == 4 and again.exists_prefix(hashes) == 0
                assert again.verify().ok
            finally:
                again.close()
