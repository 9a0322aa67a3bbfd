"""What every L3 backend keeps of the pages it removed: the rules of its bounded removal log (`L3Store.removals`).

A miss is explained from these records (`kvc explain`): the store answers, per page hash, the newest record of
what removed that page and when. The rules every backend keeps (tests/conformance checks them):

- Each removal is recorded in the same transaction (LMDB) or script (a standalone Redis) as the removal itself,
  with its reason (`RemovalReason`): capacity and share evictions by a put, quarantine of a page that failed its
  checksum (when the bad page is taken out of the store), and every page a repair (`verify(repair=True)`) removes.
- A namespace dropped whole (`delete_namespace`: an offboarding, reason DROP, or a TTL expiry, reason TTL) is
  recorded once, for the namespace, not once per page: a drop of millions of pages costs one record and does not
  push every other record out of the log. It answers for a page only when the caller names the namespace
  (`removals(hashes, namespace=...)`), and then for any page of that namespace whose own record (if any) is
  older: the store does not know, after the drop, which pages the namespace held.
- At most REMOVALS_KEPT records are kept; each new one pushes the oldest out (amortised O(1) per removal). A
  page removed twice keeps only its newest record. So a page with no record was never removed, or was removed
  long enough ago that its record aged out: an explanation says "no record", it does not guess.
- A store written before the log, or one whose log a repair or a rebuild dropped, answers "no record" for every
  page; a read-only handle reads the log as it is. The records are diagnostics: a rebuild of a damaged store
  (`salvage`) and a `migrate` start a fresh log, and a repair that finds the log damaged clears it.

What a record costs (measured at the bound, records keyed by random page hashes as real ones are): LMDB ~140 bytes
of data file a record (a 33-byte value under a 17-byte key, and its sequence entry: a 17-byte value under a 9-byte
key; LMDB's node headers and leaves ~2/3 full included), 8.7 MiB for REMOVALS_KEPT records; Redis ~240 bytes of
server memory a record (two fields of one hash: the record and its place in the ring), 15 MiB. docs/capacity.md.
"""

from __future__ import annotations

from ..types.ids import NamespaceId
from ..types.removals import REMOVALS_KEPT, PageRemoval, RemovalReason

# One byte per reason on disk (LMDB); Redis keeps the reason's word. Codes are never reused: a record whose code
# this kvc does not know reads as no record.
REASON_CODES: dict[RemovalReason, int] = {
    RemovalReason.CAPACITY: 1,
    RemovalReason.SHARE: 2,
    RemovalReason.TTL: 3,
    RemovalReason.DROP: 4,
    RemovalReason.REPAIR: 5,
    RemovalReason.QUARANTINE: 6,
}
REASONS_BY_CODE: dict[int, RemovalReason] = {code: reason for reason, code in REASON_CODES.items()}
NAMESPACE_WIDE = frozenset({RemovalReason.DROP, RemovalReason.TTL})  # recorded once per namespace, not per page

__all__ = ["REMOVALS_KEPT", "PageRemoval", "RemovalReason", "REASON_CODES", "REASONS_BY_CODE", "NAMESPACE_WIDE",
           "newest_removal", "removals_kept"]


def removals_kept() -> int:
    """The bound in force: REMOVALS_KEPT of this module, read at each call (a test lowers it here to see the oldest
    records go without a store of 65,536 removals)."""
    return REMOVALS_KEPT


def newest_removal(page_hash: bytes, own: tuple[int, PageRemoval] | None,
           whole: tuple[int, PageRemoval] | None) -> PageRemoval | None:
    """The record a store answers for `page_hash`: the newer (by the store's removal sequence) of the page's own
    record and its namespace's namespace-wide one, each `(seq, record)` or None. A namespace-wide record is
    answered under the page's hash."""
    if whole is not None and (own is None or whole[0] > own[0]):
        rec = whole[1]
        return PageRemoval(page_hash, rec.reason, rec.at, NamespaceId(rec.ns_id))
    return own[1] if own is not None else None
