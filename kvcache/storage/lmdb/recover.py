"""Records a rebuild takes from the data file's leaf pages where LMDB's trees no longer reach them.

A rebuild (`salvage`) first copies what LMDB's trees reach. A damaged root or branch page hides records that are
still whole in the file: a `namespaces` or `layouts` leaf zeroed takes every namespace or layout record with it,
though each page filed under them is intact; a `store` leaf takes the format record. This module finds, in the
file's own leaf pages (bounds-checked, in a child), the records the copy lacks, each one proving itself:

- pages and their metadata (a page's checksum seeded by its key; metadata that chains to its key), from live
  leaves only -- a leaf the free list names may hold a page deleted since (an offboarding must not come undone;
  the other half of a page a live tree names is looked for in every leaf, `salvage_scan.scan_file`) -- and only when
  both halves are there;
- namespace and layout records (a namespace record names its own id, a layout record is its layout's id), for the
  pages kept that need them: from a live leaf, else from the newest copy a freed leaf still holds (the copy an
  earlier commit replaced: the identity is the same, its counters are recounted);
- the store's own records: its format record (only `kvc migrate` changes it, and it rewrites the whole file) and
  its payload limits, newest copy first; shares from live leaves only (an older copy may be one since cleared).

`freed`: the free list (page -> the transaction that freed it), as complete as the file gives it: the one a
sound meta page's free-list tree holds (`pagemap`), else the newest free-list leaf found (`pagefile.probe`).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from ...types.keys import PAGE_HASH_BYTES
from ...types.shares import decode_shares_record
from ..codec import StoreFormat, decode_format, decode_layout, decode_meta, decode_namespace, decode_or_none
from . import pagefile
from .bookkeeping import SHARES_PREFIX

LIVE = 1 << 62  # the rank of a record in a live leaf: above any transaction id a freed leaf has
LIMIT_KEYS = (b"capacity", b"ns_quota")  # u64 payload limits in `store`


class Recovered(msgspec.Struct):
    """What `recover` took from the file's leaves, per sub-database (key -> value)."""

    pages: dict[bytes, bytes]
    meta: dict[bytes, bytes]
    namespaces: dict[bytes, bytes]
    layouts: dict[bytes, bytes]
    store: dict[bytes, bytes]
    older: int  # namespace, layout and store records taken from a freed leaf (an older copy)


def leaf_nodes(data: Any, psize: int, freed: dict[int, int]) -> Iterator[tuple[int, bytes, bytes]]:
    """(rank, key, value) of every node of every leaf page of the file: rank LIVE for a leaf the free list does not
    name, else the transaction that freed it. A value in overflow pages is read when its run lies inside the file;
    a node that does not fit its page is skipped."""
    npages = len(data) // psize
    for pgno in range(2, npages):
        base = pgno * psize
        if struct.unpack_from("<Q", data, base)[0] != pgno:
            continue
        flags = struct.unpack_from("<H", data, base + 10)[0]
        if not flags & pagefile.P_LEAF or flags & pagefile.P_LEAF2:
            continue
        rank = freed.get(pgno, LIVE)
        for nflags, key, size, at in pagefile.nodes(data, pgno, psize):
            if nflags & pagefile.F_SUBDATA:
                continue
            if nflags & pagefile.F_BIGDATA:
                if at + 8 > len(data):
                    continue
                over = int.from_bytes(data[at:at + 8], "little")
                if not 2 <= over < npages or (rank == LIVE and over in freed):
                    continue  # a live leaf naming a freed run: not the value it had
                at = over * psize + pagefile.HEADER
            value = bytes(data[at:at + size])
            if len(value) == size:
                yield rank, key, value


class _Best:
    """The highest-ranked value seen per key."""

    def __init__(self) -> None:
        self.values: dict[bytes, tuple[int, bytes]] = {}

    def offer(self, rank: int, key: bytes, value: bytes) -> None:
        if rank > self.values.get(key, (-1, b""))[0]:
            self.values[key] = (rank, value)


def recover(data: Any, psize: int, freed: dict[int, int], have: dict[str, set[bytes]],
            needs: tuple[set[bytes], set[bytes]], page_proves: Callable[[bytes, Any], bool],
            meta_proves: Callable[[bytes, Any], bool], pages_too: bool) -> Recovered:
    """Find the records the copy lacks (`have`: keys per sub-database it holds, "store" included) in the leaves of
    `data` (see the module docstring). `needs`: the namespace and layout ids the pages it holds are filed under.
    `pages_too`: look for pages and metadata too (a copy from a tree; a scan of the file took them already)."""
    pages, meta, namespaces, layouts, store = _Best(), _Best(), _Best(), _Best(), _Best()
    for rank, key, value in leaf_nodes(data, psize, freed):
        if len(key) == PAGE_HASH_BYTES:
            if pages_too and rank == LIVE and key not in have["pages"] and page_proves(key, value):
                pages.offer(rank, key, value)
            elif pages_too and rank == LIVE and key not in have["meta"] and meta_proves(key, value):
                meta.offer(rank, key, value)
            elif key not in have["layouts"] and layout_proves(key, value):
                layouts.offer(rank, key, value)
            elif key not in have["namespaces"] and namespace_proves(key, value):
                namespaces.offer(rank, key, value)
        elif key in have["store"]:
            continue
        elif key == b"format" and isinstance(decode_or_none(decode_format, value), StoreFormat):
            store.offer(rank, key, value)
        elif key in LIMIT_KEYS and len(value) == 8:
            store.offer(rank, key, value)
        elif rank == LIVE and key.startswith(SHARES_PREFIX) and decode_or_none(decode_shares_record, value):
            store.offer(rank, key, value)
    # a page needs both halves
    got_pages = {k: v for k, (_, v) in pages.values.items() if k in meta.values or k in have["meta"]}
    got_meta = {k: v for k, (_, v) in meta.values.items() if k in pages.values or k in have["pages"]}
    need_ns, need_layouts = set(needs[0]), set(needs[1])
    for raw in got_meta.values():
        m = decode_meta(raw)
        need_ns.add(m.ns_id)
        need_layouts.add(m.layout_id)
    got_ns = {k: rv for k, rv in namespaces.values.items() if k in need_ns}
    got_layouts = {k: rv for k, rv in layouts.values.items() if k in need_layouts}
    older = sum(rank != LIVE for rank, _ in [*got_ns.values(), *got_layouts.values(), *store.values.values()])
    return Recovered(got_pages, got_meta, {k: v for k, (_, v) in got_ns.items()},
                     {k: v for k, (_, v) in got_layouts.items()}, {k: v for k, (_, v) in store.values.items()},
                     older)


def layout_proves(key: bytes, value: Any) -> bool:
    """A layout record stored under its layout's id."""
    record = decode_or_none(decode_layout, value)
    return record is not None and record.layout.layout_id == key


def namespace_proves(key: bytes, value: Any) -> bool:
    """A namespace record stored under the id it names."""
    record = decode_or_none(decode_namespace, value)
    return record is not None and record.ns_id_hex == key.hex()
