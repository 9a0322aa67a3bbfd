"""LMDB's page map checked against itself: what LMDB trusts blindly, and an audit must not.

LMDB reads a page by the number a branch node or a meta page gives and believes what it finds: it never compares a
page's header with its place in the file, nor a page's flags with its place in the tree. A live page whose header
records another page number reads back fine; the next write that copies it frees the page its header names, and
a later commit overwrites that page while it is still live (the damage spreads, pages are lost). A page flagged
as a leaf at a branch's place (or the reverse) sends a cursor into bytes it takes for nodes. And a page that is
both live and on the free list is overwritten by the next writer that takes it.

`read_map` walks, from one meta page (by its transaction id: the snapshot a read transaction holds), every
B-tree of the environment -- the free list, the catalogue of sub-databases, each sub-database, the dupsort trees
inside them -- and every overflow run a leaf names, reading each page with pread (bounds-checked, never mapped:
a file cut short cannot fault it), and checks:

- each live page's header: its page number against its position, its flags against its place (a branch above
  the tree's depth, a leaf at it, `P_LEAF2` leaves in a dupfixed tree only, `P_OVERFLOW` where a leaf names an
  overflow run, with the run's length), its node table inside the page;
- each page is reached once, lies inside the pages the meta page names, and is not on the free list;
- each sub-database's record: its depth and its branch, leaf and overflow page counts against the walk.

What it returns are facts (`PageMap`): the free list (which page each transaction freed: what a repair may skip)
and the problems found, each one line. Layout used (mdb.c, LMDB 0.9, 64-bit): `pagefile` and `tests/lmdbpages.py`.
"""

from __future__ import annotations

import fcntl
import os
import struct

import msgspec

from ...errors import NotAStore, StoreDamaged
from .pagefile import (
    DB_RECORD,
    F_BIGDATA,
    F_SUBDATA,
    FREE_DB_AT,
    HEADER,
    LAST_PAGE_AT,
    MAIN_DB_AT,
    META_HEAD,
    NO_META,
    NODE,
    P_BRANCH,
    P_INVALID,
    P_LEAF,
    P_LEAF2,
    P_OVERFLOW,
    TXNID_AT,
    _meta_psize,
    _meta_sound,
    extent,
)

F_DUPDATA = 0x04  # a node's data is a set of duplicates: a sub-page inline, or (with F_SUBDATA) a tree of its own
MDB_DUPSORT, MDB_DUPFIXED = 0x04, 0x10
PROBLEMS_LISTED = 20  # problems named one by one; the rest are counted


class PageMap(msgspec.Struct, frozen=True):
    """One snapshot's page map as `read_map` found it."""

    txnid: int  # the transaction whose meta page the walk started from
    page_size: int
    last_page: int  # the last page that meta page names
    live: int  # pages reached: branch, leaf and overflow pages of every tree (the free list's own included)
    freed: dict[int, int]  # page -> the transaction that freed it (the free list of that snapshot)
    problems: list[str]  # each one line; PROBLEMS_LISTED at most, then one that counts the rest


def meta_txnids(path: str) -> list[int]:
    """The transaction ids of the data file's sound meta pages (newest first)."""
    with open(path, "rb") as f:
        head = os.pread(f.fileno(), META_HEAD, 0)
    psize = _meta_psize(head)
    if not psize:
        return []
    found = [struct.unpack_from("<Q", head, p * psize + TXNID_AT)[0] for p in (0, 1) if _meta_sound(head, p, psize)]
    return sorted(found, reverse=True)


def read_map(path: str, txnid: int | None = None) -> PageMap | None:
    """The page map of the data file at `path` from its meta page of transaction `txnid` (None: the newest sound
    one). None when no sound meta page records that transaction (a writer has moved on: read it again)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        head = os.pread(fd, META_HEAD, 0)
        psize = _meta_psize(head)
        metas = [p for p in (0, 1) if psize and _meta_sound(head, p, psize)]
        stamps = {p: struct.unpack_from("<Q", head, p * psize + TXNID_AT)[0] for p in metas}
        chosen = [p for p in metas if txnid is None or stamps[p] == txnid]
        if not chosen:
            return None
        slot = max(chosen, key=stamps.__getitem__)
        base = slot * psize
        last = struct.unpack_from("<Q", head, base + LAST_PAGE_AT)[0]
        walk = _Walk(fd, psize, last)
        walk.free_list(DB_RECORD.unpack_from(head, base + FREE_DB_AT))
        walk.catalogue(DB_RECORD.unpack_from(head, base + MAIN_DB_AT))
        walk.overlap()
        return PageMap(stamps[slot], psize, last, len(walk.owner), walk.freed, walk.listed())
    finally:
        os.close(fd)


SMALL_DBS = ("namespaces", "layouts", "store")  # walked whole at every open: a few pages each


def check_open(path: str, writer: bool = False) -> str:
    """What an open must know before LMDB maps the data file at `path`, in a few words ("": nothing found).
    Cheap: the two meta pages, the catalogue, the records every open reads (the namespace registry, the layouts,
    the store's own records: walked whole) and the root page of every other tree; for a `writer`, the free list
    too (every commit reads it: a damaged one fails every write). Damage deeper in the large trees is the
    audit's to find (`read_map`)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        head = os.pread(fd, META_HEAD, 0)
        psize = _meta_psize(head)
        for slot in (0, 1):
            if not psize or not _meta_sound(head, slot, psize):
                return (f"LMDB's meta page {slot} is unreadable" if psize else
                        f"{NO_META} (it is not an LMDB file, or its first pages are lost)")
        slot = max((0, 1), key=lambda p: struct.unpack_from("<Q", head, p * psize + TXNID_AT)[0])
        base = slot * psize
        walk = _Walk(fd, psize, struct.unpack_from("<Q", head, base + LAST_PAGE_AT)[0], shallow=True)
        if writer:
            walk.shallow = False
            walk.free_list(DB_RECORD.unpack_from(head, base + FREE_DB_AT))
            walk.shallow = True
        walk.catalogue(DB_RECORD.unpack_from(head, base + MAIN_DB_AT), whole=SMALL_DBS)
        return walk.problems[0] if walk.problems else ""
    finally:
        os.close(fd)


PAST_END = "past the end of the file"  # how a problem says a live page lies beyond the file's last byte


def live_past_end(path: str) -> str:
    """The first live page of the data file at `path` that lies past its end, in a few words ("": none). LMDB's
    last commit may name pages it never wrote (pages allocated and freed again in one transaction go on the free
    list unwritten), so a file shorter than its meta page says is not cut short by itself: only a live page past
    its end is a read LMDB would die of (SIGBUS). Walks every tree page (each overflow run by its bounds, unread);
    run only when the file is short of what its meta page names."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        head = os.pread(fd, META_HEAD, 0)
        psize = _meta_psize(head)
        metas = [p for p in (0, 1) if psize and _meta_sound(head, p, psize)]
        if not metas:
            return ""
        slot = max(metas, key=lambda p: struct.unpack_from("<Q", head, p * psize + TXNID_AT)[0])
        base = slot * psize
        walk = _Walk(fd, psize, struct.unpack_from("<Q", head, base + LAST_PAGE_AT)[0], read_runs=False)
        walk.free_list(DB_RECORD.unpack_from(head, base + FREE_DB_AT))
        walk.catalogue(DB_RECORD.unpack_from(head, base + MAIN_DB_AT))
        return next((p for p in walk.problems if PAST_END in p), "")
    finally:
        os.close(fd)


def whole(path: str) -> str:
    """What keeps LMDB from reading the store directory `path`'s data file safely, in a few words ("": nothing
    found, or no data file: the open says why). An empty file is one: LMDB would take it for a new environment and
    write meta pages into it."""
    data = os.path.join(path, "data.mdb")
    try:
        found = extent(data)
        if found.size == 0 and _waited_for_creator(path):
            found = extent(data)
        if found.size and found.needed > found.size:
            past = live_past_end(data)  # pages its last commit allocated and never wrote are no loss
            return f"{found.problem()} ({past})" if past else ""
    except OSError:
        return ""
    return found.problem()


def _waited_for_creator(path: str) -> bool:
    """Wait until no process holds LMDB's lock file exclusively (LMDB's first opener does while it writes a new
    environment's meta pages: an empty data file may be one being created this instant); whether it waited. Never
    when this process has the store open: closing any descriptor of the lock file drops this process's own LMDB
    locks (POSIX), so it is not opened then."""
    from .env import ENVS

    if path in ENVS:
        return False
    try:
        fd = os.open(os.path.join(path, "lock.mdb"), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH, 1, 0, 0)  # waits while a creator holds it exclusively
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # releases the shared lock with it


def damaged_detail(problem: str) -> str:
    """The rest of the line that refuses a store whose data file has `problem`: what to do."""
    return (f"{problem}; LMDB cannot read it safely, so nothing opens it. `kvc audit` says what it holds, and "
            f"`kvc audit --repair` rebuilds the store from what is left (keeping the file beside it); or restore "
            f"the store from a backup")


def refuse_damaged(path: str, writer: bool = False) -> None:
    """StoreDamaged (one line: what, and the way out) when the store directory `path`'s data file cannot be
    mapped safely (`whole`), or what every open reads is damaged (`check_open`: the meta pages, the
    catalogue, the registry, the layouts, the store's records, each tree's root; a `writer`'s free list)."""
    problem = whole(path) or _settled_check(os.path.join(path, "data.mdb"), writer)
    if problem.startswith(NO_META):  # nothing says it ever was a store: not one (nor anything LMDB may map)
        raise NotAStore(path, damaged_detail(problem))
    if problem:
        raise StoreDamaged(path, damaged_detail(problem))


OPEN_CHECK_ATTEMPTS = 3  # walks a writer may overtake before the open check gives way to LMDB's own reads


def _settled_check(data: str, writer: bool) -> str:
    """`check_open`'s answer, believed only when no commit landed during its walk ("": none found, or the walk kept
    being overtaken). A raw read holds no LMDB reader slot, so on a store other processes write, the pages of the
    snapshot it walks may be freed by the next commit and reused by the one after: a walk that found a problem while
    the newest transaction moved is made again; a store whose writers keep overtaking it is left to LMDB, which
    reads its own snapshots safely (deeper damage is the audit's to find). An OSError: "" (the open says why)."""
    for _ in range(OPEN_CHECK_ATTEMPTS):
        try:
            before = extent(data).txnid
            problem = check_open(data, writer)
            if not problem or extent(data).txnid == before:
                return problem
        except OSError:
            return ""
    return ""


def _flag_names(flags: int) -> str:
    names = [n for bit, n in ((P_BRANCH, "branch"), (P_LEAF, "leaf"), (P_OVERFLOW, "overflow"), (P_LEAF2, "leaf2"),
                              (0x08, "meta")) if flags & bit]
    return "+".join(names) if names else f"0x{flags:04x} (no page kind)"


class _Walk:
    """One walk of the page map: the pages reached (and from where), the free list, the problems."""

    def __init__(self, fd: int, psize: int, last: int, shallow: bool = False, read_runs: bool = True) -> None:
        self.fd, self.psize, self.last = fd, psize, last
        self.shallow = shallow  # root pages only (but for the trees walked whole), no counts, no overflow runs
        self.read_runs = read_runs  # read each overflow run's first page (False: check its bounds only)
        self.file_pages = os.fstat(fd).st_size // psize
        self.owner: dict[int, str] = {}  # page -> the sub-database (or "free list") that reached it
        self.freed: dict[int, int] = {}
        self.problems: list[str] = []
        self.walked = [0, 0, 0]  # branch, leaf and overflow pages of the tree walked last

    def problem(self, text: str) -> None:
        self.problems.append(text)

    def listed(self) -> list[str]:
        extra = len(self.problems) - PROBLEMS_LISTED
        return self.problems[:PROBLEMS_LISTED] + ([f"... and {extra} more problem(s) of LMDB's page map"]
                                                  if extra > 0 else [])

    def page(self, pgno: int) -> bytes:
        return os.pread(self.fd, self.psize, pgno * self.psize)

    # -- the trees -----------------------------------------------------------------------------------------

    def free_list(self, record: tuple[int, ...]) -> None:
        """The free list's tree: its pages are live; the pages its records list are free (`freed`)."""
        for key, value in self.tree("free list", record, dupfixed=False):
            if len(key) != 8 or len(value) < 8:
                self.problem(f"free list: a record of {len(key)}-byte key and {len(value)}-byte value is not a "
                             f"transaction's list of freed pages")
                continue
            count = struct.unpack_from("<Q", value)[0]
            if count * 8 + 8 != len(value):
                self.problem(f"free list: the record of transaction {struct.unpack('<Q', key)[0]} counts {count} "
                             f"pages in {len(value)} bytes")
                continue
            txn = struct.unpack("<Q", key)[0]
            for pg in struct.unpack_from(f"<{count}Q", value, 8):
                self.freed[pg] = txn

    def catalogue(self, record: tuple[int, ...], whole: tuple[str, ...] = ()) -> None:
        """The main database (the catalogue of sub-databases), then each sub-database it names (a shallow walk:
        those in `whole` whole, the others their root page only)."""
        subs: list[tuple[str, tuple[int, ...]]] = []
        deep, self.shallow = self.shallow, False
        for key, value in self.tree("the catalogue of sub-databases", record, dupfixed=False, subs=True):
            if len(value) == DB_RECORD.size:
                subs.append((key.decode("latin-1"), DB_RECORD.unpack(value)))
        for name, sub in subs:
            self.shallow = deep and name not in whole
            self.tree(name, sub, dupfixed=bool(sub[1] & MDB_DUPFIXED), dupsort=bool(sub[1] & MDB_DUPSORT))
        self.shallow = deep

    def tree(self, name: str, record: tuple[int, ...], dupfixed: bool, dupsort: bool = False,
             subs: bool = False, nested: bool = False) -> list[tuple[bytes, bytes]]:
        """Walk one B-tree from `record` (a DB_RECORD), checking each page (see the module docstring). Returns
        the (key, value) of its leaf nodes that are neither overflow runs nor dupsort sets when the tree is the
        free list or the catalogue (`subs`), else nothing (the values are not needed)."""
        _, _, depth, branches, leaves, overflows, _, root = record
        out: list[tuple[bytes, bytes]] = []
        label = f"sub-database '{name}'" if name not in ("free list", "the catalogue of sub-databases") else name
        if nested:
            label = f"a duplicate set of {label}"
        self.walked = [0, 0, 0]
        if root == P_INVALID:
            if depth or branches or leaves or overflows:
                self.problem(f"{label} has no root page, yet its record counts depth {depth} and "
                             f"{branches + leaves + overflows} page(s)")
            return out
        if not 1 <= depth <= 64:
            self.problem(f"{label}: its record gives depth {depth}, which no B-tree has")
            return out
        walked = [0, 0, 0]  # branch, leaf, overflow pages
        stack: list[tuple[int, int, int | None]] = [(root, 1, None)]
        while stack:
            pgno, level, via = stack.pop()
            where = (f"page {pgno} (the root of {label})" if via is None else
                     f"page {pgno} (a child of page {via} in {label})")
            body = self._reach(pgno, where, label)
            if body is None:
                continue
            leaf_level = level == depth
            want = (P_LEAF | (P_LEAF2 if dupfixed and nested else 0)) if leaf_level else P_BRANCH
            flags, lower, upper = struct.unpack_from("<HHH", body, 10)
            if flags != want:
                self.problem(f"{where} is flagged {_flag_names(flags)} where its place at level {level} of {depth} "
                             f"makes it a {_flag_names(want)}: LMDB would read it as what its flags say")
                if not flags & (P_BRANCH | P_LEAF):
                    continue
            if not (HEADER <= lower <= upper <= self.psize and (lower - HEADER) % 2 == 0):
                self.problem(f"{where}: its node table ({lower}, {upper}) does not fit a {self.psize}-byte page")
                continue
            walked[0 if not leaf_level else 1] += 1
            n = (lower - HEADER) // 2
            if want & P_LEAF2 or self.shallow:
                continue  # fixed-size keys packed after the header: no nodes to follow; or the root page only
            for i in range(n):
                at = struct.unpack_from("<H", body, HEADER + 2 * i)[0]
                if not upper <= at <= self.psize - NODE:
                    self.problem(f"{where}: node {i} lies at offset {at}, outside the page's nodes")
                    continue
                lo, hi, nflags, ksize = struct.unpack_from("<HHHH", body, at)
                if not leaf_level:
                    stack.append((lo | hi << 16 | nflags << 32, level + 1, pgno))
                    continue
                key_end = at + NODE + ksize
                if key_end > self.psize:
                    self.problem(f"{where}: node {i}'s key runs past the end of the page")
                    continue
                key, size = body[at + NODE:key_end], lo | hi << 16
                if nflags & F_BIGDATA:
                    if key_end + 8 > self.psize:
                        self.problem(f"{where}: node {i}'s overflow page number runs past the end of the page")
                        continue
                    over = struct.unpack_from("<Q", body, key_end)[0]
                    walked[2] += self._overflow(over, size, pgno, label)
                    if subs or name == "free list":
                        out.append((key, self._overflow_value(over, size)))
                    continue
                if key_end + size > self.psize:
                    self.problem(f"{where}: node {i}'s value runs past the end of the page")
                    continue
                value = body[key_end:key_end + size]
                if nflags & F_DUPDATA and nflags & F_SUBDATA and dupsort and size == DB_RECORD.size:
                    self.tree(name, DB_RECORD.unpack(value), dupfixed, dupsort, nested=True)
                    # a duplicate set's pages count in its sub-database's record too
                    walked = [a + b for a, b in zip(walked, self.walked, strict=True)]
                elif subs or name == "free list":
                    out.append((key, value))
        self.walked = walked
        if walked != [branches, leaves, overflows] and not self.shallow:
            # a dupsort sub-database's record counts the pages of its duplicate sets' trees as well
            self.problem(f"{label}: its record counts {branches} branch, {leaves} leaf and {overflows} overflow "
                         f"page(s); the walk found {walked[0]}, {walked[1]} and {walked[2]}")
        return out

    def _reach(self, pgno: int, where: str, label: str) -> bytes | None:
        """Page `pgno`'s bytes, once: None (and a problem) when it lies outside the live pages, was reached
        already, or its header names another page."""
        if not 2 <= pgno <= self.last:
            self.problem(f"{where} lies outside the pages the meta page names (2 to {self.last})")
            return None
        if pgno in self.owner:
            self.problem(f"{where} is reached again (first from {self.owner[pgno]})")
            return None
        self.owner[pgno] = label
        body = self.page(pgno)
        if len(body) < self.psize:
            self.problem(f"{where} lies {PAST_END}")
            return None
        recorded = struct.unpack_from("<Q", body)[0]
        if not any(body):
            self.problem(f"{where} is all zeros: its bytes are lost (a lost sector, a hole, a torn write)")
            return None
        if recorded != pgno:
            self.problem(f"{where} records page number {recorded} in its header: LMDB frees a page by that number, "
                         f"so its next write to this page would free page {recorded} while it is in use")
        return body

    def _overflow(self, over: int, size: int, via: int, label: str) -> int:
        """Check the overflow run a leaf node of page `via` names (`size` bytes of value): pages it spans."""
        span = (HEADER - 1 + size) // self.psize + 1  # OVPAGES(size, psize)
        where = f"page {over} (an overflow run of {span} page(s) named by page {via} in {label})"
        if not self.read_runs:
            if over + span > self.file_pages:
                self.problem(f"{where} lies {PAST_END}")
            return span
        body = self._reach(over, where, label)
        if body is None:
            return 0
        flags = struct.unpack_from("<H", body, 10)[0]
        count = struct.unpack_from("<I", body, 12)[0]
        if flags != P_OVERFLOW:
            self.problem(f"{where} is flagged {_flag_names(flags)} where a leaf names an overflow run")
        elif count != span:
            self.problem(f"{where} records a run of {count} page(s) for a {size}-byte value ({span} pages)")
        for pg in range(over + 1, over + span):
            if pg > self.last:
                self.problem(f"{where} runs past the last page the meta page names ({self.last})")
                break
            if pg in self.owner:
                self.problem(f"{where} runs over page {pg}, which {self.owner[pg]} also uses")
                break
            self.owner[pg] = label
        return span

    def _overflow_value(self, over: int, size: int) -> bytes:
        return os.pread(self.fd, size, over * self.psize + HEADER)

    def overlap(self) -> None:
        """Pages both live and on the free list."""
        both = sorted(set(self.owner) & set(self.freed))
        for pg in both[:PROBLEMS_LISTED]:
            self.problem(f"page {pg} is on the free list (freed by transaction {self.freed[pg]}) and live in "
                         f"{self.owner[pg]}: the next writer that takes it overwrites live records")
        if len(both) > PROBLEMS_LISTED:
            self.problem(f"... and {len(both) - PROBLEMS_LISTED} more page(s) both live and free")
