"""KV events: the wire format KV-aware routers already read from vLLM and SGLang (DESIGN §7b).

A running cache announces every change of where a page lives, so a router can send a request to the engine that
holds its prefix. The format is the engines' own, so a router that reads them reads kvc unchanged:

- one msgpack `EventBatch` per scheduler step, encoded as an array ``[ts, events, data_parallel_rank]``;
- each event a msgpack map tagged by its ``type`` (``"BlockStored"``, ``"BlockRemoved"``, ``"AllBlocksCleared"``),
  fields without a default always present (nil when unset), fields with one omitted at their default — what
  current vLLM and SGLang publish (both used arrays for the events too before; this is the map encoding that
  replaced it);
- sent on a ZeroMQ PUB socket as three frames: topic, an 8-byte big-endian sequence number, the payload
  (`kvcache.live.events`).

What kvc puts in the fields: a block is one page; `block_hashes` are kvc's 16-byte page hashes, from the
namespace-keyed chain (`kvcache.types.keys`), so a hash names its whole prefix and its namespace, and
`parent_block_hash` is the hash of the page before the first one (nil for a namespace's first page). `medium`
names the tier: ``device`` (L1), ``host`` (L2), ``storage`` (L3) by default (`MediumNames`). One event reports one
tree node's pages entering or leaving one tier. The namespace rides in two extra fields a standard decoder ignores
(an unknown map key): `extra_key` and `salt_fingerprint` — the keyed digest of the salt, **never the salt**
(SGLang sends its `cache_salt` in clear; kvc does not).

A decoder is a gate as much as a parser: a feed is read from a socket anyone on its network may publish on, so a
batch whose fields are impossible — a `ts` that is not a finite unix time of this era (NaN, inf, 1e300 end a
clock's formatting), a negative or absurd page size, token id or rank, a page hash that is not 16 bytes — fails to
decode (`msgspec.ValidationError`) and is skipped and counted like any other malformed message. The constrained
field types below (`Timestamp`, `TokenId`, `BlockSize`, `SmallIndex`) are shared by the SGLang and vLLM decoders
(`kvcache.engines.sglang_events`, `kvcache.engines.vllm_events`).
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from .ids import PageHash as _HashId  # (the NewType; this module's PageHash adds the length msgspec checks)

TS_MAX = 4_102_444_800.0  # 2100-01-01T00:00:00Z: no engine's clock of today says later (and localtime takes it)
BLOCK_SIZE_MAX = 1 << 20  # tokens per page or block: far past any engine's (a million-token page is no page)
INDEX_MAX = (1 << 16) - 1  # a data-parallel rank or a KV-cache group: far past any deployment's count

# unix seconds, finite, 1970..2100: NaN fails `ge` (every comparison with it is false), inf and 1e300 fail `le`
Timestamp = Annotated[float, msgspec.Meta(ge=0.0, le=TS_MAX)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]  # a token id, as kvc's Request takes it (DESIGN §3)
BlockSize = Annotated[int, msgspec.Meta(ge=0, le=BLOCK_SIZE_MAX)]  # an engine's 0 means "not known"
SmallIndex = Annotated[int, msgspec.Meta(ge=0, le=INDEX_MAX)]  # a rank or a group index
PageHash = Annotated[_HashId, msgspec.Meta(min_length=16, max_length=16)]  # kvc's page hashes are 16-byte digests


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """One change of the pages a cache holds; tagged by its class name (the ``type`` key of its map)."""


class BlockStored(KVCacheEvent):
    """Pages entered a tier: consecutive pages of one prefix, `block_hashes[0]` following `parent_block_hash`."""

    block_hashes: list[PageHash]  # 16-byte page hashes, in chain order
    parent_block_hash: PageHash | None  # the page before the first one; None for a namespace's first page
    token_ids: list[TokenId]  # the pages' tokens, block_size per page
    block_size: Annotated[int, msgspec.Meta(ge=1, le=BLOCK_SIZE_MAX)]  # tokens per page
    lora_id: int | None  # always None: kvc keys adapters through extra_key
    medium: str | None  # the tier (MediumNames)
    lora_name: str | None  # always None (current vLLM sends the field, so its decoders require it)
    extra_key: str | None = None  # kvc: the namespace's extra_key (omitted for none)
    salt_fingerprint: str | None = None  # kvc: keyed digest of the namespace's salt (omitted without a salt)


class BlockRemoved(KVCacheEvent):
    """Pages left a tier (evicted, dropped, or a copy freed)."""

    block_hashes: list[PageHash]
    medium: str | None
    extra_key: str | None = None  # kvc: the namespace, as in BlockStored
    salt_fingerprint: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Forget every page of this cache: sent first when a feed starts (then what the cache holds is announced)
    and when the cache closes."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The events of one scheduler step, in order: ``[ts, events, data_parallel_rank]`` on the wire."""

    ts: Timestamp  # unix seconds when the batch was closed
    events: list[KVEvent]
    data_parallel_rank: SmallIndex | None = None  # which engine replica (vLLM's field; SGLang's attn_dp_rank)


class MediumNames(str, enum.Enum):
    """Which words `medium` uses for the three tiers (a policy table: `MEDIUMS`)."""

    KVC = "kvc"  # device / host / storage: kvc's tier names, the same words as everywhere in kvc
    SGLANG = "sglang"  # GPU / CPU_PINNED / DISK: SGLang's StorageMedium, what routers fed by SGLang map to tiers


class Medium(msgspec.Struct, frozen=True):
    """The `medium` strings of one vocabulary."""

    device: str
    host: str
    storage: str


MEDIUMS: dict[MediumNames, Medium] = {
    MediumNames.KVC: Medium("device", "host", "storage"),
    MediumNames.SGLANG: Medium("GPU", "CPU_PINNED", "DISK"),
}

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(EventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    """The payload frame of a batch."""
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> EventBatch:
    """A batch from its payload frame (`msgspec.DecodeError` / `ValidationError` when it is not one, or when a field
    is impossible: see the module's docstring)."""
    return _DECODER.decode(payload)
