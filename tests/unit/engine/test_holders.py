"""kvcache.engine.holders: the one registry of slot holders, its id mint, and what the audit reads of it."""

from factories import l3_cache, make_layout, make_store
from kvcache import HostMode, Namespace, Request
from kvcache.engine.holders import Holders
from kvcache.ledger.pools import SlotPool

T1 = Namespace("t1", "holders-salt")
TOKENS = list(range(1000, 1032))


def test_the_mint_never_repeats_and_requests_have_their_own_sequence():
    h = Holders(SlotPool("device", 4, 1, 8), None)
    assert [h.mint() for _ in range(3)] == [1, 2, 3]
    assert [h.mint_handle() for _ in range(2)] == [1, 2]
    assert h.mint() == 4


def test_every_holder_kind_is_listed_for_the_audit_in_one_fixed_order(tmp_path):
    store = make_store(tmp_path / "s", make_layout(4))
    c = l3_cache(store, host_mode=HostMode.CACHE)
    seed = Request("seed", TOKENS, T1)  # L3 holds TOKENS; the device then loses them
    c.admit(seed)
    c.commit("seed")
    c.flush()
    c.evict(device_tokens=1000, host_tokens=1000)
    c.admit(Request("live", list(range(5000, 5008)), T1))
    assert c.prefetch(Request("pf", TOKENS, T1)).issued
    kinds = [(s.kind, s.rid) for s in c.holder_states()]
    assert kinds == [("request", "live"), ("op:prefetch", "pf")]
    assert c.holders.held_key("pf").namespace == T1 and c.holders.held_key("nobody") is None
    assert c.holders.holds("live") and c.holders.holds("pf") and not c.holders.holds("nobody")
    assert c.holders.running(T1.id) == 1
    c.release("pf")
    c.release("live")
    assert list(c.holder_states()) == [] and c.audit().ok
    c.close()
