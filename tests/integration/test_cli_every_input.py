"""Every input a usage error (issue 36, item 7), generated from the commands' own parameter declarations.

On ebaf189 `ping --timeout nan`, `top --interval nan` and a non-UTF-8 `init --model` ended in "internal error" (or
were taken: NaN passes click's range checks), `serve --events 99999` bound port 34463 (ZeroMQ takes a port modulo
65536) and `audit --workers` took any count (256 processes on 2 cores). Here every parameter of every command — the
global options too, and their environment variables — is walked as typer built it (`kvc.main.every_command`), and
each one gets the values it must refuse: NaN, inf and out-of-range numbers (its own declared bounds), text with an
undecodable byte, ports above 65535 where an endpoint or a mode is written as text. Each must be exit 2 and one
line naming the parameter, never a traceback or "internal error". A new option is covered the day it is declared;
one declared without an upper bound fails `test_every_number_option_declares_its_range`.

The same module runs under the newest typer (`make typer-next`), whose parameters are typer's own classes: the
helpers below read a parameter's kind and bounds from either.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from kvc import clickapi
from kvc.inputs import MAX_PORT, cpus
from kvc.main import app, every_command

runner = CliRunner()
BAD_TEXT = "t\udcffx"  # the byte 0xff of a command line or an environment, as Python hands it over


@dataclass(frozen=True)
class Param:
    """One parameter of one command, as the cases need it."""

    path: tuple[str, ...]  # the command: ("ns", "quota", "set"); () for the global options
    name: str  # what its error line names: the long option, or the argument's metavar
    kind: str  # "int", "float", "flag", "choice" or "text"
    low: float | None  # declared bounds, None where none is declared
    high: float | None
    envvar: str | None
    metavar: str | None
    option: bool  # an option (else a positional argument)
    needs: tuple[str, ...]  # placeholders for the command's required arguments (ahead of a variable's check)

    def __str__(self) -> str:
        return " ".join((*self.path, self.name)) or self.name


def _kind(param: Any) -> str:
    """int, float, flag, choice or text: from `param.type` where typer builds click parameter types (up to 0.28),
    else from its annotation (typer 0.29's own parameters have none)."""
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        return "flag"
    descriptor = getattr(param, "type_descriptor", None)
    if descriptor is None:  # typer < 0.29: click's parameter types (click's own, or typer's copy of them)
        types = clickapi.click.types
        if isinstance(param.type, types.BoolParamType):
            return "flag"
        if isinstance(param.type, types.IntParamType):
            return "int"
        if isinstance(param.type, types.FloatParamType):
            return "float"
        return "choice" if getattr(param.type, "choices", None) is not None else "text"
    if descriptor.is_choice:
        return "choice"
    annotation = descriptor.annotation
    if typing.get_origin(annotation) is list:
        (annotation,) = typing.get_args(annotation)
    return {bool: "flag", int: "int", float: "float"}.get(annotation, "text")


def _bounds(param: Any) -> tuple[float | None, float | None]:
    if getattr(param, "type_descriptor", None) is None:
        return getattr(param.type, "min", None), getattr(param.type, "max", None)
    info = param.type_descriptor.parameter_info
    return info.min, info.max


def _placeholder(param: Any) -> list[str]:
    """Words that give a required parameter a value it takes (its first choice, else "x")."""
    descriptor = getattr(param, "type_descriptor", None)
    choices = descriptor.choices if descriptor is not None else getattr(param.type, "choices", None)
    value = str(getattr(choices[0], "value", choices[0])) if choices else "x"
    return [max(param.opts, key=len), value] if getattr(param, "param_type_name", "") == "option" else [value]


def _params() -> Iterator[Param]:
    group = typer.main.get_command(app)
    commands = [((), group), *every_command()]
    for path, command in commands:
        needs = tuple(word for q in command.params if q.required for word in _placeholder(q))
        for p in command.params:
            option = getattr(p, "param_type_name", "") == "option"
            name = max(p.opts, key=len) if option else (p.metavar or p.name.upper())
            low, high = _bounds(p)
            envvar = p.envvar if isinstance(p.envvar, str) else None
            yield Param(path, name, _kind(p), low, high, envvar, p.metavar, option, needs)


PARAMS = [p for p in _params() if p.name not in ("--help",)]
NUMBERS = [p for p in PARAMS if p.kind in ("int", "float")]


def _out_of_range(p: Param) -> Iterator[str]:
    """Values of `p`'s own kind beyond its declared bounds."""
    if p.high is not None:
        yield str(int(p.high) + 1) if p.kind == "int" else repr(float(p.high) * 2 + 1)
    if p.low is not None:
        yield str(int(p.low) - 1) if p.kind == "int" else repr(float(p.low) - 1)


def _bad_values(p: Param) -> Iterator[str]:
    if p.kind == "float":
        yield from ("nan", "inf", "-inf", "NaN")
        yield from _out_of_range(p)
    elif p.kind == "int":
        yield from ("nan", "1e400")
        yield from _out_of_range(p)
    elif p.kind in ("text", "choice"):
        yield BAD_TEXT
        if p.metavar == "ENDPOINT":  # a port written as text: ZeroMQ takes 99999 as 34463
            yield from ("99999", "65536", "tcp://127.0.0.1:99999", "tcp://127.0.0.1:-1", "tcp://127.0.0.1:nan")
        if p.metavar == "MODE":  # permission bits written as octal text
            yield from ("nan", "-1", "1e20", "777777", "9")


@dataclass(frozen=True)
class Case:
    param: Param
    value: str
    via_env: bool = False

    def __str__(self) -> str:
        where = f"{self.param.envvar}=" if self.via_env else ""
        return f"{self.param}: {where}{self.value!r}"


CASES = [Case(p, v) for p in PARAMS for v in _bad_values(p)]
# an environment variable reaches the same check; one case of each kind per variable
CASES += [Case(p, "nan" if p.kind in ("int", "float") else BAD_TEXT, via_env=True) for p in PARAMS
          if p.envvar is not None and p.kind != "flag"]


def _run(case: Case) -> Any:
    p = case.param
    if case.via_env:
        # a global option's variable is read for any command; a command's own, once its arguments are there
        args = [*p.path, *p.needs] if p.path else ["ns", "ls"]
        env = {p.envvar: case.value}
    else:
        where = [*p.path] if p.path else []
        words = [p.name, case.value] if p.option else [case.value]
        args = [*where, *words] if p.path else [*words, "ns", "ls"]
        env = {}
    env = {"KVC_SALT": None, "KVC_STORE": None, "KVC_SOCKET": None, **env}
    return runner.invoke(app, args, env=env)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_bad_value_is_exit_2_and_one_line_naming_it(case: Case):
    result = _run(case)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, (result.exit_code, result.stdout[-300:], result.stderr[-600:])
    assert len(lines) == 1 and lines[0].startswith("kvc: error: "), result.stderr
    named = case.param.name.lower() in lines[0].lower()  # an argument: TRACE (click's typer), 'trace' (typer's own)
    assert named or (case.via_env and case.param.envvar in lines[0]), lines[0]
    assert "internal error" not in lines[0] and "Traceback" not in result.output
    assert "\udcff" not in result.output  # the undecodable byte is described, never echoed


def test_the_matrix_covers_every_command_and_each_kind_of_value():
    """The cases are generated, so a generator that finds nothing must fail too: every command is walked, and each
    kind of bad value has cases."""
    walked = {p.path[0] for p in PARAMS if p.path}
    assert walked >= {"init", "put", "prefetch", "replay", "audit", "serve", "top", "ping", "events", "ns"}
    values = {c.value for c in CASES}
    assert {"nan", "inf", "-inf", BAD_TEXT, "99999"} <= values
    assert len(NUMBERS) >= 40 and len(CASES) >= 300
    assert any(c.via_env and c.param.path == () for c in CASES)  # KVC_TIMEOUT=nan, ...


def test_every_number_option_declares_its_range():
    """An option without an upper bound takes 1e20 as readily as 4: each says how far it goes (a count of workers,
    a sequence number, seconds), so that the cases above can try beyond it."""
    unbounded = [str(p) for p in NUMBERS if p.high is None or not math.isfinite(p.high)]
    assert unbounded == []


def test_ports_stop_at_65535_and_worker_counts_at_the_cores():
    ports = [p for p in NUMBERS if "port" in p.name]
    workers = [p for p in NUMBERS if "workers" in p.name]
    assert ports and workers  # --metrics-port, audit --workers
    assert all(p.high is not None and p.high <= MAX_PORT for p in ports), [(str(p), p.high) for p in ports]
    assert all(p.high is not None and p.high <= cpus() for p in workers), [(str(p), p.high) for p in workers]
