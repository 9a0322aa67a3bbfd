"""Buffer-mode staged prefetches: a completed fetch parked until its request is admitted.

A `StagedPrefetch` records the request it was fetched for — id, key tokens, **namespace**, where the span starts,
its host pages and page hashes — and owns those host pages in the ledger (owner `Staged(id)`). Consuming it
checks it against the admitted request: a record of another namespace, or whose key is not a prefix of the
request's tokens (a reused request id), is dropped (pages freed, counted, logged with both fingerprints) and never
spliced; a match splices it into the tree under a key rebuilt from the record's own namespace. Its pages count
against the prefetch host budget until then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import InvariantViolation
from ..types.keys import TOKEN_BYTES, RadixKey
from ..types.owners import FREE_CODE, OwnerKind, owner_code
from ..types.request import Request
from ..types.results import DropReason
from ..types.stats import bump
from .operation import release_anchor
from .staged import StagedPrefetch

if TYPE_CHECKING:
    from ..tree import RadixTree, TreeNode
    from ..types.stats import PrefetchStats
    from .copies import Copies
    from .holders import Holders
    from .prefetch_op import PrefetchOp
    from .room import PoolRoom


class Staging:
    """A cache's staged records: parked by the prefetch, spliced by admission, or dropped."""

    def __init__(self, copies: Copies, tree: RadixTree, holders: Holders, stats: PrefetchStats,
                 device_room: PoolRoom) -> None:
        self.copies = copies  # a splice's host -> device copy (on the copier's stream on a GPU), and its source
        self.copier = copies.copier
        self.device_pool = copies.device_pool
        self.host_pool = copies.host_pool
        self.tree = tree
        self.holders = holders
        self.stats = stats
        self.device_room = device_room  # device pages for a splice

    def park(self, op: PrefetchOp, fetched: np.ndarray) -> StagedPrefetch:
        """Record `op`'s fetched pages as the request's staged record (Op(prefetch) -> Staged); the record takes
        over the op's hold on its anchor and its place in the prefetch host budget."""
        assert self.host_pool is not None
        staged = StagedPrefetch(self.holders.mint(), op.rid, op.key, self.tree.page_size, op.start_page, fetched,
                                op.hashes[: len(fetched)], op.id, op.anchor, op.hold)
        self.host_pool.transfer(fetched, op.owner, staged.owner)
        self.holders.staged[op.rid] = staged
        return staged

    def drop(self, staged: StagedPrefetch, reason: DropReason) -> None:
        """Free a staged record's host pages (Staged -> FREE) and release its anchor's hold; never splice it."""
        assert self.host_pool is not None
        self.host_pool.free(staged.pages, staged.owner)
        self.holders.count_prefetch_pages(-len(staged.pages))
        release_anchor(self.tree, staged)
        bump(self.stats.dropped, reason.value, len(staged.pages))

    def consume(self, staged: StagedPrefetch, request: Request, node: TreeNode,
                cached: np.ndarray) -> tuple[TreeNode, np.ndarray, int]:
        """At admission: splice `staged` (checked to serve `request`) after the request's cached device pages.
        Returns the new locked end node, the cached pages, and how many pages were spliced."""
        skip = len(cached) - staged.start_page  # staged pages the device already holds
        if skip < 0:
            self.drop(staged, DropReason.PREFIX_GAP)
            return node, cached, 0
        use = staged.pages[skip:]
        owner = owner_code(OwnerKind.OP_LOAD_BACK, self.holders.mint())
        dev = self.device_room.alloc(len(use), owner, staged.key.namespace) if len(use) else None
        if dev is None:
            self.drop(staged, DropReason.DUPLICATE if not len(use) else DropReason.UNATTACHED)
            return node, cached, 0
        assert self.host_pool is not None
        copied = self.copier.copy(self.host_pool, use, self.device_pool, dev)
        self.copier.order_current_stream(copied)  # the request's forward reads these pages after the copy
        # The splice key is rebuilt from the record's own namespace (checked equal to the request's above).
        end = staged.start_page + len(staged.pages)
        key = RadixKey(staged.key.data[: end * self.tree.page_size * TOKEN_BYTES], staged.key.namespace)
        ins = self.tree.insert(key, np.concatenate([cached, dev]))
        n_dup = max(0, ins.prefix_pages - len(cached))
        parts, at = [(n_dup, FREE_CODE)], n_dup
        for adopted in ins.adopted:
            at += len(adopted.device) if adopted.device is not None else 0
            parts.append((at, adopted.owner))
        parts.append((len(dev), FREE_CODE))
        self.device_pool.disperse(dev, owner, parts)
        if copied is None:
            self.host_pool.free(staged.pages, staged.owner)
        else:  # the GPU may still be reading them
            self.copies.hold_source(staged.pages, staged.owner, copied)
        self.holders.count_prefetch_pages(-len(staged.pages))
        # After the splice the tree must own exactly the spliced device slots, in the request's namespace.
        again = self.tree.match_prefix(key)
        held = again.device_pages
        if (len(held) != end or not np.array_equal(held[: len(cached)], cached)
                or not np.array_equal(held[len(cached) + n_dup:], dev[n_dup:])):
            raise InvariantViolation(f"request {request.rid}: after splicing staged record {staged.id} the tree "
                                     f"does not own exactly the spliced device pages")
        self.tree.lock(again.device_node)
        self.tree.unlock(node)
        release_anchor(self.tree, staged)
        self.stats.used_pages += len(dev) - n_dup
        bump(self.stats.dropped, DropReason.DUPLICATE.value, skip + n_dup)
        return again.device_node, again.device_pages, len(dev) - n_dup
