"""kvcache.storage.handle: what every backend's handle keeps in memory (counters, the log of unflushed reads)."""

from __future__ import annotations

import pytest

from kvcache.storage.api import AccessPolicy, StoreCounters
from kvcache.storage.handle import COUNTED, AccessLog, StoreHandle, count_read, new_counts


def test_counts_are_every_counter_but_the_one_the_log_knows():
    assert set(COUNTED) == set(StoreCounters.__struct_fields__) - {"pending_access"}
    assert set(new_counts().values()) == {0}


@pytest.mark.parametrize("served,asked,copied,pages_read,misses", [
    (4, 4, False, 0, 0), (2, 4, False, 0, 1), (3, 3, True, 3, 0), (0, 5, True, 0, 1)])
def test_a_short_read_is_a_miss_and_copied_pages_are_read(served, asked, copied, pages_read, misses):
    counts = new_counts()
    assert count_read(counts, served, asked, copied) == served
    assert (counts["pages_read"], counts["misses"]) == (pages_read, misses)


def test_a_flush_is_due_after_so_many_reads():
    log = AccessLog(AccessPolicy(flush_reads=3, flush_interval_s=1e9))
    assert [log.record(10.0, b"h", 2), log.record(11.0, b"h", 1), log.record(12.0, b"h", 5)] == [False, False, True]
    assert log.pages == 8 and bool(log)


def test_a_flush_is_due_when_the_oldest_read_is_old():
    log = AccessLog(AccessPolicy(flush_reads=1000, flush_interval_s=5.0))
    assert not log.record(100.0, b"a", 1)
    assert not log.record(104.9, b"b", 1)
    assert log.record(105.0, b"c", 1)
    log.take()
    assert not log.record(200.0, b"d", 1)  # the clock of "oldest" starts again with the next read


def test_take_empties_and_restore_puts_back_ahead_of_later_reads():
    log = AccessLog(AccessPolicy())
    log.record(1.0, b"a", 1)
    log.record(2.0, b"b", 2)
    taken = log.take()
    assert [e[1] for e in taken] == [b"a", b"b"] and log.pages == 0 and not log
    log.record(3.0, b"c", 4)
    log.restore(taken)  # the flush of `taken` failed
    assert [e[1] for e in log.take()] == [b"a", b"b", b"c"]


def test_a_log_given_back_again_and_again_keeps_only_the_newest_reads():
    log = AccessLog(AccessPolicy(), keep=3)
    for i in range(5):
        log.record(float(i), bytes([i]), 1)
    log.restore(log.take())
    assert [e[1] for e in log.take()] == [b"\x02", b"\x03", b"\x04"]


def test_clear_forgets_every_read():
    log = AccessLog(AccessPolicy())
    log.record(1.0, b"a", 3)
    log.clear()
    assert (log.pages, log.take()) == (0, [])


class _Handle(StoreHandle):
    def __init__(self) -> None:
        self.location, self.layout, self.readonly, self.closed = "somewhere", None, True, False

    def close(self) -> None:
        self.closed = True


def test_a_handle_closes_as_a_context_manager_and_says_where_it_is():
    with _Handle() as h:
        assert repr(h) == "_Handle('somewhere', no layout, read-only)"
    assert h.closed
