"""kvcache.engine.operation: every in-flight operation, whatever its class, through the same small protocols."""

import pytest

from factories import forward, l3_cache, make_layout, make_store, seed_store
from kvcache import HostMode, Namespace, Request
from kvcache.engine.operation import OP_OWNER_KIND, OpKind, anchor_holds, release_anchor
from kvcache.types.tier import Tier

NS = Namespace("t", "operation-salt")
TOKENS = list(range(400, 432))  # 8 pages of 4


def test_every_op_kind_is_an_owner_kind():
    assert set(OP_OWNER_KIND) == set(OpKind)
    assert len(set(OP_OWNER_KIND.values())) == len(OpKind)


def _anchored_prefetch(tmp_path, mode):
    """A cache whose prefetch of TOKENS hangs below a 4-page prefix it holds (the anchor)."""
    store = make_store(tmp_path / "s", make_layout(4))
    seed_store(store, Request("w", TOKENS, NS))
    c = l3_cache(store, host_mode=mode)
    head = Request("head", TOKENS[:16], NS)
    forward(c, head, c.admit(head))
    c.commit("head")
    c.flush()
    assert c.prefetch(Request("r", TOKENS, NS)).issued
    return c


@pytest.mark.parametrize("mode, tier", [(HostMode.CACHE, Tier.HOST), (HostMode.BUFFER, Tier.DEVICE)])
def test_an_anchor_hold_is_shown_on_its_tier_and_released_once(tmp_path, mode, tier):
    c = _anchored_prefetch(tmp_path, mode)
    op = c.prefetch_ops()[0]
    held = c.tree.host_held if tier is Tier.HOST else c.tree.device_held
    assert op.hold is tier and held == 4
    state = op.holder_state("device", "host")
    other = Tier.DEVICE if tier is Tier.HOST else Tier.HOST
    assert anchor_holds(op, tier) == [op.anchor.id] and anchor_holds(op, other) == []
    assert (state.host_holds if tier is Tier.HOST else state.device_holds) == [op.anchor.id]
    release_anchor(c.tree, op)
    release_anchor(c.tree, op)  # once: the second does nothing
    assert op.anchor is None and (c.tree.host_held if tier is Tier.HOST else c.tree.device_held) == 0
    c.release("r")  # gives back its pages; its hold is gone already
    assert c.audit().ok
    c.close()
