"""kvcache.engine.transfer: the in-flight copy operation, its owners, and how it follows the tree."""

import numpy as np

from kvcache import Namespace, RadixKey
from kvcache.engine.operation import OpKind
from kvcache.engine.transfer import OpTarget, TransferOp
from kvcache.ledger.pools import SlotPool
from kvcache.tree import RadixTree


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
