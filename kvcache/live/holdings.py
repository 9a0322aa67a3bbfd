"""What a consumer of KV events knows a cache holds: the pages of each medium, and whose they are.

A router rebuilds a cache's holdings from its events: a `BlockStored` adds its pages to its medium, a
`BlockRemoved` takes them away (from whichever namespace held them: SGLang's and vLLM's removals name no
namespace), `AllBlocksCleared` forgets all. `Holdings` is that consumer, shared by `kvc events` (the blocks per
medium of its summary) and by the checks that a dump (`kvc ns dump`) rebuilds what a store or a cache holds.

A dump file (`kvc ns dump --out`) is the feed's payload frames back to back: each one msgpack `EventBatch`
exactly as the feed publishes it, so any msgpack stream reader takes it; `read_batches` is kvc's.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator

import msgspec

from ..errors import AdminBadFrame, InvalidInput
from ..types.events import AllBlocksCleared, BlockStored, EventBatch, KVEvent, decode_batch

Owner = tuple[str | None, str | None]  # (extra_key, salt_fingerprint) as the events name a namespace
NOBODY: Owner = (None, None)


class HeldPages(msgspec.Struct, frozen=True):
    """Pages one namespace holds in one medium, as the events read tell."""

    medium: str
    extra_key: str | None
    salt_fingerprint: str | None
    pages: int


class Holdings:
    """The blocks each medium holds, and the namespace each came with, as the events applied so far tell. A block is
    any hashable name (kvc's 16-byte hashes; a printed record's hex; vLLM's group-qualified names)."""

    def __init__(self) -> None:
        self._held: dict[str, dict[Hashable, Owner]] = {}

    def stored(self, medium: str, blocks: Iterable[Hashable], owner: Owner = NOBODY) -> None:
        """`blocks` entered `medium`, for namespace `owner`."""
        held = self._held.setdefault(medium, {})
        for b in blocks:
            held[b] = owner

    def removed(self, medium: str, blocks: Iterable[Hashable]) -> None:
        """`blocks` left `medium` (those it did not hold are ignored, as a late consumer must)."""
        held = self._held.get(medium)
        if held is not None:
            for b in blocks:
                held.pop(b, None)

    def clear(self) -> None:
        """Forget every block: the cache cleared (or restarted, and what it held went with it)."""
        self._held.clear()

    def apply(self, event: KVEvent) -> None:
        """Apply one of kvc's events."""
        if isinstance(event, AllBlocksCleared):
            self.clear()
        elif isinstance(event, BlockStored):
            self.stored(event.medium or "-", event.block_hashes, (event.extra_key, event.salt_fingerprint))
        else:
            self.removed(event.medium or "-", event.block_hashes)

    def apply_batch(self, batch: EventBatch) -> None:
        """Apply a batch's events, in order."""
        for event in batch.events:
            self.apply(event)

    def held(self, medium: str) -> int:
        """Blocks `medium` holds."""
        return len(self._held.get(medium, ()))

    def holds(self, medium: str, block: Hashable) -> bool:
        """Whether `medium` holds `block`."""
        return block in self._held.get(medium, {})

    def counts(self) -> dict[str, int]:
        """Blocks per medium, media holding none left out."""
        return {medium: len(held) for medium, held in sorted(self._held.items()) if held}

    def namespaces(self) -> list[HeldPages]:
        """Pages per medium and namespace, sorted by medium, extra_key, fingerprint."""
        tally: dict[tuple[str, Owner], int] = {}
        for medium, held in self._held.items():
            for owner in held.values():
                tally[(medium, owner)] = tally.get((medium, owner), 0) + 1
        rows = [HeldPages(medium, owner[0], owner[1], n) for (medium, owner), n in tally.items()]
        return sorted(rows, key=lambda r: (r.medium, r.extra_key or "", r.salt_fingerprint or ""))


def read_batches(data: bytes, where: str = "the dump") -> Iterator[EventBatch]:
    """The batches of a dump file's bytes (the feed's payload frames back to back); InvalidInput naming `where` and
    the byte offset at the first that is not a KV-event batch."""
    from .protocol import _skip  # the admin frames' bounded msgpack walker finds where each batch ends

    pos = 0
    while pos < len(data):
        try:
            end = _skip(data, pos)
        except AdminBadFrame:
            raise InvalidInput(f"{where}: not a KV-event batch at byte {pos}: not a whole msgpack value (cut short, "
                               f"or not msgpack)") from None
        try:
            batch = decode_batch(data[pos:end])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise InvalidInput(f"{where}: not a KV-event batch at byte {pos}: {exc}") from None
        yield batch
        pos = end
