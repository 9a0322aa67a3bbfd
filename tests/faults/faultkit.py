"""What the fault tests share (importable as `faultkit`): the trial scale, the table of outcomes, a second local
user, the installed kvc as a subprocess, and kvc commands stopped, killed or served as processes forked from a
server that imported kvc once (`forkrun`; the `forks` and `engine_forks` fixtures of tests/conftest.py).

A row of the table is one kind of trial: how many ran, how many the system survived (the outcome the test
demands), and how many lost something (committed data, a wrong byte served, a leak; for flips, pages the repair
had to drop are reported in the note column). A test asserts its own outcome; the table is the record of it.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

import clirun
import forkrun

LONG_FACTOR = 10
KVC = clirun.KVC


def _env_scale() -> int:
    value = os.environ.get("KVC_FAULTS", "").strip().lower()
    if value == "long":
        return LONG_FACTOR
    return int(value) if value.isdigit() and int(value) > 0 else 1


_SCALE = _env_scale()


def set_scale(factor: int) -> None:
    """Multiply every trial count by `factor` (the --long option)."""
    global _SCALE
    _SCALE = max(_SCALE, factor)


def trials(ci: int) -> int:
    """The number of trials of a kind: `ci` in the default run, times the scale under --long / KVC_FAULTS."""
    return ci * _SCALE


class Row(msgspec.Struct):
    """One kind of trial and its outcomes."""

    name: str
    trials: int
    survived: int
    lost: int
    note: str = ""


ROWS: list[Row] = []


def record(name: str, trials: int, survived: int, lost: int, note: str = "") -> None:
    """Add a row to the table printed at the end of the run (and appended to $KVC_FAULTS_REPORT as JSON lines)."""
    row = Row(name, trials, survived, lost, note)
    ROWS.append(row)
    report = os.environ.get("KVC_FAULTS_REPORT")
    if report:
        with open(report, "ab") as f:
            f.write(msgspec.json.encode(row) + b"\n")


def table() -> str:
    """The rows as a Markdown table."""
    lines = ["| trial | trials | survived | lost | note |", "|---|---:|---:|---:|---|"]
    lines += [f"| {r.name} | {r.trials} | {r.survived} | {r.lost} | {r.note} |" for r in ROWS]
    return "\n".join(lines)


def kvc(*args, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """The installed kvc as a subprocess (text output)."""
    return subprocess.run([str(KVC), *map(str, args)], capture_output=True, text=True, timeout=timeout, **kw)


def stop_then_kill(args: list[str], stop_env: str, point: str, log: str, forks: forkrun.Forks) -> None:
    """Run `kvc *args` (forked from `forks`, a process of its own) with `stop_env=point` until the command stops
    itself there (SIGSTOP: the event, no timing), then kill it with SIGKILL. Its output goes to `log`; a run that
    ends without stopping fails the test."""
    child = forks.start(args, env=dict(os.environ, **{stop_env: point}), stdout=log, stderr=log, stop=True)
    if not child.wait_stopped():
        pytest.fail(f"kvc {args[0]} never reached {point} (exit status {child.returncode}): {Path(log).read_text()}")
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL


def in_ci() -> bool:
    """Whether the run is CI's (CI=true): there a fault trial that cannot run fails instead of skipping."""
    return os.environ.get("CI", "").lower() == "true"


def skip_or_fail(message: str) -> None:
    """Skip locally; fail under CI=true (a trial CI cannot run is a broken CI, never a silent skip)."""
    if in_ci():
        pytest.fail(message + "; CI=true makes this a failure, not a skip")
    pytest.skip(message)


@contextlib.contextmanager
def second_user() -> Iterator[pwd.struct_passwd]:
    """A throwaway local user for the trust tests, removed afterwards. Needs root and useradd."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        skip_or_fail("the admin-socket trust trials need root (to create a second local user) and useradd")
    name = f"kvcf{uuid.uuid4().hex[:8]}"
    made = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                          capture_output=True, text=True)
    if made.returncode != 0:
        skip_or_fail(f"useradd {name} failed: {made.stderr.strip()}")
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def run_as(user: pwd.struct_passwd, fn, *args) -> int:
    """Run `fn(*args)` in a forked child as `user` (groups dropped); its exit code (0: it returned, 1: it raised
    an AssertionError, 2: anything else), with the child's traceback on stderr."""
    import traceback

    pid = os.fork()
    if pid == 0:
        code = 2
        try:
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            fn(*args)
            code = 0
        except AssertionError:
            traceback.print_exc()
            code = 1
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


class Serve:
    """A `kvc serve` process (forked from `forks`: a process of its own), ready once its --json ready line is on its
    stdout; `stop` sends a signal and waits."""

    def __init__(self, store: str, sock: str, *extra, forks: forkrun.Forks) -> None:
        self.sock = sock
        self._work = tempfile.mkdtemp(prefix="kvc-serve-")
        out = os.path.join(self._work, "out")
        os.mkfifo(out)
        # Opened before the child exists, without waiting for a writer: select then sees the ready line, or the end
        # of the file once the child has written and closed it (exited).
        self._out = os.open(out, os.O_RDONLY | os.O_NONBLOCK)
        self._err = os.path.join(self._work, "err")
        self.proc = forks.start(["serve", "--store", store, "--socket", sock, "--json", *map(str, extra)],
                                env=os.environ, stdout=out, stderr=self._err)
        self.ready = forkrun.read_line(self._out, timeout=120)
        if not self.ready:
            self.stop(signal.SIGKILL)
            raise AssertionError(f"kvc serve did not start: {self.stderr}")

    def stop(self, sig: int = 15, timeout: float = 60) -> int:
        """Send `sig` (unless it has exited), wait for its exit status, keep its stderr (`stderr`)."""
        self.proc.kill(sig)
        code = self.proc.wait(timeout)
        os.close(self._out)
        with open(self._err, encoding="utf-8", errors="replace") as f:
            self.stderr = f.read()
        shutil.rmtree(self._work, ignore_errors=True)
        return code

    def rss_kib(self) -> int:
        """The server's resident memory now."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def fork_child(fn, *args) -> tuple[int, int]:
    """Fork a child running `fn(*args, write_fd)` (it reports on the pipe's write end); (pid, read end). The child
    exits 0 when `fn` returns, 1 with its traceback on stderr when it raises."""
    import traceback

    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(read_fd)
            fn(*args, write_fd)
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    os.close(write_fd)
    return pid, read_fd
