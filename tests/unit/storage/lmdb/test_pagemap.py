"""kvcache.storage.lmdb.pagemap's open check on a store other processes write: its raw walk holds no LMDB reader
slot, so a writer may reuse the pages it walks; the check believes only a walk no commit overtook (found by the
multi-process writers' stress test, where a writer's open was refused as "damaged" by a walk that read pages a
commit had just reused). Two writer processes commit and delete as fast as they can while this process checks
the store again and again: no check may call it damaged."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np

from kvcache.storage.api import page_origins
from kvcache.storage.lmdb.pagemap import refuse_damaged
from kvcache.storage.registry import open_store
from kvcache.types.keys import pack_tokens
from kvcache.types.layout import KVLayout
from kvcache.types.namespace import Namespace

LAYOUT = KVLayout("pagemap-race@r1", layers=1, kv_heads=1, head_dim=64, dtype="float16", page_size=4)
CHECKS = 8000  # open checks while the writers run (the unguarded walk was refused about once in 6,500 here)
WAIT_S = 120.0


def _writer(path: str, who: int, started, stop) -> None:
    # each writer its own namespaces: a drop racing another process's puts to the same namespace is outside what a
    # plain handle guarantees (live caches fence drops through the store's drop records)
    store = open_store(path, LAYOUT, durability="none")
    started.set()
    i = 0
    while not stop.is_set():
        i += 1
        hashes, origins = page_origins(LAYOUT, pack_tokens(list(range(i * 8, i * 8 + 8))),
                                       Namespace(f"w{who}-t{i % 4}"), store.chain_key)
        store.put(hashes, [np.full(LAYOUT.bytes_per_page, i % 251, np.uint8) for _ in hashes], origins)
        if i % 50 == 0:  # frees many pages at once: the next commits reuse them
            store.delete_namespace(Namespace(f"w{who}-t{(i // 50) % 4}").id)
    store.close()


def test_an_open_check_racing_writers_never_calls_a_sound_store_damaged(tmp_path):
    path = str(tmp_path / "store")
    open_store(path, LAYOUT, create=True, add_layout=True).close()
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    started = [ctx.Event() for _ in range(2)]
    writers = [ctx.Process(target=_writer, args=(path, i, s, stop)) for i, s in enumerate(started)]
    for w in writers:
        w.start()
    try:
        assert all(s.wait(WAIT_S) for s in started)
        refused = []
        for _ in range(CHECKS):
            try:
                refuse_damaged(path, writer=True)
            except Exception as exc:  # noqa: BLE001  (any refusal of this sound store is the defect)
                refused.append(str(exc))
        assert refused == []
    finally:
        stop.set()
        for w in writers:
            w.join(WAIT_S)
    assert all(w.exitcode == 0 for w in writers)
    with open_store(path, readonly=True) as ro:
        report = ro.verify()
        assert report.ok, report.findings[:3]
