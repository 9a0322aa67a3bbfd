"""Walking the prefix trees of an LMDB store: a page's stored children and the heat of its subtree.

The `children` index (parent hash -> child hashes, dupsort) walks a namespace's tree down from its root. A read
is credited to the deepest page it reached (`access`), so a page's heat (reads, latest access) is its subtree's:
reporting it costs one lookup per page below, paid by the rare caller that walks a tree, never by a read.
"""

from __future__ import annotations

from typing import Any, cast

import lmdb

from ...types.ids import PageHash
from ..api import ChildInfo, PageMeta
from ..codec import decode_meta
from .shared_env import SharedEnv


def children(shared: SharedEnv, page_hash: PageHash) -> list[ChildInfo]:
    """Stored children of a page hash or of a namespace root, hottest (most reads through the child, then most
    recent) first. Each child's figures cover its subtree: O(subtree) lookups, in one read transaction."""
    def walk(txn: lmdb.Transaction) -> list[ChildInfo]:
        found = []
        meta_db = shared.dbs.meta
        cur = txn.cursor(db=shared.dbs.children)
        for child in child_hashes(cur, page_hash):
            raw = txn.get(child, db=meta_db)
            if raw is not None:
                m = decode_meta(raw)
                last_access, hits = subtree_heat(txn, cur, meta_db, child, m)
                found.append(ChildInfo(child, m.tokens, m.nbytes, hits, last_access, m.key))
        return found

    out = shared.reading(walk)  # run again if writers overtook a lock-free read
    out.sort(key=lambda c: (-c.hits, -c.last_access))
    return out


def child_pages(shared: SharedEnv, page_hash: PageHash) -> list[ChildInfo]:
    """Stored children of a page hash or of a namespace root, unordered, each with its own figures (not its
    subtree's): one lookup per child, in one read transaction. What a walk of a whole tree takes (`kvc ns dump`),
    where `children` would cost one lookup per page below each child."""
    def walk(txn: lmdb.Transaction) -> list[ChildInfo]:
        found = []
        meta_db = shared.dbs.meta
        for child in child_hashes(txn.cursor(db=shared.dbs.children), page_hash):
            raw = txn.get(child, db=meta_db)
            if raw is not None:
                m = decode_meta(raw)
                found.append(ChildInfo(child, m.tokens, m.nbytes, m.hits, m.last_access, m.key))
        return found

    return shared.reading(walk)  # run again if writers overtook a lock-free read


def child_hashes(cur: lmdb.Cursor, page_hash: bytes) -> list[PageHash]:
    """The hashes `cur` (a cursor on `children`) lists under `page_hash`."""
    found = [bytes(c) for c in cur.iternext_dup(keys=False, values=True)] if cur.set_key(page_hash) else []
    return cast("list[PageHash]", found)  # the index lists page hashes: one cast, no call per child


def subtree_heat(txn: lmdb.Transaction, cur: lmdb.Cursor, meta_db: Any, top_hash: bytes,
                 top: PageMeta) -> tuple[float, int]:
    """(latest access, reads) over the stored subtree of page `top_hash` (metadata `top`): one lookup per page
    below it."""
    last, hits = top.last_access, top.hits
    stack = child_hashes(cur, top_hash)
    while stack:
        h = stack.pop()
        raw = txn.get(h, db=meta_db)
        if raw is None:
            continue
        m = decode_meta(raw)
        last, hits = max(last, m.last_access), hits + m.hits
        stack.extend(child_hashes(cur, h))
    return last, hits
