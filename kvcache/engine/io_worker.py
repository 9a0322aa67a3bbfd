"""The background I/O worker: runs L3 jobs (storage writes, prefetch checks and fetches) off the scheduler thread.

A job runs in steps (one L3 batch each) and is re-queued between steps, so a long prefetch never holds the
worker and can be terminated between batches. A finished job goes to the queue the part that submitted it named
(`Writes.done`, `Prefetcher.done`), in the order jobs finish, until the scheduler thread's `poll()` has that part
take it back: the worker never touches the pools, the ledger or the tree — only the store and the page bytes of
the pages its job was given (which the job's owner keeps allocated and pinned until the job is taken back).

With ``threaded=False`` nothing runs in the background: `run_pending()` runs queued steps in the caller's thread.
Replays and property tests use that mode for reproducible interleavings.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from ..storage.api import PageStore


class IOJob(Protocol):
    """One unit of L3 work. `step` does one batch and says whether more remain; exceptions end the job."""

    finished: bool
    error: BaseException | None

    def step(self, store: PageStore) -> bool:
        """Do one batch; True when the job wants another step."""


J = TypeVar("J", bound=IOJob)


class IOWorker:
    """A FIFO of L3 jobs, run by one background thread or by `run_pending`."""

    def __init__(self, store: PageStore, threaded: bool = True) -> None:
        self.store = store
        self.threaded = threaded
        # jobs to step, each with the queue it goes to when it finishes
        self._queue: collections.deque[tuple[IOJob, collections.deque[IOJob]]] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._loop, name="kvc-io", daemon=True)
            self._thread.start()

    def submit(self, job: J, done: collections.deque[J]) -> None:
        """Queue a job; when it finishes it is appended to `done` (its issuer's), and only then marked finished."""
        with self._cv:
            self._queue.append((job, done))  # type: ignore[arg-type]  # `done` receives this job only
            self._cv.notify_all()

    def run_pending(self, max_steps: int | None = None) -> int:
        """Run queued steps in this thread (threaded=False mode); returns how many ran."""
        steps = 0
        while self._queue and (max_steps is None or steps < max_steps):
            self._run_step(self._queue.popleft())
            steps += 1
        return steps

    def wait(self, job: IOJob, timeout: float | None = None) -> bool:
        """Wait until `job` has finished (running steps inline without a thread). True when it has."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.threaded:
            while not job.finished and self._queue:
                if deadline is not None and time.monotonic() >= deadline:
                    break
                self._run_step(self._queue.popleft())
            return job.finished
        with self._cv:
            while not job.finished:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._cv.wait(remaining)
            return job.finished

    def drain(self) -> None:
        """Wait until every queued job has finished."""
        if not self.threaded:
            self.run_pending()
            return
        with self._cv:
            while self._queue or self._busy:
                self._cv.wait()

    @property
    def idle(self) -> bool:
        """No job queued or running."""
        return not self._queue and not self._busy

    def close(self) -> None:
        """Finish queued jobs and stop the thread."""
        self.drain()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()

    _busy = False

    def _run_step(self, entry: tuple[IOJob, collections.deque[IOJob]]) -> None:
        job, done = entry
        try:
            more = job.step(self.store)
        except Exception as exc:  # an L3 fault ends the job; the scheduler counts it and goes on
            job.error, more = exc, False
        if more:
            self._queue.append(entry)
        else:
            done.append(job)  # before `finished`: a waiter that sees it finished finds it in `done`
            job.finished = True

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                entry = self._queue.popleft()
                self._busy = True
            try:
                self._run_step(entry)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()


def take_back(done: collections.deque[J], finish: Callable[[J], None]) -> int:
    """Hand each job of `done` (a part's queue of its finished jobs) to `finish`, in the order they finished, on the
    scheduler thread. Returns how many."""
    n = 0
    while done:
        finish(done.popleft())
        n += 1
    return n
