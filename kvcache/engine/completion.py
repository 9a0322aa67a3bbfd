"""What finishes between scheduler steps: copies, in issue order, and L3 jobs taken back on the scheduler thread by
the part that issued them; orphaned and failed L3 writes written again and prefetches retried when due; shares
refreshed when due. `poll` runs what has finished; `flush` waits for all; `wait_for_fetch` waits for one prefetch.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .backups import Backups
    from .copies import Copies
    from .holders import Holders
    from .io_worker import IOWorker
    from .prefetch import Prefetcher
    from .prefetch_op import PrefetchOp
    from .shares import AppliedShares
    from .writes import Writes


class Completion:
    """Completes one cache's copies and L3 jobs."""

    def __init__(self, holders: Holders, copies: Copies, writes: Writes, backups: Backups, prefetcher: Prefetcher,
                 io: IOWorker | None, shares: AppliedShares) -> None:
        self.holders = holders
        self.copies = copies
        self.writes = writes
        self.backups = backups
        self.prefetcher = prefetcher
        self.io = io  # None without a store
        self.shares = shares

    def poll(self) -> int:
        """Complete the copies that finished (in issue order) and the L3 jobs that finished, write again what is
        due, re-arm due prefetch retries, refresh the shares when due. Returns how many copies and jobs completed."""
        done = self.copies.complete_done()
        io = self.io
        if io is not None:
            if not io.threaded:
                io.run_pending()
            done += self.take_io_jobs()
            self.backups.retry_failed()
            self.prefetcher.rearm()
            if time.monotonic() >= self.shares.due:
                self.shares.refresh_quietly()
        return done

    def run_io(self, max_steps: int | None = None) -> int:
        """Run up to `max_steps` steps of the queued L3 jobs on this thread and take back what finished."""
        if self.io is None:
            return 0
        self.io.run_pending(max_steps=max_steps)
        return self.take_io_jobs()

    def take_io_jobs(self) -> int:
        """Take finished L3 jobs back on the scheduler thread, each by the part that issued it: writes (then the
        paths an orphaned write leaves to write again), then prefetch checks and fetches."""
        n = self.writes.take_back()
        if self.writes.rewrites:
            self.backups.rewrite_orphans()
        return n + self.prefetcher.take_back()

    def wait_for_fetch(self, op: PrefetchOp, deadline: float | None) -> None:
        """Wait for `op`'s check and fetch jobs until it has none left or `deadline` (monotonic seconds; None: no
        limit) passes, taking finished L3 jobs back as they come."""
        io = self.io
        while op.job is not None and io is not None:
            # one wait at most an hour (a condition wait overflows past ~9e9 s); the loop goes on to the end
            left = None if deadline is None else min(3600.0, max(0.0, deadline - time.monotonic()))
            if not io.wait(op.job, left):
                break
            self.take_io_jobs()

    def flush(self) -> int:
        """Wait for every in-flight copy and L3 write (and the prefetch batches queued now) and complete them."""
        done, io, holders = 0, self.io, self.holders
        while holders.copies or (io is not None and (holders.writes or self._answered() or not io.idle)):
            done += self.copies.complete_all()
            if io is not None:
                io.drain()
                done += self.take_io_jobs()
        return done

    def _answered(self) -> bool:
        """L3 jobs finished and not yet taken back."""
        return bool(self.writes.done or self.prefetcher.done)
