"""The events of a kvc feed's batches as flat, printable records (`kvc events --json` prints one per line; `kvc ns
dump` too): hashes as hex, each event with its batch's sequence number, time and rank.
"""

from __future__ import annotations

import msgspec

from ..types.events import AllBlocksCleared, BlockStored, EventBatch
from .subscriber import ReceivedBatch


class EventRecord(msgspec.Struct, omit_defaults=True):
    """One event, flat and printable (`kvc events --json` prints one per line): hashes as hex."""

    seq: int  # of its batch
    ts: float  # of its batch
    type: str  # BlockStored, BlockRemoved, AllBlocksCleared
    medium: str | None = None
    extra_key: str | None = None
    salt_fingerprint: str | None = None
    block_hashes: list[str] = []
    parent_block_hash: str | None = None
    token_ids: list[int] = []
    block_size: int | None = None
    data_parallel_rank: int | None = None
    replayed: bool = False


def records(received: ReceivedBatch[EventBatch]) -> list[EventRecord]:
    """The events of a received batch as records."""
    out = []
    b = received.batch
    for ev in b.events:
        rec = EventRecord(received.seq, b.ts, type(ev).__name__, data_parallel_rank=b.data_parallel_rank,
                          replayed=received.replayed)
        if not isinstance(ev, AllBlocksCleared):
            rec.medium, rec.extra_key, rec.salt_fingerprint = ev.medium, ev.extra_key, ev.salt_fingerprint
            rec.block_hashes = [h.hex() for h in ev.block_hashes]
        if isinstance(ev, BlockStored):
            rec.parent_block_hash = ev.parent_block_hash.hex() if ev.parent_block_hash is not None else None
            rec.token_ids, rec.block_size = ev.token_ids, ev.block_size
        out.append(rec)
    return out
