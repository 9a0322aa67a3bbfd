"""The checks of the shared integrity audit (`kvcache.storage.verify`): what counts as a finding of each
VERIFY_KINDS kind, and which findings make a page removable.

- every stored page value (`check_page`, fed by `IntegritySource.scan_pages`): its checksum, its size against its
  metadata and its layout, its hash against its metadata's parent and tokens (an engine page's: against its key
  under its namespace root, `EngineHashes`), whether its layout and namespace are recorded and whether the children
  index lists it under its parent;
- the prefix trees, read as one snapshot where the backend has one (`check_snapshot`): metadata without bytes,
  chains whose head hangs from neither a stored page nor its namespace root (`orphan`), pages tagged with another
  namespace or layout than their parent's, children entries that name no page filed under that parent, and
  registry counters against the pages stored.

Every field of a page's metadata record (`PageMeta`) is covered by a check: `ns_id` and `layout_id` (recorded in
the registry and the layouts, the same as its parent's), `parent` and `tokens` (the hash chain: the page's hash is
H(parent || tokens), and the parent is a stored page or its namespace's root), `key` (an engine page's hash under
its root), `nbytes` (the stored size, the layout's page size), `checksum` (the value's own), `created` and
`last_access` (finite, inside the store's life give or take a day of clock skew, and created <= last_access), and
`hits` (not negative, not above its namespace's count, and the pages of a namespace together not above it:
`implausible`, `_check_counters`). A low bit flipped in a time, or a hit count that stays plausible, is beyond any
check; one that would steer eviction or an incremental audit far off is not.
"""

from __future__ import annotations

import math
from typing import cast

from ..types.ids import NamespaceId, PageHash
from ..types.keys import hash_root_of_id
from ..types.layout import KVLayout
from .api import NamespaceRecord, PageMeta
from .chain import ChainRoots
from .codec import HEADER, Checksum, chains_to, engine_keyed, stored_checksum
from .verify_source import IMPLAUSIBLE, Findings, PageRow, ScannedPage, Snapshot

CLOCK_SKEW_S = 86400.0  # how far a page's times may lie outside the store's life before they are a finding


class EngineHashes:
    """The hash check of engine pages in one audit: a page's hash is its key's under its namespace/layout root
    (`codec.engine_keyed`). With the chain key each (layout, namespace) root is computed once and a page is judged
    as it is scanned; without it (a reader who may not read the store's secret) a root is one its namespace's
    record keeps, known with the snapshot only, so the page is held until then (`settle`)."""

    __slots__ = ("chain_key", "roots", "held")

    def __init__(self, chain_key: bytes | None) -> None:
        self.chain_key = chain_key
        self.roots: dict[tuple[bytes, NamespaceId], PageHash] = {}  # (layout id, namespace id) -> its root
        self.held: list[tuple[bytes, PageMeta]] = []  # pages to judge once the registry is read (no chain key)

    def sound(self, page_hash: bytes, meta: PageMeta) -> bool | None:
        """Whether engine page `page_hash` is its key's under its root; None: held for `settle`."""
        if self.chain_key is None:
            self.held.append((page_hash, meta))
            return None
        pair = (meta.layout_id, meta.ns_id)
        root = self.roots.get(pair)
        if root is None:
            root = self.roots[pair] = hash_root_of_id(meta.layout_id, meta.ns_id, self.chain_key)
        return engine_keyed(page_hash, meta, (root,))

    def settle(self, registry: dict[bytes, NamespaceRecord]) -> list[tuple[bytes, PageMeta]]:
        """The held pages whose hash is their key's under none of the roots their namespace's record keeps. A page
        of a namespace without a record that decodes is not judged: that record's own finding covers it."""
        bad = []
        for h, meta in self.held:
            record = registry.get(meta.ns_id)
            if record is not None and not engine_keyed(h, meta, recorded_roots(record)):
                bad.append((h, meta))
        self.held = []
        return bad


def recorded_roots(record: NamespaceRecord) -> list[PageHash]:
    """The roots a namespace record keeps (a damaged entry names none)."""
    roots = []
    for root in record.roots:
        try:
            roots.append(bytes.fromhex(root))
        except ValueError:
            continue
    return cast("list[PageHash]", roots)  # a record's roots: one cast, no call per root


def hash_mismatch(found: Findings, h: bytes, meta: PageMeta) -> None:
    """A page filed under a hash its metadata does not give."""
    if meta.key:
        found.add("hash_mismatch", h, f"not the hash of its {len(meta.key)}-byte engine key under the root of its "
                                      f"namespace and layout: a page filed under a wrong hash", remove=True)
    else:
        found.add("hash_mismatch", h, f"not H(parent {meta.parent.hex()} || its {len(meta.tokens)} token "
                                      f"bytes): a page filed under a wrong hash", remove=True)


def life(created: float, now: float | None = None) -> tuple[float, float]:
    """The times a page's `created` and `last_access` may take in a store created at `created` (0: unknown),
    audited `now`: from its creation to now, give or take CLOCK_SKEW_S (a clock stepped back or ahead)."""
    import time

    return (created - CLOCK_SKEW_S if created > 0 else 0.0,
            (time.time() if now is None else now) + CLOCK_SKEW_S)


def implausible(meta: PageMeta, times: tuple[float, float], ns_hits: int = -1) -> str:
    """What in `meta`'s own fields cannot be ("": nothing): what no check of the page's bytes, hash or place
    covers. `created` and `last_access` are finite, not before the store's creation nor after now (`times`, as
    `life` gives them; (0, 0): the upper bound unknown), and `created <= last_access` (a write sets both, a read
    only moves `last_access` on); `hits` is not negative and not above the hits its namespace's record counts
    (`ns_hits`, -1: unknown; every read that ends at a page counts in its namespace too, so a page never holds
    more). A flip there would steer `--since` and eviction, which trust them."""
    low, high = times
    for name, value in (("created", meta.created), ("last_access", meta.last_access)):
        if not math.isfinite(value) or value < low or (high > 0 and value > high):
            return f"its {name} {value!r} lies outside the store's life ({low:.0f} to {high:.0f}, unix seconds)"
    if meta.created > meta.last_access:
        return f"its created {meta.created!r} is after its last_access {meta.last_access!r}"
    if meta.hits < 0 or (ns_hits >= 0 and meta.hits > ns_hits):
        return f"its hits {meta.hits} are not between 0 and the {ns_hits} its namespace counts" if ns_hits >= 0 \
            else f"its hits {meta.hits} are negative"
    return ""


def check_page(found: Findings, page: ScannedPage, layouts: dict[bytes, KVLayout], checksum: Checksum,
               engine: EngineHashes, times: tuple[float, float] = (0.0, 0.0)) -> None:
    """The checks of one stored page value against its checksum, its metadata and its layout (an engine page's
    hash through `engine`), and of its metadata's own fields (`implausible`; `times`: the store's life, as
    `life` gives it)."""
    h, value, meta = page.page_hash, page.value, page.meta
    if len(value) < HEADER:
        found.add("size_mismatch", h, f"{len(value)} bytes stored: not even a checksum", remove=True)
        return
    stored_sum = stored_checksum(value)
    payload = memoryview(value)[HEADER:]
    if checksum.of(payload, h) != stored_sum:
        found.add("checksum_mismatch", h, "payload does not match its checksum", remove=True)
    if meta is None:
        found.add("missing_meta", h, "its metadata does not decode (a damaged record)" if page.damaged else
                  "page without metadata", remove=True)
        return
    size = len(payload)
    if meta.checksum != stored_sum:
        found.add("checksum_mismatch", h, "metadata checksum differs from the page's", remove=True)
    if meta.nbytes != size:
        found.add("size_mismatch", h, f"{size} bytes stored, metadata says {meta.nbytes}", remove=True)
    if (engine.sound(h, meta) if meta.key else chains_to(h, meta)) is False:
        hash_mismatch(found, h, meta)
    layout = layouts.get(meta.layout_id)
    if layout is None:
        found.add("unknown_layout", h, f"layout {meta.layout_id.hex()} is not recorded")
    elif layout.bytes_per_page != size:
        found.add("size_mismatch", h, f"{size} bytes stored, layout {layout.describe()} pages are "
                                      f"{layout.bytes_per_page}", remove=True)
    if not page.registered:
        # never the raw namespace id: next to a page's tokens it would let a short salt be guessed back
        found.add("unknown_namespace", h, "its namespace is not in the registry")
    odd = implausible(meta, times, page.ns_hits)
    if odd:
        found.add(IMPLAUSIBLE, h, odd)
    if not page.indexed:
        found.relink.setdefault(h, found.add("missing_index", h, "not listed under its parent in children"))


def check_snapshot(found: Findings, snap: Snapshot, layouts: dict[bytes, KVLayout],
                   chain_key: bytes | None, engine: EngineHashes | None = None) -> dict[bytes, list[bytes]]:
    """The tree, index and counter checks of one snapshot, namespace roots keyed by `chain_key` (None: the roots
    the namespace records keep), and the hash checks of the engine pages `engine` held for the registry. Returns
    parent -> children as the metadata says (what repair walks, besides the children index)."""
    tree = snap.tree
    for h in sorted(snap.bodiless):
        why = "metadata that does not decode, without a page" if h in snap.damaged else "metadata without a page"
        found.add("missing_page", h, why, remove=True)
    registry: dict[bytes, NamespaceRecord] = {}
    for ns_id, record in snap.registry.items():
        if record is None:
            found.damaged_record("namespaces", ns_id)
        else:
            registry[ns_id] = record
    for h, meta in engine.settle(registry) if engine is not None else ():
        hash_mismatch(found, h, meta)
    # Every root a page may hang from: each (layout, namespace) pair the pages or the records name.
    pairs = {(row.layout_id, row.ns_id) for row in tree.values()} | {(lay, ns) for lay in layouts for ns in registry}
    roots = ChainRoots(chain_key, pairs, registry)
    kids: dict[bytes, list[bytes]] = {}
    for h, row in tree.items():
        kids.setdefault(row.parent, []).append(h)
    for h, row in tree.items():
        up = tree.get(row.parent)
        if up is not None:
            if (up.ns_id, up.layout_id) != (row.ns_id, row.layout_id):
                found.add("namespace_mismatch", h, f"tagged namespace {row.ns_id.hex()} / layout "
                                                   f"{row.layout_id.hex()}, its parent {row.parent.hex()} namespace "
                                                   f"{up.ns_id.hex()} / layout {up.layout_id.hex()}", remove=True)
        elif (owner := roots.owner(row.parent)) is not None:
            if not roots.belongs(row.parent, row.layout_id, row.ns_id):
                other_lay, other_ns = owner
                found.add("namespace_mismatch", h, f"tagged namespace {row.ns_id.hex()} / layout "
                                                   f"{row.layout_id.hex()}, its parent is the root of namespace "
                                                   f"{other_ns.hex()} / layout "
                                                   f"{other_lay.hex() if other_lay else '(unknown)'}", remove=True)
        elif not roots.keyed and row.ns_id not in registry:
            pass  # no key and no record of its namespace to read roots from: its record's finding covers it
        elif row.engine:
            pass  # its parent is a hint: reachable by its key (its hash is checked apart: hash_mismatch)
        elif row.parent not in snap.headless:  # parent bytes without metadata: that page's finding covers it
            below, below_bytes = subtree_size(h, kids, tree)
            found.add("orphan", h, f"parent {row.parent.hex()} is neither a stored page nor a namespace root: "
                                   f"unreachable with the {below} page(s) ({below_bytes} bytes) below it", remove=True)
    for parent, child in snap.links:
        if child in snap.damaged and child in found.by_page:
            # the entry of a page whose metadata is damaged: it goes when repair removes that page
            found.unlink.append((parent, child, found.by_page[child][0]))
            continue
        up = tree.get(child)
        if up is None or up.parent != parent:
            why = ("names a page that is not stored" if up is None else
                   f"files it under {parent.hex()}, its metadata names parent {up.parent.hex()}")
            found.unlink.append((parent, child, found.add("dangling_index", child, f"children entry {why}")))
    _check_counters(found, snap, registry)
    return kids


def _check_counters(found: Findings, snap: Snapshot, registry: dict[bytes, NamespaceRecord]) -> None:
    per_ns: dict[bytes, list[int]] = {}
    for h, row in snap.tree.items():
        if h not in snap.bodiless:
            acc = per_ns.setdefault(row.ns_id, [0, 0, 0])
            acc[0] += 1
            acc[1] += row.nbytes
            acc[2] = -1 if row.hits < 0 or acc[2] < 0 else acc[2] + row.hits
    for ns_id, record in registry.items():
        n_pages, n_bytes, n_hits = per_ns.get(ns_id, [0, 0, 0])
        if (record.pages, record.bytes) != (n_pages, n_bytes):
            found.recount.append(found.add("counter_mismatch", None, f"namespace {record.ns_id_hex}: registry says "
                                                                     f"{record.pages} pages / {record.bytes} bytes, "
                                                                     f"store holds {n_pages} / {n_bytes}"))
        if n_hits > record.hits:
            # every read that ends at a page counts in its namespace too: the pages never hold more hits
            found.recount.append(found.add("counter_mismatch", None, f"namespace {record.ns_id_hex}: its pages "
                                                                     f"count {n_hits} hits, the registry "
                                                                     f"{record.hits}"))
    if snap.totals is None:
        return
    stored = (sum(p[0] for p in per_ns.values()), sum(p[1] for p in per_ns.values()))
    if snap.totals != stored:
        said = ("the store totals record does not decode" if snap.totals[0] < 0 else
                f"store totals say {snap.totals[0]} pages / {snap.totals[1]} bytes")
        found.recount.append(found.add("counter_mismatch", None, f"{said}, the store holds {stored[0]} / "
                                                                 f"{stored[1]}"))


def subtree_size(top: bytes, kids: dict[bytes, list[bytes]], tree: dict[bytes, PageRow]) -> tuple[int, int]:
    """(pages, payload bytes) below `top` by the parents its descendants' metadata name."""
    pages = nbytes = 0
    seen = {top}
    stack = list(kids.get(top, ()))
    while stack:
        h = stack.pop()
        if h in seen:
            continue  # only a corrupt parent link can cycle; hash_mismatch reports it
        seen.add(h)
        pages += 1
        nbytes += tree[h].nbytes
        stack.extend(kids.get(h, ()))
    return pages, nbytes
