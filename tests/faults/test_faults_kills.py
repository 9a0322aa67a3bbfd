"""kill -9 trials (issue 14): a writer of batched puts, `kvc replay` and `kvc serve` (during a live replay),
each killed at a random moment; afterwards the store verifies clean and every stored page reads back byte-exact
(its synthetic KV, recomputed from its page hash). For puts, every acknowledged batch is there and the batch in
flight is all or nothing. A killed server leaves a stale socket that the next `kvc serve` takes over."""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import threading
import time
from pathlib import Path

import faultkit
import storecheck
from kvcache import WorkloadSpec, generate, write_trace
from kvcache.live.client import AdminClient
from kvcache.live.protocol import PingRequest, ReplayOutcome, ServerInfo
from kvcache.storage.registry import open_store
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace

LAYOUT = KVLayout("kill-model@r1", layers=2, kv_heads=2, head_dim=32, dtype="float16", page_size=4)  # 1 KiB pages
SPEC = WorkloadSpec(requests=3000, tenants=3, documents=4, seed=14)


def _l3_crash():
    """tests/integration/test_l3_crash.py: its kill-and-check rounds of a put loop are this suite's put trial."""
    spec = importlib.util.spec_from_file_location("l3_crash", Path(__file__).parents[1] / "integration" /
                                                  "test_l3_crash.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kill_9_of_a_writer_loses_no_acknowledged_batch(tmp_path, capsys):
    trials = faultkit.trials(10)
    _l3_crash().check_kills(str(tmp_path / "store"), trials, seed=1414)  # asserts every round
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    faultkit.record("kill -9 of a writer mid-put", trials, trials, 0,
                    f"every acknowledged batch read back exact, the one in flight whole or absent ({summary})")


def _trace(tmp_path) -> tuple[str, list[Namespace]]:
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, generate(SPEC))
    return str(trace), [Namespace(*SPEC.tenant(t)) for t in range(SPEC.tenants)]


def _check_store(path: str, namespaces: list[Namespace]) -> tuple[bool, storecheck.Reread]:
    with open_store(path, readonly=True) as store:
        clean = store.verify().ok
    return clean, storecheck.reread(path, LAYOUT, namespaces)


def test_kill_9_of_kvc_replay_leaves_every_stored_page_exact(tmp_path, engine_forks):
    path = str(tmp_path / "store")
    open_store(path, LAYOUT, create=True).close()
    trace, namespaces = _trace(tmp_path)
    rng = random.Random(2828)
    trials = faultkit.trials(3)
    survived = lost = 0
    stored: list[int] = []
    for _ in range(trials):
        err = str(tmp_path / "replay.err")
        proc = engine_forks.start(["replay", trace, "--store", path, "--device-tokens", "2048", "--host-tokens",
                                   "4096"], env=os.environ, stdout=os.devnull, stderr=err)
        deadline = time.monotonic() + 60
        start = os.path.getsize(os.path.join(path, "data.mdb"))
        while os.path.getsize(os.path.join(path, "data.mdb")) == start:  # writing has begun
            assert proc.poll() is None, Path(err).read_text()
            assert time.monotonic() < deadline, "the replay never wrote"
            time.sleep(0.02)
        time.sleep(rng.uniform(0, 0.5))
        running = proc.poll() is None
        proc.kill()
        proc.wait()
        clean, seen = _check_store(path, namespaces)
        ok = running and clean and seen.wrong == 0 and seen.read == seen.pages
        stored.append(seen.pages)
        survived += ok
        lost += seen.wrong + seen.pages - seen.read
        assert ok, (running, clean, seen.pages, seen.read, seen.wrong)
    faultkit.record("kill -9 of `kvc replay` mid-run", trials, survived, lost,
                    f"pages stored after each kill: {stored}, all re-read byte-exact")


def test_kill_9_of_kvc_serve_during_a_live_replay(tmp_path, engine_forks):
    path = str(tmp_path / "store")
    open_store(path, LAYOUT, create=True).close()
    trace, namespaces = _trace(tmp_path)
    sock = str(tmp_path / "s.sock")
    rng = random.Random(4242)
    trials = faultkit.trials(2)
    survived = lost = 0
    for _ in range(trials):
        # ready (a stale socket was taken over), else an AssertionError
        server = faultkit.Serve(path, sock, "--device-tokens", 2048, "--host-tokens", 4096, forks=engine_forks)
        errors: list[BaseException] = []

        def replay(errors: list[BaseException] = errors) -> None:  # this trial's list, even past a join timeout
            try:
                with AdminClient(sock, timeout=120) as c:
                    c.replay(trace, ReplayOutcome, timeout=120)
            except BaseException as exc:  # the server is killed under it: an AdminError is expected
                errors.append(exc)

        client = threading.Thread(target=replay)
        client.start()
        start = os.path.getsize(os.path.join(path, "data.mdb"))
        deadline = time.monotonic() + 60
        while os.path.getsize(os.path.join(path, "data.mdb")) == start and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(rng.uniform(0, 0.5))
        running = server.proc.poll() is None
        server.stop(signal.SIGKILL)
        client.join(60)
        clean, seen = _check_store(path, namespaces)
        ok = running and clean and seen.wrong == 0 and seen.read == seen.pages and bool(errors)
        survived += ok
        lost += seen.wrong + seen.pages - seen.read
        assert ok, (running, clean, seen.pages, seen.read, seen.wrong, errors)
    again = faultkit.Serve(path, sock, forks=engine_forks)  # it took over the stale socket, else AssertionError
    try:
        with AdminClient(sock) as c:
            assert c.call(PingRequest(), ServerInfo).pid == again.proc.pid
    finally:
        assert again.stop(signal.SIGTERM) == 0
    faultkit.record("kill -9 of `kvc serve` during a live replay", trials, survived, lost,
                    "store verified and re-read byte-exact after each kill; the stale socket taken over")
