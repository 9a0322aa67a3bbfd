"""vLLM 0.34's KV-event feed, decoded without vLLM, its salts turned into keyed fingerprints.

A vLLM engine started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
"tcp://*:5557", "replay_endpoint": "tcp://*:5558", ...}'`` publishes where its blocks live
(`vllm.distributed.kv_events`). The wire is SGLang's, which copied vLLM's (`kvcache.engines.sglang_events`):

- a ZeroMQ PUB socket; one message per scheduler step of three frames: the topic (the config's ``topic``, ""
  by default), the sequence number (8 bytes, big-endian, from 0), the msgpack `KVEventBatch`; a data-parallel
  rank publishes on the endpoint's port plus its rank;
- with ``replay_endpoint``, a ROUTER socket: a client sends ``[b"", start]`` (8 bytes, big-endian) and gets
  ``[b"", topic, seq, payload]`` for every batch still buffered (``buffer_steps``) from `start` on, then
  ``[b"", b"", -1 as 8 signed bytes, b""]`` (`kvcache.live.subscriber.FeedSubscriber` reads both framings);
- a batch is an array ``[ts, events, data_parallel_rank]``; an event a map tagged by ``type`` (`BlockStored`,
  `BlockRemoved`, `AllBlocksCleared`).

What vLLM puts there:

- `block_hashes` and `parent_block_hash` are vLLM's `ExternalBlockHash`, bytes or int: the block's prefix-cache
  hash (sha256 by default, chained from the first block of the prompt) as an unsigned int of its last 8 bytes by
  default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, `maybe_convert_block_hash`), the whole digest with 0. kvc
  prints both as hex: an int as 16 digits, so it is the last 16 of the digest the bytes form would show.
- `medium`: ``GPU`` for the prefix cache's blocks (`BlockPool`); ``CPU`` and ``STORAGE`` for the KV offloading
  connector's tiers, whose `OffloadingEvent`s its `OffloadingEventsTracker` turns into BlockStored / BlockRemoved
  on the same feed, with `locality` (``LOCAL`` / ``REMOTE`` to the publisher, None: unspecified) and `ownership`
  (the secondary tier that emitted the event, e.g. ``kvcr``; None for the primary CPU tier). A block is resident
  per (medium, ownership), as the tracker counts residencies.
- `group_idx`: the KV-cache group (one per attention kind of a hybrid model): one hash in two groups is two blocks.
- `extra_keys`: per block, None or the keys its hash mixed in besides the tokens, untagged
  (`to_event_extra_keys`): the LoRA name (when `lora_name` is set, first), ``[mm identifier, offset]`` pairs,
  the request's cache_salt **in clear** (on the block that starts the prompt only: later blocks carry it through
  the hash chain), prompt-embedding digests (bytes).

kvc never shows a salt: `event_records` turns each batch into `VLLMEventRecord`s that carry each salt's
fingerprint under a key the caller gives (a store's fingerprint key, so it matches what `kvc ns ls` shows for the
same salt, or a random key of the run), and each block's extra keys as words (`extra_key_words`) in which an
element that is or may be a salt is never copied. The decoded `KVEventBatch` holds the salts only in memory.

A batch with an impossible field — a `ts` that is not a finite unix time of this era, a negative or absurd block
size, token id, rank, KV-cache group or sliding window — does not decode (`msgspec.ValidationError`): `kvc events`
skips and counts it like any malformed message (the constrained types are kvc's own feed's, `kvcache.types.events`).
"""

from __future__ import annotations

from typing import Annotated, Any, TypeAlias

import msgspec

from ..types.events import BlockSize, SmallIndex, Timestamp, TokenId
from ..types.namespace import Namespace

# vLLM's media (vllm.distributed.kv_events MEDIUM_*) -> kvc's tier words (a policy table: what `kvc events` prints
# beside the medium)
MEDIUM_TIERS: dict[str, str] = {
    "GPU": "L1",  # the prefix cache's device blocks (BlockPool)
    "CPU": "L2",  # the offloading connector's host tier
    "STORAGE": "L3",  # an offloading tier on disk or a remote store (file system, object store, KVCR's G3)
}

ExternalBlockHash: TypeAlias = bytes | int  # vLLM's: a digest, or its last 8 bytes as an unsigned int
Window = Annotated[int, msgspec.Meta(ge=1, lt=1 << 32)]  # a sliding window in tokens: past any context length


class VLLMEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """vLLM's `KVCacheEvent`: a map tagged by its class name (``type``)."""


class BlockStored(VLLMEvent):
    """Blocks entered a medium: consecutive blocks of one prefix, the first following `parent_block_hash`."""

    block_hashes: list[ExternalBlockHash]  # in chain order
    parent_block_hash: ExternalBlockHash | None = None  # the block before the first one; None at a prompt's start
    # (and from an offloading placeholder, which knows no parent)
    token_ids: list[TokenId] = []  # the blocks' tokens; empty for an offloaded recurrent state or a placeholder
    block_size: BlockSize = 0  # tokens per block (0: an offloading placeholder that knows only the hash)
    lora_id: int | None = None  # deprecated by vLLM in favour of lora_name
    medium: str | None = None  # GPU, CPU, STORAGE; None: unspecified (vLLM before offloading events: GPU)
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None  # per block; the request's salt IN CLEAR among them
    group_idx: SmallIndex | None = None  # the KV-cache group
    kv_cache_spec_kind: str | None = None  # the group's kind: full_attention, sliding_window, mamba, ...
    kv_cache_spec_sliding_window: Window | None = None
    locality: str | None = None  # LOCAL or REMOTE to the publisher
    ownership: str | None = None  # the secondary offloading tier that emitted it
    session_id: str | None = None  # the request's session: attribution only
    lookahead_token_ids: list[list[TokenId]] | None = None  # per block, the tokens past it its hash covers


class BlockRemoved(VLLMEvent):
    """Blocks left a medium."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: SmallIndex | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(VLLMEvent):
    """The engine forgot every block (`reset_prefix_cache`)."""


class KVEventBatch(msgspec.Struct, array_like=True, gc=False):
    """One scheduler step's events: ``[ts, events, data_parallel_rank]`` on the wire (the rank left out when
    None)."""

    ts: Timestamp  # unix seconds when the step's batch was made
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: SmallIndex | None = None  # whose cache (each DP rank publishes on its own port)


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch from its payload frame (`msgspec.DecodeError` / `ValidationError` when it is not one, or when a field
    is impossible)."""
    return _DECODER.decode(payload)


def block_hash_hex(block_hash: ExternalBlockHash) -> str:
    """A vLLM block hash as hex: bytes as all their digits; an int as 16 (its 8 bytes, big-endian: vLLM's int is
    the digest's last 8 bytes, so these are the digest's last 16 digits; a negative one from another publisher is
    read as two's complement, which msgpack's 64-bit ints make lossless)."""
    if isinstance(block_hash, bytes):
        return block_hash.hex()
    return (block_hash & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "big").hex()


def salt_fingerprint(salt: str | None, key: bytes) -> str | None:
    """The fingerprint of a vLLM cache_salt under `key`: kvc's salt fingerprint, so under a store's key it is what
    `kvc ns ls` shows for a namespace with the same salt. None for no salt (vLLM mixes in no empty salt)."""
    return Namespace(None, salt).fingerprint(key) if salt else None


def extra_key_words(keys: list[Any], lora_name: str | None, key: bytes) -> tuple[list[str], str | None]:
    """One block's extra keys as printable words, and the fingerprint of the salt among them (None without one).

    vLLM publishes them untagged, in the order it mixed them in: the LoRA name (iff the event names one) -> "lora"
    (its name is in `lora_name`); a ``[identifier, offset]`` pair -> ``mm:IDENTIFIER@OFFSET``; the cache_salt, a
    bare string -> ``salt:FINGERPRINT``; a prompt-embedding digest, bytes -> ``embeds:HEX``. Any other string is
    fingerprinted as a salt too, and any other shape printed as "?": a later vLLM may mix the salt in under a form
    kvc does not know, and a guess must never copy it."""
    words, salt = [], None
    for i, item in enumerate(keys):
        if isinstance(item, str):
            if i == 0 and lora_name is not None and item == lora_name:
                words.append("lora")
                continue
            fingerprint = salt_fingerprint(item, key)
            salt = salt or fingerprint
            words.append(f"salt:{fingerprint or '-'}")
        elif isinstance(item, bytes):
            words.append(f"embeds:{item.hex()}")
        elif (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], int)
              and not isinstance(item[1], bool)):
            words.append(f"mm:{item[0]}@{item[1]}")
        else:
            words.append("?")
    return words, salt


class VLLMEventRecord(msgspec.Struct, omit_defaults=True):
    """One vLLM event, flat and printable (`kvc events --engine vllm --json` prints one per line): hashes as hex,
    each salt as its keyed fingerprint, never in clear."""

    seq: int  # of its batch
    ts: float  # of its batch
    type: str  # BlockStored, BlockRemoved, AllBlocksCleared
    medium: str | None = None  # vLLM's name (GPU, CPU, STORAGE)
    tier: str | None = None  # kvc's word for it (MEDIUM_TIERS): L1, L2, L3; None for a medium not in the table
    ownership: str | None = None  # the secondary offloading tier that emitted it
    locality: str | None = None  # LOCAL, REMOTE
    group_idx: int | None = None
    block_hashes: list[str] = []  # hex (block_hash_hex)
    parent_block_hash: str | None = None
    token_ids: list[int] = []
    block_size: int | None = None
    salt_fingerprint: str | None = None  # of the first salt in the blocks' extra keys, 12 hex digits keyed by the
    # reader's key; None without one (a block past a prompt's first carries its salt only through the hash chain)
    extra_keys: list[list[str] | None] | None = None  # per block, the words of extra_key_words
    lora_id: int | None = None
    lora_name: str | None = None
    session_id: str | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    lookahead_token_ids: list[list[int]] | None = None
    data_parallel_rank: int | None = None
    replayed: bool = False  # fetched from the replay socket (missed on the feed)


def event_records(seq: int, batch: KVEventBatch, replayed: bool, key: bytes) -> list[VLLMEventRecord]:
    """The events of batch `seq` as records; salts fingerprinted under `key`, never copied."""
    out = []
    for ev in batch.events:
        rec = VLLMEventRecord(seq, batch.ts, type(ev).__name__, data_parallel_rank=batch.data_parallel_rank,
                              replayed=replayed)
        if not isinstance(ev, AllBlocksCleared):
            rec.medium = ev.medium
            rec.tier = MEDIUM_TIERS.get(ev.medium) if ev.medium is not None else None
            rec.ownership, rec.locality, rec.group_idx = ev.ownership, ev.locality, ev.group_idx
            rec.block_hashes = [block_hash_hex(h) for h in ev.block_hashes]
        if isinstance(ev, BlockStored):
            rec.parent_block_hash = block_hash_hex(ev.parent_block_hash) if ev.parent_block_hash is not None \
                else None
            rec.token_ids, rec.block_size = ev.token_ids, ev.block_size
            if ev.extra_keys is not None:
                rec.extra_keys = []
                for keys in ev.extra_keys:
                    if keys is None:
                        rec.extra_keys.append(None)
                        continue
                    words, salt = extra_key_words(keys, ev.lora_name, key)
                    rec.extra_keys.append(words)
                    rec.salt_fingerprint = rec.salt_fingerprint or salt
            rec.lora_id, rec.lora_name, rec.session_id = ev.lora_id, ev.lora_name, ev.session_id
            rec.kv_cache_spec_kind = ev.kv_cache_spec_kind
            rec.kv_cache_spec_sliding_window = ev.kv_cache_spec_sliding_window
            rec.lookahead_token_ids = ev.lookahead_token_ids
        out.append(rec)
    return out
