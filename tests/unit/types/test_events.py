"""The KV-event wire format: what vLLM's and SGLang's current decoders read (an array batch, events as maps tagged
by `type`, required fields present even when nil), kvc's namespace in extra fields, never a salt."""

from __future__ import annotations

import msgspec
import pytest

from kvcache import Namespace
from kvcache.types.events import (
    BLOCK_SIZE_MAX,
    INDEX_MAX,
    MEDIUMS,
    TS_MAX,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    MediumNames,
    decode_batch,
    encode_batch,
)


def test_the_batch_is_an_array_and_the_events_tagged_maps_with_the_namespace_as_extra_fields():
    ns = Namespace("t1", "a-secret-salt")
    batch = EventBatch(1.5, [BlockStored([b"h" * 16], None, [1, 2], 2, None, "device", None, ns.extra_key,
                                         ns.fingerprint(b"k" * 32)), BlockRemoved([b"h" * 16], "device"),
                             AllBlocksCleared()], 0)
    wire = msgspec.msgpack.decode(encode_batch(batch))
    assert wire[0] == 1.5 and wire[2] == 0 and len(wire) == 3
    stored, removed, cleared = wire[1]
    assert stored == {"type": "BlockStored", "block_hashes": [b"h" * 16], "parent_block_hash": None,
                      "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "device", "lora_name": None,
                      "extra_key": "t1", "salt_fingerprint": ns.fingerprint(b"k" * 32)}
    assert removed == {"type": "BlockRemoved", "block_hashes": [b"h" * 16], "medium": "device"}
    assert cleared == {"type": "AllBlocksCleared"}
    assert b"a-secret-salt" not in encode_batch(batch)


class Event(msgspec.Struct, tag=True):  # vLLM's current schema: no extra_key, no salt_fingerprint
    pass


class Stored(Event, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Stored]
    data_parallel_rank: int | None = None


def test_a_decoder_written_for_the_engines_reads_kvc_batches_and_ignores_the_namespace_fields():
    ours = EventBatch(2.0, [BlockStored([b"x" * 16], b"p" * 16, [1, 2, 3, 4], 4, None, "host", None, "t", "fp")], 1)
    theirs = msgspec.msgpack.decode(encode_batch(ours), type=Batch)
    assert theirs.events[0].block_hashes == [b"x" * 16] and theirs.events[0].medium == "host"
    assert decode_batch(encode_batch(ours)) == ours
    assert MEDIUMS[MediumNames.SGLANG].host == "CPU_PINNED" and MEDIUMS[MediumNames.KVC].storage == "storage"


# --- impossible fields (issue 36 #4) ---------------------------------------------------------------------------

def _kvc_payload(ts: object = 1.5, rank: object = 0, **stored: object) -> bytes:
    event = {"type": "BlockStored", "block_hashes": [b"h" * 16], "parent_block_hash": None, "token_ids": [1, 2],
             "block_size": 2, "lora_id": None, "medium": "device", "lora_name": None, **stored}
    return msgspec.msgpack.encode([ts, [event], rank])


IMPOSSIBLE = [
    pytest.param({"ts": float("nan")}, id="ts-nan"), pytest.param({"ts": float("inf")}, id="ts-inf"),
    pytest.param({"ts": float("-inf")}, id="ts-minus-inf"), pytest.param({"ts": 1e300}, id="ts-1e300"),
    pytest.param({"ts": -1.0}, id="ts-before-1970"), pytest.param({"ts": TS_MAX * 2}, id="ts-after-2100"),
    pytest.param({"rank": -1}, id="rank-negative"), pytest.param({"rank": 1 << 40}, id="rank-absurd"),
    pytest.param({"block_size": 0}, id="page-of-no-tokens"), pytest.param({"block_size": -4}, id="size-negative"),
    pytest.param({"block_size": 1 << 40}, id="size-absurd"), pytest.param({"token_ids": [1, -2]}, id="token-negative"),
    pytest.param({"token_ids": [1 << 32]}, id="token-past-32-bits"),
    pytest.param({"block_hashes": [b"short"]}, id="hash-not-16-bytes"),
    pytest.param({"parent_block_hash": b"p" * 17}, id="parent-not-16-bytes"),
]


@pytest.mark.parametrize("fields", IMPOSSIBLE)
def test_a_batch_with_an_impossible_field_does_not_decode(fields):
    """Issue 36 #4: a ts of NaN, inf or 1e300 decoded, and `kvc events` then died formatting it ("internal error:
    ValueError"); a negative page size or token id decoded too. Now each is a ValidationError: the subscriber skips
    the batch and counts it malformed, in every output mode."""
    with pytest.raises(msgspec.ValidationError):
        decode_batch(_kvc_payload(**fields))


@pytest.mark.parametrize("ts", [0.0, 1.0, 1_700_000_000.25, TS_MAX])
def test_the_edges_of_the_plausible_decode(ts):
    batch = decode_batch(_kvc_payload(ts, rank=INDEX_MAX, token_ids=[0, (1 << 32) - 1], block_size=BLOCK_SIZE_MAX))
    assert batch.ts == ts and batch.data_parallel_rank == INDEX_MAX
