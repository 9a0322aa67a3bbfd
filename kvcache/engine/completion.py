"""What finishes between scheduler steps: copies, in issue order, and L3 jobs taken back on the scheduler thread;
failed L3 writes and prefetches retried and shares refreshed when due. `poll` runs what has finished; `flush` waits for all.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .prefetch import CheckJob, FetchJob
from .writes import StorageWriteJob

if TYPE_CHECKING:
    from .copies import Copies
    from .holders import Holders
    from .io_worker import IOWorker
    from .prefetch import Prefetcher
    from .shares import AppliedShares
    from .writes import Writes


class Completion:
    """Completes one cache's copies and L3 jobs."""

    def __init__(self, holders: Holders, copies: Copies, writes: Writes, prefetcher: Prefetcher,
                 io: IOWorker | None, shares: AppliedShares) -> None:
        self.holders = holders
        self.copies = copies
        self.writes = writes
        self.prefetcher = prefetcher
        self.io = io  # None without a store
        self.shares = shares

    def poll(self) -> int:
        """Complete the copies that finished (in issue order) and the L3 jobs that finished, re-arm due prefetch
        retries, refresh the shares when due. Returns how many copies and jobs completed."""
        done = self.copies.complete_done()
        io = self.io
        if io is not None:
            if not io.threaded:
                io.run_pending()
            done += self.take_io_jobs()
            self.writes.retry_failed()
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
        """Take finished L3 jobs back on the scheduler thread: writes to `writes`, prefetch jobs to `prefetch`."""
        io, n = self.io, 0
        while io is not None and io.done:
            job = io.done.popleft()
            n += 1
            if isinstance(job, StorageWriteJob):
                self.writes.finish(job)
            else:
                assert isinstance(job, (CheckJob, FetchJob))  # the worker runs L3 writes and prefetch jobs only
                self.prefetcher.job_done(job)
        return n

    def flush(self) -> int:
        """Wait for every in-flight copy and L3 write (and the prefetch batches queued now) and complete them."""
        done, io, holders = 0, self.io, self.holders
        while holders.copies or (io is not None and (holders.writes or io.done or not io.idle)):
            done += self.copies.complete_all()
            if io is not None:
                io.drain()
                done += self.take_io_jobs()
        return done
