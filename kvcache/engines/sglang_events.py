"""SGLang 0.5.23's KV-event feed, decoded without SGLang, its salt turned into a keyed fingerprint.

An SGLang engine started with ``--kv-events-config '{"publisher": "zmq", "endpoint": "tcp://*:5557", ...}'``
publishes where its pages live (`sglang.srt.disaggregation.kv_events`). The wire, as kvc's own feed has it
(`kvcache.live.feed`):

- a ZeroMQ PUB socket; one message per scheduler step of three frames: the topic (the config's ``topic``, ""
  by default), the sequence number (8 bytes, big-endian, from 0), the msgpack `KVEventBatch`;
- with ``replay_endpoint``, a ROUTER socket: a client sends ``[b"", start]`` (8 bytes, big-endian) and gets
  ``[b"", topic, seq, payload]`` for every batch still buffered (``buffer_steps``) from `start` on, then
  ``[b"", b"", -1 as 8 signed bytes, b""]`` (`kvcache.live.subscriber.FeedSubscriber` reads both framings);
- a batch is an array ``[ts, events, attn_dp_rank]``; an event a map tagged by ``type`` (`BlockStored`,
  `BlockRemoved`, `AllBlocksCleared`), optional fields omitted when None.

What SGLang puts there: one block is one page; `block_hashes` are signed 64-bit integers — the first 16 hex digits
of the page's storage key (`kvcache.engines.sglang_keys`) read as an int64, for a request without extra_key and
cache_salt (an adapter's pages, and the ``dynamo`` format, mix a namespace seed in: `namespaced_block_hash`);
`medium` is SGLang's `StorageMedium`: ``GPU`` (L1), ``CPU_PINNED`` (L2), ``DISK`` (L3), ``EXTERNAL`` (a shared
remote pool); `BlockStored.cache_salt` is the request's salt **in clear**.

kvc never shows that salt: `event_records` turns each batch into `SGLangEventRecord`s that carry the salt's
fingerprint under a key the caller gives (a store's fingerprint key, so it matches what `kvc ns ls` shows for the
same salt, or a random key of the run) and drop the salt. The decoded `KVEventBatch` holds it only in memory.

A batch with an impossible field — a `ts` that is not a finite unix time of this era, a negative or absurd block
size, token id or rank — does not decode (`msgspec.ValidationError`): `kvc events` skips and counts it like any
malformed message (the constrained types are kvc's own feed's, `kvcache.types.events`).
"""

from __future__ import annotations

import msgspec

from ..types.events import BlockSize, SmallIndex, Timestamp, TokenId
from ..types.namespace import Namespace

# SGLang's StorageMedium values -> kvc's tier words (a policy table: what `kvc events` prints beside the medium)
MEDIUM_TIERS: dict[str, str] = {
    "GPU": "L1",  # device memory
    "CPU_PINNED": "L2",  # host pinned memory (HiCache's host pool)
    "DISK": "L3",  # local storage
    "EXTERNAL": "L4",  # a shared or remote pool (Mooncake, ...)
}


class SGLangEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """SGLang's `KVCacheEvent`: a map tagged by its class name (``type``)."""


class BlockStored(SGLangEvent):
    """Pages entered a medium: consecutive pages of one prefix, the first following `parent_block_hash`."""

    block_hashes: list[int]  # int64 page ids, in chain order
    parent_block_hash: int | None = None  # the page before the first one; None from the tree's root
    token_ids: list[TokenId | list[TokenId]] = []  # the pages' tokens; EAGLE bigram pages send [a, b] pairs
    block_size: BlockSize = 0  # tokens of the event's page (SGLang sends one page per event, coalesced down a chain)
    lora_id: int | None = None
    medium: str | None = None  # StorageMedium value; None: GPU (SGLang's default)
    cache_salt: str | None = None  # the request's salt, IN CLEAR: never printed (`event_records` fingerprints it)
    session_id: str | None = None  # attribution only
    lora_name: str | None = None


class BlockRemoved(SGLangEvent):
    """Pages left a medium."""

    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(SGLangEvent):
    """The engine forgot every page (a cache flush)."""


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    """One scheduler step's events: ``[ts, events, attn_dp_rank]`` on the wire."""

    ts: Timestamp  # unix seconds when the step's batch was made
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    attn_dp_rank: SmallIndex | None = None  # which attention-DP rank's cache (each publishes on its own port)


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch from its payload frame (`msgspec.DecodeError` / `ValidationError` when it is not one, or when a field
    is impossible)."""
    return _DECODER.decode(payload)


def block_hash_hex(block_hash: int) -> str:
    """An SGLang block hash as 16 hex digits (its 8 bytes, two's complement, big-endian): for a page without
    namespace seed, the first 16 hex digits of its storage key."""
    return (block_hash & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "big").hex()


class SGLangEventRecord(msgspec.Struct, omit_defaults=True):
    """One SGLang event, flat and printable (`kvc events --engine sglang --json` prints one per line): hashes as 16
    hex digits, the salt as its keyed fingerprint, never in clear."""

    seq: int  # of its batch
    ts: float  # of its batch
    type: str  # BlockStored, BlockRemoved, AllBlocksCleared
    medium: str | None = None  # SGLang's name (GPU, CPU_PINNED, DISK, EXTERNAL)
    tier: str | None = None  # kvc's word for it (MEDIUM_TIERS): L1, L2, L3, L4; None for a medium not in the table
    block_hashes: list[str] = []
    parent_block_hash: str | None = None
    token_ids: list[int | list[int]] = []
    block_size: int | None = None
    salt_fingerprint: str | None = None  # 12 hex digits keyed by the reader's key; None without a salt
    lora_id: int | None = None
    lora_name: str | None = None
    session_id: str | None = None
    attn_dp_rank: int | None = None
    replayed: bool = False  # fetched from the replay socket (missed on the feed)


def salt_fingerprint(salt: str | None, key: bytes) -> str | None:
    """The fingerprint of an SGLang cache_salt under `key`: kvc's salt fingerprint, so under a store's key it is
    what `kvc ns ls` shows for a namespace with the same salt. None for no salt (None or "": SGLang's request
    makes an empty salt None)."""
    return Namespace(None, salt).fingerprint(key) if salt else None


def event_records(seq: int, batch: KVEventBatch, replayed: bool, key: bytes) -> list[SGLangEventRecord]:
    """The events of batch `seq` as records; salts fingerprinted under `key`, never copied."""
    out = []
    for ev in batch.events:
        rec = SGLangEventRecord(seq, batch.ts, type(ev).__name__, attn_dp_rank=batch.attn_dp_rank,
                                replayed=replayed)
        if not isinstance(ev, AllBlocksCleared):
            rec.medium = ev.medium
            rec.tier = MEDIUM_TIERS.get(ev.medium) if ev.medium is not None else None
            rec.block_hashes = [block_hash_hex(h) for h in ev.block_hashes]
        if isinstance(ev, BlockStored):
            rec.parent_block_hash = block_hash_hex(ev.parent_block_hash) if ev.parent_block_hash is not None \
                else None
            rec.token_ids, rec.block_size = ev.token_ids, ev.block_size
            rec.salt_fingerprint = salt_fingerprint(ev.cache_salt, key)
            rec.lora_id, rec.lora_name, rec.session_id = ev.lora_id, ev.lora_name, ev.session_id
        out.append(rec)
    return out
