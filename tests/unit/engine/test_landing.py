"""kvcache.engine.landing: what a finished backup becomes, one class per host mode."""

import numpy as np
import pytest

from factories import l3_cache, make_cache, make_layout, make_store
from kvcache import HostMode, Namespace, Request
from kvcache.engine.host_mode import BackupTarget
from kvcache.engine.landing import LANDINGS, NoBackup
from kvcache.engine.operation import OpKind
from kvcache.engine.transfer import TransferOp
from kvcache.errors import InvariantViolation
from kvcache.ledger.pools import SlotPool

NS = Namespace("t", "landing-salt")
TOKENS = list(range(300, 316))


def test_every_backup_target_has_a_landing():
    assert set(LANDINGS) == set(BackupTarget) and len(set(LANDINGS.values())) == len(BackupTarget)


def test_cache_mode_a_finished_backup_is_the_nodes_host_copy():
    c = make_cache(page_size=4, device_tokens=64, host_tokens=64)
    c.admit(Request("a", TOKENS, NS))
    c.commit("a")
    assert [s.kind for s in c.holder_states()] == ["op:backup"]
    c.flush()
    m = c.match(Request("probe", TOKENS, NS))
    node = m.device_node
    assert node.host is not None and len(node.host) == 4
    assert np.all(c.host_pool.owners(node.host) == node.owner)  # Op -> Node
    assert c.audit().ok


def test_buffer_mode_a_finished_backup_is_a_bounce_copy_an_l3_write_takes_over(tmp_path):
    c = l3_cache(make_store(tmp_path / "s", make_layout(4)), host_mode=HostMode.BUFFER)
    c.admit(Request("a", TOKENS, NS))
    c.commit("a")
    c._completion.copies.complete_all()  # the copy lands; its L3 write is queued, not run (inline I/O)
    states = c.holder_states()
    assert [s.kind for s in states] == ["op:storage_write"] and len(states[0].pages) == 4 * 8  # owns 4 pages
    node = c.match(Request("probe", TOKENS, NS)).device_node
    assert node.host is None and not node.stored  # never a host copy of the tree
    assert c.audit().ok
    c.run_io()
    assert node.stored and c.holder_states() == [] and c.host_pool.used_pages == 0  # freed at the acknowledgement
    assert c.audit().ok
    c.close()


def test_with_nothing_to_back_up_to_no_backup_ever_lands():
    landing = NoBackup(None, None, None)
    pool = SlotPool("host", 4, 1, 8)
    op = TransferOp(7, OpKind.BACKUP, pool, pool.alloc(2, 1), [])
    assert landing.covered(object()) and not landing.busy(op)
    with pytest.raises(InvariantViolation, match="backs nothing up"):
        landing.land(op)
