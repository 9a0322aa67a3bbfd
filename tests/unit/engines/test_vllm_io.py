"""kvcache.engines.vllm_io: the tier's I/O threads — priorities, deadlines, drains — with a run function the test
holds on events (no store, no vLLM; nothing waits on time but the poll for a thread to take a job)."""

from __future__ import annotations

import threading
import time

import pytest

from kvcache.engines.vllm_io import Done, IOPool, Job, JobKind

WAIT_S = 60.0


def wait_until(predicate) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, "condition never met"
        time.sleep(0.001)


class Held:
    """A run function that blocks each job until the test releases it, and records the order jobs started."""

    def __init__(self) -> None:
        self.started: list[tuple[JobKind, int]] = []
        self.gates: dict[int, threading.Event] = {}

    def __call__(self, job: Job) -> Done:
        self.started.append((job.kind, job.job_id))
        self.gates.setdefault(id(job), threading.Event()).wait(WAIT_S)
        return Done(job, (True,) * len(job.keys), 0.001)

    def release(self, job: Job) -> None:
        self.gates.setdefault(id(job), threading.Event()).set()


def job(kind: JobKind, job_id: int, **kw) -> Job:
    return Job(job_id, kind, [b"k%d" % job_id], [job_id], **kw)


def test_lookups_go_first_then_loads_before_stores_on_a_load_first_thread():
    run = Held()
    pool = IOPool(1, run, "t")
    blocker = job(JobKind.STORE, 0)
    pool.submit(blocker)
    wait_until(lambda: run.started)
    queued = [job(JobKind.STORE, 1), job(JobKind.LOAD, 2), job(JobKind.LOOKUP, 3), job(JobKind.LOAD, 4)]
    for j in queued:
        pool.submit(j)
        run.release(j)
    run.release(blocker)
    wait_until(lambda: len(run.started) == 5 and not pool.running())
    assert [i for _, i in run.started] == [0, 3, 2, 4, 1]
    pool.close()


def test_a_store_first_thread_takes_stores_before_loads_so_cascades_never_starve():
    run = Held()
    threads: dict[int, str] = {}
    inner = run.__call__

    def named(j: Job) -> Done:
        threads[j.job_id] = threading.current_thread().name
        return inner(j)

    pool = IOPool(2, named, "t")  # t-0 takes loads first, t-1 stores first
    a, b = job(JobKind.LOAD, 0), job(JobKind.LOAD, 1)
    pool.submit(a)
    pool.submit(b)
    wait_until(lambda: len(run.started) == 2)  # both threads busy
    load, store = job(JobKind.LOAD, 2), job(JobKind.STORE, 3)
    pool.submit(load)  # queued first
    pool.submit(store)
    on_t1 = a if threads[0] == "t-1" else b
    run.release(on_t1)  # only the store-first thread frees up: it takes the store, though a load waits longer
    wait_until(lambda: len(run.started) == 3)
    assert run.started[2] == (JobKind.STORE, 3) and threads[3] == "t-1"
    for j in (a, b, load, store):
        run.release(j)
    pool.close()


def test_a_load_past_its_deadline_while_running_is_handed_back_with_an_event_set_when_it_ends():
    run = Held()
    pool = IOPool(1, run, "t")
    late = job(JobKind.LOAD, 7, deadline=100.0)
    pool.submit(late)
    wait_until(lambda: pool.running())
    assert pool.expire(now=99.0) == []  # not yet
    (expired,) = pool.expire(now=100.0)
    assert expired is late and late.reported and late.released is not None and not late.released.is_set()
    assert pool.expire(now=200.0) == []  # handed back once
    run.release(late)
    assert late.released.wait(WAIT_S)
    wait_until(lambda: not pool.running())
    assert pool.finished() == []  # its outcome is dropped: it was reported at its deadline
    pool.close()


def test_a_load_still_queued_at_its_deadline_never_starts_and_is_finished_failed():
    run = Held()
    pool = IOPool(1, run, "t")
    blocker = job(JobKind.STORE, 0)
    pool.submit(blocker)
    wait_until(lambda: pool.running())
    queued = job(JobKind.LOAD, 1, deadline=5.0)
    pool.submit(queued)
    assert pool.expire(now=6.0) == []  # nothing running is late: the queued one is finished, not handed back
    (done,) = pool.finished()
    assert done.job is queued and done.ok == (False,) and done.fault and queued.released is None
    run.release(blocker)
    pool.close()
    assert (JobKind.LOAD, 1) not in run.started


def test_drain_cancels_what_waits_and_returns_once_nothing_runs():
    run = Held()
    pool = IOPool(1, run, "t")
    running, waiting = job(JobKind.STORE, 0), job(JobKind.STORE, 1)
    pool.submit(running)
    wait_until(lambda: pool.running())
    pool.submit(waiting)
    drained = threading.Thread(target=pool.drain)
    drained.start()
    wait_until(lambda: any(d.job is waiting for d in list(pool._finished)))
    assert drained.is_alive()  # still waiting for the running copy: never abandoned half-way
    run.release(running)
    drained.join(WAIT_S)
    assert not drained.is_alive()
    outcomes = {d.job.job_id: d for d in pool.finished()}
    assert outcomes[0].ok == (True,) and outcomes[1].ok == (False,) and "cancelled" in outcomes[1].fault
    pool.close()


def test_a_job_submitted_after_close_is_finished_failed_and_a_run_that_raises_is_a_failed_job():
    def boom(j: Job) -> Done:
        raise RuntimeError("store gone\nsecond line")

    pool = IOPool(1, boom, "t")
    pool.submit(job(JobKind.LOAD, 1))
    wait_until(lambda: not pool.busy() or pool._finished)
    (done,) = pool.finished()
    assert done.ok == (False,) and done.fault == "RuntimeError: store gone"
    pool.close()
    pool.close()  # idempotent
    pool.submit(job(JobKind.STORE, 2))
    (late,) = pool.finished()
    assert late.ok == (False,) and "shut down" in late.fault


@pytest.mark.parametrize("threads", [1, 3])
def test_every_job_finishes_exactly_once(threads):
    seen: list[int] = []
    lock = threading.Lock()

    def run(j: Job) -> Done:
        with lock:
            seen.append(j.job_id)
        return Done(j, (True,), 0.0)

    pool = IOPool(threads, run, "t")
    for i in range(500):
        pool.submit(job(JobKind(i % 3), i))
    pool.drain()
    finished = pool.finished()
    assert sorted(d.job.job_id for d in finished) == list(range(500))
    assert len(seen) + sum(1 for d in finished if d.fault) == 500
    pool.close()
