"""kill -9 trials (issue 14): a writer of batched puts, `kvc replay` and `kvc serve` (during a live replay),
each killed at a random moment; afterwards the store verifies clean and every stored page reads back byte-exact
(its synthetic KV, recomputed from its page hash). For puts, every acknowledged batch is there and the batch in
flight is all or nothing. A killed server leaves a stale socket that the next `kvc serve` takes over."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import threading
import time
import traceback

import numpy as np

import faultkit
import storecheck
from kvcache import WorkloadSpec, generate, write_trace
from kvcache.admin import AdminClient
from kvcache.admin_protocol import PingRequest, ReplayOutcome, ServerInfo
from kvcache.keys import pack_tokens
from kvcache.layout import KVLayout
from kvcache.namespace import Namespace
from kvcache.storage.base import open_store, page_origins

LAYOUT = KVLayout("kill-model@r1", layers=2, kv_heads=2, head_dim=32, dtype="float16", page_size=4)  # 1 KiB pages
NS = Namespace("kill-tenant", "kill-salt")
PAGES_PER_BATCH = 8
SPEC = WorkloadSpec(requests=3000, tenants=3, documents=4, seed=14)


def _batch(trial: int, k: int):
    first = (trial * 100_000 + k) * PAGES_PER_BATCH * LAYOUT.page_size
    hashes, origins = page_origins(LAYOUT, pack_tokens(range(first, first + PAGES_PER_BATCH * LAYOUT.page_size)), NS)
    return hashes, origins, [np.frombuffer(hashlib.shake_128(h).digest(LAYOUT.bytes_per_page), np.uint8)
                             for h in hashes]


def _put_forever(path: str, trial: int, ack_fd: int) -> None:
    store = open_store(path, LAYOUT)
    for k in range(100_000):
        hashes, origins, payloads = _batch(trial, k)
        store.put(hashes, payloads, origins)
        os.write(ack_fd, f"{k}\n".encode())


def test_kill_9_of_a_writer_loses_no_acknowledged_batch(tmp_path):
    path = str(tmp_path / "store")
    open_store(path, LAYOUT, create=True).close()
    rng = random.Random(1414)
    trials = faultkit.trials(10)
    survived = lost = 0
    out = np.zeros((PAGES_PER_BATCH, LAYOUT.bytes_per_page), np.uint8)
    for trial in range(trials):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(read_fd)
                _put_forever(path, trial, write_fd)
            except BaseException:
                traceback.print_exc()
                code = 1
            os._exit(code)
        os.close(write_fd)
        received = b""
        while received.count(b"\n") < rng.randint(1, 8):
            chunk = os.read(read_fd, 4096)
            assert chunk, "the writer died by itself"
            received += chunk
        time.sleep(rng.uniform(0, 0.01))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        while chunk := os.read(read_fd, 4096):
            received += chunk
        os.close(read_fd)
        acked = [int(x) for x in received.split()]
        missing = 0
        with open_store(path, LAYOUT) as store:
            clean = store.verify().ok
            for k in acked:
                hashes, _, payloads = _batch(trial, k)
                got = store.get_into(hashes, list(out))
                missing += PAGES_PER_BATCH - got
                missing += sum(not np.array_equal(out[i], payloads[i]) for i in range(got))
            in_flight = store.exists_prefix(_batch(trial, len(acked))[0])
        ok = clean and missing == 0 and in_flight in (0, PAGES_PER_BATCH)
        survived += ok
        lost += missing
        assert ok, (trial, clean, missing, in_flight)
    faultkit.record("kill -9 of a writer mid-put", trials, survived, lost, "pages of acknowledged batches missing")


def _trace(tmp_path) -> tuple[str, list[Namespace]]:
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, generate(SPEC))
    return str(trace), [Namespace(*SPEC.tenant(t)) for t in range(SPEC.tenants)]


def _check_store(path: str, namespaces: list[Namespace]) -> tuple[bool, storecheck.Reread]:
    with open_store(path, readonly=True) as store:
        clean = store.verify().ok
    return clean, storecheck.reread(path, LAYOUT, namespaces)


def test_kill_9_of_kvc_replay_leaves_every_stored_page_exact(tmp_path):
    path = str(tmp_path / "store")
    open_store(path, LAYOUT, create=True).close()
    trace, namespaces = _trace(tmp_path)
    rng = random.Random(2828)
    trials = faultkit.trials(3)
    survived = lost = 0
    stored: list[int] = []
    for _ in range(trials):
        proc = subprocess.Popen([str(faultkit.KVC), "replay", trace, "--store", path, "--device-tokens", "2048",
                                 "--host-tokens", "4096"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        start = os.path.getsize(os.path.join(path, "data.mdb"))
        while os.path.getsize(os.path.join(path, "data.mdb")) == start:  # writing has begun
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the replay never wrote"
            time.sleep(0.02)
        time.sleep(rng.uniform(0, 0.5))
        running = proc.poll() is None
        proc.kill()
        proc.wait()
        proc.stderr.close()
        clean, seen = _check_store(path, namespaces)
        ok = running and clean and seen.wrong == 0 and seen.read == seen.pages
        stored.append(seen.pages)
        survived += ok
        lost += seen.wrong + seen.pages - seen.read
        assert ok, (running, clean, seen.pages, seen.read, seen.wrong)
    faultkit.record("kill -9 of `kvc replay` mid-run", trials, survived, lost,
                    f"pages stored after each kill: {stored}, all re-read byte-exact")


def test_kill_9_of_kvc_serve_during_a_live_replay(tmp_path):
    path = str(tmp_path / "store")
    open_store(path, LAYOUT, create=True).close()
    trace, namespaces = _trace(tmp_path)
    sock = str(tmp_path / "s.sock")
    rng = random.Random(4242)
    trials = faultkit.trials(2)
    survived = lost = 0
    for _ in range(trials):
        server = subprocess.Popen([str(faultkit.KVC), "serve", "--store", path, "--socket", sock, "--json",
                                   "--device-tokens", "2048", "--host-tokens", "4096"],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert server.stdout.readline(), "kvc serve did not start"  # ready: a stale socket was taken over
        errors: list[BaseException] = []

        def replay() -> None:
            try:
                AdminClient(sock, timeout=120).replay(trace, ReplayOutcome, timeout=120)
            except BaseException as exc:  # the server is killed under it: an AdminError is expected
                errors.append(exc)

        client = threading.Thread(target=replay)
        client.start()
        start = os.path.getsize(os.path.join(path, "data.mdb"))
        deadline = time.monotonic() + 60
        while os.path.getsize(os.path.join(path, "data.mdb")) == start and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(rng.uniform(0, 0.5))
        running = server.poll() is None
        server.kill()
        server.wait()
        client.join(60)
        clean, seen = _check_store(path, namespaces)
        ok = running and clean and seen.wrong == 0 and seen.read == seen.pages and bool(errors)
        survived += ok
        lost += seen.wrong + seen.pages - seen.read
        assert ok, (running, clean, seen.pages, seen.read, seen.wrong, errors)
    again = subprocess.Popen([str(faultkit.KVC), "serve", "--store", path, "--socket", sock, "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert again.stdout.readline(), "kvc serve did not take over the stale socket"
        assert AdminClient(sock).call(PingRequest(), ServerInfo).pid == again.pid
    finally:
        again.send_signal(signal.SIGTERM)
        assert again.wait(60) == 0
    faultkit.record("kill -9 of `kvc serve` during a live replay", trials, survived, lost,
                    "store verified and re-read byte-exact after each kill; the stale socket taken over")
