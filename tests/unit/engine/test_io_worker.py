"""The I/O worker runs jobs in steps, FIFO, on its thread or inline, and hands failures back as values."""

import collections

import pytest

from kvcache.engine.io_worker import IOWorker


class Job:
    def __init__(self, steps, fail_at=None):
        self.steps, self.fail_at, self.ran = steps, fail_at, 0
        self.finished, self.error = False, None

    def step(self, store):
        self.ran += 1
        if self.ran == self.fail_at:
            raise OSError("disk went away")
        return self.ran < self.steps


@pytest.mark.parametrize("threaded", [False, True])
def test_jobs_run_to_completion_and_come_back_to_their_issuers_queue(threaded):
    w = IOWorker(store=None, threaded=threaded)
    mine, theirs = collections.deque(), collections.deque()
    jobs = [Job(3), Job(1), Job(2, fail_at=2)]
    for j, done in zip(jobs, (mine, theirs, mine), strict=True):
        w.submit(j, done)
    w.drain()
    assert [j.ran for j in jobs] == [3, 1, 2]
    assert all(j.finished for j in jobs) and isinstance(jobs[2].error, OSError) and jobs[0].error is None
    assert set(map(id, mine)) == {id(jobs[0]), id(jobs[2])} and list(theirs) == [jobs[1]] and w.idle
    w.close()


def test_inline_steps_interleave_between_jobs():
    w = IOWorker(store=None, threaded=False)
    a, b = Job(3), Job(3)
    w.submit(a, collections.deque())
    w.submit(b, collections.deque())
    assert w.run_pending(max_steps=2) == 2 and (a.ran, b.ran) == (1, 1)  # re-queued between steps


@pytest.mark.parametrize("threaded", [False, True])
def test_wait_for_one_job(threaded):
    w = IOWorker(store=None, threaded=threaded)
    j = Job(5)
    w.submit(j, collections.deque())
    assert w.wait(j, timeout=10) and j.ran == 5
    w.close()
