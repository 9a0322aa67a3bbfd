"""Admission is page-level: `admit` hands back the cached and fresh page runs and builds nothing per token; the
request's pages as one array and its per-token slots are built on the first read, once, and equal what the eager
per-token array was. The ledger still checks every move the lazy admission leads to."""

import numpy as np
import pytest

from factories import make_cache
from kvcache import AdmitStatus, Namespace, OwnershipError, Request, UnknownRequest
from kvcache.types.owners import OwnerKind, owner_code

T1 = Namespace("t1", "salt-1")


def eager_slots(cache, adm, n_tokens):
    """The array admission used to build on every call: the slots of every page, cut to the request's tokens."""
    pages = np.concatenate([adm.cached_pages, adm.fresh_pages])
    return cache.device_pool.slots(pages)[:n_tokens]


@pytest.mark.parametrize("page_size", [1, 4])
def test_slots_are_built_on_first_read_once_and_equal_the_eager_array(page_size):
    c = make_cache(page_size=page_size, device_tokens=128)
    c.admit(Request("a", range(12), T1))
    c.commit("a")
    req = Request("b", list(range(8)) + [90, 91, 92], T1)  # 8 cached tokens, 3 new: a partial tail page
    adm = c.admit(req)
    assert adm.status is AdmitStatus.ADMITTED and adm.cached_tokens == 8 and adm.new_tokens == 3
    assert len(adm.cached_pages) == 8 // page_size and len(adm.fresh_pages) == -(-3 // page_size)
    assert "slots" not in adm.__dict__ and "pages" not in adm.__dict__  # nothing built by admit
    slots = adm.slots
    assert slots is adm.slots  # built once, kept
    assert slots.tolist() == eager_slots(c, adm, len(req)).tolist() == c.device_slots("b").tolist()
    assert adm.pages.tolist() == adm.cached_pages.tolist() + adm.fresh_pages.tolist()
    assert adm.pages is adm.pages
    c.commit("b")
    assert c.audit().ok


def test_an_admission_without_a_cached_prefix_and_a_refused_one():
    c = make_cache(page_size=4, device_tokens=16, host_tokens=0)
    adm = c.admit(Request("a", range(10), T1))
    assert not len(adm.cached_pages) and adm.pages is adm.fresh_pages  # no join of an empty prefix
    assert adm.slots.tolist() == c.device_pool.slots(adm.fresh_pages)[:10].tolist()
    full = c.admit(Request("b", range(100, 110), T1))  # 3 pages wanted, 1 free, nothing evictable
    assert full.status is AdmitStatus.POOL_FULL and len(full.slots) == 0 and len(full.pages) == 0
    c.commit("a")
    assert c.audit().ok


def test_the_ledger_still_checks_what_a_lazy_admission_hands_back():
    c = make_cache(page_size=4, device_tokens=64)
    adm = c.admit(Request("a", range(8), T1))
    other = owner_code(OwnerKind.REQUEST, 999)
    with pytest.raises(OwnershipError):  # the request's fresh pages freed as someone else's
        c.device_pool.free(adm.fresh_pages, other)
    c.commit("a")
    with pytest.raises(UnknownRequest):  # a double commit
        c.commit("a")
    node = c.tree.match_prefix(Request("q", range(8), T1).key).device_node
    assert node.device is adm.fresh_pages  # the new leaf took the fresh pages themselves, no copy
    with pytest.raises(OwnershipError):  # pages the tree owns are not the request's (handle 1) any more
        c.device_pool.free(adm.fresh_pages, owner_code(OwnerKind.REQUEST, 1))
    assert c.audit().ok


def test_fresh_pages_written_between_admit_and_commit_lose_the_proof_and_fail_the_full_check():
    # The ledger's shortcut at commit is a proof: the very array alloc returned, bytes unchanged. A caller that
    # writes a page it does not own into that array gets the per-page check, which refuses the move.
    c = make_cache(page_size=1, device_tokens=64)
    c.admit(Request("a", range(4), T1))
    c.commit("a")
    held = c.tree.match_prefix(Request("q", range(4), T1).key).device_pages
    adm = c.admit(Request("b", range(100, 104), T1))
    adm.fresh_pages[0] = held[0]  # a bug: the request's record now names a page a tree node owns
    with pytest.raises(OwnershipError):
        c.commit("b")


def test_a_live_requests_fresh_run_is_its_own_to_every_reader_and_its_commit_writes_the_node():
    # A fresh pool hands admissions runs whose owners the ledger writes once, at commit; every view between
    # (owners, the audit, a snapshot, another request's check) reads the request as their owner.
    c = make_cache(page_size=1, device_tokens=64)
    a = c.admit(Request("a", range(8), T1))
    b = c.admit(Request("b", range(100, 104), T1))
    req_a, req_b = c._live["a"].owner, c._live["b"].owner
    assert (c.device_pool.owners(a.fresh_pages) == req_a).all()
    assert (c.device_pool.owners(b.fresh_pages) == req_b).all()
    report = c.audit()
    assert report.ok, report
    with pytest.raises(OwnershipError):  # b's pages named as a's: the full check reads them as b's
        c.device_pool.free(b.fresh_pages.copy(), req_a)
    c.commit("a")
    node = c.tree.match_prefix(Request("q", range(8), T1).key).device_node
    assert (c.device_pool.owners(a.fresh_pages) == node.owner).all()
    c.release("b")
    assert c.audit().ok and c.device_pool.free_pages == 64 - 8
