"""A process that closes store handles under reading and writing threads (issue 36, item 3), run by
test_faults_close.py as a child so a crash (SIGSEGV, SIGBUS) is a failed test, not a dead pytest worker.

    python close_load.py '{"location": ..., "via": "store" | "sglang", "rounds": N, "seed": S,
                           "big": true}'

Each round opens a handle (the store API: `open_store`; SGLang: a `KvcStorage` registered on a host pool), starts
reader and writer threads that call it without pause, closes it once every thread has made its first call and the
round's random share of calls is done, and lets the threads run into the close. What a call may do:

- store API: return (every page it reports read holds exactly the bytes written under its key), or raise a kvc
  error (StoreClosed once the close began; the thread then stops). Any other exception is `stray`.
- SGLang: return misses or False, never raise (the adapter's promise to SGLang's threads), and every store fault
  the adapter served so is a kvc error (StoreClosed), never an exception of a connection or map dropped under the
  call (`AdapterFaults`). It is closed by SGLang's detach (`close`: the last handle, so LMDB's map is unmapped) or by a re-attach of another pool (the old
  handle closed under the calls still on it).

`big`: pages of 1 MiB, which LMDB copies with the GIL released: the copy most exposed to an unmapping close.
Prints one JSON line: calls made, pages served (each checked byte for byte), kvc errors by class, stray
exceptions (text), wrong pages. The exit status is 0 unless the process dies.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import sys
import threading
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the SGLang stand-ins

from kvcache import errors  # noqa: E402
from kvcache.engines.sglang import KvcStorage  # noqa: E402
from kvcache.engines.sglang_pool import HostPages  # noqa: E402
from kvcache.errors import KVCacheError  # noqa: E402
from kvcache.storage.api import engine_origins  # noqa: E402
from kvcache.storage.registry import open_store  # noqa: E402
from kvcache.types.layout import KVLayout  # noqa: E402
from kvcache.types.namespace import Namespace  # noqa: E402
from unit.engines.fake_sglang import FakeMHAHostPool, FakeStorageConfig  # noqa: E402

READERS, WRITERS = 3, 1
KEYS = 12  # page keys of the run: readers read them, writers write some of them again
BATCH = 3  # pages per call
SPAN = 4 * KEYS  # calls per thread per round at most (the close ends a round long before, as a rule)
AFTER_CLOSE = 2  # calls a thread makes once the close returned (misses, False), then it stops
REGION = 4  # host pages of each SGLang prefetch thread (BATCH of them used)
WRITER_PAGES = READERS * REGION  # the first host page the SGLang backup thread writes from
POOL_PAGES = WRITER_PAGES + REGION
NAMESPACE = Namespace(extra_key="sglang")  # the adapter's default: both ways store the same pages


def page_bytes(key: int, nbytes: int) -> np.ndarray:
    """The page stored under key number `key`: its number in the first 8 bytes, then a byte of its own."""
    page = np.full(nbytes, key * 37 % 251, np.uint8)
    page[:8] = np.frombuffer(key.to_bytes(8, "little"), np.uint8)
    return page


def sglang_key(key: int) -> str:
    """SGLang's page key of key number `key` (64 lowercase hex digits)."""
    return hashlib.sha256(f"close-load-{key}".encode()).hexdigest()


class Tally:
    """What the threads of a run saw, under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls = 0
        self.served = 0  # pages reported read, each checked byte for byte
        self.errors: Counter[str] = Counter()  # kvc errors raised, by class
        self.stray: list[str] = []  # what may not happen (the first few, as text)
        self.wrong = 0  # pages reported read whose bytes are not their key's

    def add(self, served: int = 0, wrong: int = 0) -> None:
        with self.lock:
            self.calls += 1
            self.served += served
            self.wrong += wrong

    def raised(self, exc: BaseException, allowed: bool) -> None:
        with self.lock:
            self.calls += 1
            if allowed:
                self.errors[type(exc).__name__] += 1
            elif len(self.stray) < 5:
                self.stray.append("".join(traceback.format_exception_only(type(exc), exc)).strip()[:300])


def store_round(location: str, layout: KVLayout, rng: random.Random, tally: Tally) -> None:
    """One round through the store API: readers (get_into; every fourth call exists_prefix) and a writer (put) on
    one handle."""
    store = open_store(location, layout)
    keys = [bytes.fromhex(sglang_key(k)) for k in range(KEYS)]
    hashes, origins = engine_origins(layout, NAMESPACE, store.chain_key, keys, None)
    pages = [page_bytes(k, layout.bytes_per_page) for k in range(KEYS)]

    def read(me: int, call: int) -> None:
        first = (me * 5 + call) % (KEYS - BATCH)
        if call % 4 == 3:
            store.exists_prefix(hashes[first:first + BATCH])
            tally.add()
            return
        outs = [memoryview(bytearray(layout.bytes_per_page)) for _ in range(BATCH)]
        got = store.get_into(hashes[first:first + BATCH], outs)
        tally.add(served=got, wrong=sum(not np.array_equal(np.frombuffer(outs[i], np.uint8), pages[first + i])
                                        for i in range(got)))

    def write(me: int, call: int) -> None:
        first = call % (KEYS - BATCH)
        store.put(hashes[first:first + BATCH], pages[first:first + BATCH], origins[first:first + BATCH])
        tally.add()

    run_round(store.close, [read] * READERS + [write] * WRITERS, rng, tally, kvc_errors_allowed=True)


def sglang_round(location: str, pools: list[FakeMHAHostPool], rng: random.Random, tally: Tally) -> None:
    """One round through SGLang's interface: prefetch threads (batch_get_v1; every fourth call batch_exists) and
    a backup thread (batch_set_v1) on one KvcStorage bound to pools[0]; closed by SGLang's detach (3 rounds in 4)
    or by a re-attach of pools[1] (later calls land there)."""
    ps = pools[0].page_size
    backend = KvcStorage(FakeStorageConfig(extra_config={"kvc_store": location}), {})
    backend.register_mem_pool_host(pools[0])
    keys = [sglang_key(k) for k in range(KEYS)]
    pages = [page_bytes(k, page_nbytes(pools[0])) for k in range(KEYS)]
    views = [HostPages(p, "check", False, None) for p in pools]

    def slots(first_page: int) -> torch.Tensor:
        return torch.arange(first_page * ps, (first_page + BATCH) * ps, dtype=torch.int64)

    def read(me: int, call: int) -> None:
        first = (me * 5 + call) % (KEYS - BATCH)
        if call % 4 == 3:
            backend.batch_exists(keys[first:first + BATCH])
            tally.add()
            return
        at = me * REGION  # this thread's pages, in whichever pool the call lands in
        for pool in pools:  # layer_first: a page's slots are [:, :, its tokens]
            pool.kv_buffer[:, :, at * ps:(at + BATCH) * ps] = 0
        served = sum(backend.batch_get_v1(keys[first:first + BATCH], slots(at)))
        wrong = 0
        for i in range(served):  # compared in place: the page's view into each pool, in the page's byte order
            want = pages[first + i]
            wrong += not any(np.array_equal(v, want.reshape(v.shape)) for v in (h.page((at + i) * ps) for h in views))
        tally.add(served=served, wrong=wrong)

    def write(me: int, call: int) -> None:
        backend.batch_set_v1(keys[:BATCH], slots(WRITER_PAGES))  # the pages of keys 0..BATCH-1 again (`main`)
        tally.add()

    # SGLang's detach closes the last handle (LMDB's map is unmapped); a re-attach opens the new one first
    close = backend.close if rng.random() < 0.75 else (lambda: backend.register_mem_pool_host(pools[1]))
    run_round(close, [read] * READERS + [write] * WRITERS, rng, tally, kvc_errors_allowed=False)
    backend.close()


class AdapterFaults(logging.Handler):
    """The store faults the adapter turned into misses or False (its log, every level): each must be a kvc error
    (StoreClosed, when a close raced the call), never an exception of something closed under the call."""

    def __init__(self, tally: Tally) -> None:
        super().__init__(logging.DEBUG)
        self.tally = tally

    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith("kvc L3 %s fault"):
            return
        fault = str(record.args[-1]) if isinstance(record.args, tuple) else ""
        kind = getattr(errors, fault.partition(":")[0], None)
        if isinstance(kind, type) and issubclass(kind, errors.KVCacheError):
            with self.tally.lock:
                self.tally.errors[f"adapter: {kind.__name__}"] += 1
        else:
            with self.tally.lock:
                if len(self.tally.stray) < 5:
                    self.tally.stray.append(f"the adapter met a fault that is no kvc error: {fault}"[:300])


def page_nbytes(pool: FakeMHAHostPool) -> int:
    """Bytes of one page of an SGLang host pool."""
    return pool.get_data_page(0).numel() * pool.kv_buffer.element_size()


def run_round(close: Callable[[], None], workers: list[Callable[[int, int], None]], rng: random.Random,
              tally: Tally, kvc_errors_allowed: bool) -> None:
    """Start `workers` (each `fn(me, call)` per call), close once each made its first call and the round's share
    of calls is done, and let them run into the close: a thread stops at its first exception, AFTER_CLOSE calls
    after the close returned, or after SPAN calls."""
    started, made, closed = threading.Semaphore(0), threading.Semaphore(0), threading.Event()
    calls_before_close = rng.randrange(len(workers), 4 * len(workers))

    def work(me: int, fn: Callable[[int, int], None]) -> None:
        after = 0
        for call in range(SPAN):
            try:
                fn(me, call)
            except BaseException as exc:  # judged by `raised`; the thread stops either way
                tally.raised(exc, allowed=kvc_errors_allowed and isinstance(exc, KVCacheError))
                break
            finally:
                if call == 0:
                    started.release()
                made.release()
            after += closed.is_set()
            if after > AFTER_CLOSE:
                break

    threads = [threading.Thread(target=work, args=(i, fn), daemon=True) for i, fn in enumerate(workers)]
    for t in threads:
        t.start()
    for _ in threads:
        started.acquire()
    for _ in range(calls_before_close):
        made.acquire()
    close()
    closed.set()
    for t in threads:
        t.join()


def main() -> None:
    config = json.loads(sys.argv[1])
    rng = random.Random(config["seed"])
    location, rounds, big = config["location"], config["rounds"], config.get("big", False)
    tally = Tally()
    if config["via"] == "store":
        layout = KVLayout(model="close-load", layers=2, kv_heads=2, head_dim=128, dtype="float16",
                          page_size=1024 if big else 64)
        with open_store(location, layout, create=True) as store:
            keys = [bytes.fromhex(sglang_key(k)) for k in range(KEYS)]
            hashes, origins = engine_origins(layout, NAMESPACE, store.chain_key, keys, None)
            store.put(hashes, [page_bytes(k, layout.bytes_per_page) for k in range(KEYS)], origins)
        for _ in range(rounds):
            store_round(location, layout, rng, tally)
    else:
        adapter_log = logging.getLogger("kvcache.engines.sglang")
        adapter_log.setLevel(logging.DEBUG)
        adapter_log.addHandler(AdapterFaults(tally))
        adapter_log.propagate = False
        page_size = 256 if big else 16  # 256 tokens: 1 MiB pages
        pools = [FakeMHAHostPool("layer_first", page_size, pages=POOL_PAGES, layers=4, heads=4, head_dim=64)
                 for _ in range(2)]
        nbytes = page_nbytes(pools[0])

        def put_page(pool: FakeMHAHostPool, page: int, key: int) -> None:
            pool.set_from_flat_data_page(page * page_size, torch.from_numpy(page_bytes(key, nbytes)).view(pool.dtype))

        writer = KvcStorage(FakeStorageConfig(extra_config={"kvc_store": location}), {})
        writer.register_mem_pool_host(pools[0])
        staging = torch.arange(WRITER_PAGES * page_size, (WRITER_PAGES + 1) * page_size)
        for k in range(KEYS):  # every key's page, written through the adapter
            put_page(pools[0], WRITER_PAGES, k)
            assert writer.batch_set_v1([sglang_key(k)], staging) == [True]
        writer.close()
        for pool in pools:  # the backup threads write keys 0..BATCH-1 again, from these pages of either pool
            for k in range(BATCH):
                put_page(pool, WRITER_PAGES + k, k)
        for _ in range(rounds):
            sglang_round(location, pools, rng, tally)
    print(json.dumps({"calls": tally.calls, "served": tally.served, "errors": dict(tally.errors),
                      "stray": tally.stray, "wrong": tally.wrong}), flush=True)


if __name__ == "__main__":
    main()
