"""A store's fingerprint key file: one per store, 0600, part of the store (a missing, empty or damaged one is
refused, never replaced behind anyone's back), and the key of the fingerprints it records.

On fbee4ed a missing key file was silently replaced by a new key on the next writable open (fingerprints and ids
changed), and a damaged one raised a plain StoreError; KeyFileError did not exist."""

import os
import stat

import numpy as np
import pytest

from factories import make_layout
from kvcache import KeyFileError, Namespace, StoreError, open_store, page_origins
from kvcache.storage.keyfile import KEY_FILE, KeyState, create_key, key_findings, key_status, read_key
from kvcache.types.keys import pack_tokens
from kvcache.types.namespace import UNKNOWN_FINGERPRINT, display_id
from unit.storage.lmdb.test_migrate import set_format_version

SALT = "keyfile-salt-1"


def _put(path, ns, create=True, first=0, format_1=False):
    layout = make_layout(4)
    if create:
        open_store(str(path), layout, create=True).close()
    if format_1:  # as a kvc before keyed chain roots wrote it (unit/storage/lmdb/test_migrate.py)
        set_format_version(str(path), 1)
    with open_store(str(path), layout) as store:
        hashes, origins = page_origins(layout, pack_tokens(np.arange(first, first + 8, dtype=np.uint32)), ns,
                                       store.chain_key)
        store.put(hashes, [np.zeros(layout.bytes_per_page, np.uint8) for _ in hashes], origins)
        return store.fingerprint_key, store.namespaces()


def test_a_new_store_gets_its_own_0600_key_and_records_fingerprints_under_it(tmp_path, monkeypatch):
    monkeypatch.delenv("KVC_FINGERPRINT_KEY", raising=False)
    ns = Namespace("t1", SALT)
    key_a, recs_a = _put(tmp_path / "a", ns)
    key_b, recs_b = _put(tmp_path / "b", ns)
    assert key_a != key_b and len(key_a) == 32
    for path in (tmp_path / "a", tmp_path / "b"):
        assert stat.S_IMODE(os.stat(path / KEY_FILE).st_mode) == 0o600
        assert SALT.encode() not in (path / KEY_FILE).read_bytes()
    assert recs_a[0].salt_fingerprint == ns.fingerprint(key_a) != recs_b[0].salt_fingerprint == ns.fingerprint(key_b)
    with open_store(str(tmp_path / "a"), readonly=True) as again:  # the key is kept: every process agrees
        assert again.fingerprint_key == key_a


def test_env_key_seeds_new_stores_so_a_deployment_shares_one(tmp_path, monkeypatch):
    monkeypatch.setenv("KVC_FINGERPRINT_KEY", "cd" * 32)
    key_a, _ = _put(tmp_path / "a", Namespace("t1", SALT))
    key_b, _ = _put(tmp_path / "b", Namespace("t1", SALT))
    assert key_a == key_b == b"\xcd" * 32


def test_a_missing_key_file_is_refused_by_every_open_and_never_replaced(tmp_path):
    _put(tmp_path / "s", Namespace("t1", SALT))
    (tmp_path / "s" / KEY_FILE).unlink()
    for kwargs in ({"readonly": True}, {"layout": make_layout(4)}):
        with pytest.raises(KeyFileError, match="key file is missing.*kvc init --rekey"):
            open_store(str(tmp_path / "s"), **kwargs)
    assert not (tmp_path / "s" / KEY_FILE).exists()  # nothing wrote a new key
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["data.mdb", "lock.mdb"]


@pytest.mark.parametrize("content, why", [(b"", "empty"), (b"\n  \n", "empty"), (b"zz" * 32, "not a key"),
                                          (b"ab" * 8, "not a key"), (b"\xff\xfe" * 40, "not a key"),
                                          (b"ab" * 400, "not a key")])
def test_an_empty_or_corrupt_key_file_is_refused_by_every_open(tmp_path, content, why):
    _put(tmp_path / "s", Namespace("t1", SALT))
    (tmp_path / "s" / KEY_FILE).write_bytes(content)
    for kwargs in ({"readonly": True}, {"layout": make_layout(4)}):
        with pytest.raises(KeyFileError, match=why) as err:
            open_store(str(tmp_path / "s"), **kwargs)
        assert content.decode("latin-1").strip() not in str(err.value) or not content.strip()  # never echoed
    assert (tmp_path / "s" / KEY_FILE).read_bytes() == content  # left as it was


def test_a_key_file_that_is_a_directory_is_refused(tmp_path):
    # (a key file this user may not read: tests/integration/test_cli_keyfile.py, run without root's capabilities)
    _put(tmp_path / "s", Namespace("t1", SALT))
    (tmp_path / "s" / KEY_FILE).unlink()
    (tmp_path / "s" / KEY_FILE).mkdir()
    for kwargs in ({"readonly": True}, {"layout": make_layout(4)}):
        with pytest.raises(KeyFileError, match="not a regular file"):
            open_store(str(tmp_path / "s"), **kwargs)


def test_a_store_made_before_key_files_is_refused_until_rekey_or_migrate_gives_it_one(tmp_path):
    # a store made before key files is of format 1 (its chain roots keyed by nothing): no key file, and nothing
    # writes one behind anyone's back; `kvc init --rekey` (here) or `kvc migrate` (ensure_key) gives it one
    from kvcache.storage.lmdb.rekey import rekey

    _put(tmp_path / "s", Namespace("t1", SALT), format_1=True)
    (tmp_path / "s" / KEY_FILE).unlink()
    for kwargs in ({"readonly": True}, {"layout": make_layout(4)}):
        with pytest.raises(KeyFileError, match="made before kvc kept one"):
            open_store(str(tmp_path / "s"), **kwargs)
    assert rekey(str(tmp_path / "s")).previous is KeyState.MISSING
    with open_store(str(tmp_path / "s"), make_layout(4)) as rw:
        assert rw.fingerprint_key == read_key(str(tmp_path / "s")) is not None
        assert rw.stats().pages == 2 and rw.verify().ok  # unkeyed chain roots: every page still reachable


def test_rekey_of_a_keyed_store_holding_pages_is_refused_unless_told_they_go(tmp_path):
    from kvcache.errors import KeyMismatch, RepairRefused
    from kvcache.storage.lmdb.rekey import rekey
    from kvcache.storage.lmdb.salvage import audit_location

    _put(tmp_path / "s", Namespace("t1", SALT))
    (tmp_path / "s" / KEY_FILE).unlink()
    with pytest.raises(StoreError, match="none of its 2 pages would be found again"):
        rekey(str(tmp_path / "s"))
    assert not (tmp_path / "s" / KEY_FILE).exists()  # nothing changed
    assert rekey(str(tmp_path / "s"), unreachable_ok=True).previous is KeyState.MISSING
    # the new key is not the one the pages were written under: named as such, nothing removed unless forced
    with pytest.raises(KeyMismatch, match="kvc audit --repair --force"):
        open_store(str(tmp_path / "s"), readonly=True)
    assert [f.kind for f in audit_location(str(tmp_path / "s")).findings] == ["key_mismatch"]
    with pytest.raises(RepairRefused, match="nothing was changed"):
        audit_location(str(tmp_path / "s"), repair=True)
    forced = audit_location(str(tmp_path / "s"), repair=True, force=True)
    assert [r.kind for r in forced.removals] == ["orphan", "orphan"]
    assert audit_location(str(tmp_path / "s")).ok
    with open_store(str(tmp_path / "s"), readonly=True) as ro:
        assert ro.stats().pages == 0 and ro.verify().ok


def test_racing_creators_agree_on_one_key(tmp_path):
    keys = {create_key(str(tmp_path)) for _ in range(5)}
    assert len(keys) == 1 and [p.name for p in tmp_path.iterdir()] == [KEY_FILE]
    assert read_key(str(tmp_path)) in keys


def test_read_key_keeps_its_meaning_bytes_or_none(tmp_path):
    assert read_key(str(tmp_path)) is None  # no key file
    key = create_key(str(tmp_path))
    assert read_key(str(tmp_path)) == key


def test_the_audit_flags_a_key_file_group_or_other_may_read_and_repair_makes_it_0600(tmp_path):
    _put(tmp_path / "s", Namespace("t1", SALT))
    path = tmp_path / "s" / KEY_FILE
    assert key_findings(str(tmp_path / "s")) == []
    os.chmod(path, 0o644)
    found = key_findings(str(tmp_path / "s"))
    assert [(f.kind, f.repaired) for f in found] == [("key_mode", False)] and "0644" in found[0].detail
    assert [(f.kind, f.repaired) for f in key_findings(str(tmp_path / "s"), repair=True)] == [("key_mode", True)]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and key_findings(str(tmp_path / "s")) == []


def test_rekey_makes_a_new_key_and_re_records_fingerprints_on_the_next_write(tmp_path):
    from kvcache.storage.lmdb.rekey import rekey

    ns, other = Namespace("t1", SALT), Namespace("t2")
    old_key, _ = _put(tmp_path / "s", ns, format_1=True)  # chain roots keyed by nothing: the pages outlive the key
    _put(tmp_path / "s", other, create=False)
    (tmp_path / "s" / KEY_FILE).unlink()
    result = rekey(str(tmp_path / "s"))
    assert (result.previous, result.namespaces, result.fingerprints_unknown) == (KeyState.MISSING, 2, 1)
    assert stat.S_IMODE(os.stat(tmp_path / "s" / KEY_FILE).st_mode) == 0o600
    with open_store(str(tmp_path / "s"), readonly=True) as store:
        key = store.fingerprint_key
        recs = {r.extra_key: r for r in store.namespaces()}
    assert recs["t1"].salt_fingerprint == UNKNOWN_FINGERPRINT and recs["t2"].salt_fingerprint is None
    _put(tmp_path / "s", ns, create=False, first=100)  # its next write records it under the new key
    with open_store(str(tmp_path / "s"), readonly=True) as store:
        rec = next(r for r in store.namespaces() if r.extra_key == "t1")
    assert rec.salt_fingerprint == ns.fingerprint(key) != ns.fingerprint(old_key)
    assert display_id(ns.id, key) != display_id(ns.id, old_key)  # what the rekey said changes


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_key_file_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path, kind):
    _put(tmp_path / "s", Namespace("t1", SALT))
    path = tmp_path / "s" / KEY_FILE
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path, 0o600)  # read() of it would wait for a writer forever
    else:
        os.symlink("/dev/zero", path)  # read() of it never ends
    assert key_status(str(tmp_path / "s")).state is KeyState.CORRUPT
    with pytest.raises(KeyFileError, match="not a regular file"):
        open_store(str(tmp_path / "s"), readonly=True)
