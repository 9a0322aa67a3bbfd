"""kvcache.engine.backups: when backups run, one class per host mode, picked once from a table."""

import pytest

from factories import l3_cache, make_cache, make_layout, make_store
from kvcache import HostMode, Namespace, Request, WritePolicy
from kvcache.engine.backups import BACKUPS, BounceBackups, HostCopyBackups, NoBackups
from kvcache.engine.host_mode import BackupTarget


def test_every_backup_target_has_its_backups():
    assert set(BACKUPS) == set(BackupTarget)
    assert len(set(BACKUPS.values())) == len(BackupTarget)


@pytest.mark.parametrize("mode, with_store, kind, write_back", [
    (HostMode.CACHE, True, HostCopyBackups, "back_up_now"),
    (HostMode.CACHE, False, HostCopyBackups, "back_up_now"),
    (HostMode.BUFFER, True, BounceBackups, "bounce_now"),
    (HostMode.BUFFER, False, NoBackups, None),
])
def test_each_host_mode_backs_up_and_writes_back_its_own_way(tmp_path, mode, with_store, kind, write_back):
    kw = dict(host_mode=mode, write_policy=WritePolicy.WRITE_BACK)
    if with_store:
        c = l3_cache(make_store(tmp_path / "s", make_layout(4)), **kw)
    else:
        c = make_cache(page_size=4, device_tokens=64, host_tokens=64, **kw)
    backups = c._completion.backups
    assert type(backups) is kind
    device_write_back = c._admissions._device_room.write_back
    if write_back is None:
        assert device_write_back is None
    else:
        assert device_write_back == getattr(backups, write_back)  # the device room's write-back is the mode's
    c.close()


def test_a_write_back_policy_copies_a_victim_to_l2_before_its_device_copy_goes():
    c = make_cache(page_size=1, device_tokens=8, host_tokens=16, write_policy=WritePolicy.WRITE_BACK)
    ns = Namespace("t", "backups-salt")
    c.admit(Request("a", list(range(8)), ns))
    c.commit("a")
    assert c.holder_states() == [] and c.counters.backups_started == 0  # write-back: nothing at commit
    assert c.evict(device_tokens=8).device_pages == 8
    m = c.match(Request("probe", list(range(8)), ns))
    assert len(m.host_pages) == 8 and c.counters.backups_completed == 1
    assert c.audit().ok


def test_a_backup_that_fits_only_a_leading_run_backs_up_that_run_and_skips_the_rest():
    c = make_cache(page_size=1, device_tokens=64, host_tokens=4)
    ns = Namespace("t", "s")
    for rid, tokens in (("f", [100, 101]), ("x", list(range(6))), ("y", [0, 1, 7, 8, 9])):
        c.admit(Request(rid, tokens, ns))
        c.commit(rid)
        c.flush()
    # f took 2 of the 4 host pages; x (6 pages) did not fit; y split x: its path is x's head (2) then its own 3
    assert c.counters.backups_skipped == 2  # x whole, then y's own tail
    m = c.match(Request("probe", [0, 1, 7, 8, 9], ns))
    head = m.device_node.parent
    assert head.host is not None and len(head.host) == 2 and m.device_node.host is None
    assert c.audit().ok
