"""What kvc's vLLM tier answers vLLM in (`Vocabulary`): vLLM's own types when the tier is built on vLLM
(`kvcache.engines.vllm.tier_class`), kvc's stand-ins for them when it is not (`STAND_INS`: `Lookup`, `JobReport`,
`TierEvent`, `RequestPolicy`), which is how kvc's tests drive the tier without vLLM installed.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from typing import Any

import msgspec

OWNERSHIP = "kvc"  # the events' `ownership`: which offloading tier says a chunk is stored or removed (vLLM's routers
#                    count a block's residency per medium and owner)


class Lookup(enum.Enum):
    """kvc's stand-in for vLLM's `LookupResult` (the values a tier returns)."""

    MISS = "miss"
    HIT = "hit"
    RETRY = "retry"


class JobReport(msgspec.Struct, frozen=True):
    """kvc's stand-in for vLLM's `JobResult`: the same fields, in the same order."""

    job_id: int
    success: bool  # every key succeeded
    successful_keys: tuple[bytes, ...] | None = None  # a failed promotion's keys that did load; None: none did
    transfer_time: float | None = None  # seconds of I/O
    transfer_bytes: int | None = None  # payload bytes moved
    deferred_release: threading.Event | None = None  # set when the I/O of a failed promotion can no longer write


class TierEvent(msgspec.Struct, frozen=True):
    """kvc's stand-in for vLLM's `OffloadingEvent` as a tier makes it."""

    keys: list[bytes]
    medium: str  # "STORAGE"
    removed: bool  # True: the store no longer holds the keys; False: it stored them
    locality: str | None = None
    ownership: str | None = None  # OWNERSHIP
    req_context: Any = None


class RequestPolicy(msgspec.Struct, frozen=True):
    """kvc's stand-in for vLLM's `RequestOffloadingContext`: chunk-level offloading (the default)."""

    policy: str = "chunk_level"


class Vocabulary(msgspec.Struct, frozen=True):
    """The values and types a tier answers vLLM in."""

    hit: Any
    miss: Any
    retry: Any
    job_result: Callable[..., Any]  # JobResult(job_id, success, successful_keys, transfer_time, transfer_bytes,
    #                                 deferred_release)
    event: Callable[..., Any]  # OffloadingEvent(keys=, medium=, removed=, locality=, ownership=, req_context=)
    request_context: Callable[[], Any]  # RequestOffloadingContext()
    medium: Any  # Medium.STORAGE
    locality: Callable[[str], Any]  # "LOCAL"/"REMOTE" -> Locality


STAND_INS = Vocabulary(Lookup.HIT, Lookup.MISS, Lookup.RETRY, JobReport, TierEvent, RequestPolicy, "STORAGE", str)
