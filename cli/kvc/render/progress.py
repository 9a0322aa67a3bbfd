"""Progress bars of long commands (replay, demo, put, bench): on stderr, and only on a terminal, so stdout stays
what the command prints (a table, tsv or one JSON object) and a log or a pipe gets no bar at all."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from .output import console


@contextlib.contextmanager
def progress(description: str, total: int | None, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr (only on a terminal); yields `advance_to(completed)`."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=console(stderr=True), transient=True,
                   disable=not (enabled and console(stderr=True).is_terminal))
    with bar:
        task = bar.add_task(description, total=total)
        yield lambda done: bar.update(task, completed=done)
