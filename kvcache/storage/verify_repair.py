"""The repair of the shared integrity audit (`kvcache.storage.verify`): what a repair does per finding kind
(api.REPAIRS) with what the checks found (`verify_source.Findings`).

Repair removes each removable finding's page and, depth first, every page below it (a page below is removed only
while the page above stays gone), in bounded batches (`IntegritySource.repair_batch`: one write transaction, one
script...). Each removal is rechecked by the backend against the record as it is then (`Guard`), so a page that a
writer stored again, or that is sound and reachable from its namespace root, is never removed. A namespace or
layout record that does not decode goes with every page filed under it; dangling children entries are unlinked,
pages missing from the index relinked, implausible metadata fields reset where the backend can (`ResetsFields`),
and the counters recounted last.
"""

from __future__ import annotations

from .api import VerifyRemoval, VerifyReport
from .verify_source import Findings, Guard, IntegritySource, PageRow, Removal, RepairOps, ResetsFields


def removed_pages(report: VerifyReport) -> set[bytes]:
    """The page hashes a repair removed records of (index entries and namespace or layout records apart): what a
    backend forgets from its quarantine, since a writer may store them again."""
    return {bytes.fromhex(r.page_hash) for r in report.removals if r.what not in ("index", "record")}


def repair(source: IntegritySource, found: Findings, kids: dict[bytes, list[bytes]],
           tree: dict[bytes, PageRow]) -> list[VerifyRemoval]:
    """Apply api.REPAIRS to what verify found, in bounded batches, each removal rechecked by the backend."""
    limit = max(source.batch_pages, 1)
    removals: list[VerifyRemoval] = []
    removed: set[bytes] = set()
    for name, key, i in found.damaged:
        for r, h in _drop_damaged(source, found, name, key, i, tree, limit):
            removals.append(r)
            if h is not None:
                removed.add(h)
        found.fixed.add(i)
        found.recount.append(i)  # the totals are set from what is left at the end
    work = [Removal(h, i, None, guard, tree.get(h)) for h, (i, guard) in reversed(found.remove.items())]
    while work:

        def remove_some(ops: RepairOps,
                        work: list[Removal] = work) -> tuple[list[Removal], list[tuple[VerifyRemoval, bytes]]]:
            return _remove_some(ops, work, kids, tree, found, limit)

        work, batch = source.repair_batch(remove_some)
        for r, h in batch:
            removals.append(r)
            removed.add(h)
    for h in removed:
        found.fixed.update(found.by_page.get(h, ()))
    for start in range(0, len(found.unlink), limit):
        chunk = found.unlink[start:start + limit]

        def unlink(ops: RepairOps, chunk: list[tuple[bytes, bytes, int]] = chunk) -> list[bool]:
            return ops.unlink([(p, c) for p, c, _ in chunk])

        gone = source.repair_batch(unlink)
        for (_, child, i), entry_removed in zip(chunk, gone, strict=True):
            if entry_removed:
                removals.append(VerifyRemoval(found.items[i].kind, child.hex(), "index", 0))
            found.fixed.add(i)
    resets = [(h, i) for h, i in found.reset.items() if h not in removed]
    for start in range(0, len(resets), limit):
        pages = resets[start:start + limit]

        def reset_some(ops: RepairOps, pages: list[tuple[bytes, int]] = pages) -> list[bool]:
            return ops.reset_fields([h for h, _ in pages]) if isinstance(ops, ResetsFields) else []

        done = source.repair_batch(reset_some)
        found.fixed.update(i for (_, i), ok in zip(pages, done, strict=False) if ok)
    relink = [(h, i) for h, i in found.relink.items() if h not in removed and h in tree]
    for start in range(0, len(relink), limit):
        pages = relink[start:start + limit]

        def relink_some(ops: RepairOps, pages: list[tuple[bytes, int]] = pages) -> list[bool]:
            return ops.relink([(h, tree[h]) for h, _ in pages])

        done = source.repair_batch(relink_some)
        found.fixed.update(i for (_, i), ok in zip(pages, done, strict=True) if ok)
    if found.recount or (removals and source.recounts_after_removals):
        source.recount()
        found.fixed.update(found.recount)
    return removals


def _remove_some(ops: RepairOps, work: list[Removal], kids: dict[bytes, list[bytes]], tree: dict[bytes, PageRow],
                 found: Findings, limit: int) -> tuple[list[Removal], list[tuple[VerifyRemoval, bytes]]]:
    """One batch: remove up to `limit` pages of `work`, depth first (a removed page's children join the work,
    guarded by PARENT_GONE). Returns the work left and what it removed; `work` itself is left untouched, so a
    rerun of the batch starts over."""
    stack = list(work)
    out: list[tuple[VerifyRemoval, bytes]] = []
    seen: set[bytes] = set()
    while stack and len(out) < limit:
        take: list[Removal] = []
        while stack and len(take) < limit - len(out):
            item = stack.pop()
            if item.page not in seen:
                seen.add(item.page)
                take.append(item)
        gone = [(item, done) for item, done in zip(take, ops.remove(take), strict=True) if done is not None]
        for item, (what, nbytes) in gone:
            head = found.items[item.finding].page_hash
            out.append((VerifyRemoval(found.items[item.finding].kind, item.page.hex(), what, nbytes,
                                      None if item.via is None else head), item.page))
        listed = ops.children([item.page for item, _ in gone]) if gone else []
        for (item, _), entries in zip(gone, listed, strict=True):
            below = set(kids.get(item.page, ())) | set(entries)
            # an engine page below stays: it proves itself by its key (an intact page is never taken for its parent)
            stack.extend(Removal(c, item.finding, item.page, Guard.PARENT_GONE, tree.get(c)) for c in below
                         if c not in tree or not tree[c].engine)
    return stack, out


def _drop_damaged(source: IntegritySource, found: Findings, name: str, key: bytes, i: int,
                  tree: dict[bytes, PageRow], limit: int) -> list[tuple[VerifyRemoval, bytes | None]]:
    """Remove a namespace or layout record that does not decode, and every page filed under it (they cannot be
    registered again without it), `limit` pages per batch."""
    filed = {"namespaces": "ns_id", "layouts": "layout_id"}.get(name)  # other records file no page under them
    pages = [h for h, row in tree.items() if getattr(row, filed) == key] if filed else []
    kind = found.items[i].kind
    out: list[tuple[VerifyRemoval, bytes | None]] = []
    for start in range(0, max(len(pages), 1), limit):
        batch = [Removal(h, i, None, Guard.FILED_UNDER, tree[h]) for h in pages[start:start + limit]]

        def body(ops: RepairOps, batch=batch, first=start == 0) -> list[tuple[VerifyRemoval, bytes | None]]:
            done: list[tuple[VerifyRemoval, bytes | None]] = []
            if first and ops.drop_record(name, key):
                done.append((VerifyRemoval(kind, key.hex(), "record", 0), None))
            for item, gone in zip(batch, ops.remove(batch) if batch else [], strict=True):
                if gone is not None:
                    done.append((VerifyRemoval(kind, item.page.hex(), gone[0], gone[1], key.hex()), item.page))
            return done

        out += source.repair_batch(body)
    return out
