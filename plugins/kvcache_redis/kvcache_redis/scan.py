"""Walks over every record of a kind by SCAN: the page records (with the fields a caller asks for, or their sizes)
and the children sets. What a namespace's deletion, a recount and the audit read, since Redis keeps no index of
them.

SCAN_COUNT keys per round trip, so a walk never blocks the server for long; it is not one snapshot (SCAN may
return a key twice, which is skipped, and sees a key written during the walk or not).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

from kvcache.storage.kit import HEADER, PAGE_HASH_BYTES, StoreError

from .connection import FAULTS, Connection, said, smembers_many
from .schema import Keys

SCAN_COUNT = 512  # keys per SCAN step (verify, delete_namespace): bounded work per round trip


class RecordScan:
    """SCAN walks of one store's page records and children sets (administrative reads: a fault is a
    StoreError)."""

    def __init__(self, conn: Connection, keys: Keys) -> None:
        self.conn = conn
        self.keys = keys

    def pages(self, fields: tuple[str, ...]) -> Iterator[tuple[bytes | str, list[Any]]]:
        """Every page record's hash and the asked fields, SCAN_COUNT keys per round trip. A key whose tail is
        not a page hash comes back as that tail, a str (verify reports it)."""
        conn = self.conn
        client = conn.live()
        pattern = self.keys.pattern("p:")
        skip = len(self.keys.page_prefix)
        batch: list[bytes] = []

        def fetch(keys: list[bytes]) -> list[tuple[bytes | str, list[Any]]]:
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.hmget(k, *fields)
            got = conn.admin(lambda c: pipe.execute())
            out: list[tuple[bytes | str, list[Any]]] = []
            for k, vals in zip(keys, got, strict=True):
                tail = k[skip:].decode(errors="replace")
                try:
                    h = bytes.fromhex(tail)
                except ValueError:
                    h = b""
                out.append((h if len(h) == PAGE_HASH_BYTES and len(tail) == 2 * PAGE_HASH_BYTES else tail, vals))
            return out

        keys_iter = conn.admin(lambda c: c.scan_iter(match=pattern, count=SCAN_COUNT))
        seen: set[bytes] = set()  # SCAN may return a key twice
        try:
            for key in keys_iter:
                if key in seen:
                    continue
                seen.add(key)
                batch.append(key)
                if len(batch) >= SCAN_COUNT:
                    yield from fetch(batch)
                    batch = []
        except FAULTS as exc:
            raise StoreError(conn.location, f"redis: {said(exc)}") from None
        if batch:
            yield from fetch(batch)

    def page_sizes(self) -> Iterator[tuple[bytes, tuple[str, int]]]:
        """Every page record with a namespace and a payload: (page hash, (namespace id hex, payload bytes))."""
        conn, page = self.conn, self.keys.page
        conn.live()
        found = [h for h, (n,) in self.pages(("n",)) if n is not None and isinstance(h, bytes)]
        for start in range(0, len(found), SCAN_COUNT):
            batch = found[start:start + SCAN_COUNT]

            def ask(c: Any, batch: list[bytes] = batch) -> list[Any]:
                pipe = c.pipeline(transaction=False)
                for h in batch:
                    pipe.hget(page(h), "n")
                    pipe.hstrlen(page(h), "d")
                return pipe.execute()

            got = conn.admin(ask)
            for j, h in enumerate(batch):
                n, size = got[2 * j], got[2 * j + 1]
                if n is not None and size:
                    yield h, (n.decode(), int(size) - HEADER)

    def links(self) -> list[tuple[bytes, bytes]]:
        """Every children entry as (parent, child), SCAN_COUNT sets per round trip (a set whose key's tail is no
        hash is skipped)."""
        conn = self.conn
        pattern = self.keys.pattern("c:")
        skip = len(self.keys.children_prefix)
        found = sorted(set(conn.admin(lambda c: list(c.scan_iter(match=pattern, count=SCAN_COUNT)))))
        links: list[tuple[bytes, bytes]] = []
        for start in range(0, len(found), SCAN_COUNT):
            chunk = found[start:start + SCAN_COUNT]
            for key, kids in zip(chunk, conn.admin(partial(smembers_many, keys=chunk)), strict=True):
                try:
                    parent = bytes.fromhex(key[skip:].decode())
                except ValueError:
                    continue
                links += [(parent, child) for child in kids]
        return links
