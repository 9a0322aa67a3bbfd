"""kvcache.engine.copies: the in-flight copy operation and its owners."""

import numpy as np

from kvcache import Namespace, RadixKey
from kvcache.engine.copies import OP_OWNER_KIND, OpKind, OpTarget, TransferOp
from kvcache.ledger.pools import SlotPool
from kvcache.tree import RadixTree


def test_every_op_kind_is_an_owner_kind():
    assert set(OP_OWNER_KIND) == set(OpKind)
    assert len(set(OP_OWNER_KIND.values())) == len(OpKind)


def test_split_target_follows_a_tree_split():
    tree = RadixTree(1)
    ins = tree.insert(RadixKey.of(range(5), Namespace()), np.arange(5))
    pool = SlotPool("host", 8, 1, 8)
    pages = pool.alloc(5, 1)
    op = TransferOp(1, OpKind.BACKUP, pool, pages, [OpTarget(ins.node, pages)])
    tree.on_split = op.split_target
    tree.match_prefix(RadixKey.of([0, 1, 7], Namespace()))
    head, tail = op.targets
    assert head.node is ins.node.parent and list(head.pages) == list(pages[:2])
    assert tail.node is ins.node and list(tail.pages) == list(pages[2:])


def test_a_backup_that_fits_only_a_leading_run_backs_up_that_run_and_skips_the_rest():
    from factories import make_cache
    from kvcache import Request

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
