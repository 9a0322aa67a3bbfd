"""L3 -> L2 prefetch: the operation a request's prefetch creates, its I/O jobs, and its whole life.

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

import enum
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InvalidInput, NamespaceMismatch, RequestIdInUse, UnknownRequest
from ..types.config import PrefetchPolicy
from ..types.explain import PrefetchFate, PrefetchRecord
from ..types.ids import PageHash
from ..types.keys import TOKEN_BYTES, RadixKey, extend_chain, hash_root, page_hashes
from ..types.namespace import Namespace
from ..types.owners import FREE_CODE, OwnerKind, owner_code
from ..types.request import Request
from ..types.results import DeclineReason, DropReason, PrefetchOutcome, SettledPrefetch
from ..types.stats import bump
from ..types.tier import Tier
from .holders import release_anchor

if TYPE_CHECKING:
    from ..ledger.pools import SlotPool
    from ..storage.api import PageStore
    from ..tree import RadixTree, TreeMatch, TreeNode
    from ..types.config import CacheConfig
    from ..types.stats import PrefetchStats
    from .expiry import Expiry
    from .holders import Holders
    from .host_mode import HostModeRules
    from .io_worker import IOWorker
    from .recent import RecentPrefetches
    from .room import Room
    from .staging import StagedPrefetch, Staging

log = logging.getLogger("kvcache")


class PrefetchState(str, enum.Enum):
    """Where a prefetch operation is."""

    CHECKING = "checking"  # waiting for exists_prefix
    FETCHING = "fetching"  # pages allocated, batches being read
    WAITING = "waiting"  # an attempt ended short; re-armed for a later attempt
    DONE = "done"  # no more attempts; what arrived stays owned by the operation until admission
    FINISHED = "finished"  # handed over (admission) or given back (abort); the operation holds nothing


class PrefetchOp:
    """An L3 -> L2 prefetch for one request. Owns its host pages (Op(prefetch)) until admission or abort."""

    __slots__ = ("id", "owner", "rid", "namespace", "key", "start_page", "hashes", "anchor", "hold", "pages",
                 "fetched", "attempts", "state", "lock", "terminated", "next_attempt", "created", "job", "hit")

    def __init__(self, ident: int, rid: str, key: RadixKey, start_page: int, hashes: list[PageHash],
                 anchor: TreeNode | None, hold: Tier | None) -> None:
        self.id = ident
        self.owner = owner_code(OwnerKind.OP_PREFETCH, ident)
        self.rid = rid
        self.namespace: Namespace = key.namespace  # the request's: every hash below was built from it
        self.key = key  # the request's key, page-aligned, up to the end of the span
        self.start_page = start_page  # pages of the key the tree held at issue; the span starts here
        self.hashes = hashes  # page hashes of the span, from the request's own chain
        self.anchor = anchor  # ends the span's prefix [0, start_page); None when the span starts at page 0
        self.hold = hold  # the tier on which the anchor's path is held while the operation lives (None: no hold)
        self.pages = np.empty(0, dtype=np.int64)  # host pages owned by this op; [:fetched] hold span pages
        self.fetched = 0  # pages of the span that have arrived, in order; changed only under `lock`
        self.attempts = 0
        self.state = PrefetchState.CHECKING
        self.lock = threading.Lock()  # held by the worker for one batch; taken by terminate()
        self.terminated = False  # no further batch starts once set
        self.next_attempt = 0.0  # monotonic seconds when a WAITING op is re-armed
        self.created = time.monotonic()
        self.job: CheckJob | FetchJob | None = None  # the job in flight, if any
        self.hit = 0  # pages of the span the store reported present (the longest run seen by any attempt)

    @property
    def wanted(self) -> int:
        """Pages of the span."""
        return len(self.hashes)

    @property
    def issued_by(self) -> int:
        """The prefetch that took the hold (this one): holds are cancelled youngest first."""
        return self.id

    def terminate(self) -> None:
        """Stop between batches: after this returns, the worker writes no more bytes for this op."""
        with self.lock:
            self.terminated = True

    def __repr__(self) -> str:
        return (f"PrefetchOp(#{self.id} {self.rid} {self.namespace.label} {self.state.value} "
                f"{self.fetched}/{self.wanted} pages)")


class CheckJob:
    """How many pages of the op's remaining span the store holds (consecutive from the first missing one)."""

    def __init__(self, op: PrefetchOp) -> None:
        self.op = op
        self.hit = 0
        self.finished = False
        self.error: BaseException | None = None

    def step(self, store: PageStore) -> bool:
        """Ask the store once; never more to do."""
        op = self.op
        if not op.terminated:
            self.hit = store.exists_prefix(op.hashes[op.fetched:])
        return False


class FetchJob:
    """Reads the op's hit pages into its host pages, one batch per step."""

    def __init__(self, op: PrefetchOp, views: list[np.ndarray], batch: int) -> None:
        self.op = op
        self.views = views  # writable byte views of op.pages[op.fetched:], one per page
        self.batch = batch
        self.done_pages = 0  # pages of `views` filled
        self.finished = False
        self.error: BaseException | None = None

    def step(self, store: PageStore) -> bool:
        """Read one batch; True when more remain."""
        op = self.op
        with op.lock:
            if op.terminated:
                return False
            start = op.fetched
            end = min(start + self.batch, start + len(self.views) - self.done_pages)
            if end <= start:
                return False
            got = store.get_into(op.hashes[start:end], self.views[self.done_pages:self.done_pages + end - start])
            self.done_pages += got
            op.fetched = start + got
            # a short batch: the page left the store (evicted, corrupt) since the check; the attempt ends here
            return got == end - start and self.done_pages < len(self.views)


class Prefetcher:
    """Issues a cache's prefetches, advances them as their I/O jobs finish, and settles or gives them back."""

    def __init__(self, config: CacheConfig, rules: HostModeRules, tree: RadixTree, host_pool: SlotPool | None,
                 holders: Holders, io: IOWorker | None, stats: PrefetchStats, recent: RecentPrefetches) -> None:
        self.config = config
        self.recent = recent  # how the last prefetch of each prefix ended (`TieredCache.explain` reads it)
        self.rules = rules
        self.tree = tree
        self.host_pool = host_pool
        self.holders = holders
        self.io = io  # None without a store: every prefetch declines
        self.stats = stats
        self.room: Room  # wired by the cache: host pages for the hit
        self.staging: Staging  # wired by the cache: buffer mode parks finished fetches there
        self.expiry: Expiry | None = None  # wired by the cache with a TTL policy: a prefetch uses its namespace
        # wired by the cache: takes every finished L3 job back (writes too), while admission waits for a fetch
        self.take_io_jobs: Callable[[], int]

    # --- issue -----------------------------------------------------------------------------------------------

    def start(self, request: Request, match: TreeMatch | None = None) -> PrefetchOutcome:
        """`TieredCache.prefetch`: see there."""
        st, holders = self.stats, self.holders
        st.attempts += 1
        rid, ns = request.rid, request.namespace
        held = holders.held_key(rid)
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
        if self.expiry is not None:  # after the refusals above: a refused prefetch moves nothing, expires nothing
            self.expiry.use(request)
            held = holders.held_key(rid)  # an expiry of the request's own namespace gave back what it held
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
        self.io.submit(op.job)

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
            pages = self.room.alloc(Tier.HOST, n, op.owner, op.namespace) if n > 0 else None
            if pages is not None:
                assert self.io is not None and self.host_pool is not None
                op.pages = np.concatenate([op.pages, pages])
                self.holders.prefetch_host_pages += n
                rows = self.host_pool.rows()  # one writable byte row per page
                op.state = PrefetchState.FETCHING
                op.job = FetchJob(op, [rows[p] for p in pages.tolist()], self.config.io_batch_pages)
                self.io.submit(op.job)
                return
        self._end_attempt(op)

    def _end_attempt(self, op: PrefetchOp) -> None:
        """Free what this attempt allocated and did not fill; re-arm a short attempt or mark the op done."""
        extra = op.pages[op.fetched:]
        if len(extra):
            assert self.host_pool is not None
            self.host_pool.free(extra, op.owner)
            self.holders.prefetch_host_pages -= len(extra)
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

    def rearm(self) -> None:
        """Start the next attempt of the operations whose retry is due."""
        now = time.monotonic()
        for op in self.holders.prefetches.values():
            if op.state is PrefetchState.WAITING and op.next_attempt <= now:
                self.stats.retried += 1
                self._submit_check(op)

    # --- settle ----------------------------------------------------------------------------------------------

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
                self.give_back(op, DropReason.ABORTED)
            raise
        return SettledPrefetch(rid, op.id, op.hit, op.fetched, inserted, rid in self.holders.staged,
                               time.monotonic() - op.created, self.tree.fingerprints.info(op.namespace))

    def settle_op(self, op: PrefetchOp, policy: PrefetchPolicy | None = None,
                  timeout_ms: float | None = None) -> int:
        """Admission: finish `op` (already out of the table) per the prefetch policy and hand what arrived to the
        tree (cache mode) or to a staged record (buffer mode). Returns the pages inserted into the tree."""
        policy = self.config.prefetch_policy if policy is None else PrefetchPolicy(policy)
        io = self.io
        if policy is not PrefetchPolicy.BEST_EFFORT and io is not None:
            budget = None
            if policy is PrefetchPolicy.TIMEOUT:
                budget = (self.config.prefetch_timeout_ms if timeout_ms is None else timeout_ms) \
                    + self.config.prefetch_timeout_per_page_ms * op.wanted
                budget = max(0.0, op.created + budget / 1000 - time.monotonic())
            deadline = None if budget is None else time.monotonic() + budget
            while op.job is not None:
                # one wait at most an hour (a condition wait overflows past ~9e9 s); the loop goes on to the end
                left = None if deadline is None else min(3600.0, max(0.0, deadline - time.monotonic()))
                if not io.wait(op.job, left):
                    break
                self.take_io_jobs()
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
        self.holders.prefetch_host_pages -= len(op.pages)
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
        self.holders.prefetch_host_pages -= len(op.pages)
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
