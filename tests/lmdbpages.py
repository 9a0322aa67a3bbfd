"""A reader of LMDB's on-disk page format (importable as `lmdbpages`), for aiming byte flips at live pages.

It walks an environment's B-trees from its newest meta page the way LMDB 0.9 lays them out (64-bit build): the
main database's leaves name the sub-databases, each sub-database is walked to its branch and leaf pages, and
the values too large for a leaf live in overflow pages (the `data` of the `pages` sub-database). Pages on the
free list are never returned: a flip there would test nothing.

Layout used (mdb.c): a page header is 16 bytes (pgno u64, pad u16, flags u16, then lower/upper u16 or an
overflow count u32); node pointers (u16 each) follow the header up to `lower`; nodes live from `upper` to the
end of the page. A node is lo u16, hi u16, flags u16, key size u16, the key, then the data (a leaf) -- a branch
node's child page number is lo | hi << 16 | flags << 32. The meta page holds, after the header, magic u32,
version u32, address u64, map size u64, then two database records (free, main) of 48 bytes: pad u32, flags u16,
depth u16, branch/leaf/overflow page counts u64 each, entries u64, root u64; then last page u64 and txnid u64.
"""

from __future__ import annotations

import os
import struct

import msgspec

HEADER = 16
P_BRANCH, P_LEAF, P_OVERFLOW, P_LEAF2, P_SUBP = 0x01, 0x02, 0x04, 0x20, 0x40
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
NODE = 8
DB_RECORD = struct.Struct("<IHHQQQQQ")  # pad, flags, depth, branch, leaf, overflow pages, entries, root
INVALID = 0xFFFFFFFFFFFFFFFF


class Page(msgspec.Struct, frozen=True):
    """A live page of the environment."""

    pgno: int
    kind: str  # "branch", "leaf" or "data" (the first page of an overflow run)
    db: str  # the sub-database it belongs to ("" for the main database)
    used: list[tuple[int, int]]  # (start, end) byte ranges in use within the page (after its header)
    span: int = 1  # pages in an overflow run


def page_size(data: bytes) -> int:
    """The environment's page size (recorded in the free database's pad field of meta page 0)."""
    return struct.unpack_from("<I", data, HEADER + 24)[0]


def _meta(data: bytes, psize: int) -> tuple[int, int]:
    """(main root page, txnid) of the newest meta page."""
    best = None
    for pgno in (0, 1):
        base = pgno * psize + HEADER
        txnid = struct.unpack_from("<Q", data, base + 24 + 2 * DB_RECORD.size + 8)[0]
        root = DB_RECORD.unpack_from(data, base + 24 + DB_RECORD.size)[7]
        if best is None or txnid > best[1]:
            best = (root, txnid)
    return best


def live_pages(path: str, records: dict[str, dict[bytes, set[int]]] | None = None) -> list[Page]:
    """Every live branch, leaf and overflow page of the environment at `path` (a directory). `records`: filled with
    where each record of each sub-database lies, db -> key -> the pages holding it (its leaf, its overflow run)."""
    with open(os.path.join(path, "data.mdb"), "rb") as f:
        data = f.read()
    psize = page_size(data)
    root, _ = _meta(data, psize)
    out: list[Page] = []
    subs: list[tuple[str, int]] = []
    _walk(data, psize, root, "", out, subs)
    for name, sub_root in subs:
        _walk(data, psize, sub_root, name, out, [], records)
    return out


def free_list_pages(path: str) -> list[Page]:
    """The pages of the free list's own B-tree (live pages too: LMDB reads them to find pages to reuse)."""
    with open(os.path.join(path, "data.mdb"), "rb") as f:
        data = f.read()
    psize = page_size(data)
    best = max((0, 1), key=lambda p: struct.unpack_from("<Q", data, p * psize + HEADER + 24 + 2 * DB_RECORD.size
                                                       + 8)[0])
    root = DB_RECORD.unpack_from(data, best * psize + HEADER + 24)[7]
    out: list[Page] = []
    _walk(data, psize, root, "free", out, [])
    return out


def _walk(data: bytes, psize: int, root: int, db: str, out: list[Page], subs: list[tuple[str, int]],
          records: dict[str, dict[bytes, set[int]]] | None = None) -> None:
    stack = [root] if root != INVALID else []
    seen: set[int] = set()
    while stack:
        pgno = stack.pop()
        if pgno in seen:
            continue
        seen.add(pgno)
        base = pgno * psize
        flags, lower, upper = struct.unpack_from("<HHH", data, base + 10)
        ptrs = [struct.unpack_from("<H", data, base + HEADER + 2 * i)[0] for i in range((lower - HEADER) // 2)]
        used = [(HEADER, lower), (upper, psize)]
        if flags & P_BRANCH:
            out.append(Page(pgno, "branch", db, used))
            for off in ptrs:
                lo, hi, fl = struct.unpack_from("<HHH", data, base + off)
                stack.append(lo | hi << 16 | fl << 32)
            continue
        if not flags & P_LEAF:
            continue  # not a tree page: the walk met damage; nothing to aim at here
        out.append(Page(pgno, "leaf", db, used))
        if flags & P_LEAF2:
            continue
        for off in ptrs:
            lo, hi, nflags, ksize = struct.unpack_from("<HHHH", data, base + off)
            key = data[base + off + NODE:base + off + NODE + ksize]
            value_at = base + off + NODE + ksize
            held = records.setdefault(db, {}).setdefault(bytes(key), set()) if records is not None else set()
            held.add(pgno)
            if nflags & F_BIGDATA:
                over = struct.unpack_from("<Q", data, value_at)[0]
                count = struct.unpack_from("<I", data, over * psize + 12)[0]
                out.append(Page(over, "data", db, [(HEADER, HEADER + (lo | hi << 16))], count))
                held.update(range(over, over + count))
            elif nflags & F_SUBDATA:
                record = DB_RECORD.unpack_from(data, value_at)
                if nflags & F_DUPDATA:
                    _walk(data, psize, record[7], db, out, [], records)  # a dupsort value's own tree
                else:
                    subs.append((key.decode("latin-1"), record[7]))
