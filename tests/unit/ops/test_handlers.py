"""kvcache.ops.handlers: what the admin requests do to a cache, run directly (as the owner thread runs them)."""

import pytest

from factories import l3_cache, make_layout, make_store
from kvcache import Namespace, Request, SyntheticKV, replay
from kvcache.ops.handlers import execute
from kvcache.ops.requests import ReplayJob
from kvcache.types.config import HostMode
from kvcache.types.keys import page_hashes
from kvcache.workload.traces import TraceRequest

SALT = "admin-ops-salt-qwerty"
T1 = Namespace("t1", SALT)
PROMPT = list(range(40))


@pytest.fixture
def store(tmp_path):
    """Three requests sharing a prompt, written to L3 with the replay's synthetic KV (what verify expects)."""
    s = make_store(tmp_path / "store", make_layout(4))
    w = l3_cache(s)
    replay(w, [TraceRequest(f"fill{i}", PROMPT + [i] * 8, "t1", SALT) for i in range(3)])
    w.close()
    yield s
    s.close()


def test_a_live_replay_whose_rids_collide_with_the_engines_holds_verifies_clean(store):
    """The engine holds a staged record for rid r1; a live replay's own r1 (other tokens) must neither take it
    nor disturb it (it used to splice the engine's KV into the replay's request: verify mismatches)."""
    c = l3_cache(store, host_mode=HostMode.BUFFER, device_tokens=512, host_tokens=512)
    engine = Request("r1", PROMPT + [1] * 8, T1)
    assert c.prefetch(engine).issued
    c.flush()
    assert [s.rid for s in c.staged_records()] == ["r1"]
    trace = [TraceRequest("r1", PROMPT + [2] * 8 + [9] * 7, "t1", SALT),
             TraceRequest("r2", PROMPT + [0] * 8, "t1", SALT)]
    outcome = execute(c, ReplayJob(trace, len(trace), verify=True, batch=1, lookahead=2, snapshot=False))
    report = outcome.replay_report()
    assert report.requests == 2 and report.verify_mismatches == 0 and report.verified_tokens > 0
    assert report.audit.ok
    assert [s.rid for s in c.staged_records()] == ["r1"]  # the engine's record is still its own
    adm = c.admit(engine)
    assert adm.cached_tokens == 48
    pages = adm.slots[::4] // 4
    hashes = page_hashes(c.layout.layout_id, engine.key, 4, c.chain_key)
    assert len(SyntheticKV(c.layout).mismatches(c.device_pool.pages, pages[:12], hashes[:12])) == 0
    c.release("r1")
    assert c.audit().ok
    c.close()


def test_a_live_namespace_drop_empties_every_tier_and_writes_nothing_back(store):
    from kvcache.ops.requests import DropRequest
    from kvcache.types.config import WritePolicy

    c = l3_cache(store, write_policy=WritePolicy.WRITE_BACK)
    replay(c, [TraceRequest(f"d{i}", PROMPT + [i] * 8 + [7] * 8, "t1", SALT) for i in range(3)])
    c.evict(device_tokens=40)  # write-back: some pages only in L2 now, not in L3 yet
    dropped = execute(c, DropRequest("t1", SALT))
    assert dropped.namespace == T1.info(store.fingerprint_key) and dropped.store_pages > 0  # the store's key
    assert dropped.device_pages + dropped.host_pages > 0 and dropped.live_requests == 0
    c.flush()
    assert T1.id_hex not in {r.ns_id_hex for r in store.namespaces()}
    assert c.match(Request("p", PROMPT, T1)).device_tokens == 0 and c.audit().ok
    c.close()


def test_load_back_counts_pages_the_store_lacks_as_absent_and_only_changed_bytes_as_differing(store):
    """Issue 25 #9: a live cache holds pages L3 does not (write-back writes at eviction): its load-back counted them
    as differing (exit 1, 1,763 "mismatches" of which 0 differed). Absent pages are not compared and are no
    failure; a page whose bytes changed still is."""
    from kvcache.ops.requests import LoadBackRequest
    from kvcache.types.config import WritePolicy

    c = l3_cache(store, write_policy=WritePolicy.WRITE_BACK)
    tokens = PROMPT + [0] * 8 + [5] * 8  # 14 pages: the first 12 are in L3 (the fixture's), the last 2 are new
    replay(c, [TraceRequest("w", tokens, "t1", SALT)])  # committed on the device; write-back: not in L3 yet
    assert store.exists_prefix(page_hashes(c.layout.layout_id, Request("k", tokens, T1).key, 4, c.chain_key)) == 12
    clean = execute(c, LoadBackRequest(tokens, "t1", SALT))
    assert clean.pages == 14 and clean.hit_tokens == 56
    assert (clean.verify_absent, clean.verify_mismatches, clean.verified_tokens) == (2, 0, 48)
    adm = c.admit(Request("x", tokens, T1))  # flip the bytes of the request's first device page
    first = int(adm.slots[0]) // 4
    c.device_pool.pages[first] = 255 - c.device_pool.pages[first]
    c.release("x")
    changed = execute(c, LoadBackRequest(tokens, "t1", SALT))
    assert (changed.verify_absent, changed.verify_mismatches, changed.verified_tokens) == (2, 1, 48)
    c.close()
