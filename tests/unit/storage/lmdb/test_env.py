"""Store files that carry no process memory (LMDB's meminit)."""

import os
import subprocess
import sys
from pathlib import Path

PLANT = r"""
import sys
import numpy as np
from kvcache import KVLayout, Namespace, open_store, page_origins
from kvcache.types.keys import pack_tokens

marker = sys.argv[2].encode()
# Blocks of LMDB's page size full of the marker, each pinned below a small live block so the heap cannot give
# them back to the OS, then freed: LMDB's next page buffers are carved out of them.
junk, keep = [], []
for i in range(4000):
    junk.append(bytearray(marker * (4096 // len(marker) + 1))[:4090])
    keep.append(bytearray(600))
del junk
layout = KVLayout("marker@r1", layers=1, kv_heads=1, head_dim=20, dtype="float16", page_size=16)
with open_store(sys.argv[1], layout, create=True) as store:
    for n in range(40):
        tokens = pack_tokens(np.arange(n * 1000, n * 1000 + 128, dtype=np.uint32))
        hashes, origins = page_origins(layout, tokens, Namespace(f"t{n}", "s"), store.chain_key)
        store.put(hashes, [np.zeros(layout.bytes_per_page, np.uint8) for _ in hashes], origins)
"""


def test_store_files_never_carry_process_memory(tmp_path):
    # Reproduces the report: with meminit=False the unused bytes of LMDB's pages went to disk as they were in
    # memory (9 copies of this marker in data.mdb, py-lmdb docstrings, kvcache source).
    marker = "KVC-PLANTED-" + os.urandom(6).hex()
    subprocess.run([sys.executable, "-c", PLANT, str(tmp_path / "s"), marker], check=True, timeout=120)
    for f in Path(tmp_path / "s").iterdir():
        assert marker.encode() not in f.read_bytes(), f.name


# -- lock-free reading (a user who cannot write lock.mdb, or --read-only) ----------------------------------------

import pytest  # noqa: E402

from kvcache import Namespace  # noqa: E402
from kvcache.errors import InvalidInput, StoreChanged, StoreReadOnly  # noqa: E402
from kvcache.storage.lmdb.env import committed_txnid  # noqa: E402
from kvcache.storage.lmdb.store import LMDBStore  # noqa: E402
from read_only_user import files_and_mtimes  # noqa: E402

LAYOUT_ARGS = dict(layers=1, kv_heads=1, head_dim=8, dtype="float16", page_size=4)
COMMIT = """
import sys
from kvcache.storage.lmdb.store import LMDBStore
with LMDBStore.open(sys.argv[1]) as store:
    for _ in range(int(sys.argv[2])):
        store.set_capacity(0)  # one write transaction each
"""


def commit(path: Path, n: int) -> None:
    """`n` write transactions on the store, from another process (a writer the lock-free reader cannot see)."""
    subprocess.run([sys.executable, "-c", COMMIT, str(path), str(n)], check=True, timeout=120)


@pytest.fixture
def filled(tmp_path: Path) -> Path:
    import numpy as np

    from kvcache import KVLayout, page_origins
    from kvcache.types.keys import pack_tokens

    layout = KVLayout("lockfree@r1", **LAYOUT_ARGS)
    path = tmp_path / "s"
    with LMDBStore.open(str(path), layout, create=True) as store:
        hashes, origins = page_origins(layout, pack_tokens(np.arange(12, dtype=np.uint32)), Namespace("t", "s"),
                                       store.chain_key)
        store.put(hashes, [np.full(layout.bytes_per_page, 7, np.uint8) for _ in hashes], origins)
    return path


def test_a_lock_free_open_reads_the_store_and_writes_nothing_to_its_directory(filled):
    os.unlink(filled / "lock.mdb")  # a locked open would make it again
    before = files_and_mtimes(filled)
    with LMDBStore.open(str(filled), readonly=True, lock=False) as store:
        assert store.lock_free and store.readonly
        assert [r.pages for r in store.namespaces()] == [3] and store.stats().pages == 3
        assert len(store.children(store.root(Namespace("t", "s"), store.layouts()[0]))) == 1
        with pytest.raises(StoreReadOnly):
            store.set_capacity(1 << 20)
    assert files_and_mtimes(filled) == before


def test_a_lock_free_open_is_a_read_only_one(filled):
    with pytest.raises(InvalidInput, match="readonly=True"):
        LMDBStore.open(str(filled), lock=False)


def test_a_lock_free_read_that_writers_overtook_is_store_changed(filled):
    with LMDBStore.open(str(filled), readonly=True, lock=False) as store:
        shared = store._lease.shared
        with shared.read() as txn:
            commit(filled, 1)  # one commit reuses nothing this snapshot holds
            assert txn.get(b"format", db=shared.dbs.store) is not None
        with pytest.raises(StoreChanged, match="overtaken by writers"):
            with shared.read() as txn:
                commit(filled, 2)  # the second may reuse the pages the first freed: this snapshot's


def test_reading_runs_an_overtaken_lock_free_read_again(filled):
    with LMDBStore.open(str(filled), readonly=True, lock=False) as store:
        shared, snapshots = store._lease.shared, []

        def body(txn):
            snapshots.append(txn.id())
            if len(snapshots) == 1:
                commit(filled, 2)
            return bytes(txn.get(b"format", db=shared.dbs.store))

        assert shared.reading(body)
        assert len(snapshots) == 2 and snapshots[1] == snapshots[0] + 2


def test_a_registered_reader_is_never_overtaken(filled):
    with LMDBStore.open(str(filled), readonly=True) as store:
        assert not store.lock_free
        with store._lease.shared.read() as txn:
            commit(filled, 3)  # the writers see this reader in lock.mdb and keep its pages
            assert txn.get(b"format", db=store._lease.shared.dbs.store) is not None


def test_committed_txnid_reads_the_last_commit_from_the_data_file(filled):
    with LMDBStore.open(str(filled), readonly=True, lock=False) as store:
        first = store._lease.shared.env.info()["last_txnid"]
        assert committed_txnid(str(filled)) == first
        commit(filled, 3)
        assert committed_txnid(str(filled)) == store._lease.shared.env.info()["last_txnid"] == first + 3


# -- closing while other threads read and write (issue 36) ------------------------------------------------------

import threading  # noqa: E402
import time  # noqa: E402

from kvcache.errors import StoreClosed  # noqa: E402

DEADLINE_S = 60.0  # how long a condition below may take to hold on a loaded machine: a hang, not a slow run


def wait_until(condition, what: str) -> None:
    """Poll `condition` until it holds (a generous deadline: the test waits for a state, not for time)."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"still not: {what}"
        time.sleep(0.001)


class InFlight:
    """A transaction held open on another thread: `body(txn)` runs in it once `go` is set."""

    def __init__(self, run, body) -> None:
        self.inside, self.go, self.out, self.error = threading.Event(), threading.Event(), [], []

        def hold(txn):
            self.inside.set()
            self.go.wait()
            return body(txn)

        def main() -> None:
            try:
                self.out.append(run(hold))
            except BaseException as exc:  # reported by the test
                self.error.append(exc)

        self.thread = threading.Thread(target=main)
        self.thread.start()
        self.inside.wait()

    def finish(self):
        self.go.set()
        self.thread.join()
        assert self.error == []
        return self.out[0]


class Closing:
    """`close()` on another thread; `done` is set once it returned."""

    def __init__(self, close) -> None:
        self.done = threading.Event()
        self.thread = threading.Thread(target=lambda: (close(), self.done.set()))
        self.thread.start()


def refused(shared) -> bool:
    """Whether a new transaction on `shared` is refused (the close began)."""
    try:
        with shared.read():
            return False
    except StoreClosed:
        return True


def test_the_last_close_waits_for_a_read_in_flight_on_another_thread(filled):
    # The repro: the last handle's close unmapped the map under a reader's zero-copy view (SIGSEGV). Now
    # the close waits for the read; new reads meanwhile are StoreClosed, never a read of unmapped memory.
    store = LMDBStore.open(str(filled))
    shared = store._lease.shared
    record = store._lease.read(lambda txn, dbs: bytes(txn.get(b"format", db=dbs.store)))
    closing = None
    reader = InFlight(lambda body: shared.reading(body, buffers=True),
                      lambda txn: None if closing is None or closing.done.is_set()  # unmapped: never touched
                      else bytes(txn.get(b"format", db=shared.dbs.store)))
    try:
        closing = Closing(store.close)
        wait_until(lambda: closing.done.is_set() or refused(shared), "the close began")
        assert not closing.done.is_set(), "the close returned while a read was in flight"
        assert not shared.closed
    finally:
        got = reader.finish()
        closing.thread.join()
    assert got == record  # read whole from the map the close kept for it
    assert shared.closed and closing.done.is_set()
    with pytest.raises(StoreClosed):
        store.exists_prefix([bytes(16)])


def test_a_write_in_flight_is_waited_for_and_commits(filled):
    store = LMDBStore.open(str(filled))
    shared = store._lease.shared
    closing = None
    writer = InFlight(lambda body: shared.write(body),
                      lambda txn: txn.put(b"close-test", b"1", db=shared.dbs.store) if closing is not None
                      and not closing.done.is_set() else None)
    try:
        closing = Closing(store.close)
        wait_until(lambda: closing.done.is_set() or refused(shared), "the close began")
        assert not closing.done.is_set(), "the close returned while a write was in flight"
    finally:
        writer.finish()
        closing.thread.join()
    with LMDBStore.open(str(filled), readonly=True) as again:
        assert again._lease.read(lambda txn, dbs: txn.get(b"close-test", db=dbs.store)) == b"1"


def test_closing_one_of_two_handles_leaves_the_other_reading(filled):
    first, second = LMDBStore.open(str(filled)), LMDBStore.open(str(filled))
    assert first._lease.shared is second._lease.shared
    first.close()
    assert not second._lease.shared.closed and [r.pages for r in second.namespaces()] == [3]
    with pytest.raises(StoreClosed):
        first.namespaces()
    second.close()
    assert second._lease.shared.closed


def test_a_close_from_inside_a_scan_closes_the_environment_when_the_scan_ends(filled):
    # the thread that closes is itself inside a read: it cannot wait for it; the read's end closes the map
    store = LMDBStore.open(str(filled))
    shared = store._lease.shared
    scan = shared.scan(shared.dbs.meta, chunk=1)
    _, key, value = next(scan)
    store.close()
    assert not shared.closed  # this thread's own read is still on the map
    assert len(bytes(value)) > 16 and len(key) == 16  # its view still reads
    with pytest.raises(StoreClosed):
        next(scan)  # the next chunk is a new transaction: refused
    assert shared.closed


def test_two_threads_closing_one_handle_release_it_once(filled):
    store, other = LMDBStore.open(str(filled)), LMDBStore.open(str(filled))
    start = threading.Barrier(2)
    threads = [threading.Thread(target=lambda: (start.wait(), store.close())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not other._lease.shared.closed and other._lease.shared.refs == 1  # the other handle still holds it
    assert [r.pages for r in other.namespaces()] == [3]
    other.close()
