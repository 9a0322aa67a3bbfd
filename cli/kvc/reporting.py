"""How every kvc command ends: the one error contract (DESIGN §8), in one place.

- Success: exit 0. "The check found problems" (audit violations, verify mismatches): exit 1, said by the command.
- Any failure — bad usage, bad input, a store or socket that cannot be used, an error kvc did not expect — is one
  line on stderr, ``kvc: error: …``, and exit 2; with --json (or -o json/jsonl) also ``{"error": {"kind",
  "message"}}`` on stdout. ``--debug`` (or env KVC_DEBUG=1) prints the traceback first.
- Ctrl-C (SIGINT) is one line, ``kvc: interrupted``, and exit 130. The first SIGINT unwinds the command through
  its cleanups (store transactions are atomic, snapshots and traces are written to a temporary file and renamed);
  further SIGINTs are ignored until that is done, so nothing is left half-written. While a command drives a cache
  in this process (`at_steps`: a replay, a sweep), the SIGINT lands at the cache's next step (`step_boundary`,
  which every progress update calls) instead of wherever the interpreter happens to be: a KeyboardInterrupt raised
  inside the engine can leave a lock taken (CPython runs the handler between a lock's acquire and the `with` that
  would release it) and the cache's close then waits on it forever.
- Warnings the core logs (an L3 write that failed, a prefetch that could not read) are collapsed: the first of a
  kind is printed, the rest counted and summarised in one line when the command ends.

`KvcGroup` is the typer group class of the app: its `main` wraps every invocation, the console script's and
CliRunner's alike; `command` marks each command's body, so the handler knows what that command prints. Every
message goes through `one_line`: flattened to one line, control characters escaped, and each store location of
this invocation in its shown form (`kvc.secrets.shown`: the whole location, never a secret's text, is what is
replaced). What a message may say is structural: kvc's own errors are built from parts that hold no secret (a
location's shown form, a salt's fingerprint); the text of an error kvc did not raise (a library's, which may
quote a URL or a value it was handed) is not printed, only its type and where it was raised, unless its type is
one whose text is about code (`CODE_SHAPED`). A `--debug` traceback follows the same rule line by line.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import signal
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import typer
from typer.core import TyperGroup

from kvcache.errors import AdminRemoteError, KVCacheError

from . import secrets
from .clickapi import exceptions as click_exc  # the click typer raises with (its own from 0.26), not `import click`
from .errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, Interrupted, UsageError
from .render.output import Output
from .render.text import escape_controls


class Invocation:
    """What the error handler needs to know about the command line being run."""

    json = False  # the command prints JSON (--json, -o json, -o jsonl): errors go to stdout as JSON too
    debug = False  # --debug or KVC_DEBUG: show tracebacks
    at_steps = 0  # > 0 while a command drives a cache here: a SIGINT waits for the next step (`at_steps`)
    interrupted = False  # a SIGINT arrived while at_steps > 0 and has not been raised yet

    def start(self, args: Sequence[str]) -> None:
        """Read what can be known before parsing (parsing itself may be what fails)."""
        self.at_steps, self.interrupted = 0, False
        self.json = wants_json(args)
        self.debug = "--debug" in args or os.environ.get("KVC_DEBUG", "") not in ("", "0")


STATE = Invocation()


def wants_json(args: Sequence[str]) -> bool:
    """Whether a command line asks for JSON output (before, or without, parsing it)."""
    args = list(args)
    if "--" in args:
        args = args[:args.index("--")]
    for i, a in enumerate(args):
        if a == "--json" or a in ("-ojson", "-ojsonl", "--output=json", "--output=jsonl"):
            return True
        if a in ("-o", "--output") and i + 1 < len(args) and args[i + 1] in ("json", "jsonl"):
            return True
    return False


F = TypeVar("F", bound=Callable[..., Any])


def command(fn: F) -> F:
    """Mark a command body: it tells the error handler whether this invocation prints JSON and shows tracebacks,
    and turns a SIGINT into `Interrupted` once the body's cleanups have run."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        STATE.json = bool(kwargs.get("json")) or kwargs.get("output") in (Output.JSON, Output.JSONL)
        STATE.debug = STATE.debug or bool(kwargs.get("debug"))
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            raise Interrupted() from None

    return cast(F, wrapper)  # functools.wraps: the same signature

def one_line(text: str) -> str:
    """`text` as one safe line: whitespace runs folded, control characters escaped, this invocation's store
    locations in their shown form."""
    return secrets.guard(escape_controls(" ".join(secrets.shown(str(text)).split())), "an error or warning line")


# Errors whose text is about the code (names, types, arities), never about the data it was handed: printed as
# raised. Any other error kvc did not raise itself has its text withheld (a ValueError or UnicodeError quotes its
# input, a library's error may quote a URL).
CODE_SHAPED = (AttributeError, TypeError, NameError, ImportError, NotImplementedError, RecursionError, IndexError,
               ZeroDivisionError)


def said(exc: BaseException) -> str:
    """What may be printed of `exc`'s own text (before `one_line`): kvc's errors and the command line's as raised,
    an OS error's file and reason, a code-shaped error's text; for any other, its type and where it was raised."""
    if isinstance(exc, (KVCacheError, click_exc.ClickException)):
        if isinstance(exc, AdminRemoteError) and exc.kind == "internal":
            # the live cache's own "internal" answer carries a foreign error's text: its type alone
            return f"{exc.path}: the live cache failed: internal error {exc.remote_message.split(':', 1)[0]} (the " \
                   f"server's log has its traceback)"
        return str(exc)
    if isinstance(exc, OSError):
        reason = exc.strerror or type(exc).__name__
        # a filename that is an fd number (an error on an open file) names nothing: the reason alone
        named = isinstance(exc.filename, (str, bytes, os.PathLike))
        return f"{os.fsdecode(exc.filename)}: {reason}" if named else reason
    if isinstance(exc, CODE_SHAPED):
        return str(exc)
    return f"(text withheld: not kvc's own, it may quote what it was handed; raised at {_raised_at(exc)})"


def _raised_at(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "an unknown place"
    last = frames[-1]
    return f"{Path(last.filename).name}:{last.lineno} ({last.name})"


def traceback_of(exc: BaseException) -> str:
    """`exc`'s traceback and those chained to it, as Python prints them (frames, source lines), each exception's
    text as `said` gives it."""
    chain: list[tuple[BaseException, str]] = []  # innermost first; each with the sentence that links it onward
    seen: set[int] = set()
    current: BaseException | None = exc
    link = ""
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append((current, link))
        if current.__cause__ is not None:
            current, link = current.__cause__, "The above exception was the direct cause of the following exception:"
        elif current.__context__ is not None and not current.__suppress_context__:
            current, link = current.__context__, "During handling of the above exception, another exception occurred:"
        else:
            current = None
    parts = []
    for error, link in reversed(chain):
        frames = traceback.extract_tb(error.__traceback__)
        if frames:
            parts.append("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames)))
        kind = type(error)
        name = kind.__qualname__ if kind.__module__ in ("builtins", "__main__") else \
            f"{kind.__module__}.{kind.__qualname__}"
        parts.append(f"{name}: {said(error)}\n")
        if link:
            parts.append(f"\n{link}\n\n")
    return "".join(parts)


def kind_of(exc: BaseException) -> str:
    """The `kind` of an error in `{"error": {"kind", "message"}}`: `usage` for bad usage, the snake_case class
    name for a kvcache error (`not_a_store`, `invalid_namespace`, `admin_unavailable`, ...), `os_error`,
    `out_of_memory`, `interrupted`, or `internal` for an error kvc did not expect."""
    if isinstance(exc, (click_exc.UsageError, UsageError)):
        return "usage"
    if isinstance(exc, (Interrupted, KeyboardInterrupt)):
        return "interrupted"
    if isinstance(exc, KVCacheError):
        return re.sub(r"(?<!^)(?=[A-Z])", "_", type(exc).__name__).lower()
    if isinstance(exc, MemoryError):
        return "out_of_memory"
    if isinstance(exc, OSError):
        return "os_error"
    if _lmdb_damage(exc):
        return "store_damaged"
    return "internal"


def _lmdb_damage(exc: BaseException) -> bool:
    """An LMDB error that says a page of the data file is damaged, raised where no store call translated it (a
    command's own walk of a damaged tree)."""
    return type(exc).__module__ == "lmdb" and type(exc).__name__ in ("CorruptedError", "PageNotFoundError")


def message_of(exc: BaseException) -> str:
    """The one-line message of an error."""
    if isinstance(exc, click_exc.UsageError):
        text = exc.format_message()
        if exc.ctx is not None:
            text += f" (see `{exc.ctx.command_path} --help`)"
        return one_line(text)
    if isinstance(exc, (Interrupted, KeyboardInterrupt)):
        return "interrupted"
    if isinstance(exc, MemoryError):  # numpy's says what it could not allocate: sizes and shapes, nothing handed
        return one_line(f"out of memory{': ' + str(exc) if str(exc) else ''} (ask for smaller tiers or budgets)")
    if _lmdb_damage(exc):
        return one_line(f"the store's data file has a damaged page (LMDB: {type(exc).__name__}): `kvc audit` says "
                        f"what is damaged, and `kvc audit --repair` rebuilds the store from what still reads back "
                        f"sound")
    text = said(exc) or type(exc).__name__
    if kind_of(exc) == "internal":
        text = f"internal error: {type(exc).__name__}: {text} (run with --debug for the traceback)"
    return one_line(text)


def report(exc: BaseException) -> int:
    """Print the error line (and the JSON object under --json); the exit code it means."""
    if STATE.debug and not isinstance(exc, (click_exc.UsageError, Interrupted, KeyboardInterrupt)):
        sys.stderr.write(secrets.guard(secrets.shown(traceback_of(exc)), "a --debug traceback"))
    code = EXIT_INTERRUPTED if kind_of(exc) == "interrupted" else EXIT_USAGE
    message = message_of(exc)
    if STATE.json:
        import msgspec

        sys.stdout.write(msgspec.json.encode({"error": {"kind": kind_of(exc), "message": message}}).decode() + "\n")
        sys.stdout.flush()
    prefix = "kvc: " if code == EXIT_INTERRUPTED else "kvc: error: "
    sys.stderr.write(prefix + message + "\n")
    sys.stderr.flush()
    return code


class KvcGroup(TyperGroup):
    """The app's group: runs an invocation under the error contract (see the module docstring)."""

    # click's main is typed with overloads per standalone_mode; one implementation serves both
    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,  # type: ignore[override]
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> Any:
        """Run one invocation under the error contract; the exit code (or, standalone, exit with it)."""
        args = list(sys.argv[1:] if args is None else args)
        STATE.start(args)
        secrets.forget()
        code = EXIT_OK
        with _sigint_unwinds(), collapsed_warnings():
            try:
                result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
                code = result if isinstance(result, int) and not isinstance(result, bool) else EXIT_OK
                if code == EXIT_INTERRUPTED:  # a SIGINT typer caught before the command ran
                    code = report(Interrupted())
            except click_exc.NoArgsIsHelpError as exc:  # `kvc` or `kvc ns` alone: the help, as a usage error
                sys.stderr.write(exc.format_message() + "\n")
                code = EXIT_USAGE
            except (typer.Abort, KeyboardInterrupt, Interrupted):
                code = report(Interrupted())
            except typer.Exit as exc:
                code = exc.exit_code
            except Exception as exc:  # noqa: BLE001 - the one place every failure becomes a line and exit 2
                code = report(exc)
        if standalone_mode:
            sys.exit(code)
        return code


@contextlib.contextmanager
def _sigint_unwinds() -> Iterator[None]:
    """The first SIGINT raises KeyboardInterrupt; later ones are ignored while the command's cleanups run."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN or not _main_thread():
        yield  # started with SIGINT ignored (nohup, a background job), or not ours to set: leave it
        return

    def first(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if STATE.at_steps:
            STATE.interrupted = True  # raised by the next step_boundary
            return
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, first)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def at_steps() -> Iterator[None]:
    """Around work that drives a cache in this process: a SIGINT is held until the next `step_boundary` (or the end
    of the block), where it is raised as KeyboardInterrupt with the cache between steps (see the module
    docstring)."""
    STATE.at_steps += 1
    try:
        yield
    finally:
        STATE.at_steps -= 1
    step_boundary()


def step_boundary() -> None:
    """A place a held SIGINT may land: raise it here (KeyboardInterrupt) if one arrived."""
    if STATE.interrupted:
        STATE.interrupted = False
        raise KeyboardInterrupt


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


class _Collapse(logging.Handler):
    """Prints the first record of each kind (logger, level, message template); counts the repeats."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: dict[tuple[str, int, str], list[Any]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        key = (record.name, record.levelno, str(record.msg))
        entry = self.seen.get(key)
        if entry is not None:
            entry[0] += 1
            return
        text = one_line(record.getMessage())
        self.seen[key] = [1, text]
        sys.stderr.write(f"kvc: {record.levelname.lower()}: {text}\n")

    def summary(self) -> None:
        for (_, level, _), (count, text) in self.seen.items():
            if count > 1:
                sys.stderr.write(f"kvc: {logging.getLevelName(level).lower()}: {count - 1} more like: {text}\n")


@contextlib.contextmanager
def collapsed_warnings() -> Iterator[None]:
    """Route the core's warnings to stderr, collapsed (see `_Collapse`), for one invocation."""
    log = logging.getLogger("kvcache")
    handler = _Collapse()
    log.addHandler(handler)
    propagate, log.propagate = log.propagate, False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.propagate = propagate
        handler.summary()
