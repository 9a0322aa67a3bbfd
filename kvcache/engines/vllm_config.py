"""The settings of kvc's vLLM tier (`kvcache.engines.vllm`): the keys of its tier config besides vLLM's own,
checked in one place before anything is opened.

- `kvc_store`: a kvc store location (a path: LMDB; `redis://...`: the Redis plugin), default env KVC_STORE;
  `kvc_store_options`: the backend's own open options, passed as they are;
- `kvc_namespace` (default "vllm"): the kvc namespace every chunk of the deployment lives under;
- `kvc_io_threads` (default 2): the threads the tier's I/O runs on (`vllm_io`);
- `kvc_lookup`: how a lookup finds out whether the store holds a key (`LookupMode`; "auto": sync for a path, async
  for a URL);
- `kvc_load_timeout_s` (default 10; 0: none): how long a promotion may copy before it is reported failed;
- `enable_kv_events` and `locality`, as for vLLM's own tiers.

A setting that is wrong is one InvalidInput naming it, raised when vLLM builds the tier, never from an I/O call.
"""

from __future__ import annotations

import enum
import math
import os
from typing import Any

import msgspec

from ..errors import InvalidInput
from ..storage.location import StoreLocation

STORE_ENV = "KVC_STORE"  # the store location when the tier config names none
DEFAULT_NAMESPACE = "vllm"  # the kvc namespace (extra_key) of a deployment's chunks when the config names none
TIER_TYPE = "KvcTier"  # the tier config's "type" (the class name vLLM's factory looks up in kvcache.engines.vllm)


class LookupMode(str, enum.Enum):
    """How `lookup` finds out whether the store holds a key it has no verdict for."""

    AUTO = "auto"  # SYNC for a store at a path (LMDB), ASYNC for a URL (a server)
    SYNC = "sync"  # ask the store on the calling thread (a lookup in mapped memory)
    ASYNC = "async"  # answer RETRY and probe on an I/O thread (no network round trip on vLLM's scheduler thread)


class TierConfig(msgspec.Struct, frozen=True):
    """The tier's settings, from the tier config's keys (see the module docstring)."""

    store: str  # kvc store location (path or URL)
    namespace: str  # extra_key of the kvc namespace the chunks live under
    store_options: dict[str, Any]  # the backend's own open options, passed as they are
    io_threads: int  # I/O threads, >= 1
    lookup: LookupMode  # SYNC or ASYNC (AUTO resolved)
    load_timeout_s: float  # seconds a promotion may copy before it is reported failed; inf: no limit
    kv_events: bool  # report stored and evicted chunks through take_events
    locality: str | None  # vLLM's Locality value ("LOCAL"/"REMOTE") for the events, or None


SETTINGS = ("kvc_store", "kvc_namespace", "kvc_store_options", "kvc_io_threads", "kvc_lookup", "kvc_load_timeout_s",
            "enable_kv_events", "locality")


def tier_config(settings: dict[str, Any]) -> TierConfig:
    """Validate the tier config's keys (everything vLLM's factory passes besides its own): InvalidInput naming
    the first that is wrong, before anything is opened."""
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise InvalidInput(f"{TIER_TYPE}: unknown settings {unknown} (it takes {', '.join(SETTINGS)})")
    store = str(settings.get("kvc_store") or os.environ.get(STORE_ENV, "")).strip()
    if not store:
        raise InvalidInput(f"{TIER_TYPE}: no kvc store: set \"kvc_store\" in the tier config or env {STORE_ENV}")
    namespace = settings.get("kvc_namespace", DEFAULT_NAMESPACE)
    if not isinstance(namespace, str) or not namespace.strip():
        raise InvalidInput(f"{TIER_TYPE}: \"kvc_namespace\" must be a non-empty string, got {namespace!r}")
    options = settings.get("kvc_store_options") or {}
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise InvalidInput(f"{TIER_TYPE}: \"kvc_store_options\" must be an object of the store backend's open "
                           f"options, got {options!r}")
    threads = settings.get("kvc_io_threads", 2)
    if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= 64:
        raise InvalidInput(f"{TIER_TYPE}: \"kvc_io_threads\" must be an integer from 1 to 64, got {threads!r}")
    try:
        mode = LookupMode(settings.get("kvc_lookup", LookupMode.AUTO.value))
    except ValueError:
        raise InvalidInput(f"{TIER_TYPE}: \"kvc_lookup\" must be one of {[m.value for m in LookupMode]}, got "
                           f"{settings.get('kvc_lookup')!r}") from None
    if mode is LookupMode.AUTO:
        mode = LookupMode.ASYNC if StoreLocation(store).is_url else LookupMode.SYNC
    timeout = settings.get("kvc_load_timeout_s", 10.0)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 <= timeout < math.inf:
        raise InvalidInput(f"{TIER_TYPE}: \"kvc_load_timeout_s\" must be a finite number of seconds >= 0 (0: no "
                           f"limit), got {timeout!r}")
    locality = settings.get("locality")
    if locality is not None and locality not in ("LOCAL", "REMOTE"):
        raise InvalidInput(f"{TIER_TYPE}: \"locality\" must be LOCAL or REMOTE, got {locality!r}")
    return TierConfig(store=store, namespace=namespace, store_options=options, io_threads=threads, lookup=mode,
                      load_timeout_s=float(timeout) or math.inf, kv_events=bool(settings.get("enable_kv_events")),
                      locality=locality)
