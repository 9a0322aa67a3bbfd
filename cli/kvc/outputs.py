"""Where a command writes a file it was given a name for (`kvc generate OUT`, `kvc replay --snapshot-out F`, `kvc
snapshot PATH`): the name is checked before any work, and the file appears whole or not at all.

A name is replaced atomically — a temporary file beside it, fsynced, renamed over it — only where it holds a
regular file or nothing. A rename over anything else destroys it: a symbolic link, a FIFO or (as root) a device
node such as /dev/full would become a regular file. So those are refused with one line (exit 2) unless `--force`,
and a directory, a socket or a block device is refused even then.

`--force` writes *through* what is there and never replaces it: a symbolic link is followed to its target, which
is checked in turn (a regular file or nothing there is replaced atomically in the target's own directory; a FIFO or
character device there is written into), and a FIFO or character device is written into as it is — streamed, not
atomic: its reader gets the bytes as they come. Why through and not over the link: kvc then never removes a link
or a node someone else made. `kvc generate --force /dev/stdout` streams to the pipe or terminal behind it where
replacing the link would (as root) turn /dev/stdout into a file, and a link kept by someone else (`trace.jsonl ->
traces/v3.jsonl`) keeps pointing where it did. The refusal without --force is what stops a link planted in a
shared directory from redirecting a write.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Annotated

import msgspec
import typer

from .errors import UsageError

ForceOpt = Annotated[bool, typer.Option(
    "--force", help="Write to an output name that holds a symbolic link (through it, to its target), a FIFO or a "
    "character device (into it, not atomically). Without it only a regular file or nothing is written there, "
    "replaced atomically.")]

# what a name may hold, in the words of a refusal; the rest of S_IFMT (a directory, a socket, a block device) is
# never written, not even with --force
_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISBLK, "a block device"))
_STREAMED = ("a named pipe (FIFO)", "a character device")  # written into under --force


class OutputTarget(msgspec.Struct, frozen=True):
    """A checked output name. `path` is where the bytes go (a symbolic link's target under --force); `streamed`:
    written into as it is (a FIFO or character device under --force), else replaced atomically."""

    given: str  # as the command line named it, for messages
    option: str  # the option or argument that named it
    path: str
    streamed: bool = False


def _words(mode: int) -> str | None:
    """What a file of `mode` is, in words; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((words for test, words in _KINDS if test(mode)), "not a regular file")


def _kind(path: str, follow: bool = False) -> str | None:
    """What `path` holds, in words (its last component followed only if `follow`); None for nothing or a regular
    file."""
    try:
        mode = (os.stat if follow else os.lstat)(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror or exc}") from None
    return _words(mode)


def output_target(path: str | os.PathLike[str], option: str, force: bool = False) -> OutputTarget:
    """Check, before any work, that the command may write its output at `path` (see the module docstring):
    UsageError (one line, exit 2) naming `option` when it may not."""
    given = os.fspath(path)
    where = f"{option} {given}"
    kind = _kind(given)
    if kind is not None and not force:
        if kind in ("a symbolic link", *_STREAMED):
            how = "through it" if kind == "a symbolic link" else "into it"
            raise UsageError(f"{where}: is {kind}; kvc replaces only a regular file (or writes a new one). Give "
                             f"another name, or --force to write {how}")
        raise UsageError(f"{where}: is {kind}, not a file kvc can write")
    real, linked = given, kind == "a symbolic link"
    if linked:
        kind = _kind(given, follow=True)  # what the chain of links leads to (nothing: a dangling link)
        if kind is None:  # a regular file or nothing: replaced (or made) under its own name, in its own directory
            real = os.path.realpath(given)
    if kind in _STREAMED:  # opened by the name given: /dev/stdout leads to /proc/self/fd/1, no path of its own
        if not os.access(given, os.W_OK):
            raise UsageError(f"{where}: {kind} this user cannot write")
        return OutputTarget(given, option, given, streamed=True)
    if kind is not None:
        raise UsageError(f"{where}: is {kind}{' (through its link)' if linked else ''}, not a file kvc can "
                         f"write")
    directory = os.path.dirname(real) or "."
    if not os.path.isdir(directory):
        raise UsageError(f"{where}: no directory {directory} to write into")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UsageError(f"{where}: directory {directory} is not writable")
    return OutputTarget(given, option, real)


@contextlib.contextmanager
def writing(target: OutputTarget) -> Iterator[IO[bytes]]:
    """A binary file to write `target`'s bytes into. Replaced atomically: a temporary file in the same directory
    (mode 0600), fsynced and renamed over the name when the block ends without an error — and only if the name
    still holds a regular file or nothing (it is checked again: the work may have taken long); else removed, so
    nothing half-written is left. Streamed (--force on a FIFO or character device): the name opened as it is."""
    if target.streamed:
        with open(target.path, "wb") as stream:  # a FIFO's open waits for its reader, as a shell redirection does
            yield stream
        return
    directory = os.path.dirname(target.path) or "."
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target.path)}.", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        kind = _kind(target.path)
        if kind is not None:
            raise UsageError(f"{target.option} {target.given}: became {kind} while kvc wrote it; nothing was "
                             f"replaced")
        os.replace(tmp, target.path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # interrupted or refused: no temporary file is left behind


def write_file(target: OutputTarget, data: bytes) -> Path:
    """Write `data` to `target` (see `writing`); the path written."""
    with writing(target) as f:
        f.write(data)
    return Path(target.path)


def is_stdout(target: OutputTarget) -> bool:
    """Whether `target` is this process's standard output (`--force /dev/stdout`): the command's own summary must
    then go to stderr, not into the data."""
    if not target.streamed:
        return False
    try:
        out, there = os.fstat(1), os.stat(target.path)
    except OSError:
        return False
    return (out.st_dev, out.st_ino) == (there.st_dev, there.st_ino)
