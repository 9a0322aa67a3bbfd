"""The write path of an LMDB store: one `put` batch is one write transaction.

Pages, metadata, indexes and registry counters commit together or not at all, so a killed writer never leaves a
half page, a page without its metadata, or counters that disagree. The handle's logged reads and quarantined
pages are folded into the same transaction (`access`).

A token page is taken only under a parent that is its namespace's root or a stored page of its namespace (one
earlier in the batch counts); a batch with any other token page is refused whole (InvalidInput). An engine page
(`PageOrigin.key`) is linked under its parent when that is such a page of its namespace and layout, and under its
namespace root otherwise (its hash is its key's under that root, so it reads the same wherever it hangs), or
when pages already hang below it (orphans of its earlier copy: under one of them it would sit in its own
subtree). Room is made by evicting least recently used leaves (`bookkeeping.evict`): within a namespace over its
limit (its share, else the quota), then across the store over its capacity; the evicted pages are named in the
result (`PutResult.evicted_hashes`). What still does not fit is rejected, so what is stored of a chain stays a
prefix. The result says what became of
each page (`PutResult.outcomes`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, cast

import lmdb

from ...errors import InvalidInput
from ...types.ids import NamespaceId, PageHash
from ...types.keys import hash_root
from ...types.layout import KVLayout
from ..api import PageMeta, PageOrigin, PageOutcome, PutResult
from ..codec import CHECKSUM_FIELD, HEADER, Checksum, decode_meta, decode_namespace, encoder
from .access import AccessRecords, Taken
from .bookkeeping import NsDelta, StoreTotals, apply_deltas, delta, evict, limits, read_totals, store_share


class PutBatch:
    """One `put`, prepared outside its write transaction (the namespace roots, one scratch page value, the
    checksum seeds); `write` is the transaction's body, which may run more than once (env: a full map grows and
    reruns it), so every effect of it stays inside the transaction."""

    def __init__(self, dbs: Any, layout: KVLayout, checksum: Checksum, hashes: Sequence[PageHash],
                 views: Sequence[Any], origins: Sequence[PageOrigin], evict_headroom: float,
                 fingerprint_key: bytes | None, chain_key: bytes) -> None:
        self.dbs = dbs
        self.layout_id = layout.layout_id
        self.nbytes = layout.bytes_per_page
        self.hashes = hashes
        self.views = views  # the caller's pages as byte views, checked against the layout (base.put_views)
        self.origins = origins
        self.roots = {ns.id: hash_root(self.layout_id, ns, chain_key) for ns in {o.namespace for o in origins}}
        # The parent each new page is linked under: its origin's, but the root for an engine page whose parent is
        # not a page of its namespace and layout (filled by `_new_pages`, inside the transaction).
        self.parents: dict[int, PageHash] = {}
        # One page value reused for every page: [checksum][payload], the payload copied in and summed in place.
        self.scratch = bytearray(HEADER + self.nbytes)
        self.digest, self.seeds = checksum.digest, checksum.seeds(hashes)
        self.evict_headroom = evict_headroom
        self.fingerprint_key = fingerprint_key

    def write(self, txn: lmdb.Transaction, access: AccessRecords, taken: Taken) -> PutResult:
        """The body of the put's write transaction, folding in `taken` (`access.take()`) on the way."""
        now = time.time()
        dbs, nbytes = self.dbs, self.nbytes
        deltas: dict[NamespaceId, NsDelta] = {}
        totals = read_totals(txn, dbs)
        capacity, quota = limits(txn, dbs)
        dropped = access.fold(txn, dbs, taken, deltas)
        # What became of each page; WRITTEN (0) until found stored or refused room. Built inside the transaction,
        # like everything below: the body may run again (a full map grows).
        outcomes = bytearray(len(self.hashes))
        new, repeats = self._new_pages(txn, outcomes)
        gone: list[bytes] = []
        gone_keys: list[bytes] = []
        evicted, stored_bytes, ns_room = self._make_room(txn, new, deltas, totals.bytes - dropped[1], capacity,
                                                         quota, gone, gone_keys)
        room = capacity - stored_bytes if capacity else len(new) * nbytes
        accepted = self._admit(new, room, ns_room)
        if len(accepted) < len(new):
            for i in set(new).difference(accepted):
                outcomes[i] = PageOutcome.REJECTED
        for i, first in repeats:  # a repeat is what its first copy became: existing once written, else rejected
            outcomes[i] = PageOutcome.EXISTING if outcomes[first] != PageOutcome.REJECTED else PageOutcome.REJECTED
        self._store(txn, accepted, deltas, now)
        written = len(accepted)
        apply_deltas(txn, dbs, deltas, now, self.fingerprint_key)
        pages_now = totals.pages - dropped[0] - evicted + written
        txn.put(b"totals", encoder.encode(StoreTotals(pages_now, stored_bytes + written * nbytes)), db=dbs.store)
        rejected = outcomes.count(PageOutcome.REJECTED)
        # `gone`: the keys of the pages evict() took, page hashes all (one cast of the list, no call per page)
        return PutResult(written, len(self.hashes) - written - rejected, rejected, evicted, written * nbytes,
                         cast("list[PageHash]", gone),
                         gone_keys, bytes(outcomes))

    def _new_pages(self, txn: lmdb.Transaction, outcomes: bytearray) -> tuple[list[int], list[tuple[int, int]]]:
        """Indexes of the pages not stored yet (the first of each hash), each token page checked to hang from its
        namespace root or a stored page of its namespace, each engine page's link settled (`parents`); and the
        repeats of a new page later in the batch, (index, index of the first). Pages stored already are marked
        EXISTING in `outcomes`."""
        dbs, hashes, origins, roots, parents = self.dbs, self.hashes, self.origins, self.roots, self.parents
        first: dict[PageHash, int] = {}  # page hash -> its first index in the batch
        fresh: set[PageHash] = set()  # pages of this batch not stored before it
        new: list[int] = []
        repeats: list[tuple[int, int]] = []
        parents.clear()
        for i, h in enumerate(hashes):
            if h in first:
                if h in fresh:
                    repeats.append((i, first[h]))
                else:
                    outcomes[i] = PageOutcome.EXISTING
                continue
            first[h] = i
            if txn.get(h, db=dbs.meta) is not None:
                outcomes[i] = PageOutcome.EXISTING
                continue
            fresh.add(h)
            new.append(i)
            origin = origins[i]
            if origin.key:
                parents[i] = self._engine_parent(txn, h, origin, first, fresh)
            elif origin.parent != roots[origin.namespace.id] and origin.parent not in fresh:
                # The chain check of put_views cannot see the namespace; a stored parent can (a parent new in this
                # batch was checked against the batch before the transaction). A parent that is no stored page
                # may be another namespace's root: that page would be read in the other namespace's chain, so it
                # is refused like one.
                raw = txn.get(origin.parent, db=dbs.meta)
                if raw is None:
                    raise InvalidInput(f"page {h.hex()}: its parent is not a stored page nor the root of "
                                       f"namespace {origin.namespace.label}")
                if decode_meta(raw).ns_id != origin.namespace.id:
                    raise InvalidInput(f"page {h.hex()}: its parent is in another namespace than "
                                       f"{origin.namespace.label}")
        return new, repeats

    def _engine_parent(self, txn: lmdb.Transaction, h: PageHash, origin: PageOrigin, first: dict[PageHash, int],
                       fresh: set[PageHash]) -> PageHash:
        """Where new engine page `h` is linked: its origin's parent when that is its root, a page new earlier in
        the batch of its namespace (put_views checked the batch; the whole batch has this handle's layout) or a
        stored page of its namespace and layout; its root otherwise (the engine's parent is a hint, never
        required). Its root too when pages already hang below it: a copy of it was dropped (corrupt) and left them,
        and linked under one of them it would be its own ancestor (a cycle no eviction or walk ever ends)."""
        root = self.roots[origin.namespace.id]
        parent = origin.parent
        if parent == root or parent == h or txn.cursor(db=self.dbs.children).set_key(h):
            return root
        if parent in fresh:
            up = self.origins[first[parent]]
            return parent if up.namespace.id == origin.namespace.id else root
        raw = txn.get(parent, db=self.dbs.meta)
        if raw is None:
            return root
        meta = decode_meta(raw)
        return parent if (meta.ns_id, meta.layout_id) == (origin.namespace.id, self.layout_id) else root

    def _make_room(self, txn: lmdb.Transaction, new: list[int], deltas: dict[NamespaceId, NsDelta], stored_bytes: int,
                   capacity: int, quota: int, gone: list[bytes], gone_keys: list[bytes]
                   ) -> tuple[int, int, dict[NamespaceId, int]]:
        """Evict for the new pages: within each namespace over its limit (its share, or the quota), then across
        the store over the capacity. (pages evicted, payload bytes stored after, payload room left of each
        namespace with a limit); the evicted pages' hashes are appended to `gone`, their engine keys to
        `gone_keys`."""
        dbs, nbytes, origins = self.dbs, self.nbytes, self.origins
        evicted = 0
        protect: set[bytes] = set(self.hashes) | {o.parent for o in origins}
        # Evictions take a little past the need so the scan behind one is paid once per many puts.
        ns_room: dict[NamespaceId, int] = {}
        ns_need: Counter[NamespaceId] = Counter(origins[i].namespace.id for i in new)
        for ns_id, n_new in ns_need.items():
            limit = store_share(txn, dbs, ns_id) or quota
            if not limit:
                continue
            raw = txn.get(ns_id, db=dbs.namespaces)
            held = decode_namespace(raw).bytes if raw is not None else 0
            held += deltas[ns_id].bytes if ns_id in deltas else 0  # corrupt pages dropped in this transaction
            if held + n_new * nbytes > limit:
                target = held + n_new * nbytes - limit + int(self.evict_headroom * limit)
                n, freed = evict(txn, dbs, target, protect, deltas, only_ns=ns_id, gone=gone, gone_keys=gone_keys)
                evicted += n
                held -= freed
                stored_bytes -= freed
            ns_room[ns_id] = limit - held
        need = len(new) * nbytes
        if capacity and stored_bytes + need > capacity:
            target = stored_bytes + need - capacity + int(self.evict_headroom * capacity)
            n, freed = evict(txn, dbs, target, protect, deltas, gone=gone, gone_keys=gone_keys)
            evicted += n
            stored_bytes -= freed
        return evicted, stored_bytes, ns_room

    def _admit(self, new: list[int], room: int, ns_room: dict[NamespaceId, int]) -> list[int]:
        """The new pages that fit, in batch order. Once a page of a namespace is rejected so are the namespace's
        later pages (all of them, once the store is full), so what is stored of a chain stays a prefix."""
        nbytes, origins = self.nbytes, self.origins
        accepted: list[int] = []
        full: set[NamespaceId] = set()  # namespaces with a rejected page in this batch
        for i in new:
            ns_id = origins[i].namespace.id
            if room < nbytes:
                break
            if ns_id in full or ns_room.get(ns_id, nbytes) < nbytes:
                full.add(ns_id)
                continue
            accepted.append(i)
            room -= nbytes
            if ns_id in ns_room:
                ns_room[ns_id] -= nbytes
        return accepted

    def _store(self, txn: lmdb.Transaction, accepted: list[int], deltas: dict[NamespaceId, NsDelta], now: float) -> None:
        """Write the accepted pages, their metadata and their child links; their counters go into `deltas`."""
        dbs, nbytes, layout_id, roots, parents = self.dbs, self.nbytes, self.layout_id, self.roots, self.parents
        hashes, views, origins, digest, seeds = self.hashes, self.views, self.origins, self.digest, self.seeds
        scratch = self.scratch
        value = memoryview(scratch)
        payload = value[HEADER:]
        metas: list[tuple[bytes, bytes]] = []
        links: list[tuple[bytes, bytes]] = []
        for i in accepted:
            h, origin = hashes[i], origins[i]
            # The checksum is taken of the copy, still in cache: one read of the caller's page instead of two,
            # and what is summed is exactly what is stored even if the caller's buffer changes meanwhile.
            view = views[i]
            if type(view) is memoryview:
                payload[:] = view
            else:  # a page in segments (checks.Segments), gathered in order
                view.gather(payload)
            checksum = digest(payload, seeds[i])
            CHECKSUM_FIELD.pack_into(scratch, 0, checksum)
            txn.put(h, value, db=dbs.pages)
            ns_id = origin.namespace.id
            d = delta(deltas, ns_id)
            if origin.key:
                # An engine page's hash hangs on its root wherever it is linked: the root is recorded for it
                # (an audit without the chain key checks the hash against the recorded roots).
                parent = parents[i]
                meta = PageMeta(ns_id, layout_id, parent, b"", nbytes, checksum, now, now, 0, origin.key)
                d.roots.add(roots[ns_id].hex())
            else:
                parent = origin.parent
                meta = PageMeta(ns_id, layout_id, parent, origin.tokens, nbytes, checksum, now, now, 0)
                if parent == roots[ns_id]:
                    d.roots.add(parent.hex())
            metas.append((h, encoder.encode(meta)))
            links.append((parent, h))
            d.info = origin.namespace
            d.pages += 1
            d.bytes += nbytes
            d.last_access = now
        # Index records go in with putmulti: one C loop per sub-database instead of a Python call per record.
        txn.cursor(db=dbs.meta).putmulti(metas)
        txn.cursor(db=dbs.children).putmulti(links)
