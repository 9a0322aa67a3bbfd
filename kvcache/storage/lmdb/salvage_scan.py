"""Records of a damaged store found in its data file's leaf pages, parsed in Python without LMDB (bounds-checked:
a damaged page is skipped, never read past): the other half of a page a damaged tree hides (`scan_file`), every
record that proves itself when no catalogue of sub-databases survives (`copy_scanned`), what the copy lacks and the
file still holds (`recover_missing`, by `recover`), and whether a rebuild would keep anything at all
(`first_proving_pair`, for the survey of `salvage`).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator
from typing import Any

from ...errors import StoreError
from ...types.keys import PAGE_HASH_BYTES
from ...types.shares import decode_shares_record
from ..codec import CHECKSUMS, StoreFormat, decode_format, decode_meta, decode_namespace, decode_or_none
from ..isolated import run_isolated
from ..verify_checks import recorded_roots
from . import pagefile, pagemap, recover
from .bookkeeping import SHARES_PREFIX
from .salvage_child import env_of
from .salvage_copy import Copied, put_raw
from .salvage_proofs import algorithms, meta_proves, page_proves, possible_chain_keys, recorded_roots_in


def scan_file(path: str, new: str, want_pages: set[bytes], want_meta: set[bytes],
              store_records: dict[bytes, bytes]) -> dict[str, list[bytes]]:
    """In a child: find the records of `want_pages` / `want_meta` in the leaf pages of the data file, past the
    B-tree that could not reach them (a damaged branch page hides whole leaves that are intact). Only keys known
    from the other sub-database are taken (a freed page still holds records of pages deleted since: those must not
    come back), and only a record that proves itself: a page whose checksum, seeded by its key, matches; metadata
    that decodes and chains to its key. Parsed in Python, bounds-checked: a damaged page is skipped, never read
    past. Writes what it finds into the fresh store; returns the keys, per sub-database."""
    if not (want_pages or want_meta):
        return {}
    algos = algorithms(store_records)
    chain_keys = possible_chain_keys(new)
    with env_of(new) as store, store.read() as txn:
        recorded = recorded_roots_in(txn, store.dbs)
    pages: dict[bytes, bytes] = {}
    metas: dict[bytes, bytes] = {}
    with open(os.path.join(path, "data.mdb"), "rb") as f:
        data = f.read()
    psize = int.from_bytes(data[40:44], "little") or 4096  # recorded in meta page 0 (LMDB's free db pad field)
    for base in range(2 * psize, len(data) - psize + 1, psize):
        # Any page whose node table fits is parsed as a leaf: its flags or free-space bound may be what was
        # damaged, and every record taken must prove itself anyway (a branch node parsed so proves nothing).
        (lower,) = struct.unpack_from("<H", data, base + 12)
        if not _HEADER_BYTES <= lower <= psize:
            continue
        for i in range((lower - _HEADER_BYTES) // 2):
            node = base + struct.unpack_from("<H", data, base + _HEADER_BYTES + 2 * i)[0]
            if node + _NODE > base + psize:
                continue
            lo, hi, nflags, ksize = struct.unpack_from("<HHHH", data, node)
            key = data[node + _NODE:node + _NODE + ksize]
            if ksize != PAGE_HASH_BYTES or (key not in want_pages and key not in want_meta):
                continue
            size, at = lo | hi << 16, node + _NODE + ksize
            if nflags & _F_BIGDATA:
                over = int.from_bytes(data[at:at + 8], "little") * psize
                at = over + _HEADER_BYTES
                if not 0 < over < len(data) - _HEADER_BYTES:
                    continue
            value = data[at:at + size]
            if len(value) != size:
                continue
            if key in want_pages and key not in pages and page_proves(key, value, algos):
                pages[key] = value
            if key in want_meta and key not in metas and meta_proves(key, value, chain_keys, recorded):
                metas[key] = value
    with env_of(new) as store:
        put_raw(store, store.dbs.pages, list(pages.items()))
        put_raw(store, store.dbs.meta, list(metas.items()))
    return {"pages": list(pages), "meta": list(metas)}


# LMDB's page layout (mdb.c, 64-bit): a 16-byte header (pgno, pad, flags, lower, upper), node offsets from there
# to `lower`; a node is lo, hi, flags, key size (u16 each), the key, then the value (or an overflow page number).
_HEADER_BYTES, _NODE = 16, 8
_F_BIGDATA = 0x01


def copy_scanned(data_file: str, new: str, probe: pagefile.Probe, freed: dict[int, int]) -> Copied:
    """No catalogue could be read: every record of the file's leaf pages that is one of kvc's and proves itself
    (a page's checksum seeded by its key, metadata that chains to its key, a layout record whose id is its key, a
    namespace record naming its own id, the format record), skipping the pages the free list names."""
    found, died = run_isolated(lambda _: _scan_records(data_file, new, probe, set(freed)), result_type=Copied)
    if died is not None:
        raise StoreError(os.path.dirname(data_file), f"rebuilding: scanning the file's pages {died.describe()}")
    return found


def _scan_records(data_file: str, new: str, probe: pagefile.Probe, freed: set[int]) -> Copied:
    """In a child: `copy_scanned`."""
    algos = list(CHECKSUMS.values())
    chain_keys = possible_chain_keys(new)
    got: dict[str, dict[bytes, bytes]] = {db: {} for db in ("pages", "meta", "namespaces", "layouts", "store")}
    engine_metas: dict[bytes, bytes] = {}  # proved once the namespace records (their recorded roots) are in
    with pagefile.mapped(data_file) as data:
        for key, value in _leaf_records(data, probe.page_size, freed):
            if len(key) == PAGE_HASH_BYTES:
                if key not in got["pages"] and page_proves(key, value, algos):
                    got["pages"][key] = value
                elif key not in got["meta"] and meta_proves(key, value, chain_keys):
                    got["meta"][key] = value
                elif key not in got["layouts"] and recover.layout_proves(key, value):
                    got["layouts"][key] = value
                elif key not in got["namespaces"] and recover.namespace_proves(key, value):
                    got["namespaces"][key] = value
                elif getattr(decode_or_none(decode_meta, value), "key", b""):
                    engine_metas.setdefault(key, value)
            elif key == b"format" and isinstance(decode_or_none(decode_format, value), StoreFormat):
                got["store"][key] = value
            elif key.startswith(SHARES_PREFIX) and decode_or_none(decode_shares_record, value) is not None:
                got["store"][key] = value
    recorded = {k: recorded_roots(decode_namespace(v)) for k, v in got["namespaces"].items()}
    for key, value in engine_metas.items():
        if key not in got["meta"] and meta_proves(key, value, chain_keys, recorded):
            got["meta"][key] = value
    with env_of(new) as store:
        for db in ("pages", "meta", "namespaces", "layouts"):
            put_raw(store, getattr(store.dbs, db), list(got[db].items()))
    known = {db: set(got[db]) for db in ("pages", "meta", "namespaces", "layouts")}
    return Copied(known, {}, got["store"])


def _leaf_records(data: bytes, psize: int, freed: set[int]) -> Iterator[tuple[bytes, bytes]]:
    """(key, value) of every node of every leaf page of the file not on the free list, bounds-checked (a value in
    overflow pages included); a node that does not fit is skipped."""
    for pgno in range(2, len(data) // psize):
        base = pgno * psize
        if pgno in freed or struct.unpack_from("<Q", data, base)[0] != pgno:
            continue
        flags = struct.unpack_from("<H", data, base + 10)[0]
        if not flags & pagefile.P_LEAF or flags & pagefile.P_LEAF2:
            continue
        for nflags, key, size, at in pagefile.nodes(data, pgno, psize):
            if nflags & pagefile.F_SUBDATA:
                continue
            if nflags & pagefile.F_BIGDATA:
                over = int.from_bytes(data[at:at + 8], "little")
                if over in freed or not 2 <= over < len(data) // psize:
                    continue
                at = over * psize + _HEADER_BYTES
            value = bytes(data[at:at + size])
            if len(value) == size:
                yield key, value


def free_list(data_file: str, probe: pagefile.Probe) -> dict[int, int]:
    """The file's free list (page -> the transaction that freed it): the whole free-list tree a sound meta page
    names (`pagemap`), else the newest free-list leaf found in the file (`probe`)."""
    if probe.sound_metas or probe.last_txnid:
        found = pagemap.read_map(data_file)
        if found is not None and found.freed:
            return found.freed
    return dict.fromkeys(probe.freed, 0)


def recover_missing(data_file: str, new: str, probe: pagefile.Probe, freed: dict[int, int], copied: Copied,
                    pages_too: bool) -> dict[str, int]:
    """Add to the fresh store what the copy lacks and the file's leaf pages still hold (`recover`); how many records
    of each kind were found ("older": of them, copies a later commit replaced)."""
    def body(_: Callable[[Any], None]) -> recover.Recovered:
        algos = algorithms(copied.store_records)
        chain_keys = possible_chain_keys(new)
        with env_of(new) as store, store.read() as txn:
            have = {db: {bytes(k) for k in txn.cursor(db=getattr(store.dbs, db)).iternext(values=False)}
                    for db in ("pages", "meta", "namespaces", "layouts")}
            metas = [decode_or_none(decode_meta, v) for _, v in txn.cursor(db=store.dbs.meta)]
            recorded = recorded_roots_in(txn, store.dbs)
        have["store"] = set(copied.store_records)
        needs = ({m.ns_id for m in metas if m is not None}, {m.layout_id for m in metas if m is not None})
        with pagefile.mapped(data_file) as data:
            got = recover.recover(data, probe.page_size or pagefile.PAGE_SIZES[0], freed, have, needs,
                                  lambda k, v: page_proves(k, v, algos),
                                  lambda k, v: meta_proves(k, v, chain_keys, recorded), pages_too)
        with env_of(new) as store:
            for db in ("pages", "meta", "namespaces", "layouts"):
                put_raw(store, getattr(store.dbs, db), list(getattr(got, db).items()))
        return got

    got, died = run_isolated(body, result_type=recover.Recovered)
    if died is not None:
        raise StoreError(os.path.dirname(data_file), f"rebuilding: reading the file's leaf pages {died.describe()}")
    for db in ("pages", "meta", "namespaces", "layouts"):
        copied.known[db] |= set(getattr(got, db))
    for key, value in got.store.items():
        copied.store_records.setdefault(key, value)
    return {"page": len(got.pages), "metadata": len(got.meta), "namespace": len(got.namespaces),
            "layout": len(got.layouts), "store": len(got.store), "older": got.older}


def first_proving_pair(path: str, probe: pagefile.Probe) -> bool:
    """Whether the data file's leaf pages (freed ones too: a rebuild falls back on them) hold a page and its
    metadata that both prove themselves: what a rebuild needs to keep anything (read in a child: the scan is
    Python, but the survey must not depend on it surviving)."""
    def scan(_: Callable[[Any], None]) -> bool:
        algos = list(CHECKSUMS.values())
        chain_keys = possible_chain_keys(path)
        pages: set[bytes] = set()
        metas: set[bytes] = set()
        with pagefile.mapped(os.path.join(path, "data.mdb")) as data:
            for _rank, k, v in recover.leaf_nodes(data, probe.page_size or pagefile.PAGE_SIZES[0], {}):
                if len(k) != PAGE_HASH_BYTES:
                    continue
                if page_proves(k, v, algos):
                    pages.add(k)
                elif meta_proves(k, v, chain_keys):
                    metas.add(k)
                else:
                    continue
                if k in pages and k in metas:
                    return True
        return False

    found, died = run_isolated(scan, result_type=bool)
    return bool(found) and died is None
