"""kvcache.storage.lmdb.salvage, read lock-free (a user who cannot write lock.mdb, `kvc audit --read-only`): a
check that writers overtook is run again, a permission problem is an error and never `structure_corrupt`, and a
child that dies while the store stands still is still damage.

Real stores in tmp dirs; the child's death is injected (the check's own function, replaced in the forked child),
the writers are real processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvcache import KVLayout, Namespace, page_origins
from kvcache.errors import InvalidInput, StoreAccessDenied, StoreChanged
from kvcache.storage.lmdb import salvage
from kvcache.storage.lmdb.store import LMDBStore
from kvcache.types.keys import pack_tokens
from read_only_user import NO_CAPS, files_and_mtimes

LAYOUT = KVLayout("salvage-ro@r1", layers=1, kv_heads=1, head_dim=8, dtype="float16", page_size=4)
COMMIT = """
import sys
from kvcache.storage.lmdb.store import LMDBStore
with LMDBStore.open(sys.argv[1]) as store:
    for _ in range(int(sys.argv[2])):
        store.set_capacity(0)  # one write transaction each
"""


@pytest.fixture
def path(tmp_path: Path) -> str:
    where = str(tmp_path / "s")
    with LMDBStore.open(where, LAYOUT, create=True) as store:
        hashes, origins = page_origins(LAYOUT, pack_tokens(np.arange(16, dtype=np.uint32)), Namespace("t", "s"),
                                       store.chain_key)
        store.put(hashes, [np.full(LAYOUT.bytes_per_page, 3, np.uint8) for _ in hashes], origins)
    return where


def _dying(path: str, marker: Path, commits: int, times: int):
    """A `verify_in` whose first `times` runs (counted in `marker`, the runs are forked children) let `commits`
    transactions commit and then die of SIGSEGV, as a lock-free walk of reused pages may."""
    real = salvage.verify_in

    def verify_in(where, report, repair, lock=True, scope=None, record=False):
        runs = marker.stat().st_size if marker.exists() else 0
        if runs < times:
            with open(marker, "ab") as f:
                f.write(b".")
            subprocess.run([sys.executable, "-c", COMMIT, path, str(commits)], check=True, timeout=120)
            os.kill(os.getpid(), signal.SIGSEGV)
        return real(where, report, repair, lock, scope, record)

    return verify_in


def test_a_lock_free_audit_writes_nothing_and_finds_nothing_in_a_sound_store(path):
    os.unlink(os.path.join(path, "lock.mdb"))
    before = files_and_mtimes(Path(path))
    report = salvage.audit_location(path, lock=False)
    assert report.ok and report.pages_checked == 4
    assert files_and_mtimes(Path(path)) == before


def test_a_lock_free_check_whose_child_died_while_writers_committed_is_run_again(path, tmp_path, monkeypatch):
    monkeypatch.setattr(salvage, "verify_in", _dying(path, tmp_path / "runs", commits=2, times=1))
    report = salvage.audit_location(path, lock=False)
    assert report.ok and report.findings == []
    assert (tmp_path / "runs").stat().st_size == 1


def test_a_lock_free_check_writers_keep_overtaking_is_store_changed_not_damage(path, tmp_path, monkeypatch):
    monkeypatch.setattr(salvage, "verify_in", _dying(path, tmp_path / "runs", commits=2, times=99))
    with pytest.raises(StoreChanged, match="lock-free audits"):
        salvage.audit_location(path, lock=False)
    assert (tmp_path / "runs").stat().st_size == salvage.LOCK_FREE_CHECKS


def test_a_lock_free_child_that_died_while_the_store_stood_still_met_damage(path, tmp_path, monkeypatch):
    # one commit cannot make a lock-free reader see reused pages: the death is the store's
    monkeypatch.setattr(salvage, "verify_in", _dying(path, tmp_path / "runs", commits=1, times=99))
    report = salvage.audit_location(path, lock=False)
    assert [f.kind for f in report.findings] == ["structure_corrupt"]
    assert (tmp_path / "runs").stat().st_size == 1


def test_a_lock_free_audit_cannot_repair(path):
    with pytest.raises(InvalidInput, match="cannot run lock-free"):
        salvage.audit_location(path, repair=True, lock=False)


def test_an_unreadable_data_file_is_access_denied_never_structure_corrupt(path):
    # f3c3857: "the walk of the store raised StoreReadOnly ... LMDB's B-tree is damaged there" (a finding, exit 1)
    os.chmod(os.path.join(path, "data.mdb"), 0)
    try:
        code = ("import sys\nfrom kvcache.storage.lmdb import salvage\n"
                "try:\n    salvage.audit_location(sys.argv[1], lock=sys.argv[2] == '1')\n"
                "except Exception as exc:\n    print(type(exc).__name__, exc)\nelse:\n    print('no error')\n")
        for lock in ("1", "0"):
            out = subprocess.run([*NO_CAPS, sys.executable, "-c", code, path, lock], capture_output=True, text=True,
                                 timeout=120)
            assert out.stdout.startswith(StoreAccessDenied.__name__), out.stdout + out.stderr
            assert "structure_corrupt" not in out.stdout and "permission denied" in out.stdout
    finally:
        os.chmod(os.path.join(path, "data.mdb"), 0o644)


def test_a_lock_free_audit_finds_what_a_locked_one_finds(path):
    import lmdb

    from kvcache.storage.lmdb.integrity import LOCK_FREE_CHUNK_PAGES

    with LMDBStore.open(path, LAYOUT) as store:  # more pages than a lock-free chunk: the scan crosses chunks
        for t in range(LOCK_FREE_CHUNK_PAGES // 4 + 2):
            hashes, origins = page_origins(LAYOUT, pack_tokens(np.arange(16, dtype=np.uint32) + 100 * t),
                                           Namespace(f"n{t}", "s"), store.chain_key)
            store.put(hashes, [np.full(LAYOUT.bytes_per_page, t, np.uint8) for _ in hashes], origins)
    env = lmdb.open(path, max_dbs=16, subdir=True)
    pages, meta = env.open_db(b"pages"), env.open_db(b"meta")
    with env.begin(write=True) as txn:
        keys = [bytes(k) for k, _ in txn.cursor(db=pages)]
        value = txn.get(keys[3], db=pages)
        txn.put(keys[3], value[:-1] + bytes([value[-1] ^ 0xFF]), db=pages)  # a payload flip
        txn.delete(keys[-2], db=meta)  # a page without its metadata
    env.close()
    locked = salvage.audit_location(path)
    lock_free = salvage.audit_location(path, lock=False)
    assert lock_free.pages_checked == locked.pages_checked == len(keys) > LOCK_FREE_CHUNK_PAGES
    assert sorted((f.kind, f.page_hash) for f in lock_free.findings) == sorted(
        (f.kind, f.page_hash) for f in locked.findings)
    assert {"checksum_mismatch", "missing_meta"} <= {f.kind for f in lock_free.findings}
