"""What a cache remembers to explain a miss (`TieredCache.explain`): the pages each tier removed lately, and why,
and how the last prefetch of each prefix ended. Bounded, the oldest entries going first.

- Removals: per tier (L1, L2), page hash -> `Removal` (reason, unix seconds): the latest removals, at most
  `REMOVALS_KEPT` pages a tier and at least half that many. Fed by the room (capacity, share, a requested
  eviction) and offboarding (a drop, a TTL expiry) for each victim, before its copy goes. One `Removal` value is
  shared by the pages of one victim. Once a tier has let go of an entry, or removed a page whose hash was never
  computed (a cache without a store hashes a page only for its KV events: eviction does not hash, it is on the
  hot path), a page with none is "no record" rather than "never written" (`MissReason.NO_RECORD`).
- Prefetches: the hash of the page a prefetch starts at (the first page the tree did not hold) -> the last
  `PrefetchRecord` there, at most `PREFETCHES_KEPT`. Written when a prefetch is declined or issued, and again when
  it is settled or given back.

Memory, measured: a removal entry ~90 bytes (a 16-byte hash and a dict slot; the value is shared), a prefetch
entry ~390 bytes: at most about 3 MB and 1.6 MB per cache (docs/capacity.md). Cost: a dict update per victim; the page
hashes of a victim are the tree's own, cached on the node (a cache with a store has computed them for its L3
writes); a victim without them is counted unrecorded rather than hashed.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import msgspec

from ..types.explain import PrefetchFate, PrefetchRecord, Removal
from ..types.ids import PageHash
from ..types.removals import RemovalReason
from ..types.results import DropReason
from ..types.tier import Tier

REMOVALS_KEPT = 16384  # removed pages remembered per tier (L1, L2)
PREFETCHES_KEPT = 4096  # prefixes whose last prefetch is remembered


class RecentRemovals:
    """The pages one cache's tiers removed lately, and why (bounded: module docstring).

    Per tier two generations of plain dicts, the newest first: a removal goes into the newest with one C-level
    update (this runs for every victim of every eviction); when it holds half the bound it becomes the older one
    and the older one is let go of. So between half the bound and the bound of the latest removals are kept, at
    O(1) a page, and a lookup asks both."""

    def __init__(self, kept: int = REMOVALS_KEPT) -> None:
        self.kept = kept
        # tier -> [newest, older]
        self._pages: dict[Tier, list[dict[PageHash, Removal]]] = {Tier.DEVICE: [{}, {}], Tier.HOST: [{}, {}]}
        self._forgot: dict[Tier, bool] = {Tier.DEVICE: False, Tier.HOST: False}  # an entry was let go of

    def removed(self, tier: Tier, hashes: Iterable[PageHash], reason: RemovalReason, at: float | None = None) -> None:
        """`tier` removed the pages `hashes` for `reason` (now, or at unix seconds `at`)."""
        record = Removal(reason, time.time() if at is None else at)
        generations = self._pages[tier]
        newest = generations[0]
        newest.update(dict.fromkeys(hashes, record))
        if len(newest) >= max(1, self.kept // 2):
            if generations[1]:
                self._forgot[tier] = True
            generations[1], generations[0] = newest, {}

    def unrecorded(self, tier: Tier) -> None:
        """`tier` removed a page without recording it (its hash was never computed): the record is not complete."""
        self._forgot[tier] = True

    def get(self, tier: Tier, page_hash: PageHash) -> Removal | None:
        """The newest removal of `page_hash` from `tier` this cache remembers."""
        newest, older = self._pages[tier]
        found = newest.get(page_hash)
        return found if found is not None else older.get(page_hash)

    def complete(self, tier: Tier) -> bool:
        """Whether `tier` still remembers every page it removed (none was let go of)."""
        return not self._forgot[tier]

    def __len__(self) -> int:
        return sum(len(g) for generations in self._pages.values() for g in generations)


class RecentPrefetches:
    """How the last prefetch of each prefix ended (bounded: module docstring)."""

    def __init__(self, kept: int = PREFETCHES_KEPT) -> None:
        self.kept = kept
        self._records: OrderedDict[PageHash, tuple[int, PrefetchRecord]] = OrderedDict()  # (change number, record)
        self._changes = 0

    def record(self, start_hash: PageHash, record: PrefetchRecord) -> None:
        """The prefetch starting at page `start_hash` is now `record` (it replaces the one before)."""
        records = self._records
        self._changes += 1
        records[start_hash] = (self._changes, record)
        records.move_to_end(start_hash)
        while len(records) > self.kept:
            records.popitem(last=False)

    def ended(self, start_hash: PageHash, fate: PrefetchFate, dropped: DropReason | None = None) -> None:
        """The prefetch starting at page `start_hash` ended so after its last record (a staged record given back):
        that record with its new fate, now. Nothing when it has none (let go of)."""
        found = self._records.get(start_hash)
        if found is not None:
            self.record(start_hash, msgspec.structs.replace(found[1], fate=fate, dropped=dropped, at=time.time()))

    def last(self, hashes: Sequence[PageHash]) -> PrefetchRecord | None:
        """The newest record of a prefetch that started at one of `hashes` (a request's pages): the last prefetch
        of a prefix of that request."""
        found = [r for r in (self._records.get(h) for h in hashes) if r is not None]
        return max(found)[1] if found else None  # the latest changed (change numbers are unique)

    def __len__(self) -> int:
        return len(self._records)
