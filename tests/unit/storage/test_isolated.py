"""kvcache/storage/isolated.py: a function run in a forked child; its result, its progress, and how it died."""

import os
import signal
import time

from kvcache.storage.isolated import run_isolated


def test_the_result_and_every_progress_report_come_back():
    seen = []
    result, died = run_isolated(lambda report: [report(i) for i in range(3)] and {"x": 1}, on_progress=seen.append)
    assert died is None and result == {"x": 1} and seen == [0, 1, 2]


def test_an_abort_is_reported_with_the_last_progress_and_no_core():
    before = set(os.listdir("."))
    result, died = run_isolated(lambda report: (report(("meta", 7)), os.abort()))
    assert result is None and died.signal == signal.SIGABRT and died.progress == ["meta", 7]
    assert "SIGABRT" in died.describe() and set(os.listdir(".")) == before  # no core file


def test_an_exception_is_reported_by_type_and_message():
    _, died = run_isolated(lambda report: 1 / 0)
    assert died.signal is None and died.error_type == "ZeroDivisionError" and "division" in died.error


def test_a_child_that_stays_silent_is_killed():
    start = time.monotonic()
    _, died = run_isolated(lambda report: time.sleep(30), stall_s=0.3)
    assert died.signal == signal.SIGKILL and time.monotonic() - start < 10
