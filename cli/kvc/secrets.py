"""The secrets a kvc command handles — a namespace's salt, a store URL's password — where they may come from, and
why no message can give them away.

A salt given as ``--salt VALUE`` sits in the process list (``ps -o args``, /proc/PID/cmdline) for every local user
for as long as the command runs. So a salt is read, in this order, from ``--salt -`` (stdin), ``--salt-file
PATH``, ``--salt VALUE`` (works, with one warning on stderr), or env ``KVC_SALT``; ``--salt ''`` means "no salt"
even when KVC_SALT is set. A salt file is a regular file of at most 4 KiB (never a directory, pipe or device:
nothing is read without bound, nothing waits for a writer), with a warning when its group or others may read it.
A salt is UTF-8 text; one that is not is refused without saying where it is not (that would describe the salt).

No message is scrubbed by looking for a secret's text in it: replacing every ``a`` of a line by ``***`` (salt
``a``) prints ``cre***te``, and anyone who knows the template reads the secret back. Secrets stay out by structure:
a salt is never put into text (only its keyed fingerprint is), and a store location is printed in its shown form
(`StoreLocation`); text from elsewhere that names a location of this invocation (an LMDB error naming the store's
directory) is shown with that whole location in its shown form (`shown`). What was read is remembered only for a
guard that tests switch on (env ``KVC_SECRET_GUARD=1``): a secret long enough that it cannot be there by
coincidence found in a line kvc is about to print raises `SecretInOutput` — a bug made loud, never text mangled.
The options themselves are declared in `kvc.options`.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import typer

from kvcache.storage.location import StoreLocation

from .errors import SecretInOutput, UsageError
from .render.text import escape_controls

SALT_ENV = "KVC_SALT"
MAX_SALT_FILE_BYTES = 4096  # a salt is a short secret: a larger --salt-file is a mistake (or /dev/zero's cousin)
GUARD_ENV = "KVC_SECRET_GUARD"
# The guard looks only for secrets this long: a shorter one (a salt `a`) is in most lines by coincidence, and
# structure alone keeps it out.
GUARD_MIN_CHARS = 8

_seen: set[str] = set()
_locations: list[StoreLocation] = []
_warned = False


def forget() -> None:
    """Start a new invocation: no secret or location seen, no warning given."""
    global _warned
    _seen.clear()
    _locations.clear()
    _warned = False


def remember(*values: str) -> None:
    """Secrets of this invocation, for the guard (`guard`); never used to edit text."""
    _seen.update(v for v in values if v)


def shown(text: str) -> str:
    """`text` with every store location of this invocation, wherever it names one whole (the URL as given, the
    directory it names), in that location's shown form (`StoreLocation.redact`)."""
    for location in _locations:
        text = location.redact(text)
    return text


def guard(text: str, channel: str) -> str:
    """`text`, checked (with env KVC_SECRET_GUARD set: the tests) for a secret of this invocation of at least
    GUARD_MIN_CHARS characters; SecretInOutput naming `channel` if one is there."""
    if os.environ.get(GUARD_ENV, "") not in ("", "0"):
        for secret in _seen:
            if len(secret) >= GUARD_MIN_CHARS and secret in text:
                raise SecretInOutput(channel)
    return text


def store_location(value: str | StoreLocation) -> StoreLocation:
    """The --store option's parser: a StoreLocation, remembered for `shown` and its credentials for `guard`."""
    if isinstance(value, StoreLocation):
        return value
    try:
        location = StoreLocation(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    _locations.append(location)
    remember(*location.secrets)
    return location


def salt_from(salt: str | None, salt_file: Path | None) -> str | None:
    """The salt of the command line (see the module docstring); None for no salt."""
    if salt is not None and salt_file is not None:
        raise UsageError("give --salt or --salt-file, not both")
    if salt == "-":
        source = "stdin (--salt -)"
        value = _first_line(sys.stdin.read(), source)
    elif salt_file is not None:
        source = f"--salt-file {escape_controls(str(salt_file))}"
        value = _first_line(read_salt_file(salt_file), source)
    elif salt is not None:
        source = "--salt"
        _warn_visible(salt)
        value = salt
    else:
        source = SALT_ENV
        value = os.environ.get(SALT_ENV, "")
    remember(value)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are not UTF-8 came through as surrogates: name no position, no byte
        raise UsageError(f"{source}: the salt is not UTF-8 text") from None
    return value or None


def read_salt_file(path: Path) -> str:
    """The text of a --salt-file: a regular file of at most MAX_SALT_FILE_BYTES (a symbolic link to one is fine:
    mounted secrets are links), else UsageError naming the option. One warning line on stderr when its group or
    others may read it. Opened without blocking, then checked on the open file itself: a FIFO is refused, never
    waited on, and a file swapped after the check is not the one read."""
    where = f"--salt-file {escape_controls(str(path))}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise UsageError(f"{where}: {exc.strerror or type(exc).__name__}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise UsageError(f"{where}: a directory; give the file that holds the salt (its first line)")
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{where}: not a regular file (a salt is read from a file of at most "
                             f"{MAX_SALT_FILE_BYTES} bytes, never from a device or pipe; use --salt - for stdin)")
        data = _read_at_most(fd, MAX_SALT_FILE_BYTES + 1)  # the size may have grown since fstat: one byte more
    except OSError as exc:
        raise UsageError(f"{where}: {exc.strerror or type(exc).__name__}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_SALT_FILE_BYTES:
        # "more than", not the size: a message says nothing measured from a secret's file
        raise UsageError(f"{where}: more than {MAX_SALT_FILE_BYTES} bytes; a salt file holds at most "
                         f"{MAX_SALT_FILE_BYTES} (the salt on its first line)")
    readers = [who for bit, who in ((stat.S_IRGRP, "its group"), (stat.S_IROTH, "every other user"))
               if st.st_mode & bit]
    if readers:
        sys.stderr.write(f"kvc: warning: {where} is readable by {' and '.join(readers)} (mode "
                         f"{stat.S_IMODE(st.st_mode):04o}); keep a salt file private: chmod 600\n")
    return data.decode("utf-8", errors="surrogateescape")


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks, left = [], limit
    while left > 0:
        chunk = os.read(fd, left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


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
