"""Request identity in every hold: a prefetch, a staged record and a live request are bound to their request's
namespace *and* tokens, so a reused request id can never be handed another request's KV."""

import numpy as np
import pytest

from factories import device_bytes_ok, forward, l3_cache, make_layout, make_store
from kvcache import AdmitStatus, InvariantViolation, Namespace, Request
from kvcache.errors import RequestIdInUse
from kvcache.types.config import HostMode
from kvcache.types.results import DeclineReason

PS = 4
T1 = Namespace("t1", "salt-one")
TOKENS = list(range(100, 140))  # 10 pages
OTHER = list(range(900, 940))


@pytest.fixture
def store(tmp_path):
    s = make_store(tmp_path / "store", make_layout(PS))
    w = l3_cache(s)
    for rid, tokens in (("w1", TOKENS), ("w2", OTHER)):
        req = Request(rid, tokens, T1)
        adm = w.admit(req)
        forward(w, req, adm)
        w.commit(rid)
    w.close()
    yield s
    s.close()


def staged_cache(store, tokens=TOKENS):
    c = l3_cache(store, host_mode=HostMode.BUFFER)
    c.prefetch(Request("r", tokens, T1))
    c.flush()
    assert len(c.staged_records()) == 1
    return c


def test_reused_rid_with_other_tokens_never_gets_the_staged_kv(store):
    c = staged_cache(store)
    req = Request("r", OTHER[:20] + [7] * 20, T1)  # same rid, same namespace, another sequence
    adm = c.admit(req)
    assert adm.cached_tokens == 0 and adm.storage_hit_tokens == 0  # was 40 tokens of TOKENS' KV
    assert c.stats().prefetch.dropped == {"key_mismatch": 10} and not c.staged_records()
    forward(c, req, adm)
    c.commit("r")
    c.flush()
    assert c.audit().ok  # was double_owner and dangling_ref
    probe = Request("p", TOKENS, T1)
    assert c.match(probe).device_tokens == 0  # nothing of TOKENS was spliced
    c.close()


def test_reused_rid_with_a_shorter_prompt_is_not_handed_more_than_it_asked(store):
    c = staged_cache(store)
    short = Request("r", TOKENS[:10], T1)
    adm = c.admit(short)  # was cached_tokens=40 > 10 and alloc(-30)
    assert adm.status is AdmitStatus.ADMITTED and 0 <= adm.cached_tokens <= len(short) and adm.new_tokens >= 0
    assert adm.cached_tokens + adm.new_tokens == len(short)
    forward(c, short, adm)
    c.commit("r")
    # the next request writes its KV: it must not land on pages the tree owns
    nxt = Request("n", OTHER, T1)
    adm = c.admit(nxt)
    forward(c, nxt, adm)
    c.commit("n")
    probe = Request("p", TOKENS[:8], T1)
    m = c.match(probe)
    assert device_bytes_ok(c, probe, c.device_pool.slots(m.device_pages), m.device_tokens)
    assert c.audit().ok
    c.close()


def test_staged_record_that_is_a_prefix_of_the_request_is_spliced(store):
    c = staged_cache(store, TOKENS[:20])
    req = Request("r", TOKENS, T1)
    adm = c.admit(req)
    assert adm.cached_tokens == 20 and adm.storage_hit_tokens == 20
    assert device_bytes_ok(c, req, adm.slots, 20)
    c.release("r")
    assert c.audit().ok
    c.close()


@pytest.mark.parametrize("mode", list(HostMode))
def test_prefetch_for_a_rid_that_holds_another_request_is_refused_before_anything_moves(store, mode):
    c = l3_cache(store, host_mode=mode)
    assert c.prefetch(Request("r", TOKENS, T1)).issued
    used = (c.host_pool.used_pages, c.device_pool.used_pages)
    same = c.prefetch(Request("r", TOKENS, T1))
    assert not same.issued and same.reason is DeclineReason.IN_FLIGHT  # a repeated call is not a conflict
    with pytest.raises(RequestIdInUse) as err:
        c.prefetch(Request("r", OTHER, T1))
    assert err.value.rid == "r"
    with pytest.raises(RequestIdInUse):
        c.prefetch(Request("r", TOKENS, Namespace("t2")))
    assert (c.host_pool.used_pages, c.device_pool.used_pages) == used
    c.release("r")
    assert c.audit().ok
    c.close()


def test_cache_mode_prefetch_of_a_reused_rid_is_not_counted_for_another_request(store):
    c = l3_cache(store)
    c.prefetch(Request("r", TOKENS, T1))
    c.flush()
    req = Request("r", OTHER, T1)
    adm = c.admit(req)
    assert adm.storage_hit_tokens == 0
    assert c.stats().prefetch.dropped.get("key_mismatch", 0) == 10
    c.release("r")
    assert c.audit().ok
    c.close()


def test_admit_of_a_live_rid_is_refused_typed(store):
    c = l3_cache(store)
    c.admit(Request("r", TOKENS, T1))
    with pytest.raises(RequestIdInUse):
        c.admit(Request("r", OTHER, T1))
    c.release("r")
    assert c.audit().ok
    c.close()


def test_admit_raises_when_its_own_bookkeeping_would_hand_out_more_than_the_request(store, monkeypatch):
    """The last line of defence: cached pages past the request's end are an invariant violation, raised before
    any page is allocated, with the cache left consistent."""
    c = staged_cache(store)
    real = c._staging.consume

    def overreach(staged, request, node, cached):
        node, cached, n = real(staged, request, node, cached)
        return node, np.concatenate([cached, cached]), n

    monkeypatch.setattr(c._staging, "consume", overreach)
    with pytest.raises(InvariantViolation, match="past the end"):
        c.admit(Request("r", TOKENS, T1))
    assert not c.holds("r") and c.audit().ok
    c.close()
