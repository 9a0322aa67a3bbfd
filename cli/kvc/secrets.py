"""The secrets a kvc command handles — a namespace's salt, a store URL's password — and where they may come from.

A salt given as ``--salt VALUE`` sits in the process list (``ps -o args``, /proc/PID/cmdline) for every local user
for as long as the command runs. So a salt is read, in this order, from ``--salt -`` (stdin), ``--salt-file
PATH``, ``--salt VALUE`` (works, with one warning on stderr), or env ``KVC_SALT``; ``--salt ''`` means "no salt"
even when KVC_SALT is set. Whatever was read is remembered for this invocation so that no message can print it
(`redact`, used by every error and warning line). The options themselves are declared in `kvc.options`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from kvcache.storage.location import REDACTED, StoreLocation

from .errors import UsageError

SALT_ENV = "KVC_SALT"

_seen: set[str] = set()
_warned = False


def forget() -> None:
    """Start a new invocation: nothing seen, no warning given."""
    global _warned
    _seen.clear()
    _warned = False


def remember(*values: str) -> None:
    """Secrets of this invocation: `redact` replaces them wherever they would be printed."""
    _seen.update(v for v in values if v)


def redact(text: str) -> str:
    """`text` with every remembered secret replaced by ***, longest first."""
    for secret in sorted(_seen, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return text


def store_location(value: str | StoreLocation) -> StoreLocation:
    """The --store option's parser: a StoreLocation, its credentials remembered."""
    if isinstance(value, StoreLocation):
        return value
    try:
        location = StoreLocation(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    remember(*location.secrets)
    return location


def salt_from(salt: str | None, salt_file: Path | None) -> str | None:
    """The salt of the command line (see the module docstring); None for no salt."""
    import os

    if salt is not None and salt_file is not None:
        raise UsageError("give --salt or --salt-file, not both")
    if salt == "-":
        value = _first_line(sys.stdin.read(), "stdin (--salt -)")
    elif salt_file is not None:
        try:
            text = Path(salt_file).read_text(encoding="utf-8", errors="surrogateescape")
        except OSError as exc:
            raise UsageError(f"--salt-file {salt_file}: {exc.strerror or exc}") from None
        value = _first_line(text, f"--salt-file {salt_file}")
    elif salt is not None:
        _warn_visible(salt)
        value = salt
    else:
        value = os.environ.get(SALT_ENV, "")
    remember(value)
    return value or None


def _first_line(text: str, source: str) -> str:
    lines = text.splitlines()
    if not lines or not lines[0]:
        raise UsageError(f"{source}: no salt there (an empty first line); give --salt '' for no salt")
    return lines[0]


def _warn_visible(salt: str) -> None:
    global _warned
    if salt and not _warned:
        _warned = True
        sys.stderr.write("kvc: warning: a salt given as --salt VALUE is visible to every local user in the process "
                         "list; use env KVC_SALT, --salt-file PATH or --salt - (stdin)\n")
