"""Commands forked from one process that imported kvc once (importable as `forkrun`).

A test that needs a process per command -- the command may die of a signal on a damaged store, is killed with
SIGKILL or stops itself at a named step (tests/faults), or serves a socket the test talks to (`kvc serve`, a feed
follower, a publisher whose memory is measured alone) -- pays a Python start and kvc's imports (numpy, LMDB, and
torch for a command that drives a cache: up to about a second and a half) per command when it starts the `kvc`
console script. A `Forks` server pays them once: it is a Python process that imports the modules named, then forks
a child per command; children run side by side (a server and its clients). The child is a process of its own, as
the console script's would be: its own pid, signals and exit status (a negative code is the signal that killed it),
its stdin, stdout and stderr on the files named (`Piped`: a stdout read as it goes, a stdin written), the
environment given, and kvc's entry point (`kvc.main:app`, what the console script calls) run with the arguments
given, or a Python script; with `no_caps`, every capability dropped as `read_only_user.NO_CAPS` (setpriv) drops
them. It ends as the interpreter would: non-daemon threads joined, atexit handlers run, the streams flushed.

What it is not: a test of start-up (what importing kvc loads), of what differs between two processes (a key drawn
per process), or of what reads the environment at import (the server imported kvc under its own): those start the
console script (tests/README.md, "In this process, or a process of its own"). The session fixtures `forks` and
`engine_forks` (tests/conftest.py) hold one server each per test process.

Run as a script, this module is the server: `python forkrun.py MODULE...` imports each MODULE (`PACKAGE.*`: every
module of PACKAGE), says ready, then reads one JSON request a line on stdin and answers on stdout: each child's pid
as it starts, "stopped" when its request asked to hear of a SIGSTOP, and its exit status (these two name the
child's pid)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
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
    """The server's loop: import `modules`, then fork a child per request line and report each child's exit (see
    the module docstring); children run side by side."""
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
    requests = os.dup(0)
    # A child's end wakes the loop: SIGCHLD writes a byte on `woken` (its handler is Python's wake-up fd).
    woken, wake = os.pipe()
    os.set_blocking(woken, False)
    os.set_blocking(wake, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake)
    running: dict[int, bool] = {}  # pid -> whether its request asked to hear of a SIGSTOP
    pending, ended = b"", False
    os.write(answers, b'{"ready": true}\n')
    while not ended:
        readable = select.select([requests, woken], [], [])[0]
        if woken in readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(woken, 4096):
                    pass
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG | os.WUNTRACED)
            if pid == 0:
                break
            if os.WIFSTOPPED(status):
                if running.get(pid):
                    os.write(answers, json.dumps({"child": pid, "stopped": True}).encode() + b"\n")
                continue
            running.pop(pid, None)
            os.write(answers, json.dumps({"child": pid, "status": os.waitstatus_to_exitcode(status)}).encode()
                     + b"\n")
        if requests not in readable:
            continue
        data = os.read(requests, 65536)
        ended = not data
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (answers, requests, woken, wake):
                    os.close(fd)
                _child(request)
            running[pid] = bool(request.get("stop"))
            os.write(answers, json.dumps({"pid": pid}).encode() + b"\n")


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

    def poll(self) -> int | None:
        """The exit status if the child has ended, else None (never waits)."""
        while self.returncode is None and self.forks.pump(0):
            pass
        return self.returncode

    def wait_stopped(self) -> bool:
        """Wait until the child stopped itself (SIGSTOP; True) or ended (False)."""
        while not self.stopped and self.returncode is None:
            self.forks.pump(None)
        return self.stopped

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit status; past `timeout` seconds, subprocess.TimeoutExpired (the child keeps running)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout or 0)
            self.forks.pump(left)
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


class Piped:
    """A forked command whose stdout this process reads as it goes (`readline`, `read`: a FIFO), its stderr in a
    file (`stderr`): what `subprocess.Popen(..., stdout=PIPE)` gives a test that waits for a server's ready line or
    follows a feed. `Forks.piped` starts one; `close` (or the with block's end) kills it if it still runs, waits for
    it and removes its files."""

    def __init__(self, forks: Forks, argv: Sequence[str], *, env: Mapping[str, str] | None, stderr: str | None,
                 script: str | None, stdin: bool = False) -> None:
        self._work = tempfile.mkdtemp(prefix="kvc-fork-")
        out = os.path.join(self._work, "out")
        os.mkfifo(out)
        # Opened before the child exists, without waiting for a writer: select sees its lines, then the end of the
        # file once the child has closed it (exited); never the end before the child opened it (Linux's FIFOs).
        self._out = os.open(out, os.O_RDONLY | os.O_NONBLOCK)
        self._in: int | None = None
        feed = None
        if stdin:  # read and write (Linux's FIFOs): neither end waits for the other to open; `close_stdin` ends it
            feed = os.path.join(self._work, "in")
            os.mkfifo(feed)
            self._in = os.open(feed, os.O_RDWR)
        self._buffer = b""
        self._ended = False
        self.err_path = stderr or os.path.join(self._work, "err")
        self.child = forks.start(argv, env=os.environ if env is None else env, stdout=out, stderr=self.err_path,
                                 stdin=feed, script=script)
        self.pid = self.child.pid

    def write(self, text: str) -> None:
        """Write `text` on the child's stdin (`Forks.piped(..., stdin=True)`)."""
        assert self._in is not None, "started without stdin=True"
        data = text.encode()
        while data:
            data = data[os.write(self._in, data):]

    def close_stdin(self) -> None:
        """Close the child's stdin: it reads the end of the file."""
        if self._in is not None:
            os.close(self._in)
            self._in = None

    def _fill(self, deadline: float) -> bool:
        """Read what the child wrote by `deadline`; False once its stdout ended or the deadline passed."""
        if self._ended:
            return False
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([self._out], [], [], left)[0]:
            return False
        chunk = os.read(self._out, 65536)
        self._ended = not chunk
        self._buffer += chunk
        return bool(chunk)

    def readline(self, timeout: float = 120) -> str:
        """The child's next stdout line ("" when it ended without one, or none came within `timeout` s)."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer and self._fill(deadline):
            pass
        if b"\n" not in self._buffer:
            return ""
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode("utf-8", "replace") + "\n"

    def read(self, timeout: float = 120) -> str:
        """The rest of the child's stdout, up to its end (or `timeout` s)."""
        deadline = time.monotonic() + timeout
        while self._fill(deadline):
            pass
        rest, self._buffer = self._buffer, b""
        return rest.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        """What the child wrote on stderr so far."""
        with open(self.err_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    @property
    def returncode(self) -> int | None:
        """The exit status once reported (negative: the signal that killed it)."""
        return self.child.returncode

    def poll(self) -> int | None:
        """The exit status if the child has ended, else None."""
        return self.child.poll()

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit status (see `Child.wait`)."""
        return self.child.wait(timeout)

    def send_signal(self, sig: int) -> None:
        """Send `sig` unless the child has been reaped."""
        self.child.kill(sig)

    def kill(self) -> None:
        """SIGKILL, unless the child has been reaped."""
        self.child.kill()

    def close(self) -> None:
        """Kill the child if it still runs, wait for it, and remove its FIFO (and its stderr, unless named)."""
        if self.child.poll() is None:
            self.child.kill()
        self.child.wait()
        self.close_stdin()
        os.close(self._out)
        shutil.rmtree(self._work, ignore_errors=True)

    def __enter__(self) -> Piped:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Forks:
    """A server that imported `modules` once and forks a child per command (see the module docstring). Children
    run side by side (a server and its clients); one a test left running is killed when the server closes."""

    def __init__(self, modules: Sequence[str] = KVC_MODULES, env: Mapping[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, *modules], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=None if env is None else dict(env))
        self.children: dict[int, Child] = {}  # those not reported ended yet
        self._started: list[int] = []
        self._pending = b""
        if self._answer(300) != {"ready": True}:
            self.close()
            raise RuntimeError(f"the fork server importing {list(modules)} did not start")

    def _answer(self, timeout: float | None) -> dict | None:
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

    def pump(self, timeout: float | None) -> bool:
        """Take the server's next answer, if one comes within `timeout` seconds (None: wait for it), to the child
        it is about; False if none came."""
        answer = self._answer(timeout)
        if answer is None:
            return False
        if "child" not in answer:  # the pid of the child `start` asked for
            self._started.append(answer["pid"])
        elif (child := self.children.get(answer["child"])) is not None:
            if answer.get("stopped"):
                child.stopped = True
            else:
                child.returncode = answer["status"]
                del self.children[child.pid]
        return True

    def start(self, argv: Sequence[str], *, env: Mapping[str, str], stdout: str, stderr: str,
              stdin: str | None = None, script: str | None = None, script_file: str | None = None,
              no_caps: bool = False, stop: bool = False) -> Child:
        """Fork a child running kvc with `argv`, or `script` (Python source, sys.argv `argv` as `python -c` gives
        it), or the Python file `script_file` (sys.argv: the file, then `argv`); streams on the files named,
        environment `env`; `no_caps`: without root's capabilities; `stop`: `Child.wait_stopped` hears of a SIGSTOP.
        Children run side by side: a server, and the clients that talk to it."""
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
        while not self._started:
            self.pump(None)
        pid = self._started.pop()
        self.children[pid] = Child(self, pid)
        return self.children[pid]

    def piped(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, stderr: str | None = None,
              script: str | None = None, stdin: bool = False) -> Piped:
        """Fork a child running kvc with `argv` (or `script`, as `start` does) whose stdout this process reads as
        it goes (`Piped`); stderr in the file `stderr` (None: a file of its own); `env` None: this process's;
        `stdin`: this process writes the child's stdin (`Piped.write`), else it reads an empty file."""
        return Piped(self, argv, env=env, stderr=stderr, script=script, stdin=stdin)

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
        """Stop the server (children still running, left by failed tests, are killed first)."""
        for child in list(self.children.values()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, 9)
            with contextlib.suppress(RuntimeError):
                child.wait()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(60)
        self.proc.stdout.close()


if __name__ == "__main__":
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # this script's folder: not on a console script's path
    serve(sys.argv[1:])
    os._exit(0)  # nothing to flush (its answers are os.write's): no interpreter teardown of torch to wait for
