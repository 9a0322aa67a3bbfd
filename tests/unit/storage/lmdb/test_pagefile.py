"""`pagefile`: LMDB's data file read without LMDB -- the probe a repair starts from (issue 25, item 1)."""

import os

from kvcache.storage.lmdb import pagefile
from kvcache.storage.lmdb.env import DB_NAMES

from .test_salvage import build, zero_meta_pages


def test_probe_tells_a_sound_file_a_zeroed_meta_and_junk_apart(tmp_path):
    path = str(tmp_path / "s")
    build(path, docs=2)
    sound = pagefile.probe(os.path.join(path, "data.mdb"), DB_NAMES)
    assert sound.sound_metas == [0, 1] and sound.catalogue is not None and sound.unreadable_bytes == 0
    zero_meta_pages(path)
    lost = pagefile.probe(os.path.join(path, "data.mdb"), DB_NAMES)
    assert lost.sound_metas == [] and lost.catalogue == sound.catalogue and lost.needs_view
    junk = tmp_path / "junk"
    junk.write_bytes(b"not lmdb at all " * 10_000)
    probe = pagefile.probe(str(junk), DB_NAMES)
    assert not probe.is_lmdb and probe.unreadable_bytes == probe.size


def test_a_meta_page_rebuilt_for_a_copy_names_the_catalogue_found(tmp_path):
    import lmdb

    path = str(tmp_path / "s")
    build(path, docs=2)
    zero_meta_pages(path)
    probe = pagefile.probe(os.path.join(path, "data.mdb"), DB_NAMES)
    with open(os.path.join(path, "data.mdb"), "r+b") as f:
        f.write(pagefile.view_meta(probe, 0) + pagefile.view_meta(probe, 1))
    env = lmdb.open(path, readonly=True, lock=False, max_dbs=16)
    try:
        with env.begin() as txn:
            assert sorted(bytes(k).decode() for k, _ in txn.cursor()) == sorted(DB_NAMES)
            pages = env.open_db(b"pages", txn=txn, create=False)
            assert txn.stat(pages)["entries"] == 40 == sum(1 for _ in txn.cursor(db=pages))
    finally:
        env.close()
