"""LMDB's data file read as bytes, without LMDB: what a repair needs when LMDB itself cannot open the file.

LMDB refuses a file whose two meta pages (pages 0 and 1) are damaged, though every B-tree page behind them may be
intact: the meta pages only say where the catalogue of sub-databases (the main database's root) and the free
list live, and which transaction is the newest. `probe` reads the file page by page (bounds-checked, never past
its end) and finds what a repair can start from:

- a meta page that is sound (then LMDB can read the file once the other slot holds a copy of it);
- else the catalogue: a leaf page naming kvc's sub-databases. Every write transaction writes a new copy of it
  and frees the old one, so several versions may be in the file. The newest is the one the newest free list
  does not name: the free list's records are keyed by the transaction that freed their pages, and the leaf
  holding the greatest key is the newest free list's. A version whose sub-database roots are no longer what they
  were (a freed page reused) is not intact and is never taken;
- and how many bytes of the file hold no readable LMDB page (zeroed or garbled, or missing past a truncation).

`view_meta` then writes a meta page naming the catalogue found, for a copy of the file (never the store's own),
which LMDB opens read-only like any other. Layout used (mdb.c, LMDB 0.9, 64-bit): see `tests/lmdbpages.py`.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec

HEADER = 16  # pgno u64, pad u16, flags u16, lower u16, upper u16 (or an overflow page count u32)
NODE = 8  # lo u16, hi u16, flags u16, key size u16; then the key and the value
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
F_BIGDATA, F_SUBDATA = 0x01, 0x02
MDB_MAGIC, MDB_DATA_VERSION = 0xBEEFC0DE, 1
MDB_INTEGERKEY = 0x08
P_INVALID = 0xFFFFFFFFFFFFFFFF
DB_RECORD = struct.Struct("<IHHQQQQQ")  # pad, flags, depth, branch, leaf, overflow pages, entries, root
FREE_DB_AT, MAIN_DB_AT = 40, 88  # offsets in a meta page of the free list's and the main database's records
LAST_PAGE_AT, TXNID_AT = 136, 144
PAGE_SIZES = (4096, 8192, 16384, 32768, 65536)
SAMPLE_PAGES = 4096  # pages sampled to tell the page size when no meta page records it


class SubDb(msgspec.Struct, frozen=True, array_like=True):
    """A sub-database record of the catalogue: its flags, depth, entries and root page."""

    name: str
    flags: int
    depth: int
    entries: int
    root: int


class Catalogue(msgspec.Struct, frozen=True):
    """One version of the main database's leaf: where it lies and the sub-databases it names."""

    pgno: int
    dbs: list[SubDb]

    def entries(self, name: str) -> int:
        """The records sub-database `name` holds in this version (-1: not named)."""
        return next((d.entries for d in self.dbs if d.name == name), -1)


class Probe(msgspec.Struct, frozen=True):
    """What a repair can start from in a data file (see the module docstring)."""

    size: int  # bytes of the file
    page_size: int
    sound_metas: list[int]  # meta pages (0, 1) that are sound and name a catalogue that is there
    catalogue: Catalogue | None  # the newest intact catalogue (None: none found)
    versions: int  # intact catalogue versions found in the file
    freed: list[int]  # pages the newest free list names (their records are deleted ones)
    unreadable_bytes: int  # bytes in pages that hold no readable LMDB page, plus what a truncation cut off
    lmdb_pages: int  # pages that read as LMDB branch, leaf, overflow or meta pages
    last_txnid: int = 0  # the newest commit a sound meta page records (0: none is sound)
    # the commit that replaced the catalogue taken (it is on the free list as that transaction's; -1: an older one,
    # its commit unknown): what was written after it is found only where the file's leaf pages still hold it. 0:
    # the catalogue taken is the current one
    replaced_by: int = 0
    damaged_roots: list[str] = []  # sub-databases whose root page in the catalogue taken is no tree page now

    @property
    def is_lmdb(self) -> bool:
        """Whether anything of an LMDB environment is in the file."""
        return bool(self.sound_metas) or self.catalogue is not None or self.lmdb_pages > 0

    @property
    def needs_view(self) -> bool:
        """Whether LMDB needs a copy with a rebuilt meta page to read the file."""
        return len(self.sound_metas) < 2


class Extent(msgspec.Struct, frozen=True):
    """How much of a data file there is, against what its newest sound meta page says its last commit wrote.

    LMDB maps the file and trusts that every page up to the last one a meta page names is in it: a file cut
    short (a copy or restore that ran out of disk) makes the first read of a page past its end a SIGBUS, which
    no caller can catch. So every open checks this first (`pagemap.whole`)."""

    size: int  # bytes of the file
    page_size: int  # as the newest sound meta page records it (0: no meta page is sound)
    needed: int  # bytes up to the end of the last page the newest sound meta page names (0: none is sound)
    txnid: int  # the transaction that meta page records (0: none is sound)

    def problem(self) -> str:
        """What is wrong with the file's length, in a few words ("": nothing)."""
        if self.size == 0:
            return "data.mdb is empty (0 bytes)"
        if self.needed > self.size:
            return (f"data.mdb is cut short: it holds {self.size} bytes, its last commit (transaction "
                    f"{self.txnid}) wrote {self.needed}")
        return ""


META_HEAD = 2 * max(PAGE_SIZES)  # bytes read to find both meta pages whatever the page size
NO_META = "data.mdb holds no LMDB meta page"  # how `pagemap.check_open` says no meta page of any size is there


def extent(path: str) -> Extent:
    """The `Extent` of the data file at `path`, read with pread (never mapped: a file that shrinks meanwhile
    cannot fault this read). The meta pages are read before the size: a writer extends the file before it
    writes the meta page naming the new pages, so a commit landing in between never reads as a cut file."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        head = os.pread(fd, META_HEAD, 0)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    psize = _meta_psize(head)
    sound = [p for p in (0, 1) if psize and _meta_sound(head, p, psize)]
    if not sound:
        return Extent(size, 0, 0, 0)
    newest = max(sound, key=lambda s: struct.unpack_from("<Q", head, s * psize + TXNID_AT)[0])
    last, txnid = struct.unpack_from("<QQ", head, newest * psize + LAST_PAGE_AT)
    return Extent(size, psize, (last + 1) * psize, txnid)


@contextmanager
def mapped(path: str) -> Iterator[bytes]:
    """The file at `path` mapped read-only (an empty file: b"")."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            yield b""
            return
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            yield mm  # type: ignore[misc]
        finally:
            mm.close()


def _meta_sound(data: bytes, pgno: int, psize: int) -> bool:
    base = pgno * psize
    if base + TXNID_AT + 8 > len(data):
        return False
    pg, _, flags = struct.unpack_from("<QHH", data, base)
    magic, version = struct.unpack_from("<II", data, base + HEADER)
    return pg == pgno and flags & P_META != 0 and magic == MDB_MAGIC and version == MDB_DATA_VERSION


def _meta_psize(data: bytes) -> int:
    for pgno in (0, 1):
        for psize in PAGE_SIZES:
            if _meta_sound(data, pgno, psize) and struct.unpack_from("<I", data, pgno * psize + FREE_DB_AT)[0] == psize:
                return psize
    return 0


def _guess_psize(data: bytes) -> int:
    """The page size under which the most sampled pages carry their own page number."""
    best, score = PAGE_SIZES[0], -1
    for psize in PAGE_SIZES:
        n = min(len(data) // psize, SAMPLE_PAGES)
        hits = sum(struct.unpack_from("<Q", data, i * psize)[0] == i for i in range(2, n))
        if hits > score:
            best, score = psize, hits
    return best


def _page_kind(data: bytes, pgno: int, psize: int) -> int:
    """The flags of page `pgno` when it reads as an LMDB page at its place (its header carries its number), else 0."""
    base = pgno * psize
    if base + HEADER > len(data):
        return 0
    pg, _, flags = struct.unpack_from("<QHH", data, base)
    if pg != pgno or flags & ~(P_BRANCH | P_LEAF | P_OVERFLOW | P_META | P_LEAF2 | 0x10 | 0x40 | 0x8000 | 0x4000):
        return 0
    if flags & (P_BRANCH | P_LEAF):
        lower, upper = struct.unpack_from("<HH", data, base + 12)
        if not HEADER <= lower <= upper <= psize:
            return 0
    return flags if flags & (P_BRANCH | P_LEAF | P_OVERFLOW | P_META) else 0


def nodes(data: bytes, pgno: int, psize: int) -> Iterator[tuple[int, bytes, int, int]]:
    """(node flags, key, data size, offset of the value) of each node of leaf page `pgno` that lies inside it."""
    base = pgno * psize
    lower = struct.unpack_from("<H", data, base + 12)[0]
    if not HEADER <= lower <= psize:
        return
    for i in range((lower - HEADER) // 2):
        node = base + struct.unpack_from("<H", data, base + HEADER + 2 * i)[0]
        if node < base + HEADER or node + NODE > base + psize:
            continue
        lo, hi, nflags, ksize = struct.unpack_from("<HHHH", data, node)
        if node + NODE + ksize > base + psize:
            continue
        yield nflags, bytes(data[node + NODE:node + NODE + ksize]), lo | hi << 16, node + NODE + ksize


def _catalogue(data: bytes, pgno: int, psize: int, names: tuple[str, ...]) -> Catalogue | None:
    dbs = []
    for nflags, key, size, at in nodes(data, pgno, psize):
        name = key.decode("latin-1")
        if not nflags & F_SUBDATA or name not in names or size != DB_RECORD.size or at + size > len(data):
            return None
        _, flags, depth, _, _, _, entries, root = DB_RECORD.unpack_from(data, at)
        dbs.append(SubDb(name, flags, depth, entries, root))
    return Catalogue(pgno, dbs) if len(dbs) >= 2 and "store" in {d.name for d in dbs} else None


def _intact(data: bytes, cat: Catalogue, psize: int) -> bool:
    """Every sub-database root it names is still a branch or leaf page at its place."""
    return all(d.root == P_INVALID or _page_kind(data, d.root, psize) & (P_BRANCH | P_LEAF) for d in cat.dbs)


def _free_records(data: bytes, pgno: int, psize: int) -> dict[int, list[int]] | None:
    """The records of a free-list leaf (txnid -> page numbers), or None when page `pgno` is not one."""
    out: dict[int, list[int]] = {}
    npages = len(data) // psize
    for nflags, key, size, at in nodes(data, pgno, psize):
        if len(key) != 8 or nflags & F_SUBDATA:
            return None
        if nflags & F_BIGDATA:
            over = struct.unpack_from("<Q", data, at)[0] if at + 8 <= len(data) else 0
            at = over * psize + HEADER
            if not 2 <= over < npages or at + size > len(data):
                return None
        if size < 16 or size % 8 or at + size > len(data):
            return None
        count = struct.unpack_from("<Q", data, at)[0]
        if count < 1 or count != size // 8 - 1:
            return None
        ids = list(struct.unpack_from(f"<{count}Q", data, at + 8))
        if any(not 2 <= p < npages for p in ids):
            return None
        out[struct.unpack_from("<Q", key)[0]] = ids
    return out or None


def probe(path: str, names: tuple[str, ...]) -> Probe:
    """Read the data file at `path` (see the module docstring); `names`: the sub-databases a catalogue names."""
    with mapped(path) as data:
        size = len(data)
        psize = _meta_psize(data) or _guess_psize(data)
        npages = size // psize
        sound = [p for p in (0, 1) if _meta_sound(data, p, psize)]
        unreadable = size - npages * psize  # a torn last page
        lmdb_pages = 0
        catalogues: list[Catalogue] = []
        free_leaves: list[dict[int, list[int]]] = []
        skip_to = 2
        for pgno in range(2, npages):
            if pgno < skip_to:
                continue  # an overflow run's continuation
            kind = _page_kind(data, pgno, psize)
            if not kind:
                unreadable += psize
                continue
            lmdb_pages += 1
            if kind & P_OVERFLOW:
                run = struct.unpack_from("<I", data, pgno * psize + 12)[0]
                skip_to = pgno + max(run, 1)
            elif kind & P_LEAF and not kind & P_LEAF2:
                cat = _catalogue(data, pgno, psize, names)
                if cat is not None:
                    catalogues.append(cat)
                    continue
                free = _free_records(data, pgno, psize)
                if free is not None:
                    free_leaves.append(free)
        unreadable += sum(psize for p in (0, 1) if p not in sound and (p + 1) * psize <= size)
        if sound:
            last = max(struct.unpack_from("<Q", data, p * psize + LAST_PAGE_AT)[0] for p in sound)
            unreadable += max(0, (last + 1) * psize - size)  # cut off by a truncation
        free_list = max(free_leaves, key=lambda r: max(r)) if free_leaves else {}
        freed_by = {p: txn for txn, ids in free_list.items() for p in ids}
        freed = sorted(freed_by)
        freed_set = set(freed)
        intact = [c for c in catalogues if _intact(data, c, psize)]
        recorded = _recorded_catalogue(data, sound, psize, names)
        current = [c for c in intact if c.pgno not in freed_set and not any(d.root in freed_set for d in c.dbs)]
        # several versions the newest free list does not name: the one with the most records (a version whose
        # pages were reused loses its roots first and is not intact)
        newest = max(current or intact, key=lambda c: (sum(d.entries for d in c.dbs), c.pgno), default=None)
        last_txnid = max((struct.unpack_from("<Q", data, p * psize + TXNID_AT)[0] for p in sound), default=0)
        if recorded is not None and not (len(sound) == 1 and recorded.pgno in freed_set and newest in current):
            # the one the newest sound meta page names: the current catalogue, even when a sub-database's root is
            # damaged (an older version would lose every record written since; what the damaged root hid is
            # looked for in the file's pages)
            chosen: Catalogue | None = recorded
            replaced_by = 0
        else:
            # no sound meta page names a catalogue, or the one left names a catalogue a later transaction freed
            # (the newer meta page is the damaged one): take the newest found in the file
            chosen = newest
            # an older catalogue when the free list names it, or when sound meta pages name another one that is
            # lost: its commit is the one that freed it (-1: unknown)
            older = chosen is not None and (chosen.pgno in freed_by or (bool(sound) and recorded is None))
            replaced_by = (freed_by.get(chosen.pgno) or -1) if chosen is not None and older else 0
            sound = []  # the copy gets rebuilt meta pages
        damaged = [d.name for d in chosen.dbs if d.root != P_INVALID
                   and not _page_kind(data, d.root, psize) & (P_BRANCH | P_LEAF)] if chosen is not None else []
        return Probe(size, psize, sound, chosen, len(intact), freed, unreadable, lmdb_pages, last_txnid,
                     replaced_by, damaged)


def _recorded_catalogue(data: bytes, sound: list[int], psize: int, names: tuple[str, ...]) -> Catalogue | None:
    """The catalogue the newest sound meta page names, when it reads as one."""
    if not sound:
        return None
    best = max(sound, key=lambda s: struct.unpack_from("<Q", data, s * psize + TXNID_AT)[0])
    root = DB_RECORD.unpack_from(data, best * psize + MAIN_DB_AT)[7]
    if not 2 <= root < len(data) // psize or not _page_kind(data, root, psize) & P_LEAF:
        return None
    return _catalogue(data, root, psize, names)


def view_meta(p: Probe, slot: int) -> bytes:
    """A meta page for slot 0 or 1 of a copy of the probed file: a sound meta page of the file when there is one,
    else one naming the catalogue found (an empty free list; the copy is only ever read)."""
    if p.catalogue is None:
        raise ValueError("no catalogue to name")
    psize = p.page_size
    page = bytearray(psize)
    struct.pack_into("<QHH", page, 0, slot, 0, P_META)
    struct.pack_into("<IIQQ", page, HEADER, MDB_MAGIC, MDB_DATA_VERSION, 0, max(p.size, psize * 2))
    DB_RECORD.pack_into(page, FREE_DB_AT, psize, MDB_INTEGERKEY, 0, 0, 0, 0, 0, P_INVALID)
    DB_RECORD.pack_into(page, MAIN_DB_AT, 0, 0, 1, 0, 1, 0, len(p.catalogue.dbs), p.catalogue.pgno)
    struct.pack_into("<QQ", page, LAST_PAGE_AT, max(p.size // psize - 1, 1), 1 + slot)
    return bytes(page)


def sound_meta_copy(path: str, p: Probe, slot: int) -> bytes:
    """The file's newest sound meta page, renumbered for `slot`."""
    with mapped(path) as data:
        best = max(p.sound_metas, key=lambda s: struct.unpack_from("<Q", data, s * p.page_size + TXNID_AT)[0])
        page = bytearray(data[best * p.page_size:(best + 1) * p.page_size])
    struct.pack_into("<Q", page, 0, slot)
    return bytes(page)
