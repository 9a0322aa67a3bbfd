"""What every kvc command shares: the --store/--json options, opening a store, output, and turning typed errors
into one line on stderr with exit code 2 (a traceback only with --debug)."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec
import numpy as np
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvcache import CacheConfig, KVCacheError, KVLayout, Namespace, TieredCache
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
ExtraKeyOpt = Annotated[str | None, typer.Option(
    "--extra-key", help="The namespace's extra_key (tenant, LoRA adapter, ...). Omit for requests without one.")]
TokensOpt = Annotated[str | None, typer.Option(
    "--tokens", help="The request's token ids, comma-separated: 1,2,3.")]
TokensFileOpt = Annotated[Path | None, typer.Option(
    "--tokens-file", help="A file of token ids: a JSON array, or integers separated by commas or whitespace.")]

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


def require_store(location: str) -> None:
    """UsageError when `location` is a path where nothing exists (a URL is checked by its backend)."""
    if "://" not in location and not Path(location).exists():
        raise UsageError(f"{location}: no store here (create one with `kvc init`, or pass --store / KVC_STORE)")


def open_inspect(location: str, writable: bool = False) -> L3Store:
    """Open an existing store to inspect it (read-only unless `writable`); a missing store is an error."""
    require_store(location)
    return open_store(location, readonly=not writable)


def open_for_cache(location: str) -> L3Store:
    """Open an existing store for a cache to read and write, under the layout it holds (`kvc init` made it)."""
    require_store(location)
    with contextlib.closing(open_store(location, readonly=True)) as probe:
        layouts = probe.layouts()
    if len(layouts) != 1:
        raise UsageError(f"{location}: the store holds {len(layouts)} layouts; kvc commands drive a cache of "
                         f"one layout (`kvc init` creates a store with one)")
    return open_store(location, layouts[0])


def offline_cache(store: L3Store, layout: KVLayout, device_tokens: int, host_tokens: int,
                  **policies: Any) -> TieredCache:
    """A cache embedded in this process on `store` (offline mode: it lives as long as the command)."""
    return TieredCache(CacheConfig(layout, device_tokens=device_tokens, host_tokens=host_tokens, **policies), store)


def round_up_pages(tokens: int, page_size: int) -> int:
    """Tokens rounded up to whole pages, at least one page."""
    return max(1, -(-tokens // page_size)) * page_size


_INT = re.compile(r"-?\d+")


def parse_tokens(text: str, source: str = "--tokens") -> np.ndarray:
    """Token ids from '1,2,3', '1 2 3' or a JSON array; UsageError naming the first bad one."""
    text = text.strip()
    if text.startswith("["):
        try:
            items = msgspec.json.decode(text)
        except msgspec.DecodeError as exc:
            raise UsageError(f"{source}: not a JSON array of token ids: {exc}") from None
        if not isinstance(items, list):
            raise UsageError(f"{source}: not a JSON array of token ids")
        words = [str(x) if isinstance(x, int) and not isinstance(x, bool) else repr(x) for x in items]
    else:
        words = [w for w in re.split(r"[\s,]+", text) if w]
    if not words:
        raise UsageError(f"{source}: no token ids")
    for i, w in enumerate(words):
        if not _INT.fullmatch(w) or not 0 <= int(w) < 2**32:
            raise UsageError(f"{source}: token {i} is {w!r}, not an integer in 0..4294967295")
    return np.array([int(w) for w in words], dtype=np.uint32)


def tokens_arg(tokens: str | None, tokens_file: Path | None) -> np.ndarray | None:
    """The request's tokens from --tokens or --tokens-file (not both); None when neither is given."""
    if tokens is not None and tokens_file is not None:
        raise UsageError("give --tokens or --tokens-file, not both")
    if tokens_file is not None:
        return parse_tokens(Path(tokens_file).read_text(), str(tokens_file))
    if tokens is not None:
        return parse_tokens(tokens)
    return None


@contextlib.contextmanager
def progress(description: str, total: int | None, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr (only on a terminal); yields `advance_to(completed)`."""
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=err, transient=True, disable=not (enabled and err.is_terminal))
    with bar:
        task = bar.add_task(description, total=total)
        yield lambda done: bar.update(task, completed=done)


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
