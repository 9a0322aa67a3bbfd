"""Removing pages, and the removal log that says why they went (kvcache.storage.removals).

Every removal is a guarded script (scripts.REMOVE_BATCH, REMOVE_PAGE): the record must still be the one that was
read (its namespace, parent, bytes...), so a page a writer stored meanwhile stays. On a standalone server one
script removes REPAIR_BATCH_PAGES pages, their children entries and counters, and records them in the log; a
cluster removes page by page (one-key scripts), then adjusts the indexes and counters and records the log in a
pipeline after. A namespace deleted whole (an offboarding, a TTL expiry) is found by SCAN, removed in batches of
DELETE_BATCH_PAGES, and recorded once, with its registry record's removal.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from functools import partial
from typing import Any

from kvcache.storage.kit import (
    DeleteResult,
    InvalidInput,
    NamespaceId,
    PageRemoval,
    RemovalReason,
    check_page_hashes,
    newest_removal,
    removals_kept,
)

from .connection import Connection, hmget_many
from .scan import RecordScan
from .schema import Keys

DELETE_BATCH_PAGES = 512  # pages removed per script when deleting a namespace (a script blocks the server)
REPAIR_BATCH_PAGES = 512
# One page to remove: (page hash, namespace id hex, parent hash hex, guard, SHA-1 hex of its bytes); a None
# namespace or parent is read from the record first (scripts.REMOVE_BATCH says what each guard checks).
Item = tuple[bytes, str | None, str | None, str, str]


class Removals:
    """One store's guarded page removals, namespace deletions and removal log."""

    def __init__(self, conn: Connection, keys: Keys, scan: RecordScan) -> None:
        self.conn = conn
        self.keys = keys
        self.scan = scan

    def remove(self, items: list[Item], reason: RemovalReason | None) -> list[int]:
        """Remove page records under guards (see scripts.REMOVE_BATCH): items are (page, namespace hex, parent
        hex, guard, sha1 hex); a None namespace or parent is read first. Returns the payload bytes freed per
        item (-1: kept by its guard). Each whole page removed is recorded in the removal log for `reason` (None:
        not one by one; a namespace dropped whole is recorded once by its caller). Standalone: one atomic script
        per REPAIR_BATCH_PAGES pages of items, its records with it; a cluster records them after its removals."""
        conn, keys = self.conn, self.keys
        client = conn.live()
        word, now, kept = (reason.value if reason is not None else ""), repr(time.time()), removals_kept()
        need = [i for i, (_, ns, parent, guard, _) in enumerate(items)
                if guard != "raw" and (ns is None or parent is None)]
        if need:
            read = hmget_many(client, [keys.page(items[i][0]) for i in need], ("n", "p"))
            for i, (ns, parent) in zip(need, read, strict=True):
                h, _, _, guard, sha = items[i]
                items[i] = (h, ns.decode() if ns else "", parent.decode() if parent else "", guard, sha)
        # every None is read by now but a "raw" item's, which the scripts take as "" (`ns or ""` below)
        known = [(h, ns or "", parent or "", guard, sha) for h, ns, parent, guard, sha in items]
        out: list[int] = []
        for start in range(0, len(known), REPAIR_BATCH_PAGES):
            chunk = known[start:start + REPAIR_BATCH_PAGES]
            if conn.cluster:
                freed = self._remove_cluster(client, chunk)
                out += freed
                gone = [(b"h" + h, ns) for (h, ns, _, guard, _), f in zip(chunk, freed, strict=True)
                        if f >= 0 and guard != "raw"]
                if reason is not None and gone:
                    self.record(client, reason, gone)
                continue
            script_keys: list[bytes] = []
            args: list[Any] = []
            for h, ns, parent, guard, sha in chunk:
                parent_hash = bytes.fromhex(parent) if parent else b""
                script_keys += [keys.page(h), keys.children(parent_hash), keys.namespace(ns or "-"),
                                keys.page(parent_hash)]
                args += [h, ns or "", parent or "", guard, sha or ""]
            script_keys.append(keys.removals)
            args += [word, now, kept]
            out += [int(x) for x in conn.call(conn.remove_batch, script_keys, args, client)]
        return out

    def _remove_batch(self, client: Any, items: list[Item]) -> list[int]:
        """One batch of a namespace's deletion, as an administrative call (`client` unused: `remove` takes the
        live one)."""
        return self.remove(items, None)

    def _remove_cluster(self, client: Any, chunk: list[tuple[bytes, str, str, str, str]]) -> list[int]:
        conn, keys = self.conn, self.keys
        pipe = client.pipeline(transaction=False)
        for h, ns, parent, guard, sha in chunk:
            if guard == "below":
                guard = "any"  # the parent's record is in another slot: checked by the caller before
            conn.call(conn.remove_page, [keys.page(h)], [ns or "", parent or "", guard, sha or ""], pipe)
        freed = [int(x) for x in pipe.execute()]
        pipe = client.pipeline(transaction=False)
        per_ns: Counter[str] = Counter()
        per_ns_bytes: Counter[str] = Counter()
        for (h, ns, parent, guard, _), f in zip(chunk, freed, strict=True):
            if f >= 0 and guard != "raw":
                pipe.srem(keys.children(bytes.fromhex(parent)), h)
                per_ns[ns] += 1
                per_ns_bytes[ns] += f
        for ns, n in per_ns.items():
            conn.call(conn.ns_adjust, [keys.namespace(ns)], ["", "0", -n, -per_ns_bytes[ns], ""], pipe)
        pipe.execute()
        return freed

    def record(self, client: Any, reason: RemovalReason, subjects: Sequence[tuple[bytes, str]]) -> None:
        """Record `subjects` ((b"h" + page hash or b"n" + namespace id, namespace id hex) each) in the removal log
        as removed for `reason` now (scripts.RECORD: one call, one key)."""
        args: list[Any] = [reason.value, repr(time.time()), removals_kept()]
        for subject, ns_hex in subjects:
            args += [subject, ns_hex]
        self.conn.call(self.conn.record, [self.keys.removals], args, client)

    def lookup(self, hashes: Sequence[bytes], namespace: bytes | None = None) -> list[PageRemoval | None]:
        """Per hash, the newest record of the removal log that answers for it (see `L3Store.removals`): one
        HMGET of the log (an administrative read: a fault is a StoreError)."""
        check_page_hashes(hashes)
        if namespace is not None and (not isinstance(namespace, bytes) or len(namespace) != 16):
            raise InvalidInput(f"a namespace id is 16 bytes, got {namespace!r:.60}")
        if not hashes:
            return []
        fields = [b"h" + h for h in hashes] + ([b"n" + namespace] if namespace is not None else [])
        raw = self.conn.admin(lambda c: c.hmget(self.keys.removals, fields))
        whole = _removal(namespace, raw[-1]) if namespace is not None else None
        return [newest_removal(h, _removal(h, v), whole) for h, v in zip(hashes, raw, strict=False)]

    def delete_namespace(self, ns_id: bytes, reason: RemovalReason) -> DeleteResult:
        """Remove every page of namespace `ns_id` and its registry record, recording the namespace removed for
        `reason` once, with the registry's removal. Scans repeat until one finds nothing, so pages a concurrent
        writer adds meanwhile go too."""
        conn, keys = self.conn, self.keys
        ns_hex = ns_id.hex()
        pages = nbytes = scripts_run = 0
        while True:
            found: list[Item] = [(h, ns_hex, parent.decode(), "any", "")
                                 for h, (ns, parent) in self.scan.pages(("n", "p"))
                                 if isinstance(h, bytes) and ns is not None and ns.decode() == ns_hex
                                 and parent is not None]
            for start in range(0, len(found), DELETE_BATCH_PAGES):
                freed = conn.admin(partial(self._remove_batch, items=found[start:start + DELETE_BATCH_PAGES]))
                scripts_run += 1
                got = [f for f in freed if f >= 0]
                pages += len(got)
                nbytes += sum(got)
            if not found:
                break

        def drop(c: Any) -> None:
            c.srem(keys.nsidx, ns_hex)
            c.delete(keys.namespace(ns_hex))
            self.record(c, RemovalReason(reason), [(b"n" + ns_id, ns_hex)])

        conn.admin(drop)
        return DeleteResult(pages, nbytes, max(scripts_run, 1))


def _removal(subject: bytes, value: bytes | None) -> tuple[int, PageRemoval] | None:
    """(seq, record) of one value of the removal log ("<seq> <reason> <unix seconds> <namespace id hex>") for a
    page hash or namespace id `subject`; None when absent or when it does not decode (an unknown reason)."""
    if value is None:
        return None
    try:
        seq, word, at, ns_hex = value.decode().split(" ")
        return int(seq), PageRemoval(subject, RemovalReason(word), float(at), NamespaceId(bytes.fromhex(ns_hex)))
    except ValueError:
        return None
