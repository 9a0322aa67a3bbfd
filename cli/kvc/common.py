"""What every kvc command shares: the --store/--json options, opening a store, output, and turning typed errors
into one line on stderr with exit code 2 (a traceback only with --debug)."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec
import typer
from rich.console import Console

from kvcache import KVCacheError, Namespace
from kvcache.storage.base import L3Store, open_store

EXIT_OK, EXIT_FOUND, EXIT_USAGE = 0, 1, 2  # DESIGN §8: ok; the check found problems; bad usage or input

DEFAULT_STORE = "./kvc-store"

StoreOpt = Annotated[str, typer.Option(
    "--store", envvar="KVC_STORE", show_default=True,
    help="The L3 store: a directory (LMDB) or a URL such as redis://host:port/0. Env: KVC_STORE.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout and nothing else.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show the traceback of an error.")]
SaltOpt = Annotated[str | None, typer.Option(
    "--salt", help="The namespace's cache_salt. Used only to derive the namespace id; never printed or stored.")]

# Piped output (runbooks, CI logs) gets 120 columns rather than rich's 80, so tables keep one row per line.
out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 120)
err = Console(stderr=True, highlight=False, soft_wrap=True, width=None if sys.stderr.isatty() else 120)

F = TypeVar("F", bound=Callable[..., Any])


class UsageError(KVCacheError):
    """Bad command-line input found by the CLI itself (exit 2)."""


def command(fn: F) -> F:
    """Run a command body, turning kvcache's typed errors (and unusable files) into one stderr line, exit 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except (KVCacheError, OSError) as exc:
            if kwargs.get("debug") or os.environ.get("KVC_DEBUG"):
                raise
            err.print(f"kvc: error: {_one_line(exc)}", markup=False)
            raise typer.Exit(EXIT_USAGE) from None

    return wrapper  # type: ignore[return-value]


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, OSError) and exc.filename:
        text = f"{exc.filename}: {exc.strerror or text}"
    return " ".join(text.split())


def emit_json(value: Any) -> None:
    """The command's result as one JSON object on stdout (msgspec structs encode as their fields)."""
    sys.stdout.write(msgspec.json.encode(value).decode() + "\n")
    sys.stdout.flush()


def open_inspect(location: str, writable: bool = False) -> L3Store:
    """Open an existing store to inspect it (read-only unless `writable`); a missing store is an error."""
    if "://" not in location and not Path(location).exists():
        raise UsageError(f"{location}: no store here (create one with `kvc init`, or pass --store / KVC_STORE)")
    return open_store(location, readonly=not writable)


def namespace_arg(extra_key: str | None, salt: str | None) -> Namespace:
    """The namespace named on the command line (`""` and no value are the default namespace)."""
    return Namespace(extra_key, salt)


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def when(ts: float) -> str:
    """A unix time as a short local timestamp ('-' for never)."""
    if not ts:
        return "-"
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
