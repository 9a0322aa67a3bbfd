"""Ownership audit: is every page of every pool held by exactly one owner, and is the tree well formed? And the
entry point of the L3 integrity audit of a store (`audit_store`), which survives a damaged store.

One implementation for a live cache and for a dumped state: `ownership.collect_state(cache)` reads a cache into
an `OwnershipState` (plain msgspec data: the ledgers, the free lists and every reference holder — tree nodes, live
requests, in-flight operations, staged records), and `check_state(state)` runs every check on it. A snapshot is
that state serialised, so an offline audit of a dump runs exactly the checks a live audit runs.

Checks:

- partition, per pool: the pages referenced by holders plus the free list cover every page exactly once
  (`leak`: nobody; `double_owner`: twice or more);
- ledger agreement: each holder's pages are recorded as owned by that holder (`dangling_ref` when the ledger names
  another owner, `free_but_referenced` when it says FREE), and free-list pages are recorded FREE
  (`free_list_mismatch`);
- structure: lock, hold and pin counts are never negative (`lock_underflow`) and equal what live requests,
  prefetches, staged records and in-flight operations account for (`lock_mismatch`, `hold_mismatch`,
  `pin_mismatch`); device and host copies each form a prefix from the
  namespace root (`device_not_prefix`, `host_not_prefix`); every node holds a copy (`empty_node`) of exactly its
  key's pages (`page_count_mismatch`) in its own namespace (`namespace_mix`); holders point at attached nodes
  (`detached_ref`); the tree's evictable/held/protected sizes equal their recomputed values (`size_mismatch`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from ..types.ids import NodeId, OwnerCode
from ..types.owners import FREE_CODE, OwnerKind, describe_code, owner_code
from ..types.reports import AuditChecked, AuditReport, Violation, ViolationKind
from .ownership import NodeState, OwnershipSource, OwnershipState, PoolState, TreeSizes, collect_state, pages_of
from .snapshot import Snapshot, decode_snapshot

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..storage.api import VerifyReport
    from ..storage.verify_parts import AuditScope

_MAX_LISTED = 32  # pages listed per violation; `count` has the full number


# the order size findings are reported in (tier, then evictable, held, protected)
_SIZE_ORDER = {name: i for i, name in enumerate(("device_evictable", "device_held", "device_protected",
                                                "host_evictable", "host_held", "host_protected"))}

def audit_cache(cache: OwnershipSource) -> AuditReport:
    """Audit a live cache."""
    return check_state(collect_state(cache))


def audit_snapshot(doc: Snapshot | bytes) -> AuditReport:
    """Audit a snapshot (a `kvcache.diagnostics.snapshot.Snapshot`, or its encoded bytes) with the checks of a
    live audit."""
    if isinstance(doc, (bytes, bytearray, memoryview)):
        doc = decode_snapshot(bytes(doc))
    return check_state(doc.state)


def audit_store(location: str, repair: bool = False, force: bool = False, lock: bool = True,
                scope: "AuditScope | None" = None,
                progress: "Callable[[str, int], None] | None" = None) -> "VerifyReport":
    """The L3 integrity audit of the store at `location` (`L3Store.verify`), with `repair` what base.REPAIRS
    allows. A backend that can run it isolated (LMDB: in child processes, so that a B-tree damaged enough to make
    LMDB abort yields a `structure_corrupt` finding instead of killing the caller, and a repair rebuilds it) does;
    any other is opened here and verified. `force`: let an LMDB rebuild replace a file that is not LMDB, or keep
    nothing (RepairRefused otherwise). `lock` False: LMDB reads the store lock-free, writing nothing to its
    directory (any other backend is opened read-only as it is without `repair`).

    `scope` (`kvcache.storage.verify_parts.AuditScope`): how many worker processes read the pages, and whether
    only the pages changed since a time (or since the store's last clean audit) are checked; a backend that
    cannot (any but LMDB) runs its full serial audit, and the report's `scope` says which ran. `progress(what,
    records)`: called as the audit walks the store (LMDB). An LMDB store records each audit it may write
    (`AuditHistory`): `since_last` reads it."""
    import contextlib

    from ..storage.registry import backend_class, open_store, scheme_of

    isolated = getattr(backend_class(scheme_of(location)), "verify_location", None)
    if isolated is not None:
        report: VerifyReport = isolated(location, repair=repair, force=force, lock=lock, scope=scope,
                                        progress=progress)
        return report
    with contextlib.closing(open_store(location, readonly=not repair)) as store:
        return store.verify(repair=repair)


# --- the checks ----------------------------------------------------------------------------------------------


def check_state(state: OwnershipState) -> AuditReport:
    """Run every check on `state`."""
    out: list[Violation] = []
    by_id = {n.id: n for n in state.nodes}
    for pool in state.pools:
        _check_pool(pool, state, out)
    _check_structure(state, by_id, out)
    _check_counts(state, by_id, out)
    checked = AuditChecked(pages=sum(p.num_pages for p in state.pools), nodes=len(state.nodes),
                           requests=sum(h.kind == "request" for h in state.holders),
                           ops=sum(h.kind.startswith("op:") for h in state.holders),
                           staged=sum(h.kind == "staged" for h in state.holders))
    return AuditReport(not out, out, checked)


class _Ref(msgspec.Struct):
    label: str  # how the holder reads in a report
    owner: OwnerCode
    pages: np.ndarray
    node: NodeId | None = None
    rid: str | None = None


def _refs(pool: PoolState, state: OwnershipState) -> list[_Ref]:
    refs = []
    for n in state.nodes:
        pages = n.device if pool.name == "device" else n.host if pool.name == "host" else None
        if pages is not None and not n.namespace_root:
            refs.append(_Ref(f"node#{n.id}", owner_code(OwnerKind.NODE, n.id), pages_of(pages), node=n.id))
    for h in state.holders:
        if h.pool == pool.name:
            label = f"{h.kind}#{h.id}" + (f" ({h.rid})" if h.rid else "")
            refs.append(_Ref(label, h.owner, pages_of(h.pages), rid=h.rid))
    return refs


def _listed(pages: np.ndarray) -> list[int]:
    return [int(p) for p in pages[:_MAX_LISTED]]


def _check_pool(pool: PoolState, state: OwnershipState, out: list[Violation]) -> None:
    n = pool.num_pages
    ledger = pages_of(pool.owners)
    free = pages_of(pool.free_list)
    refs = _refs(pool, state)
    arrays = []
    for r in refs:
        bad = (r.pages < 0) | (r.pages >= n)
        if bad.any():
            out.append(Violation(ViolationKind.DANGLING_REF, f"{r.label} references pages outside the {pool.name} "
                                 f"pool (0..{n - 1})", pool.name, _listed(r.pages[bad]), int(bad.sum()),
                                 [r.label], r.node, r.rid))
            r.pages = r.pages[~bad]
        arrays.append(r.pages)
    arrays.append(free)
    count = np.bincount(np.concatenate(arrays), minlength=n) if n else np.zeros(0, np.int64)

    nobody = np.flatnonzero(count == 0)
    if len(nobody):
        groups: dict[int, list[int]] = defaultdict(list)
        for p in nobody.tolist():
            groups[int(ledger[p]) if pool.ledger_enabled else FREE_CODE].append(p)
        for code, pages in groups.items():
            who = describe_code(code) + (" (and not on the free list)" if code == FREE_CODE else "")
            out.append(Violation(ViolationKind.LEAK, f"{len(pages)} {pool.name} pages owned by {who} are held by "
                                 f"no node, request, operation or staged record", pool.name, pages[:_MAX_LISTED],
                                 len(pages), [describe_code(code)]))
    twice = np.flatnonzero(count > 1)
    if len(twice):
        holders: dict[int, list[str]] = defaultdict(list)
        twice_set = set(twice.tolist())
        for r in refs:
            for p in set(r.pages.tolist()) & twice_set:
                holders[p].append(r.label)
            if len(set(r.pages.tolist())) != len(r.pages):  # the same page twice in one holder
                uniq, c = np.unique(r.pages, return_counts=True)
                for p in uniq[c > 1].tolist():
                    holders[p].append(r.label)
        for p in set(free.tolist()) & twice_set:
            holders[p].append("free list")
        for p in twice.tolist()[:_MAX_LISTED]:
            out.append(Violation(ViolationKind.DOUBLE_OWNER, f"{pool.name} page {p} is held {int(count[p])} times: "
                                 f"{', '.join(holders[p])}", pool.name, [p], int(count[p]), holders[p]))

    if not pool.ledger_enabled:
        return
    for r in refs:
        recorded = ledger[r.pages]
        wrong = recorded != r.owner
        if not wrong.any():
            continue
        freed = wrong & (recorded == FREE_CODE)
        other = wrong & ~freed
        if freed.any():
            out.append(Violation(ViolationKind.FREE_BUT_REFERENCED, f"{r.label} references {int(freed.sum())} "
                                 f"{pool.name} pages the ledger records as free", pool.name,
                                 _listed(r.pages[freed]), int(freed.sum()), [r.label, "free"], r.node, r.rid))
        if other.any():
            names = sorted({describe_code(c) for c in recorded[other][:_MAX_LISTED].tolist()})
            out.append(Violation(ViolationKind.DANGLING_REF, f"{r.label} references {int(other.sum())} "
                                 f"{pool.name} pages the ledger gives to {', '.join(names)}", pool.name,
                                 _listed(r.pages[other]), int(other.sum()), [r.label, *names], r.node, r.rid))
    owned = ledger[free] != FREE_CODE
    if owned.any():
        names = sorted({describe_code(c) for c in ledger[free][owned][:_MAX_LISTED].tolist()})
        out.append(Violation(ViolationKind.FREE_LIST_MISMATCH, f"{int(owned.sum())} {pool.name} pages on the free "
                             f"list are recorded as owned by {', '.join(names)}", pool.name,
                             _listed(free[owned]), int(owned.sum()), names))


def _check_structure(state: OwnershipState, by_id: dict[NodeId, NodeState], out: list[Violation]) -> None:
    ps = state.page_size
    for n in state.nodes:
        if min(n.lock_ref, n.pins, n.host_pins, n.device_holds, n.host_holds) < 0:
            out.append(Violation(ViolationKind.LOCK_UNDERFLOW, f"node#{n.id} has lock_ref={n.lock_ref}, "
                                 f"holds={n.device_holds}/{n.host_holds}, pins={n.pins}, host_pins={n.host_pins}",
                                 node=n.id))
        if n.namespace_root:
            continue
        parent = by_id.get(n.parent)
        if parent is None:
            out.append(Violation(ViolationKind.DETACHED_REF, f"node#{n.id}'s parent #{n.parent} is not in the tree",
                                 node=n.id))
            continue
        if parent.namespace != n.namespace:
            out.append(Violation(ViolationKind.NAMESPACE_MIX, f"node#{n.id} (namespace {n.namespace[:8]}) is under "
                                 f"node#{parent.id} of namespace {parent.namespace[:8]}", node=n.id))
        if n.device is None and n.host is None:
            out.append(Violation(ViolationKind.EMPTY_NODE, f"node#{n.id} holds neither a device nor a host copy",
                                 node=n.id))
        for tier, pages in (("device", n.device), ("host", n.host)):
            if pages is not None and len(pages_of(pages)) * ps != n.tokens:
                out.append(Violation(ViolationKind.PAGE_COUNT_MISMATCH, f"node#{n.id} has {n.tokens} tokens but "
                                     f"{len(pages_of(pages))} {tier} pages of {ps}", tier, node=n.id))
        if not parent.namespace_root:
            if n.device is not None and parent.device is None:
                out.append(Violation(ViolationKind.DEVICE_NOT_PREFIX, f"node#{n.id} has a device copy, its parent "
                                     f"node#{parent.id} has none", "device", node=n.id))
            if n.host is not None and parent.host is None:
                out.append(Violation(ViolationKind.HOST_NOT_PREFIX, f"node#{n.id} has a host copy, its parent "
                                     f"node#{parent.id} has none", "host", node=n.id))


def _check_counts(state: OwnershipState, by_id: dict[NodeId, NodeState], out: list[Violation]) -> None:
    locks: dict[int, int] = defaultdict(int)
    device_holds: dict[int, int] = defaultdict(int)
    host_holds: dict[int, int] = defaultdict(int)
    pins: dict[int, int] = defaultdict(int)
    host_pins: dict[int, int] = defaultdict(int)
    for h in state.holders:
        for verb, ids, counts in (("locks", h.locks, locks), ("holds the device copies of", h.device_holds,
                                                              device_holds),
                                  ("holds the host copies of", h.host_holds, host_holds)):
            for node_id in ids:  # locks and holds take the node's whole path
                walk = by_id.get(node_id)
                if walk is None and node_id != 0:
                    out.append(Violation(ViolationKind.DETACHED_REF, f"{h.kind}#{h.id} {verb} node#{node_id}, "
                                         f"which is not in the tree", node=node_id, rid=h.rid))
                while walk is not None:
                    counts[walk.id] += 1
                    walk = by_id.get(walk.parent)
        for node_id in h.pins:
            if node_id not in by_id:
                out.append(Violation(ViolationKind.DETACHED_REF, f"{h.kind}#{h.id} pins node#{node_id}, which is "
                                     f"not in the tree", node=node_id, rid=h.rid))
            pins[node_id] += 1
        for node_id in h.host_pins:
            if node_id not in by_id:
                out.append(Violation(ViolationKind.DETACHED_REF, f"{h.kind}#{h.id} reads node#{node_id}'s host "
                                     f"copy, and that node is not in the tree", node=node_id))
            host_pins[node_id] += 1
    for n in state.nodes:
        if n.lock_ref != locks[n.id]:
            out.append(Violation(ViolationKind.LOCK_MISMATCH, f"node#{n.id} has lock_ref={n.lock_ref}, live "
                                 f"requests account for {locks[n.id]}", node=n.id))
        if n.device_holds != device_holds[n.id] or n.host_holds != host_holds[n.id]:
            out.append(Violation(ViolationKind.HOLD_MISMATCH, f"node#{n.id} has holds={n.device_holds}/"
                                 f"{n.host_holds} (device/host), prefetches and staged records account for "
                                 f"{device_holds[n.id]}/{host_holds[n.id]}", node=n.id))
        if n.pins != pins[n.id] or n.host_pins != host_pins[n.id]:
            out.append(Violation(ViolationKind.PIN_MISMATCH, f"node#{n.id} has pins={n.pins}/{n.host_pins}, "
                                 f"in-flight operations account for {pins[n.id]}/{host_pins[n.id]}", node=n.id))
    # per tier: pages of locked nodes, of held ones, of the rest (a negative count is its own finding)
    device, host = [0, 0, 0], [0, 0, 0]
    for n in state.nodes:
        for by_class, pages, tier_holds in ((device, n.device, n.device_holds), (host, n.host, n.host_holds)):
            by_class[0 if n.lock_ref > 0 else 1 if tier_holds > 0 else 2] += len(pages_of(pages))
    recomputed = TreeSizes(device_evictable=device[2], device_protected=device[0], host_evictable=host[2],
                           host_protected=host[0], device_held=device[1], host_held=host[1])
    recorded_sizes = msgspec.structs.asdict(state.sizes)
    for name, value in sorted(msgspec.structs.asdict(recomputed).items(), key=lambda kv: _SIZE_ORDER[kv[0]]):
        recorded = recorded_sizes[name]
        if recorded != value:
            out.append(Violation(ViolationKind.SIZE_MISMATCH, f"tree {name} is {recorded} pages, recomputed "
                                 f"{value}", name.split("_")[0], count=abs(recorded - value)))
