"""kvcache/ttl.py and the cache's namespace expiry: each rule (sliding vs absolute, clamp, overflow, deferred on
lock, cancelled by reuse) on a cache with all three tiers (L3: a real LMDB store in a temp dir), on a fake clock.
After an expiry nothing of the namespace is matchable, fetchable or listed, and the audit is clean."""

import math

import msgspec
import pytest

import factories
from devices import TEST_DEVICE
from factories import forward, l3_cache, make_layout, make_store
from kvcache import (
    CacheConfig,
    ExpiryCause,
    InvalidConfig,
    InvalidInput,
    Namespace,
    Request,
    TieredCache,
    TTLMode,
    TTLPolicy,
)
from kvcache.live.protocol import NamespacesRequest
from kvcache.ops.handlers import execute
from kvcache.types.config import HostMode
from kvcache.types.fingerprint_key import FingerprintKey
from kvcache.types.keys import page_hashes

A, B, C, D = (Namespace(f"t{i}", f"ttl-salt-{i}") for i in "abcd")
TOKENS = list(range(100, 132))  # 8 pages of 4


class Clock:
    """A fake monotonic clock: time moves only when a test says so."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def at(self, offset: float) -> "Clock":
        self.t = 1000.0 + offset
        return self


def poll_at(cache, clock, offset: float) -> None:
    """Time moves to `offset` seconds after the start and the engine polls (a sweep when one is due)."""
    clock.at(offset)
    cache.poll()


@pytest.fixture
def store(tmp_path):
    s = make_store(tmp_path / "store", make_layout(4))
    yield s
    s.close()


def ttl_cache(store, clock, mode=TTLMode.SLIDING, default=10.0, maximum=20.0, namespaces=100, sweep=0.0, **kw):
    config = CacheConfig(make_layout(4), device_tokens=256, host_tokens=256, device=TEST_DEVICE, io_thread=False,
                         ttl=TTLPolicy(mode, default, maximum, namespaces, sweep), **kw)
    return TieredCache(config, store, clock=clock)


def serve(cache, rid, ns, tokens=TOKENS, ttl_s=None):
    """Admit, write KV, commit, and let the backups land in L2 and L3. Returns the admission."""
    adm = factories.serve(cache, Request(rid, tokens, ns, ttl_s=ttl_s))
    cache.flush()
    return adm


def held(cache, store, ns, tokens=TOKENS):
    """(device pages, host pages, L3 pages) the cache and the store hold of `ns`'s `tokens`."""
    key = Request("probe", tokens, ns).key
    m = cache.tree.match_prefix(key, touch=False)
    host = sum(len(n.host) for n in cache.tree.path(m.host_node) if n.host is not None)
    return len(m.device_pages), host, store.exists_prefix(page_hashes(cache.layout.layout_id, key, 4, cache.chain_key))


def listed(cache, store, ns) -> bool:
    """Is `ns` in the store's registry or in the live cache's `ns ls` (which also shows tracked namespaces)?"""
    live = {(r.extra_key, r.salt_fingerprint) for r in execute(cache, NamespacesRequest()).namespaces}
    named = (ns.extra_key, cache.fingerprints.fingerprint(ns))
    return ns.id_hex in {r.ns_id_hex for r in store.namespaces()} or named in live


def assert_gone(cache, store, ns, tokens=TOKENS):
    """Nothing of `ns` is matchable, fetchable (another cache's L3 prefetch finds nothing) or listed; audit ok."""
    assert held(cache, store, ns, tokens) == (0, 0, 0)
    assert cache.tree.namespace_root(ns) is None
    assert not listed(cache, store, ns)
    assert ns not in cache.ttl_tracker
    other = l3_cache(store)
    req = Request("fetch", tokens, ns)
    if other.prefetch(req).issued:
        other.flush()
        assert other.settle_prefetch("fetch").fetched_pages == 0
    other.close()
    assert cache.audit().ok, cache.audit()


def assert_held(cache, store, ns, tokens=TOKENS):
    assert held(cache, store, ns, tokens) == (8, 8, 8)
    assert listed(cache, store, ns)


# --- the policy as data ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, fact", [
    ({"default_ttl_s": 0}, "default_ttl_s=0.0 must be > 0"),
    ({"max_ttl_s": "1h"}, "max_ttl_s='1h' is not a number of seconds"),
    ({"default_ttl_s": math.nan}, "default_ttl_s=nan"),
    ({"default_ttl_s": 30.0, "max_ttl_s": 20.0}, "max_ttl_s=20.0 must be finite and >= default_ttl_s=30.0"),
    ({"max_ttl_s": math.inf}, "max_ttl_s=inf"),
    ({"max_namespaces": 0}, "max_namespaces=0 must be >= 1"),
    ({"sweep_interval_s": -1.0}, "sweep_interval_s=-1.0 must be >= 0"),
    ({"mode": "forever"}, "mode='forever' is not one of sliding, absolute"),
])
def test_a_bad_policy_is_refused_with_the_facts(kw, fact):
    with pytest.raises(InvalidConfig, match=fact.replace("(", r"\(").replace(")", r"\)")):
        TTLPolicy(**kw)


def test_a_policy_is_data_decoded_by_value_and_checked_by_the_config():
    policy = msgspec.convert({"mode": "absolute", "default_ttl_s": 5, "max_ttl_s": 9}, TTLPolicy)
    assert policy.mode is TTLMode.ABSOLUTE and policy.clamp(None) == 5 and policy.clamp(100) == 9
    assert policy.clamp(2.5) == 2.5
    with pytest.raises(InvalidConfig, match="ttl must be a TTLPolicy or None, got dict"):
        CacheConfig(make_layout(4), device_tokens=64, ttl={"mode": "sliding"})
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"mode": "sliding", "ttl": 5}, TTLPolicy)  # unknown fields are an error


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True, "10"])
def test_a_request_ttl_must_be_positive_finite_seconds(bad):
    with pytest.raises(InvalidInput, match="ttl_s must be a number of seconds > 0 and finite"):
        Request("r", [1, 2], A, ttl_s=bad)
    assert Request("r", [1, 2], A, ttl_s=3).ttl_s == 3


def test_without_a_policy_nothing_is_tracked_and_expire_points_to_drop(store):
    c = l3_cache(store)
    serve(c, "a", A)
    assert c.ttl_tracker is None and c.namespace_ttls() == [] and c.stats().ttl is None
    with pytest.raises(InvalidInput, match="no TTL policy.*drop_namespace"):
        c.expire_namespace(A)
    c.close()


# --- sliding vs absolute ---------------------------------------------------------------------------------------


def test_sliding_deadline_runs_from_the_last_use(store):
    clock = Clock()
    c = ttl_cache(store, clock, TTLMode.SLIDING)
    serve(c, "a1", A)
    serve(c, "b1", B)
    clock.at(8)
    serve(c, "a2", A)  # a use: A's deadline moves to 18, B's stays at 10
    poll_at(c, clock, 10)
    assert_held(c, store, A)
    assert_gone(c, store, B)
    poll_at(c, clock, 17.9)
    assert_held(c, store, A)
    poll_at(c, clock, 18)
    assert_gone(c, store, A)
    st = c.stats().ttl
    assert st.expired == {"deadline": 2} and st.tracked == 0
    assert (st.device_pages, st.host_pages, st.store_pages) == (16, 16, 16) and st.store_bytes > 0
    c.close()


def test_absolute_deadline_runs_from_the_first_use(store):
    clock = Clock()
    c = ttl_cache(store, clock, TTLMode.ABSOLUTE)
    serve(c, "a1", A)
    clock.at(8)
    assert serve(c, "a2", A).cached_tokens == 32  # a use, a hit: the deadline stays at 10
    [view] = c.namespace_ttls()
    assert (view.first_use, view.last_use, view.deadline, view.seconds_left) == (1000, 1008, 1010, 2)
    poll_at(c, clock, 9.9)
    assert_held(c, store, A)
    poll_at(c, clock, 10)
    assert_gone(c, store, A)
    c.close()


def test_a_use_past_the_deadline_before_the_sweep_starts_from_nothing(store):
    clock = Clock()
    c = ttl_cache(store, clock, sweep=60.0)
    c.poll()  # the first sweep: the next one is due at 60
    serve(c, "a1", A)
    clock.at(11)
    c.poll()  # no sweep yet: A is still there
    assert_held(c, store, A)
    adm = serve(c, "a2", A)
    assert adm.cached_tokens == 0  # expired first, exactly at its deadline: the use started from nothing
    assert c.stats().ttl.expired == {"deadline": 1}
    c.close()


def test_a_prefetch_is_a_use(store):
    clock = Clock()
    c = ttl_cache(store, clock)
    serve(c, "a1", A)
    clock.at(9)
    c.prefetch(Request("p", TOKENS + [1, 2, 3, 4], A))  # refreshes A (sliding) while its pages are fetched
    c.release("p")
    poll_at(c, clock, 12)
    assert_held(c, store, A)
    poll_at(c, clock, 19)
    assert_gone(c, store, A)
    c.close()


# --- clamp -----------------------------------------------------------------------------------------------------


def test_a_request_ttl_is_clamped_to_the_maximum_and_replaces_the_namespaces(store):
    clock = Clock()
    c = ttl_cache(store, clock, default=10.0, maximum=20.0)
    serve(c, "a1", A, ttl_s=1e9)  # asks for ~30 years: gets 20 s
    serve(c, "b1", B, ttl_s=3)  # asks for less than the default: gets it
    assert {v.namespace.extra_key: v.ttl_s for v in c.namespace_ttls()} == {"ta": 20.0, "tb": 3.0}
    poll_at(c, clock, 3)
    assert_gone(c, store, B)
    poll_at(c, clock, 19.9)
    assert_held(c, store, A)
    serve(c, "a2", A, ttl_s=2)  # a shorter TTL replaces it: the deadline comes closer (21.9)
    serve(c, "a3", A)  # no ttl_s: A keeps 2 s; deadline 21.9
    poll_at(c, clock, 21.8)
    assert_held(c, store, A)
    poll_at(c, clock, 21.9)
    assert_gone(c, store, A)
    c.close()


# --- overflow --------------------------------------------------------------------------------------------------


def test_overflow_expires_the_namespaces_closest_to_their_deadline(store):
    clock = Clock()
    c = ttl_cache(store, clock, default=10.0, maximum=50.0, namespaces=2, sweep=1e6)
    serve(c, "a", A, ttl_s=50)  # deadline 50
    clock.at(1)
    serve(c, "b", B, ttl_s=10)  # deadline 11: closest
    clock.at(2)
    serve(c, "c", C, ttl_s=1)  # deadline 3, closer still, but it is the one being used: B goes
    assert_gone(c, store, B)
    assert_held(c, store, A) and assert_held(c, store, C)
    assert c.stats().ttl.expired == {"overflow": 1} and len(c.ttl_tracker) == 2
    clock.at(2.5)
    serve(c, "d", D, ttl_s=40)  # deadline 42.5: C (3) is closest now
    assert_gone(c, store, C)
    assert_held(c, store, A) and assert_held(c, store, D)
    assert c.stats().ttl.expired == {"overflow": 2}
    c.close()


def test_overflow_defers_a_namespace_with_running_requests(store):
    clock = Clock()
    c = ttl_cache(store, clock, namespaces=1, sweep=1e6)
    serve(c, "a1", A)
    running = c.admit(Request("a2", TOKENS + list(range(8)), A))
    assert running.cached_tokens == 32
    serve(c, "b", B)  # A is the victim, but a request of A runs: deferred, still tracked
    assert c.stats().ttl.deferred == 1 and len(c.ttl_tracker) == 2
    assert held(c, store, A)[0] == 8
    c.commit("a2")
    c.poll()
    assert_gone(c, store, A, TOKENS + list(range(8)))
    assert c.stats().ttl.expired == {"overflow": 1}
    assert_held(c, store, B)
    c.close()


# --- deferred on lock, cancelled by reuse ---------------------------------------------------------------------


def test_expiry_of_a_locked_prefix_waits_for_its_last_running_request(store):
    clock = Clock()
    c = ttl_cache(store, clock)
    serve(c, "a0", A)
    r1 = Request("a1", TOKENS + [1] * 4, A)
    r2 = Request("a2", TOKENS + [2] * 4, A)
    for r in (r1, r2):
        forward(c, r, c.admit(r))
    poll_at(c, clock, 10)
    st = c.stats().ttl
    assert st.deferred == 1 and st.expired == {}
    [view] = c.namespace_ttls()
    assert view.deferred is ExpiryCause.DEADLINE and view.seconds_left == 0
    assert c.match(Request("m", TOKENS, A)).device_tokens == 32  # still served while it waits
    c.commit("a1")
    c.flush()
    c.poll()
    assert held(c, store, A, r1.tokens) == (9, 9, 9)  # a2 still runs: nothing goes, a1's pages were cached
    c.release("a2")
    c.poll()
    assert_gone(c, store, A, r1.tokens)
    assert_gone(c, store, A, r2.tokens)
    st = c.stats().ttl
    assert st.expired == {"deadline": 1} and st.deferred == 1 and st.cancelled == 0
    c.close()


@pytest.mark.parametrize("mode", list(TTLMode))
def test_a_new_use_cancels_a_deferred_expiry_and_rearms_the_deadline(store, mode):
    clock = Clock()
    c = ttl_cache(store, clock, mode)
    serve(c, "a0", A)
    running = Request("a1", TOKENS + [1] * 4, A)
    forward(c, running, c.admit(running))
    poll_at(c, clock, 10)
    assert c.stats().ttl.deferred == 1
    clock.at(12)
    serve(c, "a2", A)  # a use while deferred: cancelled, re-armed from now (absolute too: a new life)
    c.commit("a1")
    c.poll()
    st = c.stats().ttl
    assert st.cancelled == 1 and st.expired == {}
    [view] = c.namespace_ttls()
    assert view.deferred is None and view.deadline == 1022 and view.first_use == 1012
    poll_at(c, clock, 21.9)
    assert_held(c, store, A)
    poll_at(c, clock, 22)
    assert_gone(c, store, A, running.tokens)
    c.close()


def test_a_use_past_the_deadline_with_running_requests_is_a_deferral_cancelled(store):
    clock = Clock()
    c = ttl_cache(store, clock, sweep=1e6)
    c.poll()
    serve(c, "a0", A)
    running = Request("a1", TOKENS + [1] * 4, A)
    forward(c, running, c.admit(running))
    clock.at(15)
    assert serve(c, "a2", A).cached_tokens == 32  # overdue, but a1 locks the prefix: the use keeps it
    st = c.stats().ttl
    assert (st.deferred, st.cancelled, st.expired) == (1, 1, {})
    c.release("a1")
    c.close()


# --- on demand, prefetches, buffer mode -------------------------------------------------------------------------


def test_a_refused_prefetch_expires_nothing_and_tracks_nothing(store):
    """A prefetch refused with RequestIdInUse moves nothing: it is no use of its namespace, and the overflow a use
    would cause (expiring the namespace the held request belongs to, giving its hold back) does not happen."""
    from kvcache import RequestIdInUse

    clock = Clock()
    w = l3_cache(store)
    serve(w, "w", A)
    w.close()
    c = ttl_cache(store, clock, namespaces=1)
    assert c.prefetch(Request("p", TOKENS, A)).issued
    with pytest.raises(RequestIdInUse):
        c.prefetch(Request("p", TOKENS, B))  # the same id for another namespace
    assert c.holds("p") and B not in c.ttl_tracker and len(c.ttl_tracker) == 1
    assert c.stats().ttl.expired == {}
    c.release("p")
    c.close()


def test_a_prefetch_refused_for_a_foreign_anchor_expires_nothing(store):
    """A prefetch handed another namespace's match raises NamespaceMismatch before any use is counted: with one
    tracked namespace, the use would otherwise expire A (overflow) and free its pages on the way to the refusal
    (found by the stateful test once TTL and shares rules ran together)."""
    from kvcache import NamespaceMismatch

    clock = Clock()
    c = ttl_cache(store, clock, namespaces=1)
    serve(c, "a", A)
    before = (c.device_pool.used_pages, c.host_pool.used_pages)
    m = c.tree.match_prefix(Request("m", TOKENS, A).key)
    with pytest.raises(NamespaceMismatch):
        c.prefetch(Request("foreign", TOKENS + [7], B), m)
    assert (c.device_pool.used_pages, c.host_pool.used_pages) == before
    assert B not in c.ttl_tracker and A in c.ttl_tracker and c.stats().ttl.expired == {}
    assert_held(c, store, A)
    assert c.audit().ok
    c.close()



def test_expire_now_drops_at_once_or_defers_for_running_requests(store):
    clock = Clock()
    c = ttl_cache(store, clock)
    serve(c, "a", A)
    serve(c, "b0", B)
    out = c.expire_namespace(A)
    assert out.expired and not out.deferred and out.cause is ExpiryCause.ON_DEMAND
    assert (out.device_pages, out.host_pages, out.store_pages) == (8, 8, 8)
    assert out.id == c.fingerprints.display_id(A.id)
    assert_gone(c, store, A)
    forward(c, Request("b1", TOKENS, B), c.admit(Request("b1", TOKENS, B)))
    out = c.expire_namespace(B)
    assert out.deferred and not out.expired and out.live_requests == 1
    c.commit("b1")
    c.poll()
    assert_gone(c, store, B)
    assert c.stats().ttl.expired == {"on_demand": 2}
    # a namespace the policy never saw (only L3 holds it, written by another cache) expires as well
    w = l3_cache(store)
    serve(w, "w", C)
    w.close()
    assert c.expire_namespace(C).store_pages == 8
    assert_gone(c, store, C)
    c.close()


def test_expiry_gives_back_prefetches_in_flight(store):
    clock = Clock()
    w = l3_cache(store)
    serve(w, "w", A)
    w.close()
    c = ttl_cache(store, clock)
    assert c.prefetch(Request("p", TOKENS, A)).issued  # first use: tracked from now
    assert c.prefetch_ops()
    poll_at(c, clock, 10)
    assert not c.prefetch_ops() and c.host_pool.used_pages == 0
    assert_gone(c, store, A)
    c.close()


def test_expiry_in_buffer_mode_gives_back_staged_records(store):
    clock = Clock()
    w = l3_cache(store)
    serve(w, "w", A)
    w.close()
    c = ttl_cache(store, clock, host_mode=HostMode.BUFFER)
    assert c.prefetch(Request("s", TOKENS, A)).issued
    c.flush()
    assert [s.rid for s in c.staged_records()] == ["s"]
    poll_at(c, clock, 10)
    assert not c.staged_records() and c.host_pool.used_pages == 0
    assert_gone(c, store, A)
    c.close()


def test_other_namespaces_stay_and_the_live_listing_shows_deadlines(store):
    clock = Clock()
    c = ttl_cache(store, clock, default=10.0)
    serve(c, "a", A)
    clock.at(5)
    serve(c, "b", B)
    listing = {r.extra_key: r for r in execute(c, NamespacesRequest()).namespaces}
    assert listing["tb"].deadline - listing["ta"].deadline == pytest.approx(5, abs=0.01)
    assert not listing["ta"].expiry_deferred
    poll_at(c, clock, 10)
    assert_gone(c, store, A)
    assert_held(c, store, B)
    c.close()


# --- the tracker's lazy heap against a plain model --------------------------------------------------------------


@pytest.mark.parametrize("mode", list(TTLMode))
def test_the_lazy_heap_says_what_a_plain_model_says(mode):
    """Random uses (with and without a ttl_s, shorter and longer), sweeps and overflows on 12 namespaces: `due`
    and `overflow` name exactly the namespaces a scan of every deadline names, and the heap stays bounded."""
    import random

    from kvcache.engine.ttl import TTLTracker

    rng = random.Random(17)
    policy = TTLPolicy(mode, 5.0, 30.0, 8, 0.0)
    tracker = TTLTracker(policy, clock=lambda: now, fingerprints=FingerprintKey(b"k" * 32))
    spaces = [Namespace(f"n{i}", "s") for i in range(12)]
    model: dict[bytes, list] = {}  # ns id -> [first use, ttl, deadline]
    now = 0.0
    for _ in range(1500):
        now += rng.choice([0.0, 0.1, 0.5, 2.0])
        ns = rng.choice(spaces)
        if rng.random() < 0.7:
            ttl_s = rng.choice([None, None, 1.0, 3.0, 50.0])
            over = tracker.use(ns, ttl_s, now)
            row = model.setdefault(ns.id, [now, policy.default_ttl_s, 0.0])
            if ttl_s is not None:
                row[1] = min(ttl_s, policy.max_ttl_s)
            row[2] = (now if mode is TTLMode.SLIDING else row[0]) + row[1]
            assert over == (len(model) > policy.max_namespaces)
            if over:
                victims = tracker.overflow(ns)
                closest = sorted((r[2], i) for i, r in model.items() if i != ns.id)[:len(model) - 8]
                assert sorted(v.deadline for v in victims) == [d for d, _ in closest]
                for v in victims:
                    tracker.expired(v.namespace, ExpiryCause.OVERFLOW, 0, 0, 0, 0)
                    del model[v.namespace.id]
        else:
            due = tracker.due(now)
            assert sorted(e.namespace.id for e in due) == sorted(i for i, r in model.items() if r[2] <= now)
            for e in due:
                tracker.expired(e.namespace, ExpiryCause.DEADLINE, 0, 0, 0, 0)
                del model[e.namespace.id]
        assert len(tracker) == len(model) and len(tracker._heap) <= 2 * len(model) + 65
