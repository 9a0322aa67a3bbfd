"""The secrets a kvc command handles — a namespace's salt, a store URL's password — and where they may come from.

A salt given as ``--salt VALUE`` sits in the process list (``ps -o args``, /proc/PID/cmdline) for every local user
for as long as the command runs. So a salt is read, in this order, from ``--salt -`` (stdin), ``--salt-file
PATH``, ``--salt VALUE`` (works, with one warning on stderr), or env ``KVC_SALT``; ``--salt ''`` means "no salt"
even when KVC_SALT is set. A salt file is a regular file of at most 4 KiB (never a pipe or device: nothing is read
without bound, nothing waits for a writer), with a warning when its group or others may read it. Whatever was read is remembered for this invocation so that no message can print it
(`redact`, used by every error and warning line). The options themselves are declared in `kvc.options`.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import typer

from kvcache.storage.location import REDACTED, StoreLocation

from .errors import UsageError
from .render.text import escape_controls

SALT_ENV = "KVC_SALT"
MAX_SALT_FILE_BYTES = 4096  # a salt is a short secret: a larger --salt-file is a mistake (or /dev/zero's cousin)

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
    if salt is not None and salt_file is not None:
        raise UsageError("give --salt or --salt-file, not both")
    if salt == "-":
        value = _first_line(sys.stdin.read(), "stdin (--salt -)")
    elif salt_file is not None:
        value = _first_line(read_salt_file(salt_file), f"--salt-file {salt_file}")
    elif salt is not None:
        _warn_visible(salt)
        value = salt
    else:
        value = os.environ.get(SALT_ENV, "")
    remember(value)
    return value or None


def read_salt_file(path: Path) -> str:
    """The text of a --salt-file: a regular file of at most MAX_SALT_FILE_BYTES (a symbolic link to one is fine:
    mounted secrets are links), else UsageError. One warning line on stderr when its group or others may read it.
    Opened without blocking, then checked on the open file itself: a FIFO is refused, never waited on, and a file
    swapped after the check is not the one read."""
    where = f"--salt-file {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise UsageError(f"{where}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{where}: not a regular file (a salt is read from a file of at most "
                             f"{MAX_SALT_FILE_BYTES} bytes, never from a device or pipe; use --salt - for stdin)")
        data = f.read(MAX_SALT_FILE_BYTES + 1)  # the size may have grown since fstat: read one byte more to know
        if len(data) > MAX_SALT_FILE_BYTES:
            raise UsageError(f"{where}: {max(st.st_size, len(data))} bytes; a salt file holds at most "
                             f"{MAX_SALT_FILE_BYTES} (the salt on its first line)")
    readers = [who for bit, who in ((stat.S_IRGRP, "its group"), (stat.S_IROTH, "every other user"))
               if st.st_mode & bit]
    if readers:
        sys.stderr.write(f"kvc: warning: {escape_controls(where)} is readable by {' and '.join(readers)} (mode "
                         f"{stat.S_IMODE(st.st_mode):04o}); keep a salt file private: chmod 600\n")
    return data.decode("utf-8", errors="surrogateescape")


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
