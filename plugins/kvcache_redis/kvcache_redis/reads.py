"""The read side of the page records: the data path (`exists_prefix`, `get_into`: one pipelined round trip per
batch, a fault a counted miss) and the administrative reads of one page and of the tree below it (`page_meta`,
`children`, `child_pages`: a fault a StoreError).

`get_into` verifies each page's checksum (xxh3-64 seeded by the page hash) on the copy in the caller's buffer (or
its segments, filled in order and summed as filled): what the caller got is what was verified. A page that fails
is a miss from then on, quarantined until the next flush drops it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import partial
from typing import Any, cast

import msgspec

from kvcache.storage.kit import (
    HEADER,
    ChildInfo,
    KVLayout,
    PageHash,
    PageMeta,
    check_page_hashes,
    count_read,
    decode_meta,
    out_views_for,
)

from .access import AccessRecords
from .connection import FAULTS, Connection, hmget_many, smembers_many
from .schema import XXH3, Keys


class PageReads:
    """One handle's reads of page records (`access` logs what they served and quarantines what failed)."""

    def __init__(self, conn: Connection, keys: Keys, access: AccessRecords, layout: KVLayout | None,
                 readonly: bool) -> None:
        self.conn = conn
        self.keys = keys
        self.access = access
        self.layout = layout
        self.readonly = readonly

    def exists_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many pages from the start of `hashes` are stored (stops at the first gap). A fault is a miss."""
        if not hashes:
            return 0
        check_page_hashes(hashes)
        conn = self.conn
        client = conn.live()
        found = 0
        if conn.available():
            try:
                pk = self.keys.page
                pipe = client.pipeline(transaction=False)
                for h in hashes:
                    pipe.exists(pk(h))
                corrupt = self.access.corrupt
                for h, there in zip(hashes, pipe.execute(), strict=True):
                    if not there or (corrupt and h in corrupt):
                        break
                    found += 1
                conn.ok()
            except FAULTS as exc:
                conn.fault("read_errors", exc)
        else:
            conn.counts["read_errors"] += 1
        return count_read(conn.counts, found, len(hashes))

    def get_into(self, hashes: Sequence[bytes], out_views: Sequence[Any]) -> int:
        """Copy pages into caller-provided writable byte views (one pipelined round trip for the batch), each
        verified on the copy; return how many consecutive pages from the start were copied. A missing or corrupt
        page ends the run (and is counted); a fault is a miss."""
        outs = out_views_for(hashes, out_views, self.layout)
        n = len(outs)
        if n == 0:
            return 0
        conn = self.conn
        client = conn.live()
        done = 0
        ns_hex = ""
        if conn.available():
            try:
                pk = self.keys.page
                pipe = client.pipeline(transaction=False)
                for h in hashes:
                    pipe.hmget(pk(h), "d", "n")
                replies = pipe.execute()
                conn.ok()
            except FAULTS as exc:
                conn.fault("read_errors", exc)
                replies = []
        else:
            conn.counts["read_errors"] += 1
            replies = []
        corrupt = self.access.corrupt
        for h, out, (value, ns) in zip(hashes, outs, replies, strict=False):
            if value is None or ns is None or (corrupt and h in corrupt):
                break
            # A stored size other than a page's (the out views were checked above) is a damaged record: a miss,
            # quarantined like a checksum failure. Checked on the copy, still in cache: what the caller got is
            # what was verified.
            bad = len(value) - HEADER != len(out)
            if not bad:
                if type(out) is memoryview:
                    out[:] = memoryview(value)[HEADER:]
                    summed = XXH3.of(out, h)
                else:  # a page in segments (checks.Segments): copied in order, summed as copied
                    out.fill(memoryview(value)[HEADER:])
                    summed = XXH3.of_parts(out.views, h)
                bad = summed != int.from_bytes(value[:HEADER], "little")
            if bad:
                with conn.lock:
                    corrupt[h] = hashlib.sha1(value).hexdigest()
                    conn.counts["checksum_failures"] += 1
                break
            done += 1
            ns_hex = ns.decode()
        count_read(conn.counts, done, n, copied=True)
        if done and not self.readonly:
            self.access.record(tuple(hashes[:done]), ns_hex)
        return done

    def page_meta(self, page_hash: bytes) -> PageMeta | None:
        """A page's metadata (hits and last access as of the last flush), or None when it is not stored."""
        m, hits, last = self.conn.admin(lambda c: c.hmget(self.keys.page(page_hash), "m", "h", "a"))
        if m is None:
            return None
        meta = decode_meta(m)
        return msgspec.structs.replace(meta, hits=int(hits or 0), last_access=float(last or meta.last_access))

    def children(self, page_hash: bytes) -> list[ChildInfo]:
        """Stored children of a page hash or of a namespace root, hottest (most reads through the child, then
        most recent) first. A child's figures cover its subtree: one pipelined round trip per level below it."""
        conn, keys = self.conn, self.keys
        kids = sorted(conn.admin(lambda c: c.smembers(keys.children(page_hash))))
        out: list[ChildInfo] = []
        if not kids:
            return out
        metas = conn.admin(lambda c: hmget_many(c, [keys.page(h) for h in kids], ("m", "h", "a")))
        heads: list[tuple[bytes, PageMeta, int, float]] = []
        for child, (m, hits, last) in zip(kids, metas, strict=True):
            if m is not None:
                meta = decode_meta(m)
                heads.append((child, meta, int(hits or 0), float(last or meta.last_access)))
        # Walk every head's subtree level by level; `top` maps each page reached to the head it is under.
        heat = {child: [hits, last] for child, _, hits, last in heads}
        top = {child: child for child, _, _, _ in heads}
        level = [child for child, _, _, _ in heads]
        seen = set(level)
        while level:
            below = conn.admin(partial(smembers_many, keys=[keys.children(h) for h in level]))
            nxt = []
            for parent, members in zip(level, below, strict=True):
                for k in members:
                    if k not in seen:
                        seen.add(k)
                        top[k] = top[parent]
                        nxt.append(k)
            if not nxt:
                break
            figures = conn.admin(partial(hmget_many, keys=[keys.page(h) for h in nxt], fields=("h", "a")))
            for k, (hits, last) in zip(nxt, figures, strict=True):
                if hits is not None:
                    acc = heat[top[k]]
                    acc[0] += int(hits)
                    acc[1] = max(acc[1], float(last or 0))
            level = nxt
        # the children index holds page hashes: one cast of the list, no call per child
        for child, meta, _, _ in cast("list[tuple[PageHash, PageMeta, int, float]]", heads):
            hits, last = heat[child]
            out.append(ChildInfo(child, meta.tokens, meta.nbytes, int(hits), last, key=meta.key))
        out.sort(key=lambda c: (-c.hits, -c.last_access))
        return out

    def child_pages(self, page_hash: bytes) -> list[ChildInfo]:
        """Stored children of a page hash or of a namespace root, unordered, each with its own figures (not its
        subtree's): two round trips."""
        conn, keys = self.conn, self.keys
        kids = list(conn.admin(lambda c: c.smembers(keys.children(page_hash))))
        if not kids:
            return []
        metas = conn.admin(lambda c: hmget_many(c, [keys.page(h) for h in kids], ("m", "h", "a")))
        out = []
        for child, (m, hits, last) in zip(kids, metas, strict=True):
            if m is not None:
                meta = decode_meta(m)
                out.append(ChildInfo(child, meta.tokens, meta.nbytes, int(hits or 0), float(last or meta.last_access),
                                     key=meta.key))
        return out
