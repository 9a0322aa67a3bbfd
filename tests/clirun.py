"""Running kvc from a test (importable as `clirun`).

A test that checks what kvc prints and its exit code runs it in this process (`in_process`: typer's runner, the
same `KvcGroup.main` and error contract as the console script, without a process start of about a second). A
test that needs a process of its own — signals, start-up imports, permissions or capabilities, kill -9, sockets
served while the test talks to them, or what differs between two processes (a key drawn per process) — starts
one (`subprocess`). tests/README.md says which suites do which.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import typer
from click.testing import CliRunner

from kvc.main import app

# kvc's command group, built once: typer's own runner builds it (and every command it resolves) again on each call,
# ~16 ms, a third of a short command's time in this process; the group keeps no state between invocations
KVC_GROUP = typer.main.get_command(app)


def _installed_kvc() -> Path:
    """The `kvc` console script the project's install made: in the scripts folder of the Python running the tests
    (a venv's bin, or the user's scripts folder on a host's own Python), else on PATH."""
    for folder in (Path(sysconfig.get_path("scripts")), Path(sys.executable).parent,
                   Path(sysconfig.get_path("scripts", f"{os.name}_user"))):
        if (folder / "kvc").is_file():
            return folder / "kvc"
    found = shutil.which("kvc")
    if found is None:
        raise RuntimeError(f"the tests run kvc as a command, and no kvc console script is installed for "
                           f"{sys.executable} (nor on PATH): install the project first (make install)")
    return Path(found)


KVC = _installed_kvc()  # the kvc command the tests that need a process of their own run


class Ran(NamedTuple):
    """What one kvc run printed, and its exit code (the fields `subprocess.CompletedProcess` has)."""

    stdout: str
    stderr: str
    returncode: int


def in_process(*args: object, env: Mapping[str, str] | None = None, stdin: str | None = None) -> Ran:
    """kvc `args` in this process. `env`: the whole environment it sees, as a subprocess's `env=` (None: this
    process's own); variables of this process that `env` lacks are unset for the run."""
    changes: dict[str, str | None] | None = None
    if env is not None:
        changes = {name: None for name in os.environ if name not in env}
        changes.update(env)
    result = CliRunner().invoke(KVC_GROUP, [str(a) for a in args], env=changes, input=stdin)
    return Ran(result.stdout, result.stderr, result.exit_code)


def salted(*args: object, salt: str, code: int = 0) -> Ran:
    """kvc `args` in this process with env KVC_SALT=`salt`, which must exit `code` and print the salt nowhere."""
    ran = in_process(*args, env={**os.environ, "KVC_SALT": salt})
    assert salt not in ran.stdout + ran.stderr
    assert ran.returncode == code, ran.stdout + ran.stderr
    return ran
