"""Run a function in a forked child, so that a fault which kills a process kills the child and not the caller.

LMDB does not check its pages: walking a B-tree whose branch or leaf page holds flipped bytes can end in its own
`abort()` (``Assertion 'IS_LEAF(mp)' failed``), a SIGSEGV or a SIGBUS, none of which Python can catch. A scan of
a possibly damaged store therefore runs in a child (`run_isolated`): the child reports how far it got as it goes
(`progress`), and sends its result back; the parent learns the result, or how the child died and the last progress
it reported (`Died`). The child's stderr (where LMDB prints its assertion) is kept, not shown, and it dumps no
core.

`run_isolated_all` runs several functions at once, one child each (the integrity audit's workers,
`verify_parts`), and reads them as they report.

The child is a fork: it starts at once, shares nothing writable with the parent, and ends with `os._exit` (no
atexit handlers, no flush of the parent's buffers). Only the forking thread exists in it; the function must not
need the parent's other threads (LMDB handles of the parent are closed in the child by the LMDB backend's fork hook).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import resource
import select
import signal
import struct
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

_LENGTH = struct.Struct(">I")
_STDERR_KEPT = 4096  # bytes of the child's stderr kept for the report


class Died(msgspec.Struct, frozen=True):
    """How a child ended without a result."""

    signal: int | None  # the signal that killed it (SIGABRT, SIGSEGV, SIGBUS, ...), or None
    exit_code: int | None  # its exit code when it exited without a result
    error: str | None  # "Type: message" when the function raised
    error_type: str | None  # the exception's class name when the function raised
    progress: Any  # the last progress value it reported (None: none)
    stderr: str  # the end of what it wrote on stderr (an LMDB assertion, say)

    def describe(self) -> str:
        """One line: how it ended."""
        if self.signal is not None:
            how = f"died of {signal.Signals(self.signal).name}"
        elif self.error is not None:
            how = f"raised {self.error}"
        else:
            how = f"exited with code {self.exit_code} and no result"
        last = self.stderr.strip().splitlines()[-1:] if self.stderr.strip() else []
        return how + (f" ({last[0].strip()})" if last and self.signal is not None else "")


STALL_S = 600.0  # a child silent this long (no progress, no result) is killed: a damaged tree may loop


def run_isolated(fn: Callable[[Callable[[Any], None]], Any], progress_type: Any = Any, result_type: Any = Any,
                 on_progress: Callable[[Any], None] | None = None,
                 stall_s: float = STALL_S) -> tuple[Any, Died | None]:
    """Run `fn(report)` in a forked child; `report(value)` sends a progress value (msgspec-encodable) to the
    parent, where `on_progress(value)` sees each one as it arrives. Returns (result, None) when `fn` returned, or
    (None, Died) when the child raised, exited, was killed, or stayed silent for `stall_s` seconds (then it is
    killed with SIGKILL). Results and progress values are decoded as `result_type` / `progress_type`."""
    read_fd, write_fd = os.pipe()
    err_file = tempfile.TemporaryFile(prefix="kvc-isolated-")
    pid = os.fork()
    if pid == 0:  # the child: never returns
        _child(fn, read_fd, write_fd, err_file.fileno())
    os.close(write_fd)
    last: Any = None
    result: Any = None
    got_result = False
    error: tuple[str, str] | None = None
    try:
        while True:
            head = _read_exact(read_fd, _LENGTH.size, stall_s)
            if head is None:
                break
            body = _read_exact(read_fd, _LENGTH.unpack(head)[0], stall_s)
            if body is None:
                break
            kind, payload = msgspec.msgpack.decode(body)
            if kind == "progress":
                last = payload
                if on_progress is not None:
                    on_progress(msgspec.convert(payload, progress_type))
            elif kind == "result":
                result, got_result = payload, True
            elif kind == "error":
                error = (payload[0], payload[1])
    except _Stalled:
        os.kill(pid, signal.SIGKILL)  # a walk going round in a damaged tree: it never ends by itself
    finally:
        os.close(read_fd)
        _, status = os.waitpid(pid, 0)
    return _outcome(status, got_result, result, error, last, err_file, progress_type, result_type)


def run_isolated_all(fns: Sequence[Callable[[Callable[[Any], None]], Any]], progress_type: Any = Any,
                     result_type: Any = Any, on_progress: Callable[[int, Any], None] | None = None,
                     stall_s: float = STALL_S) -> list[tuple[Any, Died | None]]:
    """`run_isolated` of every function at once, each in its own forked child (all forked before any is read, from
    this thread): per function, in order, (result, None) or (None, Died). `on_progress(i, value)` sees the
    progress values of child `i` as they arrive. Children that all stay silent for `stall_s` seconds are killed."""
    children: list[_Running] = []
    try:
        for fn in fns:
            children.append(_Running.fork(fn))
    except BaseException:
        for child in children:
            child.kill()
            child.finish(progress_type, result_type)
        raise
    open_fds = {c.fd: i for i, c in enumerate(children)}
    try:
        while open_fds:
            ready = select.select(list(open_fds), [], [], stall_s)[0]
            if not ready:
                raise _Stalled()
            for fd in ready:
                i = open_fds[fd]
                for kind, payload in children[i].take():
                    if kind == "progress" and on_progress is not None:
                        on_progress(i, msgspec.convert(payload, progress_type))
                if children[i].ended:
                    del open_fds[fd]
    except _Stalled:
        for i in open_fds.values():
            children[i].kill()
    return [c.finish(progress_type, result_type) for c in children]


class _Running:
    """One child of `run_isolated_all`: its pipe, what it sent so far, its stderr file."""

    def __init__(self, pid: int, fd: int, err_file: Any) -> None:
        self.pid, self.fd, self.err_file = pid, fd, err_file
        self.buf = bytearray()
        self.ended = False
        self.last: Any = None  # the last progress value
        self.result: Any = None
        self.got_result = False
        self.error: tuple[str, str] | None = None

    @classmethod
    def fork(cls, fn: Callable[[Callable[[Any], None]], Any]) -> "_Running":
        read_fd, write_fd = os.pipe()
        err_file = tempfile.TemporaryFile(prefix="kvc-isolated-")
        pid = os.fork()
        if pid == 0:  # the child: never returns
            _child(fn, read_fd, write_fd, err_file.fileno())
        os.close(write_fd)
        return cls(pid, read_fd, err_file)

    def take(self) -> list[tuple[str, Any]]:
        """The whole messages readable now (the pipe is readable); `ended` once it is closed."""
        part = os.read(self.fd, 1 << 16)
        if not part:
            self.ended = True
            os.close(self.fd)
        self.buf += part
        out = []
        while len(self.buf) >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(self.buf)
            if len(self.buf) < _LENGTH.size + size:
                break
            kind, payload = msgspec.msgpack.decode(bytes(self.buf[_LENGTH.size:_LENGTH.size + size]))
            del self.buf[:_LENGTH.size + size]
            if kind == "progress":
                self.last = payload
            elif kind == "result":
                self.result, self.got_result = payload, True
            elif kind == "error":
                self.error = (payload[0], payload[1])
            out.append((kind, payload))
        return out

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def finish(self, progress_type: Any, result_type: Any) -> tuple[Any, Died | None]:
        """Reap the child: (result, None) or (None, Died), as `run_isolated`."""
        if not self.ended:
            os.close(self.fd)
            self.ended = True
        _, status = os.waitpid(self.pid, 0)
        return _outcome(status, self.got_result, self.result, self.error, self.last, self.err_file, progress_type,
                        result_type)


def _outcome(status: int, got_result: bool, result: Any, error: tuple[str, str] | None, last: Any, err_file: Any,
             progress_type: Any, result_type: Any) -> tuple[Any, Died | None]:
    """How a reaped child ended: (result, None) or (None, Died), its stderr file closed."""
    err_file.seek(0, os.SEEK_END)
    size = err_file.tell()
    err_file.seek(max(0, size - _STDERR_KEPT))
    stderr = err_file.read().decode("utf-8", "replace")
    err_file.close()
    if got_result and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return msgspec.convert(result, result_type), None
    progress = msgspec.convert(last, progress_type) if last is not None else None
    if os.WIFSIGNALED(status):
        return None, Died(os.WTERMSIG(status), None, None, None, progress, stderr)
    code = os.WEXITSTATUS(status)
    if error is not None:
        return None, Died(None, code, f"{error[0]}: {error[1]}", error[0], progress, stderr)
    return None, Died(None, code, None, None, progress, stderr)


def _child(fn: Callable[[Callable[[Any], None]], Any], read_fd: int, write_fd: int, err_fd: int) -> None:
    code = 1
    try:
        os.close(read_fd)
        os.dup2(err_fd, 2)  # LMDB's assertion goes to the report, not to the caller's terminal
        faulthandler.disable()  # nor a Python fault dump, which goes to the descriptor it was enabled with
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

        def send(kind: str, payload: Any) -> None:
            body = msgspec.msgpack.encode((kind, payload))
            _write_all(write_fd, _LENGTH.pack(len(body)) + body)

        try:
            result = fn(lambda value: send("progress", value))
        except BaseException as exc:  # reported to the parent as the child's outcome
            send("error", (type(exc).__name__, " ".join(str(exc).split()) or type(exc).__name__))
            code = 3
        else:
            send("result", result)
            code = 0
    finally:
        os._exit(code)


class _Stalled(Exception):
    """The child sent nothing for the stall limit."""


def _read_exact(fd: int, n: int, stall_s: float) -> bytes | None:
    """n bytes from the pipe; None when it ends first (the child exited or died); `_Stalled` after `stall_s`
    seconds without a byte."""
    buf = bytearray()
    while len(buf) < n:
        if not select.select([fd], [], [], stall_s)[0]:
            raise _Stalled()
        part = os.read(fd, n - len(buf))
        if not part:
            return None
        buf += part
    return bytes(buf)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
