"""SGLang's KV-event feed decoded by kvc (`kvcache.engines.sglang_events`) from messages SGLang 0.5.23's own
publisher sent (tests/goldens/sglang/make_sglang_events.py), and read off real ZeroMQ sockets by `FeedSubscriber`,
SGLang's replay framing included; its salts never reach a record."""

from __future__ import annotations

import os

import msgspec
import pytest

from kvcache.engines.sglang_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    event_records,
)
from kvcache.engines.sglang_keys import storage_keys
from kvcache.live.subscriber import FeedSubscriber
from kvcache.types.namespace import Namespace
from sglang_feed import GOLDEN, MESSAGES, SALTS, GoldenFeed

KEY = os.urandom(32)


def _records(seq: int, replayed: bool = False):
    return event_records(seq, decode_batch(MESSAGES[seq][2]), replayed, KEY)


def test_every_golden_message_decodes_to_sglangs_events_in_order():
    kinds = [[type(ev) for ev in decode_batch(m[2]).events] for m in MESSAGES]
    assert kinds == [[AllBlocksCleared], [BlockStored], [BlockStored], [BlockStored], [BlockStored], [BlockStored],
                     [BlockRemoved]]
    assert [int.from_bytes(m[1], "big") for m in MESSAGES] == list(range(len(MESSAGES)))
    assert {m[0] for m in MESSAGES} == {GOLDEN["topic"].encode()}
    assert all(decode_batch(m[2]).attn_dp_rank == 0 for m in MESSAGES)


def test_records_carry_the_salt_as_a_keyed_fingerprint_never_in_clear():
    stored = [r for seq in range(len(MESSAGES)) for r in _records(seq) if r.type == "BlockStored"]
    by_salt = {s: Namespace(None, s).fingerprint(KEY) for s in SALTS}
    assert [r.salt_fingerprint for r in stored] == [by_salt["golden-salt-A7q"], by_salt["golden-salt-A7q"],
                                                    by_salt["golden-salt-B3x"], None, by_salt["golden-salt-A7q"]]
    assert len(set(by_salt.values())) == 2 and all(len(f) == 12 for f in by_salt.values())
    text = b"".join(msgspec.json.encode(r) for seq in range(len(MESSAGES)) for r in _records(seq))
    assert all(s.encode() not in text for s in SALTS)
    assert any(s.encode() in b"".join(m[2] for m in MESSAGES) for s in SALTS)  # SGLang did send them in clear


def test_media_are_sglangs_names_with_kvcs_tier_beside():
    seen = {(r.type, r.medium, r.tier) for seq in range(len(MESSAGES)) for r in _records(seq)}
    assert ("BlockStored", "GPU", "L1") in seen and ("BlockStored", "CPU_PINNED", "L2") in seen
    assert ("BlockRemoved", "GPU", "L1") in seen and ("AllBlocksCleared", None, None) in seen


def test_unsalted_block_hashes_are_the_first_64_bits_of_the_storage_keys():
    plain = next(r for r in GOLDEN["requests"] if r["cache_salt"] is None and r["extra_key"] is None)
    keys = storage_keys(plain["tokens"], GOLDEN["page_size"])
    assert [k.hex() for k in keys] == plain["storage_keys"]  # kvc's chain is SGLang's
    rec = next(r for r in _records(4) if r.type == "BlockStored")
    assert rec.block_hashes == [k.hex()[:16] for k in keys]
    assert rec.token_ids == plain["tokens"] and rec.block_size == GOLDEN["page_size"]
    chained = _records(2)[0]  # the second request's new page hangs from the first request's second page
    assert chained.parent_block_hash == _records(1)[0].block_hashes[1]


def test_a_gap_is_filled_from_sglangs_replay_socket():
    with GoldenFeed() as feed:
        sub = FeedSubscriber(feed.endpoint, decode_batch, replay_endpoint=feed.replay_endpoint, topic="kv")
        try:
            assert feed.wait_for_subscriber() == b"\x01kv"
            feed.publish(0, 5)  # 1..4 never sent live: the subscriber asks the replay socket for them
            got = sub.receive(timeout=60) + sub.receive(timeout=60)
        finally:
            sub.close()
    assert [(b.seq, b.replayed) for b in got] == [(0, False), (1, True), (2, True), (3, True), (4, True), (5, False)]
    assert feed.replay_requests == [1] and sub.missed == 0 and sub.malformed == 0
    assert [type(b.batch.events[0]) for b in got][-1] is BlockStored


# --- impossible fields (issue 36 #4) ---------------------------------------------------------------------------

def _payload(ts: object = 1.5, rank: object = 0, **stored: object) -> bytes:
    event = {"type": "BlockStored", "block_hashes": [-5, 7], "token_ids": [1, 2, 3, 4], "block_size": 2, **stored}
    return msgspec.msgpack.encode([ts, [event], rank])


@pytest.mark.parametrize("fields", [
    {"ts": float("nan")}, {"ts": float("inf")}, {"ts": 1e300}, {"ts": -3600.0}, {"rank": -1}, {"rank": 1 << 40},
    {"block_size": -1}, {"block_size": 1 << 40}, {"token_ids": [-1]}, {"token_ids": [[5, -1]]},
    {"token_ids": [1 << 32]},
], ids=str)
def test_a_batch_with_an_impossible_field_does_not_decode(fields):
    """Issue 36 #4: SGLang's decoder took a NaN, inf or 1e300 ts (then `kvc events --engine sglang` died
    formatting it), a negative block size, token id or rank. Now each is a ValidationError: skipped and counted."""
    with pytest.raises(msgspec.ValidationError):
        decode_batch(_payload(**fields))


def test_what_sglang_sends_still_decodes_at_the_edges():
    batch = decode_batch(_payload(0.0, token_ids=[[1, 2], 0, (1 << 32) - 1], block_size=0))
    assert batch.ts == 0.0 and batch.events[0].token_ids == [[1, 2], 0, (1 << 32) - 1]
    assert decode_batch(_payload(rank=None)).attn_dp_rank is None
