"""What an offline command runs on: a store opened to inspect it (and a namespace's record in it) or for a cache,
and a cache embedded in this process on it, its tiers checked against the memory there is before anything is
allocated.

Imports stay light here (no torch, no cache): a command that only reads a store must start in a fraction of a
second (benchmarks/bench_startup.py). What moves KV imports the cache inside the function that needs it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcache.storage.api import L3Store, NamespaceRecord
from kvcache.storage.codec import KEYED_ROOTS_VERSION
from kvcache.storage.location import StoreLocation
from kvcache.storage.registry import backend_class, open_store, scheme_of
from kvcache.types.fingerprint_key import FingerprintKey
from kvcache.types.namespace import Namespace

from .errors import UsageError
from .formats import note_old_format
from .render.text import human_bytes

if TYPE_CHECKING:
    from kvcache import TieredCache
    from kvcache.types.layout import KVLayout


def require_store(location: StoreLocation) -> None:
    """UsageError when `location` is a path where nothing exists (a URL is checked by its backend)."""
    if not location.is_url and not Path(location.url).exists():
        raise UsageError(f"{location}: no store here (create one with `kvc init`, or pass --store / KVC_STORE)")


def fingerprints_of(store: L3Store) -> FingerprintKey:
    """The key kvc shows `store`'s fingerprints and namespace ids under: the store's own, as its registry records
    them (else env KVC_FINGERPRINT_KEY, the deployment's). A store opened without its key (read-only, by a user who
    may not read it: monitoring) shows what its registry recorded, and anything that would derive a keyed value
    refuses in one line (a withheld key: KeyFileError), never keyed by a random key."""
    key = getattr(store, "fingerprint_key", None)
    if key is not None:
        return FingerprintKey(key)
    path = getattr(store, "path", None)
    if path is not None and getattr(store, "backend", "") == "lmdb":
        from kvcache.storage.keyfile import key_status

        status = key_status(path)
        return FingerprintKey.or_withheld(None, status.path, status.refusal())
    return FingerprintKey.or_withheld(None, str(store.location), "the store records no fingerprint key: this needs one")


def no_store_fingerprints() -> FingerprintKey:
    """The key of a message said before any store is open: env KVC_FINGERPRINT_KEY (one key for a deployment),
    else withheld (a fingerprint under any other key would match nothing a store or a live cache shows)."""
    return FingerprintKey.or_withheld(None, "kvc", "no store's fingerprint key is at hand here to key a fingerprint "
                                                   "or id by (open the store: --store)")


def open_inspect(location: StoreLocation, writable: bool = False, read_only: bool = False) -> L3Store:
    """Open an existing store to inspect it (read-only unless `writable`); a missing store is an error.
    `read_only` (--read-only): write nothing to the store's directory (LMDB: a lock-free open). A lock-free open
    is said in one line on stderr (`note_lock_free`)."""
    require_store(location)
    if read_only and writable:
        raise UsageError("--read-only: this command writes the store")
    options: dict[str, Any] = {"lock": False} if read_only and scheme_of(location.url) == "lmdb" else {}
    store = open_store(location.url, readonly=not writable, **options)
    if getattr(store, "lock_free", False):
        note_lock_free(location, read_only)
    if writable:
        note_old_format(location, getattr(store, "format_version", KEYED_ROOTS_VERSION))
    return store


def reads_lock_free(location: StoreLocation, read_only: bool) -> bool:
    """Whether a command that opens nothing itself (the audit) reads the store lock-free: with --read-only (LMDB),
    or where this user cannot write the store's lock file. Says so on stderr when it does."""
    probe = getattr(backend_class(scheme_of(location.url)), "reads_lock_free", None)
    if probe is None:
        return False
    lock_free = read_only or probe(location.url)
    if lock_free:
        note_lock_free(location, read_only)
    return lock_free


def note_lock_free(location: StoreLocation, asked: bool) -> None:
    """The one line on stderr that says a store is read lock-free, and why."""
    why = "--read-only" if asked else "this user cannot write its lock.mdb"
    sys.stderr.write(f"kvc: note: {location}: read lock-free and read-only ({why}); nothing is written to the "
                     f"store, and a read that writers overtake is run again\n")


def open_for_cache(location: StoreLocation) -> L3Store:
    """Open an existing store for a cache to read and write, under the layout it holds (`kvc init` made it): its
    `layout` is set."""
    require_store(location)
    with contextlib.closing(open_store(location.url, readonly=True)) as probe:
        layouts = probe.layouts()
    if len(layouts) != 1:
        raise UsageError(f"{location}: the store holds {len(layouts)} layouts; kvc commands drive a cache of "
                         f"one layout (`kvc init` creates a store with one)")
    store = open_store(location.url, layouts[0])
    note_old_format(location, getattr(store, "format_version", KEYED_ROOTS_VERSION))
    return store


def namespace_record(store: L3Store, ns: Namespace) -> NamespaceRecord | None:
    """The store's registry record of `ns`; None when the store holds nothing of it."""
    return next((rec for rec in store.namespaces() if rec.ns_id_hex == ns.id_hex), None)


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


def offline_cache(store: L3Store, layout: "KVLayout | None", device_tokens: int, host_tokens: int,
                  **policies: Any) -> "TieredCache":
    """A cache embedded in this process on `store` (offline mode: it lives as long as the command), its tiers
    checked against the memory there is first. `layout`: the store's (`open_for_cache` opens it under its own)."""
    if layout is None:
        raise UsageError(f"{store.location}: the store holds no layout (`kvc init` creates a store with one)")
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
