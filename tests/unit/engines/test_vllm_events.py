"""vLLM's KV-event feed decoded by kvc (`kvcache.engines.vllm_events`) from messages vLLM 0.34.0's own publisher
sent (tests/goldens/vllm/make_vllm_events.py): its prefix cache's and its offloading tiers' events, with int block
hashes (vLLM's default) and with bytes ones; the salts vLLM sends among the blocks' extra keys never reach a
record."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import pytest

from kvcache.engines.vllm_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    block_hash_hex,
    decode_batch,
    event_records,
    extra_key_words,
)
from kvcache.types.namespace import Namespace

GOLDEN = json.loads((Path(__file__).resolve().parents[2] / "goldens" / "vllm" / "vllm_events.json").read_text())
MESSAGES: list[list[bytes]] = [[bytes.fromhex(f) for f in m] for m in GOLDEN["messages"]]  # [topic, seq, payload]
BYTES_MESSAGES: list[list[bytes]] = [[bytes.fromhex(f) for f in m] for m in GOLDEN["bytes_messages"]]
SALTS = sorted({r["cache_salt"] for r in GOLDEN["requests"] if r["cache_salt"]})
REQUESTS = {r["rid"]: r for r in GOLDEN["requests"]}
KEY = os.urandom(32)


def _records(seq: int, messages: list[list[bytes]] = MESSAGES, replayed: bool = False):
    return event_records(seq, decode_batch(messages[seq][2]), replayed, KEY)


def _all(messages: list[list[bytes]] = MESSAGES):
    return [r for seq in range(len(messages)) for r in _records(seq, messages)]


def _digests(rid: str) -> list[str]:
    """The block hashes vLLM computed for a request (sha256 digests, hex)."""
    return REQUESTS[rid]["block_hashes"]


def test_every_golden_message_decodes_to_vllms_events_in_order():
    kinds = [[type(ev) for ev in decode_batch(m[2]).events] for m in MESSAGES]
    assert kinds == [
        [AllBlocksCleared],  # reset_prefix_cache
        [BlockStored],  # a
        [BlockStored] * 3,  # a's first chunk offloaded: CPU, KVCR's STORAGE, the file system's STORAGE
        [BlockStored] * 2,  # b: its reused blocks reported again ("full" report), then its new one
        [BlockStored],  # c
        [BlockStored],  # d
        [BlockRemoved, BlockStored],  # f evicts one block
        [BlockRemoved] * 10 + [BlockStored, BlockRemoved],  # e evicts the rest; KVCR drops a's chunk
        [AllBlocksCleared],
    ]
    assert [[type(ev) for ev in decode_batch(m[2]).events] for m in BYTES_MESSAGES] == kinds
    for messages in (MESSAGES, BYTES_MESSAGES):
        assert [int.from_bytes(m[1], "big") for m in messages] == list(range(len(messages)))
        assert {m[0] for m in messages} == {GOLDEN["topic"].encode()}
        assert all(decode_batch(m[2]).data_parallel_rank == 0 for m in messages)


def test_a_record_carries_every_field_vllm_sent_but_the_salt():
    rec = _records(4)[0]  # c: a LoRA adapter, a session, a salt
    fields = msgspec.structs.asdict(rec)
    assert fields.pop("ts") == decode_batch(MESSAGES[4][2]).ts
    assert fields == {
        "seq": 4, "type": "BlockStored", "medium": "GPU", "tier": "L1", "ownership": None, "locality": None,
        "group_idx": 0, "block_hashes": [h[-16:] for h in _digests("c")], "parent_block_hash": None,
        "token_ids": REQUESTS["c"]["tokens"][:12], "block_size": GOLDEN["block_size"],
        "salt_fingerprint": Namespace(None, "golden-salt-B3x").fingerprint(KEY),
        "extra_keys": [["lora", "salt:" + Namespace(None, "golden-salt-B3x").fingerprint(KEY)], ["lora"], ["lora"]],
        "lora_id": 1, "lora_name": "adapter-x", "session_id": "sess-42", "kv_cache_spec_kind": "full_attention",
        "kv_cache_spec_sliding_window": None, "lookahead_token_ids": None, "data_parallel_rank": 0,
        "replayed": False,
    }
    assert _records(4, replayed=True)[0].replayed is True


def test_records_carry_each_salt_as_a_keyed_fingerprint_never_in_clear():
    by_salt = {s: Namespace(None, s).fingerprint(KEY) for s in SALTS}
    assert len(set(by_salt.values())) == 2 and all(len(f) == 12 for f in by_salt.values())
    stored = [r for r in _all() if r.type == "BlockStored"]
    # vLLM mixes the salt into a prompt's first block only: b's new block and the offloaded chunks carry none
    assert [r.salt_fingerprint for r in stored] == [by_salt["golden-salt-A7q"], None, None, None,
                                                    by_salt["golden-salt-A7q"], None, by_salt["golden-salt-B3x"],
                                                    None, None, None]
    assert stored[0].extra_keys == [[f"salt:{by_salt['golden-salt-A7q']}"], None, None]
    for messages in (MESSAGES, BYTES_MESSAGES):
        text = b"".join(msgspec.json.encode(r) for r in _all(messages))
        assert all(s.encode() not in text for s in SALTS)
        assert all(s.encode() in b"".join(m[2] for m in messages) for s in SALTS)  # vLLM did send them in clear


def test_fingerprints_follow_the_key_they_are_made_under():
    other = os.urandom(32)
    rec = event_records(1, decode_batch(MESSAGES[1][2]), False, other)[0]
    assert rec.salt_fingerprint == Namespace(None, "golden-salt-A7q").fingerprint(other)
    assert rec.salt_fingerprint != _records(1)[0].salt_fingerprint


def test_int_hashes_are_the_last_16_hex_digits_of_vllms_digests_and_bytes_ones_all_of_them():
    a_int, a_bytes = _records(1)[0], _records(1, BYTES_MESSAGES)[0]
    assert a_bytes.block_hashes == _digests("a") and len(a_bytes.block_hashes[0]) == 64
    assert a_int.block_hashes == [h[-16:] for h in _digests("a")]
    assert a_int.block_hashes[1] == "00160cea7dc86aac"  # an int below 2**56: padded to 16 digits
    # the two feeds differ in their hashes alone, each int hash being its digest's last 16 digits
    for r_int, r_bytes in zip(_all(), _all(BYTES_MESSAGES), strict=True):
        assert r_int.block_hashes == [h[-16:] for h in r_bytes.block_hashes]
        parent = r_bytes.parent_block_hash
        assert r_int.parent_block_hash == (parent[-16:] if parent is not None else None)
        rest = ("block_hashes", "parent_block_hash", "ts")
        assert {k: v for k, v in msgspec.structs.asdict(r_int).items() if k not in rest} == \
            {k: v for k, v in msgspec.structs.asdict(r_bytes).items() if k not in rest}


def test_a_continued_prefix_hangs_from_its_parent_block():
    reused, new = _records(3)  # b reuses a's first two blocks, then stores one of its own after them
    assert reused.block_hashes == [h[-16:] for h in _digests("a")[:2]] and reused.parent_block_hash is None
    assert new.block_hashes == [_digests("b")[2][-16:]] and new.parent_block_hash == _digests("a")[1][-16:]
    assert new.token_ids == [900, 901, 902, 903] and new.extra_keys == [None]


def test_media_are_vllms_names_with_kvcs_tier_and_the_offloading_tier_beside():
    offloaded = _records(2)
    assert [(r.medium, r.tier, r.ownership, r.locality) for r in offloaded] == [
        ("CPU", "L2", None, None), ("STORAGE", "L3", "kvcr", None), ("STORAGE", "L3", None, "LOCAL")]
    assert all(r.block_hashes == [h[-16:] for h in _digests("a")[:2]] and r.group_idx == 0 for r in offloaded)
    assert all(r.extra_keys is None and r.salt_fingerprint is None for r in offloaded)  # vLLM sends none there
    dropped = _records(7)[-1]
    assert (dropped.type, dropped.medium, dropped.tier, dropped.ownership, dropped.group_idx) == \
        ("BlockRemoved", "STORAGE", "L3", "kvcr", 0)
    assert dropped.block_hashes == offloaded[1].block_hashes
    evicted = [r for r in _records(7) if r.type == "BlockRemoved" and r.medium == "GPU"]
    assert {r.tier for r in evicted} == {"L1"} and {r.group_idx for r in evicted} == {0}
    assert {r.type: (r.medium, r.tier, r.block_hashes) for r in _records(8)} == {"AllBlocksCleared": (None, None, [])}


def test_extra_keys_show_images_and_embeddings_as_vllm_mixed_them_in():
    image = _records(5)[0]  # d: an image over tokens 2..5, which spans both blocks
    assert image.extra_keys == [[f"mm:{GOLDEN['image']}@2"], [f"mm:{GOLDEN['image']}@-2"]]
    assert image.salt_fingerprint is None and image.block_hashes == [h[-16:] for h in _digests("d")]
    embeds = next(r for r in _records(6) if r.type == "BlockStored")  # f: prompt embeddings, no token ids
    assert embeds.extra_keys == [[f"embeds:{d}"] for d in REQUESTS["f"]["prompt_embeds_digests"]]
    assert embeds.token_ids == [0] * 8 and embeds.salt_fingerprint is None


@pytest.mark.parametrize("keys, lora, words", [
    (["adapter", "s3cret"], "adapter", ["lora", "salt:FP"]),
    (["s3cret"], None, ["salt:FP"]),
    (["s3cret", "adapter"], "adapter", ["salt:FP", "salt:FPA"]),  # only a leading LoRA name is one
    ([["img", 3], b"\x01\xff"], None, ["mm:img@3", "embeds:01ff"]),
    # shapes vLLM does not send: never copied, whatever they hold
    ([["s3cret"], ["s3cret", "x"], ["img", True], {"s3cret": 1}, 7, None], None, ["?"] * 6),
])
def test_extra_key_words_never_copy_what_may_be_a_salt(keys, lora, words):
    fp = {"salt:FP": Namespace(None, "s3cret").fingerprint(KEY),
          "salt:FPA": Namespace(None, "adapter").fingerprint(KEY)}
    got, salt = extra_key_words(keys, lora, KEY)
    assert got == [f"salt:{fp[w]}" if w in fp else w for w in words]
    assert salt == next((fp[w] for w in words if w in fp), None)  # the first salt's
    assert "s3cret" not in json.dumps(got)


@pytest.mark.parametrize("block_hash, hex_", [
    (0, "0000000000000000"), (2**64 - 1, "ffffffffffffffff"), (-1, "ffffffffffffffff"), (-(2**63), "8000000000000000"),
    (b"\x00\xab", "00ab"),
])
def test_block_hash_hex(block_hash, hex_):
    assert block_hash_hex(block_hash) == hex_


def _payload(*events: dict, batch: object = None) -> bytes:
    return msgspec.msgpack.encode([1.5, list(events), 0] if batch is None else batch)


@pytest.mark.parametrize("payload, error", [
    (b"", msgspec.DecodeError),
    (MESSAGES[1][2][:-3], msgspec.DecodeError),  # truncated
    (MESSAGES[1][2] + b"\x00", msgspec.DecodeError),  # trailing bytes
    (_payload(batch={"ts": 1.5, "events": []}), msgspec.ValidationError),  # a map, not vLLM's array
    (_payload(batch=[1.5]), msgspec.ValidationError),  # no events
    (_payload({"type": "BlockEvicted", "block_hashes": [1]}), msgspec.ValidationError),  # an unknown tag
    (_payload({"block_hashes": [1]}), msgspec.ValidationError),  # no tag
    (_payload({"type": "BlockStored"}), msgspec.ValidationError),  # no hashes
    (_payload({"type": "BlockStored", "block_hashes": ["5b9f"]}), msgspec.ValidationError),  # a hash as text
    (_payload({"type": "BlockStored", "block_hashes": [1], "extra_keys": ["golden-salt-A7q"]}),
     msgspec.ValidationError),  # a block's extra keys not an array
    (_payload({"type": "BlockRemoved", "block_hashes": [1], "group_idx": "0"}), msgspec.ValidationError),
])
def test_malformed_payloads_raise_msgspec_errors(payload, error):
    with pytest.raises(error) as caught:
        decode_batch(payload)
    assert all(s not in str(caught.value) for s in SALTS)  # what `kvc events` says of a skipped message


def test_later_fields_and_a_missing_rank_are_read():
    """A newer vLLM's fields are ignored, an older one's absent ones default; a batch without a rank (vLLM omits
    a None one) has none."""
    batch = decode_batch(_payload({"type": "BlockStored", "block_hashes": [5], "a_future_field": [1, 2]},
                                  batch=[2.5, [{"type": "BlockRemoved", "block_hashes": [b"\x05"]}]]))
    assert batch.data_parallel_rank is None
    rec = event_records(3, batch, False, KEY)[0]
    assert (rec.type, rec.medium, rec.tier, rec.block_hashes) == ("BlockRemoved", None, None, ["05"])
    stored = decode_batch(_payload({"type": "BlockStored", "block_hashes": [5], "a_future_field": [1, 2]})).events[0]
    assert isinstance(stored, BlockStored) and stored.extra_keys is None and stored.medium is None


# --- impossible fields (issue 36 #4) ---------------------------------------------------------------------------

@pytest.mark.parametrize("batch", [
    [float("nan"), [], 0], [float("inf"), [], 0], [1e300, [], 0], [-1.0, [], 0], [1.5, [], -1], [1.5, [], 1 << 40],
    [1.5, [{"type": "BlockStored", "block_hashes": [1], "block_size": -16}], 0],
    [1.5, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [-7]}], 0],
    [1.5, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1 << 32]}], 0],
    [1.5, [{"type": "BlockStored", "block_hashes": [1], "group_idx": -1}], 0],
    [1.5, [{"type": "BlockRemoved", "block_hashes": [1], "group_idx": 1 << 40}], 0],
    [1.5, [{"type": "BlockStored", "block_hashes": [1], "kv_cache_spec_sliding_window": 0}], 0],
    [1.5, [{"type": "BlockStored", "block_hashes": [1], "lookahead_token_ids": [[3, -3]]}], 0],
], ids=str)
def test_a_batch_with_an_impossible_field_does_not_decode(batch):
    """Issue 36 #4: vLLM's decoder took a NaN, inf or 1e300 ts (then `kvc events --engine vllm` died formatting
    it), negative block sizes, token ids, groups and ranks. Now each is a ValidationError: skipped and counted."""
    with pytest.raises(msgspec.ValidationError):
        decode_batch(_payload(batch=batch))


def test_every_golden_batch_is_plausible():
    """What vLLM 0.34 sent passes the gate, both hash forms."""
    for messages in (MESSAGES, BYTES_MESSAGES):
        assert all(1e9 < decode_batch(m[2]).ts < 1e10 for m in messages)
