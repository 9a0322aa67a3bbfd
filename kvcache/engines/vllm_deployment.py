"""A vLLM deployment's identity in kvc: the `KVLayout` its offload chunks are stored under.

vLLM's KV offloading moves *chunks*: a row of its CPU offload region holding every worker's blocks of one chunk of
tokens (`blocks_per_chunk` blocks of `tokens_per_block` tokens), in vLLM's own byte order, padded to vLLM's
alignment. The secondary tier sees the row as bytes and nothing of its inner geometry, so kvc stores it as one
opaque page (`KVLayout.arrangement = "vllm_chunk"`, `page_bytes` = the row stride) and names the deployment in the
layout: model, KV dtype, tokens per chunk, and, in `engine_config`, everything else of vLLM's run configuration
that changes what a chunk's bytes mean — the KV cache groups (layer names, tokens per block, sliding window),
tokens per hash, blocks per chunk, world / tensor / pipeline / prefill-context / decode-context parallel sizes and
the scheduler's rank, the replicated (MLA) and canonical layouts, the KV cache layout name. Two deployments that
differ in any of them have different layout ids, so they never read each other's pages: vLLM's own `fs` tier keys
its directory by a digest of a subset of these (and collapses the parallel sizes of "parallelism-agnostic"
layouts; kvc does not: a chunk row holds every worker's part, so its bytes depend on them).

Every worker's blocks are in one row, so the ranks of the workers are not part of the identity, only the sizes;
data-parallel replicas of one deployment share their pages (vLLM's `fs` tier does the same).

The configuration is read by attribute from vLLM's `OffloadingConfig` (`offloading_spec.config`), so any object
with its fields serves (kvc's tests build one without vLLM).
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from ..errors import EngineUnsupported
from ..types.layout import KVLayout

ENGINE = "vLLM"
ARRANGEMENT = "vllm_chunk"  # KVLayout.arrangement of a vLLM chunk (an opaque page)

# vLLM's KV cache dtype names (`cache_dtype`, or the model's dtype for "auto") -> kvc's (DTYPE_BYTES keys). The exact
# vLLM name is also part of `engine_config`, so two names mapped to one kvc dtype stay apart.
VLLM_DTYPES: dict[str, str] = {
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "float32": "float32",
    "float": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "float8_e4m3fn": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "float8_e5m2": "float8_e5m2",
    "int8": "int8",
    "uint8": "uint8",
}


class Group(msgspec.Struct, frozen=True):
    """One KV cache group of the deployment (vLLM's `OffloadingGroupConfig`)."""

    group_id: int  # vLLM's KVCacheConfig group index (the last 4 bytes of an OffloadKey)
    tokens_per_block: int  # tokens of one block across all workers
    layers: tuple[str, ...]  # the layer names of the group, in vLLM's order
    sliding_window_chunks: int | None  # chunks a request keeps of a sliding-window group; None: full attention


class Deployment(msgspec.Struct, frozen=True):
    """What of vLLM's run configuration decides what a stored chunk's bytes mean (see the module docstring)."""

    model: str  # vLLM's model (path or id)
    dtype: str  # vLLM's KV cache dtype name, as vLLM spells it
    chunk_bytes: int  # bytes of one chunk row (the primary region's row stride, alignment padding included)
    groups: tuple[Group, ...]
    tokens_per_hash: int
    blocks_per_chunk: int
    world_size: int
    tp_size: int
    pp_size: int
    pcp_size: int  # prefill context parallel
    dcp_size: int  # decode context parallel
    rank: int  # the scheduler's rank (0 in vLLM 0.34): kept so a deployment that reports another never mixes
    replicated_layout: bool  # one copy of an MLA chunk for every TP rank
    canonical_layout: bool  # vLLM's canonical (parallelism-free) host byte layout
    kv_cache_layout: str | None  # vLLM's KV cache layout name (NHD, HND, ...)

    @property
    def tokens_per_chunk(self) -> int:
        """Tokens of one chunk (of the group with the largest blocks, when groups differ)."""
        return max(g.tokens_per_block for g in self.groups) * self.blocks_per_chunk

    @property
    def digest(self) -> str:
        """12 hex digits naming every field (what `engine_config` ends in)."""
        raw = msgspec.json.encode(self, order="sorted")
        return hashlib.blake2b(raw, digest_size=6, person=b"kvc.vllm.deploy").hexdigest()

    def summary(self) -> str:
        """A readable `engine_config`: the parallel sizes, groups and chunk, then the digest of all of it."""
        layers = sum(len(g.layers) for g in self.groups)
        return (f"vllm tp={self.tp_size} pp={self.pp_size} pcp={self.pcp_size} dcp={self.dcp_size} "
                f"world={self.world_size} groups={len(self.groups)} layers={layers} "
                f"chunk={self.blocks_per_chunk}x{max(g.tokens_per_block for g in self.groups)} "
                f"kv_dtype={self.dtype} #{self.digest}")

    def layout(self) -> KVLayout:
        """The layout this deployment's chunks are stored under."""
        return KVLayout(model=self.model, layers=max(1, sum(len(g.layers) for g in self.groups)), kv_heads=1,
                        head_dim=1, dtype=VLLM_DTYPES[self.dtype], page_size=self.tokens_per_chunk,
                        arrangement=ARRANGEMENT, page_bytes=self.chunk_bytes, engine_config=self.summary())


def deployment(config: Any, chunk_bytes: int) -> Deployment:
    """The deployment of vLLM's `OffloadingConfig` `config` whose primary region rows are `chunk_bytes` long.
    EngineUnsupported for a configuration kvc cannot store (no KV, no cache group, a KV dtype kvc cannot name)."""
    model = str(getattr(config.model, "name", "") or "").strip()
    if not model:
        raise EngineUnsupported(ENGINE, "a configuration that names no model (a layout needs one)")
    dtype = str(config.model.dtype).removeprefix("torch.")
    if dtype not in VLLM_DTYPES:
        raise EngineUnsupported(ENGINE, f"KV cache dtype {dtype!r} (kvc names {', '.join(sorted(VLLM_DTYPES))})")
    if chunk_bytes <= 0:
        raise EngineUnsupported(ENGINE, "a CPU offload region without chunks (no KV bytes per block)")
    groups = tuple(Group(int(g.group_id), int(g.tokens_per_block), tuple(str(n) for n in g.layer_names),
                         None if g.sliding_window_size_in_chunks is None else int(g.sliding_window_size_in_chunks))
                   for g in config.groups)
    if not groups:
        raise EngineUnsupported(ENGINE, "a configuration without KV cache groups")
    cache, par = config.cache, config.parallel
    kv_layout = getattr(config, "kv_cache_layout", None)
    return Deployment(model=model, dtype=dtype, chunk_bytes=int(chunk_bytes), groups=groups,
                      tokens_per_hash=int(cache.tokens_per_hash), blocks_per_chunk=int(cache.blocks_per_chunk),
                      world_size=int(par.world_size), tp_size=int(par.tp_size), pp_size=int(par.pp_size),
                      pcp_size=int(par.pcp_size), dcp_size=int(par.dcp_size), rank=int(par.rank),
                      replicated_layout=bool(getattr(config, "replicated_layout", False)),
                      canonical_layout=bool(getattr(config, "canonical_layout", False)),
                      kv_cache_layout=None if kv_layout is None else str(kv_layout))
