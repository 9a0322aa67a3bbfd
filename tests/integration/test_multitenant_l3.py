"""End to end, the test the upstream fix lacked: tenants' prefixes written to L3 by one cache are prefetched by
another cache whose matches stop at the root; each prefetch hits its own namespace only, and every reused byte is
what the writer wrote. Cache mode and buffer mode, threaded I/O."""

import pytest

from factories import device_bytes_ok, forward, l3_cache, make_layout, make_store
from kvcache import AdmitStatus, Namespace, Request
from kvcache.types.config import HostMode

TENANTS = [Namespace("t1", "s1"), Namespace("t2", "s2"), Namespace()]
SYSTEM = list(range(1000, 1064))  # the same tokens in every namespace: only the namespace keeps them apart


@pytest.mark.parametrize("mode", list(HostMode))
def test_two_caches_share_l3_per_namespace(tmp_path, mode):
    store = make_store(tmp_path / "store", make_layout(4))
    a = l3_cache(store, host_mode=mode, io_thread=True)
    for i, ns in enumerate(TENANTS):
        req = Request(f"a{i}", SYSTEM + [i] * 8, ns)
        adm = a.admit(req)
        forward(a, req, adm)
        a.commit(req.rid)
    a.flush()
    assert a.audit().ok and a.stats().backup.storage_pages == 3 * 18

    b = l3_cache(store, host_mode=mode, io_thread=True)
    for i, ns in enumerate(TENANTS):
        req = Request(f"b{i}", SYSTEM + [i] * 8 + [5, 5, 5], ns)
        m = b.match(req)
        assert m.device_tokens == 0 and m.host_tokens == 0 and m.anchor is b.tree.root
        out = b.prefetch(req, m)
        assert out.issued and out.requested_tokens == 72 and out.namespace == b.fingerprints.info(ns)
        b.flush()
        adm = b.admit(req)
        assert adm.status is AdmitStatus.ADMITTED and adm.cached_tokens == 72
        assert device_bytes_ok(b, req, adm.slots, 72)  # every reused token is what cache A wrote
        forward(b, req, adm)
        b.commit(req.rid)
        assert b.audit().ok
    # another tenant's request with the same tokens finds nothing of theirs
    stranger = Request("x", SYSTEM + [0] * 8, Namespace("t3", "s3"))
    out = b.prefetch(stranger)
    b.flush()
    adm = b.admit(stranger)
    assert out.issued and adm.cached_tokens == 0
    b.release("x")
    stats = b.stats()
    assert {h.namespace.extra_key: h.storage for h in stats.hits} == {"t1": 72, "t2": 72, None: 72, "t3": 0}
    assert stats.prefetch.hit_pages == 54 and stats.prefetch.namespace_mismatches == 0
    assert b.audit().ok
    a.close()
    b.close()
    store.close()
