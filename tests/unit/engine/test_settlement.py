"""kvcache.engine.settlement: a request's prefetch started after its refusals and settled per the policy; an
operation whose settling fails gives back what it holds."""

import pytest

from factories import l3_cache, make_layout, make_store, seed_store
from kvcache import Namespace, Request, RequestIdInUse, TTLPolicy
from kvcache.types.config import PrefetchPolicy

NS = Namespace("t", "settlement-salt")
TOKENS = list(range(500, 532))  # 8 pages of 4


@pytest.fixture
def store(tmp_path):
    s = make_store(tmp_path / "s", make_layout(4))
    seed_store(s, Request("w", TOKENS, NS))
    yield s
    s.close()


def test_a_settle_that_fails_while_waiting_gives_back_everything_the_op_held(store, monkeypatch):
    c = l3_cache(store)
    assert c.prefetch(Request("r", TOKENS, NS)).issued
    c.run_io(max_steps=1)  # the check answered: pages are allocated for the hit, the fetch is queued
    assert c.holder_states()[0].kind == "op:prefetch" and c.host_pool.used_pages > 0

    def interrupted(op, deadline):
        raise KeyboardInterrupt

    monkeypatch.setattr(c._settlement.completion, "wait_for_fetch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        c.settle_prefetch("r", PrefetchPolicy.WAIT_COMPLETE)
    assert not c.holds("r") and c.host_pool.used_pages == 0 and c.audit().ok
    assert c.stats().prefetch.dropped.get("aborted", 0) == 0  # nothing had arrived to drop
    c.close()


def test_a_refused_prefetch_moves_nothing_and_uses_no_namespace(store):
    c = l3_cache(store, ttl=TTLPolicy(default_ttl_s=10.0))
    c.admit(Request("r", TOKENS[:8], NS))  # the id is live for other tokens
    with pytest.raises(RequestIdInUse):
        c.prefetch(Request("r", list(range(900, 932)), Namespace("other", "x")))
    assert len(c.namespace_ttls()) == 1  # the admission's namespace: the refused prefetch's was never used
    assert c.stats().prefetch.issued == 0 and c.host_pool.used_pages == 0
    c.release("r")
    c.close()
