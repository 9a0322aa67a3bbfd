"""Who serves a store and what was dropped from it (kvcache.storage.api: register_serve, record_drop, ...), run
against every registered backend through `factory`, and the fence a live cache puts on its handle with them
(kvcache.storage.serving)."""

from __future__ import annotations

import os

import pytest
from test_l3_conformance import LAYOUT, page_payload, write

from kvcache.errors import StoreReadOnly
from kvcache.storage.api import PageOutcome, ServeRecord, page_origins
from kvcache.storage.registry import open_store
from kvcache.storage.serving import DropWatch, FencedStore, last_drop, new_serve_record, recorded_drop
from kvcache.types.keys import pack_tokens
from kvcache.types.namespace import Namespace

SALT = "serving-salt-5e1d"
NS_A = Namespace("tenant-a", SALT)
NS_B = Namespace("tenant-b", SALT)


def test_serving_records_are_seen_by_every_handle_and_removed_on_unregister(factory, location, store):
    first = new_serve_record("/run/kvc/a.sock")
    second = ServeRecord("b" * 32, os.getpid() + 1, "other-host", "/run/kvc/b.sock", 1.5)
    store.register_serve(first)
    other = factory.open(location, LAYOUT)  # another handle: another process would see the same
    try:
        other.register_serve(second)
        assert sorted(store.serves(), key=lambda r: r.token) == sorted([first, second], key=lambda r: r.token)
        store.register_serve(first)  # again: replaces, never doubles
        assert len(other.serves()) == 2
        other.unregister_serve(first.token)
        assert store.serves() == [second]
        store.unregister_serve(first.token)  # gone already: no error
    finally:
        other.close()
    again = factory.open(location, LAYOUT)
    try:
        assert again.serves() == [second]  # kept in the store
    finally:
        again.close()


def test_drop_records_are_numbered_in_order_and_read_from_a_number(factory, location, store):
    assert store.drop_seq() == 0 and store.drops() == []
    write(store, range(16), NS_A)
    first = store.record_drop(NS_A.id, "tenant-a", NS_A.info(store.fingerprint_key).salt_fingerprint, "offline")
    second = store.record_drop(NS_B.id, None, None, "/run/kvc/a.sock")
    assert (first.seq, second.seq) == (1, 2) and store.drop_seq() == 2
    assert first.ns_id_hex == NS_A.id_hex and first.extra_key == "tenant-a" and SALT not in repr(first)
    assert store.drops() == [first, second] and store.drops(1) == [second] and store.drops(2) == []
    other = factory.open(location, LAYOUT)
    try:
        third = other.record_drop(NS_A.id, None, None, "offline")
        assert third.seq == 3 and store.drop_seq() == 3 and store.drops(2) == [third]
    finally:
        other.close()
    assert last_drop(store, ns_id_hex=NS_A.id_hex) == third
    assert last_drop(store, salt_fingerprint=first.salt_fingerprint, extra_key="tenant-a") == first
    assert last_drop(store, ns_id_hex=Namespace("never", SALT).id_hex) is None


def test_a_read_only_handle_reads_the_records_and_writes_none(factory, location, store):
    store.register_serve(new_serve_record("/run/kvc/a.sock"))
    store.record_drop(NS_A.id, None, None, "offline")
    reader = open_store(location, readonly=True)
    try:
        assert len(reader.serves()) == 1 and reader.drop_seq() == 1
        with pytest.raises(StoreReadOnly):
            reader.record_drop(NS_B.id, None, None, "offline")
        with pytest.raises(StoreReadOnly):
            reader.register_serve(new_serve_record("/run/kvc/b.sock"))
    finally:
        reader.close()


def test_a_recorded_drop_deletes_the_pages_after_recording_them(store):
    write(store, range(16), NS_A)
    write(store, range(16), NS_B)
    record, deleted = recorded_drop(store, NS_A.id)
    assert deleted.pages == 4 and record.seq == 1 and record.extra_key == "tenant-a" and record.by == "offline"
    assert [r.extra_key for r in store.namespaces()] == ["tenant-b"]


def test_a_fenced_handle_refuses_a_namespace_dropped_elsewhere_until_it_applied_the_drop(factory, location, store):
    """The fence of a live cache: another process's drop record stops this handle's write-back of that namespace
    (and only that one) until the cache has let go of it."""
    watch = DropWatch(store, by="/run/kvc/a.sock")
    fenced = FencedStore(store, watch)
    elsewhere = factory.open(location, LAYOUT)
    try:
        write(elsewhere, range(8), NS_A)
        recorded_drop(elsewhere, NS_A.id, by="/run/kvc/b.sock")  # through the other cache
    finally:
        elsewhere.close()
    hashes, origins = page_origins(LAYOUT, pack_tokens(range(16)), NS_A, store.chain_key)
    b_hashes, b_origins = page_origins(LAYOUT, pack_tokens(range(16)), NS_B, store.chain_key)
    pages = [page_payload(h, LAYOUT.bytes_per_page) for h in hashes + b_hashes]
    got = fenced.put(hashes + b_hashes, pages, origins + b_origins)  # one batch, both namespaces
    assert (got.written, got.rejected) == (4, 4)
    assert got.outcomes == bytes([PageOutcome.REJECTED] * 4 + [PageOutcome.WRITTEN] * 4)  # each page, in order
    assert store.exists_prefix(hashes) == 0 and store.exists_prefix(b_hashes) == 4
    [pending] = watch.pending()
    assert pending.ns_id_hex == NS_A.id_hex and pending.by == "/run/kvc/b.sock"
    watch.done(pending)  # the cache dropped it: new pages of it may be written again
    assert fenced.put(hashes, pages[:4], origins).written == 4 and watch.pending() == []


def test_a_fenced_handles_own_drop_is_recorded_for_the_others_and_never_fences_itself(factory, location, store):
    watch = DropWatch(store, by="/run/kvc/a.sock")
    fenced = FencedStore(store, watch)
    write(store, range(16), NS_A)
    assert fenced.delete_namespace(NS_A.id).pages == 4
    [record] = store.drops()
    assert record.by == "/run/kvc/a.sock" and record.extra_key == "tenant-a"
    hashes, origins = page_origins(LAYOUT, pack_tokens(range(16)), NS_A, store.chain_key)
    pages = [page_payload(h, LAYOUT.bytes_per_page) for h in hashes]
    assert fenced.put(hashes, pages, origins).written == 4  # its own drop: applied already
    other = DropWatch(store, by="/run/kvc/b.sock")  # a cache started after the drop: nothing to follow
    assert other.fenced() == frozenset()
    with watch.applying():  # following another's record: the delete records nothing
        fenced.delete_namespace(NS_A.id)
    assert store.drop_seq() == 1
