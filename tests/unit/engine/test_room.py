"""kvcache.engine.room: one tier's allocation that evicts when short, its eviction counted on its own tier, and
write-back only when the write policy writes back on eviction."""

import pytest

from factories import make_cache
from kvcache import Namespace, Request, WritePolicy
from kvcache.types.removals import RemovalReason
from kvcache.types.tier import Tier

NS = Namespace("t", "room-salt")


def _filled(**kw):
    c = make_cache(page_size=1, device_tokens=8, host_tokens=16, **kw)
    c.admit(Request("a", list(range(8)), NS))
    c.commit("a")
    c.flush()
    return c


def test_an_allocation_short_of_pages_evicts_what_it_needs_lru_first_and_counts_it_on_its_tier():
    c = _filled()
    room = c._admissions._device_room
    assert room.pool.free_pages == 0
    pages = room.alloc(3, 12345, NS)
    assert pages is not None and len(pages) == 3
    # the path is one node of 8 pages: it goes whole, counted on the device tier only
    assert c.counters.device_pages_evicted == 8 and c.counters.host_pages_evicted == 0
    assert room.pool.free_pages == 5
    assert not c.removals.complete(Tier.DEVICE)  # a victim never hashed (no store) is noted as unrecorded
    room.pool.free(pages, 12345)
    assert c.audit().ok


def test_an_allocation_no_eviction_can_serve_is_none():
    c = _filled()
    c.admit(Request("live", list(range(8)), NS))  # locks the whole pool
    assert c._admissions._device_room.alloc(1, 12345, NS) is None
    c.release("live")
    assert c.audit().ok


@pytest.mark.parametrize("policy, writes_back", [(WritePolicy.WRITE_BACK, True), (WritePolicy.WRITE_THROUGH, False)])
def test_write_back_runs_only_under_a_policy_that_writes_back_on_eviction(policy, writes_back):
    c = make_cache(page_size=1, device_tokens=8, host_tokens=16, write_policy=policy)
    assert (c._admissions._device_room.write_back is not None) is writes_back
    assert c._room.host.write_back is None  # no store: nothing to write L2's victims to


def test_evicting_for_a_reason_records_it():
    c = _filled()
    assert c._room.evict(Tier.DEVICE, 8, reason=RemovalReason.EVICT) == 8
    assert c.counters.device_pages_evicted == 8 and c.audit().ok
