"""kvcache.live.holdings: the consumer that rebuilds a cache's holdings from its KV events, and the reader of a dump
file (the feed's payload frames back to back)."""

from __future__ import annotations

import pytest

from kvcache.errors import InvalidInput
from kvcache.live.holdings import HeldPages, Holdings, read_batches
from kvcache.types.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, encode_batch

A, B, C = b"a" * 16, b"b" * 16, b"c" * 16


def _stored(hashes, medium="device", extra_key="t1", fingerprint="0123456789ab"):
    return BlockStored(hashes, None, [0] * 4 * len(hashes), 4, None, medium, None, extra_key, fingerprint)


def test_stores_add_removals_take_away_whoever_held_them_and_a_clear_forgets_all():
    held = Holdings()
    held.apply_batch(EventBatch(1.0, [_stored([A, B]), _stored([C], "host", "t2", None), _stored([A], "host")]))
    assert held.counts() == {"device": 2, "host": 2}
    assert held.namespaces() == [HeldPages("device", "t1", "0123456789ab", 2), HeldPages("host", "t1", "0123456789ab", 1),
                                 HeldPages("host", "t2", None, 1)]
    held.apply(BlockRemoved([A, C], "host"))  # a removal that names no namespace (SGLang's, vLLM's) still counts
    held.apply(BlockRemoved([C], "device"))  # a block the medium never held: ignored
    assert held.counts() == {"device": 2} and held.holds("device", A) and not held.holds("host", A)
    held.apply(AllBlocksCleared())
    assert held.counts() == {} and held.namespaces() == []


def test_a_dump_file_reads_back_batch_by_batch_and_a_bad_one_is_named_by_its_offset():
    batches = [EventBatch(1.0, [AllBlocksCleared(), _stored([A])]), EventBatch(2.0, [_stored([B])], 3)]
    data = b"".join(encode_batch(b) for b in batches)
    assert list(read_batches(data)) == batches
    first = len(encode_batch(batches[0]))
    with pytest.raises(InvalidInput, match=f"not a KV-event batch at byte {first}"):
        list(read_batches(data[:first] + b"\x93\x01\x90"))  # a ts of this era, but no events list: not a batch
    with pytest.raises(InvalidInput, match=f"at byte {first}: not a whole msgpack value"):
        list(read_batches(data[:-3]))  # cut short
