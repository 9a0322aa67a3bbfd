"""`KvcStorage`: SGLang's HiCache L3 (`HiCacheStorage`, SGLang 0.5.23) on any kvc store.

Loaded by SGLang itself, with no change to SGLang::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "kvc", "module_path": "kvcache.engines.sglang",
        "class_name": "KvcStorage", "kvc_store": "/var/lib/kvc", "interface_v1": 1}'

`kvc_store` is any kvc store location (a path: LMDB; `redis://...`: the Redis plugin, so several SGLang nodes share
one L3), default env KVC_STORE. `kvc_namespace` (default "sglang") names the kvc namespace every page of this
engine lives under (`Namespace(extra_key=kvc_namespace)`: `kvc ns ls`, shares, TTL and `kvc ns drop` act on it).
`kvc_store_options` passes the store backend's own open options (e.g. `{"durability": "none"}`: LMDB commits
without fsync, as SGLang's `file` backend writes; the default, "data", syncs each batch). `interface_v1` is
SGLang's own switch to the zero-copy interface (`batch_get_v1`/`batch_set_v1`); without it SGLang uses the generic
one (`batch_get`/`batch_set` with flat page tensors). Both store the same bytes (`sglang_pool`).

How SGLang's calls map to the store:

- Keys: SGLang names a page by a 64-hex key (a SHA-256 chain it seeds per request namespace). Its 32 raw bytes are
  the page's engine key (`engine_key`: one key string, one engine key); kvc derives the page hash from the key
  and the namespace/layout root alone (`engine_hashes`), so a read needs nothing but the keys. `prefix_keys` (the
  keys before a call's first one) is used on writes only, to record the first page's parent; within a batch each
  page's parent is the previous key. SGLang's prefetches anchored below the root pass prefix keys that do not
  chain with the call's keys, so a read never looks at them.
- Geometry: SGLang builds the backend before its host pool exists (`cls(storage_config, kwargs)`); the layout is
  built in `register_mem_pool_host` from the pool (`sglang_pool.HostPages`) and the storage config (model name,
  shard: tp/pp/cp ranks; MLA is replicated across TP, so its shard has no TP identity). The store is opened then.
- Results: one bool per page (`PutResult.outcomes`: a page WRITTEN or EXISTING is stored, one REJECTED or FAILED
  is not); `batch_exists` counts consecutive pages from the start.
- Writers: only `storage_config.is_storage_writer` ranks write (MLA: one rank per shard); the others answer True
  for every page, as the writer rank stores them.
- Faults: SGLang calls from its prefetch, backup and scheduler threads at once. Store handles are safe to use
  from several threads (every backend's rule), so calls run side by side (a prefetch is never queued behind a
  backup's commit); the adapter's own counters and its binding to the pool are kept under a lock. A store fault
  (a server gone, a read-only store, an I/O error) becomes misses or False, counted in `kvc_stats()` and logged
  (once per new fault), never an exception into SGLang's threads. So does `close` (SGLang's detach, a failed
  attach) while a prefetch or backup thread is in a call: the store handle's close waits for the reads and writes
  in flight, and a call that reaches the store after it is a miss or False. Host indices that do not name whole
  pages of the pool (runs of page_size consecutive slots, each from a page-aligned start) are refused whole:
  misses or False, counted in `bad_requests`, logged once per kind. A page that fails its checksum is a miss (the
  store verifies what it copied): never reported read. The user SGLang runs as must read the store's key file
  (engine pages are hashed under it): registration raises StoreAccessDenied otherwise.
- Unsupported: SGLang's v2 interface for hybrid models (`register_mem_host_pool_v2`, `batch_*_v2`), decode
  context parallelism (`dcp_size > 1`), head splitting across heterogeneous TP and host-pool layouts no kvc
  arrangement names raise EngineUnsupported when SGLang registers them, never from an I/O call.

SGLang is imported lazily and never by kvc at large: `KvcStorage` is built on first access of the module attribute
(`storage_class`), as a subclass of SGLang's `HiCacheStorage` when SGLang is installed (its backend factory checks
that) and of `SGLangL3` alone when it is not (kvc's tests run it so, through the same code).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec

from ..errors import EngineUnsupported, InvalidInput
from ..storage.api import L3Store, PageOutcome, StoreCounters, engine_hashes, engine_origins, stored
from ..storage.serving import recorded_drop
from ..types.layout import KVLayout, Shard
from ..types.namespace import Namespace
from .engine_store import open_engine_store
from .sglang_pool import ENGINE, KV_POOL, HostPages, Refusal

logger = logging.getLogger(__name__)

STORE_ENV = "KVC_STORE"  # the store location when the extra config names none
DEFAULT_NAMESPACE = "sglang"  # the kvc namespace (extra_key) of an engine's pages when the config names none
CLEARED_BY = f"{ENGINE} clear"  # DropRecord.by of the drop SGLang's storage clear (`clear`) makes
MAX_ENGINE_KEY = 64  # bytes: the longest engine key a store takes (PageOrigin.key)
# A key of lowercase hex digits is its raw bytes, up to this many (SGLang's 64-digit keys: 32 bytes). Any other key
# text (upper case, spaces, SGLang's "unified" keys with a topology suffix, longer hex) is named by a digest of it of
# MAX_ENGINE_KEY bytes, a length no hex key decodes to: one key string, one engine key (`engine_key`).
MAX_RAW_KEY = MAX_ENGINE_KEY - 1
_HEX_KEY = re.compile(f"(?:[0-9a-f]{{2}}){{1,{MAX_RAW_KEY}}}")
_KEY_PERSON = b"kvc.sglang.key"

T = TypeVar("T")


class AdapterConfig(msgspec.Struct, frozen=True):
    """What the adapter takes from SGLang's `HiCacheStorageConfig` and its extra config."""

    store: str  # kvc store location: a path (LMDB) or a URL (e.g. redis://host:6379/0)
    namespace: str  # the kvc namespace's extra_key every page of this engine lives under
    model: str  # SGLang's model name (path or id): part of every page's layout
    mla: bool  # MLA model: one latent per token, replicated across TP ranks
    writer: bool  # this rank writes (SGLang's is_storage_writer); the others answer True without writing
    shard: Shard | None  # the part of the KV this rank holds; None when one rank holds it all
    # the store backend's own open options ("kvc_store_options", e.g. {"durability": "none"} for LMDB,
    # {"timeout": 2.0} for Redis): passed to open_store as they are
    store_options: dict[str, Any] = {}


def _get(config: Any, name: str, default: Any) -> Any:
    value = getattr(config, name, default)
    return default if value is None else value


def adapter_config(storage_config: Any) -> AdapterConfig:
    """The adapter's settings from SGLang's HiCacheStorageConfig (read by attribute, so any object with its fields
    serves). InvalidInput for a missing store or model, EngineUnsupported for a setting kvc cannot serve."""
    extra = dict(_get(storage_config, "extra_config", {}) or {})
    store = str(extra.get("kvc_store") or os.environ.get(STORE_ENV, "")).strip()
    if not store:
        raise InvalidInput(f"{ENGINE}: no kvc store: set \"kvc_store\" in --hicache-storage-backend-extra-config "
                           f"or env {STORE_ENV}")
    namespace = extra.get("kvc_namespace", DEFAULT_NAMESPACE)
    if not isinstance(namespace, str) or not namespace.strip():
        raise InvalidInput(f"{ENGINE}: \"kvc_namespace\" must be a non-empty string, got {namespace!r}")
    options = extra.get("kvc_store_options", {})
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise InvalidInput(f"{ENGINE}: \"kvc_store_options\" must be an object of the store backend's open options, "
                           f"got {options!r}")
    model = str(_get(storage_config, "model_name", "")).strip()
    if not model:
        raise InvalidInput(f"{ENGINE}: the storage config names no model (model_name): a layout needs one")
    if int(_get(storage_config, "dcp_size", 1)) > 1:
        raise EngineUnsupported(ENGINE, "decode context parallelism (dcp_size > 1)")
    if bool(_get(storage_config, "should_split_heads", False)):
        raise EngineUnsupported(ENGINE, "heads split across heterogeneous TP ranks (should_split_heads)")
    mla = bool(_get(storage_config, "is_mla_model", False))
    tp_rank, tp_size = int(_get(storage_config, "tp_rank", 0)), int(_get(storage_config, "tp_size", 1))
    if mla:  # the latent is replicated across TP: every TP rank holds the same pages
        tp_rank, tp_size = 0, 1
    pp_rank, pp_size = int(_get(storage_config, "pp_rank", 0)), int(_get(storage_config, "pp_size", 1))
    cp_rank, cp_size = int(_get(storage_config, "attn_cp_rank", 0)), int(_get(storage_config, "attn_cp_size", 1))
    shard = None if tp_size == pp_size == cp_size == 1 else Shard(tp_rank, tp_size, pp_rank, pp_size, cp_rank,
                                                                   cp_size)
    writer = _get(storage_config, "is_storage_writer", None)
    if writer is None:  # SGLang's rule, for a config object without the property
        writer = not mla or int(_get(storage_config, "tp_rank", 0)) == 0
    return AdapterConfig(store=store, namespace=namespace, model=model, mla=mla, writer=bool(writer), shard=shard,
                         store_options=options)


def engine_key(key: str) -> bytes:
    """The engine key kvc stores for an SGLang page key, one to one: a key of lowercase hex digit pairs (SGLang's
    64-hex SHA-256; up to MAX_RAW_KEY bytes) is its raw bytes, as kvc has always stored it; any other text is a
    MAX_ENGINE_KEY-byte digest of it, longer than any hex key decodes to, so no two key strings share a page."""
    text = key if isinstance(key, str) else str(key)
    if _HEX_KEY.fullmatch(text):
        return bytes.fromhex(text)
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=MAX_ENGINE_KEY,
                           person=_KEY_PERSON).digest()


class AdapterStats(msgspec.Struct, frozen=True):
    """What this adapter did since it was built (pages, not calls), and its store handle's counters."""

    pages_read: int = 0  # pages copied into SGLang's buffers and reported read
    pages_missed: int = 0  # pages asked for and not read (absent, corrupt, or after a fault)
    pages_written: int = 0  # pages the store wrote new
    pages_existing: int = 0  # pages the store held already
    pages_rejected: int = 0  # pages the store refused (capacity, quota): reported False
    pages_not_writer: int = 0  # pages a non-writer rank reported True without writing (the writer rank stores them)
    read_faults: int = 0  # exists/get calls a store fault ended: their pages are misses
    write_faults: int = 0  # set calls a store fault ended (raised, or pages FAILED): their pages are reported False
    bad_requests: int = 0  # calls naming no whole pages of the pool, or made before register_mem_pool_host or after
    #                        close
    last_fault: str = ""  # the latest fault, one line (never a key or a page)
    store: StoreCounters | None = None  # the store handle's own counters (checksum failures, I/O errors, ...)


class _Bound(msgspec.Struct, frozen=True):
    """The registered host pool and the store handle opened for its layout."""

    pages: HostPages  # the pool's layout and page views
    store: L3Store  # opened under pages.layout
    chain_key: bytes  # the store's chain key (store.chain_key, checked present at registration): roots the pages
    pool: Any  # SGLang's host pool (for get_dummy_flat_data_page)


class SGLangL3:
    """SGLang's HiCacheStorage interface on a kvc store (see the module docstring). Constructed as SGLang's
    `dynamic` backend factory does: `KvcStorage(storage_config, kwargs)`."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        self.config = adapter_config(storage_config)
        self.namespace = Namespace(extra_key=self.config.namespace)
        self._lock = threading.Lock()  # guards the binding (`_bound`), the counters and `_last_fault`; never held
        #                                across a store call
        self._bound: _Bound | None = None
        self._closed = False  # `close` ran: calls are misses or False until a pool is registered again
        self._counts: dict[str, int] = dict.fromkeys(
            (f for f in AdapterStats.__struct_fields__ if f not in ("last_fault", "store")), 0)
        self._last_fault = ""
        self._refused: set[str] = set()  # kinds of bad request logged already (each is logged once)

    # -- registration ---------------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang hands over its host pool: build the layout from it and open the store under that layout
        (creating the store, registering the layout). EngineUnsupported for a pool kvc cannot hold; the store's
        own errors (a location that cannot be opened) propagate: SGLang's attach fails with them."""
        self.mem_pool_host = mem_pool_host
        pages = HostPages(mem_pool_host, self.config.model, self.config.mla, self.config.shard)
        bound = self._bound
        if bound is not None and bound.pages.layout == pages.layout:
            with self._lock:
                self._bound = _Bound(pages, bound.store, bound.chain_key, mem_pool_host)
                self._closed = False
            return
        store, chain_key = open_engine_store(self.config.store, pages.layout, self.config.store_options, ENGINE,
                                             "the engine")
        with self._lock:
            self._bound = _Bound(pages, store, chain_key, mem_pool_host)
            self._closed = False
        if bound is not None:  # SGLang attached another pool: a call still on the old handle ends as a fault
            bound.store.close()
        logger.info("kvc L3 on %s: namespace %s, layout %s", store.location, self.config.namespace,
                    pages.layout.describe())

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang registers every host pool of its pool group here, the plain KV pool of an ordinary model too
        (SGLang 0.5.23's `HybridCacheController.attach_storage_backend`): the KV pool is the one kvc holds (bound
        as `register_mem_pool_host` binds it); any other pool (mamba, SWA, ... of a hybrid model) is
        EngineUnsupported."""
        name = getattr(host_pool_name, "value", host_pool_name)  # SGLang's PoolName is a str Enum
        if name != KV_POOL:
            raise EngineUnsupported(ENGINE, f"the v2 host pool interface (hybrid models; pool {name!s})")
        bound = self._bound
        if bound is None or bound.pool is not host_pool:
            self.register_mem_pool_host(host_pool)

    def on_host_pools_registered(self) -> None:
        """Nothing to finalise: the store was opened at registration."""

    def batch_exists_v2(self, keys: Any, pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """Not supported (hybrid models): EngineUnsupported."""
        raise EngineUnsupported(ENGINE, "batch_exists_v2 (hybrid models)")

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> Any:
        """Not supported (hybrid models): EngineUnsupported."""
        raise EngineUnsupported(ENGINE, "batch_get_v2 (hybrid models)")

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> Any:
        """Not supported (hybrid models): EngineUnsupported."""
        raise EngineUnsupported(ENGINE, "batch_set_v2 (hybrid models)")

    @property
    def layout(self) -> KVLayout | None:
        """The layout of the registered host pool's pages (None before registration)."""
        bound = self._bound
        return bound.pages.layout if bound is not None else None

    @property
    def store(self) -> L3Store | None:
        """The store handle (None before registration)."""
        bound = self._bound
        return bound.store if bound is not None else None

    # -- the zero-copy interface ----------------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many pages from the start of `keys` the store holds (prefix_keys are not needed: never read)."""
        if not keys:
            return 0
        return self._run("read", 0, lambda b: b.store.exists_prefix(self._hashes(b, keys)))

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Read pages straight into the host pool at `host_indices` (page_size slots per key); True for each page
        read and verified, from the start (the first miss ends the run)."""
        n = len(keys)
        if n == 0:
            return []

        def read(b: _Bound) -> int:
            starts = b.pages.page_starts(host_indices, n, distinct=True)
            if isinstance(starts, Refusal):
                return self._bad_request("batch_get_v1: host indices that do not name whole pages of the pool",
                                         starts.reason)
            return b.store.get_into(self._hashes(b, keys), b.pages.pages(starts))

        got = self._run("read", 0, read)
        self._count(pages_read=got, pages_missed=n - got)
        return [i < got for i in range(n)]

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Write pages straight from the host pool at `host_indices`; one bool per page (False: not stored)."""
        n = len(keys)
        if n == 0:
            return []
        if not self.config.writer:
            self._count(pages_not_writer=n)
            return [True] * n

        def write(b: _Bound) -> list[bool]:
            starts = b.pages.page_starts(host_indices, n)
            if isinstance(starts, Refusal):
                self._bad_request("batch_set_v1: host indices that do not name whole pages of the pool",
                                  starts.reason)
                return [False] * n
            return self._put(b, keys, b.pages.pages(starts), extra_info)

        return self._run("write", [False] * n, write)

    # -- the generic interface ------------------------------------------------------------------------------

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
                  ) -> list[Any]:
        """Read pages into SGLang's flat page tensors (`target_locations`, one per key; a new one from the pool
        where none is given); each key's tensor, or None from the first page not read on."""
        n = len(keys)
        if n == 0:
            return []
        targets: list[Any] = list(target_locations) if target_locations is not None else [None] * n

        def read(b: _Bound) -> int:
            for i in range(n):
                if targets[i] is None:
                    targets[i] = b.pool.get_dummy_flat_data_page()
                elif not targets[i].is_contiguous():  # read into a contiguous copy, and answer with it
                    targets[i] = targets[i].contiguous()
            return b.store.get_into(self._hashes(b, keys), [[_byte_view(t)] for t in targets[:n]])

        got = self._run("read", 0, read)
        self._count(pages_read=got, pages_missed=n - got)
        return [targets[i] if i < got else None for i in range(n)]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Write SGLang's flat page tensors (`values`, one per key); True when every page is stored."""
        n = len(keys)
        if n == 0:
            return True
        if not self.config.writer:
            self._count(pages_not_writer=n)
            return True

        def write(b: _Bound) -> list[bool]:
            if values is None or len(values) != n:
                self._bad_request("batch_set: not one value per key",
                                  f"{n} keys and {0 if values is None else len(values)} values")
                return [False] * n
            return self._put(b, keys, [[_byte_view(v)] for v in values], None)

        return all(self._run("write", [False] * n, write))

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """One page (see `batch_get`): its tensor, or None."""
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """One page (see `batch_set`)."""
        return self.batch_set([key], [value])

    def exists(self, key: str) -> bool:
        """Whether the store holds the page of `key`."""
        return self.batch_exists([key]) == 1

    def clear(self) -> bool:
        """Remove every page of this engine's kvc namespace (every layout, every shard), as SGLang's storage clear
        (`POST /hicache/storage-backend/clear`) asks, with a drop record as `kvc ns drop` leaves (by CLEARED_BY):
        the store says who emptied the namespace and when. A non-writer rank removes nothing. False when the store
        fails (counted)."""
        if not self.config.writer:
            return True

        def drop(b: _Bound) -> bool:
            recorded_drop(b.store, self.namespace.id, by=CLEARED_BY)
            return True

        return self._run("write", False, drop)

    def close(self) -> None:
        """Flush and close the store handle (SGLang calls it when an attach fails or the backend is detached). Safe
        while SGLang's other threads are in a call: the handle's close waits for the reads and writes in flight,
        and a call that reaches the store after it is a miss or False, never an exception."""
        with self._lock:
            bound, self._bound = self._bound, None
            self._closed = True
        if bound is not None:
            bound.store.close()

    # -- counters -------------------------------------------------------------------------------------------

    def kvc_stats(self) -> AdapterStats:
        """This adapter's counters and its store handle's."""
        with self._lock:
            counts, last = dict(self._counts), self._last_fault
            store = self._bound.store if self._bound is not None else None
        try:
            counters = store.stats().counters if store is not None else None
        except Exception as exc:  # a store gone away: the adapter's own counts still answer
            logger.warning("kvc L3: store stats unavailable: %s", exc)
            counters = None
        return AdapterStats(**counts, last_fault=last, store=counters)

    def get_stats(self) -> Any:
        """The counters (`kvc_stats`). The class built with SGLang present returns SGLang's StorageMetrics
        instead, with these counters as its `kvc` attribute (SGLang's metrics collector accepts nothing else)."""
        return self.kvc_stats()

    # -- internals ------------------------------------------------------------------------------------------

    def _hashes(self, b: _Bound, keys: Sequence[str]) -> list[Any]:
        return engine_hashes(b.pages.layout, self.namespace, b.chain_key, [engine_key(k) for k in keys])

    def _put(self, b: _Bound, keys: Sequence[str], pages: list[Any], extra_info: Any) -> list[bool]:
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        parent = engine_key(prefix[-1]) if prefix else None
        hashes, origins = engine_origins(b.pages.layout, self.namespace, b.chain_key,
                                         [engine_key(k) for k in keys], parent)
        result = b.store.put(hashes, pages, origins)
        outcomes = list(result.outcomes)
        if len(outcomes) != len(keys):  # a backend that does not report per page: all or nothing by its counts
            outcomes = [PageOutcome.REJECTED if result.rejected else PageOutcome.WRITTEN] * len(keys)
        self._count(pages_written=result.written, pages_existing=result.existing, pages_rejected=result.rejected,
                    write_faults=1 if result.failed else 0)  # a batch the store could not write: a fault
        return [stored(o) for o in outcomes]

    def _run(self, kind: str, failed: T, body: Callable[[_Bound], T]) -> T:
        """`body(bound)`; a store fault (any exception: SGLang's threads must not see one) is counted as a `kind`
        fault and answers `failed`."""
        bound = self._bound
        if bound is None:
            self._bad_request("a call after close" if self._closed else "a call before register_mem_pool_host")
            return failed
        try:
            return body(bound)
        except Exception as exc:
            fault = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            with self._lock:
                self._counts[f"{kind}_faults"] += 1
                new, self._last_fault = fault != self._last_fault, fault
            # a store gone away fails every call alike: say so once per new fault, not once per call
            logger.log(logging.WARNING if new else logging.DEBUG, "kvc L3 %s fault, served as %s: %s", kind,
                       "misses" if kind == "read" else "False", fault)
            return failed

    def _bad_request(self, kind: str, detail: str = "") -> int:
        """Count a call refused as `kind`; it is logged the first time only (SGLang repeats a bad call at its
        step rate: the counter says how often)."""
        why = f"{kind} ({detail})" if detail else kind
        with self._lock:
            self._counts["bad_requests"] += 1
            self._last_fault = why
            first = kind not in self._refused
            self._refused.add(kind)
        logger.log(logging.WARNING if first else logging.DEBUG, "kvc L3: %s%s", why,
                   "; counted in bad_requests, logged once" if first else "")
        return 0

    def _count(self, **delta: int) -> None:
        with self._lock:
            for name, value in delta.items():
                self._counts[name] += value


def _byte_view(tensor: Any) -> Any:
    """A flat page tensor as a uint8 numpy view of its memory (of a contiguous copy when it is not contiguous: a
    page to write; `batch_get` makes its targets contiguous first)."""
    import torch  # here: see sglang_pool

    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    raw = tensor if tensor.dtype == torch.uint8 else tensor.view(torch.uint8)
    return raw.reshape(-1).numpy()


# -- KvcStorage: built on first access, on SGLang's HiCacheStorage when it is installed --------------------------

_class_lock = threading.Lock()
_storage_class: type[SGLangL3] | None = None


def _sglang_get_stats(self: SGLangL3) -> Any:
    """SGLang's StorageMetrics (all its collector accepts), with the adapter's counters as `kvc`."""
    from sglang.srt.observability.metrics_collector import StorageMetrics

    metrics = StorageMetrics()
    metrics.kvc = self.kvc_stats()
    return metrics


def storage_class() -> type[SGLangL3]:
    """The class SGLang loads as `kvcache.engines.sglang.KvcStorage`: a subclass of SGLang's `HiCacheStorage`
    (and of `SGLangL3`) when SGLang is installed, of `SGLangL3` alone when it is not. Built once, on first use."""
    global _storage_class
    with _class_lock:
        if _storage_class is None:
            try:
                from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
            except ModuleNotFoundError as exc:
                if not (exc.name or "").startswith("sglang"):
                    raise  # SGLang is there but broken: say so, do not run without it
                bases: tuple[type, ...] = (SGLangL3,)
                body: dict[str, Any] = {}
            else:
                bases = (SGLangL3, HiCacheStorage)
                body = {"get_stats": _sglang_get_stats}
            body.update(__doc__=SGLangL3.__doc__, __module__=__name__, __qualname__="KvcStorage")
            _storage_class = type("KvcStorage", bases, body)
        return _storage_class


def __getattr__(name: str) -> type[SGLangL3]:
    if name == "KvcStorage":
        return storage_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
