"""kvcache.engine.copies: backups and load-backs issued into the pages they are handed, completed in issue order."""

import numpy as np

from factories import PendingCopies, make_cache
from kvcache import AdmitStatus, Namespace, Request
from kvcache.types.results import EvictResult

NS = Namespace("t", "copies-salt")


def host_only(c, tokens):
    """A path of `tokens` in L2 alone: served, backed up (a host copy of every node), gone from the device."""
    c.admit(Request("a", tokens, NS))
    c.commit("a")
    c.flush()
    c.evict(device_tokens=16)


def test_a_load_back_left_in_flight_is_completed_by_poll_and_its_pages_go_to_the_nodes():
    c = make_cache(page_size=1, device_tokens=16, host_tokens=32)
    tokens = list(range(100, 108))
    host_only(c, tokens)
    m = c.match(Request("probe", tokens, NS))
    assert len(m.device_pages) == 0 and len(m.host_pages) == 8
    pages = c._admissions.load_back(m, wait=False)
    assert pages is not None and [s.kind for s in c.holder_states()] == ["op:load_back"]
    assert c.audit().ok  # the op owns its destination pages while the copy runs
    assert c.poll() == 1 and c.holder_states() == []
    again = c.match(Request("probe", tokens, NS))
    assert np.array_equal(again.device_pages, pages) and c.audit().ok


def test_a_second_load_back_of_nodes_being_filled_is_refused_and_the_request_recomputes():
    c = make_cache(page_size=1, device_tokens=16, host_tokens=32)
    tokens = list(range(200, 206))
    host_only(c, tokens)
    m = c.match(Request("probe", tokens, NS))
    assert c._admissions.load_back(m, wait=False) is not None
    assert c._admissions.load_back(m) is None and c.counters.load_backs_refused == 1
    adm = c.admit(Request("b", tokens, NS))  # never claims the nodes twice: it recomputes
    assert adm.status is AdmitStatus.ADMITTED and adm.cached_tokens == 0 and c.counters.load_backs_refused == 2
    c.release("b")
    c.poll()  # the first load-back completes: the device holds the path again
    adm = c.admit(Request("c", tokens, NS))
    assert adm.cached_tokens == 6 and adm.device_hit_tokens == 6
    c.release("c")
    assert c.audit().ok


def test_a_load_back_still_running_on_the_gpu_hands_its_pages_over_and_keeps_the_host_copies_it_reads(monkeypatch):
    """Admission returns the loaded pages at once (the caller's stream waits for the copy); until the copy's event
    completes, the host copies it reads can be neither evicted nor reused (an L3 fetch writes host pages from the
    CPU, which no stream orders)."""
    c = make_cache(page_size=1, device_tokens=16, host_tokens=8)
    tokens = list(range(300, 308))
    host_only(c, tokens)
    gpu = PendingCopies(c, monkeypatch.setattr)
    adm = c.admit(Request("b", tokens + [1], NS))
    assert adm.cached_tokens == 8 and adm.host_hit_tokens == 8 and gpu.ordered == gpu.events  # the stream waits
    [op] = [s for s in c.holder_states() if s.kind != "request"]
    assert op.kind == "op:load_back" and op.pages == b"" and len(op.pins) > 0  # pages handed on, pins kept
    assert c.host_pool.used_pages == 8 and c.audit().ok  # the host copies it reads
    c.release("b")
    # pinned by the running copy: its nodes neither leave the device (to become host-only leaves) nor lose their
    # host copies, and no host page of them is handed to anyone else
    assert c.evict(device_tokens=16, host_tokens=8) == EvictResult(0, 0) and c.host_pool.alloc(8, 1) is None
    gpu.finish()
    assert c.poll() == 1 and c.holder_states() == [] and c.audit().ok
    assert c.evict(device_tokens=16) == EvictResult(8, 0) and c.evict(host_tokens=8) == EvictResult(0, 8)
