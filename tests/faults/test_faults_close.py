"""Handles that close safely (issue 36, item 3): a store handle closed while other threads read and write through
it, through the store API and through SGLang's `KvcStorage`, on LMDB and on Redis.

The repro: the last handle's close unmapped LMDB's map under a reader's copy (SIGSEGV, the engine process gone);
Redis' close dropped the connections under calls in flight (AttributeError out of `get_into`, `put`). Now a close
waits for the calls in flight on other threads, and a call after it is StoreClosed (the store API) or a miss or
False (SGLang's interface).

The load runs in a child process (close_load.py, forked from a server that imported what it imports: `forkrun`),
so a crash is a failed test with its signal, not a dead pytest worker. Its size: CI_ROUNDS per row in `make test`
(seconds); `KVC_FAULTS=long` (or `--long`) runs ten times as many, well over 10,000 calls in all.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis

import faultkit
import forkrun
from kvcache.errors import StoreClosed
from kvcache.storage.api import engine_origins
from kvcache.storage.registry import open_store
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace
from redis_server import RedisServer, require_server

ROOT = Path(__file__).resolve().parents[2]
LOAD = Path(__file__).with_name("close_load.py")
DEADLINE_S = 60.0  # how long a state below may take to come about on a loaded machine: a hang, not a slow run
# (backend, via) -> rounds in `make test`; LMDB's pages are 1 MiB (copied with the GIL released: the copy most
# exposed to an unmapping close), Redis' 64 KiB
LOAD_MODULES = ("torch", "numpy", "redis", "kvcache.engines.sglang", "kvcache.engines.sglang_pool",
                "kvcache.storage.registry", "kvcache.storage.lmdb.store", "kvcache_redis.store",
                "unit.engines.fake_sglang")
CI_ROUNDS = {("lmdb", "store"): 20, ("lmdb", "sglang"): 30, ("redis", "store"): 10, ("redis", "sglang"): 10}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A redis-server of this module's own (a test pauses its clients); every test uses a key prefix of its own."""
    srv = RedisServer(require_server(), tmp_path_factory.mktemp("redis-close")).start()
    yield srv
    srv.stop()


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins" / "kvcache_redis"),
                                                         str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def load_forks():
    """A server that imported what close_load.py imports (torch, the SGLang adapter and stand-ins, both backends),
    to fork each load process from (`forkrun`: a process of its own, without a Python start and those imports)."""
    server = forkrun.Forks(LOAD_MODULES, env=_env())
    yield server
    server.close()


def _load(forks: forkrun.Forks, location: str, via: str, rounds: int, seed: int, big: bool) -> dict:
    config = {"location": location, "via": via, "rounds": rounds, "seed": seed, "big": big}
    out = forks.run([json.dumps(config)], script_file=str(LOAD), env=_env(), timeout=60 + 20 * rounds)
    if out.returncode < 0:
        pytest.fail(f"the process closing handles under load died of {signal.Signals(-out.returncode).name} "
                    f"({via}, {rounds} rounds, seed {seed}); stderr: {out.stderr[-1500:]}")
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("backend", "via"), sorted(CI_ROUNDS))
def test_closing_handles_under_reading_and_writing_threads_never_crashes(tmp_path, server, load_forks, backend,
                                                                         via):
    rounds = faultkit.trials(CI_ROUNDS[backend, via])
    location = str(tmp_path / "store") if backend == "lmdb" else server.store_url()
    result = _load(load_forks, location, via, rounds, seed=sorted(CI_ROUNDS).index((backend, via)),
                   big=backend == "lmdb")
    stray, wrong = result["stray"], result["wrong"]
    faultkit.record(f"close under load: {backend}, {via}", result["calls"], result["calls"] - len(stray), wrong,
                    f"{rounds} closes; {result['served']} pages served and checked; errors {result['errors']}")
    assert stray == [] and wrong == 0, result
    assert result["served"] > 0 and result["calls"] >= 10 * rounds
    if via == "store":  # every round's threads ran into its close: each stopped at a StoreClosed, nothing else
        assert set(result["errors"]) == {"StoreClosed"}, result["errors"]
    else:  # SGLang's threads never see an exception; the faults the adapter served were closes only
        assert set(result["errors"]) <= {"adapter: StoreClosed"}, result["errors"]


# -- Redis: a close waits for a call in flight (deterministic) ---------------------------------------------------

LAYOUT = KVLayout(model="close@r1", layers=1, kv_heads=2, head_dim=64, dtype="float16", page_size=16)


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"still not: {what}"
        time.sleep(0.002)


def test_a_redis_close_waits_for_a_write_in_flight_and_later_calls_are_store_closed(server):
    # The server holds the write: CLIENT PAUSE WRITE blocks every script (a put) and lets reads and admin in.
    url = server.store_url() + "&timeout=120"  # the held write must not time out while the test holds it
    store = open_store(url, LAYOUT, create=True)
    keys = [os.urandom(32) for _ in range(4)]
    hashes, origins = engine_origins(LAYOUT, Namespace(extra_key="t"), store.chain_key, keys, None)
    pages = [np.full(LAYOUT.bytes_per_page, i + 1, np.uint8) for i in range(4)]
    admin = redis.Redis(host="127.0.0.1", port=server.port)
    outcome: list = []
    closed = threading.Event()
    admin.execute_command("CLIENT", "PAUSE", 600_000, "WRITE")
    try:
        writer = threading.Thread(target=lambda: outcome.append(store.put(hashes, pages, origins)))
        writer.start()
        _wait_until(lambda: any("b" in c["flags"] and c["cmd"] in ("evalsha", "eval")
                                for c in admin.client_list()), "the put is held by the server")
        closing = threading.Thread(target=lambda: (store.close(), closed.set()))
        closing.start()

        def refused() -> bool:
            try:
                store.exists_prefix(hashes[:1])
            except StoreClosed:
                return True
            return False

        _wait_until(lambda: closed.is_set() or refused(), "the close began")
        assert not closed.is_set(), "the close returned while a write was in flight"
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
    writer.join()
    closing.join()
    assert closed.is_set() and outcome and outcome[0].written == 4  # the write ended as it would have: stored
    with pytest.raises(StoreClosed):
        store.get_into(hashes, [memoryview(bytearray(LAYOUT.bytes_per_page)) for _ in hashes])
    with open_store(url, LAYOUT) as again:
        outs = [memoryview(bytearray(LAYOUT.bytes_per_page)) for _ in hashes]
        assert again.get_into(hashes, outs) == 4
        assert [bytes(o) for o in outs] == [p.tobytes() for p in pages]
    admin.close()
