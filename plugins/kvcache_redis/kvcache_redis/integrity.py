"""This backend's side of the shared integrity audit (`kvcache.storage.verify`): it reads the records for the
checks (`RedisIntegrity`: a SCAN of the page records, a pipelined round trip per chunk for their children entries)
and removes what a repair removes (`RedisRepairOps`: the guarded removal scripts); the checks, findings and
repairs themselves are the shared verifier's, the same as the LMDB backend's.

Redis has no snapshot: the tree the checks judge is what the scan saw, and a children entry the scan did not see
is read again before it counts as dangling (a page written during the scan is sound). Registry counters moved by
concurrent writers show as a `counter_mismatch`: run that check (and its repair, a recount) when writers are
quiet.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from kvcache.storage.kit import (
    Findings,
    Guard,
    LayoutRecord,
    NamespaceRecord,
    PageMeta,
    PageRow,
    Removal,
    RemovalReason,
    RepairOps,
    ScannedPage,
    Snapshot,
    decode_layout,
    decode_meta,
    decode_or_none,
)

from .connection import Connection, hmget_many, smembers_many
from .registry import Registry
from .removing import REPAIR_BATCH_PAGES, Removals
from .scan import SCAN_COUNT, RecordScan
from .schema import XXH3, Keys

T = TypeVar("T")


class RedisIntegrity:
    """A Redis store as `kvcache.storage.verify_source.IntegritySource`. One per verify: the tree the checks judge is
    what the scan of the page records saw (kept here)."""

    checksum = XXH3
    recounts_after_removals = False  # the removal scripts keep the counters; a recount is a racy scan

    def __init__(self, conn: Connection, keys: Keys, registry: Registry, scan: RecordScan, removals: Removals,
                 chain_key: bytes | None) -> None:
        self.conn = conn
        self.keys = keys
        self.registry = registry
        self.scan = scan
        self.removals = removals
        self.chain_key = chain_key  # the format record's: every handle holds it
        self.batch_pages = REPAIR_BATCH_PAGES
        self.namespaces: dict[str, NamespaceRecord] = {}  # the registry as read before the scan
        self.rows: dict[bytes, PageRow] = {}
        self.bodiless: set[bytes] = set()
        self.damaged: set[bytes] = set()
        self.headless: set[bytes] = set()

    def layout_records(self) -> dict[bytes, LayoutRecord | None]:
        """The layout records, by layout id (None: does not decode)."""
        raw = self.conn.admin(lambda c: c.hgetall(self.keys.layouts))
        return {bytes.fromhex(k.decode()): decode_or_none(decode_layout, v) for k, v in raw.items()}

    def scan_pages(self, found: Findings) -> Iterator[ScannedPage]:
        """Every page record, SCAN_COUNT per round trip, with one more round trip per chunk for its index
        entries. Records this interface cannot express are reported here: a key whose tail is no page hash, a
        record without its namespace or parent field, fields that disagree with the metadata."""
        self.namespaces = self.registry.records()
        chunk: list[tuple[bytes, Any, PageMeta | None, bool]] = []
        for h, (d, m, n, p) in self.scan.pages(("d", "m", "n", "p")):
            if isinstance(h, str):
                found.add("dangling_index", None, f"a page record key whose tail {h!r} is not a page hash")
                continue
            if n is None or p is None:
                found.add("missing_meta" if d is not None else "missing_page", h,
                          "a page record without its namespace or parent field", remove=True)
                continue
            meta = None if m is None else decode_or_none(decode_meta, m)
            if meta is not None:
                self.rows[h] = PageRow(meta.parent, meta.ns_id, meta.layout_id, meta.nbytes, engine=bool(meta.key))
                if n.decode() != meta.ns_id.hex() or p.decode() != meta.parent.hex():
                    found.add("namespace_mismatch", h, "the record's namespace or parent field differs from its "
                                                       "metadata", remove=Guard.SAME_BYTES)
            if m is not None and meta is None:
                self.damaged.add(h)
            if d is None:
                self.bodiless.add(h)
                continue
            if meta is None:
                self.headless.add(h)
            chunk.append((h, d, meta, m is not None and meta is None))
            if len(chunk) >= SCAN_COUNT:
                yield from self._checked(chunk)
                chunk = []
        yield from self._checked(chunk)

    def _checked(self, chunk: list[tuple[bytes, Any, PageMeta | None, bool]]) -> Iterator[ScannedPage]:
        whole = [(h, meta) for h, _, meta, _ in chunk if meta is not None]
        children = self.keys.children

        def ask(c: Any) -> list[Any]:
            pipe = c.pipeline(transaction=False)
            for h, meta in whole:
                pipe.sismember(children(meta.parent), h)
            return pipe.execute()

        listed = dict(zip((h for h, _ in whole), self.conn.admin(ask) if whole else [], strict=True))
        for h, d, meta, damaged in chunk:
            if meta is None:
                yield ScannedPage(h, d, None, damaged)
            else:
                yield ScannedPage(h, d, meta, indexed=bool(listed[h]), registered=meta.ns_id.hex() in self.namespaces)

    def snapshot(self, found: Findings) -> Snapshot:
        """What the scan saw, the registry read before it, and the children index read after it."""
        return Snapshot(self.rows, self.bodiless, self.damaged, self.headless,
                        {bytes.fromhex(k): r for k, r in self.namespaces.items()}, self._links())

    def _links(self) -> list[tuple[bytes, bytes]]:
        links = self.scan.links()
        suspects = [(parent, child) for parent, child in links
                    if child not in self.rows or self.rows[child].parent != parent]
        if not suspects:
            return links
        page = self.keys.page
        now = self.conn.admin(lambda c: hmget_many(c, [page(child) for _, child in suspects], ("p", "m")))
        written = {link for link, (p, m) in zip(suspects, now, strict=True)
                   if p is not None and p.decode() == link[0].hex() and m is not None}
        return [link for link in links if link not in written]  # stored under that parent during the scan: sound

    def repair_batch(self, body: Callable[[RepairOps], T]) -> T:
        """`body` with removals by script (Redis has no write transaction to bound: a batch is a round of
        scripts and pipelines)."""
        return body(RedisRepairOps(self))

    def recount(self) -> None:
        """Every registry counter from the page records stored now."""
        self.registry.recount()


class RedisRepairOps:
    """`verify.RepairOps` by removal scripts, each rechecking its record on the server (scripts.REMOVE_BATCH)."""

    def __init__(self, integrity: RedisIntegrity) -> None:
        self.seen = integrity
        self.conn = integrity.conn
        self.keys = integrity.keys
        self.removals = integrity.removals

    def remove(self, items: Sequence[Removal]) -> list[tuple[str, int] | None]:
        """Each item under its guard, as the scripts take it (a page of a removed record: as judged)."""
        conn, page = self.conn, self.keys.page
        sha_of = [it.page for it in items if it.guard is Guard.SAME_BYTES]
        sha: dict[bytes, str] = {}
        if sha_of:
            raw = conn.admin(lambda c: hmget_many(c, [page(h) for h in sha_of], ("d",)))
            sha = {h: hashlib.sha1(d).hexdigest() for h, (d,) in zip(sha_of, raw, strict=True) if d is not None}
        args: list[tuple[bytes, str | None, str | None, str, str]] = [
            (it.page, it.row.ns_id.hex() if it.row else None, it.row.parent.hex() if it.row else None,
             "any" if it.guard is Guard.FILED_UNDER else str(it.guard), sha.get(it.page, "")) for it in items]
        freed = conn.admin(lambda c: self.removals.remove(args, RemovalReason.REPAIR))
        # The "raw" scripts delete the record only: metadata without bytes leaves its entry under its parent.
        listed = [(it.row.parent, it.page) for it, f in zip(items, freed, strict=True)
                  if f >= 0 and it.guard is Guard.PARTIAL and it.row is not None]
        if listed:
            conn.admin(lambda c: self._srem_all(c, listed))
        return [None if f < 0 else (self._what(it), max(f, 0)) for it, f in zip(items, freed, strict=True)]

    def _what(self, item: Removal) -> str:
        if item.guard is not Guard.PARTIAL:
            return "page"
        if item.page in self.seen.bodiless:
            return "meta"
        return "page" if item.page in self.seen.damaged else "bytes"

    def children(self, pages: Sequence[bytes]) -> list[set[bytes]]:
        """The children sets of each page."""
        children = self.keys.children
        return self.conn.admin(lambda c: smembers_many(c, [children(h) for h in pages]))

    def unlink(self, links: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        """Remove children entries (SREM): per entry, whether it was there."""
        return [bool(gone) for gone in self.conn.admin(lambda c: self._srem_all(c, links))]

    def _srem_all(self, client: Any, links: Sequence[tuple[bytes, bytes]]) -> list[int]:
        pipe = client.pipeline(transaction=False)
        for parent, child in links:
            pipe.srem(self.keys.children(parent), child)
        return pipe.execute()

    def relink(self, pages: Sequence[tuple[bytes, PageRow]]) -> list[bool]:
        """Add each page to its parent's children set."""
        def run(c: Any) -> None:
            pipe = c.pipeline(transaction=False)
            for h, row in pages:
                pipe.sadd(self.keys.children(row.parent), h)
            pipe.execute()

        self.conn.admin(run)
        return [True] * len(pages)

    def drop_record(self, name: str, key: bytes) -> bool:
        """Remove a layout record that still does not decode (a namespace record that does not decode is never
        reported here: the registry read raises on it)."""
        if name != "layouts":
            return False
        conn, layouts = self.conn, self.keys.layouts
        raw = conn.admin(lambda c: c.hget(layouts, key.hex()))
        if raw is None or decode_or_none(decode_layout, raw) is not None:
            return False
        return bool(conn.admin(lambda c: c.hdel(layouts, key.hex())))
