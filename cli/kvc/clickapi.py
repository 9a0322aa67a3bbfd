"""The click that typer runs on, whichever typer is installed: every part of kvc that touches click's own classes
(exceptions, command groups) takes them from here, never from `import click`.

typer up to 0.25 runs on the click distribution; from 0.26 it carries its own reduced copy, `typer._click` (no
`Option`, no `Group`: typer's groups are commands with sub-commands), and needs no click at all. An environment
may hold both (SGLang's and most GPU images do: other packages pull click in), and then an exception class or a
parameter taken from `import click` is not the one typer raises or parses with: `except click.UsageError` misses
typer's usage errors, and a `click.Option` breaks parsing. typer.core names the module it uses; so does this one.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import Any

import typer.core


def _typers_click() -> ModuleType:
    vendored = getattr(typer.core, "_click", None)  # typer >= 0.26
    if isinstance(vendored, ModuleType):
        return vendored
    import click  # typer < 0.26 imports it itself: the same module

    return click


click: Any = _typers_click()
exceptions: Any = click.exceptions  # UsageError, NoArgsIsHelpError, BadParameter, ... as typer raises them
VENDORED = click.__name__ != "click"  # typer carries its own click (0.26 and later)


def subcommands(command: Any) -> dict[str, Any] | None:
    """The sub-commands of a group by name (every one built), or None for a command that has none. Under every
    typer a group answers `list_commands` and `get_command`; only click's own groups are `click.Group`s."""
    if not hasattr(command, "list_commands"):
        return None
    return {name: command.get_command(None, name) for name in command.list_commands(None)}


def walk(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(path, command) of every command below `command` that runs (groups walked, depth first, in listing order)."""
    subs = subcommands(command)
    if subs is None:
        yield path, command
        return
    for name, sub in subs.items():
        yield from walk(sub, (*path, name))
