"""What kvc commands share: the --store option, opening a store, reading a request's tokens and namespace,
sizing an embedded cache safely, progress bars.

Imports stay light here (no torch, no cache): a command that only reads a store must start in a fraction of a
second (benchmarks/bench_startup.py). What moves KV imports the cache inside the function that needs it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import msgspec
import typer

from kvcache.types.namespace import Namespace, use_fingerprint_key
from kvcache.storage.api import L3Store
from kvcache.storage.registry import open_store
from kvcache.storage.location import StoreLocation

from .errors import Interrupted, UsageError
from .reporting import STATE
from .output import Output, console, human_bytes
from .secrets import salt_from, store_location

if TYPE_CHECKING:
    import numpy as np

    from kvcache import KVLayout, TieredCache

DEFAULT_STORE = "./kvc-store"

StoreOpt = Annotated[StoreLocation, typer.Option(
    "--store", envvar="KVC_STORE", show_default=True, parser=store_location, metavar="PATH|URL",
    help="The L3 store: a directory (LMDB) or a URL such as redis://host:port/0. Env: KVC_STORE. A password in "
    "the URL is never printed.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show the traceback of an error.")]
ExtraKeyOpt = Annotated[str | None, typer.Option(
    "--extra-key", help="The namespace's extra_key (tenant, LoRA adapter, ...). Omit for requests without one.")]
TokensOpt = Annotated[str | None, typer.Option(
    "--tokens", help="The request's token ids (ASCII digits), comma- or space-separated (1,2,3) or a JSON array.")]
TokensFileOpt = Annotated[Path | None, typer.Option(
    "--tokens-file", help="A file of token ids: a JSON array, or integers separated by commas or whitespace.")]

F = TypeVar("F", bound=Callable[..., Any])


def command(fn: F) -> F:
    """Mark a command body: it tells the error handler (kvc.reporting) whether this invocation prints JSON and shows
    tracebacks, and turns a SIGINT into `Interrupted` once the body's cleanups have run."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        STATE.json = bool(kwargs.get("json")) or kwargs.get("output") in (Output.JSON, Output.JSONL)
        STATE.debug = STATE.debug or bool(kwargs.get("debug"))
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            raise Interrupted() from None

    return wrapper  # type: ignore[return-value]


def require_store(location: StoreLocation) -> None:
    """UsageError when `location` is a path where nothing exists (a URL is checked by its backend)."""
    if not location.is_url and not Path(location.url).exists():
        raise UsageError(f"{location}: no store here (create one with `kvc init`, or pass --store / KVC_STORE)")


def _keyed(store: L3Store) -> L3Store:
    """Show fingerprints and namespace ids under the store's own key, as its registry records them."""
    key = getattr(store, "fingerprint_key", None)
    if key is not None:
        use_fingerprint_key(key)
    return store


def open_inspect(location: StoreLocation, writable: bool = False) -> L3Store:
    """Open an existing store to inspect it (read-only unless `writable`); a missing store is an error."""
    require_store(location)
    return _keyed(open_store(location.url, readonly=not writable))


def open_for_cache(location: StoreLocation) -> L3Store:
    """Open an existing store for a cache to read and write, under the layout it holds (`kvc init` made it)."""
    require_store(location)
    with contextlib.closing(open_store(location.url, readonly=True)) as probe:
        layouts = probe.layouts()
    if len(layouts) != 1:
        raise UsageError(f"{location}: the store holds {len(layouts)} layouts; kvc commands drive a cache of "
                         f"one layout (`kvc init` creates a store with one)")
    return _keyed(open_store(location.url, layouts[0]))


def available_memory() -> int:
    """Bytes of memory the system can give this process now (MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass  # not Linux: fall back to the free pages sysconf reports
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_tiers(layout: "KVLayout", device_tokens: int, host_tokens: int) -> None:
    """Refuse (UsageError) tier sizes this machine cannot hold, before anything is allocated."""
    per_token = layout.bytes_per_token
    device, host = device_tokens * per_token, host_tokens * per_token
    in_host_memory = host
    import torch

    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        if device > free:
            raise UsageError(f"L1 of {device_tokens:,} tokens needs {human_bytes(device)} of device memory; "
                             f"{human_bytes(free)} is free")
    else:
        in_host_memory += device  # without CUDA the device pool is host memory too
    avail = available_memory()
    if in_host_memory > avail:
        raise UsageError(f"L1 {device_tokens:,} + L2 {host_tokens:,} tokens of {per_token:,} bytes need "
                         f"{human_bytes(in_host_memory)} of memory; {human_bytes(avail)} is available "
                         f"(ask for fewer tokens or pages)")


def offline_cache(store: L3Store, layout: "KVLayout", device_tokens: int, host_tokens: int,
                  **policies: Any) -> "TieredCache":
    """A cache embedded in this process on `store` (offline mode: it lives as long as the command), its tiers
    checked against the memory there is first."""
    check_tiers(layout, device_tokens, host_tokens)
    import torch

    from kvcache import CacheConfig, TieredCache

    # Torch's CPU ops on the calling thread only. A cache's copies are small per-page gathers and scatters, and
    # the L3 I/O thread runs beside them: with OpenMP workers spinning for the same cores, a 10k request replay
    # on two cores took 8x longer (44 s instead of 5.8 s, measured with --verify).
    torch.set_num_threads(1)
    return TieredCache(CacheConfig(layout, device_tokens=device_tokens, host_tokens=host_tokens, **policies), store)


def round_up_pages(tokens: int, page_size: int) -> int:
    """Tokens rounded up to whole pages, at least one page."""
    return max(1, -(-tokens // page_size)) * page_size


_INT = re.compile(r"[0-9]+", re.ASCII)  # ASCII digits only: '٣' is a digit to Python, not a token id
_TOKEN_MAX = 2**32 - 1


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
        return parse_tokens(Path(tokens_file).read_text(), str(tokens_file))
    if tokens is not None:
        return parse_tokens(tokens)
    return None


def namespace_arg(extra_key: str | None, salt: str | None, salt_file: Path | None = None) -> Namespace:
    """The namespace named on the command line (`""` and no value are the default namespace); the salt from
    --salt, --salt-file, stdin or KVC_SALT (kvc.secrets)."""
    return Namespace(extra_key, salt_from(salt, salt_file))


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


def writable_target(path: Path, option: str) -> Path:
    """Check, before any work, that a file can be written at `path` (its directory exists and is writable)."""
    directory = Path(path).parent
    if not directory.is_dir():
        raise UsageError(f"{option} {path}: no directory {directory} to write into")
    if Path(path).is_dir():
        raise UsageError(f"{option} {path}: is a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UsageError(f"{option} {path}: directory {directory} is not writable")
    return Path(path)
