"""A store's fingerprint key file: one per store, 0600, kept, and the key of the fingerprints it records."""

import os
import stat

import numpy as np

from factories import make_layout
from unit.storage.lmdb.test_migrate import set_format_version

from kvcache import Namespace, open_store, page_origins
from kvcache.types.keys import pack_tokens
from kvcache.storage.keyfile import KEY_FILE, ensure_key, read_key

SALT = "keyfile-salt-1"


def _write(path, ns):
    layout = make_layout(4)
    with open_store(str(path), layout, create=True) as store:
        hashes, origins = page_origins(layout, pack_tokens(np.arange(8, dtype=np.uint32)), ns, store.chain_key)
        store.put(hashes, [np.zeros(layout.bytes_per_page, np.uint8) for _ in hashes], origins)
        return store.fingerprint_key, store.namespaces()


def test_a_new_store_gets_its_own_0600_key_and_records_fingerprints_under_it(tmp_path, monkeypatch):
    monkeypatch.delenv("KVC_FINGERPRINT_KEY", raising=False)
    ns = Namespace("t1", SALT)
    key_a, recs_a = _write(tmp_path / "a", ns)
    key_b, recs_b = _write(tmp_path / "b", ns)
    assert key_a != key_b and len(key_a) == 32
    for path in (tmp_path / "a", tmp_path / "b"):
        assert stat.S_IMODE(os.stat(path / KEY_FILE).st_mode) == 0o600
        assert SALT.encode() not in (path / KEY_FILE).read_bytes()
    assert recs_a[0].salt_fingerprint == ns.fingerprint(key_a) != recs_b[0].salt_fingerprint == ns.fingerprint(key_b)
    with open_store(str(tmp_path / "a"), readonly=True) as again:  # the key is kept: every process agrees
        assert again.fingerprint_key == key_a


def test_env_key_seeds_new_stores_so_a_deployment_shares_one(tmp_path, monkeypatch):
    monkeypatch.setenv("KVC_FINGERPRINT_KEY", "cd" * 32)
    key_a, _ = _write(tmp_path / "a", Namespace("t1", SALT))
    key_b, _ = _write(tmp_path / "b", Namespace("t1", SALT))
    assert key_a == key_b == b"\xcd" * 32


def test_a_store_made_before_keys_gets_one_on_its_first_writable_open(tmp_path):
    _write(tmp_path / "s", Namespace("t1", SALT))
    (tmp_path / "s" / KEY_FILE).unlink()
    # a store made before key files is of format 1 (its chain roots are keyed by nothing); a keyed store that
    # lost its key file is refused instead (unit/storage/lmdb/test_migrate.py)
    set_format_version(str(tmp_path / "s"), 1)
    with open_store(str(tmp_path / "s"), readonly=True) as ro:
        assert ro.fingerprint_key is None  # read-only: nothing written
    with open_store(str(tmp_path / "s"), make_layout(4)) as rw:
        assert rw.fingerprint_key == read_key(str(tmp_path / "s")) is not None


def test_racing_writers_agree_on_one_key(tmp_path):
    keys = {ensure_key(str(tmp_path)) for _ in range(5)}
    assert len(keys) == 1 and [p.name for p in tmp_path.iterdir()] == [KEY_FILE]
