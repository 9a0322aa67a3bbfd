"""Progress of long commands (replay, demo, put, bench): a bar on stderr, only on a terminal, so stdout stays what
the command prints (a table, tsv or one JSON object) and a log or a pipe gets no bar at all.

A program that runs kvc and wants its progress (a wrapper's own display, a test that must act while a replay
runs) names a file descriptor it passed to kvc in env KVC_PROGRESS_FD: kvc writes one line per update there,
``DESCRIPTION DONE/TOTAL`` (``replay 0/20000`` when the work starts, then after each step), whether or not a
terminal shows the bar. A reader that goes away stops the lines, never the command; a reader that does not keep up
holds the command back at its next line (a pipe, not a log: the lines are the command's pace).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

from ..errors import UsageError
from ..reporting import step_boundary
from .output import console

PROGRESS_FD_ENV = "KVC_PROGRESS_FD"


class _Lines:
    """The ``DESCRIPTION DONE/TOTAL`` lines written to KVC_PROGRESS_FD (nothing once its reader has gone). Each is
    one unbuffered write, shorter than PIPE_BUF: a reader sees whole lines, and nothing waits to be flushed when the
    command ends (or is interrupted while a slow reader holds it back)."""

    def __init__(self, fd: int | None, description: str, total: int | None) -> None:
        self.fd = fd
        self.prefix = f"{description[:200]} "
        self.total = "?" if total is None else str(total)

    def write(self, done: int) -> None:
        if self.fd is None:
            return
        try:
            os.write(self.fd, f"{self.prefix}{done}/{self.total}\n".encode())
        except OSError:  # the reader went away (EPIPE): its display ends, the command goes on
            self.fd = None


def _progress_fd() -> int | None:
    """The descriptor KVC_PROGRESS_FD names (None when unset); a value that is not an open descriptor is exit 2."""
    text = os.environ.get(PROGRESS_FD_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise UsageError(f"{PROGRESS_FD_ENV}={text!r}: not a file descriptor number")
    try:
        os.fstat(int(text))
    except OSError:
        raise UsageError(f"{PROGRESS_FD_ENV}={text}: no such open file descriptor (pass it to kvc)") from None
    return int(text)


@contextlib.contextmanager
def progress(description: str, total: int | None, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr (only on a terminal, when `enabled`) and progress lines on KVC_PROGRESS_FD (when
    set); yields `advance_to(completed)`."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    lines = _Lines(_progress_fd(), description, total)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=console(stderr=True), transient=True,
                   disable=not (enabled and console(stderr=True).is_terminal))
    with bar:
        task = bar.add_task(description, total=total)

        def advance(done: int) -> None:
            bar.update(task, completed=done)
            lines.write(done)
            step_boundary()  # between steps: where a held Ctrl-C lands (reporting.at_steps)

        lines.write(0)
        yield advance
