"""Snapshots: written atomically, read back strictly, and audited with exactly the checks of a live audit."""

import msgspec
import numpy as np
import pytest

from factories import forward, l3_cache, make_cache, make_layout, make_store
from kvcache import Namespace, Request
from kvcache.diagnostics.audit import audit_snapshot
from kvcache.diagnostics.snapshot import SNAPSHOT_VERSION, InvalidSnapshot, read_snapshot
from kvcache.types.config import HostMode
from kvcache.types.owners import OwnerKind, owner_code

T1 = Namespace("t1", "snapshot-salt-xyzzy")


def busy_cache():
    c = make_cache(page_size=2, device_tokens=32, host_tokens=32)
    for rid, toks in (("a", range(8)), ("b", list(range(4)) + [9, 9, 9, 9])):
        adm = c.admit(Request(rid, toks, T1))
        forward(c, Request(rid, toks, T1), adm)
        c.commit(rid)
    c.admit(Request("live", list(range(8)) + [5, 5, 5], T1))
    return c


def kinds(report):
    return sorted(v.kind.value for v in report.violations)


def both(cache, tmp_path):
    live = cache.audit()
    cache.snapshot(tmp_path / "s.snap")
    offline = audit_snapshot(read_snapshot(tmp_path / "s.snap"))
    assert kinds(live) == kinds(offline) and live.checked == offline.checked
    return kinds(live)


def leaf(c):
    return next(n for n in c.tree.nodes() if n.device is not None and not n.children)


def test_healthy_cache_audits_clean_live_and_offline(tmp_path):
    c = busy_cache()
    assert both(c, tmp_path) == []
    snap = read_snapshot(tmp_path / "s.snap")
    assert snap.version == SNAPSHOT_VERSION and snap.layout == c.layout and snap.device_pages == 16
    assert [n.info for n in snap.namespaces] == [c.fingerprints.info(T1)]  # under the cache's key
    assert b"xyzzy" not in (tmp_path / "s.snap").read_bytes()


def test_slot_owned_by_two_nodes(tmp_path):
    c = busy_cache()
    a = leaf(c)
    b = next(n for n in c.tree.nodes() if n is not a and n.device is not None and len(n.device) == len(a.device))
    a.device = b.device.copy()
    assert {"double_owner", "dangling_ref", "leak"} <= set(both(c, tmp_path))


def test_leaked_slot(tmp_path):
    c = busy_cache()
    c.device_pool.alloc(1, owner_code(OwnerKind.REQUEST, 4242))
    assert both(c, tmp_path) == ["leak"]


def test_lock_underflow(tmp_path):
    c = busy_cache()
    leaf(c).lock_ref = -1
    assert set(both(c, tmp_path)) == {"lock_underflow", "lock_mismatch"}


def test_staged_record_whose_slots_were_freed(tmp_path):
    store = make_store(tmp_path / "store", make_layout(4))
    w = l3_cache(store)
    req = Request("w", range(32), T1)
    forward(w, req, w.admit(req))
    w.commit("w")
    w.close()
    c = l3_cache(store, host_mode=HostMode.BUFFER)
    c.prefetch(Request("r", range(32), T1))
    c.flush()
    [staged] = c.staged_records()
    assert both(c, tmp_path) == []
    c.host_pool.free(staged.pages, staged.owner)  # a bug frees the record's pages behind its back
    assert set(both(c, tmp_path)) == {"free_but_referenced", "double_owner"}  # on the free list and held
    store.close()


def test_random_workloads_audit_clean_offline(tmp_path):
    rng = np.random.default_rng(7)
    c = make_cache(page_size=2, device_tokens=64, host_tokens=64)
    for i in range(200):
        toks = rng.integers(0, 4, size=int(rng.integers(1, 20))).tolist()
        ns = [T1, Namespace("t2"), Namespace()][i % 3]
        adm = c.admit(Request(f"r{i}", toks, ns))
        if adm.status.value == "admitted":
            (c.commit if rng.random() < 0.8 else c.release)(f"r{i}")
        if i % 7 == 0:
            c.evict(device_tokens=8, host_tokens=4)
        if i % 5 == 0:
            assert both(c, tmp_path) == []
            c.poll()


def test_bad_snapshot_files(tmp_path):
    c = busy_cache()
    path = tmp_path / "s.snap"
    c.snapshot(path)
    data = path.read_bytes()
    (tmp_path / "truncated").write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidSnapshot, match="truncated|damaged"):
        read_snapshot(tmp_path / "truncated")
    newer = msgspec.msgpack.decode(data)
    newer["version"] = SNAPSHOT_VERSION + 1
    (tmp_path / "newer").write_bytes(msgspec.msgpack.encode(newer))
    with pytest.raises(InvalidSnapshot, match="newer"):
        read_snapshot(tmp_path / "newer")
    (tmp_path / "foreign").write_bytes(msgspec.msgpack.encode({"kind": "something-else", "version": 1}))
    with pytest.raises(InvalidSnapshot, match="not a kvc snapshot"):
        read_snapshot(tmp_path / "foreign")
    with pytest.raises(InvalidSnapshot, match="cannot read"):
        read_snapshot(tmp_path / "missing")
