"""Opening a store that another process is growing (issue 14, item 1).

A writer process puts batch after batch into a store whose map it keeps growing; meanwhile this process opens
the store again and again, reads its registry and totals, and closes it. An opener maps the file as it finds it:
when the writer commits past that size between the opener's `lmdb.open` and its first transaction, LMDB answers
MDB_MAP_RESIZED. Every open must retry that as a whole and succeed: 0 failures.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np

import faultkit
from kvcache.storage.api import page_origins
from kvcache.storage.registry import open_store
from kvcache.types.keys import pack_tokens
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace

LAYOUT = KVLayout("grow-model@r1", layers=2, kv_heads=2, head_dim=64, dtype="float16", page_size=4)  # 2 KiB pages
NS = Namespace("grow-tenant", "grow-salt")
PAGES_PER_BATCH = 16
OPENER_MAP = 64 << 10  # the opener maps what the file holds now: any commit past it is a resize to adopt


def _writer(path: str, ready_fd: int) -> None:
    store = open_store(path, LAYOUT, map_size=1 << 20, durability="none")
    payload = np.full(LAYOUT.bytes_per_page, 7, np.uint8)
    os.write(ready_fd, b"r")
    k = 0
    while True:
        first = k * PAGES_PER_BATCH * LAYOUT.page_size
        hashes, origins = page_origins(LAYOUT, pack_tokens(range(first, first + PAGES_PER_BATCH * LAYOUT.page_size)),
                                       NS, store.chain_key)
        store.put(hashes, [payload] * len(hashes), origins)
        k += 1
        time.sleep(0.002)  # ~16 MB/s: the file grows under every open, and the trial stays small on disk


def _start_writer(path: str) -> int:
    pid, read_fd = faultkit.fork_child(_writer, path)
    assert os.read(read_fd, 1) == b"r", "the writer did not start"
    os.close(read_fd)
    return pid


def test_opens_while_another_process_grows_the_store_never_fail(tmp_path):
    path = str(tmp_path / "store")
    open_store(path, LAYOUT, create=True, durability="none").close()
    opens = faultkit.trials(200)
    failures: list[str] = []
    pid = _start_writer(path)
    pages_seen = []
    try:
        for _ in range(opens):
            try:
                store = open_store(path, readonly=True, map_size=OPENER_MAP)
                try:
                    store.namespaces()
                    pages_seen.append(store.stats().pages)
                finally:
                    store.close()
            except Exception as exc:  # what an operator's `kvc ns ls` would have died of
                failures.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.001)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    grew = len(set(pages_seen))
    size_after = os.path.getsize(os.path.join(path, "data.mdb"))
    faultkit.record("open while another process grows the store", opens, opens - len(failures), len(failures),
                    f"the file grew to {size_after >> 20} MiB during the opens; opens saw {grew} sizes")
    assert size_after > 4 * OPENER_MAP * 16, "the writer did not grow the store: the trial proves nothing"
    assert not failures, f"{len(failures)} of {opens} opens failed, first: {failures[0]}"
    with open_store(path, LAYOUT) as store:
        assert store.verify().ok
