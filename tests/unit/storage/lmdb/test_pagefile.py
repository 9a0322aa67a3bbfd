"""`pagefile`: LMDB's data file read without LMDB -- the probe a repair starts from (issue 25, item 1)."""

import os

from kvcache.storage.lmdb import pagefile
from kvcache.storage.lmdb.env import DB_NAMES

from .test_salvage import build, stored, zero_meta_pages


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


def test_a_file_short_of_what_its_meta_page_names_is_cut_only_when_a_live_page_lies_past_its_end(tmp_path):
    """A commit may allocate pages it never writes (freed again in the same transaction): a file shorter than its
    meta page says is whole while only such pages lie past its end, and cut short once a live page does (issue 36:
    LMDB reads a live page past the end as a SIGBUS)."""
    import struct

    from kvcache.storage.lmdb import pagemap

    path = str(tmp_path / "s")
    written = build(path, docs=2)
    data = os.path.join(path, "data.mdb")
    size = os.path.getsize(data)
    with open(data, "r+b") as f:  # the last commit names three more pages than the file holds: never written
        for slot in (0, 1):
            f.seek(slot * 4096 + pagefile.LAST_PAGE_AT)
            last = struct.unpack("<Q", f.read(8))[0]
            f.seek(slot * 4096 + pagefile.LAST_PAGE_AT)
            f.write(struct.pack("<Q", last + 3))
    assert pagefile.extent(data).needed > size and pagemap.whole(path) == ""
    assert stored(path) == written  # it opens and reads as before
    freed = pagemap.read_map(data).freed
    last_live = max(p for p in range(2, size // 4096) if p not in freed)  # every other page is live
    os.truncate(data, last_live * 4096)  # the last live page gone
    problem = pagemap.whole(path)
    assert problem.startswith("data.mdb is cut short") and "past the end of the file" in problem
