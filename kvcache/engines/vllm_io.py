"""The I/O threads of kvc's vLLM tier: jobs queued by the scheduler thread, run on threads of their own, their
outcomes collected by the scheduler thread again.

vLLM calls a secondary tier from its scheduler and the tier must never block there: `submit_store` and
`submit_load` only queue a `Job`, and `get_finished_jobs` only collects what the threads finished (`Done`). The
threads take lookups first (a request waits a whole step on each one), then loads (a request waits on a promotion)
before stores (nothing waits on a cascade but the primary chunks it pins), except that every other thread takes
stores first so a stream of promotions never starves the cascades (as vLLM's own `fs` tier does).

A load may carry a deadline: one still running past it is handed back by `expire` with an event, which the
scheduler reports failed at once with that event as vLLM's `deferred_release` (vLLM keeps the primary chunks out of
its free pool until the event is set); the thread sets it when the copy ends, and its outcome is dropped. A load
still queued past its deadline never starts: it is reported failed with no event (no I/O touched its chunks).

`drain` cancels what has not started (each reported failed, as vLLM's `drain_jobs` allows) and waits for what
runs, so when it returns no thread touches vLLM's memory or the store and every deferred-release event is set.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec


class JobKind(enum.IntEnum):
    """What a job does; its value is its priority (lowest first)."""

    LOOKUP = 0  # is each key stored? (the async lookup mode's probes; nothing is copied)
    LOAD = 1  # copy pages from the store into vLLM's primary chunks (a promotion)
    STORE = 2  # copy vLLM's primary chunks into the store (a cascade)


class Job(msgspec.Struct):
    """One unit of tier I/O, queued by the scheduler thread. Mutable: the pool marks it started and, for an
    expired load, reported."""

    job_id: int  # vLLM's job id (LOAD, STORE); the tier's own counter for a LOOKUP
    kind: JobKind
    keys: list[bytes]  # vLLM OffloadKeys, in the job's order
    chunk_ids: list[int]  # the primary chunk of each key (LOAD, STORE; empty for a LOOKUP)
    req: Any = None  # vLLM's ReqContext of the job (events name it); None for a LOOKUP
    deadline: float = math.inf  # time.monotonic() past which a LOAD is reported failed; inf: never
    started: float = 0.0  # time.monotonic() when a thread took it; 0.0 while queued
    reported: bool = False  # an expired LOAD already reported failed: its outcome is dropped
    released: threading.Event | None = None  # an expired running LOAD's deferred release: set when its I/O ends


class Done(msgspec.Struct, frozen=True):
    """What a job did."""

    job: Job
    ok: tuple[bool, ...]  # per key: stored (STORE: not rejected), copied and verified (LOAD), present (LOOKUP)
    seconds: float  # time the I/O took on its thread (0.0 for a job that never ran)
    nbytes: int = 0  # payload bytes moved: pages written (STORE), pages copied into vLLM's memory (LOAD)
    evicted_keys: tuple[bytes, ...] = ()  # STORE: keys of this deployment's pages the store evicted for it
    fault: str = ""  # one line when a fault ended the job (a store error, a cancellation); "" otherwise


def never_ran(job: Job, why: str) -> Done:
    """The outcome of a job that was cancelled or expired before a thread took it: every key failed."""
    return Done(job, (False,) * len(job.keys), 0.0, fault=why)


class IOPool:
    """Threads that run `run(job)` for queued jobs (see the module docstring). Thread-safe: `submit`, `finished`,
    `expire` and `drain` are called from vLLM's scheduler side, one at a time (vLLM's manager lock)."""

    def __init__(self, threads: int, run: Callable[[Job], Done], name: str) -> None:
        self._run = run
        self._cond = threading.Condition()
        self._queues: dict[JobKind, deque[Job]] = {kind: deque() for kind in JobKind}
        self._running: dict[int, Job] = {}  # id(job) -> job, while a thread runs it
        self._finished: deque[Done] = deque()
        self._stop = False
        self._threads = [threading.Thread(target=self._work, args=(i,), name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, job: Job) -> None:
        """Queue a job for the threads."""
        with self._cond:
            if self._stop:
                self._finished.append(never_ran(job, "the tier is shut down"))
                return
            self._queues[job.kind].append(job)
            self._cond.notify()

    def finished(self) -> list[Done]:
        """The outcomes of the jobs finished since the last call, in the order they finished."""
        with self._cond:
            out = list(self._finished)
            self._finished.clear()
        return out

    def running(self) -> list[Job]:
        """The jobs a thread runs now."""
        with self._cond:
            return list(self._running.values())

    def busy(self) -> bool:
        """Whether any job is queued, running, or finished and not collected."""
        with self._cond:
            return bool(self._running or self._finished or any(self._queues.values()))

    def expire(self, now: float) -> list[Job]:
        """LOADs past their deadline. A queued one is taken off its queue and its outcome (never ran) queued with
        the finished ones; a running one is marked reported and given its `released` event, and returned: the
        caller reports it failed now, with that event (the thread sets it when the copy ends)."""
        late: list[Job] = []
        with self._cond:
            queue = self._queues[JobKind.LOAD]
            if any(job.deadline <= now for job in queue):
                keep = [job for job in queue if job.deadline > now]
                for job in queue:
                    if job.deadline <= now:
                        self._finished.append(never_ran(job, "timed out before its copy started"))
                queue.clear()
                queue.extend(keep)
            for job in self._running.values():
                if job.kind is JobKind.LOAD and not job.reported and job.deadline <= now:
                    job.reported, job.released = True, threading.Event()
                    late.append(job)
        return late

    def drain(self) -> None:
        """Cancel every queued job (each finished as failed) and wait until no job runs."""
        with self._cond:
            for queue in self._queues.values():
                for job in queue:
                    self._finished.append(never_ran(job, "cancelled by a drain before it started"))
                queue.clear()
            self._cond.wait_for(lambda: not self._running)

    def close(self) -> None:
        """Drain, then stop and join the threads. Idempotent."""
        self.drain()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()

    def _take(self, stores_first: bool) -> Job | None:
        order = (JobKind.LOOKUP, JobKind.STORE, JobKind.LOAD) if stores_first else tuple(JobKind)
        for kind in order:
            if self._queues[kind]:
                return self._queues[kind].popleft()
        return None

    def _work(self, index: int) -> None:
        stores_first = index % 2 == 1
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or any(self._queues.values()))
                job = self._take(stores_first)
                if job is None:  # stopping, nothing queued
                    return
                job.started = time.monotonic()
                self._running[id(job)] = job
            try:
                done = self._run(job)
            except BaseException as exc:  # run() turns store faults into outcomes; anything else still ends it
                done = Done(job, (False,) * len(job.keys), time.monotonic() - job.started,
                            fault=f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
            with self._cond:
                del self._running[id(job)]
                if job.released is not None:  # reported failed at its deadline: vLLM waits for this, not for `done`
                    job.released.set()
                else:
                    self._finished.append(done)
                self._cond.notify_all()
