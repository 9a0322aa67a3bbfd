"""Crash consistency of the LMDB store: a writer killed with SIGKILL in the middle of a loop of batched puts.

Each trial forks a writer that puts batch after batch and acknowledges each one on a pipe after `put` returned.
The test kills it at a random moment, reopens the store and checks: `verify()` is clean, every acknowledged batch
reads back bit-exact, and the batch that was in flight is either wholly there or wholly absent.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import traceback

import numpy as np
import pytest

from kvcache.storage.api import page_origins
from kvcache.storage.registry import open_store
from kvcache.types.keys import pack_tokens
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace

LAYOUT = KVLayout("crash-model@r1", layers=4, kv_heads=4, head_dim=64, dtype="float16", page_size=4)  # 16 KiB
NS = Namespace("crash-tenant", "crash-salt-0b5e")
PAGES_PER_BATCH = 8
TRIALS = 20


def batch(chain_key: bytes, trial: int, k: int) -> tuple[list[bytes], list, list[np.ndarray]]:
    """Hashes, origins and payloads of batch `k` of `trial` (deterministic: the checker rebuilds them)."""
    first = (trial * 100_000 + k) * PAGES_PER_BATCH * LAYOUT.page_size
    tokens = pack_tokens(range(first, first + PAGES_PER_BATCH * LAYOUT.page_size))
    hashes, origins = page_origins(LAYOUT, tokens, NS, chain_key)
    payloads = [np.frombuffer(hashlib.shake_128(h).digest(LAYOUT.bytes_per_page), np.uint8) for h in hashes]
    return hashes, origins, payloads


def writer(path: str, trial: int, ack_fd: int) -> None:
    """Put batches forever, acknowledging each committed one with its number on `ack_fd`."""
    store = open_store(path, LAYOUT)
    for k in range(100_000):
        hashes, origins, payloads = batch(store.chain_key, trial, k)
        store.put(hashes, payloads, origins)
        os.write(ack_fd, f"{k}\n".encode())


def run_trial(path: str, trial: int, rng: random.Random) -> list[int]:
    """Fork a writer, kill it after a random number of acknowledgements plus a random delay; return the acks."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the writer
        code = 0
        try:
            os.close(read_fd)
            writer(path, trial, write_fd)
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    os.close(write_fd)
    wanted = rng.randint(1, 12)
    received = b""
    while received.count(b"\n") < wanted:
        chunk = os.read(read_fd, 4096)
        assert chunk, "the writer died before it was killed"
        received += chunk
    # A random delay puts the kill anywhere in the next batch: encoding, inside the write txn, at commit.
    deadline = rng.uniform(0, 0.006)
    if deadline:
        os.sched_yield()
        np.zeros(int(deadline * 2e8), np.uint8).sum()  # busy wait without sleeping the writer's core away
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, "the writer ended by itself"
    while chunk := os.read(read_fd, 4096):
        received += chunk
    os.close(read_fd)
    return [int(line) for line in received.split()]


def test_killed_writer_loses_no_acknowledged_batch_and_leaves_no_half_batch(tmp_path):
    check_kills(str(tmp_path / "store"), TRIALS, seed=1234)


@pytest.mark.slow
def test_killed_writer_stress(tmp_path):
    """KVC_STRESS x 100 kills on one store (default 1)."""
    check_kills(str(tmp_path / "store"), 100 * int(os.environ.get("KVC_STRESS", "1")), seed=99)


def check_kills(path: str, trials: int, seed: int) -> None:
    """`trials` kill-and-check rounds on the store at `path` (see the module docstring)."""
    open_store(path, LAYOUT, create=True).close()
    rng = random.Random(seed)
    out = np.zeros((PAGES_PER_BATCH, LAYOUT.bytes_per_page), np.uint8)
    total_acked = in_flight_committed = 0
    for trial in range(trials):
        acked = run_trial(path, trial, rng)
        assert acked == list(range(len(acked)))
        total_acked += len(acked)
        with open_store(path, LAYOUT) as store:
            report = store.verify()
            assert report.ok, (trial, report.findings)
            for k in acked:
                hashes, _, payloads = batch(store.chain_key, trial, k)
                assert store.get_into(hashes, list(out)) == PAGES_PER_BATCH, (trial, k)
                assert all(np.array_equal(out[i], payloads[i]) for i in range(PAGES_PER_BATCH)), (trial, k)
            # The batch in flight at the kill: committed whole or not at all, never half.
            hashes, _, payloads = batch(store.chain_key, trial, len(acked))
            present = store.exists_prefix(hashes)
            assert present in (0, PAGES_PER_BATCH), (trial, present)
            in_flight_committed += bool(present)
            if present:
                assert store.get_into(hashes, list(out)) == PAGES_PER_BATCH
                assert all(np.array_equal(out[i], payloads[i]) for i in range(PAGES_PER_BATCH))
            assert store.exists_prefix(batch(store.chain_key, trial, len(acked) + 1)[0]) == 0
    assert total_acked >= trials
    print(f"{trials} kills, {total_acked} acknowledged batches, {in_flight_committed} in-flight batches committed")
