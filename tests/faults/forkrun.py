"""Commands forked from one process that imported kvc once (importable as `forkrun`).

A fault test that needs a process per command -- the command may die of a signal on a damaged store, or is killed
with SIGKILL, or stops itself at a named step -- pays a Python start and kvc's imports (numpy, LMDB, and torch for
a command that drives a cache: up to about a second) per command when it starts the `kvc` console script. A `Forks` server pays them once: it is a Python
process that imports the modules named, then forks a child per command. The child is a process of its own, as the
console script's would be: its own pid, signals and exit status (a negative code is the signal that killed it), its
stdin, stdout and stderr on the files named, the environment given, and kvc's entry point (`kvc.main:app`, what the
console script calls) run with the arguments given, or a Python script; with `no_caps`, every capability dropped
as `read_only_user.NO_CAPS` (setpriv) drops them. It ends as the interpreter would: non-daemon threads joined,
atexit handlers run, the streams flushed.

What it is not: a test of start-up (what importing kvc loads) or of what differs between two processes (a key drawn
per process): those start the console script (tests/README.md, "In this process, or a process of its own").

Run as a script, this module is the server: `python forkrun.py MODULE...` imports each MODULE (`PACKAGE.*`: every
module of PACKAGE), says ready, then reads one JSON request a line on stdin and answers on stdout: the child's pid,
"stopped" when the request asked to hear of a SIGSTOP, and its exit status.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

# -- the server (run as a script) -------------------------------------------------------------------------------


def _drop_capabilities() -> None:
    """Drop every capability (bounding set, ambient, then effective, permitted and inheritable): root without
    CAP_DAC_OVERRIDE and its kin, what `setpriv --bounding-set=-all --inh-caps=-all --ambient-caps=-all` leaves a
    command run under it."""
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):  # the bounding set first: dropping it needs CAP_SETPCAP
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {cap})")
    if libc.prctl(47, 4, 0, 0, 0) != 0:  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
        raise OSError(ctypes.get_errno(), "prctl(PR_CAP_AMBIENT_CLEAR_ALL)")
    if libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()) != 0:  # _LINUX_CAPABILITY_VERSION_3
        raise OSError(ctypes.get_errno(), "capset")


def _child(request: dict) -> None:
    """In the forked child: set up its streams, environment and capabilities, run the command, exit. Never
    returns."""
    code = 1
    try:
        for fd, path, flags in ((0, request.get("stdin") or os.devnull, os.O_RDONLY),
                                (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            if fd == 2 and path == request["stdout"]:  # one file for both: one file offset, as 2>&1
                os.dup2(1, 2)
                continue
            opened = os.open(path, flags, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        os.environ.clear()
        os.environ.update(request["env"])
        if request.get("cwd"):
            os.chdir(request["cwd"])
        if request.get("no_caps"):
            _drop_capabilities()
        sys.argv = list(request["argv"])
        try:
            if request.get("script_file") is not None:  # `python FILE ARGS...`
                import runpy

                runpy.run_path(request["script_file"], run_name="__main__")
            elif request.get("script") is not None:  # `python -c SCRIPT ARGS...`
                exec(compile(request["script"], "<string>", "exec"), {"__name__": "__main__"})
            else:
                from kvc.main import app

                app()
            code = 0
        except SystemExit as exc:  # what the interpreter does with it
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - an uncaught exception: its traceback and exit 1, as Python's
            import traceback

            traceback.print_exc()
            code = 1
        import atexit
        import threading

        with contextlib.suppress(BaseException):
            threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads, as at the end of a script
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
    finally:
        os._exit(code)


def serve(modules: Sequence[str]) -> None:
    """The server's loop: import `modules`, then fork a child per request line (see the module docstring)."""
    import importlib
    import pkgutil

    for name in modules:
        if name.endswith(".*"):  # the package and every module in it
            package = importlib.import_module(name[:-2])
            for found in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
                importlib.import_module(found.name)
        else:
            importlib.import_module(name)
    answers = os.dup(1)  # never sys.stdout: nothing may sit in a buffer a child inherits
    requests = os.fdopen(os.dup(0), "r")
    os.write(answers, b'{"ready": true}\n')
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.close(answers)
            requests.close()
            _child(request)
        os.write(answers, json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, os.WUNTRACED if request.get("stop") else 0)
        if os.WIFSTOPPED(status):
            os.write(answers, b'{"stopped": true}\n')
            _, status = os.waitpid(pid, 0)
        os.write(answers, json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


# What the store commands import (audit, repair, stats, ns, put's parsing, migrate): not torch. A child forks
# children of its own (the audit's workers, a repair's isolated scans), and each fork copies the page tables of the
# whole address space: torch's would make each of them slower than a Python start.
KVC_MODULES = ("kvc.main", "kvc.commands.*", "kvcache.storage.registry", "kvcache.storage.lmdb.store",
               "kvcache.storage.lmdb.salvage", "kvcache.storage.lmdb.migrate", "kvcache.diagnostics.audit",
               "kvcache.live.client")
# What a command that drives a cache imports besides (replay, serve, put): the engine, and with it torch.
ENGINE_MODULES = (*KVC_MODULES, "kvcache.engine.cache", "kvcache.ops.handlers", "kvcache.workload.replay", "torch")

# -- the client ----------------------------------------------------------------------------------------------


class Ran(NamedTuple):
    """What one command printed, and its exit status (negative: the signal that killed it)."""

    stdout: str
    stderr: str
    returncode: int


class Child:
    """One forked command: its pid, and its exit status once the server reports it (`returncode`)."""

    def __init__(self, forks: Forks, pid: int) -> None:
        self.forks = forks
        self.pid = pid
        self.stopped = False
        self.returncode: int | None = None

    def _answer(self, timeout: float | None) -> bool:
        """Take the server's next answer about this child if one comes within `timeout` (None: wait for it)."""
        answer = self.forks.answer(timeout)
        if answer is None:
            return False
        if answer.get("stopped"):
            self.stopped = True
        else:
            self.returncode = answer["status"]
            self.forks.busy = None
        return True

    def poll(self) -> int | None:
        """The exit status if the child has ended, else None (never waits)."""
        while self.returncode is None and self._answer(0):
            pass
        return self.returncode

    def wait_stopped(self) -> bool:
        """Wait until the child stopped itself (SIGSTOP; True) or ended (False)."""
        while not self.stopped and self.returncode is None:
            self._answer(None)
        return self.stopped

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit status; past `timeout` seconds, subprocess.TimeoutExpired (the child keeps running)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout or 0)
            self._answer(left)
        return self.returncode

    def kill(self, sig: int = 9) -> None:
        """Send `sig` (SIGKILL by default) unless the child has been reaped."""
        if self.poll() is None:
            os.kill(self.pid, sig)


def read_line(fd: int, timeout: float) -> str:
    """The first line written to `fd` (the read end of a FIFO a child writes), or what came before its writer closed
    it or `timeout` seconds passed ("" when nothing)."""
    data = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 4096)
        if not chunk:  # the writer closed it
            break
        data += chunk
    return data.decode("utf-8", "replace").split("\n", 1)[0] + ("\n" if b"\n" in data else "")


class Forks:
    """A server that imported `modules` once and forks a child per command (see the module docstring)."""

    def __init__(self, modules: Sequence[str] = KVC_MODULES, env: Mapping[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, *modules], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=None if env is None else dict(env))
        self.busy: Child | None = None
        self._pending = b""
        if self.answer(300) != {"ready": True}:
            self.close()
            raise RuntimeError(f"the fork server importing {list(modules)} did not start")

    def answer(self, timeout: float | None) -> dict | None:
        """The server's next answer line, or None if none comes within `timeout` seconds."""
        assert self.proc.stdout is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            data = os.read(self.proc.stdout.fileno(), 65536)
            if not data:
                raise RuntimeError(f"the fork server died (exit status {self.proc.wait()})")
            self._pending += data
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def start(self, argv: Sequence[str], *, env: Mapping[str, str], stdout: str, stderr: str,
              stdin: str | None = None, script: str | None = None, script_file: str | None = None,
              no_caps: bool = False, stop: bool = False) -> Child:
        """Fork a child running kvc with `argv`, or `script` (Python source, sys.argv `argv` as `python -c` gives
        it), or the Python file `script_file` (sys.argv: the file, then `argv`); streams on the files named,
        environment `env`; `no_caps`: without root's capabilities; `stop`: `Child.wait_stopped` hears of a SIGSTOP.
        One child at a time: a previous one still running (left by a failed test) is killed first."""
        if self.busy is not None:  # one child at a time: one a failed test left running is killed first
            self.busy.kill()
            self.busy.wait()
        assert self.proc.stdin is not None
        args = [*map(str, argv)]
        if script_file is not None:
            args = [script_file, *args]
        elif script is None:
            args = ["kvc", *args]
        request = {"argv": args, "env": dict(env), "stdout": stdout, "stderr": stderr, "stdin": stdin,
                   "script": script, "script_file": script_file, "no_caps": no_caps, "stop": stop}
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        answer = self.answer(None)
        assert answer is not None and "pid" in answer, answer
        self.busy = Child(self, answer["pid"])
        return self.busy

    def run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 120,
            script: str | None = None, script_file: str | None = None, no_caps: bool = False) -> Ran:
        """What one command printed and its exit status, as `subprocess.run(..., timeout=timeout)` gives them
        (`env` None: this process's environment); past the timeout the child is killed and
        subprocess.TimeoutExpired raised."""
        with tempfile.TemporaryDirectory(prefix="kvc-fork-") as work:
            out, err = os.path.join(work, "out"), os.path.join(work, "err")
            child = self.start(argv, env=os.environ if env is None else env, stdout=out, stderr=err, script=script,
                               script_file=script_file, no_caps=no_caps)
            try:
                code = child.wait(timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                raise
            with open(out, encoding="utf-8", errors="replace") as o, \
                    open(err, encoding="utf-8", errors="replace") as e:
                return Ran(o.read(), e.read(), code)

    def close(self) -> None:
        """Stop the server (a child still running is killed first)."""
        if self.busy is not None and self.busy.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.busy.pid, 9)
            with contextlib.suppress(RuntimeError):
                self.busy.wait()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(60)
        self.proc.stdout.close()


if __name__ == "__main__":
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # this script's folder: not on a console script's path
    serve(sys.argv[1:])
