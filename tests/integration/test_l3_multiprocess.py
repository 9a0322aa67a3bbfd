"""The LMDB store across processes: two writers and a reader on one store, map growth, and the salt on disk.

Children are forked from the test process. One writer uses the handle the parent opened before the fork (the
store must reopen its environment in the child by itself); the other opens its own. The store starts with a tiny
map, so the writers grow it under each other and under the reader.
"""

from __future__ import annotations

import hashlib
import os
import time
import traceback
from pathlib import Path

import numpy as np
import pytest

from kvcache.storage.api import page_origins
from kvcache.storage.registry import open_store
from kvcache.types.keys import pack_tokens
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace

LAYOUT = KVLayout("mp-model@r1", layers=2, kv_heads=4, head_dim=32, dtype="float16", page_size=8)  # 8 KiB pages
SALT = "mp-secret-salt-3c9e1f"
SHARED = Namespace("shared", SALT)  # both writers write the same chains here
OWN = [Namespace("writer-0", SALT), Namespace("writer-1", SALT)]
BATCHES = 40
PAGES = 6
TINY_MAP = 128 << 10


def chain(chain_key: bytes, ns: Namespace, seq: int) -> tuple[list[bytes], list, list[np.ndarray]]:
    """Hashes, origins and payloads of sequence `seq` in `ns` (deterministic, so any process can check it)."""
    tokens = pack_tokens(range(seq * 10_000, seq * 10_000 + PAGES * LAYOUT.page_size))
    hashes, origins = page_origins(LAYOUT, tokens, ns, chain_key)
    payloads = [np.frombuffer(hashlib.shake_128(h).digest(LAYOUT.bytes_per_page), np.uint8) for h in hashes]
    return hashes, origins, payloads


def fork(body, *args) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            body(*args)
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    return pid


def writer(store_or_path, w: int) -> None:
    store = open_store(store_or_path, LAYOUT) if isinstance(store_or_path, str) else store_or_path
    for k in range(BATCHES):
        hashes, origins, payloads = chain(store.chain_key, OWN[w], k)
        store.put(hashes, payloads, origins)
        if k % 4 == 0:  # the same shared chain from both writers: one stores it, the other finds it
            hashes, origins, payloads = chain(store.chain_key, SHARED, k)
            store.put(hashes, payloads, origins)
    store.close()


def reader(path: str, stop: str, report: str) -> None:
    store = open_store(path, LAYOUT, readonly=True)
    out = np.zeros((PAGES, LAYOUT.bytes_per_page), np.uint8)
    checked = rounds = 0
    while not os.path.exists(stop):
        rounds += 1
        for ns in (*OWN, SHARED):
            for k in range(BATCHES):
                hashes, _, payloads = chain(store.chain_key, ns, k)
                n = store.get_into(hashes, list(out))
                if n not in (0, PAGES):
                    raise AssertionError(f"{ns} batch {k}: {n} of {PAGES} pages, a half-visible batch")
                for i in range(n):
                    if not np.array_equal(out[i], payloads[i]):
                        raise AssertionError(f"{ns} batch {k} page {i}: wrong bytes")
                checked += n
    counters = store.counters()
    if counters.read_errors or counters.checksum_failures:
        raise AssertionError(f"reader saw faults: {counters}")
    Path(report).write_text(f"{rounds} {checked}")
    store.close()


def test_two_writers_and_a_reader_lose_nothing(tmp_path):
    check_writers_and_reader(tmp_path)


@pytest.mark.slow
def test_writers_and_reader_stress(tmp_path):
    """KVC_STRESS (default 1) x 10 rounds of the two-writer, one-reader run on fresh stores."""
    for i in range(10 * int(os.environ.get("KVC_STRESS", "1"))):
        (tmp_path / str(i)).mkdir()
        check_writers_and_reader(tmp_path / str(i))


def check_writers_and_reader(tmp_path: Path) -> None:
    """Two forked writers (one on the parent's handle) and a forked reader on one store; nothing lost."""
    path = str(tmp_path / "store")
    stop, report = str(tmp_path / "stop"), str(tmp_path / "report")
    parent = open_store(path, LAYOUT, create=True, map_size=TINY_MAP)
    start_map = parent.map_size()
    readers = [fork(reader, path, stop, report)]
    writers = [fork(writer, parent, 0), fork(writer, path, 1)]
    for pid in writers:
        assert os.waitpid(pid, 0)[1] == 0, "a writer failed (traceback above)"
    time.sleep(0.05)  # let the reader see the final state at least once
    Path(stop).touch()
    assert os.waitpid(readers[0], 0)[1] == 0, "the reader failed (traceback above)"
    rounds, checked = map(int, Path(report).read_text().split())
    assert rounds >= 1 and checked > 0
    print(f"reader: {rounds} rounds, {checked} pages checked while the writers ran")

    # The parent's handle still works after its children used the store.
    out = np.zeros((PAGES, LAYOUT.bytes_per_page), np.uint8)
    for ns, seqs in ((OWN[0], range(BATCHES)), (OWN[1], range(BATCHES)), (SHARED, range(0, BATCHES, 4))):
        for k in seqs:
            hashes, _, payloads = chain(parent.chain_key, ns, k)
            assert parent.get_into(hashes, list(out)) == PAGES, (ns, k)
            assert all(np.array_equal(out[i], payloads[i]) for i in range(PAGES))
    stats = parent.stats()
    assert stats.pages == PAGES * (2 * BATCHES + len(range(0, BATCHES, 4)))
    assert parent.map_size() > start_map
    assert parent.verify().ok
    assert {r.extra_key: r.pages for r in parent.namespaces()} == {
        "writer-0": PAGES * BATCHES, "writer-1": PAGES * BATCHES, "shared": PAGES * 10}
    parent.close()
    assert_salt_absent(path)


def test_a_tiny_map_grows_through_many_batches(tmp_path):
    path = str(tmp_path / "store")
    with open_store(path, LAYOUT, create=True, map_size=32 << 10) as store:
        start = store.map_size()
        for k in range(150):
            hashes, origins, payloads = chain(store.chain_key, OWN[0], k)
            assert store.put(hashes, payloads, origins).written == PAGES
        grown = store.map_size()
    assert grown >= 150 * PAGES * LAYOUT.bytes_per_page > start
    with open_store(path, LAYOUT) as store:
        out = np.zeros((PAGES, LAYOUT.bytes_per_page), np.uint8)
        for k in range(150):
            hashes, _, payloads = chain(store.chain_key, OWN[0], k)
            assert store.get_into(hashes, list(out)) == PAGES
            assert all(np.array_equal(out[i], payloads[i]) for i in range(PAGES))
        assert store.verify().ok
    assert_salt_absent(path)


def assert_salt_absent(path: str) -> None:
    """The salt used by these tests occurs in no byte of any file of the store (in any common encoding)."""
    encodings = (SALT.encode(), SALT.encode("utf-16-le"), SALT.encode("utf-16-be"), SALT.encode().hex().encode())
    files = sorted(os.listdir(path))
    assert "data.mdb" in files
    for name in files:
        raw = Path(path, name).read_bytes()
        for encoded in encodings:
            assert encoded not in raw, f"the salt occurs in {name}"
        assert SALT.encode() not in name.encode()
