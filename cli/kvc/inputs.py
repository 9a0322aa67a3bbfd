"""What a command reads from its command line beyond typer's types: what every value must be (a finite number,
UTF-8 text: `guard_values`), a request's token ids (--tokens, --tokens-file), its namespace (--extra-key with the
salt from `kvc.secrets`), a ZeroMQ endpoint, a point in time. Every failure is a usage error naming the option and
the first bad value: exit 2, one line. A file it writes is `kvc.outputs`'s.
"""

from __future__ import annotations

import datetime
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import typer

from kvcache.storage.location import StoreLocation
from kvcache.types.namespace import Namespace

from .errors import UsageError
from .secrets import salt_from

if TYPE_CHECKING:
    import numpy as np

_INT = re.compile(r"[0-9]+", re.ASCII)  # ASCII digits only: '٣' is a digit to Python, not a token id
_TOKEN_MAX = 2**32 - 1
# A --tokens-file holds one request: as long as the longest trace line (about two million token ids). /dev/zero
# or a runaway pipe is refused at this many bytes instead of read until memory runs out.
MAX_TOKENS_FILE_BYTES = 16 << 20


def parse_tokens(text: str, source: str = "--tokens") -> "np.ndarray":
    """Token ids from '1,2,3', '1 2 3' or a JSON array of integers; UsageError naming the first bad one."""
    import numpy as np

    text = text.strip()
    if text.startswith("["):
        try:  # typed: a nested array is an error at its first element, never a recursion
            items = msgspec.json.decode(text, type=list[int])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise UsageError(f"{source}: not a JSON array of token ids: {exc}") from None
        words = [str(x) for x in items]
    else:
        words = [w for w in re.split(r"[\s,]+", text) if w]
    if not words:
        raise UsageError(f"{source}: no token ids")
    for i, w in enumerate(words):
        if not _INT.fullmatch(w) or int(w) > _TOKEN_MAX:
            raise UsageError(f"{source}: token {i} is {w[:40]!r}, not an integer in 0..{_TOKEN_MAX} "
                             f"(ASCII digits)")
    return np.array([int(w) for w in words], dtype=np.uint32)


def tokens_arg(tokens: str | None, tokens_file: Path | None) -> "np.ndarray | None":
    """The request's tokens from --tokens or --tokens-file (not both); None when neither is given."""
    if tokens is not None and tokens_file is not None:
        raise UsageError("give --tokens or --tokens-file, not both")
    if tokens_file is not None:
        return parse_tokens(read_bounded(tokens_file, MAX_TOKENS_FILE_BYTES, "--tokens-file"), str(tokens_file))
    if tokens is not None:
        return parse_tokens(tokens)
    return None


def read_bounded(path: Path, limit: int, option: str) -> str:
    """The text of `path` (a file, or a pipe such as `<(...)`), at most `limit` bytes: UsageError beyond, or when
    it cannot be read. Undecodable bytes are kept (surrogateescape) for the parser to name."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise UsageError(f"{option} {path}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise UsageError(f"{option} {path}: more than {limit} bytes, the most {option} reads")
    return data.decode("utf-8", errors="surrogateescape")


def namespace_arg(extra_key: str | None, salt: str | None, salt_file: Path | None = None) -> Namespace:
    """The namespace named on the command line (`""` and no value are the default namespace); the salt from
    --salt, --salt-file, stdin or KVC_SALT (kvc.secrets)."""
    return Namespace(extra_key, salt_from(salt, salt_file))



# --- what every value of every option and argument must be ------------------------------------------------------


def guard_values(param: Any) -> None:
    """Check every value `param` (a command's option or argument, as typer built it) is given, after typer's own
    conversion and range check and before the parameter's callback: a number must be finite (click's ranges let
    NaN through, and inf where no bound is declared) and text UTF-8 (an undecodable byte of the command line or
    the environment arrives as a lone surrogate, which neither JSON, a terminal nor a store record can carry). A
    bad one is typer's BadParameter: `Invalid value for '--timeout': ...`, exit 2, one line."""
    if getattr(param, "_kvc_guarded", False):
        return
    previous: Callable[..., Any] | None = param.callback

    def checked(ctx: Any, p: Any, value: Any) -> Any:
        problem = _bad_value(value)
        if problem is not None:
            raise typer.BadParameter(problem, ctx=ctx, param=p)
        return previous(ctx, p, value) if previous is not None else value

    param.callback = checked
    param._kvc_guarded = True


def _bad_value(value: Any) -> str | None:
    """Why `value` (converted: a number, text, a path, a list of them, ...) cannot be used; None when it can."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value} is not a finite number"
    if isinstance(value, (str, Path)):
        return not_utf8(str(value))
    if isinstance(value, StoreLocation):
        return not_utf8(value.url)  # the location as given (str() leaves a password out)
    if isinstance(value, (list, tuple)):
        return next((p for p in map(_bad_value, value) if p is not None), None)
    return None


def not_utf8(text: str) -> str | None:
    """Why `text` is not UTF-8 text (the first undecodable byte, by position: never the text itself, which may be
    a secret); None when it is."""
    for i, ch in enumerate(text):
        if "\ud800" <= ch <= "\udfff":
            byte = f" 0x{ord(ch) - 0xDC00:02x}" if 0xDC80 <= ord(ch) <= 0xDCFF else ""
            return f"not UTF-8 text (an undecodable byte{byte} at character {i})"
    return None


# --- ZeroMQ endpoints: a port alone or an address, as `kvc serve --events` and `kvc events` take them --------------

_PORT = re.compile(r"[0-9]+", re.ASCII)
MAX_PORT = 65535


def endpoint(text: str) -> str:
    """A ZeroMQ endpoint as given (`kvcache.live.feed.endpoint_of` turns a port alone into loopback): a port alone
    (0..65535; 0 or `*`: any free one), or `tcp://HOST:PORT` with such a port; other transports (`ipc://PATH`,
    `inproc://NAME`) as written. A typer `parser`: a bad one is exit 2 naming the option. ZeroMQ itself takes a
    port above 65535 modulo 65536 (99999 binds 34463): refused here."""
    text = text.strip()
    if not text:
        raise typer.BadParameter("an empty endpoint (give a port, or tcp://HOST:PORT)")
    if _PORT.fullmatch(text) or text == "*":
        port = text
    elif text.startswith("tcp://"):
        host, sep, port = text[len("tcp://"):].rpartition(":")
        if not sep or not host:
            raise typer.BadParameter(f"{text!r}: expected tcp://HOST:PORT (a port 0..{MAX_PORT}, or *)")
    elif "://" in text:
        return text
    else:
        raise typer.BadParameter(f"{text!r}: expected a port (0..{MAX_PORT}; 0 or * for any free one), "
                                 f"tcp://HOST:PORT or ipc://PATH")
    if port != "*" and not (_PORT.fullmatch(port) and int(port) <= MAX_PORT):
        raise typer.BadParameter(f"port {port[:20]!r}: not a port number (0..{MAX_PORT}; 0 or * for any free one)")
    return text


# --- permissions of a file kvc creates: `kvc serve --socket-mode` -------------------------------------------------

_OCTAL = re.compile(r"0?o?[0-7]{1,4}", re.ASCII | re.IGNORECASE)


def octal_mode(text: str) -> str:
    """Permission bits as octal digits (600, 0660, 0o660: at most 7777), checked and given back as written (the
    command reads them with `int(text, 8)`). A typer `parser`: anything else is exit 2 naming the option."""
    text = text.strip()
    if not _OCTAL.fullmatch(text):
        raise typer.BadParameter(f"{text[:20]!r}: not an octal mode such as 600 (at most 7777)")
    return text


# --- a point in time: `kvc audit --since` -------------------------------------------------------------------------

# The latest time kvc takes: the end of year 9999 UTC, the last a datetime can hold (and far beyond any stamp a
# store records); the earliest is the epoch, before which no store wrote anything.
LATEST = datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.timezone.utc).timestamp()


def moment(text: str, option: str, expected: str = "unix seconds or an ISO 8601 time") -> float:
    """Unix seconds from `text`: a number of seconds (finite, 0..LATEST) or an ISO 8601 time with its zone
    (2026-12-03T20:00:00+00:00, ...Z). UsageError naming `option` (and what it `expected`) otherwise."""
    text = text.strip()
    seconds = _seconds(text)
    if seconds is None:
        try:
            when = datetime.datetime.fromisoformat(text)
        except ValueError:
            raise UsageError(f"{option} {text[:40]!r}: expected {expected}") from None
        if when.tzinfo is None:
            raise UsageError(f"{option} {text[:40]!r}: give the time zone (2026-12-03T20:00:00+00:00, or ...Z)")
        seconds = when.timestamp()
    if not (math.isfinite(seconds) and 0 <= seconds <= LATEST):
        raise UsageError(f"{option} {text[:40]!r}: not a time kvc can use (unix seconds 0..{LATEST:.0f}, the end "
                         f"of year 9999)")
    return seconds


def _seconds(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def since_arg(text: str | None) -> tuple[float | None, bool]:
    """`kvc audit --since` as its scope's (since, since_last): 'last', or a time (`moment`)."""
    if text is None:
        return None, False
    if text.strip().lower() == "last":
        return None, True
    return moment(text, "--since", "'last', unix seconds or an ISO 8601 time"), False


# --- how many of the machine's cores --------------------------------------------------------------------------------


def cpus() -> int:
    """The cores this process may run on: the most worker processes a command starts (`kvc audit --workers`)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
