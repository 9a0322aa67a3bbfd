"""L3 -> L2 prefetch: the whole life of the operation a request's prefetch creates (the operation and its I/O jobs
are `kvcache.engine.prefetch_op`'s; waiting for them at a settle is `kvcache.engine.settlement`'s).

The prefetch key is built from the **request's** namespace: the page hashes of the span come from the request's
own chain (`page_hashes(layout_id, request.key, ps, chain_key)`), never from a tree node. The anchor the span hangs from is only
checked — it must be the tree's root or of the request's namespace — and a disagreement is `NamespaceMismatch`,
raised before any slot is taken.

The operation is bound to its request: its key (namespace and tokens) is the request's, and admission uses it only
for a request whose tokens start with that key. It *holds* its anchor's path on the one tier its result attaches
to (a host copy in cache mode, the device prefix in buffer mode), never the whole path, and only within bounds.

The span is the request's whole pages past what the tree holds (past its device prefix in buffer mode). A match
handed in that no longer describes the tree or the request declines as `STALE_MATCH`; the same request again
declines `IN_FLIGHT`. The hold is the anchor's host copy (cache mode: the fetched pages attach below it) or the
device prefix (buffer mode: the splice extends it), within `prefetch_max_device_tokens`; nothing when the span
starts at the first page. It lasts until admission or abort.

Life of one operation — every state change is made in this module (all pool and tree moves on the scheduler
thread; the I/O worker only reads the store and writes the bytes of pages the operation owns):

    CHECKING  --exists_prefix-->  (poll) allocate host pages for the hit, FREE -> Op(prefetch)
    FETCHING  --get_into, one batch per step, stoppable between batches-->  (poll) attempt done
    WAITING   a short attempt, re-armed (bounded, paced) until admission
    DONE      no more attempts; in buffer mode what arrived is parked at once as a staged record
    FINISHED  settled: what arrived became host-only nodes (cache mode) or a staged record, or was given back
"""

from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from ..errors import NamespaceMismatch, RequestIdInUse
from ..types.config import PrefetchPolicy
from ..types.explain import PrefetchFate, PrefetchRecord
from ..types.ids import PageHash
from ..types.keys import TOKEN_BYTES, RadixKey, extend_chain, hash_root, page_hashes
from ..types.owners import FREE_CODE
from ..types.request import Request
from ..types.results import DeclineReason, DropReason, PrefetchOutcome
from ..types.stats import bump
from ..types.tier import Tier
from .io_worker import take_back
from .operation import release_anchor
from .prefetch_op import CheckJob, FetchJob, PrefetchOp, PrefetchState

if TYPE_CHECKING:
    from ..ledger.pools import SlotPool
    from ..tree import RadixTree, TreeMatch, TreeNode
    from ..types.config import CacheConfig
    from ..types.stats import PrefetchStats
    from .holders import Holders
    from .host_mode import HostModeRules
    from .io_worker import IOWorker
    from .recent import RecentPrefetches
    from .room import PoolRoom
    from .staged import StagedPrefetch
    from .staging import Staging

log = logging.getLogger("kvcache")


class Prefetcher:
    """Issues a cache's prefetches, advances them as their I/O jobs finish, and settles or gives them back."""

    def __init__(self, config: CacheConfig, rules: HostModeRules, tree: RadixTree, host_pool: SlotPool | None,
                 holders: Holders, io: IOWorker | None, stats: PrefetchStats, recent: RecentPrefetches,
                 host_room: PoolRoom | None, staging: Staging) -> None:
        self.config = config
        self.recent = recent  # how the last prefetch of each prefix ended (`TieredCache.explain` reads it)
        self.rules = rules
        self.tree = tree
        self.host_pool = host_pool
        self.holders = holders
        self.io = io  # None without a store: every prefetch declines
        self.stats = stats
        self.host_room = host_room  # host pages for the hit (None without a host tier: every prefetch declines)
        self.staging = staging  # buffer mode parks finished fetches there
        self.done: collections.deque[CheckJob | FetchJob] = collections.deque()  # jobs the worker finished, in order

    # --- issue -----------------------------------------------------------------------------------------------

    def refuse(self, request: Request, match: TreeMatch | None) -> None:
        """`TieredCache.prefetch`'s refusals, before anything moves: `RequestIdInUse` for an id that holds
        something for another request, `NamespaceMismatch` for a match whose anchor is of another namespace."""
        st = self.stats
        st.attempts += 1
        rid, ns = request.rid, request.namespace
        held = self.holders.held_key(rid)
        if held is not None and not request.key.starts_with(held):
            raise RequestIdInUse(rid, f"already holds a prefetch, staged record or admission for another request "
                                      f"(namespace {self.tree.fingerprints.label(held.namespace)}, {len(held)} "
                                      f"tokens); reuse an id only "
                                      f"once nothing is held for it")
        if match is not None:
            for node, where in ((match.anchor, "prefetch anchor"), (match.host_node, "prefetch attach node")):
                if node.namespace is not None and node.namespace != ns:
                    st.namespace_mismatches += 1
                    label = self.tree.fingerprints.label
                    log.error("request %s: %s is in namespace %s, the request is in %s: not prefetching", rid,
                              where, label(node.namespace), label(ns))
                    start = len(match.device_pages) + len(match.host_pages)
                    self._record(request, None, start, PrefetchRecord(PrefetchFate.NAMESPACE_MISMATCH, time.time(),
                                                                      start * self.tree.page_size))
                    raise NamespaceMismatch(rid, label(ns), label(node.namespace), where)

    def start(self, request: Request, match: TreeMatch | None = None) -> PrefetchOutcome:
        """`TieredCache.prefetch`, once `refuse` let it through (and its namespace's use was counted): decline, or
        issue the operation."""
        st, holders = self.stats, self.holders
        rid, ns = request.rid, request.namespace
        held = holders.held_key(rid)
        stale = False
        if match is None:
            match = self.tree.match_prefix(request.key)
        else:  # checked after the TTL use: an expiry it caused may have left the caller's match behind
            stale = not self.describes(match, request.key)
        hold_tier, ps = self.rules.prefetch_tier, self.tree.page_size
        device_only = hold_tier is Tier.DEVICE  # the span extends the device prefix (buffer mode)
        end_node = match.device_node if device_only else match.host_node
        start_page = len(match.device_pages) + (0 if device_only else len(match.host_pages))
        span = len(request) // ps - start_page
        room = self.config.prefetch_max_host_pages - holders.prefetch_host_pages
        hold = None if start_page == 0 else hold_tier
        reason = None
        if self.io is None:
            reason = DeclineReason.NO_STORE
        elif self.host_pool is None:
            reason = DeclineReason.NO_HOST_TIER
        elif held is not None:
            reason = DeclineReason.IN_FLIGHT
        elif stale:
            reason = DeclineReason.STALE_MATCH
        elif span <= 0:
            reason = DeclineReason.NOTHING_TO_FETCH
        elif span * ps < self.config.prefetch_threshold_tokens:
            reason = DeclineReason.BELOW_THRESHOLD
        elif room <= 0:
            reason = DeclineReason.HOST_LIMIT
        elif hold is Tier.HOST and end_node.host is None:
            reason = DeclineReason.UNBACKED_PREFIX
        elif hold is Tier.DEVICE and (self.tree.device_held + self.tree.unheld_device_pages(end_node)
                                      > self.config.prefetch_max_device_pages):
            reason = DeclineReason.DEVICE_LIMIT
        if reason is not None:
            bump(st.declined, reason.value)
            if reason is not DeclineReason.IN_FLIGHT and span > 0:  # in flight: that prefetch's record stands
                self._record(request, None if stale else end_node, start_page, PrefetchRecord(
                    PrefetchFate.DECLINED, time.time(), start_page * ps, span * ps, declined=reason))
            return PrefetchOutcome(rid, False, reason, namespace=self.tree.fingerprints.info(ns))
        span = min(span, room)
        end = start_page + span
        key = RadixKey(request.key.data[: end * ps * TOKEN_BYTES], ns)
        hashes = page_hashes(self.tree.layout_id, key, ps, self.tree.chain_key)[start_page:]  # the request's own chain
        anchor = end_node if hold is not None else None
        if anchor is not None and hold is not None:
            self.tree.hold(anchor, hold)
        op = PrefetchOp(holders.mint(), rid, key, start_page, hashes, anchor, hold)
        holders.prefetches[rid] = op
        self._submit_check(op)
        st.issued += 1
        self.recent.record(hashes[0], PrefetchRecord(PrefetchFate.IN_FLIGHT, time.time(), start_page * ps, span * ps))
        return PrefetchOutcome(rid, True, None, op.id, start_page * ps, span * ps, self.tree.fingerprints.info(ns))

    def _record(self, request: Request, end_node: TreeNode | None, start_page: int, record: PrefetchRecord) -> None:
        """Record `record` for a prefetch of `request` that did not start (declined, refused) and would have
        started at page `start_page`, past `end_node` (the tree's last node of the prefix; None: not known to be
        attached, so the chain is computed from the request's root)."""
        tree, ps = self.tree, self.tree.page_size
        if start_page >= len(request) // ps:
            return
        pb = ps * TOKEN_BYTES
        start: PageHash
        if start_page == 0:
            start = hash_root(tree.layout_id, request.namespace, tree.chain_key)
        elif end_node is None:  # the chain from the request's root (rare: a stale match, a mismatch)
            start = page_hashes(tree.layout_id, RadixKey(request.key.data[:start_page * pb], request.namespace), ps,
                                tree.chain_key)[-1]
        else:
            start = tree.page_hashes(end_node)[-1]  # cached on the node once computed
        first = extend_chain(start, request.key.data[start_page * pb:(start_page + 1) * pb], ps)[0]
        self.recent.record(first, record)

    def _staged_dropped(self, staged: StagedPrefetch, reason: DropReason) -> None:
        """Record that the staged record of a finished prefetch was given back before its splice."""
        if staged.hashes:
            fate = PrefetchFate.CANCELLED if reason is DropReason.CANCELLED else PrefetchFate.DROPPED
            self.recent.ended(staged.hashes[0], fate, reason)

    def _settled(self, op: PrefetchOp, fate: PrefetchFate, dropped: DropReason | None = None) -> None:
        """Record how `op` ended."""
        ps = self.tree.page_size
        self.recent.record(op.hashes[0], PrefetchRecord(fate, time.time(), op.start_page * ps, op.wanted * ps,
                                                        op.hit * ps, op.fetched * ps, dropped=dropped))

    def describes(self, m: TreeMatch, key: RadixKey) -> bool:
        """Does `m` still describe the tree for `key`: its nodes in the tree, ending where it says, on the key's
        own tokens, with the device prefix still on the device?"""
        tree, pb = self.tree, self.tree.page_size * TOKEN_BYTES
        end, dev = m.host_node, m.device_node
        if not (tree.attached(end) and tree.attached(dev)):
            return False
        path = tree.path_key(end)
        if len(path) != (len(m.device_pages) + len(m.host_pages)) * pb or not key.data.startswith(path):
            return False
        if len(tree.path_key(dev)) != len(m.device_pages) * pb:
            return False
        return not tree.path(dev) or dev.device is not None

    def _submit_check(self, op: PrefetchOp) -> None:
        assert self.io is not None
        op.state = PrefetchState.CHECKING
        op.job = CheckJob(op)
        self.io.submit(op.job, self.done)

    # --- progress (poll) -------------------------------------------------------------------------------------

    def job_done(self, job: CheckJob | FetchJob) -> None:
        """A prefetch job finished: after a check, allocate host pages for the hit and fetch them; after a fetch,
        end the attempt. A job of a settled operation, or one it no longer waits for, is dropped."""
        op, st = job.op, self.stats
        if op.state is PrefetchState.FINISHED or job is not op.job:
            return
        op.job = None
        if job.error is not None:
            st.read_errors += 1
            log.warning("prefetch %s of request %s: L3 read failed: %s", op.id, op.rid, job.error)
        if isinstance(job, CheckJob) and job.hit and not op.terminated:
            st.hit_pages += job.hit
            op.hit = max(op.hit, op.fetched + job.hit)
            n = min(job.hit, self.config.prefetch_max_host_pages - self.holders.prefetch_host_pages)
            assert self.host_room is not None  # a prefetch without a host tier declines
            pages = self.host_room.alloc(n, op.owner, op.namespace) if n > 0 else None
            if pages is not None:
                assert self.io is not None and self.host_pool is not None
                op.pages = np.concatenate([op.pages, pages])
                self.holders.count_prefetch_pages(n)
                rows = self.host_pool.rows()  # one writable byte row per page
                op.state = PrefetchState.FETCHING
                op.job = FetchJob(op, [rows[p] for p in pages.tolist()], self.config.io_batch_pages)
                self.io.submit(op.job, self.done)
                return
        self._end_attempt(op)

    def _end_attempt(self, op: PrefetchOp) -> None:
        """Free what this attempt allocated and did not fill; re-arm a short attempt or mark the op done."""
        extra = op.pages[op.fetched:]
        if len(extra):
            assert self.host_pool is not None
            self.host_pool.free(extra, op.owner)
            self.holders.count_prefetch_pages(-len(extra))
            op.pages = op.pages[: op.fetched]
        op.attempts += 1
        if op.fetched < op.wanted and op.attempts <= self.config.prefetch_retries and not op.terminated:
            op.state = PrefetchState.WAITING
            op.next_attempt = time.monotonic() + self.config.prefetch_retry_interval_ms / 1000
            return
        op.state = PrefetchState.DONE
        if self.rules.park_fetches and op.fetched:
            # an empty result stays an op (holding nothing but its anchor's hold) until admission or abort
            self.holders.prefetches.pop(op.rid, None)
            self._park(op)

    def take_back(self) -> int:
        """Take back the check and fetch jobs the worker finished, in order (`job_done`). Returns how many."""
        return take_back(self.done, self.job_done)

    def rearm(self) -> None:
        """Start the next attempt of the operations whose retry is due."""
        now = time.monotonic()
        for op in self.holders.prefetches.values():
            if op.state is PrefetchState.WAITING and op.next_attempt <= now:
                self.stats.retried += 1
                self._submit_check(op)

    # --- settle ----------------------------------------------------------------------------------------------

    def policy(self, policy: PrefetchPolicy | None) -> PrefetchPolicy:
        """The policy a settle follows: the one asked for, else the configured one."""
        return self.config.prefetch_policy if policy is None else PrefetchPolicy(policy)

    def waits(self, policy: PrefetchPolicy) -> bool:
        """Does settling under `policy` wait for the op's jobs (anything but best effort, with a store)?"""
        return policy is not PrefetchPolicy.BEST_EFFORT and self.io is not None

    def deadline(self, op: PrefetchOp, policy: PrefetchPolicy, timeout_ms: float | None = None) -> float | None:
        """When settling `op` under `policy` stops waiting (monotonic seconds): the timeout policy's budget, from
        the op's creation (`timeout_ms` in place of the configured one), plus its per-page allowance; None: wait
        until the op's jobs end."""
        if policy is not PrefetchPolicy.TIMEOUT:
            return None
        budget = (self.config.prefetch_timeout_ms if timeout_ms is None else timeout_ms) \
            + self.config.prefetch_timeout_per_page_ms * op.wanted
        return time.monotonic() + max(0.0, op.created + budget / 1000 - time.monotonic())

    def conclude(self, op: PrefetchOp, policy: PrefetchPolicy) -> int:
        """Admission or settle, once the wait `policy` asks for is over: finish `op` (already out of the table) and
        hand what arrived to the tree (cache mode) or to a staged record (buffer mode). Returns the pages inserted
        into the tree."""
        cut_short = op.state in (PrefetchState.CHECKING, PrefetchState.FETCHING)  # its check or fetch still running
        op.terminate()
        op.job = None  # a job still queued sees `terminated` and ends without touching the pages
        if op.state not in (PrefetchState.DONE, PrefetchState.FINISHED):
            # stop here: free what was allocated and not filled, never re-arm
            op.attempts = self.config.prefetch_retries + 1
            self._end_attempt(op)
        if cut_short and policy is PrefetchPolicy.TIMEOUT:
            self._settled(op, PrefetchFate.TIMED_OUT)
        elif cut_short or op.fetched < op.hit:
            self._settled(op, PrefetchFate.PARTIAL)
        else:
            self._settled(op, PrefetchFate.COMPLETED)
        if op.state is PrefetchState.FINISHED:
            return 0  # buffer mode: parked as a staged record, spliced after the load-back
        return self._insert(op)

    def _insert(self, op: PrefetchOp) -> int:
        """Cache mode: what arrived becomes a host-only leaf under the request's namespace; pages the tree already
        holds are freed by the operation, never re-owned."""
        st, host = self.stats, self.host_pool
        assert host is not None
        st.seconds += time.monotonic() - op.created
        fetched = op.pages[: op.fetched]
        st.fetched_pages += len(fetched)
        st.fetched_bytes += len(fetched) * host.page_bytes
        node, duplicates, adopted = None, 0, 0
        if len(fetched):
            ins = self.tree.insert_host(op.key, op.start_page, fetched)
            node, duplicates, adopted = ins.node, ins.duplicates, ins.adopted
        used = duplicates + adopted
        parts = [(duplicates, FREE_CODE)]
        if node is not None:
            parts.append((used, node.owner))
        parts.append((len(fetched), FREE_CODE))
        host.disperse(fetched, op.owner, parts)
        bump(st.dropped, DropReason.DUPLICATE.value, duplicates)
        bump(st.dropped, DropReason.UNATTACHED.value, len(fetched) - used)
        st.used_pages += adopted
        self.holders.count_prefetch_pages(-len(op.pages))
        op.pages = op.pages[:0]
        release_anchor(self.tree, op)
        op.state = PrefetchState.FINISHED
        return adopted

    def _park(self, op: PrefetchOp) -> None:
        """Buffer mode: a finished fetch becomes a staged record (Op(prefetch) -> Staged), keeping the anchor's hold
        and its place in the prefetch host budget."""
        st = self.stats
        assert self.host_pool is not None
        fetched = op.pages[: op.fetched]
        st.fetched_pages += len(fetched)
        st.fetched_bytes += len(fetched) * self.host_pool.page_bytes
        st.seconds += time.monotonic() - op.created
        op.state = PrefetchState.FINISHED
        self._settled(op, PrefetchFate.COMPLETED if op.fetched >= op.hit else PrefetchFate.PARTIAL)
        self.staging.park(op, fetched)
        op.pages = op.pages[:0]
        op.anchor = None  # the record holds it now

    # --- give back -------------------------------------------------------------------------------------------

    def give_back(self, op: PrefetchOp, reason: DropReason) -> None:
        """Abort: return every page the op holds to FREE and release its anchor's hold."""
        self._settled(op, PrefetchFate.CANCELLED if reason is DropReason.CANCELLED else PrefetchFate.DROPPED, reason)
        if len(op.pages):
            assert self.host_pool is not None
            self.host_pool.free(op.pages, op.owner)
            bump(self.stats.dropped, reason.value, int(op.fetched))
        self.holders.count_prefetch_pages(-len(op.pages))
        op.pages = op.pages[:0]
        release_anchor(self.tree, op)
        op.state = PrefetchState.FINISHED

    def drop_holds(self, rid: str, reason: DropReason) -> bool:
        """Give back `rid`'s prefetch and staged record, if any. True if there was one."""
        op = self.holders.prefetches.pop(rid, None)
        if op is not None:
            op.terminate()
            self.give_back(op, reason)
        staged = self.holders.staged.pop(rid, None)
        if staged is not None:
            self.staging.drop(staged, reason)
            self._staged_dropped(staged, reason)
        return op is not None or staged is not None

    def drop_foreign_holds(self, request: Request) -> None:
        """Give back the prefetch or staged record held for `request`'s id when it was fetched for another request
        (a reused id): counted, logged, never used."""
        rid, holders = request.rid, self.holders
        op = holders.prefetches.get(rid)
        if op is not None:
            reason = self._foreign(op.key, f"prefetch {op.id}", request)
            if reason is not None:
                del holders.prefetches[rid]
                op.terminate()
                self.give_back(op, reason)
        staged = holders.staged.get(rid)
        if staged is not None:
            reason = self._foreign(staged.key, f"staged record {staged.id}", request)
            if reason is not None:
                del holders.staged[rid]
                self.staging.drop(staged, reason)
                self._staged_dropped(staged, reason)

    def _foreign(self, key: RadixKey, what: str, request: Request) -> DropReason | None:
        """Why a prefetch or staged record held for `request`'s id, fetched for `key`, must not serve it: another
        namespace, or tokens that do not start with its key (a reused request id). None when it serves it.
        A mismatch is counted and logged with both namespaces' fingerprints."""
        if key.namespace != request.namespace:
            self.stats.namespace_mismatches += 1
            label = self.tree.fingerprints.label
            log.error("request %s: %s is in namespace %s, the request is in %s: dropped, not used", request.rid,
                      what, label(key.namespace), label(request.namespace))
            return DropReason.NAMESPACE_MISMATCH
        if not request.key.data.startswith(key.data):
            log.error("request %s: %s was fetched for other tokens (the request id was reused): dropped, not used",
                      request.rid, what)
            return DropReason.KEY_MISMATCH
        return None
