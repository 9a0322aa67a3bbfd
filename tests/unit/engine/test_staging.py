"""Buffer mode: a completed fetch is parked as a staged record and spliced, or dropped, at admission."""

import logging

import pytest

from factories import PendingCopies, device_bytes_ok, forward, l3_cache, make_layout, make_store
from kvcache import AdmitStatus, Namespace, Request
from kvcache.types.config import HostMode
from kvcache.types.namespace import display_id
from kvcache.types.owners import OwnerKind

T1, T2 = Namespace("t1", "salt-one"), Namespace("t2", "salt-two")
TOKENS = list(range(100, 164))


@pytest.fixture
def warm_store(tmp_path):
    store = make_store(tmp_path / "store", make_layout(4))
    w = l3_cache(store)
    req = Request("w", TOKENS, T1)
    adm = w.admit(req)
    forward(w, req, adm)
    w.commit("w")
    w.close()
    yield store
    store.close()


def test_completed_fetch_is_parked_with_the_requests_namespace(warm_store):
    c = l3_cache(warm_store, host_mode=HostMode.BUFFER)
    c.prefetch(Request("r", TOKENS, T1))
    c.flush()
    [staged] = c.staged_records()
    view = staged.view(c.fingerprints)
    key = warm_store.fingerprint_key  # the cache shows its store's fingerprints and ids
    assert view.rid == "r" and view.namespace == T1.info(key) and view.namespace_id == display_id(T1.id, key)
    assert view.staged_tokens == 64 and view.start_tokens == 0 and len(view.page_hashes) == 16
    codes = set(c.host_pool.owners(staged.pages).tolist())
    assert codes == {staged.owner} and staged.owner >> 48 == OwnerKind.STAGED
    assert c.audit().ok


def test_splice_puts_exactly_the_staged_pages_on_the_device(warm_store):
    c = l3_cache(warm_store, host_mode=HostMode.BUFFER)
    req = Request("r", TOKENS + [1, 2], T1)
    c.prefetch(req)
    c.flush()
    adm = c.admit(req)
    assert adm.status is AdmitStatus.ADMITTED and adm.cached_tokens == 64 and adm.new_tokens == 2
    assert device_bytes_ok(c, req, adm.slots, 64)
    assert c.host_pool.used_pages == 0  # the host tier was only a bounce buffer
    m = c.tree.match_prefix(req.key)
    assert list(m.device_pages) == list(c._live["r"].cached_pages)
    c.commit("r")
    assert c.audit().ok and c.stats().prefetch.used_pages == 16


def test_a_splice_still_running_on_the_gpu_keeps_the_staged_pages_it_reads_from_reuse(warm_store, monkeypatch):
    """The spliced pages go to the tree at admission (the caller's stream waits for the copy), but the staged host
    pages the copy reads stay held by it until its event completes: an L3 fetch, which writes host pages from the
    CPU, must not get them first."""
    c = l3_cache(warm_store, host_mode=HostMode.BUFFER)
    req = Request("r", TOKENS + [1, 2], T1)
    c.prefetch(req)
    c.flush()
    [staged] = c.staged_records()
    gpu = PendingCopies(c, monkeypatch.setattr)
    adm = c.admit(req)
    assert adm.status is AdmitStatus.ADMITTED and adm.cached_tokens == 64 and gpu.ordered == gpu.events
    assert device_bytes_ok(c, req, adm.slots, 64) and not c.staged_records()
    [op] = [s for s in c.holder_states() if s.kind != "request"]
    assert op.kind == "op:load_back" and op.pool == "host" and op.owner >> 48 == OwnerKind.OP_LOAD_BACK
    assert set(c.host_pool.owners(staged.pages).tolist()) == {op.owner} and c.audit().ok
    free = c.host_pool.alloc(c.host_pool.free_pages, 1)  # everything else the host pool can hand out
    assert not set(free.tolist()) & set(staged.pages.tolist())
    c.host_pool.free(free, 1)
    gpu.finish()
    assert c.poll() == 1 and c.host_pool.used_pages == 0 and c.audit().ok
    c.commit("r")
    assert c.audit().ok


def test_staged_record_consumed_by_another_namespace_is_dropped(warm_store, caplog):
    c = l3_cache(warm_store, host_mode=HostMode.BUFFER)
    c.prefetch(Request("r", TOKENS, T1))
    c.flush()
    assert c.host_pool.used_pages == 16
    with caplog.at_level(logging.ERROR, logger="kvcache"):
        adm = c.admit(Request("r", TOKENS, T2))  # the same rid, reused by another tenant
    assert adm.cached_tokens == 0 and adm.new_tokens == 64  # never spliced
    assert c.host_pool.used_pages == 0 and not c.staged_records()
    stats = c.stats().prefetch
    assert stats.namespace_mismatches == 1 and stats.dropped["namespace_mismatch"] == 16
    assert c.fingerprints.label(T1) in caplog.text and c.fingerprints.label(T2) in caplog.text
    assert "salt-one" not in caplog.text and "salt-two" not in caplog.text
    c.release("r")
    assert c.audit().ok


def test_staged_pages_the_device_already_holds_are_not_spliced_twice(warm_store):
    c = l3_cache(warm_store, host_mode=HostMode.BUFFER)
    c.prefetch(Request("r", TOKENS, T1))
    c.flush()
    other = Request("o", TOKENS[:32], T1)  # meanwhile another request computes the first half itself
    adm = c.admit(other)
    forward(c, other, adm)
    c.commit("o")
    adm = c.admit(Request("r", TOKENS, T1))
    assert adm.cached_tokens == 64 and c.stats().prefetch.dropped["duplicate"] == 8
    c.release("r")
    c.flush()
    assert c.audit().ok


def test_fetch_parked_while_admission_waits_is_spliced_once(warm_store):
    # wait_complete: the admission itself drives the fetch to completion, which parks it; the record must be
    # spliced once, not parked a second time over itself (that leaked the first record's pages).
    from kvcache.types.config import PrefetchPolicy

    c = l3_cache(warm_store, host_mode=HostMode.BUFFER, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    req = Request("r", TOKENS, T1)
    c.prefetch(req)
    adm = c.admit(req)
    assert adm.cached_tokens == 64 and device_bytes_ok(c, req, adm.slots, 64)
    c.commit("r")
    c.flush()
    assert c.audit().ok and not c.staged_records()
    assert c.host_pool.used_pages == 0  # L2 is a bounce buffer: the write-through copy went to L3 and was freed
    assert c.stats().backup.storage_pages == 16
