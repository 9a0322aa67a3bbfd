"""A request's prefetch from the top: starting one (after its refusals, the use of its namespace) and settling
one, without an admission or as admission's first step.

Settling waits for the operation's L3 jobs as the prefetch policy says (best effort: not at all; timeout: until
its budget is spent; otherwise until they end), taking finished jobs back meanwhile, then hands what arrived to the
tree or to a staged record (`Prefetcher.conclude`). An operation whose settling fails gives back what it holds.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from ..errors import InvalidInput, UnknownRequest
from ..types.results import DropReason, PrefetchOutcome, SettledPrefetch
from .prefetch_op import PrefetchState

if TYPE_CHECKING:
    from ..tree import RadixTree, TreeMatch
    from ..types.config import PrefetchPolicy
    from ..types.request import Request
    from .completion import Completion
    from .expiry import Expiry
    from .holders import Holders
    from .prefetch import Prefetcher
    from .prefetch_op import PrefetchOp


class Settlement:
    """Starts and settles one cache's prefetches on behalf of their requests."""

    def __init__(self, prefetcher: Prefetcher, completion: Completion, holders: Holders, tree: RadixTree,
                 expiry: Expiry | None) -> None:
        self.prefetcher = prefetcher
        self.completion = completion  # waits for an operation's jobs, taking finished ones back
        self.holders = holders
        self.tree = tree
        self.expiry = expiry  # None without a TTL policy

    def prefetch(self, request: Request, match: TreeMatch | None = None) -> PrefetchOutcome:
        """`TieredCache.prefetch`: see there."""
        prefetcher = self.prefetcher
        prefetcher.refuse(request, match)
        if self.expiry is not None:  # after the refusals: a refused prefetch moves nothing, expires nothing
            self.expiry.use(request)
        return prefetcher.start(request, match)

    def settle(self, rid: str, policy: PrefetchPolicy | None = None,
               timeout_ms: float | None = None) -> SettledPrefetch:
        """`TieredCache.settle_prefetch`: see there."""
        if timeout_ms is not None and not 0 <= timeout_ms < math.inf:
            raise InvalidInput(f"timeout_ms={timeout_ms} must be >= 0 and finite")
        op = self.holders.prefetches.pop(rid, None)
        if op is None:
            raise UnknownRequest(rid, "has no prefetch to settle")
        try:
            inserted = self.settle_op(op, policy, timeout_ms)
        except BaseException:  # the op is out of the table: give back what it holds, or nobody ever will
            if op.state is not PrefetchState.FINISHED:
                op.terminate()
                self.prefetcher.give_back(op, DropReason.ABORTED)
            raise
        return SettledPrefetch(rid, op.id, op.hit, op.fetched, inserted, rid in self.holders.staged,
                               time.monotonic() - op.created, self.tree.fingerprints.info(op.namespace))

    def settle_op(self, op: PrefetchOp, policy: PrefetchPolicy | None = None, timeout_ms: float | None = None) -> int:
        """Admission: finish `op` (already out of the table) per the prefetch policy and hand what arrived to the
        tree (cache mode) or to a staged record (buffer mode). Returns the pages inserted into the tree."""
        prefetcher = self.prefetcher
        chosen = prefetcher.policy(policy)
        if prefetcher.waits(chosen):
            self.completion.wait_for_fetch(op, prefetcher.deadline(op, chosen, timeout_ms))
        return prefetcher.conclude(op, chosen)
