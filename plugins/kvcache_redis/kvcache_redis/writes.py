"""The write path: `put`, one batch of pages with their metadata, children entries and namespace counters.

On a standalone server a batch is one Lua script (scripts.PUT_BATCH): all of it appears or none, also under
concurrent writers on many nodes (pages are content-addressed: a page already stored is `existing`, counted
once). On a cluster each page is one one-key script (scripts.PUT_PAGE: the page still never appears without its
metadata) and the indexes and counters follow in a pipeline (README.md, "Cluster mode").

An engine page's parent is a hint: it hangs from its namespace root when its parent is not a stored page of its
namespace and layout; a token page's parent must be one (InvalidInput, nothing written). A batch the server
refuses for room is `rejected` whole, one it cannot answer or will not write is `failed` whole; nothing is
raised. A server that lost its data loses the format record too: every put checks it, and a writer that finds it
gone stops writing (`format_lost`) and says so once, on the `kvcache_redis` logger, until `kvc init` makes the
store again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import redis

from kvcache.storage.kit import (
    HEADER,
    InvalidInput,
    KVLayout,
    PageHash,
    PageMeta,
    PageOrigin,
    PageOutcome,
    PageView,
    PutResult,
    decode_meta,
    decode_or_none,
    encoder,
    hash_root,
    put_views,
)

from .access import AccessRecords
from .connection import FAULTS, OOM, Connection
from .schema import XXH3, Keys

log = logging.getLogger("kvcache_redis")


def page_value(page_hash: bytes, page: PageView) -> bytes:
    """A page record's `d` field: the checksum, then one copy of the caller's page (its segments gathered in
    order), summed as copied (what is summed is exactly what is sent)."""
    value = bytearray(HEADER + len(page))
    payload = memoryview(value)[HEADER:]
    if type(page) is memoryview:
        payload[:] = page
    else:
        page.gather(payload)
    value[:HEADER] = XXH3.of(payload, page_hash).to_bytes(HEADER, "little")
    del payload  # a bytearray with a view on it cannot be copied out
    return bytes(value)


class _Batch(msgspec.Struct, frozen=True):
    """One put batch as the write paths take it: the caller's hashes and origins, and what `put` derived."""

    hashes: Sequence[bytes]
    values: list[bytes]  # each page's `d` field: checksum + payload
    metas: list[bytes]  # each page's PageMeta (msgpack), parent as the origin says
    root_metas: list[bytes]  # an engine page's PageMeta hanging from its namespace root; b"" for the others
    origins: Sequence[PageOrigin]
    roots: dict[bytes, PageHash]  # namespace id -> its hash root under the handle's layout
    now: float  # unix seconds of the write


class PageWrites:
    """One handle's writes of page batches under its layout and chain key (`access`: logged reads ride with
    writes)."""

    def __init__(self, conn: Connection, keys: Keys, access: AccessRecords, layout: KVLayout | None,
                 chain_key: bytes | None, fingerprint_key: bytes | None) -> None:
        self.conn = conn
        self.keys = keys
        self.access = access
        self.layout = layout
        self.chain_key = chain_key
        self.fingerprint_key = fingerprint_key  # keys the salt fingerprint of a namespace record written
        self._gone = False  # the last put found the format record gone (said once until a put succeeds)

    def put(self, hashes: Sequence[bytes], pages: Sequence[Any], origins: Sequence[PageOrigin]) -> PutResult:
        """Store a batch of pages (see the module docstring); `outcomes` says what became of each."""
        conn = self.conn
        views = put_views(self.layout, hashes, pages, origins, self.chain_key)
        values = [page_value(h, mv) for h, mv in zip(hashes, views, strict=True)]
        if not hashes:
            return PutResult(0, 0, 0, 0, 0, outcomes=b"")
        layout = self.layout
        assert layout is not None  # put_views refuses a handle opened without one
        nbytes = layout.bytes_per_page
        client = conn.live()
        if not conn.available():
            return self._failed_put(len(hashes))  # inside a backoff pause: the server was gone a moment ago
        self.access.flush_quietly()  # logged reads ride with writes, as in the LMDB backend
        layout_id, now = layout.layout_id, time.time()
        chain_key = self.chain_key
        assert chain_key is not None  # every store this backend opens keeps one (`schema.read_format`)
        namespaces = {o.namespace for o in origins}
        roots: dict[bytes, PageHash] = {ns.id: hash_root(layout_id, ns, chain_key) for ns in namespaces}
        metas: list[bytes] = []
        root_metas: list[bytes] = []  # an engine page's metadata hanging from its root ("" for the others)
        for o, v in zip(origins, values, strict=True):
            meta = PageMeta(o.namespace.id, layout_id, o.parent, o.tokens, nbytes, int.from_bytes(v[:HEADER], "little"),
                            now, now, 0, o.key)
            metas.append(encoder.encode(meta))
            root = roots[o.namespace.id]
            hangs = o.key and o.parent != root
            root_metas.append(encoder.encode(msgspec.structs.replace(meta, parent=root)) if hangs else b"")
        batch = _Batch(hashes, values, metas, root_metas, origins, roots, now)
        try:
            outcomes = self._put_cluster(client, batch) if conn.cluster else self._put_batch(client, batch)
            conn.ok()
        except redis.ResponseError as exc:
            if str(exc).startswith("KVCNOSTORE"):
                return self._store_gone(len(hashes))
            if str(exc).startswith("KVCNS"):
                _, i, stored = str(exc).split()[:3]
                raise _foreign_parent(hashes[int(i)], origins[int(i)], stored == "stored") from None
            if isinstance(exc, OOM) or str(exc).startswith("OOM"):  # (redis-py names the reply by its class)
                # The server is full (maxmemory, noeviction): a capacity outcome, like a rejected page in LMDB.
                return self._failed_put(len(hashes), fault=False)
            return self._failed_put(len(hashes), error=exc)
        except FAULTS as exc:
            return self._failed_put(len(hashes), error=exc)
        written = outcomes.count(PageOutcome.WRITTEN)
        existing = outcomes.count(PageOutcome.EXISTING)
        rejected = len(outcomes) - written - existing
        with conn.lock:
            c = conn.counts
            c["pages_written"] += written
            c["pages_existing"] += existing
            c["pages_rejected"] += rejected
            back, self._gone = self._gone, False
        if back:
            log.warning("%s: the store's format record is back; writing again", conn.location)
        return PutResult(written, existing, rejected, 0, written * nbytes, outcomes=outcomes)

    def _store_gone(self, n: int) -> PutResult:
        """The format record is gone (the server lost its data, or the store was deleted): the batch fails whole
        (FAILED) and is counted (`format_lost`), and it is said once, in one line, until a put succeeds again."""
        conn = self.conn
        with conn.lock:
            conn.counts["format_lost"] += 1
            first, self._gone = not self._gone, True
        if first:
            log.error("%s: the store's format record under prefix %r is gone (the server lost its data?); writes "
                      "stop until `kvc init` creates the store again", conn.location, self.keys.prefix)
        return _failed(n)

    def _failed_put(self, n: int, error: BaseException | None = None, fault: bool = True) -> PutResult:
        """A batch not stored. A fault (`error`, or none known: inside a backoff pause) fails it whole (FAILED,
        counted in write_errors); `fault` False is an OOM reply, the server full: a capacity refusal, rejected
        whole (counted in pages_rejected)."""
        conn = self.conn
        if error is not None:
            conn.fault("write_errors", error)
        elif fault:
            with conn.lock:
                conn.counts["write_errors"] += 1
        if fault:
            return _failed(n)
        with conn.lock:
            conn.counts["pages_rejected"] += n
        return _rejected(n)

    def _put_batch(self, client: Any, batch: _Batch) -> bytes:
        """The standalone put: one PUT_BATCH script; the per-page outcomes."""
        conn, keys = self.conn, self.keys
        pk, ck = keys.page, keys.children
        ns_order: dict[bytes, int] = {}
        infos: list[Any] = []
        for o in batch.origins:
            if o.namespace.id not in ns_order:
                ns_order[o.namespace.id] = len(ns_order) + 1
                infos.append(o.namespace)
        script_keys: list[bytes] = [keys.nsidx] + [keys.namespace(ns.id_hex) for ns in infos]
        args: list[Any] = [repr(batch.now), len(infos)]
        for ns in infos:
            args += [ns.id_hex, encoder.encode(ns.info(self.fingerprint_key))]
        fresh: set[bytes] = set()
        for h, v, m, rm, o in zip(batch.hashes, batch.values, batch.metas, batch.root_metas, batch.origins,
                                  strict=True):
            root = batch.roots[o.namespace.id]
            kind = ("r" if o.parent == root else "e" if o.key else "b" if o.parent in fresh else "s")
            fresh.add(h)
            script_keys += [pk(h), ck(o.parent), pk(o.parent), ck(root), ck(h)]
            args += [h, v, m, ns_order[o.namespace.id], o.parent.hex(), kind, rm, root.hex()]
        script_keys += [keys.shares, keys.format]
        *_, outcomes = conn.call(conn.put_batch, script_keys, args, client)
        return bytes(outcomes)

    def _put_cluster(self, client: Any, batch: _Batch) -> bytes:
        """The cluster put: one PUT_PAGE script per page, then the indexes and counters; the per-page outcomes.

        Parents are read first (another slot than the page): a token page's must be a stored page of its
        namespace (a race with a concurrent writer of the parent can only make it miss a wrong parent that a
        content-addressed hash already rules out); an engine page whose parent is not one (nor an earlier page
        of the batch) is written hanging from its root. The format record lives in another slot than the pages:
        checked first, not atomically with the writes (a loss between the check and the writes leaves pages
        that verify reports as orphans, as does a parent removed between its read and the child's write)."""
        conn, keys = self.conn, self.keys
        hashes, origins, roots = batch.hashes, batch.origins, batch.roots
        parents = [o.parent for o in origins]  # the parent each page is linked under
        metas = list(batch.metas)
        if not client.exists(keys.format):
            raise redis.ResponseError("KVCNOSTORE the format record is gone")
        fresh = set(hashes)
        earlier: dict[bytes, bytes] = {}  # page hash -> namespace id, of the pages before the one looked at
        to_check: list[int] = []
        for i, (h, o) in enumerate(zip(hashes, origins, strict=True)):
            if o.parent == roots[o.namespace.id]:
                pass
            elif o.key:  # linked under an earlier page of the batch only when that is of its namespace
                if o.parent not in earlier:
                    to_check.append(i)
                elif earlier[o.parent] != o.namespace.id:
                    parents[i], metas[i] = roots[o.namespace.id], batch.root_metas[i]
            elif o.parent not in fresh:
                to_check.append(i)
            earlier.setdefault(h, o.namespace.id)
        if to_check:
            pipe = client.pipeline(transaction=False)
            for i in to_check:
                pipe.hmget(keys.page(origins[i].parent), "n", "m")
            layout_id = self.layout.layout_id if self.layout is not None else b""
            for i, (up, m) in zip(to_check, pipe.execute(), strict=True):
                o = origins[i]
                if not o.key:
                    if up is None or up.decode() != o.namespace.id_hex:
                        raise _foreign_parent(hashes[i], o, stored=up is not None)
                    continue
                meta = None if m is None else decode_or_none(decode_meta, m)
                if meta is None or (meta.ns_id, meta.layout_id) != (o.namespace.id, layout_id):
                    parents[i], metas[i] = roots[o.namespace.id], batch.root_metas[i]
        # An engine page with pages already below it (a dropped corrupt copy of it left them) hangs from its root:
        # linked under one of them it would be its own ancestor, a cycle no eviction or walk ever ends.
        linked = [i for i, o in enumerate(origins) if o.key and parents[i] != roots[o.namespace.id]]
        if linked:
            pipe = client.pipeline(transaction=False)
            for i in linked:
                pipe.exists(keys.children(hashes[i]))
            for i, below in zip(linked, pipe.execute(), strict=True):
                if int(below):
                    parents[i], metas[i] = roots[origins[i].namespace.id], batch.root_metas[i]
        values = batch.values
        over = self._over_share(client, hashes, origins, len(values[0]) - HEADER if values else 0)
        pipe = client.pipeline(transaction=False)
        for i, (h, v, m, o) in enumerate(zip(hashes, values, metas, origins, strict=True)):
            if i in over:  # past its namespace's store share: only asked whether it is stored already
                pipe.exists(keys.page(h))
            else:
                conn.call(conn.put_page, [keys.page(h)],
                          [v, m, o.namespace.id_hex, parents[i].hex(), repr(batch.now)], client=pipe)
        flags = pipe.execute()
        outcomes = bytearray(len(hashes))
        for i, f in enumerate(flags):
            if i in over:
                outcomes[i] = PageOutcome.EXISTING if int(f) else PageOutcome.REJECTED
            else:
                outcomes[i] = PageOutcome.WRITTEN if int(f) == 1 else PageOutcome.EXISTING
        written_idx = [i for i, out in enumerate(outcomes) if out == PageOutcome.WRITTEN]
        # Indexes and counters after the pages: a reader never finds a children entry without its page; a writer
        # that dies here leaves a missing_index / counter_mismatch that verify reports and repair fixes.
        per_ns: dict[bytes, list[Any]] = {}
        pipe = client.pipeline(transaction=False)
        for i in written_idx:
            o = origins[i]
            pipe.sadd(keys.children(parents[i]), hashes[i])
            acc = per_ns.setdefault(o.namespace.id, [o.namespace, 0, 0, ""])
            acc[1] += 1
            acc[2] += len(values[i]) - HEADER
            if o.key or parents[i] == roots[o.namespace.id]:
                acc[3] = roots[o.namespace.id].hex()  # an engine page's hash hangs on its root: recorded always
        for ns, n, b, root in per_ns.values():
            conn.call(conn.ns_adjust, [keys.namespace(ns.id_hex)],
                      [encoder.encode(ns.info(self.fingerprint_key)), repr(batch.now), n, b, root], pipe)
            pipe.sadd(keys.nsidx, ns.id_hex)
        if written_idx:
            pipe.execute()
        return bytes(outcomes)

    def _over_share(self, client: Any, hashes: Sequence[bytes], origins: Sequence[PageOrigin],
                    nbytes: int) -> set[int]:
        """Cluster mode: indexes of the batch's pages past their namespace's store share. The pages of a
        namespace with a share are asked whether they are stored (those take no room) in the round trip after
        the limits. The shares hash and the counters live in other slots than the pages, so this is read before
        the writes, not atomically with them: concurrent writers of one namespace can overshoot it by a batch
        each."""
        keys = self.keys
        ns_hexes = sorted({o.namespace.id_hex for o in origins})
        pipe = client.pipeline(transaction=False)
        pipe.hmget(keys.shares, ["b:" + h for h in ns_hexes])
        for h in ns_hexes:
            pipe.hget(keys.namespace(h), "bytes")
        limits, *held = pipe.execute()
        room = {h: int(lim) - int(b or 0) for h, lim, b in zip(ns_hexes, limits, held, strict=True) if lim is not None}
        over: set[int] = set()
        if not room:
            return over
        limited = [i for i, o in enumerate(origins) if o.namespace.id_hex in room]
        pipe = client.pipeline(transaction=False)
        for i in limited:
            pipe.exists(keys.page(hashes[i]))
        stored = {i for i, there in zip(limited, pipe.execute(), strict=True) if there}
        counted: set[bytes] = set()  # a repeat of a page in the batch takes its room once
        for i in limited:
            h = origins[i].namespace.id_hex
            if i in stored or hashes[i] in counted:
                continue
            if room[h] < nbytes:
                room[h] = -1  # the rest of the namespace's pages in the batch go too: a stored chain is a prefix
                over.add(i)
            else:
                room[h] -= nbytes
                counted.add(hashes[i])
        return over


def _rejected(n: int) -> PutResult:
    """A batch of `n` pages the server refused whole for room (an OOM reply under maxmemory)."""
    return PutResult(0, 0, n, 0, 0, outcomes=bytes([PageOutcome.REJECTED]) * n)


def _failed(n: int) -> PutResult:
    """A batch of `n` pages none of which was written: a fault, a write the server would not take, a lost format
    record."""
    return PutResult(0, 0, 0, 0, 0, outcomes=bytes([PageOutcome.FAILED]) * n)


def _foreign_parent(page_hash: bytes, origin: PageOrigin, stored: bool) -> InvalidInput:
    # A parent that is no stored page may be another namespace's root: the page would be read in that namespace's
    # chain, so it is refused like a parent of another namespace.
    if stored:
        return InvalidInput(f"page {page_hash.hex()}: its parent is in another namespace than "
                            f"{origin.namespace.label}")
    return InvalidInput(f"page {page_hash.hex()}: its parent is not a stored page nor the root of namespace "
                        f"{origin.namespace.label}")
