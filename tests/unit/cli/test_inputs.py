"""kvc.inputs' checks of values typer hands over (issue 36, item 7): what each refuses, and that each lets through
what the commands take (the matrix of tests/integration/test_cli_every_input.py tries them through every option)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import typer

from kvc.errors import UsageError
from kvc.inputs import LATEST, MAX_PORT, cpus, endpoint, guard_values, moment, not_utf8, octal_mode, since_arg
from kvcache.storage.location import StoreLocation


class Param:
    """A parameter as `guard_values` sees one: a callback slot."""

    def __init__(self, callback=None) -> None:
        self.callback = callback


@pytest.mark.parametrize("value", [1.5, 0.0, -3.0, 10**30, 0, "t1", "ü日本", Path("/a/b"), ["x", 2.0], (1, 2),
                                   None, True, StoreLocation("redis://:pw@h:1/0")])
def test_the_guard_lets_what_a_command_can_use_through_to_the_callback(value):
    seen = []
    param = Param(lambda ctx, p, v: seen.append(v) or v)
    guard_values(param)
    assert param.callback(None, param, value) == value and seen == [value]


@pytest.mark.parametrize("value, says", [
    (math.nan, "nan is not a finite number"), (math.inf, "inf is not a finite number"),
    (-math.inf, "-inf is not a finite number"), ("a\udcffb", "undecodable byte 0xff at character 1"),
    (Path("/tmp/\udcfe"), "undecodable byte 0xfe at character 5"), ([1.0, math.nan], "nan is not a finite"),
    (StoreLocation("/srv/\udcff"), "undecodable byte 0xff at character 5"),
])
def test_the_guard_refuses_what_no_command_can_use_before_the_callback(value, says):
    called = []
    param = Param(lambda ctx, p, v: called.append(v))
    guard_values(param)
    with pytest.raises(typer.BadParameter, match=says):
        param.callback(None, param, value)
    assert called == []


def test_a_parameter_is_guarded_once():
    param = Param()
    guard_values(param)
    first = param.callback
    guard_values(param)  # a command built twice (help, then run) keeps one check
    assert param.callback is first and param.callback(None, param, 3) == 3


def test_not_utf8_never_repeats_the_text():
    said = not_utf8("secret\udcffsalt")
    assert said is not None and "secret" not in said and "salt" not in said
    assert not_utf8("plain ü") is None


@pytest.mark.parametrize("text", ["5557", "0", "*", "65535", "tcp://127.0.0.1:5557", "tcp://*:*", "tcp://[::1]:80",
                                  "ipc:///run/kvc/events", "inproc://feed", " 5557 "])
def test_endpoints_a_user_means(text):
    assert endpoint(text) == text.strip()


@pytest.mark.parametrize("text", ["99999", "65536", "-1", "tcp://127.0.0.1:99999", "tcp://127.0.0.1:", "tcp://:80",
                                  "tcp://127.0.0.1", "tcp://h:1e3", "tcp://h:٣", "localhost", "", "5557x"])
def test_endpoints_zeromq_would_misread_are_refused(text):
    with pytest.raises(typer.BadParameter):
        endpoint(text)
    assert MAX_PORT == 65535


@pytest.mark.parametrize("text", ["600", "0600", "0o660", "7", "7777"])
def test_octal_modes(text):
    assert octal_mode(text) == text


@pytest.mark.parametrize("text", ["nan", "-1", "1e20", "77777", "9", "", "0x1ff", "6 00"])
def test_modes_that_are_not_octal_bits(text):
    with pytest.raises(typer.BadParameter):
        octal_mode(text)


def test_since_takes_last_a_time_or_unix_seconds_within_the_calendar():
    assert since_arg(None) == (None, False) and since_arg(" Last ") == (None, True)
    assert since_arg("1700000000") == (1700000000.0, False)
    assert since_arg("2026-12-03T20:00:00+00:00") == (1796328000.0, False)
    assert moment("2026-12-03T20:00:00Z", "--since") == 1796328000.0
    assert moment(repr(LATEST), "--since") == LATEST


@pytest.mark.parametrize("text", ["1e20", "nan", "inf", "-5", "2026-12-03T20:00:00", "0001-01-01T00:00:00+00:00",
                                  "yesterday", ""])
def test_since_refuses_what_is_no_time(text):
    with pytest.raises(UsageError, match="--since"):
        since_arg(text)


def test_cpus_is_what_this_process_may_run_on():
    assert 1 <= cpus() <= (__import__("os").cpu_count() or 1)
