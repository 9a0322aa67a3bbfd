"""kvcache.engine.copies: backups and load-backs issued into the pages they are handed, completed in issue order."""

import numpy as np

from factories import make_cache
from kvcache import AdmitStatus, Namespace, Request

NS = Namespace("t", "copies-salt")


def test_a_load_back_left_in_flight_is_completed_by_poll_and_its_pages_go_to_the_nodes():
    c = make_cache(page_size=1, device_tokens=16, host_tokens=32)
    tokens = list(range(100, 108))
    c.admit(Request("a", tokens, NS))
    c.commit("a")
    c.flush()  # the path is backed up: a host copy of every node
    c.evict(device_tokens=16)
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
    c.admit(Request("a", tokens, NS))
    c.commit("a")
    c.flush()
    c.evict(device_tokens=16)
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
